"""PEFT LoRA adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``)
read onto and written from a Llama-family model with :mod:`nnx_shard._low_rank` adapters.

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

from nnx_shard import _safetensors_io as st
from nnx_shard._annotate import path_str
from nnx_shard._errors import NnxShardError, UsageError, check_path, short
from nnx_shard._low_rank import Adapter, adaptable_kernels, adapters, kernel_axes, lora
from nnx_shard._quantized import QuantizedKernel
from nnx_shard.hf._files import as_path
from nnx_shard.hf._lora_folder import CONFIG, WEIGHTS, destination, replace_folder, write_adapter
from nnx_shard.hf._mapping import compile_rules, mapping_for

__all__ = ["load_lora", "save_lora"]

_PREFIX = "base_model.model."
# The factors PEFT saves, ``lora_A.weight``; a name between (``lora_A.other.weight``) is
# a named adapter's, which PEFT's from_pretrained does not read.
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.([\w-]+))?\.weight$")
# Our projection paths -> the Hugging Face module (the inverse of LLAMA_MAPPING's
# projection rows; ``blocks/attn/q`` is a stacked ``[layers, ...]`` kernel).
_OURS = re.compile(r"^blocks/(?:(\d+)/)?(attn|mlp)/(q|k|v|o|gate|up|down)$")
_HF_GROUP = {"attn": "self_attn", "mlp": "mlp"}


def _fail(folder: Path, what: str, fix: str) -> NnxShardError:
    return UsageError(f"load_lora: {folder}: {what}. Fix: {fix}")


# Fields of a LoRA config that change what PEFT computes beyond ``W + s * B @ A`` on the
# targeted projections: a folder that sets one is refused, never read as plain LoRA.
_UNSUPPORTED = ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern",
                "lora_bias", "alora_invocation_tokens", "layer_replication", "target_parameters",
                "trainable_token_indices", "use_qalora", "use_bdlora", "arrow_config",
                "kasa_config", "monteclora_config")

_REWRITES_BASE = ("pissa", "olora", "corda", "loftq")


def _read_json(folder: Path) -> dict[str, Any]:
    file = folder / CONFIG
    check_path(folder, "load_lora", expected="a directory", error=UsageError,
               fix="pass the folder PeftModel.save_pretrained wrote (it holds "
                   "adapter_config.json and adapter_model.safetensors)")
    try:
        cfg = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise _fail(folder, f"has no {CONFIG}", "pass a PEFT adapter folder") from e
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _fail(folder, f"{CONFIG} is not readable JSON ({short(str(e), 120)})",
                    "save the adapter again with PeftModel.save_pretrained") from e
    if not isinstance(cfg, dict):
        raise _fail(folder, f"{CONFIG} holds {type(cfg).__name__}, not an object",
                    "save the adapter again with PeftModel.save_pretrained")
    return cfg


def _read_config(folder: Path) -> tuple[int, float, dict[str, Any]]:
    cfg = _read_json(folder)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _fail(folder, f"peft_type is {short(cfg.get('peft_type'), 40)}, not 'LORA'",
                    "only LoRA adapters are read")
    # PEFT's LoraConfig default: a config without lora_alpha scales by 8 / r, not 1.
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise _fail(folder, f"r is {short(r, 40)}, not a positive int",
                    "an adapter config has e.g. \"r\": 8")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) \
            or not math.isfinite(alpha):
        raise _fail(folder, f"lora_alpha is {short(alpha, 40)}, not a finite number",
                    "an adapter config has e.g. \"lora_alpha\": 16")
    unsupported = [(k, cfg.get(k)) for k in _UNSUPPORTED if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.insert(0, ("bias", cfg.get("bias")))
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_REWRITES_BASE):
        # PEFT's from_pretrained runs these initializations again, which replace the base
        # weights by a residual: the adapter is not a delta on the plain base model.
        unsupported.insert(0, ("init_lora_weights", init))
    if unsupported:
        k, v = unsupported[0]
        raise _fail(folder, f"{k}={short(v, 60)} is not supported (plain LoRA only: one rank "
                    "and alpha on the targeted projections of the unchanged base model, no "
                    "DoRA, aLoRA, biases, replicated layers or fully trained modules)",
                    f"train the adapter without {k}, or merge it with PEFT first (PiSSA, "
                    "OLoRA: save it with path_initial_model_for_weight_conversion)")
    _check_targets(folder, cfg)
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale), cfg


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_targets(folder: Path, cfg: Mapping[str, Any]) -> None:
    """Refuses the selection fields (``target_modules``, ``exclude_modules``,
    ``layers_to_transform``, ``layers_pattern``) PEFT would refuse or that are malformed."""
    targets, exclude = cfg.get("target_modules"), cfg.get("exclude_modules")
    layers, pattern = cfg.get("layers_to_transform"), cfg.get("layers_pattern")
    if not targets or not (isinstance(targets, str) or _names(targets)):
        raise _fail(folder, f"target_modules is {short(targets, 60)}, not a module name list "
                    "or a regex", "save the adapter with PEFT (its config lists the adapted "
                    "modules, e.g. \"target_modules\": [\"q_proj\", \"v_proj\"])")
    if exclude is not None and not (isinstance(exclude, str) or _names(exclude)):
        raise _fail(folder, f"exclude_modules is {short(exclude, 60)}, not a module name list or "
                    "a regex", "e.g. \"exclude_modules\": [\"down_proj\"], or null")
    if isinstance(layers, bool) or not (layers is None or isinstance(layers, int) or (
            isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                             for i in layers))):
        raise _fail(folder, f"layers_to_transform is {short(layers, 60)}, not a layer index or "
                    "a list of them", "e.g. \"layers_to_transform\": [0, 1], or null")
    if pattern is not None and not (isinstance(pattern, str) or _names(pattern)):
        raise _fail(folder, f"layers_pattern is {short(pattern, 60)}, not a name or a list of "
                    "names", "e.g. \"layers_pattern\": \"layers\", or null")
    for field, regex in (("target_modules", targets), ("exclude_modules", exclude)):
        if isinstance(regex, str):
            try:
                re.compile(regex)
            except re.error as e:
                raise _fail(folder, f"{field} {short(regex, 60)} is not a regex ({e})",
                            f"write {field} as a Python regex or a list of names") from e
    if isinstance(targets, str) and (layers is not None or pattern is not None):
        field = "layers_to_transform" if layers is not None else "layers_pattern"
        raise _fail(folder, f"{field} is set with a regex target_modules (PEFT refuses this "
                    "config)", f"put the layers into the target_modules regex, or remove {field}")
    if pattern and layers is None:
        raise _fail(folder, "layers_pattern is set without layers_to_transform (PEFT refuses "
                    "this config)", "set layers_to_transform too, or remove layers_pattern")


def _targeted(cfg: Mapping[str, Any], key: str) -> bool:
    """Whether PEFT adapts the module ``key`` (``model.layers.0.self_attn.q_proj``):
    ``peft.tuners.tuners_utils.check_target_module_exists`` for the fields read here."""
    exclude = cfg.get("exclude_modules")
    if isinstance(exclude, str) and re.fullmatch(exclude, key):
        return False
    if isinstance(exclude, list) and any(key == e or key.endswith(f".{e}") for e in exclude):
        return False
    targets = cfg["target_modules"]
    if isinstance(targets, str) and targets.lower() == "all-linear":
        # Every nn.Linear but the output layer: the projections of the blocks.
        return key.startswith("model.layers.")
    if isinstance(targets, str):  # a regex over the whole name
        return re.fullmatch(targets, key) is not None
    if key in targets:  # named in full: no layer selection
        return True
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    layers, pattern = cfg.get("layers_to_transform"), cfg.get("layers_pattern")
    if layers is None or layers == []:
        return True
    if not pattern:
        hit = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        for p in [pattern] if isinstance(pattern, str) else pattern:
            hit = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
            if hit is not None:
                break
    if hit is None:
        return False
    index = int(hit.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


def _check_concrete(model: Any, who: str) -> None:
    """Refuses a model without values (nnx.eval_shape, ns.abstract_init) or with deleted
    (donated) arrays before it is changed: its adapters could never be computed."""
    if not isinstance(model, nnx.Module):
        return  # mapping_for names what is wrong with it
    for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if isinstance(value, jax.Array) and not value.is_deleted():
            continue
        what = ("a deleted array (donated to a step)" if isinstance(value, jax.Array) else
                f"abstract ({type(value).__name__}: a shape and dtype, no values)")
        raise UsageError(f"{who}: model parameter {path_str(key)!r} is {what}. Nothing was "
                         "changed. Fix: pass a model with values: load the base weights first "
                         "(ns.hf.load_pretrained, or ns.hf.load_safetensors into an abstract_init "
                         "model)")


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
              if isinstance(n, nnx.Param | QuantizedKernel) and not isinstance(n, nnx.LoRAParam)}
    return [m for m, (kpath, layer) in sorted(where.items())
            if kpath not in shapes or (layer is not None and layer >= shapes[kpath][0])]


def _put(host: np.ndarray, like: Any) -> jax.Array:
    sharding = getattr(like, "sharding", None)
    host = host.astype(like.dtype)
    if isinstance(sharding, NamedSharding):
        # Each device takes its own slice of the (small) host copy.
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
    return jax.numpy.asarray(host)


def _factors(folder: Path, header: Any) -> dict[str, dict[str, str]]:
    """HF module name -> {"A": key, "B": key} of the factors in the weights file."""
    factors: dict[str, dict[str, str]] = {}
    stray, named, flat = [], [], []
    for name, info in header.tensors.items():
        m = _KEY.match(name)
        if m is None:
            stray.append(name)
        elif m.group(3) is not None:
            named.append(name)
        elif len(info.shape) != 2:
            flat.append(f"{name} {list(info.shape)}")
        else:
            factors.setdefault(m.group(1), {})[m.group(2)] = name
    if stray:
        raise _fail(folder, f"{WEIGHTS} holds tensors that are not LoRA factors: "
                    f"{', '.join(stray[:4])}", "keep only lora_A / lora_B weights")
    if named:
        # PEFT reads only unnamed factors (lora_A.weight) into its adapter: it would load
        # none of these and run the base model unchanged.
        raise _fail(folder, f"{WEIGHTS} holds factors of a named adapter, e.g. {named[0]}, "
                    "which PEFT's from_pretrained does not load (it reads "
                    "...lora_A.weight / ...lora_B.weight)", "save the adapter with "
                    "PeftModel.save_pretrained, or rename the keys to drop the adapter name")
    if flat:
        raise _fail(folder, f"{WEIGHTS} holds factors that are not matrices: "
                    f"{', '.join(flat[:4])}", "lora_A is [r, in] and lora_B [out, r]; save "
                    "the adapter again with PeftModel.save_pretrained")
    half = [m for m, ab in factors.items() if len(ab) != 2]
    if half or not factors:
        raise _fail(folder, f"{WEIGHTS} " + (f"lacks the lora_A or lora_B of {half[0]}" if half
                    else "holds no tensors"), "save the adapter again")
    return factors


def _model_modules(model: Any) -> list[str]:
    """The names PEFT matches target_modules against: the model's projections under
    their Hugging Face names, its output layer and its embedding."""
    names = ["lm_head", "model.embed_tokens"]
    for p, n in nnx.iter_graph(model):
        if not isinstance(n, nnx.Param | QuantizedKernel) or isinstance(n, nnx.LoRAParam):
            continue
        hf = _hf_module(path_str(p))
        if hf is not None:
            proj, (layer,) = hf
            layers = [layer] if layer is not None else range(int(n.shape[0]))
            names += [f"model.layers.{i}.{proj}" for i in layers]
    return names


def _selected(folder: Path, cfg: Mapping[str, Any], model: Any,
              factors: Mapping[str, Any]) -> list[str]:
    """The modules of the file PEFT loads: those its config targets in this model."""
    targeted = {m for m in _model_modules(model) if _targeted(cfg, m)}
    fields = ", ".join(f"{k}={short(cfg.get(k), 60)}" for k in (
        "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")
        if cfg.get(k) is not None)
    if not targeted:
        raise _fail(folder, f"{fields} selects no module of this model (PEFT raises "
                    "'not found in the base model')", "name projections the model has, e.g. "
                    "\"target_modules\": [\"q_proj\", \"v_proj\"]")
    chosen = sorted(m for m in factors if m in targeted)
    if not chosen:
        raise _fail(folder, f"{fields} selects none of the modules {WEIGHTS} holds factors "
                    f"of ({', '.join(sorted(factors)[:4])}): PEFT would load nothing",
                    "fix the config's target_modules to the adapted modules")
    return chosen


def load_lora(path: str | os.PathLike[str], model: Any, *, rngs: int = 0) -> Any:
    """Reads the PEFT LoRA adapter folder ``path`` onto the Llama-family ``model``
    (concrete, any sharding, stacked blocks too) and returns ``model``.

    The model gets adapters on the projections PEFT adapts (through
    :func:`nnx_shard.lora` when it has none there yet; existing ones must have the
    file's rank), scaled ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``;
    ``lora_alpha`` is 8 when the config has none, as in PEFT), and each device
    takes its slice of the factors in the adapter's sharding. As PEFT's
    ``from_pretrained``, it loads only the factors of the modules the config
    selects: ``target_modules`` (a list of names or ``.``-suffixes, a regex over the
    whole name, or ``"all-linear"``), within ``layers_to_transform`` (and
    ``layers_pattern``), less ``exclude_modules``. Configs of LoRA variants (DoRA,
    aLoRA, ``layer_replication``, ...) are refused naming the field, as are factors
    of modules the model lacks and of a named (non-default) adapter.

    >>> import tempfile
    >>> from flax import nnx
    >>> from nnx_shard.models import Llama, get_config
    >>> model = Llama(get_config("llama-tiny"), rngs=nnx.Rngs(0))
    >>> _ = lora(model, 4, 8.0, targets=r"attn/(q|v)$")
    >>> folder = tempfile.mkdtemp()
    >>> save_lora(folder, model)
    >>> other = load_lora(folder, Llama(get_config("llama-tiny"), rngs=nnx.Rngs(0)))
    >>> sorted(adapters(other)) == sorted(adapters(model))
    True
    """
    folder = as_path(path, "load_lora")
    r, scale, cfg = _read_config(folder)
    _check_concrete(model, "load_lora")
    file = folder / WEIGHTS
    if not file.is_file():
        found = ", ".join(sorted(p.name for p in folder.iterdir())[:8])
        raise _fail(folder, f"has no {WEIGHTS} (found: {found or 'nothing'})",
                    "save the adapter with safe_serialization=True (PEFT's default)")
    header = st.read_header(str(file))
    factors = _factors(folder, header)
    where = _module_paths(model, sorted(factors), folder)
    where = {m: where[m] for m in _selected(folder, cfg, model, factors)}
    hosts = _host_factors(folder, header, model, factors, where, r)
    nodes = adapters(model)
    missing = sorted(set(hosts) - set(nodes))
    if missing:
        targets = "^(" + "|".join(re.escape(p) for p in missing) + ")$"
        lora(model, r, scale * r, targets=targets, rngs=rngs)
        nodes = adapters(model)
    for kpath, (a, b) in hosts.items():
        node = nodes[kpath]
        node.lora_a.set_value(_put(a, node.lora_a.get_value()))
        node.lora_b.set_value(_put(b, node.lora_b.get_value()))
        node.scale = scale
    return model


def _host_factors(folder: Path, header: Any, model: Any, factors: Mapping[str, Any],
                  where: Mapping[str, tuple[str, int | None]], r: int
                  ) -> dict[str, list[np.ndarray]]:
    """Our kernel path -> [A, B] on the host in our layout (stacked: every layer's slot,
    zero where the file has none); every problem is found before the model changes."""
    shapes = {path_str(p): n for p, n in nnx.iter_graph(model)
              if isinstance(n, nnx.Param | QuantizedKernel) and not isinstance(n, nnx.LoRAParam)}
    nodes = adapters(model)
    plain, _ = adaptable_kernels(model)
    hosts: dict[str, list[np.ndarray]] = {}
    errors = []
    for module, (kpath, layer) in sorted(where.items()):
        node = nodes.get(kpath)
        if node is not None and node.rank != r:
            errors.append(f"{kpath} has an adapter of rank {node.rank}, the file's is {r}")
            continue
        full = tuple(shapes[kpath].shape)
        if node is not None:
            n_in = node.n_in
        else:  # the split lora() makes of this kernel
            owner, _, var = plain[kpath]
            n_in = kernel_axes(kpath, var, owner)[1]
        shape = full[1:] if layer is not None else full
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
            stack = hosts.setdefault(kpath, [np.zeros((full[0], *ins, r), a.dtype),
                                             np.zeros((full[0], r, *outs), b.dtype)])
            stack[0][layer], stack[1][layer] = a, b
    if errors:
        raise _fail(folder, "its factors do not fit this model: " + "; ".join(errors[:6]),
                    "load it onto the model it was trained for (same sizes and rank)")
    return hosts


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

    The folder is replaced whole or not at all: the adapter is written into a
    fresh folder beside ``path``, flushed to disk, and swapped in with one atomic
    rename, so ``path`` holds the whole previous adapter or the whole new one at
    every instant (a killed or failed save, or two saves at once, never leave a
    mix), and a save that fails leaves nothing of itself. The folder keeps its
    mode; the other files in it stay (hard-linked into the new folder, or moved
    back after the swap). No file is ever written through a symbolic link; a
    ``path`` that is a link to a folder saves into that folder.

    >>> import tempfile
    >>> from flax import nnx
    >>> from nnx_shard.models import Llama, get_config
    >>> model = lora(Llama(get_config("llama-tiny"), rngs=nnx.Rngs(0)), 4, 8.0)
    >>> folder = tempfile.mkdtemp()
    >>> save_lora(folder, model)
    >>> sorted(os.listdir(folder))
    ['adapter_config.json', 'adapter_model.safetensors']
    """
    out = destination(path)
    nodes = adapters(model)
    mapping_for(model)  # a model with no Hugging Face names fails here, with its fix
    if not nodes:
        raise NnxShardError("save_lora: the model has no LoRA adapters. Fix: add them with "
                            "ns.lora(model, rank, alpha) or ns.hf.load_lora.")
    _check_concrete(model, "save_lora")
    kinds = {(n.rank, n.scale) for n in nodes.values()}
    if len(kinds) > 1:
        raise NnxShardError(f"save_lora: the adapters differ in (rank, scale): {sorted(kinds)}; "
                            "a PEFT config has one r and lora_alpha. Fix: save groups of "
                            "equal adapters from separate models, or merge_lora some first.")
    (r, scale), = kinds
    tensors, per_layer = _peft_tensors(nodes, r)
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
    raw = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    replace_folder(out, lambda stage: write_adapter(stage, tensors, raw))


def _peft_tensors(nodes: Mapping[str, Adapter], r: int
                  ) -> tuple[dict[str, np.ndarray], dict[int, set[str]]]:
    """PEFT's factors by key, and the projections adapted in each layer."""
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
    return tensors, per_layer


