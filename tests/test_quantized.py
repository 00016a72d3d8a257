"""QLoRA (nnx_shard._quantized via ns.lora(quantize=)): the quantized base's names and
sharding, its per-device bytes in XLA's compiled forward, training only the adapters
over a bitwise-frozen quantized base, the loss curve against a float32 base, and
merging."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard._low_rank import adapters
from nnx_shard._quantized import QuantizedKernel, QuantizedValue
from nnx_shard.models import Llama, LlamaConfig, get_config, lm_loss

ALL = r"attn/(q|k|v|o)$|mlp/(gate|up|down)$"
FIXTURES = Path(__file__).parent / "fixtures"
PEFT_TARGETS = r"attn/(q|v|o)$|mlp/down$"  # the fixture adapter's modules


def _llama(scan: bool = False, **kw) -> Llama:
    return Llama(dataclasses.replace(get_config("llama-tiny"), scan_layers=scan, **kw),
                 rngs=nnx.Rngs(0))


@pytest.mark.parametrize(("quantize", "dtype"), [("int8", jnp.int8), ("int4", jnp.int4)])
def test_quantized_base_keeps_names_and_shards_scales_on_outputs(quantize, dtype):
    strategy = ns.strategies.get("tp")
    mesh = strategy.make_mesh(2)
    model = ns.sharded_init(
        lambda: ns.lora(_llama(scan=True), 4, 8.0, targets=ALL, quantize=quantize), mesh, strategy)
    q = model.blocks.attn.q  # the frozen kernel, quantized; its adapter beside it
    assert isinstance(q, QuantizedKernel)
    assert model.blocks.attn.lora_q.lora_a.shape == (2, 32, 4)
    assert q.qvalue.get_metadata("out_sharding") == ("layers", "embed", "heads", "kv")
    assert q.scale.get_metadata("out_sharding") == ("layers", None, "heads", "kv")
    assert q.qvalue.dtype == dtype and q.scale.shape == (2, 1, 4, 8)
    w_spec = q.qvalue.get_value().sharding.spec
    s_spec = q.scale.get_value().sharding.spec
    assert w_spec[2] == "model" and s_spec[2] == "model"  # scales split with their heads
    assert q.shape == (2, 32, 4, 8) and q.dtype == jnp.float32
    # dequantized within one step of the int grid: absmax per output channel
    ref = _llama(scan=True).blocks.attn.q[...]
    levels = 127 if quantize == "int8" else 7
    step = np.abs(np.asarray(ref)).max(axis=1, keepdims=True) / levels
    assert np.all(np.abs(np.asarray(q[...]) - np.asarray(ref)) <= 0.5 * step + 1e-6)


def _base_bytes(quantize):
    """Per-device argument bytes of the compiled forward, less the non-base arguments."""
    strategy = ns.strategies.get("fsdp")
    mesh = strategy.make_mesh(8)
    cfg = dict(param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, vocab=64, embed=256, mlp=512,
               heads=4, kv_heads=4, head_dim=64)
    model = ns.sharded_init(
        lambda: ns.lora(_llama(scan=True, **cfg), 4, 8.0, targets=ALL, quantize=quantize), mesh, strategy)
    tokens = jnp.zeros((8, 16), jnp.int32)
    with ns.use(mesh, strategy.rules):
        compiled = nnx.jit(lambda m, t: m(t)).lower(model, tokens).compile()
    args = compiled.memory_analysis().argument_size_in_bytes
    other = nnx.state(model, nnx.Not(nnx.Any(QuantizedValue, _AdaptedKernel())))
    rest = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(other))
    rest += tokens.addressable_shards[0].data.nbytes
    return args - rest


class _AdaptedKernel:
    """A filter: the full-precision kernels that have an adapter (all seven projections)."""

    def __call__(self, path, value):
        return bool(path) and path[-1] in ("q", "k", "v", "o", "gate", "up", "down")


@pytest.mark.slow
def test_quantized_base_bytes_in_the_compiled_forward():
    bf16 = _base_bytes(None)
    int8 = _base_bytes("int8") / bf16
    int4 = _base_bytes("int4") / bf16
    print(f"base bytes per device: bf16 {bf16}, int8 {int8:.4f}x, int4 {int4:.4f}x")
    # the values halve / quarter; the bf16 scales (one per output channel, unsplit under
    # fsdp) add out / (in / 8) of the kernel: 8/256 here at most
    assert 0.5 < int8 <= 0.5 + 8 / 256
    assert 0.25 < int4 <= 0.25 + 8 / 256


def _curve(quantize, steps=10):
    """10 AdamW steps of the fixture's PEFT adapter on its base under fsdp: the losses,
    and the base and adapter states before and after."""
    strategy = ns.strategies.get("fsdp")
    mesh = strategy.make_mesh(8)
    cfg = LlamaConfig.from_hf(FIXTURES / "hf_llama" / "config.json")
    target = ns.abstract_init(lambda: Llama(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
    model = ns.hf.load_safetensors(FIXTURES / "hf_llama", target)
    ns.lora(model, 4, 8.0, targets=PEFT_TARGETS, quantize=quantize)  # the file's r, alpha
    ns.hf.load_lora(FIXTURES / "peft_llama", model)
    opt = ns.sharded_optimizer(model, optax.adamw(1e-2), mesh, strategy, wrt=nnx.LoRAParam)
    tokens = jnp.asarray(np.tile(np.load(FIXTURES / "peft_llama" / "expected.npz")["tokens"],
                                 (4, 1)))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(
            model, batch)
        opt.update(model, grads)
        return loss

    frozen = lambda: jax.device_get(nnx.state(model, nnx.Not(nnx.LoRAParam)))  # noqa: E731
    trained = lambda: jax.device_get(nnx.state(model, nnx.LoRAParam))  # noqa: E731
    before = frozen(), trained()
    with ns.use(mesh, strategy.rules):
        losses = [float(step(model, opt, batch)) for _ in range(steps)]
    return np.array(losses), before, (frozen(), trained()), model


@pytest.mark.slow
def test_qlora_loss_curve_follows_the_float_base_and_trains_only_adapters():
    ref, *_ = _curve(None)
    assert ref[-1] < 0.9 * ref[0]
    gaps = {}
    for quantize, tol in [("int8", 0.01), ("int4", 0.05)]:
        losses, (base0, lora0), (base1, lora1), model = _curve(quantize)
        gaps[quantize] = float(np.abs(losses - ref).max() / ref.max())
        assert gaps[quantize] <= tol, (quantize, losses, ref)
        assert losses[-1] < 0.9 * losses[0]
        values = [leaf for leaf in jax.tree.leaves(base0) if leaf.dtype == jnp.dtype(quantize)]
        assert len(values) == 2 * 4  # q, v, o, down of the 2 layers: quantized
        for a, b in zip(jax.tree.leaves(base0), jax.tree.leaves(base1), strict=True):
            np.testing.assert_array_equal(a, b)  # the quantized base is bitwise unchanged
        for a, b in zip(jax.tree.leaves(lora0), jax.tree.leaves(lora1), strict=True):
            assert not np.array_equal(a, b)
        assert sorted(adapters(model))[:2] == ["blocks/0/attn/o", "blocks/0/attn/q"]
    print("max loss gap / max loss:", gaps)
    assert gaps["int8"] < gaps["int4"]


def _fixture_model(strategy, mesh, quantize):
    cfg = LlamaConfig.from_hf(FIXTURES / "hf_llama" / "config.json")
    target = ns.abstract_init(lambda: Llama(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
    model = ns.hf.load_safetensors(FIXTURES / "hf_llama", target)
    ns.lora(model, 4, 8.0, targets=PEFT_TARGETS, quantize=quantize)
    return ns.hf.load_lora(FIXTURES / "peft_llama", model)


@pytest.mark.slow
def test_qlora_merges_dequantized_and_saves_peft_adapters(tmp_path):
    from nnx_shard import _safetensors_io as st

    strategy = ns.strategies.get("tp")
    mesh = strategy.make_mesh(2)
    model = _fixture_model(strategy, mesh, "int8")
    ns.hf.save_lora(tmp_path / "out", model)
    ours = st.read_header(str(tmp_path / "out" / "adapter_model.safetensors"))
    theirs = st.read_header(str(FIXTURES / "peft_llama" / "adapter_model.safetensors"))
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    for name, info in theirs.tensors.items():  # the adapters, bitwise, whatever the base
        index = [slice(None)] * len(info.shape)
        np.testing.assert_array_equal(st.read_slice(ours, name, index),
                                      st.read_slice(theirs, name, index))
    tokens = jnp.asarray(np.tile(np.load(FIXTURES / "peft_llama" / "expected.npz")["tokens"],
                                 (4, 1)))
    forward = nnx.jit(lambda m, t: m(t))
    with ns.use(mesh, strategy.rules):
        adapted = np.asarray(forward(model, tokens))
        attn = model.blocks[0].attn
        want = np.asarray(attn.q[...]) + np.asarray(attn.lora_q.delta())
        ns.merge_lora(model)
        merged = np.asarray(forward(model, tokens))
    assert not adapters(model)
    kernel = model.blocks[0].attn.q
    assert type(kernel) is nnx.Param and kernel.dtype == jnp.float32
    assert kernel.get_metadata("out_sharding") == ("embed", "heads", "kv")
    assert kernel.get_value().sharding.spec[1] == "model"
    np.testing.assert_allclose(np.asarray(kernel[...]), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(merged, adapted, atol=2e-4 * np.abs(adapted).max())
    # the quantization error stays: the merged model is not the float base's merge
    exp = np.load(FIXTURES / "peft_llama" / "expected.npz")["merged_logits"]
    assert np.abs(merged[:2] - exp).max() > 1e-4


@pytest.mark.slow
def test_qlora_checkpoint_restores_the_int4_base_bitwise(tmp_path):
    strategy = ns.strategies.get("fsdp")
    mesh = strategy.make_mesh(8)

    def make(seed):
        model = ns.sharded_init(
            lambda: ns.lora(_llama(), 4, 8.0, quantize="int4", rngs=seed), mesh, strategy)
        return model, ns.sharded_optimizer(model, optax.adam(1e-2), mesh, strategy, wrt=nnx.LoRAParam)

    model, opt = make(0)
    ns.save(tmp_path, 1, model=model, optimizer=opt)
    fresh, fresh_opt = make(5)
    back, _, _ = ns.restore(tmp_path, model=fresh, optimizer=fresh_opt)
    q = back.blocks[0].attn.q
    assert q.qvalue.dtype == jnp.int4 and q.qvalue.get_value().sharding.spec[0] == "data"
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
