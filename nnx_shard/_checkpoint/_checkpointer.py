""":class:`Checkpointer`: saves every N steps in the background and keeps the last K."""

from __future__ import annotations

import os
import pathlib
import weakref
from collections.abc import Mapping
from typing import Any

from flax import nnx

from nnx_shard._checkpoint._exits import (
    register_exit,
    rotate_failed,
    save_failed,
    unregister_exit,
)
from nnx_shard._checkpoint._internal import (
    _DIR_LOCKS_LOCK,
    _OPEN,
    _UNSETTLED,
    _dir_lock,
    _finished_steps,
    _refuse_file,
    _release_tmp,
    _remove_leftovers,
    _remove_tmp,
    _resolve_dir,
    _rotate,
    _settle,
    _taken,
    _WriteLock,
)
from nnx_shard._checkpoint._restore import restore
from nnx_shard._checkpoint._save import do_save, manager, save_args
from nnx_shard._errors import UsageError, count, flag

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
        refused with ``NotADirectoryError``, an empty path with ``UsageError``).
      every: save when the step counter is a multiple of this.
      keep: how many of the latest checkpoints to keep (``None``: all).
      async_save: write in the background.

    >>> import tempfile
    >>> from flax import nnx
    >>> from nnx_shard import Checkpointer
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
            # Rotation is ours (only our own steps): orbax would delete any folder
            # with a number for a name.
            self._mngr = manager(
                self.directory, create=True, enable_async_checkpointing=async_save
            )
            _remove_leftovers(self.directory)
            with _DIR_LOCKS_LOCK:
                _OPEN.setdefault(self.directory, weakref.WeakSet()).add(self)
        register_exit()

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
        >>> from nnx_shard import Checkpointer
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), every=5)
        >>> ckpt.should_save(0), ckpt.should_save(5), ckpt.should_save(7)
        (False, True, False)
        """
        step = count(step, "Checkpointer.should_save: step", least=0)
        return step > 0 and step % self.every == 0

    def steps(self) -> list[int]:
        """The finished checkpoints on disk, oldest first (a save in flight is not one yet).

        >>> import tempfile
        >>> from nnx_shard import Checkpointer
        >>> Checkpointer(tempfile.mkdtemp()).steps()
        []
        """
        return _finished_steps(self.directory)

    def latest_step(self) -> int | None:
        """The latest finished step, or ``None`` when there is none.

        >>> import tempfile
        >>> from nnx_shard import Checkpointer
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
        >>> from nnx_shard import Checkpointer
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), async_save=False)
        >>> ckpt.save(7, model=nnx.Linear(1, 1, rngs=nnx.Rngs(0))).name, ckpt.latest_step()
        ('7', 7)
        """
        self._check_open()
        args = save_args(step, model, optimizer, extra)
        self.wait()  # a failure of the previous save is raised first; this one is not started
        with _dir_lock(self.directory):
            lock = do_save(self._mngr, self.directory, step, args, "Checkpointer",
                           background=self.async_save)
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
        >>> from nnx_shard import Checkpointer
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
        >>> from nnx_shard import Checkpointer
        >>> Checkpointer(tempfile.mkdtemp()).wait()
        """
        self._collect()
        self._raise_failure()

    def close(self) -> None:
        """Waits for saves in flight, then releases orbax's threads (raises like
        :meth:`wait`; closing again does nothing).

        >>> import tempfile
        >>> from nnx_shard import Checkpointer
        >>> Checkpointer(tempfile.mkdtemp()).close()
        """
        if not self._closed:
            try:
                self._collect()
                self._mngr.close()
            finally:
                self._closed = True
                with _DIR_LOCKS_LOCK:
                    _OPEN.get(self.directory, weakref.WeakSet()).discard(self)
                unregister_exit()
        self._raise_failure()

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(
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
                self._mngr.wait_until_finished()
            except Exception as e:
                _taken(self._mngr)
                _remove_tmp(self.directory, step)
                self._failure = save_failed("Checkpointer", self.directory, step, e,
                                             background=True)
                self._failure.__cause__ = e
            else:
                _release_tmp(self.directory, step)
                try:
                    _rotate(self._mngr, self.directory, self.keep)
                except OSError as e:
                    self._failure = rotate_failed(self.directory, step, self.keep, e)
                    self._failure.__cause__ = e
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
            if self._closed:
                unregister_exit()
            raise failure
