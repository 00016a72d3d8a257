"""Chat templates compiled as transformers compiles them (jinja2's
``ImmutableSandboxedEnvironment``, blocks trimmed, ``raise_exception``,
``strftime_now``, a ``tojson`` that leaves HTML alone) and rendered within the
limits of :mod:`._template_limits` (time, loop iterations, string and list
sizes, characters made, integer powers), each refused with :class:`Limit`
(which :meth:`~nnx_shard.inference.Tokenizer.apply_chat_template` reports
naming the template and the limit). Here the operations that multiply sizes
(``*``, ``%``, ``~``, ``format``, ``center``, ``join``, ``replace``,
``indent``, ``tojson``, ...) are checked before they run, every other result
after, and every ``for`` and ``~`` of the compiled template goes through a
checked call.

Templates of real checkpoints stay orders of magnitude below every limit, and
they render exactly as without them: the hooks only check, the values are
Python's own.

``{% generation %} ... {% endgeneration %}`` blocks (the assistant's text, as
transformers' ``AssistantTracker`` extension reads them) render their body as
it is; :func:`render` given a ``spans`` list records there the characters each
block printed, where the output stood when the block ended (so a block inside a
macro or a ``{% set %}`` block is placed as transformers places it). The spans
recorded count against :data:`~._template_limits.MAX_ITEMS`.

This module imports jinja2: it is imported only when a template is compiled.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import json
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import ext, nodes, sandbox
from markupsafe import Markup

from nnx_shard.inference._template_limits import (
    MAX_INDENT,
    MAX_ITEMS,
    MAX_LIPSUM_WORDS,
    MAX_POWER_BITS,
    MAX_TEXT,
    Limit,
    bounded,
    budget,
    made,
    past,
    text_of,
    tick,
    want,
    weight,
)


@dataclasses.dataclass
class _Tracker:
    """Where the output of a rendering stands (``size``, the characters yielded so
    far) and the ``(start, end)`` characters of each generation block."""

    spans: list[tuple[int, int]]
    size: int = 0


_TRACKER: contextvars.ContextVar[_Tracker | None] = contextvars.ContextVar("chat_tracker",
                                                                          default=None)


# -- what multiplies sizes, checked before it runs ------------------------------------

_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")
_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?")


def _check_printf(fmt: str, args: Any) -> None:
    """``fmt % args``: widths and precisions within :data:`MAX_TEXT`, the values'
    text too."""
    values = list(args) if isinstance(args, tuple) else [args]
    for m in _PRINTF.finditer(fmt):
        for group in m.group(1, 2):
            if group == "*":
                if any(isinstance(v, int) and v > MAX_TEXT for v in values):
                    raise Limit(f"a '%*' width past the limit of {MAX_TEXT:,} characters")
            elif group and (len(group) > 8 or int(group) > MAX_TEXT):
                raise past(f"the '%' width {group[:20]}", int(group[:20]), MAX_TEXT)
    want(len(fmt) + weight(args), "a '%' formatting")


def _check_spec(spec: str) -> None:
    m = _SPEC.match(spec)
    if m is None:
        return
    for group in m.groups():
        if group and (len(group) > 8 or int(group) > MAX_TEXT):
            raise past(f"the format width {group[:20]}", int(group[:20]), MAX_TEXT)


class _Formatter(sandbox.SandboxedFormatter):
    def format_field(self, value: Any, format_spec: str) -> Any:
        _check_spec(format_spec)
        text_of(value, "a str.format field")
        return super().format_field(value, format_spec)


class _EscapeFormatter(sandbox.SandboxedEscapeFormatter):
    def format_field(self, value: Any, format_spec: str) -> Any:
        _check_spec(format_spec)
        text_of(value, "a str.format field")
        return super().format_field(value, format_spec)


def _str_format(obj: Any) -> tuple[str, str] | None:
    """``(text, 'format' | 'format_map')`` where ``obj`` is that method of a string."""
    target = getattr(obj, "__wrapped__", obj)  # jinja >= 3.1.5 wraps them on access
    name = getattr(target, "__name__", None)
    owner = getattr(target, "__self__", None)
    if name in ("format", "format_map") and isinstance(owner, str) and callable(target):
        return owner, name
    return None


def _format(env: Any, text: str, name: str, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> str:
    if name == "format_map":
        if kwargs or len(args) != 1:
            # not user input: the TypeError str.format_map itself raises, mirrored in the sandbox
            raise TypeError("format_map() takes exactly one argument")
        mapping = args[0]
        args, kwargs = (), mapping
    formatter = (_EscapeFormatter(env, escape=text.escape) if isinstance(text, Markup)
                 else _Formatter(env))
    return type(text)(formatter.vformat(text, args, kwargs))


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) else None


def _check_method(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The methods of strings and ints whose result can be far larger than
    their arguments."""
    owner = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", "")
    if isinstance(owner, str | bytes | bytearray):
        first = args[0] if args else None
        if name in ("center", "ljust", "rjust", "zfill"):
            width = _int(first if first is not None else kwargs.get("width"))
            if width is not None:
                want(width, f"str.{name}({width})")
        elif name == "expandtabs":
            size = _int(first if first is not None else kwargs.get("tabsize", 8)) or 0
            tabs = owner.count("\t") if isinstance(owner, str) else owner.count(b"\t")
            want(len(owner) + tabs * size, f"str.expandtabs({size})")
        elif name == "join" and args:
            items = args[0]
            if isinstance(items, list | tuple):
                want(len(owner) * max(0, len(items) - 1) + sum(
                    weight(v) for v in items[:MAX_ITEMS + 1]), "str.join(...)")
        elif name == "replace" and len(args) >= 2:
            old, new = args[0], args[1]
            if isinstance(old, str | bytes) and isinstance(new, str | bytes):
                n = owner.count(old) if old else len(owner) + 1  # type: ignore[arg-type]
                if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
                    n = min(n, args[2])
                want(len(owner) + n * max(0, len(new) - len(old)), "str.replace(...)")
        elif name == "translate" and args and isinstance(args[0], Mapping):
            longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
            want(len(owner) * longest, "str.translate(...)")
    elif isinstance(owner, int) and name == "to_bytes":
        length = _int(args[0] if args else kwargs.get("length", 1))
        if length is not None:
            want(length, f"int.to_bytes({length})")


