"""What a mixture-of-experts training step costs, from XLA's own count.

Compiles (``jax.jit(...).lower(abstract args).compile()``, nothing allocated: the
models are ``nnx.eval_shape``'d) one training step (loss, gradients, an SGD update
of every parameter) of:

* ``moe, tiles``: a Mixtral-shaped model (``mixtral-8x7b``'s widths scaled down:
  embed 1024, 8 experts of mlp 3584, top-2, 2 layers, vocab 4096), its experts'
  grouped matmuls as a loop over tiles of the tokens sorted by expert
  (``expert_matmul="tiles"``, the default off TPU);
* ``moe, ragged_dot``: the same model with ``expert_matmul="ragged_dot"``
  (``jax.lax.ragged_dot``, the default on TPU);
* ``dense``: the dense Llama with the MoE model's *active* width (mlp = top_k x
  expert mlp = 7168), the same attention, embedding and layers: what each token
  computes with, as if routing were free;

and reads ``cost_analysis()["flops"]``. The target is ``moe / dense <= 1.25``
(the router, the sort, the tiles' straddling rows and the weighting are the
overhead; computing every expert for every token costs ``experts / top_k`` = 4x
the expert FLOPs).

XLA counts a loop's body once, so the tiles' FLOPs are read from the same step
compiled with the loop unrolled (``nnx_shard.models._grouped.unrolled``); the
scanned step's own count is in the JSON too (``flops_as_a_loop``), and times and
temporaries are the scanned step's, the one that runs. ``--time`` also reports the
CPU seconds per step (every XLA thread's, warm-up included), steadier than the wall
time on a loaded machine.

XLA's CPU backend has no grouped-matmul kernel for ``ragged_dot``: it rewrites it
into a dense product over all experts before counting. XLA's GPU backend in jax
0.11.2 rewrites it too (the HLO check finds no ``ragged-dot`` left), and its
``cost_analysis()`` counts cuBLAS calls partially, so on a GPU read the times
(``--time``), not the FLOPs. The table says which backend measured it.

Run (about 3 minutes on 2 CPU cores; ``--quick``: 128 tokens)::

    .venv/bin/python benchmarks/moe_cost.py --time 3
    JAX_PLATFORMS=cuda .venv/bin/python benchmarks/moe_cost.py --time 5
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from _common import cost_parser, hlo_ops, machine, median_ms, print_table, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "moe_cost.json"


def configs() -> tuple[Any, Any]:
    """The MoE config and the dense config of its active width."""
    import jax.numpy as jnp

    from nnx_shard.models import DecoderConfig

    shared = dict(embed=1024, heads=8, kv_heads=2, head_dim=128, layers=2, vocab=4096,
                  dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    moe = DecoderConfig.for_model("mixtral", **shared, mlp=3584, experts=8, top_k=2,
                                  expert_matmul="tiles")
    dense = DecoderConfig(**shared, mlp=2 * 3584)
    return moe, dense


def step_flops(cfg: Any, tokens: int, rounds: int = 0) -> dict[str, Any]:
    """XLA's flops of one compiled training step of the model of ``cfg`` (the tile
    loop unrolled for the count), its temporaries, the grouped-matmul ops left in its
    optimised HLO, and with ``rounds`` its median milliseconds on real arrays."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_shard.models import Decoder, lm_loss
    from nnx_shard.models._grouped import resolve, unrolled

    def make() -> Any:
        return Decoder(cfg, rngs=nnx.Rngs(0))

    model = make() if rounds else nnx.eval_shape(make)
    graphdef, params = nnx.split(model, nnx.Param)
    batch = {k: jax.ShapeDtypeStruct((1, tokens), jnp.int32) for k in ("inputs", "targets")}

    def step(params: Any, batch: dict[str, jax.Array]) -> Any:
        value, grads = jax.value_and_grad(
            lambda p: lm_loss(nnx.merge(graphdef, p), batch))(params)
        return value, jax.tree.map(lambda p, g: p - (1e-3 * g).astype(p.dtype), params, grads)

    def flops(compiled: Any) -> float:
        cost = compiled.cost_analysis()
        return float((cost[0] if isinstance(cost, list | tuple) else cost)["flops"])

    compiled = jax.jit(step, donate_argnums=0).lower(params, batch).compile()
    out: dict[str, Any] = {"flops": flops(compiled),
                           "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                           "hlo": hlo_ops(compiled, ("ragged-dot", "__gpu$xla.gpu.triton",
                                                     "custom-call"))}
    if any(cfg.moe_layers()) and resolve(cfg.expert_matmul) == "tiles":
        # A new function: jax reuses the trace of one it has seen, loop and all.
        with unrolled():
            out["flops_as_a_loop"], out["flops"] = out["flops"], flops(jax.jit(
                lambda p, b: step(p, b), donate_argnums=0).lower(params, batch).compile())
    if rounds:
        inputs = jax.random.randint(jax.random.key(0), (1, tokens), 0, cfg.vocab)
        real = {"inputs": inputs, "targets": inputs}
        held = {"params": params}

        def run() -> None:
            value, held["params"] = compiled(held["params"], real)
            jax.block_until_ready(value)

        # CPU seconds as well: on a shared machine the wall time follows the load, the
        # CPU time (all of XLA's threads) much less.
        cpu = time.process_time()
        out["ms"] = median_ms(run, rounds, 5)
        out["cpu_s"] = (time.process_time() - cpu) / (1 + 5 * rounds)  # with the warm-up
    return out


