"""The offloaded parameters streamed layer by layer (``offload="optimizer+params"``).

With the parameters in host memory and the decoder's layers scanned, ``Trainer``'s steps
leave the stacked parameters there: ``nnx_shard.pipeline.scan`` moves one layer's slice
in per turn of the forward (and, recomputed, of the backward) pass, their gradients come
back in host memory, and every reader of those (the update, the gradient norm, the NaN
guard's check) reads them a layer at a time (``nnx_shard._train._stream``).

(a) it trains as without offload (losses and weights, rtol 1e-5): fsdp with
    guard="grads", dp with guard="off";
(b) the traced call: every op that reads a host-memory value is a move, a loop or a
    call feeding it on; no stacked parameter is moved in whole nor kept on the device
    as a residual of the layer loop; the forward loop moves each stacked parameter in a
    slice per turn; the stacked gradients are host-typed (the update loop reads them
    from host memory);
(c) a NaN step is skipped (the guard reads the host gradients' norm), replayed and
    stopped at as without offload; the replay and guard="full"'s check stream too;
(d) where it cannot stream (two microbatches; an optimizer that is not element-wise)
    the parameters move in whole, as before, and it still trains as without offload.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard.models import Decoder
from tests._close import assert_close
from tests._lm import lm_batches
from tests.conftest import needs_devices
from tests.train import test_stream
from tests.train.test_stream import BATCH, CFG, CLIPPED, LAYERS, STEPS, K, _eqns, _on_host, _tx

pytestmark = needs_devices(8)

PARAMS = "optimizer+params"


def _nan_loss(model, batch):
    """lm_loss, NaN (and its gradients too) in a step whose first target is masked."""
    loss = ns.models.lm_loss(model, batch)
    return jnp.where(batch["targets"][0, 0] == -100, jnp.nan, 1.0) * loss


def _build(name: str, offload: str | None, tx: str, guard: str, microbatches: int = 1,
           loss=ns.models.lm_loss, cfg=CFG):
    s = ns.strategies.get(name, offload=offload)
    mesh = s.make_mesh(8)
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, s)
    opt = ns.sharded_optimizer(model, _tx(tx), mesh, s)
    trainer = ns.Trainer(model, opt, loss, mesh=mesh, rules=s, steps_per_call=K,
                         guard=guard, batch_names=("batch", "length"),
                         microbatches=microbatches)
    return s, mesh, model, opt, trainer


@functools.cache
def _trained(name, offload, tx="adamw", guard="grads", microbatches=1, nan_at=None):
    loss = ns.models.lm_loss if nan_at is None else _nan_loss
    *_, model, opt, trainer = _build(name, offload, tx, guard, microbatches, loss)
    stacked = {k: v.copy() for k, v in lm_batches(STEPS, BATCH, CFG.length, CFG.vocab).items()}
    if nan_at is not None:
        stacked["targets"][nan_at, 0, 0] = -100
    history = trainer.fit([{k: v[i] for k, v in stacked.items()} for i in range(STEPS)],
                          STEPS, progress=False)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state((model, opt), nnx.Param))}
    if nan_at is not None:
        assert history.stop_reason is not None and len(history) == nan_at
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(opt)))
    return np.asarray(history["loss"]), jax.device_get(nnx.state(model, nnx.Param)), kinds


def _assert_trains_as_without(name, tx="adamw", guard="grads", microbatches=1, nan_at=None):
    losses, params, kinds = _trained(name, PARAMS, tx, guard, microbatches, nan_at)
    # (test_stream's own reference runs, where they are the same, are shared.)
    ref_losses, ref_params, _ = (
        test_stream._trained(name, None, tx, guard) if microbatches == 1 and nan_at is None
        else _trained(name, None, tx, guard, microbatches, nan_at))
    assert kinds == {"pinned_host"}  # the parameters stay on the host between calls
    assert losses[-1] < losses[0]
    what = f"{name} {tx} {guard} M={microbatches}"
    assert_close(losses, ref_losses, 1e-5, f"{what} losses")
    assert_close(params, ref_params, 1e-5, f"{what} params")


# (~4 CPU-s each: the quick tier proves the streaming on the traced call, (b).)
@pytest.mark.slow
@pytest.mark.parametrize(("name", "guard"), [("fsdp", "grads"), ("dp", "off")])
def test_streamed_params_train_as_without_offload(name, guard):
    _assert_trains_as_without(name, guard=guard)


@pytest.mark.slow
@pytest.mark.parametrize(("tx", "microbatches"), [("adamw", 2), (CLIPPED, 1)])
def test_what_cannot_stream_still_trains_as_without_offload(tx, microbatches):
    _assert_trains_as_without("fsdp", tx, microbatches=microbatches)


@pytest.mark.slow
def test_a_non_finite_step_is_skipped_and_replayed_as_without_offload():
    # Step 4 of 4 (the second call's second) is NaN: its host gradients' norm says so,
    # the step is not applied and the call is replayed step by step (the replay moves
    # the parameters in whole); fit stops there with the state after step 3.
    _assert_trains_as_without("fsdp", nan_at=3)


# --------------------------------------------------------------------------- (b) the program


def _traced_call(tx="adamw", microbatches=1, offload=PARAMS, cfg=CFG, replay=False,
                 guard="grads"):
    """The Trainer's fused call (fsdp, parameters offloaded; with ``replay`` the
    guard's step-by-step replay of a failed call) traced, and the global shapes of the
    stacked parameters."""
    s, mesh, model, opt, trainer = _build("fsdp", offload, tx, guard, microbatches, cfg=cfg)
    stacked = lm_batches(K, BATCH, CFG.length, CFG.vocab)
    fused = trainer._careful if replay else trainer._fused
    with ns.use(mesh, s.rules):
        placed = ns.shard_batch(stacked, mesh, s.rules, ("batch", "length"), steps=True)
        plan, _, _, values, data = fused._prepare((model, opt, placed, trainer._guard))
        jaxpr = jax.make_jaxpr(plan.run)(values, data)
    shapes = [tuple(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))
              if x.ndim and x.shape[0] == LAYERS]
    return jaxpr, shapes


def _kept(jaxpr, shapes):
    """Device-memory stacks of a parameter's shape a layer loop leaves behind."""
    return [v for e, _ in _eqns(jaxpr.jaxpr) if e.primitive.name == "scan"
            and e.params["length"] == LAYERS for v in e.outvars
            if tuple(v.aval.shape) in shapes and not _on_host(v)]


