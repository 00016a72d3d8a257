"""LoRA adapters (nnx_shard._low_rank): placement, names, sharding, training only the
adapters (under the presets whose layouts they meet, to the one-device numbers), the
optimizer state's compiled bytes, merging, and the errors of ns.lora."""

import dataclasses
import functools
import math
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard._low_rank import Adapter, adapters, without_adapters
from nnx_shard.models import Decoder, get_config, lm_loss
from tests import _user_models as um
from tests._close import assert_close
from tests._shared import device_bytes, host, host_copy
from tests.conftest import needs_devices


def _llama(scan: bool = False) -> Decoder:
    return Decoder(dataclasses.replace(get_config("llama-tiny"), scan_layers=scan),
                 rngs=nnx.Rngs(0))


def test_linear_starts_equal_and_merges():
    layer = nnx.Linear(6, 3, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6))
    y0 = layer(x)
    assert ns.lora(layer, rank=2, alpha=8, targets=r"kernel$") is layer
    node = layer.dot_general
    assert type(layer.kernel) is nnx.Param
    assert isinstance(node, Adapter) and node.scale == 4.0
    assert isinstance(node.lora_a, nnx.LoRAParam) and node.lora_a.shape == (6, 2)
    a = np.asarray(node.lora_a[...])
    assert np.abs(a).max() <= 1 / math.sqrt(6) and np.abs(a).max() > 0  # PEFT's bound
    assert not np.asarray(node.lora_b[...]).any()  # B zeros: starts as the base
    np.testing.assert_array_equal(layer(x), y0)
    node.lora_b[...] = jnp.ones((2, 3))
    y1 = layer(x)
    want = y0 + 4.0 * (x @ node.lora_a[...]) @ jnp.ones((2, 3))
    np.testing.assert_allclose(y1, want, rtol=1e-5, atol=1e-5)
    ns.merge_lora(layer)
    assert type(layer.kernel) is nnx.Param and not adapters(layer)
    assert sorted(nnx.state(layer)) == ["bias", "kernel"]
    np.testing.assert_allclose(layer(x), y1, rtol=1e-5, atol=1e-5)


def test_linear_general_splits_its_input_axes():
    layer = nnx.LinearGeneral((4, 2), 5, axis=(-2, -1), rngs=nnx.Rngs(0))
    ns.lora(layer, 3, 3.0, targets="kernel")
    node = adapters(layer)["kernel"]
    assert node.lora_a.shape == (4, 2, 3) and node.lora_b.shape == (3, 5)
    node.lora_b[...] = jnp.ones((3, 5))
    x = jnp.ones((1, 4, 2))
    got = layer(x)
    ns.merge_lora(layer)
    np.testing.assert_allclose(layer(x), got, rtol=1e-5)


@pytest.mark.parametrize("scan", [False, True])
def test_llama_adapters_carry_the_kernels_names(scan):
    model = ns.lora(_llama(scan), 4, 8.0, targets=r"attn/(q|o)$|mlp/down$")
    nodes = adapters(model)
    stack = ("layers",) if scan else ()
    q = nodes["blocks/attn/q" if scan else "blocks/0/attn/q"]
    o = nodes["blocks/attn/o" if scan else "blocks/0/attn/o"]
    down = nodes["blocks/mlp/down" if scan else "blocks/1/mlp/down"]
    assert len(nodes) == (3 if scan else 6)
    assert q.lora_a.get_metadata("out_sharding") == (*stack, "embed", None)
    assert q.lora_b.get_metadata("out_sharding") == (*stack, None, "heads", "kv")
    assert o.lora_a.get_metadata("out_sharding") == (*stack, "heads", "kv", None)
    assert o.lora_b.get_metadata("out_sharding") == (*stack, None, "embed")
    assert down.lora_a.get_metadata("out_sharding") == (*stack, "mlp", None)
    assert o.lora_a.shape[-3:] == (4, 8, 4)


