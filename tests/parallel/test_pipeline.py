"""Pipeline parallelism (nnx_shard._parallel.pipeline, the pp presets) on 8 simulated devices.

The proof runs (one module-scoped compilation each): the reference transformer
with ``scan_layers=True`` trained for K fused steps under GPipe and the
circular schedule with S = 2 and 4 stages must give the loss, gradients,
parameters and Adam state of a one-device run; each device holds 1/S of the
stack and its optimizer state; the compiled step moves activations between
stages with collective-permutes and never gathers layers over ``stage``.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard import pipeline
from nnx_shard.models import Decoder, get_config, lm_loss
from nnx_shard.planner import compiled_collectives
from nnx_shard.planner._costs import KINDS as COLLECTIVE_KINDS
from tests._close import assert_close
from tests._lm import Run, assert_same_values, lm_batches, lm_run, lm_step
from tests._shared import device_bytes
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

K = 3  # fused steps per run
LR = 1e-3
RTOL = 1e-4  # x max|expected| per tensor: see tests/_close.py
RTOL_PARAMS = 1e-3  # Adam normalises each element's gradient (see test_strategies.py)
BATCH = 16


def _config(layers: int):
    return dataclasses.replace(get_config("tiny"), layers=layers, scan_layers=True)


def _factory(cfg):
    return lambda: Decoder(cfg, rngs=nnx.Rngs(0))


def _host_batches(cfg) -> dict[str, np.ndarray]:
    return lm_batches(K, BATCH, cfg.length, cfg.vocab)


_step = lm_step


def _run(strategy, mesh, cfg, microbatches: int) -> Run:
    return lm_run(strategy, mesh, cfg, _host_batches(cfg), LR, microbatches)


@functools.cache
def _reference(layers: int) -> Run:
    mesh = ns.make_mesh("data=1", devices=jax.devices()[:1])
    return _run(ns.strategies.get("dp"), mesh, _config(layers), 1)


# (stages, repeats, layers, microbatches): GPipe and circular, S = 2 and 4.
# The quick tier keeps one GPipe case; 4 stages and the circular ones are in the slow tier.
CASES = [(2, 1, 4, 4), pytest.param((4, 1, 4, 4), marks=pytest.mark.slow),
         pytest.param((2, 2, 4, 4), marks=pytest.mark.slow),
         pytest.param((4, 2, 8, 4), marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=CASES,
                ids=lambda c: f"S{c[0]}V{c[1]}L{c[2]}M{c[3]}")
def run(request) -> Run:
    s, v, layers, m = request.param
    strategy = ns.strategies.get("pp", repeats=v)
    mesh = ns.make_mesh({"stage": s, "data": 8 // s})
    return _run(strategy, mesh, _config(layers), m)


def _stages(run: Run) -> int:
    return dict(run.mesh.shape)["stage"]


def test_same_values_as_one_device(run: Run) -> None:
    assert_same_values(run, _reference(run.model.cfg.layers), RTOL, RTOL_PARAMS)


def test_stack_bytes_per_device_are_one_over_stages(run: Run) -> None:
    s = _stages(run)
    stack = nnx.state(run.model.blocks, nnx.Param)
    total = sum(x.nbytes for x in jax.tree.leaves(stack))
    assert set(device_bytes(stack).values()) == {total // s}
    mu, nu = run.opt.opt_state[0].mu["blocks"], run.opt.opt_state[0].nu["blocks"]
    assert set(device_bytes(mu).values()) == {total // s}
    assert set(device_bytes(nu).values()) == {total // s}
    # The layout survives the fused steps: still split over stage along layers.
    assert run.model.blocks.attn.q.get_value().sharding.spec == P("stage", None, None, None)


def test_each_stage_holds_its_own_layers(run: Run) -> None:
    s = _stages(run)
    layers = run.model.cfg.layers
    q = run.model.blocks.attn.q.get_value()
    coord = {d.id: i for i, row in enumerate(run.mesh.devices) for d in np.ravel(row)}
    for shard in q.addressable_shards:
        stage = coord[shard.device.id]
        start = stage * layers // s
        assert shard.index[0] == slice(start, start + layers // s)
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(q)[start:start + layers // s])


def test_compiled_collectives(run: Run) -> None:
    found = compiled_collectives(run.hlo, run.mesh)
    pairs = {(c.kind, c.axes) for c in found}
    v = run.strategy.rules.options["pipeline"].repeats
    assert ("collective-permute", ("stage",)) in pairs
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert all(c.axes == ("stage",) for c in permutes)
    assert "roll" in " ".join(c.op_name for c in permutes)
    # Nothing is ever gathered over stage; what crosses stages in reductions is
    # activations (at most the batch's residual stream), never layers.
    assert not [c for c in found if c.kind == "all-gather"]
    cfg = run.model.cfg
    acts = BATCH * cfg.length * cfg.embed * 4
    stage_reduce = [c for c in found if c.kind == "all-reduce" and "stage" in (c.axes or ())]
    assert stage_reduce and all(c.bytes <= acts for c in stage_reduce)
    assert ("all-reduce", ("data",)) in pairs  # the data axis' gradient reduction
    kinds = {c.kind for c in found}
    if v == 1:
        assert kinds == {"collective-permute", "all-reduce"} == set(run.strategy.collectives)
    else:
        # Circular: the stored contiguous stack is re-laid out to the circular order.
        assert kinds == {"collective-permute", "all-reduce", "all-to-all"}
        assert kinds == set(run.strategy.collectives)
        # Within stage groups (S = 4: pairs of stages, which no mesh axis names), and
        # only the stack's re-layout (a reshape), once per step.
        a2a = [c for c in found if c.kind == "all-to-all"]
        assert all(c.axes in (("stage",), None) and c.op_name.endswith("reshape") for c in a2a)
        assert a2a and all(c.op_name.count("while/body") == 1 for c in a2a)  # not in the loop
        assert any(c.op_name.count("while/body") == 2 for c in found if "roll" in c.op_name)


def test_explain_per_stage_matches_the_arrays(run: Run) -> None:
    s, m = _stages(run), run.microbatches
    cfg = run.model.cfg
    v = run.strategy.rules.options["pipeline"].repeats
    carry = jax.ShapeDtypeStruct((BATCH, cfg.length, cfg.embed), jnp.float32)
    r = pipeline.stage_report(run.model, run.mesh, run.strategy, optax.adam(LR), carry=carry,
                              microbatches=m)
    stack = nnx.state(run.model.blocks, nnx.Param)
    other = nnx.state(run.model, nnx.Param)
    del other["blocks"]
    opt = run.opt.opt_state[0]
    assert r.stack_param_bytes == max(device_bytes(stack).values())
    assert r.other_param_bytes == max(device_bytes(other).values())
    assert r.stack_opt_bytes == 2 * r.stack_param_bytes == max(
        device_bytes((opt.mu["blocks"], opt.nu["blocks"])).values())
    data = 8 // s
    assert r.microbatch_bytes == BATCH * cfg.length * cfg.embed * 4 // (m * data)
    g = cfg.layers // (s * v)
    assert r.activation_bytes == ((m * v + s - 1) * g + m + 1) * r.microbatch_bytes
    assert r.bubble == pipeline.bubble(s, m, v)
    # Stage st runs layer groups st, st + S, ...: contiguous for GPipe.
    want = [[layer for rep in range(v) for layer in range((rep * s + st) * g, (rep * s + st + 1) * g)]
            for st in range(s)]
    assert [list(x) for x in r.groups] == want
    if v == 2 and s == 2:
        assert [list(x) for x in r.groups] == [[0, 2], [1, 3]]
        assert str(r).splitlines()[1].split()[:2] == ["0", "0,2"]


def test_plan_cli_shows_stages(capsys) -> None:
    import json

    from nnx_shard.cli import main

    rc = main(["plan", "--model", "small", "--mesh", "stage=4,data=2", "--strategy", "pp",
               "--scan-layers", "--no-compile", "--batch", "16", "--seq", "64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["error"] is None
    st = out["stages"]
    assert st["stages"] == 4 and st["microbatches"] == 4
    assert st["groups"] == [[0], [1], [2], [3]]
    small = get_config("small")
    assert st["microbatch_bytes"] == 16 * 64 * small.embed * 4 // (4 * 2)
    stack = [r for r in out["largest"] if r["path"].startswith("blocks/")]
    assert stack and all(r["spec"][0] == "stage" for r in stack)
    main(["plan", "--model", "small", "--mesh", "stage=4,data=2", "--strategy", "pp",
          "--scan-layers", "--no-compile", "--batch", "16", "--seq", "64"])
    text = capsys.readouterr().out
    assert "per pipeline stage (microbatches = 4, the stage count):" in text
    assert "GPipe: 4 stages, 4 microbatches of 64.00 KiB per device, bubble 42.9%" in text


@pytest.mark.slow
def test_plan_cli_a_compiled_pipeline_is_an_upper_bound_and_the_stage_formula_decides(
        capsys) -> None:
    """On XLA CPU a pipeline's compiled figure is not an accelerator's: plan says so and
    decides with the formula whose activations are one stage's layers'."""
    import json

    from nnx_shard.cli import main
    from nnx_shard.models._memory import activation_bytes

    flags = ["plan", "--model", "tiny", "--mesh", "stage=2,data=4", "--strategy", "pp_fsdp",
             "--scan-layers", "--batch", "8", "--seq", "16"]
    rc = main([*flags, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["compiled"]["backend"] == "cpu"
    assert out["decided_by"] == "stage formula" and out["compiled_trusted"] is False
    assert out["notice"].startswith("XLA CPU's figure for a pipeline is not an accelerator's")
    cfg = dataclasses.replace(get_config("tiny"), scan_layers=True)
    stage = activation_bytes(dataclasses.replace(cfg, layers=cfg.layers // 2),
                             ns.strategies.get("pp_fsdp").rules, {"stage": 2, "data": 4}, 8, 16)
    per_device = out["bytes_per_device"]
    assert out["stage_activations"] == stage < per_device["activations"]
    assert out["bytes_needed"] == per_device["total"] - per_device["activations"] + stage
    # The verdict follows the stage formula, not the (larger) compiled total.
    between = (out["bytes_needed"] + out["compiled"]["total"]) // 2
    assert out["bytes_needed"] < between < out["compiled"]["total"]
    assert main([*flags, "--device-memory", str(between)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "* compiled, not trusted: XLA CPU's figure for a pipeline" in text
    assert "used, stage formula total)" in text
    # Without a pipeline the compiled figure decides, as before.
    rc = main(["plan", "--model", "tiny", "--mesh", "data=8", "--strategy", "fsdp", "--batch", "8",
               "--seq", "16", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["decided_by"] == "compiled" and out["compiled_trusted"] is True
    assert out["notice"] is None


@pytest.mark.slow
def test_moe_aux_loss_per_microbatch_as_gradient_accumulation() -> None:
    # Scalar carries (the summed load-balancing loss) travel with their microbatch and
    # are averaged over microbatches, as gradient accumulation averages them.
    cfg = dataclasses.replace(get_config("tiny_moe"), scan_layers=True)
    mesh1 = ns.make_mesh("data=1", devices=jax.devices()[:1])
    ref = _run(ns.strategies.get("dp"), mesh1, cfg, 2)
    got = _run(ns.strategies.get("pp"), ns.make_mesh({"stage": 2, "data": 4}), cfg, 2)
    assert_close(got.metrics["loss"], ref.metrics["loss"], RTOL, "loss")
    assert_close(got.metrics["grads"], ref.metrics["grads"], RTOL, "grads")


# --------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("s,v", [(2, 1), (4, 1), (4, 2), (8, 3)])
def test_measured_idle_fraction_is_the_analytic_bubble(s, v) -> None:
    for m in (s, 2 * s, 4 * s, 8 * s):
        table = pipeline.schedule_table(s, m, v)
        assert table.shape == (m * v + s - 1, s)
        assert pipeline.idle_fraction(s, m, v) == pytest.approx((s - 1) / (m * v + s - 1))
        assert pipeline.idle_fraction(s, m, v) == pytest.approx(pipeline.bubble(s, m, v))
        # Every stage does every pass of every microbatch exactly once.
        for stage in range(s):
            assert sorted(table[:, stage][table[:, stage] >= 0]) == list(range(m * v))


def test_scan_without_pipeline_is_lax_scan() -> None:
    w = jnp.arange(1.0, 5.0)[:, None] * jnp.ones((4, 3))
    body = lambda h, layer: (h * layer, layer.sum())  # noqa: E731
    got = pipeline.scan(body, jnp.ones((2, 3)), w)
    want = jax.lax.scan(body, jnp.ones((2, 3)), w)
    assert_close(got, want, 0, "plain scan")


class _Stack(nnx.Module):
    """A user's own nnx.vmap-stacked blocks, run through pipeline.scan."""

    def __init__(self, layers: int, d: int, rngs: nnx.Rngs, microbatches: int | None = None):
        init = ns.with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.microbatches = microbatches

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(r):
            return nnx.Linear(d, d, kernel_init=init, use_bias=False, rngs=r)

        self.blocks = make(rngs)

    def __call__(self, x):
        graphdef, state = nnx.split(self.blocks)

        def body(h, layer):
            return jnp.tanh(nnx.merge(graphdef, layer)(h)), None

        return pipeline.scan(body, x, state, microbatches=self.microbatches)[0]


