"""The language-model loss every model of :mod:`nnx_shard.models` trains with:
:func:`lm_loss` (next-token cross-entropy over the kept targets, plus the weighted
load-balancing loss of a mixture of experts), transformers' causal-LM loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard._errors import UsageError
from nnx_shard._weighting import mean_over
from nnx_shard.models._layout import seq_names
from nnx_shard.models._ops import constrain, cross_entropy

__all__ = ["IGNORE_INDEX", "MODEL_KEYS", "lm_loss"]


def _check_batch(batch: Any) -> None:
    fix = ("Fix: pass {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]} (what "
           "nnx_shard.corpus.CharCorpus.batches yields).")
    if not isinstance(batch, Mapping):
        raise UsageError(
            "lm_loss: the batch must be a dict with keys 'inputs' and 'targets' (int32 "
            f"[batch, length]); got {type(batch).__name__} of shape {np.shape(batch)}. {fix}"
        )
    if "inputs" not in batch or "targets" not in batch:
        raise KeyError(
            "lm_loss: the batch needs keys 'inputs' and 'targets' (int32 [batch, length]); "
            f"got a dict with keys {list(batch)}. {fix}"
        )


#: The target id :func:`lm_loss` skips (transformers' and PyTorch's ``ignore_index``).
IGNORE_INDEX = -100

#: The batch keys :func:`lm_loss` hands to the model besides ``inputs``.
MODEL_KEYS = ("attention_mask", "positions", "segment_ids")


def _check_targets(targets: Any, vocab: Any) -> None:
    """On the host, when the targets are concrete: ids in the vocabulary or
    :data:`IGNORE_INDEX`, and at least one kept."""
    if isinstance(targets, jax.core.Tracer) or not getattr(targets, "is_fully_addressable", True):
        return  # traced, or spread over processes: nothing to read here
    host = np.asarray(targets)
    kept = host != IGNORE_INDEX
    if not kept.any():
        raise UsageError(
            f"lm_loss: every target of the batch (shape {host.shape}) is {IGNORE_INDEX} "
            "(ignored), so the mean over kept tokens is 0/0. Fix: keep at least one target "
            "per batch (e.g. pack prompt-masked examples together with ns.pack), "
            "or drop the batch.")
    if isinstance(vocab, int) and host.size:
        bad = kept & ((host < 0) | (host >= vocab))
        if bad.any():
            raise UsageError(
                f"lm_loss: targets hold {int(host[bad][0])}, neither a token id of the "
                f"vocabulary (0 .. {vocab - 1}) nor {IGNORE_INDEX} (ignored). Fix: mark "
                f"targets to skip with {IGNORE_INDEX}, as transformers' labels do.")


def _kept_targets(batch: dict[str, jax.Array]) -> jax.Array:
    """The number of targets :func:`lm_loss` averages over (those not ``-100``)."""
    _check_batch(batch)
    return jnp.sum(jnp.asarray(batch["targets"]) != IGNORE_INDEX)


@mean_over(_kept_targets)
def lm_loss(model: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy of ``batch = {"inputs", "targets"}`` (int32
    ``[batch, length]``) over the targets not equal to ``-100``
    (:data:`IGNORE_INDEX`: prompt tokens, padding), plus ``aux_loss_weight``
    times the load-balancing loss for a mixture of experts. ``model`` is a
    :class:`~nnx_shard.models.Decoder` or any model with its ``forward(tokens) -> (logits,
    aux)`` and a ``cfg`` (e.g. :class:`nnx_shard.models.Decoder`).

    As transformers' causal-LM loss (``labels=``): the sum of the cross-entropy
    over kept targets divided by their number. The batch keys
    ``attention_mask``, ``positions`` and ``segment_ids``, where present, go to
    ``model.forward`` as keyword arguments.

    With microbatches (``Trainer(..., microbatches=M)``, ``multistep(...,
    microbatches=M)``, ``value_and_grad(..., microbatches=M)``) the loss is
    declared a mean over its kept targets (:func:`nnx_shard.mean_over`): the
    step's kept targets are counted before the batch is split and each
    microbatch weighs as many as it keeps (its summed cross-entropy over the
    step's count, transformers' ``num_items_in_batch``), so the step's loss and
    update are those of M = 1 (up to float rounding), and a microbatch keeping
    none adds nothing. The load-balancing loss of a mixture of experts is
    weighted the same way (it is a mean over each microbatch's tokens, so it
    differs slightly from M = 1's).

    A batch with no kept target has no mean: with concrete targets (called
    outside ``jit``) that is a :class:`nnx_shard._errors.UsageError`; inside a
    compiled step, where values are unknown when it is traced, the loss is NaN
    (0/0; the gradients are zero, every term being masked), a step that
    :class:`nnx_shard.Trainer`'s guard reports and skips, with microbatches as
    with one.

    Args:
      model: a :class:`~nnx_shard.models.Decoder`, a :class:`~nnx_shard.models.Decoder`, or a model with ``forward(tokens) -> (logits,
        aux)`` and a ``cfg``.
      batch: ``{"inputs", "targets"}`` int32 ``[batch, length]``, optionally ``attention_mask``,
        ``positions``, ``segment_ids``.

    >>> import optax
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, ReferenceConfig, lm_loss
    >>> model = Decoder(ReferenceConfig(), rngs=nnx.Rngs(0))
    >>> tokens = jnp.zeros((2, 16), jnp.int32)
    >>> float(lm_loss(model, {"inputs": tokens, "targets": tokens})) > 0
    True
    >>> half = tokens.at[:, :8].set(-100)                   # only the last 8 targets count
    >>> bool(jnp.isclose(lm_loss(model, {"inputs": tokens, "targets": half}),
    ...                  optax.softmax_cross_entropy_with_integer_labels(
    ...                      model(tokens)[:, 8:], tokens[:, 8:]).mean()))
    True
    >>> lm_loss(model, {"x": tokens})
    Traceback (most recent call last):
    ...
    KeyError: "lm_loss: the batch needs keys 'inputs' and 'targets' (int32 [batch, length]); got a dict with keys ['x']. ..."
    """
    _check_batch(batch)
    _check_targets(batch["targets"], getattr(getattr(model, "cfg", None), "vocab", None))
    extra = {k: batch[k] for k in MODEL_KEYS if k in batch}
    logits, aux = model.forward(batch["inputs"], **extra)
    # Targets arrive laid out like the inputs (under sequence parallelism: split
    # along ``length``); they must match the logits' layout, split along ``vocab``.
    targets = constrain(batch["targets"], seq_names(("batch", None)))
    kept = targets != IGNORE_INDEX
    ce = jnp.where(kept, cross_entropy(logits, targets), 0.0)
    # 0/0 = NaN when nothing is kept (see the docstring).
    ce = jnp.sum(ce) / jnp.sum(kept).astype(jnp.float32)
    if getattr(model.cfg, "experts", 0):  # dense configs have no experts
        return ce + model.cfg.aux_loss_weight * aux
    return ce
