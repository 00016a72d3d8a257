"""The tolerance helper the layout-equality tests rely on (tests/_close.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._close import assert_close


def _grads() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"mlp": {"down": (rng.normal(size=(4, 8)) * 1e-2).astype(np.float32),
                    "up": rng.normal(size=(8, 4)).astype(np.float32)}}


def test_near_zero_elements_pass_at_the_tensors_scale_where_a_bare_atol_fails() -> None:
    # The CI failure, its numbers: a gradient of largest value ~0.02 summed in
    # another order; one small element differs by 0.17% of itself, 1e-5 of the tensor.
    want = _grads()
    got = jax.tree.map(np.copy, want)
    want["mlp"]["down"][1, 3], got["mlp"]["down"][1, 3] = -0.0001373, -0.00013707
    assert 0.01 < np.abs(want["mlp"]["down"]).max() < 0.05
    with pytest.raises(AssertionError):  # the old comparison
        np.testing.assert_allclose(got["mlp"]["down"], want["mlp"]["down"], rtol=1e-4, atol=1e-7)
    assert_close(got, want, 1e-4, "grads")
    # Activations of size ~100: a near-zero element off by 1e-7 of that scale.
    want = np.linspace(-100, 100, 9, dtype=np.float32)
    want[4] = 1e-3
    got = want.copy()
    got[4] += np.float32(1e-7 * 100)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert_close(got, want, 1e-5)


def test_a_wrong_tensor_fails_and_names_the_leaf() -> None:
    want = _grads()
    got = jax.tree.map(np.copy, want)
    got["mlp"]["up"][2, 1] *= 1.001  # one element off by 0.1%: a real error
    with pytest.raises(AssertionError, match=r"grads\['mlp'\]\['up'\].*max\|expected\|"):
        assert_close(got, want, 1e-5, "grads")
    assert_close(got, want, 1e-2, "grads")  # a loose enough tolerance accepts it
    half = jax.tree.map(np.copy, want)
    half["mlp"]["down"][:2] = 0  # a shard that was never written
    with pytest.raises(AssertionError, match=r"grads\['mlp'\]\['down'\]"):
        assert_close(half, want, 1e-3, "grads")


def test_scale_is_per_leaf() -> None:
    # A small tensor is not compared at the scale of a large one beside it.
    want = {"big": np.full(3, 1e3, np.float32), "small": np.array([1e-3, 2e-3], np.float32)}
    got = {"big": want["big"], "small": np.array([1e-3, 2.1e-3], np.float32)}
    with pytest.raises(AssertionError, match=r"\['small'\]"):
        assert_close(got, want, 1e-3)


def test_structure_shape_and_exact_leaves() -> None:
    with pytest.raises(AssertionError, match="state: tree paths differ"):
        assert_close({"a": np.zeros(2)}, {"b": np.zeros(2)}, 1e-5, "state")
    with pytest.raises(AssertionError, match=r"\['a'\]: shape \(2,\) vs expected \(1, 2\)"):
        assert_close({"a": np.zeros(2)}, {"a": np.zeros((1, 2))})
    # Integers (step counters) must be equal whatever the tolerance.
    with pytest.raises(AssertionError, match="count"):
        assert_close({"count": np.uint32(3)}, {"count": np.uint32(4)}, 0.5)
    # PRNG keys compare by their bits.
    assert_close({"k": jax.random.key(1)}, {"k": jax.random.key(1)})
    with pytest.raises(AssertionError, match=r"\['k'\]"):
        assert_close({"k": jax.random.key(1)}, {"k": jax.random.key(2)}, 0.5)


def test_rtol_zero_is_bitwise() -> None:
    x = np.linspace(-1, 1, 5, dtype=np.float32)
    assert_close(x, x.copy(), 0)
    with pytest.raises(AssertionError):
        assert_close(np.nextafter(x, np.float32(2)), x, 0)


def test_non_finite_values_must_match_and_do_not_set_the_scale() -> None:
    want = np.array([np.nan, np.inf, 1.0, 0.0], np.float32)
    assert_close(want.copy(), want, 1e-5)
    with pytest.raises(AssertionError):  # inf in expected does not make atol infinite
        assert_close(np.array([np.nan, np.inf, 1.0, 0.5], np.float32), want, 1e-5)
    with pytest.raises(AssertionError):
        assert_close(np.array([1.0, np.inf, 1.0, 0.0], np.float32), want, 1e-5)


def test_scale_overrides_a_near_zero_scalar() -> None:
    # The mean of values of size ~1 that nearly cancel: compare at the values' size.
    with pytest.raises(AssertionError):
        assert_close(np.float32(2e-7), np.float32(1e-7), 1e-5)
    assert_close(np.float32(2e-7), np.float32(1e-7), 1e-5, scale=1.0)


def test_modules_and_bfloat16() -> None:
    a, b = nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    assert_close(a, b, 0, "linear")
    with pytest.raises(AssertionError, match=r"linear\['kernel'\]"):
        assert_close(a, nnx.Linear(3, 4, rngs=nnx.Rngs(1)), 1e-2, "linear")
    x = jnp.linspace(-2, 2, 8, dtype=jnp.bfloat16)
    assert_close(x + jnp.bfloat16(2.0 ** -8), x, 1e-2)
    with pytest.raises(AssertionError):
        assert_close(x + jnp.bfloat16(0.25), x, 1e-2)
