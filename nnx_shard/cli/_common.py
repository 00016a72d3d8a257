"""What the ``nnx-shard`` commands share: the program's name, the debug switch,
the bounds of their flags, and the readers of flags that name library things (a
mesh, a strategy, an optimizer, a size), which turn bad text into the one-line
:class:`~nnx_shard._errors.UsageError`.
"""

from __future__ import annotations

import math
import os
import sys

import jax
import optax

from nnx_shard import _optimizers as optimizers
from nnx_shard._errors import ShardingError, UsageError, short
from nnx_shard._mesh import parse_axes
from nnx_shard._units import parse_bytes
from nnx_shard.strategies import _presets as presets
from nnx_shard.strategies._strategy import MAX_PLAN_DEVICES, Strategy

__all__ = [
    "COMPILE_MAX_DEVICES", "DEBUG_ENV", "DEBUG_HINT", "DEMO_MAX_STEPS", "MAX_PLAN_DEVICES", "PROG",
    "SIMULATED_DEVICES", "UsageError", "device_memory", "mesh_sizes", "optimizer",
    "simulate_devices", "strategy",
]

PROG = "nnx-shard"
SIMULATED_DEVICES = 8
DEMO_MAX_STEPS = 1_000_000
# Meshes up to this many devices are compiled by default (a 256-device compile of
# the small models takes seconds; larger ones grow with the device count).
COMPILE_MAX_DEVICES = 512

DEBUG_ENV = "NNX_SHARD_DEBUG"
DEBUG_HINT = f"(--debug or {DEBUG_ENV}=1 shows the traceback)"

_FORCE = "--xla_force_host_platform_device_count"


def simulate_devices(n: int = SIMULATED_DEVICES) -> bool:
    """Asks JAX for ``n`` CPU devices unless its backends already started or a
    device count is set; returns whether it did.

    The count only shapes the CPU platform, so on a machine with accelerators it
    changes nothing there; on a laptop it turns one CPU into ``n`` devices.
    """
    if _FORCE in os.environ.get("XLA_FLAGS", "") or os.environ.get("JAX_NUM_CPU_DEVICES"):
        return False
    # Set by the user (config or env at import). Read through the public mapping of every
    # option: jax 0.10 does not type the option as an attribute of jax.config, 0.12 does.
    if jax.config.values["jax_num_cpu_devices"] >= 0:
        return False
    try:
        # JAX's public route: importing jax starts no backend; the first
        # jax.devices() does, and from then on this update raises.
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        print(f"{PROG}: JAX already started with {jax.device_count()} device(s), too late to "
              f"simulate {n} CPU devices; run it in a fresh process or set "
              f"JAX_NUM_CPU_DEVICES={n} before the first JAX call", file=sys.stderr)
        return False
    return True


def mesh_sizes(text: str, flag: str = "--mesh") -> dict[str, int]:
    """``--mesh data=8,model=8`` as sizes, read by :func:`nnx_shard._mesh.parse_axes`
    (its messages, after the flag); every axis needs a size (no devices here).

    >>> mesh_sizes("data=4,model=2")
    {'data': 4, 'model': 2}
    >>> mesh_sizes("data=4,model")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: --mesh: mesh spec 'data=4,model': 'model' is not 'axis=size'. ...
    """
    try:
        sizes = parse_axes(text, rest=False)
    except UsageError as e:
        raise UsageError(f"{flag}: {e}") from None
    if math.prod(sizes.values()) > MAX_PLAN_DEVICES:
        raise UsageError(f"{flag} {short(text)} has {math.prod(sizes.values()):,} devices, more "
                         f"than the {MAX_PLAN_DEVICES:,} planned for. Fix: a mesh of at most "
                         f"{MAX_PLAN_DEVICES:,} devices")
    return sizes


def strategy(name: str, flag: str = "--strategy") -> Strategy:
    """``--strategy NAME``: the preset; an unknown name is the usage error of ``flag``,
    naming the known ones.

    >>> strategy("fsdp").name
    'fsdp'
    >>> strategy("fsdpp")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: --strategy 'fsdpp': unknown strategy 'fsdpp'. Did you mean 'fsdp'? ...
    """
    try:
        return presets.get(name)
    except ShardingError as e:
        raise UsageError(f"{flag} {short(name, 60)}: {e}") from None


def optimizer(name: str) -> optax.GradientTransformation:
    """``--optimizer NAME``: the optax optimizer."""
    return optimizers.get(name)


def device_memory(text: str, flag: str = "--device-memory") -> int:
    """``--device-memory 80GB`` (or another size flag, ``flag``): bytes.

    >>> device_memory("1TB", "--host-memory")
    1000000000000
    >>> device_memory("lots")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: --device-memory 'lots' is not a size. Fix: write e.g. 80GB, 80GiB or 512MiB
    """
    try:
        return parse_bytes(text)
    except UsageError as e:
        raise UsageError(f"{flag} {e}") from None
