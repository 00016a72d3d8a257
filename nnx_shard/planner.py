"""A planner that chooses: strategy preset x mesh shape x remat policy x microbatches.

:func:`auto` (also ``ns.strategies.auto``, and ``nnx-shard plan --auto``)
enumerates every preset of :data:`nnx_shard.strategies.NAMES` on every
factorisation of the device count over the preset's mesh axes, drops what
cannot be laid out (the preset's ``check`` raises, or the batch does not divide)
or does not fit in the device memory, and ranks the rest by a cost model read
from the compiled train step (the call ``Trainer.fit`` makes: two steps of
``value_and_grad(loss)`` + ``optimizer.update`` and the NaN guard, compiled from
abstract inputs, nothing allocated; per-step figures are the call's halved)::

    predicted step = matmul FLOPs per device / peak FLOP/s
                   + collective bytes sent per device / link bytes/s
                   + collectives per step x link latency
                   + memory bytes per device / memory bytes/s

* FLOPs: the ``dot`` operations of the compiled per-device HLO,
  ``2 x |result| x |contracted dims|`` each, times the trip count of every loop
  around it (scanned layers, microbatches); elementwise work is left out.
* Collective bytes: each collective of the HLO (read with
  :func:`nnx_shard.strategies.compiled_collectives`) as a ring algorithm sends
  them over its ``n`` devices: all-reduce ``2 (n-1)/n x size``, all-gather and
  all-to-all ``(n-1)/n x size``, reduce-scatter ``(n-1) x size``,
  collective-permute ``size``; times the loop trip counts.
* Memory bytes: what each operation outside a fusion reads and writes (a
  fusion's operands and result), loop-weighted; a slice of a stacked buffer
  counts as the slice. An approximation of XLA's ``bytes accessed``: it
  matters for steps bound by memory traffic (optimizer updates of replicated
  state, small matmuls on CPU).
* Memory: XLA's buffer assignment (arguments + temp + outputs - donated) of that
  call compiled on simulated CPU devices, the guard's copy of the model and
  optimizer state included: a GPU/TPU compile can differ.

The search is bounded: a mesh with a size-1 axis beyond the first repeats a
preset with fewer axes and is skipped; a candidate whose formula estimate
(``nnx-shard plan``'s, which under-counts XLA's figure) already exceeds the
memory is dropped without compiling; remat policies and microbatches (which
trade time for memory in this cost model) are tried only for layouts whose
plain step does not fit, cheapest first, stopping at the first that fits; and
at most ``max_compiles`` compiles run. :attr:`Plan.pruned` says what was
skipped. Compiles are cached by their configuration.

>>> PROFILES["h100-sxm"].peak_flops
989000000000000.0
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

__all__ = [
    "PROFILES", "Candidate", "Hardware", "Plan", "auto", "calibrate", "hardware", "hlo_costs",
]

# --------------------------------------------------------------------------- hardware


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator's figures for the cost model.

    Attributes:
      name: a label.
      peak_flops: dense matmul FLOP/s per device in ``precision``.
      link_bandwidth: bytes/s one device sends to its peers (one direction).
      device_memory: bytes of memory per device (``None``: not known).
      link_latency: seconds per collective operation (0: ignored).
      memory_bandwidth: bytes/s between a device and its memory (``None``: that
        term is left out of the cost model).
      precision: the number format ``peak_flops`` is for.
      source: where the figures come from.

    >>> Hardware("mine", peak_flops=1e12, link_bandwidth=1e10).predict(1e12, 1e10, 0)
    2.0
    """

    name: str
    peak_flops: float
    link_bandwidth: float
    device_memory: int | None = None
    link_latency: float = 0.0
    memory_bandwidth: float | None = None
    precision: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        for field in ("peak_flops", "link_bandwidth"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Hardware {field} must be a finite number > 0, got {value!r}")
        if self.link_latency < 0:
            raise ValueError(f"Hardware link_latency must be >= 0, got {self.link_latency!r}")

    def predict(self, flops: float, collective_bytes: float, collectives: int,
                memory_bytes: float = 0.0) -> float:
        """Predicted seconds of one step from its per-device figures.

        >>> PROFILES["a100-80gb"].predict(312e12, 0, 0)
        1.0
        >>> PROFILES["a100-80gb"].predict(0, 0, 0, memory_bytes=2.039e12)
        1.0
        """
        memory = memory_bytes / self.memory_bandwidth if self.memory_bandwidth else 0.0
        return (flops / self.peak_flops + collective_bytes / self.link_bandwidth
                + collectives * self.link_latency + memory)

    def replace(self, **changes: Any) -> Hardware:
        """A copy with some figures changed (``None`` values are ignored).

        >>> PROFILES["h100-sxm"].replace(device_memory=40e9, peak_flops=None).device_memory
        40000000000
        """
        changes = {k: v for k, v in changes.items() if v is not None}
        if "device_memory" in changes:
            changes["device_memory"] = int(changes["device_memory"])
        return dataclasses.replace(self, **changes)


_NVIDIA = ("NVIDIA datasheet; dense (no sparsity) BF16 tensor-core peak; NVLink bandwidth "
           "per direction (half of the datasheet's bidirectional figure); HBM bandwidth")
_GOOGLE = ("Google Cloud TPU system architecture page; BF16 peak per chip; inter-chip "
           "interconnect bandwidth per chip; HBM bandwidth")

#: Where each profile's figures come from.
_SOURCES = {
    "a100-80gb": _NVIDIA + " (A100 SXM 80GB: 312 TFLOP/s, NVLink 600 GB/s, HBM2e 2,039 GB/s)",
    "h100-sxm": _NVIDIA + " (H100 SXM: 989 TFLOP/s, NVLink 900 GB/s, HBM3 3.35 TB/s)",
    "h200": _NVIDIA + " (H200 SXM: 989 TFLOP/s, 141 GB, NVLink 900 GB/s, HBM3e 4.8 TB/s)",
    "tpu-v5e": _GOOGLE + " (v5e: 197 TFLOP/s, 16 GB HBM, 819 GB/s, ICI 1600 Gbps)",
    "tpu-v5p": _GOOGLE + " (v5p: 459 TFLOP/s, 95 GB HBM, 2,765 GB/s, ICI 4800 Gbps)",
}

#: Public peak figures of a few common accelerators (BF16 dense matmul).
PROFILES: dict[str, Hardware] = {
    name: Hardware(name, flops, link, memory, memory_bandwidth=hbm, precision="bf16",
                   source=_SOURCES[name])
    for name, (flops, link, memory, hbm) in {
        # name: (FLOP/s, link bytes/s per direction, device memory bytes, HBM bytes/s)
        "a100-80gb": (312e12, 300e9, 80 * 10**9, 2.039e12),
        "h100-sxm": (989e12, 450e9, 80 * 10**9, 3.35e12),
        "h200": (989e12, 450e9, 141 * 10**9, 4.8e12),
        "tpu-v5e": (197e12, 200e9, 16 * 10**9, 819e9),
        "tpu-v5p": (459e12, 600e9, 95 * 10**9, 2.765e12),
    }.items()
}


def hardware(name: str) -> Hardware:
    """The profile ``name`` of :data:`PROFILES`.

    >>> hardware("tpu-v5e").device_memory
    16000000000
    >>> hardware("h100")
    Traceback (most recent call last):
    ...
    ValueError: unknown hardware profile 'h100'. Did you mean 'h100-sxm'? Known: a100-80gb, h100-sxm, h200, tpu-v5e, tpu-v5p; or give --peak-flops and --link-bandwidth (hardware=Hardware(...)), or --calibrate to measure this machine.
    """
    if name in PROFILES:
        return PROFILES[name]
    import difflib

    # A prefix ("h100" for "h100-sxm") beats a near spelling ("h200").
    close = ([k for k in PROFILES if k.startswith(name.lower())][:1]
             or difflib.get_close_matches(name, PROFILES, n=1, cutoff=0.5))
    mean = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown hardware profile {name!r}.{mean} Known: {', '.join(PROFILES)}; "
                     "or give --peak-flops and --link-bandwidth (hardware=Hardware(...)), "
                     "or --calibrate to measure this machine.")


