"""Preference losses of a model on a batch of pairs (:func:`loss`), for
:class:`nnx_shard.Trainer` and :func:`nnx_shard.multistep`, and the reference model's
log-probabilities computed once (:func:`reference_logps`).

The batch (what :func:`nnx_shard.preference.tokenize` returns) holds the chosen and the
rejected sequences of ``P`` pairs as ``2P`` rows, the ``P`` chosen first, then the
``P`` rejected in the same order (TRL's ``concatenated_forward``), so that one forward
scores both: ``inputs`` (the tokens), ``targets`` (the next token where it belongs to
the answer, ``-100`` on the prompt and padding) and ``attention_mask`` (1 on real
tokens), all ``[2P, length]``; and, for the DPO kinds with a precomputed reference
(``reference="batch"``), ``ref_logps [2P]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard._errors import UsageError, short
from nnx_shard.models._layout import seq_names
from nnx_shard.models._loss import IGNORE_INDEX, MODEL_KEYS
from nnx_shard.models._ops import constrain, cross_entropy
from nnx_shard.preference._objectives import (
    DPO_KINDS,
    check_beta,
    check_smoothing,
    dpo,
    orpo,
    simpo,
)
from nnx_shard.preference._reference import REFERENCES, reference_model

__all__ = ["KINDS", "loss", "reference_logps"]

#: Every objective :func:`loss` builds.
KINDS = (*DPO_KINDS, "simpo", "orpo")

_FIX = ("Fix: make the batch with nnx_shard.preference.tokenize(tokenizer, pairs) (the P "
        "chosen rows, then the P rejected).")


def _check(batch: Any, who: str, ref: bool = False) -> int:
    """The number of pairs of ``batch``, after checking its keys and shapes."""
    if not isinstance(batch, Mapping):
        raise UsageError(f"{who}: the batch must be a dict with 'inputs' and 'targets' "
                         f"[2 * pairs, length], got {type(batch).__name__}. {_FIX}")
    need = ("inputs", "targets", *(("ref_logps",) if ref else ()))
    missing = [k for k in need if k not in batch]
    if missing:
        more = (" ('ref_logps' [2 * pairs]: the reference model's summed log-probabilities "
                "of each row, from nnx_shard.preference.reference_logps; or the reference "
                "computed in the step: reference='adapters' for a LoRA policy, 'frozen' for "
                "a preference.WithReference)"
                if "ref_logps" in missing else "")
        raise KeyError(f"{who}: the batch needs the keys {missing}{more}; got {list(batch)}. "
                       f"{_FIX}")
    shape = np.shape(batch["inputs"])
    if len(shape) != 2 or shape[0] % 2 or not shape[0] or np.shape(batch["targets"]) != shape:
        raise UsageError(f"{who}: 'inputs' and 'targets' must be [2 * pairs, length] (the "
                         f"chosen rows, then the rejected), got {shape} and "
                         f"{np.shape(batch['targets'])}. {_FIX}")
    if ref and np.shape(batch["ref_logps"]) != shape[:1]:
        raise UsageError(f"{who}: 'ref_logps' must be [2 * pairs] = {shape[:1]}, one per row, "
                         f"got {np.shape(batch['ref_logps'])}.")
    return shape[0] // 2


def _token_logps(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row: the summed log-probability of the kept targets, and how many there are."""
    targets = constrain(targets, seq_names(("batch", None)))
    kept = targets != IGNORE_INDEX
    logp = -cross_entropy(logits, jnp.where(kept, targets, 0))
    return jnp.sum(jnp.where(kept, logp, 0.0), axis=1), jnp.sum(kept, axis=1)


def _forward(model: Any, batch: Mapping[str, Any]) -> tuple[jax.Array, jax.Array]:
    extra = {k: batch[k] for k in MODEL_KEYS if k in batch}
    out: tuple[jax.Array, jax.Array] = model.forward(batch["inputs"], **extra)
    return out


def reference_logps(model: Any, batch: Mapping[str, Any]) -> jax.Array:
    """Each row's summed log-probability of its answer (the targets not ``-100``) under
    ``model``, float32 ``[2 * pairs]``: the reference log-probabilities the DPO kinds of
    :func:`loss` read from ``batch["ref_logps"]``, as TRL's ``precompute_ref_log_probs``
    stores them.

    Run it once per batch with the frozen reference model (the policy before tuning,
    typically), e.g. ``nnx.jit(reference_logps)`` over the data set with a fixed
    ``length``, and keep the result with the batch; no gradient flows through it. (Or
    compute it inside each training step: :func:`loss`'s ``reference="adapters"`` for a
    LoRA policy, ``"frozen"`` with a :class:`~nnx_shard.preference.WithReference`.)

    Args:
      model: a :class:`~nnx_shard.models.Decoder` or a model with ``forward(tokens) ->
        (logits, aux)``.
      batch: the pairs' batch (:func:`nnx_shard.preference.tokenize`).

    >>> import numpy as np
    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, ReferenceConfig
    >>> from nnx_shard.preference import reference_logps
    >>> model = Decoder(ReferenceConfig(layers=1), rngs=nnx.Rngs(0))
    >>> tokens = np.ones((2, 8), np.int32)           # one pair: chosen row, rejected row
    >>> targets = np.full((2, 8), -100, np.int32); targets[:, 3:7] = 1
    >>> reference_logps(model, {"inputs": tokens, "targets": targets}).shape
    (2,)
    """
    _check(batch, "reference_logps")
    return _logps(model, batch)


