"""Twins known before compiling: one compile per program."""

from __future__ import annotations

import dataclasses

import pytest
from flax import nnx

from nnx_shard import _optimizers as optimizers
from nnx_shard import planner
from nnx_shard.models import Decoder, get_config
from nnx_shard.planner import _explore
from nnx_shard.planner._cache import Cache
from nnx_shard.planner._formula import abstract_report
from nnx_shard.planner._twins import signature
from nnx_shard.strategies._presets import get


def _sig(cfg, name, sizes, *, microbatches=1, remat="none"):
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    strat = get(name)
    rows = abstract_report(model, sizes, strat.rules, optimizers.get("adamw"),
                           strat.opt_rules).rows
    return signature(strat, sizes, rows, cfg, batch=8, seq=16, microbatches=microbatches,
                     remat=remat)


def test_twins_are_equal_and_other_layouts_are_not():
    cfg = get_config("tiny")
    dp = _sig(cfg, "dp", {"data": 4})
    # ep on a dense model is dp, on every split of the devices.
    for sizes in ({"data": 1, "expert": 4}, {"data": 2, "expert": 2}):
        assert _sig(cfg, "ep", sizes) == dp, sizes
    assert _sig(cfg, "fsdp_tp", {"data": 1, "model": 4}) == _sig(cfg, "tp", {"data": 1, "model": 4})
    differ = [dp, _sig(cfg, "fsdp", {"data": 4}), _sig(cfg, "zero1", {"data": 4}),
              _sig(cfg, "tp", {"data": 2, "model": 2}), _sig(cfg, "sp", {"data": 2, "model": 2}),
              _sig(cfg, "fsdp_tp", {"data": 2, "model": 2}), _sig(cfg, "tp", {"data": 1, "model": 4}),
              _sig(cfg, "dp", {"data": 4}, remat="full"), _sig(cfg, "dp", {"data": 4}, microbatches=2),
              _sig(cfg, "dp", {"data": 2})]
    assert len(set(differ)) == len(differ)
    # A layout with execution options has none: it is compiled.
    for name, sizes in (("cp", {"data": 2, "context": 2}), ("async_tp", {"data": 2, "model": 2})):
        assert _sig(cfg, name, sizes) is None


def test_on_a_mixture_of_experts_ep_is_not_dp():
    cfg = get_config("tiny_moe")
    assert _sig(cfg, "ep", {"data": 2, "expert": 2}) != _sig(cfg, "dp", {"data": 4})
    # fsdp_ep over one data device splits nothing ep does not; over two, every parameter.
    ep = _sig(cfg, "ep", {"data": 1, "expert": 4})
    assert _sig(cfg, "fsdp_ep", {"data": 1, "expert": 4}) == ep
    assert _sig(cfg, "fsdp_ep", {"data": 2, "expert": 2}) != _sig(cfg, "ep", {"data": 2, "expert": 2})


@pytest.mark.slow
def test_the_search_compiles_each_program_once_with_the_same_figures(monkeypatch):
    """Twins (one program under two labels) compile once; and workers=2 splits the
    compiles over two children side by side: the figures, the ranking and the choice are
    those of one child compiling each program once (one comparison proves both: the
    children are the expensive part)."""
    def run(dedupe):
        monkeypatch.setattr(Cache, "shared", {})  # compile again, not from memory
        if not dedupe:
            monkeypatch.setattr(_explore.Search, "signature", lambda self, c, strat=None: None)
        # One layer: the twins are told by layout, not by size, and which child compiles a
        # program changes none of its figures at any size.
        return planner.auto(dataclasses.replace(get_config("tiny"), layers=1), devices=4,
                            batch=8, seq=16, device_memory="1GB",
                            strategies=["dp", "ep", "tp", "fsdp_tp"], progress=False,
                            workers=1 if dedupe else 2)

    once, each = run(True), run(False)
    assert each.request["compiled"] == 7 and once.request["compiled"] == 4
    same = [p for p in once.pruned if p.startswith("3 candidates not compiled: the same program")]
    assert same and "ep data=2,expert=2 remat=none mb=1 (= dp data=4 remat=none mb=1)" in same[0]
    assert "fsdp_tp data=1,model=4 remat=none mb=1 (= tp data=1,model=4 remat=none mb=1)" in same[0]
    assert [c.label for c in once.ranked] == [c.label for c in each.ranked]
    for a, b in zip(once.ranked, each.ranked, strict=True):
        assert dataclasses.astuple(a)[4:12] == dataclasses.astuple(b)[4:12]
    assert once.best.label == each.best.label