_lookup = hardware


def _best(fn: Callable[[], Any], seconds: float) -> float:
    """The fastest of repeated blocking calls of ``fn`` within about ``seconds``."""
    import jax

    jax.block_until_ready(fn())  # compile
    best, t_end = math.inf, time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            return best


def calibrate(n_devices: int | None = None, seconds: float = 1.0) -> Hardware:
    """Measures this machine's devices: a jitted float32 matmul run on every device
    at once (FLOP/s per device), an all-gather of a few MiB over them (bytes/s
    each device receives), a tiny psum (latency per collective) and an
    elementwise stream over 16 MiB per device (memory bytes/s).

    With simulated CPU devices the devices share the host's cores, so the
    figures are what each gets while all of them run, which is how a sharded
    step runs.

    >>> hw = calibrate(2, seconds=0.05)
    >>> hw.peak_flops > 0 and hw.link_bandwidth > 0 and hw.precision
    'float32'
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nnx_shard.mesh import make_mesh

    n = jax.device_count() if n_devices is None else int(n_devices)
    if not 1 <= n <= jax.device_count():
        raise ValueError(f"calibrate: n_devices must be 1..{jax.device_count()} (the devices "
                         f"JAX has), got {n}")
    mesh = make_mesh({"d": n}, devices=jax.devices()[:n])
    shard = NamedSharding(mesh, P("d"))
    k = 256
    a = jax.device_put(jnp.ones((n, k, k), jnp.float32), shard)
    reps = 8

    @jax.jit
    def mm(a: jax.Array) -> jax.Array:
        def body(_: int, x: jax.Array) -> jax.Array:
            return jnp.einsum("nij,njk->nik", x, a) * (1.0 / k)
        return jax.lax.fori_loop(0, reps, body, a)

    t_mm = _best(lambda: mm(a), seconds)
    flops = 2 * k**3 * reps / t_mm
    rows = 1 << 16  # 256 KiB per device; the gathered result is n times that
    x = jax.device_put(jnp.ones((n * rows,), jnp.float32), shard)
    gather = jax.jit(lambda x: x * 1.0, out_shardings=NamedSharding(mesh, P()))
    t_ag = _best(lambda: gather(x), seconds)
    # 16 MiB per device: larger than the caches, so the stream measures memory.
    big = jax.device_put(jnp.ones((n * (rows * 64),), jnp.float32), shard)
    stream = jax.jit(lambda x: x * 1.0001 + 1.0)
    t_mem = _best(lambda: stream(big), seconds / 2)
    tiny = jax.device_put(jnp.ones((n,), jnp.float32), shard)
    psum = jax.jit(lambda x: jnp.sum(x), out_shardings=NamedSharding(mesh, P()))
    t_lat = _best(lambda: psum(tiny), seconds / 2)
    moved = (n - 1) * rows * 4 if n > 1 else rows * 4
    bandwidth = moved / max(t_ag - t_lat, t_ag / 10)
    return Hardware(
        f"calibrated {jax.devices()[0].platform} x{n}", float(flops), float(bandwidth),
        None, link_latency=float(t_lat) if n > 1 else 0.0,
        memory_bandwidth=float(2 * rows * 64 * 4 / t_mem), precision="float32",
        source=(f"measured: {k}x{k} float32 matmuls on {n} devices at once "
                f"{t_mm / reps * 1e6:.0f} us each; all-gather of {4 * rows * n / 2**20:.1f} MiB "
                f"{t_ag * 1e3:.2f} ms; psum of {n} floats {t_lat * 1e6:.0f} us; "
                f"x * a + b over {256 * rows / 2**20:.0f} MiB per device {t_mem * 1e3:.2f} ms"),
    ) if np.isfinite(flops) else Hardware("calibrated", 1.0, 1.0)


# --------------------------------------------------------------------------- HLO costs

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->.*\{\s*$")
_PARAM = re.compile(r"([\w.\-]+):\s*([a-z][a-z0-9]*\[[0-9,]*\])")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*"
                    r"(\((?:[^()]|\([^()]*\))*\)|[a-z][a-z0-9]*\[[0-9,]*\])\S*\s+"
                    r"([a-z][\w-]*)\((.*)$")
# Operations that move no data of their own (views, control flow, constants).
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
                   "call", "conditional", "after-all", "partition-id", "replica-id",
                   "opt-barrier"})
_CALLS = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|"
                    r"called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_DIMS = re.compile(r"\[([0-9,]*)\]")


def _dims(type_txt: str) -> list[int]:
    m = _DIMS.search(type_txt)
    return [int(t) for t in m.group(1).split(",") if t] if m else []


def _ring_bytes(kind: str, size: int, n: int) -> float:
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n * size, "all-gather": (n - 1) / n * size,
            "all-to-all": (n - 1) / n * size, "reduce-scatter": (n - 1) * size,
            "collective-permute": float(size)}.get(kind, float(size))


def _traffic(op: str, rest: str, type_txt: str, operands: list[str],
             comps: Mapping[str, Mapping[str, Any]]) -> int:
    """Bytes one instruction reads and writes in memory, as XLA's cost analysis counts
    them: a slice of a stacked buffer (scanned layers) moves the slice, an in-place
    update moves the update, not the whole buffer."""
    from nnx_shard.hlo import _nbytes

    out = _nbytes(type_txt)
    sizes = [_nbytes(t) for t in operands]
    callee = re.search(r"calls=%?([\w.\-]+)", rest) if op == "fusion" else None
    flags = comps.get(callee.group(1), {}) if callee else {}
    if op == "dynamic-update-slice" or flags.get("dus"):
        # The buffer updated in place (same type as the result) is neither read nor
        # written whole; the update is read and written.
        rest_in = [b for t, b in zip(operands, sizes, strict=True) if t != type_txt]
        return 2 * sum(rest_in)
    if op == "dynamic-slice" or flags.get("ds"):
        return out + sum(min(b, out) for b in sizes)
    return out + sum(sizes)


def hlo_costs(hlo_text: str, mesh: Any) -> dict[str, Any]:
    """Per-device matmul FLOPs and collective traffic of a compiled program's
    text, each operation weighted by the trip counts of the loops around it.

    Returns ``flops``, ``collective_bytes`` (ring-algorithm bytes each device
    sends), ``collectives`` (operations executed per call), ``by_kind``
    (kind -> bytes sent) and ``unknown_loops`` (loops without a known trip
    count, counted once).

    >>> import jax, jax.numpy as jnp
    >>> from nnx_shard.mesh import make_mesh
    >>> mesh = make_mesh("d=2", devices=jax.devices()[:2])
    >>> def f(x):
    ...     return jax.lax.fori_loop(0, 3, lambda i, y: y @ x, x).sum()
    >>> c = hlo_costs(jax.jit(f).lower(jnp.ones((4, 4))).compile().as_text(), mesh)
    >>> c["flops"]   # 3 matmuls of 4x4 by 4x4
    384
    """
    from nnx_shard.hlo import KINDS, compiled_collectives

    sizes = dict(mesh.shape)
    comps: dict[str, dict[str, Any]] = {}
    entry = None
    cur: dict[str, Any] | None = None
    for line in hlo_text.splitlines():
        if cur is None:
            m = _HEADER.match(line)
            if m:
                cur = {"flops": 0, "coll": 0.0, "ops": 0, "mem": 0, "kinds": {}, "calls": [],
                       "shapes": dict(_PARAM.findall(m.group(2)))}
                comps[m.group(1)] = cur
                if line.startswith("ENTRY"):
                    entry = m.group(1)
            continue
        if line.startswith("}"):
            cur = None
            continue
        m = _INSTR.match(line)
        op = ""
        if m:
            name, type_txt, op, rest = m.groups()
            cur["shapes"][name] = type_txt
            base = op.removesuffix("-start").removesuffix("-done")
            cur["ds"] = cur.get("ds", False) or op == "dynamic-slice"
            cur["dus"] = cur.get("dus", False) or op == "dynamic-update-slice"
            if op not in _FREE and base not in KINDS and not op.endswith("-done"):
                operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
                cur["mem"] += _traffic(op, rest, type_txt,
                                       [cur["shapes"].get(o, "") for o in operands], comps)
            if op == "dot":
                lhs = rest.split(",", 1)[0].strip().lstrip("%").split()[-1].lstrip("%")
                lhs_dims = _dims(cur["shapes"].get(lhs, ""))
                contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
                k = math.prod(lhs_dims[int(i)] for i in contract.group(1).split(",") if i) \
                    if contract and lhs_dims else 1
                cur["flops"] += 2 * math.prod(_dims(type_txt)) * k
        for coll in compiled_collectives(line, mesh) if "replica_groups" in line or \
                "source_target_pairs" in line else ():
            n = math.prod(sizes[a] for a in coll.axes) if coll.axes else max(sizes.values())
            sent = _ring_bytes(coll.kind, coll.bytes, n)
            cur["coll"] += sent
            cur["ops"] += 1
            cur["kinds"][coll.kind] = cur["kinds"].get(coll.kind, 0.0) + sent
        for kind, names in _CALLS.findall(line):
            trip = _TRIP.search(line)
            factor = int(trip.group(1)) if trip and kind in ("body", "condition") else 1
            unknown = kind == "body" and not trip
            # Inside a fusion (or a reduction's scalar computation) data stays in registers
            # or cache: its memory traffic is the fusion's operands and result.
            fused = (kind == "calls" and op != "call") or (kind == "to_apply" and op != "call")
            for callee in names.strip("{}").split(","):
                callee = callee.strip().lstrip("%")
                if callee:
                    cur["calls"].append((callee, factor, unknown, fused))
    weights: dict[str, int] = {}
    unfused: dict[str, int] = {}
    unknown_loops = 0

    def visit(name: str, w: int, fused: bool, depth: int = 0) -> None:
        nonlocal unknown_loops
        if name not in comps or depth > 64:
            return
        weights[name] = weights.get(name, 0) + w
        if not fused:
            unfused[name] = unfused.get(name, 0) + w
        for callee, factor, unknown, into_fusion in comps[name]["calls"]:
            unknown_loops += unknown
            visit(callee, w * factor, fused or into_fusion, depth + 1)

    if entry is not None:
        visit(entry, 1, False)
    kinds: dict[str, float] = {}
    for name, w in weights.items():
        for kind, b in comps[name]["kinds"].items():
            kinds[kind] = kinds.get(kind, 0.0) + w * b
    return {
        "flops": sum(w * comps[n]["flops"] for n, w in weights.items()),
        "collective_bytes": sum(w * comps[n]["coll"] for n, w in weights.items()),
        "collectives": sum(w * comps[n]["ops"] for n, w in weights.items()),
        "memory_bytes": sum(w * comps[n]["mem"] for n, w in unfused.items()),
        "by_kind": kinds,
        "unknown_loops": unknown_loops,
    }


# --------------------------------------------------------------------------- compiling


def compile_step(factory: Callable[[], Any], strategy: str, sizes: Mapping[str, int], *,
                 batch: int, seq: int, optimizer: str = "adamw", microbatches: int = 1,
                 loss: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Compiles the call :meth:`nnx_shard.Trainer.fit` makes for one step of
    ``factory()``'s model (abstract: nothing allocated; NaN guard included, see
    :func:`nnx_shard.compiled.compile_fit`) under preset ``strategy`` on mesh
    ``sizes`` of this process's devices, and returns its per-device memory
    (``total``, ``temp``, ``argument``, ``output``, ``alias``), :func:`hlo_costs`
    figures per step and ``compile_s``. The batch is ``{"inputs", "targets"}``,
    int32 ``[batch, seq]`` tokens, and ``loss`` defaults to
    :func:`nnx_shard.models.lm_loss`. The call compiled runs two steps (the
    rolled loop of ``fit``'s calls); the costs are its figures halved, so they
    include half of the guard's once-per-call check.

    >>> from flax import nnx
    >>> from nnx_shard.models import Transformer, get_config
    >>> r = compile_step(lambda: Transformer(get_config("tiny"), rngs=nnx.Rngs(0)),
    ...                  "dp", {"data": 2}, batch=4, seq=8)
    >>> r["total"] > 0 and r["flops"] > 0 and r["collectives"] > 0
    True
    """
    from nnx_shard.compiled import compile_fit

    compiled, trainer, seconds = compile_fit(
        factory, strategy, sizes, batch=batch, seq=seq, optimizer=optimizer,
        microbatches=microbatches, loss=loss)
    mem = compiled.memory_analysis()
    costs = hlo_costs(compiled.as_text(), trainer.mesh)
    k = trainer.steps_per_call
    costs = {**costs, "by_kind": {kind: b / k for kind, b in costs["by_kind"].items()},
             **{key: costs[key] / k
                for key in ("flops", "collective_bytes", "collectives", "memory_bytes")}}
    arg, temp, out, alias = (int(mem.argument_size_in_bytes), int(mem.temp_size_in_bytes),
                             int(mem.output_size_in_bytes), int(mem.alias_size_in_bytes))
    return {"total": arg + temp + out - alias, "temp": temp, "argument": arg, "output": out,
            "alias": alias, **costs, "compile_s": round(seconds, 3)}


