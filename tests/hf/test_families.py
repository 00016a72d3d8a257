"""Model families beyond Llama and Qwen3 against transformers: Qwen2 (q/k/v
biases without an o bias), Mistral (a sliding window shorter than the
sequences), Gemma (GELU-tanh MLP, scaled embeddings, RMSNorm by 1 + w) and
OLMo 2 (norms after attention and MLP, q/k norms over all heads), Gemma 2 (four
norms per block, soft-capped attention scores and logits, query_pre_attn_scalar,
alternating sliding and global layers), Gemma 3 (per-head q/k norms, local and
global rotary bases) and Phi-3 (fused q/k/v and gate/up tensors), loaded with
``load_pretrained`` (``load_safetensors`` with stacked layers under pp).

Ground truth: tests/fixtures/hf_<family>/ (tests/fixtures/make_hf_families.py, run
by hand with torch and transformers). Logits must equal transformers' within
2e-4 x max|logit| on one device (quick) and (slow) under fsdp_tp and the presets that
meet the family's own features (cp for the sliding windows and soft-capping, pp with 2
stages for Gemma 2's alternating layers); greedy continuations through the key/value
cache (where the window applies to cached keys) must pick transformers' tokens wherever
its top-2 margin is not a near-tie.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard._errors import UsageError
from nnx_shard.hf import load_pretrained
from nnx_shard.inference import GenerationConfig, generate
from nnx_shard.models import Decoder, DecoderConfig
from tests._close import assert_close
from tests._shared import load_refusal
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FAMILIES = ("hf_qwen2", "hf_mistral", "hf_gemma", "hf_olmo2", "hf_gemma2", "hf_gemma3_text",
            "hf_phi3")
RTOL = 2e-4
# A greedy step whose top-2 margin is below this may go either way under float
# rounding (the logits above err by ~1e-6 x max|logit|, far less).
NEAR_TIE = 1e-3
# Each family on one device (quick), then (slow) under fsdp_tp, its parameters split over
# data and model, and under the presets that meet its own features: a sliding window under
# context parallelism (the window's band crosses the context shards), soft-capped scores in
# cp's ring, Gemma 2's alternating window layers stacked for a pipeline. Q/K/V biases
# (Qwen2), q/k norms over all heads (OLMo 2) and fused q/k/v and gate/up tensors (Phi-3)
# meet the model split of fsdp_tp. That the presets compute what one device does is the
# preset matrix's (tests/test_strategies.py).
FEATURE_LAYOUTS = {"hf_mistral": ("cp",), "hf_gemma2": ("cp", "pp"), "hf_gemma3_text": ("cp",)}
LAYOUTS = [pytest.param(name, "one", id=f"{name}-one") for name in FAMILIES] + [
    pytest.param(name, s, id=f"{name}-{s}", marks=pytest.mark.slow)
    for name in FAMILIES for s in ("fsdp_tp", *FEATURE_LAYOUTS.get(name, ()))]


def _expected(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / name / "expected.npz"))


def _mesh_rules(strategy: str) -> tuple[jax.sharding.Mesh, object]:
    if strategy == "one":
        return (jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
                ns.strategies.get("dp").rules)
    s = ns.strategies.get(strategy)
    if strategy == "pp":  # the fixtures have 2 or 4 layers: 2 stages
        return ns.make_mesh({"stage": 2, "data": 4}), s.rules
    return s.make_mesh(8), s.rules


@functools.cache
def _loaded(name: str, strategy: str) -> Decoder:
    mesh, rules = _mesh_rules(strategy)
    if strategy == "pp":  # a pipeline runs stacked layers
        cfg = DecoderConfig.from_hf(FIXTURES / name, scan_layers=True)
        return ns.hf.load_safetensors(FIXTURES / name, ns.abstract_init(
            lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, rules))
    model = load_pretrained(FIXTURES / name, mesh=mesh, rules=rules)
    assert isinstance(model, Decoder)
    return model


@functools.cache
def _forward():
    return nnx.jit(lambda m, t: m(t))


def _logits(name: str, strategy: str, tokens: np.ndarray) -> np.ndarray:
    mesh, rules = _mesh_rules(strategy)
    rows = tokens.shape[0]
    host = np.tile(tokens, (mesh.devices.size // rows or 1, 1))
    with ns.use(mesh, rules):
        out = _forward()(_loaded(name, strategy), host)
    return np.asarray(out)[:rows]


def test_family_configs_are_read() -> None:
    qwen2 = DecoderConfig.from_hf(FIXTURES / "hf_qwen2")
    assert (qwen2.model_type, qwen2.family.qkv_bias, qwen2.sliding_window,
            qwen2.tie_embeddings) == ("qwen2", True, None, True)
    assert "attention_bias" not in qwen2.to_hf()  # not a field of Qwen2's config
    mistral = DecoderConfig.from_hf(FIXTURES / "hf_mistral")
    assert (mistral.model_type, mistral.family.qkv_bias, mistral.sliding_window,
            mistral.tie_embeddings) == ("mistral", False, 5, False)
    gemma = DecoderConfig.from_hf(FIXTURES / "hf_gemma")
    assert (gemma.activation, gemma.family.embed.__name__, gemma.family.norm_offset,
            gemma.head_dim, gemma.tie_embeddings) == ("gelu_pytorch_tanh", "scale_embeddings",
                                                      True, 16, True)
    assert (mistral.activation, mistral.family.norm_offset) == ("silu", False)
    olmo2 = DecoderConfig.from_hf(FIXTURES / "hf_olmo2")
    assert (olmo2.family.block.__name__, olmo2.family.qk_norm) == ("PostNormBlock", "all")
    block = _loaded("hf_olmo2", "one").blocks[0]
    assert block.attn_norm is None and block.mlp_post_norm is not None
    assert block.attn.q_norm.scale.get_value().shape == (olmo2.heads, olmo2.head_dim)
    for cfg in (qwen2, mistral, gemma, olmo2):
        assert DecoderConfig.from_hf(cfg.to_hf()) == cfg
    model = _loaded("hf_qwen2", "one")
    attn = model.blocks[0].attn
    assert attn.q_bias is not None and attn.v_bias is not None and attn.o_bias is None
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert params == qwen2.num_params
    olmo = _loaded("hf_olmo2", "one")
    assert sum(x.size for x in jax.tree.leaves(nnx.state(olmo, nnx.Param))) == olmo2.num_params


@pytest.mark.parametrize(("name", "strategy"), LAYOUTS)
def test_family_logits_match_transformers(name: str, strategy: str) -> None:
    expected = _expected(name)
    assert float(expected["logits"].std()) > 5  # far from uniform: the comparison bites
    logits = _logits(name, strategy, expected["tokens"])
    assert_close(logits, expected["logits"], RTOL, f"{name} {strategy} logits")


def test_the_window_decides_mistral_logits() -> None:
    # Without the band the logits differ: the fixture's window (5) is shorter
    # than its 16 tokens, so the test above checks the window.
    cfg = DecoderConfig.from_hf(FIXTURES / "hf_mistral")
    mesh, rules = _mesh_rules("one")
    full = ns.hf.load_safetensors(FIXTURES / "hf_mistral", ns.abstract_init(
        lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, rules))
    unbanded = nnx.merge(nnx.graphdef(Decoder(dataclasses.replace(cfg, sliding_window=None),
                                            rngs=nnx.Rngs(0))), nnx.state(full))
    expected = _expected("hf_mistral")
    tokens = expected["tokens"]
    banded, plain = np.asarray(full(tokens)), np.asarray(unbanded(tokens))
    # the first 5 positions see the same keys either way; the later ones do not
    assert_close(banded[:, :5], plain[:, :5], 1e-5, "first window")
    assert not np.allclose(banded[:, 5:], plain[:, 5:], atol=1e-2)


# Greedy generation through the cache on one device: in the quick tier where the cache meets
# a family's own feature (the window over cached keys: Mistral, Gemma 2, Gemma 3), in the
# slow tier for the others; sharded (slow) for the uniform window (Mistral) and the one
# alternating with global layers under soft-capping (Gemma 2).
WINDOWED = ("hf_mistral", "hf_gemma2", "hf_gemma3_text")
GENERATION = [pytest.param(name, "one", id=f"{name}-one",
                           marks=() if name in WINDOWED else pytest.mark.slow)
              for name in FAMILIES] + [
    pytest.param(name, "fsdp_tp", id=f"{name}-fsdp_tp", marks=pytest.mark.slow)
    for name in ("hf_mistral", "hf_gemma2")]


@pytest.mark.parametrize(("name", "strategy"), GENERATION)
def test_family_greedy_generation_matches_transformers(name: str, strategy: str) -> None:
    expected = _expected(name)
    prompt, want, margins = expected["prompt"], expected["generated"], expected["margins"]
    mesh, rules = _mesh_rules(strategy)
    rows = prompt.shape[0]
    tiled = np.tile(prompt, (max(mesh.devices.size // rows, 1), 1))  # the batch splits
    got = np.asarray(generate(_loaded(name, strategy), tiled,
                              GenerationConfig(max_new_tokens=want.shape[1]), mesh=mesh,
                              rules=rules))[:rows, prompt.shape[1]:]
    for row in range(want.shape[0]):
        differ = np.flatnonzero(got[row] != want[row])
        if differ.size:  # only a near-tie may flip, and everything after follows it
            assert margins[row, differ[0]] < NEAR_TIE, (row, differ[0], got[row], want[row])
        else:
            np.testing.assert_array_equal(got[row], want[row])


def _copy_with(tmp_path: Path, name: str, change: dict) -> Path:
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | change))
    return out


def test_a_checkpoint_of_another_config_is_refused(tmp_path) -> None:
    # Mistral's tensors have a Llama's shapes: only the config tells them apart.
    cfg = DecoderConfig.from_hf(FIXTURES / "hf_mistral")
    llama = cfg.with_family("llama")
    target = ns.abstract_init(lambda: Decoder(llama, rngs=nnx.Rngs(0)), "data=8",
                              ns.strategies.get("dp").rules)
    with pytest.raises(UsageError) as info:
        ns.hf.load_safetensors(FIXTURES / "hf_mistral", target)
    text = str(info.value)
    assert "2 fields differ" in text and "hf_mistral/config.json" in text
    assert "- model_type: checkpoint 'mistral', model 'llama'" in text
    assert "- sliding_window: checkpoint 5, model None" in text
    assert "Fix: build the target from the checkpoint's config" in text
    # Gemma's tensors fill a Llama of its sizes too: the family (its embedding scale and
    # norm) and the activation tell them apart.
    gemma = DecoderConfig.from_hf(FIXTURES / "hf_gemma").with_family("llama", activation="silu")
    text = load_refusal(FIXTURES / "hf_gemma", gemma)
    assert "2 fields differ" in text
    assert "- model_type: checkpoint 'gemma', model 'llama'" in text
    assert "- hidden_act: checkpoint 'gelu_pytorch_tanh', model 'silu'" in text
    # OLMo 2's post-norms have Llama's pre-norms' shapes: the family tells them apart.
    olmo = DecoderConfig.from_hf(FIXTURES / "hf_olmo2").with_family("llama")
    assert re.search(r"(?s)differ.*- model_type: checkpoint 'olmo2', model 'llama'",
                     load_refusal(FIXTURES / "hf_olmo2", olmo))
    # A family this does not read: the fields the file states are compared.
    gpt2 = _copy_with(tmp_path, "hf_mistral", {"model_type": "gpt2", "hidden_act": "gelu"})
    with pytest.raises(UsageError) as info:
        ns.hf.load_safetensors(gpt2, target)
    text = str(info.value)
    assert "- model_type: checkpoint 'gpt2', model 'llama'" in text
    assert "- hidden_act: checkpoint 'gelu', model 'silu'" in text
    # load_pretrained refuses the unknown family by name.
    with pytest.raises(UsageError, match="model_type 'gpt2' is not a family load_pretrained"):
        load_pretrained(gpt2, mesh="data=8", rules=ns.strategies.get("dp").rules)


def test_mixed_window_layers_are_refused() -> None:
    hf = json.loads((FIXTURES / "hf_qwen2" / "config.json").read_text())
    with pytest.raises(UsageError, match="sliding-window attention in some layers only"):
        DecoderConfig.from_hf(hf | {"use_sliding_window": True, "sliding_window": 4,
                                  "max_window_layers": 1, "layer_types": None})
    every = DecoderConfig.from_hf(hf | {"use_sliding_window": True, "sliding_window": 4,
                                      "max_window_layers": 0, "layer_types": None})
    assert every.sliding_window == 4
