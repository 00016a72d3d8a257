"""Memory and speed of the attention kernels: dense vs blockwise (vs cuDNN on a GPU).

The ``small`` transformer (embed 128, 4 heads of 32, mlp 512, vocab 512) with
2 scanned layers, ``--batch`` sequences of ``length`` tokens, on one device, with
``ReferenceConfig(attention=kernel)``. The step is
``jax.value_and_grad(lm_loss)`` over the parameters.

* bytes: ``compile().memory_analysis()`` of the step (nothing is run): ``temp``
  (activations and attention scratch) at each length of ``--lengths``; next to it
  the activation formula of ``nnx_shard.models._memory`` (what ``nnx-shard plan``
  prints) for the same kernel. Dense attention keeps the float32 ``[batch, heads,
  seq, seq]`` probabilities per layer (O(L^2)); blockwise keeps q, k, v, the
  output and a log-sum-exp per row, plus a few ``block x block`` tiles while it
  runs (O(L x block)).
* steps/s: the median of interleaved rounds of a few blocking steps each, at the
  lengths of ``--speed-lengths``, as a ratio to dense measured in the same rounds.

Results go to ``benchmarks/results/attention.json``. Run (2 shared CPU cores: the
memory table compiles 8 programs, a minute or two; the speed rows time 2k-token
steps, several minutes; ``--quick``: short sequences, one round)::

    .venv/bin/python benchmarks/attention.py [--quick] [--lengths 1024,2048,4096,8192]
        [--speed-lengths 512,2048] [--kernels dense,blockwise] [--dtype bfloat16]
"""

from __future__ import annotations

import os

from _common import interleaved, machine, print_table, simulated_cpu, write_json

os.environ.update(simulated_cpu(1))  # before jax is imported (JAX_PLATFORMS=cuda for a GPU)

import argparse
import dataclasses
import itertools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import nnx_shard as ns
from nnx_shard.models import Decoder, get_config, lm_loss
from nnx_shard.models._memory import activation_bytes

RESULTS = Path(__file__).resolve().parent / "results" / "attention.json"
RULES = ns.strategies.get("dp").rules


def build(length: int, kernel: str, batch: int, dtype):
    cfg = dataclasses.replace(get_config("small"), length=length, layers=2, scan_layers=True,
                              attention=kernel, dtype=dtype)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (batch, length + 1))
    data = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
            "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}

    def step(state, data):
        return jax.value_and_grad(lambda s: lm_loss(nnx.merge(graphdef, s), data))(state)

    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(state, data).compile()
    return cfg, compiled, data, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="short sequences, one round (writes attention_quick.json)")
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--speed-lengths", default="512,2048")
    ap.add_argument("--kernels", default="dense,blockwise")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    lengths = [256, 512] if args.quick else [int(x) for x in args.lengths.split(",") if x]
    speed_lengths = [128] if args.quick else [int(x) for x in args.speed_lengths.split(",")
                                              if x]
    rounds, steps = (1, 1) if args.quick else (args.rounds, args.steps)
    kernels = args.kernels.split(",")
    dtype = jnp.dtype(args.dtype)

    mem_rows = []
    for length in lengths:
        for kernel in kernels:
            cfg, compiled, _, seconds = build(length, kernel, args.batch, dtype)
            m = compiled.memory_analysis()
            formula = activation_bytes(cfg, RULES, {"data": 1}, args.batch, length)
            mem_rows.append({"length": length, "kernel": kernel,
                             "temp_bytes": m.temp_size_in_bytes, "formula_bytes": formula,
                             "argument_bytes": m.argument_size_in_bytes,
                             "output_bytes": m.output_size_in_bytes, "compile_s": seconds})
            print(f"bytes: length {length} {kernel}: temp {m.temp_size_in_bytes / 2**20:.1f} "
                  f"MiB, formula {formula / 2**20:.1f} MiB ({seconds:.1f} s to compile)",
                  flush=True)

    speed_rows, runs = [], []
    for length in speed_lengths:
        for kernel in kernels:
            cfg, compiled, data, _ = build(length, kernel, args.batch, dtype)
            state = nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)))
            loss, _ = jax.block_until_ready(compiled(state, data))  # warm up
            speed_rows.append({"length": length, "kernel": kernel, "loss": float(loss)})
            runs.append((compiled, state, data))
            print(f"speed: length {length} {kernel} compiled, loss {float(loss):.6f}", flush=True)
    rates = interleaved(runs, rounds, steps, lambda r: jax.block_until_ready(r[0](*r[1:])))
    for row, rate in zip(speed_rows, rates, strict=True):
        row["steps_per_s"] = rate

    mib = 2.0**20
    print(f"\nsmall (2 scanned layers), batch {args.batch}, {args.dtype}, {machine()}")
    print("\nBytes of one value_and_grad step (memory_analysis temp; formula: "
          "nnx_shard.models._memory):")
    cols = ["length"] + [f"{k} temp MiB" for k in kernels] + [f"{k} formula MiB"
                                                               for k in kernels]
    table = []
    for length in lengths:
        by = {r["kernel"]: r for r in mem_rows if r["length"] == length}
        table.append([length] + [f"{by[k]['temp_bytes'] / mib:.1f}" for k in kernels]
                     + [f"{by[k]['formula_bytes'] / mib:.1f}" for k in kernels])
    print_table(cols, table)
    if len(lengths) > 1:
        print("\nGrowth of temp per doubling of the length:")
        growth = []
        for a, b in itertools.pairwise(lengths):
            ra = {r["kernel"]: r["temp_bytes"] for r in mem_rows if r["length"] == a}
            rb = {r["kernel"]: r["temp_bytes"] for r in mem_rows if r["length"] == b}
            growth.append([f"{a} -> {b}"] + [f"{rb[k] / ra[k]:.2f}x" for k in kernels])
        print_table(["lengths", *kernels], growth)
    print(f"\nSteps/s ({rounds} interleaved rounds of {steps} steps, median):")
    base = {r["length"]: r["steps_per_s"] for r in speed_rows if r["kernel"] == kernels[0]}
    print_table(["length", "kernel", "steps/s", f"vs {kernels[0]}"],
                [[r["length"], r["kernel"], f"{r['steps_per_s']:.3f}",
                  f"{r['steps_per_s'] / base[r['length']]:.2f}x"] for r in speed_rows])
    write_json(RESULTS.with_name("attention_quick.json") if args.quick else RESULTS, {
        "model": "small, layers=2, scan_layers", "batch": args.batch, "dtype": args.dtype,
        "jax": jax.__version__, "backend": jax.default_backend(), "machine": machine(),
        "quick": args.quick, "rounds": rounds, "steps_per_round": steps,
        "memory": mem_rows, "speed": speed_rows,
    })


if __name__ == "__main__":
    main()
