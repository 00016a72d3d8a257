"""One call of ``Trainer.fit`` once set up (:class:`FitRun`): fused calls dispatched
two deep, their metrics read back, a failed call replayed with the per-step guard,
the NaN stop, checkpoints (:class:`Saver`) and callbacks; and what it returns
(:class:`History`)."""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from nnx_shard.checkpoint import Checkpointer
from nnx_shard.train.feed import Inline, Prefetcher
from nnx_shard.train.fused import Carry, Fused
from nnx_shard.train.guard import Guard, not_finite_leaf, why_not_finite
from nnx_shard.train.progress import Progress

__all__ = ["FitRun", "History", "Saver", "TrainState"]


class TrainState(Protocol):
    """What a run reads and advances of its trainer (a :class:`~nnx_shard.Trainer`):
    the objects it trains and its two counters. A protocol, so this module does not
    import the trainer that imports it."""

    model: Any
    optimizer: Any
    step: int
    data_position: int


@dataclasses.dataclass
class History:
    """What :meth:`Trainer.fit` ran: per-step metrics (NumPy, one entry per applied
    step, ``"step"`` numbering them), why it stopped early (``None`` if it did
    not) and the wall time.

    >>> h = History({"step": np.array([1, 2]), "loss": np.array([0.5, 0.25])}, 2, None, 0.1)
    >>> h["loss"][-1], len(h)
    (np.float64(0.25), 2)
    """

    metrics: dict[str, np.ndarray]
    steps: int
    stop_reason: str | None
    seconds: float

    def __getitem__(self, key: str) -> np.ndarray:
        return self.metrics[key]

    def __len__(self) -> int:
        return self.steps


class Saver:
    """fit's checkpoints: a save at every save step (the run drains the calls in
    flight there first) and one after the last step."""

    def __init__(self, trainer: TrainState, checkpointer: Checkpointer) -> None:
        self.trainer = trainer
        self.checkpointer = checkpointer
        self.last_saved = trainer.step

    def due(self, step: int) -> bool:
        return self.checkpointer.should_save(step) and step > self.last_saved

    def save(self, carry: Carry) -> None:
        """Saves the current step, unless it is saved already (no call is in flight:
        the carried state is synced into the model and optimizer first)."""
        t = self.trainer
        if t.step > self.last_saved:
            carry.sync()
            self.checkpointer.save(
                t.step, model=t.model, optimizer=t.optimizer,
                extra={"step": t.step, "data_position": t.data_position},
            )
            self.last_saved = t.step


