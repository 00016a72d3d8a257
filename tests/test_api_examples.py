"""Every example of the API reference runs as written: the ``>>>`` lines of each public
module's, function's, class's and public method's docstring (what the API pages render), in a
fresh namespace with nothing imported for it, so that an example names every import it uses.

(``--doctest-modules`` runs the same docstrings with their module's globals; this proves that a
reader who copies an example gets the same result.)
"""

from __future__ import annotations

import doctest
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import pytest

import nnx_shard
from tests._tiers import SLOW_DOCTESTS, SLOW_EXAMPLES
from tests.test_api import MODULES

_PARSER = doctest.DocTestParser()
_FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def _members(obj: Any) -> Iterator[tuple[str, Any]]:
    """A class's own public methods and properties (rendered on its page)."""
    for name, value in vars(obj).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            value = value.fget
        if inspect.isfunction(value):
            yield name, value


def _documented() -> Iterator[tuple[str, str]]:
    """(dotted name, docstring) of everything the API pages render."""
    top = nnx_shard
    for name in top.__all__:
        obj = getattr(top, name)
        if not inspect.ismodule(obj):
            yield from _one(f"nnx_shard.{name}", obj)
    for module_name in sorted(MODULES):
        module = importlib.import_module(module_name)
        yield module_name, module.__doc__ or ""
        for name in module.__all__:
            yield from _one(f"{module_name}.{name}", getattr(module, name))


def _one(dotted: str, obj: Any) -> Iterator[tuple[str, str]]:
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        return
    yield dotted, inspect.getdoc(obj) or ""
    if inspect.isclass(obj):
        for name, member in _members(obj):
            yield f"{dotted}.{name}", inspect.getdoc(member) or ""


EXAMPLES = {name: doc for name, doc in _documented() if ">>>" in doc}


def test_the_reference_has_examples():
    assert len(EXAMPLES) >= 60, len(EXAMPLES)


def test_slow_examples_are_examples():
    assert SLOW_EXAMPLES <= EXAMPLES.keys(), SLOW_EXAMPLES - EXAMPLES.keys()
    for dotted in SLOW_DOCTESTS:
        module, _, attr = dotted.rpartition(".")
        obj = getattr(importlib.import_module(module), attr)
        assert ">>>" in (obj.__doc__ or ""), dotted


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_EXAMPLES else name
    for name in sorted(EXAMPLES)])
def test_example_runs_as_written(name, tmp_path, monkeypatch):
    test = _PARSER.get_doctest(EXAMPLES[name], {"__name__": "__example__"}, name, None, 0)
    runner = doctest.DocTestRunner(optionflags=_FLAGS)
    out: list[str] = []
    runner.run(test, out=out.append, clear_globs=True)
    assert runner.failures == 0, "".join(out)[-4000:]
