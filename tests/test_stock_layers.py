"""Models built only from stock ``flax.nnx`` layers, with no sharding code in the
model, annotated from outside by ``ns.annotate(..., strict=True)`` path patterns,
train under every preset on the preset's default mesh (Auto axes):

* ``sharded_init`` through the strategy succeeds, and every Variable is laid out
  as the rules say;
* 3 ``Trainer`` steps give the losses and parameters (and batch statistics) of a
  plain ``nnx.jit`` loop on one device;
* ``ns.save`` then ``ns.restore`` onto another preset's mesh is bitwise equal.

Layer kinds are grouped into a few models (tiny shapes) rather than one model per
layer, to keep the matrix fast. On Explicit axes the same stock layers stop with
a ``ShardingError`` that names the operation and the fix (end of file).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import nnx_shard as ns
from tests._shared import host as _host
from tests._shared import one_device_run
from tests.conftest import needs_devices

# Every test here trains a stock layer under a preset: over ~10 s each on 2 cores.
pytestmark = [needs_devices(8), pytest.mark.slow]

STEPS = 3
RTOL = 1e-4
BATCH, LENGTH, EMBED, HEADS, MLP, VOCAB = 8, 8, 16, 4, 32, 32


def _tx() -> optax.GradientTransformation:
    # SGD with momentum: updates are linear in the gradients, so float rounding
    # of differently ordered sums stays at rounding size (Adam's m/sqrt(v) turns
    # a near-zero gradient's rounding into a full-size step). Momentum gives
    # zero1 an optimizer state to shard.
    return optax.sgd(0.05, momentum=0.9)


# --------------------------------------------------------------------------- models


class LM(nnx.Module):
    """Embed (tied output via ``attend``), causal MultiHeadAttention, LayerNorm,
    RMSNorm, an MLP of nnx.Linear, Dropout."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
        self.norm1 = nnx.LayerNorm(EMBED, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=EMBED, qkv_features=EMBED, decode=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(EMBED, rngs=rngs)
        self.up = nnx.Linear(EMBED, MLP, rngs=rngs)
        self.down = nnx.Linear(MLP, EMBED, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        x = x + self.attn(self.norm1(x), mask=nnx.make_causal_mask(tokens))
        x = x + self.drop(self.down(nnx.gelu(self.up(self.norm2(x)))))
        return self.embed.attend(x)


LM_PATTERNS = {
    r"^embed/embedding$": ("vocab", "embed"),
    r"^norm1/(scale|bias)$": ("embed",),
    r"^attn/(query|key|value)/kernel$": ("embed", "heads", "kv"),
    r"^attn/(query|key|value)/bias$": ("heads", "kv"),
    r"^attn/out/kernel$": ("heads", "kv", "embed"),
    r"^attn/out/bias$": ("embed",),
    r"^norm2/scale$": ("embed",),
    r"^up/kernel$": ("embed", "mlp"),
    r"^up/bias$": ("mlp",),
    r"^down/kernel$": ("mlp", "embed"),
    r"^down/bias$": ("embed",),
}


class ConvNet(nnx.Module):
    """Conv, GroupNorm, BatchNorm (train mode: batch statistics carried), Einsum,
    LinearGeneral."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(EMBED, MLP, kernel_size=(3, 3), rngs=rngs)
        self.gn = nnx.GroupNorm(MLP, num_groups=4, rngs=rngs)
        self.bn = nnx.BatchNorm(MLP, momentum=0.5, rngs=rngs)
        self.mix = nnx.Einsum("bm,me->be", (MLP, EMBED), (EMBED,), rngs=rngs)
        self.head = nnx.LinearGeneral(EMBED, (2, 5), rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = nnx.relu(self.bn(self.gn(self.conv(images))))
        x = self.mix(x.mean(axis=(1, 2)))
        return self.head(nnx.relu(x)).reshape(x.shape[0], 10)


CONV_PATTERNS = {
    r"^conv/kernel$": (None, None, "embed", "mlp"),
    r"^conv/bias$": ("mlp",),
    r"^(gn|bn)/(scale|bias|mean|var)$": ("mlp",),
    r"^mix/kernel$": ("mlp", "embed"),
    r"^mix/bias$": ("embed",),
    r"^head/kernel$": ("embed", None, None),
    r"^head/bias$": (None, None),
}


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(EMBED, EMBED, rngs=rngs)
        self.norm = nnx.LayerNorm(EMBED, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + nnx.tanh(self.linear(self.norm(x)))


class Head(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(EMBED, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear(x)


class Stacked(nnx.Module):
    """Layers stacked by nnx.vmap (``transform_metadata`` names the layer axis),
    run by nnx.scan with a carry and nnx.remat; a LoRA adapter; an ensemble of
    heads applied with nnx.vmap."""

    def __init__(self, rngs: nnx.Rngs, layers: int = 3, heads: int = 2):
        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def blocks(rngs: nnx.Rngs) -> Block:
            return Block(rngs)

        @nnx.split_rngs(splits=heads)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def ensemble(rngs: nnx.Rngs) -> Head:
            return Head(rngs)

        self.lora = nnx.LoRA(EMBED, 2, EMBED, rngs=rngs)
        self.blocks = blocks(rngs)
        self.heads = ensemble(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.lora(x)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def run(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        x = run(x, self.blocks)
        outs = nnx.vmap(lambda head, x: head(x), in_axes=(0, None))(self.heads, x)
        return outs.mean(axis=0)


STACKED_PATTERNS = {
    r"^lora/lora_a$": ("embed", None),
    r"^lora/lora_b$": (None, "mlp"),
    r"^blocks/linear/kernel$": ("layers", "embed", "mlp"),
    r"^blocks/linear/bias$": ("layers", "mlp"),
    r"^blocks/norm/(scale|bias)$": ("layers", "embed"),
    r"^heads/linear/kernel$": ("layers", "embed", None),
    r"^heads/linear/bias$": ("layers", None),
}


class Recurrent(nnx.Module):
    """nnx.RNN over an LSTMCell, then over a GRUCell."""

    def __init__(self, rngs: nnx.Rngs):
        self.lstm = nnx.RNN(nnx.LSTMCell(EMBED, MLP, rngs=rngs))
        self.gru = nnx.RNN(nnx.GRUCell(MLP, EMBED, rngs=rngs))
        self.head = nnx.Linear(EMBED, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.gru(self.lstm(x)))


RECURRENT_PATTERNS = {
    r"^lstm/cell/i[ifgo]_?/kernel$": ("embed", "mlp"),
    r"^lstm/cell/h[ifgo]/kernel$": (None, "mlp"),
    r"^lstm/cell/h[ifgo]/bias$": ("mlp",),
    r"^gru/cell/dense_i/kernel$": ("mlp", "embed"),
    r"^gru/cell/dense_i/bias$": ("embed",),
    r"^gru/cell/dense_h/kernel$": (None, "embed"),
    r"^head/kernel$": ("embed", None),
    r"^head/bias$": (None,),
}


# --------------------------------------------------------------------------- cases


def _ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _mse(pred: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((pred - target) ** 2)


@dataclasses.dataclass(frozen=True)
class Case:
    model: type[nnx.Module]
    patterns: dict[str, tuple[str | None, ...]]
    loss: Callable[[jax.Array, jax.Array], jax.Array]
    data: Callable[[np.random.Generator], dict[str, np.ndarray]]
    batch_names: tuple[str, ...]
    # A parameter whose layout the test spells out, with its logical names.
    probe: tuple[str, tuple[str | None, ...]]

    def factory(self) -> Callable[[], nnx.Module]:
        return lambda: ns.annotate(self.model(nnx.Rngs(0)), self.patterns, strict=True)

    def loss_fn(self, model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
        return self.loss(model(batch["x"]), batch["y"])


def _tokens(rng: np.random.Generator) -> dict[str, np.ndarray]:
    t = rng.integers(0, VOCAB, size=(BATCH, LENGTH + 1)).astype(np.int32)
    return {"x": t[:, :-1], "y": t[:, 1:]}


CASES = {
    "lm": Case(LM, LM_PATTERNS, _ce, _tokens, ("batch", "length"),
               ("attn/query/kernel", ("embed", "heads", "kv"))),
    "conv": Case(
        ConvNet, CONV_PATTERNS, _ce,
        lambda rng: {"x": rng.normal(size=(BATCH, 6, 6, EMBED)).astype(np.float32),
                     "y": rng.integers(0, 10, size=(BATCH,)).astype(np.int32)},
        ("batch",), ("conv/kernel", (None, None, "embed", "mlp"))),
    "stacked": Case(
        Stacked, STACKED_PATTERNS, _mse,
        lambda rng: {"x": rng.normal(size=(BATCH, EMBED)).astype(np.float32),
                     "y": rng.normal(size=(BATCH, 4)).astype(np.float32)},
        ("batch",), ("blocks/linear/kernel", ("layers", "embed", "mlp"))),
    "recurrent": Case(
        Recurrent, RECURRENT_PATTERNS, _mse,
        lambda rng: {"x": rng.normal(size=(BATCH, LENGTH, EMBED)).astype(np.float32),
                     "y": rng.normal(size=(BATCH, LENGTH, 4)).astype(np.float32)},
        ("batch", "length"), ("lstm/cell/ii/kernel", ("embed", "mlp"))),
}
PRESETS = ("dp", "zero1", "fsdp", "tp", "fsdp_tp", "sp")
# sp shards the sequence: it applies to the models that have a length axis.
MATRIX = [(c, p) for c in CASES for p in PRESETS
          if p != "sp" or "length" in CASES[c].batch_names]
# The mesh axis each preset gives the logical names the models use (others: replicated).
TP_AXES = {"heads": "model", "mlp": "model", "vocab": "model"}
PROMISED = {"dp": {}, "zero1": {}, "fsdp": {"embed": "data"}, "tp": TP_AXES,
            "fsdp_tp": {"embed": "data", **TP_AXES}, "sp": TP_AXES}
# Where each run's checkpoint is restored: another preset, another mesh shape.
RESTORE_ON = {"dp": "fsdp_tp", "zero1": "tp", "fsdp": "tp", "tp": "fsdp", "fsdp_tp": "dp",
              "sp": "fsdp"}


@functools.cache
def _batches(name: str) -> tuple[dict[str, np.ndarray], ...]:
    rng = np.random.default_rng(0)
    return tuple(CASES[name].data(rng) for _ in range(STEPS))


@functools.cache
def _reference(name: str) -> tuple[np.ndarray, Any]:
    """Losses and final state of a plain nnx.jit loop on one device."""
    case = CASES[name]
    return one_device_run(case.factory(), case.loss_fn, _tx(), _batches(name), ...)


def _assert_close(actual: Any, expected: Any, what: str) -> None:
    a_flat = nnx.to_flat_state(actual)
    e_flat = nnx.to_flat_state(expected)
    assert [p for p, _ in a_flat] == [p for p, _ in e_flat], what
    # A tensor whose gradient is zero by symmetry (attention's key bias: softmax
    # ignores a constant shift of the scores) holds only rounding noise (~1e-9),
    # so each tensor's scale is floored at 1e-3 of the model's largest value.
    floor = 1e-3 * max(float(np.max(np.abs(v.get_value()))) for _, v in e_flat
                       if np.asarray(v.get_value()).dtype.kind == "f")
    for (path, a), (_, e) in zip(a_flat, e_flat, strict=True):
        a, e = np.asarray(a.get_value()), np.asarray(e.get_value())
        where = f"{what}: {'/'.join(map(str, path))}"
        if e.dtype.kind != "f":  # RNG keys and counters: exactly
            np.testing.assert_array_equal(a, e, err_msg=where)
            continue
        scale = max(float(np.max(np.abs(e))) if e.size else 0.0, floor)
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=RTOL * scale, err_msg=where)


@pytest.mark.parametrize(("name", "preset"), MATRIX, ids=[f"{c}-{p}" for c, p in MATRIX])
def test_stock_model_trains_like_one_device(name: str, preset: str, tmp_path) -> None:
    case = CASES[name]
    s = ns.strategies.get(preset)
    mesh = s.make_mesh()
    assert set(mesh.axis_types) == {AxisType.Auto}  # the presets' default mesh

    # Init through the strategy: every Variable laid out as the rules say.
    model = ns.sharded_init(case.factory(), mesh, s)
    state = nnx.state(model)
    want = ns.shardings(state, mesh, s.rules)
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state)) == jax.tree.leaves(want)
    path, names = case.probe
    probe = dict(nnx.to_flat_state(state))[tuple(path.split("/"))].get_value()
    spec = s.rules.spec(names, shape=probe.shape, mesh=mesh)
    assert probe.sharding.spec == spec
    # ... and that is what the preset promises for these names (spelled out here).
    want_axes = tuple(PROMISED[preset].get(n) for n in names)
    assert tuple(spec) + (None,) * (len(names) - len(spec)) == want_axes
    opt = ns.sharded_optimizer(model, _tx(), mesh, s)

    trainer = ns.Trainer(model, opt, case.loss_fn, mesh=mesh, rules=s.rules,
                         steps_per_call=STEPS, batch_names=case.batch_names)
    history = trainer.fit(list(_batches(name)), STEPS, progress=False)

    losses, ref_state = _reference(name)
    scale = float(np.max(np.abs(losses)))
    np.testing.assert_allclose(history["loss"], losses, rtol=RTOL, atol=RTOL * scale)
    _assert_close(_host(nnx.state(model)), ref_state, f"{name} under {preset}")
    # Train-mode state moved, and was carried: the reference agrees on it above.
    if name == "lm":
        assert int(model.drop.rngs.count[...]) == STEPS  # a dropout key per step
    if name == "conv":
        assert np.abs(np.asarray(model.bn.mean[...])).max() > 0  # batch statistics
    # Training kept the layouts.
    state = nnx.state(model)
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state)) == jax.tree.leaves(want)

    # Saved sharded, restored onto another preset's mesh: the same bits.
    ns.save(tmp_path / "ckpt", STEPS, model=model)
    other = ns.strategies.get(RESTORE_ON[preset])
    other_mesh = other.make_mesh()
    restored = ns.restore(tmp_path / "ckpt", model=ns.abstract_init(case.factory(), other_mesh, other))
    restored_state = nnx.state(restored)
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, restored_state)) == jax.tree.leaves(
        ns.shardings(restored_state, other_mesh, other.rules))
    for (p, a), (_, b) in zip(nnx.to_flat_state(_host(restored_state)),
                              nnx.to_flat_state(_host(state)), strict=True):
        np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg="/".join(map(str, p)))


# --------------------------------------------------------------------------- Explicit axes


def test_sharding_type_error_is_where_nnx_shard_looks_for_it() -> None:
    # JAX has no public name for it; if it moves, nnx_shard's translation of it
    # into ShardingError silently stops, so this fails loudly instead.
    from jax._src import core

    assert ns._errors.ShardingTypeError is core.ShardingTypeError
    mesh = ns.make_mesh("data=8", axis_types="explicit")
    table = jnp.ones((VOCAB, EMBED))
    idx = jax.device_put(np.zeros((BATCH, 2), np.int32),
                         jax.NamedSharding(mesh, jax.P("data")))
    with jax.set_mesh(mesh), pytest.raises(core.ShardingTypeError, match="gather"):
        jnp.take(table, idx, axis=0)


class EmbedMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
        self.up = nnx.Linear(EMBED, MLP, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.embed.attend(self.up(self.embed(tokens)) @ self.up.kernel[...].T)


EMBED_PATTERNS = {r"embedding$": ("vocab", "embed"), r"up/kernel$": ("embed", "mlp"),
                  r"up/bias$": ("mlp",)}


def _explicit_run(preset: str, model_cls, patterns, data, batch_names=("batch",)):
    s = ns.strategies.get(preset)
    mesh = s.make_mesh(axis_types="explicit")
    model = ns.sharded_init(lambda: ns.annotate(model_cls(nnx.Rngs(0)), patterns, strict=True),
                            mesh, s)
    opt = ns.sharded_optimizer(model, _tx(), mesh, s)
    trainer = ns.Trainer(model, opt, lambda m, b: _ce(m(b["x"]), b["y"]), mesh=mesh,
                         rules=s.rules, steps_per_call=2, batch_names=batch_names)
    return trainer.fit([data] * 2, 2, progress=False)


FIX = r"Fix: build the mesh with Auto axes, ns.make_mesh\(\.\.\., axis_types='auto'\)"


@pytest.mark.parametrize("preset", ["dp", "fsdp_tp"])
def test_stock_embed_on_explicit_axes_raises_sharding_error(preset: str) -> None:
    tokens = _tokens(np.random.default_rng(0))
    with pytest.raises(ns.ShardingError) as info:
        _explicit_run(preset, EmbedMLP, EMBED_PATTERNS, tokens, ("batch", "length"))
    msg = str(info.value)
    assert msg.startswith("Trainer.fit: JAX rejected the sharding types of a "
                          "'gather' operation on Explicit mesh axes, in Embed.__call__ "
                          "(flax/nnx/nn/linear.py:")
    assert "jnp.take(embedding, inputs, axis=0)" in msg
    assert "called from EmbedMLP.__call__ (" in msg and "test_stock_layers.py" in msg
    # The table and the indices, as JAX typed them (dims @ the mesh axes sharding them).
    table = f"float32[{VOCAB},{EMBED}]" if preset == "dp" else f"float32[{VOCAB}@model,{EMBED}@data]"
    assert f"Arrays involved (dims@mesh axes): {table}, int32[{BATCH}@data,{LENGTH},1]" in msg
    assert "Use `.at[...].get(out_sharding=)`" in msg  # JAX's own words are kept
    assert re.search(FIX, msg)
    assert isinstance(info.value.__cause__, ns._errors.ShardingTypeError)


def test_stock_linear_chain_on_explicit_axes_raises_sharding_error() -> None:
    class Chain(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(EMBED, MLP, rngs=rngs)
            self.b = nnx.Linear(MLP, EMBED, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    pats = {r"a/kernel": ("embed", "mlp"), r"a/bias": ("mlp",), r"b/kernel": ("mlp", "embed"),
            r"b/bias": ("embed",)}
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(BATCH, EMBED)).astype(np.float32),
            "y": rng.integers(0, EMBED, size=(BATCH,)).astype(np.int32)}
    with pytest.raises(ns.ShardingError, match=r"'dot_general' operation on Explicit mesh axes"
                       r", in Linear.__call__ .*called from .*Chain.__call__.*" + FIX):
        _explicit_run("tp", Chain, pats, data)


def test_scan_carry_changing_sharding_on_explicit_axes_raises_sharding_error() -> None:
    class ScanMLP(nnx.Module):  # Flax's toy: nnx.scan over vmap-stacked layers, with a carry
        def __init__(self, rngs):
            @nnx.split_rngs(splits=2)
            @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(rngs):
                return nnx.Linear(EMBED, EMBED, rngs=rngs)

            self.layers = make(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, layer):
                return nnx.relu(layer(x))

            return body(x, self.layers)

    pats = {r"kernel$": ("layers", "embed", "mlp"), r"bias$": ("layers", "mlp")}
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(BATCH, EMBED)).astype(np.float32),
            "y": rng.integers(0, EMBED, size=(BATCH,)).astype(np.int32)}
    s = ns.strategies.get("tp")
    with pytest.raises(ns.ShardingError) as info:
        _explicit_run("tp", ScanMLP, pats, data)
    msg = str(info.value)
    assert "'scan' operation on Explicit mesh axes" in msg
    assert f"float32[{BATCH}@data,{EMBED}], float32[{BATCH}@data,{EMBED}@model]" in msg
    assert "carry input and carry output must have equal types" in msg
    assert re.search(FIX, msg)
    # The same model trains on the preset's default (Auto) mesh.
    mesh = s.make_mesh()
    model = ns.sharded_init(lambda: ns.annotate(ScanMLP(nnx.Rngs(0)), pats, strict=True), mesh, s)
    trainer = ns.Trainer(model, ns.sharded_optimizer(model, _tx(), mesh, s),
                         lambda m, b: _ce(m(b["x"]), b["y"]), mesh=mesh, rules=s.rules,
                         steps_per_call=2)
    assert np.isfinite(trainer.fit([data] * 2, 2, progress=False)["loss"]).all()


def test_multistep_lower_and_init_raise_sharding_error() -> None:
    mesh = ns.make_mesh("data=8", axis_types="explicit")
    model = nnx.Embed(VOCAB, EMBED, rngs=nnx.Rngs(0))
    idx = jax.device_put(np.zeros((2, BATCH, 3), np.int32),
                         jax.NamedSharding(mesh, jax.P(None, "data")))

    def step(model, tokens):
        return {"loss": model(tokens).sum()}

    with jax.set_mesh(mesh), pytest.raises(
            ns.ShardingError, match=r"^multistep\(step\)\.lower\(\.\.\.\): .*'gather'"):
        ns.multistep(step).lower(model, idx)

    # A factory that computes an initial value under the user's Explicit mesh.
    def factory():
        layer = nnx.Embed(VOCAB, EMBED, rngs=nnx.Rngs(0))
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            shift = jnp.take(jnp.ones((VOCAB, EMBED)), idx[0], axis=0).mean()
        layer.embedding[...] += shift
        return layer

    for entry in (ns.sharded_init, ns.abstract_init):
        with jax.set_mesh(mesh), pytest.raises(
                ns.ShardingError, match=rf"^{entry.__name__}: the factory .*factory: JAX "
                r"rejected the sharding types of a 'gather' operation"):
            entry(factory, mesh, {"vocab": None, "embed": None})
