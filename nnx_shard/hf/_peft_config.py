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
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from re import _parser as re_parser  # type: ignore[attr-defined]
from typing import Any

import regex

from nnx_shard._errors import LinkedOut, NotAFile, UsageError, check_path, short
from nnx_shard._trusted_files import folder_roots, read_within, roots_words

__all__ = ["CONFIG", "FIELDS", "MATCH_SECONDS", "MAX_PATTERN_ITEMS", "MERGE_FIX", "AdapterConfig",
           "Patterns", "fail", "refused_file"]

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
    # QA-LoRA (pooled adapter inputs) is PEFT's variant of GPTQ-quantized linear layers
    # only: on any other layer PEFT runs plain LoRA whatever these say, and the bases
    # read here are never GPTQ (a GPTQ adapter's narrower lora_A is refused by shape).
    "use_qalora": "ignored", "qalora_group_size": "ignored",
    # Device placement of DoRA's weight norm (DoRA itself is refused).
    "runtime_config": "ignored",
    # Ties the adapters of a tied embedding and output layer; a tied model with
    # embedding LoRA or modules_to_save is refused where they are read.
    "ensure_weight_tying": "ignored",
    # LoRA variants that compute something else than x @ W + s * (x @ A) @ B.
    "use_dora": "refused", "alora_invocation_tokens": "refused", "lora_bias": "refused",
    "layer_replication": "refused", "target_parameters": "refused", "trainable_token_indices":
    "refused", "use_bdlora": "refused", "arrow_config": "refused",
    "kasa_config": "refused", "monteclora_config": "refused", "velora_config": "refused",
}

# What each refused field is, for the message.
_VARIANT = {
    "use_dora": "DoRA (weight-decomposed LoRA)", "alora_invocation_tokens":
    "aLoRA (activated LoRA: the adapter applies only after the invocation tokens)",
    "lora_bias": "a trained bias on lora_B",
    "layer_replication": "replicated layers", "target_parameters":
    "LoRA on raw parameters (e.g. MoE experts)", "trainable_token_indices":
    "trainable token embeddings", "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing between adapters", "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA", "velora_config": "VeLoRA",
}
_REWRITES_BASE = ("pissa", "olora", "corda", "loftq", "lora_ga")


def fail(folder: Path, what: str, fix: str) -> UsageError:
    return UsageError(f"load_lora: {folder}: {what}. Fix: {fix}")


def refused_file(folder: Path, name: str, e: LinkedOut | NotAFile, roots: list[str]
                 ) -> UsageError:
    """The error of the adapter folder's file ``name`` that
    :func:`~nnx_shard._trusted_files.open_within` refused: a link out of ``roots`` (the
    folder, or its hub cache repository, as they were when the file was opened), or not
    a regular file when it was opened.

    >>> print(refused_file(Path("a"), "adapter_config.json", NotAFile("a/adapter_config.json",
    ...                                                                 "a FIFO"), ["/a"]))
    load_lora: a: adapter_config.json is a FIFO, not a file. Fix: put the file PeftModel.save_pretrained wrote there
    """
    if isinstance(e, LinkedOut):
        return fail(folder, f"{name} leads to {e.target}, outside the adapter folder "
                    f"{roots_words(roots)} "
                    "(only the adapter's own files are read)", "put a copy of the file in the "
                    f"folder instead of the link (cp --remove-destination {e.target} "
                    f"{folder / name})")
    return fail(folder, f"{name} is {e.kind}, not a file",
                "put the file PeftModel.save_pretrained wrote there")


#: Seconds one read config (each load_lora reads its own) may spend matching its patterns
#: against the model's module names, every match together: a name takes microseconds, and
#: a pattern that backtracks without end (a repeat inside a repeat, ``(x+)*``) is stopped
#: here instead of running for hours as it would under Python's re.
MATCH_SECONDS = 2.0
#: The most items a pattern may have once its counted repeats are written out (``a{1000}``
#: is 1000): the regex engine writes them out when it compiles, a few hundred bytes each.
#: save_lora's regex of every module name of a large model is some 30,000.
MAX_PATTERN_ITEMS = 200_000

