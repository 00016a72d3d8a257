"""``resize_token_embeddings`` against transformers' ``resize_token_embeddings``.

The ground truth is ``tests/fixtures/hf_resize`` (``make_hf_resize.py``): transformers
resized ``hf_llama`` to its tokenizer's added tokens (and ``hf_llama_tied`` padded to
a multiple of 8), then set the new rows to fixed values. The tests resize the
original checkpoints here, set the same rows, and compare logits and the exported
tensors. The random draws of mean resizing are checked by their statistics.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import nnx_shard as ns
from nnx_shard._errors import ShardingError, UsageError
from nnx_shard.inference import Tokenizer
from nnx_shard.models import Decoder, ReferenceConfig, get_config, resize_token_embeddings

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
RESIZE = FIXTURES / "hf_resize"


def _load(name: str, mesh: str, strategy: str) -> Decoder:
    model = ns.hf.load_pretrained(FIXTURES / name, mesh=mesh,
                                  rules=ns.strategies.get(strategy).rules)
    assert isinstance(model, Decoder)
    return model


def _set_rows(var: nnx.Param, start: int, rows: np.ndarray, axis: int = 0) -> None:
    """Sets ``var``'s rows (``axis=1``: columns) from ``start`` on, keeping its layout."""
    old = var.get_value()
    new = np.array(old)
    if axis == 0:
        new[start:] = rows
    else:
        new[:, start:] = rows.T
    var.set_value(jax.device_put(new, old.sharding))


def _forward(model: Decoder, tokens: jax.Array) -> jax.Array:
    # One compiled forward: op by op, a sharded model's forward compiles each op.
    return nnx.jit(lambda m, t: m(t))(model, tokens)


def _close_logits(actual: jax.Array, expected: np.ndarray) -> None:
    actual = np.asarray(actual)
    assert actual.shape == expected.shape
    err = np.max(np.abs(actual - expected))
    assert err <= 2e-4 * np.max(np.abs(expected)), err


def test_added_tokens_match_transformers_and_export_its_tensors(tmp_path):
    want = np.load(RESIZE / "expected.npz")
    tokenizer = Tokenizer.from_pretrained(RESIZE)
    assert tokenizer.vocab_size == 131  # 128 + the three added tokens
    ids = tokenizer.encode(str(want["text"]))
    assert ids == want["ids"].tolist() and max(ids) >= 128

    model = _load("hf_llama", "data=8", "fsdp")
    embed_spec = model.token_embed.get_value().sharding.spec
    head_spec = model.unembed.get_value().sharding.spec
    old_embed = np.asarray(model.token_embed[...])
    old_head = np.asarray(model.unembed[...])
    assert resize_token_embeddings(model, tokenizer.vocab_size) is model
    assert model.cfg.vocab == 131
    assert model.token_embed.shape == (131, 32) and model.unembed.shape == (32, 131)
    assert model.token_embed.get_value().sharding.spec == embed_spec
    assert model.unembed.get_value().sharding.spec == head_spec
    np.testing.assert_array_equal(np.asarray(model.token_embed[:128]), old_embed)
    np.testing.assert_array_equal(np.asarray(model.unembed[:, :128]), old_head)
    # Drawn around the old rows' mean at transformers' scale (1e-9 x covariance): as
    # far from it as transformers' own draw, give or take.
    for ours, theirs, mean in ((model.token_embed[128:], want["hf_embed_rows"],
                                want["embed_mean"]),
                               (model.unembed[:, 128:].T, want["hf_head_rows"],
                                want["head_mean"])):
        np.testing.assert_allclose(mean, np.asarray(ours).mean(0), atol=1e-3)
        ours_off = np.max(np.abs(np.asarray(ours) - mean))
        theirs_off = np.max(np.abs(theirs - mean))
        assert 0 < ours_off and theirs_off / 10 < ours_off < theirs_off * 10

    _set_rows(model.token_embed, 128, want["embed_rows"])
    _set_rows(model.unembed, 128, want["head_rows"], axis=1)
    _close_logits(_forward(model, jnp.asarray([ids], jnp.int32)), want["logits"])

    out = tmp_path / "export"
    ns.hf.save_safetensors(out, model)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 131
    got, expected = load_file(out / "model.safetensors"), load_file(RESIZE / "model.safetensors")
    assert got["model.embed_tokens.weight"].shape == (131, 32)
    assert got["lm_head.weight"].shape == (131, 32)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=0, err_msg=name)


