"""The checkpoint package's shared helpers: the checkpoint directory, whose step
folders are whose (only folders a save of nnx_shard finished or claimed are ever
touched), the write lock, leftovers and rotation. Its private names are for the
package's own modules (save, restore, the Checkpointer, exits, the backend)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import socket
import threading
import uuid
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from nnx_shard._errors import UsageError, check_path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, no removal of temporary folders
    fcntl = None  # type: ignore[assignment]


_FORMAT = 2
_FORMATS = (1, 2)  # the manifest formats this nnx_shard reads
_ITEMS = ("model", "optimizer")
TMP_MARK = ".orbax-checkpoint-tmp"
_TRASH_MARK = ".nnx_shard-deleting"
LOCK_FILE = ".nnx_shard.lock"
STEP_NAME = re.compile(r"0|[1-9][0-9]*")
_TRASH_NAME = re.compile(r"[0-9]+" + re.escape(_TRASH_MARK) + r"-.*")
_SHOW = 8  # paths listed in one error message before "... and N more"
# Bounds the host/device memory a restore or save needs beyond the state itself.
_HASH_BATCH_BYTES = 64 * 2**20
_RESTORE_CONCURRENT_GB = 0.25
_STALL_ENV = "NNX_SHARD_EXIT_STALL"
_STALL_DEFAULT_S = 60.0


# --------------------------------------------------------------------------- directories

# Saves to one directory are serialised within the process: orbax writes a step
# under a temporary name and renames it, and two writers of one step collide on
# that rename ("Directory not empty") or delete each other's temporary files.
_DIR_LOCKS: dict[pathlib.Path, threading.RLock] = {}
_DIR_LOCKS_LOCK = threading.Lock()
# Checkpointers open per directory, whose background writes a save must wait for.
_OPEN: dict[pathlib.Path, weakref.WeakSet[Any]] = {}
# Checkpointers with a save in flight or a failure not yet raised: kept alive until
# exit even when the user dropped them, so neither is lost.
_UNSETTLED: set[Any] = set()


def _dir_lock(directory: pathlib.Path) -> threading.RLock:
    with _DIR_LOCKS_LOCK:
        return _DIR_LOCKS.setdefault(directory, threading.RLock())


def _settle(directory: pathlib.Path) -> None:
    """Waits for the background saves of every Checkpointer of ``directory`` in this
    process, so the disk shows which steps exist (call with the directory's lock). A
    failure is kept for its Checkpointer to raise."""
    with _DIR_LOCKS_LOCK:
        open_now = list(_OPEN.get(directory, ()))
    for ckpt in open_now:
        ckpt._collect()


def _resolve_dir(directory: Any, caller: str) -> pathlib.Path:
    """``directory`` as an absolute path; an empty path or a non-path is refused."""
    if isinstance(directory, bytes) or not isinstance(directory, str | os.PathLike):
        raise UsageError(
            f"{caller}: the directory must be a path (str or os.PathLike), got "
            f"{type(directory).__name__} {directory!r:.60}. Fix: e.g. 'runs/ckpt'."
        )
    text = os.fspath(directory)
    if not isinstance(text, str):
        raise UsageError(f"{caller}: the directory must be a str path, got {text!r:.60}. "
                         "Fix: e.g. 'runs/ckpt'.")
    if text == "" or (isinstance(directory, pathlib.PurePath) and not directory.parts):
        # pathlib.Path("") is "."; an empty string would silently mean the current directory.
        raise UsageError(
            f"{caller}: the directory is an empty path; it would mean the current "
            "directory. Fix: name a folder for the checkpoints, e.g. 'runs/ckpt' (created "
            "if missing)."
        )
    try:
        return pathlib.Path(text).expanduser().absolute()
    except RuntimeError:  # "~user" of no known user (pathlib cannot find a home)
        user = text[1:].split("/", 1)[0] or "the current user"
        raise UsageError(
            f"{caller}: the directory {text!r} starts with '~' but the home directory of "
            f"{user} is not known (no such user, or HOME is unset). Fix: write the path out, "
            "e.g. '/home/me/ckpt' or 'runs/ckpt'."
        ) from None


def _refuse_file(directory: pathlib.Path, caller: str) -> None:
    """A NotADirectoryError when ``directory`` (or a parent of it) is an existing file."""
    check_path(directory, caller, expected="a checkpoint directory", missing_ok=True,
               kind_error=NotADirectoryError,
               fix="pass a directory (it holds one subdirectory per step; save and "
                   "Checkpointer create it when missing), e.g. a new folder name.")


# --------------------------------------------------------------------------- whose folders


class _WriteLock:
    """The directory's lock file, held shared by this process while it writes a step.

    Opening a :class:`Checkpointer` removes temporary folders of interrupted saves
    only when it can take the lock exclusively, i.e. while no process writes.
    Locks die with their process, so a killed save does not hold it.
    """

    def __init__(self, directory: pathlib.Path) -> None:
        self.fd: int | None = None
        if fcntl is None:  # pragma: no cover - no flock (Windows)
            return
        try:
            fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # e.g. a read-only directory: the save itself reports it
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError:  # pragma: no cover - a file system without flock
            os.close(fd)
            return
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@contextlib.contextmanager
def _alone(directory: pathlib.Path) -> Iterator[bool]:
    """Yields True while holding the directory's lock exclusively (no process is
    writing a step there), False when that cannot be had or known."""
    if fcntl is None:  # pragma: no cover
        yield False
        return
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
        else:
            yield True
    finally:
        os.close(fd)


def _step_folders(directory: pathlib.Path) -> dict[int, pathlib.Path]:
    """Every real folder (not a symlink) of ``directory`` named as a step number."""
    if not directory.is_dir():
        return {}
    return {int(p.name): p for p in directory.iterdir()
            if STEP_NAME.fullmatch(p.name) and not p.is_symlink() and p.is_dir()}


def _claims(path: pathlib.Path) -> bool:
    """Whether the step folder says it is ours (it has a manifest file at all)."""
    return (path / "manifest" / "metadata").is_file()


def not_whole(path: pathlib.Path) -> str | None:
    """Why ``path`` is not a whole checkpoint of ours, or None when it is one: our
    manifest (a known format, with its digest) and the files of every item it lists."""
    try:
        manifest = json.loads((path / "manifest" / "metadata").read_bytes())
    except FileNotFoundError:
        return "has no manifest/metadata (nnx_shard writes one into every step)"
    except (OSError, ValueError) as e:
        return f"has a manifest that cannot be read ({type(e).__name__})"
    if not (isinstance(manifest, dict) and manifest.get("format") in _FORMATS
            and "digest" in manifest and isinstance(manifest.get("items"), dict)):
        return "has a manifest without nnx_shard's format and digest"
    needed = ["_CHECKPOINT_METADATA", "extra/metadata"]
    needed += [f"{name}/_METADATA" for name in manifest["items"] if name in _ITEMS]
    missing = [f for f in needed if not (path / f).is_file()]
    if missing:
        return f"is incomplete (no {', '.join(missing)})"
    return None


def _finished_steps(directory: pathlib.Path) -> list[int]:
    """The whole checkpoints of ours, oldest first. From the disk, not orbax's cache:
    a save in flight is not one yet, nor a folder of the user's with a number for a
    name, nor a damaged or half-deleted step."""
    return sorted(s for s, p in _step_folders(directory).items() if not_whole(p) is None)


def _unfinished(directory: pathlib.Path, step: int | None = None) -> list[str]:
    if not directory.is_dir():
        return []
    head = str(step) if step is not None else r"\d+"
    pattern = re.compile("^" + head + re.escape(TMP_MARK))
    return sorted(p.name for p in directory.iterdir() if pattern.match(p.name))


# --------------------------------------------------------------------------- claims
#
# A folder is removed only when a claim of ours names it: a record written before the
# folder was made (a save's temporary folder) or renamed (a step being deleted), with
# the writer's host and process id and, once it exists, the folder's device and inode.
# A name alone proves nothing: a user's "5.orbax-checkpoint-tmp" or
# "7.nnx_shard-deleting-mine" is never touched.

_CLAIM = ".nnx_shard-claim-"
_CLAIM_NAME = re.compile(re.escape(_CLAIM) + r"[0-9a-f]{32}\.json")
# What orbax and nnx_shard write at the top of a step folder.
_STEP_CONTENT = {*_ITEMS, "extra", "manifest", "_CHECKPOINT_METADATA", "commit_success.txt"}


def _tmp_name(step: int) -> str:
    """The temporary folder orbax writes ``step`` into (renamed to ``step`` when done)."""
    return f"{step}{TMP_MARK}"


def _claim(directory: pathlib.Path, kind: str, name: str, step: int) -> pathlib.Path:
    """Records that this process is about to make (``kind="tmp"``) or rename into
    (``"trash"``) the folder ``name``; returns the record's path."""
    record = directory / f"{_CLAIM}{uuid.uuid4().hex}.json"
    data = {"kind": kind, "name": name, "step": step, "host": socket.gethostname(),
            "pid": os.getpid(), "ino": None, "dev": None}
    _write_record(record, data)
    return record


