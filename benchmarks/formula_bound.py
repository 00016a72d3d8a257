"""How far the activation formula is from XLA's compiled figure, per preset.

The planner (``nnx-shard plan --auto``) skips compiling a layout when the
formula alone is over ``_formula.PRUNE_MARGIN`` x the memory budget; that is
safe only while the formula stays near or under XLA's compiled total. For every
preset x mesh factorisation of 8 simulated CPU devices x remat policy, this
compiles the fused AdamW train step of a scanned reference Decoder
(abstract: nothing allocated; pipeline presets with 2 x stages microbatches)
and prints formula / compiled per device, sorted, plus the range.

Run (minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/formula_bound.py --model small --batch 32 --seq 128
    .venv/bin/python benchmarks/formula_bound.py --model tiny --batch 16 --seq 32 \\
        --config "heads=8,head_dim=4,layers=4,length=32" --remat none,full

``--strategies cp,fsdp_cp`` limits the presets.
"""

from __future__ import annotations

import os

from _common import simulated_cpu

os.environ.update(simulated_cpu(8))  # before jax is imported

import argparse
import dataclasses

import jax
from flax import nnx

import nnx_shard as ns
from nnx_shard import strategies
from nnx_shard._axes import sizes_str
from nnx_shard._optimizers import get as optimizer
from nnx_shard.models import Decoder, get_config
from nnx_shard.planner import _compile, _formula
from nnx_shard.planner._candidates import enumerate_candidates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--config", default="", help="config overrides, e.g. heads=8,layers=4")
    parser.add_argument("--strategies", default=",".join(strategies.NAMES))
    args = parser.parse_args()
    overrides = {k: int(v) for k, v in (kv.split("=") for kv in args.config.split(",") if kv)}
    base = dataclasses.replace(get_config(args.model), scan_layers=True, **overrides)
    layouts, _ = enumerate_candidates(jax.device_count(), args.strategies.split(","))
    tx = optimizer("adamw")
    ratios = []
    for name, sizes in layouts:
        for remat in args.remat.split(","):
            cfg = dataclasses.replace(base, remat=remat)
            strat = strategies.get(name)
            mesh = ns.make_mesh(sizes, devices=jax.devices()[:jax.device_count()])
            mb = 2 * sizes["stage"] if "stage" in sizes else 1
            label = f"{name} {sizes_str(sizes)} remat={remat} mb={mb}"
            try:
                abstract = ns.abstract_init(lambda cfg=cfg: Decoder(cfg, rngs=nnx.Rngs(0)),
                                            mesh, strat)
                formula = _formula.formula_bytes(abstract, cfg, strat, sizes, tx,
                                                 args.batch // mb, args.seq, remat)
                compiled = _compile.compile_step(
                    lambda cfg=cfg: Decoder(cfg, rngs=nnx.Rngs(0)), name, sizes,
                    batch=args.batch, seq=args.seq, microbatches=mb)["total"]
            except Exception as e:  # a layout the model cannot take: said, not counted
                print(f"{label}: {type(e).__name__}: {' '.join(str(e).split())[:100]}")
                continue
            ratios.append((formula / compiled, label, formula, compiled))
            print(f"{label}: formula {formula / 2**20:.2f} MiB, compiled {compiled / 2**20:.2f} "
                  f"MiB, ratio {formula / compiled:.2f}", flush=True)
    ratios.sort()
    print("\n| formula / compiled | layout |\n|---|---|")
    for r, label, _, _ in ratios:
        print(f"| {r:.2f} | {label} |")
    if ratios:
        print(f"\nrange {ratios[0][0]:.2f}-{ratios[-1][0]:.2f} over {len(ratios)} layouts; "
              f"the planner prunes past {_formula.PRUNE_MARGIN}x")


if __name__ == "__main__":
    main()
