"""What LoRA adapters cost, from XLA's own count: one train step and one decode step.

Compiles (``jax.jit(...).lower(abstract args).compile()``, nothing allocated: the
model is ``nnx.eval_shape``'d) and reads ``cost_analysis()["flops"]`` and
``memory_analysis().temp_size_in_bytes`` of:

* ``full``: a train step (loss, gradients, an SGD update) of every ``nnx.Param``
  of the base model (full fine-tuning);
* ``adapters``: the same step of the adapters alone (``wrt=nnx.LoRAParam``) on the
  model with rank-16 adapters on all seven projections (q, k, v, o, gate, up,
  down), the base frozen;
* ``decode``: one decode step (one token against a 1024-position cache) of the
  base model and of the model with unmerged adapters.

The model: one Llama-3-8B block (``ns.models.get_config("llama3-8b")`` with
``layers=1``, vocab 4096, bfloat16), batch 1 x 1024 tokens. The ratios are the
point: the adapter-only step against full fine-tuning (flops and temporary bytes),
the adapted decode step against the base's.

Run (about 2 minutes on 2 CPU cores; ``--quick``: 256 tokens)::

    .venv/bin/python benchmarks/lora_cost.py
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from _common import machine, print_table, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "lora_cost.json"
ALL = r"attn/(q|k|v|o)$|mlp/(gate|up|down)$"
RANK = 16


def config(**overrides: Any) -> Any:
    """The one-block Llama-3-8B shape (vocab 4096, bfloat16) the table measures."""
    from nnx_shard.models import get_config

    base = dict(layers=1, vocab=4096)
    return dataclasses.replace(get_config("llama3-8b"), **(base | overrides))


def abstract(cfg: Any, adapters: bool) -> Any:
    """The model of ``cfg``, shapes only, with rank-16 adapters on every projection."""
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import Llama

    def make() -> Any:
        model = Llama(cfg, rngs=nnx.Rngs(0))
        return ns.lora(model, RANK, 2 * RANK, targets=ALL) if adapters else model

    return nnx.eval_shape(make)


def train_cost(cfg: Any, tokens: int, adapters: bool) -> dict[str, float]:
    """Flops and temporary bytes of one compiled train step: the adapters alone
    (``adapters``) or every Param of the base model."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_shard.models import lm_loss

    model = abstract(cfg, adapters)
    wrt = nnx.LoRAParam if adapters else nnx.Param
    graphdef, trained, frozen = nnx.split(model, wrt, ...)
    batch = {k: jax.ShapeDtypeStruct((1, tokens), jnp.int32) for k in ("inputs", "targets")}

    def step(trained: Any, frozen: Any, batch: dict[str, jax.Array]) -> Any:
        def loss(p: Any) -> jax.Array:
            return lm_loss(nnx.merge(graphdef, p, frozen), batch)

        value, grads = jax.value_and_grad(loss)(trained)
        return value, jax.tree.map(lambda p, g: p - (1e-3 * g).astype(p.dtype), trained, grads)

    compiled = jax.jit(step, donate_argnums=0).lower(trained, frozen, batch).compile()
    return _cost(compiled)


def decode_cost(cfg: Any, cache: int, adapters: bool) -> dict[str, float]:
    """Flops and temporary bytes of one compiled decode step (one token after a
    ``cache``-position prompt)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def make() -> Any:
        import nnx_shard as ns
        from nnx_shard.models import Llama

        model = Llama(cfg, rngs=nnx.Rngs(0))
        if adapters:
            ns.lora(model, RANK, 2 * RANK, targets=ALL)
        model.init_cache(1, cache)
        return model

    graphdef, state = nnx.split(nnx.eval_shape(make))
    token = jax.ShapeDtypeStruct((1, 1), jnp.int32)

    def step(state: Any, token: jax.Array) -> Any:
        model = nnx.merge(graphdef, state)
        logits = model.decode(token)
        return logits, nnx.state(model)

    return _cost(jax.jit(step, donate_argnums=0).lower(state, token).compile())


def _cost(compiled: Any) -> dict[str, float]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    memory = compiled.memory_analysis()
    return {"flops": float(cost["flops"]), "temp_bytes": float(memory.temp_size_in_bytes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 tokens")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    args = ap.parse_args()
    tokens = 256 if args.quick else 1024
    cfg = config()
    full = train_cost(cfg, tokens, adapters=False)
    lora = train_cost(cfg, tokens, adapters=True)
    base_dec = decode_cost(cfg, tokens, adapters=False)
    lora_dec = decode_cost(cfg, tokens, adapters=True)
    rows = [
        ["train: full fine-tuning", f"{full['flops'] / 1e9:.1f}",
         f"{full['temp_bytes'] / 2**20:.1f}", "1.00x", "1.00x"],
        ["train: adapters only", f"{lora['flops'] / 1e9:.1f}", f"{lora['temp_bytes'] / 2**20:.1f}",
         f"{lora['flops'] / full['flops']:.2f}x",
         f"{lora['temp_bytes'] / full['temp_bytes']:.2f}x"],
        ["decode: base", f"{base_dec['flops'] / 1e9:.3f}",
         f"{base_dec['temp_bytes'] / 2**20:.1f}", "1.00x", "1.00x"],
        ["decode: unmerged adapters", f"{lora_dec['flops'] / 1e9:.3f}",
         f"{lora_dec['temp_bytes'] / 2**20:.1f}", f"{lora_dec['flops'] / base_dec['flops']:.2f}x",
         f"{lora_dec['temp_bytes'] / max(base_dec['temp_bytes'], 1):.2f}x"],
    ]
    print(f"One Llama-3-8B block (vocab 4096, bf16), batch 1 x {tokens} tokens, rank {RANK} on "
          f"q/k/v/o/gate/up/down; {machine()}")
    print_table(["program", "GFLOPs", "temp MiB", "flops ratio", "temp ratio"], rows)
    write_json(args.out, {
        "machine": machine(), "tokens": tokens, "rank": RANK,
        "model": "llama3-8b, layers=1, vocab=4096, bfloat16",
        "measure": "jax.jit(step).lower(abstract args).compile(): cost_analysis()['flops'], "
                   "memory_analysis().temp_size_in_bytes",
        "train_full": full, "train_adapters": lora, "decode_base": base_dec,
        "decode_adapters": lora_dec,
        "ratios": {"train_flops": lora["flops"] / full["flops"],
                   "train_temp_bytes": lora["temp_bytes"] / full["temp_bytes"],
                   "decode_flops": lora_dec["flops"] / base_dec["flops"]},
    })


if __name__ == "__main__":
    main()
