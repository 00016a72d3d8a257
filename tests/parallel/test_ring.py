"""Context parallelism: the attention op (nnx_shard._attention / nnx_shard.models.attention)
in dense, ring and all-gather mode, and the cp presets training the reference
transformer, on 8 simulated devices.

Proof (issue 16): loss, gradients and parameters after K fused steps under ring
attention equal one device for context C = 2, 4, 8, causal; the compiled step
moves K/V by collective-permutes over ``context`` and never all-gathers full-length
keys or values.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard._attention._context_parallel import _zigzag_pairs
from nnx_shard.models import Decoder, attention, get_config, lm_loss
from nnx_shard.planner import compiled_collectives
from tests._close import assert_close
from tests._lm import lm_batches, lm_step
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

K = 3
LR = 1e-3
RTOL = 1e-4  # x max|expected| per tensor: see tests/_close.py
RTOL_PARAMS = 1e-3  # Adam divides by each gradient element's own size (test_strategies)


def _original_core(q, k, v):
    """The reference transformer's attention core before it called the op."""
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    length = q.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", probs, v)


def _qkv(length=32, batch=4):
    return jax.random.normal(jax.random.key(0), (3, batch, length, 2, 8))


def _rules(mode):
    return ns.Rules({"batch": "data", "length": "context", "heads": None,
                     "kv": None}).with_options(attention=mode)


# --------------------------------------------------------------------------- the op


def test_dense_is_the_original_core() -> None:
    q, k, v = _qkv()
    dense = functools.partial(attention, implementation="dense")
    np.testing.assert_array_equal(dense(q, k, v), _original_core(q, k, v))
    with ns.use("data=8", ns.strategies.get("dp").rules):  # no attention option: one device
        np.testing.assert_array_equal(jax.jit(dense)(q, k, v), jax.jit(_original_core)(q, k, v))
    # The default kernel (blockwise on CPU) computes the same attention (compiled: eagerly,
    # each op of its tile loops compiles a program of its own).
    assert_close(jax.jit(attention)(q, k, v), jax.jit(_original_core)(q, k, v), RTOL, "blockwise")


def test_zigzag_order() -> None:
    # Chunk j of 2C lives on device j (j < C) or 2C - 1 - j: device i gets i, 2C-1-i.
    first, second = _zigzag_pairs(4)
    assert first == [(0, 0), (1, 2), (2, 3), (3, 1)]
    assert second == [(0, 1), (1, 3), (2, 2), (3, 0)]