def _config_factory(config: Mapping[str, Any], remat: str) -> Callable[[], Any]:
    import jax.numpy as jnp
    from flax import nnx

    from nnx_shard.models import Transformer, TransformerConfig

    fields = {k: (jnp.dtype(v) if k.endswith("dtype") else v) for k, v in config.items()}
    cfg = TransformerConfig(**{**fields, "remat": remat})
    return lambda: Transformer(cfg, rngs=nnx.Rngs(0))


def _child_compile(request: Mapping[str, Any]) -> dict[str, Any]:
    factory = _config_factory(request["config"], request["remat"])
    return compile_step(factory, request["strategy"], request["sizes"], batch=request["batch"],
                        seq=request["seq"], optimizer=request["optimizer"],
                        microbatches=request["microbatches"])


def _child_main() -> None:
    """Reads a JSON list of requests from stdin; prints one JSON line per result."""
    for request in json.loads(sys.stdin.read()):
        try:
            result = _child_compile(request)
        except Exception as e:  # reported to the parent as one line
            msg = " ".join(str(e).split()) or type(e).__name__
            result = {"error": f"{type(e).__name__}: {msg}"[:1000]}
        print(json.dumps({"key": request["key"], **result}), flush=True)


_CHILD = "from nnx_shard.planner import _child_main; _child_main()"


