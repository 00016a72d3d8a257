"""Sharding-aware primitives the reference models are written with.

Model code names the layout it wants for each activation (logical names, as
everywhere in nnx_shard); these helpers turn that into what the active mesh
needs. Under an Auto-typed mesh (GSPMD propagation) a sharding constraint on
the output is enough. Under an Explicit-typed mesh (JAX's default) a matmul
whose operands are sharded along different dimensions by the same mesh axis,
e.g. an FSDP weight sharded on ``embed`` times activations sharded on
``batch``, both over ``data``, is a type error, so the weight is first
resharded to a layout compatible with the activations (the all-gather FSDP
implies) and the output sharding is passed explicitly. Outside
:func:`nnx_shard.use` they are plain ``jnp`` calls, except that parameters
sharded over Explicit axes are gathered whole first (so a restored or
sharded model can also be called under a plain ``nnx.jit``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from nnx_shard._axes import axes_entry, entry_axes
from nnx_shard._low_rank import adapter_name, lora_equations
from nnx_shard._mesh import constrain, current, option
from nnx_shard._parallel.collective_matmul import projection

__all__ = ["constrain", "einsum", "lookup", "project", "whole"]


def _explicit() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and any(t == AxisType.Explicit for t in mesh.axis_types)


def _explicitly_sharded(a: jax.Array) -> bool:
    """``a`` is typed sharded over an Explicit mesh axis (whatever the context mesh)."""
    sharding = jax.typeof(a).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return False
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                if t == AxisType.Explicit}
    return any(axis in explicit for entry in sharding.spec for axis in entry_axes(entry))


def _gathered(w: jax.Array) -> jax.Array:
    # With no rules active nothing says how to lay the result out; a parameter
    # sharded over Explicit axes is gathered whole (as FSDP would) so that the
    # operation is well-typed, and activations keep the layout of the inputs.
    if not _explicitly_sharded(w):
        return w
    return jax.sharding.reshard(w, NamedSharding(jax.typeof(w).sharding.mesh, PartitionSpec()))


def _spec_of(x: jax.Array) -> tuple[Any, ...]:
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def _compatible(x_letters: str, x: jax.Array, w_letters: str, w: jax.Array) -> jax.Array:
    """``w`` resharded so that no mesh axis shards one dimension of ``x`` and a
    different dimension of ``w`` (Explicit meshes only)."""
    x_use = {}
    for letter, entry in zip(x_letters, _spec_of(x), strict=True):
        for axis in entry_axes(entry):
            x_use[axis] = letter
    w_spec = _spec_of(w)
    new = []
    for letter, entry in zip(w_letters, w_spec, strict=True):
        kept = tuple(a for a in entry_axes(entry) if x_use.get(a, letter) == letter)
        new.append(axes_entry(kept))
    if tuple(new) == w_spec:
        return w
    return jax.sharding.reshard(w, PartitionSpec(*new))


def _resolve(names: Sequence[str | None], shape: Sequence[int]) -> NamedSharding | None:
    active = current()
    if active is None:
        return None
    mesh, rules = active
    return NamedSharding(mesh, rules.spec(names, shape=shape, mesh=mesh, path="activation"))


def einsum(
    eq: str, x: jax.Array, w: jax.Array, names: Sequence[str | None], *, seq: str | None = None,
    reduce: Sequence[str | None] | None = None,
) -> jax.Array:
    """``jnp.einsum(eq, x, w)`` whose output is laid out by logical ``names``.

    ``seq`` names the letter of the sequence dimension of a tensor-parallel
    projection: under rules with the option ``collective_matmul`` (the
    ``async_tp`` strategy) the sequence is gathered into (or scattered out of)
    the matmul in ring steps, see :mod:`nnx_shard.collective_matmul`.

    ``reduce`` (a row-parallel projection's) lays the product out by those names
    before ``names`` on Auto meshes: under sequence parallelism the whole sequence,
    where the partial sums over the split contraction meet, before the sequence is
    split. The gradient then takes the sequence whole into the transposed product,
    which keeps the kernel split; left to itself XLA's partitioner may instead gather
    the kernel whole on every device (the attention output's, under sp on tiny shapes).

    >>> import jax.numpy as jnp
    >>> einsum("bd,df->bf", jnp.ones((2, 3)), jnp.ones((3, 4)), ("batch", None)).shape
    (2, 4)
    """
    ins, out = eq.split("->")
    xl, wl = ins.split(",")
    sizes = dict(zip(xl, x.shape, strict=True)) | dict(zip(wl, w.shape, strict=True))
    sharding = _resolve(names, [sizes[c] for c in out])
    if sharding is None:
        return jnp.einsum(eq, x, _gathered(w))
    if seq is not None and option("collective_matmul", False):
        y = projection(eq, x, w, sharding, seq)
        if y is not None:
            return y
    if _explicit():
        w = _compatible(xl, x, wl, w)
        return jnp.einsum(eq, x, w, out_sharding=sharding.spec)
    y = jnp.einsum(eq, x, w)
    if reduce is not None:
        first = _resolve(reduce, y.shape)
        if first is not None and first.spec != sharding.spec:
            y = jax.lax.with_sharding_constraint(y, first)
    return jax.lax.with_sharding_constraint(y, sharding)


def lookup(table: jax.Array, ids: jax.Array, names: Sequence[str | None],
           table_names: Sequence[str | None] | None = None) -> jax.Array:
    """Rows ``table[ids]`` laid out by logical ``names`` (an embedding lookup).

    On Explicit meshes the table is gathered whole first (a gather from a sharded
    table indexed by a sharded array has no Explicit typing rule). On Auto meshes,
    ``table_names`` (the table's own logical names, e.g. ``("vocab", "embed")``) let
    the lookup lay itself out where a mesh axis splits both the table and the tokens
    (:func:`_clash_layout`) rather than leave that to XLA's partitioner.

    >>> import jax.numpy as jnp
    >>> lookup(jnp.eye(4), jnp.array([[1, 2]]), ("batch", "length", None)).shape
    (1, 2, 4)
    """
    sharding = _resolve(names, (*ids.shape, table.shape[-1]))
    if sharding is None:
        return jnp.take(_gathered(table), ids, axis=0)
    if _explicit():
        table = jax.sharding.reshard(table, PartitionSpec())
        return table.at[ids].get(out_sharding=sharding.spec)
    between = None
    if table_names is not None:
        table, ids, between = _clash_layout(table, ids, sharding, table_names)
    rows = jnp.take(table, ids, axis=0)
    if between is not None:
        rows = jax.lax.with_sharding_constraint(rows, between)
    return jax.lax.with_sharding_constraint(rows, sharding)


def _clash_layout(table: jax.Array, ids: jax.Array, out: NamedSharding,
                  table_names: Sequence[str | None],
                  ) -> tuple[jax.Array, jax.Array, NamedSharding | None]:
    """``(table, ids, between)`` for :func:`lookup` on an Auto mesh, when the rules split
    the table (laid out by ``table_names``) and the tokens of ``out`` over one mesh axis:
    across those axes either the table or the tokens must move.

    * The rows (``vocab`` over a tensor-parallel axis, the tokens split over it too, as
      under sequence parallelism): the tokens move. ``ids`` are gathered over those
      axes, each device looks up the rows it holds and the partial rows are summed to
      ``out`` (``between`` at the table's own width split). Gathering the table there
      would hold the whole vocabulary on every device, which splitting it avoids.
    * Only the width (``embed`` over FSDP's axis, the batch over it too): whichever
      moves fewer bytes per device. The table's width is gathered (what FSDP does for
      any parameter) when the rows a device holds, times the devices of the clash, are
      fewer than the tokens it would otherwise take; else the tokens move: ``ids``
      gathered, the rows looked up at the table's width split, then moved to ``out``
      (an all-to-all, and back for the gradient, which so stays width-split).

    Left to XLA's partitioner, the jax 0.12 one logs "Involuntary full
    rematerialization" for this lookup's gradient under fsdp_tp and pp_fsdp (it cannot
    move the tokens to width-split between the two ways it writes layouts) and at some
    shapes replicates it; see docs/architecture.md. ``(table, ids, None)`` when nothing
    clashes (or a layout is unconstrained).
    """
    active = current()
    if active is None:
        return table, ids, None
    mesh, rules = active
    spec = rules.spec(tuple(table_names), shape=table.shape, mesh=mesh, path="embedding table")
    t_rows, t_width = (*spec, None, None)[:2]
    o_spec = (*out.spec, *(None,) * (ids.ndim + 1 - len(out.spec)))
    if any(e is PartitionSpec.UNCONSTRAINED for e in (t_rows, t_width, *o_spec)):
        return table, ids, None
    token_axes = {a for e in o_spec[:-1] for a in entry_axes(e)}
    rows_clash = set(entry_axes(t_rows)) & token_axes
    width_clash = set(entry_axes(t_width)) & token_axes
    if not rows_clash and not width_clash:
        return table, ids, None

    def size(axes: Any) -> int:
        return math.prod(mesh.shape[a] for a in axes)

    if not rows_clash:
        rows = table.shape[0] // size(entry_axes(t_rows))
        tokens = math.prod(ids.shape) // size(token_axes - width_clash)
        if rows * size(width_clash) < tokens:
            width = axes_entry(tuple(a for a in entry_axes(t_width) if a not in width_clash))
            table = jax.lax.with_sharding_constraint(
                table, NamedSharding(mesh, PartitionSpec(t_rows, width)))
            return table, ids, None
    clash = rows_clash | width_clash
    ids_spec = [axes_entry(tuple(a for a in entry_axes(e) if a not in clash))
                for e in o_spec[:-1]]
    ids = jax.lax.with_sharding_constraint(ids, NamedSharding(mesh, PartitionSpec(*ids_spec)))
    return table, ids, NamedSharding(mesh, PartitionSpec(*ids_spec, t_width))


def whole(w: jax.Array) -> jax.Array:
    """``w`` replicated on Explicit meshes (the all-gather FSDP implies before a
    parameter meets activations elementwise); ``w`` itself otherwise, where the
    partitioner chooses.

    >>> import jax.numpy as jnp
    >>> whole(jnp.ones(3)).shape
    (3,)
    """
    if current() is None:
        return _gathered(w)
    if not _explicit():
        return w
    return jax.sharding.reshard(w, PartitionSpec())


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token cross-entropy of float ``logits [..., vocab]`` and int ``labels [...]``.

    The label's logit is picked with a one-hot product rather than a gather, so
    logits sharded over ``vocab`` (tensor parallelism) reduce with one small
    all-reduce, on Auto and Explicit meshes alike.

    >>> import jax.numpy as jnp
    >>> float(cross_entropy(jnp.zeros((1, 4)), jnp.array([2]))[0])  # log(4)
    1.386...
    """
    logits = logits.astype(jnp.float32)
    picked = jnp.sum(logits * jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype), -1)
    return jax.nn.logsumexp(logits, axis=-1) - picked


def project(eq: str, x: jax.Array, owner: Any, name: str, dt: Any,
            names: Sequence[str | None], *, seq: str | None = None,
            reduce: Sequence[str | None] | None = None,
            deterministic: bool | None = None) -> jax.Array:
    """The projection ``einsum(eq, x, owner.<name>)`` in the compute dtype ``dt``,
    laid out by ``names`` (``reduce`` first, see :func:`einsum`), plus the LoRA adapter's
    ``scale * (dropout(x) @ A) @ B`` when the kernel has one (``owner.lora_<name>``,
    :func:`nnx_shard.lora`). The adapter's einsums come from ``eq``'s letters
    (:func:`nnx_shard._low_rank.lora_equations`); ``deterministic=True`` turns its
    dropout off (decoding).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> class Proj(nnx.Module):
    ...     lora_kernels = ("w",)
    ...     def __init__(self):
    ...         self.w = nnx.Param(jnp.ones((3, 4)))
    >>> owner = Proj()
    >>> float(project("bd,df->bf", jnp.ones((2, 3)), owner, "w", jnp.float32, ("batch", None))[0, 0])
    3.0
    >>> import nnx_shard as ns
    >>> _ = ns.lora(owner, 2, 2.0, targets="w")
    >>> owner.lora_w.lora_b[...] = jnp.ones((2, 4))
    >>> y = project("bd,df->bf", jnp.ones((2, 3)), owner, "w", jnp.float32, ("batch", None))
    >>> bool(jnp.allclose(y, 3.0 + jnp.ones(3) @ owner.lora_w.lora_a[...] @ jnp.ones((2, 4))))
    True
    """
    kernel = getattr(owner, name)
    if hasattr(kernel, "contract"):  # a quantized base: dequantized tile by tile
        y = kernel.contract(eq, x, dt, partial(einsum, names=names, seq=seq, reduce=reduce))
    else:
        y = einsum(eq, x, kernel[...].astype(dt), names, seq=seq, reduce=reduce)
    adapter = getattr(owner, adapter_name(name), None)
    if adapter is None:
        return y
    eq_a, eq_b = lora_equations(eq)
    out = eq.split("->")[1]
    by_letter = dict(zip(out, names, strict=True))
    rank_out = eq_a.split("->")[1]
    h = einsum(eq_a, adapter.dropped(x, deterministic), adapter.lora_a[...].astype(dt),
               [by_letter.get(c) for c in rank_out])
    h = h * jnp.asarray(adapter.scale, dt)
    return y + einsum(eq_b, h, adapter.lora_b[...].astype(dt), names)
