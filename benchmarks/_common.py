"""What the benchmark scripts share: the small MLP, and running a worker per device count.

Each device count runs in a subprocess of its own (``XLA_FLAGS`` must be set
before jax loads): the script calls itself with ``--worker N`` (or another
worker flag) and reads the JSON line it prints last. A script that runs on
one device count itself sets it with :func:`simulated_cpu` before it imports
jax, which is why importing this module loads neither jax nor nnx_shard.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def simulated_cpu(n: int) -> dict[str, str]:
    """The environment for ``n`` simulated CPU devices in this process, for
    ``os.environ.update`` before jax is imported (jax and XLA read it when they
    load): the device-count flag appended to ``XLA_FLAGS``, and the CPU platform
    unless ``JAX_PLATFORMS`` names one."""
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    return {"XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}


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



def bytes_parser(doc: str, quick: str, out: Path) -> argparse.ArgumentParser:
    """The flags of a benchmark that reads compiled figures: ``--quick`` (``quick`` says
    what it runs) and ``--out`` (default ``out``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--out", type=Path, default=out, help="where the JSON goes")
    return ap


def cost_parser(doc: str, quick: str, out: Path, timed: str) -> argparse.ArgumentParser:
    """:func:`bytes_parser`'s flags and ``--time ROUNDS``, which also runs each program on
    real arrays (``timed``: what one round runs)."""
    ap = bytes_parser(doc, quick, out)
    ap.add_argument("--time", type=int, default=0, metavar="ROUNDS",
                    help=f"also run each {timed} on real arrays: median ms over ROUNDS "
                    "rounds (meant for an accelerator)")
    return ap

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
    from nnx_shard._simulated import simulated_env

    cmd = [sys.executable, script, flag, str(n)] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, env=env or simulated_env(n), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"worker for {n} devices failed ({proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def provenance() -> dict[str, Any]:
    """Where and how a result was measured: the CPU model and cores, the load average when
    the result was written, the versions of the packages a run uses, and the command."""
    import platform
    from importlib import metadata

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    versions = {}
    for name in ("jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint", "qwix",
                 "nnx_shard"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {"cpu": cpu, "cores": os.cpu_count(),
            "loadavg_at_write": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "python": platform.python_version(), "versions": versions,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "command": " ".join(["python", *sys.argv])}


def write_json(path: Path, payload: dict) -> None:
    """Writes ``payload`` with its :func:`provenance` (unless it has one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**payload, "provenance": payload.get("provenance")
                                or provenance()}, indent=2))
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



@dataclasses.dataclass
class Timings:
    """Seconds of wall and of process CPU time of one call of each name, one per round."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]

    def over(self, table: str, v: str, base: str) -> float:
        """The median over rounds of ``v``'s time over ``base``'s (``table``: "wall" or
        "cpu")."""
        import statistics

        times = getattr(self, table)
        return statistics.median(a / b for a, b in zip(times[v], times[base], strict=True))


def time_calls(calls: dict[str, Callable[[], Any]], names: list[str], rounds: int) -> Timings:
    """The times of one call of each of ``names`` (a key of ``calls``; its result waited
    for), each the mean of two calls, one per round of ``rounds`` that visit the names in a
    rotating order, after one warm-up call each."""
    import time

    import jax

    timings = Timings({v: [] for v in names}, {v: [] for v in names})
    for v in names:  # warm up
        jax.block_until_ready(calls[v]())
    for r in range(rounds):
        for j in range(len(names)):
            v = names[(j + r) % len(names)]
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(2):
                jax.block_until_ready(calls[v]())
            timings.wall[v].append((time.perf_counter() - t0) / 2)
            timings.cpu[v].append((time.process_time() - c0) / 2)
    return timings


def median_ms(step: Callable[[], Any], rounds: int, steps: int) -> float:
    """Milliseconds of one ``step()`` (which blocks on its result) at :func:`interleaved`'s
    median rate over ``rounds`` rounds of ``steps`` calls, after one warm-up call."""
    step()
    return 1e3 / interleaved([step], rounds, steps, lambda run: run())[0]


def hlo_ops(compiled: Any, names: tuple[str, ...]) -> dict[str, int]:
    """How often each of ``names`` occurs in the optimised HLO of ``compiled``
    (which kernels a backend chose, e.g. ``ragged-dot`` or a Triton custom call)."""
    text = compiled.as_text()
    return {name: text.count(name) for name in names}


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


#: The protocol of the strategy benchmarks (strategies.py, async_tp.py), one so that
#: their figures compare: the reference transformer ``small`` trained with AdamW
#: (``optax.adamw(1e-3)``), K steps per fused call, a global batch of BATCH.
K = 4
BATCH = 16
LM_MODEL = "small (4 layers, d=128, 4 heads x 32, mlp 512, vocab 512, seq 128)"


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


def lm_device_batches(cfg, mesh, rules) -> list[dict]:
    """The two K-step batches (seeds 0 and 1) that :func:`timed_calls` alternates,
    laid out by ``rules`` on ``mesh`` (under ``ns.use``)."""
    import nnx_shard as ns

    return [ns.shard_batch(lm_host_batches(cfg, K, BATCH, i), mesh, rules, ("batch", "length"),
                           steps=True) for i in range(2)]


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


def timed_calls(setup: Setup, calls: int) -> tuple[float, float]:
    """Steps/s over ``calls`` calls of ``setup.fused`` (K steps each) on its two
    batches in turn, at most two in flight, and the process's CPU seconds per step
    (all the simulated devices' work: less sensitive than wall time to other load
    on the machine)."""
    import collections
    import time

    import jax
    from flax import nnx

    import nnx_shard as ns

    pending: collections.deque = collections.deque()
    with ns.use(setup.mesh, setup.rules):
        c0 = time.process_time()
        t0 = time.perf_counter()
        for i in range(calls):
            pending.append(setup.fused(setup.model, setup.opt, setup.data[i % 2]))
            if len(pending) > 2:
                jax.block_until_ready(pending.popleft())
        jax.block_until_ready(list(pending))
        jax.block_until_ready(nnx.state(setup.model))
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
    return calls * K / dt, cpu / (calls * K)


def time_lm(names: list[str], prepare: Callable[[str], Setup], quick: bool, rounds: int,
            calls: int) -> tuple[list[dict], dict]:
    """The strategy benchmarks' timing, on 8 simulated devices: a :class:`Setup` per
    name from ``prepare`` (printing its compile time), timed with :func:`timed_calls`
    in ``rounds`` rounds of ``calls`` calls (1 and 2 with ``quick``), the rounds in
    alternating order (other load on the machine hits every setup alike).

    Returns the rows, with the steps/s and the CPU seconds per step of each round
    (``*_rounds``) and their medians, and the run's ``meta`` for the JSON."""
    import platform
    import statistics
    import time

    import jax

    assert jax.device_count() == 8, jax.device_count()
    t0 = time.perf_counter()
    rounds, calls = (1, 2) if quick else (rounds, calls)
    setups = []
    for name in names:
        setups.append(prepare(name))
        print(f"  {name}: compiled in {setups[-1].row['compile_s']:.1f} s", flush=True)
    rates: dict[str, list[float]] = {s.name: [] for s in setups}
    cpu: dict[str, list[float]] = {s.name: [] for s in setups}
    for r in range(rounds):
        for setup in (setups if r % 2 == 0 else setups[::-1]):
            rate, cpu_s = timed_calls(setup, calls)
            rates[setup.name].append(rate)
            cpu[setup.name].append(cpu_s)
    for setup in setups:
        setup.row.update(steps_per_s_rounds=rates[setup.name],
                         steps_per_s=statistics.median(rates[setup.name]),
                         cpu_s_per_step_rounds=cpu[setup.name],
                         cpu_s_per_step=statistics.median(cpu[setup.name]))
    meta = {"jax": jax.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(),
            "backend": jax.default_backend(), "devices": jax.device_count(),
            "K": K, "global_batch": BATCH, "model": LM_MODEL, "optimizer": "adamw",
            "rounds": rounds, "calls_per_round": calls, "quick": quick,
            "seconds": time.perf_counter() - t0}
    return [setup.row for setup in setups], meta


def report(path: Path, table: str, note: str, rows: list[dict], meta: dict) -> None:
    """Prints a benchmark's table and its note, and writes its rows and meta to ``path``."""
    print()
    print(table)
    print(note)
    write_json(path, {"meta": meta, "results": rows})


def hand_scan(graphdef: Any, loss_fn: Callable, unroll: int = 1) -> Callable:
    """The benchmarks' bare reference: ``jax.jit(jax.lax.scan)`` of K plain steps
    (``nnx.value_and_grad`` of ``loss_fn(model, batch)``, ``opt.update``) over the
    ``nnx.split((model, optimizer))`` state, donated; returns ``(state, losses)``.
    ``unroll`` is ``jax.lax.scan``'s (steps per loop iteration)."""
    import functools

    import jax
    from flax import nnx

    @functools.partial(jax.jit, donate_argnums=0)
    def scan_train(state: Any, batches: Any) -> Any:
        def body(state: Any, step_batch: Any) -> Any:
            model, opt = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(loss_fn)(model, step_batch)
            opt.update(model, grads)
            return nnx.split((model, opt))[1], loss

        return jax.lax.scan(body, state, batches, unroll=unroll)

    return scan_train


@dataclasses.dataclass
class LMProblem:
    """The reference LM trained data-parallel-style for the fit-cost benchmarks: one
    window of K steps (host arrays and the same on devices, batch over ``data``) and a
    ``make()`` of a fresh sharded model and Adam optimizer."""

    strategy: Any
    mesh: Any
    cfg: Any
    arrays: dict
    window: Any
    make: Callable[[], tuple[Any, Any]]

    @property
    def rules(self) -> Any:
        return self.strategy.rules



def hand_call(lm: LMProblem) -> tuple[Callable[[], Any], Any, float]:
    """The :func:`hand_scan` of ``lm``'s window as a call (for :func:`time_calls`) on a
    fresh model, each call going on from the state the last left; its compiled program;
    the MiB of that state the first device holds."""
    import jax
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import lm_loss

    graphdef, state0 = nnx.split(lm.make())
    scan_train: Any = hand_scan(graphdef, lm_loss)
    box = [state0]

    def hand() -> Any:
        box[0], loss = scan_train(box[0], lm.window)
        return loss

    with ns.use(lm.mesh, lm.rules):
        compiled = scan_train.lower(box[0], lm.window).compile()
    mib = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state0)) / 2**20
    return hand, compiled, mib


