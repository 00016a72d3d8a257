"""Checkpoints with orbax: save sharded, restore onto any mesh or strategy, resume exactly.

:func:`save` writes a model (every Variable: parameters, RNG state, batch
statistics), optionally its optimizer and a small JSON ``extra``, with each
process writing its own shards. :func:`restore` reads them into *targets* that
say where every array goes: an abstract model from
:func:`nnx_shard.abstract_init` (and :func:`nnx_shard.sharded_optimizer` on
it), or a concrete model. Each device reads exactly its own slice of each
array from disk, so a checkpoint written by FSDP on 8 devices restores onto
FSDP+TP on 4x2, or onto one device, without the whole model ever passing
through one device. :class:`Checkpointer` saves every N steps in the
background, keeps the last K, and is what ``Trainer.fit(checkpointer=...,
resume=True)`` uses.

On disk, one directory per step, written by orbax's ``CheckpointManager``::

    <directory>/<step>/model/       arrays (tensorstore, zarr in OCDBT)
    <directory>/<step>/optimizer/   arrays (only when an optimizer was saved)
    <directory>/<step>/extra/       JSON
    <directory>/<step>/manifest/    JSON: format, and per array its shape,
                                    dtype and a checksum of its bits

No pickle anywhere. A step is written under a temporary name
(``<step>.orbax-checkpoint-tmp-*``) and renamed when complete, so a save
killed half-way never looks like a checkpoint. Orbax's compressed chunks carry
no checksum (a flipped byte decodes to wrong values), hence the manifest:
restore recomputes every array's checksum on the devices and refuses a
mismatch.

Typed PRNG keys (``nnx.Rngs`` state) are stored as their ``uint32`` key data
and re-wrapped on restore with the implementation the target's dtype names.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from nnx_shard.mesh import current, nbytes

__all__ = ["Checkpointer", "restore", "restore_into", "save"]

_FORMAT = 1
_ITEMS = ("model", "optimizer")
_TMP_MARK = ".orbax-checkpoint-tmp"
_SHOW = 8  # paths listed in one error message before "... and N more"
# Bounds the host/device memory a restore or save needs beyond the state itself.
_HASH_BATCH_BYTES = 64 * 2**20
_RESTORE_CONCURRENT_GB = 0.25


def _ocp() -> Any:
    # orbax pulls in tensorstore and more; import it when checkpoints are used.
    import orbax.checkpoint as ocp

    return ocp


# --------------------------------------------------------------------------- leaves


def _is_key(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_impl(keys: jax.Array) -> str:
    return str(jax.random.key_impl(keys))


def _flat(obj: Any, what: str) -> tuple[Any, Any, list[tuple[tuple[Any, ...], str, Any]]]:
    """(graphdef, state, [(path, 'a/b/c', Variable)]) of an NNX object."""
    if not (isinstance(obj, nnx.Module | nnx.Optimizer) or nnx.graphlib.is_graph_node(obj)):
        raise TypeError(
            f"{what} must be an NNX object (nnx.Module or nnx.Optimizer), got "
            f"{type(obj).__name__}."
        )
    graphdef, state = nnx.split(obj)
    rows = []
    for path, var in nnx.to_flat_state(state):
        rows.append((tuple(path), "/".join(str(p) for p in path), var))
    return graphdef, state, rows


def _value(var: Any) -> Any:
    return var.get_value() if isinstance(var, nnx.Variable) else var


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{'a/b': x} -> {'a': {'b': x}}: orbax stores nested dicts of arrays."""
    out: dict[str, Any] = {}
    for key, x in flat.items():
        node = out
        *head, last = key.split("/")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = x
    return out


