"""The planner's search: :func:`auto` over its :class:`AutoOptions` (defined, with
their checks, in :mod:`nnx_shard.planner.options`).

:func:`auto` runs in named phases: :func:`_resolve` checks the options and builds
the model abstractly; :func:`_layouts` enumerates preset x mesh and drops what
cannot be laid out; a :class:`~nnx_shard.planner.explore.Search` compiles the plain
layouts, then remat policies and microbatches for the layouts that do not fit, and
ranks what fits. See :mod:`nnx_shard.planner` for the cost model.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from nnx_shard.errors import NnxShardError, ShardingError, UsageError, short
from nnx_shard.models import LlamaConfig, TransformerConfig
from nnx_shard.models.named import NAMED, max_length
from nnx_shard.planner.compile import config_dict, config_factory
from nnx_shard.planner.explore import Problem, Search
from nnx_shard.planner.options import (
    REMAT_ORDER,
    AutoOptions,
    check_auto_options,
    names_list,
    positive_int,
    remat_policies,
)
from nnx_shard.planner.plan import Candidate, Plan, clip
from nnx_shard.planner.user import UserModel
from nnx_shard.presets import get
from nnx_shard.report import fmt_bytes
from nnx_shard.strategy import factorizations

__all__ = ["REMAT_ORDER", "AutoOptions", "NothingFits", "auto", "enumerate_layouts"]


class NothingFits(NnxShardError, ValueError):
    """No candidate fits the memory; ``plan`` holds what was tried, and the message
    names the smallest need and the knob that cuts it most.

    >>> issubclass(NothingFits, ValueError)
    True
    """

    def __init__(self, plan: Plan, message: str) -> None:
        super().__init__(message)
        self.plan = plan


# -- phase 1: the options and the model ---------------------------------------------------


def _resolve(model: Any, opts: AutoOptions, user: UserModel | None = None) -> Problem:
    """Checks ``opts``, resolves ``model`` and builds it abstractly (nothing allocated)."""
    hw, memory, names, tx = check_auto_options(opts)
    if user is not None:
        mbs = sorted({int(m) for m in opts.microbatches if int(m) >= 1} | {1})
        return Problem(opts, hw, memory, names, tx, None, model, None, False, [None],
                        user.abstract(), mbs, user)
    cfg, model_name, takes_remat = None, None, False
    if isinstance(model, str):
        if model not in NAMED:
            raise UsageError(f"auto: unknown model {model!r}; known: {', '.join(NAMED)}, or "
                             "pass a TransformerConfig, a LlamaConfig or a factory")
        cfg, model_name = NAMED[model], model
    elif isinstance(model, TransformerConfig | LlamaConfig):
        cfg = model
    elif callable(model):
        try:
            takes_remat = "remat" in inspect.signature(model).parameters
        except (TypeError, ValueError):
            takes_remat = False
    else:
        raise UsageError(f"auto: model must be a config name, a TransformerConfig or a "
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
                    abstract, mbs)


# -- phase 2: the layouts ---------------------------------------------------------------------


def enumerate_layouts(n: int, names: Sequence[str]) -> tuple[list[tuple[str, dict[str, int]]],
                                                              list[str]]:
    """Every preset of ``names`` on every factorisation of ``n`` devices over its mesh
    axes, but those with a size-1 axis beyond the first (a preset with fewer axes
    lays the model out the same); and what was skipped, in words.

    >>> layouts, pruned = enumerate_layouts(4, ["dp", "tp"])
    >>> layouts
    [('dp', {'data': 4}), ('tp', {'data': 1, 'model': 4}), ('tp', {'data': 2, 'model': 2})]
    """
    out, pruned = [], []
    skipped = 0
    for name in names:
        strat = get(name)
        for shape in factorizations(n, len(strat.mesh_axes)):
            sizes = dict(zip(strat.mesh_axes, shape, strict=True))
            if n > 1 and len(shape) > 1 and 1 in shape[1:]:
                skipped += 1
                continue
            out.append((name, sizes))
    if skipped:
        pruned.append(f"{skipped} meshes with a size-1 axis beyond the first (the same layout "
                      "as a preset with fewer axes, e.g. tp model=1 is dp)")
    return out, pruned


def _layouts(p: Problem) -> tuple[list[tuple[str, dict[str, int]]],
                                   list[tuple[str, dict[str, int], int]], list[Candidate],
                                   list[str]]:
    """Every layout, those that can be laid out (with the fewest microbatches they
    run with: a pipeline's stage count), the dropped ones (with why) and what the
    enumeration skipped; raises when no preset can use the devices."""
    opts = p.opts
    layouts, pruned = enumerate_layouts(opts.devices, p.names)
    dropped: list[Candidate] = []
    viable: list[tuple[str, dict[str, int], int]] = []
    for name, sizes in layouts:
        strat = p.strategy(name)
        base = Candidate(name, sizes, p.policies[0])
        # The batch first: one rule lookup, where check resolves every parameter (and,
        # failing, every mesh of the devices for a suggestion): with many devices most
        # layouts cannot split the batch, and the search stays linear in the layouts.
        mb, why = p.first_mb(strat, sizes)
        if mb is None:
            base.reason = why
            dropped.append(base)
            continue
        try:
            strat.check(p.abstract, sizes)
        except (ShardingError, ValueError, TypeError) as e:
            # A preset states what it needs of the model by raising from check.
            base.reason = "cannot lay out: " + " ".join(str(e).split())
            dropped.append(base)
            continue
        idle = p.idle_axes(strat, sizes, mb)
        if idle:
            n = sizes[idle[0]]
            base.reason = (f"mesh axis {idle[0]!r} (size {n}) splits nothing of this model: "
                           "no parameter, optimizer state, batch or activation is laid out "
                           f"over it, so its {n} devices would each repeat the same step")
            dropped.append(base)
            continue
        viable.append((name, sizes, mb))
    if not viable:
        fams = Plan([], dropped, pruned, p.hw, {}).families()
        n, batch = opts.devices, opts.batch
        good = [d for d in range(max(1, n - 8), n + 9) if d != n and batch % d == 0 and d > 1]
        hint = (f" Device counts near {n} that divide the batch {batch}: "
                f"{', '.join(map(str, good[:6]))}." if good else "")
        # One line of bounded length, however many presets: each reason gets its share.
        each = max(60, min(160, 1200 // max(len(fams), 1)))
        raise UsageError(
            f"auto: no preset can use {n} devices for this model with batch {batch} x "
            f"seq {opts.seq}: " + "; ".join(f"{k}: {clip(v, each)}" for k, v in fams.items())
            + f".{hint} Fix: a global batch that divides by the data axes, or another "
            "device count")
    return layouts, viable, dropped, pruned


def auto(model: Any = "small", options: AutoOptions | None = None, *,
         loss: Callable[[Any, Any], Any] | None = None, batch_spec: Any = None,
         aliases: Mapping[str, str] | None = None, **knobs: Any) -> Plan:
    """Chooses a strategy preset, mesh shape, remat policy and microbatch count
    for ``model`` on ``options.devices`` devices with ``options.device_memory``
    bytes each, and ranks the candidates that fit by predicted step time (see
    :mod:`nnx_shard.planner`).

    ``model`` is a reference config name (``"small"``, ``"1b"``, ...), a
    :class:`~nnx_shard.models.TransformerConfig`, or a zero-argument factory
    returning a language model (called as ``lm_loss`` calls the reference
    Transformer; a factory taking a ``remat`` keyword gets the policies tried).
    Configs compile in a subprocess with ``devices`` simulated CPU devices; a
    factory compiles in this process and needs that many devices. The options are
    an :class:`AutoOptions`, or its fields as keywords (``auto("small", devices=8,
    batch=16, seq=16)``); keywords given with ``options`` replace its fields.
    Raises :class:`NothingFits` when no candidate fits.

    A model of the user's own (no ``forward``, no reference config) comes with
    ``loss(model, batch) -> scalar`` and ``batch_spec``, one step's global batch (a
    pytree of ``jax.ShapeDtypeStruct``, or ``"inputs=int32[16,128],..."`` text, see
    :class:`~nnx_shard.planner.user.UserModel`); ``batch`` and ``seq`` then come from
    it. ``aliases`` map the model's own logical names onto the presets'
    (:meth:`~nnx_shard.Strategy.with_rules`). Each candidate compiles
    :func:`~nnx_shard.planner.compile.compile_step` of that loss and batch::

        plan = auto(make_llama, loss=loss_fn, batch_spec="x=int32[16,128],y=int32[16,128]",
                    aliases={"fsdp": "embed", "tp": "mlp"}, devices=8)

    >>> fake = lambda c: {"total": 100 * (1 + (c.strategy == "dp")), "temp": 1,
    ...                   "flops": 1e9, "collective_bytes": 1e6 * c.mesh.get("model", 1),
    ...                   "collectives": 1}
    >>> plan = auto("tiny", devices=8, batch=8, seq=16, device_memory=150,
    ...             strategies=["dp", "fsdp", "tp"], compile_fn=fake, progress=False)
    >>> [c.label for c in plan.ranked]
    ['fsdp data=8 remat=none mb=1', 'tp data=4,model=2 remat=none mb=1', 'tp data=2,model=4 remat=none mb=1']
    >>> [c.reason for c in plan.dropped if c.strategy == "dp"][0]
    'needs 200 B per device (compiled), over the 150 B available'
    """
    user = None
    if loss is not None or batch_spec is not None:
        if loss is None or batch_spec is None:
            raise UsageError("auto: a model of your own needs both loss= and batch_spec=. Fix: "
                             "auto(factory, loss=loss_fn, batch_spec='x=int32[16,128],...', "
                             "devices=N)")
        user = UserModel(model, loss, batch_spec, aliases).check()
        for arg, value in (("batch", user.global_batch), ("seq", user.seq)):
            given = knobs.get(arg, getattr(options, arg, value))
            if given != value:
                raise UsageError(f"auto: {arg}={given} but the batch spec has {value}. Fix: "
                                 f"drop {arg}= (it comes from batch_spec)")
            knobs[arg] = value
    elif aliases is not None:
        raise UsageError("auto: aliases= goes with a model of your own (loss= and "
                         "batch_spec=); the reference configs use the presets' names")
    opts = _options(options, knobs)
    p = _resolve(model, opts, user)
    if user is not None:
        user.check_names(p.abstract, p.names)
    layouts, viable, dropped, pruned = _layouts(p)
    search = Search(p, layouts, dropped, pruned)
    if p.cfg is None and opts.compile_fn is None and jax.device_count() < opts.devices:
        raise UsageError(
            f"auto: a model factory compiles in this process, which has "
            f"{jax.device_count()} devices, fewer than devices={opts.devices}. Fix: run with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={opts.devices} (CPU), or pass "
            "a config name / TransformerConfig (compiled in a subprocess).")
    try:
        first = search.plain(viable)
        search.variants(first)
    finally:
        search.close()
    unsaved = search.store.save()
    if unsaved is not None:  # best effort: the plan is what was asked for
        warnings.warn(f"auto: {unsaved}", RuntimeWarning, stacklevel=2)
    twins = search.rank()
    plan = search.plan(twins)
    if not plan.ranked:
        raise NothingFits(plan, _nothing_fits(plan, p.memory, opts.batch, opts.devices))
    return plan


def _options(options: AutoOptions | None, knobs: Mapping[str, Any]) -> AutoOptions:
    """``options`` with ``knobs`` replacing its fields (or the knobs alone), checked for
    names: a misspelt knob is an error naming the field meant."""
    if options is not None and not isinstance(options, AutoOptions):
        raise UsageError(f"auto: options must be an AutoOptions, got {type(options).__name__} "
                         f"{short(options, 60)}. Fix: AutoOptions(devices=8, batch=16, seq=16), "
                         "or give the fields as keywords")
    fields = [f.name for f in dataclasses.fields(AutoOptions)]
    for knob in knobs:
        if knob not in fields:
            close = difflib.get_close_matches(knob, fields, n=1, cutoff=0.6)
            mean = f" Did you mean {close[0]!r}?" if close else ""
            raise UsageError(f"auto: unknown option {knob!r}.{mean} Fix: one of "
                             + ", ".join(fields))
    if options is not None:
        return dataclasses.replace(options, **knobs)
    missing = [f for f in ("devices", "batch", "seq") if f not in knobs]
    if missing:
        raise UsageError(f"auto: {', '.join(missing)} must be given. Fix: e.g. "
                         "auto('small', devices=8, batch=16, seq=128)")
    return AutoOptions(**knobs)


def _nothing_fits(plan: Plan, memory: int | None, batch: int, devices: int) -> str:
    measured = [c for c in plan.dropped if c.bytes_per_device]
    if not measured:
        fams = plan.families()
        return ("auto: no candidate compiled: "
                + "; ".join(f"{k}: {clip(v, 200)}" for k, v in fams.items()))
    least = min(measured, key=lambda c: c.bytes_per_device or 0)
    need = least.bytes_per_device or 0
    temp = least.temp or 0
    if least.compiled and temp > need / 2:
        knob = (f"activations dominate ({fmt_bytes(temp)} of it is XLA's temporaries): a "
                f"smaller batch (e.g. {max(1, batch // 2)}) or more microbatches cut it most")
    else:
        knob = (f"parameters and optimizer state dominate: more devices (fsdp shards them 1/N; "
                f"e.g. {devices * 2}) or a smaller optimizer state (sgd) cut it most")
    return (f"auto: nothing fits in {fmt_bytes(memory or 0)} per device: the smallest need is "
            f"{fmt_bytes(need)} ({least.label}); {knob}.")

