"""QLoRA (nnx_shard._quantized via ns.lora(quantize=)): NF4 / int4 / int8 codes with block
scales (and double quantization) as qwix and QLoRA define them, their names and sharding,
the projection that dequantizes tile by tile, the base's per-device bytes in XLA's compiled
forward, the loss of LoRA over a quantized base against a bf16 base, merging and
checkpointing."""

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
import nnx_shard._quantized as quantized
from nnx_shard._low_rank import adapters
from nnx_shard._quantized import QuantizedKernel, QuantizedValue, QuantSpec, quantize_kernel
from nnx_shard.models import Decoder, DecoderConfig, get_config, lm_loss
from tests._shared import load_file

ALL = r"attn/(q|k|v|o)$|mlp/(gate|up|down)$"
FIXTURES = Path(__file__).parent / "fixtures"
PEFT_TARGETS = r"attn/(q|v|o)$|mlp/down$"  # the fixture adapter's modules
NF4_LEVELS = np.array([-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734,
                       -0.0910500, 0.0, 0.0795803, 0.1609302, 0.2461123, 0.3379152,
                       0.4407098, 0.5626170, 0.7229568, 1.0])
# Input axes divisible by QLoRA's block of 64 (o's last input axis is head_dim).
WIDE = dict(vocab=64, embed=512, heads=4, kv_heads=4, head_dim=64, mlp=512)


def _llama(scan: bool = False, **kw) -> Decoder:
    return Decoder(dataclasses.replace(get_config("llama-tiny"), scan_layers=scan, **kw),
                 rngs=nnx.Rngs(0))


def _kernel(shape, seed=0, outliers=True):
    rng = np.random.default_rng(seed)
    w = rng.normal(0.0, 0.02, shape)
    if outliers:
        w[rng.choice(shape[0], 2, replace=False)] *= 8.0
    return nnx.Param(jnp.asarray(w, jnp.float32))


def test_nf4_codes_and_block_scales_are_qloras():
    w = _kernel((256, 8))
    q = quantize_kernel(w, QuantSpec("nf4"), stack=0, n_in=1)
    assert q.qvalue.dtype == jnp.int4 and q.scale.dtype == jnp.float32  # uint4 codes' bits
    ref = np.asarray(w[...]).reshape(4, 64, 8)
    absmax = np.abs(ref).max(axis=1)  # one scale per 64 inputs and output channel
    np.testing.assert_allclose(np.asarray(q.scale[...]), absmax, rtol=1e-6)
    nearest = np.abs(ref[:, :, None, :] / absmax[:, None, None, :]
                     - NF4_LEVELS[None, None, :, None]).argmin(axis=2)
    codes = np.asarray(q.qvalue[...]).astype(np.int8) % 16  # the int4 bits as 0..15
    np.testing.assert_array_equal(codes.reshape(4, 64, 8), nearest)
    np.testing.assert_allclose(np.asarray(q[...]).reshape(4, 64, 8),
                               NF4_LEVELS[nearest] * absmax[:, None, :], rtol=1e-6, atol=1e-9)
    # double quantization: the scales less their mean, int8 in groups of up to 256
    d = quantize_kernel(w, QuantSpec("nf4", 64, double=True), stack=0, n_in=1)
    assert d.scale.dtype == jnp.int8 and d.scale.shape == (4, 8)
    assert d.scale_scale.shape == (1, 1) and d.scale_offset.shape == (1, 1)
    np.testing.assert_allclose(np.asarray(d.float_scales()), absmax,
                               atol=np.abs(absmax - absmax.mean()).max() / 127)
    np.testing.assert_array_equal(np.asarray(d.qvalue[...]), np.asarray(q.qvalue[...]))
    for qtype, levels in [("int4", 7.5), ("int8", 127.5)]:
        b = quantize_kernel(w, QuantSpec(qtype), stack=0, n_in=1)
        assert b.qvalue.dtype == jnp.dtype(qtype) and b.scale.shape == (4, 8)
        step = np.repeat(np.asarray(b.scale[...]), 64, axis=0)
        np.testing.assert_allclose(step, np.repeat(absmax, 64, axis=0) / levels, rtol=1e-6)
        assert np.all(np.abs(np.asarray(b[...] - w[...])) <= 0.5 * step + 1e-7)


