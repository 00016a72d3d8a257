"""transformers' ``config.json`` of the Llama family, read and written: the model
types, activations and architectures it names, each value checked as transformers'
config classes check it (sizes, flags, finite numbers, sliding windows, the rotary
base and scaling), and the file written back from a
:class:`~nnx_shard.models.LlamaConfig` (its :meth:`~nnx_shard.models.LlamaConfig.from_hf`
and :meth:`~nnx_shard.models.LlamaConfig.to_hf`)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from nnx_shard._errors import UsageError, check_path, count, short
from nnx_shard._safetensors_io import described
from nnx_shard.models._families import family_of, model_types
from nnx_shard.models._rope import checked

__all__ = ["ACTIVATIONS", "ARCHITECTURES", "MODEL_TYPES", "hf_config", "hf_fields", "read_json"]

#: ``config.json`` model types :meth:`LlamaConfig.from_hf` reads: the registered
#: families (:mod:`nnx_shard.models._families`).
MODEL_TYPES = model_types()


#: MLP activations (transformers' ``hidden_act`` names) the model implements:
#: SwiGLU's SiLU, and Gemma's tanh approximation of GELU.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


#: The architectures :meth:`LlamaConfig.to_hf` names for each model type.
ARCHITECTURES = {kind: family_of(kind).architectures[0] for kind in MODEL_TYPES}


GEMMAS = ("gemma", "gemma2", "gemma3_text")


#: The :class:`LlamaConfig` options a family fixes (``Family.options``; off unless named).
_FAMILY_OPTIONS = ("qk_norm", "qk_norm_full", "post_norms", "qkv_bias", "embed_scale",
                   "norm_offset", "sandwich_norms", "attention_bias", "mlp_bias")


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


_FIX_VALUE = "Fix: use the checkpoint's own config.json"


def read_json(config: Any) -> tuple[dict[str, Any], str]:
    """The config as a dict, and how messages name it (the file, or ``config.json``)."""
    if isinstance(config, Mapping):
        return dict(config), "config.json"
    if isinstance(config, bytes) or not isinstance(config, str | os.PathLike) or not str(config):
        raise UsageError(f"LlamaConfig.from_hf: config must be a dict, a config.json path or "
                         f"the directory holding it, got {type(config).__name__} "
                         f"{short(config, 60)}. Fix: e.g. LlamaConfig.from_hf('checkpoints/llama')")
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    check_path(path, "LlamaConfig.from_hf", want="file", expected="a config.json file",
               fix="pass the checkpoint directory, its config.json, or the dict.")
    fix = "Fix: download the checkpoint's config.json again."

    def constant(name: str) -> Any:
        raise UsageError(f"{path}: holds {name}, which is not JSON and no size. {fix}")

    with open(path, "rb") as f:
        raw = f.read()
    try:
        hf = json.loads(raw.decode("utf-8"), parse_constant=constant)
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: is not UTF-8 ({e.reason} at byte {e.start}). {fix}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: is not JSON ({e.msg} at character {e.pos}). {fix}") from None
    except RecursionError:
        raise UsageError(f"{path}: is nested too deeply to be a config.json. {fix}") from None
    if not isinstance(hf, dict):
        raise UsageError(f"{path}: is {described(hf)}, not a JSON object of settings. {fix}")
    return hf, path


def _count(hf: Mapping[str, Any], key: str, default: int | None, where: str) -> int:
    """``hf[key]``, a whole count >= 1 (never a bool or a float: ``32.7`` or ``true``
    is no size); ``default`` when absent or null, where the key may be."""
    value = hf.get(key)
    if value is None and default is not None:
        return default
    return count(value, f"{where}: {key}", fix=f"{_FIX_VALUE}, whose {key} is a whole "
                 f"number, e.g. \"{key}\": 4")


def _real(value: Any, name: str, default: float | None, where: str, *,
          least: float = 0.0, strict: bool = True) -> float:
    """``value``, a finite number > ``least`` (>= with ``strict=False``); ``default``
    for null. Text, bools, NaN and infinities are refused."""
    if value is None and default is not None:
        return default
    try:
        ok = (isinstance(value, int | float) and not isinstance(value, bool)
              and math.isfinite(value) and (value > least if strict else value >= least))
    except OverflowError:  # an int past float's range
        ok = False
    if not ok:
        bound = f"> {least:g}" if strict else f">= {least:g}"
        raise UsageError(f"{where}: {name} must be a finite number {bound}, got "
                         f"{short(value, 60)} ({type(value).__name__}). {_FIX_VALUE}.")
    return float(value)


def _flag(hf: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    """``hf[key]``, a JSON true or false (``"false"`` is text, and text is truthy)."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UsageError(f"{where}: {key} must be true or false, got {short(value, 60)} "
                         f"({type(value).__name__}). Fix: write \"{key}\": true or "
                         f"\"{key}\": false.")
    return value


