"""One call of ``Trainer.fit`` once set up (:class:`FitRun`): fused calls dispatched
with at most two in flight, their metrics read back in bulk, a failed call replayed
with the per-step guard, the NaN stop, checkpoints (:class:`Saver`) and callbacks;
and what it returns (:class:`History`)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from nnx_shard._checkpoint import Checkpointer
from nnx_shard._train._diloco import DiLoCo
from nnx_shard._train._feed import Feed, Group
from nnx_shard._train._fused import Carry, Fused
from nnx_shard._train._guard import Guard, not_finite_leaf, why_not_finite
from nnx_shard._train._progress import Progress
from nnx_shard._train._traced import Packed

__all__ = ["FitRun", "History", "Saver", "TrainState"]

_HERE = os.path.dirname(os.path.abspath(__file__))

#: Calls in flight (dispatched, not known to be finished): the device always has the
#: next call queued, and no more (docs/architecture.md: deeper queues of calls with
#: collectives can abort XLA's CPU rendezvous).
IN_FLIGHT = 2
#: Where nothing needs each call's metrics at once (no callbacks, a guard that undoes
#: nothing), they stay on the devices and are read back together: after this many
#: calls, or ``READ_SECONDS`` after the last read (the progress bar's refresh and the
#: most a non-finite stop is noticed late; the steps after it are not applied).
READ_EVERY = 64
READ_SECONDS = 0.1


class _Call(NamedTuple):
    """A dispatched call whose metrics are not read yet."""

    steps: int
    examples: int
    metrics: Any
    group: Group | None  # kept only where a failed call may be replayed (guard="full")
    generation: int  # replays when dispatched

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
            # A DiLoCo holds the model (its anchor) and every replica: saved whole.
            model, optimizer = ((t.optimizer, None) if isinstance(t.optimizer, DiLoCo)
                                else (t.model, t.optimizer))
            self.checkpointer.save(
                t.step, model=model, optimizer=optimizer,
                extra={"step": t.step, "data_position": t.data_position},
            )
            self.last_saved = t.step


class FitRun:
    """One call of :meth:`Trainer.fit` after its set-up: dispatching fused calls,
    reading their metrics (replaying a call the NaN guard undid), then, for each
    call: the checkpoint, the user's callbacks (given the steps of the call that
    were applied, also when a non-finite step cut it short) and the NaN stop (with
    a ``RuntimeWarning`` naming the check, the first non-finite leaf and the step),
    in that order, until the data ends or training stops; the progress bar after
    each read.

    ``fused`` is fit's call (the guard checks it once); ``careful`` replays a
    failed call with every step checked, ``checked`` naming the leaves of its
    ``nonfinite`` metric; ``guard`` is the :class:`~nnx_shard._train._guard.Guard`
    both take. ``mode`` is the guard's (:data:`~nnx_shard._train._guard.GUARDS`):
    only ``"full"`` undoes and replays a call; under ``"grads"`` and ``"off"`` the
    steps say themselves which were applied, and a call behind a failed one
    applies nothing (its guard is down), so metrics can be read late: with no
    callbacks they are read in bulk (:data:`READ_EVERY`, :data:`READ_SECONDS`),
    the step counters and the history then catch up, and what a callback,
    a checkpoint or the end of fit sees is read first.
    """

    def __init__(self, trainer: TrainState, fused: Fused, careful: Fused,
                 checked: Sequence[tuple[str, str]], guard: Guard,
                 callbacks: Sequence[Callable[..., Any]], depth: int, *,
                 progress: Progress, saver: Saver | None, mode: str = "full",
                 host_metrics: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 ) -> None:
        self.trainer = trainer
        self.mode = mode
        # The host side of the metrics (a DiLoCo's per-replica ones averaged), applied
        # to every call's metrics as they are read.
        self.host_metrics = host_metrics or dict
        self.careful = careful
        self.checked = checked
        self.guard = guard
        self.callbacks = callbacks
        self.depth = depth
        self.progress = progress
        self.saver = saver
        self.start = self.last_t = self.last_read = time.perf_counter()
        self.hist: dict[str, list[np.ndarray]] = collections.defaultdict(list)
        self.done = 0  # steps applied by this fit
        self.shown = 0  # steps applied when the bar was last updated
        self.last_loss: float | None = None
        self.stop_reason: str | None = None
        self.nonfinite = False
        self.pending: collections.deque[_Call] = collections.deque()
        self.in_flight: collections.deque[Any] = collections.deque()
        self.replays = 0  # calls replayed with the per-step guard so far
        self.examples = 0  # examples per step of the last call read
        self.failure: str | None = None  # why the last call read was cut short
        # Metrics read in bulk: only where no call needs them at once.
        self.lazy = mode != "full" and not callbacks
        # The model and optimizer state between calls; synced into the NNX objects
        # before anything reads them (see Carry).
        self.carry = Carry(fused)

    def dispatch(self, feed: Feed) -> None:
        try:
            self._dispatch(feed)
        except BaseException:
            # The calls dispatched ran: counted (steps, history) before the error
            # leaves, so the trainer's counters agree with the state fit syncs.
            with contextlib.suppress(Exception):
                self.read_all()
            raise

    def _dispatch(self, feed: Feed) -> None:
        t = self.trainer
        dispatched = t.step  # the step counter once every dispatched call is applied
        while self.stop_reason is None:
            # Calls queued behind a replayed one changed nothing: they are replayed
            # (in order) before anything new runs on the state.
            while self.pending and self.pending[0].generation < self.replays \
                    and not self.stop_reason:
                self.finish_one()
            if self.stop_reason is not None:
                break
            group = feed.get()
            if group is None:
                break
            metrics = self.carry(t.model, t.optimizer, group.data, self.guard,
                                 data_shardings=(group.shardings,))
            self.pending.append(_Call(group.steps, group.examples, metrics,
                                      None if self.mode != "full" else group, self.replays))
            self._bound(self.carry.done)
            # The next group is read (and stacked) at the top of the loop while the
            # device runs this call.
            dispatched += group.steps
            if self.saver is not None and self.saver.checkpointer.should_save(dispatched):
                # Read before the next call is dispatched: it would donate
                # (overwrite) exactly the state the save writes.
                self.read_all()
            elif not self.lazy:
                if len(self.pending) >= self.depth:
                    self.read_all()
            elif (len(self.pending) >= READ_EVERY
                  or time.perf_counter() - self.last_read >= READ_SECONDS):
                self.read_all()
        self.read_all()

    def _bound(self, done: Any) -> None:
        """Waits for the call :data:`IN_FLIGHT` calls back (a scalar that is ready
        when its call is): the metrics need not be read for that."""
        self.in_flight.append(done)
        while len(self.in_flight) > IN_FLIGHT:
            self.in_flight.popleft().block_until_ready()

    def save_last(self) -> None:
        """The checkpoint after the last step, unless a non-finite step stopped training."""
        if self.saver is not None and not self.nonfinite:
            self.saver.save(self.carry)

    def read_all(self) -> None:
        """Reads back every pending call's metrics (one transfer for all of them) and
        counts them, oldest first; then the progress bar."""
        self.last_read = time.perf_counter()
        if not self.pending:
            return
        if self.stop_reason is not None:
            self.pending.clear()  # in flight when training stopped: they applied nothing
            return
        raw = jax.device_get([c.metrics for c in self.pending])
        if not self._apply_all(raw):
            for host in raw:
                self.finish_one(_unpacked(host))
        self._show_progress()

    def _apply_all(self, raw: list[Any]) -> bool:
        """Counts the pending calls at once where that is all there is to do (calls of
        one layout, every step applied and finite, no callbacks, no checkpoint due):
        each metric is cut once from the calls' packed bytes, and the history gains
        one array per metric, whatever the number of calls. False, with nothing
        done, otherwise."""
        if self.callbacks or self.mode == "full" or len(raw) < 2:
            return False
        first = raw[0]
        if not isinstance(first, Packed) or any(
                not isinstance(p, Packed) or p.spec != first.spec for p in raw):
            return False
        t = self.trainer
        n = self.pending[0].steps
        steps = n * len(raw)
        rows = self.host_metrics(first.rows_of(raw))  # each [calls, K, ...]; state_finite [calls]
        if "state_finite" not in rows or "applied" not in rows:
            return False
        if not (rows["applied"].all() and rows["state_finite"].all()
                and np.isfinite(rows["loss"]).all() and np.isfinite(rows["grad_norm"]).all()):
            return False
        if self.saver is not None and any(
                self.saver.due(s) for s in range(t.step + 1, t.step + steps + 1)):
            return False
        for key, v in rows.items():
            if key not in ("applied", "state_finite"):
                self.hist[key].append(v.reshape(steps, *v.shape[2:]))
        self.hist["step"].append(np.arange(t.step + 1, t.step + steps + 1))
        self.last_loss = rows["loss"][-1, -1]
        self.examples = self.pending[-1].examples
        t.step += steps
        t.data_position += steps
        self.done += steps
        self.failure = None
        self.pending.clear()
        return True

    def finish_one(self, host: dict[str, Any] | None = None) -> None:
        """Counts the oldest pending call (``host``: its metrics, already read)."""
        t = self.trainer
        call = self.pending.popleft()
        if self.stop_reason is not None:
            return  # in flight when training stopped: it applied nothing
        if host is None or call.generation < self.replays:
            host = _unpacked(jax.device_get(call.metrics))
        if self.mode == "full" and (call.generation < self.replays or not host["applied"].all()):
            # This call failed the guard and was undone, or was queued behind one
            # that did (then it changed nothing): run it again, every step checked.
            assert call.group is not None
            self.carry.sync()
            self.replays += 1
            self.guard.raise_()
            batch = jax.device_put(call.group.data, call.group.shardings)
            host = jax.device_get(self.careful(t.model, t.optimizer, batch, self.guard))
        seen = self._apply(call.steps, call.examples, dict(host))
        if self.failure is None and self.saver is not None and self.saver.due(t.step):
            self.saver.save(self.carry)
        if self.callbacks and (self.failure is None or len(seen["loss"])):
            # After a non-finite step the callbacks still see the steps of this call
            # that were applied (History and a MetricsWriter then agree).
            self._show_progress()
            self._callbacks(seen)
        if self.failure is not None:
            self._show_progress()
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
        host = self.host_metrics(host)
        applied = host.pop("applied")  # one flag (the call's check) or one per step
        nonfinite_at = host.pop("nonfinite", None)
        state_finite = host.pop("state_finite", None)  # "grads" and "off" only
        good = n if applied.all() else int(np.argmin(applied))
        step0 = t.step
        for key, v in host.items():
            self.hist[key].append(v if good == n else v[:good])
        self.hist["step"].append(np.arange(step0 + 1, step0 + good + 1))
        if good:
            self.last_loss = host["loss"][good - 1]
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
        finite = np.ones(n, bool)
        for key in ("loss", "grad_norm"):
            finite &= np.isfinite(np.reshape(host[key], (n, -1))).all(axis=1)
        if state_finite and finite.all():
            return None
        first = None
        if not finite.all():
            i = int(np.argmin(finite))
            first = " and ".join(f"{key} is {host[key][i]}" for key in ("loss", "grad_norm")
                                 if not np.all(np.isfinite(host[key][i])))
            first += f" at step {step0 + i + 1}"
        if state_finite and self.mode == "grads" and "replica_loss" in host:
            return self._replica_failure(first, int(np.argmin(finite)), host)
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

    def _replica_failure(self, first: str | None, i: int, host: dict[str, np.ndarray]) -> str:
        """Why a DiLoCo's call of ``guard="grads"`` failed: the replicas whose step ``i``
        was not finite stopped there, unapplied; the others could not know before the
        next sync (nothing crosses replicas in between), so they ran on, and no sync ran."""
        bad = ~(np.isfinite(host["replica_loss"][i]) & np.isfinite(host["replica_grad_norm"][i]))
        which = ", ".join(map(str, np.flatnonzero(bad)))
        return (f"{first} (replica {which}); stopped without applying it: the replica stopped "
                f"there, the other replicas ran on to the end of the call (they learn of it "
                f"only at a sync) and no sync ran since: the state is finite but not the one "
                f"after step {self.trainer.step} (not saved). Fix: resume from the last "
                "checkpoint (fit(..., resume=True)), or Trainer(..., guard='full'), which "
                f"puts back the state after step {self.trainer.step}")

    def _show_progress(self) -> None:
        """The bar after the calls read: steps, the last loss, and the rates since
        it was last updated."""
        if self.progress.bar is None or self.done == self.shown or self.last_loss is None:
            return
        now = time.perf_counter()
        rate = (self.done - self.shown) / max(now - self.last_t, 1e-9)
        self.last_t, self.shown = now, self.done
        self.progress.update(self.done, float(self.last_loss), rate, rate * self.examples)

    def _stop_nonfinite(self) -> None:
        self.stop_reason = self.failure
        self.nonfinite = True
        # Points at the user's fit call: the first frame outside this package.
        level = 1
        frame: FrameType | None = sys._getframe()
        while frame is not None and frame.f_code.co_filename.startswith(_HERE):
            frame, level = frame.f_back, level + 1
        warnings.warn(f"Trainer.fit: {self.failure}.", RuntimeWarning, stacklevel=level)

    def history(self, num_steps: int) -> History:
        if self.stop_reason is None and self.done < num_steps:
            self.stop_reason = f"data ran out after {self.done} of {num_steps} steps"
        metrics = {key: np.concatenate(v) for key, v in self.hist.items()}
        if not metrics:
            metrics = {"step": np.zeros((0,), np.int64)}
        return History(metrics, self.done, self.stop_reason, time.perf_counter() - self.start)


def _unpacked(metrics: Any) -> dict[str, np.ndarray]:
    """A call's metrics read back (see :class:`~nnx_shard._train._traced.Packed`)."""
    return metrics.unpack() if isinstance(metrics, Packed) else dict(metrics)
