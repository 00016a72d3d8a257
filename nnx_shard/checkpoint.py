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
    <directory>/<step>/manifest/    JSON: format, step, per array its shape, dtype
                                    and a checksum of its bits, a hash of extra,
                                    and a digest of all of it
    <directory>/.nnx_shard.lock     held (shared) by every process while it saves

No pickle anywhere. A step is written under a temporary name
(``<step>.orbax-checkpoint-tmp*``) and renamed when complete, so a save killed
half-way never looks like a checkpoint.

What is ours. A folder of ``directory`` is a checkpoint only when its name is a
step number (``12``, not ``012``) and it holds our manifest with its digest and
the files of every item the manifest lists. Anything else there (``1/`` or
``2024/`` of yours, a file named ``3``, a symlink) is never listed, restored,
rotated, written over or deleted; saving a step whose folder exists is refused.
``keep=`` rotation deletes a step by first renaming it to
``<step>.nnx_shard-deleting-*`` (one atomic rename), so a process killed while
deleting leaves no half-deleted step behind, only that folder, which the next
:class:`Checkpointer` removes. The temporary folder of an interrupted save is
removed when a :class:`Checkpointer` is opened only if no process holds the
directory's lock file: every save holds it (shared) while it writes and the
kernel drops it when a process dies, so another process's save in flight is
never deleted. (On a file system without ``flock`` nothing is removed.)

What is checked. Orbax's compressed chunks carry no checksum (a flipped byte
decodes to wrong values), hence the manifest: restore recomputes every array's
checksum on the devices and refuses a mismatch. The manifest's digest covers its
entries, the step it was written for (a renamed folder is refused) and a hash of
``extra`` (an edited ``"step"`` or data position is refused, naming the file).
The other files orbax reads (its tree metadata, OCDBT manifests, shardings) only
steer the reading: damage there is a read error or yields arrays that fail their
checksums, never different values. Checkpoints of format 1 (written before the
digest covered ``extra``) still restore, checked as before.

Failures. A background save that fails (disk full, read-only file system) is
raised at the next :meth:`Checkpointer.save`, :meth:`~Checkpointer.wait` or
:meth:`~Checkpointer.close`, as one ``OSError`` naming the step and the cause;
one never collected makes the interpreter print one line and exit with status 1.
At exit, saves in flight are finished as long as they make progress (bytes
written); after ``NNX_SHARD_EXIT_STALL`` seconds (default 60) without any, exit
gives up on them (one line, status 1) instead of hanging. Orbax's own log
records are dropped while checkpoints are in use (the failure is reported once,
as above); ``NNX_SHARD_DEBUG=1`` keeps them.

Saves to one directory are serialised within a process (threads, several
:class:`Checkpointer` objects): of concurrent saves of the same step exactly
one writes it and the others raise ``FileExistsError``. Processes that save
to one directory must coordinate themselves (multi-process jobs do: every
process takes part in each save).

Typed PRNG keys (``nnx.Rngs`` state) are stored as their ``uint32`` key data
and re-wrapped on restore with the implementation the target's dtype names.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import functools
import hashlib
import json
import logging
import math
import os
import pathlib
import re
import shutil
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from nnx_shard.annotate import path_str
from nnx_shard.errors import count, flag, short
from nnx_shard.mesh import current, nbytes

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, no removal of temporary folders
    fcntl = None  # type: ignore[assignment]

__all__ = ["Checkpointer", "restore", "restore_into", "save"]

_FORMAT = 2
_FORMATS = (1, 2)  # the manifest formats this nnx_shard reads
_ITEMS = ("model", "optimizer")
_TMP_MARK = ".orbax-checkpoint-tmp"
_TRASH_MARK = ".nnx_shard-deleting"
_LOCK_FILE = ".nnx_shard.lock"
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")
_TRASH_NAME = re.compile(r"[0-9]+" + re.escape(_TRASH_MARK) + r"-.*")
_SHOW = 8  # paths listed in one error message before "... and N more"
# Bounds the host/device memory a restore or save needs beyond the state itself.
_HASH_BATCH_BYTES = 64 * 2**20
_RESTORE_CONCURRENT_GB = 0.25
_DEBUG_ENV = "NNX_SHARD_DEBUG"
_STALL_ENV = "NNX_SHARD_EXIT_STALL"
_STALL_DEFAULT_S = 60.0

