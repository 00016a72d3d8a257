"""One GPU: steps/s of float32 vs Precision(float32 master, bf16 compute) on a Llama and the Transformer."""
import dataclasses, json, sys, time
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import nnx_shard as ns
from nnx_shard.models import Llama, LlamaConfig, Transformer, get_config, lm_loss

print(jax.devices(), flush=True)
out = {"devices": str(jax.devices()), "jax": jax.__version__, "rows": []}
B, L, K, STEPS = 8, 1024, 5, 30
rng = np.random.default_rng(0)
llama = LlamaConfig(vocab=32000, embed=1024, heads=16, kv_heads=8, head_dim=64, mlp=4096,
                    layers=8, scan_layers=True)
if len(sys.argv) > 2:  # smoke test
    B, L = 2, 32
    llama = LlamaConfig(vocab=128, scan_layers=True)
strategy = ns.strategies.get("dp")
mesh = strategy.make_mesh(1)
for name, cfg in (("llama 8x1024 gqa", llama),):
    tokens = rng.integers(0, cfg.vocab, (STEPS * B * 2, L + 1)).astype(np.int32)
    data = ns.Batches({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, B)
    for label, dtype, prec in (("float32", jnp.float32, None),
                               ("bf16 compute", jnp.bfloat16, ns.Precision(params=jnp.float32, compute=jnp.bfloat16))):
        c = dataclasses.replace(cfg, dtype=dtype)
        model = strategy.sharded_init(lambda c=c: Llama(c, rngs=nnx.Rngs(0)), mesh)
        opt = strategy.optimizer(model, optax.adamw(1e-4), mesh)
        t = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=strategy.rules, steps_per_call=K, precision=prec)
        t0 = time.perf_counter(); t.fit(data, num_steps=2 * K, progress=False); first = time.perf_counter() - t0
        times = []
        for r in range(3):
            t0 = time.perf_counter(); h = t.fit(data, num_steps=STEPS // 3, progress=False)
            times.append(time.perf_counter() - t0)
        sps = [(STEPS // 3) / x for x in times]
        row = {"model": name, "compute": label, "steps_per_s": float(np.median(sps)), "rounds": sps,
               "tokens_per_s": float(np.median(sps)) * B * L, "first_call_s": first,
               "loss_last": float(h["loss"][-1])}
        print(row, flush=True); out["rows"].append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
