"""The files of a Hugging Face checkpoint (:func:`checkpoint_files`: one
``model.safetensors`` or the shards its index lists; :func:`open_checkpoint`: their
header, each file opened once) and the per-parameter programs between the Hugging Face
layout and the model's: what loading and saving share."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard import _safetensors_io as st
from nnx_shard._errors import LinkedOut, NnxShardError, NotAFile, UsageError, check_path, short
from nnx_shard._init import auto_typed_mesh
from nnx_shard._safetensors_io import described
from nnx_shard._trusted_files import ANYWHERE, folder_roots, read_within, roots_words
from nnx_shard.hf import _export_dir as export_dir
from nnx_shard.hf._mapping import TRANSFORM_FNS, Leaf

__all__ = ['INDEX', 'MARKER', 'SINGLE', 'CheckpointNotFound', 'barrier', 'checkpoint_files',
           'layouts', 'open_checkpoint', 'program']

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MARKER = export_dir.MARKER


def as_path(path: Any, who: str) -> Path:
    """``path`` as a Path: a str or os.PathLike (None, bytes or a number would fail
    inside pathlib with no word of which argument)."""
    if isinstance(path, bytes) or not isinstance(path, str | os.PathLike) or not str(path):
        raise UsageError(f"{who}: path must be a directory path (str or os.PathLike), got "
                         f"{type(path).__name__} {short(path, 60)}. Fix: e.g. "
                         f"{who}('checkpoints/llama', ...)")
    return Path(path)


class CheckpointNotFound(NnxShardError, FileNotFoundError):
    """No checkpoint at a path, or files its index lists are absent: a
    FileNotFoundError of nnx_shard's error family.

    >>> issubclass(CheckpointNotFound, FileNotFoundError), issubclass(CheckpointNotFound, NnxShardError)
    (True, True)
    """


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json`` (tensor name -> file),
    checked: a JSON object whose ``weight_map`` maps names to file names."""
    fix = (f"Fix: download the index again (or the checkpoint as one {SINGLE}, which is "
           "read instead when it is there).")
    roots = folder_roots(index.parent)
    try:
        # One descriptor, inside the folder (or its hub cache repository): an index
        # swapped for a link out would put another file's keys into the messages below.
        raw = read_within(index, roots)
    except LinkedOut as e:
        raise UsageError(f"load_safetensors: the index {index} leads to {e.target}, outside "
                         f"the checkpoint folder {roots_words(roots)}; only the checkpoint's own "
                         "files are read. Fix: put a copy of the index in the folder instead of "
                         f"the link (cp --remove-destination {e.target} {index}).") from None
    except NotAFile as e:
        raise UsageError(f"load_safetensors: the index {index} is {e.kind}, not a file. "
                         f"{fix}") from None
    try:
        content = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        why = getattr(e, "msg", None) or getattr(e, "reason", None) or type(e).__name__
        raise UsageError(f"load_safetensors: the index {index} is not JSON ({why}). "
                         f"{fix}") from None
    if not isinstance(content, dict):
        raise UsageError(f"load_safetensors: the index {index} is {described(content)}, not a "
                         "JSON object with a 'weight_map'. " + fix)
    if "weight_map" not in content:
        raise UsageError(f"load_safetensors: the index {index} has no 'weight_map' (found "
                         f"keys {short(sorted(content), 100)}). " + fix)
    weight_map = content["weight_map"]
    if not isinstance(weight_map, dict):
        raise UsageError(f"load_safetensors: the index {index}'s 'weight_map' is "
                         f"{described(weight_map)}, not an object of tensor name -> file. " + fix)
    if not weight_map:
        raise UsageError(f"load_safetensors: the index {index}'s 'weight_map' is empty: it "
                         "names no tensor. " + fix)
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name or "\x00" in name:
            raise UsageError(f"load_safetensors: the index {index} maps {short(key, 100)} to "
                             f"{described(name) if not isinstance(name, str) else short(name, 100)}"
                             ", not a file name. " + fix)
    return weight_map


def _inside(folder: Path, index: Path, name: str) -> Path:
    """``folder / name`` when the name stays inside ``folder``: an index must not make
    the loader read files elsewhere. The check is on the name; a shard that is itself
    a link is followed (the Hugging Face hub cache links every shard to a blob kept
    outside the snapshot folder)."""
    parts = Path(name).parts
    depth = 0
    for part in parts:
        depth += -1 if part == ".." else 0 if part == "." else 1
        if depth < 0:
            break
    if Path(name).is_absolute() or depth < 0:
        raise UsageError(f"load_safetensors: the index {index} names the file {short(name, 200)}"
                         ", outside the checkpoint folder; only files inside it are read. Fix: "
                         "name shards relative to the folder (e.g. "
                         "'model-00001-of-00002.safetensors'), or load the folder that holds "
                         "them.")
    return folder / name