def test_tied_model_padded_under_tp_stays_tied_and_matches_transformers(tmp_path):
    want = np.load(RESIZE / "expected_tied.npz")
    model = _load("hf_llama_tied", "data=4,model=2", "tp")
    assert model.unembed is None
    assert model.token_embed.get_value().sharding.spec == jax.sharding.PartitionSpec("model", None)
    resize_token_embeddings(model, 130, pad_to_multiple_of=8)
    assert model.cfg.vocab == int(want["vocab"]) == 136 and model.unembed is None
    assert model.cfg.tie_embeddings
    assert model.token_embed.get_value().sharding.spec == jax.sharding.PartitionSpec("model", None)
    _set_rows(model.token_embed, 128, want["rows"])
    _close_logits(_forward(model, jnp.asarray(want["tokens"])), want["logits"])

    ns.hf.save_safetensors(tmp_path / "export", model)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["vocab_size"] == 136 and config["tie_word_embeddings"] is True
    tensors = load_file(tmp_path / "export" / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].shape == (136, 32)


def test_singular_covariance_gives_the_mean_as_transformers():
    want = np.load(RESIZE / "expected.npz")
    model = _load("hf_llama", "data=8", "fsdp")
    embed = np.array(model.token_embed[...])
    embed[:, 3] = 0.5  # a constant column: the covariance is singular
    model.token_embed.set_value(jax.device_put(embed, model.token_embed.get_value().sharding))
    resize_token_embeddings(model, 131)
    rows = np.asarray(model.token_embed[128:])
    np.testing.assert_allclose(rows, want["degenerate_rows"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(rows, np.broadcast_to(embed.mean(0), rows.shape), atol=1e-6)
    assert np.all(rows == rows[0])  # no draw at all: every new row is the mean
    # The head's covariance is regular: its new columns are drawn, not the mean.
    head = np.asarray(model.unembed[:, 128:])
    assert not np.all(head == head[:, :1])


def test_new_rows_have_the_old_mean_and_scaled_covariance():
    cfg = ReferenceConfig(vocab=64, embed=8, heads=2, head_dim=4, mlp=16, layers=1)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    old = np.asarray(model.token_embed[...], np.float64)
    old_head = np.asarray(model.unembed[...], np.float64).T
    added = 4000
    resize_token_embeddings(model, 64 + added, seed=3)
    assert model.cfg.vocab == 64 + added
    for new, before in ((np.asarray(model.token_embed[64:], np.float64), old),
                        (np.asarray(model.unembed[:, 64:], np.float64).T, old_head)):
        mean = before.mean(0)
        cov = (before - mean).T @ (before - mean) / before.shape[0]
        scaled = 1e-9 * cov
        # The sample mean is within a few standard errors of the old mean.
        se = np.sqrt(np.diag(scaled) / added)
        assert np.all(np.abs(new.mean(0) - mean) < 5 * se + 1e-7 * np.abs(mean))
        # The sample covariance is 1e-9 times the old one (Frobenius error of a few %).
        centered = new - mean
        sample = centered.T @ centered / added
        assert np.linalg.norm(sample - scaled) < 0.15 * np.linalg.norm(scaled)
    np.testing.assert_array_equal(np.asarray(model.token_embed[:64]), old.astype(np.float32))


def test_mean_resizing_off_draws_from_the_initializer_range():
    model = Decoder(ReferenceConfig(vocab=64, embed=16, heads=2, head_dim=8, mlp=16,
                                          layers=1, tie_embeddings=True), rngs=nnx.Rngs(0))
    resize_token_embeddings(model, 64 + 2000, mean_resizing=False)
    new = np.asarray(model.token_embed[64:])
    assert model.unembed is None and model.cfg.vocab == 2064
    assert abs(new.mean()) < 0.003 and abs(new.std() - 0.02) < 0.002


def test_seed_decides_the_draw():
    def rows(seed: int) -> np.ndarray:
        m = Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))
        return np.asarray(resize_token_embeddings(m, 130, seed=seed).token_embed[128:])

    np.testing.assert_array_equal(rows(1), rows(1))
    assert not np.array_equal(rows(1), rows(2))


