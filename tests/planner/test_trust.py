"""Which compiled CPU figures the planner trusts."""

from __future__ import annotations

from nnx_shard import strategies
from nnx_shard.planner._trust import PIPELINE_NOTICE, compiled_trusted


def test_every_pipeline_preset_and_only_those_are_untrusted_on_cpu():
    for name in strategies.NAMES:
        strat = strategies.get(name)
        ok, why = compiled_trusted(strat)
        piped = strat.rules.options.get("pipeline") is not None
        assert (ok, why) == ((False, PIPELINE_NOTICE) if piped else (True, None)), name
        assert compiled_trusted(strat, backend="gpu") == (True, None)
    assert sum(not compiled_trusted(strategies.get(n))[0] for n in strategies.NAMES) == 3


def test_a_preset_with_extra_rules_keeps_its_pipeline_verdict():
    strat = strategies.get("pp_tp").with_rules({"embed": "data", "length": "model"})
    assert compiled_trusted(strat)[0] is False
    assert compiled_trusted(strategies.get("fsdp_tp").with_rules({"length": "model"}))[0]
