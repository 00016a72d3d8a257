"""nnx_shard.Precision: float32 master weights read in bfloat16 inside the step.

References from outside: a one-device float32 run in plain Flax/optax (the
bfloat16 run must follow it within bfloat16's rounding, scaled to each tensor),
transformers' float32 logits of the tiny checkpoints in tests/fixtures, and the
HLO XLA's SPMD partitioner writes (the dtype and bytes of each all-gather).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard._errors import UsageError
from nnx_shard.models import Decoder, DecoderConfig, lm_loss
from nnx_shard.planner import compiled_collectives, partitioned_hlo
from tests._close import assert_close
from tests.conftest import needs_devices

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MIXED = ns.Precision(params=jnp.float32, compute=jnp.bfloat16)
# bfloat16 keeps 8 significant bits (relative rounding 2^-8 = 0.4%); a forward
# pass through a few layers compounds a few of those.
BF16_RTOL = 3e-2


class Net(nnx.Module):
    """Stock Flax layers. ``nnx.Embed`` computes in its ``dtype`` (by default the
    table's): bfloat16 for mixed precision; the others follow their inputs."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 64, d: int = 64, h: int = 128,
                 dtype=jnp.bfloat16) -> None:
        self.embed = nnx.Embed(vocab, d, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d, h, rngs=rngs)
        self.down = nnx.Linear(h, d, rngs=rngs)
        self.norm = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        # Rows over the batch axes (no-op outside ns.use): under fsdp the weights,
        # not the activations, are what moves.
        x = ns.constrain(self.embed(tokens), ("batch", None, None))
        x = x + self.down(nnx.gelu(ns.constrain(self.up(x), ("batch", None, None))))
        # Norm and logits in float32, as the reference models keep them.
        return self.embed.attend(self.norm(x.astype(jnp.float32)).astype(x.dtype)
                                 ).astype(jnp.float32)


PATTERNS = {r"embed/embedding$": ("vocab", "embed"), r"up/kernel$": ("embed", "mlp"),
            r"up/bias$": ("mlp",), r"down/kernel$": ("mlp", "embed"), r"down/bias$": ("embed",),
            r"norm/(scale|bias)$": ("embed",)}


def _net(**kw) -> Net:
    return ns.annotate(Net(nnx.Rngs(0), **kw), PATTERNS, strict=True)


def ce_loss(model, batch):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _batches(steps: int, batch: int = 16, length: int = 8, vocab: int = 64) -> dict:
    toks = np.random.default_rng(0).integers(0, vocab, (steps, batch, length + 1), np.int32)
    return {"inputs": toks[:, :, :-1], "targets": toks[:, :, 1:]}


def _step(model, opt, batch):
    loss, grads = ns.value_and_grad(ce_loss)(model, batch)
    opt.update(model, grads)
    return {"loss": loss, "grads": grads}


def _reference(steps: int) -> tuple[np.ndarray, dict]:
    """Plain Flax and optax on one device, float32 throughout."""
    model = Net(nnx.Rngs(0), dtype=jnp.float32)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    data = _batches(steps)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(ce_loss)(model, batch)
        opt.update(model, grads)
        return loss

    first = jax.tree.map(lambda a: a[0], data)
    grads = jax.device_get(nnx.grad(ce_loss)(model, first))
    losses = [step(model, opt, jax.tree.map(lambda a, i=i: a[i], data)) for i in range(steps)]
    return np.array(jax.device_get(losses)), grads


@pytest.mark.slow
def test_value_and_grad_reads_bfloat16_and_returns_float32_gradients():
    """One device, no mesh: the fast check of what the sharded tests below repeat."""
    model = Net(nnx.Rngs(0))
    batch = jax.tree.map(lambda a: jnp.asarray(a[0]), _batches(1))
    want_loss, want = _reference_grads(batch)
    loss, grads = ns.value_and_grad(ce_loss, precision=MIXED)(model, batch)
    assert loss != want_loss
    assert_close(loss, want_loss, rtol=BF16_RTOL, what="loss")
    assert {str(g.dtype) for g in jax.tree.leaves(grads)} == {"float32"}
    assert_close(jax.device_get(grads), want, rtol=BF16_RTOL, what="gradients")
    seen = []
    probe = lambda m, b: seen.append(m.up.kernel[...].dtype) or ce_loss(m, b)  # noqa: E731
    ns.value_and_grad(probe, precision=MIXED)(model, batch)
    assert seen == [jnp.bfloat16] and model.up.kernel[...].dtype == jnp.float32


