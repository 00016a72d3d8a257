"""Per-device bytes of dp, ZeRO-1, ZeRO-2 and FSDP: where each keeps the gradients.

For dp, zero1, zero2 and fsdp on 8 simulated CPU devices (mesh data=8, the presets'
default Auto axes): the reference transformer ``tiny`` with embed=256, heads=4,
head_dim=64, mlp=1024, vocab=512, ``scan_layers=True`` (2 layers, length 16), AdamW,
M = 1 and 4 microbatches of 8 sequences (a global batch of 8 x M). Two programs each,
lowered on the model and optimizer as ``sharded_init`` / ``sharded_optimizer`` place
them and compiled; XLA's ``memory_analysis()`` per device:

* the train step: ``Trainer``'s fused call for K=1 steps (NaN guard included):
  argument, output and temporary bytes;
* the gradient program: ``jax.jit`` of ``ns.value_and_grad(lm_loss, microbatches=M)``
  under ``ns.use(mesh, strategy.rules)``: its output bytes are the loss and the
  gradients in the layout the step holds them in after the reduction.

What the table shows. zero1 and zero2 hold the same parameters (replicated) and
optimizer state (1/8 over ``embed``); they differ in the rules option ``gradients``
that ``value_and_grad`` lays each reduced gradient out by: zero1's is its parameters'
table (each device holds whole gradients, as ZeRO-1 says), zero2's the optimizer
state's (each gradient reduced straight to the 1/8 slice its optimizer state owns, and
with microbatches the running sum kept at 1/8 inside the accumulation loop). Before
the option existed zero1's compiled step was identical to zero2's: XLA's sharding
propagation already reduced zero1's gradients to the optimizer state's shards (same
collectives, same temporaries), so zero1 was in effect ZeRO-2. With the option, zero1
keeps whole gradients and does not reduce-scatter; zero2 does.

On XLA's CPU backend a reduce-scatter is compiled as an all-reduce followed by a local
dynamic-slice (XLA's GPU compiler rewrites that pair into a reduce-scatter, its CPU
compiler does not), so the collective bytes of zero2 equal dp's here; the saving is in the
bytes each device keeps (tests/train/test_zero.py reads that pattern from the HLO).

Run (about a minute on 2 CPU cores)::

    .venv/bin/python benchmarks/zero_bytes.py

Results go to ``benchmarks/results/zero_bytes.json``; ``--quick`` runs M=1 only.
"""

from __future__ import annotations

import os

from _common import bytes_parser, machine, print_table, simulated_cpu, write_json

os.environ.update(simulated_cpu(8))  # before jax is imported

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

import nnx_shard as ns
from nnx_shard.models import Decoder, get_config, lm_loss

RESULTS = Path(__file__).resolve().parent / "results" / "zero_bytes.json"
STRATEGIES = ("dp", "zero1", "zero2", "fsdp")
MICROBATCHES = (1, 4)
PER_MICROBATCH, LENGTH = 8, 16


def config():
    return dataclasses.replace(get_config("tiny"), embed=256, heads=4, head_dim=64, mlp=1024,
                               vocab=512, length=LENGTH, scan_layers=True)


def measure(name: str, m: int) -> dict:
    cfg = config()
    strategy = ns.strategies.get(name)
    mesh = strategy.make_mesh(8)
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
    opt = ns.sharded_optimizer(model, optax.adamw(1e-3), mesh, strategy)
    batch = PER_MICROBATCH * m
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=strategy, steps_per_call=1,
                         microbatches=m, batch_names=("batch", "length"))
    tokens = jax.ShapeDtypeStruct((1, batch, LENGTH), jnp.int32)
    step = trainer.lower({"inputs": tokens, "targets": tokens}).compile().memory_analysis()

    spec = strategy.rules.spec(("batch", "length"), shape=(batch, LENGTH), mesh=mesh)
    one = jax.ShapeDtypeStruct((batch, LENGTH), jnp.int32, sharding=NamedSharding(mesh, spec))
    graphdef, state = nnx.split(model)
    grad_fn = ns.value_and_grad(lm_loss, microbatches=m)
    with ns.use(mesh, strategy.rules):
        grads = jax.jit(lambda st, b: grad_fn(nnx.merge(graphdef, st), b)).lower(
            state, {"inputs": one, "targets": one}).compile().memory_analysis()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {"strategy": name, "microbatches": m, "batch": batch, "mesh": dict(mesh.shape),
            "argument": step.argument_size_in_bytes, "output": step.output_size_in_bytes,
            "temp": step.temp_size_in_bytes, "alias": step.alias_size_in_bytes,
            "grad_output": grads.output_size_in_bytes, "param_bytes": param_bytes}


def mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def main() -> None:
    args = bytes_parser(__doc__, "M=1 only (a smoke test)", RESULTS).parse_args()
    rows = [measure(name, m) for m in ((1,) if args.quick else MICROBATCHES)
            for name in STRATEGIES]
    print(f"\n{machine()}; per-device MB (10^6 bytes) of the compiled programs\n")
    print_table(["M", "strategy", "step arguments", "step outputs", "step temp",
                 "gradient program outputs"],
                [[r["microbatches"], r["strategy"], mb(r["argument"]), mb(r["output"]),
                  mb(r["temp"]), mb(r["grad_output"])] for r in rows])
    cfg = config()
    write_json(args.out, {"config": {"embed": cfg.embed, "heads": cfg.heads,
                                     "head_dim": cfg.head_dim, "mlp": cfg.mlp,
                                     "vocab": cfg.vocab, "layers": cfg.layers,
                                     "length": LENGTH, "per_microbatch": PER_MICROBATCH,
                                     "scan_layers": True, "devices": 8, "optimizer": "adamw",
                                     "steps_per_call": 1},
                          "rows": rows})


if __name__ == "__main__":
    main()
