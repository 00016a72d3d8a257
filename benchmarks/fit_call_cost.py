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

import contextlib
import os
import platform
import statistics
from pathlib import Path

from _common import (
    fit_call,
    hand_call,
    lm_problem,
    parse,
    print_table,
    run_worker,
    time_calls,
    worker_main,
    write_json,
)

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

    import nnx_shard as ns
    from nnx_shard._train import _guard as train_guard
    from nnx_shard._train import _trainer as train_trainer

    assert jax.device_count() == n_devices, (jax.device_count(), n_devices)
    name = os.environ.get(STRATEGY_ENV, "dp")
    lm = lm_problem(name, n_devices, quick, K, BATCH)

    def temp_mib(compiled) -> float:
        return compiled.memory_analysis().temp_size_in_bytes / 2**20

    calls, temp = {}, {}

    calls["hand scan"], compiled, state = hand_call(lm)
    temp["hand scan"] = temp_mib(compiled)

    # -- fit's call, and the same call with parts taken out ------------------------------
    @contextlib.contextmanager
    def taken_out(undo=True, grad_norm=True, shares=True):
        saved = train_guard.grads_norm, train_guard.grad_sq_shares, train_trainer.guard_call
        if not undo:  # fit's own end-of-call guard, minus the select back
            train_trainer.guard_call = functools.partial(train_guard.guard_call, undo=False)
        if not grad_norm:
            train_guard.grads_norm = lambda grads, replicated=False: jnp.zeros(())
        if not grad_norm or not shares:
            train_guard.grad_sq_shares = lambda grads, specs, mesh: None
        try:
            yield
        finally:
            train_guard.grads_norm, train_guard.grad_sq_shares, train_trainer.guard_call = saved

    def variant(**parts):
        call, compiled = fit_call(lm, K, BATCH, "full", functools.partial(taken_out, **parts))
        return call, temp_mib(compiled)

    calls["fit"], temp["fit"] = variant()
    calls[VARIANTS[2]], temp[VARIANTS[2]] = variant(shares=False)
    calls[VARIANTS[3]], temp[VARIANTS[3]] = variant(undo=False)
    calls[VARIANTS[4]], temp[VARIANTS[4]] = variant(undo=False, grad_norm=False)

    rounds = 3 if quick else 12
    with ns.use(lm.mesh, lm.rules):
        timed = time_calls(calls, list(VARIANTS), rounds)
    wall, cpu = timed.wall, timed.cpu

    return {
        "n_devices": n_devices, "strategy": name, "model": "tiny" if quick else "small", "rounds": rounds,
        "ms_per_call": {v: 1e3 * statistics.median(wall[v]) for v in VARIANTS},
        "over_hand_wall": {v: timed.over("wall", v, "hand scan") for v in VARIANTS},
        "over_hand_cpu": {v: timed.over("cpu", v, "hand scan") for v in VARIANTS},
        "temp_mib_per_device": temp,
        "state_mib_per_device": state,
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
