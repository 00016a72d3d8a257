"""Save and restore time, and peak host memory during restore, of a >= 500 MB sharded state.

The state is a stack of 4096x4096 float32 linear layers (8 x 64 MiB = 512 MiB),
FSDP-sharded over 8 simulated CPU devices (``data=8``). Measured, each in a
fresh process so that one measurement's caches and buffers do not help the next:

* ``save (sync)``: ``ns.save`` until the checkpoint is on disk;
* ``save (async), blocked``: how long ``Checkpointer.save`` holds training up
  (copying the arrays off the devices), and ``save (async), total`` until
  ``Checkpointer.wait`` returns;
* ``restore``: ``ns.restore`` onto a target from ``ns.abstract_init`` on a
  different mesh (``data=4,model=2``), until every array is ready;
* ``restore peak RSS``: the restoring process's peak resident memory
  (``getrusage``) minus its resident memory just before the restore, as a
  multiple of the state size. On CPU the restored arrays themselves live in
  host memory, so 1.0x is the floor; the goal is <= 1.5x (nothing staged
  whole on the way). A restore also has a fixed cost (orbax and tensorstore
  thread pools, compiling the checksum programs, about 200 MiB), so the state
  is measured at two sizes, 512 MiB and 2 GiB, and the growth of the peak
  between them per byte of state is printed too.

Disk: the checkpoints go to a temporary directory (``--dir`` to choose) and are
deleted afterwards.

Run (about 3 minutes on 2 CPU cores; about 3 GB of disk at peak)::

    .venv/bin/python benchmarks/checkpoint.py

``--quick`` uses 64 and 128 MiB states (a smoke test of the script only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint.json"
WIDTH = 4096
GOAL = 1.5


# Worker (one process per measurement)
# ------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0  # pragma: no cover


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak if sys.platform == "darwin" else peak * 1024


def _factory(layers: int):
    from flax import nnx

    import nnx_shard as ns

    init = ns.with_logical(nnx.initializers.normal(0.02), ("embed", "mlp"))

    class Stack(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List(
                [nnx.Linear(WIDTH, WIDTH, use_bias=False, kernel_init=init, rngs=rngs)
                 for _ in range(layers)]
            )

    return lambda: Stack(nnx.Rngs(0))


def worker(mode: str, directory: str, layers: int) -> dict[str, float]:
    import jax

    import nnx_shard as ns

    rules = {"embed": "data", "mlp": None}
    factory = _factory(layers)
    out: dict[str, float] = {}
    if mode in ("save", "async"):
        model = ns.sharded_init(factory, "data=8", rules)
        jax.block_until_ready(jax.tree.leaves(model))
        if mode == "save":
            t = time.perf_counter()
            ns.save(directory, 1, model=model)
            out["save_s"] = time.perf_counter() - t
        else:
            with ns.Checkpointer(directory, every=1, async_save=True) as ckpt:
                t = time.perf_counter()
                ckpt.save(2, model=model)
                out["async_blocked_s"] = time.perf_counter() - t
                ckpt.wait()
                out["async_total_s"] = time.perf_counter() - t
    else:
        target = ns.abstract_init(factory, "data=4,model=2", {"embed": "data", "mlp": "model"})
        before = _rss()
        t = time.perf_counter()
        model = ns.restore(directory, model=target, step=1)
        jax.block_until_ready(jax.tree.leaves(model))
        out["restore_s"] = time.perf_counter() - t
        out["rss_before"] = before
        out["rss_peak"] = _peak_rss()
        kernel = model.layers[0].kernel.get_value()
        assert tuple(kernel.sharding.spec) == ("data", "model"), kernel.sharding
    return out


# Driver
# ------------------------------------------------------------------------------


def run_worker(mode: str, directory: str, layers: int) -> dict[str, float]:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run(
        [sys.executable, __file__, "--worker", mode, "--dir", directory, "--layers", str(layers)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    if done.returncode != 0:
        raise SystemExit(f"worker {mode} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(layers: int, base: str | None) -> dict[str, float]:
    state = layers * WIDTH * WIDTH * 4
    root = Path(tempfile.mkdtemp(prefix="nnx_shard_ckpt_bench_", dir=base))
    try:
        print(f"state: {layers} x {WIDTH}x{WIDTH} float32 = {state / 2**20:.0f} MiB, "
              "fsdp over data=8 (8 simulated CPU devices)", flush=True)
        saved = run_worker("save", str(root), layers)
        asyn = run_worker("async", str(root / "async"), layers)
        restored = run_worker("restore", str(root), layers)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    peak = restored["rss_peak"] - restored["rss_before"]
    return {
        "state_bytes": state,
        "save_s": saved["save_s"],
        "async_blocked_s": asyn["async_blocked_s"],
        "async_total_s": asyn["async_total_s"],
        "restore_s": restored["restore_s"],
        "restore_peak_rss_over_before_bytes": peak,
        "restore_peak_rss_ratio": peak / state,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 and 128 MiB: smoke test only")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.dir, args.layers)))
        return

    sizes = (1, 2) if args.quick else (8, 32)
    runs = [measure(layers, args.dir) for layers in sizes]
    small, large = runs
    # Peak growth per byte of state between the two sizes: what a restore costs
    # beyond its fixed overhead (thread pools, compiled checksum programs).
    marginal = (
        (large["restore_peak_rss_over_before_bytes"] - small["restore_peak_rss_over_before_bytes"])
        / (large["state_bytes"] - small["state_bytes"])
    )
    mib = 2**20
    header = ["measurement"] + [f"{r['state_bytes'] / mib:.0f} MiB state" for r in runs]
    rows = [
        ["save (sync)"] + [f"{r['save_s']:.2f} s" for r in runs],
        ["save (async): training blocked"] + [f"{r['async_blocked_s']:.2f} s" for r in runs],
        ["save (async): until on disk"] + [f"{r['async_total_s']:.2f} s" for r in runs],
        ["restore onto data=4,model=2"] + [f"{r['restore_s']:.2f} s" for r in runs],
        ["restore: peak RSS - RSS before"]
        + [f"{r['restore_peak_rss_over_before_bytes'] / mib:.0f} MiB" for r in runs],
        ["  as a multiple of the state"] + [f"{r['restore_peak_rss_ratio']:.2f}x" for r in runs],
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    print(f"restore peak RSS per extra byte of state (between the two sizes): {marginal:.2f}x "
          f"(goal <= {GOAL}x)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "runs": runs,
        "restore_marginal_rss_ratio": marginal,
        "goal_ratio": GOAL,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
    }
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
