"""generate's prefill attends with the model's memory-efficient kernel.

Outside references: XLA's ``memory_analysis`` of the compiled prefill program
(nothing allocated; the model abstract), the dense one-step attention
(``DecoderConfig(attention="dense")``), whose logits the blockwise prefill must give,
and the bytes of float32 ``[prompt, vocab]`` logits, which the prefill no longer
computes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_shard._errors import UsageError
from nnx_shard.inference import _generation as gen
from nnx_shard.models import Decoder, get_config

SMALL = dict(layers=1, embed=64, heads=8, kv_heads=2, head_dim=16, mlp=128, vocab=256,
             max_length=8192)


def _temp_bytes(prompt_len: int, kernel: str, **overrides: int) -> int:
    """XLA's temporary bytes of generate's prefill for one prompt of ``prompt_len``."""
    cfg = dataclasses.replace(get_config("llama-tiny"), **(SMALL | overrides),  # type: ignore[arg-type]
                              attention=kernel)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    run = gen._prepare(model, np.zeros((1, prompt_len), np.int32), 8, gen.Options(), 0, None,
                       None, "test")
    args = (run.old, run.rest, run.prompt, run.mask, run.real, run.key, run.options)
    return int(run.programs.prefill.lower(*args).compile().memory_analysis().temp_size_in_bytes)


# A prompt 4x longer may take at most 1.3 x 4 = 5.2x the temporary bytes: linear growth
# with room for XLA's buffer assignment (the fixed part, a few score tiles and the
# weights' temporaries, keeps the blockwise ratio near 1.25). The dense one-step
# attention keeps float32 scores [heads, prompt, prompt + new]: about 16x the bytes for
# 4x the prompt, 3x past the bound (the slow test below checks it, so the bound bites).
BOUND = 1.3 * 4


def test_prefill_memory_grows_linearly_with_the_prompt() -> None:
    ratio = _temp_bytes(4096, "auto") / _temp_bytes(1024, "auto")
    assert ratio <= BOUND, ratio


def test_the_prefill_computes_the_last_positions_logits_only() -> None:
    # Llama 3's vocabulary: float32 logits [4096, 128256] alone would take 2.1 GB; the
    # prefill unembeds the last position only, so its temporaries stay under a quarter
    # of that (every position's logits made them 2.1 GB and more).
    vocab, prompt = 128256, 4096
    temp = _temp_bytes(prompt, "auto", vocab=vocab)
    assert temp < prompt * vocab * 4 / 4, temp


def test_decode_logits_to_keep() -> None:
    cfg = get_config("llama-tiny").with_family("gemma2", final_softcap=5.0)
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.arange(1, 7, dtype=jnp.int32)[None]

    @jax.jit
    def run(state: nnx.State) -> list[jax.Array]:
        out = []
        for keep in (0, 1, 2, 50):
            model = nnx.merge(graphdef, state)
            model.init_cache(1, 8)
            out.append(model.decode(tokens, logits_to_keep=keep))
        return out

    every, last, two, more = (np.asarray(a) for a in run(state))
    assert every.shape == (1, 6, cfg.vocab) and last.shape == (1, 1, cfg.vocab)
    np.testing.assert_allclose(last, every[:, -1:], atol=1e-5)   # soft-capped alike
    np.testing.assert_allclose(two, every[:, -2:], atol=1e-5)
    np.testing.assert_allclose(more, every, atol=1e-5)   # more than T: all of them
    model = nnx.merge(graphdef, state)
    model.init_cache(1, 8)
    for bad in (-1, True, 1.0):
        with pytest.raises(UsageError, match="logits_to_keep"):
            model.decode(tokens, logits_to_keep=bad)  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_dense_prefill_fails_the_linear_bound() -> None:
    ratio = _temp_bytes(4096, "dense") / _temp_bytes(1024, "dense")
    assert ratio > 2 * BOUND, ratio


def _logits(kernel: str, variant: str, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Logits of ``tokens`` run through the cache in two calls (a prefill, then a
    second one after it), with the padding ``mask``."""
    base = dataclasses.replace(get_config("llama-tiny"), max_length=2048, attention=kernel)
    if variant == "windowed":  # Gemma 2's: windowed and global layers, soft-capped scores
        base = base.with_family("gemma2", layers=2, sliding_window=300,
                                window_layers=(True, False), attn_softcap=20.0,
                                scan_layers=True)
    graphdef, state = nnx.split(Decoder(base, rngs=nnx.Rngs(0)))
    cut = 700

    @jax.jit
    def run(state: nnx.State, tokens: jax.Array, mask: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, state)
        model.init_cache(tokens.shape[0], tokens.shape[1] + 4)
        first = model.decode(tokens[:, :cut], attention_mask=mask[:, :cut])
        second = model.decode(tokens[:, cut:], attention_mask=mask[:, cut:])
        return jnp.concatenate([first, second], axis=1)

    return np.asarray(run(state, jnp.asarray(tokens), jnp.asarray(mask)))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plain", "windowed"])
def test_blockwise_prefill_logits_equal_the_dense_path(variant: str) -> None:
    # 1100 tokens: several 512-token blocks; the second call's queries sit after the
    # cache index 700 and its window reaches back into the first call's keys.
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, (2, 1100)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[1, :37] = 0   # row 1 left-padded
    fast = _logits("blockwise", variant, tokens, mask)
    slow = _logits("dense", variant, tokens, mask)
    real = mask.astype(bool)   # padding rows see no key: their logits are no one's
    scale = float(np.abs(slow[real]).max())
    np.testing.assert_allclose(fast[real], slow[real], rtol=0, atol=2e-5 * scale)
