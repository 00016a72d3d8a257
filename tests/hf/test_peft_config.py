"""adapter_config.json read as PEFT 0.21 reads it: every LoraConfig field is read,
ignored (no effect on the forward pass) or refused with a UsageError naming it and a fix."""

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import nnx_shard as ns
from nnx_shard._low_rank import adapters
from nnx_shard.hf import _peft_config
from nnx_shard.hf._peft_config import FIELDS, AdapterConfig, Patterns
from tests._shared import adapter_copy

FIXTURES = Path(__file__).parent.parent / "fixtures"
PEFT = FIXTURES / "peft_llama"
PEFT_SRC = Path("/work/refvenv/lib")


def _folder(tmp_path, **changes):
    return adapter_copy(PEFT, tmp_path / "adapter", **changes)


def _model():
    from flax import nnx

    from nnx_shard.models import Decoder, DecoderConfig

    cfg = DecoderConfig.from_hf(FIXTURES / "hf_llama" / "config.json")
    return ns.hf.load_safetensors(FIXTURES / "hf_llama", Decoder(cfg, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize(("field", "value"), [
    ("alora_invocation_tokens", [1, 2]), ("use_dora", True), ("lora_bias", True),
    ("layer_replication", [[0, 2]]), ("target_parameters", ["mlp.experts.down_proj"]),
    ("trainable_token_indices", [3]), ("use_bdlora", {"nblocks": 2}),
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


# --- use_qalora: PEFT pools adapter inputs on GPTQ layers only ------------------------------------
def _factors(model):
    return {k: (np.asarray(n.lora_a[...]), np.asarray(n.lora_b[...]), n.scale)
            for k, n in adapters(model).items()}


def test_use_qalora_on_an_unquantized_base_is_plain_lora(tmp_path):
    """PEFT's QA-LoRA variant is only built on GPTQ linear layers: on this model it
    computes plain LoRA, and the load gives the same adapters as without use_qalora."""
    plain = _factors(ns.hf.load_lora(PEFT, _model()))
    qa = _factors(ns.hf.load_lora(_folder(tmp_path, use_qalora=True, qalora_group_size=8),
                                  _model()))
    assert sorted(qa) == sorted(plain) and len(qa) == 8
    for k, (a, b, scale) in qa.items():
        assert np.array_equal(a, plain[k][0]) and np.array_equal(b, plain[k][1])
        assert scale == plain[k][2] == 2.0


@pytest.mark.slow  # three models and two eager forward passes
def test_use_qalora_on_an_unquantized_base_gives_peft_s_logits(tmp_path):
    import jax.numpy as jnp

    exp = np.load(PEFT / "expected.npz")
    tokens = jnp.asarray(exp["tokens"])
    plain = ns.hf.load_lora(PEFT, _model())
    qa = ns.hf.load_lora(_folder(tmp_path, use_qalora=True, qalora_group_size=8), _model())
    qa.eval()
    plain.eval()
    out, ref = np.asarray(qa(tokens)), np.asarray(plain(tokens))
    assert np.array_equal(out, ref)
    assert np.abs(out - exp["logits"]).max() <= 2e-4 * np.abs(exp["logits"]).max()  # PEFT's


def test_use_qalora_adapter_of_a_gptq_base_is_refused_by_shape(tmp_path):
    """A QA-LoRA adapter trained on GPTQ layers has lora_A [r, in / group]: refused, the
    message saying why."""
    out = _folder(tmp_path, use_qalora=True, qalora_group_size=8)
    tensors = load_file(out / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = np.ascontiguousarray(tensors[key][:, ::8])
    save_file(tensors, out / "adapter_model.safetensors")
    with pytest.raises(ns.UsageError, match="Fix:") as info:
        ns.hf.load_lora(out, _model())
    text = str(info.value)
    assert "q_proj: lora_A (4, 4)" in text and "use_qalora" in text and "GPTQ" in text


# --- the config's regexes: checked as PEFT compiles them, matched under a time bound --------------
NAMES = ["lm_head", "model.embed_tokens"] + [
    f"model.layers.{i}.{m}" for i in range(3) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def _peft_targeted(cfg, key):
    """peft.tuners.tuners_utils.check_target_module_exists (0.21) for these fields, on re."""
    exclude = cfg.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return False
        elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
            return False
    targets = cfg["target_modules"]
    if isinstance(targets, str):
        return bool(re.fullmatch(targets, key))
    if key in targets:
        return True
    found = any(key.endswith(f".{t}") for t in targets)
    layers, pattern = cfg.get("layers_to_transform"), cfg.get("layers_pattern")
    if found and layers is not None and (layers != [] if isinstance(layers, list) else True):
        match = None
        if pattern is None or len(pattern) == 0:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            for p in [pattern] if isinstance(pattern, str) else pattern:
                match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
                if match is not None:
                    break
        index = match.groupdict().get("idx") if match else None
        if index is None:
            return False
        return int(index) == layers if isinstance(layers, int) else int(index) in layers
    return found


def _peft_pattern_key(keys, name):
    """peft.utils.other.get_pattern_key (0.21), on re."""
    return next((k for k in keys if re.match(rf"(.*\.)?({k})$", name)), name)


@pytest.mark.parametrize("changes", [
    {"target_modules": r".*\.(q|v)_proj"}, {"target_modules": r"model\.layers\.1\..*"},
    {"target_modules": r"(?i).*Q_PROJ"}, {"target_modules": r".*(?<=self_attn\.)[qk]_proj"},
    {"target_modules": "lm_head"}, {"target_modules": ["q_proj", "mlp"], "exclude_modules": "lm_head"},
    {"target_modules": ["q_proj", "up_proj"], "exclude_modules": r".*layers\.0\..*"},
    {"target_modules": ["q_proj", "up_proj"], "layers_to_transform": [1, 2],
     "layers_pattern": "layers"},
    {"target_modules": ["q_proj"], "layers_to_transform": 2, "layers_pattern": ["h", "lay[a-z]+"]},
    # a | at the top of PEFT's layer pattern: a match without the index group is no layer
    {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": "layers|h"},
    {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": "h|layers"},
    {"target_modules": ["v_proj"], "layers_to_transform": [0, 1], "layers_pattern": []},
])
def test_module_selection_is_peft_s_on_re(changes):
    cfg = {"r": 2} | changes
    got = [n for n in NAMES if AdapterConfig.read_dict(dict(cfg)).targeted(n)]
    assert got == [n for n in NAMES if _peft_targeted(cfg, n)]


def test_layers_pattern_with_a_top_level_bar():
    cfg = AdapterConfig.read_dict({"r": 2, "target_modules": ["q_proj"],
                                   "layers_to_transform": [0], "layers_pattern": "layers|h"})
    assert not cfg.targeted("model.layers.0.self_attn.q_proj")  # matched, no index
    cfg = AdapterConfig.read_dict({"r": 2, "target_modules": ["q_proj"],
                                   "layers_to_transform": [0], "layers_pattern": "h|layers"})
    assert not cfg.targeted("model.layers.0.self_attn.q_proj")  # neither branch matches
    assert cfg.targeted("layers.0.self_attn.q_proj")  # the second, with its index


RANKS = {"q_proj": 4, r"layers\.1\..*": 8, "(?i:K_PROJ)": 6, r"self_attn\.(v|o)_proj": 3,
         r"model\.layers\.2\.mlp\.up_proj": 5, "a)|(.*gate_proj": 7, "mlp": 9}


def test_rank_pattern_keys_match_as_peft_s_on_re():
    cfg = AdapterConfig.read_dict({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
                                   "rank_pattern": RANKS, "alpha_pattern": RANKS})
    for name in NAMES:
        key = _peft_pattern_key(RANKS, name)
        assert cfg.rank_scale(name) == (RANKS.get(key, 2), RANKS.get(key, 4) / RANKS.get(key, 2))
    assert cfg.rank_scale("model.layers.0.mlp.down_proj") == (2, 2.0)  # "mlp": not a suffix


def test_plain_names_compare_as_their_regex():
    pats = Patterns(Path("a"))
    for key in ("q_proj", r"self_attn\.q_proj", ""):
        pats.add("rank_pattern", key)
        for name in ("model.layers.0.self_attn.q_proj", "xq_proj", "q_proj", "a.", "x.q_proj\n",
                     "a\nb.q_proj", "self_attn.q_proj"):
            want = re.match(rf"(.*\.)?({key})$", name) is not None
            assert bool(pats.match("rank_pattern", key, name)) == want, (key, name)
    pats.add("target_modules", "q_proj")
    assert [bool(pats.match("target_modules", "q_proj", n)) for n in ("q_proj", "q_proj\n", "a.q_proj")] \
        == [True, False, False]


@pytest.mark.parametrize(("changes", "words"), [
    ({"rank_pattern": {"(?i)Q_PROJ": 4}}, ["rank_pattern key '(?i)Q_PROJ'", "global flags",
                                            "(?i:q_proj)"]),
    ({"alpha_pattern": {"q_proj(": 4}}, ["alpha_pattern key 'q_proj('", "missing )"]),
    ({"layers_to_transform": [0], "layers_pattern": "lay(ers"},
     ["layers_pattern 'lay(ers'", "inside (?:^|.*?\\.)...\\.(?P<idx>\\d+)\\."]),
    ({"layers_to_transform": [0], "layers_pattern": ["h", "(?P<idx>layers)"]},
     ["layers_pattern '(?P<idx>layers)'", "redefinition of group name 'idx'", "drop the group"]),
    ({"target_modules": "(?<=a+)q_proj"}, ["target_modules '(?<=a+)q_proj'", "fixed-width"]),
    ({"exclude_modules": "mlp.*)"}, ["exclude_modules 'mlp.*)'", "unbalanced"]),
    ({"rank_pattern": {"q_proj{e<=1}": 4}}, ["rank_pattern key 'q_proj{e<=1}'", "'{'"]),
    ({"target_modules": "[[:alpha:]._]+"}, ["target_modules '[[:alpha:]._]+'", "'['"]),
    ({"rank_pattern": {"a{4294967294}": 4}}, ["rank_pattern key 'a{4294967294}'",
                                              "4294967297 items", "over 200000"]),
    ({"rank_pattern": {"((a{100}){100}){100}": 4}}, ["1000003 items"]),
    ({"target_modules": "(" * 5000 + ")" * 5000}, ["target_modules", "too deep"]),
])
def test_patterns_peft_cannot_compile_are_named(changes, words):
    with pytest.raises(ns.UsageError, match="Fix:") as info:
        AdapterConfig.read_dict({"r": 2, "target_modules": ["q_proj"]} | changes)
    for word in words:
        assert word in str(info.value)


def test_a_layers_pattern_peft_never_reads_is_not_checked():
    cfg = AdapterConfig.read_dict({"r": 2, "target_modules": ["q_proj"],
                                   "layers_to_transform": [], "layers_pattern": "lay(ers"})
    assert cfg.targeted("model.layers.3.self_attn.q_proj")


@pytest.mark.parametrize("key", [r"([a-z_.0-9]+)*!", "(.*)*z", r"(\w|\w)*!"])
def test_patterns_that_hang_re_finish(key):
    """Patterns Python's re backtracks on for hours (on these names) match nothing here
    in well under the bound, as re would find after those hours: past the bound the
    reads below would raise."""
    cfg = AdapterConfig.read_dict({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
                                   "rank_pattern": {key: 8}, "exclude_modules": key})
    assert [cfg.rank_scale(n) for n in NAMES] == [(2, 2.0)] * len(NAMES)
    assert [n for n in NAMES if cfg.targeted(n)] == [n for n in NAMES if n.endswith(".q_proj")]


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern", "target_modules",
                                   "exclude_modules", "layers_pattern"])
def test_a_pattern_that_backtracks_without_end_is_stopped(field, monkeypatch):
    monkeypatch.setattr(_peft_config, "MATCH_SECONDS", 0.2)
    slow = r"(.|\w)*(?!.)x?[!-]"
    cfg = {"r": 2, "target_modules": ["q_proj"]} | {
        "rank_pattern": {"rank_pattern": {slow: 4}}, "alpha_pattern": {"alpha_pattern": {slow: 4}},
        "target_modules": {"target_modules": slow}, "exclude_modules": {"exclude_modules": slow},
        "layers_pattern": {"layers_to_transform": [0], "layers_pattern": slow}}[field]
    read = AdapterConfig.read_dict(cfg)
    with pytest.raises(ns.UsageError, match="Fix:") as info:
        for name in NAMES:
            read.targeted(name)
            read.rank_scale(name)
    text = str(info.value)
    assert f"{field}" in text and repr(slow) in text and "ran past the 0.2 s" in text


def test_the_bound_is_one_budget_for_a_load(monkeypatch):
    """Many cheap patterns add up: the budget is shared, not per pattern."""
    monkeypatch.setattr(_peft_config, "MATCH_SECONDS", 0.05)
    many = {f"x{i}?y+z": 2 for i in range(20000)}
    with pytest.raises(ns.UsageError, match="ran past the 0.05 s") as info:
        AdapterConfig.read_dict({"r": 2, "target_modules": ["q_proj"], "rank_pattern": many})
    assert "rank_pattern key 'x" in str(info.value)


def test_save_lora_s_escaped_names_cost_no_regex():
    keys = {re.escape(n): 4 for n in NAMES[::2]}
    targets = "|".join(keys)
    cfg = AdapterConfig.read_dict({"r": 2, "target_modules": targets, "rank_pattern": keys})
    assert [cfg.rank_scale(n)[0] for n in NAMES] == [4 if i % 2 == 0 else 2
                                                    for i in range(len(NAMES))]
    assert [n for n in NAMES if cfg.targeted(n)] == NAMES[::2]
    assert set(cfg.patterns._compiled) == {("target_modules", targets)}  # the keys: as text
