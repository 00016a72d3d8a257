"""What a checkpoint says about itself: the flat leaves of a model, the checksum of
every array, the storage kind of a quantized base's codes, the layouts restored
arrays take, and the manifest's digest and checks."""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from nnx_shard._annotate import path_str
from nnx_shard._checkpoint._internal import _FORMAT, _FORMATS, _HASH_BATCH_BYTES, _ITEMS
from nnx_shard._errors import ShardingError, UsageError
from nnx_shard._mesh import current, nbytes
from nnx_shard._offload import traced_on_device
from nnx_shard._quantized import QuantizedKernel

# --------------------------------------------------------------------------- leaves


def is_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def key_impl_name(keys: jax.Array) -> str:
    return str(jax.random.key_impl(keys))


def flatten_state(obj: Any, what: str) -> tuple[Any, Any, list[tuple[tuple[Any, ...], str, Any]]]:
    """(graphdef, state, [(path, 'a/b/c', Variable)]) of an NNX object."""
    if not (isinstance(obj, nnx.Module | nnx.Optimizer) or nnx.graphlib.is_graph_node(obj)):
        raise UsageError(
            f"{what} must be an NNX object (nnx.Module or nnx.Optimizer), got "
            f"{type(obj).__name__}. Fix: pass the model (or optimizer) itself, e.g. "
            f"{what}=ns.sharded_init(factory, mesh, rules)."
        )
    graphdef, state = nnx.split(obj)
    rows = []
    for path, var in nnx.to_flat_state(state):
        rows.append((tuple(path), path_str(path), var))
    return graphdef, state, rows


def quant_kinds(obj: Any) -> dict[str, str]:
    """The storage kind (``"nf4"``, ``"int4"``, ``"int8"``) of each quantized kernel's
    codes in ``obj``, by the codes' flat path (``.../q/qvalue``). NF4 and int4 codes
    are both int4 arrays of the kernel's shape: only this record tells them apart,
    and the same bits read as the other kind are other weights.

    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> quant_kinds(ns.lora(nnx.Linear(128, 4, rngs=nnx.Rngs(0)), 2, 4.0, targets="kernel",
    ...                     quantize="nf4"))
    {'kernel/qvalue': 'nf4'}
    """
    if not (isinstance(obj, nnx.Module | nnx.Optimizer) or nnx.graphlib.is_graph_node(obj)):
        return {}
    return {path_str((*path, "qvalue")): node.qtype for path, node in nnx.iter_graph(obj)
            if isinstance(node, QuantizedKernel)}


def var_value(var: Any) -> Any:
    return var.get_value() if isinstance(var, nnx.Variable) else var


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{'a/b': x} -> {'a': {'b': x}}: orbax stores nested dicts of arrays."""
    out: dict[str, Any] = {}
    for key, x in flat.items():
        node = out
        *head, last = key.split("/")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = x
    return out


def unnest(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(unnest(v, key))
        else:
            out[key] = v
    return out


# --------------------------------------------------------------------------- checksums


def _bits(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 (one element per 8/16/32 bits, two per 64)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype.name in ("int4", "int2"):  # sub-byte ints (a quantized base): exact in 8 bits
        x = x.astype(jnp.int8)
    if x.dtype.name in ("uint4", "uint2"):
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    size = x.dtype.itemsize
    if size == 4 or size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if size == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)  # pragma: no cover


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major position (mod 2**32), whatever the array's sharding."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(
            stride % 2**32
        )
        stride *= shape[d]
    return index


def _hash_v1(x: jax.Array) -> jax.Array:
    """Format 1's checksum: [sum of the bits, sum of bits * (2*index + 1)], mod 2**32.

    Kept to check checkpoints of format 1 only: it is linear in the bits, so it
    collapses on round constants (a float32 array of ones, 512 long, sums to
    2**32 * 127 = 0 in both lanes).
    """
    u = _bits(x)
    if u.ndim == 0:
        u = u[None]
    weights = _flat_index(u.shape) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * weights, dtype=jnp.uint32)])


def _mix(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection that spreads every input bit."""
    x = x ^ (x >> jnp.uint32(16))
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> jnp.uint32(13))
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> jnp.uint32(16))


