"""Small helpers the training modules share: which arguments are NNX objects, and how
leaves, shapes and values are named in messages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import graphlib

from nnx_shard._annotate import path_str
from nnx_shard._errors import short

__all__ = ["fmt_shape", "is_node", "leaf_path", "short_repr"]


def is_node(x: Any) -> bool:
    """True for arguments that are (or contain) NNX graph nodes: these are carried."""
    hit = False

    def leaf(y: Any) -> bool:
        nonlocal hit
        if graphlib.is_graph_node(y) or isinstance(y, nnx.Variable):
            hit = True
            return True
        return False

    jax.tree_util.tree_leaves(x, is_leaf=leaf)
    return hit


def leaf_path(path: Sequence[Any]) -> str:
    # State leaves end in `.value` (the Variable's payload); users know the variable path.
    keys = [k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")]
    return path_str(keys)


def fmt_shape(x: Any) -> str:
    return str(tuple(np.shape(x)))


def short_repr(x: Any, limit: int = 60) -> str:
    return short(x, limit)
