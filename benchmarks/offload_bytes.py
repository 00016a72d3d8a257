"""Device and host bytes of the compiled Trainer step with host offload.

For dp, fsdp, fsdp_tp and zero2 on 8 simulated CPU devices, each with
``offload=None``, ``"optimizer"`` and ``"optimizer+params"``
(``ns.strategies.get(name, offload=...)``): the reference transformer with
embed=256, heads=4, head_dim=64, mlp=1024, vocab=512, ``scan_layers=True``
(LAYERS layers, length LENGTH), AdamW, the Trainer's fused call for K=1 steps of a
global batch of BATCH sequences, NaN guard included, lowered on the model and
optimizer as ``sharded_init`` / ``sharded_optimizer`` place them, and compiled. :func:`nnx_shard.planner.memory_split` splits
its per-device bytes into device memory (arguments + outputs + temporaries - aliased)
and host memory; on CPU the host figures are derived from the program's entry layout
(``S(5)`` arrays), as XLA's CPU backend reports none.

Run (about a minute on 2 CPU cores)::

    .venv/bin/python benchmarks/offload_bytes.py

Results go to ``benchmarks/results/offload_bytes.json``; ``--quick`` runs fsdp only.
"""

from __future__ import annotations

import os

from _common import bytes_parser, machine, print_table, simulated_cpu, write_json

os.environ.update(simulated_cpu(8))  # before jax is imported

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import nnx_shard as ns
from nnx_shard.models import Decoder, get_config, lm_loss
from nnx_shard.planner import memory_split

RESULTS = Path(__file__).resolve().parent / "results" / "offload_bytes.json"
STRATEGIES = ("dp", "fsdp", "fsdp_tp", "zero2")
OFFLOADS = (None, "optimizer", "optimizer+params")
LAYERS, LENGTH, BATCH = 4, 64, 16


def config():
    return dataclasses.replace(get_config("tiny"), embed=256, heads=4, head_dim=64, mlp=1024,
                               vocab=512, layers=LAYERS, length=LENGTH, scan_layers=True)


def measure(name: str, offload: str | None) -> dict:
    cfg = config()
    strategy = ns.strategies.get(name, offload=offload)
    mesh = strategy.make_mesh()
    # Concrete arrays, as fit is given them: lowered on abstract state, the call leaves
    # the outputs' layout to XLA (it has no committed input sharding to pin them to).
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
    opt = ns.sharded_optimizer(model, optax.adamw(1e-3), mesh, strategy)
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=strategy, steps_per_call=1,
                         batch_names=("batch", "length"))
    batch = {k: jax.ShapeDtypeStruct((1, BATCH, LENGTH), jnp.int32)
             for k in ("inputs", "targets")}
    split = memory_split(trainer.lower(batch).compile())

    def per_device(tree):
        return sum(_shard_bytes(x) for x in jax.tree.leaves(tree))

    return {"strategy": name, "offload": offload, "mesh": dict(mesh.shape),
            "device": split.device, "host": split.host, "derived": split.derived,
            "device_bytes": split.device_bytes, "host_bytes": split.host_bytes,
            "params_bytes": per_device(nnx.state(model, nnx.Param)),
            "optimizer_bytes": per_device(nnx.state(opt))}


def _shard_bytes(x) -> int:
    return math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    args = bytes_parser(__doc__, "fsdp only (a smoke test)", RESULTS).parse_args()
    rows = [measure(name, off) for name in (("fsdp",) if args.quick else STRATEGIES)
            for off in OFFLOADS]
    print(f"\n{machine()}; per-device MiB of the compiled Trainer step (K=1)\n")
    base = {r["strategy"]: r for r in rows if r["offload"] is None}
    print_table(
        ["strategy", "offload", "device args", "device out", "device temp", "device total",
         "host args", "host total", "device total change", "opt. state", "params"],
        [[r["strategy"], r["offload"] or "-", mib(r["device"]["argument"]),
          mib(r["device"]["output"]), mib(r["device"]["temp"]), mib(r["device_bytes"]),
          mib(r["host"]["argument"]), mib(r["host_bytes"]),
          mib(r["device_bytes"] - base[r["strategy"]]["device_bytes"]),
          mib(r["optimizer_bytes"]), mib(r["params_bytes"])] for r in rows])
    write_json(args.out, {"config": {"embed": 256, "heads": 4, "head_dim": 64, "mlp": 1024,
                                     "vocab": 512, "layers": LAYERS, "length": LENGTH,
                                     "batch": BATCH, "scan_layers": True, "devices": 8,
                                     "optimizer": "adamw", "steps_per_call": 1},
                          "rows": rows})


if __name__ == "__main__":
    main()
