"""The language-model batches, train step and fused run the strategy tests share."""

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import nnx_shard as ns
from nnx_shard.models import Decoder, lm_loss
from tests._close import assert_close


@functools.cache
def lm_batches(steps: int, batch: int, length: int, vocab: int = 128) -> dict[str, np.ndarray]:
    """``steps`` host batches ``[steps, batch, length]`` of next-token pairs (seed 0)."""
    toks = np.random.default_rng(0).integers(0, vocab, size=(steps, batch, length + 1))
    toks = toks.astype(np.int32)
    return {"inputs": toks[:, :, :-1], "targets": toks[:, :, 1:]}


def lm_step(model, opt, batch):
    """One AdamW/SGD step of ``lm_loss``; returns the loss and the gradients."""
    loss, grads = ns.value_and_grad(lm_loss)(model, batch)
    opt.update(model, grads)
    return {"loss": loss, "grads": grads}


@dataclasses.dataclass
class Run:
    """What :func:`lm_run` leaves: the trained model and optimizer, host copies of
    the initial parameters and of the per-step metrics, and the compiled HLO."""

    strategy: ns.strategies.Strategy
    mesh: jax.sharding.Mesh
    model: Any
    opt: nnx.Optimizer
    init_params: dict  # host copies, before training
    metrics: dict  # host, [K, ...]
    hlo: str
    microbatches: int = 1


def lm_run(strategy, mesh, cfg, batches: dict[str, np.ndarray], lr: float,
           microbatches: int = 1, model_class: Any = Decoder) -> Run:
    """The reference transformer ``cfg`` (or ``model_class(cfg)``) initialised by
    ``strategy`` on ``mesh``, then trained with Adam over the host ``batches``
    (``[K, batch, length]``) in one fused call, whose compilation is the one
    inspected (``Run.hlo``)."""
    model = ns.sharded_init(lambda: model_class(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
    init_params = jax.device_get(nnx.state(model, nnx.Param))
    opt = ns.sharded_optimizer(model, optax.adam(lr), mesh, strategy)
    with ns.use(mesh, strategy.rules):
        batch = ns.shard_batch(batches, mesh, strategy.rules, ("batch", "length"), steps=True)
        fused = ns.multistep(lm_step, microbatches=microbatches)
        hlo = fused.lower(model, opt, batch).compile().as_text()
        metrics = jax.device_get(fused(model, opt, batch))
    assert fused.traces == 1  # the call reused the compilation inspected above
    return Run(strategy, mesh, model, opt, init_params, metrics, hlo, microbatches)


def assert_same_values(run: Run, ref: Run, rtol: float, rtol_params: float) -> None:
    """``run`` computed what the one-device ``ref`` did: the same initial parameters
    (bitwise: threefry bits are partitionable, and init is elementwise, no
    reduction to reorder), and the same loss, gradients, parameters and optimizer
    state after its K steps within ``rtol`` (``rtol_params`` for the parameters and the
    optimizer state) x max|expected| per tensor, since sharded steps sum in another
    order; and it trains. The optimizer state's moments add up K steps' gradients, whose
    rounding is bounded by each step's own largest gradient, not by the moment's largest
    element (the steps can cancel), hence the parameters' looser tolerance."""
    k = len(run.metrics["loss"])
    assert_close(run.init_params, ref.init_params, 0, "initial params")
    assert_close(run.metrics["loss"], ref.metrics["loss"], rtol, "loss")
    assert_close(run.metrics["grads"], ref.metrics["grads"], rtol, "grads")
    assert_close(nnx.state(run.model, nnx.Param), nnx.state(ref.model, nnx.Param),
                 rtol_params, f"params after {k} steps")
    assert_close(run.opt, ref.opt, rtol_params, f"optimizer state after {k} steps")
    assert run.metrics["loss"][-1] < run.metrics["loss"][0]  # it trains


def lower_bare_steps(strategy: str, sizes: dict[str, int], batch: int, seq: int,
                     steps: int = 2, config: Any = "tiny") -> jax.stages.Lowered:
    """The bare fused call of the reference model of ``config`` (a name or a config):
    ``steps`` steps of ``lm_loss`` and AdamW (no NaN guard, no gradient norm), lowered from
    abstract inputs: the program ``Trainer.fit``'s call is compared with."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from nnx_shard._optimizers import get as optimizer
    from nnx_shard.models import get_config

    strat = ns.strategies.get(strategy)
    mesh = ns.make_mesh(sizes)
    cfg = get_config(config) if isinstance(config, str) else config
    model = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, strat)
    opt = ns.sharded_optimizer(model, optimizer("adamw"), mesh, strat)
    spec = strat.rules.spec((None, "batch", "length"), shape=(steps, batch, seq), mesh=mesh)
    tokens = jax.ShapeDtypeStruct((steps, batch, seq), jnp.int32,
                                  sharding=NamedSharding(mesh, spec))

    def step(model, opt, batch):
        loss, grads = ns.value_and_grad(lm_loss)(model, batch)
        opt.update(model, grads)
        return loss

    with ns.use(mesh, strat.rules):
        return ns.multistep(step).lower(model, opt, {"inputs": tokens, "targets": tokens})
