"""``resize_token_embeddings`` on a model with LoRA adapters on its embedding or head
(the factor carrying the vocabulary resized with the table, new tokens' rows zero),
quantized tables refused, and sizes the devices' memory cannot hold refused before
anything changes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard._errors import UsageError
from nnx_shard.models import Decoder, get_config, resize_token_embeddings
from nnx_shard.models._resize import memory_shortfall

_forward = nnx.jit(lambda model, tokens: model(tokens))
OLD = jnp.asarray([[1, 5, 127, 3]], jnp.int32)
NEW = jnp.asarray([[1, 5, 127, 3, 130, 135]], jnp.int32)


def _adapted(targets: str, tied: bool = False) -> Decoder:
    """The tiny Llama with adapters on ``targets`` whose zero factor is set, so the
    adapters change the logits."""
    cfg = dataclasses.replace(get_config("llama-tiny"), tie_embeddings=tied)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    ns.lora(model, rank=2, alpha=4.0, targets=targets)
    for name in ("lora_token_embed", "lora_unembed"):
        node = getattr(model, name, None)
        if node is not None:
            node.lora_b[...] = 0.5 * jax.random.normal(jax.random.key(1), node.lora_b.shape)
    return model


@pytest.mark.parametrize("targets", ["token_embed", "unembed", "token_embed|unembed"])
def test_adapter_factors_grow_with_zero_rows_and_old_tokens_keep_their_logits(targets):
    model = _adapted(targets)
    before = np.asarray(_forward(model, OLD))
    factors = {n: np.asarray(getattr(model, n).lora_a[...] if n == "lora_token_embed"
                             else getattr(model, n).lora_b[...])
               for n in ("lora_token_embed", "lora_unembed") if hasattr(model, n)}
    resize_token_embeddings(model, 136)
    assert model.cfg.vocab == 136
    if "lora_token_embed" in factors:
        a = np.asarray(model.lora_token_embed.lora_a[...])
        assert a.shape == (136, 2) and model.lora_token_embed.lora_b.shape == (2, 32)
        np.testing.assert_array_equal(a[:128], factors["lora_token_embed"])
        np.testing.assert_array_equal(a[128:], 0.0)
    if "lora_unembed" in factors:
        b = np.asarray(model.lora_unembed.lora_b[...])
        assert b.shape == (2, 136) and model.lora_unembed.lora_a.shape == (32, 2)
        np.testing.assert_array_equal(b[:, :128], factors["lora_unembed"])
        np.testing.assert_array_equal(b[:, 128:], 0.0)
    after = np.asarray(_forward(model, NEW))
    assert after.shape == (1, 6, 136) and np.isfinite(after).all()
    # Causal: the old prefix's logits over the old vocabulary are as before the resize.
    np.testing.assert_allclose(after[:, :4, :128], before, rtol=1e-5, atol=1e-5)
    adapted = np.asarray(_forward(model, NEW))
    ns.merge_lora(model)
    assert not hasattr(model, "lora_token_embed") and not hasattr(model, "lora_unembed")
    assert model.token_embed.shape == (136, 32)
    np.testing.assert_allclose(np.asarray(_forward(model, NEW)), adapted, rtol=1e-5, atol=1e-5)


def test_a_new_token_gets_no_adapter_delta():
    model = _adapted("token_embed|unembed")
    resize_token_embeddings(model, 136)
    ids = jnp.asarray([[130, 135]], jnp.int32)
    adapted = np.asarray(_forward(model, ids))
    old_ids = np.asarray(_forward(model, OLD))
    embed_b = model.lora_token_embed.lora_b[...]
    model.lora_token_embed.lora_b[...] = jnp.zeros(embed_b.shape)
    # New ids read zero rows of the embedding adapter's A: its B does not reach them.
    np.testing.assert_array_equal(np.asarray(_forward(model, ids)), adapted)
    assert np.abs(np.asarray(_forward(model, OLD)) - old_ids).max() > 1e-3  # it does reach old ids
    model.lora_token_embed.lora_b[...] = embed_b
    model.lora_unembed.lora_b[...] = jnp.zeros(model.lora_unembed.lora_b.shape)
    without_head = np.asarray(_forward(model, ids))
    # The head adapter's new columns of B are zero: the new tokens' logits are the base's.
    np.testing.assert_allclose(without_head[..., 128:], adapted[..., 128:], rtol=1e-6,
                               atol=1e-6)
    assert np.abs(without_head[..., :128] - adapted[..., :128]).max() > 1e-3


def test_tied_model_with_an_embedding_adapter_shrinks_it_too():
    model = _adapted("token_embed", tied=True)
    before = np.asarray(_forward(model, OLD[:, :2]))
    resize_token_embeddings(model, 100)
    assert model.unembed is None and model.lora_token_embed.lora_a.shape == (100, 2)
    np.testing.assert_allclose(np.asarray(_forward(model, OLD[:, :2])), before[..., :100], rtol=1e-5,
                               atol=1e-5)


def test_sharded_adapter_factors_keep_their_layout():
    strategy = ns.strategies.get("tp")
    model = ns.sharded_init(
        lambda: ns.lora(Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0)), 2, 4.0,
                        targets="token_embed|unembed"), "data=4,model=2", strategy)
    before = {n: getattr(model, n).get_value().sharding
              for n in ("token_embed", "unembed")}
    a_sh = model.lora_token_embed.lora_a.get_value().sharding
    b_sh = model.lora_unembed.lora_b.get_value().sharding
    resize_token_embeddings(model, 136)
    assert model.lora_token_embed.lora_a.get_value().sharding == a_sh
    assert model.lora_unembed.lora_b.get_value().sharding == b_sh
    assert {n: getattr(model, n).get_value().sharding for n in before} == before
    assert np.isfinite(np.asarray(_forward(model, NEW))).all()


@pytest.mark.parametrize("targets,name", [("token_embed", "token_embed"),
                                          ("unembed", "unembed")])
def test_a_quantized_table_is_refused_with_the_fix(targets, name):
    model = ns.lora(Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0)), 2, 4.0,
                    targets=targets, quantize="int8", quant_block=None)
    with pytest.raises(UsageError, match=f"{name} is quantized") as e:
        resize_token_embeddings(model, 136)
    assert "ns.merge_lora(model) first" in str(e.value) and model.cfg.vocab == 128


@pytest.mark.parametrize("targets", ["", "token_embed|unembed"])
def test_a_table_past_memory_is_refused_and_nothing_changes(targets):
    model = (Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0)) if not targets
             else _adapted(targets))
    leaves = jax.tree.leaves(nnx.state(model))
    with pytest.raises(UsageError, match="new_vocab 2147483647") as e:
        resize_token_embeddings(model, 2**31 - 1)
    message = str(e.value)
    assert "GiB" in message and "memory" in message and "left unchanged" in message
    assert "token_embed (128, 32)" in message
    assert ("lora_token_embed/lora_a (128, 2)" in message) == bool(targets)
    assert model.cfg.vocab == 128
    assert all(a is b for a, b in zip(leaves, jax.tree.leaves(nnx.state(model)), strict=True))


def test_memory_shortfall_counts_cpu_devices_against_the_host():
    devices = jax.devices()
    assert memory_shortfall(dict.fromkeys(devices, 1 << 20)) is None
    short = memory_shortfall(dict.fromkeys(devices, 1 << 60))
    assert short is not None and f"{len(devices) * 2**30:,.1f} GiB in all" in short
    assert "this host's" in short
