"""The family registry (nnx_shard.models._families): every family resolves by its
``model_type``; the tables, fusions and config.json it gives are the ones the options
used to pick; an unknown type and contradictory options are refused by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from flax import nnx

from nnx_shard._errors import UsageError
from nnx_shard.hf import mapping_for
from nnx_shard.hf._fused import fusions
from nnx_shard.hf._mapping import LLAMA_MAPPING, LLAMA_TIED_MAPPING
from nnx_shard.models import CONFIGS, Decoder, DecoderConfig, get_config
from nnx_shard.models._families import Family, family_of, model_types, register
from nnx_shard.models._family.gemma2 import GEMMA2_MAPPING
from nnx_shard.models._family.olmo2 import OLMO2_MAPPING

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NINE = ("llama", "qwen3", "qwen2", "mistral", "gemma", "olmo2", "gemma2", "gemma3_text",
        "phi3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                 "gemma": "GemmaForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
# The mixture-of-experts families (tests/models/test_moe.py checks them against transformers).
MOE = ("mixtral", "qwen3_moe")


def _tiny(kind: str) -> DecoderConfig:
    """Each family's tiny config: the named ones, else its test fixture's."""
    if kind in ("llama", "qwen3"):
        return get_config(f"{kind}-tiny")  # type: ignore[return-value]
    return DecoderConfig.from_hf(FIXTURES / f"hf_{kind}")


def _by_structure(cfg: DecoderConfig) -> dict:
    """The table the model's structure asks for (the reference): the block's norms."""
    head = {r"lm_head\.weight": None}
    block = cfg.family.block
    if block.pre_norms and block.post_norms:
        return GEMMA2_MAPPING | head if cfg.tie_embeddings else GEMMA2_MAPPING
    if block.post_norms:
        return OLMO2_MAPPING | head if cfg.tie_embeddings else OLMO2_MAPPING
    return LLAMA_TIED_MAPPING if cfg.tie_embeddings else LLAMA_MAPPING


@pytest.mark.parametrize("kind", NINE)
def test_every_family_resolves_by_its_model_type(kind: str) -> None:
    family = family_of(kind)
    assert family.model_type == kind
    assert family.architectures == (ARCHITECTURES[kind],)
    assert set(model_types()) == set(NINE + MOE)
    assert [family_of(k).architectures[0] for k in MOE] == [ARCHITECTURES[k] for k in MOE]


@pytest.mark.parametrize("kind", NINE)
@pytest.mark.parametrize("tie", [False, True])
def test_mapping_for_gives_the_table_the_options_gave(kind: str, tie: bool) -> None:
    cfg = dataclasses.replace(_tiny(kind), tie_embeddings=tie)
    assert cfg.model_type == kind
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    table = mapping_for(model)
    assert table == _by_structure(cfg)
    if kind in ("llama", "qwen3", "qwen2", "mistral", "gemma", "phi3"):
        assert table is (LLAMA_TIED_MAPPING if tie else LLAMA_MAPPING)
    assert mapping_for(model) is table  # one tied table per family table
    assert cfg.to_hf()["architectures"] == [ARCHITECTURES[kind]]
    assert cfg.to_hf()["model_type"] == kind


def test_named_configs_are_their_familys() -> None:
    named = {n for kind in NINE + MOE for n in family_of(kind).named_configs}
    llama_named = {n for n, c in CONFIGS.items() if isinstance(c, DecoderConfig)}
    assert named == llama_named
    for kind in NINE + MOE:
        for name in family_of(kind).named_configs:
            assert CONFIGS[name].model_type == kind  # type: ignore[union-attr]


def test_only_phi3_has_fused_tensors() -> None:
    for kind in NINE:
        found = fusions(_tiny(kind))
        assert bool(found) == (kind == "phi3")
    phi3 = _tiny("phi3")
    assert [f.fused for f in fusions(phi3)] == ["self_attn.qkv_proj.weight",
                                                "mlp.gate_up_proj.weight"]


def test_an_unknown_model_type_is_refused_naming_it() -> None:
    with pytest.raises(UsageError, match=r"model_type 'gpt2' is not a registered model family "
                                         r"\(known: gemma, .*, qwen3, qwen3_moe\)\. Fix"):
        family_of("gpt2")
    with pytest.raises(UsageError, match=r"'gpt2' is not a Llama-family model.*Fix"):
        DecoderConfig.from_hf({**get_config("llama-tiny").to_hf(),  # type: ignore[union-attr]
                             "model_type": "gpt2"})
    with pytest.raises(UsageError, match=r"model_type='gpt2'.*Fix"):
        DecoderConfig(model_type="gpt2")
    with pytest.raises(UsageError, match="expected a Family"):
        register("llama")  # type: ignore[arg-type]


def test_a_registered_family_is_found() -> None:
    family = family_of("llama")
    assert register(family) is family_of("llama") is family
    assert isinstance(family, Family) and family.fused is None


@pytest.mark.parametrize(("change", "names"), [
    (dict(attn_softcap=50.0), ("attn_softcap=50.0", "model_type='llama'", "gemma2")),
    (dict(mlp_bias=True, model_type="qwen2"), ("mlp_bias", "model_type='qwen2'", "llama")),
    (dict(experts=4, model_type="qwen3"), ("experts=4", "mixtral", "qwen3_moe")),
    (dict(rope_local_theta=1e4, model_type="gemma2", sliding_window=4),
     ("rope_local_theta", "gemma3_text")),
    (dict(sliding_window=4), ("sliding_window", "mistral")),
])
def test_a_field_the_family_lacks_is_refused_naming_who_has_it(change: dict,
                                                               names: tuple) -> None:
    with pytest.raises(UsageError) as info:
        DecoderConfig.for_model(change.pop("model_type", "llama"), **change)
    text = str(info.value)
    assert all(n in text for n in names) and "Fix:" in text


def test_a_familys_own_fields_are_accepted_and_its_structure_is_its_records() -> None:
    assert DecoderConfig.for_model("gemma2", attn_softcap=50.0).attn_softcap == 50.0
    assert DecoderConfig.for_model("mistral", sliding_window=4).sliding_window == 4
    assert DecoderConfig.for_model("llama", mlp_bias=True).mlp_bias
    assert [family_of(k).block.__name__ for k in ("llama", "olmo2", "gemma2")] == [
        "DecoderBlock", "PostNormBlock", "SandwichBlock"]
    assert [family_of(k).qk_norm for k in NINE] == [None, "head", None, None, None, "all",
                                                     None, "head", None]