def _reference_grads(batch):
    model = Net(nnx.Rngs(0), dtype=jnp.float32)
    return nnx.value_and_grad(ce_loss)(model, batch)


@pytest.mark.slow
@needs_devices(8)
# dp: mixed precision alone; fsdp_tp: with the parameters split over data and model (fsdp's
# split is one half of it).
@pytest.mark.parametrize("strategy", ["dp", "fsdp_tp"])
def test_stock_model_follows_float32_one_device(strategy):
    steps = 4
    want_loss, want_grads = _reference(steps)
    s = ns.strategies.get(strategy)
    mesh = s.make_mesh(8)
    model = ns.sharded_init(_net, mesh, s)
    opt = ns.sharded_optimizer(model, optax.adam(1e-2), mesh, s)
    with ns.use(mesh, s.rules):
        batch = ns.shard_batch(_batches(steps), mesh, s.rules, ("batch", "length"), steps=True)
        fused = ns.multistep(_step, precision=MIXED)
        metrics = jax.device_get(fused(model, opt, batch))
    # Master weights, optimizer state and gradients stay float32.
    for tree in (nnx.state(model, nnx.Param), nnx.state(opt, nnx.optimizer.OptState),
                 metrics["grads"]):
        dtypes = {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype,
                                                                                 jnp.floating)}
        assert dtypes == {"float32"}, dtypes
    # bfloat16 compute is not float32 compute: the losses differ, within its rounding.
    assert not np.array_equal(metrics["loss"], want_loss)
    assert_close(metrics["loss"], want_loss, rtol=BF16_RTOL, what="loss")
    # The first step's gradients (Adam's later steps amplify sign flips of near-zero
    # gradient entries, so parameters after several steps are not a fair comparison).
    assert_close(jax.tree.map(lambda g: g[0], metrics["grads"]), want_grads, rtol=BF16_RTOL,
                 what="first step's gradients")
    # Outside the step the parameters read as stored again.
    assert model.up.kernel[...].dtype == jnp.float32
    assert model.up.kernel.get_metadata("on_get_value", None) is None


@pytest.mark.slow
@needs_devices(8)
def test_trainer_precision_matches_multistep_and_checks_model():
    s = ns.strategies.get("fsdp")
    mesh = s.make_mesh(8)
    model = ns.sharded_init(_net, mesh, s)
    opt = ns.sharded_optimizer(model, optax.adam(1e-2), mesh, s)
    trainer = ns.Trainer(model, opt, ce_loss, mesh=mesh, rules=s.rules, steps_per_call=2,
                         precision=MIXED)
    data = _batches(4)
    hist = trainer.fit(({k: v[i] for k, v in data.items()} for i in range(4)), num_steps=4,
                       progress=False)
    want, _ = _reference(4)
    assert_close(np.array(hist["loss"]), want, rtol=BF16_RTOL, what="loss")
    assert "precision=Precision(params=float32, compute=bfloat16)" in repr(trainer._fused)


