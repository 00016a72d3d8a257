"""The reference transformer: shapes, causality, stacked layers, mixture of
experts, tied embeddings, configuration errors and 7B-class planning shapes."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard.models import Decoder, ReferenceConfig, get_config, lm_loss
from nnx_shard.models._moe import DecoderMoE as MoE
from nnx_shard.models._ops import cross_entropy
from tests._close import assert_close
from tests.conftest import needs_devices

TINY = get_config("tiny")


def _tokens(cfg: ReferenceConfig, batch: int = 2, length: int | None = None, seed: int = 0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, cfg.vocab, size=(batch, length or cfg.length)), jnp.int32)


def _count(model_or_state) -> int:
    state = nnx.state(model_or_state, nnx.Param)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


@pytest.fixture(scope="module")
def tiny() -> Decoder:
    return Decoder(TINY, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tiny_logits(tiny: Decoder) -> np.ndarray:
    """The unsharded model's logits for ``_tokens(TINY)``, computed once."""
    return np.asarray(tiny(_tokens(TINY)))


def test_shapes_and_dtypes(tiny: Decoder) -> None:
    logits, aux = nnx.jit(lambda m, t: m.forward(t))(tiny, _tokens(TINY))
    assert logits.shape == (2, TINY.length, TINY.vocab) and logits.dtype == jnp.float32
    assert aux.shape == () and float(aux) == 0.0  # dense MLP: no balancing loss
    # Shorter sequences use the first positions.
    short = nnx.eval_shape(lambda m: m(_tokens(TINY, batch=3, length=5)), tiny)  # traced
    assert short.shape == (3, 5, TINY.vocab)
    assert _count(tiny) == TINY.num_params
    assert tiny.blocks[0].mlp.up.get_value().shape == (TINY.embed, TINY.mlp)
    assert tiny.blocks[0].attn.o.get_metadata("out_sharding") == ("heads", "kv", "embed")


def test_too_long_sequence(tiny: Decoder) -> None:
    with pytest.raises(ValueError, match="length 17 but the model has 16 positions"):
        tiny(_tokens(TINY, length=17))


def test_causal(tiny: Decoder) -> None:
    fwd = nnx.jit(lambda m, t: m(t))
    tokens = _tokens(TINY, batch=1)
    t = 9
    changed = tokens.at[0, t].set((tokens[0, t] + 1) % TINY.vocab)
    a, b = np.asarray(fwd(tiny, tokens)), np.asarray(fwd(tiny, changed))
    np.testing.assert_array_equal(a[:, :t], b[:, :t])  # the past does not see the future
    assert np.abs(a[:, t:] - b[:, t:]).max(axis=-1).min() > 1e-4  # the present and future do


def test_loss_is_next_token_cross_entropy(tiny: Decoder) -> None:
    tokens = _tokens(TINY, length=TINY.length + 1)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    logits = tiny(batch["inputs"])
    want = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    np.testing.assert_allclose(float(lm_loss(tiny, batch)), float(want), rtol=1e-6)
    # Near log(vocab) at init: the unembedding starts small.
    assert abs(float(want) - math.log(TINY.vocab)) < 1.0


def _stack_blocks(unrolled: Decoder, scanned: Decoder) -> None:
    """Copies the unrolled model's parameters into the scanned one (blocks stacked)."""
    per_layer = [nnx.state(b, nnx.Param) for b in unrolled.blocks]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
    nnx.update(scanned.blocks, stacked)
    for name in ("token_embed", "pos_embed", "unembed"):
        getattr(scanned, name).set_value(getattr(unrolled, name).get_value())
    scanned.final_norm.scale.set_value(unrolled.final_norm.scale.get_value())


