"""The attention package's one meaning of "dense": the context-parallel mode without
context parallelism is "local"; the old option value "dense" and the old module paths
(nnx_shard.parallel.ring, nnx_shard.blockwise) still work and warn with the new name."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnx_shard as ns
from nnx_shard.attention import LOCAL, MODES, attention, context_mode, expect_attention
from nnx_shard.attention import kernels as new_kernels
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

RULES = ns.Rules({"batch": "data", "length": None, "heads": None})


def _inputs() -> tuple[jax.Array, jax.Array, jax.Array]:
    q = jax.random.normal(jax.random.key(0), (8, 12, 4, 8))
    kv = jax.random.normal(jax.random.key(1), (8, 12, 2, 8))   # grouped-query
    return q, kv, kv * 0.5


def _run(rules: ns.Rules, kernel: str) -> np.ndarray:
    q, k, v = _inputs()
    seg = jnp.array([[0] * 5 + [1] * 7] * 8)
    with ns.use("data=8", rules):
        out = jax.jit(lambda q, k, v: attention(q, k, v, segment_ids=seg,
                                                implementation=kernel, block_size=4))(q, k, v)
    return np.asarray(out)


@pytest.mark.parametrize("kernel", ["dense", "blockwise"])
def test_local_is_what_dense_and_no_option_were(kernel: str) -> None:
    unset = _run(RULES, kernel)
    local = _run(RULES.with_options(attention="local"), kernel)
    with pytest.warns(DeprecationWarning, match=r"attention='dense' is deprecated: use "
                      r"attention='local' \(no context parallelism; 'dense' names the "
                      r"per-device kernel implementation='dense' only\)"):
        old = _run(RULES.with_options(attention="dense"), kernel)
    np.testing.assert_array_equal(local, unset)
    np.testing.assert_array_equal(old, local)
    q, k, v = _inputs()
    ref = np.asarray(attention(q, k, v, implementation="dense", segment_ids=jnp.array(
        [[0] * 5 + [1] * 7] * 8)))
    np.testing.assert_allclose(local, ref, atol=1e-5)


def test_the_modes_and_what_each_option_value_reads_as() -> None:
    assert MODES == ("local", "ring", "allgather") and LOCAL == "local"
    assert context_mode() == "local"
    for value in MODES:
        with ns.use("data=8", RULES.with_options(attention=value)):
            assert context_mode() == value
    with ns.use("data=8", RULES.with_options(attention="dense")), pytest.warns(
            DeprecationWarning, match="use attention='local'"):
        assert context_mode() == "local"


def test_the_old_value_asks_for_no_context_parallelism_in_a_step() -> None:
    # expect_attention raises only for ring/allgather: "dense" must read as "local" there.
    with ns.use("data=8", RULES.with_options(attention="dense")), pytest.warns(
            DeprecationWarning, match="attention='local'"), expect_attention("my_step"):
        pass
    rules = ns.strategies.get("cp").rules
    with ns.use("data=4,context=2", rules), pytest.raises(
            ns.ShardingError, match=r"my_step ran under rules with attention='ring'"):
        with expect_attention("my_step"):
            pass


@pytest.mark.parametrize("value", ["flash", "Local", 2])
def test_an_unknown_option_value_lists_the_modes(value: object) -> None:
    q, k, v = _inputs()
    rules = RULES.with_options(attention=value)
    with ns.use("data=8", rules), pytest.raises(
            ns.ShardingError, match=r"attention: execution option attention=.* is not one of "
            r"\('local', 'ring', 'allgather'\)\. Fix: rules.with_options\(attention='ring'\) "
            r"or 'allgather' for context parallelism, or attention='local'"):
        attention(q, k, v)


@pytest.mark.parametrize(("old", "name", "new"), [
    ("nnx_shard.parallel.ring", "attention", "nnx_shard.attention.attention"),
    ("nnx_shard.parallel.ring", "expect_attention", "nnx_shard.attention.expect_attention"),
    ("nnx_shard.parallel.ring", "MODES", "nnx_shard.attention.MODES"),
    ("nnx_shard.parallel.ring", "OPTION", "nnx_shard.attention.OPTION"),
    ("nnx_shard.blockwise", "KERNELS", "nnx_shard.attention.kernels.KERNELS"),
    ("nnx_shard.blockwise", "Masks", "nnx_shard.attention.blocks.Masks"),
    ("nnx_shard.blockwise", "stats", "nnx_shard.attention.blocks.stats"),
    ("nnx_shard.blockwise", "attention_local", "nnx_shard.attention.kernels.attention_local"),
    ("nnx_shard.blockwise", "resolve", "nnx_shard.attention.kernels.resolve"),
])
def test_the_old_import_paths_warn_with_the_new_one(old: str, name: str, new: str) -> None:
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"^{old}\.{name} is deprecated: use {new}$"):
        got = getattr(module, name)
    home, _, attr = new.rpartition(".")
    assert got is getattr(importlib.import_module(home), attr)


def test_the_old_paths_refuse_names_they_never_had() -> None:
    import nnx_shard.blockwise as old_blockwise
    import nnx_shard.parallel.ring as old_ring

    for module in (old_ring, old_blockwise):
        with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
            module.nothing  # noqa: B018
    assert ns.parallel.ring is old_ring


def test_no_module_of_the_package_imports_a_deprecated_path() -> None:
    import ast
    import pathlib

    root = pathlib.Path(ns.__file__).parent
    old = {"nnx_shard.blockwise", "nnx_shard.parallel.ring"}
    users = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = {f"{node.module}.{a.name}" for a in node.names} | {node.module or ""}
            elif isinstance(node, ast.Import):
                names = {a.name for a in node.names}
            else:
                continue
            if names & old:
                users.append(str(path.relative_to(root)))
    assert users == [], f"modules still importing a deprecated path: {users}"
    assert ns.models.attention is attention
    assert new_kernels.KERNELS == ("auto", "blockwise", "dense", "cudnn")
