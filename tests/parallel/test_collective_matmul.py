"""Collective matmuls (nnx_shard._parallel.collective_matmul) and the async_tp strategy.

(a) each op equals the plain einsum, values and gradients, on 2-, 4- and
    8-way model axes, one-way and bidirectional rings, Auto and Explicit axes;
(b) the reference transformer after K fused steps under async_tp equals tp
    and a one-device run;
(c) the compiled step has collective-permutes over ``model`` in place of tp's
    all-reduces for the projections;
(d) bad input raises ShardingError / ValueError naming the fix.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard._parallel.collective_matmul import (
    all_gather_matmul,
    check_tokens,
    expect_projection,
    matmul_reduce_scatter,
    projection,
)
from nnx_shard.models import Decoder, get_config, lm_loss
from nnx_shard.planner import compiled_collectives
from tests._close import assert_close
from tests._lm import lm_batches, lm_step
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

K = 3
LR = 1e-3
RTOL = 1e-5  # x max|expected|: the ops sum the same products in another order
RTOL_STEP = 1e-4  # after K training steps (see tests/test_strategies.py)
RTOL_PARAMS = 1e-3

COLUMN = "ble,ehk->blhk"  # Q/K/V: gather the sequence, heads split
ROW = "blhk,hke->ble"  # attention output: heads contracted, sequence scattered


def _rand(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _spec(a: jax.Array) -> P:
    """``a``'s partition spec without trailing ``None`` entries."""
    spec = list(a.sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def _check_op(fn, eq: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``fn(x, w)`` (jitted) against ``jnp.einsum(eq, x, w)``: values and the
    gradients of a random linear functional of the output."""
    # The reference on one device, whatever the operands' layout.
    xh, wh = (jnp.asarray(np.asarray(a)) for a in (x, w))
    want = jnp.einsum(eq, xh, wh)
    ct = _rand(99, want.shape)
    got = jax.block_until_ready(jax.jit(fn)(x, w))
    assert_close(got, want, RTOL, "value")

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w) * ct)

    g_got = jax.block_until_ready(jax.jit(jax.grad(loss(fn), argnums=(0, 1)))(x, w))
    g_want = jax.grad(loss(lambda x, w: jnp.einsum(eq, x, w)), argnums=(0, 1))(xh, wh)
    assert_close(g_got, g_want, RTOL, "grads (x, w)")
    return got


def _permutes(fn, x, w, mesh) -> list:
    hlo = jax.jit(fn).lower(x, w).compile().as_text()
    return compiled_collectives(hlo, mesh)


# --------------------------------------------------------------------------- (a) the ops


@pytest.mark.parametrize("model", [2, 4, 8])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_all_gather_matmul_equals_einsum(model: int, bidirectional: bool) -> None:
    mesh = ns.make_mesh({"data": 8 // model, "model": model})
    x, w = _rand(0, (4, 32, 16)), _rand(1, (16, 8, 4))  # [b, l, e], [e, h, k]

    def fn(x, w):
        return all_gather_matmul(COLUMN, x, w, gather="l", shard="h", mesh=mesh,
                                 bidirectional=bidirectional)

    y = _check_op(fn, COLUMN, x, w)
    assert _spec(y) == P(None, None, "model")  # heads split, sequence whole
    found = _permutes(fn, x, w, mesh)
    # The gather is ring steps of collective-permutes over model, no all-gather.
    assert {(c.kind, c.axes) for c in found} == {("collective-permute", ("model",))}
    # model - 1 hops of the whole block, or of each half both ways round.
    assert len(found) == (model - 1) * (2 if bidirectional else 1)


@pytest.mark.parametrize("model", [2, 4, 8])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_matmul_reduce_scatter_equals_einsum(model: int, bidirectional: bool) -> None:
    mesh = ns.make_mesh({"data": 8 // model, "model": model})
    x, w = _rand(2, (4, 32, 8, 4)), _rand(3, (8, 4, 16))  # [b, l, h, k], [h, k, e]

    def fn(x, w):
        return matmul_reduce_scatter(ROW, x, w, scatter="l", contract="h", mesh=mesh,
                                     bidirectional=bidirectional)

    y = _check_op(fn, ROW, x, w)
    assert _spec(y) == P(None, "model")  # the sum's sequence blocks, one per device
    found = _permutes(fn, x, w, mesh)
    assert {(c.kind, c.axes) for c in found} == {("collective-permute", ("model",))}
    assert len(found) == (model - 1) * (2 if bidirectional else 1)


@pytest.mark.slow
@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_ops_keep_the_batch_split_over_data(axis_types: str) -> None:
    # Other mesh axes are not the ring's business: the batch stays split over
    # data, with no collective over data (Explicit: read from the type; Auto:
    # from the layout given).
    mesh = ns.make_mesh("data=2,model=4", axis_types=axis_types)
    layout = None if axis_types == "explicit" else {"b": ("data",)}
    x = jax.device_put(_rand(4, (4, 16, 16)), NamedSharding(mesh, P("data", "model")))
    w = jax.device_put(_rand(5, (16, 8)), NamedSharding(mesh, P(None, "model")))
    with jax.set_mesh(mesh):
        def up(x, w):
            return all_gather_matmul("ble,em->blm", x, w, gather="l", shard="m", layout=layout)

        def down(h, w):
            return matmul_reduce_scatter("blm,me->ble", h, w.T, scatter="l", contract="m",
                                         layout=layout)

        h = _check_op(up, "ble,em->blm", x, w)
        assert _spec(h) == P("data", None, "model")
        y = _check_op(down, "blm,em->ble", h, w)
        assert _spec(y) == P("data", "model")
        for fn, args in ((up, (x, w)), (down, (h, w))):
            kinds = {(c.kind, c.axes) for c in _permutes(fn, *args, mesh)}
            assert kinds == {("collective-permute", ("model",))}


@pytest.mark.slow
def test_projection_dispatch() -> None:
    mesh = ns.make_mesh("data=2,model=4")
    x, wq, wo = _rand(6, (2, 16, 16)), _rand(7, (16, 4, 2)), _rand(8, (4, 2, 16))
    heads = NamedSharding(mesh, P("data", None, "model"))
    seq = NamedSharding(mesh, P("data", "model"))
    # Jitted: eagerly, the rings' shard_map would run (and compile) op by op.
    q = jax.jit(lambda x, w: projection(COLUMN, x, w, heads, "l"))(x, wq)  # an all-gather ring
    assert_close(q, jnp.einsum(COLUMN, x, wq), RTOL)
    assert _spec(q) == heads.spec
    o = jax.jit(lambda q, w: projection(ROW, q, w, seq, "l"))(q, wo)  # a reduce-scatter ring
    assert_close(o, jnp.einsum(ROW, q, wo), RTOL)
    assert _spec(o) == seq.spec
    # Nothing to overlap: the sequence replicated in the output of a row-parallel
    # matmul (tp's layout), or nothing split over an axis of size > 1.
    assert projection(ROW, q, wo, NamedSharding(mesh, P("data")), "l") is None
    assert projection(COLUMN, x, wq, NamedSharding(mesh, P("data")), "l") is None


# --------------------------------------------------------------------------- (b), (c) the model


def _host_batches(length: int = 16) -> dict[str, np.ndarray]:
    return lm_batches(K, 8, length)


_step = lm_step


@dataclasses.dataclass
class Run:
    model: Decoder
    metrics: dict
    collectives: list


@functools.cache
def _run(name: str, mesh_spec: str, axis_types: str = "auto") -> Run:
    s = ns.strategies.get(name)
    n = 1 if mesh_spec == "data=1" else 8
    mesh = ns.make_mesh(mesh_spec, axis_types=axis_types, devices=jax.devices()[:n])
    model = ns.sharded_init(lambda: Decoder(get_config("tiny"), rngs=nnx.Rngs(0)), mesh, s)
    opt = ns.sharded_optimizer(model, optax.adam(LR), mesh, s)
    with ns.use(mesh, s.rules):
        batch = ns.shard_batch(_host_batches(), mesh, s.rules, ("batch", "length"), steps=True)
        fused = ns.multistep(_step)
        hlo = fused.lower(model, opt, batch).compile().as_text()
        metrics = jax.device_get(fused(model, opt, batch))
    return Run(model, metrics, compiled_collectives(hlo, mesh))


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "axis_types"), [("data=2,model=4", "auto"),
                                                  ("data=4,model=2", "auto"),
                                                  ("data=2,model=4", "explicit")])
def test_async_tp_equals_tp_and_one_device(mesh: str, axis_types: str) -> None:
    got = _run("async_tp", mesh, axis_types)
    for ref in (_run("tp", mesh, axis_types), _run("dp", "data=1")):
        assert_close(got.metrics["loss"], ref.metrics["loss"], RTOL_STEP, "loss")
        assert_close(got.metrics["grads"], ref.metrics["grads"], RTOL_STEP, "grads")
        assert_close(nnx.state(got.model, nnx.Param), nnx.state(ref.model, nnx.Param),
                     RTOL_PARAMS, f"params after {K} steps")
    assert got.metrics["loss"][-1] < got.metrics["loss"][0]
    # tp's parameter layout: checkpoints are interchangeable.
    tp = _run("tp", mesh, axis_types)
    got_s = [x.sharding.spec for x in jax.tree.leaves(nnx.state(got.model, nnx.Param))]
    tp_s = [x.sharding.spec for x in jax.tree.leaves(nnx.state(tp.model, nnx.Param))]
    assert got_s == tp_s


PROJECTIONS = ("blhk,hke->ble", "blm,me->ble", "ble,ehk->blhk", "ble,em->blm")


# Slow: tests/test_user_models.py's quick tier checks the rings of a compiled async_tp step.
@pytest.mark.slow
@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_compiled_step_permutes_in_place_of_all_reduces(axis_types: str) -> None:
    tp = _run("tp", "data=2,model=4", axis_types).collectives
    got = _run("async_tp", "data=2,model=4", axis_types).collectives

    def over_model(found, kind):
        return [c for c in found if c.kind == kind and c.axes == ("model",)]

    def of_projections(found, kind):
        return [c for c in over_model(found, kind) if any(p in c.op_name for p in PROJECTIONS)]

    # tp: an all-reduce over model after each row-parallel matmul (forward)
    # and for the input gradient of each column-parallel one (backward).
    # (XLA combines the three of Q/K/V into one): 6 activations per layer
    cfg = get_config("tiny")
    activation = 8 // 2 * cfg.length * cfg.embed * 4  # bytes of [batch / data, length, embed]
    # (XLA merges some with other small all-reduces, hence >=).
    assert sum(c.bytes for c in of_projections(tp, "all-reduce")) >= 6 * cfg.layers * activation
    # async_tp: none for the projections, and no all-gather of the sequence for
    # them either; ring steps of collective-permutes over model instead,
    # forward and backward, one-way (the blocks of the tiny sequence, 16 / 4,
    # are even: both ways round).
    assert of_projections(got, "all-reduce") == []
    assert of_projections(got, "all-gather") == []
    permutes = [c for c in got if c.kind == "collective-permute"]
    assert permutes and all(c.axes == ("model",) for c in permutes)
    # Each ring: model - 1 = 3 steps of two halves. Forward, per layer: one
    # gather ring for Q, K and V (the same blocks of x: XLA shares it), one
    # for the MLP's up projection and a reduce-scatter ring each for the
    # attention output and the MLP's down projection. Backward: a ring per
    # activation gradient (Q, K, V, up: reduce-scatter; O, down: gather of the
    # output gradient, which also feeds the weight gradient).
    ring = 3 * 2
    forward = [c for c in permutes if "transpose(" not in c.op_name]
    assert len(forward) == cfg.layers * 4 * ring
    assert len(permutes) - len(forward) == cfg.layers * 6 * ring
    # tp's remaining model collectives (embedding table, logits over vocab)
    # stay: async_tp changes the projections only.
    assert len(over_model(got, "all-reduce")) < len(over_model(tp, "all-reduce"))


@pytest.mark.slow
def test_trainer_carries_the_option() -> None:
    # Trainer(rules=strategy.rules) passes the options through ns.use.
    s = ns.strategies.get("async_tp")
    mesh = s.make_mesh(8)
    model = ns.sharded_init(lambda: Decoder(get_config("tiny"), rngs=nnx.Rngs(0)), mesh, s)
    opt = ns.sharded_optimizer(model, optax.adam(LR), mesh, s)
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=s.rules, steps_per_call=K,
                         batch_names=("batch", "length"))
    host = _host_batches()
    history = trainer.fit([{k: v[i] for k, v in host.items()} for i in range(K)], K,
                          progress=False)
    ref = _run("dp", "data=1")
    assert_close(history["loss"], ref.metrics["loss"], RTOL_STEP, "loss")
    assert_close(nnx.state(model, nnx.Param), nnx.state(ref.model, nnx.Param), RTOL_PARAMS,
                 "params after Trainer.fit")


# --------------------------------------------------------------------------- (d) bad input


def test_sequence_not_divisible_by_model_axis() -> None:
    s = ns.strategies.get("async_tp")
    mesh = s.make_mesh(8)
    model = ns.sharded_init(lambda: Decoder(get_config("tiny"), rngs=nnx.Rngs(0)), mesh, s)
    toks = jnp.zeros((8, 15), jnp.int32)
    with ns.use(mesh, s.rules), pytest.raises(ns.ShardingError) as e:
        lm_loss(model, {"inputs": toks[:, :-1], "targets": toks[:, 1:]})
    msg = str(e.value)
    assert "sequence length 14, not divisible by 4 (rule 'length' -> 'model')" in msg
    assert "multiple of 4 (e.g. 12 or 16)" in msg and "model=2" in msg and "'tp'" in msg


@pytest.mark.parametrize(("cfg", "param", "logical"),
                         [({"heads": 6}, "blocks/0/attn/k", "heads"),
                          ({"mlp": 30}, "blocks/0/mlp/down", "mlp")])
def test_heads_or_mlp_not_divisible(cfg, param, logical) -> None:
    config = dataclasses.replace(get_config("tiny"), **cfg)
    s = ns.strategies.get("async_tp")
    with pytest.raises(ns.ShardingError) as e:
        ns.sharded_init(lambda: Decoder(config, rngs=nnx.Rngs(0)), "data=2,model=4", s)
    msg = str(e.value)
    assert f"parameter '{param}'" in msg and f"rule '{logical}'" in msg
    assert "Suggested mesh: {'data': 4, 'model': 2}" in msg


def test_op_dimension_not_divisible() -> None:
    mesh = ns.make_mesh("data=2,model=4")
    with pytest.raises(ns.ShardingError) as e:
        all_gather_matmul(COLUMN, _rand(0, (2, 10, 16)), _rand(1, (16, 4, 2)), gather="l",
                          shard="h", mesh=mesh)
    assert ("dimension 'l' of x (shape (2, 10, 16)), which the ring gathers over mesh axis "
            "'model', has size 10, not divisible by the 'model' size 4") in str(e.value)
    assert "multiple of 4 (e.g. 8 or 12), or use a mesh with model=2" in str(e.value)
    # The batch as the ring's dimension: the same rule.
    with pytest.raises(ns.ShardingError, match="dimension 'b' of x .* size 6, not divisible"):
        all_gather_matmul("bd,df->bf", _rand(0, (6, 16)), _rand(1, (16, 8)), gather="b",
                          shard="f", mesh=mesh)
    # Heads not divisible by the ring.
    with pytest.raises(ns.ShardingError, match="dimension 'h' of x .* size 6, not divisible"):
        matmul_reduce_scatter(ROW, _rand(0, (2, 8, 6, 2)), _rand(1, (6, 2, 16)), scatter="l",
                              contract="h", mesh=mesh)


def test_op_argument_errors() -> None:
    mesh = ns.make_mesh("data=2,model=4")
    x, w = _rand(0, (2, 8, 16)), _rand(1, (16, 4, 2))
    with pytest.raises(ns.UsageError, match="two-operand einsum"):
        all_gather_matmul("ble->bl", x, w, gather="l", shard="h", mesh=mesh)
    with pytest.raises(ns.UsageError, match="gives x 2 dimensions .* shape \\(2, 8, 16\\)"):
        all_gather_matmul("be,ehk->bhk", x, w, gather="b", shard="h", mesh=mesh)
    with pytest.raises(ns.UsageError, match="shard='e' must be a letter of w that is in the output"):
        all_gather_matmul(COLUMN, x, w, gather="l", shard="e", mesh=mesh)
    with pytest.raises(ns.UsageError, match="contract='l' must be a letter of both operands"):
        matmul_reduce_scatter(ROW, _rand(0, (2, 8, 4, 2)), _rand(1, (4, 2, 16)), scatter="l",
                              contract="l", mesh=mesh)
    with pytest.raises(ns.ShardingError, match="mesh has axes \\('data', 'model'\\)"):
        all_gather_matmul(COLUMN, x, w, gather="l", shard="h", axis="tensor", mesh=mesh)
    with pytest.raises(ns.UsageError, match="needs an even block"):
        all_gather_matmul(COLUMN, _rand(0, (2, 12, 16)), w, gather="l", shard="h", mesh=mesh,
                          bidirectional=True)
    with pytest.raises(ns.ShardingError, match="no mesh is active"):
        all_gather_matmul(COLUMN, x, w, gather="l", shard="h")


@pytest.mark.parametrize(("value", "halves"), [(True, 2), ("bidirectional", 2),
                                               ("unidirectional", 1)])
def test_option_picks_the_ring(value, halves) -> None:
    mesh = ns.make_mesh("data=2,model=4")
    rules = ns.strategies.get("async_tp").rules.with_options(collective_matmul=value)
    x, w = _rand(0, (2, 16, 16)), _rand(1, (16, 4, 2))
    heads = NamedSharding(mesh, P("data", None, "model"))
    with ns.use(mesh, rules):
        fn = jax.jit(lambda x, w: projection(COLUMN, x, w, heads, "l"))
        assert_close(fn(x, w), jnp.einsum(COLUMN, x, w), RTOL)
        found = compiled_collectives(fn.lower(x, w).compile().as_text(), mesh)
    assert len([c for c in found if c.kind == "collective-permute"]) == 3 * halves


def test_bad_option_value() -> None:
    mesh = ns.make_mesh("data=2,model=4")
    rules = ns.strategies.get("async_tp").rules.with_options(collective_matmul="ring")
    heads = NamedSharding(mesh, P("data", None, "model"))
    with ns.use(mesh, rules), pytest.raises(ValueError, match="collective_matmul='ring' is not"):
        projection(COLUMN, _rand(0, (2, 16, 16)), _rand(1, (16, 4, 2)), heads, "l")


def test_batch_not_divisible_by_data_axis() -> None:
    s = ns.strategies.get("async_tp")
    with ns.use("data=2,model=4", s.rules), pytest.raises(ns.ShardingError) as e:
        check_tokens((3, 16))
    assert str(e.value).startswith("rule 'batch' splits the batch size over mesh axis 'data' "
                                   "(size 2), but the tokens (shape (3, 16)")
    assert "multiple of 2 (e.g. 2 or 4), use a mesh with data=1." in str(e.value)


@pytest.mark.parametrize(("args", "match"), [
    (((-1, 4),), r"check_tokens: shape must be a tuple of sizes >= 0"),
    (("ab",), r"check_tokens: shape must be a tuple of sizes >= 0"),
    (((8, 4), ("batch",)), r"must give one logical name per dimension of shape \(8, 4\)"),
])
def test_check_tokens_refuses_shapes_that_are_not(args, match):
    with pytest.raises(ns.ShardingError, match=match):
        check_tokens(*args)


@pytest.mark.slow
@needs_devices(8)
def test_a_users_own_ring_is_the_projection_async_tp_asks_for():
    mesh = ns.make_mesh("data=2,model=4")
    x = jax.device_put(jnp.ones((2, 8, 16)), NamedSharding(mesh, P("data", "model", None)))
    w = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P(None, "model")))
    with ns.use(mesh, ns.strategies.get("async_tp").rules):
        with expect_projection("my_step"):
            y = ns.collective_matmul.all_gather_matmul("blm,mk->blk", x, w, gather="l", shard="k")
        with pytest.raises(ns.ShardingError, match=r"my_step ran .* never ran a projection .*"
                           r"nnx_shard.collective_matmul.all_gather_matmul / matmul_reduce_scatter"):
            with expect_projection("my_step"):
                pass
    assert float(y[0, 0, 0]) == 16.0 and y.sharding.spec == P("data", None, "model")
