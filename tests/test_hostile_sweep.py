"""The hostile sweep (tests/hostile_sweep.py): its verdicts, a quick slice, and the
whole sweep (slow). Every case hands a public function or the command an invalid
value; each must end in one clear error naming the argument: no raw traceback, no
hang, no silent acceptance."""

from __future__ import annotations

import numpy as np
import pytest

import nnx_shard as ns
from tests import hostile_sweep as hs


def test_the_verdicts_can_fail():
    # An error of ours naming the argument is clear; one that names something else, one
    # raised inside a library, or an unbounded message is raw.
    try:
        ns.pipeline.bubble(0, 4)
    except ns.NnxShardError as e:
        assert hs.classify_exception(e, ("stages",))[0] == hs.CLEAR
        assert hs.classify_exception(e, ("repeats",))[0] == hs.RAW
    try:
        np.ones(3).reshape(5)
    except ValueError as e:
        assert hs.classify_exception(e, ("shape",))[0] == hs.RAW
    assert hs.classify_exception(ns.ShardingError("x" * 5000), ("x",))[0] == hs.RAW
    # The command: exit 2 with one error line naming the flag is clear; exit 0 is silent.
    assert hs.classify_cli(2, "", "nnx-shard: error: --top must be 0 or more", ("--top",))[0] \
        == hs.CLEAR
    assert hs.classify_cli(0, "plan", "", ("--top",))[0] == hs.SILENT
    assert hs.classify_cli("exception", "", "Traceback (most recent call last):\n",
                           ("--top",))[0] == hs.RAW


# The quick tier's slice; the slow tier's sweep runs every other case.
SLICE = ("pipeline.bubble/", "Checkpointer/", "cli plan --auto/link_latency")


def test_a_slice_of_the_sweep_is_all_clear():
    picked = [c for c in hs.cases() if c.name.startswith(SLICE)]
    assert len(picked) >= 25
    results = hs.sweep(picked)
    assert [r for r in results if r["outcome"] != hs.CLEAR] == []


@pytest.mark.slow
def test_the_whole_sweep_is_all_clear():
    selected = [c for c in hs.cases() if not c.slow and not c.name.startswith(SLICE)]
    assert len(selected) >= 600
    results = hs.sweep(selected)
    bad = [f"{r['outcome']}: {r['name']}: {r['why']}" for r in results
           if r["outcome"] != hs.CLEAR]
    assert bad == [], "\n".join(bad)