@pytest.mark.parametrize("spec", [QuantSpec("nf4", double=True), QuantSpec("int8", None)],
                         ids=["nf4_double", "int8_channel"])
def test_contraction_dequantizes_tile_by_tile_without_a_float_kernel(spec):
    w = nnx.Param(jax.random.normal(jax.random.key(0), (1024, 4096), jnp.float32) * 0.02)
    q = quantize_kernel(w, spec, stack=0, n_in=1)
    x = jax.random.normal(jax.random.key(1), (8, 1024))

    def tiled(x, q):
        return jnp.sum(jnp.sin(q.contract("bi,io->bo", x, jnp.float32)))

    def whole(x, q):
        return jnp.sum(jnp.sin(x @ q[...]))

    kernel_bytes = 1024 * 4096 * 4
    temps = {}
    for name, f in [("tiled", tiled), ("whole", whole)]:
        compiled = nnx.jit(nnx.value_and_grad(f)).lower(x, q).compile()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
    assert temps["tiled"] < 0.6 * kernel_bytes <= temps["whole"], temps
    (y, g), (y_ref, g_ref) = (nnx.jit(nnx.value_and_grad(f))(x, q) for f in (tiled, whole))
    np.testing.assert_allclose(float(y), float(y_ref), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=1e-5 * float(
        np.abs(np.asarray(g_ref)).max()))


STOCK = {
    "linear": lambda: nnx.Linear(1024, 4096, use_bias=False, rngs=nnx.Rngs(0)),
    "linear_general": lambda: nnx.LinearGeneral((4, 256), 4096, axis=(-2, -1), use_bias=False,
                                                rngs=nnx.Rngs(0)),
    "einsum": lambda: nnx.Einsum("bi,io->bo", (1024, 4096), rngs=nnx.Rngs(0)),
}


@pytest.mark.parametrize(("layer", "quantize", "kw"), [
    ("linear", "nf4", {"double_quant": True}), ("linear", "int8", {"quant_block": None}),
    ("linear_general", "nf4", {}), ("einsum", "int4", {})])
def test_stock_layer_dequantizes_tile_by_tile_without_a_float_kernel(layer, quantize, kw):
    """Stock nnx.Linear / LinearGeneral / Einsum under QLoRA: their forward and backward
    contract the codes tile by tile, never holding the float kernel, and compute what the
    dequantized kernel and the adapter compute."""
    model = ns.lora(STOCK[layer](), 4, 8.0, targets="kernel", quantize=quantize, **kw)
    node = next(iter(adapters(model).values()))
    node.lora_b[...] = 0.1 * jnp.ones(node.lora_b.shape)
    x = jax.random.normal(jax.random.key(1), (8, 4, 256) if layer == "linear_general" else
                          (8, 1024))

    def loss(x, model):
        return jnp.sum(jnp.sin(model(x)))

    kernel_bytes = 1024 * 4096 * 4
    step = nnx.jit(nnx.value_and_grad(loss))
    temp = step.lower(x, model).compile().memory_analysis().temp_size_in_bytes
    assert temp < 0.6 * kernel_bytes, temp
    xs = np.asarray(x).reshape(8, 1024)
    w = np.asarray(model.kernel[...]).reshape(1024, 4096)
    a, b = np.asarray(node.lora_a[...]).reshape(1024, 4), np.asarray(node.lora_b[...])
    want = xs @ w + node.scale * (xs @ a) @ b
    got = np.asarray(nnx.jit(lambda m, x: m(x))(model, x))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
    (y, g), g_ref = step(x, model), np.cos(want) @ (w + node.scale * a @ b).T
    np.testing.assert_allclose(float(y), np.sin(want).sum(), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(g).reshape(8, 1024), g_ref,
                               atol=1e-4 * np.abs(g_ref).max())


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fsdp", "fsdp_tp"])
def test_quantized_base_shards_codes_and_block_scales_by_the_kernels_names(preset):
    strategy = ns.strategies.get(preset)
    mesh = strategy.make_mesh(8)
    # The layout sharded_init compiles its init to (the same shardings of the same
    # abstract state); test_sharded_nf4_lora_step_matches_one_device and
    # test_qlora_checkpoint_restores_the_nf4_base_bitwise materialize nf4 bases in it.
    model = ns.abstract_init(lambda: ns.lora(_llama(scan=True, **WIDE), 4, 8.0, targets=ALL,
                                             quantize="nf4", double_quant=True), mesh, strategy)
    q = model.blocks.attn.q
    assert isinstance(q, QuantizedKernel) and q.shape == (2, 512, 4, 64)
    assert q.qvalue.get_metadata("out_sharding") == ("layers", "embed", "heads", "kv")
    # the block axis (512 / 64 = 8 blocks) is named, and split, after the input axis
    assert q.scale.shape == (2, 8, 4, 64)
    assert q.scale.get_metadata("out_sharding") == ("layers", "embed", "heads", "kv")
    assert q.scale_scale.get_metadata("out_sharding") == ("layers", None, None, None)
    data = "data"
    w_spec = tuple(q.qvalue.get_value().sharding.spec)
    s_spec = tuple(q.scale.get_value().sharding.spec)
    assert w_spec[1] == s_spec[1] == data
    if preset == "fsdp_tp":
        assert w_spec[2] == s_spec[2] == "model"
    o = model.blocks.attn.o  # [heads, kv, embed]: blocks along kv, one per head
    assert o.scale.shape == (2, 4, 1, 512)


