"""Asynchronous tensor parallelism (collective matmuls) against tp, side by side.

The reference transformer (``small``: 4 layers, d=128, 4 heads x 32, mlp 512,
vocab 512, seq 128), AdamW, global batch 16, on 8 simulated CPU devices, mesh
data=2, model=4 (Auto axes, the presets' default), one row per variant:

* ``tp``: Megatron tensor parallelism (all-reduces over model);
* ``sp``: tp with the sequence split between blocks (async_tp's layout with
  the plain all-gather / reduce-scatter);
* ``async_tp``: the projections as collective matmuls, bidirectional rings;
* ``async_tp (one-way)``: the same with ``collective_matmul="unidirectional"``.

Columns: steps/s (``ns.multistep``, K=4 steps per call, at most two calls in
flight, the median of rounds that interleave the variants, in alternating
order), its ratio to tp and to sp (per round, then the median; the range over
rounds for tp), the process's CPU seconds per step (the median over rounds;
the work of all 8 simulated devices, less sensitive than steps/s to other
load on the machine), and the collectives over ``model`` of one step of the
compiled program (count and bytes per device, by kind).

XLA's CPU backend runs collectives serially on the same cores as the matmuls,
so there is no communication to hide: async_tp pays for its extra ring steps
(more, smaller operations) and shows no gain here. The overlap it is built for
needs an accelerator whose interconnect runs beside the compute.

Run (about 5 minutes on 2 idle CPU cores; ``--quick`` about 2)::

    .venv/bin/python benchmarks/async_tp.py

``--quick`` shortens the timing (a smoke test of the script only).
"""

from __future__ import annotations

import os

# Simulated devices must be requested before jax is imported.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import collections
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import optax
from _common import Setup, lm_host_batches, lm_train_step
from flax import nnx

import nnx_shard as ns
from nnx_shard.models import Transformer, get_config
from nnx_shard.report import fmt_bytes
from nnx_shard.strategies import compiled_collectives

RESULTS = Path(__file__).resolve().parent / "results" / "async_tp.json"
K = 4
BATCH = 16
MESH = "data=2,model=4"
#: row label -> (preset, collective_matmul option override or None)
VARIANTS = {
    "tp": ("tp", None),
    "sp": ("sp", None),
    "async_tp": ("async_tp", None),
    "async_tp (one-way)": ("async_tp", "unidirectional"),
}








def prepare(label: str) -> Setup:
    preset, ring = VARIANTS[label]
    s = ns.strategies.get(preset)
    rules = s.rules if ring is None else s.rules.with_options(collective_matmul=ring)
    cfg = get_config("small")
    mesh = ns.make_mesh(MESH)
    model = s.sharded_init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    opt = s.optimizer(model, optax.adamw(1e-3), mesh)
    row: dict = {"variant": label, "strategy": preset, "mesh": dict(mesh.shape),
                 "collective_matmul": rules.options.get("collective_matmul")}
    names = ("batch", "length")
    with ns.use(mesh, rules):
        fused = ns.multistep(lm_train_step)
        data = [ns.shard_batch(lm_host_batches(cfg, K, BATCH, i), mesh, rules, names, steps=True)
                for i in range(2)]
        t0 = time.perf_counter()
        # The fused program runs its K steps in a loop whose body (one step) the
        # HLO holds once: the counts are per step. The calls below reuse it.
        hlo = fused.lower(model, opt, data[0]).compile().as_text()
        row["compile_s"] = time.perf_counter() - t0
        count: dict[str, int] = collections.Counter()
        size: dict[str, int] = collections.Counter()
        for c in compiled_collectives(hlo, mesh):
            if c.axes == ("model",):
                count[c.kind] += 1
                size[c.kind] += c.bytes
        row["model_collectives_count"] = dict(count)
        row["model_collectives_bytes"] = dict(size)
        out = jax.block_until_ready(fused(model, opt, data[0]))
        row["first_loss"] = float(out["loss"][0])
        jax.block_until_ready(fused(model, opt, data[1]))  # warm
    assert fused.traces == 1  # one compilation, the one inspected
    return Setup(label, mesh, rules, model, opt, fused, data, row)