def _stack_grads(s, microbatches, own=None):
    mesh = s.make_mesh(8)
    model = ns.sharded_init(lambda: _Stack(4, 8, nnx.Rngs(0), own), mesh, s)
    x = jax.random.normal(jax.random.key(1), (8, 8))
    with ns.use(mesh, s.rules):
        return nnx.jit(lambda m: ns.value_and_grad(
            lambda m, b: jnp.mean(m(b) ** 2), microbatches=microbatches)(m, x))(model)


def _stack_reference():
    x = jax.random.normal(jax.random.key(1), (8, 8))
    return jax.device_get(nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(
        _Stack(4, 8, nnx.Rngs(0))))


def test_users_vmap_stack_pipelines() -> None:
    want_loss, want_g = _stack_reference()
    loss, g = _stack_grads(ns.strategies.get("pp"), 4)
    assert_close(loss, want_loss, RTOL, "loss")
    assert_close(g, want_g, RTOL, "grads")
    assert g["blocks"]["kernel"].get_value().sharding.spec[0] == "stage"
    # A model that picks its own microbatch count still counts as having a stack.
    loss, g = _stack_grads(ns.strategies.get("pp"), 2, own=4)
    assert_close(loss, want_loss, RTOL, "loss (own microbatches)")


def test_fewer_microbatches_than_stages_when_the_user_insists() -> None:
    # GPipe runs with idle stages, and says how much of the pipeline idles.
    s = ns.strategies.get("pp", allow_few_microbatches=True)
    with pytest.warns(ns.ShardingWarning, match=re.escape(
            "microbatches=2 is fewer than the 4 stages of mesh axis 'stage': at least 2 "
            "stage(s) never work; the bubble is 60% of stage-steps.")):
        loss, g = _stack_grads(s, 2)
    want_loss, want_g = _stack_reference()
    assert_close(loss, want_loss, RTOL, "loss")
    assert_close(g, want_g, RTOL, "grads")
    # The circular schedule cannot: it needs every stage's slot filled.
    s = ns.strategies.get("pp", repeats=2, allow_few_microbatches=True)
    with ns.use(s.make_mesh(8), s.rules), pytest.raises(
            ns.ShardingError, match="The circular schedule needs microbatches >= stages."):
        pipeline.scan(lambda h, w: (h * w, None), jnp.ones((8, 3)), jnp.ones((8, 3)),
                      microbatches=2)


