"""Each strategy preset does what it claims, on 8 simulated devices with the
reference transformer (``tiny``; ``tiny_moe`` for expert parallelism):

(a) loss, gradients, parameters and optimizer state after a few fused steps
    equal a single-device run;
(b) per-device bytes of parameters and optimizer state are what the strategy
    promises, read from the arrays' shards and from ``explain``;
(c) the compiled train step contains the collectives the strategy names, over
    the mesh axes it names, read from the HLO.

One module-scoped run per strategy (init, one compilation, K fused steps) feeds
all three.
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
from nnx_shard.models import Transformer, get_config, lm_loss
from nnx_shard.planner import compiled_collectives
from nnx_shard.planner._costs import KINDS as COLLECTIVE_KINDS
from tests._close import assert_close
from tests._lm import Run, assert_same_values, lm_batches, lm_run
from tests._shared import device_bytes
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
NAMES = tuple(n for n in ns.strategies.NAMES if not n.startswith("pp"))

# Which parameters each strategy splits, and by how much, on its default 8-device
# mesh (the promise (b) checks): path pattern -> divisor.
TP = r"attn/[qkvo]$|mlp/(up|down)$|token_embed$|unembed$"  # heads, mlp or vocab
EXPERTS = r"mlp/(up|down)$"  # the expert dimension (tiny_moe)
PROMISE = {
    #          params                               optimizer state (Adam mu, nu)
    "dp": (lambda p: 1, lambda p: 1),
    "zero1": (lambda p: 1, lambda p: 8),
    "fsdp": (lambda p: 8, lambda p: 8),
    "tp": (lambda p: 4 if re.search(TP, p) else 1, lambda p: 4 if re.search(TP, p) else 1),
    "sp": (lambda p: 4 if re.search(TP, p) else 1, lambda p: 4 if re.search(TP, p) else 1),
    "async_tp": (lambda p: 4 if re.search(TP, p) else 1,
                 lambda p: 4 if re.search(TP, p) else 1),
    # data=4 over embed (every parameter has it), model=2 over heads/mlp/vocab.
    "fsdp_tp": (lambda p: 8 if re.search(TP, p) else 4, lambda p: 8 if re.search(TP, p) else 4),
    "ep": (lambda p: 4 if re.search(EXPERTS, p) else 1,
           lambda p: 4 if re.search(EXPERTS, p) else 1),
    "cp": (lambda p: 1, lambda p: 1),
    "fsdp_cp": (lambda p: 4, lambda p: 4),  # data=4 over embed
}

# (c): the (collective, mesh axes) pairs each compiled train step contains.
COLLECTIVES = {
    "dp": {("all-reduce", ("data",))},
    "zero1": {("all-reduce", ("data",)), ("all-gather", ("data",))},
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
    "cp": {("collective-permute", ("context",)), ("all-reduce", ("context",)),
           ("all-reduce", ("data",)), ("all-gather", ("context",))},
    "fsdp_cp": {("collective-permute", ("context",)), ("all-reduce", ("context",)),
                ("all-reduce", ("data",)), ("all-gather", ("context",)),
                ("all-gather", ("data",)), ("collective-permute", ("data",))},
}


def _config(name: str):
    return get_config("tiny_moe" if name == "ep" else "tiny")


def _host_batches(cfg) -> dict[str, np.ndarray]:
    return lm_batches(K, 8, cfg.length, cfg.vocab)


def _run(strategy, mesh, cfg) -> Run:
    return lm_run(strategy, mesh, cfg, _host_batches(cfg), LR)


@functools.cache
def _reference(cfg) -> Run:
    """The same K steps on one device."""
    mesh = ns.make_mesh("data=1", devices=jax.devices()[:1])
    return _run(ns.strategies.get("dp"), mesh, cfg)


@pytest.fixture(scope="module", params=NAMES)
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
    if name == "zero1":
        assert want_params == total and want_opt == 2 * total // 8 + 4
    if name == "fsdp":
        assert want_params == total // 8 and want_opt == 2 * total // 8 + 4
    if name in ("tp", "sp", "fsdp_tp", "ep", "async_tp"):
        assert total // 8 < want_params < total


# --------------------------------------------------------------------------- (c) collectives


def test_compiled_collectives(run: Run) -> None:
    s = run.strategy
    found = compiled_collectives(run.hlo, run.mesh)
    pairs = {(c.kind, c.axes) for c in found}
    assert {c.kind for c in found} == set(s.collectives)
    assert pairs == COLLECTIVES[s.name]
    assert "reduce-scatter" not in run.hlo  # see the strategies docstring, note [1]

    def total(kind: str, axes: tuple[str, ...]) -> int:
        return sum(c.bytes for c in found if (c.kind, c.axes) == (kind, axes))

    def ops(kind: str, axes: tuple[str, ...]) -> str:
        return " ".join(c.op_name for c in found if (c.kind, c.axes) == (kind, axes))

    param_bytes = sum(b for _, b in _paths(nnx.state(run.model, nnx.Param)))
    if s.name in ("dp", "zero1", "fsdp"):
        # Every gradient is summed over the data axis.
        assert total("all-reduce", ("data",)) >= param_bytes
    if s.name in ("zero1", "fsdp"):
        # zero1 gathers the updated parameters, fsdp the parameters before use:
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
        assert len(gathers) > 1 + 2 * get_config("tiny").layers
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
        cfg = get_config("tiny")
        full_kv = 8 // run.mesh.shape["data"] * cfg.length * cfg.heads * cfg.head_dim * 4
        assert all(c.bytes < full_kv for c in found
                   if (c.kind, c.axes) == ("all-gather", ("context",)))
    if s.name == "ep":
        # Tokens go to their experts' devices and come back.
        assert "jvp(blxc,ble->xbce)" in ops("all-to-all", ("expert",))
        assert "jvp(xbce,blxc->ble)" in ops("all-to-all", ("expert",))


# --------------------------------------------------------------------------- Trainer, Auto


def test_trainer_with_strategy_matches_one_device() -> None:
    s = ns.strategies.get("fsdp_tp")
    mesh = s.make_mesh(8)
    cfg = _config("fsdp_tp")
    model = ns.sharded_init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh, s)
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


# --------------------------------------------------------------------------- bad input


def _factory(cfg):
    return lambda: Transformer(cfg, rngs=nnx.Rngs(0))


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
    assert ns.strategies.NAMES == ("dp", "zero1", "fsdp", "tp", "fsdp_tp", "sp", "ep",
                                   "async_tp", "cp", "fsdp_cp", "pp", "pp_fsdp", "pp_tp")
    for name in NAMES:
        s = ns.strategies.get(name)
        assert s.name == name and s.mesh_axes[0] == "data"
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
