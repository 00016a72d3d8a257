"""The planner's entry point: :func:`auto` over its :class:`AutoOptions` (defined, with
their checks, in :mod:`nnx_shard.planner._options`).

:func:`auto` runs in named phases: :func:`~nnx_shard.planner._problem.resolve` checks the
options and builds the model abstractly; :func:`~nnx_shard.planner._candidates.viable_candidates`
enumerates preset x mesh and drops what cannot be laid out; a
:class:`~nnx_shard.planner._explore.Search` compiles the plain layouts, then remat policies
and microbatches for the layouts that do not fit, and ranks what fits. See
:mod:`nnx_shard.planner` for the cost model.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax

from nnx_shard._errors import NnxShardError, UsageError, short
from nnx_shard._report import fmt_bytes
from nnx_shard.planner._candidates import viable_candidates
from nnx_shard.planner._explore import Search
from nnx_shard.planner._options import REMAT_ORDER, AutoOptions
from nnx_shard.planner._plan import Plan, clip
from nnx_shard.planner._problem import resolve
from nnx_shard.planner._user import UserModel

__all__ = ["REMAT_ORDER", "AutoOptions", "NothingFits", "auto"]


class NothingFits(NnxShardError, ValueError):
    """No candidate fits the memory; ``plan`` holds what was tried, and the message
    names the smallest need and the knob that cuts it most.

    Args:
      plan: the :class:`Plan` of the search (its ``dropped`` candidates say why).
      message: the error's text.

    >>> from nnx_shard.planner import NothingFits
    >>> issubclass(NothingFits, ValueError)
    True
    """

    def __init__(self, plan: Plan, message: str) -> None:
        super().__init__(message)
        self.plan = plan


def auto(model: Any = "small", options: AutoOptions | None = None, *,
         loss: Callable[[Any, Any], Any] | None = None, batch_spec: Any = None,
         aliases: Mapping[str, str] | None = None, **knobs: Any) -> Plan:
    """Chooses a strategy preset, mesh shape, remat policy and microbatch count
    for ``model`` on ``options.devices`` devices with ``options.device_memory``
    bytes each, and ranks the candidates that fit by predicted step time (see
    :mod:`nnx_shard.planner`).

    ``model`` is a reference config name (``"small"``, ``"1b"``, ...), a
    :class:`~nnx_shard.models.ReferenceConfig`, or a zero-argument factory
    returning a language model (called as ``lm_loss`` calls
    ``Decoder``; a factory taking a ``remat`` keyword gets the policies tried).
    Configs compile in a subprocess with ``devices`` simulated CPU devices; a
    factory compiles in this process and needs that many devices. The options are
    an :class:`AutoOptions`, or its fields as keywords (``auto("small", devices=8,
    batch=16, seq=16)``); keywords given with ``options`` replace its fields.
    Raises :class:`NothingFits` when no candidate fits.

    Args:
      model: a reference config name, a ``ReferenceConfig``, or a zero-argument
        factory of the model.
      options: an :class:`AutoOptions`; ``None`` builds one from ``knobs``.
      loss: with a model of your own, ``loss(model, batch) -> scalar``.
      batch_spec: with ``loss``, one step's global batch (a pytree of
        ``jax.ShapeDtypeStruct`` or ``"x=int32[16,128],..."`` text).
      aliases: the model's logical names mapped onto the presets'.
      **knobs: :class:`AutoOptions` fields, replacing those of ``options``.

    Returns:
      A :class:`Plan`: the fitting candidates ranked, the others with reasons.

    A model of the user's own (no ``forward``, no reference config) comes with
    ``loss(model, batch) -> scalar`` and ``batch_spec``, one step's global batch (a
    pytree of ``jax.ShapeDtypeStruct``, or ``"inputs=int32[16,128],..."`` text, see
    :class:`~nnx_shard.planner._user.UserModel`); ``batch`` and ``seq`` then come from
    it. ``aliases`` map the model's own logical names onto the presets'
    (:meth:`~nnx_shard.strategies.Strategy.with_rules`). Each candidate compiles
    :func:`~nnx_shard.planner._compile.compile_step` of that loss and batch::

        plan = auto(make_llama, loss=loss_fn, batch_spec="x=int32[16,128],y=int32[16,128]",
                    aliases={"fsdp": "embed", "tp": "mlp"}, devices=8)

    >>> from nnx_shard.planner import auto
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
    p = resolve(model, opts, user)
    if user is not None:
        user.check_names(p.abstract, p.names)
    candidates, viable, dropped, pruned = viable_candidates(p)
    search = Search(p, candidates, dropped, pruned)
    if p.cfg is None and opts.compile_fn is None and jax.device_count() < opts.devices:
        raise UsageError(
            f"auto: a model factory compiles in this process, which has "
            f"{jax.device_count()} devices, fewer than devices={opts.devices}. Fix: run with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={opts.devices} (CPU), or pass "
            "a config name / ReferenceConfig (compiled in a subprocess).")
    try:
        first = search.plain(viable)
        search.variants(first)
        search.offloaded(viable)  # only where nothing fits without
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