def test_precision_refuses_what_would_not_be_mixed_precision():
    with pytest.raises(UsageError, match=r"float16\) needs loss scaling"):
        ns.Precision(compute=jnp.float16)
    with pytest.raises(UsageError, match="not a float dtype"):
        ns.Precision(params=jnp.int32)
    # Parameters already bfloat16 have no float32 master copy.
    def llama(**kw):
        return nnx.eval_shape(lambda: Decoder(DecoderConfig(**kw), rngs=nnx.Rngs(0)))

    pure = llama(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    with pytest.raises(UsageError, match=r"(?s)not stored in float32.*final_norm.*"
                                         r"Fix: build the model with param_dtype=float32"):
        MIXED.check(pure)
    # A model that computes in float32 would cast the bfloat16 reads back up.
    with pytest.raises(UsageError, match=r"(?s)\(the model\) \(Decoder\) has dtype=float32.*"
                                         r"dtype=jnp.bfloat16, param_dtype=jnp.float32"):
        MIXED.check(llama())
    MIXED.check(llama(dtype=jnp.bfloat16))  # the right build
    # nnx.Embed's default dtype is its table's; Trainer checks when it is built.
    net = Net(nnx.Rngs(0), dtype=jnp.float32)
    with pytest.raises(UsageError, match=r"embed \(Embed\) has dtype=float32"):
        ns.Trainer(net, nnx.Optimizer(net, optax.sgd(0.1), wrt=nnx.Param), ce_loss,
                   mesh="data=1", rules={}, precision=MIXED)
    with pytest.raises(UsageError, match="must be an nnx_shard.Precision"):
        ns.multistep(_step, precision="bf16")


def test_multistep_precision_needs_value_and_grad():
    model = _net()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def plain(model, opt, batch):
        loss, grads = nnx.value_and_grad(ce_loss)(model, batch)
        opt.update(model, grads)
        return {"loss": loss}

    batch = jax.tree.map(jnp.asarray, _batches(2, batch=2))
    with pytest.raises(ValueError, match=r"precision=Precision\(params=float32, compute=bfloat16"
                                         r"\)\): plain never called nnx_shard.value_and_grad"):
        ns.multistep(plain, precision=MIXED)(model, opt, batch)


def _all_gather_bytes(precision, text_of) -> int:
    s = ns.strategies.get("fsdp")
    mesh = s.make_mesh(8)
    dtype = jnp.float32 if precision is None else jnp.bfloat16
    model = ns.abstract_init(lambda: _net(vocab=256, d=256, h=1024, dtype=dtype), mesh, s)
    opt = ns.sharded_optimizer(model, optax.adam(1e-3), mesh, s)
    trainer = ns.Trainer(model, opt, ce_loss, mesh=mesh, rules=s.rules, steps_per_call=2,
                         precision=precision)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))
    tokens = jax.ShapeDtypeStruct((2, 16, 8), jnp.int32, sharding=spec)
    compiled, text = partitioned_hlo(trainer.lower({"inputs": tokens, "targets": tokens}))
    text = text if text_of == "partitioned" else compiled.as_text()
    return sum(c.bytes for c in compiled_collectives(text, mesh) if c.kind == "all-gather")


@pytest.mark.slow
@needs_devices(8)
def test_fsdp_all_gathers_move_bfloat16_bytes():
    f32 = _all_gather_bytes(None, "partitioned")
    mixed = _all_gather_bytes(MIXED, "partitioned")
    # Every gathered weight is cast on its shard first: half the bytes (the float32
    # LayerNorm and biases are a few hundred bytes of ~1 MB).
    assert f32 > 1_000_000
    assert 0.49 < mixed / f32 < 0.51, (mixed, f32)


def _fixture(name: str, strategy: str, dtype) -> tuple[Decoder, dict]:
    cfg = dataclasses.replace(DecoderConfig.from_hf(FIXTURES / name), dtype=dtype)
    s = ns.strategies.get(strategy)
    target = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), s.make_mesh(8), s)
    return ns.hf.load_safetensors(FIXTURES / name, target), dict(
        np.load(FIXTURES / name / "expected.npz"))


@needs_devices(8)
@pytest.mark.parametrize("name", ["hf_llama", "hf_qwen3"])
def test_bfloat16_compute_logits_follow_transformers(name):
    model, expected = _fixture(name, "fsdp_tp", jnp.bfloat16)
    tokens = expected["tokens"]
    logits = jax.device_get(nnx.jit(lambda m, t: m(t))(model, tokens))
    assert logits.dtype == np.float32                      # logits stay float32
    assert model.final_norm.scale[...].dtype == jnp.float32  # master weights as loaded
    want = expected["logits"]
    err = np.abs(logits - want).max() / np.abs(want).max()
    assert 1e-4 < err < BF16_RTOL, err  # bfloat16's rounding, not float32's, and not more


@pytest.mark.slow
@needs_devices(8)
def test_fine_tune_in_bfloat16_ends_near_float32():
    """A short fine-tune of the tiny Llama fixture on the stdlib corpus (the
    300-step figure is benchmarks/mixed_precision.py's)."""
    from nnx_shard.corpus import load_stdlib

    corpus = load_stdlib()
    final = {}
    for label, dtype, precision in (("f32", jnp.float32, None),
                                    ("mixed", jnp.bfloat16, MIXED)):
        model, _ = _fixture("hf_llama", "fsdp", dtype)
        s = ns.strategies.get("fsdp")
        mesh = s.make_mesh(8)
        opt = ns.sharded_optimizer(model, optax.adamw(3e-3), mesh, s)
        trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=s.rules, steps_per_call=20,
                             precision=precision)
        hist = trainer.fit(corpus.batches(batch=16, length=64), num_steps=60, progress=False)
        final[label] = float(np.mean(hist["loss"][-10:]))
    assert final["f32"] < 4.0  # it learned (from ~15.8 at the start)
    assert abs(final["mixed"] - final["f32"]) / final["f32"] < 0.03, final