_OCP_LOCK = threading.Lock()
_ocp_tamed = False


def _ocp() -> Any:
    # orbax pulls in tensorstore and more; import it when checkpoints are used.
    global _ocp_tamed
    import orbax.checkpoint as ocp

    with _OCP_LOCK:
        if not _ocp_tamed:
            _ocp_tamed = True
            _tame(ocp)
    return ocp


def _no_raw_bytes(*args: Any, **kwargs: Any) -> None:
    return None


def _tame(ocp: Any) -> None:
    """Turns off orbax's raw-bytes telemetry and filters its log records (see
    :class:`_OrbaxRecords`).

    For two log lines and two ``jax.monitoring`` scalars per array write or read,
    orbax asks tensorstore for its metrics (``get_tensorstore_raw_bytes`` ->
    ``tensorstore.experimental_collect_matching_metrics``). In tensorstore 0.1.86
    every result of that call stays referenced: about 8 KB a call, so resident
    memory grew ~30 KB per small save without bound. Orbax skips the telemetry
    when the starting count is None, which is what this makes it get.
    """
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils
    except ImportError:  # pragma: no cover - another orbax layout: nothing to turn off
        tensorstore_utils = None
    if hasattr(tensorstore_utils, "get_tensorstore_raw_bytes"):
        tensorstore_utils.get_tensorstore_raw_bytes = _no_raw_bytes
    logging.getLogger("absl").addFilter(_OrbaxRecords(os.path.dirname(ocp.__file__)))


# --------------------------------------------------------------------------- orbax's noise

# Open Checkpointers plus save/restore calls in progress: while any, orbax's
# warnings and errors are dropped (a failure is reported once, by us).
_quiet_users = 0
_QUIET_LOCK = threading.Lock()


class _OrbaxRecords(logging.Filter):
    """Drops orbax's WARNING and ERROR log records while nnx_shard uses it.

    A failed save or restore made orbax log every thread's view of it, each with
    a traceback and tensorstore's spec (pages on stderr, through absl's logger),
    before the one exception that reports it. The failure reaches the user once,
    as nnx_shard's error; with ``NNX_SHARD_DEBUG=1`` the records are kept.
    """

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = root + os.sep

    def filter(self, record: logging.LogRecord) -> bool:
        if _quiet_users <= 0 or os.environ.get(_DEBUG_ENV, "") not in ("", "0"):
            return True
        return not (record.levelno >= logging.WARNING and record.pathname.startswith(self.root))


def _hush(delta: int) -> None:
    global _quiet_users
    with _QUIET_LOCK:
        _quiet_users += delta


# --------------------------------------------------------------------------- orbax's event loops


class _QuietLoop(asyncio.SelectorEventLoop):
    """An event loop that drops thread-safe callbacks arriving after it closed.

    Orbax runs each read in a fresh event loop and closes it as soon as the
    read returns, or fails: when one array of a corrupt checkpoint fails,
    ``asyncio.gather`` returns at once while tensorstore is still finishing the
    other reads on its own threads. Each of those then hands its result back
    with ``loop.call_soon_threadsafe``, which raises "RuntimeError: Event loop
    is closed" on tensorstore's thread, printed as a bare traceback on stderr
    (and also seen at interpreter exit). Those results have no reader left, so
    dropping them is the whole fix.
    """

    def call_soon_threadsafe(self, callback: Any, *args: Any, context: Any = None) -> Any:
        if self.is_closed():
            return None
        return super().call_soon_threadsafe(callback, *args, context=context)

    def close(self) -> None:
        # Orbax closes the loop as soon as one read of a damaged checkpoint failed; the
        # sibling reads are left pending, and when one is destroyed later its
        # ``except BaseException: raise Exception(... tensorstore spec ...)`` turns the
        # GeneratorExit into an "Exception ignored in: <coroutine ...>" page on stderr.
        # Cancelled and run to their end here (as asyncio.run does), they end quietly.
        if not self.is_running() and not self.is_closed():
            try:
                pending = [t for t in asyncio.all_tasks(self) if not t.done()]
            except RuntimeError:  # pragma: no cover - the task set changed meanwhile
                pending = []
            for task in pending:
                task.cancel()
            if pending:
                with contextlib.suppress(BaseException):
                    self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        # When one read of a damaged checkpoint fails, orbax raises that error (which
        # restore reports) and abandons the sibling reads; when those fail too, asyncio
        # logs each as "Task exception was never retrieved" with a traceback. They are
        # the same damage, already reported: drop them, keep every other report.
        if context.get("message") == "Task exception was never retrieved":
            return
        super().call_exception_handler(context)


