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

from _common import Setup, lm_device_batches, lm_train_step, report, simulated_cpu, time_lm

os.environ.update(simulated_cpu(8))  # before jax is imported

import argparse
import collections
import statistics
import time
from pathlib import Path

import jax
import optax
from flax import nnx

import nnx_shard as ns
from nnx_shard._report import fmt_bytes
from nnx_shard.models import Decoder, get_config
from nnx_shard.planner import compiled_collectives

RESULTS = Path(__file__).resolve().parent / "results" / "async_tp.json"
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
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, s)
    opt = ns.sharded_optimizer(model, optax.adamw(1e-3), mesh, s)
    row: dict = {"variant": label, "strategy": preset, "mesh": dict(mesh.shape),
                 "collective_matmul": rules.options.get("collective_matmul")}
    with ns.use(mesh, rules):
        fused = ns.multistep(lm_train_step)
        data = lm_device_batches(cfg, mesh, rules)
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
    rows, meta = time_lm(list(VARIANTS), prepare, args.quick, args.rounds, 6)
    rates = {row["variant"]: row["steps_per_s_rounds"] for row in rows}
    # The ratio per round (same round, adjacent in time), then the median.
    for row in rows:
        for ref in ("tp", "sp"):
            per_round = [a / b for a, b in zip(row["steps_per_s_rounds"], rates[ref],
                                               strict=True)]
            row[f"ratio_to_{ref}_rounds"] = per_round
            row[f"ratio_to_{ref}"] = statistics.median(per_round)
    meta["mesh"] = MESH
    report(RESULTS, table(rows), f"\n(jax {meta['jax']}, {meta['cpus']} CPUs, 8 simulated "
           f"devices, mesh {MESH}, {meta['rounds']} interleaved rounds, {meta['seconds']:.0f} s)",
           rows, meta)


if __name__ == "__main__":
    main()
