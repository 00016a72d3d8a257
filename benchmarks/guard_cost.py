"""What each mode of ``Trainer.fit``'s NaN guard costs: bytes per device and steps/s.

``Trainer(..., guard=...)``:

* ``full``: the call keeps the state from before it and puts it back if any
  step's loss, gradient norm or the final state is not finite (then the call is
  replayed with every step checked): one more copy of the parameters and
  optimizer state per device;
* ``grads`` (the default): each step is applied only where its loss and gradient
  norm are finite (the optimizer step skipped with ``jax.lax.cond``), the final
  state checked once per call; nothing kept, nothing undone;
* ``off``: every step applied, the call checked once at its end.

``grads, select gate`` is ``grads`` with the update computed and the old values
selected back (``jnp.where`` per leaf) instead of the ``cond``: not an option of
``Trainer``, set here through ``nnx_shard._train._guard.skip_update_with`` to show why the
``cond`` was chosen. ``hand scan`` is the bare ``jax.jit(jax.lax.scan)`` of the
same steps (no checks, no gradient norm), the floor.

Two parts, each in subprocesses with simulated CPU devices:

1. Memory of Llama-3.1 8B (``ns.models.CONFIGS["llama3-8b"]``: bfloat16 parameters,
   AdamW, scanned layers, remat full) under ``fsdp`` on ``data=8``, batch 8 x seq
   256, compiled from abstract inputs as ``nnx-shard plan`` does (nothing is
   allocated): XLA's temp, argument and total bytes per device of fit's call per
   mode, beside the bare fused step and the planner formula's guard bytes.
2. Steps/s and memory of the ``small`` transformer (batch 8 x 128, Adam, K=10 steps
   per call) on 1 device (dp) and on 8 simulated devices under ``dp`` (state
   replicated) and ``fsdp`` (state 1/8 per device): the compiled calls alone on
   data already on the devices (one call, then block), in interleaved rounds, as
   ``benchmarks/fit_call_cost.py`` does; ratios are medians of paired rounds.

Results go to ``benchmarks/results/guard_cost.json``. Run (about 15 minutes on 2
CPU cores; ``--quick``: the tiny configs, a smoke run; ``--skip-8b``)::

    .venv/bin/python benchmarks/guard_cost.py
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from _common import fit_call, hand_call, lm_problem, print_table, run_worker, time_calls, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "guard_cost.json"
SETTINGS = ((1, "dp"), (8, "dp"), (8, "fsdp"))
STRATEGY_ENV = "GUARD_COST_STRATEGY"
BATCH, K = 8, 10
# (label, Trainer's guard, the gate of make_gated_step)
MODES = (("full", "full", None), ("grads", "grads", "cond"),
         ("grads, select gate", "grads", "select"), ("off", "off", "cond"))
VARIANTS = ("hand scan", *(m[0] for m in MODES))
LLAMA_BATCH, LLAMA_SEQ = 8, 256


def _gate(gate: str | None):
    """A context setting make_gated_step's gate while the step is traced."""
    import contextlib

    from nnx_shard._train._guard import skip_update_with

    return skip_update_with(gate) if gate else contextlib.nullcontext()


def _mem(compiled) -> dict:
    m = compiled.memory_analysis()
    arg, temp, out, alias = (int(m.argument_size_in_bytes), int(m.temp_size_in_bytes),
                             int(m.output_size_in_bytes), int(m.alias_size_in_bytes))
    return {"temp": temp, "argument": arg, "total": arg + temp + out - alias}


