"""PEFT LoRA adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``)
read onto and written from a Llama-family model with :mod:`nnx_shard.low_rank` adapters.

PEFT stores, per adapted ``nn.Linear`` ``M``, ``base_model.model.M.lora_A.weight``
``[r, in]`` and ``...lora_B.weight`` ``[out, r]`` (torch layout, ``W += s * B @ A``).
Our kernels are ``[*in, *out]`` (heads split: q ``[embed, heads, head_dim]``, o
``[heads, head_dim, embed]``), so ``A = lora_A.T`` reshaped to ``[*in, r]`` and
``B = lora_B.T`` reshaped to ``[r, *out]``; the projection of ``M`` is found with the
base weights' own table (:data:`nnx_shard.hf.LLAMA_MAPPING`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from nnx_shard import safetensors_io as st
from nnx_shard.annotate import path_str
from nnx_shard.errors import NnxShardError, UsageError, check_path, short
from nnx_shard.hf.layout import as_path
from nnx_shard.hf.mapping import compile_rules, mapping_for
from nnx_shard.low_rank import Adapted, adapters, lora

__all__ = ["load_lora", "save_lora"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# Our projection paths -> the Hugging Face module (the inverse of LLAMA_MAPPING's
# projection rows; ``blocks/attn/q`` is a stacked ``[layers, ...]`` kernel).
_OURS = re.compile(r"^blocks/(?:(\d+)/)?(attn|mlp)/(q|k|v|o|gate|up|down)$")
_HF_GROUP = {"attn": "self_attn", "mlp": "mlp"}


def _fail(folder: Path, what: str, fix: str) -> NnxShardError:
    return UsageError(f"load_lora: {folder}: {what}. Fix: {fix}")


def _read_config(folder: Path) -> tuple[int, float, dict[str, Any]]:
    file = folder / CONFIG
    check_path(folder, "load_lora", expected="a directory", error=UsageError,
               fix="pass the folder PeftModel.save_pretrained wrote (it holds "
                   "adapter_config.json and adapter_model.safetensors)")
    try:
        cfg = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise _fail(folder, f"has no {CONFIG}", "pass a PEFT adapter folder") from e
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _fail(folder, f"{CONFIG} is not readable JSON ({short(str(e), 120)})",
                    "save the adapter again with PeftModel.save_pretrained") from e
    if not isinstance(cfg, dict):
        raise _fail(folder, f"{CONFIG} holds {type(cfg).__name__}, not an object",
                    "save the adapter again with PeftModel.save_pretrained")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _fail(folder, f"peft_type is {short(cfg.get('peft_type'), 40)}, not 'LORA'",
                    "only LoRA adapters are read")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise _fail(folder, f"r is {short(r, 40)}, not a positive int",
                    "an adapter config has e.g. \"r\": 8")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) \
            or not math.isfinite(alpha):
        raise _fail(folder, f"lora_alpha is {short(alpha, 40)}, not a finite number",
                    "an adapter config has e.g. \"lora_alpha\": 16")
    unsupported = [(k, v) for k, v in (
        ("use_dora", cfg.get("use_dora")), ("fan_in_fan_out", cfg.get("fan_in_fan_out")),
        ("modules_to_save", cfg.get("modules_to_save")), ("rank_pattern", cfg.get("rank_pattern")),
        ("alpha_pattern", cfg.get("alpha_pattern")),
        ("bias", None if cfg.get("bias", "none") == "none" else cfg.get("bias")),
        ("lora_bias", cfg.get("lora_bias"))) if v]
    if unsupported:
        k, v = unsupported[0]
        raise _fail(folder, f"{k}={short(v, 60)} is not supported (plain LoRA only: one rank "
                    "and alpha, no DoRA, no biases, no fully trained modules)",
                    f"train the adapter without {k}, or merge it with PEFT first")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale), cfg


def _module_paths(model: Any, modules: list[str], folder: Path) -> dict[str, tuple[str, int | None]]:
    """HF module name -> (our kernel path, layer index into a stacked kernel or None)."""
    rules = compile_rules(mapping_for(model))
    stacked = bool(getattr(getattr(model, "cfg", None), "scan_layers", False))
    out: dict[str, tuple[str, int | None]] = {}
    bad = []
    for m in modules:
        path = None
        for rule in rules:
            hit = rule.regex.fullmatch(f"{m}.weight")
            if hit and rule.template is not None and rule.transform != "copy":
                path = hit.expand(rule.template)
                break
        ours = _OURS.match(path or "")
        if ours is None:
            bad.append(m)
            continue
        if stacked:
            out[m] = (f"blocks/{ours.group(2)}/{ours.group(3)}", int(ours.group(1)))
        else:
            out[m] = (path or "", None)
    if not bad:
        bad = _absent(model, out)
    if bad:
        raise _fail(folder, f"adapts modules that are not projections of this model: "
                    f"{', '.join(bad[:6])}", "adapt only q/k/v/o_proj and gate/up/down_proj "
                    "(embeddings and lm_head are not supported)")
    return out


def _absent(model: Any, where: Mapping[str, tuple[str, int | None]]) -> list[str]:
    """The modules of ``where`` whose kernel (or stacked layer) the model lacks."""
    shapes = {path_str(p): tuple(n.shape) for p, n in nnx.iter_graph(model)
              if isinstance(n, nnx.Param | Adapted) and not isinstance(n, nnx.LoRAParam)}
    return [m for m, (kpath, layer) in sorted(where.items())
            if kpath not in shapes or (layer is not None and layer >= shapes[kpath][0])]


def _put(host: np.ndarray, like: Any) -> jax.Array:
    sharding = getattr(like, "sharding", None)
    host = host.astype(like.dtype)
    if isinstance(sharding, NamedSharding):
        # Each device takes its own slice of the (small) host copy.
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
    return jax.numpy.asarray(host)


def load_lora(path: str | os.PathLike[str], model: Any, *, rngs: int = 0) -> Any:
    """Reads the PEFT LoRA adapter folder ``path`` onto the Llama-family ``model``
    (concrete, any sharding, stacked blocks too) and returns ``model``.

    The model gets adapters on the projections the file names (through
    :func:`nnx_shard.lora` when it has none there yet; existing ones must have the
    file's rank), scaled ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), and
    each device takes its slice of the factors in the adapter's sharding.

    >>> import tempfile
    >>> from flax import nnx
    >>> from nnx_shard.models import Llama, get_llama_config
    >>> model = Llama(get_llama_config("tiny"), rngs=nnx.Rngs(0))
    >>> _ = lora(model, 4, 8.0, targets=r"attn/(q|v)$")
    >>> folder = tempfile.mkdtemp()
    >>> save_lora(folder, model)
    >>> other = load_lora(folder, Llama(get_llama_config("tiny"), rngs=nnx.Rngs(0)))
    >>> sorted(adapters(other)) == sorted(adapters(model))
    True
    """
    folder = as_path(path, "load_lora")
    r, scale, _ = _read_config(folder)
    file = folder / WEIGHTS
    if not file.is_file():
        found = ", ".join(sorted(p.name for p in folder.iterdir())[:8])
        raise _fail(folder, f"has no {WEIGHTS} (found: {found or 'nothing'})",
                    "save the adapter with safe_serialization=True (PEFT's default)")
    header = st.read_header(str(file))
    factors: dict[str, dict[str, str]] = {}
    stray = []
    for name in header.tensors:
        m = _KEY.match(name)
        if m is None:
            stray.append(name)
        else:
            factors.setdefault(m.group(1), {})[m.group(2)] = name
    if stray:
        raise _fail(folder, f"{WEIGHTS} holds tensors that are not LoRA factors: "
                    f"{', '.join(stray[:4])}", "keep only lora_A / lora_B weights")
    half = [m for m, ab in factors.items() if len(ab) != 2]
    if half or not factors:
        raise _fail(folder, f"{WEIGHTS} " + (f"lacks the lora_A or lora_B of {half[0]}" if half
                    else "holds no tensors"), "save the adapter again")
    where = _module_paths(model, sorted(factors), folder)
    nodes = adapters(model)
    missing = sorted({p for p, _ in where.values()} - set(nodes))
    if missing:
        targets = "^(" + "|".join(re.escape(p) for p in missing) + ")$"
        lora(model, r, scale * r, targets=targets, rngs=rngs)
        nodes = adapters(model)
    hosts: dict[str, list[np.ndarray]] = {}
    errors = []
    for module, (kpath, layer) in sorted(where.items()):
        node = nodes[kpath]
        if node.rank != r:
            errors.append(f"{kpath} has an adapter of rank {node.rank}, the file's is {r}")
            continue
        n_in, shape = node.n_in, node.shape[1:] if layer is not None else node.shape
        ins, outs = shape[:n_in], shape[n_in:]
        a_hf = st.read_slice(header, factors[module]["A"], [slice(None)] * 2)
        b_hf = st.read_slice(header, factors[module]["B"], [slice(None)] * 2)
        want = ((r, math.prod(ins)), (math.prod(outs), r))
        if (a_hf.shape, b_hf.shape) != want:
            errors.append(f"{module}: lora_A {a_hf.shape} / lora_B {b_hf.shape}, this model "
                          f"needs {want[0]} / {want[1]}")
            continue
        a = np.ascontiguousarray(a_hf.T).reshape(*ins, r)
        b = np.ascontiguousarray(b_hf.T).reshape(r, *outs)
        if layer is None:
            hosts[kpath] = [a, b]
        else:
            stack = hosts.setdefault(kpath, [np.zeros(node.lora_a.shape, a.dtype),
                                             np.zeros(node.lora_b.shape, b.dtype)])
            stack[0][layer], stack[1][layer] = a, b
    if errors:
        raise _fail(folder, "its factors do not fit this model: " + "; ".join(errors[:6]),
                    "load it onto the model it was trained for (same sizes and rank)")
    for kpath, (a, b) in hosts.items():
        node = nodes[kpath]
        node.lora_a.set_value(_put(a, node.lora_a.get_value()))
        node.lora_b.set_value(_put(b, node.lora_b.get_value()))
        node.scale = scale
    return model


def _host(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def _hf_module(kpath: str) -> tuple[str, list[int | None]] | None:
    m = _OURS.match(kpath)
    if m is None:
        return None
    proj = f"{_HF_GROUP[m.group(2)]}.{m.group(3)}_proj"
    return proj, [int(m.group(1)) if m.group(1) is not None else None]


def save_lora(path: str | os.PathLike[str], model: Any, *,
              base_model_name_or_path: str | None = None) -> None:
    """Writes the adapters of the Llama-family ``model`` as a PEFT adapter folder
    ``path`` that ``peft.PeftModel.from_pretrained(base, path)`` reads (and
    :func:`load_lora`): ``adapter_config.json`` and ``adapter_model.safetensors``
    with the factors in PEFT's layout and dtype. All adapters must share one rank
    and scale (PEFT's ``r`` and ``lora_alpha``).

    >>> import tempfile
    >>> from flax import nnx
    >>> from nnx_shard.models import Llama, get_llama_config
    >>> model = lora(Llama(get_llama_config("tiny"), rngs=nnx.Rngs(0)), 4, 8.0)
    >>> folder = tempfile.mkdtemp()
    >>> save_lora(folder, model)
    >>> sorted(os.listdir(folder))
    ['adapter_config.json', 'adapter_model.safetensors']
    """
    out = as_path(path, "save_lora")
    nodes = adapters(model)
    mapping_for(model)  # a model with no Hugging Face names fails here, with its fix
    if not nodes:
        raise NnxShardError("save_lora: the model has no LoRA adapters. Fix: add them with "
                            "ns.lora(model, rank, alpha) or ns.load_lora.")
    kinds = {(n.rank, n.scale) for n in nodes.values()}
    if len(kinds) > 1:
        raise NnxShardError(f"save_lora: the adapters differ in (rank, scale): {sorted(kinds)}; "
                            "a PEFT config has one r and lora_alpha. Fix: save groups of "
                            "equal adapters from separate models, or merge_lora some first.")
    (r, scale), = kinds
    if out.exists() and not out.is_dir():
        raise UsageError(f"save_lora: {out} exists and is not a directory. "
                         "Fix: pass a folder path.")
    tensors: dict[str, np.ndarray] = {}
    per_layer: dict[int, set[str]] = {}
    for kpath, node in sorted(nodes.items()):
        hf = _hf_module(kpath)
        if hf is None:
            raise NnxShardError(f"save_lora: adapter {kpath!r} is not on a Llama projection "
                                "(blocks/<i>/attn/q|k|v|o or blocks/<i>/mlp/gate|up|down). "
                                "Fix: merge_lora it, or adapt only those projections.")
        proj, (layer,) = hf
        a_all, b_all = _host(node.lora_a.get_value()), _host(node.lora_b.get_value())
        layers = [layer] if layer is not None else list(range(a_all.shape[0]))
        for i in layers:
            a, b = (a_all, b_all) if layer is not None else (a_all[i], b_all[i])
            name = f"{_PREFIX}model.layers.{i}.{proj}"
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)
            per_layer.setdefault(i, set()).add(proj.rpartition(".")[2])
    shared = set.intersection(*per_layer.values())
    n_layers = int(getattr(getattr(model, "cfg", None), "layers", len(per_layer)))
    targets: list[str] | str
    if all(v == shared for v in per_layer.values()) and len(per_layer) == n_layers:
        targets = sorted(shared)
    else:  # PEFT reads a string as a regex matched against whole module names
        targets = "|".join(rf"model\.layers\.{i}\.[a-z_]+\.({'|'.join(sorted(v))})"
                           for i, v in sorted(per_layer.items()))
    alpha = scale * r
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
        "base_model_name_or_path": base_model_name_or_path,
    }
    if jax.process_index() != 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    _write(out / WEIGHTS, tensors)
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write(file: Path, tensors: Mapping[str, np.ndarray]) -> None:
    tmp = file.with_name(file.name + ".partial")
    names = sorted(tensors)
    st.create(str(tmp), {n: (st.dtype_name(tensors[n].dtype), tensors[n].shape) for n in names},
              {"format": "pt"})
    header = st.read_header(str(tmp))
    for n in names:
        st.write_slice(str(tmp), header, n, [slice(None)] * tensors[n].ndim, tensors[n])
    os.replace(tmp, file)