@pytest.mark.slow
def test_remat_per_stage_same_values_less_memory() -> None:
    cfg = _config(8)
    batch = {k: v[:1] for k, v in _host_batches(cfg).items()}
    out = {}
    for remat in (False, True):
        s = ns.strategies.get("pp", remat=remat)
        mesh = ns.make_mesh({"stage": 2, "data": 4})
        model = ns.sharded_init(_factory(cfg), mesh, s)
        opt = ns.sharded_optimizer(model, optax.adam(LR), mesh, s)
        with ns.use(mesh, s.rules):
            b = ns.shard_batch(batch, mesh, s.rules, ("batch", "length"), steps=True)
            fused = ns.multistep(_step, microbatches=2)
            temp = fused.lower(model, opt, b).compile().memory_analysis().temp_size_in_bytes
            metrics = jax.device_get(fused(model, opt, b))
        carry = jax.ShapeDtypeStruct((BATCH, cfg.length, cfg.embed), jnp.float32)
        acts = pipeline.stage_report(model, mesh, s, carry=carry, microbatches=2).activation_bytes
        out[remat] = (metrics, nnx.state(model, nnx.Param), temp, acts)
    assert_close(out[True][0], out[False][0], RTOL, "loss and grads")
    assert_close(out[True][1], out[False][1], RTOL_PARAMS, "params")
    assert out[True][2] < out[False][2]  # compiled temporaries
    micro = BATCH * cfg.length * cfg.embed * 4 // (2 * 4)
    assert out[False][3] == ((2 + 1) * 4 + 2 + 1) * micro  # 4 layers per stage
    assert out[True][3] == ((2 + 1) * 1 + 2 + 1) * micro  # one stage input


