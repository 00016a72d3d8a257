"""Hostile cases across surfaces: Precision's dtypes, generate's sampling arguments and
prompts, plan --auto's device counts, explain's strategy and factory, launch's
devices per process, and training a model with an integer parameter."""

from __future__ import annotations

from typing import Any


def _ns() -> Any:
    import nnx_shard

    return nnx_shard


def _jnp() -> Any:
    import jax.numpy

    return jax.numpy


def build(hs: Any) -> None:
    # -- Precision: None is not a dtype (it read as float64), float8 is no dtype to train in
    for field in ("params", "compute"):
        hs.api(f"misc/precision_{field}_none", field,
               lambda field=field: _ns().Precision(**{field: None}))
        hs.api(f"misc/precision_{field}_float8", field,
               lambda field=field: _ns().Precision(**{field: _jnp().float8_e4m3fn}))
        hs.api(f"misc/precision_{field}_int8", field,
               lambda field=field: _ns().Precision(**{field: "int8"}))