class FitRun:
    """One call of :meth:`Trainer.fit` after its set-up: dispatching fused calls,
    reading each one's metrics (replaying it if the NaN guard undid it), then, after
    each call: the progress bar, the checkpoint, the user's callbacks (given the
    steps of the call that were applied, also when a non-finite step cut it short)
    and the NaN stop (with a ``RuntimeWarning`` naming the check, the first
    non-finite leaf and the step), in that order, until the data ends or training
    stops.

    ``fused`` is fit's call (the guard checks it once); ``careful`` replays a
    failed call with every step checked, ``checked`` naming the leaves of its
    ``nonfinite`` metric; ``guard`` is the :class:`~nnx_shard.train.guard.Guard`
    both take. ``mode`` is the guard's (:data:`~nnx_shard.train.guard.GUARDS`):
    only ``"full"`` undoes and replays a call; under ``"grads"`` and ``"off"`` the
    steps say themselves which were applied.
    """

    def __init__(self, trainer: TrainState, fused: Fused, careful: Fused,
                 checked: Sequence[tuple[str, str]], guard: Guard,
                 callbacks: Sequence[Callable[..., Any]], depth: int, *,
                 progress: Progress, saver: Saver | None, mode: str = "full") -> None:
        self.trainer = trainer
        self.mode = mode
        self.careful = careful
        self.checked = checked
        self.guard = guard
        self.callbacks = callbacks
        self.depth = depth
        self.progress = progress
        self.saver = saver
        self.start = self.last_t = time.perf_counter()
        self.hist: dict[str, list[np.ndarray]] = collections.defaultdict(list)
        self.done = 0  # steps applied by this fit
        self.stop_reason: str | None = None
        self.nonfinite = False
        # (steps, examples per step, metrics, batch, replays when dispatched)
        self.pending: collections.deque[tuple[int, int, Any, Any, int]] = collections.deque()
        self.replays = 0  # calls replayed with the per-step guard so far
        self.examples = 0  # examples per step of the last call read
        self.failure: str | None = None  # why the last call read was cut short
        # The model and optimizer state between calls; synced into the NNX objects
        # before anything reads them (see Carry).
        self.carry = Carry(fused)

    def dispatch(self, prefetch: Prefetcher | Inline) -> None:
        t = self.trainer
        dispatched = t.step  # the step counter once every dispatched call is applied
        while self.stop_reason is None:
            # Calls queued behind a replayed one changed nothing: they are replayed
            # (in order) before anything new runs on the state.
            while self.pending and self.pending[0][4] < self.replays and not self.stop_reason:
                self.finish_one()
            if self.stop_reason is not None:
                break
            group = prefetch.get()
            if group is None:
                break
            n, batch, examples = group
            metrics = self.carry(t.model, t.optimizer, batch, self.guard)
            self.pending.append((n, examples, metrics, batch, self.replays))
            dispatched += n
            if self.saver is not None and self.saver.checkpointer.should_save(dispatched):
                # Drained before the next call is dispatched: it would donate
                # (overwrite) exactly the state the save writes.
                while self.pending:
                    self.finish_one()
            elif len(self.pending) >= self.depth:
                self.finish_one()
        while self.pending:
            self.finish_one()

    def save_last(self) -> None:
        """The checkpoint after the last step, unless a non-finite step stopped training."""
        if self.saver is not None and not self.nonfinite:
            self.saver.save(self.carry)

    def _read(self, metrics: Any) -> dict[str, np.ndarray]:
        return {key: np.asarray(v) for key, v in jax.device_get(metrics).items()}

    def finish_one(self) -> None:
        t = self.trainer
        n, examples, metrics, batch, generation = self.pending.popleft()
        if self.stop_reason is not None:
            return  # in flight when training stopped: it applied nothing
        host = self._read(metrics)
        if self.mode == "full" and (generation < self.replays or not host["applied"].all()):
            # This call failed the guard and was undone, or was queued behind one
            # that did (then it changed nothing): run it again, every step checked.
            self.carry.sync()
            self.replays += 1
            self.guard.raise_()
            host = self._read(self.careful(t.model, t.optimizer, batch, self.guard))
        seen = self._apply(n, examples, host)
        self._show_progress(seen)
        if self.failure is None and self.saver is not None and self.saver.due(t.step):
            self.saver.save(self.carry)
        if self.failure is None or len(seen["loss"]):
            # After a non-finite step the callbacks still see the steps of this call
            # that were applied (History and a MetricsWriter then agree).
            self._callbacks(seen)
        if self.failure is not None:
            self._stop_nonfinite()

    def _callbacks(self, seen: dict[str, np.ndarray]) -> None:
        t = self.trainer
        for cb in self.callbacks:
            if getattr(cb, "reads_model", True):
                # The user's callbacks run with no other call in flight (depth 1), so
                # the carried state is exactly the one after this call.
                self.carry.sync()
            if cb(t.step, seen) is True:
                name = getattr(cb, "__name__", repr(cb))
                self.stop_reason = f"callback {name} asked to stop at step {t.step}"
                return

    def _apply(self, n: int, examples: int, host: dict[str, np.ndarray]
               ) -> dict[str, np.ndarray]:
        """Counts the steps of a call read back that were applied into the history and
        the trainer's counters; returns their metrics (what the callbacks see)."""
        t = self.trainer
        applied = host.pop("applied")  # one flag (the call's check) or one per step
        nonfinite_at = host.pop("nonfinite", None)
        state_finite = host.pop("state_finite", None)  # "grads" and "off" only
        good = n if applied.all() else int(np.argmin(applied))
        step0 = t.step
        for key, v in host.items():
            self.hist[key].append(v[:good])
        self.hist["step"].append(np.arange(step0 + 1, step0 + good + 1))
        t.step += good
        t.data_position += good
        self.done += good
        self.examples = examples
        self.failure = None
        if state_finite is not None:
            self.failure = self._unguarded_failure(n, good, host, bool(state_finite))
        elif good < n:
            what = why_not_finite({**host, "nonfinite": nonfinite_at},  # type: ignore[dict-item]
                                  good, self.checked)
            kept = f"from after step {step0 + good}" if step0 + good else "from before it"
            self.failure = (
                f"{what} at step {step0 + good + 1}; stopped without applying it, keeping "
                f"the model and optimizer state {kept}, the last finite one"
            )
        return host if good == n else {key: v[:good] for key, v in host.items()}

    def _unguarded_failure(self, n: int, good: int, host: dict[str, np.ndarray],
                           state_finite: bool) -> str | None:
        """Why a call of the ``"grads"`` or ``"off"`` guard failed (``None`` if it did
        not), once its ``good`` applied steps are counted: the first step with a
        non-finite loss or gradient norm, and the state the call left, which nothing
        undoes (its first non-finite leaf, found on the host only now)."""
        t = self.trainer
        step0 = t.step - good
        bad = [i for i in range(n)
               if not all(np.all(np.isfinite(host[key][i])) for key in ("loss", "grad_norm"))]
        if state_finite and not bad:
            return None
        first = None
        if bad:
            i = bad[0]
            first = " and ".join(f"{key} is {host[key][i]}" for key in ("loss", "grad_norm")
                                 if not np.all(np.isfinite(host[key][i])))
            first += f" at step {step0 + i + 1}"
        if state_finite and self.mode == "grads":
            # The gate held: the first non-finite step and those after it were not applied.
            kept = f"from after step {t.step}" if t.step else "from before it"
            return (f"{first}; stopped without applying it, keeping the model and optimizer "
                    f"state {kept}, the last finite one")
        # Nothing undid the call: name what it left not finite.
        self.carry.sync()
        state = ("the model and optimizer state are finite" if state_finite else
                 not_finite_leaf(t.model, t.optimizer)
                 or "the model and optimizer state are not finite")
        if self.mode == "grads":
            return (f"{state} after step {t.step}; guard='grads' checks each step's loss and "
                    "gradient norm before applying it, not the state its update makes: that "
                    "update was applied, so the state is left not finite (not saved). Fix: "
                    "Trainer(..., guard='full') keeps the last finite state")
        if first is None:
            return (f"{state} after step {t.step}; guard='off' applies every step: stopped "
                    "there, the state left not finite (not saved). Fix: guard='full' keeps "
                    "the last finite state")
        held = state if state_finite else f"{state}, left as it is"
        return (f"{first}; guard='off' applies every step: stopped after step {t.step}, "
                f"{held} (not saved). Fix: guard='grads' or 'full' keeps the last finite state")

    def _show_progress(self, seen: Mapping[str, np.ndarray]) -> None:
        """The bar after a call: steps, the last loss, and the rates of that call."""
        if self.progress.bar is None:
            return
        now = time.perf_counter()
        good = len(seen["loss"])
        rate = good / max(now - self.last_t, 1e-9)
        self.last_t = now
        if good:
            self.progress.update(self.done, float(seen["loss"][-1]), rate, rate * self.examples)

    def _stop_nonfinite(self) -> None:
        self.stop_reason = self.failure
        self.nonfinite = True
        # Points at the user's fit call: fit -> dispatch -> finish_one -> here.
        warnings.warn(f"Trainer.fit: {self.failure}.", RuntimeWarning, stacklevel=5)

    def history(self, num_steps: int) -> History:
        if self.stop_reason is None and self.done < num_steps:
            self.stop_reason = f"data ran out after {self.done} of {num_steps} steps"
        metrics = {key: np.concatenate(v) for key, v in self.hist.items()}
        if not metrics:
            metrics = {"step": np.zeros((0,), np.int64)}
        return History(metrics, self.done, self.stop_reason, time.perf_counter() - self.start)