def _window(hf: Mapping[str, Any], kind: str, layers: int, where: str) -> int | None:
    """The sliding window of every layer (``None``: full attention), read as each
    family's transformers config reads it: Mistral's ``sliding_window`` applies to
    every layer (its model ignores ``layer_types``); Qwen2/Qwen3 slide where
    ``use_sliding_window`` is set, in the layers from ``max_window_layers`` on
    (or as ``layer_types`` says); Llama has no window. A window in some layers
    only is refused: the model applies one to all."""
    fix = "Fix: e.g. \"sliding_window\": 4096, or null for full attention."
    if kind in ("mistral", "phi3", "mixtral"):  # their models slide in every layer
        size = hf.get("sliding_window")
        return None if size is None else _count(hf, "sliding_window", None, where)
    layer_types = hf.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(
            t in ("full_attention", "sliding_attention") for t in layer_types)):
        raise UsageError(f"{where}: layer_types must be a list of \"full_attention\" / "
                         f"\"sliding_attention\" (or null), got {short(layer_types, 60)}. Fix: "
                         "e.g. \"layer_types\": [\"full_attention\", \"full_attention\"].")
    use = _flag(hf, "use_sliding_window", False, where)
    size = None
    if kind in ("qwen2", "qwen3", "qwen3_moe") and use and hf.get("sliding_window") is not None:
        size = _count(hf, "sliding_window", None, where)
    if layer_types is None:
        first = hf.get("max_window_layers", 28)
        first = first if isinstance(first, int) and not isinstance(first, bool) else 28
        layer_types = ["sliding_attention" if size is not None and i >= first
                       else "full_attention" for i in range(layers)]
    sliding = [t == "sliding_attention" for t in layer_types]
    if kind in ("llama", "gemma", "olmo2") and (use or any(sliding)):
        raise UsageError(f"{where}: sliding-window attention layers (use_sliding_window / "
                         "layer_types) are not part of a {kind} model. Fix: use the "
                         "checkpoint's own config.json, or model_type \"mistral\".")
    if size is None or not any(sliding):
        return None
    if not all(sliding):
        raise UsageError(f"{where}: sliding-window attention in some layers only "
                         f"({sum(sliding)} of {len(sliding)}, from use_sliding_window / "
                         "max_window_layers / layer_types) is not implemented: the model "
                         "applies one window to every layer. Fix: use a checkpoint with the "
                         "window in every layer or in none. " + fix)
    return size


def _gemma_window(hf: Mapping[str, Any], kind: str, layers: int, where: str
                  ) -> tuple[int | None, tuple[bool, ...] | None]:
    """Gemma 2 / 3's window and its layers, as their configs read them: ``layer_types``,
    else every other layer sliding from the first (Gemma 2) or all but every
    ``sliding_window_pattern``-th (Gemma 3, 6 by default)."""
    if hf.get("sliding_window") is None:
        size = 4096 if "sliding_window" not in hf else None
    else:
        size = _count(hf, "sliding_window", None, where)
    layer_types = hf.get("layer_types")
    if layer_types is None:
        every = 2 if kind == "gemma2" else hf.get("sliding_window_pattern", 6)
        every = count(every, f"{where}: sliding_window_pattern", fix="e.g. 6")
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                       for i in range(layers)]
    if not (isinstance(layer_types, list) and len(layer_types) == layers and all(
            t in ("full_attention", "sliding_attention") for t in layer_types)):
        raise UsageError(f"{where}: layer_types must list \"full_attention\" / "
                         f"\"sliding_attention\" for each of the {layers} layers, got "
                         f"{short(layer_types, 80)}. {_FIX_VALUE}.")
    flags = tuple(t == "sliding_attention" for t in layer_types)
    if size is None or not any(flags):
        return None, None
    return size, (None if all(flags) else flags)