def _logps(model: Any, batch: Mapping[str, Any]) -> jax.Array:
    # Under stop_gradient no gradient reaches the reference's weights, and XLA keeps none
    # of its forward's activations for the backward pass.
    logits, _ = _forward(model, batch)
    logps, _ = _token_logps(logits, jnp.asarray(batch["targets"]))
    return jax.lax.stop_gradient(logps)


def _sequence_targets(batch: Mapping[str, Any]) -> jax.Array:
    """ORPO's targets: every next token that is not padding, the prompt's included."""
    if "attention_mask" not in batch:
        raise KeyError("preference.loss('orpo'): the batch needs 'attention_mask' (1 on real "
                       "tokens): ORPO's negative log-likelihood counts the prompt's tokens too, "
                       f"and only the mask tells them from padding; got {list(batch)}. {_FIX}")
    inputs, mask = jnp.asarray(batch["inputs"]), jnp.asarray(batch["attention_mask"])
    nxt = jnp.where(mask[:, 1:] != 0, inputs[:, 1:], IGNORE_INDEX)
    return jnp.concatenate([nxt, jnp.full_like(nxt[:, :1], IGNORE_INDEX)], axis=1)


def loss(kind: str = "sigmoid", *, beta: float = 0.1, label_smoothing: float = 0.0,
         gamma: float | None = None, cpo_alpha: float | None = None,
         reference: str = "batch") -> Callable[[Any, Mapping[str, Any]], tuple[jax.Array, dict[str, jax.Array]]]:
    """The preference loss ``loss_fn(model, batch) -> (loss, metrics)`` of ``kind``, for
    :class:`nnx_shard.Trainer` / :func:`nnx_shard.multistep` with ``has_aux=True`` (the
    metrics, under TRL's names, go to the history).

    One forward of the model scores the batch's ``2P`` rows (the ``P`` chosen answers,
    then the ``P`` rejected: :func:`nnx_shard.preference.tokenize`); each row's
    log-probability is summed over its targets (``-100`` on the prompt and padding) and
    the objective is TRL 1.16's:

    * ``"sigmoid"``, ``"ipo"``, ``"hinge"``, ``"robust"``: DPO against the reference
      model's log-probabilities (see :func:`nnx_shard.preference.dpo`), from where
      ``reference`` says;
    * ``"simpo"``: reference-free, length-normalised, see
      :func:`nnx_shard.preference.simpo` (``gamma`` default 0.5, ``cpo_alpha`` 0);
    * ``"orpo"``: the odds ratio plus the chosen sequences' negative log-likelihood over
      their prompt and answer (read off ``attention_mask``), see
      :func:`nnx_shard.preference.orpo`.

    The DPO kinds' reference (``reference=``):

    * ``"batch"``: precomputed, ``batch["ref_logps"]`` (:func:`reference_logps`, once
      over the data set, as TRL's ``precompute_ref_log_probs``);
    * ``"adapters"``: the model is a LoRA policy (:func:`nnx_shard.lora`,
      ``ns.hf.load_lora``) and the reference is the same model with its adapters
      switched off, a second forward inside the same compiled step (over the same
      weights: no copy; under ``jax.lax.stop_gradient``), as TRL does with a PEFT
      model and no ``ref_model``;
    * ``"frozen"``: the model is a :class:`nnx_shard.preference.WithReference`, the
      policy and a frozen copy carried beside it as inputs of the compiled call (never
      updated, no gradient), e.g. the policy's checkpoint loaded twice with the same
      mesh and rules.

    Both in-step references run in the fused K-step call under the presets that train
    the policy (tested: one device, ``fsdp``, ``fsdp_tp``, and ``pp``, where the
    reference's forward is pipelined through the stages as the policy's is). XLA's bytes
    of the step: ``"adapters"`` adds no argument byte to ``"batch"``'s (the weights are
    read twice, never copied); ``"frozen"`` adds its parameters' bytes.

    A mixture of experts adds ``aux_loss_weight`` times its load-balancing loss, as
    :func:`nnx_shard.models.lm_loss` does. The loss is a mean over pairs: with
    ``microbatches=M`` every microbatch must hold whole pairs, so ``M`` must divide
    ``P`` (the split takes rows ``j, j + M, ...``: then chosen row ``i`` and rejected row
    ``P + i`` land in the same microbatch, still chosen first). The negative
    log-likelihoods of ``"orpo"`` and of ``"simpo"`` with ``cpo_alpha`` are means over
    each microbatch's tokens, averaged over the microbatches (TRL's gradient
    accumulation does the same).

    Args:
      kind: one of :data:`KINDS`.
      beta: ``β`` of every kind (TRL's default 0.1).
      label_smoothing: ``ε`` of ``"robust"`` and ``"simpo"``.
      gamma: SimPO's target margin ``γ`` (``"simpo"`` only).
      cpo_alpha: the weight of the chosen answers' negative log-likelihood
        (``"simpo"`` only).
      reference: where the DPO kinds' reference comes from: ``"batch"``,
        ``"adapters"`` or ``"frozen"`` (above).

    Train with it as with any loss: ``ns.Trainer(model, opt, loss("sigmoid"),
    has_aux=True, ...)``.

    >>> import numpy as np
    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, ReferenceConfig
    >>> from nnx_shard.preference import loss, reference_logps
    >>> model = Decoder(ReferenceConfig(layers=1), rngs=nnx.Rngs(0))
    >>> tokens = np.ones((8, 8), np.int32)              # 4 pairs: 4 chosen rows, 4 rejected
    >>> targets = np.full((8, 8), -100, np.int32); targets[:, 3:7] = 1
    >>> batch = {"inputs": tokens, "targets": targets}
    >>> batch["ref_logps"] = np.asarray(reference_logps(model, batch))
    >>> value, metrics = loss("sigmoid")(model, batch)
    >>> round(float(value), 4), float(metrics["rewards/margins"])   # policy = reference
    (0.6931, 0.0)
    >>> loss("sigmoid", gamma=0.5)
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: preference.loss('sigmoid'): gamma is SimPO's (kind='simpo')...
    """
    if not isinstance(kind, str) or kind not in KINDS:
        raise UsageError(f"preference.loss: kind must be one of {KINDS}, got {short(kind, 40)}.")
    who = f"preference.loss({kind!r})"
    beta = check_beta(beta, who)
    if kind != "simpo":
        for name, value in (("gamma", gamma), ("cpo_alpha", cpo_alpha)):
            if value is not None:
                raise UsageError(f"{who}: {name} is SimPO's (kind='simpo'); this kind has none. "
                                 f"Fix: drop {name}=, or kind='simpo'.")
    if kind in ("robust", "simpo"):
        check_smoothing(label_smoothing, who, below=0.5 if kind == "robust" else 1.0)
    elif label_smoothing != 0:
        raise UsageError(f"{who}: label_smoothing={short(label_smoothing, 40)} is read only by "
                         "'robust' and 'simpo' (TRL 1.16's other losses ignore it). Fix: "
                         "kind='robust' for label-smoothed DPO, or label_smoothing=0.")
    if reference not in REFERENCES:
        raise UsageError(f"{who}: reference must be one of {REFERENCES}, got "
                         f"{short(reference, 40)}.")
    dpo_kind = kind in DPO_KINDS
    if reference != "batch" and not dpo_kind:
        raise UsageError(f"{who}: {kind!r} is reference-free, so reference={reference!r} has "
                         "nothing to do. Fix: drop reference=, or a DPO kind "
                         f"{DPO_KINDS}.")
    if kind == "simpo":  # check gamma and cpo_alpha now, not at the first step's trace
        simpo(jnp.zeros(1), jnp.zeros(1), jnp.ones(1), jnp.ones(1), beta=beta,
              gamma=0.5 if gamma is None else gamma, label_smoothing=label_smoothing,
              cpo_alpha=0.0 if cpo_alpha is None else cpo_alpha)

    def loss_fn(model: Any, batch: Mapping[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
        pairs = _check(batch, who, ref=dpo_kind and reference == "batch")
        # ORPO's targets first: a batch without a mask fails before the forward.
        full = _sequence_targets(batch)[:pairs] if kind == "orpo" else None
        policy, ref_model = reference_model(model, reference, who)
        logits, aux = _forward(policy, batch)
        logps, tokens = _token_logps(logits, jnp.asarray(batch["targets"]))
        pc, pr, nc, nr = logps[:pairs], logps[pairs:], tokens[:pairs], tokens[pairs:]
        value: jax.Array
        if dpo_kind:
            ref = (jnp.asarray(batch["ref_logps"], jnp.float32) if ref_model is None
                   else _logps(ref_model, batch))
            value, metrics = dpo(pc, pr, ref[:pairs], ref[pairs:], kind=kind, beta=beta,
                                 label_smoothing=label_smoothing, chosen_tokens=nc,
                                 rejected_tokens=nr)
        elif full is not None:  # orpo
            seq_logps, seq_tokens = _token_logps(logits[:pairs], full)
            nll = -jnp.sum(seq_logps) / jnp.sum(seq_tokens).astype(jnp.float32)
            value, metrics = orpo(pc, pr, nc, nr, nll, beta=beta)
        else:
            value, metrics = simpo(pc, pr, nc, nr, beta=beta,
                                   gamma=0.5 if gamma is None else gamma,
                                   label_smoothing=label_smoothing,
                                   cpo_alpha=0.0 if cpo_alpha is None else cpo_alpha)
        cfg: Any = getattr(policy, "cfg", None)
        if getattr(cfg, "experts", 0):  # dense configs have no experts
            value = value + cfg.aux_loss_weight * aux
        return value, metrics

    loss_fn.__name__ = loss_fn.__qualname__ = f"preference_{kind}"
    return loss_fn