def _matmuls(jaxpr):
    return sum(e.primitive.name == "dot_general" for e, _ in _eqns(jaxpr.jaxpr))


# Primitives that may take a host-memory value: moves, and what only hands it on to a
# jaxpr of its own (checked there in turn): loops, calls, branches, remat.
_HANDS_ON = {"device_put", "scan", "pjit", "jit", "closed_call", "remat2", "checkpoint",
             "cond", "while", "custom_jvp_call", "custom_vjp_call", "optimization_barrier"}


def _moves_in(jaxpr):
    return [e for e, _ in _eqns(jaxpr.jaxpr) if e.primitive.name == "device_put"
            and e.params["devices"][0] == jax.memory.Space.Device and _on_host(e.invars[0])]


@pytest.fixture(scope="module")
def streamed_call():
    return _traced_call()


def test_host_values_are_only_moved_or_handed_on(streamed_call):
    jaxpr, shapes = streamed_call
    assert shapes  # the model has stacked parameters to stream
    readers = {e.primitive.name for e, _ in _eqns(jaxpr.jaxpr)
               if any(_on_host(v) for v in e.invars if hasattr(v, "aval"))}
    assert readers <= _HANDS_ON, readers - _HANDS_ON


def test_stacked_params_move_in_a_layer_at_a_time_and_are_never_kept(streamed_call):
    jaxpr, shapes = streamed_call
    ins = _moves_in(jaxpr)
    assert [e for e in ins if tuple(e.invars[0].aval.shape) in shapes] == []  # never whole
    # The forward loop (and its recomputation in the backward pass) moves in one slice
    # of each stacked parameter per turn.
    slices = {tuple(e.invars[0].aval.shape) for e in ins}
    assert {shape[1:] for shape in shapes} <= slices
    # No loop leaves a device-memory stack of a parameter's shape behind (a residual
    # of the forward pass kept for the backward one): the moves are recomputed.
    assert _kept(jaxpr, shapes) == []


