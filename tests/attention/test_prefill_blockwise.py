"""The blockwise kernel as a prefill runs it: queries placed after a cache index
(``q_offset``), a key/value cache longer than the prompt, key padding and a sliding
window (``Masks.window``), against the dense masked softmax of the same problem
with the window spelt out as a ``[q_len, kv_len]`` mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_shard._attention._blocks import Masks, finish, stats, tile_mask
from nnx_shard._attention._kernels import attention_local, dense
from nnx_shard.models._kv_cache import attend


def _qkv(lq: int, lk: int, heads: int = 4, kv_heads: int = 2, d: int = 8, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (2, lq, heads, d))
    k = jax.random.normal(ks[1], (2, lk, kv_heads, d))
    v = jax.random.normal(ks[2], (2, lk, kv_heads, d))
    return q, k, v


def _band(lq: int, lk: int, offset: int, window: int) -> jax.Array:
    """The window as a full mask in the grouped layout ``[1, 1, 1, lq, lk]``."""
    qpos = offset + np.arange(lq)[:, None]
    kpos = np.arange(lk)[None, :]
    return jnp.asarray(kpos > qpos - window)[None, None, None]


def test_tile_mask_applies_the_window_on_cache_positions() -> None:
    m = tile_mask(Masks(window=jnp.int32(2)), True, 3, 0, 2, 0, 6, None)
    assert m is not None
    # Queries at positions 3 and 4: themselves and the one key before.
    assert np.asarray(m).astype(int).tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0]]


@pytest.mark.parametrize("window", [None, 3, 40])
@pytest.mark.parametrize("offset", [0, 13])
def test_blockwise_with_offset_window_and_padding_equals_dense(window: int | None,
                                                               offset: int) -> None:
    # 45 queries against a cache of 72 positions, blocks of 16: several query and key
    # blocks, a partial last block, key blocks wholly before a small window skipped.
    q, k, v = _qkv(45, 72)
    valid = jnp.asarray(np.arange(72)[None, :] >= np.array([[0], [5]]))   # row 1 left-padded
    win = None if window is None else jnp.int32(window)
    fast = attention_local(q, k, v, Masks(kv_valid=valid, window=win), causal=True,
                           kernel="blockwise", block=16, q_offset=offset)
    band = None if window is None else _band(45, 72, offset, window)
    slow = dense(q, k, v, Masks(kv_valid=valid, mask=band), True, offset)
    # Row 1's first queries (positions < 5 with offset 0) see no key: zeros in both.
    np.testing.assert_allclose(np.asarray(fast), np.asarray(slow), atol=2e-6)


def test_traced_window_skips_nothing_it_must_see() -> None:
    # A window traced inside jit (a scanned layer's own), huge where the layer is global.
    q, k, v = _qkv(40, 40, seed=1)

    @jax.jit
    def run(w: jax.Array) -> jax.Array:
        out, _ = finish(stats(q.reshape(2, 40, 2, 2, 8), k, v, Masks(window=w), causal=True,
                              block=8), jnp.float32)
        return out.reshape(q.shape)

    for w in (5, jnp.iinfo(jnp.int32).max // 2):
        band = _band(40, 40, 0, int(w))
        ref = dense(q, k, v, Masks(mask=band), True)
        np.testing.assert_allclose(np.asarray(run(jnp.int32(w))), np.asarray(ref), atol=2e-6)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_attend_prefill_equals_the_one_step_path(softcap: float | None) -> None:
    # kv_cache.attend: the blockwise prefill against the dense one-step attention it
    # replaces, at a cache index past 0, with padding, a window and soft-capping.
    q, k, v = _qkv(30, 50, seed=2)
    k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)   # the cache's [batch, kv_heads, length, dim]
    valid = jnp.asarray(np.arange(50)[None, :] >= np.array([[0], [9]]))
    index = jnp.int32(7)
    fast = attend(q, k, v, index, valid, window=11, softcap=softcap, kernel="blockwise",
                  block=8)
    slow = attend(q, k, v, index, valid, window=11, softcap=softcap, kernel="dense")
    # Rows of row 1 before position 9 see only padding: the one-step softmax averages
    # every value there, the kernels give zeros; no real token reads those rows.
    real = np.asarray(index + np.arange(30))[None, :] >= np.array([[0], [9]])
    np.testing.assert_allclose(np.asarray(fast)[real], np.asarray(slow)[real], atol=2e-6)
    assert not np.asarray(fast)[~real].any()


def test_attend_rejects_an_unknown_kernel() -> None:
    q, k, v = _qkv(4, 8)
    with pytest.raises(ValueError, match="kernel='flash'.*Fix"):
        attend(q, k, v, jnp.int32(0), kernel="flash")