@pytest.mark.parametrize("experts", [0, 4])
def test_scan_layers_equals_unrolled(experts: int) -> None:
    cfg = dataclasses.replace(TINY, layers=3, experts=experts)
    unrolled = Decoder(cfg, rngs=nnx.Rngs(1))
    scanned = Decoder(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(2))
    q = scanned.blocks.attn.q
    assert q.get_value().shape == (3, cfg.embed, cfg.heads, cfg.head_dim)
    assert q.get_metadata("out_sharding") == ("layers", "embed", "heads", "kv")
    assert _count(scanned) == cfg.num_params
    tokens = _tokens(cfg)
    before = np.asarray(scanned(tokens))
    _stack_blocks(unrolled, scanned)
    (lu, au), (ls, as_) = unrolled.forward(tokens), scanned.forward(tokens)
    assert np.abs(before - np.asarray(ls)).max() > 1e-3  # the copy changed something
    assert_close(ls, lu, 1e-5, "logits")
    np.testing.assert_allclose(float(as_), float(au), rtol=1e-5)


@needs_devices(8)
def test_scan_layers_shard_with_layers_axis() -> None:
    # The stacked axis is named, so optimizer state and strategies see 4-D specs.
    cfg = dataclasses.replace(TINY, scan_layers=True)
    s = ns.strategies.get("fsdp_tp")
    model = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), "data=4,model=2", s)
    assert model.blocks.attn.q.get_value().sharding.spec == jax.sharding.PartitionSpec(
        None, "data", "model", None)
    rules = s.rules | {"layers": "data", "embed": None}
    m2 = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), "data=2,model=4", rules)
    assert m2.blocks.mlp.up.get_value().sharding.spec == jax.sharding.PartitionSpec(
        "data", None, "model")


# --------------------------------------------------------------------------- MoE


def test_moe_forward_and_aux_loss() -> None:
    cfg = get_config("tiny_moe")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = _tokens(cfg, length=cfg.length + 1)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    logits, aux = model.forward(batch["inputs"])
    assert logits.shape == (2, cfg.length, cfg.vocab)
    # experts * sum_e(fraction routed * mean prob) is 1 when perfectly balanced, >0 always.
    assert 0.5 < float(aux) < cfg.experts
    ce = cross_entropy(logits, batch["targets"]).mean()
    assert float(lm_loss(model, batch)) == pytest.approx(
        float(ce) + cfg.aux_loss_weight * float(aux), rel=1e-6)
    assert _count(model) == cfg.num_params
    assert model.blocks[0].mlp.up.get_metadata("out_sharding") == ("expert", "embed", "mlp")


@pytest.mark.parametrize("capacity_factor", [0.25, 1.0])
def test_moe_routing_respects_capacity(capacity_factor: float) -> None:
    cfg = dataclasses.replace(get_config("tiny_moe"), capacity_factor=capacity_factor)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, cfg.length, cfg.embed))
    dispatch, combine = (np.asarray(a) for a in moe.capacity_route(x)[:2])
    capacity = math.ceil(cfg.top_k * cfg.length * capacity_factor / cfg.experts)
    assert dispatch.shape == (4, cfg.length, cfg.experts, capacity)
    assert set(np.unique(dispatch)) <= {0.0, 1.0}
    assert dispatch.sum(axis=1).max() == 1  # a slot holds at most one token
    per_expert = dispatch.sum(axis=(1, 3))  # [batch, experts]
    assert per_expert.max() <= capacity
    per_token = dispatch.sum(axis=(2, 3))
    assert per_token.max() <= cfg.top_k
    if capacity_factor < 1:
        assert per_expert.max() == capacity and per_token.sum() < 4 * cfg.length * cfg.top_k
    # Combine weights sit exactly where tokens were dispatched.
    assert ((combine > 0) == (dispatch > 0)).all()
    kept_all = per_token == cfg.top_k
    np.testing.assert_allclose(combine.sum(axis=(2, 3))[kept_all], 1.0, rtol=1e-6)