# How PEFT 0.21 builds and calls each pattern field's regex: get_pattern_key for the keys
# of rank_pattern / alpha_pattern, match_target_against_key and check_target_module_exists
# for the others.
_USES: dict[str, tuple[Callable[[str], str], str]] = {
    "rank_pattern": (lambda p: rf"(.*\.)?({p})$", "match"),
    "alpha_pattern": (lambda p: rf"(.*\.)?({p})$", "match"),
    "target_modules": (lambda p: p, "fullmatch"),
    "exclude_modules": (lambda p: p, "fullmatch"),
    "layers_pattern": (lambda p: rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", "match"),
}
_REPEATS = (re_parser.MAX_REPEAT, re_parser.MIN_REPEAT, re_parser.POSSESSIVE_REPEAT)


def _children(op: Any, av: Any) -> list[Any]:
    """The sub-patterns of one node of re's parse tree."""
    if op in _REPEATS:
        return [av[2]]
    if op is re_parser.SUBPATTERN:
        return [av[3]]
    if op is re_parser.BRANCH:
        return list(av[1])
    if op in (re_parser.ASSERT, re_parser.ASSERT_NOT):
        return [av[1]]
    if op is re_parser.ATOMIC_GROUP:
        return [av]
    if op is re_parser.GROUPREF_EXISTS:
        return [sub for sub in av[1:] if sub is not None]
    return []


def _items(tree: Any) -> int:
    """Items of re's parse ``tree`` with every repeat written out ``max(min, 1)`` times,
    as the regex engine compiles them."""
    n = 0
    for op, av in tree:
        inner = sum(_items(sub) for sub in _children(op, av))
        n += max(av[0], 1) * inner if op in _REPEATS else inner or 1
    return n


def _read_apart(tree: Any) -> str | None:
    """What of re's parse ``tree`` the regex engine reads otherwise than re: a ``{`` that
    re takes as text (regex may take ``{e<=1}`` for a fuzzy match) and a ``[`` in a set
    (``[[:alpha:]]`` is a POSIX class to regex, three characters and a ``]`` to re)."""
    for op, av in tree:
        if op is re_parser.LITERAL and av == ord("{"):
            return "a '{' read as text"
        if op is re_parser.IN and (re_parser.LITERAL, ord("[")) in av:
            return "a '[' inside a [...] set"
        found = next(filter(None, map(_read_apart, _children(op, av))), None)
        if found:
            return found
    return None


def _literal(pattern: str) -> str | None:
    r"""The text ``pattern`` matches when it is plain text with no flags (``q_proj``,
    ``model\.layers\.0\.mlp``: what save_lora writes), else None."""
    try:
        tree = re_parser.parse(pattern)
    except re.error:
        return None  # a fragment PEFT's surrounding pattern completes
    if tree.state.flags & ~re.UNICODE or any(op is not re_parser.LITERAL for op, _ in tree):
        return None
    return "".join(chr(av) for _, av in tree)


class Patterns:
    r"""The regexes of one adapter config, each checked as PEFT builds it (Python's re
    compiles it, or PEFT would fail too) and matched with the ``regex`` engine, which
    matches what re matches and can be stopped: checking and matching every pattern of
    one config together get :data:`MATCH_SECONDS`. Plain names are compared as text, as
    their regex would match them.

    >>> pats = Patterns(Path("adapter"))
    >>> pats.add("rank_pattern", r"layers\.1\..*")
    >>> bool(pats.match("rank_pattern", r"layers\.1\..*", "model.layers.1.mlp.up_proj"))
    True
    >>> pats.add("rank_pattern", "(?i)Q_PROJ")
    Traceback (most recent call last):
    nnx_shard._errors.UsageError: load_lora: adapter: rank_pattern key '(?i)Q_PROJ' ...
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.left = MATCH_SECONDS
        self._compiled: dict[tuple[str, str], Any] = {}
        self._text: dict[tuple[str, str], str] = {}

    @staticmethod
    def _shown(field: str, pattern: str) -> str:
        what = f"{field} key" if field in ("rank_pattern", "alpha_pattern") else field
        return f"{what} {short(pattern, 80)}"

    def add(self, field: str, pattern: str) -> None:
        """Checks ``pattern`` of the config's ``field``; a pattern PEFT cannot compile, or
        that the regex engine would read otherwise, is a UsageError naming both."""
        if (field, pattern) in self._compiled or (field, pattern) in self._text:
            return
        start = time.monotonic()
        self._check(field, pattern)
        self._spend(start, field, pattern, None)

    def _check(self, field: str, pattern: str) -> None:
        build, _ = _USES[field]
        full, shown = build(pattern), self._shown(field, pattern)
        inside = f" inside {build('...')}" if build("...") != "..." else ""
        fix = f"write {field} as a Python regex that compiles{inside}, or as module names"
        try:
            with warnings.catch_warnings():  # re's warning of [[, refused below
                warnings.simplefilter("ignore", FutureWarning)
                re.compile(full)
                tree = re_parser.parse(full)
            items, apart = _items(tree), _read_apart(tree)
        except (re.error, OverflowError) as e:  # re's "repetition number is too large"
            if "global flags not at the start" in str(e):
                fix = ("scope the flag to the pattern, e.g. (?i:q_proj): PEFT puts it"
                       f"{inside}, where a flag for the whole pattern is an error")
            elif "redefinition of group name 'idx'" in str(e):
                fix = ("drop the group's name 'idx' (a (...) group works): PEFT's own pattern "
                       "names the layer index 'idx'")
            raise fail(self.folder, f"{shown} is not a regex as PEFT uses it"
                       f"{inside.replace(' inside', ', inside', 1)}: {e}", fix) from e
        except RecursionError as e:
            raise fail(self.folder, f"{shown} nests its groups too deep to compile", fix) from e
        if items > MAX_PATTERN_ITEMS:
            raise fail(self.folder, f"{shown} repeats too much: written out it has {items} "
                       f"items, over {MAX_PATTERN_ITEMS}", "use * or + in place of large "
                       "counts (x{1000}): module names are a few dozen characters")
        if apart is not None:
            raise fail(self.folder, f"{shown} holds {apart}, which no module name has and "
                       "which the bounded regex engine reads otherwise than Python's re",
                       "remove it from the pattern (it matches nothing in module names)")
        text = _literal(pattern) if field != "layers_pattern" else None
        if text is not None:
            self._text[(field, pattern)] = text  # its regex is compiled if ever needed
            return
        try:
            self._compiled[(field, pattern)] = regex.compile(full, regex.V0)
        except (regex.error, RecursionError, OverflowError, MemoryError) as e:
            raise fail(self.folder, f"{shown} cannot be compiled by the bounded regex engine "
                       f"({short(str(e), 80)})", fix) from e

    def match(self, field: str, pattern: str, name: str) -> Any:
        """PEFT's match of ``pattern`` for ``field`` against the module name ``name``
        (checked first if :meth:`add` has not): truthy when it matches (a match object of
        layers_pattern)."""
        if (field, pattern) not in self._compiled and (field, pattern) not in self._text:
            self.add(field, pattern)
        text = self._text.get((field, pattern))
        if text is not None and "\n" not in name:  # re's $ also matches before a last \n
            if field in ("rank_pattern", "alpha_pattern"):
                return name == text or name.endswith(f".{text}")
            return name == text
        start = time.monotonic()
        compiled = self._compiled.get((field, pattern))
        if compiled is None:  # a plain name's, for a name with a newline
            compiled = self._compiled[(field, pattern)] = regex.compile(
                _USES[field][0](pattern), regex.V0)
        hit = None
        try:
            if self.left > 0:
                hit = getattr(compiled, _USES[field][1])(name, timeout=self.left)
        except TimeoutError:
            self.left = 0.0
        self._spend(start, field, pattern, name)
        return hit

    def _spend(self, start: float, field: str, pattern: str, name: str | None) -> None:
        self.left -= time.monotonic() - start
        if self.left > 0:
            return
        at = f"{self._shown(field, pattern)}" + (f" on {short(name, 80)}" if name else "")
        raise fail(self.folder, f"checking and matching the config's patterns against the "
                   f"module names ran past the {MATCH_SECONDS:g} s one load gives them, at "
                   f"{at}: a pattern that backtracks without end (a repeat inside a repeat, "
                   "such as (x+)* or (a|ab)*), or a great many patterns", f"write {field} as "
                   "module names, or as a regex without nested repeats (e.g. \"q_proj\", or "
                   "\".*\\\\.q_proj\")")


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
    patterns: Patterns = field(default_factory=lambda: Patterns(Path(".")), repr=False,
                               compare=False)

    @classmethod
    def read(cls, folder: Path) -> AdapterConfig:
        """The config of the adapter folder ``folder``; refusals name their field."""
        check_path(folder, "load_lora", expected="a directory", error=UsageError,
                   fix="pass the folder PeftModel.save_pretrained wrote (it holds "
                       "adapter_config.json and adapter_model.safetensors)")
        # One descriptor of a file inside the folder: a config swapped for a link out while
        # it is read is refused, not read.
        roots = folder_roots(folder)
        try:
            cfg = json.loads(read_within(folder / CONFIG, roots).decode("utf-8"))
        except (LinkedOut, NotAFile) as e:
            raise refused_file(folder, CONFIG, e, roots) from None
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
        out = cls(r, float(alpha), cfg, folder=folder, patterns=Patterns(folder))
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
            self.patterns.add(key, k)
        return {k: kind(v) for k, v in value.items()}

    def rank_scale(self, module: str) -> tuple[int, float]:
        """``(r, scale)`` PEFT gives the adapter of ``module``: ``rank_pattern`` /
        ``alpha_pattern``'s first key matching a ``.``-suffix of the name (PEFT's
        ``get_pattern_key``), else ``r`` / ``lora_alpha``; scale ``alpha / r``
        (``alpha / sqrt(r)`` with rsLoRA)."""
        match = self.patterns.match
        r = next((v for k, v in self.rank_pattern.items()
                  if match("rank_pattern", k, module)), self.r)
        alpha = next((v for k, v in self.alpha_pattern.items()
                      if match("alpha_pattern", k, module)), self.alpha)
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
        if isinstance(targets, str) and targets.lower() != "all-linear":
            self.patterns.add("target_modules", targets)
        if isinstance(exclude, str) and exclude:
            self.patterns.add("exclude_modules", exclude)
        if isinstance(targets, str) and (layers is not None or pattern is not None):
            key = "layers_to_transform" if layers is not None else "layers_pattern"
            raise fail(folder, f"{key} is set with a regex target_modules (PEFT refuses this "
                       "config)", f"put the layers into the target_modules regex, or remove "
                       f"{key}")
        if pattern and layers is None:
            raise fail(folder, "layers_pattern is set without layers_to_transform (PEFT "
                       "refuses this config)", "set layers_to_transform too, or remove "
                       "layers_pattern")
        if pattern and layers != []:  # PEFT reads it only to pick layers
            for p in [pattern] if isinstance(pattern, str) else pattern:
                self.patterns.add("layers_pattern", p)

    def targeted(self, key: str) -> bool:
        """Whether PEFT adapts the module ``key`` (``model.layers.0.self_attn.q_proj``):
        ``peft.tuners.tuners_utils.check_target_module_exists`` for these fields."""
        cfg = self.raw
        exclude = cfg.get("exclude_modules")
        if isinstance(exclude, str) and exclude and self.patterns.match(
                "exclude_modules", exclude, key):
            return False
        if isinstance(exclude, list) and any(key == e or key.endswith(f".{e}") for e in exclude):
            return False
        targets = cfg["target_modules"]
        if isinstance(targets, str) and targets.lower() == "all-linear":
            # Every nn.Linear but the output layer: the projections of the blocks.
            return key.startswith("model.layers.")
        if isinstance(targets, str):  # a regex over the whole name
            return bool(self.patterns.match("target_modules", targets, key))
        if key in targets:  # named in full: no layer selection
            return True
        if not any(key.endswith(f".{t}") for t in targets):
            return False
        return self._in_layers(key)

    def _in_layers(self, key: str) -> bool:
        layers, pattern = self.raw.get("layers_to_transform"), self.raw.get("layers_pattern")
        if layers is None or layers == []:
            return True
        hit = None
        if not pattern:
            hit = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            for p in [pattern] if isinstance(pattern, str) else pattern:
                hit = self.patterns.match("layers_pattern", p, key)
                if hit is not None:
                    break
        # A pattern with a top-level | can match without the index group: no layer, as PEFT.
        index = None if hit is None else hit.groupdict().get("idx")
        if index is None:
            return False
        return int(index) == layers if isinstance(layers, int) else int(index) in layers

    def fields(self) -> str:
        """The selection fields set, for messages."""
        return ", ".join(f"{k}={short(self.raw.get(k), 60)}" for k in (
            "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")
            if self.raw.get(k) is not None)
