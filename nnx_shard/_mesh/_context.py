"""The one execution context: :class:`Context`, read by :func:`context` and entered by
:func:`use` (the mesh and rules), ``multistep`` (the step's microbatches and
precision), ``value_and_grad`` and the pipeline (what they hand down the code they
trace); the views :func:`current` and :func:`option` of it, and the activation
constraints it enables (:func:`constrain`).

Each enclosing call enters a :func:`dataclasses.replace` of the context it finds
(:func:`entered`) for the duration of a ``with`` block; code further down reads the
innermost one. The context lives in one :class:`contextvars.ContextVar`, so two
threads (or two asyncio tasks) never see each other's, and leaving a block, by its
end or an exception, restores the one outside it.

What a traced step took is recorded, not written back: the step enters a fresh
:class:`CallLog` (:func:`watching`), the ops it calls append their names to it
(:func:`called`), and the step reads what it holds once its code returned.

>>> from nnx_shard import Rules
>>> with use("data=8", Rules({"batch": "data"})), entered(microbatches=4):
...     dict(context().mesh.shape), context().microbatches, option("attention")
({'data': 8}, 4, 'local')
>>> context() == Context()
True
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from nnx_shard._errors import UsageError
from nnx_shard._mesh._build import make_mesh
from nnx_shard._mesh._placement import apply_sharding
from nnx_shard._rules import Rules, as_rules, option_row

__all__ = ["CallLog", "Calls", "Context", "called", "constrain", "context", "current", "entered",
           "option", "use", "watching"]


class CallLog:
    """The names of the ops a traced step called, in order (see :func:`watching`)."""

    __slots__ = ("names",)

    def __init__(self) -> None:
        self.names: list[str] = []

    def __repr__(self) -> str:
        return f"CallLog({self.names!r})"


@dataclasses.dataclass(frozen=True)
class Context:
    """Everything enclosing calls hand down to the code they run or trace.

    Attributes:
      mesh: the mesh of the innermost :func:`use`, or ``None``.
      rules: its rules (their :attr:`~nnx_shard.Rules.options` are the execution
        options :func:`option` reads), or ``None``.
      microbatches: the ``microbatches=M`` of the enclosing ``multistep`` (what
        ``value_and_grad`` splits a batch into when not told), or ``None``.
      precision: the ``precision=`` of the enclosing ``multistep`` (a
        :class:`~nnx_shard.Precision`), or ``None``.
      reading: the precision the ``value_and_grad`` being traced reads the
        parameters in (``None``: as stored).
      stage_microbatches: the microbatches ``pipeline.scan`` cuts its batch into,
        set by ``value_and_grad`` under a pipeline strategy, or ``None``.
      calls: the :class:`CallLog` of the step being traced, or ``None`` (not
        compared: two contexts that differ only there are equal).
    """

    mesh: Mesh | None = None
    rules: Rules | None = None
    microbatches: int | None = None
    precision: Any = None
    reading: Any = None
    stage_microbatches: int | None = None
    calls: CallLog | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def options(self) -> Mapping[str, Any]:
        """The execution options of :attr:`rules` (empty without rules)."""
        return {} if self.rules is None else self.rules.options


# The one place the context is kept: per thread and per asyncio task. The default is
# frozen, so sharing it is safe.
_CONTEXT: contextvars.ContextVar[Context] = contextvars.ContextVar(
    "nnx_shard_context", default=Context())  # noqa: B039


def context() -> Context:
    """The innermost :class:`Context` (an empty one outside every enclosing call).

    >>> context().mesh is None, context().microbatches
    (True, None)
    """
    return _CONTEXT.get()


@contextlib.contextmanager
def entered(**changes: Any) -> Iterator[Context]:
    """Runs the block in ``dataclasses.replace(context(), **changes)``; the context
    outside it is back after the block, whatever happens inside.

    >>> with entered(microbatches=2) as ctx:
    ...     ctx.microbatches, context() is ctx
    (2, True)
    >>> context().microbatches is None
    True
    """
    ctx = dataclasses.replace(_CONTEXT.get(), **changes)
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


class Calls:
    """The names :func:`called` recorded inside one :func:`watching` block (those
    recorded after the block are not its)."""

    __slots__ = ("_end", "_log", "_start")

    def __init__(self, log: CallLog, start: int) -> None:
        self._log, self._start = log, start
        self._end: int | None = None

    def _names(self) -> list[str]:
        return self._log.names[self._start:self._end]

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __repr__(self) -> str:
        return f"Calls({sorted(set(self._names()))!r})"


@contextlib.contextmanager
def watching() -> Iterator[Calls]:
    """Yields the :class:`Calls` of the block: what the ops called inside it record
    with :func:`called`. Nested blocks share the outermost block's log, so each
    sees every call made inside it.

    >>> with watching() as outer:
    ...     with watching() as inner:
    ...         called("attention")
    ...     called("value_and_grad")
    >>> "attention" in inner, "value_and_grad" in inner, "attention" in outer
    (True, False, True)
    """
    log = _CONTEXT.get().calls
    fresh = log is None
    if log is None:
        log = CallLog()
    calls = Calls(log, len(log.names))
    try:
        with entered(calls=log) if fresh else contextlib.nullcontext():
            yield calls
    finally:
        calls._end = len(log.names)


def called(name: str) -> None:
    """Records that the op ``name`` ran, for the enclosing :func:`watching` blocks
    (nothing outside them).

    >>> called("attention")  # no block watching: nothing to record
    """
    log = _CONTEXT.get().calls
    if log is not None:
        log.names.append(name)


@contextlib.contextmanager
def use(mesh: Mesh | str | Mapping[str, int], rules: Rules | Mapping[str, Any]) -> Iterator[Mesh]:
    """Makes ``(mesh, rules)`` active: JAX's mesh context plus the rules that
    :func:`constrain` and the trainer read (the context's ``mesh`` and ``rules``).

    Args:
      mesh: a ``Mesh`` or a spec for :func:`nnx_shard.make_mesh` (``"data=4,model=2"``).
      rules: the logical-to-mesh table (:class:`~nnx_shard.Rules` or a dict); its
        :attr:`~nnx_shard.Rules.options` are the execution options the block runs with.

    >>> from nnx_shard import Rules, use
    >>> rules = Rules({"batch": "data"})
    >>> with use("data=8", rules) as mesh:
    ...     dict(mesh.shape)
    {'data': 8}
    """
    mesh = make_mesh(mesh)
    rules = as_rules(rules)
    with entered(mesh=mesh, rules=rules), jax.set_mesh(mesh):
        yield mesh


def current() -> tuple[Mesh, Rules] | None:
    """The ``(mesh, rules)`` of :func:`context` (the innermost :func:`use`), or ``None``.

    >>> current() is None
    True
    """
    ctx = _CONTEXT.get()
    if ctx.mesh is None or ctx.rules is None:
        return None
    return ctx.mesh, ctx.rules


_UNSET: Any = object()


def option(name: str, default: Any = _UNSET) -> Any:
    """The execution option ``name`` of the context's rules
    (:attr:`nnx_shard.Rules.options`); where they do not set it, ``default``, else
    the option's own default (:data:`nnx_shard._rules.OPTIONS`).

    Sharding-aware operations read how a strategy wants them to run here
    (e.g. ring or all-gather attention), so switching strategy never edits
    model code.

    Raises:
      UsageError: ``name`` is not an execution option.

    >>> rules = Rules({"batch": "data"}).with_options(attention="ring")
    >>> with use("data=8", rules):
    ...     option("attention"), option("pipeline")
    ('ring', None)
    >>> option("attention")
    'local'
    >>> option("atention")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: option 'atention' is not an execution option. ...
    """
    row = option_row(name)
    value = _CONTEXT.get().options.get(name, _UNSET)
    if value is not _UNSET:
        return value
    return row.default if default is _UNSET else default


def constrain(x: Any, names: Sequence[str | None]) -> Any:
    """Constrains an activation's layout by logical names, under :func:`use`.

    Outside any :func:`use` context it returns ``x`` unchanged, so model code
    that calls it still runs on one device with no mesh.

    Args:
      x: the activation (a ``jax.Array``, inside ``jit``).
      names: one logical name (or ``None``) per dimension of ``x``.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from nnx_shard import Rules, constrain, use
    >>> x = jnp.ones((8, 4))
    >>> with use("data=8", Rules({"batch": "data", "embed": None})):
    ...     y = jax.jit(lambda x: constrain(x * 2, ("batch", "embed")))(x)
    >>> y.sharding.shard_shape(y.shape)
    (1, 4)
    >>> constrain(x, ("batch", "embed")) is x
    True
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise UsageError(f"constrain: x must be an array, got {type(x).__name__} "
                         f"({x!r:.60}). Fix: constrain(activation, ('batch', 'embed'))")
    active = current()
    if active is None:
        return x
    mesh, rules = active
    spec = rules.spec(names, shape=x.shape, mesh=mesh, path="activation")
    return apply_sharding(x, NamedSharding(mesh, spec))
