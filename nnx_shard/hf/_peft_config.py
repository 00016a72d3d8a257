"""A PEFT ``adapter_config.json`` read as PEFT 0.21 reads it: every field of its
``LoraConfig`` (and ``PeftConfig``) is either used exactly (rank, alpha, their per-module
patterns, rsLoRA, dropout, the module selection, ``modules_to_save``), ignored because
it leaves PEFT's forward pass unchanged on a Llama-family model, or refused with a
:class:`~nnx_shard._errors.UsageError` naming it and what to do instead.

>>> cfg = AdapterConfig.read_dict({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]})
>>> cfg.rank_scale("model.layers.0.self_attn.q_proj")   # lora_alpha defaults to 8, as in PEFT
(4, 2.0)
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nnx_shard._errors import UsageError, check_path, short

__all__ = ["CONFIG", "FIELDS", "MERGE_FIX", "AdapterConfig", "fail"]

CONFIG = "adapter_config.json"

#: What a user can do with any adapter this reader refuses: PEFT applies it to the base
#: weights itself, and the merged model is a plain checkpoint.
MERGE_FIX = ("merge it into the base with PEFT (PeftModel.from_pretrained(base, folder)"
             ".merge_and_unload().save_pretrained(out)) and load that checkpoint with "
             "ns.hf.load_pretrained(out)")

#: field -> how it is read: "read" (used exactly), "ignored" (no effect on PEFT's forward
#: pass here, the reason beside it) or "refused" (when set to anything but its default).
FIELDS: dict[str, str] = {
    # PeftConfig's: bookkeeping, never part of the computation.
    "peft_type": "read", "task_type": "ignored", "base_model_name_or_path": "ignored",
    "revision": "ignored", "inference_mode": "ignored", "auto_mapping": "ignored",
    "peft_version": "ignored",
    "r": "read", "lora_alpha": "read", "use_rslora": "read", "rank_pattern": "read",
    "alpha_pattern": "read", "target_modules": "read", "exclude_modules": "read",
    "layers_to_transform": "read", "layers_pattern": "read", "modules_to_save": "read",
    # Training only: kept on the adapters (off in eval mode and generation, as in PEFT).
    "lora_dropout": "read",
    # PEFT sets it back to False on every nn.Linear and nn.Embedding (it is for GPT-2's
    # Conv1D), with a warning: no effect on the projections of these models.
    "fan_in_fan_out": "ignored",
    # Biases of the base model: "none" changes nothing; the others only train them, and
    # a file holding trained biases is refused where its tensors are read.
    "bias": "read",
    # How fresh factors are drawn: a saved adapter's factors replace them. The variants
    # that rewrite the base weights at load (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA) are
    # refused in AdapterConfig._refusals.
    "init_lora_weights": "read", "loftq_config": "ignored", "eva_config": "ignored",
    "corda_config": "ignored", "lora_ga_config": "ignored",
    # Megatron-LM base layers only; a transformers model has none.
    "megatron_config": "ignored", "megatron_core": "ignored",
    # PEFT's QA-LoRA group size only matters with use_qalora (refused).
    "qalora_group_size": "ignored",
    # Device placement of DoRA's weight norm (DoRA itself is refused).
    "runtime_config": "ignored",
    # Ties the adapters of a tied embedding and output layer; a tied model with
    # embedding LoRA or modules_to_save is refused where they are read.
    "ensure_weight_tying": "ignored",
    # LoRA variants that compute something else than x @ W + s * (x @ A) @ B.
    "use_dora": "refused", "alora_invocation_tokens": "refused", "use_qalora": "refused",
    "lora_bias": "refused", "layer_replication": "refused", "target_parameters": "refused",
    "trainable_token_indices": "refused", "use_bdlora": "refused", "arrow_config": "refused",
    "kasa_config": "refused", "monteclora_config": "refused", "velora_config": "refused",
}

# What each refused field is, for the message.
_VARIANT = {
    "use_dora": "DoRA (weight-decomposed LoRA)", "alora_invocation_tokens":
    "aLoRA (activated LoRA: the adapter applies only after the invocation tokens)",
    "use_qalora": "QA-LoRA (pooled adapter inputs)", "lora_bias": "a trained bias on lora_B",
    "layer_replication": "replicated layers", "target_parameters":
    "LoRA on raw parameters (e.g. MoE experts)", "trainable_token_indices":
    "trainable token embeddings", "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing between adapters", "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA", "velora_config": "VeLoRA",
}
_REWRITES_BASE = ("pissa", "olora", "corda", "loftq", "lora_ga")


def fail(folder: Path, what: str, fix: str) -> UsageError:
    return UsageError(f"load_lora: {folder}: {what}. Fix: {fix}")


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) \
        and math.isfinite(value)


@dataclass
class AdapterConfig:
    """The fields of an adapter config that decide what PEFT computes."""

    r: int
    alpha: float
    raw: dict[str, Any]
    rslora: bool = False
    dropout: float = 0.0
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    modules_to_save: list[str] = field(default_factory=list)
    folder: Path = Path(".")

    @classmethod
    def read(cls, folder: Path) -> AdapterConfig:
        """The config of the adapter folder ``folder``; refusals name their field."""
        check_path(folder, "load_lora", expected="a directory", error=UsageError,
                   fix="pass the folder PeftModel.save_pretrained wrote (it holds "
                       "adapter_config.json and adapter_model.safetensors)")
        try:
            cfg = json.loads((folder / CONFIG).read_text())
        except FileNotFoundError as e:
            raise fail(folder, f"has no {CONFIG}", "pass a PEFT adapter folder") from e
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise fail(folder, f"{CONFIG} is not readable JSON ({short(str(e), 120)})",
                       "save the adapter again with PeftModel.save_pretrained") from e
        if not isinstance(cfg, dict):
            raise fail(folder, f"{CONFIG} holds {type(cfg).__name__}, not an object",
                       "save the adapter again with PeftModel.save_pretrained")
        return cls.read_dict(cfg, folder)

    @classmethod
    def read_dict(cls, cfg: dict[str, Any], folder: Path = Path(".")) -> AdapterConfig:
        """:meth:`read` of a config already parsed (fields unknown to PEFT 0.21 are
        dropped, as PEFT drops them with a warning)."""
        if cfg.get("peft_type", "LORA") != "LORA":
            raise fail(folder, f"peft_type is {short(cfg.get('peft_type'), 40)}, not 'LORA'",
                       "only LoRA adapters are read; " + MERGE_FIX)
        # PEFT's LoraConfig default: a config without lora_alpha scales by 8 / r.
        r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise fail(folder, f"r is {short(r, 40)}, not a positive int",
                       "an adapter config has e.g. \"r\": 8")
        if not _number(alpha):
            raise fail(folder, f"lora_alpha is {short(alpha, 40)}, not a finite number",
                       "an adapter config has e.g. \"lora_alpha\": 16")
        out = cls(r, float(alpha), cfg, folder=folder)
        out._refusals()
        out.rslora = bool(cfg.get("use_rslora"))
        dropout = cfg.get("lora_dropout") or 0.0
        if not _number(dropout) or not 0.0 <= dropout < 1.0:
            raise fail(folder, f"lora_dropout is {short(dropout, 40)}, not a number in [0, 1)",
                       "e.g. \"lora_dropout\": 0.05, or 0.0")
        out.dropout = float(dropout)
        out.rank_pattern = out._pattern("rank_pattern", int)
        out.alpha_pattern = out._pattern("alpha_pattern", float)
        saved = cfg.get("modules_to_save") or []
        if not _names(saved):
            raise fail(folder, f"modules_to_save is {short(saved, 60)}, not a list of module "
                       "names", "e.g. \"modules_to_save\": [\"lm_head\"], or null")
        out.modules_to_save = list(saved)
        out._check_targets()
        return out

    def _refusals(self) -> None:
        cfg, folder = self.raw, self.folder
        for key in (k for k, how in FIELDS.items() if how == "refused"):
            if cfg.get(key):
                raise fail(folder, f"{key}={short(cfg[key], 60)} is set: {_VARIANT[key]} is "
                           "not supported (plain LoRA only)", f"train the adapter without "
                           f"{key}, or {MERGE_FIX}")
        init = cfg.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(_REWRITES_BASE):
            # PEFT's from_pretrained runs these initializations again, which replace the
            # base weights by a residual: the adapter is not a delta on the plain base.
            raise fail(folder, f"init_lora_weights={init!r} rewrites the base weights when "
                       "PEFT loads the adapter, which load_lora does not", "convert it to "
                       "plain LoRA with PEFT (save_pretrained(..., path_initial_model_for_"
                       "weight_conversion=...)), or " + MERGE_FIX)
        bias = cfg.get("bias", "none")
        if bias not in ("none", "all", "lora_only", None):
            raise fail(folder, f"bias is {short(bias, 40)}, not 'none', 'all' or 'lora_only'",
                       "e.g. \"bias\": \"none\"")

    def _pattern(self, key: str, kind: type) -> dict[str, Any]:
        value = self.raw.get(key) or {}
        ok = isinstance(value, dict) and all(
            isinstance(k, str) and _number(v) and (kind is float or (
                isinstance(v, int) and v > 0)) for k, v in value.items())
        if not ok:
            what = "positive int ranks" if kind is int else "numbers"
            raise fail(self.folder, f"{key} is {short(value, 60)}, not a map of module name "
                       f"patterns to {what}", f"e.g. \"{key}\": {{\"q_proj\": 8}}, or {{}}")
        for k in value:
            try:
                re.compile(k)
            except re.error as e:
                raise fail(self.folder, f"{key} key {k!r} is not a regex ({e})",
                           f"write the {key} keys as Python regexes") from e
        return {k: kind(v) for k, v in value.items()}

    def rank_scale(self, module: str) -> tuple[int, float]:
        """``(r, scale)`` PEFT gives the adapter of ``module``: ``rank_pattern`` /
        ``alpha_pattern``'s first key matching a ``.``-suffix of the name (PEFT's
        ``get_pattern_key``), else ``r`` / ``lora_alpha``; scale ``alpha / r``
        (``alpha / sqrt(r)`` with rsLoRA)."""
        r = next((v for k, v in self.rank_pattern.items() if _suffix(k, module)), self.r)
        alpha = next((v for k, v in self.alpha_pattern.items() if _suffix(k, module)),
                     self.alpha)
        return r, alpha / math.sqrt(r) if self.rslora else alpha / r

    def saves(self, module: str) -> bool:
        """Whether ``module`` is one of ``modules_to_save`` (its name or a ``.``-suffix)."""
        return any(module == m or module.endswith(f".{m}") for m in self.modules_to_save)

    def _check_targets(self) -> None:
        """Refuses the selection fields PEFT would refuse or that are malformed."""
        cfg, folder = self.raw, self.folder
        targets, exclude = cfg.get("target_modules"), cfg.get("exclude_modules")
        layers, pattern = cfg.get("layers_to_transform"), cfg.get("layers_pattern")
        if not targets or not (isinstance(targets, str) or _names(targets)):
            raise fail(folder, f"target_modules is {short(targets, 60)}, not a module name "
                       "list or a regex", "save the adapter with PEFT (its config lists the "
                       "adapted modules, e.g. \"target_modules\": [\"q_proj\", \"v_proj\"])")
        if exclude is not None and not (isinstance(exclude, str) or _names(exclude)):
            raise fail(folder, f"exclude_modules is {short(exclude, 60)}, not a module name "
                       "list or a regex", "e.g. \"exclude_modules\": [\"down_proj\"], or null")
        if isinstance(layers, bool) or not (layers is None or isinstance(layers, int) or (
                isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                 for i in layers))):
            raise fail(folder, f"layers_to_transform is {short(layers, 60)}, not a layer index "
                       "or a list of them", "e.g. \"layers_to_transform\": [0, 1], or null")
        if pattern is not None and not (isinstance(pattern, str) or _names(pattern)):
            raise fail(folder, f"layers_pattern is {short(pattern, 60)}, not a name or a list "
                       "of names", "e.g. \"layers_pattern\": \"layers\", or null")
        for key, regex in (("target_modules", targets), ("exclude_modules", exclude)):
            if isinstance(regex, str):
                try:
                    re.compile(regex)
                except re.error as e:
                    raise fail(folder, f"{key} {short(regex, 60)} is not a regex ({e})",
                               f"write {key} as a Python regex or a list of names") from e
        if isinstance(targets, str) and (layers is not None or pattern is not None):
            key = "layers_to_transform" if layers is not None else "layers_pattern"
            raise fail(folder, f"{key} is set with a regex target_modules (PEFT refuses this "
                       "config)", f"put the layers into the target_modules regex, or remove "
                       f"{key}")
        if pattern and layers is None:
            raise fail(folder, "layers_pattern is set without layers_to_transform (PEFT "
                       "refuses this config)", "set layers_to_transform too, or remove "
                       "layers_pattern")

    def targeted(self, key: str) -> bool:
        """Whether PEFT adapts the module ``key`` (``model.layers.0.self_attn.q_proj``):
        ``peft.tuners.tuners_utils.check_target_module_exists`` for these fields."""
        cfg = self.raw
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
        return _in_layers(cfg, key)

    def fields(self) -> str:
        """The selection fields set, for messages."""
        return ", ".join(f"{k}={short(self.raw.get(k), 60)}" for k in (
            "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")
            if self.raw.get(k) is not None)


def _suffix(pattern: str, name: str) -> bool:
    return re.match(rf"(.*\.)?({pattern})$", name) is not None


def _in_layers(cfg: Mapping[str, Any], key: str) -> bool:
    layers, pattern = cfg.get("layers_to_transform"), cfg.get("layers_pattern")
    if layers is None or layers == []:
        return True
    hit = None
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