# --------------------------------------------------------------------------- bad input


def _trainer(strategy, mesh, cfg, microbatches):
    model = ns.sharded_init(_factory(cfg), mesh, strategy.rules)
    opt = ns.sharded_optimizer(model, optax.adam(LR), mesh, strategy.rules)
    return ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=strategy.rules,
                      microbatches=microbatches, batch_names=("batch", "length"))


def _fit_error(cfg, microbatches: int) -> str:
    """The ShardingError of a pp Trainer's first step on one batch of 8 rows."""
    s = ns.strategies.get("pp")
    trainer = _trainer(s, s.make_mesh(8), cfg, microbatches)
    batch = {k: np.resize(v[0], (8, *v.shape[2:])) for k, v in _host_batches(cfg).items()}
    with pytest.raises(ns.ShardingError) as e:
        trainer.fit([batch], 1, progress=False)
    return str(e.value)


def test_layers_not_divisible_by_stages() -> None:
    s = ns.strategies.get("pp")
    with pytest.raises(ns.ShardingError, match=re.escape(
            "parameter 'blocks/attn/k' stacks 6 layers, which do not divide into 4 stages "
            "(mesh stage=4, data=2). Fix: a layer count that is a multiple of 4, or a 'stage' "
            "axis of size 1 / 2 / 3 / 6.")):
        ns.sharded_init(_factory(_config(6)), "stage=4,data=2", s)


