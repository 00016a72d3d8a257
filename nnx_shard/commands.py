"""``nnx-shard plan`` and ``nnx-shard explain``: what a model needs per device
on a mesh, from the compiled train step (a subprocess with that many simulated
CPU devices) and a formula, and the per-parameter report of a user's model
factory. Nothing is allocated.

The command line (flags, errors) is :mod:`nnx_shard.cli`'s; this module runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

from nnx_shard.axes import abstract_mesh, sizes_str
from nnx_shard.cli import (
    _DEBUG_HINT,
    COMPILE_MAX_DEVICES,
    PROG,
    _mesh_sizes,
    _optimizer,
    _parse_bytes,
    _strategy,
    _Usage,
)
from nnx_shard.models.memory import ACTIVATION_FORMULA, activation_bytes

__all__ = []

def _fmt(n: float) -> str:
    from nnx_shard.report import fmt_bytes

    return fmt_bytes(n)


def _report(model: Any, sizes: dict[str, int], rules: Any, tx: Any = None,
            opt_rules: Any = None) -> Any:
    """:func:`nnx_shard.explain` on an ``AbstractMesh``: any device count, no devices needed."""
    from nnx_shard.report import explain

    return explain(model, abstract_mesh(sizes), rules, tx, opt_rules=opt_rules)


def _formula(report: Any, activations: int) -> dict[str, int]:
    """The formula's bytes per device: parameters, their gradients, optimizer state,
    the copy of parameters and optimizer state ``Trainer.fit``'s NaN guard keeps
    while a call runs (to put it back if the call is not finite), activations."""
    # A gradient takes the layout of the optimizer moment it updates where that is
    # smaller (ZeRO-1's sharded state): XLA reduce-scatters it straight into the
    # sharded update instead of keeping the replicated sum.
    grads = {(r.path, r.shape): r.bytes_per_device for r in report.rows
             if r.group == "params" and r.kind == "Param"}
    for r in report.rows:
        if r.group == "optimizer" and r.kind == "Param":
            names = r.path.split("/")
            for key in (("/".join(names[i:]), r.shape) for i in range(1, len(names))):
                if key in grads:
                    grads[key] = min(grads[key], r.bytes_per_device)
                    break
    parts = {
        "params": int(report.param_bytes_per_device),
        "grads": int(sum(grads.values())),
        "optimizer": int(report.opt_bytes_per_device),
        "guard": int(report.param_bytes_per_device + report.opt_bytes_per_device),
        "activations": int(activations),
    }
    return {**parts, "total": sum(parts.values())}


def _stage_report(model: Any, sizes: dict[str, int], strategy: Any, tx: Any, cfg: Any,
                  batch: int, seq: int) -> Any:
    """Per-stage bytes under a pipeline strategy (``None`` otherwise), with as many
    microbatches as stages."""
    import jax
    import jax.numpy as jnp

    from nnx_shard import pipeline

    sched = strategy.rules.options.get(pipeline.OPTION)
    if sched is None or sched.axis not in sizes:
        return None
    carry = jax.ShapeDtypeStruct((batch, seq, cfg.embed), jnp.dtype(cfg.dtype))
    return pipeline.explain(model, abstract_mesh(sizes), strategy, tx, carry=carry,
                            microbatches=sizes[sched.axis])


# Meshes up to this many devices are compiled by default (a 256-device compile of
# the small models takes seconds; larger ones grow with the device count).


_DECIDES = {
    "compiled": (
        "* compiled: XLA's buffer assignment of the call Trainer.fit makes (two steps of "
        "value_and_grad of lm_loss + the optimizer update, and the NaN guard's copy of the "
        "state), compiled for this mesh on simulated CPU devices "
        "from abstract inputs (nothing allocated); total = arguments + temp + outputs - "
        "donated buffers. It decides whether the model fits: the formula is off by more than "
        "15% ({ratio}here; 0.33-0.93 over the presets, remat policies and meshes measured), "
        "as it models neither XLA's temporaries nor how remat is scheduled. These are XLA "
        "CPU's figures: a GPU or TPU compile can differ."),
    "formula": (
        "* not compiled (--no-compile, or more than "
        f"{COMPILE_MAX_DEVICES} devices): the formula decides, and it under-counts what XLA "
        "allocates (0.33-0.93 of the compiled total over the presets, remat policies and "
        "meshes measured); leave headroom, or compile with --compile."),
}


def _count(n: int) -> str:
    """935040 -> '935,040'; 124_439_808 -> '124.4 M'; 6_720_000_000 -> '6.72 B'."""
    if n < 1_000_000:
        return f"{n:,}"
    if n < 1_000_000_000:
        return f"{n / 1e6:.1f} M"
    return f"{n / 1e9:.2f} B"


def _plan(args: argparse.Namespace) -> int:
    import jax.numpy as jnp
    from flax import nnx

    from nnx_shard.errors import ShardingError
    from nnx_shard.models import CONFIGS, Transformer

    if args.model not in CONFIGS:
        raise _Usage(f"unknown model {args.model!r}; known: {', '.join(CONFIGS)}")
    if args.auto:
        from nnx_shard.planner import run_cli

        return run_cli(args)
    if not args.mesh:
        raise _Usage("plan needs --mesh (e.g. data=8,model=8), or --auto --devices N to "
                     "choose one")
    if args.batch < 1 or args.seq < 1:
        raise _Usage("--batch and --seq must be at least 1")
    cfg = CONFIGS[args.model]
    if args.scan_layers is not None:  # the planned model is the compiled one (pp needs a stack)
        cfg = dataclasses.replace(cfg, scan_layers=args.scan_layers)
    strategy = _strategy(args.strategy)
    sizes = _mesh_sizes(args.mesh)
    if args.seq > cfg.length:
        raise _Usage(f"--seq {args.seq} is longer than model {args.model!r} allows ({cfg.length})")
    device_memory = _parse_bytes(args.device_memory) if args.device_memory else None
    tx = _optimizer(args.optimizer)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    out: dict[str, Any] = {
        "model": args.model, "num_params": cfg.num_params, "strategy": strategy.name,
        "mesh": sizes, "devices": math.prod(sizes.values()), "optimizer": args.optimizer,
        "batch": args.batch, "seq": args.seq, "remat": args.remat,
        "scan_layers": cfg.scan_layers if args.scan_layers is None else args.scan_layers,
        "param_dtype": jnp.dtype(cfg.param_dtype).name,
    }
    try:
        strategy.check(model, sizes)
        report = _report(model, sizes, strategy.rules, tx, strategy.opt_rules)
        stages = _stage_report(model, sizes, strategy, tx, cfg, args.batch, args.seq)
        try:
            acts = activation_bytes(cfg, strategy.rules, sizes, args.batch, args.seq, args.remat)
        except ShardingError as e:
            raise ShardingError(f"activations of --batch {args.batch} x --seq {args.seq}: {e}") from None
    except ShardingError as e:
        out["error"] = str(e)
        if args.json:
            print(json.dumps(out))
        else:
            print(f"{PROG} plan: {args.model} on {args.mesh} with {strategy.name}: cannot lay out")
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    per_device = _formula(report, acts)
    devices = out["devices"]
    compile_it = args.compile if args.compile is not None else devices <= COMPILE_MAX_DEVICES
    compiled = None
    if compile_it:
        from nnx_shard.compiled import CompileError, compiled_memory_subprocess

        try:
            compiled = compiled_memory_subprocess(
                args.model, sizes, strategy=strategy.name, optimizer=args.optimizer,
                batch=args.batch, seq=args.seq, remat=args.remat,
                scan_layers=args.scan_layers, timeout=args.compile_timeout)
        except CompileError as e:
            raise _Usage(str(e)) from None
    decided_by = "compiled" if compiled is not None else "formula"
    need = compiled["total"] if compiled is not None else per_device["total"]
    largest = sorted((r for r in report.rows if r.group == "params"),
                     key=lambda r: -r.bytes_per_device)[: args.top]
    out.update({
        "bytes_per_device": per_device,
        "compiled": compiled,
        "decided_by": decided_by,
        "bytes_needed": need,
        "bytes_total": {"params": report.total_bytes, "optimizer": report.opt_total_bytes},
        "largest": [
            {"path": r.path, "shape": list(r.shape), "dtype": r.dtype,
             "spec": [None if x is None else x if isinstance(x, str) else list(x) for x in r.spec],
             "bytes_per_device": r.bytes_per_device}
            for r in largest
        ],
        "replicated_params": sum(1 for r in report.replicated if r.group == "params"),
        "stages": None if stages is None else dataclasses.asdict(stages),
        "activation_formula": ACTIVATION_FORMULA,
        "device_memory": device_memory,
        "fits": None if device_memory is None else need <= device_memory,
        "error": None,
    })
    if args.json:
        print(json.dumps(out))
    else:
        print(f"plan: model {args.model} ({_count(cfg.num_params)} parameters, "
              f"{out['param_dtype']}), strategy {strategy.name}, mesh {sizes_str(sizes)} "
              f"({devices} devices), {args.optimizer}, batch {args.batch} x seq {args.seq}, "
              f"remat {args.remat}, {'scanned' if out['scan_layers'] else 'unrolled'} layers")
        print()
        if compiled is not None:
            print("per device          compiled*   formula estimate")
            rows = [("params", compiled["params"], per_device["params"]),
                    ("grads", None, per_device["grads"]),
                    ("optimizer", compiled["optimizer"], per_device["optimizer"]),
                    ("guard copy", None, per_device["guard"]),
                    ("temp", compiled["temp"], None),
                    ("activations", None, per_device["activations"]),
                    ("total", compiled["total"], per_device["total"])]
            for label, c, f in rows:
                ctxt = _fmt(c) if c is not None else "(in temp)" if label != "total" else ""
                ftxt = _fmt(f) if f is not None else ""
                print(f"  {label:<13} {ctxt:>12}   {ftxt:>12}")
            print(f"  (compiled in {compiled['compile_s']:.1f} s on {devices} simulated CPU "
                  "devices; total = arguments + temp + outputs - donated)")
        else:
            print("per device (formula estimate; not compiled):")
            for key in ("params", "grads", "optimizer", "guard", "activations", "total"):
                label = "guard copy" if key == "guard" else key
                print(f"  {label:<13} {_fmt(per_device[key]):>12}")
        print(f"  (unsharded: params {_fmt(report.total_bytes)}, optimizer state "
              f"{_fmt(report.opt_total_bytes)})")
        print()
        print(f"largest parameters per device (of {sum(1 for r in report.rows if r.group == 'params')}; "
              f"{out['replicated_params']} replicated):")
        from nnx_shard.report import _spec_txt

        cols = [(r.path, str(r.shape), _spec_txt(r.spec), _fmt(r.bytes_per_device))
                for r in largest]
        widths = [max(len(c[i]) for c in cols) for i in range(4)] if cols else [0] * 4
        for c in cols:
            print("  " + "  ".join(f"{x:<{w}}" for x, w in zip(c[:3], widths, strict=False))
                  + f"  {c[3]:>{widths[3]}}")
        print()
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
        print(textwrap.fill(_DECIDES[decided_by].format(ratio=ratio), width=100,
                            subsequent_indent="  "))
        print(textwrap.fill(f"* formula activations: {ACTIVATION_FORMULA}", width=100,
                            subsequent_indent="  "))
        if device_memory is not None:
            verdict = "fits" if out["fits"] else "does NOT fit"
            print(f"\n{verdict} in {_fmt(device_memory)} per device "
                  f"({100 * need / device_memory:.0f}% used, {decided_by} total)")
    return 0 if out["fits"] in (None, True) else 1


def _load_factory(spec: str) -> Any:
    mod_name, colon, attr = spec.partition(":")
    if not colon or not mod_name or not attr:
        raise _Usage(f"{spec!r} is not 'module:factory' (e.g. mypkg.models:make_model)")
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            path = Path(mod_name)
            if not path.is_file():
                raise _Usage(f"no file {str(path)!r}")
            sp = importlib.util.spec_from_file_location(path.stem, path)
            assert sp is not None and sp.loader is not None
            module = importlib.util.module_from_spec(sp)
            sp.loader.exec_module(module)
        else:
            # Like `python -m`: modules in the current directory are importable.
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise _Usage(f"cannot import {mod_name!r}: {e}") from None
        raise _Usage(f"FACTORY {spec!r}: importing {mod_name!r} raised ModuleNotFoundError: "
                     f"{_one_line(e)} {_DEBUG_HINT}") from e
    except _Usage:
        raise
    except Exception as e:  # the user's module failed while importing: their code, one line
        raise _Usage(f"FACTORY {spec!r}: importing {mod_name!r} raised {type(e).__name__}: "
                     f"{_one_line(e)} {_DEBUG_HINT}") from e
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise _Usage(f"module {mod_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise _Usage(f"{spec!r} is not callable; give a zero-argument function returning a module")
    return factory


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or "(no message)"


def _call_factory(spec: str, factory: Any) -> Any:
    """``nnx.eval_shape(factory)``, with the user's own exceptions as one usage line."""
    import inspect

    from flax import nnx

    from nnx_shard.errors import ShardingError

    try:
        required = [p.name for p in inspect.signature(factory).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                           p.POSITIONAL_OR_KEYWORD,
                                                           p.KEYWORD_ONLY)]
    except (TypeError, ValueError):  # no signature to read (some builtins): just call it
        required = []
    if required:
        raise _Usage(f"FACTORY {spec!r} needs arguments ({', '.join(required)}); give a "
                     "zero-argument function returning an nnx.Module, e.g. "
                     "def make(): return MyModel(cfg, rngs=nnx.Rngs(0))")
    try:
        return nnx.eval_shape(factory)
    except ShardingError:
        raise
    except Exception as e:
        raise _Usage(f"FACTORY {spec!r} raised {type(e).__name__}: {_one_line(e)} "
                     f"{_DEBUG_HINT}") from e


def _explain(args: argparse.Namespace) -> int:
    from flax import nnx

    from nnx_shard.rules import Rules

    sizes = _mesh_sizes(args.mesh)
    opt_rules = None
    if args.rules:
        if not Path(args.rules).is_file():
            raise _Usage(f"--rules {args.rules!r}: no such file")
        try:
            rules = Rules.from_file(args.rules)
        except (ValueError, TypeError, OSError, ImportError) as e:
            raise _Usage(f"--rules {args.rules!r}: {_one_line(e)}") from e
    elif args.strategy:
        strategy = _strategy(args.strategy)
        rules, opt_rules = strategy.rules, strategy.opt_rules
    else:
        raise _Usage("give --rules FILE (.toml, .json or .yaml) or --strategy NAME")
    factory = _load_factory(args.factory)
    model = _call_factory(args.factory, factory)
    if not isinstance(model, nnx.Module):
        raise _Usage(f"FACTORY {args.factory!r} returned {type(model).__name__}, not an "
                     "nnx.Module")
    tx = _optimizer(args.optimizer) if args.optimizer else None
    report = _report(model, sizes, rules, tx, opt_rules)
    print(report.to_markdown() if args.markdown else report)
    return 0