def _local_theta(hf: Mapping[str, Any], where: str) -> float:
    """Gemma 3's rotary base of the sliding layers: ``rope_parameters``'
    ``sliding_attention`` entry, else ``rope_local_base_freq``, else 10000."""
    rope = hf.get("rope_parameters")
    local = rope.get("sliding_attention") if isinstance(rope, Mapping) else None
    if isinstance(local, Mapping):
        kind = local.get("rope_type", "default")
        if kind != "default":
            raise UsageError(f"{where}: rope_parameters['sliding_attention'] of type "
                             f"{short(kind, 40)} is not implemented (the sliding layers rotate "
                             "with the default frequencies). " + _FIX_VALUE + ".")
        if "rope_theta" in local:
            return _real(local["rope_theta"], "rope_parameters['sliding_attention']"
                         "['rope_theta']", None, where)
    return _real(hf.get("rope_local_base_freq"), "rope_local_base_freq", 10000.0, where)


def _softcap(hf: Mapping[str, Any], key: str, kind: str, gemma2: float, where: str
             ) -> float | None:
    """A soft-cap of Gemma 2 / 3 (``None``: none); Gemma 2's configs default to
    ``gemma2``, Gemma 3's to none; the other families have none."""
    if kind not in ("gemma2", "gemma3_text"):
        return None
    if key not in hf:
        return gemma2 if kind == "gemma2" else None
    return None if hf[key] is None else _real(hf[key], key, None, where)


def _rope(hf: Mapping[str, Any], where: str, max_length: int) -> tuple[float, Any]:
    """``(rope_theta, rope_scaling)`` read as transformers 5 reads them: ``rope_scaling``
    when set, else ``rope_parameters`` (its own spelling; a set for each layer type in
    files that nest them); ``rope_theta`` inside it, else beside it, else 10000."""
    for key in ("rope_scaling", "rope_parameters"):
        value = hf.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise UsageError(f"{where}: {key} must be an object (or null), got "
                             f"{short(value, 60)} ({type(value).__name__}). {_FIX_VALUE}, e.g. "
                             f"\"{key}\": {{\"rope_type\": \"default\"}}.")
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = dict(hf.get(key) or {})
    if isinstance(rope.get("full_attention"), Mapping):
        rope = dict(rope["full_attention"])
    name = f"{where}: {key}"
    if "rope_theta" in rope:
        theta = _real(rope["rope_theta"], f"{key}['rope_theta']", None, where)
    else:
        theta = _real(hf.get("rope_theta"), "rope_theta", 10000.0, where)
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise UsageError(f"{where}: partial_rotary_factor={short(partial, 60)} rotates only part "
                         "of each head, which the model does not implement. Fix: use a "
                         "checkpoint that rotates every feature (partial_rotary_factor 1.0).")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if hf.get("model_type") == "phi3" and kind in ("su", "yarn"):
        kind = rope["rope_type"] = "longrope"  # Phi3Config's legacy names
    if hf.get("model_type") == "phi3" and kind not in ("default", "longrope"):
        raise UsageError(f"{name} of type {short(kind, 40)}: Phi-3 rotates with the default "
                         f"or longrope frequencies only (as Phi3Config checks). {_FIX_VALUE}.")
    if kind in ("llama3", "yarn", "longrope"):
        # transformers fills a scaling's pretraining context from max_position_embeddings,
        # Phi-3 from its own top-level value
        if hf.get("model_type") == "phi3":
            rope["original_max_position_embeddings"] = hf.get(
                "original_max_position_embeddings", 4096)
        rope.setdefault("original_max_position_embeddings", max_length)
    return theta, checked(rope, where, key)


def hf_scaling(scaling: Any) -> dict[str, Any] | None:
    """``rope_scaling`` as config.json spells it (longrope's factors as lists)."""
    if not scaling:
        return None
    return {k: list(v) if isinstance(v, tuple) else v for k, v in scaling}


