"""nnx_shard.models._rope: the rotary scaling types (default, linear, dynamic,
yarn, longrope, llama3) against transformers.

Ground truth: tests/fixtures/rope_scaling/<type>/ (tests/fixtures/make_rope_scaling.py,
run by hand with torch and transformers): a tiny ``LlamaForCausalLM`` of each type,
the inverse frequencies and attention factor transformers uses for a short (12)
and a long (32) sequence, its logits for both, and a greedy continuation through
the key/value cache past position 16, where ``dynamic`` and ``longrope`` change
their frequencies. Frequencies must equal transformers' to float32 precision,
logits within 2e-4 x max|logit| on one device, greedy tokens wherever the
top-2 margin is not a near-tie.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard.hf import load_pretrained
from nnx_shard.inference import GenerationConfig, generate
from nnx_shard.models import Decoder, DecoderConfig
from nnx_shard.models import _rope as rope
from tests._close import assert_close

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rope_scaling"
TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
RTOL = 2e-4
NEAR_TIE = 1e-3


def _expected(kind: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / kind / "expected.npz"))


def _mesh_rules() -> tuple[jax.sharding.Mesh, object]:
    return (jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
            ns.strategies.get("dp").rules)


@functools.cache
def _loaded(kind: str) -> Decoder:
    mesh, rules = _mesh_rules()
    model = load_pretrained(FIXTURES / kind, mesh=mesh, rules=rules)
    assert isinstance(model, Decoder)
    return model


def test_the_types_are_the_ones_implemented() -> None:
    assert rope.ROPE_TYPES == TYPES
    for kind in TYPES:
        cfg = DecoderConfig.from_hf(FIXTURES / kind)
        got = "default" if cfg.rope_scaling is None else dict(cfg.rope_scaling)["rope_type"]
        assert got == kind


@pytest.mark.parametrize("kind", TYPES)
def test_frequencies_equal_transformers(kind: str) -> None:
    cfg = DecoderConfig.from_hf(FIXTURES / kind)
    want = _expected(kind)
    for tag, length in (("short", 12), ("long", 32)):
        inv, factor = rope.frequencies(cfg, length)
        assert inv.dtype == np.float32 and inv.shape == (cfg.head_dim // 2,)
        np.testing.assert_allclose(inv, want[f"inv_{tag}"], rtol=1e-6, err_msg=f"{kind} {tag}")
        np.testing.assert_allclose(factor, float(want["attention_factor"]), rtol=1e-6)
        traced, traced_factor = jax.jit(lambda n: rope.frequencies_at(cfg, n)[0])(
            jnp.asarray(length)), rope.frequencies_at(cfg, jnp.asarray(length))[1]
        np.testing.assert_allclose(np.asarray(traced), want[f"inv_{tag}"], rtol=1e-6)
        assert traced_factor == factor


def test_the_length_dependent_types_change_with_the_length() -> None:
    # the fixtures bite: dynamic and longrope differ between 12 and 32 positions,
    # the others do not, and yarn's and longrope's attention factors are not 1
    for kind in TYPES:
        want = _expected(kind)
        same = np.array_equal(want["inv_short"], want["inv_long"])
        assert same == (kind not in rope.BY_LENGTH), kind
        assert (float(want["attention_factor"]) != 1.0) == (kind in ("yarn", "longrope"))


@pytest.mark.parametrize("kind", TYPES)
def test_logits_match_transformers(kind: str) -> None:
    want = _expected(kind)
    forward = nnx.jit(lambda m, t: m(t))
    mesh, rules = _mesh_rules()
    for tag in ("short", "long"):
        expected = want[f"logits_{tag}"]
        assert float(expected.std()) > 5  # far from uniform: the comparison bites
        with ns.use(mesh, rules):
            got = np.asarray(forward(_loaded(kind), want[f"tokens_{tag}"]))
        assert_close(got, expected, RTOL, f"{kind} {tag} logits")
        np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("kind", TYPES)
def test_greedy_generation_matches_transformers(kind: str) -> None:
    want = _expected(kind)
    prompt, generated, margins = want["prompt"], want["generated"], want["margins"]
    mesh, rules = _mesh_rules()
    got = np.asarray(generate(_loaded(kind), prompt,
                              GenerationConfig(max_new_tokens=generated.shape[1]), mesh=mesh,
                              rules=rules))[:, prompt.shape[1]:]
    for row in range(generated.shape[0]):
        differ = np.flatnonzero(got[row] != generated[row])
        if differ.size:  # only a near-tie may flip, and everything after follows it
            assert margins[row, differ[0]] < NEAR_TIE, (row, differ[0], got[row],
                                                        generated[row])


@pytest.mark.parametrize("kind", TYPES)
def test_config_round_trip(kind: str) -> None:
    cfg = DecoderConfig.from_hf(FIXTURES / kind)
    hf = cfg.to_hf()
    assert DecoderConfig.from_hf(hf) == cfg
    if kind != "default":
        written = hf["rope_scaling"]
        assert written["rope_type"] == kind
        if kind == "longrope":
            assert isinstance(written["short_factor"], list)
            assert len(written["long_factor"]) == cfg.head_dim // 2
    hash(cfg)  # the config stays hashable (static metadata of the module graph)


def test_phi3_reads_its_own_original_context() -> None:
    factors = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    hf = {"model_type": "phi3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64,
          "original_max_position_embeddings": 16,
          "rope_scaling": {"type": "longrope", **factors}}
    cfg = DecoderConfig.from_hf(hf)
    assert dict(cfg.rope_scaling)["original_max_position_embeddings"] == 16
    assert DecoderConfig.from_hf(cfg.to_hf()) == cfg
    # without the key Phi3Config's default (4096) applies, over the scaling's own
    del hf["original_max_position_embeddings"]
    hf["rope_scaling"]["original_max_position_embeddings"] = 16
    assert dict(DecoderConfig.from_hf(hf).rope_scaling)["original_max_position_embeddings"] == 4096
    with pytest.raises(ns.NnxShardError, match="Phi-3 rotates with the default or longrope"):
        DecoderConfig.from_hf({**hf, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})


_HF = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
       "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64}
_LONG = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
         "original_max_position_embeddings": 16}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
MALFORMED = [
    ({"rope_type": "linear"}, r"type 'linear' lacks \['factor'\]"),
    ({"rope_type": "dynamic"}, r"type 'dynamic' lacks \['factor'\]"),
    ({"rope_type": "yarn"}, r"type 'yarn' lacks \['factor'"),
    ({"rope_type": "linear", "factor": "2"}, r"rope_scaling\['factor'\] must be a finite"),
    ({"rope_type": "dynamic", "factor": 0.5}, r"rope_scaling\['factor'\] must be .* >= 1"),
    ({"rope_type": "linear", "factor": True}, r"rope_scaling\['factor'\]"),
    ({**_YARN, "beta_fast": "32"}, r"rope_scaling\['beta_fast'\]"),
    ({**_YARN, "attention_factor": -1.0}, r"rope_scaling\['attention_factor'\]"),
    ({**_YARN, "truncate": "yes"}, r"rope_scaling\['truncate'\] must be true or false"),
    ({**_YARN, "original_max_position_embeddings": 16.5},
     r"rope_scaling\['original_max_position_embeddings'\]"),
    ({k: v for k, v in _LONG.items() if k != "long_factor"}, r"lacks \['long_factor'\]"),
    ({**_LONG, "short_factor": 1.0}, r"rope_scaling\['short_factor'\] must be a list"),
    ({**_LONG, "long_factor": [2.0] * 3}, r"long_factor'\] has 3 numbers; head_dim 8 rotates 4"),
    ({**_LONG, "short_factor": [1.0, 1.0, "x", 1.0]}, r"rope_scaling\['short_factor'\]\[2\]"),
    ({**_LONG, "long_factor": [2.0, 0.0, 2.0, 2.0]}, r"long_factor'\]\[1\] must be"),
    ({**_LONG, "factor": 0.0}, r"rope_scaling\['factor'\]"),
    ({"rope_type": "ntk", "factor": 2.0}, "type 'ntk' is not implemented"),
]


@pytest.mark.parametrize("scaling, match", MALFORMED,
                         ids=[f"{i}-{s['rope_type']}" for i, (s, _) in enumerate(MALFORMED)])
def test_malformed_parameters_are_refused(scaling: dict, match: str) -> None:
    for build in (lambda: DecoderConfig.from_hf({**_HF, "rope_scaling": scaling}),
                  lambda: DecoderConfig(rope_scaling=scaling)):
        with pytest.raises(ns.NnxShardError, match=match) as info:
            build()
        assert "Fix:" in str(info.value)


# Values that each pass their own check but give non-finite tables (every logit NaN)
# or a formula that divides by zero: refused when the config is built, naming the field.
_YARN_FAR = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}
NON_FINITE = [
    ("dynamic_factor", {"rope_scaling": {"rope_type": "dynamic", "factor": 1e17}},
     r"rope_scaling\['factor'\]=1e\+17 \(rope_type 'dynamic'\).*not finite"),
    ("tiny_theta", {"rope_theta": 1e-50}, r"rope_theta=1e-50 .*not finite in float32"),
    ("attention_factor", {"rope_scaling": {**_YARN_FAR, "attention_factor": 1e300}},
     r"rope_scaling\['attention_factor'\]=1e\+300.*past float32's range"),
    ("attention_factor_squared", {"rope_scaling": {**_YARN_FAR, "attention_factor": 1e30}},
     r"rope_scaling\['attention_factor'\]=1e\+30.*square"),
    ("mscale", {"rope_scaling": {**_YARN_FAR, "mscale": 1e308, "mscale_all_dim": 1.0}},
     r"rope_scaling\['mscale'\]=1e\+308.*attention factor"),
    ("longrope_original_1", {"rope_scaling": {**_LONG, "original_max_position_embeddings": 1}},
     r"rope_scaling\['original_max_position_embeddings'\]=1 .*ln\(original"),
    ("short_factor", {"rope_scaling": {**_LONG, "short_factor": [1e-45] * 4}},
     r"rope_scaling\['short_factor'\]=.*not finite"),
    ("yarn_theta_1", {"rope_theta": 1.0, "rope_scaling": _YARN_FAR},
     r"rope_theta=1.0 with rope_scaling of type 'yarn'.*ln\(rope_theta\) = 0"),
    ("dynamic_head_dim_2", {"head_dim": 2, "rope_scaling": {"rope_type": "dynamic",
                                                           "factor": 2.0}},
     r"head_dim=2 with rope_scaling of type 'dynamic'.*division by zero"),
]


@pytest.mark.parametrize("fields, match", [c[1:] for c in NON_FINITE],
                         ids=[c[0] for c in NON_FINITE])
def test_non_finite_tables_are_refused_by_field(fields: dict, match: str) -> None:
    hf = {**_HF, **fields}  # config.json spells these three as the fields
    built = [lambda: DecoderConfig(**fields), lambda: DecoderConfig.from_hf(hf)]
    # transformers 5's own spelling: the rotary base inside rope_parameters
    rope = {"rope_type": "default", **fields.get("rope_scaling", {})}
    rope["rope_theta"] = fields.get("rope_theta", 10000.0)
    built.append(lambda: DecoderConfig.from_hf(
        {**{k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta")},
         "rope_parameters": rope}))
    for build in built:
        with pytest.raises(ns.UsageError, match=match) as info:
            build()
        assert "Fix:" in str(info.value)


@pytest.mark.slow
def test_the_first_forward_of_a_refused_config_was_nan() -> None:
    # What the check guards against: the same values, past it, give NaN logits.
    cfg = DecoderConfig(rope_theta=1e6)
    object.__setattr__(cfg, "rope_theta", 1e-50)
    with np.errstate(all="ignore"):
        logits = Decoder(cfg, rngs=nnx.Rngs(0))(jnp.ones((1, 4), jnp.int32))
    assert np.isnan(np.asarray(logits)).all()


def test_every_published_and_fixture_config_passes_the_table_check() -> None:
    from nnx_shard.models import CONFIGS

    for cfg in CONFIGS.values():
        if isinstance(cfg, DecoderConfig):
            rope.check_tables(cfg)  # no error: each named config stays buildable
    for kind in TYPES:
        rope.check_tables(DecoderConfig.from_hf(FIXTURES / kind))
    # near the edges, still finite: a large but real base, a factor near 1
    DecoderConfig(rope_theta=1e12, rope_scaling={**_YARN_FAR, "attention_factor": 1e3})
    DecoderConfig(head_dim=4, rope_scaling={"rope_type": "dynamic", "factor": 64.0})


def test_yarn_defaults_as_transformers() -> None:
    # a null factor is max / original; mscale and mscale_all_dim set the attention
    # factor (DeepSeek: equal, so 1); a missing original context is max_position_embeddings
    cfg = DecoderConfig.from_hf({**_HF, "rope_scaling": {**_YARN, "factor": None}})
    assert rope.frequencies(cfg)[1] == pytest.approx(0.1 * np.log(4.0) + 1)
    deepseek = DecoderConfig.from_hf({**_HF, "rope_scaling": {
        **_YARN, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}})
    assert rope.frequencies(deepseek)[1] == 1.0
    bare = DecoderConfig.from_hf({**_HF, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    assert dict(bare.rope_scaling)["original_max_position_embeddings"] == 64


@pytest.mark.slow
def test_per_token_positions_choose_by_the_highest() -> None:
    # a padding mask gives per-token positions: the sequence length is the highest + 1,
    # so an all-ones mask computes what the static length does, on both sides of the
    # longrope threshold
    model = _loaded("longrope")
    mesh, rules = _mesh_rules()
    want = _expected("longrope")
    for tag in ("short", "long"):
        tokens = want[f"tokens_{tag}"]
        with ns.use(mesh, rules):
            masked = np.asarray(model(tokens, attention_mask=np.ones_like(tokens)))
        assert_close(masked, want[f"logits_{tag}"], RTOL, f"longrope {tag} masked")