def test_sharded_adapters_follow_their_layer():
    strategy = ns.strategies.get("fsdp_tp")
    mesh = strategy.make_mesh(8)
    model = ns.sharded_init(
        lambda: ns.lora(_llama(), 4, 8.0, targets=r"attn/(q|o)$"), mesh, strategy)
    assert type(model.blocks[0].attn.q) is nnx.Param
    kernel = tuple(model.blocks[0].attn.q.get_value().sharding.spec)
    q = model.blocks[0].attn.lora_q
    assert tuple(q.lora_a.get_value().sharding.spec) == (kernel[0], None)
    assert tuple(q.lora_b.get_value().sharding.spec)[:2] == (None, kernel[1])
    assert "model" in str(q.lora_b.get_value().sharding.spec)
    report = str(ns.explain(model, mesh, strategy.rules))
    assert "blocks/0/attn/lora_q/lora_a" in report and "blocks/0/attn/lora_o/lora_b" in report


def _tokens(n=8):
    toks = np.random.default_rng(0).integers(0, 128, (n, 17)).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


@pytest.mark.slow
def test_training_only_the_adapters_keeps_the_base_bitwise(tmp_path):
    strategy = ns.strategies.get("fsdp")
    mesh = strategy.make_mesh(8)
    model = ns.sharded_init(lambda: ns.lora(_llama(scan=True), 4, 8.0), mesh, strategy)
    opt = ns.sharded_optimizer(model, optax.adam(1e-2), mesh, strategy, wrt=nnx.LoRAParam)
    state_paths = [jax.tree_util.keystr(p) for p, _ in
                   jax.tree_util.tree_leaves_with_path(nnx.state(opt.opt_state))]
    moments = [p for p in state_paths if "count" not in p]
    assert len(moments) == 8  # mu and nu of q and v's A and B, nothing of the base
    assert all("lora_a" in p or "lora_b" in p for p in moments)
    base0 = jax.device_get(nnx.state(model, nnx.Not(nnx.LoRAParam)))
    lora0 = jax.device_get(nnx.state(model, nnx.LoRAParam))
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=strategy.rules,
                         steps_per_call=2, batch_names=("batch", "length"))
    history = trainer.fit((_tokens() for _ in range(8)), num_steps=4, progress=False)
    assert history["loss"][-1] < history["loss"][0]
    for a, b in zip(jax.tree.leaves(base0),
                    jax.tree.leaves(jax.device_get(nnx.state(model, nnx.Not(nnx.LoRAParam)))),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(lora0),
                    jax.tree.leaves(jax.device_get(nnx.state(model, nnx.LoRAParam))),
                    strict=True):
        assert not np.array_equal(a, b)
    ns.save(tmp_path, 4, model=model, optimizer=opt)
    fresh = ns.sharded_init(lambda: ns.lora(_llama(scan=True), 4, 8.0, rngs=9), mesh, strategy)
    fresh_opt = ns.sharded_optimizer(fresh, optax.adam(1e-2), mesh, strategy, wrt=nnx.LoRAParam)
    back, back_opt, _ = ns.restore(tmp_path, model=fresh, optimizer=fresh_opt)
    for a, b in zip(jax.tree.leaves(nnx.state((model, opt))),
                    jax.tree.leaves(nnx.state((back, back_opt))), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_adapter_only_steps_differentiate_only_the_adapters():
    model = ns.lora(_llama(), 2, 4.0)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.LoRAParam)
    seen = []

    def step(model, opt, batch):
        loss, grads = ns.value_and_grad(lm_loss, wrt=opt.wrt)(model, batch)
        seen.append(sorted({type(v).__name__ for v in jax.tree.leaves(
            grads, is_leaf=lambda x: isinstance(x, nnx.Variable))}))
        opt.update(model, grads)
        return {"loss": loss}

    batch = {k: v[None] for k, v in _tokens(2).items()}
    ns.multistep(step)(model, opt, batch)
    assert seen == [["LoRAParam"]]


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"rank": 0}, ns.NnxShardError, "lora rank must be a positive int"),
    ({"rank": True}, ns.NnxShardError, "(a bool)"),
    ({"alpha": float("nan")}, ns.NnxShardError, "alpha must be a finite number"),
    ({"alpha": "16"}, ns.NnxShardError, "alpha must be a finite number"),
    ({"dropout": 1.0}, ns.NnxShardError, "dropout must be a number in [0, 1)"),
    ({"dropout": -0.1}, ns.NnxShardError, "dropout must be a number in [0, 1)"),
    ({"targets": r"nothing/here"}, ns.NnxShardError, "blocks/0/attn/q"),
    ({"targets": "("}, ns.NnxShardError, "is not a regex"),
    ({"targets": r"attn_norm/scale$"}, ns.ShardingError, "not a 2-D-like projection"),
])
def test_lora_errors(kwargs, error, words):
    args = {"rank": 4, "alpha": 8.0} | kwargs
    with pytest.raises(error, match="Fix:") as info:
        ns.lora(_llama(), **args)
    assert words in str(info.value)


