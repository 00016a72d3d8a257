"""transformers' ``config.json`` of the Llama family, read and written: the model
types, activations and architectures it names, each value checked as transformers'
config classes check it (sizes, flags, finite numbers, sliding windows, the rotary
base and scaling), and the file written back from a
:class:`~nnx_shard.models.DecoderConfig` (its :meth:`~nnx_shard.models.DecoderConfig.from_hf`
and :meth:`~nnx_shard.models.DecoderConfig.to_hf`). One table, :data:`FIELDS`, maps every
config field to its ``config.json`` key, default and kind; a family's hooks read and
write only what is its own.

>>> FIELDS["kv_heads"].hf, FIELDS["experts"].hf
(('num_key_value_heads',), ('num_local_experts', 'num_experts'))
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from nnx_shard._errors import (
    LinkedOut,
    NnxShardError,
    NotAFile,
    UsageError,
    check_path,
    count,
    short,
)
from nnx_shard._safetensors_io import described
from nnx_shard._trusted_files import folder_roots, read_within, roots_words
from nnx_shard.models._families import family_of, model_types
from nnx_shard.models._rope import checked

__all__ = ["ACTIVATIONS", "FIELDS", "FIX_VALUE", "FieldRow", "count_key", "differences",
           "every_layer_window", "flag_key", "hf_config", "hf_fields", "hf_scaling", "no_window",
           "qwen_window", "read_json", "real_value"]

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


def hf_fields(hf: Mapping[str, Any], where: str, base: Any) -> tuple[Any, dict[str, Any]]:
    """``(config class, fields)`` of the transformers ``config.json`` ``hf`` (``where``:
    how messages name it): the class its family registers (``base`` for a family that
    registers none), and its fields, each value
    checked as transformers checks it (see :meth:`DecoderConfig.from_hf`). The table
    (:data:`FIELDS`) reads every field the class has, with the class's own defaults;
    the rotary base and scaling, the activation and the family's ``read`` hook (its
    window, ...) the rest."""
    kind = hf.get("model_type")
    try:
        family = family_of(kind)
    except UsageError:
        raise UsageError(
            f"{where}: model_type {short(kind, 60)} is not a Llama-family model this reads "
            f"(supported: {', '.join(model_types())}). Fix: pass the config.json of a "
            "checkpoint of one of these types."
        ) from None
    cls, kind = family.config or base, family.model_type
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
    own = {f.name for f in dataclasses.fields(cls)}
    fields: dict[str, Any] = {}
    for name, row in FIELDS.items():
        if name in own and row.reads is not None:
            default = cls.hf_defaults.get(name, row.default)
            fields[name] = _read(hf, row, default(fields) if callable(default) else default,
                                 where)
    fields["rope_theta"], fields["rope_scaling"] = _rope(hf, where, fields["max_length"])
    fields.update(activation=act, model_type=kind)
    fields.update(family.read(hf, where, fields))  # its window, local rotary base ...
    return cls, fields


def _read(hf: Mapping[str, Any], row: FieldRow, default: Any, where: str) -> Any:
    """The value of ``row``'s key in ``hf`` (the first of its keys that is set), read as
    ``row.reads`` says; ``default`` when absent (or null, but for a soft-cap, where null
    means none)."""
    key = next((k for k in row.hf if hf.get(k) is not None), row.hf[0])
    if row.reads == "count":
        return count_key(hf, key, default, where)
    if row.reads == "optional_count":
        return default if hf.get(key) is None else count_key(hf, key, None, where)
    if row.reads in ("real", "real0"):
        return real_value(hf.get(key), key, default, where, strict=row.reads == "real")
    if row.reads == "flag":
        return flag_key(hf, key, default, where)
    if row.reads == "cap":  # absent: the default; null: no cap
        value = hf.get(key, default)
        return None if value is None else real_value(value, key, None, where)
    value = default if hf.get(key) is None else hf[key]  # "layers": a list of layer indices
    if not isinstance(value, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise UsageError(f"{where}: {key} must be a list of layer indices, got "
                         f"{short(value, 60)}. {FIX_VALUE}.")
    return tuple(value)


def hf_config(cfg: Any) -> dict[str, Any]:
    """The transformers ``config.json`` of the :class:`~nnx_shard.models.DecoderConfig`
    ``cfg`` (see :meth:`DecoderConfig.to_hf`): the table's key of each of its fields
    (:data:`FIELDS`), then the keys only its family writes."""
    dtype = {v: k for k, v in DTYPES.items()}.get(cfg.param_dtype, "float32")
    family = family_of(cfg.model_type)
    out: dict[str, Any] = {"architectures": list(family.architectures)}
    own = {f.name for f in dataclasses.fields(cfg)}
    for name, row in FIELDS.items():
        if name in own and row.hf and row.writes:
            value = getattr(cfg, row.source or name)
            out[type(cfg).hf_keys.get(name, row.hf[0])] = (
                hf_scaling(value) if name == "rope_scaling"
                else list(value) if isinstance(value, tuple) else value)
    out.update(attention_dropout=0.0, torch_dtype=dtype)
    family.write(cfg, out)  # the family's own keys
    return out


#: A key with no default: every ``config.json`` names it.
REQUIRED = None


@dataclasses.dataclass(frozen=True)
class FieldRow:
    """One row of :data:`FIELDS`: a config field as ``config.json`` has it.

    Attributes:
      hf: its ``config.json`` keys (read: the first one set; written: the first, or
        the config class's ``hf_keys`` entry); ``()``: how the model runs, not in the file.
      kind: how :class:`~nnx_shard.models.DecoderConfig` checks the value (``count``,
        ``real``, ``flag``, ``optional_real``, ...).
      reads: how :meth:`DecoderConfig.from_hf` reads it from the table (``count``,
        ``optional_count``, ``real`` (> 0), ``real0`` (>= 0), ``flag``, ``cap``,
        ``layers``); ``None``: read by the shared rotary / activation reading or the
        family's ``read`` hook.
      default: transformers' value for an absent key (a callable: of the fields read so
        far; a config class's ``hf_defaults`` entry overrides it).
      absent: the value meaning "not there", for a config class without the field.
      writes: :meth:`DecoderConfig.to_hf` writes it (else the family's ``write`` hook).
      source: the attribute written, when not the field itself.
      compare: part of what a checkpoint computes (``differences``); not: layout,
        remat, kernel, dtypes, context length, the loss's settings.
      label: how ``differences`` names it, when not by its keys.
    """

    hf: tuple[str, ...]
    kind: str
    reads: str | None = None
    default: Any = REQUIRED
    absent: Any = None
    writes: bool = True
    source: str | None = None
    compare: bool = True
    label: str | None = None


def _row(hf: str, kind: str, reads: str | None = None, default: Any = REQUIRED, **more: Any
         ) -> FieldRow:
    return FieldRow(tuple(hf.split(" / ")) if hf else (), kind, reads, default, **more)


#: Every config field of every family of the shared decoder, in ``config.json``'s order:
#: the one map between the fields and ``config.json`` (read by ``from_hf``, written by
#: ``to_hf``, compared by ``differences``) and the kind each field is checked as.
FIELDS: dict[str, FieldRow] = {
    "model_type": _row("model_type", "model_type"),
    "vocab": _row("vocab_size", "count", "count"),
    "embed": _row("hidden_size", "count", "count"),
    "mlp": _row("intermediate_size", "count", "count"),
    "layers": _row("num_hidden_layers", "count", "count"),
    "heads": _row("num_attention_heads", "count", "count"),
    # transformers' defaults for an absent (or null) value
    "kv_heads": _row("num_key_value_heads", "count", "count", lambda f: f["heads"]),
    "head_dim": _row("head_dim", "count", "count", lambda f: f["embed"] // f["heads"]),
    "activation": _row("hidden_act", "activation"),
    "max_length": _row("max_position_embeddings", "count", "count", 2048, compare=False),
    "norm_eps": _row("rms_norm_eps", "real", "real", 1e-6),
    "rope_theta": _row("rope_theta", "real"),
    "rope_scaling": _row("rope_scaling", "rope_scaling"),
    "tie_embeddings": _row("tie_word_embeddings", "flag", "flag", False),
    "attention_bias": _row("attention_bias", "flag", "flag", False, absent=False),
    "mlp_bias": _row("mlp_bias", "flag", "flag", False, absent=False),
    "sliding_window": _row("sliding_window", "window"),
    "window_layers": _row("layer_types", "layer_flags", writes=False,
                          label="layer_types (which layers slide)"),
    "rope_local_theta": _row("rope_local_base_freq", "optional_real", writes=False),
    "query_scale": _row("query_pre_attn_scalar", "optional_real", "real", 256.0),
    "attn_softcap": _row("attn_logit_softcapping", "optional_real", "cap"),
    "final_softcap": _row("final_logit_softcapping", "optional_real", "cap"),
    "experts": _row("num_local_experts / num_experts", "experts", "count", absent=0),
    "top_k": _row("num_experts_per_tok", "count", "count", 2),
    "moe_mlp": _row("moe_intermediate_size", "optional_count", "optional_count", 768,
                    source="expert_mlp"),
    "norm_topk_prob": _row("norm_topk_prob", "flag", "flag", False),
    "sparse_step": _row("decoder_sparse_step", "count", "count", 1),
    "mlp_only_layers": _row("mlp_only_layers", "layers", "layers", ()),
    "router_aux_loss_coef": _row("router_aux_loss_coef", "finite", "real0", 0.001,
                                 compare=False),
    "output_router_logits": _row("output_router_logits", "flag", "flag", False,
                                 compare=False),
    "expert_matmul": _row("", "expert_matmul", compare=False),
    "scan_layers": _row("", "flag", compare=False),
    "remat": _row("", "remat", compare=False),
    "attention": _row("", "kernel", compare=False),
    "dtype": _row("", "dtype", compare=False),
    "param_dtype": _row("", "dtype", compare=False),
}


# What a config.json that does not parse as a model type here is compared on.
_RAW_KEYS = ("model_type", "hidden_act", "hidden_activation", "vocab_size", "hidden_size",
             "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "tie_word_embeddings", "sliding_window",
             "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")


def _value(cfg: Any, name: str) -> Any:
    """``cfg``'s field ``name``, or the table's value meaning "not there" for a config
    class without it."""
    if name in {f.name for f in dataclasses.fields(cfg)}:
        return getattr(cfg, name)
    return FIELDS[name].absent


def differences(config: str | os.PathLike[str] | Mapping[str, Any], cfg: Any) -> list[str]:
    """What the checkpoint ``config`` (a ``config.json``, its directory or the dict)
    describes differently from ``cfg`` (a :class:`~nnx_shard.models.DecoderConfig`), one ``"key: checkpoint X, model Y"`` line
    per field that changes what the model computes (the field table's compared ones:
    model type, activation, norm, sizes, biases, rotary, window and expert settings);
    ``[]`` when they agree. Layout, remat, kernel, dtypes and the context length are
    not compared.

    >>> from nnx_shard.models import DecoderConfig
    >>> tiny = DecoderConfig(max_length=64)
    >>> differences(tiny.to_hf(), tiny)
    []
    >>> differences({**tiny.to_hf(), "model_type": "gemma", "hidden_act": "gelu"}, tiny)[:2]
    ["model_type: checkpoint 'gemma', model 'llama'", "hidden_act: checkpoint 'gelu_pytorch_tanh', model 'silu'"]
    >>> differences({**tiny.to_hf(), "model_type": "gpt2", "hidden_act": "gelu"}, tiny)
    ["model_type: checkpoint 'gpt2', model 'llama'", "hidden_act: checkpoint 'gelu', model 'silu'"]
    """
    hf, _ = read_json(config)
    try:
        theirs = type(cfg).from_hf(hf)  # the family's class, whichever cfg's is
    except NnxShardError:
        theirs = None
    if theirs is not None:
        return [f"{row.label or ' / '.join(row.hf)}: checkpoint {_value(theirs, name)!r}, model "
                f"{_value(cfg, name)!r}" for name, row in FIELDS.items()
                if row.compare and _value(theirs, name) != _value(cfg, name)]
    # Not a model this reads (another family, or a value from_hf refuses): compare
    # what the file states against what the model's own config.json would.
    ours = cfg.to_hf()
    ours.setdefault("hidden_activation", ours.get("hidden_act"))
    ours.setdefault("hidden_act", ours["hidden_activation"])
    return [f"{key}: checkpoint {short(hf[key], 60)}, model {ours[key]!r}"
            for key in _RAW_KEYS if key in hf and key in ours and hf[key] != ours[key]]