def _hash(x: jax.Array) -> jax.Array:
    """Two 32-bit lanes, each a sum over elements of mix(bits, mix(position, seed)).

    A sum mod 2**32 is exact and order-free, so the result does not depend on how
    the array is sharded (it is checked after restoring onto another layout); each
    term is a non-linear mix of an element's bits and its position, so no constant
    or round array collapses (format 1's linear sums did), and values moved between
    places change it.
    """
    u = _bits(x)
    if u.ndim == 0:
        u = u[None]
    index = _flat_index(u.shape)
    a = _mix(u ^ _mix(index + jnp.uint32(0x9E3779B9)))
    b = _mix((u * jnp.uint32(0x27D4EB2F)) ^ _mix(index ^ jnp.uint32(0x165667B1)))
    return jnp.stack([jnp.sum(a, dtype=jnp.uint32), jnp.sum(b, dtype=jnp.uint32)])


@functools.partial(jax.jit, static_argnums=1)
def _hash_all(xs: list[jax.Array], version: int) -> list[jax.Array]:
    fn = _hash if version >= 2 else _hash_v1
    # Offloaded arrays (host memory) are hashed on the devices: the ops mix no memory spaces.
    return [fn(traced_on_device(x)) for x in xs]


def checksums_of(values: Sequence[jax.Array], version: int = _FORMAT) -> list[list[int]]:
    """One [a, b] pair per array (the checksum of manifest format ``version``); one
    compiled call per set of devices and batch.

    Hashing takes temporaries about twice the size of its input, so arrays are
    hashed in batches of at most ``_HASH_BATCH_BYTES``: memory stays bounded
    whatever the model's size (a restore's host memory is what it costs).

    >>> import jax.numpy as jnp
    >>> ones = checksums_of([jnp.ones(512)])[0]
    >>> ones != [0, 0], checksums_of([jnp.ones(512)], version=1)[0]
    (True, [0, 0])
    """
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(values):
        committed = getattr(x, "committed", True)
        key = frozenset(d.id for d in x.sharding.device_set) if committed else None  # type: ignore[attr-defined]
        groups.setdefault(key, []).append(i)
    out: list[list[int]] = [[]] * len(values)
    for idx in groups.values():
        batches: list[list[int]] = [[]]
        size = 0
        for i in idx:
            n = nbytes(values[i].shape, values[i].dtype)
            if batches[-1] and size + n > _HASH_BATCH_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(i)
            size += n
        for batch in batches:
            # One call at a time, blocked on: it holds collectives (see docs/architecture.md).
            hashes = jax.device_get(_hash_all([values[i] for i in batch], version))
            for i, h in zip(batch, hashes, strict=True):
                out[i] = [int(h[0]), int(h[1])]
    return out


# --------------------------------------------------------------------------- layouts


def _concrete_mesh(abstract: AbstractMesh) -> Mesh:
    ctx = current()
    for mesh in (ctx[0] if ctx else None, jax.sharding.get_mesh()):
        if (
            isinstance(mesh, Mesh)
            and not mesh.empty
            and mesh.axis_names == abstract.axis_names
            and tuple(mesh.axis_sizes) == tuple(abstract.axis_sizes)
        ):
            return mesh
    size = math.prod(abstract.axis_sizes)
    devices = jax.devices()
    if size > len(devices):
        raise ShardingError(
            f"restore: the target is laid out on an abstract mesh {dict(abstract.shape)} "
            f"({size} devices) but only {len(devices)} devices exist. Fix: build the target "
            "with ns.abstract_init(factory, mesh, rules) on a mesh of these devices."
        )
    return Mesh(
        np.asarray(devices[:size]).reshape(abstract.axis_sizes),
        abstract.axis_names,
        axis_types=abstract.axis_types,
    )


def target_sharding(x: Any) -> jax.sharding.Sharding:
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        # Unplaced values (a target from jax.eval_shape, NumPy arrays) go to one device.
        return SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
        # nnx.eval_shape under a mesh gives shardings on an AbstractMesh, which
        # cannot hold data: read onto the concrete mesh with those axes.
        return NamedSharding(_concrete_mesh(sharding.mesh), sharding.spec)
    return sharding


