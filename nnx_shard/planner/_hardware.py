"""Accelerator figures for the planner's cost model: datasheet profiles, and
:func:`calibrate` to measure the machine at hand.

>>> PROFILES["h100-sxm"].peak_flops
989000000000000.0
>>> PROFILES["h100-sxm"].host_memory, PROFILES["tpu-v5e"].host_memory
(250000000000, None)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_shard._errors import UsageError, short
from nnx_shard._mesh import make_mesh
from nnx_shard._simulated import run_one
from nnx_shard._units import MAX_BYTES

__all__ = ["PROFILES", "Hardware", "calibrate", "calibrate_subprocess", "hardware"]



def _number(x: Any) -> bool:
    """A real number, not a bool (``True`` is an int)."""
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(
        x, bool | np.bool_)


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
      host_memory: bytes of host memory per device that offloaded state
        (:attr:`nnx_shard.strategies.Strategy.offload`) may take (``None``: not
        known, not checked). The NVIDIA profiles' is a DGX's 2 TB over its 8 GPUs
        (250 GB); the TPU profiles' is not known.

    >>> from nnx_shard.planner import Hardware
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
    host_memory: int | None = None

    def __post_init__(self) -> None:
        for field in ("peak_flops", "link_bandwidth", "memory_bandwidth"):
            value = getattr(self, field)
            if field == "memory_bandwidth" and value is None:
                continue
            if not _number(value) or not math.isfinite(value) or value <= 0:
                raise UsageError(f"Hardware {field} must be a finite number > 0, got "
                                 f"{short(value, 60)}. Fix: e.g. {field}=1e12")
        latency = self.link_latency
        if not _number(latency) or not math.isfinite(latency) or not 0 <= latency < 3600:
            raise UsageError(f"Hardware link_latency (--link-latency) must be a number of "
                             f"seconds >= 0 and under an hour, got {short(latency, 60)}. Fix: "
                             "e.g. 5e-6, or 0 to leave latency out")
        for field, flag, example in (("device_memory", "--device-memory", "80e9 (80GB)"),
                                     ("host_memory", "--host-memory", "256e9 (256GB)")):
            memory = getattr(self, field)
            if memory is not None and (not _number(memory) or not math.isfinite(memory)
                                       or not 1 <= memory < MAX_BYTES or memory != int(memory)):
                raise UsageError(f"Hardware {field} ({flag}) must be a whole number of bytes "
                                 f">= 1, got {short(memory, 60)}. Fix: e.g. {example}, or None "
                                 "when not known")

    def predict(self, flops: float, collective_bytes: float, collectives: int,
                memory_bytes: float = 0.0) -> float:
        """Predicted seconds of one step from its per-device figures.

        >>> from nnx_shard.planner import hardware
        >>> hardware("a100-80gb").predict(312e12, 0, 0)
        1.0
        >>> hardware("a100-80gb").predict(0, 0, 0, memory_bytes=2.039e12)
        1.0
        """
        memory = memory_bytes / self.memory_bandwidth if self.memory_bandwidth else 0.0
        return (flops / self.peak_flops + collective_bytes / self.link_bandwidth
                + collectives * self.link_latency + memory)

    def replace(self, **changes: Any) -> Hardware:
        """A copy with some figures changed (``None`` values are ignored).

        >>> from nnx_shard.planner import hardware
        >>> hardware("h100-sxm").replace(device_memory=40e9, peak_flops=None).device_memory
        40000000000
        """
        changes = {k: v for k, v in changes.items() if v is not None}
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise UsageError(f"Hardware has no field {unknown[0]!r}. Fix: one of "
                             + ", ".join(f.name for f in dataclasses.fields(self)))
        for field in ("device_memory", "host_memory"):
            memory = changes.get(field)
            if (memory is not None and _number(memory) and math.isfinite(memory)
                    and memory == int(memory)):
                changes[field] = int(memory)
        return dataclasses.replace(self, **changes)


_NVIDIA = ("NVIDIA datasheet; dense (no sparsity) BF16 tensor-core peak; NVLink bandwidth "
           "per direction (half of the datasheet's bidirectional figure); HBM bandwidth; host "
           "memory: a DGX's 2 TB over its 8 GPUs")
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

#: Host memory per GPU of the NVIDIA profiles: a DGX A100 (640 GB), H100 or H200
#: has 2 TB of system memory for its 8 GPUs. Offload checks the host's share of the
#: offloaded state against it (``--host-memory`` sets another).
_DGX_HOST = 2 * 10**12 // 8

#: Public peak figures of a few common accelerators (BF16 dense matmul).
PROFILES: dict[str, Hardware] = {
    name: Hardware(name, flops, link, memory, memory_bandwidth=hbm, precision="bf16",
                   source=_SOURCES[name],
                   host_memory=_DGX_HOST if name.startswith(("a100", "h1", "h2")) else None)
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

    Args:
      name: a key of :data:`PROFILES`: ``a100-80gb``, ``h100-sxm``, ``h200``, ``tpu-v5e``,
        ``tpu-v5p``.

    >>> from nnx_shard.planner import hardware
    >>> hardware("tpu-v5e").device_memory
    16000000000
    >>> hardware("h100")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: unknown hardware profile 'h100'. Did you mean 'h100-sxm'? Known: a100-80gb, h100-sxm, h200, tpu-v5e, tpu-v5p; or give --peak-flops and --link-bandwidth (hardware=Hardware(...)), or --calibrate to measure this machine.
    """
    if name in PROFILES:
        return PROFILES[name]
    # A prefix ("h100" for "h100-sxm") beats a near spelling ("h200").
    close = ([k for k in PROFILES if k.startswith(name.lower())][:1]
             or difflib.get_close_matches(name, PROFILES, n=1, cutoff=0.5))
    mean = f" Did you mean {close[0]!r}?" if close else ""
    raise UsageError(f"unknown hardware profile {name!r}.{mean} Known: {', '.join(PROFILES)}; "
                     "or give --peak-flops and --link-bandwidth (hardware=Hardware(...)), "
                     "or --calibrate to measure this machine.")



def _best(fn: Callable[[], Any], seconds: float) -> float:
    """The fastest of repeated blocking calls of ``fn`` within about ``seconds``."""
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
    n = jax.device_count() if n_devices is None else int(n_devices)
    if not 1 <= n <= jax.device_count():
        raise UsageError(f"calibrate: n_devices must be 1..{jax.device_count()} (the devices "
                         f"JAX has), got {n}. Fix: a count in that range, or "
                         "calibrate_subprocess(n) for more")
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



def _calibrate_request(request: dict[str, Any]) -> dict[str, Any]:
    return dataclasses.asdict(calibrate())


def calibrate_subprocess(n_devices: int, timeout: float = 120.0) -> Hardware:
    """:func:`calibrate` in a fresh Python with ``n_devices`` simulated CPU devices;
    raises :class:`~nnx_shard._errors.CompileError` if it fails or takes longer than
    ``timeout`` seconds.

    >>> calibrate_subprocess(2).precision
    'float32'
    """
    return Hardware(**run_one(
        "nnx_shard.planner._hardware:_calibrate_request", {}, n_devices, timeout=timeout,
        what=f"calibrating {n_devices} simulated devices",
        slow=". Fix: calibrate fewer devices, or give --peak-flops and --link-bandwidth instead",
        fix=". Fix: give --peak-flops and --link-bandwidth instead"))