class _QuietPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _QuietLoop()


_POLICY_LOCK = threading.Lock()
_policy_users = 0
_saved_policy: Any = None


@contextlib.contextmanager
def _quiet_loops() -> Iterator[None]:
    """While orbax runs, the event loops it creates (``asyncio.new_event_loop``) are
    :class:`_QuietLoop`. Only asyncio's own default policy is swapped (a policy a user
    installed, e.g. uvloop's, is left alone), and only on platforms whose default
    loop is the selector loop."""
    global _policy_users, _saved_policy
    with _POLICY_LOCK:
        current = asyncio.get_event_loop_policy()
        swap = _policy_users > 0 or (
            sys.platform != "win32" and type(current) is asyncio.DefaultEventLoopPolicy
        )
        if swap:
            if _policy_users == 0:
                _saved_policy = current
                asyncio.set_event_loop_policy(_QuietPolicy())
            _policy_users += 1
    try:
        yield
    finally:
        if swap:
            with _POLICY_LOCK:
                _policy_users -= 1
                if _policy_users == 0:
                    asyncio.set_event_loop_policy(_saved_policy)
                    _saved_policy = None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Around every call into orbax: quiet event loops, orbax's log records dropped."""
    _hush(1)
    try:
        with _quiet_loops():
            yield
    finally:
        _hush(-1)


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
        raise TypeError(
            f"{caller}: the directory must be a path (str or os.PathLike), got "
            f"{type(directory).__name__} {directory!r:.60}. Fix: e.g. 'runs/ckpt'."
        )
    text = os.fspath(directory)
    if not isinstance(text, str):
        raise TypeError(f"{caller}: the directory must be a str path, got {text!r:.60}.")
    if text == "" or (isinstance(directory, pathlib.PurePath) and not directory.parts):
        # pathlib.Path("") is "."; an empty string would silently mean the current directory.
        raise ValueError(
            f"{caller}: the directory is an empty path; it would mean the current "
            "directory. Fix: name a folder for the checkpoints, e.g. 'runs/ckpt' (created "
            "if missing)."
        )
    return pathlib.Path(text).expanduser().absolute()