def _wide_lora(strategy=None, mesh=None):
    def make():  # one block: every projection's sharded step is in it
        return ns.lora(_llama(**dict(WIDE, layers=1)), 4, 8.0, targets=ALL, quantize="nf4",
                       rngs=1)

    model = make() if strategy is None else ns.sharded_init(make, mesh, strategy)
    for site in adapters(model).values():  # B != 0: the step moves every factor
        b = site.lora_b.get_value()
        site.lora_b.set_value(jax.device_put(jnp.full(b.shape, 0.01, b.dtype), b.sharding))
    return model


def _lora_step(model, batch, rules=None, mesh=None):
    # SGD: Adam's first step is a sign, which flips on the rounding of near-zero gradients
    opt = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(
            model, batch)
        opt.update(model, grads)
        return loss

    base = jax.device_get(nnx.state(model, QuantizedValue))
    if rules is None:
        loss = step(model, opt, batch)
    else:
        with ns.use(mesh, rules):
            loss = step(model, opt, batch)
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(nnx.state(model, QuantizedValue)),
                    strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))  # the base is frozen, bitwise
    return float(loss), jax.device_get(nnx.state(model, nnx.LoRAParam))


_ONE_DEVICE: dict[str, tuple[float, Any]] = {}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fsdp", "fsdp_tp"])
def test_sharded_nf4_lora_step_matches_one_device(preset, monkeypatch):
    monkeypatch.setattr(quantized, "TILE_BYTES", 64 << 10)  # tiles of 2 blocks: the loop runs
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 0, WIDE["vocab"])
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if "ref" not in _ONE_DEVICE:  # the one-device step, the same for every preset
        _ONE_DEVICE["ref"] = _lora_step(_wide_lora(), batch)
    ref_loss, ref = _ONE_DEVICE["ref"]
    strategy = ns.strategies.get(preset)
    mesh = strategy.make_mesh(8)
    loss, got = _lora_step(_wide_lora(strategy, mesh), batch, strategy.rules, mesh)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                   atol=1e-5 * max(1.0, float(np.abs(np.asarray(b)).max())))


def test_bad_block_size_and_unknown_quant_type_are_usage_errors():
    with pytest.raises(ns.UsageError) as e:
        ns.lora(_llama(), 4, 8.0, targets=r"attn/q$", quantize="nf4")
    msg = str(e.value)
    assert "blocks/0/attn/q" in msg and "(32, 4, 8)" in msg and "quant_block=32" in msg
    assert "quant_block=None" in msg
    model = _llama()
    with pytest.raises(ns.UsageError, match=r"'blocks/0/attn/o' of shape \(4, 8, 32\)"):
        ns.lora(model, 4, 8.0, targets=ALL, quantize="int4", quant_block=32)
    assert not adapters(model)  # checked before any kernel changed
    with pytest.raises(ns.UsageError, match="'nf4', 'int4' or 'int8', got 'fp4'"):
        ns.lora(_llama(), 4, 8.0, quantize="fp4")
    with pytest.raises(ns.UsageError, match="quant_block must be a positive int"):
        ns.lora(_llama(), 4, 8.0, quantize="nf4", quant_block=0)
    with pytest.raises(ns.UsageError, match="double_quant=True needs block scales"):
        ns.lora(_llama(), 4, 8.0, quantize="nf4", quant_block=None, double_quant=True)
    q = ns.lora(_llama(), 4, 8.0, targets="attn/o$", quantize="nf4", quant_block=8)
    o = q.blocks[0].attn.o
    assert o.scale.shape == (4, 1, 32) and o.qtype == "nf4"