def test_lora_twice_and_merge_without_adapters():
    model = ns.lora(_llama(), 2, 4.0)
    with pytest.raises(ns.NnxShardError, match="already have adapters"):
        ns.lora(model, 2, 4.0)
    ns.lora(model, 2, 4.0, targets=r"mlp/up$")  # other kernels are fine
    assert len(adapters(model)) == 6
    with pytest.raises(ns.NnxShardError, match="has no LoRA adapters"):
        ns.merge_lora(_llama())


def test_without_adapters_reads_the_base_inside_jit_and_leaves_the_model_adapted():
    """Stacked reference blocks and a stock layer: the base's outputs bit for bit, inside
    jit, with the model's adapters (and their non-zero B) still in place."""
    model = _llama(scan=True)
    tokens = jnp.arange(8, dtype=jnp.int32)[None] % 128
    base_logits = model(tokens)
    ns.lora(model, 2, 4.0, targets=r"attn/(q|v)$|unembed")
    for node in adapters(model).values():
        node.lora_b[...] = jnp.ones(node.lora_b.shape) * 0.1
    adapted, base = nnx.jit(lambda m: (m(tokens), without_adapters(m)(tokens)))(model)
    np.testing.assert_array_equal(base, base_logits)
    assert float(jnp.max(jnp.abs(adapted - base_logits))) > 1e-3
    assert len(adapters(model)) == 3
    with pytest.raises(ns.NnxShardError, match="no LoRA adapters to switch off"):
        without_adapters(_llama())
    layer = ns.lora(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), 2, 4.0, targets="kernel")
    layer.bias = nnx.LoRAParam(layer.bias[...])  # trained in full, as modules_to_save
    with pytest.raises(ns.UsageError, match="'bias' .*modules_to_save.*Fix: adapters alone"):
        without_adapters(layer)


def test_reference_transformer_adapts_and_merges():
    from nnx_shard.models import Decoder, get_config

    model = Decoder(get_config("tiny"), rngs=nnx.Rngs(0))
    ns.lora(model, 2, 4.0, targets=r"attn/(q|k|v|o)$|mlp/(up|down)$")
    nodes = adapters(model)
    assert len(nodes) == 6 * get_config("tiny").layers
    for node in nodes.values():
        node.lora_b.set_value(0.1 * jnp.ones(node.lora_b.shape))
    tokens = jnp.asarray(_tokens(2)["inputs"])
    adapted = model(tokens)
    ns.merge_lora(model)
    np.testing.assert_allclose(model(tokens), adapted, rtol=1e-4, atol=1e-4)
    with pytest.raises(ns.ShardingError, match="not a 2-D-like projection"):
        ns.lora(Decoder(get_config("tiny_moe"), rngs=nnx.Rngs(0)), 2, 4.0,
                targets=r"experts?/(up|down)$|moe/(up|down)$|mlp/(up|down)$")


