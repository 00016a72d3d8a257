"""The limits of one chat-template rendering (:mod:`._chat_template`) and their
counting: a template is code from a downloaded folder, and the sandbox keeps it
from reaching Python's internals but not from running forever or asking for
gigabytes (``range`` loops inside loops, ``'a' * 10**10``, ``lipsum(10**7)``).
Each limit passed raises :class:`Limit`, which
:meth:`~nnx_shard.inference.Tokenizer.apply_chat_template` reports naming the
template and the limit:

* the time of one rendering (:data:`TIME_LIMIT`), checked at every loop
  iteration, call, filter, operator and attribute (:func:`tick`);
* the loop iterations of one rendering (:data:`MAX_LOOPS`, :func:`bounded`);
* the length of any one string the template makes and of the output
  (:data:`MAX_TEXT`), checked before the operations that multiply sizes (``*``,
  ``%``, ``~``, ``format``, ``center``, ``join``, ``replace``, ``indent``,
  ``tojson``, ...: :func:`want`) and after every other (:func:`made`);
* the items of any one list the template makes (:data:`MAX_ITEMS`);
* the characters made in all (:data:`MAX_MADE`), which bounds what a loop keeps;
* the size of an integer power (:data:`MAX_POWER_BITS`).

The counts live in one :func:`budget` per rendering (or compilation), held in a
``ContextVar``; outside one only the sizes are checked.

This module imports no jinja2.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["MAX_INDENT", "MAX_ITEMS", "MAX_LIPSUM_WORDS", "MAX_LOOPS", "MAX_MADE",
           "MAX_POWER_BITS", "MAX_TEXT", "TIME_LIMIT", "Limit", "bounded", "budget", "made",
           "past", "text_of", "tick", "want", "weight"]

#: Seconds one rendering may take (real chat templates take milliseconds).
TIME_LIMIT = 2.0
#: Loop iterations of one rendering.
MAX_LOOPS = 1_000_000
#: Characters of any one string a template makes, and of its output (about four
#: million tokens: past the context of almost every model).
MAX_TEXT = 1 << 24
#: Items of any one list, tuple or dict a template makes.
MAX_ITEMS = 1 << 20
#: Characters made in all by one rendering.
MAX_MADE = 1 << 28
#: Bits of an integer ``a ** b``.
MAX_POWER_BITS = 1 << 16
#: Words of ``lipsum()``, and the indent ``tojson`` may take.
MAX_LIPSUM_WORDS = 100_000
MAX_INDENT = 100


class Limit(Exception):
    """A rendering went past one of the limits; ``what`` says which and how far."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


@dataclasses.dataclass
class _Budget:
    deadline: float
    loops: int = 0
    made: int = 0


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_budget",
                                                                         default=None)


@contextlib.contextmanager
def budget() -> Iterator[None]:
    """The limits of one rendering (or compilation: jinja evaluates constant
    expressions when it compiles)."""
    token = _BUDGET.set(_Budget(time.monotonic() + TIME_LIMIT))
    try:
        yield
    finally:
        _BUDGET.reset(token)


def tick() -> None:
    """Refuses to go on past the rendering's deadline."""
    state = _BUDGET.get()
    if state is not None and time.monotonic() > state.deadline:
        raise Limit(f"the rendering ran past the time limit of {TIME_LIMIT:g} s")


def past(what: str, n: int, limit: int, unit: str = "characters") -> Limit:
    """The :class:`Limit` of ``what``, ``n`` ``unit`` against ``limit``.

    >>> past("a '+' of strings", 20_000_000, MAX_TEXT).what
    "a '+' of strings would be 20,000,000 characters, past the limit of 16,777,216"
    """
    return Limit(f"{what} would be {n:,} {unit}, past the limit of {limit:,}")


def want(n: int, what: str) -> None:
    """Refuses a string of ``n`` characters before it is made."""
    if n > MAX_TEXT:
        raise past(what, n, MAX_TEXT)


def made(value: Any, what: str = "a value") -> Any:
    """``value`` once checked: a string within :data:`MAX_TEXT` (and counted
    against :data:`MAX_MADE`), a container within :data:`MAX_ITEMS`."""
    if isinstance(value, str | bytes | bytearray):
        n = len(value)
        if n > MAX_TEXT:
            raise past(what, n, MAX_TEXT)
        state = _BUDGET.get()
        if state is not None and n:
            state.made += n
            if state.made > MAX_MADE:
                raise past("the text made in all", state.made, MAX_MADE)
    elif isinstance(value, list | tuple | dict | set | frozenset):
        if len(value) > MAX_ITEMS:
            raise past(what, len(value), MAX_ITEMS, "items")
    return value


def weight(value: Any, indent: int = 0) -> int:
    """About how many characters ``str(value)`` (or its JSON, each line
    indented by ``indent`` per level) takes, counted only up to just past
    :data:`MAX_TEXT`: a list that holds one long string a million times is
    small in memory and huge as text.

    >>> weight("abc"), weight(["ab", "c"])   # str(["ab", "c"]) has 11
    (3, 13)
    >>> weight(["x" * 10**6] * 10**6) > MAX_TEXT   # counted only to just past the limit
    True
    """
    if isinstance(value, str):
        return len(value)
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if not seen & 0xFFF:
            tick()
        if isinstance(item, str | bytes):
            total += len(item) + 2
        elif isinstance(item, Mapping):
            total += 2 + len(item) * (4 + indent * (depth + 1))
            stack.extend((k, depth + 1) for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            total += 2 + len(item) * (2 + indent * (depth + 1))
            stack.extend((v, depth + 1) for v in item)
        else:
            total += 8
        if total > MAX_TEXT:
            return total
    return total


def text_of(value: Any, what: str, indent: int = 0) -> None:
    """Refuses a value whose text (:func:`weight`) would pass :data:`MAX_TEXT`."""
    if not isinstance(value, str):
        want(weight(value, indent), what)


def bounded(items: Iterable[Any]) -> Iterator[Any]:
    """``items``, each counted against :data:`MAX_LOOPS` and the time limit."""
    state = _BUDGET.get()
    for item in items:
        if state is not None:
            state.loops += 1
            if state.loops > MAX_LOOPS:
                raise past("the loop iterations", state.loops, MAX_LOOPS, "iterations")
            if not state.loops & 0xFF:
                tick()
        yield item
