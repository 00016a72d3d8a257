"""Preference tuning: TRL 1.16's objectives on the fused trainer.

Pairs in TRL's format (``prompt`` / ``chosen`` / ``rejected``, plain text or
conversations) become one batch with :func:`tokenize` (the ``P`` chosen sequences, then
the ``P`` rejected, targets ``-100`` on the prompt and padding); :func:`loss` builds the
``loss_fn(model, batch) -> (loss, metrics)`` of an objective for
:class:`nnx_shard.Trainer` (``has_aux=True``): DPO's ``sigmoid``, ``ipo``, ``hinge`` and
``robust``, reference-free ``simpo``, and ``orpo``; the DPO kinds read the reference
model's log-probabilities from the batch, computed once by :func:`reference_logps`, or
compute them inside the step: a LoRA policy's reference is the same model with its
adapters off (``reference="adapters"``), a full policy's a frozen copy carried beside it
(:class:`WithReference`, ``reference="frozen"``). The
objectives themselves are pure functions of per-sequence log-probabilities:
:func:`dpo`, :func:`simpo`, :func:`orpo`. :func:`example_pairs` is a small preference
set shipped with the package. Each loss and metric is TRL's
(``DPOTrainer``, ``CPOTrainer`` with ``loss_type="simpo"``, ``ORPOTrainer``), under TRL's
metric names (``rewards/chosen``, ``rewards/margins``, ``logps/chosen``, ...).

>>> from nnx_shard import preference
>>> preference.KINDS
('sigmoid', 'ipo', 'hinge', 'robust', 'simpo', 'orpo')
"""

from nnx_shard.preference._data import tokenize
from nnx_shard.preference._examples import example_pairs
from nnx_shard.preference._loss import KINDS, loss, reference_logps
from nnx_shard.preference._objectives import dpo, orpo, simpo
from nnx_shard.preference._reference import WithReference

__all__ = ["KINDS", "WithReference", "dpo", "example_pairs", "loss", "orpo", "reference_logps",
           "simpo", "tokenize"]
