"""Models built only from stock ``flax.nnx`` layers on Explicit mesh axes: where JAX's
sharding-in-types rejects an operation of a stock layer (a gather, a dot, a scan's carry),
training stops with a ``ShardingError`` that names the operation, the layer, the arrays'
layouts and the fix (Auto axes), its cause JAX's own error. The stock layers under the
presets on their default (Auto) meshes are a row of the preset matrix in
tests/test_strategies.py (the models: tests/_stock_models.py).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from tests._stock_models import BATCH, EMBED, LENGTH, MLP, VOCAB, ce, tokens
from tests.conftest import needs_devices

# Every test here compiles a sharded training step: several seconds each on 2 cores.
pytestmark = [needs_devices(8), pytest.mark.slow]


def _tx() -> optax.GradientTransformation:
    return optax.sgd(0.05, momentum=0.9)


# --------------------------------------------------------------------------- Explicit axes


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
    trainer = ns.Trainer(model, opt, lambda m, b: ce(m(b["x"]), b["y"]), mesh=mesh,
                         rules=s.rules, steps_per_call=2, batch_names=batch_names)
    return trainer.fit([data] * 2, 2, progress=False)


FIX = r"Fix: build the mesh with Auto axes, ns.make_mesh\(\.\.\., axis_types='auto'\)"


@pytest.mark.parametrize("preset", ["dp", "fsdp_tp"])
def test_stock_embed_on_explicit_axes_raises_sharding_error(preset: str) -> None:
    data = tokens(np.random.default_rng(0))
    with pytest.raises(ns.ShardingError) as info:
        _explicit_run(preset, EmbedMLP, EMBED_PATTERNS, data, ("batch", "length"))
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
                         lambda m, b: ce(m(b["x"]), b["y"]), mesh=mesh, rules=s.rules,
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
