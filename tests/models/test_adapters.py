"""Models nnx_shard never saw, made memory-efficient and context-parallel by one
argument or one line (nnx_shard.models._adapters):

* stock ``nnx.MultiHeadAttention(attention_fn=ns.models.attention_fn)`` equals the
  stock layer (flax's own attention), values and gradients, with a padding mask
  and grouped key/value heads;
* a stock-MHA language model with a padding mask, and a grouped-query model of
  its own projections calling ``ns.models.attention`` with key padding and
  segment ids (packed sequences), train under ``cp`` (ring) and ``fsdp_cp`` on 8
  simulated devices to the losses and parameters of one device.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from tests._close import assert_close
from tests._shared import one_device_run
from tests.conftest import needs_devices

STEPS = 2
RTOL = 1e-4
BATCH, LENGTH, EMBED, HEADS, KV_HEADS, VOCAB = 8, 16, 16, 4, 2, 32
PAD = 0


def _mha(rngs: nnx.Rngs, attention_fn: Any = nnx.dot_product_attention,
         kv_heads: int | None = None) -> nnx.MultiHeadAttention:
    return nnx.MultiHeadAttention(num_heads=HEADS, in_features=EMBED, qkv_features=EMBED,
                                  num_kv_heads=kv_heads, decode=False,
                                  attention_fn=attention_fn, rngs=rngs)


def _padding_mask(tokens: jax.Array) -> jax.Array:
    """Causal, and padding (token PAD) on both sides: padded queries see nothing."""
    valid = tokens != PAD
    return nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(valid, valid))


def _tokens(seed: int = 0, batch: int = BATCH) -> np.ndarray:
    """Next-token rows with a random amount of right padding (PAD)."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(1, VOCAB, size=(batch, LENGTH + 1)).astype(np.int32)
    for row, n in enumerate(rng.integers(LENGTH // 2, LENGTH + 2, size=batch)):
        toks[row, n:] = PAD
    return toks


# --------------------------------------------------------------------------- the layer


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [None, KV_HEADS])
def test_adapter_equals_stock_multi_head_attention(kv_heads) -> None:
    tokens = jnp.asarray(_tokens()[:, :-1])
    x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, EMBED))
    mask = _padding_mask(tokens)
    valid = (tokens != PAD)[..., None]
    w = jax.random.normal(jax.random.key(2), x.shape) * valid  # padded rows do not count

    def loss(layer, x):
        return jnp.sum(layer(x, mask=mask) * w)

    stock = _mha(nnx.Rngs(0), kv_heads=kv_heads)
    for kernel in ("auto", "blockwise", "dense"):
        fn = functools.partial(ns.models.attention_fn, implementation=kernel, block_size=4)
        ours = _mha(nnx.Rngs(0), fn, kv_heads)
        expected = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(stock, x)
        got = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(ours, x)
        # The key bias's gradient is zero by symmetry (softmax ignores a constant shift
        # of a row's scores): rounding noise, compared on the scale of all gradients.
        scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(expected[1]))
        assert_close(got, expected, 1e-5, f"{kernel} kv_heads={kv_heads}", scale=scale)
        # The padded query rows: flax averages all values there, the op gives 0.
        out = nnx.jit(lambda m, x: m(x, mask=mask))(ours, x)
        assert_close(out * valid, stock(x, mask=mask) * valid, 1e-5, kernel)
        assert not np.asarray(out * ~valid).any()
    # is_causal= reaches the op too.
    ours = _mha(nnx.Rngs(0), ns.models.attention_fn, kv_heads)
    assert_close(ours(x, is_causal=True), stock(x, is_causal=True), 1e-5, "is_causal")


