"""transformers' ``config.json`` of the Llama family, read and written: the model
types, activations and architectures it names, each value checked as transformers'
config classes check it (sizes, flags, finite numbers, sliding windows, the rotary
base and scaling), and the file written back from a
:class:`~nnx_shard.models.DecoderConfig` (its :meth:`~nnx_shard.models.DecoderConfig.from_hf`
and :meth:`~nnx_shard.models.DecoderConfig.to_hf`)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from nnx_shard._errors import LinkedOut, NotAFile, UsageError, check_path, count, short
from nnx_shard._safetensors_io import described
from nnx_shard._trusted_files import folder_roots, read_within, roots_words
from nnx_shard.models._families import family_of, model_types
from nnx_shard.models._rope import checked

__all__ = ["ACTIVATIONS", "FIX_VALUE", "count_key", "every_layer_window", "flag_key", "hf_config",
           "hf_fields", "hf_scaling", "moe_config", "moe_fields", "no_window", "qwen_window",
           "read_json", "real_value"]

#: MLP activations (transformers' ``hidden_act`` names) the model implements:
#: SwiGLU's SiLU, and Gemma's tanh approximation of GELU.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


FIX_VALUE = "Fix: use the checkpoint's own config.json"


def read_json(config: Any, *, roots: Sequence[str] | None = None) -> tuple[dict[str, Any], str]:
    """The config as a dict, and how messages name it (the file, or ``config.json``).

    A file is read through one descriptor
    (:func:`~nnx_shard._trusted_files.read_within`), where a link may lead only into
    ``roots``: by default the checkpoint folder given (or, for a file named itself, the
    folder of the file that name leads to) and its hub cache repository
    (:func:`~nnx_shard._trusted_files.folder_roots`). A ``config.json`` linking out of
    its checkpoint, or swapped for such a link while it is read, is refused: what is
    read here is what an export of the model publishes.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> read_json(ns.hf.tiny_checkpoint(tempfile.mkdtemp(), tokenizer=False))[0]["model_type"]
    'llama'
    """
    if isinstance(config, Mapping):
        return dict(config), "config.json"
    if isinstance(config, bytes) or not isinstance(config, str | os.PathLike) or not str(config):
        raise UsageError(f"DecoderConfig.from_hf: config must be a dict, a config.json path or "
                         f"the directory holding it, got {type(config).__name__} "
                         f"{short(config, 60)}. Fix: e.g. DecoderConfig.from_hf('checkpoints/llama')")
    path = os.fspath(config)
    if os.path.isdir(path):
        roots = folder_roots(path) if roots is None else roots
        path = os.path.join(path, "config.json")
    elif roots is None:  # a file named itself: the link it is (if any) was named too
        roots = folder_roots(os.path.dirname(os.path.realpath(path)))

    def check() -> None:
        check_path(path, "DecoderConfig.from_hf", want="file", expected="a config.json file",
                   fix="pass the checkpoint directory, its config.json, or the dict.")

    check()
    fix = "Fix: download the checkpoint's config.json again."

    def constant(name: str) -> Any:
        raise UsageError(f"{path}: holds {name}, which is not JSON and no size. {fix}")

    try:
        raw = read_within(path, roots)
    except LinkedOut as e:
        raise UsageError(f"{path}: leads to {e.target}, outside the checkpoint folder "
                         f"{roots_words(roots)}; only the checkpoint's own files are read (an "
                         "export publishes what is read here). Fix: put a copy of the file in "
                         f"the folder instead of the link (cp --remove-destination {e.target} "
                         f"{path}).") from None
    except (NotAFile, FileNotFoundError) as e:
        check()  # replaced since the check above: the check's own words for what is there
        raise UsageError(f"{path}: changed while it was read ({e.strerror}). Fix: leave the "
                         "checkpoint's files as they are while it loads, and load it "
                         "again.") from None
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


def count_key(hf: Mapping[str, Any], key: str, default: int | None, where: str) -> int:
    """``hf[key]``, a whole count >= 1 (never a bool or a float: ``32.7`` or ``true``
    is no size); ``default`` when absent or null, where the key may be."""
    value = hf.get(key)
    if value is None and default is not None:
        return default
    # count() writes the "Fix: " itself
    return count(value, f"{where}: {key}", fix=f"{FIX_VALUE.removeprefix('Fix: ')}, whose "
                 f"{key} is a whole number, e.g. \"{key}\": 4")


def real_value(value: Any, name: str, default: float | None, where: str, *,
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
                         f"{short(value, 60)} ({type(value).__name__}). {FIX_VALUE}.")
    return float(value)


def flag_key(hf: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    """``hf[key]``, a JSON true or false (``"false"`` is text, and text is truthy)."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UsageError(f"{where}: {key} must be true or false, got {short(value, 60)} "
                         f"({type(value).__name__}). Fix: write \"{key}\": true or "
                         f"\"{key}\": false.")
    return value


