"""Memory, compile time and speed of the reference model's remat policies.

For each ``ReferenceConfig.remat`` policy (``none``, ``full``, ``dots``, and
``offload`` where the backend has pinned host memory), the ``small`` model with
``scan_layers=True`` and ``length=256``, batch 16 x 256, one device: a
``jax.jit`` of ``jax.value_and_grad(lm_loss)`` on the split state is lowered and
compiled, and the table shows

* ``temp``, ``args``, ``out``: ``compile().memory_analysis()`` bytes (temp is
  where the activations saved for the backward pass live);
* ``compile s``: lower + compile seconds;
* ``steps/s``: the median over interleaved rounds (policies in a rotating order)
  of ``STEPS`` steps each, blocking on every result.

``--unrolled`` adds the same rows with ``scan_layers=False``. Results go to
``benchmarks/results/remat.json``.

Run (about 2 minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/remat.py

``--quick`` shortens every measurement (a smoke test of the script only).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _common import machine, print_table, time_compiled, write_json
from flax import nnx

from nnx_shard.models import REMAT_POLICIES, Decoder, get_config, lm_loss, remat_policy

RESULTS = Path(__file__).resolve().parent / "results" / "remat.json"


def supported() -> list[str]:
    """The policies this backend can build (``offload`` needs pinned host memory)."""
    names = []
    for name in REMAT_POLICIES:
        try:
            remat_policy(name)
        except ValueError as e:
            print(f"skipping remat={name!r}: {e}")
            continue
        names.append(name)
    return names


def build(remat: str, scan_layers: bool, batch: int, length: int):
    cfg = dataclasses.replace(get_config("small"), length=length, scan_layers=scan_layers,
                              remat=remat)
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (batch, length)),
                         jnp.int32)
    data = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}

    def step(state, data):
        return jax.value_and_grad(lambda s: lm_loss(nnx.merge(graphdef, s), data))(state)

    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(state, data).compile()
    seconds = time.perf_counter() - t0
    return compiled, state, data, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, 1 round")
    parser.add_argument("--unrolled", action="store_true",
                        help="also measure scan_layers=False")
    args = parser.parse_args()
    batch, length = (2, 32) if args.quick else (16, 256)
    rounds, steps = (1, 1) if args.quick else (5, 5)

    cases = [(r, True) for r in supported()]
    if args.unrolled:
        cases += [(r, False) for r, _ in cases]
    rows, runs = [], []
    for remat, scan in cases:
        compiled, state, data, seconds = build(remat, scan, batch, length)
        jax.block_until_ready(compiled(state, data))  # warm up
        m = compiled.memory_analysis()
        rows.append({"remat": remat, "scan_layers": scan, "temp_bytes": m.temp_size_in_bytes,
                     "argument_bytes": m.argument_size_in_bytes,
                     "output_bytes": m.output_size_in_bytes, "compile_s": seconds})
        runs.append((compiled, state, data))
    time_compiled(rows, runs, rounds, steps)

    mib = 2.0**20
    print(f"small, batch {batch} x {length}, {machine()}")
    print_table(["remat", "scan", "temp MiB", "args MiB", "out MiB", "compile s", "steps/s"],
                [[row["remat"], row["scan_layers"], f"{row['temp_bytes'] / mib:.1f}",
                  f"{row['argument_bytes'] / mib:.1f}", f"{row['output_bytes'] / mib:.1f}",
                  f"{row['compile_s']:.1f}", f"{row['steps_per_s']:.2f}"] for row in rows])
    write_json(RESULTS, {
        "model": "small", "batch": batch, "length": length, "jax": jax.__version__,
        "backend": jax.default_backend(), "devices": jax.device_count(),
        "rounds": rounds, "steps_per_round": steps, "rows": rows,
    })


if __name__ == "__main__":
    main()
