"""The gradient norm of fit's steps, reduced cheaply: the small replicated leaves as one
vector per dtype (:func:`join_small`, shared with the NaN guard's finiteness check) and
sharded gradients as per-device shares summed once a fused call
(:func:`grad_sq_shares`).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# NamedSharding: a name grad_sq_shares' example reads from the module's globals.
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: F401

from nnx_shard._offload import host_rows, traced_host

__all__ = ["grad_sq_shares", "grads_norm", "join_small"]


def _per_layer(x: jax.Array, reduce: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``reduce`` of a gradient in host memory (a streamed stack's, see
    ``nnx_shard._train._stream``), computed on the device a layer slice at a time
    (:func:`~nnx_shard._offload.host_rows`), the per-slice results summed; a scalar
    is moved in whole."""
    if np.ndim(x) == 0:
        return reduce(jax.device_put(x, jax.memory.Space.Device))
    return jnp.sum(host_rows(x, reduce), axis=0)


def _sq(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.real(x * jnp.conj(x)))


# Gradient leaves up to this many elements are summed as one concatenated vector.
_SMALL_LEAF = 1 << 16


def _known_replicated(x: jax.Array, replicated: bool) -> bool:
    """Whether ``x`` (traced) is replicated: seen in its type on Explicit axes, else
    ``replicated`` (what the host saw of the parameters' shardings)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None) or ()
    if any(entry is not None for entry in spec):
        return False
    mesh = getattr(sharding, "mesh", None)
    explicit = (mesh is not None and not mesh.empty
                and all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types))
    return explicit or replicated


def grads_norm(grads: Any, replicated: bool = False) -> jax.Array:
    """``optax.tree.norm(grads)``, with the small replicated leaves summed as one vector.

    XLA's CPU backend runs every reduction as a kernel of its own, and for the
    small leaves of a small model that fixed cost dominates: one reduction over
    the concatenated small leaves (a copy of at most ``_SMALL_LEAF`` elements
    each) costs a fraction of one per leaf (docs/benchmarks.md, "Fused
    training"). Sharded leaves keep
    their own reduction (a concatenation would gather them).

    >>> import optax
    >>> g = {"b": jnp.ones((3,)), "w": jnp.full((2, 2), 2.0)}
    >>> bool(grads_norm(g) == optax.tree.norm(g)), round(float(grads_norm(g)) ** 2, 4)
    (True, 19.0)
    """
    leaves = jax.tree.leaves(grads)
    # Host-memory gradients (a streamed stack's) are read a layer at a time.
    sums = [_per_layer(x, _sq) for x in leaves if traced_host(x)
            and jnp.issubdtype(x.dtype, jnp.floating)]
    whole, joined = join_small([x for x in leaves if not traced_host(x)], replicated,
                               lambda x: jnp.issubdtype(x.dtype, jnp.floating))
    sums += [_sq(x) for x in whole]
    sums += [jnp.sum(flat * flat) for flat in joined]
    return jnp.sqrt(sum(sums)) if sums else jnp.zeros(())

def _typed_spec(x: jax.Array) -> PartitionSpec | None:
    """``x``'s spec from its traced type, where the type holds it (all axes Explicit)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if sharding is None or mesh is None or mesh.empty or not mesh.are_all_axes_explicit:
        return None
    return sharding.spec


def grad_sq_shares(
    grads: Any, specs: Sequence[PartitionSpec] | None, mesh: Mesh | None
) -> jax.Array | None:
    """Each device's share of the squared gradient norm: a ``[mesh.size]`` vector,
    sharded one entry per device, whose sum is ``optax.tree.norm(grads) ** 2``.

    Summing sharded leaves to one scalar takes a cross-device reduction; inside a
    fused call that is one more collective every step. Here every device sums the
    squares of its own blocks (a block held by several devices counted once, on
    the first of them), and the K steps' shares are summed across devices once,
    at the end of the call; what that saves under fsdp is measured by
    ``benchmarks/fit_call_cost.py`` (docs/benchmarks.md, "Fused training"). ``specs`` are the gradient leaves' specs
    on ``mesh`` (the parameters', read on the host; Explicit axes give their
    own). None where it does not apply: one device, a layout not known, or every
    leaf replicated (then nothing is sharded and :func:`grads_norm` needs no
    collective).

    >>> import optax
    >>> mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> w = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, PartitionSpec("data")))
    >>> g = {"w": w, "b": jnp.ones(3)}
    >>> shares = grad_sq_shares(g, [PartitionSpec(), PartitionSpec("data")], mesh)
    >>> shares.shape, float(shares.sum()), float(optax.tree.norm(g) ** 2)
    ((2,), 17.0, 17.0)
    """
    leaves = jax.tree.leaves(grads)
    if mesh is None or mesh.size == 1 or specs is None or len(specs) != len(leaves):
        return None
    specs = [_typed_spec(x) or spec for x, spec in zip(leaves, specs, strict=True)]
    used = [{a for entry in spec if entry is not None
             for a in (entry if isinstance(entry, tuple) else (entry,))} for spec in specs]
    if not any(used):
        return None
    host = [i for i, x in enumerate(leaves) if traced_host(x)]
    near = [i for i, x in enumerate(leaves) if not traced_host(x)]
    total = _shares([leaves[i] for i in near], [specs[i] for i in near],
                    [used[i] for i in near], mesh)
    # Host-memory gradients (a streamed stack's, whose layer axis is not split) give
    # their shares a layer slice at a time, the slice laid out as the rest of the spec.
    for i in host:
        part = _per_layer(leaves[i], functools.partial(
            _row_shares, spec=PartitionSpec(*tuple(specs[i])[1:]), used=used[i], mesh=mesh))
        total = part if total is None else total + part
    return total


def _row_shares(row: jax.Array, spec: PartitionSpec, used: set[str], mesh: Mesh) -> jax.Array:
    shares = _shares([row], [spec], [used], mesh)
    assert shares is not None  # one leaf given
    return shares


def _shares(leaves: Sequence[jax.Array], specs: Sequence[PartitionSpec],
            used: Sequence[set[str]], mesh: Mesh) -> jax.Array | None:
    """:func:`grad_sq_shares` of ``leaves`` (on device) with their specs and the mesh
    axes each spec uses; None for no leaves."""
    if not leaves:
        return None
    axes = tuple(mesh.axis_names)

    def local(*blocks: jax.Array) -> jax.Array:
        # Blocks replicated over the same axes are summed together, then kept only
        # on the devices at index 0 of those axes.
        groups: dict[tuple[str, ...], list[jax.Array]] = collections.defaultdict(list)
        for x, on in zip(blocks, used, strict=True):
            if jnp.issubdtype(x.dtype, jnp.inexact):
                groups[tuple(a for a in axes if a not in on)].append(_sq(x))
        total = jnp.zeros((), jnp.float32)
        for over, sums in groups.items():
            part = sum(sums)
            if over:
                first = functools.reduce(jnp.logical_and,
                                         [jax.lax.axis_index(a) == 0 for a in over])
                part = jnp.where(first, part, jnp.zeros_like(part))
            total = total + part
        return total[None]

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs),
                         out_specs=PartitionSpec(axes), check_vma=False)(*leaves)


def join_small(
    leaves: Sequence[Any], replicated: bool, joinable: Callable[[Any], bool]
) -> tuple[list[Any], list[jax.Array]]:
    """``leaves`` split into those kept whole and one flat vector per dtype of the
    small replicated ones ``joinable`` accepts (a copy of at most ``_SMALL_LEAF``
    elements each): what :func:`grads_norm` and :func:`all_finite` reduce."""
    whole, small = [], collections.defaultdict(list)
    for x in leaves:
        if joinable(x) and x.size <= _SMALL_LEAF and _known_replicated(x, replicated):
            small[x.dtype].append(x.reshape(-1))
        else:
            whole.append(x)
    return whole, [parts[0] if len(parts) == 1 else jnp.concatenate(parts)
                   for parts in small.values()]
