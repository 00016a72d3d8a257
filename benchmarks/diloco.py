"""DiLoCo against ``hsdp`` on the demo corpus: held-out loss after the same tokens, and
the bytes each moves across replicas.

On 8 simulated CPU devices laid out by the ``hsdp`` preset (``replica=2, data=4``), a
character-level Decoder (vocab 128 = ASCII, 2 layers, embed 64, 4 heads x 16, mlp 256,
length 64; 119,104 float32 parameters) learns the demo corpus
(``nnx_shard.corpus.load_stdlib``: Python's own sources) for STEPS steps of a global
batch of 32 windows of 64 (the same windows, in the same order, for every row: STEPS =
600 steps, 1,228,800 training characters, about twice the training text), with the same inner optimizer, ``optax.adamw(3e-3)``, everywhere:

* ``hsdp``: ``ns.multistep`` of one AdamW step of ``lm_loss`` on the whole batch
  (gradients averaged over both replicas every step);
* ``DiLoCo H=h``: ``ns.DiLoCo(model, adamw(3e-3), inner_steps=h)`` with DiLoCo's outer
  optimizer (``optax.sgd(0.7, momentum=0.9, nesterov=True)``, the default), each replica
  on its 16 of the 32 windows; at H=10 also with every ``compress=`` option; and all of
  these again at a smaller outer learning rate, 0.35 (the same Nesterov momentum 0.9;
  ``--outer-lr`` sets the rates); and ``mask:0.25`` once more at each rate with plain
  outer SGD (no momentum): error feedback sends each element's delta about 1/P syncs
  late, and momentum keeps moving along such stale deltas.

Each row's held-out loss is ``lm_loss`` of the trained model (DiLoCo's anchor; STEPS is a
multiple of every H, so the last step synced) averaged over 8 fixed batches of 32 x 64
characters of the corpus' held-out files (``corpus.heldout_batches``; disjoint from
the training files). The bytes are read from the compiled K-step program the row trains
with (``nnx_shard.planner.compiled_collectives``, which counts an operation in the
loop's body once): the per-device result bytes of its collectives over ``replica``,
which for ``hsdp`` run every step (bytes per 100 steps = x 100) and for DiLoCo only in
the sync (its ``lax.cond`` branch inside the loop; x 100 / H); DiLoCo's inner step has
no collective over ``replica`` (tests/train/test_diloco.py). Wall and process CPU
seconds are those of the row's training calls, the first call's compile included.

Run (about 7 minutes on 2 loaded CPU cores; 15 rows of 20-26 CPU-s and their compiles)::

    .venv/bin/python benchmarks/diloco.py

Results go to ``benchmarks/results/diloco.json``; ``--quick`` trains 20 steps at
H = 10 and the first outer learning rate only (a smoke test: its losses mean nothing).
"""

from __future__ import annotations

import os

from _common import bytes_parser, machine, print_table, simulated_cpu, write_json

os.environ.update(simulated_cpu(8))  # before jax is imported

import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import nnx_shard as ns
from nnx_shard.corpus import load_stdlib
from nnx_shard.models import Decoder, ReferenceConfig, lm_loss
from nnx_shard.planner import compiled_collectives

RESULTS = Path(__file__).resolve().parent / "results" / "diloco.json"
CFG = ReferenceConfig(vocab=128, length=64, embed=64, heads=4, head_dim=16, mlp=256, layers=2)
HSDP = ns.strategies.get("hsdp")
BATCH, STEPS, K = 32, 600, 50  # K steps a compiled call; STEPS a multiple of K and every H
LR = 3e-3
COMPRESS = ("int8", "int4", "mask:0.25", "rank:2")


def lm_step(model: Any, opt: Any, batch: Any) -> dict:
    loss, grads = ns.value_and_grad(lm_loss)(model, batch)
    opt.update(model, grads)
    return {"loss": loss}


def windows(corpus: Any, steps: int, k: int, mesh: Any) -> list[Any]:
    """The training batches, ``steps // k`` calls of ``k`` steps, laid out on ``mesh``."""
    stream = corpus.batches(batch=BATCH, length=CFG.length, seed=0)
    host = [next(stream) for _ in range(steps)]
    out = []
    for i in range(0, steps, k):
        chunk = {key: np.stack([b[key] for b in host[i:i + k]]) for key in host[0]}
        out.append(ns.shard_batch(chunk, mesh, HSDP.rules, ("batch", "length"), steps=True))
    return out


def heldout_loss(model: Any, batches: list[Any]) -> float:
    """``lm_loss`` averaged over the held-out batches (all of the same size)."""
    loss = nnx.jit(lm_loss)
    return float(np.mean([jax.device_get(loss(model, b)) for b in batches]))


def replica_bytes(hlo: str, mesh: Any) -> int:
    return sum(c.bytes for c in compiled_collectives(hlo, mesh) if "replica" in (c.axes or ()))