def test_layers_not_divisible_by_stages_at_trace_time() -> None:
    # Rules carrying the pipeline option, on layers stacked outside the strategy.
    s = ns.strategies.get("pp")
    with ns.use(s.make_mesh(8), s.rules), pytest.raises(ns.ShardingError, match=re.escape(
            "pipeline: 6 stacked layers do not divide into 4 stages. Fix: a layer count that "
            "is a multiple of 4, or a 'stage' axis of size 1 / 2 / 3 / 6.")):
        pipeline.scan(lambda h, w: (h * w, None), jnp.ones((8, 3)), jnp.ones((6, 3)),
                      microbatches=4)


def test_layers_not_divisible_by_stages_times_repeats() -> None:
    s = ns.strategies.get("pp", repeats=2)
    with pytest.raises(ns.ShardingError, match=re.escape(
            "stacks 4 layers, which do not divide into 4 stages x 2 repeats = 8 layer groups")):
        ns.abstract_init(_factory(_config(4)), "stage=4,data=2", s)


def test_model_without_stacked_layers() -> None:
    s = ns.strategies.get("pp")
    cfg = dataclasses.replace(get_config("tiny"), layers=4)  # scan_layers=False
    with pytest.raises(ns.ShardingError, match="no stacked layer axis.*scan_layers=True.*"
                       r"nnx\.vmap.*PARTITION_NAME"):
        ns.sharded_init(_factory(cfg), "stage=4,data=2", s)
    # Built without the strategy's check: the first step says the same.
    assert re.search("microbatches=4: the model has no stacked layer axis .*scan_layers=True",
                     _fit_error(cfg, 4))


def test_fewer_microbatches_than_stages() -> None:
    assert _fit_error(_config(4), 2) == (
        "pipeline: microbatches=2 is fewer than the 4 stages of mesh axis 'stage': at least "
        "2 stage(s) would never work and the bubble would be 60% of stage-steps. Fix: "
        "microbatches >= 4 (Trainer(..., microbatches=4) or multistep(..., microbatches=4); "
        "16 gives a bubble of 16%). To run anyway (GPipe), get('pp', "
        "allow_few_microbatches=True).")