def test_moe_equals_dense_mixture_when_nothing_dropped() -> None:
    # With capacity for every token, the layer is sum_k gate_k * expert_k(x).
    cfg = get_config("tiny_moe")
    # Capacity ceil(top_k * length * 2.0 / experts) = length: no expert can overflow.
    assert math.ceil(cfg.top_k * cfg.length * cfg.capacity_factor / cfg.experts) == cfg.length
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (2, cfg.length, cfg.embed))
    out, _ = moe(x)
    probs = jax.nn.softmax(x @ moe.router[...], axis=-1)
    gates, idx = jax.lax.top_k(probs, cfg.top_k)
    gates = gates / gates.sum(-1, keepdims=True)
    experts = jnp.stack([jax.nn.gelu(x @ moe.up[...][e]) @ moe.down[...][e]
                         for e in range(cfg.experts)], axis=2)  # [b, l, x, e]
    picked = jnp.take_along_axis(experts, idx[..., None], axis=2)  # [b, l, k, e]
    want = jnp.sum(picked * gates[..., None], axis=2)
    assert_close(out, want, 1e-5, "moe output")


# --------------------------------------------------------------------------- tied


@pytest.mark.slow
def test_tied_embeddings() -> None:
    cfg = dataclasses.replace(TINY, tie_embeddings=True)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    assert model.unembed is None
    assert "unembed" not in nnx.state(model, nnx.Param)
    assert _count(model) == cfg.num_params == TINY.num_params - TINY.embed * TINY.vocab
    # The output projection is the token embedding: editing the row of a token that
    # is not in the input changes that token's logits, and only those.
    tokens = jnp.zeros((1, cfg.length), jnp.int32)
    forward = nnx.jit(lambda m, t: m(t))  # one program (eagerly, each op compiles its own)
    before = np.asarray(forward(model, tokens))
    table = model.token_embed.get_value()
    model.token_embed.set_value(table.at[7].multiply(2.0))
    after = np.asarray(forward(model, tokens))
    assert np.abs(after[..., 7] - before[..., 7]).min() > 1e-4
    np.testing.assert_allclose(np.delete(after, 7, -1), np.delete(before, 7, -1), atol=1e-6)
    # Gradients of the tied table come from both ends.
    batch = {"inputs": tokens, "targets": tokens}
    grads = nnx.jit(nnx.grad(lm_loss))(model, batch)
    assert float(jnp.abs(grads["token_embed"][...][7]).sum()) > 0


def test_bfloat16_config() -> None:
    cfg = dataclasses.replace(TINY, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    assert model.blocks[0].attn.q.get_value().dtype == jnp.bfloat16
    # The dtype the forward pass gives: traced for shapes, nothing to compute.
    assert nnx.eval_shape(lambda m: m(_tokens(cfg)), model).dtype == jnp.float32


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"heads": 0}, "heads must be >= 1"),
        ({"layers": -1}, "layers must be >= 1"),
        ({"experts": -2}, "need experts >= 0"),
        ({"experts": 4, "top_k": 5}, "1 <= top_k <= experts"),
        ({"experts": 4, "top_k": 0}, "1 <= top_k <= experts"),
    ],
)
def test_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReferenceConfig(**kwargs)


def test_get_config() -> None:
    transformers = {n for n, c in ns.models.CONFIGS.items()
                    if isinstance(c, ns.models.ReferenceConfig)}
    assert transformers == {"tiny", "tiny_moe", "small", "125m", "1b", "7b"}
    assert get_config("tiny") is ns.models.CONFIGS["tiny"]
    assert isinstance(get_config("llama-tiny"), ns.models.DecoderConfig)
    with pytest.raises(ns.UsageError, match=r"unknown model config 'huge'\. Known: tiny, "):
        get_config("huge")
    with pytest.raises(ns.UsageError, match="name must be a config name"):
        get_config(7)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.layers = 3  # type: ignore[misc]


def test_7b_abstract_without_allocation() -> None:
    cfg = get_config("7b")
    e, v, m, layers = 4096, 32000, 16384, 32
    want = v * e + 4096 * e + layers * (4 * e * 32 * 128 + 2 * e * m + 2 * e) + e + e * v
    assert cfg.num_params == want == 6_721_638_400
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(math.prod(x.shape) for x in leaves) == want
    assert model.blocks.mlp.up.get_value().shape == (layers, e, m)
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}


