"""``nnx-shard plan --auto``: the planner's choice of strategy, mesh, remat and
microbatches for a model (the library's by name, or your own with ``--factory``) on
``--devices`` devices, with the hardware the costs are read for; printed or as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

from nnx_shard.cli._common import MAX_PLAN_DEVICES, PROG, UsageError, device_memory
from nnx_shard.cli._plan_user import user_model
from nnx_shard.planner import NothingFits, auto, hardware
from nnx_shard.planner._cache import default_cache
from nnx_shard.planner._hardware import calibrate_subprocess
from nnx_shard.planner._plan import plan_json

__all__ = ["run_auto"]


def _auto_hardware(args: argparse.Namespace) -> Any:
    """``--hardware`` (or ``--calibrate``) with the flags that override its figures."""
    try:
        if args.calibrate:
            hw = calibrate_subprocess(min(args.devices, 64))
        else:
            hw = hardware(args.hardware or "h100-sxm")
        return hw.replace(peak_flops=args.peak_flops, link_bandwidth=args.link_bandwidth,
                          link_latency=args.link_latency,
                          device_memory=device_memory(args.device_memory)
                          if args.device_memory is not None else None,
                          host_memory=device_memory(args.host_memory, "--host-memory")
                          if args.host_memory is not None else None)
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None


def _check_counts(args: argparse.Namespace) -> None:
    """--devices, --top and --max-compiles within their bounds."""
    if args.devices < 1:
        raise UsageError(f"--devices must be at least 1, got {args.devices}. Fix: e.g. --devices 8")
    if args.devices > MAX_PLAN_DEVICES:
        raise UsageError(f"--devices must be at most {MAX_PLAN_DEVICES:,} (the largest mesh "
                         f"plan lays out, as for --mesh), got {args.devices:,}. Fix: e.g. "
                         "--devices 1024")
    if args.top < 0:
        raise UsageError(f"--top must be 0 or more, got {args.top}. Fix: e.g. --top 5")
    if args.max_compiles < 1:
        raise UsageError(f"--max-compiles must be at least 1, got {args.max_compiles}. Fix: e.g. "
                         "--max-compiles 64")


def run_auto(args: argparse.Namespace) -> int:
    """``nnx-shard plan --auto``: prints the plan (or JSON); exit 0 when something
    fits, 1 when nothing does. Bad input raises the usage error.

    >>> from nnx_shard.cli import main
    >>> main(["plan", "--auto", "--model", "tiny", "--batch", "8", "--seq", "16"])
    2
    """
    if args.generate:
        raise UsageError("--generate plans one strategy and mesh: drop --auto and give "
                         "--mesh (e.g. --mesh data=2,model=4 --strategy tp)")
    if args.devices is None:
        raise UsageError("plan --auto needs --devices N (the device count to plan for)")
    if args.param_dtype or args.compute_dtype:
        raise UsageError("plan --auto plans the model's own dtypes; --param-dtype and "
                         "--compute-dtype apply to a plan of one mesh (drop --auto)")
    if args.mesh:
        raise UsageError("plan --auto chooses the mesh: drop --mesh (or drop --auto to check one)")
    _check_counts(args)
    names = None
    if args.strategies is not None:
        names = [s.strip() for s in args.strategies.split(",") if s.strip()]
        if not names:
            raise UsageError(f"--strategies {args.strategies!r} names no preset. Fix: e.g. "
                             "--strategies fsdp,tp, or leave it out to try every preset")
    # Your own model: batch and seq come from --batch-spec.
    user = user_model(args) if args.factory or args.loss or args.batch_spec else None
    model, own = (args.model, {"batch": args.batch, "seq": args.seq}) if user is None else (
        user.factory, {"loss": user.loss, "batch_spec": user.batch, "aliases": user.aliases})
    hw = _auto_hardware(args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plan = auto(model, devices=args.devices, **own, device_memory=hw.device_memory,
                        hardware=hw, optimizer=args.optimizer, guard=args.guard,
                        strategies=names, max_compiles=args.max_compiles,
                        cache=None if args.no_cache else default_cache(),
                        progress=not args.json and sys.stderr.isatty(),
                        timeout=args.compile_timeout)
        except NothingFits as e:
            if args.json:
                print(json.dumps(plan_json(e.plan, str(e))))
            else:
                print(e.plan)
            print(f"nnx-shard: {e}", file=sys.stderr)
            return 1
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(plan_json(plan, None)))
    else:
        plan.request["top"] = args.top
        print(plan)
    # After the plan: a cache that could not be written costs only the next run.
    for w in caught:
        print(f"{PROG}: warning: {w.message}", file=sys.stderr)
    return 0