@pytest.mark.parametrize(("replay", "guard"), [(True, "grads"), (False, "full")])
def test_the_guards_streams_and_keeps_the_state_before_on_the_host(replay, guard):
    # The replay of a failed call (step by step, each step checked and undone if not
    # finite) moves as the fused call does, and guard="full"'s check at the end of a
    # call reads the host state a layer at a time: their fallback state is the host
    # arrays, chosen by a cond.
    jaxpr, shapes = _traced_call(replay=replay, guard=guard)
    readers = {e.primitive.name for e, _ in _eqns(jaxpr.jaxpr)
               if any(_on_host(v) for v in e.invars if hasattr(v, "aval"))}
    assert readers <= _HANDS_ON, readers - _HANDS_ON
    ins = _moves_in(jaxpr)
    assert [e for e in ins if tuple(e.invars[0].aval.shape) in shapes] == []
    assert {shape[1:] for shape in shapes} <= {tuple(e.invars[0].aval.shape) for e in ins}
    assert _kept(jaxpr, shapes) == []


def test_stacked_grads_come_back_in_host_memory(streamed_call):
    jaxpr, shapes = streamed_call
    loops = [e for e, _ in _eqns(jaxpr.jaxpr) if e.primitive.name == "scan"
             and e.params["length"] == LAYERS and any(map(_on_host, e.outvars))]

    def host(vs):
        return sorted(tuple(v.aval.shape) for v in vs if _on_host(v) and v.aval.ndim)

    # The backward loop gives the stacked gradients, in host memory; the update loop
    # reads from there each stacked parameter, its gradient and its two AdamW moments,
    # and gives the new parameters and moments back there.
    (backward,) = [e for e in loops if host(e.outvars) == sorted(shapes)]
    (update,) = [e for e in loops if e is not backward]
    assert host(update.invars) == sorted(shapes * 4)
    assert host(update.outvars) == sorted(shapes * 3)


@pytest.mark.slow
def test_the_streamed_loop_recomputes_a_layer_as_remat_full_does(streamed_call):
    # The streamed loop keeps only each layer's input: its backward pass recomputes the
    # layer's forward (its matmuls) once, as the model's own remat="full" does, which
    # the loop then adds nothing to and keeps in force.
    full = dataclasses.replace(CFG, remat="full")
    (plain, _), (remat, _) = _traced_call(offload=None), _traced_call(offload=None, cfg=full)
    streamed, shapes = _traced_call(cfg=full)
    assert _matmuls(plain) < _matmuls(remat)
    assert _matmuls(streamed) == _matmuls(remat) == _matmuls(streamed_call[0])
    assert _kept(streamed, shapes) == []


# Moves in whole of each stacked shape: the parameter, once; under the clip the two
# AdamW moments too (the update does not stream; with two microbatches it still does).
@pytest.mark.slow
@pytest.mark.parametrize(("tx", "microbatches", "each"), [("adamw", 2, 1), (CLIPPED, 1, 3)])
def test_what_cannot_stream_moves_the_params_in_whole(tx, microbatches, each):
    jaxpr, shapes = _traced_call(tx, microbatches)
    whole = [tuple(e.invars[0].aval.shape) for e in _moves_in(jaxpr)]
    assert sorted(s for s in whole if s in shapes) == sorted(shapes * each)


