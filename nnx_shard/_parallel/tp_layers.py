"""Stock layers run as collective matmuls, documented where public: :mod:`nnx_shard.tp_layers`."""

from __future__ import annotations

import dataclasses
import string
from typing import Any, Literal, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard._axes import axes_entry, entry_axes
from nnx_shard._errors import UsageError, short
from nnx_shard._low_rank import Adapter
from nnx_shard._mesh import current, option
from nnx_shard._parallel.collective_matmul import (
    OPTION,
    check_tokens,
    expect_projection,
    projection,
)
from nnx_shard._parallel.registry import ParallelOp, register

__all__ = ["ProjectionOp", "intercept"]

M = TypeVar("M")


def _out_spec(eq: str, w: jax.Array, names: tuple[Any, ...]) -> tuple[NamedSharding, str] | None:
    """The output layout that makes ``eq`` a column- or row-parallel collective matmul
    under the active rules, with the sequence letter; ``None`` for a plain einsum."""
    active = current()
    ins, out = eq.split("->")
    xl, wl = ins.split(",")
    if active is None or len(xl) < 3 or xl[0] not in out or xl[1] not in out or xl[1] in wl:
        return None
    mesh, rules = active
    if len(names) == w.ndim + 1:  # a stacked layer's names, read inside its loop
        names = names[1:]
    if len(names) != w.ndim:
        return None
    w_spec = tuple(rules.spec(names, shape=w.shape, mesh=mesh))
    w_spec += (None,) * (w.ndim - len(w_spec))
    seq_axes = entry_axes(rules.spec(("length",), mesh=mesh)[0])
    batch = entry_axes(rules.spec(("batch",), mesh=mesh)[0])
    if len(seq_axes) != 1:
        return None
    axis = seq_axes[0]
    split = [c for c, e in zip(wl, w_spec, strict=True) if axis in entry_axes(e)]
    if len(split) != 1:
        return None
    contracted = [c for c in wl if c in xl and c not in out]
    row = split[0] in contracted
    if row and split[0] != contracted[0]:
        return None  # the ring reduces over the first contracted letter only
    w_entries = {c: tuple(a for a in entry_axes(e) if a != axis or not row)
                 for c, e in zip(wl, w_spec, strict=True)}
    by_letter = {xl[0]: tuple(a for a in batch if a != axis), xl[1]: (axis,) if row else ()}
    entries = [by_letter.get(c, w_entries.get(c, ()) if c in wl else ()) for c in out]
    used = [a for axes in entries for a in axes]
    if len(used) != len(set(used)):
        return None  # the batch and the kernel claim one mesh axis: leave it to XLA
    return NamedSharding(mesh, PartitionSpec(*(axes_entry(a) for a in entries))), xl[1]


def _dot_general_eq(lhs: jax.Array, rhs: jax.Array, dims: Any) -> str | None:
    (lc, rc), (lb, rb) = dims
    if lb or rb or lhs.ndim + rhs.ndim > len(string.ascii_letters):
        return None
    letters = iter(string.ascii_letters)
    xl = [next(letters) for _ in range(lhs.ndim)]
    wl = [next(letters) for _ in range(rhs.ndim)]
    for i, j in zip(lc, rc, strict=True):
        wl[j] = xl[i]
    out = [c for i, c in enumerate(xl) if i not in lc] + [c for j, c in enumerate(wl)
                                                         if j not in rc]
    return f"{''.join(xl)},{''.join(wl)}->{''.join(out)}"