def test_adapter_rejects_what_it_cannot_compute() -> None:
    q = jnp.ones((2, 4, 2, 8))
    with pytest.raises(ns.UsageError, match=r"dropout on the attention weights \(dropout_rate=0\.1"
                       r"\) .* Fix: nnx\.MultiHeadAttention\(\.\.\., dropout_rate=0\.0\)"):
        ns.models.attention_fn(q, q, q, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    with pytest.raises(ns.UsageError, match=r"additive attention bias is not supported\. Fix: use "
                       r"flax's own attention_fn"):
        ns.models.attention_fn(q, q, q, bias=jnp.zeros((2, 2, 4, 4)))
    # Extra batch dimensions are flattened and restored, as flax's function does.
    q5 = jnp.ones((3, 2, 4, 2, 8))
    assert ns.models.attention_fn(q5, q5, q5, mask=jnp.ones((3, 2, 1, 4, 4), bool)).shape == (
        3, 2, 4, 2, 8)


# --------------------------------------------------------------------------- models


class MHALM(nnx.Module):
    """Embed + learned positions, one stock MultiHeadAttention (op as attention_fn)
    with a causal padding mask, LayerNorm, a stock Linear head."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (LENGTH, EMBED)))
        self.norm = nnx.LayerNorm(EMBED, rngs=rngs)
        self.attn = _mha(rngs, ns.models.attention_fn)
        self.head = nnx.Linear(EMBED, VOCAB, rngs=rngs)

    def __call__(self, batch: dict[str, jax.Array]) -> jax.Array:
        tokens = batch["x"]
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        x = x + self.attn(self.norm(x), mask=_padding_mask(tokens))
        return self.head(x)


def lm_patterns(qkv: str, out: str) -> dict[str, tuple[str | None, ...]]:
    """The logical names of an LM with a position table whose attention projections are
    ``qkv`` (a regex of the three paths) and ``out``."""
    return {
        r"^embed/embedding$": ("vocab", "embed"),
        r"^pos$": (None, "embed"),
        rf"^{qkv}/kernel$": ("embed", "heads", "kv"),
        rf"^{qkv}/bias$": ("heads", "kv"),
        rf"^{out}/kernel$": ("heads", "kv", "embed"),
        rf"^{out}/bias$": ("embed",),
        r"^head/kernel$": ("embed", "vocab"),
        r"^head/bias$": ("vocab",),
    }


MHA_PATTERNS = {r"^norm/(scale|bias)$": ("embed",),
                **lm_patterns("attn/(query|key|value)", "attn/out")}


class GQALM(nnx.Module):
    """Grouped-query attention of its own (4 query heads, 2 key/value heads) whose core
    is the op, with key padding and segment ids (packed sequences), and a small
    blockwise block so that each ring step runs several tiles."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (LENGTH, EMBED)))
        d = EMBED // HEADS
        self.q = nnx.LinearGeneral(EMBED, (HEADS, d), rngs=rngs)
        self.k = nnx.LinearGeneral(EMBED, (KV_HEADS, d), rngs=rngs)
        self.v = nnx.LinearGeneral(EMBED, (KV_HEADS, d), rngs=rngs)
        self.o = nnx.LinearGeneral((HEADS, d), EMBED, axis=(-2, -1), rngs=rngs)
        self.head = nnx.Linear(EMBED, VOCAB, rngs=rngs)

    def __call__(self, batch: dict[str, jax.Array]) -> jax.Array:
        tokens = batch["x"]
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        out = ns.models.attention(self.q(x), self.k(x), self.v(x), causal=True,
                                  mask=(tokens != PAD)[:, None, None, :],
                                  segment_ids=batch["seg"], block_size=2)
        return self.head(x + self.o(out))


GQA_PATTERNS = lm_patterns("(q|k|v)", "o")


def _masked_ce(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    logits = model(batch)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    keep = (batch["y"] != PAD).astype(ce.dtype)
    return jnp.sum(ce * keep) / jnp.sum(keep)


def _batches() -> list[dict[str, np.ndarray]]:
    out = []
    for step in range(STEPS):
        toks = _tokens(seed=step)
        # Two packed sequences per row, cut at a different place in each row.
        cut = np.random.default_rng(10 + step).integers(3, LENGTH - 3, size=(BATCH, 1))
        seg = (np.arange(LENGTH)[None, :] >= cut).astype(np.int32)
        out.append({"x": toks[:, :-1], "y": toks[:, 1:], "seg": seg})
    return out


MODELS = {"mha": (MHALM, MHA_PATTERNS), "gqa": (GQALM, GQA_PATTERNS)}


def _tx() -> optax.GradientTransformation:
    return optax.sgd(0.05, momentum=0.9)  # linear in the gradients: see test_strategies' _sgd


@functools.cache
def _reference(name: str) -> tuple[np.ndarray, Any]:
    cls, patterns = MODELS[name]
    return one_device_run(lambda: ns.annotate(cls(nnx.Rngs(0)), patterns, strict=True),
                          _masked_ce, _tx(), _batches())


@pytest.mark.slow
@needs_devices(8)
# fsdp_cp runs cp's ring with the parameters split over data too: the adapter's masks and
# segments meet the ring the same way under both (cp itself: the preset matrix).
@pytest.mark.parametrize("preset", ["fsdp_cp"])
@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_user_models_under_context_parallelism_equal_one_device(name, preset) -> None:
    cls, patterns = MODELS[name]
    s = ns.strategies.get(preset)
    mesh = s.make_mesh()
    model = ns.sharded_init(lambda: ns.annotate(cls(nnx.Rngs(0)), patterns, strict=True), mesh, s)
    opt = ns.sharded_optimizer(model, _tx(), mesh, s)
    trainer = ns.Trainer(model, opt, _masked_ce, mesh=mesh, rules=s.rules, steps_per_call=STEPS,
                         batch_names=("batch", "length"))
    history = trainer.fit(_batches(), STEPS, progress=False)
    losses, params = _reference(name)
    assert_close(history["loss"], losses, RTOL, f"{name} {preset} loss")
    # Per tensor, floored at 1e-3 of the model's largest value: the key bias holds only
    # rounding noise (see test_adapter_equals_stock_multi_head_attention).
    got, want = jax.device_get(nnx.state(model, nnx.Param)), params
    floor = 1e-3 * max(float(np.abs(x).max()) for x in jax.tree.leaves(want))
    for (path, a), (_, e) in zip(jax.tree_util.tree_leaves_with_path(got),
                                 jax.tree_util.tree_leaves_with_path(want), strict=True):
        assert_close(a, e, RTOL, f"{name} {preset} {jax.tree_util.keystr(path)}",
                     scale=max(float(np.abs(e).max()), floor))
    # The attention ran context-parallel: the ring's K/V permutes over context, in the
    # program fit ran (lowered again for the same group of steps: no second compile).
    stacked = {k: np.stack([b[k] for b in _batches()]) for k in _batches()[0]}
    text = trainer.lower(stacked).compile().as_text()
    kinds = {(x.kind, x.axes) for x in ns.planner.compiled_collectives(text, mesh)}
    assert ("collective-permute", ("context",)) in kinds
