"""The planner's names moved between its modules stay importable from where they were,
with a DeprecationWarning that names where they live now."""

from __future__ import annotations

import importlib

import pytest

from nnx_shard.planner import evaluate, layouts, problem


@pytest.mark.parametrize("old, name, new", [
    ("nnx_shard.planner.search", "enumerate_layouts", layouts),
    ("nnx_shard.planner.explore", "batch_problem", problem),
    ("nnx_shard.planner.explore", "apply_result", evaluate),
])
def test_a_moved_name_warns_and_is_the_same_object(old, name, new):
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} is deprecated: import it "
                                                rf"from {new.__name__}"):
        got = getattr(module, name)
    assert got is getattr(new, name)


def test_problem_is_still_imported_by_the_search():
    from nnx_shard.planner import explore

    assert explore.Problem is problem.Problem


def test_an_unknown_name_is_still_an_attribute_error():
    from nnx_shard.planner import search

    with pytest.raises(AttributeError, match="has no attribute 'enumerate'"):
        search.enumerate  # noqa: B018
