"""Saving a sharded model as a Hugging Face checkpoint, every process writing
the shards it owns."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnx_shard import safetensors_io as st
from nnx_shard.annotate import path_str
from nnx_shard.errors import count, short
from nnx_shard.hf.layout import INDEX, MARKER, SINGLE, as_path, barrier, layouts, program
from nnx_shard.hf.mapping import (
    TRANSFORM_FNS,
    Leaf,
    MappingValue,
    Rule,
    compile_rules,
    hf_key,
    leaves_of,
    mapping_for,
    natural,
)
from nnx_shard.init import _rewrap

__all__ = ['save_safetensors']

def _plan_save(state: Any, rules: Sequence[Rule]) -> dict[str, Leaf]:
    leaves = leaves_of(state, "save_safetensors")
    problems = []
    for leaf in leaves.values():
        found = hf_key(rules, leaf, None)
        if found is not None:
            leaf.keys[None], leaf.rule = found
        elif leaf.shape and (layered := hf_key(rules, leaf, 0)) is not None:
            leaf.layers = leaf.shape[0]
            for i in range(leaf.layers):
                got = hf_key(rules, leaf, i)
                if got is not None:
                    leaf.keys[i], leaf.rule = got
            leaf.rule = layered[1]
        if leaf.rule is None:
            problems.append(f"{leaf.describe()} has no Hugging Face name: no mapping "
                            "template produces its path (templates of patterns with regex "
                            "syntax beyond literal text and groups cannot be inverted). Fix: "
                            "add a literal pattern for it to the mapping.")
            continue
        leaf.transform = leaf.rule.transform
    if problems:
        raise ValueError(f"save_safetensors: {len(problems)} parameters cannot be named:\n"
                         + "\n".join(f"- {p}" for p in problems))
    return leaves


def _prepare_dir(out: Path, names: Sequence[str]) -> None:
    """Makes ``out`` ready for ``names``: files of an earlier save_safetensors (listed
    in its marker) are removed; anything else in the way is an error."""
    out.mkdir(parents=True, exist_ok=True)
    marker = out / MARKER
    ours = set(json.loads(marker.read_text())["files"]) if marker.is_file() else set()
    present = {p.name for p in out.iterdir()}
    clash = sorted(((set(names) | {n for n in present if n.endswith(".safetensors")})
                    & present) - ours)
    if clash:
        raise FileExistsError(
            f"save_safetensors: {out} already holds {', '.join(clash)}, which save_safetensors "
            "did not write there. Fix: save to a new or empty directory (nothing is "
            "overwritten).")
    for name in sorted(ours & present):
        (out / name).unlink()
    marker.write_text(json.dumps({"files": sorted(names)}) + "\n")


def _check_args(path: Any, model: Any, max_shard_bytes: Any, dtype: Any) -> None:
    if as_path(path, "save_safetensors").exists() and not Path(path).is_dir():
        raise FileExistsError(f"save_safetensors: path {str(path)!r} is a file, not a directory "
                              "(it is never written over). Fix: a directory path")
    if dtype is not None:
        try:
            st.dtype_name(dtype)
        except TypeError:
            raise TypeError(f"save_safetensors: dtype {short(dtype, 40)} is not a dtype. Fix: "
                            "e.g. dtype=jnp.bfloat16, or None to keep each parameter's") from None
    if not isinstance(model, nnx.Module):
        raise TypeError(f"save_safetensors: model must be an nnx.Module, got "
                        f"{type(model).__name__} {short(model, 60)}. Fix: the model to write")
    if max_shard_bytes is not None:
        count(max_shard_bytes, "save_safetensors: max_shard_bytes",
              fix="bytes per file, e.g. 5 * 10**9, or None for one file")


def _plan_files(leaves: Mapping[str, Leaf], max_shard_bytes: int | None, dtype: Any
                ) -> tuple[dict[str, tuple[str, tuple[int, ...], Leaf]], list[str],
                           list[list[str]], list[str]]:
    """The tensors to write (Hugging Face key -> (dtype name, shape, leaf)), their keys
    in order, the keys of each file, and the file names."""
    tensors: dict[str, tuple[str, tuple[int, ...], Leaf]] = {}
    for leaf in leaves.values():
        t = TRANSFORM_FNS[leaf.transform or "copy"]
        shape = tuple(t.hf_shape(leaf.layer_shape))
        kind = st.dtype_name(leaf.dtype if dtype is None else dtype)
        for key in leaf.keys.values():
            tensors[key] = (kind, shape, leaf)
    order = sorted(tensors, key=natural)
    groups: list[list[str]] = [[]]
    size = 0
    for key in order:
        kind, shape, _ = tensors[key]
        n = st.DTYPES[kind].itemsize * int(np.prod(shape))
        if max_shard_bytes is not None and groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    names = ([SINGLE] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    return tensors, order, groups, names


def save_safetensors(path: str | os.PathLike[str], model: Any,
                     mapping: Mapping[str, MappingValue] | None = None, *,
                     max_shard_bytes: int | None = None, dtype: Any = None) -> None:
    """Writes ``model``'s parameters as a Hugging Face checkpoint in the directory
    ``path``: ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json`` with ``max_shard_bytes``), plus
    ``config.json`` for a :class:`~nnx_shard.models.Llama` (transformers'
    ``from_pretrained`` reads the directory).

    Works from any mesh and any number of processes: parameter by parameter,
    each device's shard is turned back into the Hugging Face layout on device
    and written by its own process into its byte ranges; no array is gathered.
    Every process must call it (processes must share the filesystem).
    :func:`load_safetensors` of the result is bitwise the saved model (for the
    same dtype). Files a previous ``save_safetensors`` wrote to ``path`` are
    replaced; any other file in the way is an error, never overwritten.

    Args:
      path: the output directory (created if needed).
      model: a concrete model with sharded (or single-device) arrays.
      mapping: as in :func:`load_safetensors`; each template must be invertible
        (literal text and groups). Default :func:`mapping_for`.
      max_shard_bytes: split the tensors over files of at most this many bytes
        (a tensor larger than that gets its own file).
      dtype: store every tensor in this dtype (e.g. ``jnp.bfloat16``); default:
        each parameter's own.

    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> import nnx_shard as ns
    >>> from nnx_shard.models import Llama, get_llama_config
    >>> model = ns.strategies.get("fsdp_tp").sharded_init(
    ...     lambda: Llama(get_llama_config("tiny"), rngs=nnx.Rngs(0)), "data=4,model=2")
    >>> out = tempfile.mkdtemp()
    >>> save_safetensors(out, model, max_shard_bytes=40_000, dtype=jnp.bfloat16)
    >>> sorted(os.listdir(out))[:3]
    ['.nnx_shard_safetensors', 'config.json', 'model-00001-of-00002.safetensors']
    >>> json.load(open(os.path.join(out, "config.json")))["torch_dtype"]
    'bfloat16'
    """
    _check_args(path, model, max_shard_bytes, dtype)
    rules = compile_rules(mapping_for(model) if mapping is None else mapping)
    leaves = _plan_save(nnx.state(model), rules)
    tensors, order, groups, names = _plan_files(leaves, max_shard_bytes, dtype)
    out = Path(path)
    cfg = getattr(model, "cfg", None)
    extra = ([INDEX] if len(groups) > 1 else []) + (["config.json"] if hasattr(cfg, "to_hf")
                                                     else [])
    if jax.process_index() == 0:
        _prepare_dir(out, names + extra)
        for name, group in zip(names, groups, strict=True):
            st.create(str(out / name), {k: tensors[k][:2] for k in group}, {"format": "pt"})
        if len(groups) > 1:
            total = sum(st.DTYPES[tensors[k][0]].itemsize * int(np.prod(tensors[k][1]))
                        for k in order)
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: n for n, g in zip(names, groups, strict=True) for k in g}}
            (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if cfg is not None and hasattr(cfg, "to_hf"):
            config = cfg.to_hf()
            if dtype is not None:
                config["torch_dtype"] = np.dtype(dtype).name
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    barrier("nnx_shard.save_safetensors.create")
    header = st.read_header(*(str(out / n) for n in names))
    arrays = {path_str(k): v.get_value() if isinstance(v, nnx.Variable) else v
              for k, v in nnx.to_flat_state(nnx.state(model))}
    for leaf in leaves.values():
        # The Auto view of the parameter's mesh (the same buffers), as the program takes it.
        x = _rewrap(arrays.pop(leaf.path), layouts(leaf)[2])
        y = program(leaf, "save", leaf.dtype if dtype is None else dtype)(x)
        for shard in y.addressable_shards:
            if shard.replica_id != 0:
                continue
            data = np.asarray(shard.data)
            if leaf.layers:
                first = shard.index[0].indices(leaf.layers)[0]
                for i in range(data.shape[0]):
                    st.write_slice(header.tensors[leaf.keys[first + i]].path, header,
                                   leaf.keys[first + i], shard.index[1:], data[i])
            else:
                key = leaf.keys[None]
                st.write_slice(header.tensors[key].path, header, key, shard.index, data)
        del y
    barrier("nnx_shard.save_safetensors.written")
