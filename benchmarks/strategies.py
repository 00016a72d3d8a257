"""Every parallelism strategy preset on the same model and 8 simulated CPU devices.

For each preset of ``ns.strategies`` (default mesh shape of 8 devices), the
reference transformer (``small``: 4 layers, d=128, 4 heads, vocab 512, seq 128;
``ep`` runs the same with a 4-expert top-2 mixture-of-experts MLP, capacity
factor 1.0, since expert parallelism needs experts), AdamW, global batch 16, one table:

* params / opt state per device: from ``ns.explain`` (no allocation);
* state per device (compiled): ``argument_size_in_bytes`` of the compiled train
  step's ``memory_analysis()`` minus the batch (what the step really takes in);
  temp: its ``temp_size_in_bytes`` (activations, gathered parameters, ...);
* steps/s and tokens/s: ``ns.multistep`` with K=4 steps per call, at most two
  calls in flight (docs/architecture.md: deeper queues can deadlock XLA's CPU rendezvous);
  the median of 3 rounds that interleave the strategies;
* collective bytes per step: the result sizes of the all-reduce, all-gather,
  reduce-scatter, all-to-all and collective-permute operations of the compiled
  one-step program (``ns.planner.compiled_collectives``), per device.

8 simulated devices share the machine's cores and "communicate" through memory,
so steps/s compares the partitioned programs' total work and overheads, not
interconnects; bytes are exact.

Run (about 3 minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/strategies.py

``--quick`` shortens the timing (a smoke test of the script only).
"""

from __future__ import annotations

import os

from _common import (
    BATCH,
    Setup,
    lm_device_batches,
    lm_host_batches,
    lm_train_step,
    report,
    simulated_cpu,
    time_lm,
)

os.environ.update(simulated_cpu(8))  # before jax is imported

import argparse
import collections
import dataclasses
import time
from pathlib import Path

import jax
import optax
from flax import nnx

import nnx_shard as ns
from nnx_shard._report import fmt_bytes
from nnx_shard.models import Decoder, get_config
from nnx_shard.planner import compiled_collectives

RESULTS = Path(__file__).resolve().parent / "results" / "strategies.json"


def config_for(name: str):
    cfg = get_config("small")
    if name == "ep":  # capacity 1.0: each expert takes up to an even share of the top-2 picks
        return dataclasses.replace(cfg, experts=4, top_k=2, capacity_factor=1.0)
    return cfg


def prepare(name: str) -> Setup:
    s = ns.strategies.get(name)
    cfg = config_for(name)
    mesh = s.make_mesh(8, axis_types="explicit")  # where the README figures were taken
    tx = optax.adamw(1e-3)
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, s)
    opt = ns.sharded_optimizer(model, tx, mesh, s)
    report = ns.explain(model, mesh, s, tx)
    row: dict = {
        "strategy": name,
        "mesh": dict(mesh.shape),
        "params": cfg.num_params,
        "experts": cfg.experts,
        "explain_param_bytes_per_device": report.param_bytes_per_device,
        "explain_opt_bytes_per_device": report.opt_bytes_per_device,
        "total_param_bytes": report.total_bytes,
        "total_opt_bytes": report.opt_total_bytes,
    }
    names = ("batch", "length")
    with ns.use(mesh, s.rules):
        # The one-step program: per-step memory and collectives without the loop.
        one = ns.shard_batch(lm_host_batches(cfg, 1, BATCH, 0), mesh, s.rules, names, steps=True)
        compiled = ns.multistep(lm_train_step).lower(model, opt, one).compile()
        mem = compiled.memory_analysis()
        batch_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(one))
        row["compiled_state_bytes_per_device"] = int(mem.argument_size_in_bytes) - batch_bytes
        row["compiled_temp_bytes_per_device"] = int(mem.temp_size_in_bytes)
        per_kind: dict[str, int] = collections.Counter()
        per_axes: dict[str, int] = collections.Counter()
        for c in compiled_collectives(compiled.as_text(), mesh):
            per_kind[c.kind] += c.bytes
            per_axes[f"{c.kind} over {'x'.join(c.axes) if c.axes else '?'}"] += c.bytes
        row["collective_bytes_per_step"] = sum(per_kind.values())
        row["collective_bytes_by_kind"] = dict(per_kind)
        row["collective_bytes_by_axes"] = dict(per_axes)

        fused = ns.multistep(lm_train_step)
        data = lm_device_batches(cfg, mesh, s.rules)
        t0 = time.perf_counter()
        jax.block_until_ready(fused(model, opt, data[0]))
        row["compile_s"] = time.perf_counter() - t0
        jax.block_until_ready(fused(model, opt, data[1]))  # warm
    return Setup(name, mesh, s.rules, model, opt, fused, data, row)


def table(rows: list[dict]) -> str:
    head = ("| strategy | mesh | params (total) | params / dev | opt state / dev | "
            "state / dev (compiled) | temp / dev | steps/s | tokens/s | "
            "collective bytes / step / dev |")
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
        coll = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(
            r["collective_bytes_by_kind"].items()))
        lines.append(
            f"| {r['strategy']}{' (MoE)' if r['experts'] else ''} | {mesh} "
            f"| {fmt_bytes(r['total_param_bytes'])} "
            f"| {fmt_bytes(r['explain_param_bytes_per_device'])} "
            f"| {fmt_bytes(r['explain_opt_bytes_per_device'])} "
            f"| {fmt_bytes(r['compiled_state_bytes_per_device'])} "
            f"| {fmt_bytes(r['compiled_temp_bytes_per_device'])} "
            f"| {r['steps_per_s']:.1f} | {r['tokens_per_s']:,.0f} "
            f"| {fmt_bytes(r['collective_bytes_per_step'])} ({coll}) |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short timing (smoke test)")
    # Pipeline presets need a stacked model and microbatches: benchmarks/pipeline.py.
    ap.add_argument("--only", nargs="*",
                    default=[n for n in ns.strategies.NAMES if not n.startswith("pp")],
                    choices=ns.strategies.NAMES, help="strategies to run")
    args = ap.parse_args()
    rows, meta = time_lm(args.only, prepare, args.quick, 3, 8)
    for row in rows:
        row["tokens_per_s"] = row["steps_per_s"] * BATCH * config_for(row["strategy"]).length
    report(RESULTS, table(rows), f"\n(jax {meta['jax']}, {meta['cpus']} CPUs, 8 simulated "
           f"devices, {meta['seconds']:.0f} s; ep: the same model with 4 experts, top-2, "
           "capacity 1.0)", rows, meta)


if __name__ == "__main__":
    main()
