"""What the decoder's families share (nnx_shard.models._layers): one RMSNorm for the
reference family and the Hugging Face ones, with the parameter paths, logical names, dtypes and values each
model had with its own copy, so checkpoints and Hugging Face mappings address them as
before."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_shard.models import Decoder, get_config
from nnx_shard.models import _decoder as llama
from nnx_shard.models import _decoder_layers as layers
from nnx_shard.models._layers import RMSNorm

TRANSFORMER_BLOCK = ["attn/k", "attn/o", "attn/q", "attn/v", "attn_norm/scale", "mlp/down",
                     "mlp/up", "mlp_norm/scale"]
LLAMA_BLOCK = ["attn/k", "attn/o", "attn/q", "attn/v", "attn_norm/scale", "mlp/down", "mlp/gate",
               "mlp/up", "mlp_norm/scale"]
QWEN3_BLOCK = sorted([*LLAMA_BLOCK, "attn/q_norm/scale", "attn/k_norm/scale"])


def _paths(model: nnx.Module) -> list[str]:
    return sorted("/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model)))


def _blocks(per_block: list[str], layers: int) -> list[str]:
    return [f"blocks/{i}/{p}" for i in range(layers) for p in per_block]


def test_both_models_build_every_norm_from_the_one_rmsnorm() -> None:
    t = Decoder(get_config("tiny"), rngs=nnx.Rngs(0))
    q = Decoder(get_config("qwen3-tiny"), rngs=nnx.Rngs(0))
    norms = [t.final_norm, t.blocks[0].attn_norm, t.blocks[1].mlp_norm, q.final_norm,
             q.blocks[0].attn_norm, q.blocks[1].mlp_norm, q.blocks[0].attn.q_norm,
             q.blocks[0].attn.k_norm]
    assert [type(n) for n in norms] == [RMSNorm] * len(norms)
    assert layers.RMSNorm is RMSNorm and llama.RMSNorm is RMSNorm


def test_parameter_paths_are_those_checkpoints_and_mappings_address() -> None:
    cfg, lcfg = get_config("tiny"), get_config("llama-tiny")
    assert (cfg.layers, lcfg.layers) == (2, 2)
    assert _paths(Decoder(cfg, rngs=nnx.Rngs(0))) == sorted(
        [*_blocks(TRANSFORMER_BLOCK, 2), "final_norm/scale", "pos_embed", "token_embed",
         "unembed"])
    scanned = Decoder(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(0))
    assert _paths(scanned) == sorted(
        [*(f"blocks/{p}" for p in TRANSFORMER_BLOCK), "final_norm/scale", "pos_embed",
         "token_embed", "unembed"])
    assert _paths(Decoder(lcfg, rngs=nnx.Rngs(0))) == sorted(
        [*_blocks(LLAMA_BLOCK, 2), "final_norm/scale", "token_embed", "unembed"])
    assert _paths(Decoder(get_config("qwen3-tiny"), rngs=nnx.Rngs(0))) == sorted(
        [*_blocks(QWEN3_BLOCK, 2), "final_norm/scale", "token_embed"])  # tied: no unembed


def test_norm_scales_keep_their_names_dtypes_and_initial_values() -> None:
    bf16 = dataclasses.replace(get_config("tiny"), param_dtype=jnp.bfloat16,
                               dtype=jnp.bfloat16, scan_layers=True)
    t = Decoder(bf16, rngs=nnx.Rngs(0))
    assert t.final_norm.scale.get_metadata("out_sharding") == ("embed",)
    assert t.blocks.attn_norm.scale.get_metadata("out_sharding") == ("layers", "embed")
    assert t.blocks.attn_norm.scale.dtype == jnp.bfloat16
    np.testing.assert_array_equal(t.final_norm.scale[...], np.ones(32))
    olmo = Decoder(get_config("qwen3-tiny").with_family("olmo2"), rngs=nnx.Rngs(0))
    assert olmo.blocks[0].attn.q_norm.scale.get_metadata("out_sharding") == ("heads", "kv")
    assert olmo.blocks[0].attn.k_norm.scale.shape == (2, 16)  # kv_heads x head_dim together
    gemma = Decoder(get_config("qwen3-tiny").with_family("gemma"), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(gemma.final_norm.scale[...], np.zeros(32))  # 1 + weight


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_models_norms_compute_the_same_values(dtype) -> None:
    """The reference family's norms (eps 1e-6) and the llama family's with the same eps, given the same
    weights and input, agree exactly, and match the float32 formula."""
    t = Decoder(dataclasses.replace(get_config("tiny"), dtype=dtype), rngs=nnx.Rngs(0))
    lcfg = dataclasses.replace(get_config("llama-tiny"), norm_eps=1e-6, dtype=dtype)
    q = Decoder(lcfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    w = rng.normal(size=32).astype(np.float32)
    x = jnp.asarray(rng.normal(size=(2, 5, 32)) * 3, dtype)
    t.final_norm.scale[...] = w
    q.final_norm.scale[...] = w
    out = t.final_norm(x)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out), np.asarray(q.final_norm(x)))
    x32 = np.asarray(x, np.float32)
    want = w * x32 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(out, np.float32), want,
                               rtol=1e-5 if dtype == jnp.float32 else 1e-2)


def test_offset_scales_by_one_plus_weight_over_several_axes() -> None:
    plain = RMSNorm((2, 3), ("heads", "kv"), 1e-6, jnp.float32, jnp.float32, rngs=nnx.Rngs(0))
    offset = RMSNorm((2, 3), ("heads", "kv"), 1e-6, jnp.float32, jnp.float32,
                     rngs=nnx.Rngs(0), offset=True)
    w = np.arange(6, dtype=np.float32).reshape(2, 3) / 10
    plain.scale[...], offset.scale[...] = 1 + w, w
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 2, 3)), jnp.float32)
    np.testing.assert_allclose(offset(x), plain(x), rtol=1e-6)
    # Both trailing axes are normalized together: unit mean square over each [2, 3].
    unit = RMSNorm((2, 3), ("heads", "kv"), 0.0, jnp.float32, jnp.float32, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.mean(np.square(unit(x)), axis=(1, 2)), np.ones(4), rtol=1e-5)