@dataclasses.dataclass(frozen=True)
class ProjectionOp:
    """A stock layer's ``dot_general`` (``kind='dot_general'``) or ``einsum_op``
    (``kind='einsum'``) that runs as a collective matmul where the active rules ask
    (see the module docs), else as the stock op. Frozen and hashable: it is a
    static attribute of the layer, part of its graph definition.

    Attributes:
      names: the logical names of the layer's kernel (its ``out_sharding``).
      kind: which of the layer's attributes it stands in for.

    >>> import jax.numpy as jnp
    >>> from nnx_shard.tp_layers import ProjectionOp
    >>> op = ProjectionOp(("embed", "mlp"), "dot_general")
    >>> op(jnp.ones((2, 3)), jnp.ones((3, 4)), (((1,), (0,)), ((), ()))).shape
    (2, 4)
    """

    names: tuple[Any, ...]
    kind: Literal["dot_general", "einsum"]

    def __post_init__(self) -> None:
        if self.kind not in ("dot_general", "einsum"):
            raise UsageError(f"ProjectionOp: kind must be 'dot_general' or 'einsum', got "
                             f"{short(self.kind, 40)}. Fix: ProjectionOp(names, 'dot_general')")
        if not isinstance(self.names, tuple) or not all(
                n is None or isinstance(n, str) for n in self.names):
            raise UsageError(f"ProjectionOp: names must be a tuple of logical names (str or "
                             f"None), got {short(self.names, 60)}. Fix: e.g. ('embed', 'mlp')")

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        if self.kind == "einsum":
            return self._einsum(*args, **kwargs)
        return self._dot_general(*args, **kwargs)

    def _dot_general(self, lhs: jax.Array, rhs: jax.Array, dims: Any, *args: Any,
                     **kwargs: Any) -> jax.Array:
        eq = self._wanted(kwargs) and _dot_general_eq(lhs, rhs, dims)
        y = self._ring(eq, lhs, rhs) if eq else None
        return y if y is not None else jax.lax.dot_general(lhs, rhs, dims, *args, **kwargs)

    def _einsum(self, eq: str, x: jax.Array, w: jax.Array, **kwargs: Any) -> jax.Array:
        y = self._ring(eq.replace(" ", ""), x, w) if self._wanted(kwargs) else None
        return y if y is not None else jnp.einsum(eq, x, w, **kwargs)

    @staticmethod
    def _wanted(kwargs: dict[str, Any]) -> bool:
        return (option(OPTION, False) not in (None, False)
                and kwargs.get("out_sharding") is None)

    def _ring(self, eq: str, x: jax.Array, w: jax.Array) -> jax.Array | None:
        if eq.count(",") != 1 or "..." in eq:
            return None
        layout = _out_spec(eq, w, self.names)
        if layout is None:
            return None
        # The ring splits the batch and the sequence: say so in those terms, not in the
        # letters of the equation.
        check_tokens(tuple(int(d) for d in x.shape[:2]))
        return projection(eq, x, w, *layout)


_Kind = Literal["dot_general", "einsum"]
_STOCK: tuple[tuple[type, str, _Kind, tuple[Any, ...]], ...] = (
    (nnx.Einsum, "einsum_op", "einsum", (jnp.einsum,)),
    (nnx.LinearGeneral, "dot_general", "dot_general", (None, jax.lax.dot_general)),
    (nnx.Linear, "dot_general", "dot_general", (jax.lax.dot_general,)))


def intercept(model: M) -> M:
    """Sets the projection op of every stock ``nnx.Linear``, ``nnx.LinearGeneral`` and
    ``nnx.Einsum`` in ``model`` whose kernel carries logical names (and whose op is
    still Flax's default) to a :class:`ProjectionOp`, in place; returns ``model``. A layer
    with a LoRA adapter (:func:`nnx_shard.lora`) keeps it: the adapter calls the
    :class:`ProjectionOp` in place of the op it wraps, then adds its own term.

    Under the ``async_tp`` strategy those layers then run as collective matmuls; under
    any other rules (or none) they compute what the stock op computes. Layers with a
    custom ``dot_general`` / ``dot_general_cls`` / ``einsum_op``, or unannotated
    kernels, are left alone. Calling it again changes nothing.

    Args:
      model: a module with stock projection layers whose kernels carry logical names.

    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> from nnx_shard.tp_layers import intercept
    >>> init = ns.with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    >>> mlp = nnx.Sequential(nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0)),
    ...                      nnx.Linear(8, 4, rngs=nnx.Rngs(0)))  # unannotated: left alone
    >>> [type(layer.dot_general).__name__ for layer in intercept(mlp).layers]
    ['ProjectionOp', 'function']
    """
    if not isinstance(model, nnx.Module | list | tuple | dict):
        raise UsageError(f"tp_layers.intercept: model must be an nnx.Module (or a list, tuple "
                         f"or dict of them), got {type(model).__name__} {short(model, 40)}. "
                         "Fix: intercept(model) with the model the step trains")
    for _, node in nnx.iter_graph(model):
        for cls, attr, kind, defaults in _STOCK:
            if not isinstance(node, cls):
                continue
            layer: Any = node
            holder, slot = layer, attr
            current_op = getattr(layer, attr)
            if isinstance(current_op, Adapter) and current_op.op == kind:
                holder, slot, current_op = current_op, "inner", current_op.inner
            custom = getattr(layer, "dot_general_cls", None) is not None
            if custom or not any(current_op is d for d in defaults):
                break
            names = _kernel_names(layer.kernel)
            if names:
                setattr(holder, slot, ProjectionOp(tuple(names), kind))
            break
    return model


def _kernel_names(kernel: Any) -> Any:
    # A QLoRA kernel (a QuantizedKernel) keeps the names on its stored values.
    meta = getattr(kernel, "qvalue", kernel).get_metadata()
    return meta.get("out_sharding")


def _prepare(nodes: Any) -> None:
    intercept(nodes)


# The fused step checks that some projection ran as a ring (expect_projection) and
# intercepts the stock layers of its traced copy first.
register(ParallelOp("collective_matmul", OPTION, check_step=expect_projection,
                    prepare=_prepare))
