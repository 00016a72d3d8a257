"""``Trainer``: a (sharded) model trained K steps per compiled call, with batches
stacked and sharded while the device runs, a progress bar, a NaN/Inf stop and
checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from nnx_shard._checkpoint import Checkpointer
from nnx_shard._checkpoint._restore import restore_in_place
from nnx_shard._errors import UsageError, count, flag, short
from nnx_shard._init import StrategyLike, tables
from nnx_shard._mesh import make_mesh, use
from nnx_shard._rules import Rules
from nnx_shard._train._diloco import DiLoCo
from nnx_shard._train._diloco_fit import (
    check_diloco,
    make_diloco_steps,
    replica_guard,
    replica_metrics,
)
from nnx_shard._train._feed import BatchCheck, Feed, groups, iter_group_sizes
from nnx_shard._train._fused import Fused
from nnx_shard._train._fused_checks import check_options
from nnx_shard._train._guard import (
    DEFAULT_GUARD,
    Guard,
    StateLayout,
    check_call,
    check_guard,
    guard_call,
    make_fast_step,
    make_gated_step,
    make_step,
)
from nnx_shard._train._microbatch import check_tracked
from nnx_shard._train._placement import (
    LogicalNames,
    Placer,
    batch_shardings,
    host_sharding_types,
)
from nnx_shard._train._precision import Precision, as_precision
from nnx_shard._train._progress import Progress
from nnx_shard._train._run import FitRun, History, Saver
from nnx_shard._train._trees import short_repr

__all__ = ["Trainer"]


class Trainer:
    """Trains a (sharded) model: K steps per compiled call, batches stacked and sharded.

    ``loss_fn(model, batch) -> loss`` (or ``(loss, aux_dict)`` with
    ``has_aux=True``) is differentiated with :func:`value_and_grad`; each step
    applies ``optimizer.update(model, grads)``. :meth:`fit` pulls host
    batches (pytrees of NumPy arrays with a leading batch axis) from any
    iterable, stacks ``steps_per_call`` of them, shards them with
    :func:`shard_batch` (``batch_names`` name the leading dims), and runs
    them in one fused call; the next group is prepared while it runs.

    Args:
      model, optimizer: NNX model and ``nnx.Optimizer``, already laid out
        (e.g. by ``sharded_init`` / ``sharded_optimizer``); updated in place. Arrays
        in host memory (a strategy's ``offload``) stay there between steps: each step
        moves offloaded parameters to the devices at its start (scanned layers' a layer
        at a time inside the layer loop, where the update streams too) and the optimizer
        state once the gradients exist, and both back at its end
        (:meth:`~nnx_shard.strategies.Strategy.with_offload`).
        The optimizer may be a :class:`~nnx_shard.DiLoCo` of ``model`` (its anchor):
        ``fit`` then trains its replicas as ``ns.multistep(lambda d, b: d.step(loss_fn,
        b))`` does, syncs included; the history's ``loss`` and ``grad_norm`` are the means
        over the replicas (taken on the host; ``replica_loss`` and ``replica_grad_norm``
        hold each replica's, ``[steps, R]``), checkpoints hold the whole DiLoCo, and no step
        crosses replicas but the sync: under ``guard="grads"`` a replica whose loss or
        gradient is not finite skips its update, and the others run on to the end of
        the call (see :meth:`fit`); ``microbatches``, ``precision`` and ``has_aux`` do
        not apply.
      loss_fn: the loss, a mean over the examples of the batch.
      mesh: where batches go; with a strategy as ``rules``, it defaults to the mesh the
        model's arrays live on.
      rules: what ``ns.sharded_init`` took: a rules table (maps ``batch_names``) or the
        strategy the model was built with (``ns.strategies.get("fsdp")``: its rules,
        after the same :meth:`~nnx_shard.strategies.Strategy.check`).
      steps_per_call: K, steps per compiled call.
      microbatches: split each step's batch into this many, accumulating gradients to
        the whole batch's step (a loss declared with :func:`~nnx_shard.mean_over`, as
        ``lm_loss``, weighs each by its items; see :func:`value_and_grad`).
      batch_names: logical names of the leading dims of every batch leaf.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; aux metrics go to the history.
      donate: reuse state buffers across calls (see :func:`multistep`).
      unroll: steps per iteration of the compiled loop (see :func:`multistep`).
      precision: a :class:`~nnx_shard.Precision`, e.g. ``Precision(params=
        jnp.float32, compute=jnp.bfloat16)``: ``loss_fn`` reads the model's float
        parameters in bfloat16 where it uses them, while the parameters, the
        optimizer state and the gradients stay float32. Checked against the
        model here (see :meth:`Precision.check`).
      guard: the NaN guard of :meth:`fit` (``"grads"``, the default, ``"full"`` or
        ``"off"``): what it catches and what it costs are in :meth:`fit`.

    >>> from nnx_shard import Trainer
    >>> import numpy as np, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> mse = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    >>> trainer = Trainer(model, opt, mse, mesh="data=8", rules={"batch": "data"},
    ...                   steps_per_call=4)
    >>> data = ({"x": np.ones((8, 3), np.float32), "y": np.zeros((8, 1), np.float32)}
    ...         for _ in range(10))
    >>> history = trainer.fit(data, num_steps=6, progress=False)
    >>> history["step"].tolist(), history["loss"].shape, int(opt.step[...])
    ([1, 2, 3, 4, 5, 6], (6,), 6)

    DiLoCo over hsdp's replicas (``replica=2``), synced every 2 steps:

    >>> import nnx_shard as ns
    >>> s = ns.strategies.get("hsdp")
    >>> model = ns.sharded_init(lambda: nnx.Linear(3, 1, rngs=nnx.Rngs(0)), s.make_mesh(), s)
    >>> diloco = ns.DiLoCo(model, optax.sgd(0.1), inner_steps=2)
    >>> trainer = Trainer(model, diloco, mse, rules=s, steps_per_call=4)
    >>> data = ({"x": np.ones((8, 3), np.float32), "y": np.zeros((8, 1), np.float32)}
    ...         for _ in range(4))
    >>> history = trainer.fit(data, num_steps=4, progress=False)
    >>> history["loss"].shape, history["replica_loss"].shape, int(diloco.count[...])
    ((4,), (4, 2), 4)
    """

    def __init__(  # noqa: PLR0913  # the options of fit's compiled call, keyword-only
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer | DiLoCo,
        loss_fn: Callable[..., Any],
        *,
        mesh: Mesh | str | Mapping[str, int] | None = None,
        rules: Rules | Mapping[str, Any] | StrategyLike | None = None,
        steps_per_call: int = 10,
        microbatches: int = 1,
        batch_names: LogicalNames = ("batch",),
        has_aux: bool = False,
        donate: bool = True,
        unroll: int = 1,
        precision: Precision | None = None,
        guard: str = DEFAULT_GUARD,
    ) -> None:
        if not isinstance(model, nnx.Module):
            raise UsageError(
                f"Trainer: model must be an nnx.Module, got {type(model).__name__} "
                f"({short_repr(model)}). Fix: pass the Flax NNX model itself, e.g. "
                "ns.sharded_init(lambda: MyModel(rngs=nnx.Rngs(0)), mesh, rules)."
            )
        if not isinstance(optimizer, nnx.Optimizer | DiLoCo):
            given = (
                "an optax transformation" if isinstance(optimizer, optax.GradientTransformation)
                else f"{type(optimizer).__name__} ({short_repr(optimizer)})"
            )
            raise UsageError(
                f"Trainer: optimizer must be an nnx.Optimizer holding the optimizer state, got "
                f"{given}. Fix: ns.sharded_optimizer(model, optax.adamw(1e-3), mesh, rules), "
                "or nnx.Optimizer(model, tx, wrt=nnx.Param)."
            )
        if not callable(loss_fn):
            raise UsageError(
                f"Trainer: loss_fn must be callable as loss_fn(model, batch), got "
                f"{short_repr(loss_fn)}. Fix: def loss_fn(model, batch): return a scalar loss."
            )
        steps_per_call = count(steps_per_call, "Trainer: steps_per_call", fix="e.g. steps_per_call=10")
        if isinstance(batch_names, str | bytes) or not isinstance(batch_names, Sequence) or not (
                batch_names and all(n is None or (isinstance(n, str) and n) for n in batch_names)):
            raise UsageError(
                f"Trainer: batch_names must be a tuple of logical names (str or None), one per "
                f"leading dim of every batch leaf, got {short(batch_names, 60)}. Fix: e.g. "
                "batch_names=('batch',) or ('batch', 'length')")
        flag(has_aux, "Trainer: has_aux")
        # multistep's own checks of the options both take, naming Trainer
        check_options(loss_fn, microbatches, None, unroll, "Trainer")
        flag(donate, "Trainer: donate")
        self.precision = as_precision(precision, "Trainer: precision")
        if self.precision is not None:
            self.precision.check(model)  # here, not at the first step's trace
        self._guard_mode = check_guard(guard)
        diloco = isinstance(optimizer, DiLoCo)
        if isinstance(optimizer, DiLoCo):
            check_diloco(model, optimizer, microbatches=microbatches, precision=precision,
                         has_aux=has_aux)
        check_tracked(model, optimizer)
        self.model = model
        self.optimizer = optimizer
        self.mesh, self.rules = _layout(model, mesh, rules)
        self.steps_per_call = steps_per_call
        self.batch_names = tuple(batch_names)
        self.step = 0
        # Batches consumed by applied steps, across fit calls: where a resumed
        # run's data continues (saved in checkpoints, see fit).
        self.data_position = 0
        # The steps' last argument: the NaN flag carried across calls and the state's
        # StateLayout, which fit records from the arrays (Auto mesh axes hide it from the
        # traced types) and the steps read when traced.
        self._guard = (replica_guard(optimizer) if isinstance(optimizer, DiLoCo)
                       and guard != "full" else Guard())
        # fit bounds the calls in flight itself (it reads each call's metrics), so the
        # fused call does not block on top of that. With guard="full" fit runs _fused,
        # whose NaN guard checks each call once (guard_call, at the end of the compiled
        # call); a call that fails it is undone and replayed with _careful, which checks
        # every step (it compiles only when that happens). With "grads" and "off" the
        # steps gate their own updates and check_call only checks the call: nothing is
        # undone, nothing replayed.
        finish: Callable[..., Any]
        # With a DiLoCo the metrics are per replica, averaged on the host.
        self._host_metrics = replica_metrics(guard) if diloco else None
        if diloco:
            step, finish, careful_step, self._checked = make_diloco_steps(loss_fn, guard)
        elif guard == "full":
            step, finish = make_fast_step(loss_fn, has_aux), guard_call
        else:
            step, finish = make_gated_step(loss_fn, has_aux, guard == "grads"), check_call
        self._fused = Fused(
            step, donate=donate, microbatches=microbatches,
            max_in_flight=None, unroll=unroll, finish=finish, entry="Trainer.fit",
            precision=self.precision, owner="Trainer", pack_metrics=not diloco,
        )
        if not diloco:
            careful_step, self._checked = make_step(loss_fn, has_aux)
        self._careful = Fused(careful_step, donate=donate, microbatches=microbatches,
                              max_in_flight=None, entry="Trainer.fit", precision=self.precision,
                              owner="Trainer")

    @property
    def guard(self) -> str:
        """The NaN guard's mode (``"grads"``, ``"full"`` or ``"off"``; see :meth:`fit`)."""
        return self._guard_mode

    @property
    def traces(self) -> int:
        """Compilations of the fused step so far (one per distinct K and batch shape;
        the per-step guard that replays a non-finite call compiles apart, only then)."""
        return self._fused.traces

    def fit(
        self,
        data: Iterable[Any] | Callable[[int], Iterable[Any]],
        num_steps: int,
        *,
        progress: bool = True,
        callbacks: Sequence[Callable[[int, dict[str, np.ndarray]], bool | None]] = (),
        checkpointer: Checkpointer | None = None,
        resume: bool = False,
    ) -> History:
        """Runs up to ``num_steps`` steps on batches from ``data``; returns the :class:`History`.

        Stops early when a step is not finite: its loss, its gradient norm, the
        updated parameters (any float Variable of the model) or the updated
        optimizer state hold a NaN/Inf (a ``RuntimeWarning`` and
        ``stop_reason`` name the check, the first non-finite leaf and the step;
        nothing from that call is saved; what is kept depends on the
        Trainer's ``guard``, below); when ``data`` runs out (so with finite
        data a huge ``num_steps`` means "until the data ends": steps are
        planned lazily); or when a callback returns ``True``. ``callback(step,
        metrics)`` runs after every fused call with that call's per-step
        metrics (NumPy) and the model exactly as of ``step``. Without
        callbacks, the metrics stay on the devices and are read back in bulk
        (every 64 calls or 0.1 s): ``trainer.step`` and the bar catch up then,
        and the steps after a non-finite one are dispatched but not applied. A final group smaller than ``steps_per_call`` compiles once
        more. With ``progress=True``, process 0 shows a tqdm bar (steps, loss,
        steps/s, examples/s): redrawn on a terminal, a widget in a notebook,
        and on stderr that is a log file a line at the start, every 30 s and
        at the end; ``progress=False`` shows nothing. With several
        processes, each one's ``data`` yields only its own rows of every global
        batch (``ns.distributed.process_slice``); all of them call ``fit``.

        Checkpoints: with ``checkpointer=ns.Checkpointer(directory, every=N,
        keep=K)`` the model, the optimizer and ``extra={"step": ...,
        "data_position": ...}`` are saved each time the step counter reaches a
        multiple of N (fused calls are cut at those steps, so an N that is not
        a multiple of ``steps_per_call`` costs one more compilation), and after
        the last step unless a non-finite step stopped training. Saves are
        written in the background while training goes on; ``fit`` returns once
        they are on disk. ``resume=True`` first restores the latest checkpoint
        in place (parameters, optimizer state and step, RNG state held in the
        model, the step counter and the data position), then trains until the
        step counter reaches ``num_steps``: with ``resume=True``, ``num_steps``
        is the run's total, so rerunning the same command continues where it
        stopped. Without ``resume``, a directory that already holds a step
        later than the current one is an error (the runs would mix).

        Data: ``data`` is an iterable of host batches, or a callable
        ``data(position)`` returning one that starts at batch ``position``,
        the number of batches consumed by applied steps so far
        (``trainer.data_position``; batches read but not applied, e.g.
        after an early stop, do not count). ``fit`` calls it with the current
        position. On resume, an iterable is taken to start at the beginning of
        the stream and the batches the restored steps consumed are skipped
        (read and dropped); a callable can seek there instead. An
        :class:`~nnx_shard.Batches` over whole arrays is read K steps at a time
        as one ``[K, batch, ...]`` window (no per-step Python, no stacking) and
        seeks to the data position on resume; any other iterable is read and
        stacked (one ``np.stack`` per leaf). Both happen in the calling thread
        while the previous calls run, and the compiled call copies the group to
        the devices itself.

        Each group's integer fields the library knows by name are checked on the
        host before the call (:class:`~nnx_shard._train._feed.BatchCheck`), since
        inside it they are traced and the model's own checks cannot run:
        ``attention_mask`` 0 or 1, ``targets`` / ``labels`` token ids or -100
        (ignored), ``positions`` from 0, token ids (``input_ids``, ``tokens``;
        ``inputs`` for a model with a vocabulary) from 0, and below the
        vocabulary size and the context of a model with a ``cfg.vocab`` (the
        ``Decoder``). A bad value is a
        :class:`~nnx_shard._errors.UsageError` naming the batch, the field and
        the value.

        The NaN guard, ``Trainer(..., guard=...)``; every mode checks each
        step's loss and gradient norm and the state each fused call leaves:

        * ``"grads"`` (the default): a step whose loss or gradient norm is
          NaN/Inf is not applied (the optimizer update is skipped in place,
          inside the compiled call) and training stops with the model and
          optimizer at the last finite state. It keeps no copy of the state.
          It does not catch a step whose gradients are finite but whose update
          makes the state non-finite (an infinite learning rate, e.g.
          ``optax.sgd(inf)``, or an overflowing optimizer moment): that step
          is applied, training stops after it, the state is left non-finite
          (not saved) and ``stop_reason`` names its first non-finite leaf.
        * ``"full"``: also catches that case: each fused call keeps the state
          from before it (one more copy of the parameters and optimizer state
          per device) and puts it back if any step or the final state is not
          finite; the call is then run again with every step checked (that
          variant compiles only then), which finds the step and the leaf, and
          the state kept is the last finite one.
        * ``"off"``: every step of a call is applied; the check at the end of
          the call stops training and names what went wrong, the state left
          as the call made it (not saved).

        With a :class:`~nnx_shard.DiLoCo` the guard keeps one flag per replica and
        no check crosses replicas outside the sync: under ``"grads"`` a replica whose
        loss or gradient norm is not finite skips that update and stops, while the
        others learn of it only at a sync (which then does not run) and run on to the
        end of the call; training stops there with every replica finite but not as
        after the last finite step (not saved: resume from the last checkpoint).
        ``"full"`` checks the whole DiLoCo once per call (one reduction over the
        replicas) and puts all of it back; ``"off"`` is as above.

        The checks run on values the call computes anyway; ``"grads"`` needs
        the gradient norm before each update (under sharded layouts one more
        small cross-device sum per step). ``nnx-shard plan --guard`` counts
        each mode's bytes; ``benchmarks/guard_cost.py`` measures them and the
        steps/s of each.

        >>> from nnx_shard import Trainer
        >>> import numpy as np, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> opt = nnx.Optimizer(model, optax.sgd(1e30), wrt=nnx.Param)   # diverges
        >>> mse = lambda m, b: jnp.mean((m(b) - 1.0) ** 2)
        >>> trainer = Trainer(model, opt, mse, mesh="data=8", rules={"batch": "data"},
        ...                   steps_per_call=5)
        >>> import warnings
        >>> with warnings.catch_warnings(record=True):
        ...     h = trainer.fit([np.ones((8, 2), np.float32)] * 10, 10, progress=False)
        >>> print(h.stop_reason)
        loss is inf and grad_norm is inf at step 2; stopped without applying it, keeping ... after step 1, ...
        >>> bool(jnp.isfinite(model.kernel[...]).all()), len(h)
        (True, 1)
        """
        num_steps = count(num_steps, "num_steps", least=0, fix="e.g. num_steps=1000")
        callbacks = _check_fit_args(data, callbacks, checkpointer, progress, resume)
        if resume and checkpointer is None:
            raise UsageError(
                "fit(resume=True) needs the checkpointer to resume from. Fix: pass one, e.g. "
                "checkpointer=ns.Checkpointer(directory, every=1000)."
            )
        num_steps, resumed = self._resume(checkpointer, resume, num_steps)
        every = checkpointer.every if checkpointer is not None else None
        sizes = iter_group_sizes(self.step, num_steps, self.steps_per_call, every)
        place = Placer(self.mesh, self.rules, self.batch_names)
        reader = groups(data, sizes, place, position=self.data_position, resumed=resumed,
                        check=BatchCheck.of(self.model))
        self._guard.raise_()
        self._record_layout()
        # Two calls in flight keep the device busy while the host stacks the next group
        # (never more: docs/architecture.md, deeper queues deadlock XLA's CPU rendezvous);
        # the metrics are read in bulk, except that the user's callbacks see the model
        # as of their step, so with them: one call at a time.
        # The run shows progress, stops on a non-finite step and saves before them (they
        # see only finite steps, and a save never follows a non-finite step).
        run = FitRun(self, self._fused, self._careful, self._checked, self._guard, callbacks,
                     depth=1 if callbacks else 2, progress=Progress(num_steps, progress),
                     saver=Saver(self, checkpointer) if checkpointer is not None else None,
                     mode=self._guard_mode, host_metrics=self._host_metrics)
        feed = Feed(reader)
        try:
            with use(self.mesh, self.rules):
                run.dispatch(feed)
                run.save_last()
        finally:
            run.carry.sync()
            feed.close()
            run.progress.close()
            if checkpointer is not None:
                checkpointer.wait()
        return run.history(num_steps)

    def lower(self, batch: Any) -> jax.stages.Lowered:
        """Lowers the compiled call :meth:`fit` makes for one group of K steps, NaN guard
        included, without running it: ``.compile().memory_analysis()`` gives the
        per-device bytes ``fit`` needs (the guard keeps the state from before the
        call, one more copy of the model and optimizer state than a bare
        :func:`multistep`). ``batch`` is one group as ``fit`` places it: a pytree of
        ``[K, batch, ...]`` arrays, or ``jax.ShapeDtypeStruct`` with their shardings;
        the model and optimizer may be abstract (:func:`~nnx_shard.abstract_init`).

        >>> from nnx_shard import Trainer
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> mse = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
        >>> trainer = Trainer(model, opt, mse, mesh="data=8", rules={"batch": "data"})
        >>> batch = {"x": jax.ShapeDtypeStruct((10, 8, 3), jnp.float32),
        ...          "y": jax.ShapeDtypeStruct((10, 8, 1), jnp.float32)}
        >>> mem = trainer.lower(batch).compile().memory_analysis()
        >>> mem.temp_size_in_bytes > 0
        True
        """
        self._record_layout()
        # As fit runs it: host data, placed by the call after these shardings (a
        # leaf's own sharding where it has one). Python numbers and lists become
        # arrays, so that the checks of the shardings name them.
        batch = jax.tree.map(
            lambda x: x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x), batch)
        resolved = batch_shardings(batch, self.mesh, self.rules, self.batch_names, steps=True)
        shardings = jax.tree.map(
            lambda x, s: x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding)
            else s, batch, resolved)
        host = (batch if host_sharding_types(self.mesh) else
                jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch))
        with use(self.mesh, self.rules):
            return self._fused._lower((self.model, self.optimizer, host, self._guard),
                                      (shardings,))

    def call(self, batch: Any) -> Any:
        """Runs the compiled call :meth:`fit` makes for one group of K steps, once, on
        ``batch`` placed as ``fit`` places it (e.g. :func:`~nnx_shard.shard_batch` with
        ``steps=True``), without fit's host loop (no stacking, no metrics read, no
        callbacks): for timing the call itself. Returns the call's outputs as device
        arrays, not waited for; the model and optimizer are updated as by ``fit``.

        >>> from nnx_shard import Trainer, shard_batch
        >>> import jax.numpy as jnp, numpy as np, optax
        >>> from flax import nnx
        >>> mse = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
        >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> trainer = Trainer(model, opt, mse, mesh="data=8", rules={"batch": "data"},
        ...                   steps_per_call=2)
        >>> batch = {"x": np.ones((2, 8, 3), np.float32), "y": np.ones((2, 8, 1), np.float32)}
        >>> out = trainer.call(shard_batch(batch, trainer.mesh, trainer.rules, steps=True))
        >>> out is not None
        True
        """
        self._record_layout()
        with use(self.mesh, self.rules):
            return self._fused(self.model, self.optimizer, batch, self._guard)

    # -- the phases of fit --------------------------------------------------------

    def _record_layout(self) -> None:
        """Gives the guard the :class:`~nnx_shard._train._guard.StateLayout` of the model and
        optimizer state as it is now: the steps read it when traced, and a new one
        (a static attribute of the guard) traces them again."""
        layout = StateLayout.of(self.model, self.optimizer, self.mesh)
        if layout != self._guard.layout:
            self._guard.layout = layout

    def _resume(
        self, checkpointer: Checkpointer | None, resume: bool, num_steps: int
    ) -> tuple[int, bool]:
        """Restores the latest checkpoint for ``resume=True``; refuses a directory that
        is ahead of this trainer otherwise. Returns the steps left to run and whether
        a checkpoint was restored."""
        resumed = False
        if checkpointer is None:
            return num_steps, resumed
        latest = checkpointer.latest_step()
        if resume and latest is not None:
            checkpointer.wait()
            # A DiLoCo holds the model (its anchor): it is saved and restored whole.
            step, extra = (restore_in_place(checkpointer.directory, self.optimizer, None)
                           if isinstance(self.optimizer, DiLoCo) else
                           restore_in_place(checkpointer.directory, self.model, self.optimizer))
            self.step = int(extra.get("step", step))
            self.data_position = int(extra.get("data_position", self.step))
            resumed = True
        elif latest is not None and latest > self.step:
            raise UsageError(
                f"fit: {checkpointer.directory} already holds a checkpoint for step "
                f"{latest}, later than this trainer's step {self.step}. Fix: pass "
                "resume=True to continue from it, or use another directory."
            )
        if resume:
            num_steps = max(num_steps - self.step, 0)
        return num_steps, resumed