def every_layer_window(hf: Mapping[str, Any], where: str) -> int | None:
    """``sliding_window`` in every layer, as Mistral's, Phi-3's and Mixtral's models
    apply it (``None``: full attention; they ignore ``layer_types``)."""
    size = hf.get("sliding_window")
    return None if size is None else count_key(hf, "sliding_window", None, where)


def _layer_types(hf: Mapping[str, Any], where: str) -> Any:
    layer_types = hf.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(
            t in ("full_attention", "sliding_attention") for t in layer_types)):
        raise UsageError(f"{where}: layer_types must be a list of \"full_attention\" / "
                         f"\"sliding_attention\" (or null), got {short(layer_types, 60)}. Fix: "
                         "e.g. \"layer_types\": [\"full_attention\", \"full_attention\"].")
    return layer_types


def no_window(hf: Mapping[str, Any], kind: str, where: str) -> None:
    """Refuses sliding-window layers (``use_sliding_window`` / ``layer_types``) in the
    ``config.json`` of a family whose model has none (Llama, Gemma, OLMo 2)."""
    sliding = [t == "sliding_attention" for t in _layer_types(hf, where) or ()]
    if flag_key(hf, "use_sliding_window", False, where) or any(sliding):
        raise UsageError(f"{where}: sliding-window attention layers (use_sliding_window / "
                         f"layer_types) are not part of a {kind} model. Fix: use the "
                         "checkpoint's own config.json, or model_type \"mistral\".")


def qwen_window(hf: Mapping[str, Any], layers: int, where: str) -> int | None:
    """The sliding window of Qwen2 / Qwen3's configs (``None``: full attention): with
    ``use_sliding_window``, in the layers from ``max_window_layers`` on (or as
    ``layer_types`` says). A window in some layers only is refused: the model applies
    one to all."""
    fix = "Fix: e.g. \"sliding_window\": 4096, or null for full attention."
    layer_types = _layer_types(hf, where)
    use = flag_key(hf, "use_sliding_window", False, where)
    size = None
    if use and hf.get("sliding_window") is not None:
        size = count_key(hf, "sliding_window", None, where)
    if layer_types is None:
        first = hf.get("max_window_layers", 28)
        first = first if isinstance(first, int) and not isinstance(first, bool) else 28
        layer_types = ["sliding_attention" if size is not None and i >= first
                       else "full_attention" for i in range(layers)]
    sliding = [t == "sliding_attention" for t in layer_types]
    if size is None or not any(sliding):
        return None
    if not all(sliding):
        raise UsageError(f"{where}: sliding-window attention in some layers only "
                         f"({sum(sliding)} of {len(sliding)}, from use_sliding_window / "
                         "max_window_layers / layer_types) is not implemented: the model "
                         "applies one window to every layer. Fix: use a checkpoint with the "
                         "window in every layer or in none. " + fix)
    return size


def _rope(hf: Mapping[str, Any], where: str, max_length: int) -> tuple[float, Any]:
    """``(rope_theta, rope_scaling)`` read as transformers 5 reads them: ``rope_scaling``
    when set, else ``rope_parameters`` (its own spelling; a set for each layer type in
    files that nest them); ``rope_theta`` inside it, else beside it, else 10000."""
    for key in ("rope_scaling", "rope_parameters"):
        value = hf.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise UsageError(f"{where}: {key} must be an object (or null), got "
                             f"{short(value, 60)} ({type(value).__name__}). {FIX_VALUE}, e.g. "
                             f"\"{key}\": {{\"rope_type\": \"default\"}}.")
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = dict(hf.get(key) or {})
    if isinstance(rope.get("full_attention"), Mapping):
        rope = dict(rope["full_attention"])
    if "rope_theta" in rope:
        theta = real_value(rope["rope_theta"], f"{key}['rope_theta']", None, where)
    else:
        theta = real_value(hf.get("rope_theta"), "rope_theta", 10000.0, where)
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise UsageError(f"{where}: partial_rotary_factor={short(partial, 60)} rotates only part "
                         "of each head, which the model does not implement. Fix: use a "
                         "checkpoint that rotates every feature (partial_rotary_factor 1.0).")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("llama3", "yarn", "longrope"):
        # transformers fills a scaling's pretraining context from max_position_embeddings
        rope.setdefault("original_max_position_embeddings", max_length)
    return theta, checked(rope, where, key)