def fit_call(lm: LMProblem, k: int, batch: int, guard: str,
             during_fit: Callable[[], Any] = contextlib.nullcontext
             ) -> tuple[Callable[[], Any], Any]:
    """The compiled call of a ``Trainer`` of a fresh model of ``lm`` (``k`` steps a call,
    NaN guard ``guard``) on ``lm``'s window, as ``fit`` makes it but without fit's host
    loop, and its compiled program. One ``fit`` of ``k`` steps (in the context
    ``during_fit()``) compiles it and records the layout fit reads from the arrays."""
    import nnx_shard as ns
    from nnx_shard._train._fused import Carry
    from nnx_shard.models import lm_loss

    with during_fit():
        t = ns.Trainer(*lm.make(), lm_loss, mesh=lm.mesh, rules=lm.rules, steps_per_call=k,
                       guard=guard)
        history = t.fit(ns.Batches(lm.arrays, batch), k, progress=False)
    assert history.steps == k and t.traces == 1, (history.stop_reason, t.traces)
    carry: Any = Carry(t._fused)

    def call() -> Any:
        return carry(t.model, t.optimizer, lm.window, t._guard)

    with ns.use(lm.mesh, lm.rules):
        call()  # run once
        compiled = carry.plan.jitted.lower(carry.values, (lm.window,)).compile()
    return call, compiled

def lm_problem(strategy_name: str, n_devices: int, quick: bool, k: int, batch: int) -> LMProblem:
    """``small`` (``tiny`` with ``quick``) under preset ``strategy_name`` on
    ``data=n_devices``, ``k`` steps of ``batch`` random token sequences."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import Decoder, get_config

    strategy = ns.strategies.get(strategy_name)
    mesh = ns.make_mesh({"data": n_devices})
    cfg = get_config("tiny" if quick else "small")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab, size=(k * batch, cfg.length + 1)).astype(np.int32)
    arrays = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    window = jax.device_put({key: v.reshape(k, batch, -1) for key, v in arrays.items()},
                            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data")))

    def make() -> tuple[Any, Any]:
        model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
        return model, ns.sharded_optimizer(model, optax.adam(1e-3), mesh, strategy)

    return LMProblem(strategy, mesh, cfg, arrays, window, make)

