"""Hostile cases of the regexes in a PEFT ``adapter_config.json`` (``ns.hf.load_lora``):
patterns that backtrack without end under Python's re (``rank_pattern`` / ``alpha_pattern``
keys, a ``target_modules`` or ``exclude_modules`` string, ``layers_pattern``), a great many
patterns, patterns PEFT cannot compile where it puts them (a global flag inside
``(.*\\.)?(...)$``, an unbalanced or ``idx``-named group in ``layers_pattern``), counted
repeats that the regex engine would write out into gigabytes, syntax that engine reads
otherwise than re (``{e<=1}``, ``[[:alpha:]]``); and the adapter files around them: one
factor under both its plain key and the adapter name ``default`` with different values,
another adapter name, and a QA-LoRA adapter of a GPTQ base (``use_qalora``, pooled
``lora_A``).

Folders are copies of ``tests/fixtures/peft_cases/full`` (factors of all fourteen
projections of the two-layer fixture) with the config or the tensors changed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
FULL = os.path.join(FIXTURES, "peft_cases", "full")
# Backtracks without end under re and under the regex engine (no literal it can look for).
SLOW = r"(.|\w)*(?!.)x?[!-]"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def build(hs: Any) -> None:
    F = hs.F

    def folder(name: str, change: dict[str, Any] | None = None,
               tensors: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> str:
        return hs.peft_copy(FULL, F.path(f"r6lora_{name}"), change, tensors)

    def load(path: str) -> Any:
        import nnx_shard

        return nnx_shard.hf.load_lora(path, hs._tiny_llama())

    def case(name: str, names: str | tuple[str, ...], change: dict[str, Any] | None = None,
             tensors: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        hs.api(f"r6lora/{name}", names, lambda: load(folder(name, change, tensors)))

    # patterns that backtrack without end: stopped by the one time bound of a load ---------------
    case("rank_pattern_backtracks", "rank_pattern", {"rank_pattern": {SLOW: 4}})
    case("alpha_pattern_backtracks", "alpha_pattern", {"alpha_pattern": {SLOW: 4}})
    case("target_modules_backtracks", "target_modules", {"target_modules": SLOW})
    case("exclude_modules_backtracks", "exclude_modules", {"exclude_modules": SLOW})
    case("layers_pattern_backtracks", "layers_pattern",
         {"layers_to_transform": [0], "layers_pattern": SLOW})
    case("layers_pattern_list_backtracks", "layers_pattern",
         {"layers_to_transform": [1], "layers_pattern": ["h", SLOW]})
    case("rank_pattern_100k_keys", "rank_pattern",
         {"rank_pattern": {f"blocks?{i}+x": 2 for i in range(100_000)}})
    # patterns PEFT cannot compile where it puts them ----------------------------------------------
    case("rank_pattern_global_flag", ("rank_pattern", "(?i)Q_PROJ"),
         {"rank_pattern": {"(?i)Q_PROJ": 4}})
    case("alpha_pattern_global_flag", ("alpha_pattern", "(?s)"),
         {"alpha_pattern": {"(?s).*q_proj": 4}})
    case("layers_pattern_unbalanced", ("layers_pattern", "lay(ers"),
         {"layers_to_transform": [0], "layers_pattern": "lay(ers"})
    case("layers_pattern_idx_group", ("layers_pattern", "idx"),
         {"layers_to_transform": [0], "layers_pattern": "(?P<idx>layers)"})
    case("layers_pattern_list_bad_entry", ("layers_pattern", "h)"),
         {"layers_to_transform": [0], "layers_pattern": ["layers", "h)"]})
    case("layers_pattern_global_flag", "layers_pattern",
         {"layers_to_transform": [0], "layers_pattern": "(?i)LAYERS"})
    case("rank_pattern_bad_escape", ("rank_pattern", "\\p"), {"rank_pattern": {r"\p{L}+": 4}})
    case("rank_pattern_deep_nesting", ("rank_pattern", "deep"),
         {"rank_pattern": {"(" * 50_000 + "q_proj" + ")" * 50_000: 4}})
    case("exclude_variable_lookbehind", ("exclude_modules", "look-behind"),
         {"exclude_modules": "(?<=a+)q_proj"})
    case("target_modules_unbalanced", "target_modules", {"target_modules": ".*q_proj)"})
    # what the regex engine would compile into gigabytes, or read otherwise than re -------------
    case("rank_pattern_huge_count", ("rank_pattern", "repeats"),
         {"rank_pattern": {"q_proj{4294967294}": 4}})
    case("target_modules_nested_counts", ("target_modules", "repeats"),
         {"target_modules": "((q{999}){999}){999}"})
    case("alpha_pattern_count_at_max", ("alpha_pattern", "repeats"),
         {"alpha_pattern": {"(?:ab){4294967295}": 4}})
    case("target_modules_fuzzy", ("target_modules", "{"), {"target_modules": r".*q_proj{e<=1}"})
    case("exclude_modules_posix_class", ("exclude_modules", "["),
         {"exclude_modules": "[[:alpha:]._]+"})
    case("rank_pattern_fuzzy_group", ("rank_pattern", "{"),
         {"rank_pattern": {"(q_proj){i<=2,d<=2}": 4}})
    # a layers_pattern with a top-level | matches without the layer index: no layer selected --------
    case("layers_pattern_top_level_bar", "layers_pattern",
         {"layers_to_transform": [0], "layers_pattern": "layers|h"})
    # the adapter file ----------------------------------------------------------------------------------
    case("default_twin_differs", ("lora_A.default.weight", "different values"),
         tensors=lambda t: t | {Q_A.replace(".lora_A.", ".lora_A.default."): t[Q_A] * 2.0})
    case("other_adapter_beside_default", ("lora_A.other.weight", "named adapter"),
         tensors=lambda t: t | {Q_A.replace(".lora_A.", ".lora_A.other."): t[Q_A]})
    case("qalora_pooled_lora_a", ("use_qalora", "lora_A"), {"use_qalora": True,
                                                             "qalora_group_size": 8},
         tensors=lambda t: t | {Q_A: t[Q_A][:, ::8].copy()})
