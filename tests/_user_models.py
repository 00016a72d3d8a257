"""Models written the way users outside nnx_shard write them, shared by the tests of a
user's own model under every preset:

* ``Decoder``: a grouped-query Llama (RoPE from per-call ``positions``, SwiGLU), its
  metadata in its own names ``('fsdp', 'tp')`` (``nnx.with_partitioning``), a plain
  mutable ``@dataclass`` config stored on every module (unhashable), its blocks in a
  Python list (``nnx.List``), an embedding lookup written ``table[(tokens,)]``, the
  attention core through ``ns.models.attention``; with ``experts`` a Qwen3-MoE-style
  MLP (a router, top-k softmax gates, experts named ``('exp', 'fsdp', 'tp')``);
* ``MHALM``: stock ``nnx.MultiHeadAttention(attention_fn=ns.models.attention_fn)``
  blocks in a list, a causal padding mask passed to every block, unannotated: laid out
  from outside by ``ns.annotate`` patterns in its own names.

The only nnx_shard lines in them are the documented one-liners: ``ns.models.attention``
/ ``attention_fn`` for the attention core and ``ns.pipeline.run(self.layers, x, ...)``
for the loop over blocks (a plain loop for the list).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nnx_shard as ns

PAD = 0
#: The model names -> the presets' names (``strategy.with_rules(ALIASES)``).
ALIASES = {"fsdp": "embed", "tp": "mlp", "exp": "expert"}


@dataclasses.dataclass  # mutable, so unhashable: as users write configs
class Config:
    vocab: int = 32
    embed: int = 16
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 4
    mlp: int = 32
    layers: int = 4
    experts: int = 0
    top_k: int = 2
    length: int = 16


def _init(names: tuple[str | None, ...], scale: float = 1.0) -> Any:
    return nnx.with_partitioning(nnx.initializers.normal(scale), names)


def _rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    freq = 1.0 / (10_000.0 ** (jnp.arange(half) / half))
    angle = positions[..., None, None].astype(jnp.float32) * freq  # [B, L, 1, half]
    a, b = x[..., :half], x[..., half:]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


class Attention(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, k = cfg.head_dim, cfg.heads, cfg.kv_heads
        s = cfg.embed ** -0.5
        self.q_proj = nnx.LinearGeneral(cfg.embed, (h, d), use_bias=False,
                                        kernel_init=_init(("fsdp", "tp", None), s), rngs=rngs)
        self.k_proj = nnx.LinearGeneral(cfg.embed, (k, d), use_bias=False,
                                        kernel_init=_init(("fsdp", "tp", None), s), rngs=rngs)
        self.v_proj = nnx.LinearGeneral(cfg.embed, (k, d), use_bias=False,
                                        kernel_init=_init(("fsdp", "tp", None), s), rngs=rngs)
        self.o_proj = nnx.LinearGeneral((h, d), cfg.embed, axis=(-2, -1), use_bias=False,
                                        kernel_init=_init(("tp", None, "fsdp"), (h * d) ** -0.5),
                                        rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        q = _rope(self.q_proj(x), positions)
        k = _rope(self.k_proj(x), positions)
        out = ns.models.attention(q, k, self.v_proj(x), causal=True)  # GQA: K/V not repeated
        return self.o_proj(out)


class MLP(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.cfg = cfg
        s = cfg.embed ** -0.5
        self.gate = nnx.Linear(cfg.embed, cfg.mlp, use_bias=False,
                               kernel_init=_init(("fsdp", "tp"), s), rngs=rngs)
        self.up = nnx.Linear(cfg.embed, cfg.mlp, use_bias=False,
                             kernel_init=_init(("fsdp", "tp"), s), rngs=rngs)
        self.down = nnx.Linear(cfg.mlp, cfg.embed, use_bias=False,
                               kernel_init=_init(("tp", "fsdp"), cfg.mlp ** -0.5), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class MoE(nnx.Module):
    """A router picks ``top_k`` experts per token; every expert runs on every token and
    the gates (zero off the top k) weigh them: dense dispatch, exact."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.cfg = cfg
        e, s = cfg.experts, cfg.embed ** -0.5
        self.router = nnx.Linear(cfg.embed, e, use_bias=False,
                                 kernel_init=_init(("fsdp", None), s), rngs=rngs)
        self.gate = nnx.Param(_init(("exp", "fsdp", "tp"), s)(rngs.params(),
                                                               (e, cfg.embed, cfg.mlp)))
        self.up = nnx.Param(_init(("exp", "fsdp", "tp"), s)(rngs.params(),
                                                             (e, cfg.embed, cfg.mlp)))
        self.down = nnx.Param(_init(("exp", "tp", "fsdp"), cfg.mlp ** -0.5)(
            rngs.params(), (e, cfg.mlp, cfg.embed)))

    def __call__(self, x: jax.Array) -> jax.Array:
        logits = self.router(x)
        top, _ = jax.lax.top_k(logits, self.cfg.top_k)
        keep = logits >= top[..., -1:]
        gates = jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)  # [B, L, E]
        h = nnx.silu(jnp.einsum("ble,xem->blxm", x, self.gate[...]))
        h = h * jnp.einsum("ble,xem->blxm", x, self.up[...])
        y = jnp.einsum("blxm,xme->blxe", h, self.down[...])
        return jnp.einsum("blxe,blx->ble", y, gates)


