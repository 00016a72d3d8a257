"""The per-device attention kernels (nnx_shard._attention._kernels, their block math in
nnx_shard._attention._blocks) through the op (nnx_shard.models.attention) on one device: blockwise and dense against attention
computed the plain way (repeated K/V heads, one masked softmax), values and
gradients, for causal and not, grouped-query heads, segment ids, key padding and
full masks, lengths that are not a multiple of the block, cross-attention; the
causal blockwise loops skip fully masked tiles; bad input raises with a Fix.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_shard._attention import _blocks as blocks
from nnx_shard._attention import _kernels as kernels
from nnx_shard._attention._blocks import Masks, stats
from nnx_shard.models import attention
from tests._close import assert_close

RTOL = 1e-5  # x max|expected| per tensor: see tests/_close.py


@pytest.fixture(autouse=True)
def _float32_matmuls():
    # GPUs multiply float32 in TF32 by default: kernel and reference would differ by
    # its rounding (1e-4), not by the kernel.
    with jax.default_matmul_precision("highest"):
        yield


def plain(q, k, v, *, causal=True, mask=None, segment_ids=None):
    """Attention the plain way: K/V repeated to the query heads, one [b, h, q, k]
    softmax; rows with nothing to see give 0."""
    b, lq, h, d = q.shape
    lk, g = k.shape[1], h // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    seen = jnp.ones((b, h, lq, lk), bool)
    if causal:
        seen &= jnp.tril(jnp.ones((lq, lk), bool))
    if mask is not None:
        seen &= mask
    if segment_ids is not None:
        seen &= (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    p = jax.nn.softmax(jnp.where(seen, s, -jnp.inf), axis=-1)
    p = jnp.where(seen.any(-1, keepdims=True), p, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@functools.cache
def _inputs(length=37, heads=4, kv_heads=2, batch=3, d=8, kv_length=None):
    def draw():  # one program (eagerly, each draw and shape compiles its own)
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (batch, length, heads, d))
        k = jax.random.normal(keys[1], (batch, kv_length or length, kv_heads, d))
        v = jax.random.normal(keys[2], (batch, kv_length or length, kv_heads, d))
        w = jax.random.normal(keys[3], q.shape)  # loss weights: every output matters
        return q, k, v, w

    return jax.jit(draw)()


def _segments(length: int) -> jax.Array:
    # Packed sequences of different lengths per row; row 1 is one sequence.
    cuts = [(10, 25), (length,), (3, 4, 30)]
    ids = np.zeros((3, length), np.int32)
    for r, row in enumerate(cuts):
        for c in row:
            ids[r, c:] += 1
    return jnp.asarray(ids)


def _valid(length: int) -> jax.Array:
    return jnp.arange(length)[None, :] < jnp.array([[length - 5], [length], [9]])


def _masking(name: str, length: int) -> dict:
    valid = _valid(length)
    if name == "none":
        return {}
    if name == "segments":
        return {"segment_ids": _segments(length)}
    if name == "key_padding":
        return {"mask": valid[:, None, None, :]}
    # Queries and keys padded: rows past the valid length see nothing.
    return {"mask": valid[:, None, :, None] & valid[:, None, None, :]}


def _value_and_grads(fn, q, k, v, w):
    """The output and the gradients of ``sum(output * w)`` w.r.t. q, k, v (compared as
    tensors: the scalar sum cancels, its own rounding is no measure)."""
    def run(q, k, v):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(w.astype(out.dtype))

    return jax.jit(run)(q, k, v)


@pytest.mark.parametrize("masking", ["none", "segments", "key_padding", "padding"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", ["blockwise", "dense"])
def test_kernels_equal_plain_attention(kernel, causal, masking) -> None:
    # 37 tokens in blocks of 8: five query and five key blocks, the last one padded;
    # 4 query heads over 2 key/value heads.
    q, k, v, w = _inputs()
    extra = _masking(masking, q.shape[1])
    got = _value_and_grads(
        lambda q, k, v: attention(q, k, v, causal=causal, implementation=kernel, block_size=8,
                                  **extra), q, k, v, w)
    expected = _value_and_grads(
        lambda q, k, v: plain(q, k, v, causal=causal, mask=extra.get("mask"),
                              segment_ids=extra.get("segment_ids")), q, k, v, w)
    assert_close(got, expected, RTOL, f"{kernel} causal={causal} {masking}")


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 1)])
def test_blockwise_mha_and_multi_query(heads, kv_heads) -> None:
    q, k, v, w = _inputs(length=20, heads=heads, kv_heads=kv_heads)
    for block in (4, 512):  # many tiles; one tile
        got = _value_and_grads(
            functools.partial(attention, implementation="blockwise", block_size=block),
            q, k, v, w)
        assert_close(got, _value_and_grads(plain, q, k, v, w), RTOL, f"block {block}")


@pytest.mark.slow
def test_cross_attention_lengths() -> None:
    # Fewer queries than keys (and a decoding step: one query, no causal mask), blocks
    # of 4. Causal with fewer queries: query i sees keys 0..i, as in flax and jax.
    for lq, causal in ((5, False), (5, True), (1, False)):
        q, k, v, w = _inputs(length=lq, kv_length=13)
        mask = _valid(13)[:, None, None, :]
        got = _value_and_grads(functools.partial(
            attention, causal=causal, mask=mask, implementation="blockwise", block_size=4),
            q, k, v, w)
        want = _value_and_grads(functools.partial(plain, causal=causal, mask=mask), q, k, v, w)
        assert_close(got, want, RTOL, f"lq={lq} causal={causal}")


def test_rows_that_see_nothing_are_zero() -> None:
    q, k, v, w = _inputs(length=12)
    extra = _masking("padding", 12)  # row 2: queries 9.. see no key
    for kernel in ("blockwise", "dense"):
        fn = functools.partial(attention, implementation=kernel, block_size=4, **extra)
        out = jax.jit(fn)(q, k, v)
        np.testing.assert_array_equal(np.asarray(out[2, 9:]), 0.0)
        dq = _value_and_grads(fn, q, k, v, w)[1][0]
        np.testing.assert_array_equal(np.asarray(dq[2, 9:]), 0.0)
        assert np.isfinite(np.asarray(dq)).all()


def test_bfloat16_inputs() -> None:
    q, k, v, _ = _inputs(length=24)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = jax.jit(lambda q, k, v: attention(q, k, v, implementation="blockwise",
                                            block_size=8))(*bf)
    assert out.dtype == jnp.bfloat16
    want = jax.jit(plain)(*bf)  # compiled, as the kernel (eagerly, one program per op)
    assert_close(out.astype(jnp.float32), want.astype(jnp.float32), 2e-2, "bfloat16")


# --------------------------------------------------------------------------- no work


def _count_tiles(monkeypatch) -> dict[str, int]:
    """Counts the tiles the blockwise loops compute, forward and backward, at run time
    (a host callback in each tile: a loop that skips a tile never calls it)."""
    seen = {"fwd": 0, "bwd": 0}
    fwd, bwd = blocks._block_fwd, blocks._block_bwd

    def counted(name, fn):
        def tile(*args):
            jax.debug.callback(lambda: seen.__setitem__(name, seen[name] + 1))
            return fn(*args)
        return tile

    monkeypatch.setattr(blocks, "_block_fwd", counted("fwd", fwd))
    monkeypatch.setattr(blocks, "_block_bwd", counted("bwd", bwd))
    return seen


@pytest.mark.parametrize("causal,tiles", [(False, 16), (True, 10)])
def test_causal_blockwise_skips_fully_masked_tiles(monkeypatch, causal, tiles) -> None:
    # 4 x 4 blocks of 8 rows: causal computes the 10 tiles on and below the diagonal.
    seen = _count_tiles(monkeypatch)
    q, k, v, w = _inputs(length=32)
    fn = functools.partial(attention, causal=causal, implementation="blockwise", block_size=8)
    got = jax.block_until_ready(_value_and_grads(fn, q, k, v, w))
    jax.effects_barrier()
    assert seen == {"fwd": tiles, "bwd": tiles}
    assert_close(got, _value_and_grads(lambda q, k, v: plain(q, k, v, causal=causal), q, k, v, w),
                 RTOL, "counted")


def test_causal_skipping_with_a_query_offset(monkeypatch) -> None:
    # Queries at positions 8..15 of 16 keys (all-gather mode's view), blocks of 4:
    # the first query block sees 3 key blocks, the second all 4.
    seen = _count_tiles(monkeypatch)
    q, k, v, _ = _inputs(length=8, kv_length=16, heads=2, kv_heads=2)
    qg = q[:, :, :, None]
    o, rowsum, _ = jax.jit(lambda q, k, v: stats(q, k, v, Masks(), causal=True, q_offset=8,
                                                 block=4))(qg, k, v)
    jax.effects_barrier()
    assert seen["fwd"] == 7
    out = np.asarray(o) / np.moveaxis(np.asarray(rowsum), 3, 1)[..., None]
    # Compiled, as the kernel (eagerly, each op compiles a program of its own).
    ref = jax.jit(lambda q, k, v: plain(jnp.concatenate([jnp.zeros_like(q), q], 1), k, v))(
        q, k, v)[:, 8:]
    assert_close(out[:, :, :, 0], ref, RTOL, "offset")


# --------------------------------------------------------------------------- kernels chosen


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="what 'auto' picks on CPU")
def test_auto_is_blockwise_on_cpu() -> None:
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    assert kernels.resolve("auto", q, q, Masks(), context_parallel=False) == "blockwise"
    assert kernels.resolve("dense", q, q, Masks(), context_parallel=True) == "dense"
    # Context parallelism needs per-block statistics that cuDNN's kernel does not return.
    assert kernels.resolve("cudnn", q, q, Masks(), context_parallel=True) == "blockwise"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs a GPU")
def test_cudnn_kernel_on_gpu() -> None:
    q, k, v, w = (x.astype(jnp.bfloat16) for x in _inputs(length=64, d=64))
    assert kernels.resolve("auto", q, k, Masks(), context_parallel=False) == "cudnn"
    for kernel in ("auto", "cudnn", "blockwise"):
        got = _value_and_grads(functools.partial(attention, implementation=kernel), q, k, v, w)
        want = _value_and_grads(plain, *(x.astype(jnp.float32) for x in (q, k, v)),
                                w.astype(jnp.float32))
        assert_close(jax.tree.map(lambda x: x.astype(jnp.float32), got), want, 3e-2, kernel)
    text = jax.jit(lambda q: attention(q, k, v)).lower(q).compile().as_text()
    assert "cudnn" in text.lower()


# --------------------------------------------------------------------------- bad input


def test_bad_masks_and_kernels() -> None:
    q, k, v, _ = _inputs(length=8)
    with pytest.raises(ValueError, match=r"mask of shape \(3, 3, 8, 8\) does not broadcast to "
                       r"\[batch, heads, q_len, kv_len\] = \(3, 4, 8, 8\) .* Fix: e\.g\. "
                       r"flax\.nnx\.make_attention_mask"):
        attention(q, k, v, mask=jnp.ones((3, 3, 8, 8), bool))
    with pytest.raises(ValueError, match=r"q segment ids must be integers of shape \(batch, "
                       r"q_len\) = \(3, 8\), got int32 of shape \(3, 7\) .* Fix: one id per "
                       r"token"):
        attention(q, k, v, segment_ids=jnp.zeros((3, 7), jnp.int32))
    with pytest.raises(ValueError, match=r"segment ids must be integers .* got float32"):
        attention(q, k, v, segment_ids=jnp.zeros((3, 8)))
    with pytest.raises(ValueError, match=r"implementation='flash' is not one of \('auto', "
                       r"'blockwise', 'dense', 'cudnn'\)\. Fix: pass one of them"):
        attention(q, k, v, implementation="flash")
