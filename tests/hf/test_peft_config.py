"""adapter_config.json read as PEFT 0.21 reads it: every LoraConfig field is read,
ignored (no effect on the forward pass) or refused with a UsageError naming it and a fix."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

import nnx_shard as ns
from nnx_shard.hf._peft_config import FIELDS, AdapterConfig

FIXTURES = Path(__file__).parent.parent / "fixtures"
PEFT = FIXTURES / "peft_llama"
PEFT_SRC = Path("/work/refvenv/lib")


def _folder(tmp_path, **changes):
    out = tmp_path / "adapter"
    out.mkdir()
    cfg = json.loads((PEFT / "adapter_config.json").read_text()) | changes
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    (out / "adapter_model.safetensors").write_bytes(
        (PEFT / "adapter_model.safetensors").read_bytes())
    return out


def _model():
    from flax import nnx

    from nnx_shard.models import Llama, LlamaConfig

    cfg = LlamaConfig.from_hf(FIXTURES / "hf_llama" / "config.json")
    return ns.hf.load_safetensors(FIXTURES / "hf_llama", Llama(cfg, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize(("field", "value"), [
    ("alora_invocation_tokens", [1, 2]), ("use_dora", True), ("lora_bias", True),
    ("layer_replication", [[0, 2]]), ("target_parameters", ["mlp.experts.down_proj"]),
    ("trainable_token_indices", [3]), ("use_qalora", True), ("use_bdlora", {"nblocks": 2}),
    ("arrow_config", {"top_k": 2}), ("kasa_config", {}), ("monteclora_config", {"a": 1}),
    ("velora_config", {"rank": 2}), ("init_lora_weights", "pissa"),
    ("init_lora_weights", "lora_ga"), ("peft_type", "IA3"),
])
def test_refused_fields_name_themselves_and_a_fix(tmp_path, field, value):
    if field == "kasa_config":
        value = {"x": 1}
    with pytest.raises(ns.UsageError) as info:
        ns.hf.load_lora(_folder(tmp_path, **{field: value}), _model())
    text = str(info.value)
    assert field in text and "Fix:" in text
    assert "merge_and_unload" in text or field == "peft_type"


@pytest.mark.parametrize(("field", "value"), [
    ("fan_in_fan_out", True), ("megatron_config", {"tp": 2}), ("loftq_config", {"bits": 4}),
    ("eva_config", {"rho": 2}), ("init_lora_weights", "gaussian"), ("bias", "all"),
    ("task_type", "SEQ_CLS"), ("ensure_weight_tying", True), ("a_future_field", 1),
])
def test_ignored_fields_change_nothing(tmp_path, field, value):
    model = ns.hf.load_lora(_folder(tmp_path, **{field: value}), _model())
    assert len(ns.hf.load_lora(PEFT, _model()).blocks) == len(model.blocks)


def test_no_lora_alpha_means_eight():
    cfg = AdapterConfig.read_dict({"r": 4, "target_modules": ["q_proj"]})
    assert cfg.rank_scale("model.layers.0.self_attn.q_proj") == (4, 2.0)


def test_patterns_match_a_dotted_suffix_first_key_wins():
    cfg = AdapterConfig.read_dict({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
                                   "rank_pattern": {"q_proj": 4, "layers.1.self_attn.q_proj": 8},
                                   "alpha_pattern": {r"layers\.1\..*": 16}})
    assert cfg.rank_scale("model.layers.1.self_attn.q_proj") == (4, 4.0)
    assert cfg.rank_scale("model.layers.0.self_attn.k_proj") == (2, 2.0)
    assert cfg.rank_scale("model.layers.0.self_attn.xq_proj") == (2, 2.0)  # not a suffix


@pytest.mark.parametrize(("changes", "field"), [
    ({"rank_pattern": {"q_proj": 0}}, "rank_pattern"),
    ({"alpha_pattern": {"(": 2}}, "alpha_pattern"),
    ({"lora_dropout": 1.5}, "lora_dropout"), ({"modules_to_save": "lm_head"}, "modules_to_save"),
    ({"r": 0}, "r is 0"), ({"bias": "some"}, "bias"),
])
def test_malformed_fields_are_named(changes, field):
    with pytest.raises(ns.UsageError, match="Fix:") as info:
        AdapterConfig.read_dict({"r": 2, "target_modules": ["q_proj"]} | changes)
    assert field in str(info.value)


def test_the_table_covers_every_lora_config_field():
    """Every field of PEFT's LoraConfig and PeftConfig is in FIELDS (when PEFT is here)."""
    files = sorted(PEFT_SRC.glob("python*/site-packages/peft/tuners/lora/config.py"))
    if not files:
        pytest.skip("no peft installation to read")
    text = files[0].read_text()
    body = text[text.index("class LoraConfig"):]
    body = body[:body.index("def __post_init__")]
    names = set(re.findall(r"^    (\w+): .*= field\(", body, re.M))
    assert names and names <= set(FIELDS), sorted(names - set(FIELDS))
    assert dataclasses.is_dataclass(AdapterConfig)
