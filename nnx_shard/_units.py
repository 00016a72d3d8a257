"""Sizes in bytes as people write them: ``80GB``, ``80GiB``, ``512MiB``, ``1e9``."""

from __future__ import annotations

import re

from nnx_shard._errors import UsageError, short

__all__ = ["MAX_BYTES", "parse_bytes"]

#: Sizes at or past this (1 EB) are not a device's memory (and ``1e999`` is infinite).
MAX_BYTES = 10**18

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B?|B)?\s*")
_POWERS = {"B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_bytes(text: str) -> int:
    """Bytes of a size: decimal units (``GB`` = 1e9) and binary ones (``GiB`` = 2**30);
    a bare number is bytes. Raises :class:`~nnx_shard._errors.UsageError` for text
    that is not a size.

    >>> parse_bytes("80GB"), parse_bytes("80GiB") == 80 * 2**30, parse_bytes("512 MiB")
    (80000000000, True, 536870912)
    >>> parse_bytes("1e9")
    1000000000
    >>> parse_bytes("0")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: '0' is not a memory size: sizes are at least 1 byte ...
    """
    m = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if not m:
        raise UsageError(f"{short(text, 60)} is not a size. Fix: write e.g. 80GB, 80GiB or "
                         "512MiB")
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    value = float(m.group(1)) * _POWERS[unit]
    if not 1 <= value < MAX_BYTES:
        raise UsageError(f"{short(text, 60)} is not a memory size: sizes are at least 1 byte and "
                         "under 1 EB (10**18 bytes). Fix: write e.g. 80GB, 80GiB or 512MiB")
    return int(value)
