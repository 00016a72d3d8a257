"""Where ``Trainer.fit``'s compiled call spends its time beyond a bare scan.

``benchmarks/fit_speed.py`` times the whole loop; this times the compiled calls
alone, on data already on the devices (one call, then block), so the host's
work is out of the figure and what is left is what each call computes. The
``small`` reference model (batch 8 x 128, Adam), K=10 steps per call, on
1 device and on 8 simulated CPU devices under ``dp`` (state replicated) and
``fsdp`` (state sharded 1/8), each setting in a subprocess of its own; five
compiled calls in interleaved rounds:

* ``hand scan``: ``jax.jit(jax.lax.scan)`` over the ``nnx.split`` state
  (donated), ``nnx.value_and_grad`` and ``opt.update``; the loss is its only
  output (as in fit_speed.py);
* ``fit``: the call ``Trainer(..., guard="full").fit`` runs: the same steps,
  each step's gradient norm, and the NaN guard (once per call: every step's loss and
  gradient norm and the final state are checked; a call that fails is
  undone, so the state before the call is kept until its end);
* ``fit, norm reduced every step``: ``fit``'s call with the gradient norm
  summed to one scalar in every step (a cross-device reduction per step when
  gradients are sharded), as fit did before it summed each device's share
  once per call;
* ``fit, guard without undo``: the guard's check, without keeping the state
  before the call (nor selecting it back);
* ``fit, no undo, no gradient norm``: that, and no per-step gradient norm.

The last two are not options of ``Trainer``: they are built here (fit's own
end-of-call guard with ``undo=False``, and the step's gradient norm replaced
by zeros) to price each part. Beside the time, each call's compiled temporary
bytes per device (``memory_analysis().temp_size_in_bytes``): the undo's copy
of the state shows there. Results go to ``benchmarks/results/fit_call_cost.json``.

Run (about 5 minutes on 2 CPU cores; ``--quick``: a short smoke run)::

    .venv/bin/python benchmarks/fit_call_cost.py
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

from _common import hand_scan, lm_problem, parse, print_table, run_worker, worker_main, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "fit_call_cost.json"
# (devices, strategy): on one device fsdp is dp.
SETTINGS = ((1, "dp"), (8, "dp"), (8, "fsdp"))
STRATEGY_ENV = "FIT_CALL_STRATEGY"
BATCH, K = 8, 10
VARIANTS = ("hand scan", "fit", "fit, norm reduced every step", "fit, guard without undo",
            "fit, no undo, no gradient norm")


def worker(n_devices: int, quick: bool) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard._train import _guard as train_guard
    from nnx_shard._train import _trainer as train_trainer
    from nnx_shard._train._fused import Carry
    from nnx_shard.models import lm_loss

    assert jax.device_count() == n_devices, (jax.device_count(), n_devices)
    name = os.environ.get(STRATEGY_ENV, "dp")
    lm = lm_problem(name, n_devices, quick, K, BATCH)
    mesh, rules, arrays, window, make = lm.mesh, lm.rules, lm.arrays, lm.window, lm.make

    def temp_mib(compiled) -> float:
        return compiled.memory_analysis().temp_size_in_bytes / 2**20

    calls, temp = {}, {}

    # -- hand scan -------------------------------------------------------------------
    graphdef, state0 = nnx.split(make())

    scan_train = hand_scan(graphdef, lm_loss)
    box = [state0]

    def hand():
        box[0], loss = scan_train(box[0], window)
        return loss

    with ns.use(mesh, rules):
        temp["hand scan"] = temp_mib(scan_train.lower(box[0], window).compile())
    calls["hand scan"] = hand

    # -- fit's call, and the same call with parts taken out ------------------------------
    def fit_call(undo=True, grad_norm=True, shares=True):
        saved = train_guard.grads_norm, train_guard.grad_sq_shares, train_trainer.guard_call
        if not undo:  # fit's own end-of-call guard, minus the select back
            train_trainer.guard_call = functools.partial(train_guard.guard_call, undo=False)
        if not grad_norm:
            train_guard.grads_norm = lambda grads, replicated=False: jnp.zeros(())
        if not grad_norm or not shares:
            train_guard.grad_sq_shares = lambda grads, specs, mesh: None
        try:  # one fit compiles the call (and records the layout fit reads from the arrays)
            t = ns.Trainer(*make(), lm_loss, mesh=mesh, rules=rules, steps_per_call=K,
                           guard="full")
            history = t.fit(ns.Batches(arrays, BATCH), K, progress=False)
        finally:
            train_guard.grads_norm, train_guard.grad_sq_shares, train_trainer.guard_call = saved
        assert history.steps == K and t.traces == 1, (history.stop_reason, t.traces)
        carry = Carry(t._fused)

        def call():
            return carry(t.model, t.optimizer, window, t._guard)

        with ns.use(mesh, rules):
            call()
            compiled = carry.plan.jitted.lower(carry.values, (window,)).compile()
        return call, temp_mib(compiled)

    calls["fit"], temp["fit"] = fit_call()
    calls[VARIANTS[2]], temp[VARIANTS[2]] = fit_call(shares=False)
    calls[VARIANTS[3]], temp[VARIANTS[3]] = fit_call(undo=False)
    calls[VARIANTS[4]], temp[VARIANTS[4]] = fit_call(undo=False, grad_norm=False)

    rounds = 3 if quick else 12
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with ns.use(mesh, rules):
        for v in VARIANTS:  # warm up
            jax.block_until_ready(calls[v]())
        for r in range(rounds):
            for j in range(len(VARIANTS)):
                v = VARIANTS[(j + r) % len(VARIANTS)]
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(2):
                    jax.block_until_ready(calls[v]())
                wall[v].append((time.perf_counter() - t0) / 2)
                cpu[v].append((time.process_time() - c0) / 2)

    def paired(table: dict[str, list[float]], v: str) -> float:
        return statistics.median(a / b for a, b in zip(table[v], table["hand scan"], strict=True))

    return {
        "n_devices": n_devices, "strategy": name, "model": "tiny" if quick else "small", "rounds": rounds,
        "ms_per_call": {v: 1e3 * statistics.median(wall[v]) for v in VARIANTS},
        "over_hand_wall": {v: paired(wall, v) for v in VARIANTS},
        "over_hand_cpu": {v: paired(cpu, v) for v in VARIANTS},
        "temp_mib_per_device": temp,
        "state_mib_per_device": sum(
            x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(box[0])) / 2**20,
        "wall_s": wall, "cpu_s": cpu,
    }


def main() -> None:
    args = parse(__doc__)
    if worker_main(args, {"worker": worker}):
        return
    from nnx_shard._simulated import simulated_env

    results = [run_worker(__file__, n, args.quick, env={**simulated_env(n), STRATEGY_ENV: name})
               for n, name in SETTINGS]
    load = os.getloadavg()
    import jax

    print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load average {load[0]:.2f} at the end (shared machine)")
    first = results[0]
    print(f"\n{first['model']} transformer, batch {BATCH}, K={K} steps per call, data on the "
          f"devices; per call: median of {first['rounds']} rounds; / hand scan: median of paired "
          "rounds (wall, process CPU time); temp: compiled temporary bytes per device")
    rows = []
    for r in results:
        setting = f"{r['n_devices']} dev, {r['strategy']} (state {r['state_mib_per_device']:.2f} MiB)"
        for v in VARIANTS:
            rows.append([setting, v, f"{r['ms_per_call'][v]:.1f}", f"{r['over_hand_wall'][v]:.3f}",
                         f"{r['over_hand_cpu'][v]:.3f}", f"{r['temp_mib_per_device'][v]:.2f}"])
    print_table(["devices, strategy", "compiled call", "ms per call", "/ hand (wall)",
                 "/ hand (CPU)", "temp MiB per device"], rows)
    write_json(RESULTS, {"jax": jax.__version__, "cores": os.cpu_count(), "loadavg_end": load,
                         "quick": args.quick, "results": results})


if __name__ == "__main__":
    main()