@pytest.mark.slow
@needs_devices(8)
def test_planner_compiles_master_weights_in_float32():
    """The planner's compile of a Llama with float32 master weights and bfloat16
    compute holds float32 parameters and Adam moments (twice pure bfloat16's), and
    the formula's parameter bytes are XLA's."""
    from nnx_shard.models import get_config
    from nnx_shard.planner._compile import compiled_memory, planned_config
    from nnx_shard.planner._formula import abstract_report

    cfg = get_config("llama-tiny")
    kw = dict(sizes={"data": 8}, strategy="fsdp", batch=8, seq=16)
    pure = compiled_memory(cfg, param_dtype="bfloat16", compute_dtype="bfloat16", **kw)
    mixed = compiled_memory(cfg, param_dtype="float32", compute_dtype="bfloat16", **kw)
    assert mixed["params"] == 2 * pure["params"]
    assert abs(mixed["optimizer"] - 2 * pure["optimizer"]) <= 8  # the int32 step count
    planned, precision = planned_config(cfg, param_dtype="float32", compute_dtype="bfloat16")
    assert precision == MIXED
    s = ns.strategies.get("fsdp")
    model = nnx.eval_shape(lambda: Decoder(planned, rngs=nnx.Rngs(0)))
    report = abstract_report(model, {"data": 8}, s.rules, optax.adamw(1e-3), s.opt_rules)
    assert report.param_bytes_per_device == mixed["params"]


@pytest.mark.parametrize("field", ["params", "compute"])
@pytest.mark.parametrize("value", [None, jnp.float8_e4m3fn, "float8_e5m2", jnp.float4_e2m1fn,
                                   jnp.int8, bool, "uint16"])
def test_precision_refuses_none_low_bit_floats_and_non_floats(field, value):
    # None must not fall through to jnp.dtype(None), float64; float8/float4 and
    # integers cannot hold master weights or run a step's matmuls.
    with pytest.raises(UsageError, match=rf"Precision\({field}=.*Fix: e\.g\. {field}="):
        ns.Precision(**{field: value})


def test_precision_keeps_the_float_dtypes_it_documents():
    for name in ("float32", "bfloat16", "bf16", "fp32", "float64"):
        assert ns.Precision(params=name, compute="bf16").params.name in (
            "float32", "bfloat16", "float64")
    assert ns.Precision(params=jnp.bfloat16, compute=jnp.float32).compute == jnp.float32


def test_lora_adapters_train_in_bfloat16_compute():
    # An adapter computes in the dtype of the projection it joins, so Precision accepts
    # it; the adapters train, the base stays bitwise as loaded.
    base_only = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
    losses = {}
    for name, dtype, precision in (("f32", jnp.float32, None), ("bf16", jnp.bfloat16, MIXED)):
        model = Decoder(DecoderConfig(dtype=dtype, layers=1), rngs=nnx.Rngs(0))
        ns.lora(model, rank=4, alpha=8, targets=r"attn/(q|v)$|mlp/down$")
        if precision is not None:
            precision.check(model)
        before = jax.tree.map(np.asarray, nnx.state(model, base_only))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
        dp = ns.strategies.get("dp")
        trainer = ns.Trainer(model, opt, lm_loss, mesh=dp.make_mesh(jax.device_count()),
                             rules=dp.rules, steps_per_call=2, precision=precision)
        tokens = np.random.default_rng(0).integers(
            0, 128, (4, jax.device_count(), 16)).astype(np.int32)
        hist = trainer.fit(({"inputs": t, "targets": t} for t in tokens), num_steps=4,
                           progress=False)
        losses[name] = np.asarray(hist["loss"])
        after = nnx.state(model, base_only)
        assert all(jax.tree.leaves(jax.tree.map(
            lambda a, b: bool(np.array_equal(a, np.asarray(b))), before, after)))
        assert model.blocks[0].attn.lora_q.lora_b.get_value().dtype == jnp.float32
        assert float(np.abs(model.blocks[0].attn.lora_q.lora_b.get_value()).max()) > 0
    assert_close(losses["bf16"], losses["f32"], rtol=BF16_RTOL, what="LoRA loss in bf16 compute")