@needs_devices(8)
def test_7b_planned_under_fsdp() -> None:
    s = ns.strategies.get("fsdp")
    model = ns.abstract_init(lambda: Decoder(get_config("7b"), rngs=nnx.Rngs(0)), "data=8", s)
    assert all(isinstance(x, jax.ShapeDtypeStruct)
               for x in jax.tree.leaves(nnx.state(model)))
    report = ns.explain(model, "data=8", s, optax.adam(1e-4))
    assert report.total_bytes == 2 * get_config("7b").num_params  # bf16
    assert report.param_bytes_per_device == report.total_bytes // 8
    assert report.opt_bytes_per_device == 2 * report.total_bytes // 8 + 4


@needs_devices(8)
@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
@pytest.mark.parametrize("name", ["fsdp_tp", "sp"])  # fsdp's data split is fsdp_tp's too
def test_sharded_model_runs_under_plain_jit_without_rules(
    tiny_logits: np.ndarray, name: str, axis_types: str
) -> None:
    # Restored or sharded models are called for inference outside ns.use: parameters
    # sharded over Explicit axes are gathered, values equal the unsharded model.
    s = ns.strategies.get(name)
    mesh = s.make_mesh(8, axis_types=axis_types)
    model = ns.sharded_init(lambda: Decoder(TINY, rngs=nnx.Rngs(0)), mesh, s)
    tokens = _tokens(TINY)
    out = nnx.jit(lambda m, t: m(t))(model, tokens)
    assert_close(out, tiny_logits, 1e-5, "logits")
    assert model.blocks[0].mlp.up.get_value().sharding.spec[0] == ("data" if name != "sp" else None)


def test_lm_loss_names_the_batch_keys(tiny: Decoder) -> None:
    tokens = _tokens(TINY)
    with pytest.raises(KeyError, match=r"needs keys 'inputs' and 'targets'.*got a dict with "
                       r"keys \['x', 'y'\].*Fix: pass \{'inputs': tokens\[:, :-1\]"):
        lm_loss(tiny, {"x": tokens, "y": tokens})
    with pytest.raises(KeyError, match=r"keys \['inputs'\]"):
        lm_loss(tiny, {"inputs": tokens})
    with pytest.raises(ns.UsageError, match=r"must be a dict with keys 'inputs' and 'targets' .*; "
                       rf"got (ArrayImpl|Array) of shape \(2, {TINY.length}\)"):
        lm_loss(tiny, tokens)


# --- rematerialization -------------------------------------------------------------


def _value_and_grad(cfg: ReferenceConfig, batch_size: int = 2, length: int | None = None):
    """The jitted ``value_and_grad`` step of ``lm_loss`` for ``cfg``, its state and batch."""
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = _tokens(cfg, batch=batch_size, length=length)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}

    def step(state, batch):
        return jax.value_and_grad(lambda s: lm_loss(nnx.merge(graphdef, s), batch))(state)

    return jax.jit(step), state, batch


@pytest.mark.parametrize(
    ("remat", "scan_layers", "experts"),
    [("full", True, 0), ("offload", False, 0)]
    + [pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("full", False, 0), ("dots", False, 0), ("dots", True, 0), ("offload", True, 0),
        ("full", True, 4), ("dots", False, 4))],  # mixture of experts: aux loss through remat
)
def test_remat_keeps_loss_and_gradients(remat: str, scan_layers: bool, experts: int) -> None:
    cfg = dataclasses.replace(TINY, layers=2, scan_layers=scan_layers, experts=experts)
    step, state, batch = _value_and_grad(cfg)
    loss, grads = step(state, batch)
    r_step, r_state, _ = _value_and_grad(dataclasses.replace(cfg, remat=remat))
    assert_close(r_state, state, 0, "same init")  # remat changes nothing but the backward pass
    r_loss, r_grads = r_step(r_state, batch)
    assert_close(r_loss, loss, 1e-5, f"loss remat={remat}")
    assert_close(r_grads, grads, 1e-5, f"grads remat={remat}")


