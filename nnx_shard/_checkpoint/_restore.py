"""Reading a step back onto any mesh: the step to read, matching its leaves to the
targets, checking the manifest and checksums, and :func:`restore` /
:func:`restore_in_place` (what ``Trainer.fit(resume=True)`` runs)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnx_shard._checkpoint._backend import orbax_module
from nnx_shard._checkpoint._internal import (
    _SHOW,
    _claims,
    _finished_steps,
    _refuse_file,
    _resolve_dir,
    _step_folders,
    _unfinished,
)
from nnx_shard._checkpoint._manifest import (
    QUANT_KEY,
    checksums_of,
    extra_hash,
    flatten_state,
    is_key_dtype,
    key_data_sharding,
    manifest_problem,
    nest,
    quant_kinds,
    target_sharding,
    unnest,
    var_value,
)
from nnx_shard._checkpoint._save import manager
from nnx_shard._errors import UsageError, count, short

# --------------------------------------------------------------------------- restore


def _pick_step(directory: pathlib.Path, step: int | None) -> int:
    """The step to read: ``step``, or the newest folder that says it is a checkpoint
    of ours (whether it is whole is checked by the read: a damaged newest step is an
    error, not a silent fall-back to an older one)."""
    folders = _step_folders(directory)
    steps = _finished_steps(directory)
    if step is None:
        claimed = sorted(s for s, p in folders.items() if _claims(p))
        if claimed:
            return claimed[-1]
        more = ""
        tmp = _unfinished(directory)
        if tmp:
            more += (f" Only unfinished saves are there ({', '.join(tmp)}): they were "
                     "interrupted and are never restored.")
        if folders:
            names = _listing([str(s) for s in sorted(folders)])
            more += (f" Its numbered folders ({names}) have no manifest/metadata: they were "
                     "not written by nnx_shard, and are never read or touched.")
        raise FileNotFoundError(f"restore: no finished checkpoint in {directory}.{more}")
    path = directory / str(step)
    if step in folders and _claims(folders[step]):
        return int(step)
    if os.path.lexists(path):
        raise FileNotFoundError(
            f"restore: {path} is not a checkpoint written by nnx_shard (it has no "
            f"manifest/metadata; never read or touched). Finished steps: {steps or 'none'}."
        )
    tmp = _unfinished(directory, step)
    if tmp:
        raise FileNotFoundError(
            f"restore: the checkpoint for step {step} in {directory} is unfinished (only "
            f"{directory / tmp[0]} exists: its save was interrupted). Finished steps: "
            f"{steps or 'none'}."
        )
    raise FileNotFoundError(
        f"restore: no checkpoint for step {step} at {path}. Finished steps: "
        f"{steps or 'none'}."
    )


def _listing(paths: Sequence[str]) -> str:
    shown = ", ".join(paths[:_SHOW])
    return shown + (f" ... and {len(paths) - _SHOW} more" if len(paths) > _SHOW else "")


def _match(
    what: str, rows: list[tuple[tuple[Any, ...], str, Any]], entries: Mapping[str, Any],
    where: pathlib.Path, kinds: Mapping[str, str] | None = None,
) -> None:
    """Raises one UsageError naming every path, shape, dtype and quantization kind
    (``kinds``: the target's, by the codes' path) that differs."""
    target = {key: var for _, key, var in rows}
    kinds = kinds or {}
    problems = []
    quant_fix = ""
    missing = sorted(set(target) - set(entries))
    extra = sorted(set(entries) - set(target))
    if missing:
        problems.append(f"in the target but not in the checkpoint: {_listing(missing)}")
    if extra:
        problems.append(f"in the checkpoint but not in the target: {_listing(extra)}")
    for key in sorted(set(target) & set(entries)):
        x = var_value(target[key])
        saved = entries[key]
        shape = tuple(np.shape(x))
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        is_key = is_key_dtype(dtype)
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
        # A checkpoint from before the kind was recorded has none: it is taken as it is.
        elif QUANT_KEY in saved and saved[QUANT_KEY] != kinds.get(key, saved[QUANT_KEY]):
            problems.append(
                f"{what}/{key}: checkpoint holds {saved[QUANT_KEY]} codes (quantize="
                f"{saved[QUANT_KEY]!r}), target quantizes as {kinds[key]} (quantize="
                f"{kinds[key]!r}); the same bits read as the other kind are other weights"
            )
            quant_fix = (f" For the quantized base: ns.lora(..., quantize="
                         f"{saved[QUANT_KEY]!r}) as it was saved.")
    if problems:
        raise UsageError(
            f"restore: the {what} target does not match the checkpoint at {where}:\n"
            + "\n".join(f"- {p}" for p in problems)
            + f"\nFix: build the target from the same {what} definition and config that "
            f"was saved (e.g. ns.abstract_init(factory, mesh, rules)).{quant_fix}"
        )


def _orbax_target(rows: list[tuple[tuple[Any, ...], str, Any]]) -> dict[str, Any]:
    flat = {}
    for _, key, var in rows:
        x = var_value(var)
        shape, dtype = tuple(np.shape(x)), x.dtype
        sharding = target_sharding(x)
        if is_key_dtype(dtype):
            data_shape = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
            flat[key] = jax.ShapeDtypeStruct(
                data_shape.shape, data_shape.dtype,
                sharding=key_data_sharding(sharding, len(shape)),
            )
        else:
            flat[key] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return flat


def _corrupt(where: pathlib.Path, e: BaseException) -> UsageError:
    text = " ".join(str(e).split())
    return UsageError(
        f"restore: the checkpoint at {where} could not be read; it is corrupt or incomplete "
        f"({type(e).__name__}: {text[:400]}). Fix: restore another step "
        "(restore(..., step=N)) or re-create this one."
    )


def check_targets(targets: Mapping[str, Any]) -> None:
    """Every restore route's first check: each target is an NNX object (before the
    directory is looked at, so a wrong target is named whatever the disk holds)."""
    for name, obj in targets.items():
        if not (isinstance(obj, nnx.Module | nnx.Optimizer) or nnx.graphlib.is_graph_node(obj)):
            raise UsageError(
                f"restore: {name} must be an NNX object (nnx.Module or nnx.Optimizer), got "
                f"{type(obj).__name__} {short(obj, 60)}. Fix: a target that says where every "
                f"array goes, e.g. {name}=ns.abstract_init(factory, mesh, strategy)"
                + (" and optimizer=ns.sharded_optimizer(model, tx, mesh, strategy)."
                   if name == "optimizer" else ".")
            )


def _read(
    directory: pathlib.Path, step: int | None, targets: Mapping[str, Any]
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Reads the items named in ``targets`` (an NNX object each) into new states.

    Returns (step, {item: new State}, extra).
    """
    ocp = orbax_module()
    check_targets(targets)
    if step is not None:
        step = count(step, "restore: step", least=0,
                     fix="a saved step number, or step=None for the latest")
    _refuse_file(directory, "restore")
    if not directory.is_dir():
        raise FileNotFoundError(f"restore: checkpoint directory {directory} does not exist.")
    return _read_open(ocp, manager(directory, create=False), directory, step, targets)


