"""``save_lora``: the adapters of a Llama-family model (and its parameters trained in
full) written as a PEFT adapter folder, in PEFT's layout and config; the format and the
reading side are :mod:`nnx_shard.hf._peft`'s.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from nnx_shard._annotate import path_str
from nnx_shard._errors import NnxShardError, UsageError
from nnx_shard._low_rank import Adapter, adapters
from nnx_shard.hf._lora_folder import destination, replace_folder, write_adapter
from nnx_shard.hf._mapping import TRANSFORM_FNS, mapping_for
from nnx_shard.hf._peft import PREFIX, host_copy, scanned, trained_in_full
from nnx_shard.hf._peft_names import fused_of, hf_param, kernel_module, model_modules, module_name

__all__ = ["save_lora"]


class _Entry(NamedTuple):
    """One PEFT module of a saved adapter: its factors in PEFT's layout."""

    module: str
    embedding: bool
    a: np.ndarray  # [r, in]
    b: np.ndarray  # [out, r]
    rank: int
    scale: float


def _fuse(module: str, parts: list[tuple[int, _Entry]], rows: tuple[int, ...]) -> _Entry:
    """One adapter on a fused module (Phi-3's ``qkv_proj``) computing what the adapters
    of its parts compute: their ``lora_A`` stacked along the rank and their ``lora_B``
    block-diagonal (zero rows for a part without one), each block scaled by its part's
    scale over the module's; just the shared ``lora_A`` when every part has the same
    ``lora_A`` and scale (an adapter PEFT trained on the fused module, loaded)."""
    parts = sorted(parts, key=lambda p: p[0])
    first = parts[0][1]
    if len(parts) == len(rows) and all(e.scale == first.scale and np.array_equal(e.a, first.a)
                                       for _, e in parts):
        return _Entry(module, False, first.a, np.concatenate([e.b for _, e in parts]),
                      first.rank, first.scale)
    rank = sum(e.rank for _, e in parts)
    b = np.zeros((sum(rows), rank), np.result_type(*(e.b.dtype for _, e in parts)))
    at = 0
    for i, e in parts:
        start = sum(rows[:i])
        b[start:start + rows[i], at:at + e.rank] = e.b * (e.scale / first.scale)
        at += e.rank
    return _Entry(module, False, np.concatenate([e.a for _, e in parts]), b, rank, first.scale)


def _entries(model: Any, nodes: Mapping[str, Adapter]) -> list[_Entry]:
    """PEFT's modules of the adapters ``nodes``, in PEFT's layout."""
    fused = fused_of(model)
    out: list[_Entry] = []
    groups: dict[str, list[tuple[int, _Entry]]] = {}
    rows_of: dict[str, tuple[int, ...]] = {}
    for kpath, node in sorted(nodes.items()):
        hf = kernel_module(kpath)
        if hf is None:
            raise NnxShardError(f"save_lora: adapter {kpath!r} is not on a Llama projection, "
                                "lm_head or embedding (blocks/<i>/attn/q|k|v|o, blocks/<i>/mlp/"
                                "gate|up|down, unembed, token_embed). Fix: ns.merge_lora the "
                                "model, or adapt only those kernels.")
        sub, layer = hf
        r = node.rank
        a_all, b_all = host_copy(node.lora_a.get_value()), host_copy(node.lora_b.get_value())
        stacked = layer is None and kpath.startswith("blocks/")
        for i in range(a_all.shape[0]) if stacked else [layer]:
            a, b = (a_all[i], b_all[i]) if stacked else (a_all, b_all)
            entry = _Entry(module_name(sub, i), kpath == "token_embed",
                           np.ascontiguousarray(a.reshape(-1, r).T),
                           np.ascontiguousarray(b.reshape(r, -1).T), r, node.scale)
            if sub in fused:
                f, index, rows = fused[sub]
                groups.setdefault(module_name(f, i), []).append((index, entry))
                rows_of[module_name(f, i)] = rows
            else:
                out.append(entry)
    out += [_fuse(m, parts, rows_of[m]) for m, parts in groups.items()]
    return sorted(out, key=lambda e: e.module)


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _config(model: Any, entries: list[_Entry], saved: list[str], dropout: float,
            base_model_name_or_path: str | None) -> dict[str, Any]:
    """PEFT's config of ``entries``: the commonest rank and alpha, the others by module
    in rank_pattern / alpha_pattern, the modules as suffixes when they cover every
    module of their kind, else as a regex of their full names."""
    kinds = Counter((e.rank, e.scale * e.rank) for e in entries)
    r, alpha = kinds.most_common(1)[0][0] if kinds else (8, 8.0)
    # PEFT matches these keys as regexes on a ``.``-suffix of the name: escaped in full.
    ranks = {re.escape(e.module): e.rank for e in entries if e.rank != r}
    alphas = {re.escape(e.module): _number(e.scale * e.rank) for e in entries
              if not math.isclose(e.scale * e.rank, alpha, rel_tol=1e-12)}
    covered = {e.module for e in entries}
    every = model_modules(model)
    kinds_of = {m.rpartition(".")[2] for m in covered}
    targets: list[str] | str
    if all(m in covered for m in every if m.rpartition(".")[2] in kinds_of):
        targets = sorted(kinds_of)
    else:  # PEFT reads a string as a regex matched against whole module names
        targets = "|".join(re.escape(m) for m in sorted(covered))
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": _number(alpha),
        "target_modules": targets or None, "lora_dropout": dropout, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": saved or None, "init_lora_weights": True, "inference_mode": True,
        "rank_pattern": ranks, "alpha_pattern": alphas, "layers_to_transform": None,
        "base_model_name_or_path": base_model_name_or_path,
    }