def test_batch_not_divisible_by_microbatches_times_data() -> None:
    s = ns.strategies.get("pp")
    # data=2 devices x 8 microbatches = 16 > 8 rows: each device's 4 rows do not split.
    assert ("has 8 rows (shape (8, 16)) sharded over mesh axes data (2 devices), so 4 rows per "
            "device, which does not divide by 8. Fix: a global batch that is a multiple of "
            "8 x 2 = 16") in _fit_error(_config(4), 8)
    # Without a data axis to split over, the pipeline itself checks.
    mesh = ns.make_mesh("stage=4,data=1", devices=jax.devices()[:4])
    x = jnp.ones((6, 3))
    with ns.use(mesh, s.rules), pytest.raises(ns.ShardingError, match=re.escape(
            "the batch of 6 rows does not divide into microbatches=4 x 1 data-parallel devices "
            "= 4. Fix: a batch that is a multiple of 4, or a number of microbatches that "
            "divides the 6 rows of each data-parallel device.")):
        pipeline.scan(lambda h, w: (h * w, None), x, jnp.ones((4, 3)), microbatches=4)


def test_mesh_without_stage_axis() -> None:
    s = ns.strategies.get("pp")
    with pytest.raises(ns.ShardingError, match="the mesh has no axis 'stage'.*Suggested mesh: "
                       r"\{'stage': 4, 'data': 2\}"):
        ns.sharded_init(_factory(_config(4)), "data=8", s)
    # Rules carrying the pipeline option, on a mesh without the axis, at trace time.
    with ns.use("data=8", s.rules), pytest.raises(ns.ShardingError, match=re.escape(
            "pipeline schedule over mesh axis 'stage', but the mesh has axes data=8. Fix: a mesh "
            "with a 'stage' axis")):
        pipeline.scan(lambda h, w: (h * w, None), jnp.ones((8, 3)), jnp.ones((4, 3)),
                      microbatches=4)


def test_explicit_mesh_axes_are_refused() -> None:
    s = ns.strategies.get("pp")
    mesh = s.make_mesh(8, axis_types="explicit")
    with ns.use(mesh, s.rules), pytest.raises(ns.ShardingError, match="Explicit mesh axes are "
                                              "not supported.*axis_types='auto'"):
        pipeline.scan(lambda h, w: (h * w, None), jnp.ones((8, 3)), jnp.ones((4, 3)),
                      microbatches=4)


def test_presets() -> None:
    for name in ("pp", "pp_fsdp", "pp_tp"):
        s = ns.strategies.get(name, stage="pipe", data="dp")
        assert s.mesh_axes[:2] == ("pipe", "dp") and s.rules["layers"] == "pipe"
        assert s.rules.options["pipeline"] == pipeline.Schedule(axis="pipe")
        assert set(s.collectives) <= set(COLLECTIVE_KINDS)
        assert np.prod(list(s.mesh_for(8).values())) == 8
        assert all(logical in s.rules for logical in ns.strategies.LOGICAL)
    assert ns.strategies.get("pp_fsdp").mesh_for(8) == {"stage": 4, "data": 2}
    assert ns.strategies.get("pp", repeats=2).rules.options["pipeline"].name == "circular"
    with pytest.raises(ns.ShardingError, match="must be distinct"):
        ns.strategies.get("pp", stage="x", data="x")


def test_bad_schedule() -> None:
    with pytest.raises(ns.ShardingError, match=r"repeats=0 must be an int >= 1"):
        ns.strategies.get("pp", repeats=0)


# --------------------------------------------------------------------------- compositions


def _nan_at_step(bad: int) -> optax.GradientTransformation:
    """Passes updates through, NaN at the ``bad``-th update (1-based)."""

    def init(params):
        return jnp.zeros((), jnp.int32)

    def update(updates, count, params=None):
        count = count + 1
        scale = jnp.where(count == bad, jnp.nan, 1.0)
        return jax.tree.map(lambda u: u * scale, updates), count

    return optax.GradientTransformation(init, update)


def _fit(strategy, mesh, cfg, steps, tx=None, steps_per_call=K, guard="grads"):
    model = ns.sharded_init(_factory(cfg), mesh, strategy)
    opt = ns.sharded_optimizer(model, tx or optax.adam(LR), mesh, strategy)
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=strategy.rules,
                         steps_per_call=steps_per_call, microbatches=4,
                         batch_names=("batch", "length"), guard=guard)
    host = _host_batches(cfg)
    data = [{k: v[i % K] for k, v in host.items()} for i in range(steps)]
    return trainer, trainer.fit(data, steps, progress=False)


