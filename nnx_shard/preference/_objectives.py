"""The preference objectives, pure functions of per-sequence log-probabilities, each as
TRL 1.16 defines it: DPO's ``sigmoid``, ``ipo``, ``hinge`` and ``robust`` losses
(``DPOTrainer``), SimPO (``CPOTrainer`` with ``loss_type="simpo"``) and ORPO
(``ORPOTrainer``), with the metrics TRL logs under its names.

Every function takes, per preference pair, the completion's log-probability summed over
its tokens (``chosen_logps``, ``rejected_logps``; ``[pairs]``) and returns ``(loss,
metrics)``: the loss averaged over the pairs and a dict of scalars.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from nnx_shard._errors import UsageError, short

__all__ = ["DPO_KINDS", "check_beta", "check_smoothing", "dpo", "orpo", "simpo"]

#: DPOTrainer's ``loss_type`` values :func:`dpo` has.
DPO_KINDS = ("sigmoid", "ipo", "hinge", "robust")


def check_beta(beta: Any, who: str) -> float:
    """``beta`` as a float, or a :class:`UsageError`: a finite number above 0."""
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not (
            math.isfinite(beta) and beta > 0):
        raise UsageError(f"{who}: beta must be a finite number above 0 (TRL's default is 0.1), "
                         f"got {short(beta, 40)}.")
    return float(beta)


def check_smoothing(value: Any, who: str, *, below: float = 1.0) -> float:
    """``label_smoothing`` as a float in ``[0, below)``, or a :class:`UsageError`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            0.0 <= value < below):
        raise UsageError(f"{who}: label_smoothing must be a number in [0, {below}), got "
                         f"{short(value, 40)}.")
    return float(value)


def _metrics(chosen_rewards: jax.Array, rejected_rewards: jax.Array, chosen_logps: jax.Array,
             rejected_logps: jax.Array) -> dict[str, jax.Array]:
    """TRL's reward and log-probability metrics: each a mean over the pairs."""
    return {
        "rewards/chosen": jnp.mean(chosen_rewards),
        "rewards/rejected": jnp.mean(rejected_rewards),
        "rewards/accuracies": jnp.mean((chosen_rewards > rejected_rewards).astype(jnp.float32)),
        "rewards/margins": jnp.mean(chosen_rewards - rejected_rewards),
        "logps/chosen": jnp.mean(chosen_logps),
        "logps/rejected": jnp.mean(rejected_logps),
    }


def _f32(*xs: Any) -> list[jax.Array]:
    return [jnp.asarray(x, jnp.float32) for x in xs]


