"""Steps/s of float32 against mixed precision on one device, through ``Trainer.fit``.

A Llama (vocab 32000, embed 1024, 16 heads / 8 key-value heads of 64, mlp 4096,
8 scanned layers), AdamW, batch 8 x 1024 random tokens, K=5 steps per fused call,
on the first device: ``float32`` (parameters and compute) against
``ns.Precision(params=float32, compute=bfloat16)`` (float32 master weights, the
model's ``dtype`` bfloat16). Each variant compiles in a warm-up fit of 2K steps,
then runs 3 rounds of 10 steps; the table shows the median round.

Meant for an accelerator (CPUs have no fast bfloat16 arithmetic)::

    JAX_PLATFORMS=cuda .venv/bin/python benchmarks/precision_speed.py

``--quick`` runs a tiny Llama on short sequences (a smoke test of the script).
Results go to ``benchmarks/results/precision_speed.json``.
"""

from __future__ import annotations

import os

from _common import machine, parse, print_table, simulated_cpu, write_json

os.environ.update(simulated_cpu(1))  # before jax is imported (JAX_PLATFORMS=cuda for a GPU)

import dataclasses
import statistics
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nnx_shard as ns
from nnx_shard.models import Decoder, DecoderConfig, lm_loss

RESULTS = Path(__file__).resolve().parent / "results" / "precision_speed.json"
K, STEPS, ROUNDS = 5, 10, 3


def main() -> None:
    args = parse(__doc__)
    if args.quick:
        batch, length = 2, 32
        cfg = DecoderConfig(vocab=128, scan_layers=True)
    else:
        batch, length = 8, 1024
        cfg = DecoderConfig(vocab=32000, embed=1024, heads=16, kv_heads=8, head_dim=64, mlp=4096,
                          layers=8, scan_layers=True)
    strategy = ns.strategies.get("dp")
    mesh = strategy.make_mesh(1)
    tokens = np.random.default_rng(0).integers(
        0, cfg.vocab, (batch * (2 * K + ROUNDS * STEPS), length + 1)).astype(np.int32)
    data = ns.Batches({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, batch)
    rows = []
    variants = (("float32", jnp.float32, None),
                ("bf16 compute", jnp.bfloat16,
                 ns.Precision(params=jnp.float32, compute=jnp.bfloat16)))
    for label, dtype, precision in variants:
        c = dataclasses.replace(cfg, dtype=dtype)
        model = ns.sharded_init(lambda c=c: Decoder(c, rngs=nnx.Rngs(0)), mesh, strategy)
        trainer = ns.Trainer(model, ns.sharded_optimizer(model, optax.adamw(1e-4), mesh, strategy), lm_loss,
                             mesh=mesh, rules=strategy.rules, steps_per_call=K,
                             precision=precision)
        t0 = time.perf_counter()
        trainer.fit(data, num_steps=2 * K, progress=False)  # compiles
        first = time.perf_counter() - t0
        rounds = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            history = trainer.fit(data, num_steps=STEPS, progress=False)
            rounds.append(STEPS / (time.perf_counter() - t0))
        sps = statistics.median(rounds)
        rows.append({"compute": label, "steps_per_s": sps, "tokens_per_s": sps * batch * length,
                     "rounds": rounds, "first_call_s": first,
                     "last_loss": float(history["loss"][-1])})
    base = rows[0]["steps_per_s"]
    print(f"\nfloat32 vs bf16 compute, Llama {cfg.layers} x {cfg.embed}, batch {batch} x {length}, "
          f"K={K}; {machine()}\n")
    print_table(["compute", "steps/s", "tokens/s", "ratio to float32", "first fit s"],
                [[r["compute"], f"{r['steps_per_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
                  f"{r['steps_per_s'] / base:.2f}x", f"{r['first_call_s']:.1f}"] for r in rows])
    write_json(RESULTS, {"machine": machine(), "quick": args.quick, "batch": batch,
                         "length": length, "k": K, "rows": rows})


if __name__ == "__main__":
    main()
