"""Speed, compile time and memory of ``ns.multistep`` against the loops it replaces.

Two models, Adam, run side by side on 1 CPU device and on 8 simulated CPU
devices (data parallel: batch sharded over ``data=8``, model replicated), each
device count in its own subprocess (``XLA_FLAGS`` must be set before jax loads):

* ``mlp``: MLP 32-128-128-8, batch 64, MSE;
* ``lm``: a 2-layer transformer-ish LM (d=64, 4 heads, vocab 256, seq 32), batch 16.

Steps/s of four ways to run the same train step:

* ``nnx.jit loop``: a Python loop over ``@nnx.jit`` steps (what most NNX code does);
* ``jax.jit loop``: a Python loop over ``jax.jit`` of the step on ``nnx.split`` state,
  merging inside, with donation (Flax's performance guide);
* ``hand scan``: a hand-written ``jax.jit(jax.lax.scan)`` over the split state,
  K=100 steps per call, donated (the practical limit);
* ``multistep``: ``ns.multistep(step)``, K=100 steps per call.

Every variant keeps at most two calls in flight (it blocks on the result of the
call before the previous one): with 8 simulated devices on few cores, unbounded
asynchronous dispatch can deadlock XLA's CPU rendezvous (docs/architecture.md). Variants
are timed in interleaved rounds, ordered by a balanced Latin square; the table shows
the median round, and multistep / hand scan is the median of the per-round ratios.

Also: compile time (lower + compile) of ``multistep`` at K = 10, 100, 1000, and
per-device bytes from ``compile().memory_analysis()`` of the fused K=100 call vs
one ``jax.jit`` step, with the stacked batch and metrics (which must grow with K)
subtracted.

Run (about 4 minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/multistep.py

``--quick`` shortens every measurement (a smoke test of the script only).
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from pathlib import Path

from _common import mlp, parse, run_worker, worker_main, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "multistep.json"
DEVICE_COUNTS = (1, 8)
K = 100
COMPILE_KS = (10, 100, 1000)
VARIANTS = ("nnx.jit loop", "jax.jit loop", "hand scan", "multistep")
# Williams design for 4 treatments: every variant runs right after every other once.
WILLIAMS = ((0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1))


# Worker (one process per device count)
# ------------------------------------------------------------------------------


def worker(n_devices: int, quick: bool) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard._train import multistep, shard_batch

    def split_state_step(graphdef, step):
        """One training step as ``jax.jit`` over the split (model, optimizer) state, donated."""

        @functools.partial(jax.jit, donate_argnums=0)
        def run(state, batch):
            model, opt = nnx.merge(graphdef, state)
            metrics = step(model, opt, batch)
            return nnx.split((model, opt))[1], metrics

        return run

    assert jax.device_count() == n_devices, (jax.device_count(), n_devices)
    # Auto axes: on Explicit axes the LM's embedding gather of a batch-sharded index
    # array needs an explicit out_sharding, which is model code, not what we measure.
    mesh = ns.make_mesh(f"data={n_devices}", axis_types="auto")
    rules = ns.Rules({"batch": "data"})
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    class Block(nnx.Module):
        def __init__(self, d: int, heads: int, rngs: nnx.Rngs) -> None:
            self.ln1 = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(d, rngs=rngs)
            self.up = nnx.Linear(d, 4 * d, rngs=rngs)
            self.down = nnx.Linear(4 * d, d, rngs=rngs)

        def __call__(self, x, mask):
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.down(nnx.gelu(self.up(self.ln2(x))))

    class LM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs, vocab=256, d=64, heads=4, layers=2, seq=32) -> None:
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, d)) * 0.02)
            self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
            self.ln = nnx.LayerNorm(d, rngs=rngs)
            self.head = nnx.Linear(d, vocab, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
            mask = nnx.make_causal_mask(tokens)
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.ln(x))

    def mlp_loss(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    def lm_loss(model, batch):
        logits = model(batch["tokens"])[:, :-1]
        labels = batch["tokens"][:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def mlp_data(k: int, rng: np.random.Generator) -> dict:
        return {
            "x": rng.normal(size=(k, 64, 32)).astype(np.float32),
            "y": rng.normal(size=(k, 64, 8)).astype(np.float32),
        }

    def lm_data(k: int, rng: np.random.Generator) -> dict:
        return {"tokens": rng.integers(0, 256, size=(k, 16, 32)).astype(np.int32)}

    models = {
        "mlp": (mlp, mlp_loss, mlp_data, 64),
        "lm": (LM, lm_loss, lm_data, 16),
    }

    def make_step(loss_fn):
        def step(model, opt, batch):
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
            opt.update(model, grads)
            return {"loss": loss}

        return step

    def fresh(cls):
        model = cls(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        # Replicated over the mesh, committed, like a model from ns.sharded_init.
        state = jax.device_put(nnx.state((model, opt)), rep)
        nnx.update((model, opt), state)
        return model, opt

    def bounded(results: list, out) -> None:
        # At most two calls in flight: block on the one before the previous.
        results.append(out)
        if len(results) > 2:
            jax.block_until_ready(results[-3])

    out: dict = {"n_devices": n_devices, "models": {}}
    rounds = 4 if quick else 8
    for name, (cls, loss_fn, make_data, global_batch) in models.items():
        rng = np.random.default_rng(0)
        step = make_step(loss_fn)
        host = make_data(K, rng)
        batches = shard_batch(host, mesh, rules, steps=True)  # [K, B, ...], sharded on B
        singles = [jax.tree.map(lambda x, i=i: x[i], batches) for i in range(K)]

        # -- the four variants, each a closure running `n_calls` calls ---------------
        m1, o1 = fresh(cls)
        jstep = nnx.jit(step)

        def nnx_loop(n_calls, m=m1, o=o1, jstep=jstep, singles=singles):
            res: list = []
            for i in range(n_calls):
                bounded(res, jstep(m, o, singles[i % K]))
            jax.block_until_ready(res)

        m2, o2 = fresh(cls)
        graphdef, state2 = nnx.split((m2, o2))

        jit_step = split_state_step(graphdef, step)

        box2 = [state2]

        def jax_loop(n_calls, box=box2, jit_step=jit_step, singles=singles):
            res: list = []
            for i in range(n_calls):
                box[0], metrics = jit_step(box[0], singles[i % K])
                bounded(res, metrics)
            jax.block_until_ready(res)

        m3, o3 = fresh(cls)
        graphdef3, state3 = nnx.split((m3, o3))

        @functools.partial(jax.jit, donate_argnums=0)
        def scan_train(state, batches, graphdef=graphdef3, step=step):
            def body(state, batch):
                model, opt = nnx.merge(graphdef, state)
                metrics = step(model, opt, batch)
                return nnx.split((model, opt))[1], metrics

            return jax.lax.scan(body, state, batches)

        box3 = [state3]

        def hand_scan(n_calls, box=box3, scan_train=scan_train, batches=batches):
            res: list = []
            for _ in range(n_calls):
                box[0], metrics = scan_train(box[0], batches)
                bounded(res, metrics)
            jax.block_until_ready(res)

        m4, o4 = fresh(cls)
        fused = multistep(step)

        def fused_run(n_calls, m=m4, o=o4, fused=fused, batches=batches):
            res: list = []
            for _ in range(n_calls):
                bounded(res, fused(m, o, batches))
            jax.block_until_ready(res)

        # name -> (run, steps per call)
        variants = {
            "nnx.jit loop": (nnx_loop, 1),
            "jax.jit loop": (jax_loop, 1),
            "hand scan": (hand_scan, K),
            "multistep": (fused_run, K),
        }
        # Size every round to ~`target` seconds per variant from a warm-up measurement.
        target = 0.15 if quick else 0.5
        calls = {}
        for v, (run, spc) in variants.items():
            run(2)  # compile + warm
            t0 = time.perf_counter()
            run(2 if spc == K else 20)
            per_call = (time.perf_counter() - t0) / (2 if spc == K else 20)
            calls[v] = max(3, int(target / per_call))
        rates: dict[str, list[float]] = {v: [] for v in variants}
        order = list(variants)
        for r in range(rounds):
            # A variant's speed depends measurably on which one ran just before it
            # (seen with 8 simulated devices on 2 cores), so the order follows a
            # balanced Latin square: each variant follows every other equally often.
            for j in WILLIAMS[r % len(WILLIAMS)]:
                v = order[j]
                run, spc = variants[v]
                gc.collect()
                t0 = time.perf_counter()
                run(calls[v])
                rates[v].append(calls[v] * spc / (time.perf_counter() - t0))
        speed = {v: statistics.median(r) for v, r in rates.items()}
        # Paired per round: both ran back to back, so shared noise (other processes,
        # 8 simulated devices contending for 2 cores) largely cancels in the ratio.
        vs_scan = statistics.median(
            a / b for a, b in zip(rates["multistep"], rates["hand scan"], strict=True)
        )
        assert fused.traces == 1, fused.traces

        # -- hand scan and multistep compute the same thing -------------------------
        ma, oa = fresh(cls)
        mb, ob = fresh(cls)
        _, sta = nnx.split((ma, oa))
        sta, _ = scan_train(sta, batches)
        nnx.update((ma, oa), sta)
        fused_check = multistep(step)
        fused_check(mb, ob, batches)
        same = all(
            np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
            for a, b in zip(jax.tree.leaves(nnx.state(ma)), jax.tree.leaves(nnx.state(mb)),
                            strict=True)
        )

        # -- compile time vs K -------------------------------------------------------
        compile_s = {}
        for k in COMPILE_KS:
            mk, ok = fresh(cls)
            bk = shard_batch(make_data(k, rng), mesh, rules, steps=True)
            times = []
            for _ in range(1 if quick else 2):  # best of 2: compile times are noisy too
                f = multistep(step)
                t0 = time.perf_counter()
                f.lower(mk, ok, bk).compile()
                times.append(time.perf_counter() - t0)
            compile_s[k] = min(times)

        # -- memory: fused K=100 call vs one jax.jit step ----------------------------
        mm, om = fresh(cls)
        fused_mem = fused.lower(mm, om, batches).compile().memory_analysis()
        gd, st = nnx.split((mm, om))

        one_step = split_state_step(gd, step)

        single_mem = one_step.lower(st, singles[0]).compile().memory_analysis()

        def peak(m) -> int:
            return int(m.argument_size_in_bytes + m.output_size_in_bytes
                       - m.alias_size_in_bytes + m.temp_size_in_bytes)

        batch_dev = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(singles[0]))
        # Metrics are one f32 scalar per step, replicated.
        growth = (K - 1) * batch_dev + (K - 1) * 4
        out["models"][name] = {
            "steps_per_s": speed,
            "multistep_vs_hand_scan": vs_scan,
            "rounds": {v: r for v, r in rates.items()},
            "calls_per_round": calls,
            "same_params_hand_scan_vs_multistep": same,
            "compile_s": compile_s,
            "memory": {
                "fused_peak": peak(fused_mem),
                "single_peak": peak(single_mem),
                "stacked_batch_and_metrics_extra": growth,
                "fused": {k: getattr(fused_mem, k) for k in (
                    "argument_size_in_bytes", "output_size_in_bytes",
                    "alias_size_in_bytes", "temp_size_in_bytes")},
                "single": {k: getattr(single_mem, k) for k in (
                    "argument_size_in_bytes", "output_size_in_bytes",
                    "alias_size_in_bytes", "temp_size_in_bytes")},
            },
            "global_batch": global_batch,
        }
    return out


# Driver
# ------------------------------------------------------------------------------


def fmt_table(results: list[dict]) -> str:
    lines = []
    names = list(results[0]["models"])
    cols = [f"{r['n_devices']} dev" for r in results]
    for name in names:
        lines.append(f"\n{name}: steps/s (ratio to nnx.jit loop; multistep vs hand scan)")
        lines.append(f"| variant | {' | '.join(cols)} |")
        lines.append("| --- |" + " --- |" * len(cols))
        for v in VARIANTS:
            cells = []
            for r in results:
                s = r["models"][name]["steps_per_s"]
                cells.append(f"{s[v]:,.0f} ({s[v] / s['nnx.jit loop']:.1f}x)")
            lines.append(f"| {v} | {' | '.join(cells)} |")
        cells = []
        for r in results:
            cells.append(f"{r['models'][name]['multistep_vs_hand_scan']:.3f}")
        lines.append(f"| multistep / hand scan (median of paired rounds) | {' | '.join(cells)} |")
        cells = []
        for r in results:
            c = r["models"][name]["compile_s"]
            cells.append(" / ".join(f"{c[str(k)] if str(k) in c else c[k]:.2f}" for k in COMPILE_KS)
                         + f" ({_c(c, 1000) / _c(c, 10):.2f}x)")
        lines.append(f"| compile s, K={'/'.join(map(str, COMPILE_KS))} | {' | '.join(cells)} |")
        cells = []
        for r in results:
            mem = r["models"][name]["memory"]
            adj = (mem["fused_peak"] - mem["stacked_batch_and_metrics_extra"]) / mem["single_peak"]
            cells.append(f"{mem['fused_peak'] / 1024:,.0f} / {mem['single_peak'] / 1024:,.0f} KiB "
                         f"({adj:.2f}x net)")
        lines.append(f"| peak bytes/device fused K={K} / one step | {' | '.join(cells)} |")
    return "\n".join(lines)


def _c(c: dict, k: int) -> float:
    return c[str(k)] if str(k) in c else c[k]


def main() -> None:
    args = parse(__doc__)
    if worker_main(args, {"worker": worker}):
        return
    t0 = time.perf_counter()
    results = [run_worker(__file__, n, args.quick, timeout=600) for n in DEVICE_COUNTS]
    import jax

    meta = {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "K": K,
        "quick": args.quick,
        "seconds": time.perf_counter() - t0,
    }
    print(fmt_table(results))
    print(f"\n(jax {meta['jax']}, {meta['cpus']} CPUs, {meta['seconds']:.0f} s; "
          "8 dev = simulated CPU devices sharing the same cores)")
    write_json(RESULTS, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