def memory_worker(n_devices: int, quick: bool) -> dict:
    """Part 1: fit's call per mode for the 8B config, compiled abstractly."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    import nnx_shard as ns
    from nnx_shard._optimizers import get as optimizer
    from nnx_shard.models import CONFIGS, Decoder, lm_loss
    from nnx_shard.planner._compile import compile_fit
    from nnx_shard.planner._formula import abstract_report, formula

    assert jax.device_count() == n_devices
    name = "tiny" if quick else "llama3-8b"
    cfg = dataclasses.replace(CONFIGS[name], remat="full", scan_layers=True)
    batch, seq = (8, 16) if quick else (LLAMA_BATCH, LLAMA_SEQ)
    sizes = {"data": n_devices}
    factory = lambda: Decoder(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    out: dict = {"model": name, "strategy": "fsdp", "sizes": sizes, "batch": batch, "seq": seq,
                 "remat": "full", "param_dtype": jnp.dtype(cfg.param_dtype).name, "modes": {}}
    for label, mode, gate in MODES:
        t0 = time.perf_counter()
        with _gate(gate):
            compiled, trainer, _ = compile_fit(factory, "fsdp", sizes, batch=batch, seq=seq,
                                               guard=mode)
        out["modes"][label] = {**_mem(compiled), "compile_s": time.perf_counter() - t0}
        print(label, out["modes"][label], file=sys.stderr, flush=True)
    strat = ns.strategies.get("fsdp")
    report = abstract_report(trainer.model, sizes, strat.rules, optimizer("adamw"),
                             strat.opt_rules)
    out["state_per_device"] = int(report.param_bytes_per_device + report.opt_bytes_per_device)
    out["formula_guard"] = {mode: formula(report, 0, mode)["guard"] for _, mode, _ in MODES}

    # The bare fused step: value_and_grad and the update, no guard, no gradient norm.
    mesh = trainer.mesh
    spec = strat.rules.spec((None, "batch", "length"), shape=(2, batch, seq), mesh=mesh)
    tokens = jax.ShapeDtypeStruct((2, batch, seq), jnp.int32, sharding=NamedSharding(mesh, spec))

    def step(model, opt, batch):
        loss, grads = ns.value_and_grad(lm_loss)(model, batch)
        opt.update(model, grads)
        return loss

    with ns.use(mesh, strat.rules):
        lowered = ns.multistep(step).lower(trainer.model, trainer.optimizer,
                                           {"inputs": tokens, "targets": tokens})
    out["bare"] = _mem(lowered.compile())
    return out


def time_worker(n_devices: int, quick: bool) -> dict:
    """Part 2: the small transformer's compiled calls per mode, timed and measured."""
    import jax

    import nnx_shard as ns

    assert jax.device_count() == n_devices
    name = os.environ.get(STRATEGY_ENV, "dp")
    lm = lm_problem(name, n_devices, quick, K, BATCH)

    calls, temp = {}, {}
    calls["hand scan"], compiled, state = hand_call(lm)
    temp["hand scan"] = _mem(compiled)["temp"]

    def gated_call(mode: str, gate: str | None):
        with _gate(gate):  # all of it: the compile of fit_call traces the gated step again
            call, compiled = fit_call(lm, K, BATCH, mode)
        return call, _mem(compiled)["temp"]

    for label, mode, gate in MODES:
        calls[label], temp[label] = gated_call(mode, gate)

    rounds = 3 if quick else 12
    with ns.use(lm.mesh, lm.rules):
        timed = time_calls(calls, list(VARIANTS), rounds)
    wall, cpu = timed.wall, timed.cpu

    return {
        "n_devices": n_devices, "strategy": name, "model": cfg_name(quick), "rounds": rounds,
        "steps_per_s": {v: K / statistics.median(wall[v]) for v in VARIANTS},
        "over_hand_wall": {v: timed.over("wall", v, "hand scan") for v in VARIANTS},
        "over_hand_cpu": {v: timed.over("cpu", v, "hand scan") for v in VARIANTS},
        "over_full_wall": {v: timed.over("wall", v, "full") for v in VARIANTS},
        "temp_mib_per_device": {v: b / 2**20 for v, b in temp.items()},
        "state_mib_per_device": state,
        "wall_s": wall, "cpu_s": cpu,
    }


def cfg_name(quick: bool) -> str:
    return "tiny" if quick else "small"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--memory-worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="tiny configs, few rounds (smoke test)")
    ap.add_argument("--skip-8b", action="store_true", help="part 2 only")
    args = ap.parse_args()
    import json

    if args.worker:
        print(json.dumps(time_worker(args.worker, args.quick)))
        return
    if args.memory_worker:
        print(json.dumps(memory_worker(args.memory_worker, args.quick)))
        return
    from nnx_shard._simulated import simulated_env

    big = None
    if not args.skip_8b:
        big = run_worker(__file__, 8, args.quick, flag="--memory-worker", timeout=1800)
    results = [run_worker(__file__, n, args.quick, env={**simulated_env(n), STRATEGY_ENV: name},
                          timeout=1800)
               for n, name in SETTINGS]
    load = os.getloadavg()
    import jax

    print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load average {load[0]:.2f} at the end (shared machine)")
    gib = 2**30
    if big is not None:
        print(f"\n{big['model']} ({big['param_dtype']} parameters, AdamW, remat full, scanned "
              f"layers), fsdp on data={big['sizes']['data']}, batch {big['batch']} x seq "
              f"{big['seq']}, compiled from abstract inputs on simulated CPU devices; per "
              f"device, GiB (parameters + optimizer state: {big['state_per_device'] / gib:.2f})")
        rows = [["bare fused step (no guard)", f"{big['bare']['temp'] / gib:.3f}",
                 f"{big['bare']['total'] / gib:.3f}", "", ""]]
        for label, mode, _ in MODES:
            m = big["modes"][label]
            rows.append([f"fit, guard={label}", f"{m['temp'] / gib:.3f}", f"{m['total'] / gib:.3f}",
                         f"{(m['temp'] - big['bare']['temp']) / gib:+.3f}",
                         f"{big['formula_guard'][mode] / gib:.3f}"])
        print_table(["compiled call", "temp", "total", "temp - bare", "formula's guard"], rows)
    first = results[0]
    print(f"\n{first['model']} transformer, batch {BATCH}, K={K} steps per call, data on the "
          f"devices; steps/s: median of {first['rounds']} rounds; ratios: medians of paired "
          "rounds (wall; CPU time for / hand); temp: compiled temporary bytes per device")
    rows = []
    for r in results:
        setting = f"{r['n_devices']} dev, {r['strategy']} (state {r['state_mib_per_device']:.2f} MiB)"
        for v in VARIANTS:
            rows.append([setting, v, f"{r['steps_per_s'][v]:.1f}",
                         f"{r['over_full_wall'][v]:.3f}", f"{r['over_hand_wall'][v]:.3f}",
                         f"{r['over_hand_cpu'][v]:.3f}", f"{r['temp_mib_per_device'][v]:.2f}"])
    print_table(["devices, strategy", "compiled call", "steps/s", "time / full",
                 "time / hand (wall)", "/ hand (CPU)", "temp MiB per device"], rows)
    write_json(RESULTS, {"jax": jax.__version__, "cores": os.cpu_count(), "loadavg_end": load,
                         "quick": args.quick, "llama_8b": big, "small": results})


if __name__ == "__main__":
    main()
