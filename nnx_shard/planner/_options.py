"""The options of the planner's search: :class:`AutoOptions` (what
:func:`nnx_shard.planner.auto` searches, and how), and their checks, each bad
option one :class:`~nnx_shard.UsageError` naming it and a fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nnx_shard import _optimizers as optimizers
from nnx_shard._errors import UsageError, short
from nnx_shard._train._guard import DEFAULT_GUARD, GUARDS
from nnx_shard._units import parse_bytes
from nnx_shard.models import REMAT_POLICIES
from nnx_shard.planner._hardware import Hardware, hardware
from nnx_shard.strategies._presets import get
from nnx_shard.strategies._strategy import MAX_PLAN_DEVICES, PRESETS

__all__ = ["OFFLOAD_ORDER", "REMAT_ORDER", "AutoOptions"]

#: Remat policies tried (in this order) for layouts whose plain step does not fit.
REMAT_ORDER = ("dots", "full")

#: Host offloads (:attr:`nnx_shard.strategies.Strategy.offload`) tried, in this order,
#: only where no candidate without offload fits; each mode's search stops the next.
OFFLOAD_ORDER = ("optimizer", "optimizer+params")


@dataclasses.dataclass(frozen=True)
class AutoOptions:
    """What :func:`auto` searches, and how.

    Attributes:
      devices: the device count.
      batch, seq: the global batch and sequence length.
      device_memory: bytes per device (an int, or ``"80GB"``; default: the
        hardware profile's, else unlimited).
      host_memory: bytes of host memory per device offloaded state may take (an int,
        or ``"256GB"``; default: the hardware profile's ``host_memory``, 250 GB for
        the NVIDIA profiles; else not checked).
      offload: the host offloads to try, in order, where nothing fits without
        offload (default :data:`OFFLOAD_ORDER`: ``optimizer`` then
        ``optimizer+params``; ``[]`` never offloads).
      hardware: a :class:`~nnx_shard.planner.Hardware`, or a
        :data:`~nnx_shard.planner._hardware.PROFILES` name (default ``h100-sxm``).
      optimizer: the optimizer by name (``adamw``, ``adam``, ``sgd``).
      guard: the NaN guard mode ``Trainer.fit`` will run (``grads``, the default,
        ``full`` or ``off``; see :class:`~nnx_shard.Trainer`): ``full`` needs one
        more copy of the parameters and optimizer state per device.
      strategies: presets to try (default every registered one, ``strategies.NAMES``).
      remat: policies to try where the plain step does not fit (default
        ``dots`` then ``full``).
      microbatches: microbatch counts to try likewise (1 first).
      max_compiles: at most this many compiles; the rest is pruned (and said).
      cache: a JSON file to keep compile results across runs (always kept in memory).
      progress: a progress bar on stderr.
      timeout: seconds per compile in the subprocess.
      workers: compile subprocesses run side by side (default one per core, at
        most 4; a config name only: a factory compiles in this process).
      compile_fn: replaces the compile and the formula's pre-check (tests):
        ``compile_fn(candidate) -> dict`` with ``total``, ``temp``, ``flops``,
        ``collective_bytes``, ``collectives``.

    >>> from nnx_shard.planner import AutoOptions
    >>> AutoOptions(devices=8, batch=16, seq=16).max_compiles
    64
    """

    devices: int
    batch: int
    seq: int
    device_memory: int | str | None = None
    hardware: Hardware | str | None = None
    optimizer: str = "adamw"
    guard: str = DEFAULT_GUARD
    strategies: Sequence[str] | None = None
    remat: Sequence[str] | None = None
    microbatches: Sequence[int] = (1, 2, 4, 8)
    max_compiles: int = 64
    cache: str | os.PathLike[str] | None = None
    progress: bool = True
    timeout: float = 120.0
    workers: int | None = None
    compile_fn: Callable[..., Mapping[str, Any]] | None = None
    host_memory: int | str | None = None
    offload: Sequence[str] | None = None


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def names_list(value: Any, arg: str, example: str) -> list[Any]:
    """A list or tuple option (``strategies``, ``remat``, ``microbatches``): a string or a
    number there would be read item by item, or fail deep inside."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise UsageError(f"auto: {arg} must be a list, got {type(value).__name__} "
                         f"{short(value, 60)}. Fix: e.g. {arg}={example}")
    if not value:
        raise UsageError(f"auto: {arg}=[] leaves nothing to try. Fix: e.g. {arg}={example}, "
                         "or leave it out for the default")
    return list(value)


def check_auto_options(opts: AutoOptions) -> tuple[Hardware, int | None, list[str], Any]:
    _check_sizes(opts)
    _check_kinds(opts)
    hw = opts.hardware if isinstance(opts.hardware, Hardware) else hardware(
        opts.hardware or "h100-sxm")
    hw = hw.replace(host_memory=_device_memory(opts.host_memory, hw, "host_memory"))
    memory = _device_memory(opts.device_memory, hw)
    names = _strategy_names(opts.strategies)
    try:
        tx = optimizers.get(opts.optimizer)
    except UsageError as e:
        raise UsageError(f"auto: {e}") from None
    return hw, memory, names, tx