@pytest.mark.parametrize("axis_types", ["auto", pytest.param("explicit", marks=pytest.mark.slow)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode,c", [("ring", 2), ("ring", 4), ("ring", 8), ("allgather", 4)])
def test_op_matches_dense(mode, c, causal, axis_types) -> None:
    q, k, v = _qkv()
    grad = _weighted_loss_grad(causal)
    expected = _one_device(causal)
    mesh = ns.make_mesh({"data": 8 // c, "context": c}, axis_types=axis_types)
    with ns.use(mesh, _rules(mode)):
        sharded = [jax.device_put(a, NamedSharding(mesh, P("data", "context"))) for a in (q, k, v)]
        fn = jax.jit(grad)
        got = jax.block_until_ready(fn(*sharded))
        text = fn.lower(*sharded).compile().as_text()
    assert_close(got, expected, RTOL, f"{mode} C={c}")
    found = {(x.kind, x.axes) for x in compiled_collectives(text, mesh)}
    # (The loss's sum over the sharded output adds all-reduces.)
    if mode == "ring":
        assert ("collective-permute", ("context",)) in found
        assert not {kind for kind, axes in found if axes and "context" in axes} - {
            "collective-permute", "all-reduce"}
    else:
        assert ("all-gather", ("context",)) in found
        assert ("collective-permute", ("context",)) not in found


def _weighted_loss_grad(causal: bool):
    """The loss ``sum(attention(q, k, v) * weights)`` (with the output) and its gradients."""
    shape = _qkv().shape[1:]
    weights = jnp.sin(jnp.arange(math.prod(shape), dtype=jnp.float32)).reshape(shape)

    def f(q, k, v):
        out = attention(q, k, v, causal=causal)
        return jnp.sum(out * weights), out

    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)


@functools.cache
def _one_device(causal: bool):
    """:func:`_weighted_loss_grad` with no mesh, compiled once for every layout compared."""
    return jax.jit(_weighted_loss_grad(causal))(*_qkv())


def test_ring_never_gathers_full_kv_in_memory() -> None:
    # Per-device temp bytes of the ring's forward+backward fall with C; all-gather's
    # hold the full-length K/V and score rows.
    q = jnp.ones((1, 256, 2, 8))
    temp = {}
    for mode, c in [("ring", 2), ("ring", 8), ("allgather", 8)]:
        mesh = ns.make_mesh({"data": 8 // c, "context": c})
        with ns.use(mesh, ns.Rules({"batch": None, "length": "context"}).with_options(
                attention=mode)):
            g = jax.jit(jax.grad(lambda q: attention(q, q, q).sum()))
            temp[mode, c] = g.lower(q).compile().memory_analysis().temp_size_in_bytes
    assert temp["ring", 8] < temp["ring", 2] / 2
    assert temp["ring", 8] < temp["allgather", 8]


CP_CASES = [
    # mode, C, causal, kernel (block), kv heads, masking, axis types
    ("ring", 4, True, "blockwise", 2, "segments+keys", "auto"),
    ("ring", 4, True, "blockwise", 4, "full", "explicit"),
    ("ring", 2, False, "dense", 2, "full", "auto"),
    ("ring", 8, False, "blockwise", 1, "segments+keys", "auto"),
    ("allgather", 4, True, "blockwise", 2, "full", "auto"),
    ("allgather", 2, True, "dense", 2, "segments+keys", "explicit"),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode,c,causal,kernel,kv_heads,masking,axis_types", CP_CASES)
def test_gqa_masks_and_segments_match_plain_attention(mode, c, causal, kernel, kv_heads, masking,
                                                      axis_types) -> None:
    """Grouped K/V heads, segment ids and key padding (which travel with the K/V blocks)
    or a full [batch, 1, q, k] mask (rows held per device), blockwise tiles of 3 (the
    last padded) inside each ring step: values and gradients equal plain attention."""
    from tests.test_blockwise import plain

    keys = jax.random.split(jax.random.key(3), 4)
    b, length = 4, 32
    q = jax.random.normal(keys[0], (b, length, 4, 8))
    k, v = (jax.random.normal(x, (b, length, kv_heads, 8)) for x in keys[1:3])
    w = jax.random.normal(keys[3], q.shape)
    valid = jnp.arange(length)[None, :] < jnp.array([[length], [20], [5], [31]])
    seg = jnp.asarray(np.cumsum(np.random.default_rng(0).random((b, length)) < 0.15, axis=1),
                      jnp.int32)
    if masking == "full":  # padded queries see nothing (row 2 from token 5 on)
        extra = {"mask": valid[:, None, :, None] & valid[:, None, None, :]}
    else:
        extra = {"segment_ids": seg, "mask": valid[:, None, None, :]}

    def run(fn):
        def f(q, k, v):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(w)
        return f

    expected = jax.jit(run(functools.partial(
        plain, causal=causal, mask=extra["mask"], segment_ids=extra.get("segment_ids"))))(q, k, v)
    mesh = ns.make_mesh({"data": 8 // c, "context": c}, axis_types=axis_types)
    op = functools.partial(attention, causal=causal, implementation=kernel, block_size=3,
                           **extra)
    with ns.use(mesh, _rules(mode)):
        sharded = [jax.device_put(a, NamedSharding(mesh, P("data", "context"))) for a in (q, k, v)]
        got = jax.block_until_ready(jax.jit(run(op))(*sharded))
    assert_close(got, expected, RTOL, f"{mode} C={c} {kernel} kv={kv_heads} {masking}")


def test_kv_heads_must_split_like_the_query_heads() -> None:
    q, kv = jnp.ones((2, 8, 4, 8)), jnp.ones((2, 8, 1, 8))
    rules = ns.Rules({"batch": "data", "length": "context", "heads": "model"}).with_options(
        attention="ring")
    with ns.use("data=2,context=2,model=2", rules):
        with pytest.raises(ns.ShardingError, match=r"k/v \(2, 8, 1, 8\) have 1 kv heads, but "
                           r"the query heads are split over mesh axes \('model',\) \(2 ways"
                           r".* Fix: use a number of kv heads divisible by 2"):
            jax.jit(attention)(q, kv, kv)
        with pytest.raises(ns.ShardingError, match=r"q \(2, 8, 4, 8\) and k \(2, 4, 4, 8\) "
                           r"differ in length; context parallelism splits one sequence"):
            jax.jit(attention)(q, q[:, :4], q[:, :4])


# --------------------------------------------------------------------------- bad input


def test_length_not_divisible_by_twice_context() -> None:
    q = jnp.ones((2, 12, 2, 8))
    with ns.use("data=2,context=4", ns.strategies.get("cp").rules):
        with pytest.raises(ns.ShardingError) as e:
            jax.jit(attention)(q, q, q)
    msg = str(e.value)
    assert "attention='ring': sequence length 12" in msg
    assert "2 x 4 = 8 zig-zag chunks" in msg and "'context' of size 4" in msg
    assert msg.endswith("Fix: use a sequence length that divides by 8 (e.g. 8), or a mesh "
                        "whose context size C has 2 x C dividing 12.")
    # All-gather mode needs only C slices: length 12 over 4 is fine.
    rules = ns.strategies.get("cp").rules.with_options(attention="allgather")
    with ns.use("data=2,context=4", rules):
        assert jax.jit(attention)(q, q, q).shape == q.shape


def test_bad_shapes_and_options() -> None:
    q = jnp.ones((2, 8, 2, 4))
    with pytest.raises(ValueError, match=r"q must be \[batch, length, heads, head_dim\] "
                       r"\(rank 4\), got ArrayImpl of shape \(2, 8, 8\)"):
        attention(q.reshape(2, 8, 8), q, q)
    with pytest.raises(ValueError, match=r"got q \(2, 8, 2, 4\), k \(2, 8, 2, 4\), v "
                       r"\(2, 4, 2, 4\); need .* Fix: project k and v with the same number"):
        attention(q, q, q[:, :4])
    with pytest.raises(ValueError, match=r"heads a multiple of kv_heads"):
        attention(q[:, :, :1].repeat(3, 2), q, q)   # 3 query heads, 2 kv heads
    with ns.use("data=8", ns.Rules({"batch": "data"}).with_options(attention="flash")):
        with pytest.raises(ns.ShardingError, match=r"attention='flash' is not one of \('local', "
                           r"'ring', 'allgather'\)\. Fix: rules.with_options"):
            attention(q, q, q)
    with ns.use("data=8", ns.Rules({"batch": "data"}).with_options(attention="ring")):
        with pytest.raises(ns.ShardingError, match=r"rules have no 'length' entry .* Fix: add "
                           r"one, e.g. rules \| \{'length': 'context'\}"):
            attention(q, q, q)


class _NoAttention(nnx.Module):
    """A sequence model whose token mixing is not the attention op."""

    def __init__(self) -> None:
        self.w = nnx.Param(jnp.ones((4, 4)))

    def __call__(self, x):
        return jnp.cumsum(x @ self.w[...], axis=1)


def test_model_without_the_op_is_an_error() -> None:
    model = _NoAttention()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def my_step(model, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)
        return loss

    x = jnp.ones((1, 8, 16, 4))
    with ns.use("data=2,context=4", ns.strategies.get("cp").rules):
        with pytest.raises(ns.ShardingError) as e:
            ns.multistep(my_step)(model, opt, x)
    msg = str(e.value)
    assert msg.startswith("my_step ran under rules with attention='ring' (logical axis "
                          "'length' is split over mesh axes ('context',)), but the model never "
                          "called nnx_shard.models.attention")
    assert "Fix: compute the attention core of the model with nnx_shard.models.attention(q, " \
           "k, v, causal=True)" in msg
    # Without the option the same step trains.
    with ns.use("data=8", ns.strategies.get("dp").rules):
        assert ns.multistep(my_step)(model, opt, x).shape == (1,)


# --------------------------------------------------------------------------- the proof


def _batches(length: int) -> dict[str, np.ndarray]:
    return lm_batches(K, 8, length)


_step = lm_step


def _train(mesh, rules, cfg):
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, rules)
    opt = ns.sharded_optimizer(model, optax.adam(LR), mesh, rules)
    with ns.use(mesh, rules):
        batch = ns.shard_batch(_batches(cfg.length), mesh, rules, ("batch", "length"),
                               steps=True)
        fused = ns.multistep(_step)
        text = fused.lower(model, opt, batch).compile().as_text()
        metrics = jax.device_get(fused(model, opt, batch))
    return model, metrics, text


@functools.cache
def _reference(cfg):
    mesh = ns.make_mesh("data=1", devices=jax.devices()[:1])
    model, metrics, _ = _train(mesh, ns.strategies.get("dp").rules, cfg)
    return jax.device_get(nnx.state(model, nnx.Param)), metrics


# Slow: fsdp_cp trains against one device in tests/test_strategies.py's quick tier.
@pytest.mark.slow
@pytest.mark.parametrize("c", [2, 4, 8])
def test_ring_training_equals_one_device(c) -> None:
    cfg = get_config("tiny")  # length 16: 2 x 8 chunks of one token at C = 8
    s = ns.strategies.get("cp")
    mesh = ns.make_mesh({"data": 8 // c, "context": c})
    model, metrics, text = _train(mesh, s.rules, cfg)
    ref_params, ref = _reference(cfg)
    assert_close(metrics["loss"], ref["loss"], RTOL, f"loss C={c}")
    assert_close(metrics["grads"], ref["grads"], RTOL, f"grads C={c}")
    assert_close(nnx.state(model, nnx.Param), ref_params, RTOL_PARAMS, f"params C={c}")

    found = compiled_collectives(text, mesh)
    permutes = [x for x in found if (x.kind, x.axes) == ("collective-permute", ("context",))]
    assert permutes and all("shard_map" in x.op_name for x in permutes)
    # Full-length K (or V) of one device: [batch / data, length, heads, head_dim] f32.
    full_kv = 8 // (8 // c) * cfg.length * cfg.heads * cfg.head_dim * 4
    gathers = [x for x in found if x.kind == "all-gather" and x.axes and "context" in x.axes]
    assert all(x.bytes < full_kv for x in gathers), [(x.bytes, x.op_name) for x in gathers]


# Slow: fsdp_cp trains against one device in test_strategies' quick tier (cp in its slow tier).
@pytest.mark.slow
def test_allgather_and_fsdp_cp_training_equal_one_device() -> None:
    cfg = get_config("tiny")
    ref_params, ref = _reference(cfg)
    s = ns.strategies.get("cp")
    rules = s.rules.with_options(attention="allgather")
    mesh = ns.make_mesh({"data": 2, "context": 4})
    model, metrics, text = _train(mesh, rules, cfg)
    assert_close(metrics["loss"], ref["loss"], RTOL, "loss allgather")
    assert_close(nnx.state(model, nnx.Param), ref_params, RTOL_PARAMS, "params allgather")
    full_kv = 4 * cfg.length * cfg.heads * cfg.head_dim * 4
    assert any(x.kind == "all-gather" and x.axes == ("context",) and x.bytes >= full_kv
               for x in compiled_collectives(text, mesh))

    f = ns.strategies.get("fsdp_cp")
    mesh = f.make_mesh(8, axis_types="explicit")
    model, metrics, _ = _train(mesh, f.rules, cfg)
    assert_close(metrics["loss"], ref["loss"], RTOL, "loss fsdp_cp")
    assert_close(nnx.state(model, nnx.Param), ref_params, RTOL_PARAMS, "params fsdp_cp")
    assert model.blocks[0].mlp.up.get_value().sharding.spec == P("data", None)


@pytest.mark.slow
def test_trainer_with_cp_and_logits_in_order() -> None:
    # The Trainer carries the rules' options; logits come back in token order.
    cfg = dataclasses.replace(get_config("tiny"), layers=1)
    s = ns.strategies.get("cp")
    mesh = s.make_mesh(8)
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, s)
    ref = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = _batches(cfg.length)["inputs"][0]
    with ns.use(mesh, s.rules):
        logits = nnx.jit(lambda m, t: m(t))(model, tokens)
    assert logits.sharding.spec[1] == "context"
    assert_close(logits, ref(tokens), RTOL, "logits")

    opt = ns.sharded_optimizer(model, optax.adam(LR), mesh, s)
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=s.rules, steps_per_call=K,
                         batch_names=("batch", "length"))
    host = _batches(cfg.length)
    history = trainer.fit([{k: v[i] for k, v in host.items()} for i in range(K)], K,
                          progress=False)
    ref_opt = nnx.Optimizer(ref, optax.adam(LR), wrt=nnx.Param)
    fused = ns.multistep(_step)
    expected = jax.device_get(fused(ref, ref_opt, {k: jnp.asarray(v) for k, v in host.items()}))
    assert_close(history["loss"], expected["loss"], RTOL, "Trainer loss")