def hf_scaling(scaling: Any) -> dict[str, Any] | None:
    """``rope_scaling`` as config.json spells it (longrope's factors as lists)."""
    if not scaling:
        return None
    return {k: list(v) if isinstance(v, tuple) else v for k, v in scaling}


def hf_fields(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The :class:`~nnx_shard.models.DecoderConfig` fields of the transformers
    ``config.json`` ``hf`` (``where``: how messages name it), each value checked as
    transformers checks it (see :meth:`DecoderConfig.from_hf`)."""
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
    hf = family.hf_in(dict(hf), where)  # the family's own spellings made the shared ones
    act = hf.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise UsageError(f"{where}: hidden_act={short(act, 60)}; the model implements the "
                         f"gated MLP with {' or '.join(repr(a) for a in ACTIVATIONS)}. Fix: "
                         "use a checkpoint of a model with one of those.")
    if flag_key(hf, "use_bidirectional_attention", False, where):
        raise UsageError(f"{where}: use_bidirectional_attention is set; the model is a "
                         "causal decoder. Fix: use a causal checkpoint.")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in hf]
    if missing:
        raise UsageError(f"{where}: missing keys {missing}; a {kind} config.json names "
                         "every size. Fix: use the checkpoint's own config.json.")
    heads = count_key(hf, "num_attention_heads", None, where)
    embed = count_key(hf, "hidden_size", None, where)
    max_length = count_key(hf, "max_position_embeddings", 2048, where)
    theta, scaling = _rope(hf, where, max_length)
    fields: dict[str, Any] = dict(
        vocab=count_key(hf, "vocab_size", None, where),
        embed=embed,
        heads=heads,
        # transformers' defaults for a null or absent value
        kv_heads=count_key(hf, "num_key_value_heads", heads, where),
        head_dim=count_key(hf, "head_dim", embed // heads, where),
        mlp=count_key(hf, "intermediate_size", None, where),
        layers=count_key(hf, "num_hidden_layers", None, where),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=real_value(hf.get("rms_norm_eps"), "rms_norm_eps", 1e-6, where),
        # transformers' defaults: Gemma ties the embeddings, the others do not
        tie_embeddings=flag_key(hf, "tie_word_embeddings", family.tied_default, where),
        # the flags its config.json has
        **{name: flag_key(hf, name, False, where) for name in family.hf_flags},
        activation=act,
        max_length=max_length,
        model_type=kind,
    )
    # the family's own fields: its window, soft-caps, experts ...
    fields.update(family.read(hf, where, fields))
    if family.moe:
        fields.update(moe_fields(hf, family.moe, fields["mlp"], where))
    return fields


def moe_fields(hf: Mapping[str, Any], moe: Mapping[str, Any], mlp: int, where: str
               ) -> dict[str, Any]:
    """The mixture-of-experts fields every MoE family has, from its ``config.json``
    (``moe``: its keys and transformers' defaults; the expert count under either of
    transformers' names, ``num_local_experts`` or ``num_experts``). A family's own
    expert keys (Qwen3-MoE's width, renormalisation, dense layers) are its ``read``'s."""
    experts_key = next(k for k in moe if k in ("num_local_experts", "num_experts"))
    key = next((k for k in ("num_local_experts", "num_experts") if hf.get(k) is not None),
               experts_key)
    return dict(
        experts=count_key(hf, key, moe[experts_key], where),
        top_k=count_key(hf, "num_experts_per_tok", moe["num_experts_per_tok"], where),
        router_aux_loss_coef=real_value(hf.get("router_aux_loss_coef"), "router_aux_loss_coef",
                                        moe["router_aux_loss_coef"], where, strict=False),
        output_router_logits=flag_key(hf, "output_router_logits", False, where),
    )


def hf_config(cfg: Any) -> dict[str, Any]:
    """The transformers ``config.json`` of the :class:`~nnx_shard.models.DecoderConfig`
    ``cfg`` (see :meth:`DecoderConfig.to_hf`)."""
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
    out.update({name: getattr(cfg, name) for name in family.hf_flags})
    if family.moe:
        out.update(moe_config(cfg, family.moe))
    family.write(cfg, out)  # the family's own keys
    return out


def moe_config(cfg: Any, moe: Mapping[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts keys of a MoE family's ``config.json``."""
    values = {"num_local_experts": cfg.experts, "num_experts": cfg.experts,
              "num_experts_per_tok": cfg.top_k,
              "router_aux_loss_coef": cfg.router_aux_loss_coef,
              "output_router_logits": cfg.output_router_logits}
    return {key: values[key] for key in moe}