class Block(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attn_norm = nnx.RMSNorm(cfg.embed, rngs=rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.embed, rngs=rngs)
        self.mlp = MoE(cfg, rngs) if cfg.experts else MLP(cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class Embedder(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.cfg = cfg
        self.input_embedding = nnx.Param(_init(("tp", "fsdp"))(rngs.params(),
                                                               (cfg.vocab, cfg.embed)))

    def encode(self, tokens: jax.Array) -> jax.Array:
        return self.input_embedding[(tokens,)]


class Decoder(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedder = Embedder(cfg, rngs)
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.final_norm = nnx.RMSNorm(cfg.embed, rngs=rngs)
        self.lm_head = nnx.Linear(cfg.embed, cfg.vocab, use_bias=False,
                                  kernel_init=_init(("fsdp", "tp"), cfg.embed ** -0.5),
                                  rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embedder.encode(tokens)
        x = ns.pipeline.run(self.layers, x, positions)
        return self.lm_head(self.final_norm(x))


def small_llama() -> Decoder:
    """A factory for ``nnx-shard explain tests._user_models:small_llama``."""
    return Decoder(Config(layers=2), rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------- stock MHA


def padding_mask(tokens: jax.Array) -> jax.Array:
    """Causal, and padding (token PAD) on both sides."""
    valid = tokens != PAD
    return nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(valid, valid))


class MHABlock(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(cfg.embed, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.heads, in_features=cfg.embed, qkv_features=cfg.heads * cfg.head_dim,
            decode=False, attention_fn=ns.models.attention_fn, rngs=rngs)
        self.up = nnx.Linear(cfg.embed, cfg.mlp, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp, cfg.embed, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(x)))


class MHALM(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.embed, rngs=rngs)
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.length, cfg.embed)))
        self.layers = nnx.List([MHABlock(cfg, rngs) for _ in range(cfg.layers)])
        self.head = nnx.Linear(cfg.embed, cfg.vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        x = ns.pipeline.run(self.layers, x, padding_mask(tokens))
        return self.head(x)


#: ``ns.annotate`` patterns for MHALM, in the model's own names (the stacked form's too:
#: ``(\d+/)?`` takes the list index, or none once stacked, when the layer axis is named).
MHA_PATTERNS = {
    r"^embed/embedding$": ("tp", "fsdp"),
    r"^pos$": (None, "fsdp"),
    r"^layers/(\d+/)?norm/(scale|bias)$": ("fsdp",),
    r"^layers/(\d+/)?attn/(query|key|value)/kernel$": ("fsdp", "tp", None),
    r"^layers/(\d+/)?attn/(query|key|value)/bias$": ("tp", None),
    r"^layers/(\d+/)?attn/out/kernel$": ("tp", None, "fsdp"),
    r"^layers/(\d+/)?attn/out/bias$": ("fsdp",),
    r"^layers/(\d+/)?up/kernel$": ("fsdp", "tp"),
    r"^layers/(\d+/)?up/bias$": ("tp",),
    r"^layers/(\d+/)?down/kernel$": ("tp", "fsdp"),
    r"^layers/(\d+/)?down/bias$": ("fsdp",),
    r"^head/kernel$": ("fsdp", "tp"),
    r"^head/bias$": ("tp",),
}


def mha_lm(cfg: Config, rngs: nnx.Rngs) -> MHALM:
    """MHALM annotated from outside (its list form)."""
    return ns.annotate(MHALM(cfg, rngs=rngs), MHA_PATTERNS, strict=True)


# --------------------------------------------------------------------------- data, loss


def tokens(cfg: Config, batch: int, seed: int = 0, pad: bool = False) -> np.ndarray:
    """``[batch, length + 1]`` tokens; with ``pad`` a random amount of right padding."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(1, cfg.vocab, size=(batch, cfg.length + 1)).astype(np.int32)
    if pad:
        for row, n in enumerate(rng.integers(cfg.length // 2, cfg.length + 2, size=batch)):
            toks[row, n:] = PAD
    return toks


def batches(cfg: Config, steps: int, batch: int, pad: bool = False) -> list[dict[str, np.ndarray]]:
    out = []
    for k in range(steps):
        t = tokens(cfg, batch, seed=k, pad=pad)
        out.append({"x": t[:, :-1], "y": t[:, 1:]})
    return out


def loss_fn(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
