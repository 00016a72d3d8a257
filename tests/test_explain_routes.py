"""``ns.explain`` is the one report of a layout: the ``nnx-shard explain`` command prints
it, and the per-stage bytes of a pipeline have their own name,
``ns.pipeline.stage_report``."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard import cli
from nnx_shard._axes import abstract_mesh
from nnx_shard.models import Transformer, get_config

CFG = dataclasses.replace(get_config("tiny"), layers=4, scan_layers=True)


def pipelined():
    model = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
    carry = jax.ShapeDtypeStruct((8, CFG.length, CFG.embed), jnp.float32)
    return model, carry


@pytest.mark.parametrize(("strategy", "kw"), [
    ("pp", {"microbatches": 0}),
    ("pp", {"microbatches": 3}),  # 8 rows do not split into 3 on 2 replicas
    ("pp", {"carry": 5}),
    ("fsdp", {}),  # no pipeline option
])
def test_stage_report_refuses_naming_itself(strategy, kw):
    model, carry = pipelined()
    args = {"carry": carry, "microbatches": 4, **kw}
    with pytest.raises(ns.NnxShardError) as e:
        ns.pipeline.stage_report(model, "stage=4,data=2", strategy, **args)
    assert str(e.value).startswith("pipeline.stage_report: "), e.value


FACTORY = '''
from flax import nnx
import nnx_shard as ns

def make():
    init = ns.with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    return nnx.Linear(64, 128, kernel_init=init, rngs=nnx.Rngs(0))
'''


@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])
def test_the_explain_command_prints_ns_explain(capsys, tmp_path, monkeypatch, strategy):
    (tmp_path / "route_models.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "route_models", raising=False)
    code = cli.main(["explain", "route_models:make", "--mesh", "data=64",
                     "--strategy", strategy, "--optimizer", "adam"])
    out, err = capsys.readouterr()
    assert code == 0, err
    sys.path.insert(0, str(tmp_path))
    try:
        from route_models import make
    finally:
        sys.path.remove(str(tmp_path))
    report = ns.explain(nnx.eval_shape(make), abstract_mesh({"data": 64}),
                        ns.strategies.get(strategy), optax.adam(1e-3))
    assert str(report) in out
    assert report.opt_bytes_per_device > 0
