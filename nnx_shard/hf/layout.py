"""Checkpoint files and the per-parameter programs between the Hugging Face
layout and the model's: what loading and saving share."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard.errors import short
from nnx_shard.hf import export_dir
from nnx_shard.hf.mapping import TRANSFORM_FNS, Leaf
from nnx_shard.init import _auto_mesh

__all__ = ['INDEX', 'MARKER', 'SINGLE', 'barrier', 'checkpoint_files', 'layouts', 'program']

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MARKER = export_dir.MARKER


def as_path(path: Any, who: str) -> Path:
    """``path`` as a Path: a str or os.PathLike (None, bytes or a number would fail
    inside pathlib with no word of which argument)."""
    if isinstance(path, bytes) or not isinstance(path, str | os.PathLike) or not str(path):
        raise TypeError(f"{who}: path must be a directory path (str or os.PathLike), got "
                        f"{type(path).__name__} {short(path, 60)}. Fix: e.g. "
                        f"{who}('checkpoints/llama', ...)")
    return Path(path)


def checkpoint_files(path: str | os.PathLike[str]) -> list[str]:
    p = as_path(path, "load_safetensors")
    if p.is_file() and p.suffix == ".safetensors":
        return [str(p)]
    if not p.is_dir():
        raise FileNotFoundError(f"load_safetensors: path {str(p)!r} is not a directory or a "
                                ".safetensors file. Fix: pass the checkpoint directory (with "
                                f"{SINGLE} or {INDEX}).")
    marker = export_dir._marker_problem(p / MARKER) if (p / MARKER).is_file() else None
    if isinstance(marker, export_dir.Marker) and not marker.complete:
        raise export_dir.ExportError(
            f"load_safetensors: {p} is an unfinished save_safetensors export (its save failed "
            "or was killed before it was moved into place; its tensors are not all written). "
            "Fix: load the export's destination folder, or save again.")
    if (p / INDEX).is_file():
        with open(p / INDEX) as f:
            weight_map = json.load(f).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        absent = [n for n in names if not (p / n).is_file()]
        if absent:
            raise FileNotFoundError(f"load_safetensors: {p / INDEX} lists {len(absent)} files "
                                    f"that are not there: {', '.join(absent)}. Fix: download "
                                    "every shard of the checkpoint.")
        return [str(p / n) for n in names]
    if (p / SINGLE).is_file():
        return [str(p / SINGLE)]
    raise FileNotFoundError(f"load_safetensors: {p} holds neither {SINGLE} nor {INDEX}. Fix: "
                            "pass the directory save_pretrained (or save_safetensors) wrote.")


# -- compiled transforms ---------------------------------------------------------------------


def layouts(leaf: Leaf) -> tuple[tuple[int, ...], NamedSharding, NamedSharding]:
    """The Hugging Face-layout shape of ``leaf`` (``[layers, ...]`` when stacked) and
    its sharding, derived from the parameter's so that the transform is local,
    and the parameter's sharding, on the Auto view of the mesh."""
    t = TRANSFORM_FNS[leaf.transform or "copy"]
    spec = leaf.spec()
    if leaf.layers:
        shape = (leaf.layers, *t.hf_shape(leaf.layer_shape))
        hf = (spec[0], *t.hf_spec(spec[1:]))
    else:
        shape, hf = tuple(t.hf_shape(leaf.shape)), tuple(t.hf_spec(spec))
    mesh = _auto_mesh(leaf.sharding.mesh)  # type: ignore[arg-type]  # concrete: laid out
    return shape, NamedSharding(mesh, PartitionSpec(*hf)), NamedSharding(mesh,
                                                                         PartitionSpec(*spec))


_programs: dict[Any, Any] = {}


def program(leaf: Leaf, direction: str, dtype: Any) -> Any:
    """The jitted transform of ``leaf`` to the model layout (``direction="load"``,
    casting to the parameter's dtype) or back (``"save"``, casting to ``dtype``)."""
    _, hf, model = layouts(leaf)
    t = TRANSFORM_FNS[leaf.transform or "copy"]
    layer_shape = leaf.layer_shape
    key = (direction, leaf.transform, leaf.layers is not None, layer_shape, np.dtype(dtype).name,
           hf, model)
    if key not in _programs:
        if len(_programs) > 256:  # a bound on what a long session keeps compiled
            _programs.clear()
        if direction == "load":
            def one(x: jax.Array) -> jax.Array:
                return t.to_model(x, layer_shape).astype(dtype)
            src, dst = hf, model
        else:
            def one(x: jax.Array) -> jax.Array:
                return t.to_hf(x).astype(dtype)
            src, dst = model, hf
        fn = jax.vmap(one) if leaf.layers else one
        _programs[key] = jax.jit(fn, in_shardings=src, out_shardings=dst)
    return _programs[key]


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# -- public ----------------------------------------------------------------------------------
