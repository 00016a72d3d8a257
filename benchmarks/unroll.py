"""Compile time and steps/s of the fused K-step call under ``jax.lax.scan(unroll=...)``.

``Trainer.fit`` and ``ns.multistep`` compile K steps as one rolled
``jax.lax.scan`` by default (one loop iteration a step); their ``unroll``
argument copies the step body that many times per iteration: XLA can fuse
across steps, but the program and its compile time grow with it. This measures
that trade on the MLP 32-128-128-8, Adam, batch 64, MSE, K=100, 1 CPU device,
with the hand-written scan of ``benchmarks/_common.hand_scan`` (the bare call
``fit``'s is measured against), data already on the device. Compile time is
``lower`` + ``compile``; steps/s is the median over interleaved rounds
(:func:`_common.interleaved`).

Run (about 15 s on 2 CPU cores; ``--unroll`` picks the factors, default
``1,2,4,10``)::

    .venv/bin/python benchmarks/unroll.py

``--quick`` shortens every measurement (a smoke test of the script only).
"""

from __future__ import annotations

import os

from _common import simulated_cpu

os.environ.update(simulated_cpu(1))  # before jax is imported

import argparse
import time
from pathlib import Path

import jax
import numpy as np
import optax
from _common import hand_scan, interleaved, machine, mlp, print_table, write_json
from flax import nnx

K, BATCH = 100, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--unroll", default="1,2,4,10", help="comma-separated unroll factors")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    args = ap.parse_args()
    factors = [int(u) for u in args.unroll.split(",")]
    rounds, calls = (2, 1) if args.quick else (args.rounds, 10)

    def mse(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    rng = np.random.default_rng(0)
    data = jax.device_put({"x": rng.normal(size=(K, BATCH, 32)).astype(np.float32),
                           "y": rng.normal(size=(K, BATCH, 8)).astype(np.float32)})
    rows, runs = [], []
    for u in factors:
        model = mlp(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        graphdef, state = nnx.split((model, opt))
        t0 = time.perf_counter()
        compiled = hand_scan(graphdef, mse, unroll=u).lower(state, data).compile()
        seconds = time.perf_counter() - t0
        rows.append({"unroll": u, "compile_s": seconds})
        runs.append([compiled, state])
        print(f"unroll {u}: compiled in {seconds:.2f} s", flush=True)

    def call(run: list) -> None:
        run[1], losses = run[0](run[1], data)  # donated: carry the new state
        jax.block_until_ready(losses)

    rates = interleaved(runs, rounds, calls, call)
    for row, rate in zip(rows, rates, strict=True):
        row["steps_per_s"] = rate * K
    base = rows[0]["steps_per_s"]
    print(f"\nMLP 32-128-128-8, Adam, batch {BATCH}, K={K} steps per call; {machine()}; "
          f"median of {rounds} interleaved rounds of {calls} calls")
    print_table(["unroll", "compile s", "steps/s", "vs unroll 1"],
                [[r["unroll"], f"{r['compile_s']:.2f}", f"{r['steps_per_s']:,.0f}",
                  f"{r['steps_per_s'] / base:.2f}x"] for r in rows])
    write_json(Path(__file__).resolve().parent / "results" / "unroll.json",
               {"machine": machine(), "k": K, "batch": BATCH, "rounds": rounds, "rows": rows})


if __name__ == "__main__":
    main()
