"""Fused multi-step training (being split into modules; see fused.py)."""

from nnx_shard.train.fused import *  # noqa: F403
from nnx_shard.train.fused import __all__  # noqa: F401
