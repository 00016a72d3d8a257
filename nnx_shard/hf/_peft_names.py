"""The names PEFT gives the modules of a Llama-family model and the kernels of
:class:`nnx_shard.models.Decoder` they stand for, both ways: a projection
(``model.layers.0.self_attn.q_proj`` <-> ``blocks/0/attn/q``), the output layer
(``lm_head`` <-> ``unembed``), the embedding (``model.embed_tokens`` <->
``token_embed``), and Phi-3's fused ``qkv_proj`` / ``gate_up_proj``, whose rows are
the q, k, v (gate, up) kernels.

>>> kernel_module("blocks/1/mlp/down"), kernel_module("unembed")
(('mlp.down_proj', 1), ('lm_head', None))
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import numpy as np
from flax import nnx

from nnx_shard._annotate import path_str
from nnx_shard._quantized import QuantizedKernel
from nnx_shard.hf._fused import fusions_for
from nnx_shard.hf._mapping import Leaf, compile_rules, hf_key, mapping_for

__all__ = ["Part", "full_param", "fused_of", "hf_param", "kernel_module", "kernels", "model_modules",
           "module_name", "module_parts"]

# Our adaptable kernel paths (``blocks/attn/q`` is a stacked ``[layers, ...]`` kernel).
_OURS = re.compile(r"^(?:blocks/(?:(\d+)/)?(attn|mlp)/(q|k|v|o|gate|up|down)|unembed|token_embed)$")
_HF_GROUP = {"attn": "self_attn", "mlp": "mlp"}
_TOP = {"unembed": "lm_head", "token_embed": "model.embed_tokens"}


class Part(NamedTuple):
    """One kernel a PEFT module stands for: its path, the layer of a stacked kernel
    (None when unstacked), and the rows of a fused module's ``lora_B`` it takes."""

    kpath: str
    layer: int | None
    rows: slice


def kernel_module(kpath: str) -> tuple[str, int | None] | None:
    """``(module under the layer, layer)`` of an adaptable kernel path (a stacked one
    has layer None), or ``(full module name, None)`` outside the blocks."""
    m = _OURS.match(kpath)
    if m is None:
        return None
    if m.group(2) is None:
        return _TOP[kpath], None
    proj = f"{_HF_GROUP[m.group(2)]}.{m.group(3)}_proj"
    return proj, int(m.group(1)) if m.group(1) is not None else None


def module_name(sub: str, layer: int | None) -> str:
    return sub if layer is None else f"model.layers.{layer}.{sub}"


def kernels(model: Any) -> dict[str, Any]:
    """The base weights of ``model`` (never adapter factors) by path."""
    return {path_str(p): n for p, n in nnx.iter_graph(model)
            if isinstance(n, nnx.Param | QuantizedKernel)
            and not (isinstance(n, nnx.LoRAParam) and path_str(p).rpartition("/")[2]
                     in ("lora_a", "lora_b"))}


def _fused(model: Any) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Fused module under the layer -> (its part modules, their rows)."""
    return {f.fused.removesuffix(".weight"): (tuple(p.removesuffix(".weight") for p in f.parts),
                                              f.rows) for f in fusions_for(model)}


def model_modules(model: Any) -> list[str]:
    """The names PEFT matches ``target_modules`` against: the model's projections
    (fused ones as the checkpoint has them), its output layer and its embedding."""
    fused = _fused(model)
    in_fused = {p: f for f, (parts, _) in fused.items() for p in parts}
    names = {"lm_head", "model.embed_tokens"}
    for kpath, n in kernels(model).items():
        hf = kernel_module(kpath)
        if hf is None or hf[0] in _TOP.values():
            continue
        sub, layer = hf
        layers = [layer] if layer is not None else range(int(n.shape[0]))
        names |= {module_name(in_fused.get(sub, sub), i) for i in layers}
    return sorted(names)


def module_parts(model: Any, modules: list[str]) -> tuple[dict[str, list[Part]], list[str]]:
    """PEFT module name -> the kernels it stands for; and the modules that are none of
    this model's (or whose kernel or stacked layer the model lacks)."""
    rules = compile_rules(mapping_for(model))
    stacked = bool(getattr(getattr(model, "cfg", None), "scan_layers", False))
    fused = _fused(model)
    have = {k: tuple(v.shape) for k, v in kernels(model).items()}
    out: dict[str, list[Part]] = {}
    bad = []
    for m in modules:
        hit = re.fullmatch(r"(model\.layers\.\d+\.)(.+)", m)
        if hit is not None and hit.group(2) in fused:
            subs, rows = fused[hit.group(2)]
            names = [hit.group(1) + s for s in subs]
        else:
            names, rows = [m], (None,)  # type: ignore[assignment]
        parts, start = [], 0
        for name, n in zip(names, rows, strict=True):
            path = next((h.expand(r.template) for r in rules if r.template is not None
                         for h in [r.regex.fullmatch(f"{name}.weight")] if h), "")
            ours = _OURS.match(path)
            rows_of = slice(None) if n is None else slice(start, start + n)
            start += n or 0
            if ours is None:
                break
            if stacked and ours.group(1) is not None:
                kpath, layer = f"blocks/{ours.group(2)}/{ours.group(3)}", int(ours.group(1))
            else:
                kpath, layer = path, None
            if kpath not in have or (layer is not None and layer >= have[kpath][0]):
                break
            parts.append(Part(kpath, layer, rows_of))
        if len(parts) != len(names):
            bad.append(m)
        else:
            out[m] = parts
    return out, bad


def full_param(model: Any, name: str) -> tuple[str, int | None, str] | None:
    """``(path, layer of a stacked one, transform)`` of the model parameter the Hugging
    Face tensor ``name`` (``lm_head.weight``) is, or None."""
    stacked = bool(getattr(getattr(model, "cfg", None), "scan_layers", False))
    for rule in compile_rules(mapping_for(model)):
        hit = rule.regex.fullmatch(name)
        if hit is None or rule.template is None:
            continue
        path = hit.expand(rule.template)
        layer = None
        if stacked:
            m = re.fullmatch(r"blocks/(\d+)/(.+)", path)
            if m is not None:
                path, layer = f"blocks/{m.group(2)}", int(m.group(1))
        return path, layer, rule.transform
    return None


def hf_param(model: Any, path: str, value: Any) -> list[tuple[str, str]]:
    """``(Hugging Face tensor name, transform)`` of the model parameter ``path`` (one
    per layer of a stacked one, in order)."""
    rules = compile_rules(mapping_for(model))
    stacked = bool(getattr(getattr(model, "cfg", None), "scan_layers", False)) \
        and path.startswith("blocks/")
    layers: list[int | None] = list(range(value.shape[0])) if stacked else [None]
    leaf = Leaf(path, tuple(value.shape), np.float32, None, None,  # type: ignore[arg-type]
                layers=value.shape[0] if stacked else None)
    out = []
    for layer in layers:
        found = hf_key(rules, leaf, layer)
        if found is None:
            return []
        out.append((found[0], found[1].transform))
    return out


def fused_of(model: Any) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """Part module under the layer (``self_attn.q_proj``) -> (its fused module, its
    place among the parts, every part's rows), for a model whose checkpoint fuses."""
    return {p: (f, i, rows) for f, (parts, rows) in _fused(model).items()
            for i, p in enumerate(parts)}
