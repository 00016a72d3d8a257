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

``--adamw`` adds the two train steps with ``optax.adamw`` in place of SGD (on a
GPU, XLA writes SGD's update into the gradient's matrix product, so full
fine-tuning keeps no weight gradient there; AdamW needs each gradient);
``--time R`` also runs every program on real arrays and reports its median
milliseconds (meant for an accelerator: on 2 CPU cores a step takes seconds).

Run (about 2 minutes on 2 CPU cores; ``--quick``: 256 tokens)::

    .venv/bin/python benchmarks/lora_cost.py
    JAX_PLATFORMS=cuda .venv/bin/python benchmarks/lora_cost.py --adamw --time 5
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from _common import cost_parser, machine, median_ms, print_table, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "lora_cost.json"
ALL = r"attn/(q|k|v|o)$|mlp/(gate|up|down)$"
RANK = 16
STEPS = 5  # calls per timed round (--time)


def config(**overrides: Any) -> Any:
    """The one-block Llama-3-8B shape (vocab 4096, bfloat16) the table measures."""
    from nnx_shard.models import get_config

    base = dict(layers=1, vocab=4096)
    return dataclasses.replace(get_config("llama3-8b"), **(base | overrides))


def abstract(cfg: Any, adapters: bool, real: bool = False) -> Any:
    """The model of ``cfg``, shapes only (``real``: allocated, to time it), with
    rank-16 adapters on every projection."""
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import Decoder

    def make() -> Any:
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        return ns.lora(model, RANK, 2 * RANK, targets=ALL) if adapters else model

    return make() if real else nnx.eval_shape(make)


def train_cost(cfg: Any, tokens: int, adapters: bool, rounds: int = 0,
               adamw: bool = False) -> dict[str, float]:
    """Flops and temporary bytes of one compiled train step: the adapters alone
    (``adapters``) or every Param of the base model, updated by SGD (``adamw``:
    by ``optax.adamw``, whose moments are arguments); with ``rounds``, also its
    median milliseconds on real arrays (``ms``)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_shard.models import lm_loss

    model = abstract(cfg, adapters, real=rounds > 0)
    wrt = nnx.LoRAParam if adapters else nnx.Param
    graphdef, trained, frozen = nnx.split(model, wrt, ...)
    batch = {k: jax.ShapeDtypeStruct((1, tokens), jnp.int32) for k in ("inputs", "targets")}

    def loss(p: Any, frozen: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return lm_loss(nnx.merge(graphdef, p, frozen), batch)

    def step(trained: Any, frozen: Any, batch: dict[str, jax.Array]) -> Any:
        value, grads = jax.value_and_grad(loss)(trained, frozen, batch)
        return value, jax.tree.map(lambda p, g: p - (1e-3 * g).astype(p.dtype), trained, grads)

    if adamw:
        import optax

        opt = optax.adamw(1e-3)
        moments = jax.eval_shape(opt.init, trained)

        def adam_step(held: Any, frozen: Any, batch: dict[str, jax.Array]) -> Any:
            params, moments = held
            value, grads = jax.value_and_grad(loss)(params, frozen, batch)
            updates, moments = opt.update(grads, moments, params)
            return value, (optax.apply_updates(params, updates), moments)

        compiled = jax.jit(adam_step, donate_argnums=0).lower(
            (trained, moments), frozen, batch).compile()
        return _cost(compiled)
    compiled = jax.jit(step, donate_argnums=0).lower(trained, frozen, batch).compile()
    cost = _cost(compiled)
    if rounds:
        tokens_in = jnp.zeros((1, tokens), jnp.int32)
        state = {"trained": trained}

        def run() -> None:
            value, state["trained"] = compiled(
                state["trained"], frozen, {"inputs": tokens_in, "targets": tokens_in})
            jax.block_until_ready(value)

        cost["ms"] = median_ms(run, rounds, STEPS)
    return cost


def decode_cost(cfg: Any, cache: int, adapters: bool, rounds: int = 0) -> dict[str, float]:
    """Flops and temporary bytes of one compiled decode step (one token after a
    ``cache``-position prompt); with ``rounds``, also its median milliseconds."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def make() -> Any:
        import nnx_shard as ns
        from nnx_shard.models import Decoder

        model = Decoder(cfg, rngs=nnx.Rngs(0))
        if adapters:
            ns.lora(model, RANK, 2 * RANK, targets=ALL)
        model.init_cache(1, cache)
        return model

    graphdef, state = nnx.split(make() if rounds else nnx.eval_shape(make))
    token = jax.ShapeDtypeStruct((1, 1), jnp.int32)

    def step(state: Any, token: jax.Array) -> Any:
        model = nnx.merge(graphdef, state)
        logits = model.decode(token)
        return logits, nnx.state(model)

    compiled = jax.jit(step, donate_argnums=0).lower(state, token).compile()
    cost = _cost(compiled)
    if rounds:
        # Each step writes one cache position: the rounds stay inside the cache.
        real_token = jnp.zeros((1, 1), jnp.int32)
        held = {"state": state}

        def run() -> None:
            logits, held["state"] = compiled(held["state"], real_token)
            jax.block_until_ready(logits)

        cost["ms"] = median_ms(run, rounds, STEPS)
    return cost