def _compiled_opt_init(rank: int, wrt: Any = nnx.LoRAParam) -> tuple[Any, Any, int]:
    """The model (fsdp, 8 devices), the compiled memory analysis of the program
    ``sharded_optimizer`` runs to build Adam's state for ``wrt``, and its output count."""
    from nnx_shard._init import _lower_optimizer

    strategy = ns.strategies.get("fsdp")
    mesh = strategy.make_mesh(8)
    model = ns.sharded_init(
        lambda: ns.lora(_llama(), rank, 8.0, targets=r"attn/(q|v|o)$|mlp/down$"), mesh, strategy)
    _, lowered, _ = _lower_optimizer(model, optax.adam(1e-3), mesh, strategy.rules, wrt,
                                     strategy.opt_rules)
    outputs = len(jax.tree.leaves(lowered.out_info))
    return model, lowered.compile().memory_analysis(), outputs


@pytest.mark.slow  # three compilations
@needs_devices(8)
def test_adapter_only_adam_state_is_twice_the_adapters_per_device():
    got, adapters_at = {}, {}
    for rank in (4, 8):
        model, memory, outputs = _compiled_opt_init(rank)
        adapter = set(device_bytes(nnx.state(model, nnx.LoRAParam)).values())
        assert len(adapter) == 1  # every device holds the same share
        adapters_at[rank] = next(iter(adapter))
        # XLA counts the output tuple's table (one 8-byte pointer an output) in the
        # output size; the scalars are Adam's count and the optimizer's step (int32).
        state = memory.output_size_in_bytes - 8 * outputs
        assert state == 2 * adapter.pop() + 2 * 4, (rank, state)  # mu and nu, no base
        got[rank] = state - 8
    assert got[8] == 2 * got[4] > 0
    # The same measure sees the base's moments when the base is trained too (wrt=Param
    # takes LoRAParam, its subclass, as well).
    model, memory, outputs = _compiled_opt_init(4, wrt=nnx.Param)
    every = max(device_bytes(nnx.state(model, nnx.Param)).values())
    assert every > 2 * adapters_at[4]  # the base is most of the model
    assert memory.output_size_in_bytes - 8 * outputs == 2 * every + 8


# --------------------------------------------------------------------------- every preset

LORA_TARGETS = r"attn/(q_proj|v_proj)/kernel$|mlp/down/kernel$"
STEPS = 2
# Two blocks: one per stage under pp_tp (2 stages), and half the compilation of four.
LORA_CFG = um.Config(layers=2)


def _factor(path: str, layer: int, shape: tuple[int, ...]) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(zlib.crc32(path.encode())), layer)
    return 0.3 * jax.random.normal(key, shape)


def _user_lora(stacked: bool = False) -> nnx.Module:
    """The user Llama of tests/_user_models.py with rank-2 adapters on q, v and down,
    both factors drawn per layer from the adapter's path (B non-zero, so the first step
    moves both), the same numbers whether its blocks are a list or stacked."""
    model = um.Decoder(LORA_CFG, rngs=nnx.Rngs(0))
    if stacked:  # adapters go on the stacked kernels, their leading axis the layer's
        model = ns.pipeline.stack(model, "layers")
    ns.lora(model, 2, 4.0, targets=LORA_TARGETS)
    for path, node in adapters(model).items():
        for factor in (node.lora_a, node.lora_b):
            # the path less 'layers/' (and the layer index, in the list form)
            name = path.split("/", 1 if stacked else 2)[-1]
            name += "/a" if factor is node.lora_a else "/b"
            if stacked:
                rows = [_factor(name, i, factor.shape[1:]) for i in range(factor.shape[0])]
                factor.set_value(jnp.stack(rows))
            else:
                factor.set_value(_factor(name, int(path.split("/")[1]), factor.shape))
    return model


def _lora_tx() -> optax.GradientTransformation:
    return optax.adam(1e-2)


def _lora_batches() -> list[dict[str, np.ndarray]]:
    return um.batches(LORA_CFG, STEPS, 8)