def run_row(name: str, h: int | None, compress: str | None, outer_lr: float, momentum: float,
            data: list[Any], heldout: list[Any], mesh: Any) -> dict:
    model = ns.sharded_init(lambda: Decoder(CFG, rngs=nnx.Rngs(0)), mesh, HSDP)
    if h is None:
        opt = ns.sharded_optimizer(model, optax.adamw(LR), mesh, HSDP)
        fused = ns.multistep(lm_step)
        args: tuple = (model, opt)
    else:
        outer = (optax.sgd(outer_lr, momentum=momentum, nesterov=True) if momentum
                 else optax.sgd(outer_lr))
        diloco = ns.DiLoCo(model, optax.adamw(LR), inner_steps=h, outer=outer,
                           compress=compress)
        fused = ns.multistep(lambda d, b: {"loss": d.step(lm_loss, b)})
        args = (diloco,)
    losses = []
    with ns.use(mesh, HSDP.rules):
        hlo = fused.lower(*args, data[0]).compile().as_text()
        t0, c0 = time.perf_counter(), time.process_time()
        for batches in data:
            losses.append(jax.device_get(fused(*args, batches))["loss"])
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        held = heldout_loss(model, heldout)
    assert fused.traces == 1, fused.traces
    per_event = replica_bytes(hlo, mesh)  # every step (hsdp), every sync (DiLoCo)
    per_call = [float(np.mean(x)) for x in losses]  # over steps (and replicas)
    return {"row": name, "inner_steps": h, "compress": compress,
            "outer_lr": None if h is None else outer_lr,
            "outer_momentum": None if h is None else momentum,
            "heldout_loss": held, "train_loss_per_call": per_call,
            "replica_bytes_per_event": per_event,
            "replica_bytes_per_100_steps": per_event * 100 / (h or 1),
            "wall_s": wall, "cpu_s": cpu}


def main() -> None:
    ap = bytes_parser(__doc__, "20 steps, H=10 at the first outer learning rate only (a smoke test)", RESULTS)
    ap.add_argument("--outer-lr", type=float, nargs="+", default=[0.7, 0.35],
                    help="outer learning rates (Nesterov momentum 0.9): the DiLoCo rows run "
                    "at each")
    args = ap.parse_args()
    steps, k = (20, 10) if args.quick else (STEPS, K)
    hs = (10,) if args.quick else (10, 50)
    mesh = HSDP.make_mesh()
    assert dict(mesh.shape) == {"replica": 2, "data": 4}, mesh.shape
    corpus = load_stdlib()
    t0 = time.perf_counter()
    with ns.use(mesh, HSDP.rules):
        data = windows(corpus, steps, k, mesh)
        heldout = [ns.shard_batch(b, mesh, HSDP.rules, ("batch", "length"))
                   for b in corpus.heldout_batches(BATCH, CFG.length, max_batches=8)]
    plan: list[tuple[str, int | None, str | None, float, float]] = [("hsdp", None, None, 0.0, 0.0)]
    for lr in args.outer_lr[:1] if args.quick else args.outer_lr:
        plan += [(f"DiLoCo H={h}", h, None, lr, 0.9) for h in hs]
        plan += [(f"DiLoCo H=10 {c}", 10, c, lr, 0.9) for c in COMPRESS]
        plan += [("DiLoCo H=10 mask:0.25, no momentum", 10, "mask:0.25", lr, 0.0)]
    rows = []
    for name, h, compress, lr, momentum in plan:
        rows.append(run_row(name, h, compress, lr, momentum, data, heldout, mesh))
        r = rows[-1]
        outer = "" if h is None else f" (outer lr {lr})"
        print(f"  {name}{outer}: held-out {r['heldout_loss']:.4f}, {r['cpu_s']:.0f} CPU-s", flush=True)
    base = rows[0]
    for r in rows:
        r["loss_vs_hsdp"] = r["heldout_loss"] / base["heldout_loss"]
        r["bytes_vs_hsdp"] = r["replica_bytes_per_100_steps"] / base["replica_bytes_per_100_steps"]
    params = sum(x.size for x in jax.tree.leaves(nnx.state(
        nnx.eval_shape(lambda: Decoder(CFG, rngs=nnx.Rngs(0))), nnx.Param)))
    print(f"\n{machine()}; hsdp replica=2 x data=4; {params:,} parameters; {steps} steps of "
          f"{BATCH} x {CFG.length} characters; unigram baseline "
          f"{corpus.unigram_baseline():.3f} nats/char\n")
    print_table(["row", "outer lr", "momentum", "held-out loss (nats/char)", "vs hsdp", "bytes over replica / 100 steps",
                 "vs hsdp", "wall s", "CPU s"],
                [[r["row"], r["outer_lr"] or "-",
                  "-" if r["outer_momentum"] is None else r["outer_momentum"],
                  f"{r['heldout_loss']:.4f}", f"{r['loss_vs_hsdp']:.3f}",
                  f"{r['replica_bytes_per_100_steps']:,.0f}", f"{r['bytes_vs_hsdp']:.4f}",
                  f"{r['wall_s']:.0f}", f"{r['cpu_s']:.0f}"] for r in rows])
    write_json(args.out, {
        "config": {"vocab": CFG.vocab, "length": CFG.length, "embed": CFG.embed,
                   "heads": CFG.heads, "head_dim": CFG.head_dim, "mlp": CFG.mlp,
                   "layers": CFG.layers, "parameters": params, "mesh": dict(mesh.shape),
                   "global_batch": BATCH, "steps": steps, "steps_per_call": k,
                   "inner": f"adamw({LR})", "outer": "sgd(lr, momentum, nesterov=True); momentum 0: sgd(lr)",
                   "heldout_batches": len(heldout),
                   "unigram_baseline": corpus.unigram_baseline(), "quick": args.quick,
                   "seconds": time.perf_counter() - t0},
        "rows": rows})


if __name__ == "__main__":
    main()
