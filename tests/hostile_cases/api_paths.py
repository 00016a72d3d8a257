"""Hostile cases of the one-path entry points and rules tables: a list where a product
or fallbacks was meant, Fallbacks where a pair table repeats pairs, a strategy given
twice (with opt_rules, or with rules to the Trainer), and a Trainer given no layout."""

from __future__ import annotations

from typing import Any


def _ns() -> Any:
    import nnx_shard

    return nnx_shard


def _optax() -> Any:
    import optax

    return optax


def build(hs: Any) -> None:
    F = hs.F
    hs.api("api_paths/rules_list_value", ["mlp", "Fallbacks"],
           lambda: _ns().Rules({"mlp": ["model", None]}))
    hs.api("api_paths/rules_pair_list_value", ["mlp", "Fallbacks"],
           lambda: _ns().Rules([("mlp", ["model", "data"])]))
    hs.api("api_paths/rules_merge_list_value", ["mlp", "Fallbacks"],
           lambda: _ns().Rules({}) | {"mlp": ["model"]})
    hs.api("api_paths/from_pairs_fallbacks", ["mlp", "repeated pair"],
           lambda: _ns().Rules.from_pairs([["mlp", _ns().Fallbacks("model", None)]]))
    hs.api("api_paths/fallbacks_empty", ["mlp", "Fallbacks()"],
           lambda: _ns().Rules({"mlp": _ns().Fallbacks()}))
    hs.api("api_paths/rules_file_dict_array", ["mlp", "logical_axis_rules"],
           lambda: _ns().Rules.from_file(F.rules_file("api_paths.toml",
                                                      '[rules]\nmlp = ["model", ""]\n')))
    hs.api("api_paths/optimizer_strategy_and_opt_rules", ["opt_rules", "zero1"],
           lambda: _ns().sharded_optimizer(F.model(), _optax().sgd(0.1), "data=8",
                                           _ns().strategies.get("zero1"),
                                           opt_rules={"batch": "data"}))
    hs.api("api_paths/trainer_no_layout", ["rules="],
           lambda: _ns().Trainer(F.model(), F.opt(), F.mse, mesh="data=8"))
    hs.api("api_paths/trainer_rules_a_preset_name", ["Rules", "dp"],
           lambda: _ns().Trainer(F.model(), F.opt(), F.mse, mesh="data=8", rules="dp"))