def _child_env(n_devices: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n_devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _run_child(requests: list[dict[str, Any]], n_devices: int, timeout: float,
               done: Callable[[dict[str, Any]], None]) -> None:
    """Compiles ``requests`` in one fresh Python with ``n_devices`` simulated CPU
    devices, calling ``done(result)`` as each finishes."""
    env = _child_env(n_devices)
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(requests))
        proc.stdin.close()
        seen = set()
        for line in proc.stdout:
            if line.startswith("{"):
                result = json.loads(line)
                seen.add(result["key"])
                done(result)
        proc.wait()
        err = (proc.stderr.read() if proc.stderr else "").strip().splitlines()
        for r in requests:
            if r["key"] not in seen:
                why = (f"took longer than {timeout:g} s" if not timer.is_alive()
                       else (err[-1] if err else f"exit {proc.returncode}"))
                done({"key": r["key"], "error": f"the compile subprocess failed: {why}"})
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class _Cache:
    """Compile results by request, in memory and optionally in a JSON file."""

    shared: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, path: str | os.PathLike[str] | None, shared: bool = True) -> None:
        # Results of a replaced compile (compile_fn) stay out of the process-wide table.
        self.memory = self.shared if shared else {}
        self.path = Path(path) if path else None
        self.disk: dict[str, dict[str, Any]] = {}
        if self.path and self.path.is_file():
            try:
                self.disk = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self.disk = {}

    def get(self, key: str) -> dict[str, Any] | None:
        return self.memory.get(key) or self.disk.get(key)

    def put(self, key: str, value: dict[str, Any]) -> None:
        self.memory[key] = value
        if self.path and "error" not in value:
            self.disk[key] = value

    def save(self) -> None:
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.disk))
            tmp.replace(self.path)