def _check_fit_args(data: Any, callbacks: Any, checkpointer: Any, progress: Any,
                    resume: Any) -> tuple[Callable[..., Any], ...]:
    """:meth:`Trainer.fit`'s arguments checked before anything is compiled or read (a
    bad callback found after the first training call would cost that call)."""
    if isinstance(data, str | bytes) or not (isinstance(data, Iterable) or callable(data)):
        raise UsageError(
            f"Trainer.fit: data must be an iterable of batches (or a callable data(position) "
            f"returning one), got {type(data).__name__} {short(data, 60)}. Fix: e.g. a list or "
            "generator of arrays, or ns.Batches(arrays, batch_size=...)")
    if isinstance(callbacks, str | bytes) or not isinstance(callbacks, Iterable):
        raise UsageError(
            f"Trainer.fit: callbacks must be a list of callables callback(step, metrics), got "
            f"{type(callbacks).__name__} {short(callbacks, 60)}. Fix: e.g. callbacks=[writer]")
    callbacks = tuple(callbacks)
    for i, cb in enumerate(callbacks):
        if not callable(cb):
            raise UsageError(
                f"Trainer.fit: callbacks[{i}] is {type(cb).__name__} {short(cb, 60)}, not a "
                "callable callback(step, metrics). Fix: e.g. callbacks=[ns.MetricsWriter(dir)]")
    if checkpointer is not None and not isinstance(checkpointer, Checkpointer):
        raise UsageError(
            f"Trainer.fit: checkpointer must be an ns.Checkpointer or None, got "
            f"{type(checkpointer).__name__} {short(checkpointer, 60)}. Fix: "
            "checkpointer=ns.Checkpointer(directory, every=1000)")
    flag(progress, "Trainer.fit: progress")
    flag(resume, "Trainer.fit: resume")
    return callbacks


def _layout(model: nnx.Module, mesh: Any, rules: Any) -> tuple[Mesh, Rules]:
    """``(mesh, rules)`` of the Trainer's ``mesh=`` and ``rules=`` (a table or a strategy:
    :func:`nnx_shard._init.tables` tells the two apart, as for every other entry point)."""
    if rules is None:
        raise UsageError(
            "Trainer: rules= not given. Fix: pass what ns.sharded_init took, e.g. "
            "Trainer(model, optimizer, loss_fn, rules=ns.strategies.get('fsdp')) or "
            "Trainer(..., mesh=mesh, rules=rules).")
    table, _, strategy = tables(rules, None, "Trainer")
    if mesh is None:
        found = [x.sharding.mesh for x in jax.tree.leaves(nnx.state(model))
                 if isinstance(getattr(x, "sharding", None), NamedSharding)]
        if strategy is None or not found:
            raise UsageError(
                "Trainer: mesh= not given" + ("" if strategy is None else
                                              " and the model's arrays are not on a mesh")
                + ". Fix: pass the mesh the model was built on, e.g. mesh='data=8'.")
        mesh = found[0]
    mesh = make_mesh(mesh)
    if strategy is not None:
        strategy.check(model, mesh)
    return mesh, table
