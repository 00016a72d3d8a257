"""QLoRA's frozen base: what each storage costs in bytes and in loss.

Two tables:

* **bytes**: the base's bytes per device, by XLA: the argument bytes of a compiled
  forward (``jax.jit(...).lower(abstract sharded model).compile().memory_analysis()``,
  nothing allocated) less the arguments that are not the adapted kernels (embeddings,
  norms, adapters, tokens), for one Llama-3-8B block (vocab 4096, bfloat16) under the
  ``fsdp`` preset on 8 simulated devices, against the bf16 base;
* **loss**: the loss after 10 AdamW steps (lr 1e-3) of rank-8 LoRA on all seven
  projections (dropout 0) over a base with a trained model's spread (a 2-layer bf16
  Decoder, embed 256, kernels normal(0, 0.02) with two input channels 8x wider), on
  random tokens whose next tokens are drawn from the float base itself; the relative
  gap of each quantized base's final loss to the bf16 base's.

Rows: int8 and int4 with block scales (64 inputs), int4 with one scale per output
channel (``quant_block=None``), NF4 (QLoRA's 4-bit NormalFloat, block 64) and NF4
with double quantization (``double_quant=True``: int8 block scales).

Run (a few minutes on 2 CPU cores; ``--quick``: the bytes table only)::

    .venv/bin/python benchmarks/qlora.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from _common import machine, print_table, simulated_cpu, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "qlora.json"
ALL = r"attn/(q|k|v|o)$|mlp/(gate|up|down)$"
ROWS: list[tuple[str, str | None, dict[str, Any]]] = [
    ("bf16 base", None, {}),
    ("int8, block 64", "int8", {}),
    ("int4, per output channel", "int4", {"quant_block": None}),
    ("int4, block 64", "int4", {}),
    ("nf4, block 64", "nf4", {}),
    ("nf4, block 64, double quant", "nf4", {"double_quant": True}),
]


def base_bytes(quantize: str | None, kw: dict[str, Any]) -> int:
    """Per-device bytes of the adapted kernels (quantized or not) in the compiled forward."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard._quantized import QuantizedValue
    from nnx_shard.models import Decoder, get_config

    cfg = dataclasses.replace(get_config("llama3-8b"), layers=1, vocab=4096)
    strategy = ns.strategies.get("fsdp")
    mesh = strategy.make_mesh(8)
    model = ns.abstract_init(lambda: ns.lora(Decoder(cfg, rngs=nnx.Rngs(0)), 16, 32.0,
                                             targets=ALL, quantize=quantize, **kw),
                             mesh, strategy)
    tokens = jax.ShapeDtypeStruct((8, 128), jnp.int32,
                                  sharding=jax.sharding.NamedSharding(
                                      mesh, jax.sharding.PartitionSpec("data")))
    graphdef, state = nnx.split(model)
    with ns.use(mesh, strategy.rules):
        compiled = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(state, tokens).compile()
    args = compiled.memory_analysis().argument_size_in_bytes

    def base(path: Any, value: Any) -> bool:
        return isinstance(value, QuantizedValue) or (
            bool(path) and path[-1] in ("q", "k", "v", "o", "gate", "up", "down"))

    rest = 8 * 128 * 4 // 8
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Not(base))):
        shard = leaf.sharding.shard_shape(leaf.shape)
        rest += int(jnp.dtype(leaf.dtype).itemsize * int(jnp.prod(jnp.array(shard))))
    return int(args - rest)


def realistic_llama() -> Any:
    """The bf16 2-layer Llama with a trained model's spread: kernels normal(0, 0.02) with
    two input channels 8x wider (as tests/test_quantized.py)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from nnx_shard.models import Decoder, get_config

    cfg = dataclasses.replace(get_config("llama-tiny"), vocab=256, embed=256, heads=4,
                              kv_heads=4, head_dim=64, mlp=512, param_dtype=jnp.bfloat16)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and var.ndim >= 2:
            name = str(path[-1])
            std = {"embedding": 1.0, "unembed": 0.1}.get(name, 0.02)
            w = rng.normal(0.0, std, var.shape)
            if name not in ("embedding", "unembed"):
                w[rng.choice(var.shape[0], 2, replace=False)] *= 8.0  # 2 outlier inputs
            var[...] = jnp.asarray(w, var.dtype)
    return model


def losses(quantize: str | None, kw: dict[str, Any], steps: int = 10) -> list[float]:
    """The loss before each of ``steps`` AdamW steps of LoRA, and after the last."""
    import jax
    import optax
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import lm_loss

    model = realistic_llama()
    tokens = jax.random.randint(jax.random.key(1), (8, 32), 0, 256)
    logits = nnx.jit(lambda m, t: m(t))(model, tokens).astype(jax.numpy.float32)
    batch = {"inputs": tokens, "targets": jax.random.categorical(jax.random.key(2), logits)}
    ns.lora(model, 8, 16.0, targets=ALL, quantize=quantize, **kw)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model: Any, opt: Any, batch: Any) -> Any:
        loss, grads = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(
            model, batch)
        opt.update(model, grads)
        return loss

    out = [float(step(model, opt, batch)) for _ in range(steps)]
    return [*out, float(nnx.jit(lm_loss)(model, batch))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the bytes table only")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    args = ap.parse_args()
    payload: dict[str, Any] = {"machine": machine(), "bytes": {}, "loss": {}}
    bf16 = base_bytes(None, {})
    rows = []
    for name, quantize, kw in ROWS:
        b = bf16 if quantize is None else base_bytes(quantize, kw)
        payload["bytes"][name] = {"bytes_per_device": b, "vs_bf16": b / bf16}
        rows.append([name, f"{b / 2**20:.2f}", f"{b / bf16:.4f}x"])
    print(f"Base bytes per device: one Llama-3-8B block (bf16), fsdp on 8 devices; {machine()}")
    print_table(["base", "MiB per device", "vs bf16"], rows)
    payload["bytes_measure"] = ("compiled forward's memory_analysis().argument_size_in_bytes "
                                "less the non-base arguments; llama3-8b, layers=1, vocab=4096, "
                                "bfloat16, fsdp, 8 devices")
    if not args.quick:
        ref = losses(None, {})
        rows = []
        for name, quantize, kw in ROWS:
            curve = ref if quantize is None else losses(quantize, kw)
            gap = abs(curve[-1] - ref[-1]) / ref[-1]
            payload["loss"][name] = {"losses": curve, "final": curve[-1], "gap_vs_bf16": gap}
            rows.append([name, f"{curve[0]:.4f}", f"{curve[-1]:.4f}", f"{100 * gap:.2f}%"])
        print("\nLoRA over each base: 10 AdamW steps (lr 1e-3), rank 8 on all projections, "
              "a 2-layer bf16 Llama with outlier input channels")
        print_table(["base", "first loss", "loss after 10 steps", "gap vs bf16 base"], rows)
        payload["loss_measure"] = ("final loss after 10 AdamW steps, |q - bf16| / bf16; "
                                   "fixture as realistic_llama()")
    write_json(args.out, payload)


if __name__ == "__main__":
    os.environ.update(simulated_cpu(8))
    main()