def default_cache() -> Path:
    """Where ``nnx-shard plan --auto`` keeps compile results (``$XDG_CACHE_HOME``
    or ``~/.cache``, then ``nnx_shard/planner.json``).

    >>> default_cache().name
    'planner.json'
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nnx_shard" / "planner.json"


def _versions() -> str:
    import flax
    import jax

    src = Path(__file__).resolve().parent
    digest = hashlib.sha1()
    for f in sorted(src.rglob("*.py")):
        digest.update(f.read_bytes())
    return f"jax{jax.__version__}-flax{flax.__version__}-{digest.hexdigest()[:12]}"


# --------------------------------------------------------------------------- candidates


@dataclasses.dataclass
class Candidate:
    """One configuration the planner considered.

    Attributes:
      strategy: preset name; mesh: axis -> size; remat: policy (``None``: the
        factory's own); microbatches: per step.
      fits: whether it fits (``None``: not decided).
      reason: why it was dropped (``None`` if it was not).
      bytes_per_device: compiled total (or the formula estimate when
        ``compiled`` is False); temp: XLA's temporaries.
      flops, collective_bytes, collectives, memory_bytes: per device per step.
      predicted_s: the cost model's step time.

    >>> c = Candidate("dp", {"data": 8})
    >>> c.label
    'dp data=8 remat=none mb=1'
    """

    strategy: str
    mesh: dict[str, int]
    remat: str | None = "none"
    microbatches: int = 1
    fits: bool | None = None
    reason: str | None = None
    compiled: bool = False
    bytes_per_device: int | None = None
    temp: int | None = None
    flops: float | None = None
    collective_bytes: float | None = None
    collectives: int | None = None
    memory_bytes: float | None = None
    predicted_s: float | None = None
    compile_s: float | None = None
    by_kind: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        return f"{self.strategy} {mesh} remat={self.remat or 'own'} mb={self.microbatches}"

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "label": self.label}


@dataclasses.dataclass
class Plan:
    """What :func:`auto` found: ``ranked`` (fitting candidates, fastest predicted
    first), ``dropped`` (with reasons), ``pruned`` (what the search skipped, in
    words), the ``hardware``, the request and ``twins`` (fitting candidates left
    out of ``ranked`` as they compile to the program of a better-ranked one).

    >>> Plan([], [], [], PROFILES["h100-sxm"], {}).best is None
    True
    """

    ranked: list[Candidate]
    dropped: list[Candidate]
    pruned: list[str]
    hardware: Hardware
    request: dict[str, Any]
    twins: list[Candidate] = dataclasses.field(default_factory=list)

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    def families(self) -> dict[str, str]:
        """Per preset without a fitting candidate: why (its dropped candidates' reasons).

        >>> Plan([], [Candidate("tp", {"data": 1, "model": 8}, reason="x")], [],
        ...      PROFILES["h100-sxm"], {}).families()
        {'tp': 'data=1,model=8: x'}
        """
        # preset -> reason -> the candidates it applies to (one reason said once)
        out: dict[str, dict[str, list[str]]] = {}
        # A preset whose fitting layout is another's program (ep on a dense model) fits.
        ok = {c.strategy for c in self.ranked + self.twins}
        for c in self.dropped:
            if c.strategy in ok:
                continue
            mesh = ",".join(f"{k}={v}" for k, v in c.mesh.items())
            extra = "" if c.remat in ("none", None) and c.microbatches == 1 else \
                f" (remat={c.remat}, mb={c.microbatches})"
            out.setdefault(c.strategy, {}).setdefault(str(c.reason), []).append(mesh + extra)
        return {k: "; ".join(f"{' and '.join(_dedupe(who))}: {why}" for why, who in v.items())
                for k, v in out.items()}

    def python(self) -> str:
        """Python that trains with the best candidate.

        >>> Plan([], [], [], PROFILES["h100-sxm"], {}).python()
        ''
        """
        c = self.best
        if c is None:
            return ""
        model = self.request.get("model_name")
        mesh = ", ".join(f'"{k}": {v}' for k, v in c.mesh.items())
        if model:
            make = (f"cfg = dataclasses.replace(get_config({model!r}), remat={c.remat!r})\n"
                    "factory = lambda: Transformer(cfg, rngs=nnx.Rngs(0))\n")
            head = ("import dataclasses\n\nimport optax\nfrom flax import nnx\n\n"
                    "import nnx_shard as ns\n"
                    "from nnx_shard.models import Transformer, get_config, lm_loss\n\n")
        else:
            make = ("factory = my_factory" + (f"  # with remat={c.remat!r}" if c.remat else "")
                    + "\n")
            head = "import optax\n\nimport nnx_shard as ns\nfrom nnx_shard.models import lm_loss\n\n"
        return (
            f"{head}strategy = ns.strategies.get({c.strategy!r})\n"
            f"mesh = ns.make_mesh({{{mesh}}})\n{make}"
            "model = strategy.sharded_init(factory, mesh)\n"
            f"opt = strategy.optimizer(model, optax.{self.request.get('optimizer', 'adamw')}"
            "(1e-3), mesh)\n"
            "trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=strategy.rules,\n"
            f"                     microbatches={c.microbatches}, batch_names=(\"batch\", \"length\"))\n"
            f"# trainer.fit(batches)  # batches: {{'inputs', 'targets'}} int32 "
            f"[{self.request.get('batch')}, {self.request.get('seq')}]\n"
        )

    def command(self) -> str:
        """The ``nnx-shard plan`` command that shows the best candidate's memory in detail.

        >>> Plan([], [], [], PROFILES["h100-sxm"], {}).command()
        ''
        """
        c = self.best
        model = self.request.get("model_name")
        if c is None or not model:
            return ""
        mesh = ",".join(f"{k}={v}" for k, v in c.mesh.items())
        return (f"nnx-shard plan --model {model} --strategy {c.strategy} --mesh {mesh} "
                f"--batch {self.request['batch']} --seq {self.request['seq']} "
                f"--remat {c.remat} --optimizer {self.request.get('optimizer', 'adamw')}")

    def table(self, top: int = 5) -> str:
        """The ranked candidates as a text table.

        >>> print(Plan([], [], [], PROFILES["h100-sxm"], {}).table())
        (no candidate fits)
        """
        if not self.ranked:
            return "(no candidate fits)"
        from nnx_shard.report import fmt_bytes

        head = ("rank", "strategy", "mesh", "remat", "mb", "bytes/device", "collective B",
                "GFLOP/dev", "predicted")
        rows = [head]
        for i, c in enumerate(self.ranked[:top], 1):
            rows.append((str(i), c.strategy, ",".join(f"{k}={v}" for k, v in c.mesh.items()),
                         str(c.remat or "own"), str(c.microbatches),
                         fmt_bytes(c.bytes_per_device or 0), fmt_bytes(c.collective_bytes or 0),
                         f"{(c.flops or 0) / 1e9:.4g}", _secs(c.predicted_s or 0.0)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(x.ljust(w) if j < 5 else x.rjust(w)
                           for j, (x, w) in enumerate(zip(r, widths, strict=True)))
                 for r in rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        r = self.request
        hw = self.hardware
        mem = "unlimited" if r.get("device_memory") is None else _fmt(r["device_memory"])
        out = [f"plan --auto: model {r.get('model_label')}, {r.get('devices')} devices, batch "
               f"{r.get('batch')} x seq {r.get('seq')}, {r.get('optimizer')}, memory {mem} "
               "per device",
               f"hardware: {hw.name}: {hw.peak_flops / 1e12:.3g} TFLOP/s ({hw.precision}), "
               f"link {hw.link_bandwidth / 1e9:.3g} GB/s"
               + (f", memory {hw.memory_bandwidth / 1e9:.4g} GB/s" if hw.memory_bandwidth
                  else "")
               + (f", latency {hw.link_latency * 1e6:.0f} us" if hw.link_latency else ""),
               f"considered {r.get('considered', 0)} candidates, compiled "
               f"{r.get('compiled', 0)} ({r.get('cached', 0)} from cache), "
               f"{len(self.ranked)} fit", "", self.table(r.get("top", 5)), ""]
        fams = self.families()
        if fams:
            out.append("dropped (per preset with nothing that fits):")
            out += [f"  {k}: {_clip(v)}" for k, v in fams.items()]
            out.append("")
        if self.pruned:
            out.append("pruned:")
            out += [f"  - {p}" for p in self.pruned]
            out.append("")
        if self.best is not None:
            out.append(f"chosen: {self.best.label}; train with:")
            out.append("")
            out += [("    " + ln).rstrip() for ln in self.python().splitlines()]
            if self.command():
                out += ["", f"check its memory in detail: {self.command()}"]
        out.append("")
        out.append("predicted = matmul FLOPs/device / peak + collective bytes sent/device / link"
                   " bandwidth + collectives x latency + memory traffic / memory bandwidth; "
                   "bytes/device is XLA CPU's buffer assignment of the compiled step (a GPU/TPU "
                   "compile can differ).")
        return "\n".join(out)


def _clip(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _dedupe(items: Iterable[str]) -> list[str]:
    seen: list[str] = []
    for x in items:
        if x not in seen:
            seen.append(x)
    return seen


def _secs(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def _fmt(n: float) -> str:
    from nnx_shard.report import fmt_bytes

    return fmt_bytes(n)


# --------------------------------------------------------------------------- the search

#: Remat policies tried (in this order) for layouts whose plain step does not fit.
REMAT_ORDER = ("dots", "full")


def _config_dict(cfg: Any) -> dict[str, Any]:
    import numpy as np

    return {k: (np.dtype(v).name if k.endswith("dtype") else v)
            for k, v in dataclasses.asdict(cfg).items()}


def _enumerate(n: int, names: Sequence[str]) -> tuple[list[tuple[str, dict[str, int]]], list[str]]:
    from nnx_shard import strategies
    from nnx_shard.strategy import factorizations

    out, pruned = [], []
    skipped = 0
    for name in names:
        strat = strategies.get(name)
        for shape in factorizations(n, len(strat.mesh_axes)):
            sizes = dict(zip(strat.mesh_axes, shape, strict=True))
            if n > 1 and len(shape) > 1 and 1 in shape[1:]:
                skipped += 1
                continue
            out.append((name, sizes))
    if skipped:
        pruned.append(f"{skipped} meshes with a size-1 axis beyond the first (the same layout "
                      "as a preset with fewer axes, e.g. tp model=1 is dp)")
    return out, pruned


#: The formula decides "does not fit" without a compile only when it is this many
#: times over the budget. Over every preset x mesh factorisation of 8 devices
#: (benchmarks/formula_bound.py, scanned layers) it was 0.22-1.07x XLA's compiled total
#: of fit's call for remat none and full (tiny and small; 1.07: zero1 full remat, small);
#: dots layouts are judged on the full formula (see _formula_bytes), 0.37-0.99x of
#: their compiled total on small. tests/test_planner.py
#: ::test_the_formula_prunes_only_what_xla_would_not_fit holds it under this margin.
_PRUNE_MARGIN = 1.25


def _formula_bytes(abstract: Any, cfg: Any, strat: Any, sizes: dict[str, int], tx: Any,
                   batch: int, seq: int, remat: str) -> int | None:
    """``nnx-shard plan``'s formula; it skips a compile only past :data:`_PRUNE_MARGIN`."""
    from nnx_shard.commands import _formula, _report
    from nnx_shard.models.memory import activation_bytes

    # The formula counts dots (and offload) as no remat, but with scanned layers XLA
    # keeps only the saved matmul outputs: 1.29x its compiled total for zero1 dots on
    # small. Dots keeps at least what full remat keeps, so the full formula is a floor
    # that cannot prune a dots layout that fits.
    remat = "full" if remat in ("dots", "offload") else remat
    try:
        report = _report(abstract, sizes, strat.rules, tx, strat.opt_rules)
        acts = activation_bytes(cfg, strat.rules, sizes, batch, seq, remat) if cfg else 0
    except Exception:  # the compile will say what is wrong
        return None
    return _formula(report, acts)["total"]


def _batch_problem(strat: Any, sizes: dict[str, int], batch: int, seq: int,
                   microbatches: int) -> str | None:
    from jax.sharding import AbstractMesh

    from nnx_shard.errors import ShardingError

    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    try:
        spec = strat.rules.spec((None, "batch", "length"), shape=(1, batch, seq), mesh=mesh,
                                path="batch['inputs']")
    except ShardingError as e:
        msg = " ".join(str(e).split())
        return f"batch {batch} x seq {seq} cannot be laid out: {msg[:200]}"
    entry = tuple(spec)[1] if len(tuple(spec)) > 1 else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    rows = batch // math.prod(sizes[a] for a in axes)
    if rows % microbatches:
        return f"{microbatches} microbatches do not divide the {rows} rows per device"
    return None


def auto(model: Any = "small", *, devices: int, batch: int, seq: int,
         device_memory: int | str | None = None, hardware: Hardware | str | None = None,
         optimizer: str = "adamw", strategies: Sequence[str] | None = None,
         remat: Sequence[str] | None = None, microbatches: Sequence[int] = (1, 2, 4, 8),
         max_compiles: int = 64, cache: str | os.PathLike[str] | None = None,
         progress: bool = True, timeout: float = 120.0,
         compile_fn: Callable[..., dict[str, Any]] | None = None) -> Plan:
    """Chooses a strategy preset, mesh shape, remat policy and microbatch count
    for ``model`` on ``devices`` devices with ``device_memory`` bytes each, and
    ranks the candidates that fit by predicted step time (see the module doc).

    Args:
      model: a reference config name (``"small"``, ``"1b"``, ...), a
        :class:`~nnx_shard.models.TransformerConfig`, or a zero-argument factory
        returning a language model (called as ``lm_loss`` calls the reference
        Transformer; a factory taking a ``remat`` keyword gets the policies
        tried). Configs compile in a subprocess with ``devices`` simulated CPU
        devices; a factory compiles in this process and needs that many devices.
      devices: the device count.
      batch, seq: the global batch and sequence length.
      device_memory: bytes per device (an int, or ``"80GB"``; default: the
        hardware profile's, else unlimited).
      hardware: a :class:`Hardware`, or a :data:`PROFILES` name (default ``h100-sxm``).
      strategies: presets to try (default every one of ``strategies.NAMES``).
      remat: policies to try where the plain step does not fit (default
        ``dots`` then ``full``).
      microbatches: microbatch counts to try likewise (1 first).
      max_compiles: at most this many compiles; the rest is pruned (and said).
      cache: a JSON file to keep compile results across runs (always kept in memory).
      compile_fn: replaces the compile and the formula's pre-check (tests):
        ``compile_fn(candidate) -> dict`` with ``total``, ``temp``, ``flops``,
        ``collective_bytes``, ``collectives``.

    >>> fake = lambda c: {"total": 100 * (1 + (c.strategy == "dp")), "temp": 1,
    ...                   "flops": 1e9, "collective_bytes": 1e6 * c.mesh.get("model", 1),
    ...                   "collectives": 1}
    >>> plan = auto("tiny", devices=8, batch=8, seq=16, device_memory=150,
    ...             strategies=["dp", "fsdp", "tp"], compile_fn=fake, progress=False)
    >>> [c.label for c in plan.ranked]
    ['fsdp data=8 remat=none mb=1', 'tp data=4,model=2 remat=none mb=1', 'tp data=2,model=4 remat=none mb=1']
    >>> [c.reason for c in plan.dropped if c.strategy == "dp"][0]
    'needs 200 B per device (compiled), over the 150 B available'
    """
    from flax import nnx

    from nnx_shard import strategies as _strategies
    from nnx_shard.cli import _optimizer, _parse_bytes, _Usage
    from nnx_shard.errors import ShardingError
    from nnx_shard.models import CONFIGS, REMAT_POLICIES, TransformerConfig

    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"auto: devices must be a positive int, got {devices!r}")
    for arg, value in (("batch", batch), ("seq", seq)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"auto: {arg} must be a positive int, got {value!r}")
    hw = hardware if isinstance(hardware, Hardware) else _lookup(hardware or "h100-sxm")
    if isinstance(device_memory, str):
        try:
            device_memory = _parse_bytes(device_memory)
        except _Usage:
            raise ValueError(f"auto: device_memory {device_memory!r} is not a size; use e.g. "
                             "80GB, 80GiB or an int of bytes") from None
    memory = device_memory if device_memory is not None else hw.device_memory
    names = list(_strategies.NAMES if strategies is None else strategies)
    for s in names:
        _strategies.get(s)  # an unknown name raises, naming the known ones
    try:
        tx = _optimizer(optimizer)
    except _Usage as e:
        raise ValueError(f"auto: {e}") from None

    # -- the model ---------------------------------------------------------------
    cfg = None
    factory_takes_remat = False
    if isinstance(model, str):
        if model not in CONFIGS:
            raise ValueError(f"auto: unknown model {model!r}; known: {', '.join(CONFIGS)}, or "
                             "pass a TransformerConfig or a factory")
        cfg, model_name = CONFIGS[model], model
    elif isinstance(model, TransformerConfig):
        cfg, model_name = model, None
    elif callable(model):
        model_name = None
        try:
            factory_takes_remat = "remat" in inspect.signature(model).parameters
        except (TypeError, ValueError):
            factory_takes_remat = False
    else:
        raise TypeError(f"auto: model must be a config name, a TransformerConfig or a factory, "
                        f"got {type(model).__name__}")
    if cfg is not None and seq > cfg.length:
        raise ValueError(f"auto: seq {seq} is longer than the model allows ({cfg.length}); "
                         "use a smaller seq")
    if cfg is not None:
        policies = ["none", *[p for p in (remat or REMAT_ORDER) if p != "none"]]
        bad = [p for p in policies if p not in REMAT_POLICIES]
        if bad:
            raise ValueError(f"auto: unknown remat policy {bad[0]!r}; valid: "
                             + ", ".join(REMAT_POLICIES))
        make = _config_factory(_config_dict(cfg), "none")
    else:
        policies = (["none", *[p for p in (remat or REMAT_ORDER) if p != "none"]]
                    if factory_takes_remat else [None])
        make = (lambda: model(remat="none")) if factory_takes_remat else model
    try:
        abstract = nnx.eval_shape(make)
    except Exception as e:
        raise ValueError(f"auto: the model factory raised {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}") from e
    mbs = sorted({int(m) for m in microbatches if int(m) >= 1} | {1})

    # -- enumerate and check layouts ---------------------------------------------
    layouts, pruned = _enumerate(devices, names)
    dropped: list[Candidate] = []
    viable: list[tuple[str, dict[str, int]]] = []
    for name, sizes in layouts:
        strat = _strategies.get(name)
        base = Candidate(name, sizes, policies[0])
        try:
            strat.check(abstract, sizes)
        except (ShardingError, ValueError, TypeError) as e:
            # A preset states what it needs of the model by raising from check.
            base.reason = "cannot lay out: " + " ".join(str(e).split())
            dropped.append(base)
            continue
        if (why := _batch_problem(strat, sizes, batch, seq, 1)) is not None:
            base.reason = why
            dropped.append(base)
            continue
        viable.append((name, sizes))
    if not viable:
        plan = Plan([], dropped, pruned, hw, {})
        fams = plan.families()
        good = [d for d in range(max(1, devices - 8), devices + 9)
                if d != devices and batch % d == 0 and d > 1]
        hint = (f" Device counts near {devices} that divide the batch {batch}: "
                f"{', '.join(map(str, good[:6]))}." if good else "")
        raise ValueError(
            f"auto: no preset can use {devices} devices for this model with batch {batch} x "
            f"seq {seq}: " + "; ".join(f"{k}: {_clip(v, 160)}" for k, v in fams.items())
            + f".{hint}")

    label = model_name or (f"TransformerConfig(embed={cfg.embed}, layers={cfg.layers})"
                           if cfg is not None else getattr(model, "__name__", "factory"))
    request = {"model_name": model_name, "model_label": label, "devices": devices,
               "batch": batch, "seq": seq, "optimizer": optimizer, "device_memory": memory}
    store = _Cache(cache, shared=compile_fn is None)
    version = _versions()
    counters = {"compiled": 0, "cached": 0, "considered": len(layouts)}

    def key_of(c: Candidate) -> str:
        what = {"model": _config_dict(cfg) if cfg is not None else
                f"{getattr(model, '__module__', '')}.{getattr(model, '__qualname__', '')}"
                f"#{id(model)}", "strategy": c.strategy, "sizes": c.mesh, "remat": c.remat,
                "microbatches": c.microbatches, "batch": batch, "seq": seq,
                "optimizer": optimizer, "v": version}
        return hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()

    def formula_over(c: Candidate) -> int | None:
        if memory is None or compile_fn is not None:
            return None
        est = _formula_bytes(abstract, cfg, _strategies.get(c.strategy), c.mesh, tx,
                             batch // c.microbatches, seq, c.remat or "none")
        return est if est is not None and est > memory * _PRUNE_MARGIN else None

    def formula_reason(over: int) -> str:
        return (f"the formula alone needs {_fmt(over)} per device, over {_PRUNE_MARGIN}x the "
                f"{_fmt(memory)} available (not compiled)")

    def run(cands: list[Candidate], bar: Any) -> None:
        todo: list[Candidate] = []
        for c in cands:
            hit = store.get(key_of(c))
            if hit is not None:
                counters["cached"] += 1
                _apply(c, hit, memory, hw)
                bar.update(1)
            else:
                todo.append(c)
        if not todo:
            return
        by_key = {key_of(c): c for c in todo}

        def done(result: dict[str, Any]) -> None:
            c = by_key[result.pop("key")]
            store.put(key_of(c), result)
            counters["compiled"] += 1
            _apply(c, result, memory, hw)
            bar.set_postfix_str(c.label, refresh=False)
            bar.update(1)

        if compile_fn is not None or cfg is None:
            for c in todo:
                try:
                    if compile_fn is not None:
                        result = dict(compile_fn(c))
                    else:
                        fac = (lambda c=c: model(remat=c.remat)) if factory_takes_remat else model
                        result = compile_step(fac, c.strategy, c.mesh, batch=batch, seq=seq,
                                              optimizer=optimizer, microbatches=c.microbatches)
                except Exception as e:  # a candidate that cannot compile is dropped, with why
                    result = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
                done({"key": key_of(c), **result})
        else:
            reqs = [{"key": key_of(c), "config": _config_dict(cfg), "remat": c.remat,
                     "strategy": c.strategy, "sizes": c.mesh, "batch": batch, "seq": seq,
                     "optimizer": optimizer, "microbatches": c.microbatches} for c in todo]
            _run_child(reqs, devices, timeout * len(reqs) + 60, done)

    if cfg is None and compile_fn is None:
        import jax

        if jax.device_count() < devices:
            raise ValueError(
                f"auto: a model factory compiles in this process, which has "
                f"{jax.device_count()} devices, fewer than devices={devices}. Fix: run with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} (CPU), or pass a "
                "config name / TransformerConfig (compiled in a subprocess).")

    ranked: list[Candidate] = []
    budget = max_compiles
    first = [Candidate(n, s, policies[0]) for n, s in viable]
    stage1: list[Candidate] = []
    for c in first:
        over = formula_over(c)
        if over is not None:
            c.fits, c.reason = False, formula_reason(over)
            c.bytes_per_device = over
        else:
            stage1.append(c)
    if len(stage1) > budget:
        pruned.append(f"{len(stage1) - budget} layouts not compiled (max_compiles={max_compiles})")
        for c in stage1[budget:]:
            c.reason = f"not compiled: over max_compiles={max_compiles}"
        stage1 = stage1[:budget]
    budget -= len(stage1)
    with _bar(len(stage1), progress, "compiling layouts") as bar:
        run(stage1, bar)
    for c in first:
        (ranked if c.fits else dropped).append(c)

    # Remat and microbatches only where the plain step does not fit, cheapest first.
    retry = [c for c in first if c.fits is False and c.bytes_per_device is not None]
    variants_of = {}
    for c in retry:
        order = [(p, 1) for p in policies[1:]] + [(p, m) for p in policies for m in mbs if m > 1]
        variants_of[(c.strategy, tuple(c.mesh.items()))] = [
            Candidate(c.strategy, c.mesh, p, m) for p, m in order
            if _batch_problem(_strategies.get(c.strategy), c.mesh, batch, seq, m) is None]
    if retry and len(policies) == 1 and len(mbs) == 1:
        pruned.append("no remat policy or microbatch count to try for layouts that do not fit")
    tried = 0
    with _bar(sum(len(v) for v in variants_of.values()), progress,
              "remat / microbatches") as bar:
        # One round per variant index across layouts, so each layout gets its cheapest
        # variants first within the compile budget.
        live = dict(variants_of)
        while live and budget > 0:
            batch_round = []
            for key in list(live):
                if not live[key]:
                    del live[key]
                    continue
                batch_round.append(live[key].pop(0))
            skipped = []
            for v in list(batch_round):
                over = formula_over(v)
                if over is not None:
                    v.fits, v.reason = False, formula_reason(over)
                    v.bytes_per_device = over
                    skipped.append(v)
                    batch_round.remove(v)
                    bar.update(1)
            for v in batch_round[budget:]:  # past the budget: said, not silently lost
                v.reason = f"not compiled: over max_compiles={max_compiles}"
                live.setdefault((v.strategy, tuple(v.mesh.items())), []).insert(0, v)
            batch_round = batch_round[:budget]
            budget -= len(batch_round)
            tried += len(batch_round)
            run(batch_round, bar)
            for v in batch_round + skipped:
                key = (v.strategy, tuple(v.mesh.items()))
                if v.fits:
                    ranked.append(v)
                    live.pop(key, None)  # the first variant that fits is kept
                else:
                    dropped.append(v)
        left = sum(len(v) for v in live.values())
        if left:
            pruned.append(f"{left} remat/microbatch variants not compiled (max_compiles="
                          f"{max_compiles})")
    if variants_of:
        pruned.append("remat policies and microbatches tried only for layouts whose plain step "
                      "does not fit (they add recompute or per-microbatch collectives), "
                      "cheapest first, stopping at the first that fits")
    store.save()
    ranked.sort(key=lambda c: (c.predicted_s, c.bytes_per_device or 0))
    # A preset whose extra axis the model does not use (ep on a dense model) compiles
    # to the program of a simpler one: keep the first of identical programs.
    seen: dict[tuple[Any, ...], Candidate] = {}
    twins: list[Candidate] = []
    same: list[str] = []
    for c in ranked:
        sig = (c.bytes_per_device, c.temp, c.flops, c.collective_bytes, c.collectives,
               c.memory_bytes, c.microbatches, c.remat)
        if sig in seen:
            twins.append(c)
            same.append(f"{c.label} (= {seen[sig].label})")
        else:
            seen[sig] = c
    if twins:
        ranked = list(seen.values())
        pruned.append(f"{len(twins)} candidates that compile to the same program as a "
                      f"better-ranked one: {', '.join(same)}")
    counters["considered"] = len(layouts) + sum(1 for c in dropped + ranked
                                                if (c.remat, c.microbatches) != (policies[0], 1))
    request.update(counters)
    plan = Plan(ranked, dropped, pruned, hw, request, twins)
    if not ranked:
        raise NothingFits(plan, _nothing_fits(plan, memory, batch, devices))
    return plan


class NothingFits(ValueError):
    """No candidate fits the memory; ``plan`` holds what was tried."""

    def __init__(self, plan: Plan, message: str) -> None:
        super().__init__(message)
        self.plan = plan


def _nothing_fits(plan: Plan, memory: int | None, batch: int, devices: int) -> str:
    measured = [c for c in plan.dropped if c.bytes_per_device]
    if not measured:
        fams = plan.families()
        return ("auto: no candidate compiled: "
                + "; ".join(f"{k}: {_clip(v, 200)}" for k, v in fams.items()))
    least = min(measured, key=lambda c: c.bytes_per_device or 0)
    need = least.bytes_per_device or 0
    temp = least.temp or 0
    if least.compiled and temp > need / 2:
        knob = (f"activations dominate ({_fmt(temp)} of it is XLA's temporaries): a smaller "
                f"batch (e.g. {max(1, batch // 2)}) or more microbatches cut it most")
    else:
        knob = (f"parameters and optimizer state dominate: more devices (fsdp shards them 1/N; "
                f"e.g. {devices * 2}) or a smaller optimizer state (sgd) cut it most")
    return (f"auto: nothing fits in {_fmt(memory or 0)} per device: the smallest need is "
            f"{_fmt(need)} ({least.label}); {knob}.")


def _apply(c: Candidate, result: Mapping[str, Any], memory: int | None, hw: Hardware) -> None:
    if "error" in result:
        c.fits, c.reason = False, f"does not compile: {result['error']}"
        return
    c.compiled = True
    c.bytes_per_device = int(result["total"])
    c.temp = int(result.get("temp", 0))
    c.flops = float(result["flops"])
    c.collective_bytes = float(result["collective_bytes"])
    c.collectives = round(float(result.get("collectives", 0)))
    c.memory_bytes = float(result.get("memory_bytes", 0.0))
    c.by_kind = dict(result.get("by_kind", {}))
    c.compile_s = result.get("compile_s")
    c.predicted_s = hw.predict(c.flops, c.collective_bytes, c.collectives, c.memory_bytes)
    if memory is not None and c.bytes_per_device > memory:
        c.fits = False
        c.reason = (f"needs {_fmt(c.bytes_per_device)} per device (compiled), over the "
                    f"{_fmt(memory)} available")
    else:
        c.fits, c.reason = True, None


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _bar(total: int, progress: bool, desc: str) -> Any:
    if not progress or total == 0:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="compile", file=sys.stderr, leave=False)


# --------------------------------------------------------------------------- CLI

_CALIBRATE = """
import dataclasses, json
from nnx_shard.planner import calibrate
print(json.dumps(dataclasses.asdict(calibrate())))
"""


def calibrate_subprocess(n_devices: int, timeout: float = 120.0) -> Hardware:
    """:func:`calibrate` in a fresh Python with ``n_devices`` simulated CPU devices.

    >>> calibrate_subprocess(2).precision
    'float32'
    """
    try:
        done = subprocess.run([sys.executable, "-c", _CALIBRATE], env=_child_env(n_devices),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"calibrating {n_devices} simulated devices took longer than "
                           f"{timeout:g} s") from None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = " ".join((done.stderr or "").strip().splitlines()[-1:]) or f"exit {done.returncode}"
        raise RuntimeError(f"calibrating {n_devices} simulated devices failed: {tail}")
    return Hardware(**json.loads(lines[-1]))


def run_cli(args: Any) -> int:
    """``nnx-shard plan --auto``: prints the plan (or JSON); exit 0 when something
    fits, 1 when nothing does. Bad input raises the CLI's usage error.

    >>> from nnx_shard.cli import main
    >>> main(["plan", "--auto", "--model", "tiny", "--batch", "8", "--seq", "16"])
    2
    """
    from nnx_shard.cli import _parse_bytes, _Usage

    if args.devices is None:
        raise _Usage("plan --auto needs --devices N (the device count to plan for)")
    if args.mesh:
        raise _Usage("plan --auto chooses the mesh: drop --mesh (or drop --auto to check one)")
    if args.devices < 1:
        raise _Usage(f"--devices must be at least 1, got {args.devices}")
    try:
        if args.calibrate:
            hw = calibrate_subprocess(min(args.devices, 64))
        else:
            hw = hardware(args.hardware or "h100-sxm")
        hw = hw.replace(peak_flops=args.peak_flops, link_bandwidth=args.link_bandwidth,
                        link_latency=args.link_latency,
                        device_memory=_parse_bytes(args.device_memory)
                        if args.device_memory else None)
    except (ValueError, RuntimeError) as e:
        raise _Usage(str(e)) from None
    names = [s.strip() for s in args.strategies.split(",") if s.strip()] \
        if args.strategies else None
    try:
        plan = auto(args.model, devices=args.devices, batch=args.batch, seq=args.seq,
                    device_memory=hw.device_memory, hardware=hw, optimizer=args.optimizer,
                    strategies=names, max_compiles=args.max_compiles,
                    cache=None if args.no_cache else default_cache(),
                    progress=not args.json and sys.stderr.isatty(),
                    timeout=args.compile_timeout)
    except NothingFits as e:
        if args.json:
            print(json.dumps(_plan_json(e.plan, str(e))))
        else:
            print(e.plan)
        print(f"nnx-shard: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        raise _Usage(str(e)) from None
    if args.json:
        print(json.dumps(_plan_json(plan, None)))
    else:
        plan.request["top"] = args.top
        print(plan)
    return 0


def _plan_json(plan: Plan, error: str | None) -> dict[str, Any]:
    return {"request": plan.request, "hardware": dataclasses.asdict(plan.hardware),
            "ranked": [c.as_dict() for c in plan.ranked],
            "dropped": [c.as_dict() for c in plan.dropped], "families": plan.families(),
            "pruned": plan.pruned, "python": plan.python(), "command": plan.command(),
            "error": error}