def main() -> None:
    import jax

    ap = cost_parser(__doc__, "128 tokens", RESULTS, "step (5 steps a round)")
    ap.add_argument("--pallas", action="store_true",
                    help="GPU: lower ragged_dot with JAX's Pallas/Triton grouped kernel "
                         "(jax_ragged_dot_use_gpu_pallas_triton_lowering)")
    args = ap.parse_args()
    if args.pallas:
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
    tokens = 128 if args.quick else 2048
    moe, dense = configs()
    models = {"moe_tiles": moe,
              "moe_ragged_dot": dataclasses.replace(moe, expert_matmul="ragged_dot"),
              "dense": dense}
    runs = {name: step_flops(cfg, tokens, args.time) for name, cfg in models.items()}
    ratio = {name: run["flops"] / runs["dense"]["flops"] for name, run in runs.items()}
    backend = jax.default_backend()
    print(f"One training step, batch 1 x {tokens} tokens, bf16; {machine()}"
          + ("; ragged_dot through Pallas/Triton" if args.pallas else ""))
    labels = {"moe_tiles": "MoE (8 experts, top-2), tiles",
              "moe_ragged_dot": "MoE (8 experts, top-2), ragged_dot",
              "dense": "dense, active width"}
    columns = ["model", "params", "active params", "GFLOPs", "vs dense active", "temp MiB"]
    rows = [[labels[name], f"{cfg.num_params / 1e6:.0f}M", f"{cfg.active_params / 1e6:.0f}M",
             f"{runs[name]['flops'] / 1e9:.1f}", f"{ratio[name]:.2f}x",
             f"{runs[name]['temp_bytes'] / 2**20:.0f}"] for name, cfg in models.items()]
    if args.time:
        columns += ["ms (median)", "ms vs dense", "CPU s", "CPU vs dense"]
        for row, name in zip(rows, models, strict=True):
            row += [f"{runs[name]['ms']:.2f}", f"{runs[name]['ms'] / runs['dense']['ms']:.2f}x",
                    f"{runs[name]['cpu_s']:.2f}",
                    f"{runs[name]['cpu_s'] / runs['dense']['cpu_s']:.2f}x"]
    print_table(columns, rows)
    print("grouped-matmul ops in the ragged_dot step's optimised HLO: "
          f"{runs['moe_ragged_dot']['hlo']}")
    if backend == "cpu":
        print("CPU: XLA expands ragged_dot into a product over every expert before counting.")
    write_json(args.out, {
        "machine": machine(), "backend": backend, "tokens": tokens,
        "ragged_dot_lowering": "pallas-triton" if args.pallas else "default",
        **{name: {"params": cfg.num_params, "active_params": cfg.active_params, **runs[name]}
           for name, cfg in models.items()},
        "ratio": ratio,
        "measure": "jax.jit(step).lower(abstract args).compile().cost_analysis()['flops'], "
                   "the tile loop unrolled (nnx_shard.models._grouped.unrolled)",
    })


if __name__ == "__main__":
    main()
