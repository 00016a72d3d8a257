"""Resident memory over many small checkpoint saves: flat, or growing per save?

One process saves a small model (``nnx.Linear(64, 64)``, 16 KiB of parameters)
with ``ns.Checkpointer(directory, keep=3)`` (background saves, the last three
kept) again and again, and reads its resident set size (``VmRSS``) after every
``--every`` saves, once the save is on disk. Two such processes run one after
the other:

* ``nnx_shard``: as nnx_shard saves (orbax as it comes: its raw-bytes telemetry,
  ``tensorstore_utils.get_tensorstore_raw_bytes``, calls
  ``tensorstore.experimental_collect_matching_metrics``, whose results tensorstore
  0.1.86 never frees, twice per array written);
* ``telemetry stubbed by the program``: the same, in a program that replaces that
  orbax function with one returning ``None`` itself before it saves (nnx_shard
  changes nothing of orbax; a program may).

The growth is reported from the first reading after a warm-up of ``--every``
saves (compilation, thread pools and allocator pools settle there) to the last,
per save and in total. The first process also runs ``Trainer.fit`` for 20,000
steps of a one-weight model and reports what its ``History`` holds and how much
resident memory grew over the fit, per 10,000 steps: the other thing a long run
keeps in memory.

Run (about 10 minutes on 2 CPU cores; ``--quick``: 200 saves, ``--saves N``)::

    .venv/bin/python benchmarks/checkpoint_rss.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, simulated_cpu, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_rss.json"
VARIANTS = ("nnx_shard", "telemetry stubbed by the program")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")  # pragma: no cover


def worker(variant: str, saves: int, every: int) -> dict:
    from flax import nnx

    import nnx_shard as ns

    if variant == VARIANTS[1]:
        from orbax.checkpoint._src.serialization import tensorstore_utils

        # The program's own choice, for the whole process: no raw-bytes metrics collected.
        tensorstore_utils.get_tensorstore_raw_bytes = lambda *args, **kwargs: None
    model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    readings = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d, ns.Checkpointer(d, keep=3) as ckpt:
        for step in range(1, saves + 1):
            ckpt.save(step, model=model)
            if step % every == 0:
                ckpt.wait()
                readings.append([step, round(_rss_mib(), 2)])
        steps_on_disk = ckpt.steps()
    seconds = time.perf_counter() - t0
    history = _history(20_000) if variant == VARIANTS[0] else {}
    return {"variant": variant, "saves": saves, "readings": readings, "seconds": seconds,
            "steps_on_disk": steps_on_disk, **history}


def _history(steps: int) -> dict:
    """Trainer.fit of a one-weight model for ``steps`` steps: the History's arrays, and
    resident memory before fit and after it (the History still held)."""
    import gc

    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import nnx_shard as ns

    model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    trainer = ns.Trainer(model, opt, lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                         mesh="data=1", rules={"batch": "data"}, steps_per_call=100)
    x = np.ones((steps, 1, 1), np.float32)
    data = ns.Batches({"x": x, "y": x}, batch_size=1, epochs=1)
    trainer.fit(data, 100, progress=False)  # compiled, pools warm
    gc.collect()
    before = _rss_mib()
    history = trainer.fit(data, steps, progress=False)
    gc.collect()
    after = _rss_mib()
    return {"history_steps": len(history),
            "history_bytes": sum(v.nbytes for v in history.metrics.values()),
            "history_keys": sorted(history.metrics),
            "fit_rss_growth_mib": after - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--saves", type=int, default=2000)
    ap.add_argument("--every", type=int, default=100, help="saves between readings")
    ap.add_argument("--quick", action="store_true", help="200 saves, a reading every 20")
    args = ap.parse_args()
    if args.quick:
        args.saves, args.every = 200, 20
    if args.worker:
        print(json.dumps(worker(args.worker, args.saves, args.every)))
        return
    env = {**os.environ, **simulated_cpu(1)}
    runs = []
    for variant in VARIANTS:
        print(f"{variant}: {args.saves} saves ...", flush=True)
        out = subprocess.run([sys.executable, __file__, "--worker", variant, "--saves",
                              str(args.saves), "--every", str(args.every)], env=env,
                             capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            sys.stderr.write(out.stderr)
            raise SystemExit(f"worker {variant!r} failed ({out.returncode})")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print()
    steps = [s for s, _ in runs[0]["readings"]]
    print_table(["saves", *[f"RSS MiB, {r['variant']}" for r in runs]],
                [[s, *[dict(r["readings"])[s] for r in runs]] for s in steps])
    print()
    rows = []
    for r in runs:
        (s0, m0), (s1, m1) = r["readings"][0], r["readings"][-1]
        r["growth_mib"] = m1 - m0
        r["growth_kib_per_save"] = (m1 - m0) * 1024 / max(1, s1 - s0)
        rows.append([r["variant"], f"{m0:.1f}", f"{m1:.1f}", f"{m1 - m0:+.1f}",
                     f"{r['growth_kib_per_save']:+.2f}", f"{r['seconds'] / r['saves'] * 1e3:.0f}"])
    print_table(["variant", f"RSS after {steps[0]} saves (MiB)", f"after {steps[-1]} (MiB)",
                 "growth (MiB)", "per save (KiB)", "ms per save"], rows)
    h = runs[0]
    per10k = 10_000 / h["history_steps"]
    print(f"\nTrainer.fit for {h['history_steps']:,} steps: its History ({', '.join(h['history_keys'])}) "
          f"holds {h['history_bytes'] * per10k / 2**20:.2f} MiB per 10,000 steps; resident memory "
          f"grew {h['fit_rss_growth_mib'] * per10k:.2f} MiB per 10,000 steps over the fit")
    meta = {"python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "saves": args.saves, "every": args.every,
            "model": "nnx.Linear(64, 64)", "checkpointer": "Checkpointer(d, keep=3), async"}
    write_json(RESULTS, {"meta": meta, "results": runs})


if __name__ == "__main__":
    main()
