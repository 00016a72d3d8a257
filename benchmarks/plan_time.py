"""How long ``nnx-shard plan --auto`` takes, and where the time goes.

Two parts, each in fresh subprocesses (the planner's in-memory cache is per
process):

1. ``auto`` on a case with ``workers=1`` (one compile subprocess, as before
   compiles ran side by side) and with the default (one per core, at most 4),
   alternated: wall seconds, compiles, the sum of the per-compile seconds the
   children report, and whether the ranking and the choice are the same.
2. One candidate's compile (``fsdp`` on ``data=8``) with XLA's default options
   and with :data:`nnx_shard.planner._compile.PLAN_COMPILER_OPTIONS`, both orders
   (the first compile of a process pays a warm-up): seconds and whether the
   optimised HLO and the memory figures are the same.

``--floors`` measures instead the bounds the search prunes with, from one search
that prunes nothing by time: the least predicted-time ratio of a later compiled step
of a layout to an earlier one, over all pairs and per kind of pair (full after dots,
dots after none, full after none, any other), beside the floor the search uses for
that kind (``explore.REMAT_TIME_FLOORS``, ``explore.VARIANT_TIME_FLOOR``), and the
largest formula / compiled total; it writes ``plan_floors_<case>.json`` with every
compiled step.

Cases: ``8b`` (Llama-3.1 8B shapes as a ReferenceConfig, float32, scanned
layers, AdamW, 8 devices, 80 GB, batch 16 x seq 2048), ``70b`` (Llama-3.1 70B
shapes likewise, 256 devices, 80 GB, torchtitan's global batch 512 x 8192) and
``small`` (README's: 8 devices, batch 32 x 128, 48 MiB). Results go to
``benchmarks/results/plan_time_<case>.json``. Run::

    .venv/bin/python benchmarks/plan_time.py --case 8b
    .venv/bin/python benchmarks/plan_time.py --case 70b --workers default --skip-compile
    .venv/bin/python benchmarks/plan_time.py --case 8b --floors --max-compiles 80
    .venv/bin/python benchmarks/plan_time.py --case small --floors --max-compiles 80
    .venv/bin/python benchmarks/plan_time.py --case 70b --floors --max-compiles 64 --formula-prune
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import print_table, write_json

RESULTS = Path(__file__).resolve().parent / "results"
CASES = {
    "8b": {"config": {"vocab": 128256, "length": 8192, "embed": 4096, "heads": 32,
                      "head_dim": 128, "mlp": 14336, "layers": 32, "scan_layers": True},
           "devices": 8, "batch": 16, "seq": 2048, "device_memory": "80GB"},
    "70b": {"config": {"vocab": 128256, "length": 8192, "embed": 8192, "heads": 64,
                       "head_dim": 128, "mlp": 28672, "layers": 80, "scan_layers": True},
            "devices": 256, "batch": 512, "seq": 8192, "device_memory": "80GB"},
    "small": {"config": "small", "devices": 8, "batch": 32, "seq": 128,
              "device_memory": "48MiB"},
}


def _model(case: dict):
    from nnx_shard.models import ReferenceConfig

    cfg = case["config"]
    return cfg if isinstance(cfg, str) else ReferenceConfig(**cfg)


def auto_worker(name: str, workers: int | None) -> dict:
    import nnx_shard as ns

    case = CASES[name]
    t0 = time.perf_counter()
    plan = ns.planner.auto(_model(case), devices=case["devices"], batch=case["batch"],
                              seq=case["seq"], device_memory=case["device_memory"],
                              progress=False, workers=workers)
    wall = time.perf_counter() - t0
    cands = plan.ranked + plan.dropped
    return {"wall_s": wall, "compiled": plan.request["compiled"],
            "compile_s_sum": sum(c.compile_s or 0 for c in cands),
            "best": plan.best.label, "ranked": [c.label for c in plan.ranked],
            "pruned": plan.pruned}


def floors_worker(name: str, max_compiles: int, formula_prune: bool) -> dict:
    """The measured bounds the search prunes with, from a search that prunes nothing by
    time (``VARIANT_TIME_FLOOR`` 0), nor by the formula unless ``formula_prune``: over every pair of compiled steps of one layout
    (the earlier in the search's order first), the smallest ratio of the later step's
    predicted time to the earlier's; over every candidate its compiled figure decided,
    the largest formula / compiled total."""
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard import _optimizers as optimizers
    from nnx_shard.models._named import build, get_config
    from nnx_shard.planner import _explore as explore
    from nnx_shard.planner._formula import formula_bytes
    from nnx_shard.strategies._presets import get

    # Nothing pruned by time (nor by the formula, where asked): the compiles measured.
    floors, default = dict(explore.REMAT_TIME_FLOORS), explore.VARIANT_TIME_FLOOR
    explore.VARIANT_TIME_FLOOR = 0.0
    explore.REMAT_TIME_FLOORS = {}
    if not formula_prune:
        explore.PRUNE_MARGIN = float("inf")
    case = CASES[name]
    cfg = _model(case)
    if isinstance(cfg, str):  # a reference config by name
        cfg = get_config(cfg)
    try:
        plan = ns.planner.auto(cfg, devices=case["devices"], batch=case["batch"],
                                  seq=case["seq"], device_memory=case["device_memory"],
                                  progress=False, max_compiles=max_compiles)
    except ns.planner.NothingFits as e:
        raise SystemExit(f"nothing fits within {max_compiles} compiles: raise "
                         "--max-compiles, or keep the formula's pruning") from e
    steps = [c for c in plan.ranked + plan.dropped + plan.twins
             if c.compiled and c.predicted_s is not None]
    order = {"none": 0, "dots": 1, "full": 2}
    explore_pairs = set(floors)
    layouts: dict = {}
    for c in steps:
        layouts.setdefault((c.strategy, tuple(c.mesh.items())), []).append(c)
    times = []
    by_kind: dict = {}  # "none->dots" etc. (same microbatches), or "other"
    for group in layouts.values():
        group.sort(key=lambda c: (c.microbatches, order.get(str(c.remat), 3)))
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                pair = (b.predicted_s / a.predicted_s, b.label, a.label)
                times.append(pair)
                kind = (f"{a.remat}->{b.remat}" if (a.remat, b.remat) in explore_pairs
                        else "other")
                by_kind[kind] = min(by_kind.get(kind, pair), pair)
    abstract = nnx.eval_shape(lambda: build(cfg, nnx.Rngs(0)))
    tx = optimizers.get("adamw")
    formula = [(formula_bytes(abstract, cfg, get(c.strategy), c.mesh, tx,
                              case["batch"] // c.microbatches, case["seq"], str(c.remat))
                / c.bytes_per_device, c.label)
               for c in steps if c.decided_by == "compiled" and c.bytes_per_device]
    low, high = min(times), max(formula)
    return {"compiled": plan.request["compiled"], "pairs": len(times),
            "time_floor": low[0], "time_floor_pair": low[1:],
            "time_floor_by_kind": {k: {"ratio": v[0], "pair": v[1:],
                                       "floor": floors.get(tuple(k.split("->")), default)}
                                   for k, v in sorted(by_kind.items())},
            "candidates": len(formula),
            "formula_over_compiled_max": high[0], "formula_max_candidate": high[1],
            "best": plan.best.label,
            "steps": [{"label": c.label, "strategy": c.strategy, "mesh": c.mesh,
                       "remat": c.remat, "microbatches": c.microbatches,
                       "predicted_s": c.predicted_s, "bytes": c.bytes_per_device,
                       "fits": c.fits, "decided_by": c.decided_by} for c in steps]}


def compile_worker(order: str) -> dict:
    import hashlib

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from nnx_shard.models import Decoder
    from nnx_shard.planner import _compile as planner_compile

    case = CASES["8b"]
    model = _model(case)
    _, trainer, _ = planner_compile.compile_fit(
        lambda: Decoder(model, rngs=nnx.Rngs(0)), "fsdp", {"data": 8},
        batch=case["batch"], seq=4)  # a tiny compile: the imports and warm-up
    batch, seq = case["batch"], case["seq"]
    strat_rules = trainer.rules
    spec = strat_rules.spec((None, "batch", "length"), shape=(2, batch, seq), mesh=trainer.mesh)
    tokens = jax.ShapeDtypeStruct((2, batch, seq), jnp.int32,
                                  sharding=NamedSharding(trainer.mesh, spec))
    lowered = trainer.lower({"inputs": tokens, "targets": tokens})
    out = {}
    for label in order.split(","):
        opts = planner_compile.PLAN_COMPILER_OPTIONS if label == "plan" else {}
        t0 = time.perf_counter()
        compiled = lowered.compile(compiler_options=opts)
        m = compiled.memory_analysis()
        out[label] = {"compile_s": time.perf_counter() - t0,
                      "hlo": hashlib.sha1(compiled.as_text().encode()).hexdigest(),
                      "memory": [m.temp_size_in_bytes, m.argument_size_in_bytes,
                                 m.output_size_in_bytes, m.alias_size_in_bytes]}
    return out


def _child(args: list[str], devices: int | None = None) -> dict:
    env = dict(os.environ)
    if devices:
        from nnx_shard._simulated import simulated_env

        env = simulated_env(devices)
    proc = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True,
                          text=True, timeout=7200, check=False)
    if proc.returncode:
        raise SystemExit(f"worker {args} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=tuple(CASES), default="8b")
    ap.add_argument("--rounds", type=int, default=1, help="alternated rounds of part 1")
    ap.add_argument("--skip-auto", action="store_true", help="part 2 only")
    ap.add_argument("--skip-compile", action="store_true", help="part 1 only")
    ap.add_argument("--workers", default="1,default",
                    help="part 1's worker settings, alternated (default: 1,default)")
    ap.add_argument("--auto-worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--floors", action="store_true",
                    help="only the measured bounds the search prunes with (VARIANT_TIME_FLOOR, "
                    "PRUNE_MARGIN), from a search that prunes nothing by time or formula")
    ap.add_argument("--max-compiles", type=int, default=200, help="for --floors")
    ap.add_argument("--formula-prune", action="store_true",
                    help="for --floors: keep the formula's pruning (a large case's plain "
                    "layouts alone would use up the compiles)")
    ap.add_argument("--floors-worker", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--compile-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.floors_worker:
        name, most, prune = args.floors_worker
        print(json.dumps(floors_worker(name, int(most), prune == "1")))
        return
    if args.floors:
        got = _child(["--floors-worker", args.case, str(args.max_compiles),
                      "1" if args.formula_prune else "0"])
        print(f"case {args.case}: {got['compiled']} compiles, chosen {got['best']}")
        print_table(["measure", "value", "where"], [
            [f"smallest predicted-time ratio of a later step to an earlier one of its layout "
             f"({got['pairs']} pairs)", f"{got['time_floor']:.3f}",
             " after ".join(got["time_floor_pair"])],
            [f"largest formula / compiled total ({got['candidates']} candidates)",
             f"{got['formula_over_compiled_max']:.3f}", got["formula_max_candidate"]]])
        print_table(["pair (earlier -> later step)", "least ratio measured", "floor the "
                     "search prunes with", "where"], [
            [k, f"{v['ratio']:.3f}", f"{v['floor']:g}", " after ".join(v["pair"])]
            for k, v in got["time_floor_by_kind"].items()])
        write_json(RESULTS / f"plan_floors_{args.case}.json", got)
        return
    if args.auto_worker:
        name, workers = args.auto_worker
        print(json.dumps(auto_worker(name, None if workers == "default" else int(workers))))
        return
    if args.compile_worker:
        print(json.dumps(compile_worker(args.compile_worker)))
        return

    runs: list[dict] = []
    if not args.skip_auto:
        settings = args.workers.split(",")
        for r in range(args.rounds):
            for workers in (settings if r % 2 == 0 else settings[::-1]):
                got = _child(["--auto-worker", args.case, workers])
                runs.append({"workers": workers, **got})
                print(workers, {k: v for k, v in got.items() if k != "ranked"},
                      file=sys.stderr, flush=True)
    compiles = [] if args.skip_compile else [
        _child(["--compile-worker", order], devices=8) for order in ("default,plan", "plan,default")]
    load = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average {load[0]:.2f} at the end (shared machine)")
    if runs:
        same = all(r["ranked"] == runs[0]["ranked"] for r in runs)
        print(f"\nplan --auto, case {args.case}: ranking and choice the same in every run: {same}")
        print_table(["workers", "wall s", "compiles", "sum of compile s", "chosen"],
                    [[r["workers"], f"{r['wall_s']:.1f}", str(r["compiled"]),
                      f"{r['compile_s_sum']:.1f}", r["best"]] for r in runs])
    if runs:
        print("\npruned (first run):\n" + "\n".join(f"- {p}" for p in runs[0]["pruned"]))
    print("\none compile, 8B shapes, fsdp data=8 (each order in its own process)")
    rows = []
    for c in compiles:
        for label, v in c.items():
            rows.append([" then ".join(c), label, f"{v['compile_s']:.1f}", v["hlo"][:10],
                         ", ".join(map(str, v["memory"]))])
    print_table(["order", "options", "compile s", "HLO sha1", "temp, argument, output, alias"],
                rows)
    write_json(RESULTS / f"plan_time_{args.case}.json", {"case": args.case, "cores": os.cpu_count(), "loadavg_end": load,
                         "auto": runs, "compile": compiles})


if __name__ == "__main__":
    main()