def _refuse_file(directory: pathlib.Path, caller: str) -> None:
    """A NotADirectoryError when ``directory`` (or a parent of it) is an existing file."""
    for path in (directory, *directory.parents):
        if path.exists():
            if path.is_dir():
                return
            what = "is a file" if path == directory else f"is under {path}, which is a file"
            raise NotADirectoryError(
                f"{caller}: {directory} {what}, not a checkpoint directory. Fix: pass a "
                "directory (it holds one subdirectory per step; save and Checkpointer create "
                "it when missing), e.g. a new folder name."
            )


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
            fd = os.open(directory / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
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
        fd = os.open(directory / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
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
            if _STEP_NAME.fullmatch(p.name) and not p.is_symlink() and p.is_dir()}


def _claims(path: pathlib.Path) -> bool:
    """Whether the step folder says it is ours (it has a manifest file at all)."""
    return (path / "manifest" / "metadata").is_file()


def _not_whole(path: pathlib.Path) -> str | None:
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
    return sorted(s for s, p in _step_folders(directory).items() if _not_whole(p) is None)


def _unfinished(directory: pathlib.Path, step: int | None = None) -> list[str]:
    if not directory.is_dir():
        return []
    head = str(step) if step is not None else r"\d+"
    pattern = re.compile("^" + head + re.escape(_TMP_MARK))
    return sorted(p.name for p in directory.iterdir() if pattern.match(p.name))


def _remove_leftovers(directory: pathlib.Path) -> None:
    """Removes what interrupted work left (process 0 only): steps being deleted when
    their process died, and temporary folders of saves that were killed, the latter
    only while no process writes a step here (see :class:`_WriteLock`).

    Orbax's own ``cleanup_tmp_directories`` does not recognise every temporary
    name it writes on a local filesystem, and does not know whether their writer
    still runs, so the names are matched here.
    """
    if jax.process_index() != 0 or not directory.is_dir():
        return
    for p in directory.iterdir():
        if _TRASH_NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
    if not _unfinished(directory):
        return
    with _alone(directory) as alone:
        if alone:
            for name in _unfinished(directory):
                shutil.rmtree(directory / name, ignore_errors=True)


def _delete_step(directory: pathlib.Path, step: int) -> None:
    """Deletes a step of ours: renamed first (atomic), so a kill half-way leaves a
    ``*.nnx_shard-deleting-*`` folder to finish later, never a half-deleted step."""
    trash = directory / f"{step}{_TRASH_MARK}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(directory / str(step), trash)
    except FileNotFoundError:  # deleted meanwhile
        return
    shutil.rmtree(trash, ignore_errors=True)


def _rotate(mngr: Any, directory: pathlib.Path, keep: int | None) -> None:
    """Deletes the oldest whole checkpoints of ours beyond the newest ``keep``."""
    if keep is None or jax.process_index() != 0:
        return
    steps = _finished_steps(directory)
    gone = steps[:-keep] if len(steps) > keep else []
    for step in gone:
        _delete_step(directory, step)
    if gone:
        _forget(mngr, gone)


def _forget(mngr: Any, steps: Sequence[int]) -> None:
    # Orbax caches the steps it saved (and refuses to save one again): drop deleted ones.
    infos = getattr(mngr, "_checkpoints", None)
    if infos is not None and hasattr(infos, "delete_if"):
        infos.delete_if(lambda info: info.step in steps)
    else:  # pragma: no cover - another orbax: re-read the directory
        mngr.reload()


def _remove_tmp(directory: pathlib.Path, step: int) -> None:
    """Removes the temporary folder this process's failed save of ``step`` left
    (under the directory's lock: no other save of ours writes it)."""
    for name in _unfinished(directory, step):
        shutil.rmtree(directory / name, ignore_errors=True)


# --------------------------------------------------------------------------- failures


def _errno_of(e: BaseException) -> int | None:
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno:
            return int(x.errno)
        m = re.search(r"os_error_code='?(\d+)", str(x))
        if m:
            return int(m.group(1))
        x = x.__cause__ or x.__context__
    return None


def _save_failed(caller: str, directory: pathlib.Path, step: int, e: BaseException,
                 background: bool) -> OSError:
    """One clear OSError for a save that failed: which, why, what is left, the fix."""
    code = _errno_of(e)
    text = " ".join(str(e).split()) or type(e).__name__
    text = text if len(text) <= 300 else text[:300] + "..."
    reason = f"{os.strerror(code)} ({text})" if code else text
    if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        fix = "free disk space (or keep fewer checkpoints: keep=), then save again"
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "save to a directory this process can write"
    else:
        fix = "check the directory, then save again"
    what = "background save" if background else "save"
    err = OSError(
        f"{caller}: the {what} of step {step} to {directory} failed: {reason}; that step "
        f"was not written (finished steps: {_finished_steps(directory)}). Fix: {fix}."
    )
    err.errno = code  # type: ignore[assignment]
    return err


# --------------------------------------------------------------------------- exit


def _stall_seconds() -> float:
    try:
        value = float(os.environ.get(_STALL_ENV, _STALL_DEFAULT_S))
    except ValueError:
        return _STALL_DEFAULT_S
    return value if value > 0 and math.isfinite(value) else _STALL_DEFAULT_S


def _bytes_written(ckpts: Sequence[Any]) -> int:
    """Bytes on disk under the folders of the saves in flight: their progress."""
    total = 0
    for ckpt in ckpts:
        step = ckpt._pending
        if step is None:
            continue
        for name in [*_unfinished(ckpt.directory, step), str(step)]:
            for root, _, files in os.walk(ckpt.directory / name):
                for f in files:
                    with contextlib.suppress(OSError):
                        total += os.stat(os.path.join(root, f)).st_size
    return total


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _exit_1() -> None:
    """Ends the process with status 1 after the other ``atexit`` handlers ran: Python
    offers no other way to change the exit status once the interpreter is exiting."""
    atexit.unregister(_exit_1)
    run_others = getattr(atexit, "_run_exitfuncs", None)
    if run_others is not None:
        run_others()
    _flush()
    os._exit(1)


def _finish_saves_at_exit(in_shutdown: bool = True) -> None:
    """Finishes the background saves of Checkpointers still open at interpreter exit.

    Orbax writes through asyncio's default thread pool, which refuses new work
    once the interpreter starts shutting down ("cannot schedule new futures after
    interpreter shutdown"): a save in flight was lost, with tracebacks on stderr.
    This runs first in the shutdown sequence (see ``_register_exit``). A save that
    failed, and one that makes no progress for ``NNX_SHARD_EXIT_STALL`` seconds,
    is one line on stderr and exit status 1; exit never hangs on one.
    """
    with _DIR_LOCKS_LOCK:
        ckpts = {id(c): c for c in [*_UNSETTLED, *(c for s in _OPEN.values() for c in list(s))]}
    todo = list(ckpts.values())
    if not todo:
        return
    failures: list[str] = []

    def finish() -> None:
        for ckpt in todo:
            try:
                ckpt.close()
            except Exception as e:  # reported below, one line each
                failures.append(" ".join(str(e).split()) or type(e).__name__)

    worker = threading.Thread(target=finish, name="nnx_shard-exit", daemon=True)
    try:
        worker.start()
    except RuntimeError:  # pragma: no cover - a Python that starts no thread this late
        finish()
    stall = _stall_seconds()
    seen, since = _bytes_written(todo), time.monotonic()
    while worker.is_alive():
        worker.join(timeout=min(0.5, stall))
        if not worker.is_alive():
            break
        now = _bytes_written(todo)
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= stall:
            stuck = [c for c in todo if c._pending is not None]
            for ckpt in stuck:
                print(f"nnx_shard: error: the save of step {ckpt._pending} to "
                      f"{ckpt.directory} made no progress for {stall:g} s at exit; it is "
                      f"lost ({_STALL_ENV} sets how long to wait).", file=sys.stderr)
            if not stuck:
                print(f"nnx_shard: error: closing the checkpointers of "
                      f"{', '.join(sorted({str(c.directory) for c in todo}))} made no progress "
                      f"for {stall:g} s at exit ({_STALL_ENV} sets how long to wait).",
                      file=sys.stderr)
            # Orbax's threads are stuck and the interpreter would wait for them.
            _flush()
            os._exit(1)
    for line in failures:
        print(f"nnx_shard: error: {line}", file=sys.stderr)
    if failures:
        if in_shutdown:
            atexit.register(_exit_1)  # registered last, runs first; runs the others
        else:  # pragma: no cover - already inside atexit
            _exit_1()


_exit_registered = False


def _register_exit() -> None:
    """Registers :func:`_finish_saves_at_exit` to run before the thread pools shut down.

    ``atexit`` runs too late (after ``concurrent.futures`` stopped its pools); the
    stdlib's own pools register through ``threading._register_atexit`` (Python >= 3.9),
    whose callbacks run last-registered first, so ours runs before theirs. Where that
    private hook is missing we fall back to ``atexit`` (saves then only finish if the
    pools still accept work).
    """
    global _exit_registered
    if _exit_registered:
        return
    _exit_registered = True
    hook = getattr(threading, "_register_atexit", None)
    if hook is None:  # pragma: no cover - a Python without the hook
        atexit.register(_finish_saves_at_exit, False)
    else:
        hook(_finish_saves_at_exit)


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
        rows.append((tuple(path), path_str(path), var))
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
    return [fn(x) for x in xs]


def _checksums(values: Sequence[jax.Array], version: int = _FORMAT) -> list[list[int]]:
    """One [a, b] pair per array (the checksum of manifest format ``version``); one
    compiled call per set of devices and batch.

    Hashing takes temporaries about twice the size of its input, so arrays are
    hashed in batches of at most ``_HASH_BATCH_BYTES``: memory stays bounded
    whatever the model's size (a restore's host memory is what it costs).

    >>> import jax.numpy as jnp
    >>> ones = _checksums([jnp.ones(512)])[0]
    >>> ones != [0, 0], _checksums([jnp.ones(512)], version=1)[0]
    (True, [0, 0])
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


def _check_extra(extra: Any) -> None:
    """Extra must come back from JSON as it was given: a dict with str keys (JSON turns
    the key 1 into "1") holding JSON data, each bad piece named by its place."""
    if not isinstance(extra, Mapping):
        raise TypeError(
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
                    raise TypeError(
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
                raise TypeError(
                    f"save: {where} is {x!r}, which strict JSON cannot hold. Fix: store a "
                    "finite number, or None."
                )
        else:
            raise TypeError(
                f"save: {where} is a {type(x).__name__} ({x!r:.40}), not JSON data (dicts, "
                "lists, strings, finite numbers, bools, None). Fix: keep arrays in the model; "
                "convert scalars first (e.g. float(x), int(x), x.tolist())."
            )

    walk(extra, "extra")


def _save_args(
    step: int, model: Any, optimizer: Any, extra: Mapping[str, Any] | None
) -> Any:
    ocp = _ocp()
    step = count(step, "save: step", least=0, fix="the step number, e.g. save(d, 100, ...)")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"save: model must be an nnx.Module, got {type(model).__name__} "
                        f"{short(model, 60)}. Fix: save(directory, step, model=model)")
    if extra is not None:
        _check_extra(extra)
    # As it will read back: tuples become lists.
    extra = json.loads(json.dumps(dict(extra or {})))
    items: dict[str, Any] = {}
    manifest: dict[str, Any] = {"format": _FORMAT, "step": int(step), "items": {},
                                "extra": _extra_hash(extra)}
    for name, obj in (("model", model), ("optimizer", optimizer)):
        if obj is None:
            continue
        arrays, entries = _saveable(obj, name)
        keys = list(arrays)
        for key, checksum in zip(keys, _checksums([arrays[k] for k in keys]), strict=True):
            entries[key]["checksum"] = checksum
        items[name] = ocp.args.StandardSave(_nest(arrays))
        manifest["items"][name] = entries
    manifest["digest"] = _digest(manifest)
    items["extra"] = ocp.args.JsonSave(extra)
    items["manifest"] = ocp.args.JsonSave(manifest)
    return ocp.args.Composite(**items)


def _canonical(x: Any) -> bytes:
    return json.dumps(x, sort_keys=True, separators=(",", ":")).encode()


def _extra_hash(extra: Any) -> str:
    """sha256 of ``extra`` as JSON: the manifest's record of extra/metadata."""
    return hashlib.sha256(_canonical(extra)).hexdigest()


def _digest(manifest: Mapping[str, Any]) -> str:
    """The manifest's digest, stored in it: a damaged manifest (a flipped byte in a
    name, a shape, a checksum, the step or extra's hash) is caught as such. Format
    1 digested the entries only."""
    if manifest.get("format") == 1:
        return hashlib.sha256(_canonical(manifest.get("items"))).hexdigest()
    return hashlib.sha256(_canonical({k: v for k, v in manifest.items() if k != "digest"})).hexdigest()


_ENTRY_KEYS = {"shape", "dtype", "key", "checksum"}
_MANIFEST_KEYS = {1: {"format", "items", "digest"},
                  2: {"format", "step", "items", "extra", "digest"}}


def _entry_problem(name: str, key: str, e: Any) -> str | None:
    if not isinstance(e, Mapping) or set(e) != _ENTRY_KEYS:
        got = sorted(e) if isinstance(e, Mapping) else type(e).__name__
        return f"entry {name}/{key} has {got}, not {sorted(_ENTRY_KEYS)}"
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


def _manifest_problem(manifest: Any) -> str | None:
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
    if manifest["digest"] != _digest(manifest):
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
    opts = ocp.CheckpointManagerOptions(
        create=create, save_root_metadata=False,
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


def _do_save(
    mngr: Any, directory: pathlib.Path, step: int, args: Any, caller: str
) -> _WriteLock:
    """Starts the save under the directory's lock, after every in-process save to it
    finished, so of concurrent saves of one step exactly one writes it and the
    others are refused. Returns the write lock, held until the save is finished.
    A save that fails before returning is one clear OSError."""
    ocp = _ocp()
    step = int(step)
    with _dir_lock(directory):
        _settle(directory)
        _refuse_existing(directory, step, caller)
        _forget(mngr, [step])  # a stale entry of orbax's (e.g. a user's "007/") must not block it
        lock = _WriteLock(directory)
        try:
            with _quiet():
                mngr.save(step, args=args, force=True)
        except ocp.checkpoint_manager.StepAlreadyExistsError:  # pragma: no cover - raced
            lock.release()
            _refuse_existing(directory, step, caller)
            raise
        except Exception as e:
            lock.release()
            _remove_tmp(directory, step)
            raise _save_failed(caller, directory, step, e, background=False) from e
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
      TypeError: ``extra`` is not a dict of JSON data with str keys (each bad key or
        value is named), or the model is abstract.
      ValueError: ``directory`` is an empty path.

    >>> import tempfile
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> path = save(tempfile.mkdtemp(), 100, model=model, extra={"data_position": 100})
    >>> path.name, sorted(p.name for p in path.iterdir() if p.is_dir())
    ('100', ['extra', 'manifest', 'model'])
    """
    directory = _resolve_dir(directory, "save")
    _refuse_file(directory, "save")
    args = _save_args(step, model, optimizer, extra)
    with _dir_lock(directory), _quiet():
        mngr = _manager(directory, create=True, enable_async_checkpointing=False)
        try:
            _do_save(mngr, directory, step, args, "save").release()
            return directory / str(int(step))
        finally:
            mngr.close()


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
    if step is not None:
        step = count(step, "restore: step", least=0,
                     fix="a saved step number, or step=None for the latest")
    _refuse_file(directory, "restore")
    if not directory.is_dir():
        raise FileNotFoundError(f"restore: checkpoint directory {directory} does not exist.")
    with _quiet():
        return _read_open(ocp, _manager(directory, create=False), directory, step, targets)


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
        problem = _manifest_problem(manifest)
        fix = "Fix: restore another step (restore(..., step=N)) or re-create this one."
        if problem:
            raise ValueError(
                f"restore: the checkpoint at {where} is corrupt: its manifest "
                f"{where / 'manifest' / 'metadata'} {problem} (damaged, or not written by "
                f"nnx_shard.save). {fix}"
            )
        if manifest["format"] >= 2 and manifest["step"] != step:
            raise ValueError(
                f"restore: the checkpoint at {where} is corrupt: its manifest "
                f"{where / 'manifest' / 'metadata'} was written for step {manifest['step']}, "
                f"not {step} (the folder was renamed or copied). {fix}"
            )
        if manifest["format"] >= 2 and _extra_hash(extra) != manifest["extra"]:
            raise ValueError(
                f"restore: the checkpoint at {where} is corrupt: {where / 'extra' / 'metadata'} "
                "does not match the digest in its manifest (edited or damaged: the step "
                f"counter and data position it holds cannot be trusted). {fix}"
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
        sums = _checksums([arrays[k] for k in keys], version=manifest["format"])
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
      NotADirectoryError: ``directory`` is a file.
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
    directory = _resolve_dir(directory, "restore")
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
    on (the next save, :meth:`wait` and :meth:`close` wait for it, and raise
    ``OSError`` if it failed). Older checkpoints beyond ``keep`` are deleted
    once a newer one is finished on disk, so up to ``keep + 1`` exist while a
    save is in flight. Only checkpoints nnx_shard wrote are ever listed or
    deleted (see the module's notes: other folders of ``directory``, numbered or
    not, are never touched). Opening a ``Checkpointer`` removes what killed
    saves and deletions left, but never the temporary folder of a save another
    process is still writing.

    Args:
      directory: where the step directories go (created if missing; a file is
        refused with ``NotADirectoryError``, an empty path with ``ValueError``).
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
        every = count(every, "Checkpointer: every", fix="save every N steps, e.g. every=1000")
        if keep is not None:
            keep = count(keep, "Checkpointer: keep",
                         fix="how many steps to keep, e.g. keep=3, or keep=None for all")
        flag(async_save, "Checkpointer: async_save")
        self.directory = _resolve_dir(directory, "Checkpointer")
        _refuse_file(self.directory, "Checkpointer")
        self.every = every
        self.keep = keep
        self.async_save = async_save
        self._pending: int | None = None  # the step of the save in flight
        self._lock: _WriteLock | None = None
        self._failure: OSError | None = None  # a failed save, raised at the next call
        self._closed = False
        with _dir_lock(self.directory):
            # Temporary directories of this process's saves in flight are not leftovers.
            _settle(self.directory)
            with _quiet():
                # Rotation is ours (only our own steps): orbax would delete any folder
                # with a number for a name.
                self._mngr = _manager(
                    self.directory, create=True, enable_async_checkpointing=async_save
                )
            _remove_leftovers(self.directory)
            with _DIR_LOCKS_LOCK:
                _OPEN.setdefault(self.directory, weakref.WeakSet()).add(self)
        _hush(1)
        _register_exit()

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
        step = count(step, "Checkpointer.should_save: step", least=0)
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
        ``keep`` are deleted once it is finished (seen by the next save, wait or
        close). If the previous save failed, its ``OSError`` is raised and this
        one is not started.

        >>> import tempfile
        >>> from flax import nnx
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), async_save=False)
        >>> ckpt.save(7, model=nnx.Linear(1, 1, rngs=nnx.Rngs(0))).name, ckpt.latest_step()
        ('7', 7)
        """
        self._check_open()
        args = _save_args(step, model, optimizer, extra)
        self.wait()  # a failure of the previous save is raised first; this one is not started
        with _dir_lock(self.directory):
            lock = _do_save(self._mngr, self.directory, step, args, "Checkpointer")
            self._pending, self._lock = int(step), lock
            with _DIR_LOCKS_LOCK:
                _UNSETTLED.add(self)
            if not self.async_save:
                self.wait()
        return self.directory / str(int(step))

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
        """Blocks until every save started so far is finished on disk; raises
        ``OSError`` (once) if one failed: which step, why, what is left.

        >>> import tempfile
        >>> Checkpointer(tempfile.mkdtemp()).wait()
        """
        self._collect()
        self._raise_failure()

    def close(self) -> None:
        """Waits for saves in flight, then releases orbax's threads (raises like
        :meth:`wait`; closing again does nothing).

        >>> import tempfile
        >>> Checkpointer(tempfile.mkdtemp()).close()
        """
        if not self._closed:
            try:
                self._collect()
                with _quiet():
                    self._mngr.close()
            finally:
                self._closed = True
                with _DIR_LOCKS_LOCK:
                    _OPEN.get(self.directory, weakref.WeakSet()).discard(self)
                _hush(-1)
        self._raise_failure()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(
                f"Checkpointer: {self!r} is closed. Fix: open a new Checkpointer on "
                f"{self.directory}."
            )

    def _collect(self) -> None:
        """Waits for the save in flight; on success deletes steps beyond ``keep``, on
        failure keeps the error for the next save/wait/close (and exit) to raise."""
        with _dir_lock(self.directory):
            step = self._pending
            if step is None:
                return
            try:
                with _quiet():
                    self._mngr.wait_until_finished()
            except Exception as e:
                _remove_tmp(self.directory, step)
                self._failure = _save_failed("Checkpointer", self.directory, step, e,
                                             background=True)
                self._failure.__cause__ = e
            else:
                _rotate(self._mngr, self.directory, self.keep)
            finally:
                if self._lock is not None:
                    self._lock.release()
                    self._lock = None
                self._pending = None
                if self._failure is None:
                    with _DIR_LOCKS_LOCK:
                        _UNSETTLED.discard(self)

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            with _DIR_LOCKS_LOCK:
                _UNSETTLED.discard(self)
            raise failure


def _uncommitted(x: jax.Array) -> jax.Array:
    """``x`` as a fresh eager value: on the default device, free to move."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.device_put(np.asarray(jax.random.key_data(x)))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x))


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