def _write_record(record: pathlib.Path, data: dict[str, Any]) -> None:
    """Writes a claim whole (a temporary file renamed over it); a failed write (a full
    disk) leaves no temporary file and names the record in its error."""
    tmp = record.with_name(record.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, record)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if e.filename is None:
            e.filename = str(record)
        raise


def _pin(record: pathlib.Path, folder: pathlib.Path) -> None:
    """Adds ``folder``'s device and inode to its claim ``record`` (once it exists)."""
    try:
        data = json.loads(record.read_text())
        st = os.lstat(folder)
    except (OSError, ValueError):
        return
    data["dev"], data["ino"] = st.st_dev, st.st_ino
    # Without the inode (a full disk), the claim still proves the folder by its content.
    with contextlib.suppress(OSError):
        _write_record(record, data)


def _claims_in(directory: pathlib.Path) -> list[tuple[pathlib.Path, dict[str, Any]]]:
    """Every readable claim record of ``directory``."""
    found: list[tuple[pathlib.Path, dict[str, Any]]] = []
    if not directory.is_dir():
        return found
    for p in directory.iterdir():
        if not _CLAIM_NAME.fullmatch(p.name) or p.is_symlink():
            continue
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("name"), str) and \
                data.get("kind") in ("tmp", "trash") and isinstance(data.get("pid"), int):
            found.append((p, data))
    return found