# ------------------------------------------------- (e) multistep(..., stream_offload=True)


def _step(model, optimizer, batch):
    loss, grads = ns.value_and_grad(ns.models.lm_loss)(model, batch)
    ns.apply_gradients(model, optimizer, grads)
    return {"loss": loss}


def _fused_setup(offload, stream_offload, step=_step):
    s = ns.strategies.get("fsdp", offload=offload)
    mesh = s.make_mesh(8)
    model = ns.sharded_init(lambda: Decoder(CFG, rngs=nnx.Rngs(0)), mesh, s)
    opt = ns.sharded_optimizer(model, _tx("adamw"), mesh, s)
    fused = ns.multistep(step, stream_offload=stream_offload)
    return s, mesh, model, opt, fused


def _traced_fused(stream_offload):
    s, mesh, model, opt, fused = _fused_setup(PARAMS, stream_offload)
    with ns.use(mesh, s.rules):
        placed = ns.shard_batch(lm_batches(K, BATCH, CFG.length, CFG.vocab), mesh, s.rules,
                                ("batch", "length"), steps=True)
        plan, _, _, values, data = fused._prepare((model, opt, placed))
        jaxpr = jax.make_jaxpr(plan.run)(values, data)
    shapes = [tuple(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))
              if x.ndim and x.shape[0] == LAYERS]
    return jaxpr, shapes


def test_a_streaming_multistep_step_moves_a_layer_at_a_time():
    # Whole at step start by default; a layer at a time (forward, backward and update,
    # never a device stack left behind) with stream_offload and ns.apply_gradients.
    whole, shapes = _traced_fused(False)
    assert sorted(tuple(e.invars[0].aval.shape) for e in _moves_in(whole)
                  if tuple(e.invars[0].aval.shape) in shapes) == sorted(shapes * 3)
    streamed, _ = _traced_fused(True)
    ins = _moves_in(streamed)
    assert [e for e in ins if tuple(e.invars[0].aval.shape) in shapes] == []
    assert {shape[1:] for shape in shapes} <= {tuple(e.invars[0].aval.shape) for e in ins}
    assert _kept(streamed, shapes) == []


@pytest.mark.slow
def test_a_streaming_multistep_step_trains_as_without_offload():
    runs = {}
    for offload, stream in ((None, False), (PARAMS, True)):
        s, mesh, model, opt, fused = _fused_setup(offload, stream)
        stacked = lm_batches(STEPS, BATCH, CFG.length, CFG.vocab)
        losses = []
        with ns.use(mesh, s.rules):
            for call in range(STEPS // K):
                part = {k: v[call * K:(call + 1) * K] for k, v in stacked.items()}
                placed = ns.shard_batch(part, mesh, s.rules, ("batch", "length"), steps=True)
                losses.extend(np.asarray(fused(model, opt, placed)["loss"]))
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state((model, opt)))}
        runs[offload] = np.asarray(losses), jax.device_get(nnx.state(model, nnx.Param)), kinds
    (losses, params, kinds), (ref_losses, ref_params, _) = runs[PARAMS], runs[None]
    assert kinds == {"pinned_host"}  # parameters and optimizer state stay on the host
    assert losses[-1] < losses[0]
    assert_close(losses, ref_losses, 1e-5, "streamed multistep losses")
    assert_close(params, ref_params, 1e-5, "streamed multistep params")


def _plain_update(model, optimizer, batch):
    loss, grads = ns.value_and_grad(ns.models.lm_loss)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss}


def _swapped(optimizer, model, batch):
    return _step(model, optimizer, batch)


