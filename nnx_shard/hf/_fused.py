"""Checkpoint tensors that hold several of the model's parameters stacked by rows
(Phi-3's ``qkv_proj`` and ``gate_up_proj``): each is read and written as its
parts, views of its byte range, so that the mapping and the sharded reads and
writes stay one tensor per parameter.

A row block of a row-major ``[rows, cols]`` tensor is one contiguous byte range,
so a part is a :class:`~nnx_shard._safetensors_io.TensorInfo` of its own: same
file, an offset into the fused tensor, its rows.

>>> from nnx_shard.models import get_config
>>> cfg = get_config("llama-tiny").with_family("phi3")
>>> [(f.fused, f.parts, f.rows) for f in fusions(cfg)][0]
('self_attn.qkv_proj.weight', ('self_attn.q_proj.weight', 'self_attn.k_proj.weight', 'self_attn.v_proj.weight'), (32, 16, 16))
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from nnx_shard import _safetensors_io as st
from nnx_shard._errors import UsageError
from nnx_shard.models._families import Fusion, family_of

__all__ = ["Fusion", "fuse_names", "fusions", "fusions_for", "split"]

_LAYER = re.compile(r"(model\.layers\.\d+\.)(.*)")


def fusions(cfg: Any) -> list[Fusion]:
    """The fused tensors of a :class:`~nnx_shard.models.DecoderConfig`'s checkpoints,
    as its family has them (Phi-3's; none for the others: see the module example)."""
    fused = family_of(cfg.model_type).fused
    return [] if fused is None else fused(cfg)


def fusions_for(model: Any) -> list[Fusion]:
    """:func:`fusions` of a built-in model's config (none for other models)."""
    from nnx_shard.models._decoder import Decoder

    return fusions(model.cfg) if isinstance(model, Decoder) else []


def split(header: st.Header, found: list[Fusion], where: str) -> st.Header:
    """``header`` with each fused tensor replaced by its parts (views of its bytes).

    Raises:
      UsageError: a fused tensor whose shape is not ``[sum(rows), cols]``, named with
        the rows the configuration gives each part.
    """
    if not found:
        return header
    out: dict[str, st.TensorInfo] = {}
    for name, info in header.tensors.items():
        m = _LAYER.fullmatch(name)
        fusion = next((f for f in found if m is not None and m.group(2) == f.fused), None)
        if fusion is None or m is None:
            out[name] = info
            continue
        if len(info.shape) != 2 or info.shape[0] != sum(fusion.rows):
            raise UsageError(
                f"{where}: fused tensor {name!r} has shape {list(info.shape)}; the config "
                f"stacks {' + '.join(map(str, fusion.rows))} = {sum(fusion.rows)} rows "
                f"({', '.join(p.split('.')[-2] for p in fusion.parts)}). Fix: build the model "
                "from the checkpoint's own config.json (DecoderConfig.from_hf(path)).")
        cols = info.shape[1]
        row_bytes = st.DTYPES[info.dtype].itemsize * cols
        start = 0
        for part, rows in zip(fusion.parts, fusion.rows, strict=True):
            out[m.group(1) + part] = st.TensorInfo(info.path, info.dtype, (rows, cols),
                                                   info.offset + start * row_bytes,
                                                   rows * row_bytes)
            start += rows
    return dataclasses.replace(header, tensors=out)  # the same open files, if any


def fuse_names(tensors: Mapping[str, tuple[str, tuple[int, ...]]], found: list[Fusion]
               ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The file entries (name -> (dtype, shape)) of ``tensors`` named part by part: each
    complete set of parts becomes its fused tensor, where its first part stood (the
    byte layout :func:`split` reads back)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, (dtype, shape) in tensors.items():
        m = _LAYER.fullmatch(name)
        fusion = next((f for f in found if m is not None and m.group(2) in f.parts), None)
        if fusion is None or m is None:
            out[name] = (dtype, shape)
            continue
        fused = m.group(1) + fusion.fused
        if fused not in out:
            out[fused] = (dtype, (sum(fusion.rows), *shape[1:]))
    return out


def part_names(fused: str, found: list[Fusion]) -> list[str]:
    """The parts of a fused tensor's name (``[fused]`` for any other name)."""
    m = _LAYER.fullmatch(fused)
    fusion = next((f for f in found if m is not None and m.group(2) == f.fused), None)
    return [fused] if fusion is None or m is None else [m.group(1) + p for p in fusion.parts]


def regroup(groups: list[list[str]], found: list[Fusion]) -> list[list[str]]:
    """File groups of part names with every fusion's parts in one file (the group of
    the part that comes first), so that each fused tensor is written whole."""
    if not found:
        return groups
    owner: dict[str, int] = {}
    out: list[list[str]] = [[] for _ in groups]
    for i, group in enumerate(groups):
        for name in group:
            fused = next(iter(fuse_names({name: ("F32", (1,))}, found)))
            out[owner.setdefault(fused, i)].append(name)
    return [g for g in out if g]