def key_data_sharding(sharding: jax.sharding.Sharding, ndim: int) -> jax.sharding.Sharding:
    """The sharding of ``key_data`` of keys laid out by ``sharding`` (one more dim)."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return NamedSharding(sharding.mesh, PartitionSpec(*spec, None))
    return sharding


def _canonical(x: Any) -> bytes:
    return json.dumps(x, sort_keys=True, separators=(",", ":")).encode()


def extra_hash(extra: Any) -> str:
    """sha256 of ``extra`` as JSON: the manifest's record of extra/metadata."""
    return hashlib.sha256(_canonical(extra)).hexdigest()


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """The manifest's digest, stored in it: a damaged manifest (a flipped byte in a
    name, a shape, a checksum, the step or extra's hash) is caught as such. Format
    1 digested the entries only."""
    if manifest.get("format") == 1:
        return hashlib.sha256(_canonical(manifest.get("items"))).hexdigest()
    return hashlib.sha256(_canonical({k: v for k, v in manifest.items() if k != "digest"})).hexdigest()


_ENTRY_KEYS = {"shape", "dtype", "key", "checksum"}
#: Written on a quantized kernel's codes only (checkpoints from before it have none).
QUANT_KEY = "quant"
_MANIFEST_KEYS = {1: {"format", "items", "digest"},
                  2: {"format", "step", "items", "extra", "digest"}}


def _entry_problem(name: str, key: str, e: Any) -> str | None:
    if not isinstance(e, Mapping) or set(e) - {QUANT_KEY} != _ENTRY_KEYS:
        got = sorted(e) if isinstance(e, Mapping) else type(e).__name__
        return f"entry {name}/{key} has {got}, not {sorted(_ENTRY_KEYS)}"
    kind = e.get(QUANT_KEY)
    if QUANT_KEY in e and not (isinstance(kind, str) and 0 < len(kind) <= 40):
        return f"entry {name}/{key} has the quantization kind {kind!r:.60}"
    shape, dtype, impl, checksum = e["shape"], e["dtype"], e["key"], e["checksum"]
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        return f"entry {name}/{key} has the shape {shape!r}"
    try:
        jnp.dtype(dtype)
    except TypeError:
        return f"entry {name}/{key} has the dtype {dtype!r}"
    if impl is not None:
        try:
            jax.eval_shape(lambda: jax.random.key(0, impl=impl))
        except (TypeError, ValueError):
            return f"entry {name}/{key} names the PRNG implementation {impl!r}"
    if not (
        isinstance(checksum, list)
        and len(checksum) == 2
        and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 2**32 for c in checksum)
    ):
        return f"entry {name}/{key} has the checksum {checksum!r}"
    return None


def manifest_problem(manifest: Any) -> str | None:
    """What is wrong with a manifest read back, or None."""
    if not isinstance(manifest, Mapping):
        return f"is not a JSON object ({manifest!r:.60})"
    fmt = manifest.get("format")
    if fmt not in _FORMATS or isinstance(fmt, bool):
        return (f"has format {fmt!r:.40}; this nnx_shard reads formats "
                f"{', '.join(map(str, _FORMATS))} (a newer nnx_shard may have written it)")
    unknown = sorted(set(manifest) - _MANIFEST_KEYS[fmt])
    if unknown:
        return f"has unexpected keys {unknown}"
    if "digest" not in manifest:
        return ("has no digest (written by an nnx_shard older than the manifest's digest, "
                "which this one no longer reads)")
    items = manifest.get("items")
    if not isinstance(items, Mapping):
        return "has no 'items'"
    if manifest["digest"] != manifest_digest(manifest):
        return "does not match the digest written with it"
    if fmt >= 2:
        step = manifest.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            return f"has the step {step!r:.40}"
        if not isinstance(manifest.get("extra"), str):
            return "has no hash of extra"
    for name, entries in items.items():
        if name not in _ITEMS or not isinstance(entries, Mapping):
            return f"has an item {name!r} that nnx_shard does not write"
        for key, entry in entries.items():
            problem = _entry_problem(name, key, entry)
            if problem:
                return problem
    return None