def _unnest(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(_unnest(v, key))
        else:
            out[key] = v
    return out


# --------------------------------------------------------------------------- checksums


def _bits(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 (one element per 8/16/32 bits, two per 64)."""
    if x.dtype == jnp.bool_:
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


def _hash(x: jax.Array) -> jax.Array:
    """[sum of the bits, sum of bits * (2*index + 1)], both mod 2**32.

    Integer sums are exact and order-free, so the result does not depend on
    how the array is sharded (it is checked after restoring onto another
    layout); the position weights catch values swapped between places.
    """
    u = _bits(x)
    if u.ndim == 0:
        u = u[None]
    index = jnp.zeros(u.shape, jnp.uint32)
    stride = 1
    for d in range(u.ndim - 1, -1, -1):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, u.shape, d) * jnp.uint32(
            stride % 2**32
        )
        stride *= u.shape[d]
    weights = index * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * weights, dtype=jnp.uint32)])


@jax.jit
def _hash_all(xs: list[jax.Array]) -> list[jax.Array]:
    return [_hash(x) for x in xs]


def _checksums(values: Sequence[jax.Array]) -> list[list[int]]:
    """One [a, b] pair per array; one compiled call per set of devices and batch.

    Hashing takes temporaries about twice the size of its input, so arrays are
    hashed in batches of at most ``_HASH_BATCH_BYTES``: memory stays bounded
    whatever the model's size (a restore's host memory is what it costs).
    """
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(values):
        committed = getattr(x, "committed", True)
        key = frozenset(d.id for d in x.sharding.device_set) if committed else None
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
            # One call at a time, blocked on: it holds collectives (see DESIGN.md).
            hashes = jax.device_get(_hash_all([values[i] for i in batch]))
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
        raise ValueError(
            f"restore: the target is laid out on an abstract mesh {dict(abstract.shape)} "
            f"({size} devices) but only {len(devices)} devices exist. Fix: build the target "
            "with ns.abstract_init(factory, mesh, rules) on a mesh of these devices."
        )
    return Mesh(
        np.asarray(devices[:size]).reshape(abstract.axis_sizes),
        abstract.axis_names,
        axis_types=abstract.axis_types,
    )


def _target_sharding(x: Any) -> jax.sharding.Sharding:
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        # Unplaced values (a target from jax.eval_shape, NumPy arrays) go to one device.
        return SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
        # nnx.eval_shape under a mesh gives shardings on an AbstractMesh, which
        # cannot hold data: read onto the concrete mesh with those axes.
        return NamedSharding(_concrete_mesh(sharding.mesh), sharding.spec)
    return sharding


def _key_data_sharding(sharding: jax.sharding.Sharding, ndim: int) -> jax.sharding.Sharding:
    """The sharding of ``key_data`` of keys laid out by ``sharding`` (one more dim)."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return NamedSharding(sharding.mesh, PartitionSpec(*spec, None))
    return sharding


# --------------------------------------------------------------------------- save


def _saveable(obj: Any, what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(flat arrays to write, manifest entries) for one NNX object."""
    _, _, rows = _flat(obj, what)
    arrays: dict[str, Any] = {}
    entries: dict[str, Any] = {}
    for _, key, var in rows:
        x = _value(var)
        if isinstance(x, jax.ShapeDtypeStruct):
            raise TypeError(
                f"save: {what}/{key} is abstract ({x.shape}, {x.dtype}): there is nothing "
                "to write. Fix: save a model built with ns.sharded_init (or restored), not "
                "the target from ns.abstract_init."
            )
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ValueError(
                f"save: {what}/{key} was deleted, most likely donated to a fused call "
                "(multistep/Trainer donate=True) after being read from the model. Fix: pass "
                "the model object itself; its Variables hold the live arrays."
            )
        if not isinstance(x, jax.Array):
            x = jnp.asarray(np.asarray(x))
        entry: dict[str, Any] = {"shape": list(x.shape), "dtype": None, "key": None}
        if _is_key(x.dtype):
            entry["key"] = _key_impl(x)
            x = jax.random.key_data(x)
        entry["dtype"] = str(x.dtype)
        arrays[key] = x
        entries[key] = entry
    return arrays, entries


def _check_json(extra: Any) -> None:
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"save: extra must be JSON data (dicts, lists, strings, finite numbers, bools, "
            f"None): {e}. Fix: keep arrays in the model; put small state such as the "
            "data position or the config in extra."
        ) from None
    if not isinstance(extra, Mapping):
        raise TypeError(f"save: extra must be a dict, got {type(extra).__name__}.")


def _save_args(
    step: int, model: Any, optimizer: Any, extra: Mapping[str, Any] | None
) -> Any:
    ocp = _ocp()
    if not isinstance(step, int | np.integer) or isinstance(step, bool) or step < 0:
        raise ValueError(f"save: step must be a non-negative int, got {step!r}")
    if extra is not None:
        _check_json(extra)
    items: dict[str, Any] = {}
    manifest: dict[str, Any] = {"format": _FORMAT, "items": {}}
    for name, obj in (("model", model), ("optimizer", optimizer)):
        if obj is None:
            continue
        arrays, entries = _saveable(obj, name)
        keys = list(arrays)
        for key, checksum in zip(keys, _checksums([arrays[k] for k in keys]), strict=True):
            entries[key]["checksum"] = checksum
        items[name] = ocp.args.StandardSave(_nest(arrays))
        manifest["items"][name] = entries
    items["extra"] = ocp.args.JsonSave(dict(extra or {}))
    items["manifest"] = ocp.args.JsonSave(manifest)
    return ocp.args.Composite(**items)


def _handlers() -> dict[str, Any]:
    ocp = _ocp()
    # Orbax reads up to restore_concurrent_gb into host buffers before placing
    # them; its default (96 GB) stages a whole model at once next to the result.
    def arrays() -> Any:
        return ocp.StandardCheckpointHandler(restore_concurrent_gb=_RESTORE_CONCURRENT_GB)

    return {
        "model": arrays(),
        "optimizer": arrays(),
        "extra": ocp.JsonCheckpointHandler(),
        "manifest": ocp.JsonCheckpointHandler(),
    }


def _manager(directory: pathlib.Path, *, create: bool, **options: Any) -> Any:
    ocp = _ocp()
    opts = ocp.CheckpointManagerOptions(create=create, save_root_metadata=False, **options)
    return ocp.CheckpointManager(directory, options=opts, item_handlers=_handlers())


def _resolve_dir(directory: str | os.PathLike[str]) -> pathlib.Path:
    return pathlib.Path(os.fspath(directory)).expanduser().absolute()


def _do_save(mngr: Any, directory: pathlib.Path, step: int, args: Any) -> pathlib.Path:
    ocp = _ocp()
    step = int(step)
    try:
        mngr.save(step, args=args, force=True)
    except ocp.checkpoint_manager.StepAlreadyExistsError:
        raise FileExistsError(
            f"save: a checkpoint for step {step} already exists at {directory / str(step)}. "
            "Fix: save under another step, or delete that directory first."
        ) from None
    return directory / str(step)


def save(
    directory: str | os.PathLike[str],
    step: int,
    *,
    model: nnx.Module,
    optimizer: nnx.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> pathlib.Path:
    """Writes a checkpoint of ``model`` (and ``optimizer``, ``extra``) for ``step``; returns its path.

    Every Variable of the model is written (parameters, ``nnx.Rngs`` state,
    batch statistics), each process writing the shards it holds; nothing is
    gathered onto one device. The step appears at ``directory/<step>`` only
    once completely written (it is written under a temporary name and
    renamed). Returns when the checkpoint is on disk; use :class:`Checkpointer`
    to save in the background.

    Args:
      directory: the checkpoint directory (created if missing; steps are subdirectories).
      step: the step number, a non-negative int not yet saved in ``directory``.
      model: the model (concrete arrays).
      optimizer: its ``nnx.Optimizer``, if any.
      extra: small JSON data (a dict) saved alongside: data position, config, ...

    Raises:
      FileExistsError: ``step`` is already saved in ``directory``.
      TypeError: ``extra`` is not JSON data, or the model is abstract.

    >>> import tempfile
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> path = save(tempfile.mkdtemp(), 100, model=model, extra={"data_position": 100})
    >>> path.name, sorted(p.name for p in path.iterdir() if p.is_dir())
    ('100', ['extra', 'manifest', 'model'])
    """
    directory = _resolve_dir(directory)
    args = _save_args(step, model, optimizer, extra)
    mngr = _manager(directory, create=True, enable_async_checkpointing=False)
    try:
        return _do_save(mngr, directory, step, args)
    finally:
        mngr.close()


# --------------------------------------------------------------------------- restore


def _unfinished(directory: pathlib.Path, step: int | None = None) -> list[str]:
    if not directory.is_dir():
        return []
    head = str(step) if step is not None else r"\d+"
    pattern = re.compile("^" + head + re.escape(_TMP_MARK))
    return sorted(p.name for p in directory.iterdir() if pattern.match(p.name))


def _remove_unfinished(directory: pathlib.Path) -> None:
    """Deletes the temporary directories of interrupted saves (process 0 only).

    Orbax's own ``cleanup_tmp_directories`` does not recognise every temporary
    name it writes on a local filesystem, so the names are matched here.
    """
    if jax.process_index() != 0:
        return
    for name in _unfinished(directory):
        shutil.rmtree(directory / name, ignore_errors=True)


def _finished_steps(directory: pathlib.Path) -> list[int]:
    # From the disk, not the manager's cache: a save in flight is not finished.
    return sorted(int(s) for s in _ocp().utils.checkpoint_steps(directory))


def _pick_step(directory: pathlib.Path, step: int | None) -> int:
    steps = _finished_steps(directory)
    if step is None:
        if not steps:
            tmp = _unfinished(directory)
            more = (
                f" Only unfinished saves are there ({', '.join(tmp)}): they were interrupted "
                "and are never restored."
                if tmp
                else ""
            )
            raise FileNotFoundError(f"restore: no finished checkpoint in {directory}.{more}")
        return steps[-1]
    if step in steps:
        return int(step)
    tmp = _unfinished(directory, step)
    if tmp:
        raise FileNotFoundError(
            f"restore: the checkpoint for step {step} in {directory} is unfinished (only "
            f"{directory / tmp[0]} exists: its save was interrupted). Finished steps: "
            f"{steps or 'none'}."
        )
    raise FileNotFoundError(
        f"restore: no checkpoint for step {step} at {directory / str(step)}. Finished steps: "
        f"{steps or 'none'}."
    )


def _listing(paths: Sequence[str]) -> str:
    shown = ", ".join(paths[:_SHOW])
    return shown + (f" ... and {len(paths) - _SHOW} more" if len(paths) > _SHOW else "")


def _match(
    what: str, rows: list[tuple[tuple[Any, ...], str, Any]], entries: Mapping[str, Any],
    where: pathlib.Path,
) -> None:
    """Raises one ValueError naming every path and shape that differs."""
    target = {key: var for _, key, var in rows}
    problems = []
    missing = sorted(set(target) - set(entries))
    extra = sorted(set(entries) - set(target))
    if missing:
        problems.append(f"in the target but not in the checkpoint: {_listing(missing)}")
    if extra:
        problems.append(f"in the checkpoint but not in the target: {_listing(extra)}")
    for key in sorted(set(target) & set(entries)):
        x = _value(target[key])
        saved = entries[key]
        shape = tuple(np.shape(x))
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        is_key = _is_key(dtype)
        if tuple(saved["shape"]) != shape:
            problems.append(
                f"{what}/{key}: checkpoint has shape {tuple(saved['shape'])}, target has {shape}"
            )
        elif bool(saved.get("key")) != is_key or (
            not is_key and np.dtype(saved["dtype"]) != np.dtype(dtype)
        ):
            saved_dtype = f"key<{saved['key']}>" if saved.get("key") else saved["dtype"]
            problems.append(
                f"{what}/{key}: checkpoint has dtype {saved_dtype}, target has {dtype} "
                "(restore with the saved dtype, then cast)"
            )
    if problems:
        raise ValueError(
            f"restore: the {what} target does not match the checkpoint at {where}:\n"
            + "\n".join(f"- {p}" for p in problems)
            + f"\nFix: build the target from the same {what} definition and config that "
            "was saved (e.g. ns.abstract_init(factory, mesh, rules))."
        )


def _orbax_target(rows: list[tuple[tuple[Any, ...], str, Any]]) -> dict[str, Any]:
    flat = {}
    for _, key, var in rows:
        x = _value(var)
        shape, dtype = tuple(np.shape(x)), x.dtype
        sharding = _target_sharding(x)
        if _is_key(dtype):
            data_shape = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
            flat[key] = jax.ShapeDtypeStruct(
                data_shape.shape, data_shape.dtype,
                sharding=_key_data_sharding(sharding, len(shape)),
            )
        else:
            flat[key] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return flat


def _corrupt(where: pathlib.Path, e: BaseException) -> ValueError:
    text = " ".join(str(e).split())
    return ValueError(
        f"restore: the checkpoint at {where} could not be read; it is corrupt or incomplete "
        f"({type(e).__name__}: {text[:400]}). Fix: restore another step "
        "(restore(..., step=N)) or re-create this one."
    )


def _read(
    directory: pathlib.Path, step: int | None, targets: Mapping[str, Any]
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Reads the items named in ``targets`` (an NNX object each) into new states.

    Returns (step, {item: new State}, extra).
    """
    ocp = _ocp()
    if not directory.is_dir():
        raise FileNotFoundError(f"restore: checkpoint directory {directory} does not exist.")
    mngr = _manager(directory, create=False)
    try:
        step = _pick_step(directory, step)
        where = directory / str(step)
        try:
            meta = mngr.restore(
                step, args=ocp.args.Composite(manifest=ocp.args.JsonRestore(),
                                              extra=ocp.args.JsonRestore())
            )
            manifest, extra = meta["manifest"], meta["extra"]
        except Exception as e:
            raise _corrupt(where, e) from e
        if not isinstance(manifest, Mapping) or manifest.get("format") != _FORMAT:
            raise ValueError(
                f"restore: {where} has no nnx_shard manifest of format {_FORMAT} (found "
                f"{manifest!r:.80}); it was not written by nnx_shard.save or is damaged."
            )
        saved = manifest["items"]
        layouts = {}
        for name, obj in targets.items():
            if name not in saved:
                raise ValueError(
                    f"restore: the checkpoint at {where} has no {name} (it holds "
                    f"{', '.join(sorted(saved))}). Fix: pass {name}=None, or restore a "
                    f"checkpoint saved with a {name}."
                )
            graphdef, _, rows = _flat(obj, name)
            _match(name, rows, saved[name], where)
            layouts[name] = (graphdef, rows, _orbax_target(rows))
        args = {
            name: ocp.args.StandardRestore(_nest(layout[2])) for name, layout in layouts.items()
        }
        try:
            restored = mngr.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:
            raise _corrupt(where, e) from e
    finally:
        mngr.close()

    out = {}
    for name, (graphdef, rows, _) in layouts.items():
        arrays = _unnest(restored[name])
        keys = [key for _, key, _ in rows]
        sums = _checksums([arrays[k] for k in keys])
        bad = [k for k, s in zip(keys, sums, strict=True) if s != saved[name][k]["checksum"]]
        if bad:
            raise ValueError(
                f"restore: the checkpoint at {where} is corrupt: the data read for "
                f"{_listing([f'{name}/{k}' for k in bad])} does not match the checksum written "
                "when it was saved. Fix: restore another step (restore(..., step=N))."
            )
        new_rows = []
        for path, key, var in rows:
            x = arrays[key]
            impl = saved[name][key].get("key")
            if impl:
                x = jax.random.wrap_key_data(x, impl=impl)
            new_rows.append((path, var.replace(x) if isinstance(var, nnx.Variable) else x))
        out[name] = (graphdef, nnx.from_flat_state(new_rows))
    return step, out, dict(extra or {})


def restore(
    directory: str | os.PathLike[str],
    *,
    model: nnx.Module,
    optimizer: nnx.Optimizer | None = None,
    step: int | None = None,
) -> Any:
    """Reads a checkpoint into the layout of the targets; returns new objects.

    ``model`` (and ``optimizer``) are targets: abstract ones from
    :func:`nnx_shard.abstract_init` / :func:`nnx_shard.sharded_optimizer`
    (``jax.ShapeDtypeStruct`` leaves carrying shardings), or concrete objects
    (their arrays' shardings are used, their values are not touched). The
    result is laid out exactly as the targets say, on any mesh shape, with
    any rules, on any number of devices: each device reads only its own
    slices from disk. Targets whose shardings sit on an ``AbstractMesh``
    (``nnx.eval_shape`` under a mesh) are read onto the active
    :func:`nnx_shard.use` mesh, or the first devices, with those axes; leaves
    with no sharding go to the first local device.

    Args:
      directory: the checkpoint directory given to :func:`save`.
      model: the model target.
      optimizer: the optimizer target, if its state should be read too.
      step: which step (default: the latest finished one).

    Returns:
      ``model`` when no optimizer is asked for, else ``(model, optimizer, extra)``
      with ``extra`` the saved JSON dict (``{}`` if none).

    Raises:
      FileNotFoundError: no such directory, no finished checkpoint, or no
        finished checkpoint for ``step`` (an interrupted save is named as such).
      ValueError: the target's structure differs from the checkpoint's (every
        missing, unexpected and mis-shaped path is named), or the checkpoint
        is corrupt or incomplete (nothing is returned in that case).

    >>> import tempfile
    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> d = tempfile.mkdtemp()
    >>> init = ns.with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    >>> factory = lambda: nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0))
    >>> model = ns.sharded_init(factory, "data=8", {"embed": "data", "mlp": None})
    >>> _ = save(d, 1, model=model)
    >>> target = ns.abstract_init(factory, "data=4,model=2", {"embed": "data", "mlp": "model"})
    >>> new = restore(d, model=target)
    >>> import numpy as np
    >>> new.kernel.get_value().sharding.spec, np.array_equal(new.kernel[...], model.kernel[...])
    (P('data', 'model'), True)
    """
    directory = _resolve_dir(directory)
    targets = {"model": model}
    if optimizer is not None:
        targets["optimizer"] = optimizer
    _, states, extra = _read(directory, step, targets)
    new_model = nnx.merge(*states["model"])
    if optimizer is None:
        return new_model
    return new_model, nnx.merge(*states["optimizer"]), extra


# --------------------------------------------------------------------------- Checkpointer


class Checkpointer:
    """Saves every ``every`` steps in the background and keeps the last ``keep``.

    Give it to ``Trainer.fit(data, num_steps, checkpointer=ckpt)``; with
    ``resume=True`` training continues from the latest checkpoint (model,
    optimizer, step counter, RNG state and data position). It can also be
    driven by hand: :meth:`save`, :meth:`restore`, :meth:`wait`.

    With ``async_save=True`` a save returns once the arrays are copied off the
    devices; writing to disk runs on a background thread while training goes
    on (the next save, :meth:`wait` and :meth:`close` wait for it). Opening a
    ``Checkpointer`` removes unfinished temporary directories left in
    ``directory`` by interrupted saves.

    Args:
      directory: where the step directories go (created if missing).
      every: save when the step counter is a multiple of this.
      keep: how many of the latest checkpoints to keep (``None``: all).
      async_save: write in the background.

    >>> import tempfile
    >>> from flax import nnx
    >>> with Checkpointer(tempfile.mkdtemp(), every=10, keep=2) as ckpt:
    ...     model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    ...     for step in (10, 20, 30):
    ...         _ = ckpt.save(step, model=model)
    ...     ckpt.wait()
    ...     ckpt.steps(), ckpt.should_save(40), ckpt.should_save(45)
    ([20, 30], True, False)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        every: int = 1000,
        keep: int | None = 3,
        async_save: bool = True,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"Checkpointer: every must be a positive int, got {every!r}")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"Checkpointer: keep must be a positive int or None, got {keep!r}")
        self.directory = _resolve_dir(directory)
        self.every = every
        self.keep = keep
        self.async_save = async_save
        _remove_unfinished(self.directory)
        self._mngr = _manager(
            self.directory,
            create=True,
            enable_async_checkpointing=async_save,
            max_to_keep=keep,
        )

    def __repr__(self) -> str:
        return (
            f"Checkpointer({str(self.directory)!r}, every={self.every}, keep={self.keep}, "
            f"async_save={self.async_save})"
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def should_save(self, step: int) -> bool:
        """True when ``step`` is a save step (a positive multiple of ``every``).

        >>> import tempfile
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), every=5)
        >>> ckpt.should_save(0), ckpt.should_save(5), ckpt.should_save(7)
        (False, True, False)
        """
        return step > 0 and step % self.every == 0

    def steps(self) -> list[int]:
        """The finished checkpoints on disk, oldest first (a save in flight is not one yet).

        >>> import tempfile
        >>> Checkpointer(tempfile.mkdtemp()).steps()
        []
        """
        return _finished_steps(self.directory)

    def latest_step(self) -> int | None:
        """The latest finished step, or ``None`` when there is none.

        >>> import tempfile
        >>> print(Checkpointer(tempfile.mkdtemp()).latest_step())
        None
        """
        steps = self.steps()
        return steps[-1] if steps else None

    def save(
        self,
        step: int,
        *,
        model: nnx.Module,
        optimizer: nnx.Optimizer | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> pathlib.Path:
        """Starts saving ``step`` (as :func:`save` writes it) and returns its future path.

        With ``async_save`` it returns once the arrays are off the devices
        (the model may then be updated or donated) and the write finishes in
        the background; :meth:`wait` waits for it. Older checkpoints beyond
        ``keep`` are deleted once it is finished.

        >>> import tempfile
        >>> from flax import nnx
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), async_save=False)
        >>> ckpt.save(7, model=nnx.Linear(1, 1, rngs=nnx.Rngs(0))).name, ckpt.latest_step()
        ('7', 7)
        """
        args = _save_args(step, model, optimizer, extra)
        return _do_save(self._mngr, self.directory, step, args)

    def restore(
        self,
        *,
        model: nnx.Module,
        optimizer: nnx.Optimizer | None = None,
        step: int | None = None,
    ) -> Any:
        """:func:`restore` from this directory (waits for a save in flight first).

        >>> import tempfile
        >>> from flax import nnx
        >>> ckpt = Checkpointer(tempfile.mkdtemp())
        >>> _ = ckpt.save(3, model=nnx.Linear(1, 1, rngs=nnx.Rngs(0)))
        >>> type(ckpt.restore(model=nnx.Linear(1, 1, rngs=nnx.Rngs(1)))).__name__
        'Linear'
        """
        self.wait()
        return restore(self.directory, model=model, optimizer=optimizer, step=step)

    def wait(self) -> None:
        """Blocks until every save started so far is finished on disk.

        >>> import tempfile
        >>> Checkpointer(tempfile.mkdtemp()).wait()
        """
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Waits for saves in flight, then releases orbax's threads.

        >>> import tempfile
        >>> Checkpointer(tempfile.mkdtemp()).close()
        """
        self._mngr.close()


def restore_into(
    directory: str | os.PathLike[str], model: nnx.Module, optimizer: nnx.Optimizer | None,
    step: int | None = None,
) -> tuple[int, dict[str, Any]]:
    """Restores in place, into the layouts ``model``/``optimizer`` have now; returns
    ``(step, extra)``. (What ``Trainer.fit(resume=True)`` uses.)

    >>> import tempfile
    >>> from flax import nnx
    >>> d = tempfile.mkdtemp()
    >>> _ = save(d, 5, model=nnx.Linear(1, 1, rngs=nnx.Rngs(0)), extra={"a": 1})
    >>> model = nnx.Linear(1, 1, rngs=nnx.Rngs(1))
    >>> restore_into(d, model, None), float(model.kernel[0, 0]) == float(
    ...     nnx.Linear(1, 1, rngs=nnx.Rngs(0)).kernel[0, 0])
    ((5, {'a': 1}), True)
    """
    targets = {"model": model}
    if optimizer is not None:
        targets["optimizer"] = optimizer
    step, states, extra = _read(_resolve_dir(directory), step, targets)
    for name, obj in targets.items():
        nnx.update(obj, states[name][1])
    return step, extra
