"""The arithmetic of a pipeline schedule: the ``pipeline`` option's value
(:class:`Schedule`), which stage works on what at each iteration, the bubble, and
whether a model's layer stack splits into the stages.

The op that runs the schedule is :func:`nnx_shard.pipeline.scan`
(:mod:`nnx_shard._parallel.pipeline`); :mod:`nnx_shard._stage_report` prices
it per stage. Every name here is also ``nnx_shard.pipeline.<name>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx

from nnx_shard._errors import ShardingError, count

__all__ = ["NO_STACK_FIX", "OPTION", "Schedule", "bubble", "check_layers", "check_stack", "idle_fraction",
           "schedule_table", "stage_count", "work"]

#: The execution option (``Rules.with_options(pipeline=Schedule(...))``) the pipeline reads.
OPTION = "pipeline"

NO_STACK_FIX = (
    "Fix: stack the repeated blocks under a leading layer axis and run them through "
    "nnx_shard.pipeline.scan: ReferenceConfig(scan_layers=True) for the reference "
    "model; for your own list of blocks, ns.pipeline.stack(model, 'layers') in the "
    "factory and x = ns.pipeline.run(self.layers, x, ...) in place of the loop; or "
    "nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: 'layers'}) for your own stack."
)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How :func:`scan` pipelines a layer stack (the value of the ``pipeline`` option).

    Attributes:
      axis: the mesh axis the stages lie along.
      repeats: V. 1 is GPipe; V > 1 the circular (interleaved) schedule, in which
        each stage holds V non-contiguous groups of layers.
      allow_few_microbatches: GPipe only: run with fewer microbatches than stages
        (some stages never work) with a ``ShardingWarning`` giving the bubble,
        instead of a ``ShardingError``.
      remat: keep only each stage's input per pipeline iteration for the backward
        pass and recompute the stage's layers there (``jax.checkpoint`` per stage):
        the activations in flight shrink from every layer's to one per stage.

    >>> from nnx_shard.pipeline import Schedule
    >>> Schedule(), Schedule(repeats=2).name
    (Schedule(axis='stage', repeats=1, allow_few_microbatches=False, remat=False), 'circular')
    """

    axis: str = "stage"
    repeats: int = 1
    allow_few_microbatches: bool = False
    remat: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str) or not self.axis:
            raise ShardingError(f"Schedule.axis={self.axis!r} must be a mesh axis name.")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ShardingError(
                f"Schedule.repeats={self.repeats!r} must be an int >= 1 (1: GPipe; V > 1: "
                "circular with V layer groups per stage)."
            )

        for flag in ("allow_few_microbatches", "remat"):
            if not isinstance(getattr(self, flag), bool):
                raise ShardingError(f"Schedule.{flag}={getattr(self, flag)!r} must be a bool.")

    @property
    def name(self) -> str:
        """``"gpipe"`` or ``"circular"``."""
        return "gpipe" if self.repeats == 1 else "circular"


def stage_count(rules: Any, sizes: Mapping[str, int]) -> int | None:
    """How many stages the pipeline of ``rules`` (a :class:`~nnx_shard.Rules` whose
    ``pipeline`` option is a :class:`Schedule`) has on mesh ``sizes``: the size of its
    axis, 1 where the mesh has no such axis; ``None`` where ``rules`` run no pipeline.

    Args:
      rules: a :class:`~nnx_shard.Rules` (or a strategy's rules).
      sizes: the mesh's axis sizes, e.g. ``{"stage": 4, "data": 2}``.

    >>> from nnx_shard.pipeline import stage_count
    >>> from nnx_shard.strategies._presets import get
    >>> stage_count(get("pp").rules, {"stage": 4, "data": 2})
    4
    >>> stage_count(get("pp").rules, {"data": 8}), stage_count(get("fsdp").rules, {"data": 8})
    (1, None)
    >>> stage_count(get("pp"), {"stage": 4})
    Traceback (most recent call last):
    ...
    nnx_shard._errors.ShardingError: stage_count: rules must be a Rules table, got Strategy. Fix: pass strategy.rules
    """
    if not isinstance(getattr(rules, "options", None), Mapping):
        raise ShardingError(f"stage_count: rules must be a Rules table, got "
                            f"{type(rules).__name__}. Fix: pass strategy.rules")
    sched = rules.options.get(OPTION)
    return None if sched is None else int(sizes.get(sched.axis, 1))


def bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The analytic idle fraction of stage-steps: ``(S-1)/(M*V+S-1)``.

    Args:
      stages: pipeline stages ``S``.
      microbatches: microbatches ``M`` per step.
      repeats: layer groups per stage ``V`` (interleaved schedules).

    >>> from nnx_shard.pipeline import bubble
    >>> bubble(4, 4), bubble(4, 16), bubble(4, 4, repeats=2)
    (0.42857142857142855, 0.15789473684210525, 0.2727272727272727)
    """
    s, m, v = _smv("bubble", stages, microbatches, repeats)
    return (s - 1) / (m * v + s - 1)


#: The most stage-steps :func:`schedule_table` lays out (it is an array of them).
_MAX_TABLE = 10**8


def _smv(who: str, stages: Any, microbatches: Any, repeats: Any) -> tuple[int, int, int]:
    """S, M and V checked: whole counts >= 1 (a bool, a float or 0 would give a bubble
    of a schedule that cannot run)."""
    return (count(stages, f"{who}: stages", fix="the pipeline stages, e.g. 4"),
            count(microbatches, f"{who}: microbatches", fix="e.g. 8 (at least the stages)"),
            count(repeats, f"{who}: repeats", fix="1 (GPipe) or V > 1 (circular)"))


def schedule_table(stages: int, microbatches: int, repeats: int = 1) -> np.ndarray:
    """What each stage works on at each iteration of :func:`scan`'s loop, as the
    loop computes it: ``[iterations, stages]`` of ``microbatch * repeats + repeat``
    (the layer-group pass of one microbatch), ``-1`` where the stage is idle.

    Args:
      stages: pipeline stages.
      microbatches: microbatches per step.
      repeats: layer groups per stage.

    >>> from nnx_shard.pipeline import schedule_table
    >>> schedule_table(2, 2)
    array([[ 0, -1],
           [ 1,  0],
           [-1,  1]])
    """
    s, m, v = _smv("schedule_table", stages, microbatches, repeats)
    if (m * v + s - 1) * s > _MAX_TABLE:
        raise ShardingError(
            f"schedule_table: {s} stages x {m * v + s - 1:,} iterations is more than the "
            f"{_MAX_TABLE:,} entries laid out. Fix: bubble(stages, microbatches, repeats) gives "
            "the idle fraction without the table")
    item, busy = work(np.arange(m * v + s - 1)[:, None], np.arange(s)[None, :], m, v)
    return np.where(busy, (item % m) * v + item // m, -1)


def work(t: Any, stage: Any, m: int, v: int) -> tuple[Any, Any]:
    """The work item stage ``stage`` runs at iteration ``t`` (pass ``item // m`` of
    microbatch ``item % m``) and whether it is real work. The loop of :func:`scan`
    and :func:`schedule_table` both use it (NumPy arrays or traced values)."""
    item = t - stage
    return item, (item >= 0) & (item < m * v)


def idle_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The fraction of idle entries of :func:`schedule_table`: the measured bubble.

    Args:
      stages: pipeline stages.
      microbatches: microbatches per step.
      repeats: layer groups per stage.

    >>> from nnx_shard.pipeline import bubble, idle_fraction
    >>> idle_fraction(4, 8) == bubble(4, 8)
    True
    """
    table = schedule_table(stages, microbatches, repeats)
    return float(np.mean(table < 0))


def check_stack(state: Any, sizes: dict[str, int], sched: Schedule) -> None:
    """Raises a ``ShardingError`` unless ``state`` (a model's) has a stacked layer axis
    (parameters whose first logical name is ``layers``) whose length divides into
    the stages (x repeats) of ``sizes``. :meth:`nnx_shard.strategies.Strategy.check`
    calls it for pipeline strategies.

    >>> from nnx_shard.models import Decoder, get_config
    >>> cfg = get_config("tiny")   # 2 blocks, not stacked
    >>> model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    >>> check_stack(nnx.state(model), {"stage": 2, "data": 4}, Schedule())
    Traceback (most recent call last):
    ...
    nnx_shard._errors.ShardingError: pipeline over 'stage': the model has no stacked layer axis ...
    """
    stacked = []
    for path, var in nnx.to_flat_state(state):
        if not isinstance(var, nnx.Variable):
            continue
        names = var.get_metadata().get("out_sharding") or ()
        if names and names[0] == "layers":
            stacked.append(("/".join(map(str, path)), int(np.shape(var.get_value())[0])))
    if not stacked:
        raise ShardingError(
            f"pipeline over {sched.axis!r}: the model has no stacked layer axis (no parameter "
            f"has the logical name 'layers' on its first dimension), so there is nothing to "
            f"split over stages. {NO_STACK_FIX}"
        )
    s = sizes.get(sched.axis)
    if s is None:
        return  # the strategy's missing-axis message names the fix
    v = sched.repeats
    first, n_layers = stacked[0]
    check_layers(n_layers, s, v, sched.axis,
                  f"parameter {first!r} stacks {n_layers} layers, which do not divide into",
                  f" (mesh {', '.join(f'{k}={x}' for k, x in sizes.items())})",
                  f" with repeats={v}")


def check_layers(n_layers: int, s: int, v: int, axis: str, subject: str, where: str,
                  repeats: str) -> None:
    """Raises where ``n_layers`` stacked layers do not split into ``s`` stages x
    ``v`` repeats: ``subject`` says what holds them, ``where`` the mesh (or
    nothing), ``repeats`` how the fix keeps the repeats."""
    if n_layers % (s * v) == 0:
        return
    what = f"{s} stages" if v == 1 else f"{s} stages x {v} repeats = {s * v} layer groups"
    good = [d for d in range(1, n_layers + 1) if n_layers % (d * v) == 0]
    raise ShardingError(
        f"pipeline: {subject} {what}{where}. Fix: a layer count that is a multiple of "
        f"{s * v}, or a '{axis}' axis of size {' / '.join(map(str, good))}"
        + (repeats if v > 1 else "") + "."
    )
