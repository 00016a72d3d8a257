"""The active ``(mesh, rules)`` context: :func:`use`, what it makes readable
(:func:`current`, the execution :func:`option` s of the rules) and the activation
constraints it enables (:func:`constrain`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from nnx_shard._errors import UsageError
from nnx_shard._frames import Frames
from nnx_shard._mesh._build import make_mesh
from nnx_shard._mesh._placement import apply_sharding
from nnx_shard._rules import Rules, as_rules

__all__ = ["constrain", "current", "option", "use"]


# The (mesh, rules) of each enclosing use(), innermost last.
_active: Frames[tuple[Mesh, Rules]] = Frames()


@contextlib.contextmanager
def use(mesh: Mesh | str | Mapping[str, int], rules: Rules | Mapping[str, Any]) -> Iterator[Mesh]:
    """Makes ``(mesh, rules)`` active: JAX's mesh context plus the rules that
    :func:`constrain` and the trainer read.

    Args:
      mesh: a ``Mesh`` or a spec for :func:`nnx_shard.make_mesh` (``"data=4,model=2"``).
      rules: the logical-to-mesh table (:class:`~nnx_shard.Rules` or a dict).

    >>> from nnx_shard import Rules, use
    >>> rules = Rules({"batch": "data"})
    >>> with use("data=8", rules) as mesh:
    ...     dict(mesh.shape)
    {'data': 8}
    """
    mesh = make_mesh(mesh)
    rules = as_rules(rules)
    with _active.push((mesh, rules)), jax.set_mesh(mesh):
        yield mesh


def current() -> tuple[Mesh, Rules] | None:
    """The innermost active ``(mesh, rules)`` from :func:`use`, or ``None``.

    >>> current() is None
    True
    """
    return _active.top()


def option(name: str, default: Any = None) -> Any:
    """The execution option ``name`` of the innermost active rules
    (:attr:`nnx_shard.Rules.options`), or ``default`` outside :func:`use`.

    Sharding-aware operations read how a strategy wants them to run here
    (e.g. ring or all-gather attention), so switching strategy never edits
    model code.

    >>> rules = Rules({"batch": "data"}).with_options(attention="ring")
    >>> with use("data=8", rules):
    ...     option("attention"), option("missing", "local")
    ('ring', 'local')
    >>> option("attention", "local")
    'local'
    """
    active = current()
    if active is None:
        return default
    return active[1].options.get(name, default)


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

