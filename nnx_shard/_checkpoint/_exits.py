"""Failed saves and the end of the process: a background save that failed raises
at the next save, wait or close, and a process that exits with saves in flight
finishes them (or reports them) within a bounded stall."""

from __future__ import annotations

import atexit
import contextlib
import errno
import math
import os
import pathlib
import re
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from nnx_shard._checkpoint._internal import (
    _DIR_LOCKS_LOCK,
    _OPEN,
    _STALL_DEFAULT_S,
    _STALL_ENV,
    _UNSETTLED,
    _finished_steps,
    _unfinished,
)
from nnx_shard._errors import NnxShardError

# --------------------------------------------------------------------------- failures


class CheckpointWriteError(NnxShardError, OSError):
    """A checkpoint could not be written (a full disk, a read-only file system): the
    message names the step, the checkpoint directory, the file being written when
    known, and the fix.

    >>> issubclass(CheckpointWriteError, OSError)
    True
    """


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


def _filename_of(e: BaseException) -> str | None:
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, OSError) and x.filename:
            return os.fsdecode(x.filename)
        x = x.__cause__ or x.__context__
    return None


def save_failed(caller: str, directory: pathlib.Path, step: int, e: BaseException,
                background: bool) -> CheckpointWriteError:
    """One clear OSError for a save that failed: which, why, what is left, the fix."""
    code = _errno_of(e)
    text = " ".join(str(e).split()) or type(e).__name__
    text = text if len(text) <= 300 else text[:300] + "..."
    reason = f"{os.strerror(code)} ({text})" if code else text
    name = _filename_of(e)
    if name is not None and name not in reason:
        reason += f", writing {name}"
    if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        fix = "free disk space (or keep fewer checkpoints: keep=), then save again"
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "save to a directory this process can write"
    else:
        fix = "check the directory, then save again"
    what = "background save" if background else "save"
    err = CheckpointWriteError(
        f"{caller}: the {what} of step {step} to {directory} failed: {reason}; that step "
        f"was not written (finished steps: {_finished_steps(directory)}). Fix: {fix}."
    )
    err.errno = code
    return err


def rotate_failed(directory: pathlib.Path, step: int, keep: int | None,
                  e: BaseException) -> CheckpointWriteError:
    """The error of a save that finished while deleting the checkpoints beyond ``keep``
    failed (a full disk fails the few bytes of the deletion's claim)."""
    code = _errno_of(e)
    text = " ".join(str(e).split())[:300] or type(e).__name__
    err = CheckpointWriteError(
        f"Checkpointer: step {step} was saved to {directory}, but deleting the checkpoints "
        f"beyond keep={keep} failed: {text}; they are kept (finished steps: "
        f"{_finished_steps(directory)}). Fix: free disk space; the next save deletes them.")
    err.errno = code
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
    This runs first in the shutdown sequence (see ``register_exit``). A save that
    failed, and one that makes no progress for ``NNX_SHARD_EXIT_STALL`` seconds,
    is one line on stderr and exit status 1; exit never hangs on one.
    """
    global _exiting
    _exiting = True  # closing below must not take this hook out of the running list
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


_EXIT_LOCK = threading.Lock()
_exit_registered = False
_exiting = False


def register_exit() -> None:
    """Registers :func:`_finish_saves_at_exit` to run before the thread pools shut down,
    while a Checkpointer is open (:func:`unregister_exit` takes it back).

    ``atexit`` runs too late (after ``concurrent.futures`` stopped its pools); the
    stdlib's own pools register through ``threading._register_atexit`` (Python >= 3.9),
    whose callbacks run last-registered first, so ours runs before theirs. Where that
    private hook is missing we fall back to ``atexit`` (saves then only finish if the
    pools still accept work).
    """
    global _exit_registered
    with _EXIT_LOCK:
        if _exit_registered:
            return
        hook = getattr(threading, "_register_atexit", None)
        if hook is None:  # pragma: no cover - a Python without the hook
            atexit.register(_finish_saves_at_exit, False)
        else:
            try:
                hook(_finish_saves_at_exit)
            except RuntimeError:  # pragma: no cover - the interpreter is already exiting
                return
        _exit_registered = True


def unregister_exit() -> None:
    """Takes the exit hook back once no Checkpointer is open or holds an unreported
    failure, so a process that closed its Checkpointers exits as if none was opened.

    ``threading`` has no public way to undo ``_register_atexit``: its callbacks are the
    list ``threading._threading_atexits`` (CPython 3.11 to 3.13), from which ours is removed.
    Left alone (another Python), the hook stays and does nothing at exit.
    """
    global _exit_registered
    with _DIR_LOCKS_LOCK:
        busy = bool(_UNSETTLED) or any(len(s) for s in _OPEN.values())
    with _EXIT_LOCK:
        if busy or not _exit_registered or _exiting:
            return
        hooks = getattr(threading, "_threading_atexits", None)
        # Each entry is functools.partial(callback) there.
        ours = [h for h in hooks or () if getattr(h, "func", h) is _finish_saves_at_exit]
        if isinstance(hooks, list) and ours:
            for h in ours:
                hooks.remove(h)
        elif hooks is not None or getattr(threading, "_register_atexit", None) is not None:
            return  # pragma: no cover - not where we put it: leave it registered
        else:  # pragma: no cover - a Python without the hook: we used atexit
            atexit.unregister(_finish_saves_at_exit)
        _exit_registered = False