def _read_open(
    ocp: Any, mngr: Any, directory: pathlib.Path, step: int | None, targets: Mapping[str, Any]
) -> tuple[int, dict[str, Any], dict[str, Any]]:
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
        problem = manifest_problem(manifest)
        fix = "Fix: restore another step (restore(..., step=N)) or re-create this one."
        if problem:
            raise UsageError(
                f"restore: the checkpoint at {where} is corrupt: its manifest "
                f"{where / 'manifest' / 'metadata'} {problem} (damaged, or not written by "
                f"nnx_shard.save). {fix}"
            )
        if manifest["format"] >= 2 and manifest["step"] != step:
            raise UsageError(
                f"restore: the checkpoint at {where} is corrupt: its manifest "
                f"{where / 'manifest' / 'metadata'} was written for step {manifest['step']}, "
                f"not {step} (the folder was renamed or copied). {fix}"
            )
        if manifest["format"] >= 2 and extra_hash(extra) != manifest["extra"]:
            raise UsageError(
                f"restore: the checkpoint at {where} is corrupt: {where / 'extra' / 'metadata'} "
                "does not match the digest in its manifest (edited or damaged: the step "
                f"counter and data position it holds cannot be trusted). {fix}"
            )
        saved = manifest["items"]
        layouts = {}
        for name, obj in targets.items():
            if name not in saved:
                raise UsageError(
                    f"restore: the checkpoint at {where} has no {name} (it holds "
                    f"{', '.join(sorted(saved))}). Fix: pass {name}=None, or restore a "
                    f"checkpoint saved with a {name}."
                )
            graphdef, _, rows = flatten_state(obj, name)
            _match(name, rows, saved[name], where, quant_kinds(obj))
            layouts[name] = (graphdef, rows, _orbax_target(rows))
        args = {
            name: ocp.args.StandardRestore(nest(layout[2])) for name, layout in layouts.items()
        }
        try:
            restored = mngr.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:
            raise _corrupt(where, e) from e
    finally:
        mngr.close()

    out = {}
    for name, (graphdef, rows, _) in layouts.items():
        arrays = unnest(restored[name])
        keys = [key for _, key, _ in rows]
        sums = checksums_of([arrays[k] for k in keys], version=manifest["format"])
        bad = [k for k, s in zip(keys, sums, strict=True) if s != saved[name][k]["checksum"]]
        if bad:
            raise UsageError(
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
      NotADirectoryError: ``directory`` is a file.
      UsageError: the target's structure differs from the checkpoint's (every
        missing, unexpected and mis-shaped path is named), or the checkpoint
        is corrupt or incomplete (nothing is returned in that case).

    >>> import tempfile
    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> from nnx_shard import restore
    >>> from nnx_shard._checkpoint import save
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
    directory = _resolve_dir(directory, "restore")
    targets: dict[str, Any] = {"model": model}
    if optimizer is not None:
        targets["optimizer"] = optimizer
    _, states, extra = _read(directory, step, targets)
    new_model = nnx.merge(*states["model"])
    if optimizer is None:
        return new_model
    return new_model, nnx.merge(*states["optimizer"]), extra


def _uncommitted(x: jax.Array) -> jax.Array:
    """``x`` as a fresh eager value: on the default device, free to move."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.device_put(np.asarray(jax.random.key_data(x)))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x))


def restore_in_place(
    directory: str | os.PathLike[str], model: nnx.Module, optimizer: nnx.Optimizer | None,
    step: int | None = None,
) -> tuple[int, dict[str, Any]]:
    """:func:`restore`'s read, written into ``model``/``optimizer`` in the layouts they
    have now; returns ``(step, extra)``. This is what ``Trainer.fit(checkpointer=...,
    resume=True)`` runs: a training run keeps its objects. To restore by hand, call
    :func:`restore` (new objects, the same checks and errors).

    >>> import tempfile
    >>> from flax import nnx
    >>> from nnx_shard._checkpoint import save
    >>> d = tempfile.mkdtemp()
    >>> _ = save(d, 5, model=nnx.Linear(1, 1, rngs=nnx.Rngs(0)), extra={"a": 1})
    >>> model = nnx.Linear(1, 1, rngs=nnx.Rngs(1))
    >>> restore_in_place(d, model, None), float(model.kernel[0, 0]) == float(
    ...     nnx.Linear(1, 1, rngs=nnx.Rngs(0)).kernel[0, 0])
    ((5, {'a': 1}), True)
    """
    targets: dict[str, Any] = {"model": model}
    if optimizer is not None:
        targets["optimizer"] = optimizer
    check_targets(targets)
    # A fresh eager model (values not yet committed to a device) restores as one: orbax
    # returns committed arrays, and a committed single-device value cannot join a
    # Trainer's mesh, while an uncommitted one is placed on it like the fresh model was.
    fresh = {name: [not getattr(x, "committed", True) for x in jax.tree.leaves(nnx.state(obj))]
             for name, obj in targets.items()}
    step, states, extra = _read(_resolve_dir(directory, "restore"), step, targets)
    for name, obj in targets.items():
        state = states[name][1]
        if any(fresh[name]):
            leaves, tree = jax.tree.flatten(state)
            if len(leaves) == len(fresh[name]):
                state = jax.tree.unflatten(tree, [
                    _uncommitted(x) if loose and isinstance(x, jax.Array) else x
                    for x, loose in zip(leaves, fresh[name], strict=True)])
        nnx.update(obj, state)
    return step, extra
