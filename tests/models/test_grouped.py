"""The experts' grouped matmuls: the tile loop against ``jax.lax.ragged_dot`` (values
and gradients for any group sizes), its FLOPs by XLA's count, and the temporaries of a
training step through it by XLA's buffer assignment."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_shard as ns
from nnx_shard.models._grouped import grouped_matmul, resolve, tile_rows, unrolled

ROWS, K, N, GROUPS = 40, 8, 12, 5


@functools.cache
def _operands() -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(0), (ROWS, K))
    w = jax.random.normal(jax.random.key(1), (GROUPS, K, N))
    return x, w


@functools.cache
def _programs(tile: int | None) -> tuple:
    """Jitted (values, gradients) of the tiles and of ragged_dot, for one tile height:
    compiled once, run for every set of sizes."""

    def loss(kind: str, x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
        y = grouped_matmul(x, w, sizes, kind, tile=tile)
        return jnp.sum(jnp.sin(y))  # a cotangent that differs row by row

    out = []
    for kind in ("tiles", "ragged_dot"):
        out.append(jax.jit(lambda x, w, s, kind=kind: grouped_matmul(x, w, s, kind, tile=tile)))
        out.append(jax.jit(jax.grad(functools.partial(loss, kind), argnums=(0, 1))))
    return tuple(out)


def _close(got: jax.Array, want: jax.Array) -> None:
    # On the host: eager jnp ops would compile a program per shape.
    got, want = np.asarray(got), np.asarray(want)
    scale = max(float(np.max(np.abs(want))), 1.0)
    assert float(np.max(np.abs(got - want))) <= 1e-5 * scale


# Sizes summing to at most ROWS: the gaps between sorted cut points (empty groups and
# rows past the last group included).
sizes_strategy = st.lists(st.integers(0, ROWS), min_size=GROUPS, max_size=GROUPS).map(
    lambda cuts: [int(d) for d in np.diff([0, *sorted(cuts)])])


@settings(max_examples=30, deadline=None)
@given(sizes=sizes_strategy, tile=st.sampled_from([None, 1, 8, 16, 64]))
def test_tiles_equal_ragged_dot_for_any_sizes(sizes: list[int], tile: int | None) -> None:
    x, w = _operands()
    s = jnp.asarray(sizes, jnp.int32)
    tiles, tiles_grad, ragged, ragged_grad = _programs(tile)
    got, want = tiles(x, w, s), ragged(x, w, s)
    _close(got, want)
    assert not np.asarray(got)[sum(sizes):].any()  # rows past the groups are zeros
    for g, r in zip(tiles_grad(x, w, s), ragged_grad(x, w, s), strict=True):
        _close(g, r)


def test_edge_sizes_and_dtype() -> None:
    x, w = _operands()
    tiles, _, ragged, _ = _programs(8)
    for sizes in ([0] * GROUPS, [ROWS, 0, 0, 0, 0], [0, 0, 0, 0, ROWS], [8, 8, 8, 8, 8],
                  [7, 1, 9, 15, 8]):
        s = jnp.asarray(sizes, jnp.int32)
        _close(tiles(x, w, s), ragged(x, w, s))
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    s = jnp.asarray([10, 0, 20, 5, 5], jnp.int32)
    # Compiled (eagerly each op of the tiles compiles a program of its own).
    got = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, "tiles"))(xb, wb, s)
    want = jax.jit(jax.lax.ragged_dot)(xb, wb, s)
    assert got.dtype == want.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = float(np.max(np.abs(want)))
    assert float(np.max(np.abs(got - want))) <= 2e-2 * scale


@pytest.mark.parametrize("count", [GROUPS - 1, GROUPS + 1])
def test_sizes_of_another_length_are_refused_as_ragged_dot_refuses(count: int) -> None:
    x, w = _operands()
    sizes = jnp.full((count,), 2, jnp.int32)
    with pytest.raises(TypeError, match="group"):  # ragged_dot's own refusal
        jax.lax.ragged_dot(x, w, sizes)
    for kind in ("tiles", "ragged_dot"):
        with pytest.raises(ns.UsageError, match=rf"group_sizes\) has {count} entries but w "
                                                rf"has {GROUPS} groups.*Fix: sizes of shape "
                                                rf"\({GROUPS},\)"):
            grouped_matmul(x, w, sizes, kind)
    with pytest.raises(ns.UsageError, match="must hold integers"):
        grouped_matmul(x, w, jnp.ones((GROUPS,)), "tiles")
    with pytest.raises(ns.UsageError, match=r"shape \(5, 1\) but w has 5 groups"):
        grouped_matmul(x, w, jnp.ones((GROUPS, 1), jnp.int32), "tiles")
    with pytest.raises(ns.UsageError, match="same k"):
        grouped_matmul(x[:, :3], w, jnp.ones((GROUPS,), jnp.int32), "tiles")


def test_no_rows_give_ragged_dots_empty_product() -> None:
    _, w = _operands()
    x = jnp.zeros((0, K))
    s = jnp.zeros((GROUPS,), jnp.int32)
    got, want = grouped_matmul(x, w, s, "tiles"), jax.lax.ragged_dot(x, w, s)
    assert got.shape == want.shape == (0, N) and got.dtype == want.dtype


def test_unrolled_is_the_same_visits_without_a_loop() -> None:
    x, w = _operands()
    s = jnp.asarray([10, 0, 20, 5, 5], jnp.int32)

    def f(x: jax.Array, w: jax.Array, s: jax.Array) -> jax.Array:
        return grouped_matmul(x, w, s, "tiles", tile=8)

    looped = jax.jit(f).lower(x, w, s)
    with unrolled():
        flat = jax.jit(lambda *a: f(*a)).lower(x, w, s)
    assert "while" in looped.as_text() and "while" not in flat.as_text()
    np.testing.assert_array_equal(np.asarray(flat.compile()(x, w, s)),
                                  np.asarray(looped.compile()(x, w, s)))


@pytest.mark.parametrize("rows,groups", [(512, 4), (4096, 8)])
def test_flops_are_the_grouped_products_plus_the_straddling_tiles(rows: int,
                                                                 groups: int) -> None:
    k, n = 64, 96
    x = jax.ShapeDtypeStruct((rows, k), jnp.float32)
    w = jax.ShapeDtypeStruct((groups, k, n), jnp.float32)
    s = jax.ShapeDtypeStruct((groups,), jnp.int32)
    tile = tile_rows(rows, groups)
    visits = -(-rows // tile) + groups - 1

    def f(x: jax.Array, w: jax.Array, s: jax.Array) -> jax.Array:
        return grouped_matmul(x, w, s, "tiles")

    with unrolled():
        flops = jax.jit(lambda *a: f(*a)).lower(x, w, s).compile().cost_analysis()["flops"]
    grouped = 2 * rows * k * n  # every row times its own group's matrix, once
    assert visits * 2 * tile * k * n <= flops <= 1.05 * visits * 2 * tile * k * n
    assert flops <= 1.2 * grouped
    # XLA counts a loop's body once: the loop form alone would claim far less.
    looped = jax.jit(f).lower(x, w, s).compile().cost_analysis()["flops"]
    assert looped < 0.2 * flops


def test_tile_rows_bounds_the_straddling_rows() -> None:
    for rows in (1, 7, 100, 512, 4096, 32768, 10**6):
        for groups in (1, 2, 8, 64, 128):
            tile = tile_rows(rows, groups)
            assert tile & (tile - 1) == 0 and 8 <= tile <= 512
            assert tile <= max(8, 1 << max(rows - 1, 0).bit_length())
            if tile > 8:  # above the floor, straddling adds at most an eighth
                assert (groups - 1) * tile <= rows / 8


def test_kinds_resolve_and_a_bad_one_is_named() -> None:
    assert resolve("auto") == ("ragged_dot" if jax.default_backend() == "tpu" else "tiles")
    assert (resolve("tiles"), resolve("ragged_dot")) == ("tiles", "ragged_dot")
    with pytest.raises(ns.UsageError, match=r"expert_matmul='dense'; valid: 'auto', 'tiles', "
                                            r"'ragged_dot'\. Fix: e\.g\. expert_matmul='auto'"):
        grouped_matmul(jnp.ones((4, 2)), jnp.ones((2, 2, 3)), jnp.array([2, 2]), "dense")


def test_a_donated_training_step_keeps_its_temporaries_under_the_weights() -> None:
    """A two-layer expert MLP's SGD step (weights donated, updated in place), weights
    far larger than the tokens' activations: XLA's temporaries stay under the bytes of
    the weights it updates, because each loop's zero start is built just before that
    loop (``_zeros_after``) and the weight-gradient loop runs after the input-gradient
    loop's last read of the weights, so each expert stack's gradient is consumed by its
    update as soon as it is made. Without the zero starts, XLA builds every loop's
    zeros at the program's start and keeps the copies live through the forward pass;
    without the ordering, it copies donated weights to update them before the
    input-gradient loop reads them (docs/benchmarks.md, "Mixtures of experts")."""
    layers, rows, experts, k, n = 2, 64, 8, 64, 128
    dtype = jnp.bfloat16

    def loss(ws: list[tuple[jax.Array, jax.Array]], x: jax.Array, s: jax.Array
             ) -> jax.Array:
        for up, down in ws:
            h = jax.nn.silu(grouped_matmul(x, up, s, "tiles"))
            x = x + grouped_matmul(h, down, s, "tiles")
        return jnp.sum(x.astype(jnp.float32) ** 2)

    def step(ws: list[tuple[jax.Array, jax.Array]], x: jax.Array, s: jax.Array
             ) -> list[tuple[jax.Array, jax.Array]]:
        grads = jax.grad(loss)(ws, x, s)
        return jax.tree.map(lambda w, g: w - 0.1 * g, ws, grads)

    ws = [(jax.ShapeDtypeStruct((experts, k, n), dtype),
           jax.ShapeDtypeStruct((experts, n, k), dtype)) for _ in range(layers)]
    x = jax.ShapeDtypeStruct((rows, k), dtype)
    s = jax.ShapeDtypeStruct((experts,), jnp.int32)
    memory = jax.jit(step, donate_argnums=0).lower(ws, x, s).compile().memory_analysis()
    weights = 2 * layers * experts * k * n * jnp.dtype(dtype).itemsize  # 512 KiB
    assert memory.alias_size_in_bytes == weights  # donated: updated in place
    # Measured (jax 0.10.2 and 0.12.0.1 alike), in expert stacks of 128 KiB (the
    # weights are 4): 2.40 with the trick; 7.29 with plain jnp.zeros starts, 7.08 with
    # the weight-gradient loop started from the padded rows (not ordered after the
    # input-gradient loop), 7.28 with the tile loop of before both (commit df011c0^).
    assert memory.temp_size_in_bytes < weights