def _writer_gone(directory: pathlib.Path, data: dict[str, Any]) -> bool:
    """Whether the process that wrote a claim is gone (never known of another host)."""
    if data.get("host") != socket.gethostname():
        return False
    if data["pid"] == os.getpid():
        return str(directory / data["name"]) not in _IN_FLIGHT
    try:
        os.kill(data["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


# Temporary folders of this process's saves in flight.
_IN_FLIGHT: set[str] = set()


def _proven(directory: pathlib.Path, data: dict[str, Any]) -> pathlib.Path | None:
    """The folder a claim names, when it is provably the claimed one: a real folder
    (not a link) named as claimed, the recorded device and inode, or, when the claim
    was made before the folder existed, nothing in it but what a step holds."""
    name = data["name"]
    if "/" in name or name in ("", ".", ".."):
        return None
    pattern = _TRASH_NAME if data["kind"] == "trash" else re.compile(
        r"[0-9]+" + re.escape(TMP_MARK))
    path = directory / name
    if not pattern.fullmatch(name) or path.is_symlink() or not path.is_dir():
        return None
    if data.get("ino") is not None:
        st = os.lstat(path)
        return path if (st.st_dev, st.st_ino) == (data.get("dev"), data["ino"]) else None
    try:
        names = {p.name.split(TMP_MARK)[0] for p in path.iterdir()}
    except OSError:
        return None
    return path if names <= _STEP_CONTENT else None


def _drop_claimed(directory: pathlib.Path, record: pathlib.Path, data: dict[str, Any]) -> None:
    """Removes the folder a claim proves ours, then the claim."""
    path = _proven(directory, data)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        record.unlink()


def _remove_leftovers(directory: pathlib.Path) -> None:
    """Removes what interrupted work of ours left (process 0 only): steps being
    deleted when their process died, and temporary folders of saves that were
    killed, the latter only while no process writes a step here (see
    :class:`_WriteLock`) and once their writer is gone. Only folders a claim
    proves ours (see :func:`_claim`) are removed; a folder merely named like one
    is left alone. (Orbax's own ``cleanup_tmp_directories``, which goes by name,
    stays off: see :func:`~nnx_shard._checkpoint._save.manager`.)
    """
    if jax.process_index() != 0 or not directory.is_dir():
        return
    claims = _claims_in(directory)
    for record, data in claims:
        if data["kind"] == "trash":
            _drop_claimed(directory, record, data)
    tmp = [(r, d) for r, d in claims if d["kind"] == "tmp" and _writer_gone(directory, d)]
    if not tmp:
        return
    with _alone(directory) as alone:
        if alone:
            for record, data in tmp:
                _drop_claimed(directory, record, data)


def delete_step(directory: pathlib.Path, step: int) -> None:
    """Deletes a step of ours: renamed first (atomic), so a kill half-way leaves a
    ``*.nnx_shard-deleting-*`` folder, claimed, to finish later, never a half-deleted
    step."""
    name = f"{step}{_TRASH_MARK}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    record = _claim(directory, "trash", name, step)
    _pin(record, directory / str(step))  # the inode the rename keeps
    try:
        os.rename(directory / str(step), directory / name)
    except FileNotFoundError:  # deleted meanwhile
        record.unlink()
        return
    _drop_claimed(directory, record, json.loads(record.read_text()))


def _rotate(mngr: Any, directory: pathlib.Path, keep: int | None) -> None:
    """Deletes the oldest whole checkpoints of ours beyond the newest ``keep``."""
    if keep is None or jax.process_index() != 0:
        return
    steps = _finished_steps(directory)
    gone = steps[:-keep] if len(steps) > keep else []
    for step in gone:
        delete_step(directory, step)
    if gone:
        _forget(mngr, gone)


def _forget(mngr: Any, steps: Sequence[int]) -> None:
    # Orbax caches the steps it saved (and refuses to save one again): drop deleted ones.
    infos = getattr(mngr, "_checkpoints", None)
    if infos is not None and hasattr(infos, "delete_if"):
        infos.delete_if(lambda info: info.step in steps)
    else:  # pragma: no cover - another orbax: re-read the directory
        mngr.reload()


def _claim_tmp(directory: pathlib.Path, step: int, caller: str) -> pathlib.Path | None:
    """Claims the temporary folder of this process's save of ``step`` before orbax
    makes it (process 0; None elsewhere). A folder already there under that name is
    removed only when a claim proves it a leftover of ours; anything else is an error
    (orbax would delete it)."""
    if jax.process_index() != 0:
        return None
    name = _tmp_name(step)
    if os.path.lexists(directory / name):
        for record, data in _claims_in(directory):
            if data["kind"] == "tmp" and data["name"] == name and _writer_gone(directory, data):
                _drop_claimed(directory, record, data)
    if os.path.lexists(directory / name):
        raise FileExistsError(
            f"{caller}: {directory / name} is in the way of the save of step {step} (orbax "
            "writes the step there first) and nnx_shard did not make it; it is never "
            f"deleted. Fix: move it out of {directory}, or save under another step.")
    _IN_FLIGHT.add(str(directory / name))
    return _claim(directory, "tmp", name, step)


def _pin_tmp(record: pathlib.Path | None, directory: pathlib.Path, step: int) -> None:
    if record is not None and os.path.isdir(directory / _tmp_name(step)):
        _pin(record, directory / _tmp_name(step))


def _taken(mngr: Any) -> None:
    """Marks the failure of ``mngr``'s last save as reported (nnx_shard raises it once,
    as its own error). orbax keeps it on the finished finalize thread and raises it
    again to each further thread that waits, closes included: closing from another
    thread (exit closes from one) raised the raw error a second time and stopped
    orbax's close halfway, leaving its threads to log tracebacks after ours."""
    ref = getattr(mngr, "_finalize_thread", None)
    thread = ref.get() if ref is not None and hasattr(ref, "get") else None
    if thread is not None and not thread.is_alive() and getattr(thread, "exception", None):
        thread.exception = None


def _remove_tmp(directory: pathlib.Path, step: int) -> None:
    """Removes the temporary folder this process's failed save of ``step`` left, as
    its claim proves it (under the directory's lock: no other save of ours writes it)."""
    for record, data in _claims_in(directory):
        if data["kind"] == "tmp" and data["name"] == _tmp_name(step) and \
                data["pid"] == os.getpid():
            _drop_claimed(directory, record, data)
    _IN_FLIGHT.discard(str(directory / _tmp_name(step)))


def _release_tmp(directory: pathlib.Path, step: int) -> None:
    """Drops the claim of this process's finished save of ``step`` (its folder is
    the step now)."""
    for record, data in _claims_in(directory):
        if data["kind"] == "tmp" and data["name"] == _tmp_name(step) and \
                data["pid"] == os.getpid():
            with contextlib.suppress(OSError):
                record.unlink()
    _IN_FLIGHT.discard(str(directory / _tmp_name(step)))
