"""Steps/s of the whole training loop: ``Trainer.fit`` against a hand-written scan and Keras 3.

Three models, Adam, data in host NumPy arrays, on 1 CPU device and on 8
simulated CPU devices (data parallel: batch sharded over ``data``), each
device count in its own subprocess (``XLA_FLAGS`` must be set before jax loads):

* ``tiny_k1``, ``tiny_k10``, ``tiny_k100``: ``nnx.Linear(4, 4)``, batch 8, MSE,
  K=1, 10 and 100 steps per call: the device has next to nothing to do, so these
  price the host work of each call (fit's own overhead, nowhere to hide);
* ``mlp_k1``, ``mlp_k10``, ``mlp``: MLP 32-128-128-8, batch 64, MSE, K=1, 10
  and 100 steps per call;
* ``lm``: the reference model ``small`` (4 layers, embed 128, context
  128, vocab 512), batch 8 x 128, K=10 (``tiny`` with ``--quick``).

Ways to run the same steps over the same host arrays:

* ``hand scan``: a hand-written ``jax.jit(jax.lax.scan)`` over the
  ``nnx.split`` state (donated), fed one ``[K, B, ...]`` slice of the host
  arrays per call with ``jax.device_put``; at most two calls in flight. The
  practical limit: no checks, no metrics but the loss.
* ``hand scan (stacked)``: the same loop fed from the list of per-step batches
  ``fit(batches)`` reads: ``np.stack`` of K of them per leaf, then one
  ``jax.device_put``, what a hand-written loop over a data loader does.
* ``fit(batches)``: ``Trainer.fit`` on a list of per-step batches (slices
  of the same arrays), what most data loaders give.
* ``fit(Batches)``: ``Trainer.fit(ns.Batches(arrays, batch_size))``: K steps
  read as one window of the arrays.
* ``keras``: Keras 3 on the JAX backend, the same MLP, ``model.fit(x, y,
  batch_size=64, steps_per_execution=K)`` (MLP only; optional: ``pip install
  keras``). On 8 devices Keras runs in a subprocess of its own with
  ``keras.distribution.DataParallel``, and what happens is recorded.

Every ``fit`` includes what a user's call pays: the NaN guard, the loss and
gradient-norm history, the progress bookkeeping (bar off), the stacking of
per-step batches (an ``ns.Batches`` is read as windows).
Variants run in interleaved rounds (rotating order), each round the same
number of steps; the table shows the median round and the median of the
per-round ratios (paired: both ran back to back, so shared load largely
cancels), and the host time of a call: microseconds of CPU time of the
calling thread per fused call (median round; the thread that dispatches,
stacks and reads back; XLA's own threads are not in it). Results go to
``benchmarks/results/fit_speed.json``.

Run (about 3 minutes on 2 CPU cores; ``--quick``: a shorter smoke run;
``--only mlp:1`` (or ``lm:8``, ``tiny_k10:1,mlp:8``...): only those models and
device counts, e.g. to iterate on one figure; ``mlp1`` also works for names
without a trailing digit)::

    .venv/bin/python benchmarks/fit_speed.py
    .venv/bin/python benchmarks/fit_speed.py --only tiny_k1:1,tiny_k10:1,tiny_k100:1,mlp:1
    JAX_PLATFORMS=cuda .venv/bin/python benchmarks/fit_speed.py --only mlp:1,lm:1   # one GPU
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import hand_scan, machine, mlp, parse, run_worker, worker_main, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "fit_speed.json"
DEVICE_COUNTS = (1, 8)
MODELS = {  # name: (global batch, steps per call K, steps per round, quick steps per round)
    "tiny_k1": (8, 1, 400, 100),
    "tiny_k10": (8, 10, 2000, 500),
    "tiny_k100": (8, 100, 10000, 2000),
    "mlp_k1": (64, 1, 300, 100),
    "mlp_k10": (64, 10, 1000, 300),
    "mlp": (64, 100, 3000, 1000),
    "lm": (8, 10, 20, 10),
}


def _env(n: int, only: str = "") -> dict:
    from nnx_shard._simulated import simulated_env

    # The worker reads --only from its environment (the shared worker command line
    # carries only the device count and --quick).
    env = {**simulated_env(n), "KERAS_BACKEND": "jax", "FIT_SPEED_ONLY": only}
    if os.environ.get("JAX_PLATFORMS") in ("cuda", "gpu", "rocm"):
        # Real accelerators instead of simulated CPU devices: --only must name counts
        # the machine has (e.g. mlp1,lm1 on one GPU).
        env["JAX_PLATFORMS"] = os.environ["JAX_PLATFORMS"]
    return env


def _selected(only: str) -> set[tuple[str, int]]:
    """``--only mlp:1,lm:8`` (or ``mlp1,lm8``) -> {("mlp", 1), ("lm", 8)}; empty: everything."""
    picked = set()
    for item in filter(None, (x.strip() for x in only.split(","))):
        if ":" in item:
            name, _, count = item.partition(":")
        else:
            name, count = item.rstrip("0123456789"), item[len(item.rstrip("0123456789")):]
        if name not in MODELS or not count.isdigit() or int(count) not in DEVICE_COUNTS:
            raise SystemExit(f"--only: {item!r} is not one of "
                             f"{', '.join(f'{m}:{n}' for n in DEVICE_COUNTS for m in MODELS)}")
        picked.add((name, int(count)))
    return picked or {(m, n) for m in MODELS for n in DEVICE_COUNTS}


# Worker (one process per device count)
# ------------------------------------------------------------------------------


def keras_mlp(k: int):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((32,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(8),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", steps_per_execution=k)
    return model


def worker(n_devices: int, quick: bool) -> dict:

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import Decoder, get_config, lm_loss

    assert jax.device_count() == n_devices, (jax.device_count(), n_devices)
    strategy = ns.strategies.get("dp")
    mesh = ns.make_mesh({"data": n_devices})
    rules = strategy.rules
    rounds = 2 if quick else 7
    rng = np.random.default_rng(0)
    try:
        import keras  # noqa: F401
        have_keras = n_devices == 1
    except ImportError:
        have_keras = False

    def mse(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    out: dict = {"n_devices": n_devices, "machine": machine(), "models": {}}
    picked = _selected(os.environ.get("FIT_SPEED_ONLY", ""))
    for name, (batch, k, per_round, quick_round) in MODELS.items():
        if (name, n_devices) not in picked:
            continue
        steps = quick_round if quick else per_round
        if name.startswith(("mlp", "tiny")):
            tiny = name.startswith("tiny")
            d_in, d_out = (4, 4) if tiny else (32, 8)
            arrays = {"x": rng.normal(size=(steps * batch, d_in)).astype(np.float32),
                      "y": rng.normal(size=(steps * batch, d_out)).astype(np.float32)}
            loss_fn = mse
            cfg = None

            def make(cfg=None, tiny=tiny):
                model = nnx.Linear(4, 4, rngs=nnx.Rngs(0)) if tiny else mlp(nnx.Rngs(0))
                opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
                state = jax.device_put(nnx.state((model, opt)),
                                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
                nnx.update((model, opt), state)
                return model, opt
        else:
            cfg = get_config("tiny" if quick else "small")
            tokens = rng.integers(0, cfg.vocab, size=(steps * batch, cfg.length + 1)).astype(np.int32)
            arrays = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
            loss_fn = lm_loss

            def make(cfg=cfg):
                model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
                return model, ns.sharded_optimizer(model, optax.adam(1e-3), mesh, strategy)

        # What a data loader hands over: one batch per step (here views of the arrays).
        per_step = [{key: v[i * batch:(i + 1) * batch] for key, v in arrays.items()}
                    for i in range(steps)]

        # -- hand scan ---------------------------------------------------------------
        m0, o0 = make()
        graphdef, state0 = nnx.split((m0, o0))
        data_sharding = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(None, "data"))

        scan_train = hand_scan(graphdef, loss_fn)
        box = [state0]
        calls = -(-steps // k)

        def hand(arrays=arrays, batch=batch, k=k, steps=steps, box=box, scan_train=scan_train,
                 data_sharding=data_sharding):
            res = []
            with ns.use(mesh, rules):
                for c in range(steps // k):
                    rows = slice(c * k * batch, (c + 1) * k * batch)
                    window = {key: v[rows].reshape(k, batch, *v.shape[1:])
                              for key, v in arrays.items()}
                    box[0], loss = scan_train(box[0], jax.device_put(window, data_sharding))
                    res.append(loss)
                    if len(res) > 2:
                        res[-3].block_until_ready()
            jax.block_until_ready(res)

        box_stacked = [nnx.split(make())[1]]

        def hand_stacked(per_step=per_step, k=k, steps=steps, box=box_stacked,
                         scan_train=scan_train, data_sharding=data_sharding):
            res = []
            with ns.use(mesh, rules):
                for c in range(steps // k):
                    group = per_step[c * k:(c + 1) * k]
                    window = {key: np.stack([b[key] for b in group]) for key in group[0]}
                    box[0], loss = scan_train(box[0], jax.device_put(window, data_sharding))
                    res.append(loss)
                    if len(res) > 2:
                        res[-3].block_until_ready()
            jax.block_until_ready(res)

        # -- Trainer.fit, twice --------------------------------------------------------
        def trainer(make=make, loss_fn=loss_fn, k=k):
            model, opt = make()
            return ns.Trainer(model, opt, loss_fn, mesh=mesh, rules=rules, steps_per_call=k)

        t_iter, t_win = trainer(), trainer()
        source = ns.Batches(arrays, batch)

        def fit_iter(t=t_iter, steps=steps, per_step=per_step):
            h = t.fit(per_step, steps, progress=False)
            assert h.steps == steps, h.stop_reason

        def fit_win(t=t_win, steps=steps, source=source):
            h = t.fit(source, steps, progress=False)
            assert h.steps == steps, h.stop_reason

        variants = {"hand scan": hand, "hand scan (stacked)": hand_stacked,
                    "fit(batches)": fit_iter, "fit(Batches)": fit_win}

        if name == "mlp" and have_keras:
            km = keras_mlp(k)

            def keras_fit(km=km, arrays=arrays, batch=batch):
                km.fit(arrays["x"], arrays["y"], batch_size=batch, epochs=1, shuffle=False,
                       verbose=0)

            variants["keras"] = keras_fit

        compile_s = {}
        for v, run in variants.items():  # compile and warm up: twice (the first call
            t0 = time.perf_counter()     # commits fresh state, the second reuses it)
            run()
            compile_s[v] = time.perf_counter() - t0
            run()
        rates: dict[str, list[float]] = {v: [] for v in variants}
        cpu_rates: dict[str, list[float]] = {v: [] for v in variants}
        host_us: dict[str, list[float]] = {v: [] for v in variants}
        order = list(variants)
        for r in range(rounds):
            for j in range(len(order)):
                v = order[(j + r) % len(order)]
                t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
                variants[v]()
                host_us[v].append((time.thread_time() - h0) / calls * 1e6)
                rates[v].append(steps / (time.perf_counter() - t0))
                cpu_rates[v].append(steps / (time.process_time() - c0))

        def paired(a: str, b: str, table: dict[str, list[float]]) -> float:
            return statistics.median(x / y for x, y in zip(table[a], table[b], strict=True))

        ratios, cpu_ratios = {}, {}
        pairs = [(v, "hand scan") for v in variants if v != "hand scan"]
        pairs.append(("fit(batches)", "hand scan (stacked)"))
        if "keras" in variants:
            pairs += [(v, "keras") for v in ("fit(batches)", "fit(Batches)")]
        for a, b in pairs:
            ratios[f"{a} / {b}"] = paired(a, b, rates)
            cpu_ratios[f"{a} / {b}"] = paired(a, b, cpu_rates)
        assert t_iter.traces == 1 and t_win.traces == 1, (t_iter.traces, t_win.traces)
        out["models"][name] = {
            "batch": batch, "steps_per_call": k, "steps_per_round": steps,
            "steps_per_s": {v: statistics.median(r) for v, r in rates.items()},
            "ratios": ratios, "rounds": rates, "first_two_runs_s": compile_s,
            # Steps per second of process CPU time (every thread): less sensitive than
            # wall time to other processes on a shared machine.
            "steps_per_cpu_s": {v: statistics.median(r) for v, r in cpu_rates.items()},
            "cpu_ratios": cpu_ratios, "cpu_rounds": cpu_rates,
            # CPU microseconds of the calling thread per fused call (median round).
            "host_us_per_call": {v: statistics.median(r) for v, r in host_us.items()},
        }
    if n_devices > 1 and ("mlp", n_devices) in picked:
        out["keras"] = keras_probe(n_devices, quick)
    return out


def keras_worker(n_devices: int, quick: bool) -> dict:
    """Keras' own data parallelism on the simulated devices (run in its own process:
    it may abort)."""
    import keras
    import numpy as np

    k, batch = MODELS["mlp"][1], MODELS["mlp"][0]
    steps = 200 if quick else 1000
    if n_devices > 1:
        keras.distribution.set_distribution(keras.distribution.DataParallel())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, 32)).astype(np.float32)
    y = rng.normal(size=(steps * batch, 8)).astype(np.float32)
    model = keras_mlp(k)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return {"steps_per_s": steps / (time.perf_counter() - t0)}


def keras_probe(n: int, quick: bool) -> dict:
    try:
        import keras  # noqa: F401
    except ImportError:
        return {"outcome": "keras not installed"}
    cmd = [sys.executable, __file__, "--keras-worker", str(n)] + (["--quick"] if quick else [])
    try:
        proc = subprocess.run(cmd, env=_env(n), capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return {"outcome": "timed out after 240 s (hung)"}
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        # The line that says why (XLA's CPU rendezvous, a failed check), else the last ones.
        why = [line for line in lines if "rendezvous" in line.lower() or "Check failed" in line]
        return {"outcome": f"exited with status {proc.returncode}",
                "stderr": (why or lines)[-3:]}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"outcome": "ran", **res}


# Driver
# ------------------------------------------------------------------------------


def fmt_table(all_results: list[dict]) -> str:
    lines = []
    for name in MODELS:
        results = [r for r in all_results if name in r["models"]]
        if not results:
            continue
        cols = [f"{r['n_devices']} dev" for r in results]
        first = results[0]["models"][name]
        lines.append(f"\n{name}: batch {first['batch']}, K={first['steps_per_call']}, "
                     f"{first['steps_per_round']} steps per round; steps/s (median round)")
        lines.append(f"| variant | {' | '.join(cols)} |")
        lines.append("| --- |" + " --- |" * len(cols))
        variants = list(dict.fromkeys(v for r in results for v in r["models"][name]["steps_per_s"]))
        for v in variants:
            cells = [f"{r['models'][name]['steps_per_s'][v]:,.0f}"
                     if v in r["models"][name]["steps_per_s"] else "-" for r in results]
            lines.append(f"| {v} | {' | '.join(cells)} |")
        ratios = list(dict.fromkeys(v for r in results for v in r["models"][name]["ratios"]))
        for key, what in (("ratios", "wall"), ("cpu_ratios", "CPU time")):
            for v in ratios:
                cells = [f"{r['models'][name][key][v]:.3f}" if v in r["models"][name][key]
                         else "-" for r in results]
                lines.append(f"| {v}, {what} (median of paired rounds) | {' | '.join(cells)} |")
        for v in variants:
            cells = [f"{r['models'][name]['host_us_per_call'][v]:,.0f}"
                     if v in r["models"][name].get("host_us_per_call", {}) else "-"
                     for r in results]
            lines.append(f"| {v}, calling thread CPU us per call | {' | '.join(cells)} |")
    for r in all_results:
        if "keras" in r:
            lines.append(f"\nkeras DataParallel on {r['n_devices']} simulated devices: "
                         f"{json.dumps(r['keras'])}")
    return "\n".join(lines)


def main() -> None:
    only = ""
    if "--only" in sys.argv:  # parse() knows only the shared flags
        i = sys.argv.index("--only")
        only = sys.argv[i + 1] if i + 1 < len(sys.argv) else ""
        del sys.argv[i:i + 2]
        _selected(only)  # a bad name fails here, before any worker starts
    args = parse(__doc__, ("worker", "keras_worker"))
    if worker_main(args, {"worker": worker, "keras_worker": keras_worker}):
        return
    t0 = time.perf_counter()
    counts = sorted({n for _, n in _selected(only)})
    results = [run_worker(__file__, n, args.quick, env=_env(n, only)) for n in counts]
    load = os.getloadavg()
    import jax

    print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load average {load[0]:.2f} at the end (shared machine)")
    print(fmt_table(results))
    # A partial run does not overwrite the full table's results.
    path = RESULTS.with_name(f"fit_speed_{only.replace(',', '_').replace(':', '-')}.json") if only else RESULTS
    write_json(path, {
        "jax": jax.__version__, "cores": os.cpu_count(), "loadavg_end": load,
        "quick": args.quick, "only": only or None, "seconds": time.perf_counter() - t0, "results": results,
    })


if __name__ == "__main__":
    main()