def _compiled(cfg: ReferenceConfig, batch_size: int, length: int):
    step, state, batch = _value_and_grad(cfg, batch_size, length)
    return step.lower(state, batch).compile()


@pytest.mark.slow
def test_remat_lowers_scanned_temp_bytes() -> None:
    # Big enough that the saved per-layer activations dominate the step's temporaries.
    cfg = dataclasses.replace(get_config("small"), vocab=128, embed=64, mlp=256, heads=4,
                              head_dim=16, scan_layers=True)
    temp = {r: _compiled(dataclasses.replace(cfg, remat=r), 8, 128)
            .memory_analysis().temp_size_in_bytes for r in ns.models.REMAT_POLICIES}
    # Measured on XLA CPU: none 60.6 MiB, dots 18.1 MiB, full 16.2 MiB.
    assert temp["full"] < temp["dots"] < 0.6 * temp["none"], temp
    if jax.default_backend() == "cpu":
        # CPU memory is host memory: JAX lowers the offload transfers to nothing,
        # so "offload" compiles to the "dots" program.
        assert temp["offload"] == temp["dots"], temp


def test_remat_recomputes_unrolled_blocks() -> None:
    # XLA CPU schedules the recomputation of unrolled blocks where it does not
    # lower the peak (temp bytes stay equal); that it recomputes shows in the FLOPs.
    cfg = dataclasses.replace(TINY, layers=2, scan_layers=False)
    flops = {r: _compiled(dataclasses.replace(cfg, remat=r), 2, 16).cost_analysis()["flops"]
             for r in ("none", "dots", "full")}
    assert flops["none"] < flops["dots"] < flops["full"], flops


def test_remat_policy_names() -> None:
    assert list(ns.models.REMAT_POLICIES) == ["none", "full", "dots", "offload"]
    with pytest.raises(ValueError, match=r"remat='everything' is not a remat policy; valid: "
                       r"'none', 'full', 'dots', 'offload'"):
        dataclasses.replace(TINY, remat="everything")
    dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    assert ns.models.remat_policy("dots") is dots


def test_remat_offload_needs_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoHostMemory:  # a backend with only device memory
        platform, device_kind = "gpu", "FakeAccelerator"

        def addressable_memories(self):
            return [type("Memory", (), {"kind": "device"})()]

    monkeypatch.setattr(jax, "devices", lambda *a: [NoHostMemory()])
    msg = (r"remat='offload' .* the gpu backend \(FakeAccelerator\) has no 'pinned_host' "
           r"memory \(its memories: device\)\. Fix: use remat='dots' .* or remat='full'")
    with pytest.raises(ValueError, match=msg):
        ns.models.remat_policy("offload")
    with pytest.raises(ValueError, match=msg):  # at build, not at the first step
        Decoder(dataclasses.replace(TINY, remat="offload"), rngs=nnx.Rngs(0))


# --- attention kernels -------------------------------------------------------------