def _base_bytes(quantize, **kw):
    """Per-device argument bytes of the compiled forward, less the non-base arguments."""
    strategy = ns.strategies.get("fsdp")
    mesh = strategy.make_mesh(8)
    cfg = dict(WIDE, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    # The abstract model carries the shardings sharded_init would place: the compiled
    # forward's arguments are the same, without compiling (or running) an init.
    model = ns.abstract_init(lambda: ns.lora(_llama(scan=True, **cfg), 4, 8.0, targets=ALL,
                                             quantize=quantize, **kw), mesh, strategy)
    tokens = jnp.zeros((8, 16), jnp.int32)
    with ns.use(mesh, strategy.rules):
        compiled = nnx.jit(lambda m, t: m(t)).lower(model, tokens).compile()
    args = compiled.memory_analysis().argument_size_in_bytes
    other = nnx.state(model, nnx.Not(nnx.Any(QuantizedValue, _AdaptedKernel())))
    rest = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(other))
    rest += tokens.addressable_shards[0].data.nbytes
    return args - rest


class _AdaptedKernel:
    """A filter: the full-precision kernels that have an adapter (all seven projections)."""

    def __call__(self, path, value):
        return bool(path) and path[-1] in ("q", "k", "v", "o", "gate", "up", "down")


@pytest.mark.slow
def test_quantized_base_bytes_in_the_compiled_forward():
    bf16 = _base_bytes(None)
    ratios = {name: _base_bytes(q, **kw) / bf16 for name, q, kw in [
        ("nf4", "nf4", {}), ("nf4_dq", "nf4", {"double_quant": True}),
        ("int8", "int8", {}), ("int4_channel", "int4", {"quant_block": None})]}
    print("base bytes per device vs bf16:", ratios)
    # 4-bit codes (0.25) plus a float32 scale per 64 (4 / 64 / 2 = 0.03125)
    assert 0.275 < ratios["nf4"] <= 0.2813
    # int8 block scales (1 / 64 / 2) plus a float32 per group of scales and an offset
    assert 0.255 < ratios["nf4_dq"] <= 0.262
    assert 0.53 < ratios["int8"] <= 0.5313
    # one float32 scale per output channel, whole on each of the 8 devices under fsdp
    assert 0.25 < ratios["int4_channel"] <= 0.25 + 8 * 4 / (2 * 512)


def _benchmark():  # type: ignore[no-untyped-def]
    """benchmarks/qlora.py, whose realistic base and 10 AdamW steps the gap table measures."""
    return load_file(Path(__file__).resolve().parents[1] / "benchmarks" / "qlora.py",
                     "bench_qlora")


def final_loss(quantize=None, **kw) -> float:
    """The loss after 10 AdamW steps of LoRA (all projections, dropout 0) over the
    benchmark's realistic base, quantized or not, on next tokens drawn from the float base."""
    return _benchmark().losses(quantize, kw)[-1]


@pytest.mark.slow
def test_qlora_nf4_loss_follows_the_bf16_base():
    ref = final_loss()
    nf4 = abs(final_loss("nf4") - ref) / ref
    channel = abs(final_loss("int4", quant_block=None) - ref) / ref
    print(f"final loss gap vs bf16 base: nf4 {nf4:.4f}, int4 per channel {channel:.4f}")
    assert nf4 < 0.03
    assert channel > 3 * nf4  # the outlier channels sink per-channel scales, not blocks


def _fixture_model(strategy, mesh, quantize, **kw):
    cfg = DecoderConfig.from_hf(FIXTURES / "hf_llama" / "config.json")
    target = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
    model = ns.hf.load_safetensors(FIXTURES / "hf_llama", target)
    ns.lora(model, 4, 8.0, targets=PEFT_TARGETS, quantize=quantize, **kw)
    return ns.hf.load_lora(FIXTURES / "peft_llama", model)


