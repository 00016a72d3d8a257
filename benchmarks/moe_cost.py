"""What a mixture-of-experts training step costs, from XLA's own count.

Compiles (``jax.jit(...).lower(abstract args).compile()``, nothing allocated: the
models are ``nnx.eval_shape``'d) one training step (loss, gradients, an SGD update
of every parameter) of:

* ``moe``: a Mixtral-shaped model (``mixtral-8x7b``'s widths scaled down: embed
  1024, 8 experts of mlp 3584, top-2, 2 layers, vocab 4096), the dropless grouped
  matmuls (``jax.lax.ragged_dot``) over the tokens sorted by expert;
* ``dense``: the dense Llama with the MoE model's *active* width (mlp = top_k x
  expert mlp = 7168), the same attention, embedding and layers: what each token
  computes with, as if routing were free;

and reads ``cost_analysis()["flops"]``. The target is ``moe / dense <= 1.25``
(the router, the sort and the weighting are the overhead; computing every
expert for every token costs ``experts / top_k`` = 4x the expert FLOPs).

XLA's CPU backend has no grouped-matmul kernel: it rewrites ``ragged_dot`` into a
dense product over all experts before counting (a standalone ``ragged_dot`` of
512 rows over 8 groups counts 8x the grouped FLOPs there), so on CPU the ratio
shows the all-experts cost. XLA's GPU backend in jax 0.11.2 rewrites it too (the
HLO check below finds no ``ragged-dot`` left), and its ``cost_analysis()`` counts
cuBLAS calls partially, so on a GPU read the times (``--time``), not the FLOPs.
The table says which backend measured it and how many ``ragged-dot`` ops the
optimised HLO kept.

Run (about 1 minute on 2 CPU cores; ``--quick``: 128 tokens)::

    .venv/bin/python benchmarks/moe_cost.py
    JAX_PLATFORMS=cuda .venv/bin/python benchmarks/moe_cost.py --time 5   # also time it
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from _common import hlo_ops, machine, median_ms, print_table, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "moe_cost.json"


def configs() -> tuple[Any, Any]:
    """The MoE config and the dense config of its active width."""
    import jax.numpy as jnp

    from nnx_shard.models import LlamaConfig

    shared = dict(embed=1024, heads=8, kv_heads=2, head_dim=128, layers=2, vocab=4096,
                  dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    moe = LlamaConfig(**shared, mlp=3584, experts=8, top_k=2, model_type="mixtral")
    dense = LlamaConfig(**shared, mlp=2 * 3584)
    return moe, dense


def step_flops(cfg: Any, tokens: int, rounds: int = 0) -> dict[str, Any]:
    """XLA's flops of one compiled training step of the model of ``cfg``, the
    grouped-matmul ops left in its optimised HLO, and with ``rounds`` its median
    milliseconds on real arrays."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_shard.models import Llama, lm_loss

    def make() -> Any:
        return Llama(cfg, rngs=nnx.Rngs(0))

    model = make() if rounds else nnx.eval_shape(make)
    graphdef, params = nnx.split(model, nnx.Param)
    batch = {k: jax.ShapeDtypeStruct((1, tokens), jnp.int32) for k in ("inputs", "targets")}

    def step(params: Any, batch: dict[str, jax.Array]) -> Any:
        value, grads = jax.value_and_grad(
            lambda p: lm_loss(nnx.merge(graphdef, p), batch))(params)
        return value, jax.tree.map(lambda p, g: p - (1e-3 * g).astype(p.dtype), params, grads)

    compiled = jax.jit(step, donate_argnums=0).lower(params, batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    out: dict[str, Any] = {"flops": float(cost["flops"]),
                           "hlo": hlo_ops(compiled, ("ragged-dot", "__gpu$xla.gpu.triton",
                                                     "custom-call"))}
    if rounds:
        inputs = jax.random.randint(jax.random.key(0), (1, tokens), 0, cfg.vocab)
        real = {"inputs": inputs, "targets": inputs}
        held = {"params": params}

        def run() -> None:
            value, held["params"] = compiled(held["params"], real)
            jax.block_until_ready(value)

        out["ms"] = median_ms(run, rounds, 5)
    return out


def main() -> None:
    import jax

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="128 tokens")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    ap.add_argument("--time", type=int, default=0, metavar="ROUNDS",
                    help="also run each step on real arrays: median ms over ROUNDS rounds "
                         "of 5 steps (meant for an accelerator)")
    ap.add_argument("--pallas", action="store_true",
                    help="GPU: lower ragged_dot with JAX's Pallas/Triton grouped kernel "
                         "(jax_ragged_dot_use_gpu_pallas_triton_lowering)")
    args = ap.parse_args()
    if args.pallas:
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
    tokens = 128 if args.quick else 2048
    moe, dense = configs()
    runs = {"moe": step_flops(moe, tokens, args.time),
            "dense": step_flops(dense, tokens, args.time)}
    flops = {name: run["flops"] for name, run in runs.items()}
    ratio = flops["moe"] / flops["dense"]
    backend = jax.default_backend()
    print(f"One training step, batch 1 x {tokens} tokens, bf16; {machine()}"
          + ("; ragged_dot through Pallas/Triton" if args.pallas else ""))
    rows = [
        ["MoE (8 experts, top-2)", f"{moe.num_params / 1e6:.0f}M",
         f"{moe.active_params / 1e6:.0f}M", f"{flops['moe'] / 1e9:.1f}", f"{ratio:.2f}x"],
        ["dense, active width", f"{dense.num_params / 1e6:.0f}M",
         f"{dense.num_params / 1e6:.0f}M", f"{flops['dense'] / 1e9:.1f}", "1.00x"],
    ]
    columns = ["model", "params", "active params", "GFLOPs", "vs dense active"]
    if args.time:
        columns += ["ms (median)", "ms vs dense"]
        for row, name in zip(rows, ("moe", "dense"), strict=True):
            row += [f"{runs[name]['ms']:.2f}", f"{runs[name]['ms'] / runs['dense']['ms']:.2f}x"]
    print_table(columns, rows)
    print(f"grouped-matmul ops in the MoE step's optimised HLO: {runs['moe']['hlo']}")
    if backend == "cpu":
        print("CPU: XLA expands ragged_dot into a product over every expert before counting.")
    write_json(args.out, {
        "machine": machine(), "backend": backend, "tokens": tokens,
        "ragged_dot_lowering": "pallas-triton" if args.pallas else "default",
        "moe": {"params": moe.num_params, "active_params": moe.active_params, **runs["moe"]},
        "dense": {"params": dense.num_params, **runs["dense"]},
        "ratio": ratio,
        "measure": "jax.jit(step).lower(abstract args).compile().cost_analysis()['flops']",
    })


if __name__ == "__main__":
    main()