def test_shrinking_keeps_the_first_rows_and_their_logits():
    model = Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))
    tokens = jnp.asarray([[1, 5, 99, 7]], jnp.int32)
    before = np.asarray(model(tokens))
    embed = np.asarray(model.token_embed[...])
    resize_token_embeddings(model, 100)
    assert model.cfg.vocab == 100 and model.unembed.shape == (32, 100)
    np.testing.assert_array_equal(np.asarray(model.token_embed[...]), embed[:100])
    np.testing.assert_allclose(np.asarray(model(tokens)), before[..., :100], rtol=1e-6, atol=1e-6)
    with pytest.raises(UsageError, match="outside"):
        model(jnp.asarray([[100]], jnp.int32))


def test_same_size_is_left_alone_and_none_pads_the_current_size():
    model = Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))
    value = model.token_embed.get_value()
    assert resize_token_embeddings(model, 128, pad_to_multiple_of=64) is model
    assert model.token_embed.get_value() is value and model.cfg.vocab == 128
    resize_token_embeddings(model, None, pad_to_multiple_of=48)
    assert model.cfg.vocab == 144 and model.token_embed.shape == (144, 32)


@pytest.mark.parametrize("strategy,mesh", [("fsdp", "data=8"), ("tp", "data=4,model=2")])
def test_each_parameter_keeps_its_layout(strategy, mesh):
    rules = ns.strategies.get(strategy)
    model = ns.sharded_init(lambda: Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0)), mesh,
                            rules)
    before = {n: getattr(model, n).get_value().sharding for n in ("token_embed", "unembed")}
    resize_token_embeddings(model, 130, pad_to_multiple_of=8)
    for name, sharding in before.items():
        got = getattr(model, name).get_value().sharding
        assert got == sharding, (name, got)
    # Re-laid out by the strategy itself: the same layout.
    resize_token_embeddings(model, 160, rules=rules)
    assert model.token_embed.get_value().sharding == before["token_embed"]
    assert model.cfg.vocab == 160 and model.unembed.shape == (32, 160)


def test_explicit_mesh_keeps_its_axis_types():
    mesh = ns.make_mesh("data=4,model=2", axis_types="explicit")
    model = ns.sharded_init(lambda: Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0)), mesh,
                            ns.strategies.get("fsdp_tp"))
    before = model.token_embed.get_value().sharding
    resize_token_embeddings(model, 136)
    got = model.token_embed.get_value().sharding
    assert got == before and got.mesh.are_all_axes_explicit


def test_a_size_its_devices_do_not_divide_is_refused_with_the_fix():
    model = ns.sharded_init(lambda: Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0)),
                            "data=4,model=2", ns.strategies.get("tp"))
    value = model.token_embed.get_value()
    with pytest.raises(ShardingError, match="pad_to_multiple_of=2") as e:
        resize_token_embeddings(model, 131)
    assert "new_vocab" in str(e.value) and "131" in str(e.value)
    assert model.token_embed.get_value() is value and model.cfg.vocab == 128  # untouched
    with pytest.raises(ShardingError, match="new_vocab"):
        resize_token_embeddings(model, 131, rules=ns.strategies.get("tp"))
    # A table that replicates what does not divide: the vocab is whole on each device.
    replicate = ns.Rules(ns.strategies.get("tp").rules, indivisible="replicate")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ns.ShardingWarning)
        resize_token_embeddings(model, 131, rules=replicate)
    assert model.token_embed.get_value().sharding.spec[0] is None
    assert model.token_embed.shape == (131, 32)


@pytest.mark.parametrize("kw,name", [
    ({"new_vocab": 0}, "new_vocab"), ({"new_vocab": -3}, "new_vocab"),
    ({"new_vocab": True}, "new_vocab"), ({"new_vocab": 130.0}, "new_vocab"),
    ({"new_vocab": None}, "new_vocab"),
    ({"new_vocab": 130, "pad_to_multiple_of": 0}, "pad_to_multiple_of"),
    ({"new_vocab": 130, "pad_to_multiple_of": -1}, "pad_to_multiple_of"),
    ({"new_vocab": 130, "mean_resizing": "yes"}, "mean_resizing"),
    ({"new_vocab": 130, "seed": -1}, "seed"),
])
def test_bad_arguments_name_themselves(kw, name):
    model = Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(UsageError, match=name):
        resize_token_embeddings(model, **kw)
    assert model.cfg.vocab == 128 and model.token_embed.shape == (128, 32)


def test_a_model_without_embeddings_is_refused():
    with pytest.raises(UsageError, match="token_embed"):
        resize_token_embeddings(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), 8)