@pytest.mark.slow
def test_qlora_merges_dequantized_and_saves_peft_adapters(tmp_path):
    from nnx_shard import _safetensors_io as st

    strategy = ns.strategies.get("tp")
    mesh = strategy.make_mesh(2)
    model = _fixture_model(strategy, mesh, "int8", quant_block=8)  # the fixture's head_dim
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
def test_qlora_checkpoint_restores_the_nf4_base_bitwise(tmp_path):
    strategy = ns.strategies.get("fsdp")
    mesh = strategy.make_mesh(8)

    def make(seed, init=ns.sharded_init):
        model = init(lambda: ns.lora(_llama(**dict(WIDE, layers=1)), 4, 8.0, quantize="nf4",
                                     double_quant=True, rngs=seed), mesh, strategy)
        return model, ns.sharded_optimizer(model, optax.adam(1e-2), mesh, strategy,
                                           wrt=nnx.LoRAParam)

    model, opt = make(0)
    ns.save(tmp_path, 1, model=model, optimizer=opt)
    # An abstract target (nothing initialized): every value restored comes from the save.
    fresh, fresh_opt = make(5, ns.abstract_init)
    back, _, _ = ns.restore(tmp_path, model=fresh, optimizer=fresh_opt)
    q = back.blocks[0].attn.q
    assert q.qtype == "nf4" and q.qvalue.dtype == jnp.int4
    assert q.qvalue.get_value().sharding.spec[0] == "data"
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _qlinear(kind: str) -> nnx.Linear:
    return ns.lora(nnx.Linear(128, 4, rngs=nnx.Rngs(0)), 2, 4.0, targets="kernel",
                   quantize=kind)


def _manifest(directory: Path, step: int = 1) -> tuple[Path, dict]:
    import json

    path = directory / str(step) / "manifest" / "metadata"
    return path, json.loads(path.read_text())


def test_checkpoint_records_the_codes_kind_and_refuses_another(tmp_path):
    nf4 = _qlinear("nf4")
    ns.save(tmp_path, 1, model=nf4)
    entries = _manifest(tmp_path)[1]["items"]["model"]
    assert entries["kernel/qvalue"]["quant"] == "nf4"
    assert "quant" not in entries["kernel/scale"] and "quant" not in entries["bias"]
    int4 = _qlinear("int4")
    # The same bits as int4 levels: another kernel, which the restore must not make.
    assert int4.kernel.qvalue.dtype == nf4.kernel.qvalue.dtype == jnp.int4
    with pytest.raises(ns.UsageError) as e:
        ns.restore(tmp_path, model=int4)
    message = str(e.value)
    assert "model/kernel/qvalue: checkpoint holds nf4 codes" in message
    assert "target quantizes as int4" in message
    assert "ns.lora(..., quantize='nf4')" in message
    back = ns.restore(tmp_path, model=_qlinear("nf4"))
    assert back.kernel.qtype == "nf4"
    x = jnp.ones((1, 128))
    np.testing.assert_array_equal(np.asarray(back(x)), np.asarray(nf4(x)))


def test_checkpoint_without_the_kind_record_still_restores(tmp_path):
    import json

    from nnx_shard._checkpoint._manifest import manifest_digest

    ns.save(tmp_path, 1, model=_qlinear("nf4"))
    path, manifest = _manifest(tmp_path)
    del manifest["items"]["model"]["kernel/qvalue"]["quant"]  # as written before the record
    manifest["digest"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))
    back = ns.restore(tmp_path, model=_qlinear("int4"))  # nothing tells the kinds apart
    assert back.kernel.qtype == "int4"
    np.testing.assert_array_equal(np.asarray(back.kernel.qvalue[...]),
                                  np.asarray(_qlinear("nf4").kernel.qvalue[...]))


@pytest.mark.parametrize("record", [4, "", None, "x" * 41])
def test_a_damaged_kind_record_is_a_corrupt_manifest(tmp_path, record):
    import json

    from nnx_shard._checkpoint._manifest import manifest_digest

    ns.save(tmp_path, 1, model=_qlinear("nf4"))
    path, manifest = _manifest(tmp_path)
    manifest["items"]["model"]["kernel/qvalue"]["quant"] = record
    manifest["digest"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(ns.UsageError, match="is corrupt") as e:
        ns.restore(tmp_path, model=_qlinear("nf4"))
    assert "model/kernel/qvalue has the quantization kind" in str(e.value)
