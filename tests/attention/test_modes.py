"""The attention package's one meaning of "dense": a kernel. The context-parallel mode
without context parallelism is "local", and "dense" is no mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnx_shard as ns
from nnx_shard._attention import LOCAL, MODES, attention, context_mode, expect_attention
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
def test_local_is_what_no_option_is(kernel: str) -> None:
    unset = _run(RULES, kernel)
    local = _run(RULES.with_options(attention="local"), kernel)
    np.testing.assert_array_equal(local, unset)
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


def test_a_step_that_expects_no_context_parallelism() -> None:
    with ns.use("data=8", RULES.with_options(attention="local")), expect_attention("my_step"):
        pass
    rules = ns.strategies.get("cp").rules
    with ns.use("data=4,context=2", rules), pytest.raises(
            ns.ShardingError, match=r"my_step ran under rules with attention='ring'"):
        with expect_attention("my_step"):
            pass


@pytest.mark.parametrize("value", ["flash", "Local", "dense", 2])
def test_an_unknown_option_value_lists_the_modes(value: object) -> None:
    q, k, v = _inputs()
    rules = RULES.with_options(attention=value)
    with ns.use("data=8", rules), pytest.raises(
            ns.ShardingError, match=r"attention: execution option attention=.* is not one of "
            r"\('local', 'ring', 'allgather'\)\. Fix: rules.with_options\(attention='ring'\) "
            r"or 'allgather' for context parallelism, or attention='local'"):
        attention(q, k, v)
