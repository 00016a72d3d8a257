"""orbax, tamed while nnx_shard uses it: its raw-bytes telemetry off, its log
records and the closed-event-loop noise of its threads kept out of the user's
output; everything put back when the last save, restore or Checkpointer ends
(docs/architecture.md, "Where the library touches process state")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from nnx_shard._checkpoint._internal import _DEBUG_ENV


def orbax_module() -> Any:
    """``orbax.checkpoint``, imported on first use. Nothing about orbax, absl's logger
    or asyncio changes until nnx_shard itself saves or restores (see :func:`quiet_orbax`).

    >>> orbax_module().__name__
    'orbax.checkpoint'
    """
    # orbax pulls in tensorstore and more; import it when checkpoints are used.
    import orbax.checkpoint as ocp

    return ocp


def _no_raw_bytes(*args: Any, **kwargs: Any) -> None:
    return None


# --------------------------------------------------------------------------- scoped taming

# Open Checkpointers plus save/restore calls in progress. While any, orbax's
# raw-bytes telemetry is off and its warnings and errors are dropped (a failure is
# reported once, by us); when the last one ends, both are put back as they were.
# A Checkpointer counts from open to close, so its background saves are covered.
_users = 0
_USERS_LOCK = threading.Lock()
_saved_raw_bytes: Any = None  # orbax's own function while ours stands in for it
_filter: logging.Filter | None = None


def _tensorstore_utils() -> Any:
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils
    except ImportError:  # pragma: no cover - another orbax layout: nothing to turn off
        return None
    return tensorstore_utils if hasattr(tensorstore_utils, "get_tensorstore_raw_bytes") else None


def _tame() -> None:
    """Turns off orbax's raw-bytes telemetry and filters its log records (see
    :class:`_OrbaxRecords`); :func:`_untame` puts both back. Called under the lock.

    For two log lines and two ``jax.monitoring`` scalars per array write or read,
    orbax asks tensorstore for its metrics (``get_tensorstore_raw_bytes`` ->
    ``tensorstore.experimental_collect_matching_metrics``). In tensorstore 0.1.86
    every result of that call stays referenced: about 8 KB a call, so resident
    memory grew ~30 KB per small save without bound. Orbax skips the telemetry
    when the starting count is None, which is what this makes it get. Orbax
    (0.12.8) offers no option for it, hence the stand-in, for nnx_shard's saves only.
    """
    global _saved_raw_bytes, _filter
    ocp = orbax_module()
    utils = _tensorstore_utils()
    if utils is not None:
        _saved_raw_bytes = utils.get_tensorstore_raw_bytes
        utils.get_tensorstore_raw_bytes = _no_raw_bytes
    _filter = _OrbaxRecords(os.path.dirname(ocp.__file__))
    logging.getLogger("absl").addFilter(_filter)


def _untame() -> None:
    global _saved_raw_bytes, _filter
    utils = _tensorstore_utils()
    # Someone else's stand-in, installed meanwhile, is theirs to undo.
    if utils is not None and utils.get_tensorstore_raw_bytes is _no_raw_bytes:
        utils.get_tensorstore_raw_bytes = _saved_raw_bytes
    _saved_raw_bytes = None
    if _filter is not None:
        logging.getLogger("absl").removeFilter(_filter)
        _filter = None


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
        if os.environ.get(_DEBUG_ENV, "") not in ("", "0"):
            return True
        return not (record.levelno >= logging.WARNING and record.pathname.startswith(self.root))


def hush(delta: int) -> None:
    """One more (``+1``) or one fewer (``-1``) user of orbax: the first tames it, the
    last puts everything back."""
    global _users
    with _USERS_LOCK:
        if delta > 0 and _users == 0:
            _tame()
        _users += delta
        if delta < 0 and _users == 0:
            _untame()


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

    def call_soon_threadsafe(  # type: ignore[override]  # same call, typed loosely
            self, callback: Any, *args: Any, context: Any = None) -> Any:
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
def quiet_orbax() -> Iterator[None]:
    """Around every call into orbax: quiet event loops, orbax's log records dropped."""
    hush(1)
    try:
        with _quiet_loops():
            yield
    finally:
        hush(-1)