def timed(setup: Setup, calls: int) -> tuple[float, float]:
    """Steps/s over ``calls`` fused calls, at most two in flight, and the
    process's CPU seconds per step (all 8 simulated devices' work: less
    sensitive than wall time to other load on the machine)."""
    pending: collections.deque = collections.deque()
    with ns.use(setup.mesh, setup.rules):
        c0 = time.process_time()
        t0 = time.perf_counter()
        for i in range(calls):
            pending.append(setup.fused(setup.model, setup.opt, setup.data[i % 2]))
            if len(pending) > 2:
                jax.block_until_ready(pending.popleft())
        jax.block_until_ready(list(pending))
        jax.block_until_ready(nnx.state(setup.model))
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
    return calls * K / dt, cpu / (calls * K)


def table(rows: list[dict]) -> str:
    lines = ["| variant | steps/s | vs tp | vs sp | CPU s / step | collectives over model per "
             "step (count, bytes/dev) |", "|" + " --- |" * 6]
    for r in rows:
        coll = ", ".join(f"{k} {r['model_collectives_count'][k]} x, "
                         f"{fmt_bytes(r['model_collectives_bytes'][k])}"
                         for k in sorted(r["model_collectives_count"]))
        lines.append(f"| {r['variant']} | {r['steps_per_s']:.2f} | {r['ratio_to_tp']:.2f} "
                     f"({min(r['ratio_to_tp_rounds']):.2f}-{max(r['ratio_to_tp_rounds']):.2f}) "
                     f"| {r['ratio_to_sp']:.2f} | {r['cpu_s_per_step']:.2f} | {coll} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short timing (smoke test)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    args = ap.parse_args()
    assert jax.device_count() == 8, jax.device_count()
    t0 = time.perf_counter()
    setups = []
    for label in VARIANTS:
        setups.append(prepare(label))
        print(f"  {label}: compiled in {setups[-1].row['compile_s']:.1f} s", flush=True)
    rounds = 1 if args.quick else args.rounds
    calls = 2 if args.quick else 6
    rates: dict[str, list[float]] = {s.name: [] for s in setups}
    cpu: dict[str, list[float]] = {s.name: [] for s in setups}
    for r in range(rounds):
        for setup in (setups if r % 2 == 0 else setups[::-1]):
            rate, cpu_s = timed(setup, calls)
            rates[setup.name].append(rate)
            cpu[setup.name].append(cpu_s)
    rows = []
    for setup in setups:
        row = setup.row
        row["steps_per_s_rounds"] = rates[setup.name]
        row["steps_per_s"] = statistics.median(rates[setup.name])
        row["cpu_s_per_step_rounds"] = cpu[setup.name]
        row["cpu_s_per_step"] = statistics.median(cpu[setup.name])
        rows.append(row)
    # The ratio per round (same round, adjacent in time), then the median.
    for row in rows:
        for ref in ("tp", "sp"):
            per_round = [a / b for a, b in zip(row["steps_per_s_rounds"], rates[ref],
                                               strict=True)]
            row[f"ratio_to_{ref}_rounds"] = per_round
            row[f"ratio_to_{ref}"] = statistics.median(per_round)
    meta = {
        "jax": jax.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "backend": jax.default_backend(),
        "devices": jax.device_count(), "mesh": MESH, "K": K, "global_batch": BATCH,
        "model": "small (4 layers, d=128, 4 heads x 32, mlp 512, vocab 512, seq 128)",
        "optimizer": "adamw", "rounds": rounds, "calls_per_round": calls, "quick": args.quick,
        "seconds": time.perf_counter() - t0,
    }
    print()
    print(table(rows))
    print(f"\n(jax {meta['jax']}, {meta['cpus']} CPUs, 8 simulated devices, mesh {MESH}, "
          f"{rounds} interleaved rounds, {meta['seconds']:.0f} s)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
