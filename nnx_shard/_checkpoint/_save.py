"""Writing a step: what is saveable, the JSON ``extra``, the manifest, and
:func:`save` itself."""

from __future__ import annotations

import json
import math
import os
import pathlib
import threading
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_shard._checkpoint._backend import orbax_module
from nnx_shard._checkpoint._exits import save_failed
from nnx_shard._checkpoint._internal import (
    _FORMAT,
    _RESTORE_CONCURRENT_GB,
    _claim_tmp,
    _claims,
    _dir_lock,
    _forget,
    _pin_tmp,
    _refuse_file,
    _release_tmp,
    _remove_tmp,
    _resolve_dir,
    _settle,
    _WriteLock,
)
from nnx_shard._checkpoint._manifest import (
    QUANT_KEY,
    checksums_of,
    extra_hash,
    flatten_state,
    is_key_dtype,
    key_impl_name,
    manifest_digest,
    nest,
    quant_kinds,
    var_value,
)
from nnx_shard._errors import UsageError, count, short

# --------------------------------------------------------------------------- save


def _saveable(obj: Any, what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(flat arrays to write, manifest entries) for one NNX object."""
    _, _, rows = flatten_state(obj, what)
    kinds = quant_kinds(obj)
    arrays: dict[str, Any] = {}
    entries: dict[str, Any] = {}
    for _, key, var in rows:
        x = var_value(var)
        if isinstance(x, jax.ShapeDtypeStruct):
            raise UsageError(
                f"save: {what}/{key} is abstract ({x.shape}, {x.dtype}): there is nothing "
                "to write. Fix: save a model built with ns.sharded_init (or restored), not "
                "the target from ns.abstract_init."
            )
        if isinstance(x, jax.Array) and x.is_deleted():
            raise UsageError(
                f"save: {what}/{key} was deleted, most likely donated to a fused call "
                "(multistep/Trainer donate=True) after being read from the model. Fix: pass "
                "the model object itself; its Variables hold the live arrays."
            )
        if not isinstance(x, jax.Array):
            x = jnp.asarray(np.asarray(x))
        entry: dict[str, Any] = {"shape": list(x.shape), "dtype": None, "key": None}
        if is_key_dtype(x.dtype):
            entry["key"] = key_impl_name(x)
            x = jax.random.key_data(x)
        entry["dtype"] = str(x.dtype)
        if key in kinds:  # NF4 and int4 codes share shape and dtype: restore checks the kind
            entry[QUANT_KEY] = kinds[key]
        arrays[key] = x
        entries[key] = entry
    return arrays, entries


def _check_extra(extra: Any) -> None:
    """Extra must come back from JSON as it was given: a dict with str keys (JSON turns
    the key 1 into "1") holding JSON data, each bad piece named by its place."""
    if not isinstance(extra, Mapping):
        raise UsageError(
            f"save: extra must be a dict, got {type(extra).__name__} {extra!r:.60}. Fix: e.g. "
            "extra={'data_position': 100}."
        )

    def walk(x: Any, where: str) -> None:
        if isinstance(x, Mapping):
            for k, v in x.items():
                if not isinstance(k, str):
                    try:  # what JSON would make of it
                        back = f", so it would come back as {next(iter(json.loads(json.dumps({k: 0}))))!r}"
                    except TypeError:
                        back = ""
                    raise UsageError(
                        f"save: {where} has the key {k!r} ({type(k).__name__}); JSON object keys "
                        f"are strings{back}. Fix: use str keys, e.g. {str(k)!r}."
                    )
                walk(v, f"{where}[{k!r}]")
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                walk(v, f"{where}[{i}]")
        elif x is None or isinstance(x, str | bool | int):
            pass
        elif isinstance(x, float):
            if not math.isfinite(x):
                raise UsageError(
                    f"save: {where} is {x!r}, which strict JSON cannot hold. Fix: store a "
                    "finite number, or None."
                )
        else:
            raise UsageError(
                f"save: {where} is a {type(x).__name__} ({x!r:.40}), not JSON data (dicts, "
                "lists, strings, finite numbers, bools, None). Fix: keep arrays in the model; "
                "convert scalars first (e.g. float(x), int(x), x.tolist())."
            )

    walk(extra, "extra")


def save_args(
    step: int, model: Any, optimizer: Any, extra: Mapping[str, Any] | None
) -> Any:
    ocp = orbax_module()
    step = count(step, "save: step", least=0, fix="the step number, e.g. save(d, 100, ...)")
    if not isinstance(model, nnx.Module):
        raise UsageError(f"save: model must be an nnx.Module, got {type(model).__name__} "
                         f"{short(model, 60)}. Fix: save(directory, step, model=model)")
    if extra is not None:
        _check_extra(extra)
    # As it will read back: tuples become lists.
    extra = json.loads(json.dumps(dict(extra or {})))
    items: dict[str, Any] = {}
    manifest: dict[str, Any] = {"format": _FORMAT, "step": int(step), "items": {},
                                "extra": extra_hash(extra)}
    for name, obj in (("model", model), ("optimizer", optimizer)):
        if obj is None:
            continue
        arrays, entries = _saveable(obj, name)
        keys = list(arrays)
        for key, checksum in zip(keys, checksums_of([arrays[k] for k in keys]), strict=True):
            entries[key]["checksum"] = checksum
        items[name] = ocp.args.StandardSave(nest(arrays))
        manifest["items"][name] = entries
    manifest["digest"] = manifest_digest(manifest)
    items["extra"] = ocp.args.JsonSave(extra)
    items["manifest"] = ocp.args.JsonSave(manifest)
    return ocp.args.Composite(**items)


def _handlers() -> dict[str, Any]:
    ocp = orbax_module()
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


def manager(directory: pathlib.Path, *, create: bool, **options: Any) -> Any:
    ocp = orbax_module()
    opts = ocp.CheckpointManagerOptions(
        create=create, save_root_metadata=False,
        # Orbax would remove every folder named like a temporary save; ours are
        # removed by their claims (folders._remove_leftovers), a user's never.
        cleanup_tmp_directories=False,
        # Step folders are created before save returns: on a read-only file system the
        # save fails at once. Created in the background, the failure left orbax's other
        # threads waiting 300 s for the folder, at exit.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        **options,
    )
    return ocp.CheckpointManager(directory, options=opts, item_handlers=_handlers())


def _refuse_existing(directory: pathlib.Path, step: int, caller: str) -> None:
    """A FileExistsError when ``directory/<step>`` exists: ours or not, it is never
    written over (orbax's ``force`` would delete it first)."""
    path = directory / str(step)
    if not os.path.lexists(path):
        return
    if path.is_dir() and not path.is_symlink() and _claims(path):
        raise FileExistsError(
            f"{caller}: a checkpoint for step {step} already exists at {path}. Fix: save "
            "under another step, or delete that directory first."
        )
    kind = "folder" if path.is_dir() else "file"
    raise FileExistsError(
        f"{caller}: {path} already exists and is not a checkpoint written by nnx_shard; "
        f"nothing of yours is written over. Fix: save under another step, or move that "
        f"{kind} out of {directory}."
    )


def _start_save(mngr: Any, step: int, args: Any, background: bool) -> None:
    """``mngr.save``; a background save is started from a daemon thread of ours.

    Orbax's save threads inherit the daemon flag of the thread that starts them
    (``threading.Thread``'s documented default). As daemons, the interpreter does
    not join them at exit: Python joins non-daemon threads without any bound, before
    any public exit hook runs, so a save stuck on its storage would hang the exit.
    Ours (an ``atexit`` callback, see ``_exits.py``) waits for them while they make
    progress, and reports the ones that do not.
    """
    if not background:
        mngr.save(step, args=args, force=True)
        return
    raised: list[BaseException] = []

    def start() -> None:
        try:
            mngr.save(step, args=args, force=True)
        except BaseException as e:  # re-raised in the caller's thread
            raised.append(e)

    starter = threading.Thread(target=start, name="nnx_shard-save", daemon=True)
    starter.start()
    try:
        starter.join()
    except BaseException:  # interrupted: the save's state is known only once it returns
        starter.join()
        raise
    if raised:
        raise raised[0]


def do_save(
    mngr: Any, directory: pathlib.Path, step: int, args: Any, caller: str,
    background: bool = False,
) -> _WriteLock:
    """Starts the save under the directory's lock, after every in-process save to it
    finished, so of concurrent saves of one step exactly one writes it and the
    others are refused. Returns the write lock, held until the save is finished.
    A save that fails before returning is one clear OSError."""
    ocp = orbax_module()
    step = int(step)
    with _dir_lock(directory):
        _settle(directory)
        _refuse_existing(directory, step, caller)
        _forget(mngr, [step])  # a stale entry of orbax's (e.g. a user's "007/") must not block it
        try:
            record = _claim_tmp(directory, step, caller)
            lock = _WriteLock(directory)
        except FileExistsError:
            raise
        except OSError as e:  # a full disk fails the claim's few bytes first
            _remove_tmp(directory, step)
            raise save_failed(caller, directory, step, e, background=False) from e
        try:
            _start_save(mngr, step, args, background)
        except ocp.checkpoint_manager.StepAlreadyExistsError:  # pragma: no cover - raced
            lock.release()
            _remove_tmp(directory, step)
            _refuse_existing(directory, step, caller)
            raise
        except Exception as e:
            lock.release()
            _remove_tmp(directory, step)
            raise save_failed(caller, directory, step, e, background=False) from e
        _pin_tmp(record, directory, step)
    return lock


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
      FileExistsError: ``step`` is already saved in ``directory`` (also when another
        thread of this process saved it first), or ``directory/<step>`` is a folder
        or file that nnx_shard did not write (it is never written over).
      NotADirectoryError: ``directory`` is a file, or inside one.
      OSError: the write failed (disk full, read-only file system): one line naming
        the step and the cause; nothing of the step is left.
      UsageError: ``extra`` is not a dict of JSON data with str keys (each bad key or
        value is named), the model is abstract, or ``directory`` is an empty path.

    >>> import tempfile
    >>> from flax import nnx
    >>> from nnx_shard import save
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> path = save(tempfile.mkdtemp(), 100, model=model, extra={"data_position": 100})
    >>> path.name, sorted(p.name for p in path.iterdir() if p.is_dir())
    ('100', ['extra', 'manifest', 'model'])
    """
    directory = _resolve_dir(directory, "save")
    _refuse_file(directory, "save")
    args = save_args(step, model, optimizer, extra)
    with _dir_lock(directory):
        mngr = manager(directory, create=True, enable_async_checkpointing=False)
        try:
            do_save(mngr, directory, step, args, "save").release()
            _release_tmp(directory, int(step))
            return directory / str(int(step))
        finally:
            mngr.close()
