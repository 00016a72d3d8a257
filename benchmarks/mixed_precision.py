"""Mixed precision (``ns.Precision``): bytes, collectives, speed and loss against float32.

Three measurements on 8 simulated CPU devices:

1. **Memory and all-gathers under fsdp.** A Llama (vocab 512, embed 256, 8 heads
   x 32 with 4 key/value heads, mlp 1024, 4 scanned layers), AdamW, batch 16 x 128,
   2 steps per call, compiled as ``Trainer.fit`` runs it (``Trainer.lower``), in
   five ways: float32; ``Precision(float32 -> bfloat16)`` (each parameter cast
   where it is used); the same with ``remat="full"``; pure bfloat16 parameters
   (``param_dtype=bfloat16``, no master weights); and the whole model cast to
   bfloat16 at the top of the loss (the pitfall of Levanter#426). Per device:
   ``memory_analysis()`` argument, temp and total bytes, and the all-gather
   bytes per call, read from the HLO right after XLA's SPMD partitioner
   (``partitioned_hlo``) and from the final program (XLA's CPU backend widens
   bfloat16 collectives to float32 there; GPUs and TPUs do not).
2. **Speed.** Steps/s of the float32 and the mixed rows, timed side by side in
   interleaved rounds on the same mesh (CPUs have no bfloat16 arithmetic: XLA
   CPU converts, so expect mixed precision to be slower here, not faster).
3. **Fine-tune.** The tiny Llama checkpoint of tests/fixtures/hf_llama, loaded
   under fsdp and trained 300 steps with AdamW (3e-3) on the stdlib corpus, batch
   16 x 64, in float32 and in bfloat16 compute: the mean loss of the last 20
   steps and a held-out loss.

Run (about 10 minutes on 2 busy CPU cores)::

    .venv/bin/python benchmarks/mixed_precision.py

``--quick`` shortens every measurement (a smoke test of the script only).
Results go to ``benchmarks/results/mixed_precision.json``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from _common import simulated_cpu

os.environ.update(simulated_cpu(8))

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import interleaved, machine, parse, print_table, write_json
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import nnx_shard as ns
from nnx_shard.corpus import load_stdlib
from nnx_shard.models import Decoder, DecoderConfig, lm_loss
from nnx_shard.planner import compiled_collectives, partitioned_hlo

RESULTS = Path(__file__).resolve().parent / "results" / "mixed_precision.json"
FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf_llama"
MIXED = ns.Precision(params=jnp.float32, compute=jnp.bfloat16)
BENCH = DecoderConfig(vocab=512, embed=256, heads=8, kv_heads=4, head_dim=32, mlp=1024, layers=4,
                    max_length=128, scan_layers=True)


def cast_up_front(model, batch):
    """The whole model cast to bfloat16 once, at the top of the loss (Levanter#426)."""
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x.astype(jnp.bfloat16)
                         if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    return lm_loss(nnx.merge(graphdef, state), batch)


CASES = {
    # name: (config changes, precision, loss)
    "float32": ({}, None, lm_loss),
    "mixed (Precision)": ({"dtype": jnp.bfloat16}, MIXED, lm_loss),
    "mixed, remat full": ({"dtype": jnp.bfloat16, "remat": "full"}, MIXED, lm_loss),
    "pure bf16 params": ({"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16}, None, lm_loss),
    "cast whole model at top": ({"dtype": jnp.bfloat16}, None, cast_up_front),
}


def build(name: str, batch: int, length: int, k: int, concrete: bool):
    changes, precision, loss = CASES[name]
    cfg = dataclasses.replace(BENCH, max_length=length, **changes)
    s = ns.strategies.get("fsdp")
    mesh = s.make_mesh(8)
    factory = lambda: Decoder(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    model = ns.sharded_init(factory, mesh, s) if concrete else ns.abstract_init(factory, mesh, s)
    opt = ns.sharded_optimizer(model, optax.adamw(1e-3), mesh, s)
    trainer = ns.Trainer(model, opt, loss, mesh=mesh, rules=s.rules, steps_per_call=k,
                         precision=precision)
    spec = NamedSharding(mesh, PartitionSpec(None, "data"))
    tokens = jax.ShapeDtypeStruct((k, batch, length), jnp.int32, sharding=spec)
    return trainer, mesh, {"inputs": tokens, "targets": tokens}


def memory_rows(batch: int, length: int, k: int) -> list[dict]:
    rows = []
    for name in CASES:
        trainer, mesh, abstract = build(name, batch, length, k, concrete=False)
        compiled, text = partitioned_hlo(trainer.lower(abstract))
        m = compiled.memory_analysis()

        def gathered(hlo: str, mesh=mesh) -> int:
            return sum(c.bytes for c in compiled_collectives(hlo, mesh) if c.kind == "all-gather")

        rows.append({"case": name, "argument": m.argument_size_in_bytes,
                     "temp": m.temp_size_in_bytes,
                     "total": (m.argument_size_in_bytes + m.temp_size_in_bytes
                               + m.output_size_in_bytes - m.alias_size_in_bytes),
                     "all_gather_partitioned": gathered(text),
                     "all_gather_final": gathered(compiled.as_text())})
    return rows


def speed(batch: int, length: int, k: int, rounds: int) -> dict[str, float]:
    names = ["float32", "mixed (Precision)"]
    runs = []
    host = np.random.default_rng(0).integers(0, BENCH.vocab, (k, batch, length + 1), np.int32)
    for name in names:
        trainer, mesh, _ = build(name, batch, length, k, concrete=True)
        data = {"inputs": host[:, :, :-1], "targets": host[:, :, 1:]}
        with ns.use(mesh, trainer.rules):
            placed = ns.shard_batch(data, mesh, trainer.rules, ("batch", "length"), steps=True)
        fused = ns.multistep(_step, precision=trainer.precision)
        with ns.use(mesh, trainer.rules):
            jax.block_until_ready(fused(trainer.model, trainer.optimizer, placed))  # compile
        runs.append((fused, trainer, mesh, placed))

    def call(run):
        fused, trainer, mesh, placed = run
        with ns.use(mesh, trainer.rules):
            jax.block_until_ready(fused(trainer.model, trainer.optimizer, placed))

    rates = interleaved(runs, rounds, 1, call)
    return {name: rate * k for name, rate in zip(names, rates, strict=True)}


def _step(model, opt, batch):
    loss, grads = ns.value_and_grad(lm_loss)(model, batch)
    opt.update(model, grads)
    return {"loss": loss}


def fine_tune(steps: int) -> dict[str, dict[str, float]]:
    corpus = load_stdlib()
    heldout = corpus.heldout_batches(batch=16, length=64, max_batches=4)
    out = {}
    for name, dtype, precision in (("float32", jnp.float32, None),
                                   ("bf16 compute", jnp.bfloat16, MIXED)):
        cfg = dataclasses.replace(DecoderConfig.from_hf(FIXTURE), dtype=dtype)
        s = ns.strategies.get("fsdp")
        mesh = s.make_mesh(8)
        model = ns.hf.load_safetensors(FIXTURE, ns.abstract_init(
            lambda cfg=cfg: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, s))
        opt = ns.sharded_optimizer(model, optax.adamw(3e-3), mesh, s)
        trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=s.rules,
                             steps_per_call=min(50, steps), precision=precision)
        hist = trainer.fit(corpus.batches(batch=16, length=64), num_steps=steps, progress=False)
        # The held-out loss in float32 compute for both (the same yardstick).
        eval_model = Decoder(dataclasses.replace(cfg, dtype=jnp.float32), rngs=nnx.Rngs(0))
        nnx.update(eval_model, jax.device_get(nnx.state(model)))
        graphdef = nnx.graphdef(eval_model)
        ev = jax.jit(lambda s, b, g=graphdef: lm_loss(nnx.merge(g, s), b))
        held = float(np.mean([ev(nnx.state(eval_model), b) for b in heldout]))
        out[name] = {"first": float(hist["loss"][0]),
                     "last20": float(np.mean(hist["loss"][-20:])), "heldout": held}
    return out


def main() -> None:
    args = parse(__doc__)
    batch, length, k, rounds, steps = (8, 32, 2, 1, 20) if args.quick else (16, 128, 2, 5, 300)
    rows = memory_rows(batch, length, k)
    mib = 2.0**20
    base = rows[0]
    print(f"Llama embed 256, mlp 1024, 4 layers scanned, vocab 512; fsdp on 8 devices; AdamW; "
          f"batch {batch} x {length}, {k} steps per call; {machine()}")
    print_table(["case", "args MiB", "temp MiB", "total MiB", "all-gather MiB (partitioned)",
                 "ratio", "all-gather MiB (final CPU)"],
                [[r["case"], f"{r['argument'] / mib:.2f}", f"{r['temp'] / mib:.2f}",
                  f"{r['total'] / mib:.2f}", f"{r['all_gather_partitioned'] / mib:.2f}",
                  f"{r['all_gather_partitioned'] / base['all_gather_partitioned']:.3f}",
                  f"{r['all_gather_final'] / mib:.2f}"] for r in rows])
    rates = speed(batch, length, k, rounds)
    print()
    print_table(["case", "steps/s", "vs float32"],
                [[n, f"{r:.2f}", f"{r / rates['float32']:.2f}x"] for n, r in rates.items()])
    tuned = fine_tune(steps)
    print()
    print(f"fine-tune of tests/fixtures/hf_llama, {steps} steps, fsdp on 8 devices")
    print_table(["compute", "first loss", "mean of last 20", "held-out (f32 eval)"],
                [[n, f"{v['first']:.4f}", f"{v['last20']:.4f}", f"{v['heldout']:.4f}"]
                 for n, v in tuned.items()])
    a, b = tuned["float32"]["last20"], tuned["bf16 compute"]["last20"]
    print(f"bf16 vs float32, last-20 mean loss: {100 * (b - a) / a:+.2f}%")
    write_json(RESULTS, {"machine": machine(), "batch": batch, "length": length, "k": k,
                         "memory": rows, "steps_per_s": rates, "fine_tune": tuned,
                         "fine_tune_steps": steps, "argv": sys.argv[1:]})


if __name__ == "__main__":
    main()