@pytest.mark.slow  # pp alone against one device stays in the quick tier
@pytest.mark.parametrize("name", ["pp_fsdp", "pp_tp"])
def test_compositions_match_one_device_and_checkpoint_across_strategies(name, tmp_path) -> None:
    s = ns.strategies.get(name)
    mesh = s.make_mesh(8)
    cfg = _config(4)
    trainer, history = _fit(s, mesh, cfg, K)
    model, opt = trainer.model, trainer.optimizer
    ref = _reference(4)
    assert_close(history["loss"], ref.metrics["loss"], RTOL, "loss")
    assert_close(nnx.state(model, nnx.Param), nnx.state(ref.model, nnx.Param), RTOL_PARAMS,
                 "params")
    assert_close(opt.opt_state, ref.opt.opt_state, RTOL, "optimizer state")
    stack = model.blocks.mlp.up.get_value()
    want = {"pp_fsdp": P("stage", "data", None), "pp_tp": P("stage", None, "model")}[name]
    assert stack.sharding.spec == want
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.blocks, nnx.Param)))
    per = device_bytes(nnx.state(model.blocks, nnx.Param))
    assert max(per.values()) < total // dict(mesh.shape)["stage"]  # split further than 1/S

    # Saved under pp_*, restored under fsdp, saved again, restored under pp_*: bitwise.
    ns.save(tmp_path / "a", 1, model=model, optimizer=opt)
    fsdp = ns.strategies.get("fsdp")
    target = ns.abstract_init(_factory(cfg), "data=8", fsdp)
    m2, o2, _ = ns.restore(tmp_path / "a", model=target,
                           optimizer=ns.sharded_optimizer(target, optax.adam(LR), "data=8", fsdp))
    assert m2.blocks.mlp.up.get_value().sharding.spec == P(None, "data", None)
    assert_close(nnx.state(m2), nnx.state(model), 0, "restored under fsdp")
    assert_close(o2.opt_state, opt.opt_state, 0, "optimizer restored under fsdp")
    ns.save(tmp_path / "b", 1, model=m2, optimizer=o2)
    target = ns.abstract_init(_factory(cfg), mesh, s)
    m3, o3, _ = ns.restore(tmp_path / "b", model=target,
                           optimizer=ns.sharded_optimizer(target, optax.adam(LR), mesh, s))
    assert m3.blocks.mlp.up.get_value().sharding == stack.sharding
    assert_close(nnx.state(m3), nnx.state(model), 0, "restored under " + name)
    assert_close(o3.opt_state, opt.opt_state, 0, "optimizer restored under " + name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp_fsdp", "pp_tp"])
def test_compositions_never_gather_layers_over_stage(name) -> None:
    s = ns.strategies.get(name)
    mesh = s.make_mesh(8)
    cfg = _config(4)
    model = ns.sharded_init(_factory(cfg), mesh, s)
    opt = ns.sharded_optimizer(model, optax.adam(LR), mesh, s)
    with ns.use(mesh, s.rules):
        batch = ns.shard_batch({k: v[:1] for k, v in _host_batches(cfg).items()}, mesh, s.rules,
                               ("batch", "length"), steps=True)
        hlo = ns.multistep(_step, microbatches=4).lower(model, opt, batch).compile().as_text()
    found = compiled_collectives(hlo, mesh)
    assert ("collective-permute", ("stage",)) in {(c.kind, c.axes) for c in found}
    over_stage = [c for c in found if c.kind == "all-gather" and "stage" in (c.axes or ())]
    # Nothing inside the pipeline loop (the stack's layers) is gathered over stage; XLA
    # may gather the head's weight (vocab x embed) outside it.
    assert not [c for c in over_stage if c.op_name.count("while/body") > 1]
    assert all(c.bytes <= cfg.vocab * cfg.embed * 4 for c in over_stage)
    if name == "pp_fsdp":  # FSDP gathers each layer over data before use
        assert any(c.kind == "all-gather" and c.axes == ("data",)
                   and c.op_name.count("while/body") > 1 for c in found)
    if name == "pp_tp":  # Megatron's row-parallel all-reduce inside each stage
        assert any(c.kind == "all-reduce" and c.axes == ("model",)
                   and "blm,me->ble" in c.op_name for c in found)


@pytest.mark.slow
def test_nan_guard_under_pp() -> None:
    s = ns.strategies.get("pp")
    mesh = s.make_mesh(8)
    cfg = _config(4)
    tx = optax.chain(optax.adam(LR), _nan_at_step(3))
    # Finite gradients, a NaN update: only guard="full" undoes that step.
    with pytest.warns(RuntimeWarning, match="at step 3"):
        trainer, h = _fit(s, mesh, cfg, 4, tx=tx, steps_per_call=1, guard="full")
    assert h.steps == 2 and np.isfinite(h["loss"]).all()
    # The same guard, so the same compiled step: bitwise equality holds by construction.
    ref, _ = _fit(s, mesh, cfg, 2, tx=optax.chain(optax.adam(LR), _nan_at_step(99)),
                  steps_per_call=1, guard="full")
    assert_close(nnx.state(trainer.model), nnx.state(ref.model), 0, "kept the last finite state")
    assert trainer.model.blocks.attn.q.get_value().sharding.spec == P("stage", None, None, None)


# --------------------------------------------------------------------------- wrong values


@pytest.mark.parametrize("fn", [ns.pipeline.bubble, ns.pipeline.idle_fraction,
                                ns.pipeline.schedule_table])
@pytest.mark.parametrize("args, match", [
    ((0, 0), r"stages must be a positive int, got 0"),
    ((-1, 4), r"stages must be a positive int, got -1"),
    ((4, 0), r"microbatches must be a positive int, got 0"),
    ((4, -8), r"microbatches must be a positive int, got -8"),
    ((True, 4), r"stages must be a positive int, got True \(a bool\)"),
    ((4, 1.5), r"microbatches must be a positive int, got 1.5"),
    ((4, float("nan")), r"microbatches must be a positive int, got nan"),
    ((4, 4, 0), r"repeats must be a positive int, got 0"),
])
def test_schedule_arithmetic_refuses_counts_that_are_not(fn, args, match):
    with pytest.raises(ns.NnxShardError, match=match):
        fn(*args)


def test_schedule_table_refuses_a_table_too_big_to_hold():
    with pytest.raises(ns.ShardingError, match=r"more than the 100,000,000 entries"):
        ns.pipeline.schedule_table(10**6, 10**6)
    assert ns.pipeline.bubble(10**6, 10**6) == pytest.approx((10**6 - 1) / (2 * 10**6 - 1))


@pytest.mark.parametrize("microbatches, match", [
    (-4, r"microbatches must be a positive int, got -4"),
    (0, r"microbatches must be a positive int, got 0"),
    (True, r"microbatches must be a positive int, got True"),
    (4.0, r"microbatches must be a positive int, got 4.0"),
    (3, r"carry has 16 rows, which do not split into microbatches=3 on each of 1 data"),
])
def test_pipeline_explain_refuses_microbatches_that_would_give_wrong_bytes(microbatches, match):
    cfg = ns.models.ReferenceConfig(layers=4, scan_layers=True)
    model = nnx.eval_shape(lambda: ns.models.Decoder(cfg, rngs=nnx.Rngs(0)))
    carry = jax.ShapeDtypeStruct((16, cfg.length, cfg.embed), jnp.float32)
    mesh = ns.make_mesh({"stage": 4, "data": 1}, devices=jax.devices()[:4])
    with pytest.raises(ns.NnxShardError, match=rf"^pipeline\.stage_report: {match}"):
        ns.pipeline.stage_report(model, mesh, "pp", carry=carry, microbatches=microbatches)
    report = ns.pipeline.stage_report(model, mesh, "pp", carry=carry, microbatches=4)
    assert report.microbatch_bytes == 16 * cfg.length * cfg.embed * 4 // 4
    with pytest.raises(ns.ShardingError, match=r"carry is int 5, not an array"):
        ns.pipeline.stage_report(model, mesh, "pp", carry=5, microbatches=4)
    with pytest.raises(ns.ShardingError, match=r"unknown strategy 'nope'"):
        ns.pipeline.stage_report(model, mesh, "nope", carry=carry, microbatches=4)
    with pytest.raises(ns.ShardingError, match=r"^pipeline\.stage_report: the rules carry no "
                       r"pipeline option .*Fix: pass a pp strategy"):
        ns.pipeline.stage_report(model, mesh, "fsdp", carry=carry, microbatches=4)