@functools.cache
def _lora_reference() -> tuple[np.ndarray, Any]:
    """Losses and final adapters of a plain one-device nnx.jit loop."""
    with jax.default_device(jax.devices()[0]), nnx.use_eager_sharding(False):
        model = _user_lora()
        opt = nnx.Optimizer(model, _lora_tx(), wrt=nnx.LoRAParam)

        @nnx.jit
        def step(model, opt, batch):
            loss, grads = nnx.value_and_grad(um.loss_fn, argnums=nnx.DiffState(
                0, nnx.LoRAParam))(model, batch)
            opt.update(model, grads)
            return loss

        start = host(nnx.state(model, nnx.LoRAParam))
        losses = [float(step(model, opt, jax.tree.map(jnp.asarray, b)))
                  for b in _lora_batches()]
    end = host(nnx.state(model, nnx.LoRAParam))
    assert all(not np.array_equal(a, b)  # both factors of every adapter move
               for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(end), strict=True))
    return np.asarray(losses), host(nnx.state(model, nnx.LoRAParam))


# The presets whose layouts the adapters meet: the optimizer state of the adapters alone
# sharded (zero1), the factors split with their kernel over data and model (fsdp_tp), the
# sequence split through them (sp), and stacked adapters over a pipeline's stages with
# their kernels' model split inside each (pp_tp). That the presets themselves compute what
# one device does is the preset matrix's (tests/test_strategies.py); async_tp's rings
# through adapted layers: test_adapted_stock_layers_still_run_as_rings_under_async_tp.
LORA_PRESETS = ("zero1", "fsdp_tp", "sp", "pp_tp")


@pytest.mark.slow
@needs_devices(8)
@pytest.mark.parametrize("preset", LORA_PRESETS)
def test_lora_trains_like_one_device_under_the_presets_it_meets(preset):
    s = ns.strategies.get(preset).with_rules(um.ALIASES)
    pipelined = s.mesh_for(8).get("stage", 1) > 1
    mesh = s.make_mesh()
    model = ns.sharded_init(lambda: _user_lora(stacked=pipelined), mesh, s)
    opt = ns.sharded_optimizer(model, _lora_tx(), mesh, s, wrt=nnx.LoRAParam)
    trainer = ns.Trainer(model, opt, um.loss_fn, mesh=mesh, rules=s.rules,
                         steps_per_call=STEPS, batch_names=("batch", "length"),
                         microbatches=4 if pipelined else 1)
    history = trainer.fit(_lora_batches(), STEPS, progress=False)
    losses, want = _lora_reference()
    assert_close(np.asarray(history["loss"]), losses, 1e-4, f"loss under {preset}")
    if pipelined:
        model = ns.pipeline.unstack(host_copy(model), "layers")
    got = host(nnx.state(model, nnx.LoRAParam))
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(want))
    assert_close(got, want, 1e-4, f"adapters under {preset}", scale=scale)


# --------------------------------------------------------------------------- cost

