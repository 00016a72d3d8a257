"""Per-stage bytes of a pipelined model (``nnx_shard.pipeline.stage_report``): each
stage's share of the layer stack and of its optimizer state, what lies outside
the stack, and the activations the schedule keeps in flight.

It reads the same per-parameter rows as :func:`nnx_shard.explain` and the
schedule of :mod:`nnx_shard._parallel.schedule`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnx_shard._errors import ShardingError, count, short
from nnx_shard._mesh import make_mesh
from nnx_shard._parallel.schedule import OPTION, Schedule, bubble, check_stack
from nnx_shard._report import explain as report
from nnx_shard._report import fmt_bytes
from nnx_shard._rules import Rules
from nnx_shard.strategies._presets import get

__all__ = ["StageReport", "stage_report"]


@dataclasses.dataclass(frozen=True)
class StageReport:
    """Per-stage bytes of a pipelined model (see :func:`stage_report`); every figure is per
    device of that stage.

    Attributes:
      stages, repeats, microbatches: S, V, M.
      groups: the stack's layers each stage runs, in the order it runs them.
      stack_param_bytes, stack_opt_bytes: the stage's share of the stack and of its
        optimizer state (the same on every stage: 1/S of the stack, split further by
        other mesh axes).
      other_param_bytes, other_opt_bytes: everything outside the stack (embeddings,
        head), placed by the rest of the rules (replicated over ``stage``).
      microbatch_bytes: one microbatch of the activations entering the stack.
      activation_bytes: the activations of the microbatches in flight that the
        backward pass keeps at layer boundaries: ``(M*V + S - 1)`` iterations x
        ``L/(S*V)`` layers (1 with ``Schedule.remat``: the stage's input) x
        ``microbatch_bytes``, plus the ``M`` microbatches of outputs and one of
        inputs the pipeline holds. Layers without rematerialisation keep more
        inside each layer; this is the floor (``remat="full"``).
      bubble: the idle fraction of stage-steps, ``(S-1)/(M*V+S-1)``.
    """

    stages: int
    repeats: int
    microbatches: int
    groups: tuple[tuple[int, ...], ...]
    stack_param_bytes: int
    stack_opt_bytes: int
    other_param_bytes: int
    other_opt_bytes: int
    microbatch_bytes: int
    activation_bytes: int
    bubble: float

    @property
    def total_bytes(self) -> int:
        """Parameters, optimizer state and activations of one stage's device."""
        return (self.stack_param_bytes + self.stack_opt_bytes + self.other_param_bytes
                + self.other_opt_bytes + self.activation_bytes)

    def __str__(self) -> str:
        head = ("stage", "layers", "stack params", "stack opt", "other params", "other opt",
                "activations", "total")
        body = []
        for i, layers in enumerate(self.groups):
            contiguous = list(layers) == list(range(layers[0], layers[-1] + 1))
            shown = (str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
                     if contiguous else ",".join(map(str, layers)))
            body.append((str(i), shown, *(fmt_bytes(b) for b in (
                self.stack_param_bytes, self.stack_opt_bytes, self.other_param_bytes,
                self.other_opt_bytes, self.activation_bytes, self.total_bytes))))
        widths = [max(len(r[c]) for r in (head, *body)) for c in range(len(head))]
        lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip()
                 for r in (head, *body)]
        kind = "GPipe" if self.repeats == 1 else f"circular, {self.repeats} repeats"
        lines.append(f"{kind}: {self.stages} stages, {self.microbatches} microbatches of "
                     f"{fmt_bytes(self.microbatch_bytes)} per device, bubble "
                     f"{self.bubble:.1%} of stage-steps")
        return "\n".join(lines)


