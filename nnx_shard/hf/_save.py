"""Saving a sharded model as a Hugging Face checkpoint, every process writing
the shards it owns."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnx_shard import _safetensors_io as st
from nnx_shard._annotate import path_str
from nnx_shard._errors import NnxShardError, UsageError, count, short
from nnx_shard._init import rewrap
from nnx_shard.hf import _export_dir as export_dir
from nnx_shard.hf import _fused as fused
from nnx_shard.hf._files import INDEX, SINGLE, as_path, barrier, layouts, program
from nnx_shard.hf._mapping import (
    TRANSFORM_FNS,
    Leaf,
    MappingValue,
    Rule,
    compile_rules,
    hf_key,
    leaves_of,
    mapping_for,
    natural,
)
from nnx_shard.hf._source import export_files

__all__ = ['save_safetensors']

def _plan_save(state: Any, rules: Sequence[Rule]) -> dict[str, Leaf]:
    leaves = leaves_of(state, "save_safetensors")
    problems = []
    for leaf in leaves.values():
        # Stacked experts are one tensor per expert (a whole-tensor pattern may match too).
        found = None if leaf.names and leaf.names[0] == "expert" else hf_key(rules, leaf, None)
        if found is not None:
            leaf.keys[None], leaf.rule = found
        elif leaf.shape and (layered := hf_key(rules, leaf, 0)) is not None:
            leaf.layers = leaf.shape[0]
            for i in range(leaf.layers):
                got = hf_key(rules, leaf, i)
                if got is not None:
                    leaf.keys[i], leaf.rule = got
            leaf.rule = layered[1]
        elif len(leaf.shape) > 2 and (layered := hf_key(rules, leaf, (0, 0))) is not None:
            # Experts under scanned layers: one tensor per (layer, expert).
            leaf.depth, leaf.layers = 2, leaf.shape[0] * leaf.shape[1]
            for i in range(leaf.layers):
                got = hf_key(rules, leaf, leaf.index(i))
                if got is not None:
                    leaf.keys[i], leaf.rule = got
            leaf.rule = layered[1]
        if leaf.rule is None:
            problems.append(f"{leaf.describe()} has no Hugging Face name: no mapping "
                            "template produces its path (templates of patterns with regex "
                            "syntax beyond literal text and groups cannot be inverted). Fix: "
                            "add a literal pattern for it to the mapping.")
            continue
        leaf.transform = leaf.rule.transform
    if problems:
        raise UsageError(f"save_safetensors: {len(problems)} parameters cannot be named:\n"
                         + "\n".join(f"- {p}" for p in problems))
    return leaves


def _prepare(out: Path, names: Sequence[str]) -> set[str]:
    """Checks that ``out`` can take an export of ``names`` and returns the files of
    the previous export there (proven by its marker): what the new export replaces.
    Anything else in the way is an error; nothing is deleted here."""
    export_dir.clean_leftovers(out)
    if not out.is_dir():
        return set()
    mine = export_dir.owned(out, export_dir.read_marker(out))
    present = {p.name for p in out.iterdir()}
    clash = sorted(((set(names) | {n for n in present if n.endswith(".safetensors")})
                    & present) - mine)
    if clash:
        raise FileExistsError(
            f"save_safetensors: {out} already holds {', '.join(clash)}, which save_safetensors "
            "did not write there (or which changed since). Fix: save to a new or empty "
            "directory (nothing is overwritten or deleted).")
    return mine


def _target(path: Any) -> Path:
    """The destination folder: ``path``, or the folder it links to; a path that is, or
    is under, a file or a dangling link is an error naming it."""
    out = as_path(path, "save_safetensors")
    if out.is_symlink():
        if not out.exists():
            raise export_dir.ExportError(
                f"save_safetensors: path {str(path)!r} is a symbolic link to "
                f"{os.readlink(out)!r}, which does not exist. Fix: create the folder it points "
                "to, remove the link, or save to another directory.")
        out = Path(os.path.realpath(out))
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"save_safetensors: path {str(path)!r} is a file, not a directory "
                              "(it is never written over). Fix: a directory path")
    _not_in_use(path, out)
    for parent in Path(os.path.abspath(out)).parents:
        if os.path.lexists(parent):
            if not parent.is_dir():
                raise export_dir.ExportError(
                    f"save_safetensors: path {str(path)!r} is under {str(parent)!r}, which is "
                    "not a directory (a file or a dangling link). Fix: save to a directory "
                    "path whose parents are folders.")
            break
    return out


def _not_in_use(path: Any, out: Path) -> None:
    """Refuses a destination the export cannot be swapped into: the working directory
    or a folder above it (the swap would pull the process's working directory away
    with the previous export) and a mount point (which no rename moves)."""
    real = Path(os.path.realpath(out))
    try:
        cwd: Path | None = Path(os.path.realpath(os.getcwd()))
    except OSError:  # the working directory is gone: nothing of it to pull away
        cwd = None
    fix = (f"Fix: save to a subfolder, e.g. save_safetensors({os.path.join(str(path), 'export')!r}"
           ", model); nothing was written.")
    if cwd is not None and (cwd == real or real in cwd.parents):
        what = "the working directory" if cwd == real else f"above the working directory {cwd}"
        raise export_dir.ExportError(
            f"save_safetensors: path {str(path)!r} ({real}) is {what}: the export is written "
            "beside the destination and swapped in whole, which would move the working "
            f"directory of this process with the previous folder. {fix}")
    if real.is_dir() and os.path.ismount(real):
        raise export_dir.ExportError(
            f"save_safetensors: path {str(path)!r} ({real}) is a mount point: the export is "
            "written beside the destination and swapped in by a rename, which cannot move a "
            f"mount point. {fix}")


def _check_plain(model: Any) -> None:
    """Refuses a model with LoRA adapters or a quantized (QLoRA) base before anything is
    written: a Hugging Face checkpoint holds plain weights, which those are not yet."""
    from nnx_shard._low_rank import adapters
    from nnx_shard._quantized import QuantizedKernel

    found = sorted(adapters(model))
    quantized = sorted(path_str(p) for p, node in nnx.iter_graph(model)
                       if isinstance(node, QuantizedKernel))
    if not found and not quantized:
        return
    what = (f"LoRA adapters on {len(found)} kernel(s) (e.g. {found[0]!r})" if found else
            f"{len(quantized)} quantized kernel(s) (e.g. {quantized[0]!r})")
    base = " over a quantized base" if found and quantized else ""
    merge = ("ns.merge_lora(model) (which also dequantizes the base)" if quantized else
             "ns.merge_lora(model)")
    raise UsageError(
        f"save_safetensors: model has {what}{base}, which a Hugging Face checkpoint cannot "
        f"hold. Nothing was written. Fix: merge them into the weights first with {merge}, "
        "or save the adapter alone with ns.hf.save_lora(path, model).")


def _values(model: Any) -> Any:
    """``model``'s state, its values checked: host (numpy) arrays are placed on the
    default device (written as any single-device array is); a model without values
    (nnx.eval_shape, ns.abstract_init) or with deleted (donated) arrays is refused
    before anything is written, since its export would be all zeros."""
    flat = []
    bad = []
    for key, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if isinstance(value, np.ndarray | np.generic):
            # A copy of the variable: the user's model keeps its own values.
            value = jax.numpy.asarray(value)
            var = var.replace(value) if isinstance(var, nnx.Variable) else value
        if not isinstance(value, jax.Array) or value.is_deleted():
            bad.append((path_str(key), value))
        flat.append((key, var))
    if bad:
        path, value = bad[0]
        what = ("a deleted array (donated to a step)" if isinstance(value, jax.Array) else
                f"abstract ({type(value).__name__}: a shape and dtype, no values)"
                if isinstance(value, jax.ShapeDtypeStruct) else
                f"a {type(value).__name__} ({short(value, 40)}), not an array")
        raise NnxShardError(
            f"save_safetensors: parameter {path!r} is {what}; {len(bad)} of {len(flat)} "
            "variables have no values to write. Nothing was written. Fix: save a model with "
            "values: build it with ns.sharded_init / strategy.sharded_init, or fill an "
            "abstract one with ns.hf.load_safetensors or ns.restore first.")
    return nnx.from_flat_state(flat)


def _check_args(path: Any, model: Any, max_shard_bytes: Any, dtype: Any) -> None:
    _target(path)
    if dtype is not None:
        try:
            kind = st.dtype_name(dtype)
        except (TypeError, ValueError):
            raise UsageError(f"save_safetensors: dtype {short(dtype, 40)} is not a dtype. Fix: "
                             "e.g. dtype=jnp.bfloat16, or None to keep each parameter's") from None
        if not kind.startswith(("F", "BF")):
            raise NnxShardError(
                f"save_safetensors: dtype {np.dtype(dtype).name} is not a floating-point dtype: "
                "parameters cast to it lose their values, and nothing loads such a checkpoint "
                "back into the model. Fix: e.g. dtype=jnp.bfloat16 or jnp.float32, or None to "
                "keep each parameter's")
    if not isinstance(model, nnx.Module):
        raise UsageError(f"save_safetensors: model must be an nnx.Module, got "
                         f"{type(model).__name__} {short(model, 60)}. Fix: the model to write")
    if max_shard_bytes is not None:
        count(max_shard_bytes, "save_safetensors: max_shard_bytes",
              fix="bytes per file, e.g. 5 * 10**9, or None for one file")


def _plan_files(leaves: Mapping[str, Leaf], max_shard_bytes: int | None, dtype: Any
                ) -> tuple[dict[str, tuple[str, tuple[int, ...], Leaf]], list[str],
                           list[list[str]], list[str]]:
    """The tensors to write (Hugging Face key -> (dtype name, shape, leaf)), their keys
    in order, the keys of each file, and the file names."""
    tensors: dict[str, tuple[str, tuple[int, ...], Leaf]] = {}
    for leaf in leaves.values():
        t = TRANSFORM_FNS[leaf.transform or "copy"]
        shape = tuple(t.hf_shape(leaf.layer_shape))
        kind = st.dtype_name(leaf.dtype if dtype is None else dtype)
        for key in leaf.keys.values():
            tensors[key] = (kind, shape, leaf)
    order = sorted(tensors, key=natural)
    groups: list[list[str]] = [[]]
    size = 0
    for key in order:
        kind, shape, _ = tensors[key]
        n = st.DTYPES[kind].itemsize * int(np.prod(shape))
        if max_shard_bytes is not None and groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    names = ([SINGLE] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    return tensors, order, groups, names


def save_safetensors(path: str | os.PathLike[str], model: Any,
                     mapping: Mapping[str, MappingValue] | None = None, *,
                     max_shard_bytes: int | None = None, dtype: Any = None,
                     source: Any = None, copy_tokenizer: bool = True,
                     tokenizer: Any = None) -> None:
    """Writes ``model``'s parameters as a Hugging Face checkpoint in the directory
    ``path``: ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json`` with ``max_shard_bytes``), plus
    ``config.json`` for a :class:`~nnx_shard.models.Decoder` (transformers'
    ``from_pretrained`` reads the directory).

    Works from any mesh and any number of processes: parameter by parameter,
    each device's shard is turned back into the Hugging Face layout on device
    and written by its own process into its byte ranges; no array is gathered.
    Every process must call it (processes must share the filesystem).
    :func:`load_safetensors` of the result is bitwise the saved model (for the
    same dtype).

    The export is written whole into a folder beside ``path`` and swapped into
    place when every byte is on disk (:mod:`nnx_shard.hf._export_dir`): a save
    that fails (a full disk) or is killed leaves the previous export at
    ``path`` as it was, and never a folder that loads. A previous export of
    ``save_safetensors`` is replaced (the marker ``.nnx_shard_safetensors``
    proves which files it wrote); the user's other files in ``path`` stay; a
    file in the way of the export, or a marker save_safetensors did not write,
    is an error and nothing is deleted. The model must hold values (not an
    ``nnx.eval_shape`` / ``abstract_init`` one) and ``dtype`` must be a
    floating-point type.

    The export keeps the destination folder's mode and owner (a private 0700
    folder stays private), and its files are no more open than the folder lets
    them be read, nor than the files they replace. A destination the swap cannot
    take is refused before anything is written: the working directory, a folder
    above it, a mount point (save to a subfolder). A failed write names the file
    it was writing.

    Args:
      path: the output directory (created if needed).
      model: a concrete model with sharded (or single-device) arrays.
      mapping: as in :func:`load_safetensors`; each template must be invertible
        (literal text and groups). Default :func:`mapping_for`.
      max_shard_bytes: split the tensors over files of at most this many bytes
        (a tensor larger than that gets its own file).
      dtype: store every tensor in this dtype (e.g. ``jnp.bfloat16``); default:
        the source's ``torch_dtype`` / ``dtype``, else each parameter's own.
      source: the checkpoint the model comes from (:mod:`nnx_shard.hf._source`):
        None for the one :func:`~nnx_shard.hf.load_pretrained` remembered (if
        any), a checkpoint folder, or False for none. With a source the export is
        one to publish: its ``config.json`` keeps the source's fields (token ids,
        rope settings, unknown keys) with the model's sizes and the export's
        dtype, ``generation_config.json`` is the source's (or the config's bos /
        eos / pad ids), and the tokenizer files are copied.
      copy_tokenizer: False leaves the source's tokenizer files out.
      tokenizer: the :class:`~nnx_shard.inference.Tokenizer` whose ids the model
        reads, written in place of the source's tokenizer files (its
        ``tokenizer.json`` with any tokens added to it, its config and chat
        template): pass it after adding tokens and
        :func:`~nnx_shard.models.resize_token_embeddings`. Without it, a model
        resized from its source's ``vocab_size`` is refused while the source's
        tokenizer lacks the ids it was resized for (its size names both); a
        tokenizer with more ids than the model's vocabulary is refused.

    >>> import json
    >>> import os
    >>> from flax import nnx
    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> import nnx_shard as ns
    >>> from nnx_shard.hf import save_safetensors
    >>> from nnx_shard.models import Decoder, get_config
    >>> model = ns.sharded_init(lambda: Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0)),
    ...                         "data=4,model=2", ns.strategies.get("fsdp_tp"))
    >>> out = tempfile.mkdtemp()
    >>> save_safetensors(out, model, max_shard_bytes=40_000, dtype=jnp.bfloat16)
    >>> sorted(os.listdir(out))[:3]
    ['.nnx_shard_safetensors', 'config.json', 'model-00001-of-00002.safetensors']
    >>> json.load(open(os.path.join(out, "config.json")))["torch_dtype"]
    'bfloat16'
    """
    _check_args(path, model, max_shard_bytes, dtype)
    _check_plain(model)
    state = _values(model)
    files, dtype = export_files(model, source, copy_tokenizer, dtype, tokenizer)
    rules = compile_rules(mapping_for(model) if mapping is None else mapping)
    leaves = _plan_save(state, rules)
    tensors, order, groups, names = _plan_files(leaves, max_shard_bytes, dtype)
    # Phi-3 stores q/k/v and gate/up fused: written as parts into their fused tensors.
    found = fused.fusions_for(model)
    groups = fused.regroup(groups, found)
    out = _target(path)
    extra = ([INDEX] if len(groups) > 1 else []) + list(files)
    token = _shared_token()
    stage = export_dir.staging(out, token)
    first = jax.process_index() == 0
    export_dir._ACTIVE.add(token)
    try:
        if first:
            with _failing(out, stage, token):
                previous = _prepare(out, names + extra)
                out.parent.mkdir(parents=True, exist_ok=True)
                modes = export_dir.make_stage(stage, out)
                export_dir.write_marker(stage, token, out.name, None)
                for name, group in zip(names, groups, strict=True):
                    with export_dir.writing(stage / name):
                        st.create(str(stage / name),
                                  fused.fuse_names({k: tensors[k][:2] for k in group}, found),
                                  {"format": "pt"})
        barrier("nnx_shard.save_safetensors.create")
        with _failing(out, stage, token, remove=first):
            _write_tensors(state, leaves, [str(stage / n) for n in names], dtype, found)
        barrier("nnx_shard.save_safetensors.written")
        if first:
            with _failing(out, stage, token):
                if len(groups) > 1:
                    total = sum(st.DTYPES[tensors[k][0]].itemsize * int(np.prod(tensors[k][1]))
                                for k in order)
                    index = {"metadata": {"total_size": total},
                             "weight_map": {k: n for n, g in zip(names, groups, strict=True)
                                            for k in fused.fuse_names(
                                                {k: tensors[k][:2] for k in g}, found)}}
                    with export_dir.writing(stage / INDEX):
                        st.write_file(str(stage / INDEX),
                                      (json.dumps(index, indent=2) + "\n").encode())
                for name, raw in files.items():
                    with export_dir.writing(stage / name):
                        st.write_file(str(stage / name), raw)
                modes.apply(stage, names + extra)
                export_dir.write_marker(stage, token, out.name, names + extra)
                export_dir.carry_over(out, stage, previous)
                export_dir.fsync_dir(stage)
                export_dir.swap_in(stage, out, token)
        barrier("nnx_shard.save_safetensors.swapped")
    finally:
        export_dir._ACTIVE.discard(token)


def _shared_token() -> str:
    """One fresh export token, the same in every process (process 0's)."""
    token = export_dir.new_token()
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        raw = multihost_utils.broadcast_one_to_all(np.frombuffer(bytes.fromhex(token), np.uint8))
        token = bytes(np.asarray(raw, np.uint8)).hex()
    return token


@contextlib.contextmanager
def _failing(out: Path, stage: Path, token: str, *, remove: bool = True) -> Iterator[None]:
    """On any failure, removes this save's staging folder (``remove``: process 0) and
    reports an OSError as an :class:`~nnx_shard.hf._export_dir.ExportError` naming
    ``out``; the previous export there is untouched."""
    try:
        yield
    except BaseException as e:
        if remove:
            with contextlib.suppress(OSError):
                export_dir.remove_stage(stage, token, out, mine=True)
        if isinstance(e, OSError) and not isinstance(e, NnxShardError | FileExistsError):
            where = ""
            if e.filename:
                name = Path(os.fsdecode(e.filename))
                where = (f" (writing {name.name})" if name.parent == stage else
                         f" (writing {name})")
            fix = export_dir.write_fix(
                e.errno, "the export", "directory", " (the export needs about the model's size "
                "twice while the previous one is replaced)")
            raise export_dir.ExportError(
                f"save_safetensors: could not write the export to {out}: "
                f"{e.strerror or e}{where}. The previous export there (if any) is untouched and "
                f"nothing of this one was kept. Fix: {fix}.") from e
        raise


def _write_tensors(state: Any, leaves: Mapping[str, Leaf], files: Sequence[str],
                   dtype: Any, found: list[fused.Fusion]) -> None:
    """Writes this process's shards of every parameter of ``state`` into the created
    ``files``."""
    header = fused.split(st.read_header(*files), found, "save_safetensors")
    arrays = {path_str(k): v.get_value() if isinstance(v, nnx.Variable) else v
              for k, v in nnx.to_flat_state(state)}
    for leaf in leaves.values():
        # The Auto view of the parameter's mesh (the same buffers), as the program takes it.
        x = rewrap(arrays.pop(leaf.path), layouts(leaf)[2])
        y = program(leaf, "save", leaf.dtype if dtype is None else dtype)(x)
        for shard in y.addressable_shards:
            if shard.replica_id != 0:
                continue
            data = np.asarray(shard.data)
            if leaf.layers and leaf.depth == 2:
                l0 = shard.index[0].indices(leaf.shape[0])[0]
                e0 = shard.index[1].indices(leaf.shape[1])[0]
                for i in range(data.shape[0]):
                    for j in range(data.shape[1]):
                        key = leaf.keys[(l0 + i) * leaf.shape[1] + e0 + j]
                        with export_dir.writing(Path(header.tensors[key].path)):
                            st.write_slice(header.tensors[key].path, header, key,
                                           shard.index[2:], data[i, j])
            elif leaf.layers:
                first = shard.index[0].indices(leaf.layers)[0]
                for i in range(data.shape[0]):
                    key = leaf.keys[first + i]
                    with export_dir.writing(Path(header.tensors[key].path)):
                        st.write_slice(header.tensors[key].path, header, key, shard.index[1:],
                                       data[i])
            else:
                key = leaf.keys[None]
                with export_dir.writing(Path(header.tensors[key].path)):
                    st.write_slice(header.tensors[key].path, header, key, shard.index, data)
        del y
    for f in files:
        with export_dir.writing(Path(f)):
            st.sync(f)
