"""Each strategy preset does what it claims, on 8 simulated devices: the one place where a
preset's correctness is proved, on a representative set of models.

The reference transformer (``tiny`` with one layer: every block is the same program, a
second adds compilation, not coverage; ``tiny_moe`` for expert parallelism) under every
preset but the pipeline ones (tests/parallel/test_pipeline.py runs those on it):

(a) loss, gradients, parameters and optimizer state after a few fused steps
    equal a single-device run;
(b) per-device bytes of parameters and optimizer state are what the strategy
    promises, read from the arrays' shards and from ``explain``;
(c) the compiled train step contains the collectives the strategy names, over
    the mesh axes it names, read from the HLO.

One module-scoped run per strategy (init, one compilation, K fused steps) feeds
all three. Then (slow) the other representative models, each under the presets that
meet its own layers, trained against a plain one-device loop:

* :class:`nnx_shard.models.Decoder` (grouped-query attention, RoPE, stacked layers) under
  pp_tp;
* a user's own model (tests/_user_models.py: a GQA Llama with its own metadata names, a
  list of blocks and an unhashable config; its Qwen3-MoE-style variant; stock
  ``nnx.MultiHeadAttention`` blocks with padding masks), through
  ``strategy.with_rules(ALIASES)``, under each kind of parallelism (the composed presets
  fsdp_tp, fsdp_cp, pp_fsdp and pp_tp stand for their parts);
* models of stock ``flax.nnx`` layers only (tests/_stock_models.py), annotated from
  outside, under fsdp_tp (and sp where they have a sequence): every Variable laid out as
  the rules say, the batch statistics and dropout keys carried, and a checkpoint restored
  onto another preset's mesh bit for bit.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard.models import Decoder, get_config, lm_loss
from nnx_shard.planner import compiled_collectives
from nnx_shard.planner._costs import KINDS as COLLECTIVE_KINDS
from tests import _stock_models as sm
from tests import _user_models as um
from tests._close import assert_close
from tests._lm import Run, assert_same_values, lm_batches, lm_run
from tests._shared import device_bytes, host, host_copy, one_device_run
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

K = 3  # fused steps per run
LR = 1e-3
RTOL = 1e-4  # x max|expected| per tensor: see tests/_close.py
# Adam divides each gradient element by its own size, so an element whose gradient
# is mostly rounding (an expert unit few tokens reach) moves by up to ~LR per step
# in either run: measured up to 8e-5 of max|param| (ep, after K steps).
RTOL_PARAMS = 1e-3
# Pipeline presets need a stacked layer axis and microbatches: tests/parallel/test_pipeline.py.
# hsdp is fsdp's tables with the batch over one more axis: tests/strategies/test_hsdp.py
# proves it against fsdp on the same devices (its values, bytes and collectives).
NAMES = tuple(n for n in ns.strategies.NAMES if not n.startswith("pp") and n != "hsdp")

# Which parameters each strategy splits, and by how much, on its default 8-device
# mesh (the promise (b) checks): path pattern -> divisor.
TP = r"attn/[qkvo]$|mlp/(up|down)$|token_embed$|unembed$"  # heads, mlp or vocab
EXPERTS = r"mlp/(up|down)$"  # the expert dimension (tiny_moe)
PROMISE = {
    #          params                               optimizer state (Adam mu, nu)
    "dp": (lambda p: 1, lambda p: 1),
    "zero1": (lambda p: 1, lambda p: 8),
    "zero2": (lambda p: 1, lambda p: 8),
    "fsdp": (lambda p: 8, lambda p: 8),
    "tp": (lambda p: 4 if re.search(TP, p) else 1, lambda p: 4 if re.search(TP, p) else 1),
    "sp": (lambda p: 4 if re.search(TP, p) else 1, lambda p: 4 if re.search(TP, p) else 1),
    "async_tp": (lambda p: 4 if re.search(TP, p) else 1,
                 lambda p: 4 if re.search(TP, p) else 1),
    # data=4 over embed (every parameter has it), model=2 over heads/mlp/vocab.
    "fsdp_tp": (lambda p: 8 if re.search(TP, p) else 4, lambda p: 8 if re.search(TP, p) else 4),
    "ep": (lambda p: 4 if re.search(EXPERTS, p) else 1,
           lambda p: 4 if re.search(EXPERTS, p) else 1),
    # data=2 over embed (every parameter has it), expert=4 over the experts.
    "fsdp_ep": (lambda p: 8 if re.search(EXPERTS, p) else 2,
                lambda p: 8 if re.search(EXPERTS, p) else 2),
    "cp": (lambda p: 1, lambda p: 1),
    "fsdp_cp": (lambda p: 4, lambda p: 4),  # data=4 over embed
}

# What XLA's CPU backend compiles a collective a preset names into (the strategies
# docstring, note [1]): a reduce-scatter is an all-reduce and a local slice.
CPU_KIND = {"reduce-scatter": "all-reduce"}

# (c): the (collective, mesh axes) pairs each compiled train step contains.
COLLECTIVES = {
    "dp": {("all-reduce", ("data",))},
    "zero1": {("all-reduce", ("data",)), ("all-gather", ("data",))},
    # The gradients' reduce-scatter is an all-reduce and a local slice on CPU (note [1]).
    "zero2": {("all-reduce", ("data",)), ("all-gather", ("data",))},
    "fsdp": {("all-reduce", ("data",)), ("all-gather", ("data",))},
    "tp": {("all-reduce", ("model",)), ("all-reduce", ("data",)), ("all-gather", ("model",))},
    "fsdp_tp": {("all-reduce", ("model",)), ("all-reduce", ("data",)),
                ("all-gather", ("model",)), ("all-gather", ("data",))},
    "sp": {("all-reduce", ("model",)), ("all-reduce", ("data",)), ("all-gather", ("model",))},
    # The projections' all-reduces become collective-permutes (ring steps); the
    # embedding, logits and norm-gradient collectives stay.
    "async_tp": {("collective-permute", ("model",)), ("all-reduce", ("model",)),
                 ("all-reduce", ("data",)), ("all-gather", ("model",))},
    "ep": {("all-to-all", ("expert",)), ("all-gather", ("expert",)),
           ("all-gather", ("data", "expert")), ("all-reduce", ("data",)),
           ("all-reduce", ("data", "expert"))},
    "fsdp_ep": {("all-to-all", ("expert",)), ("all-gather", ("expert",)),
                ("all-gather", ("data", "expert")), ("all-gather", ("data",)),
                ("all-reduce", ("data",)), ("all-reduce", ("data", "expert"))},
    "cp": {("collective-permute", ("context",)), ("all-reduce", ("context",)),
           ("all-reduce", ("data",)), ("all-gather", ("context",))},
    "fsdp_cp": {("collective-permute", ("context",)), ("all-reduce", ("context",)),
                ("all-reduce", ("data",)), ("all-gather", ("context",)),
                ("all-gather", ("data",)), ("collective-permute", ("data",))},
}


def _config(name: str):
    # tiny_moe keeps its two layers: with one, its K steps on random tokens need not lower
    # the loss, which assert_same_values checks.
    return get_config("tiny_moe") if name in ("ep", "fsdp_ep") else dataclasses.replace(
        get_config("tiny"), layers=1)


def _host_batches(cfg) -> dict[str, np.ndarray]:
    return lm_batches(K, 8, cfg.length, cfg.vocab)


def _run(strategy, mesh, cfg) -> Run:
    return lm_run(strategy, mesh, cfg, _host_batches(cfg), LR)


@functools.cache
def _reference(cfg) -> Run:
    """The same K steps on one device."""
    mesh = ns.make_mesh("data=1", devices=jax.devices()[:1])
    return _run(ns.strategies.get("dp"), mesh, cfg)


# The quick tier runs the presets that compose the others (fsdp_tp: fsdp's and tp's
# tables; fsdp_cp: cp's ring; async_tp: sp's sequence split with the projections as rings;
# fsdp_ep: ep's token routing under fsdp's parameters; zero2: zero1's replicated parameters
# and sharded optimizer state, its gradients sharded too); the slow tier adds the parts
# alone.
PARTS = ("zero1", "fsdp", "tp", "sp", "ep", "cp")


@pytest.fixture(scope="module", params=[
    pytest.param(n, marks=pytest.mark.slow) if n in PARTS else n for n in NAMES])
def run(request) -> Run:
    # Explicit axes: the collectives each preset documents are those of the
    # Explicit-typed program (on Auto axes, the default, XLA's partitioner picks
    # them; test_auto_mesh_gives_same_values covers that mode).
    s = ns.strategies.get(request.param)
    return _run(s, s.make_mesh(8, axis_types="explicit"), _config(request.param))


# --------------------------------------------------------------------------- (a) values


def test_same_values_as_one_device(run: Run) -> None:
    ref = _reference(_config(run.strategy.name))
    assert dict(run.mesh.shape) == run.strategy.mesh_for(8)
    assert_same_values(run, ref, RTOL, RTOL_PARAMS)


def test_layout_survives_training(run: Run) -> None:
    # The fused steps keep every array in the layout the strategy gave it.
    rules = run.strategy.rules
    opt_rules = run.strategy.opt_rules or rules
    want = ns.shardings(nnx.state(run.model), run.mesh, rules)
    got = jax.tree.map(lambda x: x.sharding, nnx.state(run.model))
    assert jax.tree.leaves(got) == jax.tree.leaves(want)
    mu = run.opt.opt_state[0].mu
    want_mu = ns.shardings(mu, run.mesh, opt_rules)
    assert [x.sharding for x in jax.tree.leaves(mu)] == jax.tree.leaves(want_mu)


# --------------------------------------------------------------------------- (b) bytes


def _device_bytes(tree) -> list[int]:
    """Bytes each device holds of the arrays in ``tree``."""
    return list(device_bytes(tree).values())


def _paths(state) -> list[tuple[str, int]]:
    return [
        ("/".join(str(k) for k in path), var.get_value().nbytes)
        for path, var in nnx.to_flat_state(state)
    ]


def test_bytes_per_device_match_promise(run: Run) -> None:
    name = run.strategy.name
    param_div, opt_div = PROMISE[name]
    params = nnx.state(run.model, nnx.Param)
    total = sum(b for _, b in _paths(params))
    want_params = sum(b // param_div(p) for p, b in _paths(params))
    # Adam's mu and nu, each shaped like the parameters, and its int32 step count.
    want_opt = 2 * sum(b // opt_div(p) for p, b in _paths(params)) + 4
    opt_state = run.opt.opt_state

    # Every device holds the same, and exactly the promised, number of bytes.
    assert _device_bytes(params) == [want_params] * 8
    assert _device_bytes(opt_state) == [want_opt] * 8
    report = ns.explain(run.model, run.mesh, run.strategy, optax.adam(LR))
    assert report.total_bytes == total
    assert report.param_bytes_per_device == want_params
    assert report.opt_bytes_per_device == want_opt
    # The headline claims, spelled out.
    if name == "dp":
        assert want_params == total and want_opt == 2 * total + 4
    if name in ("zero1", "zero2"):
        assert want_params == total and want_opt == 2 * total // 8 + 4
    if name == "fsdp":
        assert want_params == total // 8 and want_opt == 2 * total // 8 + 4
    if name in ("tp", "sp", "fsdp_tp", "ep", "fsdp_ep", "async_tp"):
        assert total // 8 < want_params < total


# --------------------------------------------------------------------------- (c) collectives


def test_compiled_collectives(run: Run) -> None:
    s = run.strategy
    found = compiled_collectives(run.hlo, run.mesh)
    pairs = {(c.kind, c.axes) for c in found}
    # A preset may name the reduce-scatter it means (zero2); CPU runs it as note [1] says.
    assert {c.kind for c in found} == {CPU_KIND.get(k, k) for k in s.collectives}
    assert pairs == COLLECTIVES[s.name]
    assert "reduce-scatter" not in run.hlo  # see the strategies docstring, note [1]

    def total(kind: str, axes: tuple[str, ...]) -> int:
        return sum(c.bytes for c in found if (c.kind, c.axes) == (kind, axes))

    def ops(kind: str, axes: tuple[str, ...]) -> str:
        return " ".join(c.op_name for c in found if (c.kind, c.axes) == (kind, axes))

    param_bytes = sum(b for _, b in _paths(nnx.state(run.model, nnx.Param)))
    if s.name in ("dp", "zero1", "zero2", "fsdp"):
        # Every gradient is summed over the data axis.
        assert total("all-reduce", ("data",)) >= param_bytes
    if s.name in ("zero1", "zero2", "fsdp"):
        # zero1 and zero2 gather the updated parameters, fsdp the parameters before use:
        # either way the whole model passes through all-gathers over data.
        assert total("all-gather", ("data",)) >= param_bytes
    if s.name in ("tp", "fsdp_tp", "sp"):
        # Megatron's row-parallel halves: attention output and MLP down projection.
        assert "jvp(blhk,hke->ble)" in ops("all-reduce", ("model",))
        assert "jvp(blm,me->ble)" in ops("all-reduce", ("model",))
    gathers = [c for c in found if (c.kind, c.axes) == ("all-gather", ("model",))]
    if s.name in ("tp", "fsdp_tp"):
        # Over the model axis tp gathers only the vocabulary-split token embedding ...
        assert len(gathers) == 1 and gathers[0].bytes == 128 * 32 * 4
    if s.name == "sp":
        # ... sp also gathers the sequence before attention and the MLP (and the
        # gradients of the length-split position embedding).
        assert len(gathers) > 1 + 2 * run.model.cfg.layers
    if s.name == "async_tp":
        # No all-reduce or all-gather over model for the projections: ring steps.
        for proj in ("blhk,hke->ble", "blm,me->ble", "ble,ehk->blhk", "ble,em->blm"):
            assert proj not in ops("all-reduce", ("model",)) + ops("all-gather", ("model",))
        assert "shard_map/ppermute" in ops("collective-permute", ("model",))
    if s.name in ("cp", "fsdp_cp"):
        # Ring attention: K/V blocks move by collective-permutes inside the attention
        # op; the only all-gather over context is the position embedding's gradient,
        # never the full-length keys or values ([batch/data, length, heads, kv]).
        assert "shard_map" in ops("collective-permute", ("context",))
        cfg = run.model.cfg
        full_kv = 8 // run.mesh.shape["data"] * cfg.length * cfg.heads * cfg.head_dim * 4
        assert all(c.bytes < full_kv for c in found
                   if (c.kind, c.axes) == ("all-gather", ("context",)))
    if s.name in ("ep", "fsdp_ep"):
        # Tokens go to their experts' devices and come back.
        assert "jvp(blxc,ble->xbce)" in ops("all-to-all", ("expert",))
        assert "jvp(xbce,blxc->ble)" in ops("all-to-all", ("expert",))


# --------------------------------------------------------------------------- Trainer, Auto


def test_trainer_with_strategy_matches_one_device() -> None:
    s = ns.strategies.get("fsdp_tp")
    mesh = s.make_mesh(8)
    cfg = _config("fsdp_tp")
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, s)
    opt = ns.sharded_optimizer(model, optax.adam(LR), mesh, s)
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=s.rules, steps_per_call=K,
                         batch_names=("batch", "length"))
    host = _host_batches(cfg)
    data = [{k: v[i] for k, v in host.items()} for i in range(K)]
    history = trainer.fit(data, K, progress=False)
    ref = _reference(cfg)
    assert_close(history["loss"], ref.metrics["loss"], RTOL, "loss")
    assert_close(nnx.state(model, nnx.Param), nnx.state(ref.model, nnx.Param), RTOL_PARAMS,
                 "params after Trainer.fit")


@pytest.mark.parametrize("name", [pytest.param("ep", marks=pytest.mark.slow), "sp"])
def test_auto_mesh_gives_same_values(name) -> None:
    # The presets' default mesh has Auto (GSPMD) axes: the same rules, propagation decides.
    s = ns.strategies.get(name)
    cfg = _config(name)
    mesh = s.make_mesh(8)
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}
    r = _run(s, mesh, cfg)
    ref = _reference(cfg)
    assert_close(r.metrics["loss"], ref.metrics["loss"], RTOL, "loss")
    assert_close(r.metrics["grads"], ref.metrics["grads"], RTOL, "grads")
    assert_close(nnx.state(r.model, nnx.Param), nnx.state(ref.model, nnx.Param), RTOL_PARAMS,
                 "params")
    if name == "sp":
        return
    assert "all-to-all" in {c.kind for c in compiled_collectives(r.hlo, r.mesh)}


# --------------------------------------------------------------------------- Decoder


@pytest.mark.slow
def test_llama_trains_like_one_device_under_pp_tp() -> None:
    # The library's own Decoder, its 4 stacked layers two per stage, the heads and MLP split
    # over model inside each stage; K fused Adam steps on one batch (the loss must fall).
    # The reference transformer's pipeline runs are in tests/parallel/test_pipeline.py.
    cfg = dataclasses.replace(get_config("qwen3-tiny"), layers=4, scan_layers=True)
    one = lm_batches(1, 16, 16, 128)
    batches = {k: np.repeat(v, K, axis=0) for k, v in one.items()}
    s = ns.strategies.get("pp_tp")
    mesh = s.make_mesh(8)
    run = lm_run(s, mesh, cfg, batches, 1e-2, microbatches=4, model_class=Decoder)
    ref = lm_run(ns.strategies.get("dp"), ns.make_mesh("data=1", devices=jax.devices()[:1]),
                 cfg, batches, 1e-2, model_class=Decoder)
    assert_same_values(run, ref, RTOL, RTOL_PARAMS)
    want = ns.shardings(run.model, mesh, s.rules)
    got = jax.tree.map(lambda x: x.sharding.spec, nnx.state(run.model))
    assert got == jax.tree.map(lambda x: x.spec, want)
    assert run.model.blocks.attn.q.get_value().sharding.spec[0] == "stage"


# --------------------------------------------------------------------------- a user's model

USER_STEPS, USER_BATCH = 2, 8
# Four blocks where a pipeline of 4 stages needs them (pp, pp_fsdp), else two: one per stage
# of pp_tp's 2, and half the compilation of four.
USER_MODELS = {
    "llama": (lambda layers: um.Decoder(um.Config(layers=layers), rngs=nnx.Rngs(0)), False),
    "moe": (lambda layers: um.Decoder(um.Config(layers=layers, experts=4), rngs=nnx.Rngs(0)),
            False),
    "mha": (lambda layers: um.mha_lm(um.Config(layers=layers), nnx.Rngs(0)), True),  # masks
}
# The Llama-style model under each kind of parallelism (dp, zero1 and fsdp shard no more of
# it than fsdp_tp does; cp's ring runs in fsdp_cp, pp's schedule in pp_fsdp and pp_tp); the
# MoE where its router and experts meet a split (ep, fsdp_tp); the stock-attention model
# where its padding masks meet one (the heads over model, the sequence over context) and
# its stock modules are stacked for a pipeline.
USER_MATRIX = ([("llama", p) for p in ("fsdp_tp", "sp", "async_tp", "fsdp_cp", "pp_fsdp",
                                       "pp_tp")]
               + [("moe", "ep"), ("moe", "fsdp_tp"), ("mha", "tp"), ("mha", "cp"), ("mha", "pp")])


def _sgd() -> optax.GradientTransformation:
    # SGD with momentum: updates are linear in the gradients, so float rounding of
    # differently ordered sums stays at rounding size (Adam's m/sqrt(v) turns a near-zero
    # gradient's rounding into a full-size step). Momentum gives zero1 a state to shard.
    return optax.sgd(0.05, momentum=0.9)


def _user_layers(preset: str) -> int:
    return 4 if ns.strategies.get(preset).mesh_for(8).get("stage", 1) == 4 else 2


@functools.cache
def _user_reference(name: str, layers: int) -> tuple[np.ndarray, object]:
    """Losses and final parameters of a plain nnx.jit loop on one device."""
    make, pad = USER_MODELS[name]
    return one_device_run(lambda: make(layers), um.loss_fn, _sgd(),
                          um.batches(um.Config(), USER_STEPS, USER_BATCH, pad=pad))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "preset"), USER_MATRIX, ids=[f"{m}-{p}" for m, p in USER_MATRIX])
def test_user_model_trains_like_one_device(name: str, preset: str) -> None:
    make, pad = USER_MODELS[name]
    layers = _user_layers(preset)
    s = ns.strategies.get(preset).with_rules(um.ALIASES)
    pipelined = preset.startswith("pp")
    factory = ((lambda: ns.pipeline.stack(make(layers), "layers")) if pipelined
               else (lambda: make(layers)))
    mesh = s.make_mesh()
    model = ns.sharded_init(factory, mesh, s)
    trainer = ns.Trainer(model, ns.sharded_optimizer(model, _sgd(), mesh, s), um.loss_fn,
                         mesh=mesh, rules=s.rules, steps_per_call=USER_STEPS,
                         batch_names=("batch", "length"), microbatches=4 if pipelined else 1)
    history = trainer.fit(um.batches(um.Config(), USER_STEPS, USER_BATCH, pad=pad), USER_STEPS,
                          progress=False)
    losses, params = _user_reference(name, layers)
    assert_close(np.asarray(history["loss"]), losses, RTOL, "loss")
    state = nnx.state(model)
    want = ns.shardings(state, mesh, s.rules)
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state)) == jax.tree.leaves(want)
    if pipelined:
        stacked = model.layers.attn if name == "mha" else model.layers.attn.q_proj
        assert next(iter(jax.tree.leaves(nnx.state(stacked)))).sharding.spec[0] == "stage"
        model = ns.pipeline.unstack(host_copy(model), "layers")
    # Tensors whose gradient is zero by symmetry hold rounding noise: the model's scale.
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(params))
    assert_close(host(nnx.state(model, nnx.Param)), params, RTOL, f"{name} under {preset}",
                 scale=scale)


# --------------------------------------------------------------------------- stock layers

STOCK_STEPS = 2
# fsdp_tp splits every annotated dimension a stock layer has (embed over data; heads, mlp and
# vocab over model); sp adds the sequence, for the models that have one.
STOCK_MATRIX = [(c, p) for c in sm.CASES for p in ("fsdp_tp", "sp")
                if p != "sp" or "length" in sm.CASES[c].batch_names]
TP_AXES = {"heads": "model", "mlp": "model", "vocab": "model"}
PROMISED = {"fsdp_tp": {"embed": "data", **TP_AXES}, "sp": TP_AXES}
# Where each run's checkpoint is restored: another preset, another mesh shape.
RESTORE_ON = {"fsdp_tp": "dp", "sp": "fsdp"}


@functools.cache
def _stock_batches(name: str) -> tuple[dict[str, np.ndarray], ...]:
    rng = np.random.default_rng(0)
    return tuple(sm.CASES[name].data(rng) for _ in range(STOCK_STEPS))


@functools.cache
def _stock_reference(name: str) -> tuple[np.ndarray, object]:
    """Losses and final state (batch statistics and RNG counts too) of a plain nnx.jit
    loop on one device."""
    case = sm.CASES[name]
    return one_device_run(case.factory(), case.loss_fn, _sgd(), _stock_batches(name), ...)


def _assert_stock_close(actual, expected, what: str) -> None:
    a_flat = nnx.to_flat_state(actual)
    e_flat = nnx.to_flat_state(expected)
    assert [p for p, _ in a_flat] == [p for p, _ in e_flat], what
    # A tensor whose gradient is zero by symmetry (attention's key bias: softmax
    # ignores a constant shift of the scores) holds only rounding noise (~1e-9),
    # so each tensor's scale is floored at 1e-3 of the model's largest value.
    floor = 1e-3 * max(float(np.max(np.abs(v.get_value()))) for _, v in e_flat
                       if np.asarray(v.get_value()).dtype.kind == "f")
    for (path, a), (_, e) in zip(a_flat, e_flat, strict=True):
        a, e = np.asarray(a.get_value()), np.asarray(e.get_value())
        where = f"{what}: {'/'.join(map(str, path))}"
        if e.dtype.kind != "f":  # RNG keys and counters: exactly
            np.testing.assert_array_equal(a, e, err_msg=where)
            continue
        scale = max(float(np.max(np.abs(e))) if e.size else 0.0, floor)
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=RTOL * scale, err_msg=where)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "preset"), STOCK_MATRIX,
                         ids=[f"{c}-{p}" for c, p in STOCK_MATRIX])
def test_stock_model_trains_like_one_device(name: str, preset: str, tmp_path) -> None:
    case = sm.CASES[name]
    s = ns.strategies.get(preset)
    mesh = s.make_mesh()
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}  # the presets' default mesh

    # Init through the strategy: every Variable laid out as the rules say.
    model = ns.sharded_init(case.factory(), mesh, s)
    state = nnx.state(model)
    want = ns.shardings(state, mesh, s.rules)
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state)) == jax.tree.leaves(want)
    path, names = case.probe
    probe = dict(nnx.to_flat_state(state))[tuple(path.split("/"))].get_value()
    spec = s.rules.spec(names, shape=probe.shape, mesh=mesh)
    assert probe.sharding.spec == spec
    # ... and that is what the preset promises for these names (spelled out here).
    want_axes = tuple(PROMISED[preset].get(n) for n in names)
    assert tuple(spec) + (None,) * (len(names) - len(spec)) == want_axes

    trainer = ns.Trainer(model, ns.sharded_optimizer(model, _sgd(), mesh, s), case.loss_fn,
                         mesh=mesh, rules=s.rules, steps_per_call=STOCK_STEPS,
                         batch_names=case.batch_names)
    history = trainer.fit(list(_stock_batches(name)), STOCK_STEPS, progress=False)
    losses, ref_state = _stock_reference(name)
    scale = float(np.max(np.abs(losses)))
    np.testing.assert_allclose(history["loss"], losses, rtol=RTOL, atol=RTOL * scale)
    _assert_stock_close(host(nnx.state(model)), ref_state, f"{name} under {preset}")
    # Train-mode state moved, and was carried: the reference agrees on it above.
    if name == "lm":
        assert int(model.drop.rngs.count[...]) == STOCK_STEPS  # a dropout key per step
    if name == "conv":
        assert np.abs(np.asarray(model.bn.mean[...])).max() > 0  # batch statistics
    state = nnx.state(model)  # training kept the layouts
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state)) == jax.tree.leaves(want)

    # Saved sharded, restored onto another preset's mesh: the same bits.
    ns.save(tmp_path / "ckpt", STOCK_STEPS, model=model)
    other = ns.strategies.get(RESTORE_ON[preset])
    other_mesh = other.make_mesh()
    restored = nnx.state(ns.restore(tmp_path / "ckpt", model=ns.abstract_init(
        case.factory(), other_mesh, other)))
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, restored)) == jax.tree.leaves(
        ns.shardings(restored, other_mesh, other.rules))
    for (p, a), (_, b) in zip(nnx.to_flat_state(host(restored)),
                              nnx.to_flat_state(host(state)), strict=True):
        np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg="/".join(map(str, p)))


# --------------------------------------------------------------------------- bad input


def _factory(cfg):
    return lambda: Decoder(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    ("name", "mesh", "missing", "param", "suggest"),
    [
        ("tp", "data=8", "model", "blocks/0/attn/k", "{'data': 2, 'model': 4}"),
        ("fsdp_tp", "model=8", "data", "blocks/0/attn/k", "{'data': 4, 'model': 2}"),
        ("sp", "data=4,expert=2", "model", "blocks/0/attn/k", "{'data': 2, 'model': 4}"),
        ("fsdp", "model=8", "data", "blocks/0/attn/k", "{'data': 8}"),
    ],
)
def test_mesh_missing_strategy_axis(name, mesh, missing, param, suggest) -> None:
    s = ns.strategies.get(name)
    with pytest.raises(ns.ShardingError) as e:
        ns.sharded_init(_factory(get_config("tiny")), mesh, s)
    msg = str(e.value)
    assert f"no axis '{missing}'" in msg and f"'{param}'" in msg
    assert f"Suggested mesh: {suggest}" in msg
    with pytest.raises(ns.ShardingError, match="Suggested mesh"):
        ns.abstract_init(_factory(get_config("tiny")), mesh, s)


def test_missing_axis_with_renamed_axes() -> None:
    s = ns.strategies.get("ep", data="batch", expert="moe")
    model = nnx.eval_shape(_factory(get_config("tiny_moe")))
    with pytest.raises(ns.ShardingError, match=r"no axis 'moe'.*'blocks/0/mlp/down'.*"
                       r"Suggested mesh: \{'batch': 2, 'moe': 4\}"):
        s.check(model, "batch=8")
    s.check(model, "batch=2,moe=4")


@pytest.mark.parametrize(
    ("name", "cfg", "mesh", "param", "logical", "suggest"),
    [
        # heads=4 on model=8
        ("tp", {}, {"data": 1, "model": 8}, "blocks/0/attn/k", "heads",
         "{'data': 2, 'model': 4}"),
        # mlp=36 on model=8 (heads=8 and vocab=128 divide)
        ("tp", {"heads": 8, "mlp": 36}, {"data": 1, "model": 8}, "blocks/0/mlp/down", "mlp",
         "{'data': 2, 'model': 4}"),
        # experts=4 on expert=8
        ("ep", {"experts": 4}, {"data": 1, "expert": 8}, "blocks/0/mlp/down", "expert",
         "{'data': 2, 'expert': 4}"),
        # heads=3: only model=1 fits
        ("fsdp_tp", {"heads": 3}, {"data": 4, "model": 2}, "blocks/0/attn/k", "heads",
         "{'data': 8, 'model': 1}"),
    ],
)
def test_indivisible_dimension(name, cfg, mesh, param, logical, suggest) -> None:
    config = dataclasses.replace(get_config("tiny"), **cfg)
    s = ns.strategies.get(name)
    with pytest.raises(ns.ShardingError) as e:
        ns.sharded_init(_factory(config), ns.make_mesh(mesh), s)
    msg = str(e.value)
    assert f"parameter '{param}'" in msg and f"rule '{logical}'" in msg
    assert f"Suggested mesh: {suggest}" in msg
    # The suggestion works.
    fits = ast.literal_eval(suggest)
    s.check(nnx.eval_shape(_factory(config)), fits)


def test_no_mesh_fits() -> None:
    config = dataclasses.replace(get_config("tiny"), embed=30)
    model = nnx.eval_shape(_factory(config))
    with pytest.raises(ns.ShardingError, match="No mesh over \\('data',\\) with 8 devices"):
        ns.strategies.get("fsdp").check(model, "data=8")


def test_get_and_mesh_for() -> None:
    assert ns.strategies.NAMES == ("dp", "zero1", "zero2", "fsdp", "hsdp", "tp", "fsdp_tp", "sp",
                                   "ep", "fsdp_ep", "async_tp", "cp", "fsdp_cp", "pp", "pp_fsdp",
                                   "pp_tp")
    for name in (*NAMES, "hsdp"):
        s = ns.strategies.get(name)
        assert s.name == name and s.mesh_axes[0] == ("replica" if name == "hsdp" else "data")
        assert s.across == ("replica" if name == "hsdp" else None)
        assert set(s.collectives) <= set(COLLECTIVE_KINDS)
        assert np.prod(list(s.mesh_for(8).values())) == 8
        for logical in ns.strategies.LOGICAL:
            assert logical in s.rules
    with pytest.raises(ns.ShardingError, match="Did you mean 'fsdp'"):
        ns.strategies.get("fsdpp")
    with pytest.raises(ns.ShardingError, match="takes mesh-axis keywords \\['data'\\]"):
        ns.strategies.get("dp", model="m")
    with pytest.raises(ns.ShardingError, match="must be distinct"):
        ns.strategies.get("tp", data="x", model="x")
    assert ns.strategies.get("fsdp_tp").mesh_for(6) == {"data": 3, "model": 2}


def test_strategy_helpers_refuse_wrong_types():
    with pytest.raises(ns.ShardingError, match=r"name must be a preset name \(str\), got int 5"):
        ns.strategies.get(5)
    for n in (True, 8.0, 0):
        with pytest.raises(ns.NnxShardError, match=r"mesh_for: n_devices must be a positive int"):
            ns.strategies.get("tp").mesh_for(n)
    with pytest.raises(ns.UsageError, match=r"Strategy.check: model must be an nnx.Module"):
        ns.strategies.get("tp").check(5, {"data": 2, "model": 4})
    with pytest.raises(ns.UsageError, match=r"compiled_collectives: hlo_text must be the text"):
        compiled_collectives(5, ns.make_mesh("data=8"))
    with pytest.raises(ns.UsageError, match=r"compiled_collectives: mesh must be a jax Mesh, got str"):
        compiled_collectives("", "data=8")
