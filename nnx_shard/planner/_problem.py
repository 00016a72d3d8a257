"""What one :func:`nnx_shard.planner.auto` call plans for: :class:`Problem`, the options,
checked, and the model, resolved and built abstractly (:func:`resolve`), with what can be
told of a layout before any compile (:func:`batch_problem`, :meth:`Problem.idle_axes`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh

from nnx_shard._axes import entry_axes
from nnx_shard._errors import ShardingError, UsageError, short
from nnx_shard._parallel.schedule import stage_count
from nnx_shard.models import DecoderConfig, ReferenceConfig
from nnx_shard.models._named import CONFIGS, max_length
from nnx_shard.planner._compile import config_dict, config_factory
from nnx_shard.planner._formula import abstract_report
from nnx_shard.planner._hardware import Hardware
from nnx_shard.planner._options import (
    AutoOptions,
    check_auto_options,
    names_list,
    offload_modes,
    positive_int,
    remat_policies,
)
from nnx_shard.planner._twins import activation_entries
from nnx_shard.planner._user import UserModel
from nnx_shard.strategies._presets import get
from nnx_shard.strategies._strategy import Strategy

__all__ = ["Problem", "batch_problem", "resolve"]


@dataclasses.dataclass
class Problem:
    """The options, checked, and the model, resolved and built abstractly."""

    opts: AutoOptions
    hw: Hardware
    memory: int | None
    names: list[str]
    tx: Any
    cfg: ReferenceConfig | DecoderConfig | None  # a reference config, compiled in a subprocess
    model: Any                     # what the user gave
    model_name: str | None
    takes_remat: bool              # a factory with a remat keyword
    policies: list[str | None]
    abstract: Any
    mbs: list[int]
    user: UserModel | None = None  # a factory with its own loss and batch
    offloads: list[str] = dataclasses.field(default_factory=list)  # tried where nothing fits
    host_memory: int | None = None  # host bytes per device offloaded state may take

    def strategy(self, name: str, offload: str | None = None) -> Strategy:
        """Preset ``name`` as the search lays it out (a user model's aliases applied),
        with host ``offload`` where given."""
        strat = self.user.strategy(name) if self.user is not None else get(name)
        return strat if offload is None else strat.with_offload(offload)

    def batch_problem(self, strat: Strategy, sizes: dict[str, int], mb: int) -> str | None:
        """Why ``mb`` microbatches cannot run under ``strat`` on ``sizes`` (``None``:
        they can), known before any compile."""
        stages = stage_count(strat.rules, sizes)
        if stages is not None:
            sched = strat.rules.options["pipeline"]
            if mb < stages and not (sched.allow_few_microbatches and sched.repeats == 1):
                return (f"a pipeline over {stages} stages needs at least {stages} "
                        f"microbatches, not {mb}")
        if self.user is not None:
            return self.user.batch_problem(strat, sizes, mb)
        return batch_problem(strat, sizes, self.opts.batch, self.opts.seq, mb)

    def idle_axes(self, strat: Strategy, sizes: dict[str, int], mb: int) -> list[str]:
        """The mesh axes of size > 1 that lay out nothing of the step under ``strat`` on
        ``sizes``: no parameter, optimizer state, batch array (nor, for a reference
        model, activation) is split over them, so every device along one would repeat
        the same step (``ep`` on a dense model where the batch does not divide over
        ``data`` x ``expert``). Empty where that cannot be told here: the compile says."""
        big = [a for a, n in sizes.items() if n > 1]
        if not big:
            return []
        mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
        try:
            rows = abstract_report(self.abstract, sizes, strat.rules, self.tx,
                                   strat.opt_rules).rows
            entries = [tuple(entry_axes(e) for e in tuple(r.spec)) for r in rows]
            if self.cfg is not None:
                entries += activation_entries(strat, sizes, self.cfg, batch=self.opts.batch,
                                              seq=self.opts.seq, microbatches=mb)
            elif self.user is not None:
                for x in jax.tree_util.tree_leaves(self.user.spec):
                    spec = strat.rules.spec(("batch", *(None,) * (len(x.shape) - 1)),
                                            shape=x.shape, mesh=mesh)
                    entries.append(tuple(entry_axes(e) for e in spec))
        except Exception:  # a layout the rules refuse: the compile will say what is wrong
            return []
        used = {a for spec in entries for e in spec for a in e}
        return [a for a in big if a not in used]

    def first_mb(self, strat: Strategy, sizes: dict[str, int]) -> tuple[int | None, str]:
        """The fewest microbatches of the search's counts that can run under ``strat``
        on ``sizes`` (``None`` and why, if none can)."""
        why = ""
        for mb in self.mbs:
            why = self.batch_problem(strat, sizes, mb) or ""
            if not why:
                return mb, ""
        stages = stage_count(strat.rules, sizes) or 1
        if stages > max(self.mbs):
            why = (f"a pipeline over {stages} stages needs at least {stages} microbatches; "
                   f"the counts searched are {', '.join(map(str, self.mbs))}. Fix: "
                   f"microbatches=[..., {stages}], or fewer stages")
        return None, why


def batch_problem(strat: Strategy, sizes: dict[str, int], batch: int, seq: int,
                   microbatches: int) -> str | None:
    """Why the batch cannot be laid out under ``strat`` on ``sizes`` (``None``: it can).

    >>> batch_problem(get("dp"), {"data": 8}, 16, 128, 1) is None
    True
    >>> batch_problem(get("dp"), {"data": 8}, 16, 128, 4)
    '4 microbatches do not divide the 2 rows per device'
    """
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    try:
        spec = strat.rules.spec((None, "batch", "length"), shape=(1, batch, seq), mesh=mesh,
                                path="batch['inputs']")
    except ShardingError as e:
        msg = " ".join(str(e).split())
        return f"batch {batch} x seq {seq} cannot be laid out: {msg[:200]}"
    entry = tuple(spec)[1] if len(tuple(spec)) > 1 else None
    axes = entry_axes(entry)
    rows = batch // math.prod(sizes[a] for a in axes)
    if rows % microbatches:
        return f"{microbatches} microbatches do not divide the {rows} rows per device"
    return None


def resolve(model: Any, opts: AutoOptions, user: UserModel | None = None) -> Problem:
    """Checks ``opts``, resolves ``model`` and builds it abstractly (nothing allocated);
    ``user``: a model of the user's own, with its loss and batch.

    >>> p = resolve("tiny", AutoOptions(devices=2, batch=4, seq=8, microbatches=[2]))
    >>> p.model_name, p.mbs, p.policies[0]
    ('tiny', [1, 2], 'none')
    """
    hw, memory, names, tx = check_auto_options(opts)
    offloads = offload_modes(opts.offload)
    if user is not None:
        mbs = sorted({int(m) for m in opts.microbatches if int(m) >= 1} | {1})
        return Problem(opts, hw, memory, names, tx, None, model, None, False, [None],
                        user.abstract(), mbs, user, offloads, hw.host_memory)
    cfg, model_name, takes_remat = None, None, False
    if isinstance(model, str):
        if model not in CONFIGS:
            raise UsageError(f"auto: unknown model {model!r}; known: {', '.join(CONFIGS)}, or "
                             "pass a ReferenceConfig, a DecoderConfig or a factory")
        cfg, model_name = CONFIGS[model], model
    elif isinstance(model, ReferenceConfig | DecoderConfig):
        cfg = model
    elif callable(model):
        try:
            takes_remat = "remat" in inspect.signature(model).parameters
        except (TypeError, ValueError):
            takes_remat = False
    else:
        raise UsageError(f"auto: model must be a config name, a ReferenceConfig or a "
                         f"factory, got {type(model).__name__}. Fix: e.g. auto('small', ...)")
    if cfg is not None and opts.seq > max_length(cfg):
        raise UsageError(f"auto: seq {opts.seq} is longer than the model allows "
                         f"({max_length(cfg)}); use a smaller seq")
    if cfg is not None:
        policies = remat_policies(opts.remat)
        make = config_factory(config_dict(cfg), "none")
    else:
        policies = remat_policies(opts.remat) if takes_remat else [None]
        make = (lambda: model(remat="none")) if takes_remat else model
    try:
        abstract = nnx.eval_shape(make)
    except Exception as e:
        raise UsageError(f"auto: the model factory raised {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}") from e
    counts = names_list(opts.microbatches, "microbatches", "[1, 2, 4]")
    bad = [m for m in counts if not positive_int(m)]
    if bad:
        raise UsageError(f"auto: microbatches must be positive ints, got {short(bad[0], 60)}. "
                         "Fix: e.g. microbatches=[1, 2, 4]")
    mbs = sorted(set(counts) | {1})
    return Problem(opts, hw, memory, names, tx, cfg, model, model_name, takes_remat, policies,
                    abstract, mbs, None, offloads, hw.host_memory)

