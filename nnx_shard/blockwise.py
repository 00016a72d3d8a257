"""Moved: the per-device attention kernels are :mod:`nnx_shard.attention.kernels`, their
block math :mod:`nnx_shard.attention.blocks`.

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

#: The names this module had, and the module of nnx_shard.attention each is in now.
MOVED = {
    **dict.fromkeys(("BLOCK", "KERNELS", "attention_local", "blockwise", "dense", "resolve"),
                    "kernels"),
    **dict.fromkeys(("Masks", "delta", "finish", "grads", "group_mask", "merge", "stats"),
                    "blocks"),
}


def __getattr__(name: str) -> Any:
    if name in MOVED:
        import importlib
        import warnings

        home = f"nnx_shard.attention.{MOVED[name]}"
        warnings.warn(f"nnx_shard.blockwise.{name} is deprecated: use {home}.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
