"""Models built only from stock ``flax.nnx`` layers, with no sharding code in the model,
annotated from outside by ``ns.annotate(..., strict=True)`` path patterns: the stock-layer
row of the preset matrix (tests/strategies/test_presets.py). Layer kinds are grouped into
a few models (tiny shapes) rather than one model per layer, to keep the matrix fast."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nnx_shard as ns

BATCH, LENGTH, EMBED, HEADS, MLP, VOCAB = 8, 8, 16, 4, 32, 32


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


def ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def mse(pred: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((pred - target) ** 2)


@dataclasses.dataclass(frozen=True)
class Case:
    """A stock model, the patterns that annotate it, its loss and its data."""

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


def tokens(rng: np.random.Generator) -> dict[str, np.ndarray]:
    t = rng.integers(0, VOCAB, size=(BATCH, LENGTH + 1)).astype(np.int32)
    return {"x": t[:, :-1], "y": t[:, 1:]}


CASES = {
    "lm": Case(LM, LM_PATTERNS, ce, tokens, ("batch", "length"),
               ("attn/query/kernel", ("embed", "heads", "kv"))),
    "conv": Case(
        ConvNet, CONV_PATTERNS, ce,
        lambda rng: {"x": rng.normal(size=(BATCH, 6, 6, EMBED)).astype(np.float32),
                     "y": rng.integers(0, 10, size=(BATCH,)).astype(np.int32)},
        ("batch",), ("conv/kernel", (None, None, "embed", "mlp"))),
    "stacked": Case(
        Stacked, STACKED_PATTERNS, mse,
        lambda rng: {"x": rng.normal(size=(BATCH, EMBED)).astype(np.float32),
                     "y": rng.normal(size=(BATCH, 4)).astype(np.float32)},
        ("batch",), ("blocks/linear/kernel", ("layers", "embed", "mlp"))),
    "recurrent": Case(
        Recurrent, RECURRENT_PATTERNS, mse,
        lambda rng: {"x": rng.normal(size=(BATCH, LENGTH, EMBED)).astype(np.float32),
                     "y": rng.normal(size=(BATCH, LENGTH, 4)).astype(np.float32)},
        ("batch", "length"), ("lstm/cell/ii/kernel", ("embed", "mlp"))),
}
