"""What the benchmark scripts share: the small MLP, and running a worker per device count.

Each device count runs in a subprocess of its own (``XLA_FLAGS`` must be set
before jax loads): the script calls itself with ``--worker N`` (or another
worker flag) and reads the JSON line it prints last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nnx_shard.launch import simulated_env


def mlp(rngs):
    """MLP 32-128-128-8 with ReLU (the issue tracker's speed reference)."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.l1 = nnx.Linear(32, 128, rngs=rngs)
            self.l2 = nnx.Linear(128, 128, rngs=rngs)
            self.l3 = nnx.Linear(128, 8, rngs=rngs)

        def __call__(self, x):
            return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))

    return MLP(rngs)


def parse(doc: str, workers: tuple[str, ...] = ("worker",)) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    for name in workers:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    return ap.parse_args()


def worker_main(args: argparse.Namespace, workers: dict[str, Callable[[int, bool], dict]]) -> bool:
    """Runs the worker the command line names, printing its JSON; False if none."""
    for name, fn in workers.items():
        n = getattr(args, name)
        if n:
            print(json.dumps(fn(n, args.quick)))
            return True
    return False


def run_worker(script: str, n: int, quick: bool, *, flag: str = "--worker",
               env: dict[str, str] | None = None, timeout: float = 900) -> dict:
    """Runs ``script flag n`` with ``n`` simulated CPU devices; its last line, parsed."""
    cmd = [sys.executable, script, flag, str(n)] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, env=env or simulated_env(n), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"worker for {n} devices failed ({proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


def interleaved(runs: list, rounds: int, steps: int, call: Callable) -> list[float]:
    """Median steps/s of each run, timed in ``rounds`` rounds that visit the runs in a
    rotating order (so drifting load on a shared machine spreads over all of them);
    ``call(run)`` does one step and blocks on its result."""
    import statistics
    import time

    import numpy as np

    rates: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        for i in np.roll(np.arange(len(runs)), -r):
            t0 = time.perf_counter()
            for _ in range(steps):
                call(runs[i])
            rates[i].append(steps / (time.perf_counter() - t0))
    return [statistics.median(x) for x in rates]


def time_compiled(rows: list[dict], runs: list[tuple], rounds: int, steps: int) -> None:
    """Times each run ``(compiled, *args)`` with :func:`interleaved`, one blocking
    ``compiled(*args)`` a step, and puts its steps/s in the row at the same place."""
    import jax

    rates = interleaved(runs, rounds, steps, lambda run: jax.block_until_ready(run[0](*run[1:])))
    for row, rate in zip(rows, rates, strict=True):
        row["steps_per_s"] = rate


def print_table(columns: list[str], rows: list[list]) -> None:
    """Prints a markdown table: a header of ``columns``, then one line a row of cells."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")


def machine() -> str:
    """``jax 0.10.2, 8 cpu device(s), x86_64``: where a table was measured."""
    import platform

    import jax

    return (f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} device(s), "
            f"{platform.processor() or platform.machine()}")


def lm_train_step(model, optimizer, batch):
    """One optimizer step of the reference transformer's ``lm_loss``."""
    from flax import nnx

    from nnx_shard.models import lm_loss

    loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss}


def lm_host_batches(cfg, k: int, batch: int, seed: int) -> dict:
    """``k`` steps of ``batch`` random next-token pairs for ``cfg``, on the host."""
    import numpy as np

    toks = np.random.default_rng(seed).integers(0, cfg.vocab, size=(k, batch, cfg.length + 1))
    toks = toks.astype(np.int32)
    return {"inputs": toks[:, :, :-1], "targets": toks[:, :, 1:]}


@dataclasses.dataclass
class Setup:
    """One layout of the reference transformer, compiled and ready to be timed."""

    name: str
    mesh: Any
    rules: Any
    model: Any
    opt: Any
    fused: Any
    data: list
    row: dict
