"""The planner on a model of the user's own (``auto(factory, loss=..., batch_spec=...)``,
``nnx-shard plan --factory ... --loss ... --batch-spec ...``), on the outside-style
models of tests/_user_models.py: no ``forward``, its own logical names, a list of blocks."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard._errors import UsageError
from nnx_shard.cli import main
from nnx_shard.planner import UserModel, auto
from nnx_shard.planner._compile import compile_step
from nnx_shard.planner._user import parse_batch_spec
from tests import _user_models as um

ROOT = Path(__file__).resolve().parents[2]
CFG = um.Config(vocab=16, embed=8, heads=4, kv_heads=2, head_dim=2, mlp=16, layers=1, length=8)
SPEC = "x=int32[8,8],y=int32[8,8]"


def tiny_llama() -> um.Decoder:
    """The GQA Llama of its own names, one block (for ``--factory``)."""
    return um.Decoder(CFG, rngs=nnx.Rngs(0))


def tiny_mha() -> um.MHALM:
    return um.mha_lm(dataclasses.replace(CFG, heads=2, head_dim=4), nnx.Rngs(0))


def per_token(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])  # not reduced


# -- the batch spec ------------------------------------------------------------------------


def test_parse_batch_spec_reads_shapes_dtypes_and_nesting():
    spec = parse_batch_spec("inputs=int32[16, 128], targets=int32[16,128],extra.mask=bool[16]")
    assert spec["inputs"] == jax.ShapeDtypeStruct((16, 128), jnp.int32)
    assert spec["targets"].shape == (16, 128)
    assert spec["extra"]["mask"] == jax.ShapeDtypeStruct((16,), jnp.bool_)


@pytest.mark.parametrize("text, words", [
    ("x=int32[8", "is not name=dtype[dims]"),
    ("x int32[8]", "is not name=dtype[dims]"),
    ("x=int33[8]", "'int33' is not a dtype"),
    ("x=int32[0,4]", "needs positive dims"),
    ("x=int32[8],x=int32[8]", "'x' is given twice"),
    ("", "is empty"),
])
def test_parse_batch_spec_refuses_bad_text_in_one_line(text, words):
    with pytest.raises(UsageError) as e:
        parse_batch_spec(text)
    msg = str(e.value)
    assert words in msg and "Fix:" in msg and "\n" not in msg


# -- the checks of the loss and batch --------------------------------------------------------


def test_user_model_takes_specs_of_every_form():
    for batch in (SPEC, parse_batch_spec(SPEC), {"x": "int32[8,8]", "y": "int32[8,8]"},
                  {"x": jnp.zeros((8, 8), jnp.int32), "y": jnp.zeros((8, 8), jnp.int32)}):
        user = UserModel(tiny_llama, um.loss_fn, batch).check()
        assert (user.global_batch, user.seq) == (8, 8)
        assert user.spec["y"] == jax.ShapeDtypeStruct((8, 8), jnp.int32)


@pytest.mark.parametrize("loss, batch, words", [
    (lambda model: 0.0, SPEC, "takes (model) but is called loss(model, batch)"),
    (per_token, SPEC, "returned [(8, 8)], not a scalar"),
    (um.loss_fn, "x=int32[8,8]", "raised KeyError: 'y'"),
    (um.loss_fn, "x=int32[8,8],y=int32[4,8]", "each leaf needs the same leading"),
    (um.loss_fn, {"x": 3}, "is not a shape and dtype"),
])
def test_bad_loss_or_batch_is_one_line_with_a_fix(loss, batch, words):
    with pytest.raises(UsageError) as e:
        auto(tiny_llama, loss=loss, batch_spec=batch, devices=2, strategies=["dp"],
             progress=False)
    msg = str(e.value)
    assert words in msg and "Fix:" in msg and "\n" not in msg


def test_a_factory_that_raises_and_a_missing_half_are_one_line():
    def broken():
        raise RuntimeError("no weights here")

    with pytest.raises(UsageError, match="factory .*broken raised RuntimeError: no weights "
                       "here. Fix:"):
        auto(broken, loss=um.loss_fn, batch_spec=SPEC, devices=2, progress=False)
    with pytest.raises(UsageError, match="needs both loss= and batch_spec=. Fix:"):
        auto(tiny_llama, loss=um.loss_fn, devices=2, progress=False)
    with pytest.raises(UsageError, match="batch=4 but the batch spec has 8. Fix:"):
        auto(tiny_llama, loss=um.loss_fn, batch_spec=SPEC, batch=4, devices=2, progress=False)


def test_a_batch_no_layout_divides_names_the_fix():
    with pytest.raises(UsageError) as e:
        auto(tiny_llama, loss=um.loss_fn, batch_spec="x=int32[6,8],y=int32[6,8]",
             aliases=um.ALIASES, devices=4, strategies=["dp", "fsdp"], progress=False)
    msg = str(e.value)
    assert "dp: data=4: batch['x'] [6, 8] cannot be laid" in msg
    assert "Device counts near 4 that divide the batch 6: 2, 3, 6." in msg
    assert "Fix: a global batch that divides by the data axes" in msg and "\n" not in msg


def test_without_aliases_the_model_names_are_what_is_missing():
    with pytest.raises(UsageError) as e:
        auto(tiny_llama, loss=um.loss_fn, batch_spec=SPEC, devices=2, strategies=["fsdp"],
             progress=False)
    assert "'fsdp'" in str(e.value) and "with_rules" in str(e.value)


# -- the search on the user's model -----------------------------------------------------------


def _direct_bytes(factory, loss, strat, sizes, batch):
    """memory_analysis of the call Trainer.fit compiles for ``strat`` on ``sizes``, the
    batch laid out here by hand (first dimension on the data axis), not by the planner."""
    mesh = ns.make_mesh(sizes, devices=jax.devices()[:sum(1 for _ in range(
        int(jnp.prod(jnp.array(list(sizes.values()))))))])
    model = ns.abstract_init(factory, mesh, strat)
    opt = ns.sharded_optimizer(model, optax.adamw(1e-3), mesh, strat)
    data = {k: jax.ShapeDtypeStruct((2, *v.shape), v.dtype,
                                    sharding=NamedSharding(mesh, P(None, "data", None)))
            for k, v in batch.items()}
    trainer = ns.Trainer(model, opt, loss, mesh=mesh, rules=strat.rules, steps_per_call=2)
    mem = trainer.lower(data).compile().memory_analysis()
    return (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
            - mem.alias_size_in_bytes)


@pytest.mark.slow
def test_auto_plans_a_gqa_llama_of_its_own_names_to_the_bytes_of_a_direct_compile():
    plan = auto(tiny_llama, loss=um.loss_fn, batch_spec=SPEC, aliases=um.ALIASES, devices=4,
                strategies=["dp", "fsdp"], progress=False)
    assert {c.strategy for c in plan.ranked} == {"dp", "fsdp"}
    assert plan.request["batch"] == 8 and plan.request["seq"] == 8
    assert plan.request["batch_spec"] == SPEC and plan.request["aliases"] == um.ALIASES
    args = {}
    for c in plan.ranked:
        assert c.compiled and c.flops > 0 and c.remat is None and c.microbatches == 1
        strat = ns.strategies.get(c.strategy).with_rules(aliases=um.ALIASES)
        # The planner's figure is compile_step's of the same layout, loss and batch ...
        direct = compile_step(tiny_llama, strat, c.mesh, batch=8, seq=8, loss=um.loss_fn,
                              batch_spec=parse_batch_spec(SPEC))
        assert c.bytes_per_device == direct["total"]
        args[c.strategy] = direct["argument"]
        # ... which is XLA's memory_analysis of Trainer.fit's call, laid out by hand.
        assert c.bytes_per_device == _direct_bytes(tiny_llama, um.loss_fn, strat, c.mesh,
                                                   parse_batch_spec(SPEC))
    # The aliases took: fsdp shards the parameters and adamw state over 4 devices, so its
    # arguments are fewer bytes than dp's replicated copy (the batch is the same).
    assert args["fsdp"] < args["dp"] / 2
    code = plan.python()
    assert ".with_rules(aliases={'fsdp': 'embed', 'tp': 'mlp', 'exp': 'expert'})" in code
    assert "ns.Trainer(model, opt, loss_fn," in code and "from tests._user_models import" in code


@pytest.mark.slow
def test_auto_plans_stock_mha_blocks_in_a_list_and_drops_what_does_not_fit():
    spec = {"x": jax.ShapeDtypeStruct((4, 8), jnp.int32),
            "y": jax.ShapeDtypeStruct((4, 8), jnp.int32)}
    plan = auto(tiny_mha, loss=um.loss_fn, batch_spec=spec, aliases=um.ALIASES, devices=2,
                strategies=["dp", "tp"], progress=False)
    by = {c.strategy: c for c in plan.ranked}
    assert set(by) == {"dp", "tp"}
    # The memory limit between the two: only the sharded layout fits, by compiled bytes.
    lo, hi = sorted(c.bytes_per_device for c in by.values())
    tight = auto(tiny_mha, loss=um.loss_fn, batch_spec=spec, aliases=um.ALIASES, devices=2,
                 strategies=["dp", "tp"], device_memory=(lo + hi) // 2, microbatches=(1,),
                 progress=False)
    assert [c.bytes_per_device for c in tight.ranked] == [lo]
    assert any("over the" in str(c.reason) for c in tight.dropped)


# -- the command line -------------------------------------------------------------------------

_FLAGS = ["plan", "--auto", "--devices", "2", "--factory", "tests.planner.test_planner_user:tiny_llama",
          "--loss", "tests._user_models:loss_fn", "--batch-spec", SPEC,
          "--alias", "fsdp=embed,tp=mlp,exp=expert", "--strategies", "dp,fsdp", "--no-cache"]


@pytest.mark.slow
def test_cli_plans_the_users_model_end_to_end(capsys):
    assert main([*_FLAGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["request"]["batch_spec"] == SPEC and out["request"]["batch"] == 8
    assert out["request"]["loss"] == "tests._user_models.loss_fn"
    ranked = {c["strategy"]: c for c in out["ranked"]}
    assert set(ranked) == {"dp", "fsdp"}
    strat = ns.strategies.get("fsdp").with_rules(aliases=um.ALIASES)
    direct = compile_step(tiny_llama, strat, {"data": 2}, batch=8, seq=8, loss=um.loss_fn,
                          batch_spec=parse_batch_spec(SPEC))
    assert ranked["fsdp"]["bytes_per_device"] == direct["total"]
    assert "from tests.planner.test_planner_user import tiny_llama" in out["python"]


@pytest.mark.parametrize("change, words", [
    ({"--loss": "tests.no_such_module:loss"}, "cannot import 'tests.no_such_module'"),
    ({"--loss": "tests._user_models:no_loss"}, "has no attribute 'no_loss'. Fix:"),
    ({"--loss": "tests._user_models:small_llama"},
     "takes () but is called loss(model, batch)"),
    ({"--loss": "tests._user_models:PAD"}, "is a int, not a function. Fix:"),
    ({"--batch-spec": "x=int32[8,8"}, "--batch-spec: batch spec"),
    ({"--batch-spec": "x=int32[5,8],y=int32[5,8]"}, "cannot be laid"),
    ({"--loss": None}, "missing --loss. Fix:"),
    ({"--alias": "fsdp"}, "'fsdp' is not name=value. Fix:"),
])
def test_cli_bad_input_is_one_line_with_a_fix(change, words, capsys):
    flags = list(_FLAGS)
    for flag, value in change.items():
        i = flags.index(flag)
        flags[i:i + 2] = [] if value is None else [flag, value]
    assert main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nnx-shard: error:") and "\n" not in err
    assert words in err and "Fix" in err, err


def test_cli_alias_needs_a_factory(capsys):
    assert main(["plan", "--model", "tiny", "--mesh", "data=2", "--alias", "fsdp=embed",
                 "--no-compile"]) == 2
    assert "--alias maps your own model's names" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_simulates_the_devices_it_plans_for():
    """The installed command in a fresh process: it asks JAX for --devices CPU devices
    before the factory or loss starts JAX, and the candidates compile on them."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    flags = [f for f in _FLAGS if f != "--no-cache"]
    flags[flags.index("--devices") + 1] = "4"
    flags[flags.index("--strategies") + 1] = "dp"
    proc = subprocess.run([sys.executable, "-m", "nnx_shard.cli", *flags, "--no-cache",
                           "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert [(c["strategy"], c["mesh"]) for c in out["ranked"]] == [("dp", {"data": 4})]
    assert out["request"]["devices"] == 4 and out["request"]["factory"] == (
        "tests.planner.test_planner_user.tiny_llama")
