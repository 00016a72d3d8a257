"""Per-device memory and speed of context parallelism: ring vs all-gather attention.

The ``small`` transformer (embed 128, 4 heads of 32, mlp 512, vocab 512) with
2 scanned layers and the dense attention kernel, one sequence of ``length`` tokens, on a mesh
``data=1, context=C`` of the first C devices (C = 1 is the dense one-device
program), under ``ns.strategies.get("cp")``'s rules with ``attention="ring"``
or ``"allgather"``. The step is ``jax.value_and_grad(lm_loss)`` over the
parameters.

* bytes: ``compile().memory_analysis()`` of the step, per device (nothing is
  run): ``temp`` (activations and attention scratch), and ``peak`` = arguments
  + outputs + temp. The parameters (replicated under cp) are part of
  arguments and outputs, so ``temp`` is where 1/C shows.
* steps/s: the median of interleaved rounds of a few steps each, blocking on
  every result, at shorter lengths (XLA CPU runs the simulated devices' work
  and collectives on the host's cores, so this shows overheads, not a speedup).

Results go to ``benchmarks/results/context.json``. Run (about 3 minutes on 2 shared
CPU cores; ``--quick``: short sequences)::

    .venv/bin/python benchmarks/context.py [--quick]
"""

from __future__ import annotations

import os

from _common import machine, print_table, simulated_cpu, time_compiled, write_json

os.environ.update(simulated_cpu(8))  # before jax is imported

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import nnx_shard as ns
from nnx_shard.models import Decoder, get_config, lm_loss

RESULTS = Path(__file__).resolve().parent / "results" / "context.json"


def build(length: int, c: int, mode: str):
    # The dense kernel: this compares distributions (benchmarks/attention.py, kernels).
    cfg = dataclasses.replace(get_config("small"), length=length, layers=2, scan_layers=True,
                              attention="dense")
    mesh = ns.make_mesh({"data": 1, "context": c}, devices=jax.devices()[:c])
    rules = ns.strategies.get("cp").rules.with_options(attention=mode)
    model = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, rules)
    graphdef, state = nnx.split(model)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (1, length + 1)).astype(np.int32)
    host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def step(state, data):
        return jax.value_and_grad(lambda s: lm_loss(nnx.merge(graphdef, s), data))(state)

    with ns.use(mesh, rules):
        data = ns.shard_batch(host, mesh, rules, ("batch", "length"))
        t0 = time.perf_counter()
        compiled = jax.jit(step).lower(state, data).compile()
        seconds = time.perf_counter() - t0
    return cfg, mesh, rules, compiled, state, data, seconds


def materialize(cfg, mesh, rules, state):
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, rules)
    return nnx.state(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="short sequences, 1 round (writes context_quick.json)")
    args = parser.parse_args()
    mem_lengths = (256,) if args.quick else (2048, 4096, 8192)
    speed_lengths = (128,) if args.quick else (512, 1024)
    rounds, steps = (1, 1) if args.quick else (3, 3)
    cs = [c for c in (1, 2, 4, 8) if c <= jax.device_count()]

    def cases(lengths):
        for length in lengths:
            for c in cs:
                for mode in (("ring",) if c == 1 else ("ring", "allgather")):
                    yield length, c, mode

    mem_rows = []
    for length, c, mode in cases(mem_lengths):
        *_, compiled, _, _, seconds = build(length, c, mode)
        m = compiled.memory_analysis()
        peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        mem_rows.append({"length": length, "context": c, "attention": "local" if c == 1 else mode,
                         "temp_bytes": m.temp_size_in_bytes, "peak_bytes": peak,
                         "compile_s": seconds})
        print(f"bytes: length {length} C={c} {mem_rows[-1]['attention']}: temp "
              f"{m.temp_size_in_bytes / 2**20:.1f} MiB", flush=True)

    speed_rows, runs = [], []
    for length, c, mode in cases(speed_lengths):
        cfg, mesh, rules, compiled, state, data, _ = build(length, c, mode)
        state = materialize(cfg, mesh, rules, state)
        jax.block_until_ready(compiled(state, data))  # warm up
        speed_rows.append({"length": length, "context": c,
                           "attention": "local" if c == 1 else mode})
        runs.append((compiled, state, data))
    time_compiled(speed_rows, runs, rounds, steps)

    mib = 2.0**20
    print(f"\nsmall (2 scanned layers), batch 1, {machine()}")
    print("\nPer-device bytes of one value_and_grad step (memory_analysis):")
    base = {r["length"]: r["temp_bytes"] for r in mem_rows if r["context"] == 1}
    print_table(["length", "C", "attention", "temp MiB", "peak MiB", "temp vs C=1"],
                [[r["length"], r["context"], r["attention"], f"{r['temp_bytes'] / mib:.1f}",
                  f"{r['peak_bytes'] / mib:.1f}", f"{r['temp_bytes'] / base[r['length']]:.3f}"]
                 for r in mem_rows])
    print("\nSteps/s (value_and_grad, XLA CPU, simulated devices share the host's cores):")
    print_table(["length", "C", "attention", "steps/s"],
                [[r["length"], r["context"], r["attention"], f"{r['steps_per_s']:.2f}"]
                 for r in speed_rows])
    write_json(RESULTS.with_name("context_quick.json") if args.quick else RESULTS, {
        "model": "small, layers=2, scan_layers", "batch": 1, "jax": jax.__version__,
        "backend": jax.default_backend(), "devices": jax.device_count(),
        "quick": args.quick, "rounds": rounds, "steps_per_round": steps,
        "memory": mem_rows, "speed": speed_rows,
    })


if __name__ == "__main__":
    main()
