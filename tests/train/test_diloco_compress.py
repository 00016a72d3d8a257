"""``ns.DiLoCo(..., compress=)``: compressed syncs, on 8 simulated devices (``hsdp``,
``replica=2, data=4``) with the 1-layer tiny Decoder of tests/train/test_diloco.py:

* the randomized Hadamard rotation is orthogonal (un-rotate(rotate(x)) == x, norms kept);
* each option's sync sends over ``replica`` only its compressed payload: int8 / packed
  int4 codes plus float32 per-block scales (all-gathers), or P of the float32 delta (an
  all-reduce), with the exact bytes (the uncompressed sync's all-reduce is 16,992 B);
* rank-2 factors (PowerSGD) of each device's slice of every matrix go by two all-reduces;
* (slow) error feedback keeps its books (int8, mask, rank): one sync with outer SGD at
  learning rate 1 moves the anchor to the uncompressed anchor plus the replicas' mean
  residual; the residual is small (int8), a 1-P share (mask), smaller than the delta
  (rank); training goes on lowering the loss; the int8 residual round trips through
  ns.save / ns.restore;
* bfloat16 parameters keep their dtype through a compressed sync;
* the option's errors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard._train._compress import BLOCK, rotate, unrotate
from nnx_shard.models import Decoder, get_config, lm_loss
from nnx_shard.planner import compiled_collectives
from tests._close import assert_close
from tests._lm import lm_batches
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

CFG = dataclasses.replace(get_config("tiny"), layers=1)
HSDP = ns.strategies.get("hsdp")
FULL = 16992  # the uncompressed sync's all-reduce over replica (tests/train/test_diloco.py)


def _model(mesh: Any) -> Decoder:
    return ns.sharded_init(lambda: Decoder(CFG, rngs=nnx.Rngs(0)), mesh, HSDP)


def _params(tree: Any) -> Any:
    return jax.device_get(nnx.to_pure_dict(nnx.state(tree, nnx.Param)))


def test_rotation_is_orthogonal() -> None:
    x = jnp.asarray(np.random.default_rng(0).normal(size=3 * BLOCK + 17), jnp.float32)
    y = jax.jit(rotate)(x)
    assert y.shape == (4, BLOCK)
    assert_close(jnp.linalg.norm(y), jnp.linalg.norm(x), 1e-6, "norm")
    assert_close(unrotate(y, x.shape[0]), x, 1e-6, "un-rotate(rotate(x))")


@pytest.fixture(scope="module")
def laid_out() -> tuple[Any, Decoder]:
    """One mesh and model for the byte counts: the syncs are only lowered, never run."""
    mesh = HSDP.make_mesh()
    return mesh, _model(mesh)


def _sync_collectives(laid_out: tuple[Any, Decoder], compress: str) -> list[Any]:
    mesh, model = laid_out
    diloco = ns.DiLoCo(model, optax.sgd(0.1), inner_steps=4, compress=compress)
    with ns.use(mesh, HSDP.rules):
        hlo = nnx.jit(ns.DiLoCo.sync).lower(diloco).compile().as_text()
    found = compiled_collectives(hlo, mesh)
    assert {c.axes for c in found} == {("replica",)}, compress
    return sorted((c.kind, c.shapes, c.bytes) for c in found)


def test_quantized_sync_sends_codes_not_floats(laid_out: tuple[Any, Decoder]) -> None:
    total = sum(x.nbytes for x in jax.tree.leaves(_params(laid_out[1])))
    local = total // 4 // 4  # float32 elements of each device's 1/data slice: 4248
    blocks = -(-local // BLOCK)  # 17 blocks of 256, padded
    assert local * 4 == FULL and blocks == 17
    # Measured: each device all-gathers both replicas' codes ([2, blocks, 256] int8, or
    # two 4-bit codes a byte) and f32 scales; its own half is local, so it sends half
    # the result: 4,420 B (int8), 2,244 B (int4) against the all-reduce's 16,992.
    assert _sync_collectives(laid_out, "int8") == [
        ("all-gather", ((2, blocks),), 136), ("all-gather", ((2, blocks, BLOCK),), 8704)]
    assert _sync_collectives(laid_out, "int4") == [
        ("all-gather", ((2, blocks),), 136), ("all-gather", ((2, blocks, BLOCK // 2),), 4352)]


def test_masked_and_low_rank_sync_bytes(laid_out: tuple[Any, Decoder]) -> None:
    # A quarter of each device's 4,248 elements, float32, by one all-reduce: a quarter
    # of the bytes.
    assert _sync_collectives(laid_out, "mask:0.25") == [("all-reduce", ((1062,),), FULL // 4)]
    # Rank-2 factors of each device's slice of every matrix, vectors whole: P's and the
    # vectors in one all-reduce, Q's in another, 30% of the bytes (the slices are small:
    # e.g. [8, 32] for an attention kernel, where rank 2 keeps 80 of 256 floats).
    assert _sync_collectives(laid_out, "rank:2") == [
        ("all-reduce", ((528,),), 2112), ("all-reduce", ((752,),), 3008)]


@pytest.mark.slow
@pytest.mark.parametrize("compress", ["int8", "mask:0.25", "rank:2"])
def test_error_feedback_books_and_training(compress: str, tmp_path: Any) -> None:
    mesh = HSDP.make_mesh()
    fused = ns.multistep(lambda d, b: {"loss": d.step(lm_loss, b)})
    plain = ns.DiLoCo(_model(mesh), optax.sgd(0.1), inner_steps=2, outer=optax.sgd(1.0))
    diloco = ns.DiLoCo(_model(mesh), optax.sgd(0.1), inner_steps=2, outer=optax.sgd(1.0),
                       compress=compress)
    with ns.use(mesh, HSDP.rules):
        batches = ns.shard_batch(lm_batches(2, 8, CFG.length, CFG.vocab), mesh, HSDP.rules,
                                 ("batch", "length"), steps=True)
        fused(plain, batches)
        fused(diloco, batches)
    # The replicas trained alike before the sync; with outer SGD at 1 the uncompressed
    # anchor is mean_r(params_r), the compressed one mean_r(params_r + residual_r).
    residual = jax.device_get(nnx.to_pure_dict(nnx.state(diloco.residual)))
    want = jax.tree.map(lambda a, e: a + e.mean(axis=0), _params(plain.model), residual)
    assert_close(_params(diloco.model), want, 1e-5, "anchor = plain anchor + mean residual")
    init = _params(_model(mesh))
    moved = jax.tree.map(lambda a, b: a != b, _params(plain.model), init)
    flat = np.concatenate([e.reshape(-1) for e in jax.tree.leaves(residual)])
    if compress == "int8":  # rounding error only: small against how far the anchor moved
        step = max(float(np.max(np.abs(a - b))) for a, b in zip(
            jax.tree.leaves(_params(plain.model)), jax.tree.leaves(init), strict=True))
        assert 0 < np.max(np.abs(flat)) < 0.05 * step
    elif compress == "rank:2":  # P Q^T projects the mean delta: the rest is smaller
        mean = [e.mean(axis=0) for e in jax.tree.leaves(residual)]
        step = [a - b for a, b in zip(jax.tree.leaves(_params(plain.model)),
                                      jax.tree.leaves(init), strict=True)]
        assert 0 < sum(np.sum(m**2) for m in mean) < 0.9 * sum(np.sum(d**2) for d in step)
    else:  # where the anchor moved, the quarter of elements sent leave no residual (and
        # so do the few whose replica did not move them: token rows it never saw)
        zero = np.concatenate([(e == 0)[:, m].reshape(-1) for e, m in zip(
            jax.tree.leaves(residual), jax.tree.leaves(moved), strict=True)])
        assert 0.25 <= zero.mean() < 0.35
    # And it trains on, the residual carried from sync to sync (the same program).
    losses = []
    with ns.use(mesh, HSDP.rules):
        for _ in range(4):
            losses.extend(jax.device_get(fused(diloco, batches))["loss"].mean(axis=1))
    assert fused.traces == 2  # plain's program, then the compressed one's
    assert np.mean(losses[-2:]) < np.mean(losses[:2])
    if compress == "int8":  # the residual is checkpointed with the rest of the state
        ns.save(tmp_path, 10, model=diloco)
        back = ns.restore(tmp_path, model=ns.DiLoCo(
            _model(mesh), optax.sgd(0.1), inner_steps=2, outer=optax.sgd(1.0), compress="int8"))
        assert_close(jax.device_get(nnx.state(back.residual)),
                     jax.device_get(nnx.state(diloco.residual)), 0, "restored residual")


def test_compress_errors() -> None:
    mesh = HSDP.make_mesh()
    model = ns.sharded_init(lambda: nnx.Linear(4, 2, rngs=nnx.Rngs(0)), mesh, HSDP)
    for bad, shown in (("int2", "'int2'"), ("mask:0", "'mask:0'"), ("mask:x", "'mask:x'"),
                       ("rank:0", "'rank:0'"), (8, "8")):
        with pytest.raises(ns.UsageError, match=rf"DiLoCo: compress must be None, 'int8', "
                           rf"'int4', 'mask:P' with 0 < P <= 1 or 'rank:R' with R >= 1, "
                           rf"got {shown}\. Fix: e\.g\. "
                           r"compress='int8'"):
            ns.DiLoCo(model, optax.sgd(0.1), inner_steps=2, compress=bad)


def test_bfloat16_parameters_keep_their_dtype() -> None:
    # The sync is a lax.cond branch inside the step: its outputs (anchor, replicas,
    # residual) must keep the state's dtypes, bfloat16 here, though it computes in float32.
    mesh = HSDP.make_mesh()
    model = ns.sharded_init(
        lambda: nnx.Linear(8, 4, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16), mesh, HSDP)
    diloco = ns.DiLoCo(model, optax.sgd(0.1), inner_steps=2, compress="int8")
    mse = ns.multistep(lambda d, b: {"loss": d.step(
        lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2), b)})
    with ns.use(mesh, HSDP.rules):
        batch = ns.shard_batch({"x": np.ones((4, 8, 8), np.float32),
                                "y": np.zeros((4, 8, 4), np.float32)}, mesh, HSDP.rules,
                               steps=True)
        losses = jax.device_get(mse(diloco, batch))["loss"][:, 0]
    assert {x.dtype for x in jax.tree.leaves(nnx.state(diloco))} == {
        jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int32)}
    assert losses[-1] < losses[0]