def dpo(chosen_logps: Any, rejected_logps: Any, ref_chosen_logps: Any,
        ref_rejected_logps: Any, *, kind: str = "sigmoid", beta: float = 0.1,
        label_smoothing: float = 0.0, chosen_tokens: Any = None,
        rejected_tokens: Any = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DPO's loss of ``kind`` and its metrics, as TRL 1.16's ``DPOTrainer`` computes them
    (``loss_type=[kind]``, ``f_divergence_type="reverse_kl"``, no ``ld_alpha``).

    With ``d`` the policy's log-ratio to the reference on the chosen answer minus that on
    the rejected one (``(chosen - ref_chosen) - (rejected - ref_rejected)``, summed
    log-probabilities), each pair's loss is:

    * ``"sigmoid"``: ``-log σ(β d)`` (the DPO paper's);
    * ``"hinge"``: ``max(0, 1 - β d)`` (SLiC);
    * ``"ipo"``: ``(d' - 1 / (2β))²`` where ``d'`` divides each answer's log-ratio by its
      number of tokens (at least 1) first: TRL's length-normalised IPO, so
      ``chosen_tokens`` and ``rejected_tokens`` are needed;
    * ``"robust"``: ``(-(1 - ε) log σ(β d) + ε log σ(-β d)) / (1 - 2ε)`` with ``ε =
      label_smoothing`` in ``[0, 0.5)``, the probability that a label is flipped (rDPO).

    The loss is their mean over the pairs. In TRL 1.16 only ``"robust"`` (of these) reads
    ``label_smoothing``; ``"sigmoid"`` ignores it there (older TRL's conservative
    ``sigmoid`` is this ``"robust"``'s numerator), so any other kind refuses a non-zero
    value here rather than ignore it.

    Metrics (means over the pairs): ``rewards/chosen`` and ``rewards/rejected``, ``β``
    times each answer's log-ratio to the reference; ``rewards/accuracies``, the share of
    pairs whose chosen reward is strictly the larger; ``rewards/margins``; and
    ``logps/chosen``, ``logps/rejected``, the policy's summed log-probabilities.

    Args:
      chosen_logps, rejected_logps: the policy's summed completion log-probabilities,
        ``[pairs]``.
      ref_chosen_logps, ref_rejected_logps: the reference model's, ``[pairs]``.
      kind: ``"sigmoid"``, ``"ipo"``, ``"hinge"`` or ``"robust"``.
      beta: ``β``: the deviation from the reference allowed (for ``"ipo"``, the
        regularisation ``τ``).
      label_smoothing: ``ε`` of ``"robust"``.
      chosen_tokens, rejected_tokens: each answer's number of completion tokens
        (``"ipo"`` only).

    >>> import jax.numpy as jnp
    >>> from nnx_shard.preference import dpo
    >>> loss, metrics = dpo(jnp.array([-10.0]), jnp.array([-12.0]), jnp.array([-11.0]),
    ...                     jnp.array([-11.0]), beta=0.5)
    >>> round(float(loss), 4), float(metrics["rewards/margins"])   # -log σ(0.5 * 2)
    (0.3133, 1.0)
    >>> dpo(jnp.zeros(1), jnp.zeros(1), jnp.zeros(1), jnp.zeros(1), label_smoothing=0.1)
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: dpo: label_smoothing=0.1 is read only by kind='robust' in TRL 1.16 ...
    """
    if kind not in DPO_KINDS:
        raise UsageError(f"dpo: kind must be one of {DPO_KINDS} (TRL's loss_type), got "
                         f"{short(kind, 40)}.")
    beta = check_beta(beta, "dpo")
    if kind == "robust":
        eps = check_smoothing(label_smoothing, "dpo(kind='robust')", below=0.5)
    elif label_smoothing != 0:
        raise UsageError(
            f"dpo: label_smoothing={short(label_smoothing, 40)} is read only by kind='robust' in "
            f"TRL 1.16 (its {kind!r} loss ignores it). Fix: kind='robust' for label-smoothed "
            "DPO, or label_smoothing=0.")
    pc, pr, rc, rr = _f32(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    chosen_ratio, rejected_ratio = pc - rc, pr - rr
    delta = chosen_ratio - rejected_ratio
    if kind == "sigmoid":
        per_pair = -jax.nn.log_sigmoid(beta * delta)
    elif kind == "hinge":
        per_pair = jax.nn.relu(1 - beta * delta)
    elif kind == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise UsageError("dpo(kind='ipo'): chosen_tokens and rejected_tokens are needed: "
                             "TRL's IPO divides each answer's log-ratio by its tokens.")
        nc, nr = _f32(chosen_tokens, rejected_tokens)
        ipo_delta = chosen_ratio / jnp.maximum(nc, 1.0) - rejected_ratio / jnp.maximum(nr, 1.0)
        per_pair = (ipo_delta - 1 / (2 * beta)) ** 2
    else:
        clean = -(1 - eps) * jax.nn.log_sigmoid(beta * delta)
        flipped = -eps * jax.nn.log_sigmoid(-beta * delta)
        per_pair = (clean - flipped) / (1 - 2 * eps)
    return jnp.mean(per_pair), _metrics(beta * chosen_ratio, beta * rejected_ratio, pc, pr)


def simpo(chosen_logps: Any, rejected_logps: Any, chosen_tokens: Any, rejected_tokens: Any,
          *, beta: float = 0.1, gamma: float = 0.5, label_smoothing: float = 0.0,
          cpo_alpha: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SimPO's loss and metrics as TRL 1.16 computes them (``CPOTrainer`` with
    ``loss_type="simpo"``): reference-free and length-normalised.

    Each answer's log-probability is averaged over its tokens (``a = logps / tokens``;
    an answer of no token gives NaN, as in TRL); with ``z = a_chosen - a_rejected - γ/β``
    each pair's loss is ``-(1 - ε) log σ(β z) - ε log σ(-β z)`` (``ε =
    label_smoothing``), and the loss is their mean plus ``cpo_alpha`` times the chosen
    answers' negative log-likelihood (their summed ``-logps`` over their summed tokens:
    the cross-entropy CPO adds; TRL's ``CPOConfig`` defaults to ``cpo_alpha=1.0``, CPO-SimPO;
    0 here, the SimPO paper's loss).

    Metrics as TRL's: ``rewards/*`` are ``β`` times the averaged log-probabilities,
    ``logps/chosen`` and ``logps/rejected`` the averages themselves, and ``nll_loss``
    the negative log-likelihood (0 when ``cpo_alpha`` is 0, as TRL logs it).

    Args:
      chosen_logps, rejected_logps: the policy's summed completion log-probabilities,
        ``[pairs]``.
      chosen_tokens, rejected_tokens: each answer's number of completion tokens.
      beta: ``β``, the reward scale (TRL's default 0.1; the SimPO paper uses 2 to 2.5).
      gamma: ``γ``, the target reward margin (TRL's ``simpo_gamma``).
      label_smoothing: ``ε``, in ``[0, 1)``.
      cpo_alpha: the weight of the chosen answers' negative log-likelihood.

    >>> import jax.numpy as jnp
    >>> from nnx_shard.preference import simpo
    >>> loss, metrics = simpo(jnp.array([-4.0]), jnp.array([-9.0]), jnp.array([2]),
    ...                       jnp.array([3]), beta=2.0, gamma=1.0)
    >>> round(float(loss), 4), float(metrics["logps/chosen"])   # -log σ(2 (-2 + 3 - 0.5))
    (0.3133, -2.0)
    """
    beta = check_beta(beta, "simpo")
    eps = check_smoothing(label_smoothing, "simpo")
    for name, value in (("gamma", gamma), ("cpo_alpha", cpo_alpha)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
                value) or (name == "cpo_alpha" and value < 0):
            raise UsageError(f"simpo: {name} must be a finite number"
                             f"{' not below 0' if name == 'cpo_alpha' else ''}, got "
                             f"{short(value, 40)}.")
    pc, pr, nc, nr = _f32(chosen_logps, rejected_logps, chosen_tokens, rejected_tokens)
    avg_c, avg_r = pc / nc, pr / nr
    z = avg_c - avg_r - gamma / beta
    per_pair = (-jax.nn.log_sigmoid(beta * z) * (1 - eps)
                - jax.nn.log_sigmoid(-beta * z) * eps)
    nll = -jnp.sum(pc) / jnp.sum(nc) if cpo_alpha else jnp.zeros((), jnp.float32)
    metrics = _metrics(beta * avg_c, beta * avg_r, avg_c, avg_r)
    metrics["nll_loss"] = nll
    return jnp.mean(per_pair) + cpo_alpha * nll, metrics


def _log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 - exp(x))`` for ``x < 0``, TRL's two branches (no cancellation near 0)."""
    return jnp.where(x < -math.log(2), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def orpo(chosen_logps: Any, rejected_logps: Any, chosen_tokens: Any, rejected_tokens: Any,
         nll: Any, *, beta: float = 0.1) -> tuple[jax.Array, dict[str, jax.Array]]:
    """ORPO's loss and metrics as TRL 1.16's ``ORPOTrainer`` computes them.

    Each answer's log-probability is averaged over its tokens (``a = logps /
    tokens``); the log odds ratio of a pair is ``(a_c - a_r) - (log(1 - e^a_c) - log(1 -
    e^a_r))``, and the loss is ``nll - β mean(log σ(log odds ratio))``: the odds-ratio
    term plus the negative log-likelihood ``nll`` of the chosen sequences, which ORPO
    takes over the prompt and the answer alike (:func:`nnx_shard.preference.loss`
    computes it so).

    Metrics as TRL's: ``rewards/*`` are ``β`` times the averaged log-probabilities,
    ``logps/*`` the averages, ``nll_loss``, ``log_odds_ratio`` (the mean of ``log σ``
    of the log odds ratios) and ``log_odds_chosen`` (the mean log odds ratio).

    Args:
      chosen_logps, rejected_logps: the policy's summed completion log-probabilities,
        ``[pairs]``.
      chosen_tokens, rejected_tokens: each answer's number of completion tokens.
      nll: the chosen sequences' mean negative log-likelihood (a scalar).
      beta: ``β``, the weight of the odds-ratio term (TRL's ``ORPOConfig.beta``).

    >>> import jax.numpy as jnp
    >>> from nnx_shard.preference import orpo
    >>> loss, metrics = orpo(jnp.array([-1.0]), jnp.array([-4.0]), jnp.array([1]),
    ...                      jnp.array([2]), nll=jnp.float32(2.5))
    >>> round(float(metrics["log_odds_chosen"]), 4), round(float(loss), 4)
    (1.3133, 2.5238)
    """
    beta = check_beta(beta, "orpo")
    pc, pr, nc, nr = _f32(chosen_logps, rejected_logps, chosen_tokens, rejected_tokens)
    avg_c, avg_r = pc / nc, pr / nr
    log_odds = (avg_c - avg_r) - (_log1mexp(avg_c) - _log1mexp(avg_r))
    ratio = jax.nn.log_sigmoid(log_odds)
    nll = jnp.asarray(nll, jnp.float32)
    metrics = _metrics(beta * avg_c, beta * avg_r, avg_c, avg_r)
    metrics.update(nll_loss=nll, log_odds_ratio=jnp.mean(ratio), log_odds_chosen=jnp.mean(log_odds))
    return nll - jnp.mean(beta * ratio), metrics
