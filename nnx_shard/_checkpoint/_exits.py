"""Failed saves and the end of the process: a background save that failed raises
at the next save, wait or close; at exit, the saves of Checkpointers left open are
waited for while they make progress and each one that failed or stalled is one
line on stderr (an ``atexit`` callback: nothing else of the interpreter's exit is
changed)."""

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
from collections.abc import Iterator, Sequence
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


def _chain(e: BaseException) -> Iterator[BaseException]:
    """``e``, then its cause (or else its context), then that one's, ... each once."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        yield x
        x = x.__cause__ or x.__context__


def _errno_of(e: BaseException) -> int | None:
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno:
            return int(x.errno)
        m = re.search(r"os_error_code='?(\d+)", str(x))
        if m:
            return int(m.group(1))
    return None


def _filename_of(e: BaseException) -> str | None:
    return next((os.fsdecode(x.filename) for x in _chain(e)
                 if isinstance(x, OSError) and x.filename), None)


def _at_shutdown(e: BaseException) -> bool:
    """Whether ``e`` (or its cause) is Python refusing work because the interpreter exits."""
    # "... after interpreter shutdown", "... at interpreter shutdown", and "... after
    # shutdown" from an executor of orbax's that its failing loop shut meanwhile.
    return any(isinstance(x, RuntimeError) and "shutdown" in str(x) for x in _chain(e))


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
    elif _at_shutdown(e):
        fix = ("wait for background saves before the program ends (Checkpointer.wait() or "
               ".close(), or a with block): Python stops the threads that write them at exit")
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


def _saving(ckpt: Any) -> bool:
    """Whether ``ckpt``'s save in flight is still being written (orbax's public
    ``is_saving_in_progress``: false once it finished or failed)."""
    return ckpt._pending is not None and bool(ckpt._mngr.is_saving_in_progress())


def _finish_saves_at_exit() -> None:
    """At interpreter exit, settles the Checkpointers still open: each save in flight is
    waited for while it makes progress, then collected as :meth:`Checkpointer.close`
    does; a save that failed, or made no progress for ``NNX_SHARD_EXIT_STALL`` seconds,
    is one line on stderr. Exit never hangs on one.

    An ``atexit`` callback, so it runs after Python stopped the thread pools orbax
    writes with (``concurrent.futures``) and, on Python >= 3.12, forbade new threads:
    a save whose remaining work needs either fails ("cannot schedule new futures after
    interpreter shutdown", "can't create new thread at interpreter shutdown") and is
    reported as lost, naming the fix (wait for it before the program ends). No public
    hook runs earlier. The wait polls in this thread, since none can be started now.
    Python offers no public way to change the exit status once the program has ended,
    so the status stays the program's own; the line on stderr is the report.
    """
    global _exiting
    _exiting = True  # closing below must not unregister this callback while it runs
    with _DIR_LOCKS_LOCK:
        ckpts = {id(c): c for c in [*_UNSETTLED, *(c for s in _OPEN.values() for c in list(s))]}
    todo = list(ckpts.values())
    if not todo:
        return
    stall = _stall_seconds()
    # Once orbax's save is over, the writes of its sibling threads may still be landing
    # (one failed, the others were not waited for): the folder is removed after they do.
    settle = min(0.5, stall) if any(c._pending is not None for c in todo) else 0.0
    seen, since = _bytes_written(todo), time.monotonic()
    while True:
        busy = [c for c in todo if _saving(c)]
        now = _bytes_written(todo)
        if now != seen:
            seen, since = now, time.monotonic()
        quiet = time.monotonic() - since
        if not busy and quiet >= settle:
            break
        if busy and quiet >= stall:
            for ckpt in busy:
                print(f"nnx_shard: error: the save of step {ckpt._pending} to "
                      f"{ckpt.directory} made no progress for {stall:g} s at exit; it is "
                      f"lost ({_STALL_ENV} sets how long to wait).", file=sys.stderr)
            # Their threads are daemons (see _save._start_save): left behind, they end
            # with the interpreter.
            todo = [c for c in todo if c not in busy]
            break
        time.sleep(0.05)
    for ckpt in todo:
        try:
            ckpt.close()
        except Exception as e:  # one line each
            print(f"nnx_shard: error: {' '.join(str(e).split()) or type(e).__name__}",
                  file=sys.stderr)
    _flush()


_EXIT_LOCK = threading.Lock()
_exit_registered = False
_exiting = False


def register_exit() -> None:
    """Registers :func:`_finish_saves_at_exit` with ``atexit`` while a Checkpointer is
    open (:func:`unregister_exit` takes it back). Registered when the first one opens,
    after jax and orbax registered theirs, so it runs before them (``atexit`` runs the
    last registered first).
    """
    global _exit_registered
    with _EXIT_LOCK:
        if _exit_registered or _exiting:
            return
        atexit.register(_finish_saves_at_exit)
        _exit_registered = True


def unregister_exit() -> None:
    """Takes the exit callback back once no Checkpointer is open or holds an unreported
    failure, so a process that closed its Checkpointers exits as if none was opened."""
    with _DIR_LOCKS_LOCK:
        busy = bool(_UNSETTLED) or any(len(s) for s in _OPEN.values())
    global _exit_registered
    with _EXIT_LOCK:
        if busy or _exiting or not _exit_registered:
            return
        atexit.unregister(_finish_saves_at_exit)
        _exit_registered = False