@pytest.mark.parametrize(("step", "message"), [
    (_plain_update, "_plain_update never called nnx_shard.apply_gradients, which moves the "
                    "optimizer state"),
    (_swapped, "_swapped was given (Optimizer, Decoder) first; a streaming step takes the "
               "model and its nnx.Optimizer"),
])
def test_a_streaming_step_must_take_the_model_first_and_apply_gradients(step, message):
    s, mesh, model, opt, fused = _fused_setup("optimizer", True, step)
    args = (opt, model) if step is _swapped else (model, opt)
    with ns.use(mesh, s.rules):
        placed = ns.shard_batch(lm_batches(K, BATCH, CFG.length, CFG.vocab), mesh, s.rules,
                                ("batch", "length"), steps=True)
        plan, _, _, values, data = fused._prepare((*args, placed))
        with pytest.raises(ns.UsageError, match="stream_offload=True") as err:
            jax.make_jaxpr(plan.run)(values, data)
    assert message in str(err.value)


@pytest.mark.slow  # ~7 CPU-s: the eager update dispatches op by op
def test_apply_gradients_outside_multistep_keeps_host_state_on_the_host():
    # Eagerly, as under nnx.jit: the update equals optimizer.update's without offload,
    # and the offloaded state is in host memory again after it (the update moves the
    # leaves that are not stacked, and the step count, to the device whole).
    s = ns.strategies.get("fsdp", offload="optimizer")
    mesh = s.make_mesh(8)
    cfg = dataclasses.replace(CFG, layers=2)
    tokens = lm_batches(1, BATCH, cfg.length, cfg.vocab)
    batch = {k: v[0] for k, v in tokens.items()}
    out = {}
    for offload in ("optimizer", None):
        strategy = s.with_offload(offload)
        model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
        opt = ns.sharded_optimizer(model, _tx("adamw"), mesh, strategy)
        with ns.use(mesh, strategy.rules):
            grads = nnx.jit(lambda m, b: ns.value_and_grad(ns.models.lm_loss)(m, b)[1])(
                model, batch)
            if offload:
                ns.apply_gradients(model, opt, grads)
            else:
                opt.update(model, grads)
        out[offload] = model, opt
    (model, opt), (ref_model, ref_opt) = out["optimizer"], out[None]
    assert {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(opt))} == {"pinned_host"}
    assert int(opt.step[...]) == int(ref_opt.step[...]) == 1
    assert_close(jax.device_get(nnx.state(model, nnx.Param)),
                 jax.device_get(nnx.state(ref_model, nnx.Param)), 1e-5, "params")
    assert_close(jax.device_get(nnx.state(opt)), jax.device_get(nnx.state(ref_opt)), 1e-5,
                 "optimizer state")


_LINEAR = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
_GRADS = {"bias": jnp.ones(2), "kernel": jnp.ones((2, 2))}


@pytest.mark.parametrize(("args", "says"), [
    (("model", None, _GRADS), "model is a str, not an nnx.Module"),
    ((lambda x: x, None, _GRADS), "model is a function, not an nnx.Module"),
    ((_LINEAR, "opt", _GRADS), "optimizer is a str, not an nnx.Optimizer"),
    ((_LINEAR, None, None), "grads is a NoneType holding no gradient"),
    ((_LINEAR, None, {**_GRADS, "scale": jnp.ones(2)}),
     "grads holds a gradient for 'scale', which the optimizer does not update"),
    ((_LINEAR, None, {"bias": jnp.ones(2)}), "grads holds no gradient for 'kernel'"),
])
def test_apply_gradients_names_what_is_wrong_with_its_arguments(args, says):
    model, opt, grads = args
    if opt is None:
        opt = nnx.Optimizer(_LINEAR, _tx("adamw"), wrt=nnx.Param)
    before = jax.tree.map(np.asarray, nnx.state(_LINEAR))
    with pytest.raises(ns.UsageError, match="^apply_gradients: ") as err:
        ns.apply_gradients(model, opt, grads)
    assert says in str(err.value) and "Fix: " in str(err.value)
    # Refused before anything changed.
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(_LINEAR)),
                 before)
