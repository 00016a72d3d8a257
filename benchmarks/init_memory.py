"""Memory and time of sharded initialization: nnx_shard.sharded_init vs the usual recipes.

For each model, variant and mesh axis type a fresh subprocess (so peak RSS is
its own) builds the model on 8 simulated CPU devices (a 4x2 mesh) and reports

* XLA's per-device bytes of the init program (``compile().memory_analysis()``,
  output + temp) as a multiple of the ideal shard, total model bytes / 8;
* the process's peak RSS growth during init (``VmHWM`` after, with the peak
  reset through ``/proc/self/clear_refs`` before) as a multiple of the model
  bytes: every simulated device lives in this process, so 1.0x is the floor;
* wall time of the init, compile included, and its ratio to ``sharded_init``.

Variants:

* ``nnx_shard``: ``ns.sharded_init``.
* ``nnx_shard_unfused``: the same without the fused threefry lowering on CPU
  (an ablation: shows what that part buys).
* ``eager_set_mesh``: ``factory()`` eagerly under ``jax.set_mesh``, then
  ``jax.device_put`` to the shardings.
* ``flax_guide``: Flax's guide: ``nnx.jit`` of the factory + a sharding
  constraint (``reshard`` on Explicit axes) over ``nnx.state``, under ``jax.set_mesh``.
* ``jit_out_shardings``: ``jax.jit(lambda: nnx.state(factory()), out_shardings=...)``
  under ``jax.set_mesh``.

A worker whose RSS passes ``--rss-cap-gb`` (default 8) is stopped and reported
as ``>cap``: the Explicit baselines draw every random value at full size on
every device and would otherwise take most of the machine.

Run (about 4 minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/init_memory.py

``--quick`` uses models 1/16 the size (a smoke test of the script only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

N_DEVICES = 8
RESULTS = Path(__file__).resolve().parent / "results" / "init_memory.json"

# name -> (description, goal for the XLA per-device ratio)
MODELS = {
    "mlp2_537MB": ("two-layer MLP 4096-16384-4096, f32", 2.0),
    "stack8_604MB": ("8 stacked MLP layers 1536-6144-1536 (nnx.vmap), fully sharded", 1.5),
}
VARIANTS = ["nnx_shard", "nnx_shard_unfused", "eager_set_mesh", "flax_guide", "jit_out_shardings"]
AXIS_TYPES = ["explicit", "auto"]


# Worker (runs in a fresh process per measurement)
# ------------------------------------------------------------------------------


def _proc_status(pid: str | int = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _worker(model_name: str, variant: str, axis_types: str, quick: bool) -> dict:
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={N_DEVICES}"

    import jax
    from flax import nnx

    import nnx_shard as ns
    import nnx_shard._init as ns_init

    lecun = nnx.initializers.lecun_normal()
    zeros = nnx.initializers.zeros_init()

    def linear(i: int, o: int, names: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
        return nnx.Linear(i, o, kernel_init=ns.with_logical(lecun, names),
                          bias_init=ns.with_logical(zeros, names[1:]), rngs=rngs)

    class MLP(nnx.Module):
        def __init__(self, d: int, h: int, rngs: nnx.Rngs):
            self.up = linear(d, h, ("embed", "mlp"), rngs)
            self.down = linear(h, d, ("mlp", "embed"), rngs)

    class Stack(nnx.Module):
        def __init__(self, d: int, h: int, n_layers: int, rngs: nnx.Rngs):
            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(key: jax.Array) -> MLP:
                return MLP(d, h, nnx.Rngs(key))

            self.layers = make(jax.random.split(rngs.params(), n_layers))

    s = 4 if quick else 1  # quick: 1/16 of the bytes
    factories = {
        "mlp2_537MB": lambda: MLP(4096 // s, 16384 // s, nnx.Rngs(0)),
        "stack8_604MB": lambda: Stack(1536 // s, 6144 // s, 8, nnx.Rngs(0)),
    }
    factory = factories[model_name]
    rules = ns.Rules({"embed": "data", "mlp": "model", "layers": None})
    mesh = ns.make_mesh("data=4,model=2", axis_types=axis_types)

    abstract = nnx.state(nnx.eval_shape(factory))
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)
                if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))
    jax.jit(lambda x: x + 1)(jax.numpy.ones(8)).block_until_ready()  # runtime warm-up

    def place(x, sharding):
        return (jax.sharding.reshard(x, sharding) if sharding.mesh.are_all_axes_explicit
                else jax.lax.with_sharding_constraint(x, sharding))

    ideal = total / N_DEVICES
    xla: dict[str, float] = {}

    def report(compiled: object) -> None:
        # Printed at once, so the figures survive if the driver stops this worker.
        m = compiled.memory_analysis()
        xla.update(output_bytes=m.output_size_in_bytes, temp_bytes=m.temp_size_in_bytes,
                   output_x=m.output_size_in_bytes / ideal, temp_x=m.temp_size_in_bytes / ideal,
                   xla_x=(m.output_size_in_bytes + m.temp_size_in_bytes) / ideal)
        print(json.dumps({"partial": True, "model_bytes": total, **xla}), flush=True)

    def run() -> object:
        if variant in ("nnx_shard", "nnx_shard_unfused"):
            if variant == "nnx_shard_unfused":
                ns_init._fused_threefry = lambda: None
            # sharded_init is exactly this; split here to keep the compiled program.
            graphdef, lowered = ns_init.lower_init(factory, mesh, rules)
            compiled = lowered.compile()
            report(compiled)
            return nnx.merge(graphdef, compiled())
        if variant == "eager_set_mesh":
            with jax.set_mesh(mesh):
                model = factory()
                nnx.update(model, jax.device_put(nnx.state(model),
                                                 ns.shardings(model, mesh, rules)))
            return model
        if variant == "flax_guide":
            def create() -> nnx.Module:
                model = factory()
                state = nnx.state(model)
                sh = ns.shardings(state, mesh, rules)
                nnx.update(model, jax.tree.map(place, state, sh))
                return model

            with jax.set_mesh(mesh):
                compiled = nnx.jit(create).lower().compile()
                report(compiled)
                return compiled()
        if variant == "jit_out_shardings":
            graphdef, state = nnx.split(nnx.eval_shape(factory))
            sh = ns.shardings(state, mesh, rules)
            with jax.set_mesh(mesh):
                compiled = jax.jit(lambda: nnx.state(factory()), out_shardings=sh).lower().compile()
                report(compiled)
                return nnx.merge(graphdef, compiled())
        raise ValueError(variant)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _proc_status()["VmRSS"]
    t0 = time.perf_counter()
    model = run()
    jax.block_until_ready(nnx.state(model))
    wall = time.perf_counter() - t0
    after = _proc_status()
    row = {
        "model": model_name, "variant": variant, "axis_types": axis_types,
        "model_bytes": total, "ideal_bytes_per_device": total / N_DEVICES,
        "rss_growth_bytes": after["VmHWM"] - before,
        "rss_growth_x": (after["VmHWM"] - before) / total,
        "rss_after_growth_x": (after["VmRSS"] - before) / total,
        "wall_s": wall,
        **xla,
    }
    return row


# Driver
# ------------------------------------------------------------------------------


def _measure(model: str, variant: str, axis_types: str, quick: bool, cap: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", model, variant, axis_types]
    if quick:
        cmd.append("--quick")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        try:
            rss = _proc_status(proc.pid)["VmRSS"]
        except (FileNotFoundError, KeyError, ProcessLookupError):
            rss = 0
        if rss > cap:
            proc.kill()
            out, _ = proc.communicate()
            partial = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            row = {"model": model, "variant": variant, "axis_types": axis_types,
                   "stopped_at_rss_bytes": rss, "stopped_after_s": time.perf_counter() - t0}
            return {**(partial[-1] if partial else {}), **row}
        time.sleep(0.02)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"worker {model}/{variant}/{axis_types} failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _fmt(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "-"


def _table(rows: list[dict], cap: int) -> str:
    lines = []
    for model, (desc, goal) in MODELS.items():
        mrows = [r for r in rows if r["model"] == model]
        if not mrows:
            continue
        size = next(r["model_bytes"] for r in mrows if "model_bytes" in r)
        lines.append(f"\n{model}: {desc}; {size / 1e6:.1f} MB, mesh data=4,model=2 "
                     f"(8 CPU devices); XLA goal <= {goal}x")
        lines.append("| variant | axes | XLA out+temp / ideal (out, temp) | peak RSS growth / model "
                     "| wall s | time / nnx_shard |")
        lines.append("|---|---|---|---|---|---|")
        base = {r["axis_types"]: r["wall_s"] for r in mrows
                if r["variant"] == "nnx_shard" and "wall_s" in r}
        for r in mrows:
            xla = (f"{r['xla_x']:.2f}x ({r['output_x']:.2f}, {r['temp_x']:.2f})"
                   if "xla_x" in r else "n/a (eager)")
            if "stopped_at_rss_bytes" in r:
                lines.append(f"| {r['variant']} | {r['axis_types']} | {xla} | > {cap / size:.1f}x "
                             f"(stopped at {r['stopped_at_rss_bytes'] / 1e9:.1f} GB) "
                             f"| stopped ({r['stopped_after_s']:.0f} s into the process) | - |")
                continue
            rel = r["wall_s"] / base[r["axis_types"]] if r["axis_types"] in base else float("nan")
            lines.append(f"| {r['variant']} | {r['axis_types']} | {xla} | "
                         f"{r['rss_growth_x']:.2f}x ({r['rss_growth_bytes'] / 1e9:.2f} GB) | "
                         f"{r['wall_s']:.2f} | {rel:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "VARIANT", "AXES"))
    parser.add_argument("--quick", action="store_true", help="models 1/16 the size")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--variants", nargs="*", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--rss-cap-gb", type=float, default=8.0)
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(*args.worker, quick=args.quick)))
        return

    cap = int(args.rss_cap_gb * 1e9)
    rows = []
    for model in args.models:
        for variant in args.variants:
            for axis_types in AXIS_TYPES:
                row = _measure(model, variant, axis_types, args.quick, cap)
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    import flax
    import jax

    env = {"jax": jax.__version__, "flax": flax.__version__, "python": platform.python_version(),
           "cpu_count": os.cpu_count(), "devices": N_DEVICES, "quick": args.quick,
           "rss_cap_bytes": cap, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(_table(rows, cap))
    print(f"\n(jax {env['jax']}, flax {env['flax']}, {env['cpu_count']} CPU cores; "
          f"JSON: {args.json})")


if __name__ == "__main__":
    main()