@pytest.mark.slow
def test_attention_kernels_give_the_same_loss_and_gradients() -> None:
    # 600 tokens: the blockwise kernel's 512-blocks, the second one padded.
    cfg = dataclasses.replace(TINY, length=600)
    assert TINY.attention == "auto"  # the memory-efficient default (blockwise on CPU)
    results = {}
    for kernel in ("dense", "blockwise", "auto"):
        step, state, batch = _value_and_grad(dataclasses.replace(cfg, attention=kernel), 1)
        results[kernel] = step(state, batch)
    assert_close(results["blockwise"], results["dense"], 1e-5, "blockwise vs dense")
    # "auto" is the blockwise program on CPU: the same bits.
    for a, b in zip(jax.tree.leaves(results["auto"]), jax.tree.leaves(results["blockwise"]),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_attention_config_error() -> None:
    with pytest.raises(ValueError, match=r"attention='flash' is not an attention kernel; "
                       r"valid: 'auto', 'blockwise', 'dense', 'cudnn'\."):
        dataclasses.replace(TINY, attention="flash")


@pytest.mark.slow
def test_activation_formula_follows_the_kernel() -> None:
    """The planner's activation formula counts the dense kernel's [batch, heads, seq, seq]
    probabilities (O(L^2)) and the blockwise kernel's per-row log-sum-exp (O(L)); at two
    lengths it stays under XLA's compiled temp bytes, within a band, and grows as they do
    (measured on XLA CPU: blockwise 41.0 -> 61.1 MiB, formula 9.5 -> 19.1; dense 135.2 ->
    502.3 MiB, formula 41.5 -> 147.0)."""
    from nnx_shard.models._memory import activation_bytes

    base = dataclasses.replace(get_config("small"), vocab=128, embed=64, mlp=256, heads=4,
                               head_dim=16, layers=2, scan_layers=True)
    rules = ns.strategies.get("dp").rules
    got: dict[tuple[str, int], tuple[int, int]] = {}
    for kernel in ("blockwise", "dense"):
        for length in (1024, 2048):
            cfg = dataclasses.replace(base, length=length, attention=kernel)
            compiled = _compiled(cfg, 1, length).memory_analysis().temp_size_in_bytes
            got[kernel, length] = (activation_bytes(cfg, rules, {"data": 1}, 1, length),
                                   compiled)
    for (kernel, length), (formula, compiled) in got.items():
        assert 0.2 < formula / compiled < 1.0, (kernel, length, formula, compiled)
    # Doubling the length: blockwise at most doubles (linear; XLA's fixed tile working set
    # makes its compiled growth smaller), dense grows toward 4x.
    for kernel, (lo, hi) in {"blockwise": (1.0, 2.0), "dense": (3.0, 4.0)}.items():
        for which in (0, 1):  # formula, compiled
            growth = got[kernel, 2048][which] / got[kernel, 1024][which]
            assert lo < growth <= hi, (kernel, which, growth)


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (ReferenceConfig, {"vocab": True}, r"vocab must be >= 1 \(a whole count\), got True"),
        (ReferenceConfig, {"mlp": 64.0}, r"mlp must be >= 1 \(a whole count\), got 64.0"),
        (ReferenceConfig, {"layers": float("nan")}, r"layers must be >= 1 .* got nan"),
        (ReferenceConfig, {"vocab": "128"}, r"vocab must be >= 1 .* got '128' \(str\)"),
        (ReferenceConfig, {"experts": 4, "capacity_factor": 0.0},
         r"capacity_factor must be a finite number > 0"),
        (ReferenceConfig, {"aux_loss_weight": float("nan")},
         r"aux_loss_weight must be a finite number"),
        (ReferenceConfig, {"scan_layers": "yes"}, r"scan_layers must be True or False"),
        (ReferenceConfig, {"dtype": "float99"}, r"dtype must be a dtype, got 'float99'"),
        (ns.models.DecoderConfig, {"vocab": True}, r"DecoderConfig.vocab must be >= 1"),
        (ns.models.DecoderConfig, {"rope_theta": float("nan")},
         r"rope_theta must be a finite number > 0"),
        (ns.models.DecoderConfig, {"norm_eps": -1.0}, r"norm_eps must be a finite number > 0"),
        (ns.models.DecoderConfig, {"head_dim": 8.5}, r"head_dim must be >= 1 \(a whole count\)"),
    ],
)
def test_config_fields_refuse_bools_text_and_nan(cls, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_models_refuse_a_config_of_the_wrong_kind() -> None:
    with pytest.raises(ns.UsageError, match=r"Decoder: cfg must be a model config \(a DecoderConfig "
                       r"or a ReferenceConfig\), got int 5"):
        Decoder(5, rngs=nnx.Rngs(0))
    with pytest.raises(ns.UsageError, match=r"Decoder: cfg must be a model config .*, got str 'tiny'"):
        ns.models.Decoder("tiny", rngs=nnx.Rngs(0))
