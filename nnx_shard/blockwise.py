"""Moved: the per-device attention kernels are :mod:`nnx_shard.attention.kernels`.

Every public name of this module still reads from here, with a
``DeprecationWarning`` naming its new home.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from nnx_shard.blockwise import KERNELS
>>> KERNELS, str(caught[0].message)
(('auto', 'blockwise', 'dense', 'cudnn'), 'nnx_shard.blockwise.KERNELS is deprecated: use nnx_shard.attention.kernels.KERNELS')
"""

from __future__ import annotations

from typing import Any

#: The names this module had, now in nnx_shard.attention.kernels.
MOVED = ("BLOCK", "KERNELS", "Masks", "attention_local", "blockwise", "delta", "dense",
         "finish", "grads", "group_mask", "merge", "resolve", "stats")


def __getattr__(name: str) -> Any:
    if name in MOVED:
        import warnings

        from nnx_shard.attention import kernels

        warnings.warn(f"nnx_shard.blockwise.{name} is deprecated: use "
                      f"nnx_shard.attention.kernels.{name}", DeprecationWarning, stacklevel=2)
        return getattr(kernels, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
