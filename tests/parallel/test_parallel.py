"""The parallel wing's registry (nnx_shard._parallel.registry): the fused step knows the
ops only through what they register."""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import jax.numpy as jnp
import optax
from flax import nnx

import nnx_shard as ns
from nnx_shard._attention import _modes as attention_modes
from nnx_shard._parallel import collective_matmul as matmul_impl
from nnx_shard._parallel import pipeline as pipeline_impl
from nnx_shard._parallel import registry

TRAIN = Path(ns.__file__).parent / "_train"


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_the_training_package_imports_no_parallel_op():
    imported = set().union(*(_imported_modules(p) for p in TRAIN.glob("*.py")))
    ops = {f"nnx_shard.{m}" for m in ("pipeline", "ring", "collective_matmul")}
    ops |= {f"nnx_shard._parallel.{m}" for m in ("pipeline", "ring", "collective_matmul")}
    assert not imported & ops, imported & ops
    assert "nnx_shard._parallel.registry" in imported


def test_each_op_declares_the_option_it_reads():
    ops = {op.name: op for op in registry.registered()}
    assert ops["attention"].option == attention_modes.OPTION == "attention"
    assert ops["pipeline"].option == pipeline_impl.OPTION == "pipeline"
    assert ops["collective_matmul"].option == matmul_impl.OPTION == "collective_matmul"
    assert ops["attention"].check_step is not None and ops["pipeline"].microbatched is not None


def test_the_ops_are_attributes_of_the_package_and_live_in_parallel():
    import sys

    assert ns.pipeline.scan is pipeline_impl.scan
    assert ns.collective_matmul.all_gather_matmul is matmul_impl.all_gather_matmul
    assert ns.pipeline.stage_report.__module__ == "nnx_shard._stage_report"
    assert "nnx_shard.ring" not in sys.modules  # no alias module paths


def _step(model, opt, x):
    loss, grads = ns.value_and_grad(lambda m, b: jnp.mean(m(b) ** 2))(model, x)
    opt.update(model, grads)
    return loss


def test_a_registered_op_checks_every_traced_step(monkeypatch):
    monkeypatch.setattr(registry, "_OPS", dict(registry._OPS))  # restored after the test
    seen = []

    @contextlib.contextmanager
    def check(fn_name):
        seen.append(fn_name)
        yield

    registry.register(registry.ParallelOp("probe", "probe", check_step=check))
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    fused = ns.multistep(_step)
    fused(model, opt, jnp.ones((3, 4, 2)))
    fused(model, opt, jnp.ones((3, 4, 2)))  # compiled: not traced again
    assert seen == ["_step"]


def test_a_registered_op_takes_the_microbatches_over_while_its_option_is_set(monkeypatch):
    monkeypatch.setattr(registry, "_OPS", dict(registry._OPS))
    calls = []

    def microbatched(grad_fn, m, model, batch, *args):
        calls.append((m, batch.shape))
        return grad_fn(model, batch, *args)

    registry.register(registry.ParallelOp("probe", "probe", microbatched=microbatched))
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ns.multistep(_step, microbatches=2)(model, opt, jnp.ones((3, 4, 2)))
    assert calls == []  # option unset: value_and_grad's own accumulation loop
    rules = ns.Rules({"batch": "data"}).with_options(probe=True)
    with ns.use("data=8", rules):
        ns.multistep(_step, microbatches=2)(model, opt, jnp.ones((3, 8, 2)))
    assert calls == [(2, (8, 2))]  # the whole batch, once per traced step