def _cost(compiled: Any) -> dict[str, float]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    memory = compiled.memory_analysis()
    return {"flops": float(cost["flops"]), "temp_bytes": float(memory.temp_size_in_bytes)}


def main() -> None:
    ap = cost_parser(__doc__, "256 tokens", RESULTS, f"program ({STEPS} calls a round)")
    ap.add_argument("--adamw", action="store_true",
                    help="also the two train steps with optax.adamw instead of SGD")
    args = ap.parse_args()
    tokens = 256 if args.quick else 1024
    cfg = config()
    full = train_cost(cfg, tokens, adapters=False, rounds=args.time)
    lora = train_cost(cfg, tokens, adapters=True, rounds=args.time)
    base_dec = decode_cost(cfg, tokens, adapters=False, rounds=args.time)
    lora_dec = decode_cost(cfg, tokens, adapters=True, rounds=args.time)
    adam = ({"full": train_cost(cfg, tokens, adapters=False, adamw=True),
             "adapters": train_cost(cfg, tokens, adapters=True, adamw=True)}
            if args.adamw else None)
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
    columns = ["program", "GFLOPs", "temp MiB", "flops ratio", "temp ratio"]
    if args.time:
        columns.append("ms (median)")
        for row, cost in zip(rows, (full, lora, base_dec, lora_dec), strict=True):
            row.append(f"{cost['ms']:.3f}")
    if adam:
        for name, label in (("full", "full fine-tuning"), ("adapters", "adapters only")):
            rows.append([f"train, AdamW: {label}", f"{adam[name]['flops'] / 1e9:.1f}",
                         f"{adam[name]['temp_bytes'] / 2**20:.1f}",
                         f"{adam[name]['flops'] / adam['full']['flops']:.2f}x",
                         f"{adam[name]['temp_bytes'] / adam['full']['temp_bytes']:.2f}x"]
                        + ([""] if args.time else []))
    print_table(columns, rows)
    write_json(args.out, {
        "machine": machine(), "tokens": tokens, "rank": RANK,
        "model": "llama3-8b, layers=1, vocab=4096, bfloat16",
        "measure": "jax.jit(step).lower(abstract args).compile(): cost_analysis()['flops'], "
                   "memory_analysis().temp_size_in_bytes",
        "train_full": full, "train_adapters": lora, "decode_base": base_dec,
        "decode_adapters": lora_dec,
        "ratios": {"train_flops": lora["flops"] / full["flops"],
                   "train_temp_bytes": lora["temp_bytes"] / full["temp_bytes"],
                   "decode_flops": lora_dec["flops"] / base_dec["flops"],
                   **({"train_ms": lora["ms"] / full["ms"],
                       "decode_ms": lora_dec["ms"] / base_dec["ms"]} if args.time else {})},
        **({"adamw": adam | {"ratios": {
            "train_flops": adam["adapters"]["flops"] / adam["full"]["flops"],
            "train_temp_bytes": adam["adapters"]["temp_bytes"] / adam["full"]["temp_bytes"]}}}
           if adam else {}),
    })


if __name__ == "__main__":
    main()