def _arguments(signature: inspect.Signature, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> dict[str, Any] | None:
    try:
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None  # the filter itself says what is wrong
    bound.apply_defaults()
    return dict(bound.arguments)


def _value_key(a: dict[str, Any]) -> str | None:
    return next((k for k in ("value", "s", "iterable", "seq", "x", "obj") if k in a), None)


def _f_center(value: Any, a: dict[str, Any]) -> None:
    width = _int(a.get("width"))
    text_of(value, "the value of center")
    if width is not None:
        want(width, f"center({width})")


def _f_indent(value: Any, a: dict[str, Any]) -> None:
    width = a.get("width")
    w = len(width) if isinstance(width, str) else _int(width) or 0
    if isinstance(value, str):
        want(len(value) + (value.count("\n") + 1) * w, f"indent({short_repr(width)})")


def _f_wordwrap(value: Any, a: dict[str, Any]) -> None:
    wrap, width = a.get("wrapstring"), _int(a.get("width")) or 1
    if isinstance(value, str) and isinstance(wrap, str):
        want(len(value) + (len(value) // max(1, width) + 1) * len(wrap), "wordwrap(...)")


def _f_replace(value: Any, a: dict[str, Any]) -> None:
    old, new, count = a.get("old"), a.get("new"), a.get("count")
    if isinstance(value, str) and isinstance(old, str) and isinstance(new, str):
        n = value.count(old) if old else len(value) + 1
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        want(len(value) + n * max(0, len(new) - len(old)), "replace(...)")


def _f_join(value: Any, a: dict[str, Any]) -> None:
    key = _value_key(a)
    if key is not None and value is not None and not isinstance(value, str):
        items = a[key] = list(bounded(value))  # join makes a list of them anyway
        want(len(str(a.get("d", ""))) * max(0, len(items) - 1) + sum(
            weight(v) for v in items), "join(...)")


def _f_format(value: Any, a: dict[str, Any]) -> None:
    if isinstance(value, str):
        _check_printf(value, tuple(a.get("args", ())) or a.get("kwargs", {}))


def _f_batch(value: Any, a: dict[str, Any]) -> None:
    if a.get("fill_with") is not None and (_int(a.get("linecount")) or 0) > MAX_ITEMS:
        raise past("batch(...) rows", a["linecount"], MAX_ITEMS, "items")


def _f_slice(value: Any, a: dict[str, Any]) -> None:
    if (_int(a.get("slices")) or 0) > MAX_ITEMS:
        raise past("slice(...)", a["slices"], MAX_ITEMS, "slices")


def _f_sum(value: Any, a: dict[str, Any]) -> None:
    key = _value_key(a)
    if key is not None and value is not None and not isinstance(value, str):
        items = a[key] = list(bounded(value))
        if isinstance(a.get("start"), list | tuple | str):
            n = sum(len(v) for v in items if isinstance(v, list | tuple | str))
            if n > MAX_ITEMS:
                raise past("sum(...)", n, MAX_ITEMS, "items")


def _f_pprint(value: Any, a: dict[str, Any]) -> None:
    text_of(value, "pprint(...)", indent=1)


_FILTER_CHECKS: dict[str, Callable[[Any, dict[str, Any]], None]] = {
    "center": _f_center, "indent": _f_indent, "wordwrap": _f_wordwrap,
    "replace": _f_replace, "join": _f_join, "format": _f_format, "batch": _f_batch,
    "slice": _f_slice, "sum": _f_sum, "pprint": _f_pprint}


def _check_filter(name: str, a: dict[str, Any]) -> dict[str, Any]:
    """Checks the arguments ``a`` of filter ``name`` (bound by parameter name)
    before it runs; returns them, an iterable made a list where it is counted."""
    key = _value_key(a)
    value = a[key] if key is not None else None
    check = _FILTER_CHECKS.get(name)
    if check is not None:
        check(value, a)
    elif name in _STRINGIFY:
        text_of(value, f"{name}(...)")
    return a


# Filters that turn their value into text (a list's repr can be far larger than it).
_STRINGIFY = frozenset({"string", "e", "escape", "forceescape", "trim", "upper", "lower",
                        "capitalize", "title", "truncate", "striptags", "urlize", "urlencode",
                        "wordcount", "safe", "xmlattr"})


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 20 else text[:17] + "..."


def _wrap_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    try:
        signature: inspect.Signature | None = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin without a signature: checked after only
        signature = None
    first = next(iter(signature.parameters), None) if signature is not None else None

    @functools.wraps(func)  # keeps jinja's pass_context / pass_environment marks
    def checked(*args: Any, **kwargs: Any) -> Any:
        tick()
        lead = 0
        # jinja's sync/async filters take the context first without naming it
        if args and first not in _PASSED and isinstance(args[0], _PASS_TYPES):
            lead = 1
        a = None if signature is None else _arguments(signature, args[lead:], kwargs)
        if a is not None:
            key = _value_key(a)
            value = a[key] if key is not None else None
            a = _check_filter(name, a)
            if key is not None and a[key] is not value:  # an iterable made a list
                args = tuple(a[key] if x is value else x for x in args)
        return made(func(*args, **kwargs), f"the result of {name}")

    return checked


_PASSED = frozenset({"eval_ctx", "environment", "context", "env"})
_PASS_TYPES = (jinja2.nodes.EvalContext, jinja2.Environment, jinja2.runtime.Context)


# -- the environment -----------------------------------------------------------------


class _Generation(ext.Extension):
    """``{% generation %}`` ... ``{% endgeneration %}``: the body rendered as it is,
    its characters recorded while :func:`render` tracks them (transformers'
    ``AssistantTracker``, same parse, same positions)."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads it from the class, as a set)

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation_support"), [], [],
                               body).set_lineno(lineno)

    def _generation_support(self, caller: Callable[[], str]) -> str:
        rv = caller()
        tracker = _TRACKER.get()
        if tracker is not None:
            if len(tracker.spans) >= MAX_ITEMS:
                raise past("the generation blocks rendered", len(tracker.spans) + 1,
                            MAX_ITEMS, "blocks")
            tracker.spans.append((tracker.size, tracker.size + len(rv)))
        return rv



class _Environment(sandbox.ImmutableSandboxedEnvironment):
    """transformers' sandbox with every multiplying operation checked."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | bytes) and isinstance(n, int):
                    want(len(seq) * n, f"{short_repr(seq)} * {n}")
                elif isinstance(seq, list | tuple) and isinstance(n, int):
                    if len(seq) * n > MAX_ITEMS:
                        raise past(f"a list * {n}", len(seq) * n, MAX_ITEMS, "items")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                bits = left.bit_length() * right
                if bits > MAX_POWER_BITS:
                    raise past(f"{short_repr(left)} ** {short_repr(right)}", bits,
                                MAX_POWER_BITS, "bits")
        elif operator == "%" and isinstance(left, str):
            _check_printf(left, right)
        elif operator == "+" and isinstance(left, str) and isinstance(right, str):
            want(len(left) + len(right), "a '+' of strings")
        return made(super().call_binop(context, operator, left, right),
                     f"the result of '{operator}'")

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        tick()
        fmt = _str_format(obj)
        if fmt is not None:
            return made(_format(self, fmt[0], fmt[1], args, kwargs), f"str.{fmt[1]}(...)")
        _check_method(obj, args, kwargs)
        return made(super().call(context, obj, *args, **kwargs),
                     f"the result of {getattr(obj, '__name__', 'a call')}")

    def getattr(self, obj: Any, attribute: str) -> Any:
        tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        tick()
        return super().getitem(obj, argument)

    # Called by the compiled template: see _bound_ast.
    def bounded_loop(self, items: Any) -> Any:
        return bounded(items)

    def bounded_concat(self, *parts: Any) -> str:
        n = 0
        for part in parts:
            n += weight(part)
            if n > MAX_TEXT:
                break
        want(n, "a '~' of strings")
        return "".join(map(str, parts))


def _finalize(value: Any) -> Any:
    """What ``{{ value }}`` prints, checked before ``str`` turns it into text."""
    want(weight(value), "a printed value")
    return value


def _bound_ast(env: Any, tree: nodes.Template) -> nodes.Template:
    """``tree`` with every ``for`` iterating through :func:`bounded` and every
    ``~`` joining through ``bounded_concat`` (both checked calls)."""
    def call(name: str, args: list[Any], lineno: int) -> Any:
        node = nodes.Call(nodes.EnvironmentAttribute(name), args, [], None, None)
        node.set_lineno(lineno)
        node.set_environment(env)
        return node

    for loop in tree.find_all(nodes.For):
        loop.iter = call("bounded_loop", [loop.iter], loop.lineno)
    # Replaced bottom up (find_all yields parents first): a list of them, then in reverse.
    for parent in reversed([tree, *tree.find_all(nodes.Node)]):
        for field, value in parent.iter_fields():
            if isinstance(value, nodes.Concat):
                setattr(parent, field, call("bounded_concat", value.nodes, value.lineno))
            elif isinstance(value, list):
                value[:] = [call("bounded_concat", v.nodes, v.lineno)
                            if isinstance(v, nodes.Concat) else v for v in value]
    return tree


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    width = len(indent) if isinstance(indent, str) else _int(indent) or 0
    if width > MAX_INDENT:
        raise past(f"tojson(indent={short_repr(indent)})", width, MAX_INDENT)
    if isinstance(separators, list | tuple) and any(
            isinstance(s, str) and len(s) > MAX_INDENT for s in separators):
        raise Limit(f"tojson(separators=...) longer than the limit of {MAX_INDENT} characters")
    spread = width + (max((len(s) for s in separators if isinstance(s, str)), default=0)
                      if isinstance(separators, list | tuple) else 0)
    want(weight(x, spread), "tojson(...)")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    from jinja2.utils import generate_lorem_ipsum

    words = 0
    if isinstance(n, int) and isinstance(max, int) and isinstance(min, int):
        words = n * (max if max > min else min)
    if words > MAX_LIPSUM_WORDS:
        raise past(f"lipsum({n}, max={max})", words, MAX_LIPSUM_WORDS, "words")
    return generate_lorem_ipsum(n=n, html=html, min=min, max=max)


def compile_template(source: str) -> Any:
    """``source`` compiled as transformers compiles a chat template, its
    rendering bounded (the jinja errors of a bad template are raised as they
    are)."""
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, ext.loopcontrols],
                       finalize=_finalize)
    env.filters["tojson"] = _tojson
    env.filters = {name: _wrap_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["lipsum"] = _lipsum
    with budget():
        return env.from_string(_bound_ast(env, env.parse(source)))


def render(template: Any, context: Mapping[str, Any],
           spans: list[tuple[int, int]] | None = None) -> str:
    """``template`` rendered with ``context``, within the limits; with ``spans``,
    the ``(start, end)`` characters of each generation block appended to it."""
    out: list[str] = []
    tracker = _Tracker(spans) if spans is not None else None
    token = _TRACKER.set(tracker)
    size = 0
    try:
        with budget():
            for chunk in template.generate(**context):
                size += len(chunk)
                if size > MAX_TEXT:
                    raise past("the rendered prompt", size, MAX_TEXT)
                tick()
                out.append(chunk)
                if tracker is not None:  # what the template has yielded when it resumes
                    tracker.size = size
    finally:
        _TRACKER.reset(token)
    return "".join(out)


#: transformers' test for a template that marks the assistant's text.
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
