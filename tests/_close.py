"""Comparing float results that were computed in different layouts or orders.

A sharded step sums the same terms as the single-device step, in another order:
per-device partial sums, then an all-reduce; another CPU vectorises the loops with
another width. Each order rounds differently, so an element that is a near-zero
sum of large terms can differ by many times its own size while the tensor agrees
to float precision. Tolerances are therefore scaled to each tensor's magnitude,
``atol = rtol * max|expected|`` per leaf, never a bare tiny ``atol``.

Use ``np.testing.assert_array_equal`` instead only where equality holds by
construction: the same program on the same inputs (restore, resume), integer
arithmetic (counters, PRNG keys, threefry bits), or copies.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    if isinstance(tree, nnx.Pytree):  # modules, optimizers, Rngs: compare their state
        tree = nnx.state(tree)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def _host(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(jax.device_get(x))


def assert_close(actual: Any, expected: Any, rtol: float = 1e-5, what: str = "", *,
                 scale: float | None = None) -> None:
    """Asserts that two pytrees (or modules, or arrays) match leaf by leaf.

    Float leaves: ``|actual - expected| <= rtol * |expected| + rtol * S`` elementwise,
    ``S = max|expected|`` over the leaf's finite values (or ``scale`` when given: the
    magnitude of the terms a near-zero result was summed from). Non-finite values
    must sit at the same places. Other leaves (integers, booleans, PRNG keys) must
    be equal. Paths and shapes must agree. A failure names ``what`` and the leaf path.
    """
    a_flat, e_flat = _leaves(actual), _leaves(expected)
    a_paths, e_paths = [p for p, _ in a_flat], [p for p, _ in e_flat]
    assert a_paths == e_paths, f"{what}: tree paths differ: {a_paths} vs {e_paths}"
    for (path, a), (_, e) in zip(a_flat, e_flat, strict=True):
        name = f"{what}{path}"
        a, e = _host(a), _host(e)
        assert a.shape == e.shape, f"{name}: shape {a.shape} vs expected {e.shape}"
        if not jnp.issubdtype(e.dtype, jnp.inexact):  # bfloat16 included
            np.testing.assert_array_equal(a, e, err_msg=name)
            continue
        a, e = a.astype(np.float64), e.astype(np.float64)
        finite = np.isfinite(e)
        s = float(np.abs(e[finite]).max(initial=0.0)) if scale is None else float(scale)
        atol = rtol * s
        np.testing.assert_allclose(
            a, e, rtol=rtol, atol=atol,
            err_msg=f"{name} (atol {atol:.3g} = rtol {rtol:g} x max|expected| {s:.3g})")
