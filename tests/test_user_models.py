"""A user's own model (tests/_user_models.py: a GQA Llama with its own metadata names,
a list of blocks and an unhashable dataclass config; a Qwen3-MoE-style router MLP;
stock nnx.MultiHeadAttention blocks with ``attention_fn``) with no glue beyond the
documented one-liners:

* the fused step accepts unhashable static attributes; a DuplicateSpecError on
  Explicit axes is a ShardingError;
* ``strategy.with_rules(aliases)`` maps the model's names onto every preset (rules
  and optimizer rules together), ``nnx-shard explain --alias``; a missing rule names
  the alias fix;
* ``ns.pipeline.stack`` / ``unstack`` / ``run``: a list of blocks under pp, pp_fsdp
  and pp_tp, checkpoints converted between the two forms;
* async_tp runs the stock projection layers (annotated kernels) as collective
  matmuls, with no model edit; a model with none raises, as cp does.

The models under the presets, against a plain one-device ``nnx.jit`` loop, are a row of
the preset matrix in tests/test_strategies.py.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard import cli
from tests import _user_models as um
from tests._close import assert_close
from tests._shared import host as _host
from tests._shared import host_copy as _host_copy
from tests.conftest import needs_devices

CFG = um.Config()
MOE = um.Config(experts=4)
BATCH = 8
RTOL = 1e-4


def _tx() -> optax.GradientTransformation:
    return optax.sgd(0.05, momentum=0.9)


# --------------------------------------------------------------------------- item: tracebacks


@dataclasses.dataclass
class _Cfg:
    features: int = 4


class _Configured(nnx.Module):
    def __init__(self, cfg: _Cfg, rngs: nnx.Rngs):
        self.cfg = cfg  # a static attribute that cannot be hashed
        self.linear = nnx.Linear(cfg.features, cfg.features, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear(x)


def _sq_step(model, opt, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    opt.update(model, grads)
    return loss


def test_unhashable_static_attribute_trains_like_nnx_jit() -> None:
    with pytest.raises(TypeError, match="unhashable"):
        hash(_Cfg())
    xs = jax.random.normal(jax.random.key(0), (3, 2, 4))
    ref = _Configured(_Cfg(), nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    want = [float(nnx.jit(_sq_step)(ref, ref_opt, x)) for x in xs]
    model = _Configured(_Cfg(), nnx.Rngs(0))
    tx = optax.sgd(0.1)  # a new transformation (new closures) would be a new program
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    fused = ns.multistep(_sq_step)
    got = fused(model, opt, xs)
    assert_close(got, np.asarray(want), 1e-6, "losses")
    assert_close(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param), 1e-6, "params")
    # A new model with an equal (not the same) config reuses the compilation.
    other = _Configured(_Cfg(), nnx.Rngs(1))
    fused(other, nnx.Optimizer(other, tx, wrt=nnx.Param), xs)
    assert fused.traces == 1
    # A different config is a different program.
    third = _Configured(_Cfg(features=4), nnx.Rngs(1))
    third.cfg.features = 5  # static value differs, shapes do not
    fused(third, nnx.Optimizer(third, tx, wrt=nnx.Param), xs)
    assert fused.traces == 2


@needs_devices(8)
def test_duplicate_spec_on_explicit_axes_is_a_sharding_error() -> None:
    s = ns.strategies.get("fsdp").with_rules(um.ALIASES)
    mesh = s.make_mesh(axis_types="explicit")
    model = ns.sharded_init(lambda: um.Decoder(dataclasses.replace(CFG, layers=1),
                                             rngs=nnx.Rngs(0)), mesh, s)
    trainer = ns.Trainer(model, ns.sharded_optimizer(model, _tx(), mesh, s), um.loss_fn, mesh=mesh,
                         rules=s.rules, steps_per_call=1, batch_names=("batch", "length"))
    with pytest.raises(ns.ShardingError) as info:
        trainer.fit(um.batches(CFG, 1, BATCH), 1, progress=False)
    msg = str(info.value)
    assert msg.startswith("Trainer.fit: JAX rejected the sharding types of a 'gather' "
                          "operation on Explicit mesh axes")
    assert "called from Embedder.encode (" in msg and "self.input_embedding[(tokens,)]" in msg
    assert "P('data', None, 'data') has duplicate entries" in msg
    assert "Fix: build the mesh with Auto axes" in msg
    assert isinstance(info.value.__cause__, ns._errors.DuplicateSpecError)


# --------------------------------------------------------------------------- item: aliases


def test_with_rules_aliases_update_rules_and_optimizer_rules() -> None:
    zero1 = ns.strategies.get("zero1")
    s = zero1.with_rules(um.ALIASES)
    assert (s.rules["fsdp"], s.rules["tp"], s.opt_rules["fsdp"], s.opt_rules["tp"]) == (
        None, None, "data", None)
    assert s.name == "zero1" and s.mesh_axes == zero1.mesh_axes
    assert (zero1 | um.ALIASES) == s
    mesh = {"data": 4, "model": 2}
    fsdp_tp = ns.strategies.get("fsdp_tp").with_rules(um.ALIASES).rules
    assert fsdp_tp.spec(("fsdp", "tp"), shape=(16, 32), mesh=mesh) == jax.P("data", "model")
    for preset in ("dp", "fsdp", "tp", "sp", "pp_tp"):
        rules = ns.strategies.get(preset).with_rules(um.ALIASES).rules
        assert rules.spec(("fsdp", "tp"), shape=(16, 32), mesh=mesh) == \
            rules.spec(("embed", "mlp"), shape=(16, 32), mesh=mesh), preset
    # An alias claims mesh axes in its target's turn: 'exp' right after 'expert'.
    ep = ns.strategies.get("ep").with_rules(um.ALIASES).rules
    names = [n for n, _ in ep.to_pairs()]
    assert names.index("exp") == names.index("expert") + 1
    # Values that are not one of the table's names are plain rules, in both tables.
    s = zero1.with_rules({"norm": None, "fsdp": "data"})
    assert s.rules["fsdp"] == s.opt_rules["fsdp"] == "data" and s.rules["norm"] is None
    with pytest.raises(ns.ShardingError, match=r"alias 'x' -> 'nope'|with_rules expects"):
        ns.Rules({"embed": "data"}).alias({"x": "nope"})
    with pytest.raises(ns.ShardingError, match="with_rules expects a mapping"):
        zero1.with_rules([("fsdp", "embed")])  # type: ignore[arg-type]


@pytest.mark.parametrize("preset", ["dp", "tp"])
def test_missing_rule_names_the_alias_fix(preset: str) -> None:
    s = ns.strategies.get(preset)
    with nnx.use_eager_sharding(False):  # names, no mesh: Flax would place them eagerly
        model = nnx.eval_shape(lambda: um.Decoder(MOE, rngs=nnx.Rngs(0)))
    with pytest.raises(ns.ShardingError) as info:
        s.check(model, s.mesh_for(8))
    msg = str(info.value)
    assert "names logical axes 'tp', 'fsdp', 'exp'" in msg
    assert "strategy.with_rules({'tp': 'mlp', 'fsdp': 'embed', 'exp': 'expert'})" in msg
    assert "--alias tp=mlp,fsdp=embed,exp=expert" in msg
    assert "change the model's sizes" not in msg and "'model'" not in msg
    s.with_rules(um.ALIASES).check(model, s.mesh_for(8))  # the fix works


def test_explain_cli_takes_aliases_and_extra_rules(capsys) -> None:
    argv = ["explain", "tests._user_models:small_llama", "--mesh", "data=4,model=2",
            "--strategy", "fsdp_tp"]
    assert cli.main(argv) == 2
    assert "--alias tp=mlp,fsdp=embed" in capsys.readouterr().err
    assert cli.main([*argv, "--alias", "fsdp=embed,tp=mlp",
                     "--rules-extra", "norm=none"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("layers/0/mlp/gate/kernel"))
    assert "P('data', 'model')" in row
    assert cli.main([*argv, "--alias", "fsdp"]) == 2
    assert "'fsdp' is not name=value" in capsys.readouterr().err
    assert cli.main([*argv, "--alias", "fsdp=nope"]) == 2
    assert "'nope' is not a logical name" in capsys.readouterr().err


# --------------------------------------------------------------------------- item: async_tp


def _one_layer_step(name: str, preset: str) -> tuple[float, str, Any]:
    """One fused step of a one-layer user model under ``preset``: the loss, the
    compiled HLO and the mesh."""
    cfg = dataclasses.replace(CFG, layers=1)
    make = um.mha_lm if name == "mha" else (lambda c, r: um.Decoder(c, rngs=r))
    s = ns.strategies.get(preset).with_rules(um.ALIASES)
    mesh = s.make_mesh()
    model = ns.sharded_init(lambda: make(cfg, nnx.Rngs(0)), mesh, s)
    opt = ns.sharded_optimizer(model, _tx(), mesh, s)

    def step(model, opt, batch):
        loss, grads = ns.value_and_grad(um.loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    with ns.use(mesh, s.rules):
        host = {k: np.stack([b[k] for b in um.batches(cfg, 1, BATCH, pad=name == "mha")])
                for k in ("x", "y")}
        batch = ns.shard_batch(host, mesh, s.rules, ("batch", "length"), steps=True)
        fused = ns.multistep(step)
        hlo = fused.lower(model, opt, batch).compile().as_text()
        loss = float(jax.device_get(fused(model, opt, batch))[0])
    # The caller's model keeps Flax's own ops: the fused step intercepted its copy.
    up = model.layers[0].up if name == "mha" else model.layers[0].mlp.up
    assert up.dot_general is jax.lax.dot_general
    return loss, hlo, mesh


@needs_devices(8)
@pytest.mark.parametrize("name", ["llama", pytest.param("mha", marks=pytest.mark.slow)])
def test_async_tp_runs_the_stock_layers_as_rings(name: str) -> None:
    from nnx_shard.planner import compiled_collectives

    loss, hlo, mesh = _one_layer_step(name, "async_tp")
    sp_loss, sp_hlo, _ = _one_layer_step(name, "sp")
    assert_close(loss, sp_loss, RTOL, "async_tp loss against sp's")

    def rings(text: str) -> list[Any]:  # the ops' ppermutes (XLA adds its own elsewhere)
        return [c for c in compiled_collectives(text, mesh)
                if c.kind == "collective-permute" and "ppermute" in c.op_name]

    # Ring steps over model (size 4 on 8 devices: 3 steps, two halves each), forward
    # and backward, for the column-parallel Q/K/V, MLP and head projections and the
    # row-parallel ones.
    found = rings(hlo)
    assert found and all(c.axes == ("model",) for c in found)
    assert len(found) >= 4 * 3 * 2
    assert rings(sp_hlo) == []


@needs_devices(8)
def test_intercept_sets_ops_on_annotated_stock_layers_only() -> None:
    cfg = dataclasses.replace(CFG, layers=1)
    with nnx.use_eager_sharding(False):  # built by one program, not op by op
        model = nnx.jit(lambda: um.Decoder(cfg, rngs=nnx.Rngs(0)))()
    model.lm_head.dot_general = functools.partial(jax.lax.dot_general)  # a user's own op
    ns.tp_layers.intercept(model)
    block = model.layers[0]
    assert block.attn.q_proj.dot_general == ns.tp_layers.ProjectionOp(("fsdp", "tp", None),
                                                                        "dot_general")
    assert block.mlp.down.dot_general.names == ("tp", "fsdp")
    assert isinstance(model.lm_head.dot_general, functools.partial)  # left alone
    with pytest.raises(ns.UsageError, match=r"model must be an nnx.Module .* got str"):
        ns.tp_layers.intercept("model")
    with pytest.raises(ns.UsageError, match=r"kind must be 'dot_general' or 'einsum'"):
        ns.tp_layers.ProjectionOp(("embed",), "matmul")  # type: ignore[arg-type]
    with pytest.raises(ns.UsageError, match=r"names must be a tuple of logical names"):
        ns.tp_layers.ProjectionOp(["embed"], "einsum")  # type: ignore[arg-type]
    einsum = nnx.Einsum("ble,ef->blf", (16, 8), rngs=nnx.Rngs(0))
    assert ns.tp_layers.intercept(einsum).einsum_op is jnp.einsum  # unannotated
    # Outside async_tp the op is the stock one, bit for bit.
    x = jax.random.normal(jax.random.key(1), (2, 16, 16))
    op = block.mlp.gate.dot_general
    dims = (((2,), (0,)), ((), ()))
    np.testing.assert_array_equal(op(x, block.mlp.gate.kernel[...], dims),
                                  jax.lax.dot_general(x, block.mlp.gate.kernel[...], dims))
    # Under async_tp a kernel split along the ring's axis runs as a ring (its output split
    # there); one the rules keep whole on that axis is the plain product, left unsplit. The
    # ring is jitted, as in a step: run eagerly, its shard_map compiles each op alone.
    w = jax.random.normal(jax.random.key(2), (16, 8))
    with ns.use("data=2,model=4", ns.strategies.get("async_tp").rules):
        ring = jax.jit(lambda x, w: ns.tp_layers.ProjectionOp(("embed", "vocab"), "dot_general")(
            x, w, dims))(x, w)
        whole = ns.tp_layers.ProjectionOp(("kv", "kv"), "dot_general")(x, w, dims)
    assert ring.sharding.spec == P("data", None, "model")
    assert_close(ring, jax.lax.dot_general(x, w, dims), RTOL, "the ring's product")
    assert whole.sharding.spec == P()
    np.testing.assert_array_equal(whole, jax.lax.dot_general(x, w, dims))
    # Under async_tp a sequence the ring cannot split is refused in those terms.
    with ns.use("data=2,model=4", ns.strategies.get("async_tp").with_rules(um.ALIASES).rules), \
            pytest.raises(ns.ShardingError, match=r"sequence length 14, not divisible by 4 .* "
                          r"Fix: make the sequence length a multiple of 4 \(e.g. 12 or 16\)"):
        block.mlp.gate(x[:, :14])


@needs_devices(8)
def test_async_tp_raises_when_the_model_runs_no_collective_matmul() -> None:
    class Unannotated(nnx.Module):  # stock layers, but no names on their kernels
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(CFG.vocab, 16, rngs=rngs)
            self.head = nnx.Linear(16, CFG.vocab, rngs=rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            return self.head(self.embed(tokens))

    s = ns.strategies.get("async_tp")
    mesh = s.make_mesh()
    model = ns.sharded_init(lambda: Unannotated(nnx.Rngs(0)), mesh, s)
    trainer = ns.Trainer(model, ns.sharded_optimizer(model, _tx(), mesh, s), um.loss_fn, mesh=mesh,
                         rules=s.rules, steps_per_call=1, batch_names=("batch", "length"))
    with pytest.raises(ns.ShardingError, match=r"collective_matmul=True \(strategy 'async_tp'"
                       r"\), but the model never ran a projection .* Fix: annotate the "
                       r"projection kernels .* or train with strategy 'sp'"):
        trainer.fit(um.batches(CFG, 1, BATCH), 1, progress=False)


# --------------------------------------------------------------------------- item: stack


def test_stack_unstack_and_run() -> None:
    cfg = dataclasses.replace(CFG, layers=3)
    with nnx.use_eager_sharding(False):
        listed = um.Decoder(cfg, rngs=nnx.Rngs(0))
        stacked = ns.pipeline.stack(um.Decoder(cfg, rngs=nnx.Rngs(0)), "layers")
    k = stacked.layers.attn.q_proj.kernel
    assert k.shape == (3, 16, 8, 4)
    assert k.get_metadata()["out_sharding"] == ("layers", "fsdp", "tp", None)
    for i in range(3):  # the same values, row i = block i
        np.testing.assert_array_equal(k[...][i], listed.layers[i].attn.q_proj.kernel[...])
    toks = jnp.asarray(um.tokens(cfg, 2)[:, :-1])
    assert_close(nnx.jit(lambda m: m(toks))(stacked), nnx.jit(lambda m: m(toks))(listed),
                 1e-5, "logits")
    back = ns.pipeline.unstack(stacked, "layers")
    assert_close(nnx.state(back), nnx.state(listed), 0, "unstack(stack(model))")
    assert back.layers[2].mlp.gate.kernel.get_metadata()["out_sharding"] == ("fsdp", "tp")
    with pytest.raises(ns.ShardingError, match=r"Decoder.final_norm is RMSNorm, not a non-empty"):
        ns.pipeline.stack(listed, "final_norm")


def test_stack_refuses_different_blocks_and_stateful_blocks() -> None:
    class Net(nnx.Module):
        def __init__(self, rngs, dropout=False):
            self.layers = nnx.List([
                nnx.Sequential(nnx.Linear(4, 4, rngs=rngs),
                               nnx.Dropout(0.5, rngs=rngs) if dropout else nnx.relu)
                for _ in range(2)])

        def __call__(self, x):
            return ns.pipeline.run(self.layers, x)

    net = Net(nnx.Rngs(0))
    net.layers[1] = nnx.Linear(4, 4, use_bias=False, rngs=nnx.Rngs(0))
    with pytest.raises(ns.ShardingError, match="block 1 differs from block 0"):
        ns.pipeline.stack(net, "layers")
    stateful = ns.pipeline.stack(Net(nnx.Rngs(0), dropout=True), "layers")
    with pytest.raises(ns.ShardingError, match=r"a stacked Sequential updated its state "
                       r"'layers/1/rngs/count'"):
        stateful(jnp.ones((2, 4)))


@pytest.mark.slow
@needs_devices(8)
def test_checkpoints_convert_between_list_and_stacked(tmp_path) -> None:
    fsdp = ns.strategies.get("fsdp").with_rules(um.ALIASES)
    pp = ns.strategies.get("pp_fsdp").with_rules(um.ALIASES)
    fmesh, pmesh = fsdp.make_mesh(), pp.make_mesh()

    def make():
        return um.Decoder(CFG, rngs=nnx.Rngs(0))

    listed = ns.sharded_init(make, fmesh, fsdp)
    stacked = ns.sharded_init(lambda: ns.pipeline.stack(make(), "layers"), pmesh, pp)
    # One compiled init gives the same bits in either form.
    assert_close(nnx.state(ns.pipeline.unstack(_host_copy(stacked), "layers")),
                 _host(nnx.state(listed)), 0, "stacked init")
    # Saved as a list, restored as a list onto the pipeline's mesh, then stacked there.
    ns.save(tmp_path / "list", 1, model=listed)
    # (The list form has no layer axis for the pipeline: its own rules place it on pmesh.)
    restored = ns.restore(tmp_path / "list", model=ns.abstract_init(make, pmesh, pp.rules))
    restored = ns.pipeline.stack(restored, "layers", mesh=pmesh, rules=pp.rules)
    assert_close(_host(nnx.state(restored)), _host(nnx.state(stacked)), 0, "list -> stacked")
    kernel = restored.layers.attn.q_proj.kernel.get_value()
    assert kernel.sharding.spec == stacked.layers.attn.q_proj.kernel.get_value().sharding.spec
    assert kernel.sharding.spec[0] == "stage"
    # Saved stacked, restored stacked, unstacked onto the fsdp mesh.
    ns.save(tmp_path / "stacked", 1, model=stacked)
    target = ns.abstract_init(lambda: ns.pipeline.stack(make(), "layers"), pmesh, pp)
    back = ns.pipeline.unstack(ns.restore(tmp_path / "stacked", model=target), "layers",
                               mesh=fmesh, rules=fsdp.rules)
    assert_close(_host(nnx.state(back)), _host(nnx.state(listed)), 0, "stacked -> list")
    q = back.layers[0].attn.q_proj.kernel.get_value()
    assert q.sharding.spec == listed.layers[0].attn.q_proj.kernel.get_value().sharding.spec