def _check_sizes(opts: AutoOptions) -> None:
    """The counts and the timeout."""
    devices = opts.devices
    if not positive_int(devices):
        raise UsageError(f"auto: devices must be a positive int, got {short(devices, 60)}. "
                         "Fix: the number of devices to plan for, e.g. devices=8")
    if devices > MAX_PLAN_DEVICES:
        raise UsageError(f"auto: devices must be at most {MAX_PLAN_DEVICES:,} (2**20), got "
                         f"{devices:,}: the largest mesh nnx_shard plans for. Fix: the "
                         "number of devices of the machine to plan for, e.g. devices=1024")
    for arg, value in (("batch", opts.batch), ("seq", opts.seq)):
        if not positive_int(value):
            raise UsageError(f"auto: {arg} must be a positive int, got {short(value, 60)}. "
                             f"Fix: e.g. {arg}=16")
    if not positive_int(opts.max_compiles):
        raise UsageError(f"auto: max_compiles must be a positive int, got "
                         f"{short(opts.max_compiles, 60)}. Fix: e.g. max_compiles=64")
    timeout = opts.timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"auto: timeout must be a finite number of seconds > 0, got "
                         f"{short(timeout, 60)}. Fix: e.g. timeout=120")


def _check_kinds(opts: AutoOptions) -> None:
    """The cache path, the hardware, the workers and the guard."""
    if opts.cache is not None and (isinstance(opts.cache, bytes)
                                   or not isinstance(opts.cache, str | os.PathLike)):
        raise UsageError(f"auto: cache must be a path (str or os.PathLike) or None, got "
                         f"{type(opts.cache).__name__} {short(opts.cache, 60)}. Fix: e.g. "
                         "cache='planner.json'")
    if opts.hardware is not None and not isinstance(opts.hardware, Hardware | str):
        raise UsageError(f"auto: hardware must be a Hardware or a profile name, got "
                         f"{type(opts.hardware).__name__} {short(opts.hardware, 60)}. Fix: e.g. "
                         "hardware='h100-sxm'")
    if opts.workers is not None and (not isinstance(opts.workers, int)
                                     or isinstance(opts.workers, bool) or opts.workers < 1):
        raise UsageError(f"auto: workers must be a positive int or None, got {opts.workers!r}. "
                         "Fix: e.g. workers=2 (compile subprocesses side by side), or leave it "
                         "out for one per core")
    if opts.guard not in GUARDS:
        raise UsageError(f"auto: guard must be one of {', '.join(GUARDS)}, got {opts.guard!r}. "
                         f"Fix: e.g. guard={DEFAULT_GUARD!r} (Trainer's default)")


def _device_memory(device_memory: int | str | None, hw: Hardware,
                   field: str = "device_memory") -> int | None:
    """Bytes per device of ``field`` (``device_memory`` or ``host_memory``): the
    option's, else the hardware profile's."""
    example = "80GB" if field == "device_memory" else "256GB"
    if isinstance(device_memory, str):
        try:
            device_memory = parse_bytes(device_memory)
        except UsageError:
            raise UsageError(f"auto: {field} {short(device_memory, 60)} is not a size; "
                             f"Fix: e.g. {example}, 80GiB or an int of bytes") from None
    elif device_memory is not None:
        try:
            device_memory = getattr(hw.replace(**{field: device_memory}), field)
        except UsageError:
            raise UsageError(f"auto: {field} must be a whole number of bytes >= 1 or a "
                             f"size such as {example!r}, got {short(device_memory, 60)}. Fix: "
                             f"e.g. {field}={example!r}") from None
    out = device_memory if device_memory is not None else getattr(hw, field)
    return None if out is None else int(out)


def offload_modes(offload: Sequence[str] | None) -> list[str]:
    """The host offloads to try where nothing fits without (``[]``: none).

    >>> offload_modes(None), offload_modes([])
    (['optimizer', 'optimizer+params'], [])
    >>> offload_modes(["params"])
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: auto: unknown offload 'params'; valid: 'optimizer', 'optimizer+params'. Fix: e.g. offload=['optimizer'], or offload=[] never to offload
    """
    if offload is None:
        return list(OFFLOAD_ORDER)
    if isinstance(offload, str | bytes) or not isinstance(offload, Sequence):
        raise UsageError(f"auto: offload must be a list, got {type(offload).__name__} "
                         f"{short(offload, 60)}. Fix: e.g. offload=['optimizer']")
    for mode in offload:
        if mode not in OFFLOAD_ORDER:
            raise UsageError(f"auto: unknown offload {short(mode, 60)}; valid: "
                             + ", ".join(map(repr, OFFLOAD_ORDER)) + ". Fix: e.g. "
                             "offload=['optimizer'], or offload=[] never to offload")
    return list(dict.fromkeys(offload))


def _strategy_names(strategies: Sequence[str] | None) -> list[str]:
    # The registry as it is now: a preset registered after import is searched too.
    names = list(PRESETS if strategies is None else names_list(
        strategies, "strategies", "['fsdp', 'tp']"))
    for s in names:
        if not isinstance(s, str):
            raise UsageError(f"auto: strategies must be preset names, got {short(s, 60)}. Fix: "
                             "e.g. strategies=['fsdp', 'tp']")
        get(s)  # an unknown name raises, naming the known ones
    return names


def remat_policies(remat: Sequence[str] | None) -> list[str | None]:
    given = REMAT_ORDER if remat is None else names_list(remat, "remat", "['dots', 'full']")
    policies: list[str | None] = ["none", *[p for p in given if p != "none"]]
    bad = [p for p in policies if p not in REMAT_POLICIES]
    if bad:
        raise UsageError(f"auto: unknown remat policy {bad[0]!r}; valid: "
                         + ", ".join(REMAT_POLICIES) + ". Fix: one of those")
    return policies