def hf_fields(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The :class:`~nnx_shard.models.LlamaConfig` fields of the transformers
    ``config.json`` ``hf`` (``where``: how messages name it), each value checked as
    transformers checks it (see :meth:`LlamaConfig.from_hf`)."""
    kind = hf.get("model_type")
    try:
        family = family_of(kind)
    except UsageError:
        raise UsageError(
            f"{where}: model_type {short(kind, 60)} is not a Llama-family model this reads "
            f"(supported: {', '.join(model_types())}). Fix: pass the config.json of a "
            "checkpoint of one of these types."
        ) from None
    kind = family.model_type
    gemma = kind in GEMMAS
    later = kind in ("gemma2", "gemma3_text")  # Gemma 2 and 3: four norms, windows
    act = (hf.get("hidden_activation") if later else None) or hf.get("hidden_act") or (
        "gelu_pytorch_tanh" if gemma else "silu")
    if gemma and act == "gelu":  # transformers' GemmaConfig reads the legacy name so
        act = "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise UsageError(f"{where}: hidden_act={short(act, 60)}; the model implements the "
                         f"gated MLP with {' or '.join(repr(a) for a in ACTIVATIONS)}. Fix: "
                         "use a checkpoint of a model with one of those.")
    if _flag(hf, "use_bidirectional_attention", False, where):
        raise UsageError(f"{where}: use_bidirectional_attention is set; the model is a "
                         "causal decoder. Fix: use a causal checkpoint.")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in hf]
    if missing:
        raise UsageError(f"{where}: missing keys {missing}; a {kind} config.json names "
                         "every size. Fix: use the checkpoint's own config.json.")
    heads = _count(hf, "num_attention_heads", None, where)
    embed = _count(hf, "hidden_size", None, where)
    max_length = _count(hf, "max_position_embeddings", 2048, where)
    theta, scaling = _rope(hf, where, max_length)
    layers = _count(hf, "num_hidden_layers", None, where)
    window, window_layers = (_gemma_window(hf, kind, layers, where) if later
                             else (_window(hf, kind, layers, where), None))
    fields: dict[str, Any] = dict(
        vocab=_count(hf, "vocab_size", None, where),
        embed=embed,
        heads=heads,
        # transformers' defaults for a null or absent value
        kv_heads=_count(hf, "num_key_value_heads", heads, where),
        head_dim=(embed // heads if kind == "phi3"  # Phi-3 has no head_dim key
                  else _count(hf, "head_dim", 256 if later else embed // heads, where)),
        mlp=_count(hf, "intermediate_size", None, where),
        layers=layers,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=_real(hf.get("rms_norm_eps"), "rms_norm_eps", 1e-6, where),
        # transformers' defaults: Gemma ties the embeddings, the others do not
        tie_embeddings=_flag(hf, "tie_word_embeddings", family.tied_default, where),
        # the options the family fixes (off unless it names them) and the flags it reads
        **({name: bool(family.options.get(name, False)) for name in _FAMILY_OPTIONS}
           | {name: _flag(hf, name, False, where) for name in family.hf_flags}),
        activation=act,
        sliding_window=window,
        window_layers=window_layers,
        rope_local_theta=_local_theta(hf, where) if kind == "gemma3_text" else None,
        query_scale=(_real(hf.get("query_pre_attn_scalar"), "query_pre_attn_scalar", 256.0,
                           where) if later else None),
        attn_softcap=_softcap(hf, "attn_logit_softcapping", kind, 50.0, where),
        final_softcap=_softcap(hf, "final_logit_softcapping", kind, 30.0, where),
        max_length=max_length,
        model_type=kind,
    )
    if family.moe:
        fields.update(_moe_fields(hf, family.moe, fields["mlp"], where))
    return fields


def _moe_fields(hf: Mapping[str, Any], moe: Mapping[str, Any], mlp: int, where: str
                ) -> dict[str, Any]:
    """The mixture-of-experts fields of a MoE family's ``config.json`` (``moe``: its
    keys and transformers' defaults; the expert count under either of transformers'
    names, ``num_local_experts`` or ``num_experts``)."""
    experts_key = next(k for k in moe if k in ("num_local_experts", "num_experts"))
    key = next((k for k in ("num_local_experts", "num_experts") if hf.get(k) is not None),
               experts_key)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                             for i in only):
        raise UsageError(f"{where}: mlp_only_layers must be a list of layer indices, got "
                         f"{short(only, 60)}. {_FIX_VALUE}.")
    return dict(
        experts=_count(hf, key, moe[experts_key], where),
        top_k=_count(hf, "num_experts_per_tok", moe["num_experts_per_tok"], where),
        moe_mlp=(_count(hf, "moe_intermediate_size", moe["moe_intermediate_size"], where)
                 if "moe_intermediate_size" in moe else None),
        # Mixtral always renormalises its top-k weights
        norm_topk_prob=(_flag(hf, "norm_topk_prob", moe["norm_topk_prob"], where)
                        if "norm_topk_prob" in moe else True),
        sparse_step=(_count(hf, "decoder_sparse_step", 1, where)
                     if "decoder_sparse_step" in moe else 1),
        mlp_only_layers=tuple(only),
        router_aux_loss_coef=_real(hf.get("router_aux_loss_coef"), "router_aux_loss_coef",
                                   moe["router_aux_loss_coef"], where, strict=False),
        output_router_logits=_flag(hf, "output_router_logits", False, where),
    )


def hf_config(cfg: Any) -> dict[str, Any]:
    """The transformers ``config.json`` of the :class:`~nnx_shard.models.LlamaConfig`
    ``cfg`` (see :meth:`LlamaConfig.to_hf`)."""
    dtype = {v: k for k, v in DTYPES.items()}.get(cfg.param_dtype, "float32")
    family = family_of(cfg.model_type)
    out: dict[str, Any] = {
        "architectures": list(family.architectures),
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.embed,
        "intermediate_size": cfg.mlp,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.activation,
        "max_position_embeddings": cfg.max_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": hf_scaling(cfg.rope_scaling),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "torch_dtype": dtype,
    }
    out.update({name: getattr(cfg, name) for name in family.hf_flags if name != "mlp_bias"})
    if cfg.model_type in ("gemma2", "gemma3_text"):
        del out["hidden_act"]
        local = cfg.local_layers()
        out.update(hidden_activation=cfg.activation, sliding_window=cfg.sliding_window,
                   layer_types=["sliding_attention" if f else "full_attention"
                                for f in local],
                   # transformers types it int (a float fails its config check)
                   query_pre_attn_scalar=(int(cfg.query_scale)
                                          if cfg.query_scale is not None
                                          and cfg.query_scale.is_integer()
                                          else cfg.query_scale),
                   attn_logit_softcapping=cfg.attn_softcap,
                   final_logit_softcapping=cfg.final_softcap)
    if cfg.model_type == "gemma3_text":
        global_rope = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                       **(hf_scaling(cfg.rope_scaling) or {})}
        out["rope_parameters"] = {
            "full_attention": global_rope,
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": cfg.rope_local_theta or cfg.rope_theta}}
        del out["rope_theta"], out["rope_scaling"]
    if "mlp_bias" in family.hf_flags:
        out["mlp_bias"] = cfg.mlp_bias
    elif cfg.model_type in ("mistral", "phi3", "mixtral"):
        out["sliding_window"] = cfg.sliding_window
    if cfg.model_type == "phi3" and cfg.rope_scaling:
        # Phi3Config puts its own (default 4096) over the scaling's
        out["original_max_position_embeddings"] = dict(cfg.rope_scaling).get(
            "original_max_position_embeddings", cfg.max_length)
    if family.moe:
        out.update(_moe_config(cfg, family.moe))
    if cfg.model_type == "phi3" and cfg.vocab <= 32000:
        # Phi3Config's default pad id (32000) must index the embedding.
        out["pad_token_id"] = None
    elif cfg.model_type in (*GEMMAS, "olmo2", "mixtral"):
        pass
    else:  # qwen2 / qwen3: a window in every layer, or none
        out["use_sliding_window"] = cfg.sliding_window is not None
        out["sliding_window"] = cfg.sliding_window
        out["max_window_layers"] = 0 if cfg.sliding_window is not None else cfg.layers
    return out


def _moe_config(cfg: Any, moe: Mapping[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts keys of a MoE family's ``config.json``."""
    values = {"num_local_experts": cfg.experts, "num_experts": cfg.experts,
              "num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.expert_mlp,
              "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.sparse_step,
              "mlp_only_layers": list(cfg.mlp_only_layers),
              "router_aux_loss_coef": cfg.router_aux_loss_coef,
              "output_router_logits": cfg.output_router_logits}
    return {key: values[key] for key in moe}