def _step_cost(cfg: Any, adapters: bool) -> tuple[float, float]:
    """XLA's flops and temporary bytes of one compiled SGD step (abstract: nothing
    allocated) of every Param of ``cfg``'s Decoder, or of rank-16 adapters on its seven
    projections alone."""
    def make():
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        return ns.lora(model, 16, 32.0, targets=r"attn/(q|k|v|o)$|mlp/(gate|up|down)$") \
            if adapters else model

    graphdef, trained, frozen = nnx.split(nnx.eval_shape(make),
                                          nnx.LoRAParam if adapters else nnx.Param, ...)
    batch = {k: jax.ShapeDtypeStruct((1, 256), jnp.int32) for k in ("inputs", "targets")}

    def step(trained, frozen, batch):
        loss, grads = jax.value_and_grad(
            lambda p: lm_loss(nnx.merge(graphdef, p, frozen), batch))(trained)
        return loss, jax.tree.map(lambda p, g: p - (1e-3 * g).astype(p.dtype), trained, grads)

    compiled = jax.jit(step, donate_argnums=0).lower(trained, frozen, batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return float(cost["flops"]), float(compiled.memory_analysis().temp_size_in_bytes)


def test_adapter_only_step_costs_less_than_full_fine_tuning():
    # A Llama-3-8B-shaped block, smaller: the adapters act on the activations, so the
    # step never forms W + s A @ B nor a gradient of W's size. In float32: XLA:CPU runs
    # bfloat16 dots on float32 copies of their operands, whose copies of the frozen
    # weights would dominate its temporaries (benchmarks/lora_cost.py measures bf16).
    cfg = dataclasses.replace(
        get_config("llama3-8b"), layers=1, vocab=4096, embed=512, mlp=1792, heads=4,
        kv_heads=1, head_dim=128, dtype=jnp.float32, param_dtype=jnp.float32)
    full_flops, full_temp = _step_cost(cfg, adapters=False)
    lora_flops, lora_temp = _step_cost(cfg, adapters=True)
    assert lora_flops / full_flops <= 0.72, (lora_flops, full_flops)
    assert lora_temp / full_temp <= 0.75, (lora_temp, full_temp)


def _every_stock_kernel_adapted() -> nnx.Module:
    """The user Llama with rank-2 adapters on every stock layer (B non-zero)."""
    model = um.Decoder(LORA_CFG, rngs=nnx.Rngs(0))
    ns.lora(model, 2, 4.0, targets=r"kernel$")
    for path, node in adapters(model).items():
        node.lora_a.set_value(_factor(path + "/a", 0, node.lora_a.shape))
        node.lora_b.set_value(_factor(path + "/b", 0, node.lora_b.shape))
    return model


@pytest.mark.slow  # two compilations
@needs_devices(8)
def test_adapted_stock_layers_still_run_as_rings_under_async_tp():
    from nnx_shard.planner import compiled_collectives

    s = ns.strategies.get("async_tp").with_rules(um.ALIASES)
    mesh = s.make_mesh()
    model = ns.sharded_init(_every_stock_kernel_adapted, mesh, s)
    opt = ns.sharded_optimizer(model, _lora_tx(), mesh, s, wrt=nnx.LoRAParam)

    def step(model, opt, batch):
        loss, grads = ns.value_and_grad(um.loss_fn, wrt=opt.wrt)(model, batch)
        opt.update(model, grads)
        return loss

    first = _lora_batches()[0]
    with ns.use(mesh, s.rules):
        batch = ns.shard_batch({k: v[None] for k, v in first.items()}, mesh, s.rules,
                               ("batch", "length"), steps=True)
        fused = ns.multistep(step)
        hlo = fused.lower(model, opt, batch).compile().as_text()
        loss = float(jax.device_get(fused(model, opt, batch))[0])
    # Every projection has an adapter, each calling the collective matmul its layer would
    # have run: ring steps over model (3 on 8 devices, two halves each), forward and back.
    rings = [c for c in compiled_collectives(hlo, mesh)
             if c.kind == "collective-permute" and "ppermute" in c.op_name]
    assert rings and all(c.axes == ("model",) for c in rings)
    assert len(rings) >= 4 * 3 * 2
    # The caller's layers keep Flax's op under their adapters: the step intercepted a copy.
    assert model.layers[0].attn.q_proj.dot_general.inner is jax.lax.dot_general
    with jax.default_device(jax.devices()[0]), nnx.use_eager_sharding(False):
        want = float(nnx.jit(um.loss_fn)(_every_stock_kernel_adapted(),
                                         jax.tree.map(jnp.asarray, first)))
    assert_close(loss, want, 1e-4, "adapted loss under async_tp against one device")


def test_intercept_puts_the_projection_op_under_the_adapter():
    with nnx.use_eager_sharding(False):
        model = ns.tp_layers.intercept(_user_lora())
        fresh = ns.tp_layers.intercept(um.Decoder(LORA_CFG, rngs=nnx.Rngs(0)))
    node = model.layers[0].attn.q_proj.dot_general
    assert isinstance(node, Adapter) and isinstance(node.inner, ns.tp_layers.ProjectionOp)
    assert node.inner.kind == "dot_general"
    assert isinstance(model.layers[0].attn.k_proj.dot_general, ns.tp_layers.ProjectionOp)
    assert ns.tp_layers.intercept(model).layers[0].attn.q_proj.dot_general is node  # again
    # lora after intercept wraps the ProjectionOp; merge_lora puts it back on the layer.
    ns.lora(fresh, 2, 4.0, targets=LORA_TARGETS)
    op = fresh.layers[0].attn.q_proj.dot_general.inner
    assert isinstance(op, ns.tp_layers.ProjectionOp)
    ns.merge_lora(fresh)
    assert fresh.layers[0].attn.q_proj.dot_general is op


# --------------------------------------------------------------------------- dropout

DROP_TARGETS = r"attn/(q|v|o)$|mlp/(up|down)$"


def _dropout_llama(p: float) -> Decoder:
    """The tiny Llama with adapters of dropout ``p`` on q, v, o, up and down, whose
    factors are drawn from their paths (B non-zero), whatever ``p``."""
    model = ns.lora(_llama(), 4, 8.0, targets=DROP_TARGETS, dropout=p)
    for path, node in adapters(model).items():
        node.lora_a.set_value(_factor(path + "/a", 0, node.lora_a.shape))
        node.lora_b.set_value(_factor(path + "/b", 0, node.lora_b.shape))
    return model


def test_adapter_dropout_draws_in_training_and_is_off_in_eval():
    model = _dropout_llama(0.5)
    node = model.blocks[0].attn.lora_q
    assert isinstance(node.dropout, nnx.Dropout) and node.dropout.rate == 0.5
    assert _dropout_llama(0.0).blocks[0].attn.lora_q.dropout is None
    tokens = jnp.asarray(_tokens(2)["inputs"])
    first, second = np.asarray(model(tokens)), np.asarray(model(tokens))
    assert not np.allclose(first, second, atol=1e-3)  # a new mask every call
    model.eval()
    evaluated = np.asarray(model(tokens))
    assert not np.allclose(first, evaluated, atol=1e-3)
    assert not np.allclose(second, evaluated, atol=1e-3)
    # Evaluation mode is the model without dropout, the same factors.
    np.testing.assert_array_equal(evaluated, np.asarray(_dropout_llama(0.0)(tokens)))
    np.testing.assert_array_equal(np.asarray(model(tokens)), evaluated)
    model.train()
    assert not np.allclose(np.asarray(model(tokens)), evaluated, atol=1e-3)


@pytest.mark.slow
def test_generation_and_decoding_apply_no_adapter_dropout():
    from nnx_shard.inference import GenerationConfig, generate
    from nnx_shard.models import Decoder

    model = _dropout_llama(0.5)
    prompt = np.asarray(_tokens(2)["inputs"][:, :6])
    eight = GenerationConfig(max_new_tokens=8)
    dropped = np.asarray(generate(model, prompt, eight))
    model.eval()
    np.testing.assert_array_equal(dropped, np.asarray(generate(model, prompt, eight)))
    # The reference model's decoding too: attention, MLP and the head.
    tiny = dataclasses.replace(get_config("tiny"), tie_embeddings=False)

    def logits(model: Decoder, tokens: jax.Array) -> np.ndarray:
        model.init_cache(batch=tokens.shape[0], length=tokens.shape[1])
        return np.asarray(model.decode(tokens))

    targets = r"attn/(q|k|v|o)$|mlp/(up|down)$|unembed$"
    trained = ns.lora(Decoder(tiny, rngs=nnx.Rngs(0)), 2, 4.0, targets=targets,
                      dropout=0.5)
    for path, node in adapters(trained).items():
        node.lora_b.set_value(_factor(path, 0, node.lora_b.shape))
    tokens = jnp.asarray(_tokens(2)["inputs"][:, :8])
    train_logits = logits(trained, tokens)
    assert not np.allclose(np.asarray(trained(tokens)), np.asarray(trained(tokens)), atol=1e-3)
    trained.eval()
    np.testing.assert_allclose(train_logits, logits(trained, tokens), rtol=0, atol=0)
    np.testing.assert_allclose(train_logits[:, -1], np.asarray(trained(tokens))[:, -1],
                               atol=1e-4)
