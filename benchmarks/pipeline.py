"""Pipeline parallelism: speed, memory and bubble of GPipe and the circular schedule.

The reference model (``tiny`` widths, 8 stacked layers, ``scan_layers=True``)
trained with Adam under ``strategies.get("pp", repeats=V)`` on 8 simulated CPU
devices (``stage=4, data=2``), for M in {S, 2S, 4S, 8S} microbatches, GPipe
(V = 1) and circular (V = 2). For each, one compiled fused call of ``STEPS``
train steps (:func:`nnx_shard.multistep`), and the table shows

* ``steps/s``: median over interleaved rounds, blocking on every call;
* ``peak MiB``: per-device bytes from ``compile().memory_analysis()``:
  temp + arguments + outputs - aliased (XLA CPU's ``peak_memory_in_bytes``
  leaves the temporaries out);
* ``temp MiB``: the temporaries (where the microbatches in flight live);
* ``bubble``: the analytic idle fraction ``(S-1)/(M*V+S-1)``;
* ``idle``: the fraction of idle stage-steps counted in the schedule the
  pipeline loop runs (:func:`nnx_shard._parallel.pipeline.schedule_table`, built from the
  same function the loop uses); the script checks that it equals ``bubble``;
* ``remat``: two more rows at M = 2S with ``pp(..., remat=True)`` (each stage
  recomputed in the backward pass);
* ``relayout KiB``: per step and device, the bytes of the collectives that
  re-lay the contiguously stored stack out to the circular order (and its
  gradients back), read from the compiled HLO; 0 for GPipe.

On simulated CPU devices the stages share the same cores, so ``steps/s`` shows
the cost of the bubble's wasted stage-steps (every stage computes in every
iteration), not the overlap real devices would get.

Run (about 3 minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/pipeline.py

``--quick`` measures M in {S, 2S} only, one round (a smoke test of the script).
Results go to ``benchmarks/results/pipeline.json``.
"""

from __future__ import annotations

import os

from _common import machine, simulated_cpu

os.environ.update(simulated_cpu(8))  # before jax is imported

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import nnx_shard as ns
from nnx_shard import pipeline
from nnx_shard.models import Decoder, get_config, lm_loss
from nnx_shard.planner import compiled_collectives

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline.json"
S, DATA, LAYERS, BATCH = 4, 2, 8, 64
STEPS = 2  # train steps per fused call


def _step(model, opt, batch):
    loss, grads = ns.value_and_grad(lm_loss)(model, batch)
    opt.update(model, grads)
    return loss


def build(m: int, v: int, host: dict, remat: bool = False) -> dict:
    cfg = dataclasses.replace(get_config("tiny"), layers=LAYERS, scan_layers=True)
    strategy = ns.strategies.get("pp", repeats=v, remat=remat)
    mesh = ns.make_mesh({"stage": S, "data": DATA})
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
    opt = ns.sharded_optimizer(model, optax.adam(1e-3), mesh, strategy)
    with ns.use(mesh, strategy.rules):
        batch = ns.shard_batch(host, mesh, strategy.rules, ("batch", "length"), steps=True)
        fused = ns.multistep(_step, microbatches=m)
        t0 = time.perf_counter()
        compiled = fused.lower(model, opt, batch).compile()
        seconds = time.perf_counter() - t0
        jax.block_until_ready(fused(model, opt, batch))  # warm up (and the cached call)
    mem = compiled.memory_analysis()
    # XLA CPU's peak_memory_in_bytes leaves the temporaries out: add them up instead.
    peak = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
            - mem.alias_size_in_bytes)
    found = compiled_collectives(compiled.as_text(), mesh)
    # The stack's re-layout: collectives of reshapes outside the pipeline loop
    # (inside the fused-step loop only), per fused call -> per step.
    relayout = sum(c.bytes for c in found if c.op_name.endswith("reshape")
                   and c.op_name.count("while/body") == 1) / STEPS
    table = pipeline.schedule_table(S, m, v)
    idle = float(np.mean(table < 0))
    bubble = pipeline.bubble(S, m, v)
    assert abs(idle - bubble) < 1e-12, (idle, bubble)
    stack = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.blocks, nnx.Param)))
    row = {"schedule": "gpipe" if v == 1 else "circular", "repeats": v, "remat": remat,
           "stages": S,
           "microbatches": m, "iterations": int(table.shape[0]), "bubble": bubble,
           "idle_measured": idle, "peak_bytes": int(peak),
           "temp_bytes": int(mem.temp_size_in_bytes), "compile_s": seconds,
           "relayout_bytes_per_step": relayout, "stack_bytes_per_device": stack // S,
           "steps_per_s": []}
    return {"row": row, "run": (fused, model, opt, batch, mesh, strategy)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: M in {S, 2S}, 1 round")
    args = parser.parse_args()
    ms = [S, 2 * S] if args.quick else [S, 2 * S, 4 * S, 8 * S]
    rounds = 1 if args.quick else 3
    cfg = get_config("tiny")
    toks = np.random.default_rng(0).integers(0, cfg.vocab, (STEPS, BATCH, cfg.length + 1))
    host = {"inputs": toks[:, :, :-1].astype(np.int32), "targets": toks[:, :, 1:].astype(np.int32)}
    cases = [build(m, v, host) for v in (1, 2) for m in ms]
    # Per-stage remat (pp(..., remat=True)) at M = 2S: the activations in flight shrink.
    cases += [build(2 * S, v, host, remat=True) for v in (1, 2)]
    for r in range(rounds):
        for i in np.roll(np.arange(len(cases)), -r):
            fused, model, opt, batch, mesh, strategy = cases[i]["run"]
            with ns.use(mesh, strategy.rules):
                t0 = time.perf_counter()
                jax.block_until_ready(fused(model, opt, batch))
                cases[i]["row"]["steps_per_s"].append(STEPS / (time.perf_counter() - t0))
    rows = [c["row"] for c in cases]
    for row in rows:
        row["steps_per_s"] = statistics.median(row["steps_per_s"])

    mib = 2.0**20
    print(f"Transformer tiny x {LAYERS} layers, batch {BATCH} x {cfg.length}, mesh stage={S}, "
          f"data={DATA}, {machine()}")
    print("| schedule | V | remat | M | iterations | bubble | idle (measured) | steps/s | "
          "peak MiB | temp MiB | relayout KiB/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['schedule']} | {row['repeats']} | {row['remat']} | {row['microbatches']} | "
              f"{row['iterations']} | {row['bubble']:.3f} | {row['idle_measured']:.3f} | "
              f"{row['steps_per_s']:.2f} | {row['peak_bytes'] / mib:.2f} | "
              f"{row['temp_bytes'] / mib:.2f} | {row['relayout_bytes_per_step'] / 1024:.0f} |")
    print(f"stack parameters per device: {rows[0]['stack_bytes_per_device'] / 1024:.0f} KiB")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "model": "tiny", "layers": LAYERS, "batch": BATCH, "length": cfg.length,
        "mesh": {"stage": S, "data": DATA}, "jax": jax.__version__,
        "backend": jax.default_backend(), "devices": jax.device_count(), "rounds": rounds,
        "steps_per_call": STEPS, "rows": rows,
    }, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
