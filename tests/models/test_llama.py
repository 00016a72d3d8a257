"""nnx_shard.models.Decoder: the model and its configuration.

Values against transformers' own logits are in tests/hf/test_hf.py (the fixtures);
here: shapes, causality, grouped-query attention against multi-head attention
with repeated key/value weights, stacked layers against unrolled ones, remat,
``config.json`` parsing, the named configurations' parameter counts against
the published ones. The model under the presets against one device is a row of the
preset matrix in tests/test_strategies.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard.models import CONFIGS, Decoder, DecoderConfig, get_config, lm_loss
from nnx_shard.models._rotary import rope_frequencies
from tests._close import assert_close
from tests.conftest import needs_devices


def _model(cfg: DecoderConfig, seed: int = 0) -> Decoder:
    return Decoder(cfg, rngs=nnx.Rngs(seed))


def _tokens(batch: int = 2, length: int = 16, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, 128, jnp.int32)


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_shapes_dtypes_and_names(name: str) -> None:
    cfg = get_config(name)
    model = _model(cfg)
    logits = nnx.eval_shape(lambda m: m(_tokens()), model)  # traced: no value is checked
    assert logits.shape == (2, 16, 128) and logits.dtype == jnp.float32
    params = nnx.state(model, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params
    attn = model.blocks[0].attn
    assert attn.q.get_value().shape == (cfg.embed, cfg.heads, cfg.head_dim)
    assert attn.k.get_value().shape == (cfg.embed, cfg.kv_heads, cfg.head_dim)
    assert attn.o.get_metadata("out_sharding") == ("heads", "kv", "embed")
    assert (attn.q_norm is not None) == (cfg.family.qk_norm is not None)
    assert (model.unembed is None) == cfg.tie_embeddings


def test_causal() -> None:
    model = _model(get_config("llama-tiny"))
    forward = nnx.jit(lambda m, t: m(t))
    a, b = _tokens(seed=0), _tokens(seed=1)
    mixed = jnp.concatenate([a[:, :9], b[:, 9:]], axis=1)
    np.testing.assert_array_equal(forward(model, a)[:, :9], forward(model, mixed)[:, :9])
    assert not np.allclose(forward(model, a)[:, 9:], forward(model, mixed)[:, 9:])


def test_grouped_query_attention_is_multi_head_with_shared_kv() -> None:
    # Query head h reads key/value head h // (heads / kv_heads): a multi-head
    # model whose K/V weights repeat each group's computes the same logits.
    gqa_cfg = get_config("llama-tiny")
    gqa = _model(gqa_cfg)
    mha = _model(dataclasses.replace(gqa_cfg, kv_heads=gqa_cfg.heads))
    group = gqa_cfg.heads // gqa_cfg.kv_heads
    nnx.update(mha, nnx.state(gqa, nnx.Not(nnx.PathContains("attn"))))
    for g_block, m_block in zip(gqa.blocks, mha.blocks, strict=True):
        for w in ("q", "o"):
            getattr(m_block.attn, w).set_value(getattr(g_block.attn, w).get_value())
        for w in ("k", "v"):
            getattr(m_block.attn, w).set_value(
                jnp.repeat(getattr(g_block.attn, w).get_value(), group, axis=1))
    forward = nnx.jit(lambda m, t: m(t))  # one program (eagerly, each op compiles its own)
    assert_close(forward(mha, _tokens()), forward(gqa, _tokens()), 1e-6, "logits")


def _stack(unrolled: Decoder, scanned: Decoder) -> None:
    per_layer = [nnx.state(b, nnx.Param) for b in unrolled.blocks]
    nnx.update(scanned.blocks, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer))
    nnx.update(scanned, nnx.state(unrolled, nnx.Not(nnx.PathContains("blocks"))))


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_scan_layers_equals_unrolled(remat: str) -> None:
    cfg = get_config("qwen3-tiny")
    unrolled = _model(cfg)
    scanned = _model(dataclasses.replace(cfg, scan_layers=True, remat=remat))
    _stack(unrolled, scanned)
    batch = {"inputs": _tokens(), "targets": _tokens(seed=3)}
    # Compiled: op by op, the unrolled model's backward pass compiles each op alone.
    grad = nnx.jit(nnx.value_and_grad(lm_loss))
    loss_u, g_u = grad(unrolled, batch)
    loss_s, g_s = grad(scanned, batch)
    assert_close(loss_s, loss_u, 1e-6, "loss")
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[g_u["blocks"][i] for i in range(2)])
    assert_close(g_s["blocks"], stacked, 1e-5, "block grads")
    assert_close(g_s["token_embed"], g_u["token_embed"], 1e-5, "embedding grads")


def test_bfloat16_compute() -> None:
    cfg = dataclasses.replace(get_config("llama-tiny"), dtype=jnp.bfloat16)
    f32 = _model(get_config("llama-tiny"))
    bf16 = _model(cfg)
    forward = nnx.jit(lambda m, t: m(t))  # one program (eagerly, each op compiles its own)
    logits = forward(bf16, _tokens())
    assert logits.dtype == jnp.float32
    assert_close(logits, forward(f32, _tokens()), 0.05, "bf16 logits")


# --------------------------------------------------------------------------- attention kernels


def _kernel_grads(cfg: DecoderConfig, kernel: str, length: int) -> tuple[jax.Array, ...]:
    model = _model(dataclasses.replace(cfg, attention=kernel))
    batch = {"inputs": _tokens(1, length, seed=1), "targets": _tokens(1, length, seed=2)}
    # Compiled, as training runs them (op by op, each op of the kernels compiles alone).
    logits = nnx.jit(lambda m, t: m(t))(model, batch["inputs"])
    loss, grads = nnx.jit(nnx.value_and_grad(lm_loss))(model, batch)
    return logits, loss, grads


@pytest.mark.slow  # the kernel itself: tests/test_blockwise.py's quick tier
@pytest.mark.parametrize("length", [
    37,  # odd: one tile
    600,  # two 512-blocks, the second padded
])
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_blockwise_equals_dense(name: str, length: int) -> None:
    # Grouped-query attention (4 heads, 2 kv heads) with K/V kept at kv_heads, causal,
    # rotary (and Qwen3's q/k norm): logits, loss and every gradient of the two kernels.
    cfg = get_config(name)
    assert cfg.attention == "auto"  # the memory-efficient default (blockwise on CPU)
    dense = _kernel_grads(cfg, "dense", length)
    blockwise = _kernel_grads(cfg, "blockwise", length)
    assert_close(blockwise[0], dense[0], 1e-5, "logits")
    assert_close(blockwise[1], dense[1], 1e-6, "loss")
    assert_close(blockwise[2], dense[2], 1e-5, "grads")


def test_attention_kernel_config() -> None:
    with pytest.raises(ValueError, match=r"DecoderConfig.attention='flash' is not an attention "
                       r"kernel; valid: 'auto', 'blockwise', 'dense', 'cudnn'\."):
        DecoderConfig(attention="flash")
    # K/V reach the op with kv_heads: no [batch, length, heads, head_dim] copy of them.
    cfg = dataclasses.replace(get_config("llama-tiny"), attention="dense")
    shapes = []

    def spy(q, k, v, **kw):
        shapes.append((q.shape, k.shape, v.shape, kw["implementation"]))
        return ns.models.attention(q, k, v, **kw)

    import nnx_shard.models._decoder_layers as llama_module

    model = _model(cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama_module, "attention", spy)
        model(_tokens(2, 16))
    assert shapes[0] == ((2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8), "dense")


def test_activation_formula_counts_grouped_kv_and_swiglu() -> None:
    from nnx_shard.models._memory import activation_bytes

    cfg = get_config("llama-tiny")  # embed 32, 4 heads / 2 kv heads x 8, mlp 64, vocab 128
    tokens = 4 * 16 // 2            # batch over data=2
    p = 4                           # float32 activations
    layer = p * (4 * 32 + 2 * 4 * 8 + 2 * 2 * 8 + 4 * 64) + 4 * 4  # log-sum-exp 4h; SwiGLU 4m
    edges = 2 * p * 32 + 8 * 128
    rules = ns.Rules({"batch": "data"})
    assert activation_bytes(cfg, rules, {"data": 2}, 4, 16) == tokens * (2 * layer + edges)
    dense = dataclasses.replace(cfg, attention="dense")  # float32 probabilities 4hs
    assert activation_bytes(dense, rules, {"data": 2}, 4, 16) == tokens * (
        2 * (layer + 4 * 4 * 16 - 4 * 4) + edges)


# --------------------------------------------------------------------------- config.json


HF = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 4096,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


def test_from_hf_reads_a_config_file_and_transformers_5_rope_parameters(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF))
    cfg = DecoderConfig.from_hf(tmp_path)
    assert (cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp) == (32, 4, 2, 8, 64)
    assert dict(cfg.rope_scaling)["factor"] == 8.0 and cfg.family.qk_norm is None
    v5 = {k: v for k, v in HF.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**HF["rope_scaling"], "rope_theta": 500000.0}
    assert DecoderConfig.from_hf(v5) == cfg
    assert DecoderConfig.from_hf(tmp_path / "config.json", scan_layers=True).scan_layers
    assert DecoderConfig.from_hf(cfg.to_hf()) == cfg


def test_llama3_rope_scaling_bands() -> None:
    # head_dim 8, theta 5e5: wavelengths 6.3, 167, 4443, 118k tokens; with the
    # original context 8192 and factors 1 / 4 the first two stay, the last is
    # divided by 8 and the third interpolated between.
    cfg = DecoderConfig.from_hf(HF)
    plain = rope_frequencies(dataclasses.replace(cfg, rope_scaling=None))
    scaled = rope_frequencies(cfg)
    np.testing.assert_array_equal(scaled[:2], plain[:2])
    np.testing.assert_allclose(scaled[3], plain[3] / 8, rtol=1e-6)
    assert plain[2] / 8 < scaled[2] < plain[2]


@pytest.mark.parametrize("change, match", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not a Llama-family model"),
    ({"rope_scaling": {"rope_type": "ntk", "factor": 4.0}},
     "rope_scaling of type 'ntk' is not implemented"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 4,
      "max_window_layers": 1}, "sliding-window attention in some layers only"),
    ({"use_sliding_window": True}, "sliding-window attention layers"),
    ({"num_key_value_heads": 3}, "kv_heads=3 must divide heads=4"),
])
def test_from_hf_errors(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DecoderConfig.from_hf(HF | change)



# config.json values transformers would refuse (or read otherwise): each is one
# NnxShardError naming the field, never a config built from a guess.
_ROPE = HF["rope_scaling"]
BAD_CONFIGS = [
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"head_dim": 0}, "head_dim"),
    ({"hidden_size": 32.7}, r"hidden_size must be a positive int, got 32.7 \(float\)"),
    ({"num_attention_heads": 4.0}, "num_attention_heads"),
    ({"num_hidden_layers": True}, r"num_hidden_layers must be a positive int, got True "
     r"\(a bool\)"),
    ({"vocab_size": None}, "vocab_size"),
    ({"vocab_size": -5}, "vocab_size"),
    ({"intermediate_size": "64"}, "intermediate_size"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings must be true or false, got "
     r"'false' \(str\)"),
    ({"attention_bias": 1}, "attention_bias"),
    ({"mlp_bias": "no"}, "mlp_bias"),
    ({"use_sliding_window": "false"}, "use_sliding_window"),
    ({"layer_types": 5}, "layer_types"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"rope_theta": "10000"}, r"rope_theta must be a finite number > 0, got '10000'"),
    ({"rope_theta": float("inf")}, "rope_theta"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"rope_scaling": "llama3"}, r"rope_scaling must be an object \(or null\), got 'llama3'"),
    ({"rope_scaling": {**_ROPE, "factor": 0}}, r"rope_scaling\['factor'\] must be"),
    ({"rope_scaling": {**_ROPE, "factor": -8.0}}, r"rope_scaling\['factor'\]"),
    ({"rope_scaling": {**_ROPE, "factor": float("nan")}}, r"rope_scaling\['factor'\]"),
    ({"rope_scaling": {**_ROPE, "factor": "8"}}, r"rope_scaling\['factor'\]"),
    ({"rope_scaling": {**_ROPE, "original_max_position_embeddings": 0}},
     r"rope_scaling\['original_max_position_embeddings'\] must be a positive int"),
    ({"rope_scaling": {**_ROPE, "original_max_position_embeddings": 8192.5}},
     r"rope_scaling\['original_max_position_embeddings'\]"),
    ({"rope_scaling": {**_ROPE, "low_freq_factor": 4.0}},
     r"high_freq_factor'\] \(4.0\) must be greater than rope_scaling\['low_freq_factor'\] "
     r"\(4.0\)"),
    ({"rope_scaling": {**_ROPE, "low_freq_factor": 0}}, r"rope_scaling\['low_freq_factor'\]"),
    ({"rope_scaling": {**_ROPE, "high_freq_factor": None}},
     r"rope_scaling\['high_freq_factor'\]"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks"),
    ({"rope_scaling": {"rope_type": 3}}, "rope_type 3"),
    ({"rope_scaling": {"rope_type": "su", "factor": 2.0}},
     "rope_scaling of type 'su' is not implemented"),
    ({"rope_scaling": {"rope_type": "linear"}}, r"type 'linear' lacks \['factor'\]"),
    ({"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    # transformers 5: rope_parameters, rope_theta inside it or beside it
    ({"rope_scaling": None, "rope_parameters": "yarn"},
     r"rope_parameters must be an object \(or null\)"),
    ({"rope_scaling": None, "rope_theta": None,
      "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                          "beta_slow": 1.0, "original_max_position_embeddings": 4096.5}},
     r"rope_parameters\['original_max_position_embeddings'\]"),
    ({"rope_scaling": None, "rope_parameters": {**_ROPE, "factor": 0.0}},
     r"rope_parameters\['factor'\]"),
]


@pytest.mark.parametrize("change, match", BAD_CONFIGS,
                         ids=[f"{i}-{next(iter(c))}" for i, (c, _) in enumerate(BAD_CONFIGS)])
def test_from_hf_refuses_values_transformers_would(change: dict, match: str) -> None:
    with pytest.raises(ns.NnxShardError, match=match) as info:
        DecoderConfig.from_hf(HF | change)
    assert str(info.value).startswith("config.json: ") and "Fix:" in str(info.value)


def test_from_hf_keeps_llama3_scaling_whatever_holds_rope_theta() -> None:
    # transformers 5 reads rope_theta from rope_parameters, else beside it, else 10000.
    base = {k: v for k, v in HF.items() if k not in ("rope_theta", "rope_scaling")}
    want = DecoderConfig.from_hf(HF)
    beside = DecoderConfig.from_hf(base | {"rope_theta": 500000.0, "rope_parameters": _ROPE})
    assert beside == want
    default = DecoderConfig.from_hf(base | {"rope_parameters": _ROPE})
    assert default.rope_theta == 10000.0 and default.rope_scaling == want.rope_scaling
    # the 'type' spelling of older files, and original_max_position_embeddings taken
    # from max_position_embeddings when the scaling leaves it out, as transformers does
    old = {k: v for k, v in _ROPE.items() if k not in ("rope_type",
                                                       "original_max_position_embeddings")}
    cfg = DecoderConfig.from_hf(HF | {"rope_scaling": {**old, "type": "llama3"}})
    assert dict(cfg.rope_scaling)["original_max_position_embeddings"] == 4096
    assert np.isfinite(rope_frequencies(cfg)).all()
    # a qwen3 file nests its one parameter set under its layer type
    q = {**HF, "model_type": "qwen3", "rope_scaling": None,
         "layer_types": ["full_attention"] * 2,
         "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}}
    assert DecoderConfig.from_hf(q).rope_theta == 1e6


@pytest.mark.parametrize("text, match", [
    ("{not json", "is not JSON"),
    ("[1, 2]", r"is a list \(\[1, 2\]\), not a JSON object"),
    ("null", "is a null"),
    ('{"model_type": "llama", "vocab_size": NaN}', "NaN"),
    (b"\xff\xfe", "not UTF-8"),
])
def test_config_files_that_are_not_configs(tmp_path, text, match) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ns.NnxShardError, match=match) as info:
        DecoderConfig.from_hf(tmp_path)
    assert str(path) in str(info.value) and "Fix:" in str(info.value)
    with pytest.raises(ns.NnxShardError, match="config must be"):
        DecoderConfig.from_hf(5)  # type: ignore[arg-type]


def test_rope_scaling_given_directly_is_checked_too() -> None:
    with pytest.raises(ns.NnxShardError, match=r"rope_scaling\['factor'\] must be"):
        DecoderConfig(rope_scaling={**_ROPE, "factor": 0.0})


# Published totals (billions): Llama 3.1 model cards (8.03, 70.6, 405.9); Qwen3-0.6B's
# card: 0.6 in all, 0.44 without embeddings (its 151936 x 1024 embedding is tied).
# Mistral-7B-v0.1: 7.24; Qwen2.5-7B's card: 7.61 (7.62 as commonly rounded up); Gemma 2
# 9B: 9.24 (9,241,705,984 from the shapes: a 917.5M tied embedding and 42 blocks of
# 198.2M).
PUBLISHED = {"llama3-8b": (8.03, 0.005), "llama3-70b": (70.6, 0.05),
             "llama3-405b": (405.9, 0.05), "qwen3-0.6b": (0.60, 0.005),
             "mistral-7b": (7.24, 0.005), "qwen2.5-7b": (7.62, 0.01),
             "gemma2-9b": (9.24, 0.005)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_named_configs_have_published_parameter_counts(name: str) -> None:
    cfg = get_config(name)
    abstract = nnx.eval_shape(lambda: _model(cfg))  # nothing allocated
    params = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in params)
    count = sum(x.size for x in params)
    assert count == cfg.num_params
    want, tol = PUBLISHED[name]
    assert abs(count / 1e9 - want) <= tol, count
    if name == "qwen3-0.6b":
        assert abs((count - cfg.vocab * cfg.embed) / 1e9 - 0.44) < 0.005
    if name == "gemma2-9b":
        assert count == 9_241_705_984


def test_named_configs() -> None:
    llama = sorted(n for n, c in CONFIGS.items() if isinstance(c, DecoderConfig))
    assert llama == sorted(["llama-tiny", "qwen3-tiny", "llama3-8b", "llama3-70b",
                            "llama3-405b", "qwen3-0.6b", "mistral-7b", "qwen2.5-7b", "gemma2-9b",
                            "mixtral-8x7b", "qwen3-30b-a3b"])
    g = get_config("gemma2-9b")
    assert g.local_layers()[:3] == (True, False, True) and sum(g.local_layers()) == 21
    assert DecoderConfig.from_hf(g.to_hf(), scan_layers=True, dtype=g.dtype,
                               param_dtype=g.param_dtype) == g
    q = get_config("qwen3-0.6b")
    assert (q.head_dim, q.kv_heads, q.tie_embeddings, q.family.qk_norm) == (128, 8, True, "head")
    assert dict(get_config("llama3-405b").rope_scaling)["factor"] == 8.0
    with pytest.raises(ns.UsageError, match="Did you mean 'llama3-8b'"):
        get_config("llama3-8B")


@needs_devices(8)
def test_kv_heads_follow_heads_where_they_divide() -> None:
    factory = functools.partial(_model, get_config("llama-tiny"))  # 4 heads, 2 kv heads
    on2 = ns.abstract_init(factory, "data=4,model=2", ns.strategies.get("fsdp_tp"))
    assert on2.blocks[0].attn.k.get_value().sharding.spec == P("data", "model", None)
    on4 = ns.abstract_init(factory, "data=2,model=4", ns.strategies.get("tp"))
    assert on4.blocks[0].attn.k.get_value().sharding.spec == P(None, None, None)
    assert on4.blocks[0].attn.q.get_value().sharding.spec == P(None, "model", None)


@functools.cache
def _gqa_reference() -> tuple:
    """llama-tiny's logits, loss and gradients on one device for the batch of
    :func:`test_query_heads_split_past_the_kv_heads`: one program for both axis types
    (eagerly, each op compiles a program of its own)."""
    tokens = _tokens()
    batch = {"inputs": tokens, "targets": _tokens(seed=3)}
    return nnx.jit(lambda m: (m(tokens), nnx.value_and_grad(lm_loss)(m, batch)))(
        _model(get_config("llama-tiny")))


@needs_devices(8)
@pytest.mark.slow
@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
def test_query_heads_split_past_the_kv_heads(axis_types: str) -> None:
    # 2 kv heads, 4 query heads over model=4: the rules replicate K/V, the op hands each
    # device the key/value head of its query head; logits and gradients as on one device.
    cfg = get_config("llama-tiny")
    tokens = _tokens()
    batch = {"inputs": tokens, "targets": _tokens(seed=3)}
    want_logits, (want_loss, want_grads) = _gqa_reference()
    s = ns.strategies.get("tp")
    mesh = ns.make_mesh("data=2,model=4", axis_types=axis_types)
    model = ns.sharded_init(functools.partial(_model, cfg), mesh, s)
    with ns.use(mesh, s.rules):
        logits = nnx.jit(lambda m, t: m(t))(model, tokens)
        loss, grads = nnx.jit(nnx.value_and_grad(lm_loss))(model, batch)
    assert_close(logits, want_logits, 1e-5, "logits")
    assert_close(loss, want_loss, 1e-6, "loss")
    assert_close(jax.tree.map(np.asarray, nnx.to_pure_dict(grads)),
                 nnx.to_pure_dict(want_grads), 1e-5, "grads")


@pytest.mark.parametrize("field, value, words", [
    ("remat", "everything", "DecoderConfig.remat='everything' is not a remat policy; valid: "),
    ("attention", "flash", "DecoderConfig.attention='flash' is not an attention kernel; valid: "),
])
def test_llama_config_refuses_an_unknown_remat_policy_or_kernel_naming_itself(field, value, words):
    with pytest.raises(ValueError) as e:
        dataclasses.replace(get_config("llama-tiny"), **{field: value})
    assert str(e.value).startswith(words), str(e.value)