def checkpoint_files(path: str | os.PathLike[str]) -> list[str]:
    p = as_path(path, "load_safetensors")
    if p.is_file() and p.suffix == ".safetensors":
        return [str(p)]
    check_path(p, "load_safetensors", name=f"path {str(p)!r}",
               expected="a directory or a .safetensors file", error=CheckpointNotFound,
               fix=f"pass the checkpoint directory (with {SINGLE} or {INDEX}).")
    marker = export_dir._marker_problem(p / MARKER) if (p / MARKER).is_file() else None
    if isinstance(marker, export_dir.Marker) and not marker.complete:
        raise export_dir.ExportError(
            f"load_safetensors: {p} is an unfinished save_safetensors export (its save failed "
            "or was killed before it was moved into place; its tensors are not all written). "
            "Fix: load the export's destination folder, or save again.")
    # transformers' from_pretrained reads model.safetensors when a folder holds both it
    # and an index (a sharded copy beside it is never looked at): the same weights here.
    if (p / SINGLE).is_file():
        return [str(p / SINGLE)]
    if (p / INDEX).is_file():
        weight_map = _read_index(p / INDEX)
        names = sorted(set(weight_map.values()))
        files = [_inside(p, p / INDEX, n) for n in names]
        absent = [n for n, f in zip(names, files, strict=True) if not f.is_file()]
        if absent:
            shown = ", ".join(absent)
            raise CheckpointNotFound(
                f"load_safetensors: {p / INDEX} lists {len(absent)} files that are not there: "
                f"{shown if len(shown) <= 400 else shown[:397] + '...'}. Fix: download every "
                "shard of the checkpoint.")
        return [str(f) for f in files]
    raise CheckpointNotFound(f"load_safetensors: {p} holds neither {SINGLE} nor {INDEX}. Fix: "
                             "pass the directory save_pretrained (or save_safetensors) wrote.")


@contextlib.contextmanager
def open_checkpoint(path: str | os.PathLike[str]) -> Iterator[st.Header]:
    """The header of the checkpoint at ``path`` (its :func:`checkpoint_files`), each
    file opened once and kept open while the block runs: every tensor is read from
    the descriptor its header was read from (:func:`~nnx_shard._safetensors_io.opened`).
    A shard that is a link is followed wherever it leads, as :func:`checkpoint_files`
    says; it must be a regular file when it is opened.

    Raises:
      CheckpointNotFound: a file of the checkpoint is gone when it is opened.
      UsageError: a file of the checkpoint is a folder, a FIFO or a device when it is
        opened (a FIFO is never waited on).

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> with open_checkpoint(ns.hf.tiny_checkpoint(tempfile.mkdtemp(), tokenizer=False)) as h:
    ...     h.tensors["model.norm.weight"].shape
    (32,)
    """
    files = checkpoint_files(path)
    with contextlib.ExitStack() as stack:
        try:
            header = stack.enter_context(st.opened(files, ANYWHERE))
        except NotAFile as e:
            what = ("was swapped for another link while it was opened" if e.kind ==
                    "a symbolic link" else f"is {e.kind}, not a file")
            raise UsageError(f"load_safetensors: {e.filename} {what}. Fix: download the "
                             "checkpoint's files again, and leave them be while they "
                             "load.") from None
        except FileNotFoundError as e:
            raise CheckpointNotFound(f"load_safetensors: {e.filename} is gone (removed while "
                                     "the checkpoint was opened). Fix: download every file of "
                                     "the checkpoint again.") from None
        yield header


# -- compiled transforms ---------------------------------------------------------------------


def layouts(leaf: Leaf) -> tuple[tuple[int, ...], NamedSharding, NamedSharding]:
    """The Hugging Face-layout shape of ``leaf`` (``[layers, ...]`` when stacked) and
    its sharding, derived from the parameter's so that the transform is local,
    and the parameter's sharding, on the Auto view of the mesh."""
    t = TRANSFORM_FNS[leaf.transform or "copy"]
    spec = leaf.spec()
    if leaf.layers:
        d = leaf.depth
        shape = (*leaf.shape[:d], *t.hf_shape(leaf.layer_shape))
        hf = (*spec[:d], *t.hf_spec(spec[d:]))
    else:
        shape, hf = tuple(t.hf_shape(leaf.shape)), tuple(t.hf_spec(spec))
    mesh = auto_typed_mesh(leaf.sharding.mesh)  # type: ignore[arg-type]  # concrete: laid out
    return shape, NamedSharding(mesh, PartitionSpec(*hf)), NamedSharding(mesh,
                                                                         PartitionSpec(*spec))


_programs: dict[Any, Any] = {}


def program(leaf: Leaf, direction: str, dtype: Any) -> Any:
    """The jitted transform of ``leaf`` to the model layout (``direction="load"``,
    casting to the parameter's dtype) or back (``"save"``, casting to ``dtype``)."""
    _, hf, model = layouts(leaf)
    t = TRANSFORM_FNS[leaf.transform or "copy"]
    layer_shape = leaf.layer_shape
    depth = leaf.depth if leaf.layers else 0
    key = (direction, leaf.transform, depth, layer_shape, np.dtype(dtype).name, hf, model)
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
        fn = one
        for _ in range(depth):
            fn = jax.vmap(fn)
        _programs[key] = jax.jit(fn, in_shardings=src, out_shardings=dst)
    return _programs[key]


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# -- public ----------------------------------------------------------------------------------
