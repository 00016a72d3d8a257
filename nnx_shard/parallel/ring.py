"""Moved: the attention op and its context-parallel modes are :mod:`nnx_shard.attention`
(the ring and all-gather algorithms :mod:`nnx_shard.attention.context_parallel`).

Every public name of this module still reads from here, with a
``DeprecationWarning`` naming its new home. ``MODES`` is the new tuple, whose
first value ``"local"`` replaces ``"dense"`` (see :mod:`nnx_shard.attention.modes`).

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from nnx_shard.parallel.ring import attention
>>> attention.__module__, str(caught[0].message)
('nnx_shard.attention.op', 'nnx_shard.parallel.ring.attention is deprecated: use nnx_shard.attention.attention')
"""

from __future__ import annotations

from typing import Any

#: The names this module had, now in nnx_shard.attention.
MOVED = ("MODES", "OPTION", "attention", "expect_attention")


def __getattr__(name: str) -> Any:
    if name in MOVED:
        import warnings

        import nnx_shard.attention

        warnings.warn(f"nnx_shard.parallel.ring.{name} is deprecated: use "
                      f"nnx_shard.attention.{name}", DeprecationWarning, stacklevel=2)
        return getattr(nnx_shard.attention, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
