"""The formula's bytes per device: parameters, gradients, optimizer state, the NaN
guard's copy (``guard="full"`` only), the compute-dtype copy of the parameters
(mixed precision) and activations, from the sharding report of an abstract model
(no devices, no compile). ``nnx-shard plan`` prints it beside XLA's compiled
figure; the planner's search skips a compile when it alone is far over the memory.

Under a strategy's host offload (:attr:`nnx_shard.strategies.Strategy.offload`) the
formula splits its bytes: what is offloaded lives in host memory (``host``), and the
device holds everything else, plus the offloaded state where the step has moved it
in (:data:`ARRIVES`, :func:`offload_phases`): ``total`` is the device figure, the
larger of the step's phases, and ``streamed`` what that phase adds over the bytes
that never leave the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from nnx_shard._axes import abstract_mesh
from nnx_shard._mesh import parse_axes
from nnx_shard._report import Report, explain
from nnx_shard._rules import Rules
from nnx_shard._train._guard import DEFAULT_GUARD
from nnx_shard._train._stream import LAYERS, elementwise
from nnx_shard.models._memory import activation_bytes

__all__ = ["ARRIVES", "PRUNE_MARGIN", "abstract_report", "compute_copy", "formula",
           "formula_bytes", "formula_parts", "grads_report", "offload_phases", "offloaded_groups",
           "stage_config", "stage_formula_bytes", "streamed_param_bytes", "update_state_bytes"]

#: The formula decides "does not fit" without a compile only when it is this many
#: times over the budget: over every preset x mesh factorisation of 8 devices
#: (``benchmarks/formula_bound.py``) and the candidates ``plan --auto`` compiles for
#: Llama-3.1 8B and 70B shapes (``benchmarks/plan_time.py --floors``) the formula
#: stayed under it (the ratios: docs/guides/planner.md, "``nnx-shard plan --auto``").
#: tests/planner/test_planner.py
#: ::test_the_formula_prunes_only_what_xla_would_not_fit holds it under this margin.
PRUNE_MARGIN = 1.1

#: When each offloaded report group arrives on the device inside a step, as the fused
#: call moves it (``nnx_shard._offload``): ``"step"``, at the step's start (the
#: parameters: the forward pass reads them); ``"update"``, once the gradients exist
#: (the optimizer state: an ``optimization_barrier`` ties its host-to-device copy to
#: the gradients). Each group goes back to host memory at the step's end. The
#: parameters move whole; the optimizer state moves whole too unless the update streams
#: it a layer at a time (:func:`update_state_bytes`). :func:`offload_phases` counts by it.
ARRIVES = {"params": "step", "optimizer": "update"}


def _stacked(row: Any) -> bool:
    return bool(row.names) and row.names[0] == LAYERS and len(row.shape) >= 1


def _two_layers(rows: Any) -> int:
    """What a loop streaming the stacked ``rows`` a layer at a time holds on the device:
    the rows that are not stacked whole, two layers of each stacked one (the slice moved
    in and the next, or the new one going back)."""
    return int(sum(2 * r.bytes_per_device // r.shape[0] if _stacked(r) else r.bytes_per_device
                   for r in rows))


def update_state_bytes(report: Report, tx: Any) -> int | None:
    """The optimizer state's device bytes per device an offloaded update holds at once
    where it streams the stacked layers (``Trainer``'s steps do for an element-wise
    optimizer, :func:`nnx_shard._train._stream.elementwise`): the leaves that are not
    stacked whole, plus two layers' worth of each stacked leaf (the slice moved in and
    the new one going back). ``None`` where the update moves the whole state (no
    ``tx``, an optimizer that is not element-wise, no stacked leaf, layers split over
    devices as a pipeline's stages are).

    >>> import dataclasses, optax
    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, get_config
    >>> from nnx_shard.strategies._presets import get
    >>> cfg = dataclasses.replace(get_config("tiny"), scan_layers=True, layers=4)
    >>> model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    >>> report = abstract_report(model, {"data": 8}, get("fsdp").rules, optax.adamw(1e-3))
    >>> update_state_bytes(report, optax.adamw(1e-3)) < report.opt_bytes_per_device
    True
    >>> clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    >>> update_state_bytes(report, clipped) is None
    True
    """
    rows = [r for r in report.rows if r.group == "optimizer"]
    stacked = [r for r in rows if _stacked(r)]
    if tx is None or not stacked or not elementwise(tx):
        return None
    if any(len(r.spec) and r.spec[0] is not None for r in stacked):
        return None  # the layers split over devices (a pipeline): the update moves it whole
    return _two_layers(rows)


def abstract_report(model: Any, sizes: str | Mapping[str, int], rules: Rules, tx: Any = None,
                    opt_rules: Rules | None = None, wrt: Any = nnx.Param) -> Report:
    """:func:`nnx_shard.explain` on an ``AbstractMesh``: any device count, no devices needed.

    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, get_config
    >>> model = nnx.eval_shape(lambda: Decoder(get_config("tiny"), rngs=nnx.Rngs(0)))
    >>> from nnx_shard.strategies._strategy import REPLICATED
    >>> r = abstract_report(model, {"data": 4096}, REPLICATED | {"batch": "data"})  # no devices
    >>> r.param_bytes_per_device == r.total_bytes  # dp: replicated
    True
    """
    mesh = abstract_mesh(parse_axes(sizes, rest=False))
    return explain(model, mesh, rules, tx, wrt=wrt, opt_rules=opt_rules)


def compute_copy(report: Report, compute_dtype: Any, remat: str = "none") -> int:
    """Bytes per device of the parameters' copy in the compute dtype, which mixed
    precision (float32 master weights read in bfloat16: :class:`nnx_shard.Precision`,
    or a reference model with ``param_dtype`` != ``dtype``) adds: each float
    parameter not stored in ``compute_dtype``, at its per-device size, re-counted at
    the compute dtype's width. Without rematerialization the backward pass needs
    every layer's cast weights, so they are counted as kept through the step; with a
    remat policy (``full``, ``dots``, ``offload``) the cast, done where the weight
    is used, is redone in the backward pass and nothing is kept (0).

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> model = nnx.eval_shape(lambda: nnx.Linear(8, 4, rngs=nnx.Rngs(0)))   # 36 float32
    >>> report = abstract_report(model, {"data": 2}, Rules({}))
    >>> compute_copy(report, jnp.bfloat16), compute_copy(report, jnp.float32)
    (72, 0)
    >>> compute_copy(report, jnp.bfloat16, remat="full")
    0
    """
    if remat != "none":
        return 0
    compute = jnp.dtype(compute_dtype)
    total = 0
    for r in report.rows:
        dt = jnp.dtype(r.dtype)
        if (r.group == "params" and r.kind == "Param" and jnp.issubdtype(dt, jnp.floating)
                and dt != compute):
            total += r.bytes_per_device // dt.itemsize * compute.itemsize
    return int(total)


def offloaded_groups(offload: str | None) -> tuple[str, ...]:
    """The report groups ``offload`` (:data:`nnx_shard.strategies._strategy.OFFLOADS`)
    keeps in host memory between steps.

    >>> offloaded_groups(None), offloaded_groups("optimizer"), offloaded_groups("optimizer+params")
    ((), ('optimizer',), ('params', 'optimizer'))
    """
    return {None: (), "optimizer": ("optimizer",),
            "optimizer+params": ("params", "optimizer")}[offload]


def offload_phases(parts: Mapping[str, int], offload: str | None,
                   guard: str = DEFAULT_GUARD, streamed: int | None = None) -> dict[str, int]:
    """Device bytes per device in each phase of an offloaded step, from :func:`formula`'s
    ``parts`` (the state's bytes wherever it lives; ``total`` their sum):

    * ``host``: the offloaded state and, under ``guard="full"``, its copy (the call's
      input, which stays in host memory);
    * ``kept``: what never leaves the device (the parts less ``host``);
    * ``forward``: the forward and backward passes: ``kept`` plus the groups that
      arrive at the step's start (:data:`ARRIVES`: the parameters);
    * ``update``: the optimizer update: ``forward`` less the activations and the
      compute copy (freed by then) plus the groups that arrive for it (the optimizer
      state; ``streamed`` of it where the update streams the layers,
      :func:`update_state_bytes`).

    The NaN guard's check at the end of a call reads offloaded state where it lives
    (a stacked leaf a layer at a time) and, under ``guard="full"``, keeps or puts
    back the state from before the call in host memory: it holds no more than
    ``update``, so it is no phase of its own.

    >>> parts = {"params": 100, "grads": 100, "optimizer": 200, "guard": 0,
    ...          "activations": 500, "total": 900}
    >>> offload_phases(parts, "optimizer")   # the optimizer state arrives after the backward pass
    {'host': 200, 'kept': 700, 'forward': 700, 'update': 400}
    >>> offload_phases(parts, "optimizer+params")["forward"]   # the parameters at step start
    700
    >>> offload_phases(parts, "optimizer", streamed=50)["update"]   # a layer at a time
    250
    """
    groups = offloaded_groups(offload)
    host = sum(parts[g] for g in groups) * (2 if guard == "full" else 1)
    kept = parts["total"] - host
    forward = kept + sum(parts[g] for g in groups if ARRIVES[g] == "step")
    arriving = {**parts, "optimizer": parts["optimizer"] if streamed is None else streamed}
    update = (forward - parts["activations"] - parts.get("compute", 0)
              + sum(arriving[g] for g in groups if ARRIVES[g] == "update"))
    return {"host": int(host), "kept": int(kept), "forward": int(forward),
            "update": int(update)}


def streamed_param_bytes(report: Report, grad_sizes: Mapping[Any, int],
                         stacked_grads: set[Any]) -> dict[str, int] | None:
    """The device bytes per device of streamed parameters (``offload="optimizer+params"``
    with a streaming update, ``nnx_shard._train._stream.streams_params``): ``params``,
    the parameters that are not stacked whole plus two layers' worth of each stacked
    one (the slice moved in, and the next one, or the new one going back);
    ``grads``, their gradients alike (``grad_sizes`` by ``(path, shape)``, those in
    ``stacked_grads`` stacked); ``host_grads``, the stacked gradients, which come back
    to host memory. ``None`` without a stacked parameter.

    >>> from nnx_shard.models import Decoder, ReferenceConfig
    >>> from nnx_shard.strategies import get
    >>> stacked = ReferenceConfig(layers=4, scan_layers=True)
    >>> model = nnx.eval_shape(lambda: Decoder(stacked, rngs=nnx.Rngs(0)))
    >>> report = abstract_report(model, {"data": 8}, get("fsdp").rules)
    >>> rows = [r for r in report.rows if r.group == "params"]
    >>> sizes = {(r.path, r.shape): r.bytes_per_device for r in rows}
    >>> out = streamed_param_bytes(report, sizes, {(r.path, r.shape) for r in rows
    ...                                            if r.names and r.names[0] == "layers"})
    >>> out["params"] < report.param_bytes_per_device, out["host_grads"] > 0
    (True, True)
    """
    rows = [r for r in report.rows if r.group == "params" and r.kind == "Param"]
    if not any(_stacked(r) for r in rows):
        return None
    params = _two_layers(rows)
    grads = host = 0
    for key, size in grad_sizes.items():
        if key in stacked_grads:
            grads += 2 * size // key[1][0]
            host += size
        else:
            grads += size
    return {"params": int(params), "grads": int(grads), "host_grads": int(host)}


def _streamed_params_phases(parts: Mapping[str, int], phases: Mapping[str, int],
                            stream: Mapping[str, int], state: int,
                            activations: int | None) -> dict[str, int]:
    """:func:`offload_phases` of ``"optimizer+params"`` where the parameters stream
    (:func:`streamed_param_bytes`'s ``stream``; ``state`` the streamed update's state
    bytes; ``activations`` what the layer loop keeps, ``parts``' own where None)."""
    acts = parts["activations"] if activations is None else min(activations,
                                                                 parts["activations"])
    host = phases["host"] + stream["host_grads"]
    # What never leaves the device: the parts less the offloaded state and the stacked
    # gradients, the loop's activations in place of the parts'.
    kept = phases["kept"] - stream["host_grads"] - parts["activations"] + acts
    grads_kept = parts["grads"] - stream["host_grads"]
    forward = kept + stream["params"] - grads_kept + stream["grads"]
    update = (kept - acts - parts.get("compute", 0) + stream["params"] - grads_kept
              + stream["grads"] + state)
    return {"host": int(host), "kept": int(kept), "forward": int(forward),
            "update": int(update)}


def formula(report: Report, activations: int, guard: str = DEFAULT_GUARD,
            compute: int = 0, trained: str = "Param", grads: Report | None = None,
            offload: str | None = None, tx: Any = None, microbatches: int = 1,
            streamed_activations: int | None = None) -> dict[str, int]:
    """The formula's bytes per device: parameters, their gradients, optimizer state,
    the copy of parameters and optimizer state ``Trainer.fit``'s NaN guard keeps
    while a call runs (``guard="full"``, to put it back if the call is not finite;
    ``"grads"`` and ``"off"`` keep none), activations, and their ``total``; with
    ``compute`` (:func:`compute_copy`, mixed precision) that copy too, as ``compute``.
    ``trained`` is the Variable kind that gets gradients (``"LoRAParam"`` when only
    adapters are trained: the frozen base has none). ``grads`` is the model laid out by
    the strategy's ``gradients`` option where it sets one (:func:`grads_report`:
    zero1 keeps whole gradients, zero2 each device's slice); without it a gradient
    takes the smaller of its parameter's and its optimizer moment's layout, as XLA's
    sharding propagation places it.

    With ``offload`` (``"optimizer"`` or ``"optimizer+params"``) the parts stay the
    state's bytes, wherever they live, and two are added: ``host``, the offloaded
    state (and under ``guard="full"`` its copy) in host memory, and ``streamed``, what
    the step's largest phase (:func:`offload_phases`) holds over the bytes that never
    leave the device; ``total`` is then the device's: the largest phase, ``max``(the
    parts less the host's, with the offloaded parameters back; parameters + gradients
    + the optimizer state moved in for the update: all of it, or with ``tx`` an
    element-wise optimizer of a model with stacked layers, :func:`update_state_bytes`).
    With ``"optimizer+params"``, such an update, one microbatch (``microbatches``) and
    no ``gradients`` layout option, the stacked parameters stream as well
    (:func:`streamed_param_bytes`): the device holds two layers of them and of their
    gradients, the stacked gradients come back to host memory (``host`` counts them),
    and the layer loop keeps only each layer's input, as ``remat="full"`` does:
    ``streamed_activations`` (those activations) replaces ``activations`` there.

    >>> from flax import nnx
    >>> model = nnx.eval_shape(lambda: nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
    >>> report = abstract_report(model, {"data": 2}, Rules({}))
    >>> formula(report, 100)
    {'params': 144, 'grads': 144, 'optimizer': 0, 'guard': 0, 'activations': 100, 'total': 388}
    >>> formula(report, 100, guard="full")["guard"]
    144
    >>> formula(report, 100, compute=72)["total"]
    460
    >>> import optax
    >>> report = abstract_report(model, {"data": 2}, Rules({}), optax.adam(0.1))  # 2 moments
    >>> off = formula(report, 100, offload="optimizer")
    >>> off["optimizer"], off["host"], off["streamed"], off["total"]  # the moments on the host
    (292, 292, 192, 580)
    """
    # A gradient takes the layout of the optimizer moment it updates where that is
    # smaller (ZeRO-1's sharded state): XLA reduce-scatters it straight into the
    # sharded update instead of keeping the replicated sum.
    sizes = {(r.path, r.shape): r.bytes_per_device for r in (grads or report).rows
             if r.group == "params" and r.kind == trained}
    stacked_grads = {(r.path, r.shape) for r in (grads or report).rows
                     if r.group == "params" and r.kind == trained and _stacked(r)}
    for r in report.rows if grads is None else ():
        if r.group == "optimizer" and r.kind == trained:
            names = r.path.split("/")
            for key in (("/".join(names[i:]), r.shape) for i in range(1, len(names))):
                if key in sizes:
                    sizes[key] = min(sizes[key], r.bytes_per_device)
                    break
    parts = {
        "params": int(report.param_bytes_per_device),
        "grads": int(sum(sizes.values())),
        "optimizer": int(report.opt_bytes_per_device),
        "guard": (int(report.param_bytes_per_device + report.opt_bytes_per_device)
                  if guard == "full" else 0),
        "activations": int(activations),
    }
    if compute:
        parts["compute"] = int(compute)
    out = {**parts, "total": sum(parts.values())}
    if offload is not None:
        streamed_state = update_state_bytes(report, tx)
        phases = offload_phases(out, offload, guard, streamed_state)
        stream = (streamed_param_bytes(report, sizes, stacked_grads)
                  if offload == "optimizer+params" and microbatches == 1 and grads is None
                  else None)
        if stream is not None and streamed_state is not None:
            phases = _streamed_params_phases(out, phases, stream, streamed_state,
                                             streamed_activations)
        device = max(phases["forward"], phases["update"])
        out["streamed"] = device - phases["kept"]
        out["total"], out["host"] = device, phases["host"]
    return out


def grads_report(model: Any, sizes: str | Mapping[str, int], strat: Any,
                 wrt: Any = nnx.Param) -> Report | None:
    """``model``'s parameters laid out as the gradients of a train step under ``strat``
    are, where its rules set the ``gradients`` option (``None`` where they do not):
    what :func:`formula` counts the gradients on.

    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, get_config
    >>> from nnx_shard.strategies._presets import get
    >>> model = nnx.eval_shape(lambda: Decoder(get_config("tiny"), rngs=nnx.Rngs(0)))
    >>> z1, z2 = (grads_report(model, {"data": 8}, get(n)) for n in ("zero1", "zero2"))
    >>> z1.param_bytes_per_device > 4 * z2.param_bytes_per_device
    True
    >>> grads_report(model, {"data": 8}, get("dp")) is None
    True
    """
    table = strat.rules.options.get("gradients")
    return None if table is None else abstract_report(model, sizes, table, wrt=wrt)


def formula_bytes(abstract: Any, cfg: Any, strat: Any, sizes: dict[str, int], tx: Any,
                  batch: int, seq: int, remat: str, guard: str = DEFAULT_GUARD,
                  microbatches: int = 1) -> int | None:
    """``nnx-shard plan``'s formula total for ``abstract`` under preset ``strat`` (the
    activations of reference config ``cfg``, none without one); ``None`` where it
    cannot be computed (the compile will say what is wrong). The search skips a
    compile only past :data:`PRUNE_MARGIN` times the memory.
    """
    # The formula counts dots (and offload) as no remat, but with scanned layers XLA
    # keeps only the saved matmul outputs, so the dots formula overshoots its compiled
    # total (docs/guides/planner.md). Dots keeps at least what full remat keeps, so the full formula is a floor
    # that cannot prune a dots layout that fits.
    remat = "full" if remat in ("dots", "offload") else remat
    parts = formula_parts(abstract, cfg, strat, sizes, tx, batch, seq, remat, guard,
                          microbatches)
    return None if parts is None else parts["total"]


def formula_parts(abstract: Any, cfg: Any, strat: Any, sizes: dict[str, int], tx: Any,
                  batch: int, seq: int, remat: str, guard: str = DEFAULT_GUARD,
                  microbatches: int = 1) -> dict[str, int] | None:
    """:func:`formula`'s parts for ``abstract`` under ``strat`` (with its
    :attr:`~nnx_shard.strategies.Strategy.offload`: ``total`` is the device's, ``host``
    the host's), remat counted as given, ``batch`` one microbatch's of ``microbatches``;
    ``None`` where it cannot be computed.

    >>> from flax import nnx
    >>> import dataclasses
    >>> from nnx_shard.models import Decoder, get_config
    >>> import optax
    >>> from nnx_shard.strategies._presets import get
    >>> cfg = dataclasses.replace(get_config("tiny"), scan_layers=True)
    >>> model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    >>> args = ({"data": 2}, optax.adamw(1e-3), 8, 16, "none")
    >>> plain = formula_parts(model, cfg, get("fsdp"), *args)
    >>> off = formula_parts(model, cfg, get("fsdp").with_offload("optimizer"), *args)
    >>> off["host"] == plain["optimizer"], off["total"] < plain["total"]
    (True, True)
    """
    return _parts(abstract, cfg, cfg, strat, sizes, tx, batch, seq, remat, guard, microbatches)


def stage_config(cfg: Any, strat: Any, sizes: dict[str, int]) -> Any:
    """Reference config ``cfg`` with the layers one stage of ``strat``'s pipeline holds
    on mesh ``sizes`` (``None`` without a pipeline over an axis of ``sizes``): what a
    stage's activations are counted on.

    >>> import dataclasses
    >>> from nnx_shard.models import get_config
    >>> from nnx_shard.strategies._presets import get
    >>> cfg = dataclasses.replace(get_config("tiny"), scan_layers=True)   # 2 layers
    >>> stage_config(cfg, get("pp"), {"stage": 2, "data": 4}).layers
    1
    >>> stage_config(cfg, get("fsdp"), {"data": 8}) is None
    True
    """
    sched = strat.rules.options.get("pipeline")
    if sched is None or sched.axis not in sizes:
        return None
    return dataclasses.replace(cfg, layers=max(1, cfg.layers // sizes[sched.axis]))


def stage_formula_bytes(abstract: Any, cfg: Any, strat: Any, sizes: dict[str, int], tx: Any,
                        batch: int, seq: int, remat: str,
                        guard: str = DEFAULT_GUARD) -> int | None:
    """The per-stage formula of a pipeline (the trusted figure where XLA CPU's is an
    upper bound, :mod:`nnx_shard.planner._trust`): the parameters, gradients and
    optimizer state of ``abstract`` laid out by ``strat`` (a stage's share of the layer
    stack), and the activations of one stage's layers (:func:`stage_config`) for the
    step's whole ``batch`` (every microbatch is in flight); ``dots`` counted as no
    remat, as :func:`nnx_shard.models._memory.activation_bytes` does. ``None`` without a
    pipeline, or where it cannot be computed.

    >>> from flax import nnx
    >>> import dataclasses
    >>> from nnx_shard.models import Decoder, get_config
    >>> from nnx_shard.strategies._presets import get
    >>> cfg = dataclasses.replace(get_config("tiny"), scan_layers=True)
    >>> model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    >>> stage = stage_formula_bytes(model, cfg, get("pp"), {"stage": 2, "data": 4},
    ...                             None, 8, 16, "none")
    >>> stage < formula_bytes(model, cfg, get("pp"), {"stage": 2, "data": 4}, None, 8, 16,
    ...                       "none")
    True
    """
    stage_cfg = stage_config(cfg, strat, sizes)
    if stage_cfg is None:
        return None
    parts = _parts(abstract, cfg, stage_cfg, strat, sizes, tx, batch, seq, remat, guard)
    return None if parts is None else parts["total"]


def _parts(abstract: Any, cfg: Any, acts_cfg: Any, strat: Any, sizes: dict[str, int],
           tx: Any, batch: int, seq: int, remat: str, guard: str,
           microbatches: int = 1) -> dict[str, int] | None:
    """:func:`formula`'s parts, activations counted on ``acts_cfg`` (none without
    ``cfg``), offloaded as ``strat`` says."""
    offload = getattr(strat, "offload", None)
    try:
        report = abstract_report(abstract, sizes, strat.rules, tx, strat.opt_rules)
        acts = activation_bytes(acts_cfg, strat.rules, sizes, batch, seq, remat) if cfg else 0
        # Streamed parameters: the layer loop keeps each layer's input only.
        streamed_acts = (activation_bytes(acts_cfg, strat.rules, sizes, batch, seq, "full")
                         if cfg and offload == "optimizer+params" else None)
    except Exception:  # the compile will say what is wrong
        return None
    compute = compute_copy(report, cfg.dtype, remat) if cfg else 0
    return formula(report, acts, guard, compute, grads=grads_report(abstract, sizes, strat),
                   offload=offload, tx=tx, microbatches=microbatches,
                   streamed_activations=streamed_acts)
