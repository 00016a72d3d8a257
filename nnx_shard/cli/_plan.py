"""``nnx-shard plan``: what a model needs per device on a mesh, from the compiled
train step (a subprocess with that many simulated CPU devices) and a formula;
with ``--auto``, the planner's choice of strategy, mesh, remat and microbatches
(:mod:`nnx_shard.cli._plan_auto`). Nothing is allocated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import textwrap
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_shard import pipeline
from nnx_shard._axes import abstract_mesh, sizes_str
from nnx_shard._errors import CompileError, ShardingError, count, short
from nnx_shard._low_rank import DEFAULT_TARGETS, lora
from nnx_shard._parallel.schedule import OPTION as PIPELINE_OPTION
from nnx_shard._quantized import BLOCK, QUANT_TYPES
from nnx_shard._report import Report, fmt_bytes, spec_txt
from nnx_shard.cli._common import (
    COMPILE_MAX_DEVICES,
    PROG,
    UsageError,
    device_memory,
    mesh_sizes,
    optimizer,
    strategy,
)
from nnx_shard.cli._plan_auto import run_auto
from nnx_shard.inference import explain_cache
from nnx_shard.models._memory import ACTIVATION_FORMULA, activation_bytes
from nnx_shard.models._named import build, get_config, max_length
from nnx_shard.planner._compile import compiled_memory_subprocess, planned_config
from nnx_shard.planner._formula import (
    abstract_report,
    compute_copy,
    formula,
    grads_report,
    stage_config,
)
from nnx_shard.planner._trust import compiled_trusted
from nnx_shard.strategies._strategy import Strategy

__all__ = ["run", "run_generate"]

_DECIDES = {
    "compiled": (
        "* compiled: XLA's buffer assignment of the call Trainer.fit makes (two steps of "
        "value_and_grad of lm_loss + the optimizer update, and the NaN guard of --guard: "
        "under full, its copy of the state), compiled for this mesh on simulated CPU devices "
        "from abstract inputs (nothing allocated); total = arguments + temp + outputs - "
        "donated buffers. It decides whether the model fits: the formula can be off by more than "
        "15% ({ratio}here; over the presets and remat policies: docs/guides/planner.md), "
        "as it models neither XLA's temporaries nor how remat is scheduled. These are XLA "
        "CPU's figures: a GPU or TPU compile can differ (against published H100 runs: "
        "docs/benchmarks.md, 'Planned against published runs'; nnx_shard.planner._trust)."),
    "stage formula": (
        "* compiled, not trusted: {notice} Per-stage formula: the formula estimate with the "
        "activations of one stage's layers for every microbatch ({stage}) in place of "
        "every layer's: {need} (like the formula, a floor: leave headroom)."),
    "formula, offload": (
        "* offloaded: the compiled figure does not split device from host memory, so the "
        "formula's device total decides; it under-counts what XLA allocates (by how much "
        "over the presets and remat policies: docs/guides/planner.md): leave headroom."),
    "formula": (
        "* not compiled (--no-compile, or more than "
        f"{COMPILE_MAX_DEVICES} devices): the formula decides, and it under-counts what XLA "
        "allocates (by how much over the presets and remat policies: docs/guides/planner.md); "
        "leave headroom, or compile with --compile."),
}


def _count(n: int) -> str:
    """935040 -> '935,040'; 124_439_808 -> '124.4 M'; 6_720_000_000 -> '6.72 B'.

    >>> _count(935040), _count(124_439_808), _count(6_720_000_000)
    ('935,040', '124.4 M', '6.72 B')
    """
    if n < 1_000_000:
        return f"{n:,}"
    if n < 1_000_000_000:
        return f"{n / 1e6:.1f} M"
    return f"{n / 1e9:.2f} B"


@dataclasses.dataclass
class _Footprint:
    """The model's bytes on the mesh, as the formula knows them: its report, the
    pipeline stages (``None`` without a pipeline), the activations and the
    compute-dtype copy."""

    report: Report
    stages: Any
    activations: int
    compute: int = 0
    stage_activations: int | None = None  # one pipeline stage's layers, every microbatch
    streamed_activations: int | None = None  # streamed parameters' layer loop (remat full)


def _stage_report(model: Any, sizes: dict[str, int], strat: Strategy, tx: Any,
                  cfg: Any, batch: int, seq: int) -> Any:
    """Per-stage bytes under a pipeline strategy (``None`` otherwise), with as many
    microbatches as stages."""
    sched = strat.rules.options.get(PIPELINE_OPTION)
    if sched is None or sched.axis not in sizes:
        return None
    carry = jax.ShapeDtypeStruct((batch, seq, cfg.embed), jnp.dtype(cfg.dtype))
    return pipeline.stage_report(model, abstract_mesh(sizes), strat, tx, carry=carry,
                                 microbatches=sizes[sched.axis])


def _footprint(args: argparse.Namespace, model: Any, cfg: Any, strat: Strategy,
               sizes: dict[str, int], tx: Any) -> _Footprint:
    strat.check(model, sizes)
    wrt = nnx.LoRAParam if args.lora_rank is not None else nnx.Param
    report = abstract_report(model, sizes, strat.rules, tx, strat.opt_rules, wrt=wrt)
    stages = _stage_report(model, sizes, strat, tx, cfg, args.batch, args.seq)
    try:
        acts = activation_bytes(cfg, strat.rules, sizes, args.batch, args.seq, args.remat)
    except ShardingError as e:
        raise ShardingError(f"activations of --batch {args.batch} x --seq {args.seq}: {e}") from None
    # A stage keeps its own layers' activations for every microbatch of the step.
    per_stage = stage_config(cfg, strat, sizes)
    stage_acts = None if per_stage is None else activation_bytes(
        per_stage, strat.rules, sizes, args.batch, args.seq, args.remat)
    streamed = (activation_bytes(cfg, strat.rules, sizes, args.batch, args.seq, "full")
                if strat.offload == "optimizer+params" else None)
    return _Footprint(report, stages, acts, compute_copy(report, cfg.dtype, args.remat),
                      stage_acts, streamed)


def _compile(args: argparse.Namespace, strat: Strategy, sizes: dict[str, int],
             devices: int) -> dict[str, Any] | None:
    """XLA's figures of the train step on ``devices`` simulated devices, unless
    --no-compile or the mesh is past the bound (``None``)."""
    compile_it = args.compile if args.compile is not None else devices <= COMPILE_MAX_DEVICES
    if not compile_it or args.lora_rank is not None:  # the compiled step trains every Param
        return None
    try:
        return compiled_memory_subprocess(
            args.model, sizes, strategy=strat.name, optimizer=args.optimizer,
            batch=args.batch, seq=args.seq, remat=args.remat,
            scan_layers=args.scan_layers, guard=args.guard, timeout=args.compile_timeout,
            param_dtype=args.param_dtype, compute_dtype=args.compute_dtype)
    except CompileError as e:
        raise UsageError(str(e)) from None


def _stage_need(fp: _Footprint, per_device: dict[str, int]) -> int:
    """The per-stage formula's bytes per device: the formula's, with the activations
    of one stage's layers (for every microbatch) in place of every layer's."""
    assert fp.stage_activations is not None
    return int(per_device["total"] - per_device["activations"] + fp.stage_activations)


def _split(compiled: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """Whether ``compiled`` says its bytes in device memory apart from host memory (a
    compile of the offloaded step does; one of the step without offload does not)."""
    return compiled is not None and "device" in compiled and "host" in compiled


def _host(per_device: dict[str, int], compiled: dict[str, Any] | None,
          host_memory: int | None, out: dict[str, Any]) -> dict[str, Any]:
    """The plan's JSON fields of host offload: the host's bytes and their verdict, and
    whether the compiled figure splits device from host (``compiled_split``); under
    ``--offload`` the model fits only where both the device's and the host's do."""
    if out["offload"] is None:
        return {"host_bytes": None, "host_memory": None, "host_fits": None,
                "compiled_split": None}
    host = compiled["host"] if _split(compiled) else per_device["host"]
    host_fits = None if host_memory is None else host <= host_memory
    return {"host_bytes": host, "host_memory": host_memory, "host_fits": host_fits,
            "compiled_split": _split(compiled) if compiled is not None else None,
            "fits": False if host_fits is False else out["fits"]}


def _results(fp: _Footprint, per_device: dict[str, int], compiled: dict[str, Any] | None,
             memory: int | None, top: int, strat: Strategy) -> dict[str, Any]:
    """The plan's JSON fields past the request's: bytes, the verdict, the largest tensors.
    Under offload the device's bytes decide; a compiled figure that does not split them
    from the host's (the step compiled without offload) gives way to the formula's."""
    report = fp.report
    need = compiled["total"] if compiled is not None else per_device["total"]
    decided_by = "compiled" if compiled is not None else "formula"
    if strat.offload is not None and compiled is not None:
        if _split(compiled):
            need = compiled["device"]
        else:
            need, decided_by = per_device["total"], "formula, offload"
    trusted, notice = (compiled_trusted(strat, compiled.get("backend", "cpu"))
                       if compiled is not None else (True, None))
    if not trusted and fp.stages is not None:
        need, decided_by = _stage_need(fp, per_device), "stage formula"
    largest = sorted((r for r in report.rows if r.group == "params"),
                     key=lambda r: -r.bytes_per_device)[:top]
    return {
        "bytes_per_device": per_device,
        "compiled": compiled,
        "decided_by": decided_by,
        "compiled_trusted": trusted if compiled is not None else None,
        "notice": notice,
        "bytes_needed": need,
        "bytes_total": {"params": report.total_bytes, "optimizer": report.opt_total_bytes},
        "largest": [
            {"path": r.path, "shape": list(r.shape), "dtype": r.dtype,
             "spec": [None if x is None else x if isinstance(x, str) else list(x) for x in r.spec],
             "bytes_per_device": r.bytes_per_device}
            for r in largest
        ],
        "replicated_params": sum(1 for r in report.replicated if r.group == "params"),
        "stages": None if fp.stages is None else dataclasses.asdict(fp.stages),
        "stage_activations": fp.stage_activations,
        "activation_formula": ACTIVATION_FORMULA,
        "device_memory": memory,
        "fits": None if memory is None else need <= memory,
        "error": None,
    }


def _check(args: argparse.Namespace) -> Any:
    """The flags ``plan`` needs beyond the parser's; the config of ``--model`` as it is
    compiled (``--scan-layers``, ``--param-dtype``, ``--compute-dtype`` applied)."""
    if not args.mesh:
        raise UsageError("plan needs --mesh (e.g. data=8,model=8), or --auto --devices N to "
                         "choose one")
    if args.batch < 1 or args.seq < 1:
        raise UsageError("--batch and --seq must be at least 1. Fix: e.g. --batch 8 --seq 16")
    if args.top < 0:
        raise UsageError(f"--top must be 0 or more, got {args.top}. Fix: e.g. --top 5")
    # The planned model is the compiled one (pp needs a stack; the dtypes decide the bytes).
    cfg, _ = planned_config(args.model, scan_layers=args.scan_layers,
                            param_dtype=args.param_dtype, compute_dtype=args.compute_dtype)
    return dataclasses.replace(cfg, remat=get_config(args.model).remat)


def run(args: argparse.Namespace) -> int:
    """``nnx-shard plan``: exit 0 when the model fits (or no ``--device-memory``), 1 when
    it does not, 2 for bad input or a layout that cannot be (its error on stderr)."""
    if args.lora_rank is not None and (args.factory or args.auto or args.generate):
        raise UsageError("--lora-rank plans a reference --model's fine-tuning step; it does "
                         "not go with --auto, --generate or --factory. Fix: drop one of them")
    if args.factory or args.loss or args.batch_spec:  # the user's own model: the search
        return run_auto(args)
    if args.alias:
        raise UsageError("--alias maps your own model's names: it goes with --factory (for "
                         "a reference --model, drop it)")
    if args.model is None:
        raise UsageError("plan needs --model NAME (tiny, small, ...), or --factory mod:fn "
                         "--loss mod:fn --batch-spec ... for your own model")
    get_config(args.model)  # an unknown name is the usage error naming the known ones
    if args.auto:
        if args.offload is not None:
            raise UsageError("plan --auto turns offload on itself, only where nothing fits "
                             "without it: drop --offload (or drop --auto to plan one layout "
                             "with it)")
        return run_auto(args)  # which refuses --generate
    if args.generate and (args.offload is not None or args.host_memory is not None):
        raise UsageError("--offload and --host-memory plan a training step's state; drop "
                         "them with --generate")
    if args.generate:
        return run_generate(args)
    cfg = _check(args)
    strat = strategy(args.strategy)
    if args.offload is not None:
        strat = strat.with_offload(args.offload)
    sizes = mesh_sizes(args.mesh)
    if args.seq > max_length(cfg):
        raise UsageError(f"--seq {args.seq} is longer than model {args.model!r} allows "
                         f"({max_length(cfg)}). Fix: --seq {max_length(cfg)} or less")
    memory = device_memory(args.device_memory) if args.device_memory is not None else None
    host_memory = (device_memory(args.host_memory, "--host-memory")
                   if args.host_memory is not None else None)
    if host_memory is not None and strat.offload is None:
        raise UsageError("--host-memory checks what --offload keeps in host memory: add "
                         "--offload optimizer (or optimizer+params), or drop --host-memory")
    tx = optimizer(args.optimizer)
    model = _abstract_model(args, cfg, build)
    out: dict[str, Any] = {
        "model": args.model, "num_params": cfg.num_params, "strategy": strat.name,
        "offload": strat.offload,
        "mesh": sizes, "devices": math.prod(sizes.values()), "optimizer": args.optimizer,
        "guard": args.guard,
        "batch": args.batch, "seq": args.seq, "remat": args.remat,
        "scan_layers": cfg.scan_layers if args.scan_layers is None else args.scan_layers,
        "param_dtype": jnp.dtype(cfg.param_dtype).name,
        "compute_dtype": jnp.dtype(cfg.dtype).name,
        "lora_rank": args.lora_rank,
        "quantize_base": args.quantize_base,
        "quant_block": _quant_args(args).get("quant_block"),
        "double_quant": bool(args.double_quant),
    }
    try:
        fp = _footprint(args, model, cfg, strat, sizes, tx)
    except ShardingError as e:
        out["error"] = str(e)
        if args.json:
            print(json.dumps(out))
        else:
            print(f"{PROG} plan: {args.model} on {args.mesh} with {strat.name}: cannot lay out")
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    wrt = nnx.Param if args.lora_rank is None else nnx.LoRAParam
    per_device = formula(fp.report, fp.activations, args.guard, fp.compute,
                         trained=wrt.__name__, grads=grads_report(model, sizes, strat, wrt),
                         offload=strat.offload, tx=tx,
                         streamed_activations=fp.streamed_activations)
    compiled = _compile(args, strat, sizes, out["devices"])
    out.update(_results(fp, per_device, compiled, memory, args.top, strat))
    out.update(_host(per_device, compiled, host_memory, out))
    if args.json:
        print(json.dumps(out))
    else:
        _print_plan(args, cfg, out, fp)
    return 0 if out["fits"] in (None, True) else 1


# -- the text -------------------------------------------------------------------------------


def _print_bytes(out: dict[str, Any], report: Report) -> None:
    per_device, compiled = out["bytes_per_device"], out["compiled"]
    if compiled is not None:
        print("per device          compiled*   formula estimate")
        rows = [("params", compiled["params"], per_device["params"]),
                ("grads", None, per_device["grads"]),
                ("optimizer", compiled["optimizer"], per_device["optimizer"]),
                ("guard copy", None, per_device["guard"]),
                *([("compute copy", None, per_device["compute"])]
                  if "compute" in per_device else []),
                ("temp", compiled["temp"], None),
                ("activations", None, per_device["activations"])]
        if out.get("offload") is None:
            rows.append(("total", compiled["total"], per_device["total"]))
        else:
            split = _split(compiled)
            rows += [("streamed", None, per_device["streamed"]),
                     ("device total", compiled["device"] if split else compiled["total"],
                      per_device["total"]),
                     ("host total", compiled["host"] if split else "n/a", per_device["host"])]
        # Only guard="full" keeps a copy of the state (in XLA's temp); "grads" and "off" none.
        no_copy: tuple[str, ...] = ("total", "device total", "host total", "streamed")
        if out.get("guard") != "full":
            no_copy += ("guard copy",)
        for label, c, f in rows:
            ctxt = (c if isinstance(c, str) else fmt_bytes(c) if c is not None
                    else "(in temp)" if label not in no_copy else "")
            ftxt = fmt_bytes(f) if f is not None else ""
            print(f"  {label:<13} {ctxt:>12}   {ftxt:>12}")
        print(f"  (compiled in {compiled['compile_s']:.1f} s on {out['devices']} simulated CPU "
              "devices; total = arguments + temp + outputs - donated)")
    else:
        print("per device (formula estimate; not compiled):")
        keys: tuple[str, ...] = ("params", "grads", "optimizer", "guard", "compute",
                                 "activations", "total")
        if out.get("offload") is not None:
            keys = (*keys[:-1], "streamed", "total", "host")
        for key in keys:
            if key not in per_device:
                continue
            label = {"guard": "guard copy", "compute": "compute copy",
                     "total": "total" if out.get("offload") is None else "device total",
                     "host": "host total"}.get(key, key)
            print(f"  {label:<13} {fmt_bytes(per_device[key]):>12}")
    if out.get("offload") is not None:
        print(_offload_note(out))
    print(f"  (unsharded: params {fmt_bytes(report.total_bytes)}, optimizer state "
          f"{fmt_bytes(report.opt_total_bytes)})")
    print()


def _offload_note(out: dict[str, Any]) -> str:
    """What ``--offload`` keeps where, and how the compiled figure stands to it."""
    what = {"optimizer": "the optimizer state", "optimizer+params":
            "the optimizer state and the parameters"}[out["offload"]]
    text = (f"  offload {out['offload']}: {what} in host memory between steps (host total"
            + (", with the NaN guard's copy" if out.get("guard") == "full" else "")
            + "). Each step moves "
            + ("the parameters to the devices at its start and " if out["offload"] ==
               "optimizer+params" else "")
            + "the optimizer state once the gradients exist, whole (not layer by layer), "
            "and back at its end; device total = the larger of the step's phases, "
            "max(the parts less the host's"
            + (" with the parameters back" if out["offload"] == "optimizer+params" else "")
            + "; params + grads + optimizer state for the update)"
            + ("; the guard's check at the call's end holds the state before and after"
               if out.get("guard") == "full" else "")
            + "; streamed: what that phase adds over the bytes that never leave the device.")
    if out.get("compiled_split") is False:
        text += (" The compiled step does not split device from host bytes (its figure is "
                 "the step without offload, everything in device memory): the device/host split "
                 "of the compiled figure is not available, so the formula's device total "
                 "decides.")
    return textwrap.fill(text, width=100, subsequent_indent="  ")


def _print_rows(rows: Any) -> None:
    """Path, shape, spec and bytes per device of report rows, in aligned columns."""
    cols = [(r.path, str(r.shape), spec_txt(r.spec), fmt_bytes(r.bytes_per_device))
            for r in rows]
    widths = [max(len(c[i]) for c in cols) for i in range(4)] if cols else [0] * 4
    for c in cols:
        print("  " + "  ".join(f"{x:<{w}}" for x, w in zip(c[:3], widths, strict=False))
              + f"  {c[3]:>{widths[3]}}")


def _print_largest(out: dict[str, Any], report: Report, top: int) -> None:
    print(f"largest parameters per device (of {sum(1 for r in report.rows if r.group == 'params')}; "
          f"{out['replicated_params']} replicated):")
    largest = sorted((r for r in report.rows if r.group == "params"),
                     key=lambda r: -r.bytes_per_device)[:top]
    _print_rows(largest)
    print()


def _print_notes(args: argparse.Namespace, out: dict[str, Any], stages: Any) -> None:
    per_device, compiled = out["bytes_per_device"], out["compiled"]
    if stages is not None:
        print(f"per pipeline stage (microbatches = {stages.microbatches}, the stage count):")
        print(textwrap.indent(str(stages), "  "))
        print("  (the formula estimate above counts every layer's activations on every "
              "device; a stage keeps its own layers' for the microbatches in flight)\n")
    if compiled is not None and args.remat != "none" and not out["scan_layers"]:
        print(textwrap.fill(
            f"* remat {args.remat} with unrolled layers: on XLA CPU the compiled temp of "
            "unrolled blocks does not fall with remat (measured on small); --scan-layers "
            "compiles one scanned block, where remat lowers it.",
            width=100, subsequent_indent="  "))
    ratio = (f"formula / compiled = {per_device['total'] / compiled['total']:.2f} "
             if compiled is not None else "")
    print(textwrap.fill(_DECIDES[out["decided_by"]].format(
        ratio=ratio, notice=out.get("notice") or "",
        stage=fmt_bytes(out.get("stage_activations") or 0),
        need=fmt_bytes(out["bytes_needed"])), width=100, subsequent_indent="  "))
    print(textwrap.fill(f"* formula activations: {ACTIVATION_FORMULA}", width=100,
                        subsequent_indent="  "))
    memory = out["device_memory"]
    if memory is not None:
        verdict = "fits" if out["bytes_needed"] <= memory else "does NOT fit"
        print(f"\n{verdict} in {fmt_bytes(memory)} per device "
              f"({100 * out['bytes_needed'] / memory:.0f}% used, {out['decided_by']} total)")
        if out["bytes_needed"] > memory:
            print(textwrap.fill(_what_next(args, out), width=100, subsequent_indent="  "))
    host = out.get("host_memory")
    if host is not None:
        verdict = "fits" if out["host_fits"] else "does NOT fit"
        print(f"{'' if memory is not None else chr(10)}host: {verdict} in {fmt_bytes(host)} "
              f"of host memory per device ({100 * out['host_bytes'] / host:.0f}% used)")


def _what_next(args: argparse.Namespace, out: dict[str, Any]) -> str:
    """Where a user goes from a training plan that does not fit: the presets that shard
    more of the state, host offload, and the search over all of them."""
    return (
        "next: shard what this layout replicates: zero1 (the optimizer state 1/N per "
        "device), zero2 (and the gradients), fsdp (and the parameters), fsdp_tp / pp_fsdp "
        "past that, fsdp_ep for a mixture of experts; --offload optimizer keeps the "
        "optimizer state in host memory; or let the planner search them all: "
        f"{PROG} plan --auto --model {args.model} --devices {out['devices']} "
        f"--batch {args.batch} --seq {args.seq} --device-memory {args.device_memory}"
        + "".join(f" --{flag.replace('_', '-')} {getattr(args, flag)}"
                  for flag in ("param_dtype", "compute_dtype")
                  if getattr(args, flag, None) is not None)
        + " (docs: guides/memory.md).")


def _print_plan(args: argparse.Namespace, cfg: Any, out: dict[str, Any],
                fp: _Footprint) -> None:
    dtypes = (out["param_dtype"] if out["param_dtype"] == out["compute_dtype"] else
              f"{out['param_dtype']} master weights, {out['compute_dtype']} compute")
    print(f"plan: model {args.model} ({_count(cfg.num_params)} parameters, "
          f"{dtypes}), strategy {out['strategy']}, mesh {sizes_str(out['mesh'])} "
          f"({out['devices']} devices), {args.optimizer}, batch {args.batch} x seq {args.seq}, "
          f"remat {args.remat}, {'scanned' if out['scan_layers'] else 'unrolled'} layers, "
          f"guard {args.guard}")
    if args.lora_rank is not None:
        quant = ""
        if args.quantize_base:
            per = (f"a scale per {out['quant_block']} inputs" if out["quant_block"] else
                   "a scale per output channel")
            quant = (f", base stored {args.quantize_base} with {per}"
                     + (", scales in 8 bits" if out["double_quant"] else ""))
        print(f"LoRA rank {args.lora_rank} on {args.lora_targets or DEFAULT_TARGETS}{quant}: "
              "gradients and optimizer state for the adapters only (base frozen); "
              "formula figures (the compiled step would train every parameter)")
    print()
    _print_bytes(out, fp.report)
    _print_largest(out, fp.report, args.top)
    _print_notes(args, out, fp.stages)


# -- --generate -------------------------------------------------------------------------------


def run_generate(args: argparse.Namespace) -> int:
    """``nnx-shard plan --generate``: the bytes per device of generating ``--batch``
    sequences of ``--seq`` positions (prompt + new tokens) with
    :func:`nnx_shard.inference.generate`: the parameters in the strategy's layout and
    the key/value cache laid out by its rules (``cache_batch``, ``cache_length``,
    ``cache_kv_heads``, ``cache_head_dim``). Exit as :func:`run`.

    >>> from nnx_shard.cli import main
    >>> main(["plan", "--generate", "--model", "tiny", "--mesh", "data=2,model=4",
    ...       "--strategy", "tp", "--batch", "8", "--seq", "16", "--json"])  # doctest: +ELLIPSIS
    {"model": "tiny", ... "bytes_per_device": {"params": ..., "cache": 8276, "total": ...}, ...}
    0
    """
    cfg = _check(args)
    strat = strategy(args.strategy)
    sizes = mesh_sizes(args.mesh)
    if args.seq > max_length(cfg):
        raise UsageError(f"--seq {args.seq} is longer than model {args.model!r}'s context "
                         f"({max_length(cfg)}): prompt + new tokens must fit it. Fix: --seq "
                         f"{max_length(cfg)} or less")
    memory = device_memory(args.device_memory) if args.device_memory else None
    model = _abstract_model(args, cfg, build)
    out: dict[str, Any] = {
        "model": args.model, "num_params": cfg.num_params, "strategy": strat.name,
        "mesh": sizes, "devices": math.prod(sizes.values()), "generate": True,
        "batch": args.batch, "seq": args.seq, "param_dtype": jnp.dtype(cfg.param_dtype).name,
    }
    try:
        strat.check(model, sizes)
        params = abstract_report(model, sizes, strat.rules)
        cache = explain_cache(model, abstract_mesh(sizes), strat.rules, batch=args.batch,
                              length=args.seq)
    except ShardingError as e:
        out["error"] = str(e)
        if args.json:
            print(json.dumps(out))
        else:
            print(f"{PROG} plan --generate: {args.model} on {args.mesh} with {strat.name}: "
                  "cannot lay out")
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    per_device = {"params": params.param_bytes_per_device,
                  "cache": cache.param_bytes_per_device}
    per_device["total"] = per_device["params"] + per_device["cache"]
    out.update({
        "bytes_per_device": per_device,
        "bytes_total": {"params": params.total_bytes, "cache": cache.total_bytes},
        "cache": [{"path": r.path, "shape": list(r.shape), "dtype": r.dtype,
                   "spec": [None if x is None else x if isinstance(x, str) else list(x)
                            for x in r.spec],
                   "bytes_per_device": r.bytes_per_device} for r in cache.rows],
        "device_memory": memory,
        "fits": None if memory is None else per_device["total"] <= memory,
        "error": None,
    })
    if args.json:
        print(json.dumps(out))
        return 0 if out["fits"] in (None, True) else 1
    print(f"plan --generate: model {args.model} ({_count(cfg.num_params)} parameters, "
          f"{out['param_dtype']}), strategy {strat.name}, mesh {sizes_str(sizes)} "
          f"({out['devices']} devices), batch {args.batch} x {args.seq} positions "
          "(prompt + new tokens)")
    print()
    print("per device")
    for key in ("params", "cache", "total"):
        label = "key/value cache" if key == "cache" else key
        print(f"  {label:<16} {fmt_bytes(per_device[key]):>12}")
    print(f"  (unsharded: params {fmt_bytes(params.total_bytes)}, cache "
          f"{fmt_bytes(cache.total_bytes)})")
    print()
    arrays = [r for r in cache.rows if r.shape]
    print(f"cache arrays ({len(arrays)}; names cache_batch, cache_length, cache_kv_heads, "
          "cache_head_dim):")
    shown = arrays[:args.top]
    _print_rows(shown)
    if len(arrays) > len(shown):
        print(f"  ... and {len(arrays) - len(shown)} more alike")
    print()
    print(textwrap.fill(
        "* the cache's bytes per device are those the compiled prefill of "
        "nnx_shard.inference.generate outputs (XLA's memory_analysis; the decode loop updates "
        "the cache in place); the activations of one decode step and the prefill's are not "
        "counted.", width=100, subsequent_indent="  "))
    if memory is not None:
        verdict = "fits" if out["fits"] else "does NOT fit"
        print(f"\n{verdict} in {fmt_bytes(memory)} per device "
              f"({100 * per_device['total'] / memory:.0f}% used)")
    return 0 if out["fits"] in (None, True) else 1


def _abstract_model(args: argparse.Namespace, cfg: Any, build: Any) -> Any:
    """The planned model, abstract, with ``--lora-rank`` adapters when asked."""
    model = nnx.eval_shape(lambda: build(cfg, nnx.Rngs(0)))
    if args.lora_rank is not None:  # alpha only scales: it changes no byte
        count(args.lora_rank, "--lora-rank", fix="e.g. --lora-rank 16")
        try:
            lora(model, args.lora_rank, 2 * args.lora_rank,
                 targets=args.lora_targets or DEFAULT_TARGETS, **_quant_args(args))
        except UsageError as e:  # lora's argument names, as this command's flags
            text = str(e).replace("quant_block=None", "--quant-block none")
            raise UsageError(text.replace("quant_block=", "--quant-block ")) from None
    elif args.lora_targets is not None or args.quantize_base is not None:
        flag = "--lora-targets" if args.lora_targets is not None else "--quantize-base"
        raise UsageError(f"{flag} goes with --lora-rank. Fix: add e.g. --lora-rank 16")
    return model


def _quant_args(args: argparse.Namespace) -> dict[str, Any]:
    """``--quantize-base``, ``--quant-block`` and ``--double-quant`` as ``lora``'s
    ``quantize``, ``quant_block`` and ``double_quant``, each checked and named by its flag."""
    if args.quantize_base is None:
        if args.quant_block is not None or args.double_quant:
            flag = "--quant-block" if args.quant_block is not None else "--double-quant"
            raise UsageError(f"{flag} goes with --quantize-base. Fix: add e.g. "
                             "--quantize-base nf4")
        return {}
    accepted = ", ".join(QUANT_TYPES)
    if args.quantize_base not in QUANT_TYPES:
        raise UsageError(f"--quantize-base must be one of {accepted}, got "
                         f"{args.quantize_base!r}. Fix: --quantize-base nf4 (QLoRA's 4-bit "
                         "NormalFloat), or leave it out")
    block: int | None = BLOCK
    if args.quant_block is not None:
        text = str(args.quant_block).strip().lower()
        # ASCII digits only: str.isdigit() takes '²', which int() refuses, and a few
        # thousand digits are past what int() reads.
        digits = text.isascii() and text.isdigit() and len(text) <= 18
        block = None if text == "none" else int(text) if digits else 0
        if block == 0:
            raise UsageError(f"--quant-block must be a positive int or 'none', got "
                             f"{short(args.quant_block, 60)}. Fix: --quant-block 64 (QLoRA's), or "
                             "--quant-block none (one scale per output channel)")
    if args.double_quant and block is None:
        raise UsageError("--double-quant needs block scales, got --quant-block none. Fix: "
                         "--quant-block 64, or drop --double-quant")
    return {"quantize": args.quantize_base, "quant_block": block,
            "double_quant": args.double_quant}