def stage_report(model: Any, mesh: Any, strategy: Any, optimizer: Any = None, *,
                 carry: Any, microbatches: int) -> StageReport:
    """Per-stage parameter, optimizer and activation bytes of ``model`` (concrete or
    abstract) pipelined by ``strategy`` (a pp preset, or rules with the ``pipeline``
    option) on ``mesh``.

    Args:
      carry: the activations entering the stack for the whole batch (arrays or
        ``jax.ShapeDtypeStruct``), e.g. ``[batch, length, embed]`` for the
        reference Decoder.
      microbatches: M.

    >>> import dataclasses
    >>> import jax
    >>> from flax import nnx
    >>> from nnx_shard.pipeline import stage_report
    >>> import jax.numpy as jnp, optax
    >>> import nnx_shard as ns
    >>> from nnx_shard.models import Decoder, get_config
    >>> cfg = dataclasses.replace(get_config("tiny"), layers=8, scan_layers=True)
    >>> model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    >>> x = jax.ShapeDtypeStruct((16, cfg.length, cfg.embed), jnp.float32)
    >>> r = stage_report(model, "stage=4,data=2", ns.strategies.get("pp"), optax.adam(1e-3),
    ...                  carry=x, microbatches=8)
    >>> r.groups[1], r.microbatch_bytes, r.bubble
    ((2, 3), 2048, 0.2727272727272727)
    >>> print(r)   # doctest: +NORMALIZE_WHITESPACE
    stage  layers  stack params  stack opt   other params  other opt  activations  total
    0      0-1     64.50 KiB     129.00 KiB  34.12 KiB     68.25 KiB  62.00 KiB    357.88 KiB
    1      2-3     64.50 KiB     129.00 KiB  34.12 KiB     68.25 KiB  62.00 KiB    357.88 KiB
    2      4-5     64.50 KiB     129.00 KiB  34.12 KiB     68.25 KiB  62.00 KiB    357.88 KiB
    3      6-7     64.50 KiB     129.00 KiB  34.12 KiB     68.25 KiB  62.00 KiB    357.88 KiB
    GPipe: 4 stages, 8 microbatches of 2.00 KiB per device, bubble 27.3% of stage-steps
    """
    m = count(microbatches, "pipeline.stage_report: microbatches", fix="e.g. microbatches=8")
    if isinstance(strategy, str):  # a preset's name
        strategy = get(strategy)
    rules = getattr(strategy, "rules", strategy)
    if not isinstance(rules, Rules):
        raise ShardingError(
            f"pipeline.stage_report: strategy must be a pp preset (its name or Strategy) or Rules "
            f"with the pipeline option, got {type(strategy).__name__} {short(strategy, 60)}. "
            "Fix: e.g. ns.strategies.get('pp')")
    opt_rules = getattr(strategy, "opt_rules", None)
    sched = rules.options.get(OPTION)
    if not isinstance(sched, Schedule):
        raise ShardingError(
            f"pipeline.stage_report: the rules carry no pipeline option (got {sched!r}). Fix: pass "
            "a pp strategy, e.g. ns.strategies.get('pp'), or "
            "rules.with_options(pipeline=Schedule())."
        )
    if not isinstance(mesh, jax.sharding.AbstractMesh):  # plans any size with no devices
        mesh = make_mesh(mesh)
    sizes = dict(mesh.shape)
    state = model if isinstance(model, nnx.State) else nnx.state(model)
    check_stack(state, sizes, sched)
    if sched.axis not in sizes:
        raise ShardingError(
            f"pipeline.stage_report: the mesh ({', '.join(f'{k}={v}' for k, v in sizes.items())}) "
            f"has no {sched.axis!r} axis. Fix: e.g. make_mesh('{sched.axis}=4,data=2')."
        )
    rep = report(model, mesh, rules, optimizer, opt_rules=opt_rules)
    stack = {p for p, v in nnx.to_flat_state(state) if isinstance(v, nnx.Variable)
             and (v.get_metadata().get("out_sharding") or (None,))[0] == "layers"}
    stack_paths = {"/".join(map(str, p)) for p in stack}

    def is_stack(row: Any) -> bool:
        return (bool(row.names) and row.names[0] == "layers") or row.path in stack_paths

    def total(group: str, in_stack: bool) -> int:
        return sum(r.bytes_per_device for r in rep.rows
                   if r.group == group and is_stack(r) == in_stack)

    s, v = sizes[sched.axis], sched.repeats
    n_layers = next(int(np.shape(var.get_value())[0]) for p, var in nnx.to_flat_state(state)
                    if p in stack)
    g = n_layers // (s * v)
    groups = tuple(tuple(layer for r in range(v) for layer in range((r * s + st) * g,
                                                                     (r * s + st + 1) * g))
                   for st in range(s))
    data_axes = rules.spec(("batch",), shape=None, mesh=mesh, path="pipeline batch")[0]
    data_axes = () if data_axes is None else (data_axes,) if isinstance(data_axes, str) else data_axes
    data = math.prod(sizes[a] for a in data_axes)
    leaves = jax.tree_util.tree_flatten_with_path(carry)[0]
    for path, x in leaves:
        shape = getattr(x, "shape", None)
        where = f"carry{jax.tree_util.keystr(path)}"
        if shape is None or not hasattr(x, "dtype") or not shape:
            raise ShardingError(
                f"pipeline.stage_report: {where} is {type(x).__name__} {short(x, 60)}, not an array "
                "with a leading batch axis. Fix: the activations entering the stack, e.g. "
                "jax.ShapeDtypeStruct((batch, length, embed), jnp.float32)")
        if shape[0] % (m * data):
            raise ShardingError(
                f"pipeline.stage_report: {where} has {shape[0]} rows, which do not split into "
                f"microbatches={m} on each of {data} data replica(s). Fix: a batch that is a "
                f"multiple of {m * data}, or another number of microbatches")
    if not leaves:
        raise ShardingError("pipeline.stage_report: carry holds no array. Fix: e.g. "
                            "carry=jax.ShapeDtypeStruct((batch, length, embed), jnp.float32)")
    whole = sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for _, x in leaves)
    micro = whole // (m * data)
    acts = ((m * v + s - 1) * (1 if sched.remat else g) + m + 1) * micro
    return StageReport(stages=s, repeats=v, microbatches=m, groups=groups,
                       stack_param_bytes=total("params", True),
                       stack_opt_bytes=total("optimizer", True),
                       other_param_bytes=total("params", False),
                       other_opt_bytes=total("optimizer", False),
                       microbatch_bytes=micro, activation_bytes=acts, bubble=bubble(s, m, v))
