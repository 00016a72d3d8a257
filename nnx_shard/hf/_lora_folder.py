"""A PEFT adapter folder written as a whole (:func:`~nnx_shard.hf.save_lora`): the
files staged in a folder beside the destination and swapped in, the previous folder's
own files dropped and any other file carried over, and the stages that killed saves
left tidied away."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import socket
import stat
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nnx_shard import _safetensors_io as st
from nnx_shard._errors import NnxShardError, UsageError
from nnx_shard.hf import _export_dir as export_dir
from nnx_shard.hf._files import as_path

__all__ = ["CONFIG", "WEIGHTS", "destination", "owner", "replace_folder", "write_adapter"]

CONFIG = "adapter_config.json"


WEIGHTS = "adapter_model.safetensors"


def destination(path: Any) -> Path:
    """The folder to save into: ``path``, or the folder it links to; a dangling link, a
    file, or a path under a file is an error naming it (nothing is written)."""
    out = as_path(path, "save_lora")
    if out.is_symlink() and not out.exists():
        raise UsageError(f"save_lora: {out} is a symbolic link to {os.readlink(out)!r}, which "
                         "does not exist (nothing is written through it). Fix: create the folder "
                         "it points to, remove the link, or save to another directory.")
    out = Path(os.path.realpath(out))
    if out.exists() and not out.is_dir():
        raise UsageError(f"save_lora: {path} exists and is not a directory. "
                         "Fix: pass a folder path.")
    for parent in out.parents:
        if os.path.lexists(parent):
            if not parent.is_dir():
                raise UsageError(f"save_lora: {path} is under {parent}, which is not a "
                                 "directory. Fix: save to a folder path whose parents are "
                                 "folders.")
            break
    for name in (CONFIG, WEIGHTS):
        p = out / name
        if not p.is_symlink() and p.is_dir():
            raise UsageError(f"save_lora: {p} is a folder, where the adapter's file goes. "
                             "Fix: move it away, or save to another directory.")
    return out


def write_adapter(stage: Path, tensors: Mapping[str, np.ndarray], config: bytes) -> None:
    """Writes the adapter's two files into the fresh folder ``stage``, flushed to disk."""
    file = str(stage / WEIGHTS)
    names = sorted(tensors)
    st.create(file, {n: (st.dtype_name(tensors[n].dtype), tensors[n].shape) for n in names},
              {"format": "pt"})
    header = st.read_header(file)
    for n in names:
        st.write_slice(file, header, n, [slice(None)] * tensors[n].ndim, tensors[n])
    st.sync(file)
    st.write_file(str(stage / CONFIG), config)


_MINE = (CONFIG, WEIGHTS, WEIGHTS + ".partial")  # the last: left by an older, killed save_lora


_STAGE = ".save_lora-"


def owner() -> str:
    """This process, as stage folder names record it: a digest of the host name, the pid."""
    host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
    return f"{host}-{os.getpid()}"


def _clean_leftovers(out: Path) -> None:
    """Tidies the folders that killed saves of this host left beside ``out``: a new adapter
    never swapped in, or a previous one swapped out; their other entries go back to
    ``out`` (as after a finished save). A folder of a process still running is left."""
    host = owner().partition("-")[0]
    pattern = re.compile(rf"\.{re.escape(out.name)}{_STAGE}{host}-(\d+)-[0-9a-f]{{32}}")
    if not out.parent.is_dir():
        return
    for p in out.parent.iterdir():
        hit = pattern.fullmatch(p.name)
        if hit is None or p.is_symlink() or not p.is_dir() or _running(int(hit.group(1))):
            continue
        _drop_previous(p, out, "the folder a killed save left,")


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True  # a save in flight in another thread of this process
    return export_dir.pid_running(pid)


def _new_stage(out: Path) -> Path:
    """A fresh, uniquely named folder beside ``out``, made as ``out`` would be (mode
    0o777 less the umask)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    while True:
        stage = out.parent / f".{out.name}{_STAGE}{owner()}-{export_dir.new_token()}"
        try:
            stage.mkdir()
        except FileExistsError:
            continue
        break
    return stage


def replace_folder(out: Path, write: Callable[[Path], None]) -> None:
    """Fills a fresh folder beside ``out`` with ``write`` and swaps it in for ``out``
    atomically; on any failure removes it and leaves ``out`` as it was."""
    stage: Path | None = None
    try:
        _clean_leftovers(out)
        stage = _new_stage(out)
        write(stage)
        _carry_over(out, stage)
        with contextlib.suppress(FileNotFoundError):  # last: a read-only mode is kept too
            stage.chmod(stat.S_IMODE(out.stat().st_mode))
        export_dir.fsync_dir(stage)
        old = _swap(stage, out)
    except BaseException as e:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, NnxShardError):
            where = f" ({e.filename})" if e.filename else ""
            fix = export_dir.write_fix(e.errno, "the adapter")
            raise NnxShardError(
                f"save_lora: could not write the adapter to {out}: {e.strerror or e}{where}. "
                "The previous adapter there (if any) is untouched and nothing of this save was "
                f"kept. Fix: {fix}.") from e
        raise
    export_dir.fsync_dir(out.parent)
    if old is not None:
        _drop_previous(old, out)


def _carry_over(out: Path, stage: Path) -> None:
    """Hard-links the other regular files of ``out`` into ``stage``, so the new folder
    has them from the instant it is swapped in (others are moved back after)."""
    if not out.is_dir():
        return
    for p in out.iterdir():
        if p.name in _MINE or os.path.lexists(stage / p.name):
            continue
        if not p.is_symlink() and p.is_file():
            with contextlib.suppress(OSError):
                os.link(p, stage / p.name, follow_symlinks=False)


def _swap(stage: Path, out: Path) -> Path | None:
    """Puts ``stage`` at ``out`` in one rename (an exchange when ``out`` exists) and
    returns where the previous folder now is (``stage``), or None when there was none."""
    for _ in range(100):  # another save may create or swap ``out`` between the two calls
        if not os.path.lexists(out):
            try:
                os.rename(stage, out)
                return None
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                continue
        try:
            export_dir._exchange(stage, out)
        except FileNotFoundError:
            continue
        return stage
    raise OSError(errno.EBUSY, "the folder kept changing under concurrent saves", str(out))


def _drop_previous(old: Path, out: Path, what: str = "its previous folder") -> None:
    """Removes the folder ``old`` beside ``out`` (the previous one, swapped out): its
    adapter files go, the other entries come back to ``out`` unless ``out`` has them
    already; what cannot be is left, with a warning."""
    try:
        old.chmod(0o700)  # it kept the destination's mode, which may be read-only
        for p in list(old.iterdir()):
            if p.name in _MINE or _same_file(p, out / p.name):
                if p.is_symlink() or not p.is_dir():
                    p.unlink()  # a link itself, never its target
            elif not os.path.lexists(out / p.name):
                os.rename(p, out / p.name)
        old.rmdir()
    except OSError as e:
        warnings.warn(f"save_lora: {what} {old}, beside {out}, could not be removed ({e}); "
                      "remove it yourself.", stacklevel=4)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samestat(os.lstat(a), os.lstat(b))
    except OSError:
        return False

