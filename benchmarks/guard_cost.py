"""What one pass of fit's NaN guard over the training state costs per fused call.

``Trainer.fit`` checks, once per fused call, that the updated model and optimizer
state is finite and selects the state back to the one before the call when it
is not. This times that work alone: one finiteness check and one select-copy
pass over the float state of the ``small`` reference Transformer with AdamW,
under ``dp`` (state replicated) and ``fsdp`` (state sharded 1/N), on 8
simulated CPU devices: the best of 20 blocking calls.

Run::

    .venv/bin/python benchmarks/guard_cost.py
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import nnx_shard as ns
from nnx_shard.models import Transformer, get_config


@jax.jit
def check_and_select(leaves):
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
    return [jnp.where(ok, x * 1.0001, x) for x in leaves], ok


def main() -> None:
    n = jax.device_count()
    for name in ("dp", "fsdp"):
        strat = ns.strategies.get(name)
        mesh = ns.make_mesh({"data": n})
        model = strat.sharded_init(lambda: Transformer(get_config("small"), rngs=nnx.Rngs(0)),
                                   mesh)
        opt = strat.optimizer(model, optax.adam(1e-3), mesh)
        leaves = [x for x in jax.tree.leaves(nnx.state((model, opt)))
                  if jnp.issubdtype(x.dtype, jnp.floating)]
        per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
        jax.block_until_ready(check_and_select(leaves))
        best = float("inf")
        for _ in range(20):
            t = time.perf_counter()
            jax.block_until_ready(check_and_select(leaves))
            best = min(best, time.perf_counter() - t)
        print(f"{name}: {len(leaves)} float leaves, {per_device / 2**20:.1f} MiB per device; one "
              f"check + one select-copy pass on {n} simulated devices: {best * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
