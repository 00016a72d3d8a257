"""The reference model of DPO inside the training step: the policy with its LoRA adapters
switched off, or a frozen copy carried beside the policy (:class:`WithReference`)."""

from __future__ import annotations

from typing import Any

from flax import nnx

from nnx_shard._errors import UsageError
from nnx_shard._low_rank import adapters, without_adapters

__all__ = ["REFERENCES", "Frozen", "WithReference", "reference_model"]

#: Where :func:`nnx_shard.preference.loss` finds the reference: ``"batch"`` (precomputed
#: ``ref_logps``), ``"adapters"`` (the LoRA policy with its adapters off) or ``"frozen"``
#: (the :class:`WithReference` the Trainer trains).
REFERENCES = ("batch", "adapters", "frozen")


class Frozen(nnx.Variable[Any]):
    """A weight of a frozen reference model: read by its forward like a ``Param``, but no
    ``nnx.Param`` filter (an optimizer's ``wrt``, a gradient) ever selects it."""


class WithReference(nnx.Module):
    """A policy and the frozen reference model DPO compares it to, as one model for
    :class:`nnx_shard.Trainer` (with ``preference.loss(kind, reference="frozen")``).

    Every ``nnx.Param`` of ``reference`` becomes a ``Frozen`` variable in place (its value,
    sharding and logical names kept), so an optimizer built on the pair (``wrt=nnx.Param``
    or ``nnx.LoRAParam``, the default of :func:`nnx_shard.sharded_optimizer`) tracks and
    updates the policy alone and no gradient of the reference is ever formed. The
    reference's arrays are inputs of the Trainer's compiled call like the policy's, laid
    out as they are (load it with the policy's mesh and rules), never constants baked into
    the program. With ``donate=True`` (the Trainer's default) they are donated and come
    back as the same values (XLA aliases each to its output: no copy, no extra bytes); the
    pair's ``reference`` holds them after every call, while arrays read off the reference
    before training are stale (deleted) once the Trainer has run.

    Args:
      policy: the model trained.
      reference: the reference model (the policy before tuning, typically loaded again),
        with the same ``forward``; changed in place.

    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, ReferenceConfig
    >>> from nnx_shard.preference import WithReference
    >>> pair = WithReference(Decoder(ReferenceConfig(layers=1), rngs=nnx.Rngs(0)),
    ...                      Decoder(ReferenceConfig(layers=1), rngs=nnx.Rngs(0)))
    >>> type(pair.reference.token_embed).__name__, len(nnx.state(pair, nnx.Param)) > 0
    ('Frozen', True)
    >>> len(nnx.state(pair.reference, nnx.Param))       # nothing of it to train
    0
    """

    def __init__(self, policy: Any, reference: Any) -> None:
        if not isinstance(policy, nnx.Module) or not isinstance(reference, nnx.Module):
            raise UsageError("preference.WithReference: policy and reference must be NNX "
                             f"models, got {type(policy).__name__} and "
                             f"{type(reference).__name__}.")
        if policy is reference:
            raise UsageError("preference.WithReference: the reference is the policy itself. "
                             "Fix: load the reference again (a second copy), or train a LoRA "
                             "policy with reference='adapters' (no copy).")
        _freeze(reference)
        self.policy = policy
        self.reference = reference


def _freeze(model: Any) -> None:
    owners = {tuple(p): n for p, n in nnx.iter_graph(model)}
    for path, node in owners.items():
        if path and isinstance(node, nnx.Param):
            owner, attr = owners[tuple(path[:-1])], path[-1]
            frozen = Frozen(node.get_raw_value(), **node.get_metadata())
            if isinstance(owner, nnx.Module) and isinstance(attr, str):
                setattr(owner, attr, frozen)
            else:
                owner[attr] = frozen


def reference_model(model: Any, reference: str, who: str) -> tuple[Any, Any]:
    """``(policy, reference model)`` of the model a loss is given: the reference model is
    ``None`` for ``reference="batch"`` (precomputed log-probabilities)."""
    if reference == "batch":
        if isinstance(model, WithReference):
            raise UsageError(f"{who}: the model is a preference.WithReference, whose "
                             "reference the loss reads only with reference='frozen'. Fix: "
                             "preference.loss(kind, reference='frozen').")
        return model, None
    if reference == "frozen":
        if not isinstance(model, WithReference):
            raise UsageError(f"{who}: reference='frozen' trains a preference.WithReference "
                             f"(the policy and its frozen reference), got "
                             f"{type(model).__name__}. Fix: ns.Trainer(preference."
                             "WithReference(policy, reference), optimizer built on that pair, "
                             "...).")
        return model.policy, model.reference
    if isinstance(model, WithReference) or not adapters(model):
        raise UsageError(f"{who}: reference='adapters' reads the policy with its LoRA adapters "
                         f"off, but this {type(model).__name__} has no adapters. Fix: "
                         "ns.lora(model, rank, alpha) (or ns.hf.load_lora) first, or "
                         "reference='frozen' with a preference.WithReference.")
    return model, without_adapters(model)