def _check_values(model: Any) -> None:
    """save_lora's check of ``model``'s values: host (numpy) arrays are values and are
    written as they are; a model without values (abstract) or with deleted (donated)
    arrays is refused."""
    for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if isinstance(value, np.ndarray | np.generic) or (
                isinstance(value, jax.Array) and not value.is_deleted()):
            continue
        what = ("a deleted array (donated to a step)" if isinstance(value, jax.Array) else
                f"abstract ({type(value).__name__}: a shape and dtype, no values)"
                if isinstance(value, jax.ShapeDtypeStruct) else
                f"a {type(value).__name__}, not an array")
        raise UsageError(f"save_lora: model parameter {path_str(key)!r} is {what}. Nothing was "
                         "written. Fix: pass a model with values: load the base weights first "
                         "(ns.hf.load_pretrained, or ns.hf.load_safetensors into an abstract_init "
                         "model)")


def save_lora(path: str | os.PathLike[str], model: Any, *,
              base_model_name_or_path: str | None = None) -> None:
    """Writes the adapters of the Llama-family ``model`` as a PEFT adapter folder
    ``path`` that ``peft.PeftModel.from_pretrained(base, path)`` reads into the same
    model (and :func:`load_lora`): ``adapter_config.json`` and
    ``adapter_model.safetensors`` with the factors in PEFT's layout and dtype.

    Adapters of different ranks or scales go into ``rank_pattern`` / ``alpha_pattern``
    (the commonest pair is ``r`` / ``lora_alpha``); an embedding's factors are
    ``lora_embedding_A`` / ``_B``; the parameters trained in full
    (:func:`trained_in_full`) are saved under their Hugging Face names and their
    modules listed in ``modules_to_save``; ``lora_dropout`` is the adapters' rate. On a
    model whose checkpoint fuses projections (Phi-3's ``qkv_proj``, ``gate_up_proj``)
    the adapters of the parts are written as one adapter on the fused module that
    computes the same: their ``lora_A`` stacked along the rank, ``lora_B``
    block-diagonal (rank ``r_q + r_k + r_v``), or the shared ``lora_A`` of an adapter
    loaded from such a module.

    The folder is replaced whole or not at all: the adapter is written into a
    fresh folder beside ``path``, flushed to disk, and swapped in with one atomic
    rename, so ``path`` holds the whole previous adapter or the whole new one at
    every instant (a killed or failed save, or two saves at once, never leave a
    mix), and a save that fails leaves nothing of itself. The folder keeps its
    mode; the other files in it stay (hard-linked into the new folder, or moved
    back after the swap). No file is ever written through a symbolic link; a
    ``path`` that is a link to a folder saves into that folder.

    Args:
      path: the adapter folder to write (created, or replaced whole).
      model: a Llama-family model with adapters (or parameters trained in full),
        holding values.
      base_model_name_or_path: written into ``adapter_config.json`` for PEFT to find
        the base model (``None``: left null).

    Raises:
      NnxShardError: the model has no adapters, or is abstract.

    >>> import os, tempfile
    >>> from flax import nnx
    >>> from nnx_shard import lora
    >>> from nnx_shard.hf import save_lora
    >>> from nnx_shard.models import Decoder, get_config
    >>> model = lora(Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0)), 4, 8.0)
    >>> folder = tempfile.mkdtemp()
    >>> save_lora(folder, model)
    >>> sorted(os.listdir(folder))
    ['adapter_config.json', 'adapter_model.safetensors']
    """
    out = destination(path)
    nodes = adapters(model)
    mapping_for(model)  # a model with no Hugging Face names fails here, with its fix
    full = trained_in_full(model)
    if not nodes and not full:
        raise NnxShardError("save_lora: the model has no LoRA adapters. Fix: add them with "
                            "ns.lora(model, rank, alpha) or ns.hf.load_lora.")
    _check_values(model)
    entries = _entries(model, nodes)
    tensors: dict[str, np.ndarray] = {}
    for e in entries:
        a_name, b_name = ("lora_embedding_A", "lora_embedding_B") if e.embedding else (
            "lora_A.weight", "lora_B.weight")
        tensors[f"{PREFIX}{e.module}.{a_name}"] = e.a
        tensors[f"{PREFIX}{e.module}.{b_name}"] = e.b
    saved = set()
    for p, var in sorted(full.items()):
        names = hf_param(model, p, var)
        if not names:
            raise NnxShardError(f"save_lora: {p!r} is trained in full (an nnx.LoRAParam outside "
                                "an adapter) but has no Hugging Face name. Fix: make it an "
                                "nnx.Param again, or train only named parameters.")
        value = host_copy(var.get_value())
        stacked = p.startswith("blocks/") and scanned(model)
        for i, (name, transform) in enumerate(names):
            layer = value[i] if stacked else value
            hf = TRANSFORM_FNS[transform].to_hf(layer)  # type: ignore[arg-type]
            tensors[PREFIX + name] = np.ascontiguousarray(hf)
            saved.add(name.rpartition(".")[0])
    rates = Counter(n.dropout.rate if n.dropout is not None else 0.0
                    for k, n in nodes.items() if k != "token_embed")
    config = _config(model, entries, sorted(saved), float(rates.most_common(1)[0][0])
                     if rates else 0.0, base_model_name_or_path)
    if jax.process_index() != 0:
        return
    raw = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    replace_folder(out, lambda stage: write_adapter(stage, tensors, raw))
