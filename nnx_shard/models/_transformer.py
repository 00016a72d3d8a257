"""A decoder-only transformer LM annotated only with logical axis names.

Parameters carry logical names (``vocab``, ``embed``, ``heads``, ``kv``,
``mlp``, ``expert``, and ``layers`` when the blocks are stacked); activations
are constrained at the points where parallelism strategies differ:

* the residual stream is ``("batch", "length", None)``: sequence parallelism
  maps ``length`` to the model axis there;
* the input of attention and of the MLP is ``("batch", None, None)``: under
  sequence parallelism this is where the sequence is all-gathered;
* queries, keys and values are ``("batch", None, "heads", "kv")`` and the MLP
  hidden layer ``("batch", None, "mlp")``: Megatron's column-parallel half;
* the attention and MLP outputs return to the residual layout: the
  row-parallel half (an all-reduce, or a reduce-scatter under sequence
  parallelism);
* under rules with the option ``collective_matmul`` (``async_tp``) the
  projections gather and scatter the sequence themselves, in ring steps
  (:mod:`nnx_shard.collective_matmul`), so the input of attention and of the
  MLP stays in the residual layout;
* the mixture-of-experts layer dispatches tokens to ``("expert", "batch",
  None, None)``: expert parallelism turns that into collectives over the
  expert axis;
* under context parallelism (the rules' ``attention`` option, set by the
  ``cp`` presets) the sequence stays split on ``length`` at the dense ones of these
  points, and the attention core, :func:`nnx_shard.models.attention`, runs
  as ring (or all-gather-KV) attention over the ``length`` axes.

The embedding dimension of activations is never named: strategies that shard
parameters over ``embed`` (FSDP) use the same mesh axis for ``batch``.

Works on one device with no mesh, and under :func:`nnx_shard.use` with meshes
whose axes are Auto or Explicit (JAX's default); see ``nnx_shard.models._ops``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_shard._attention import attention
from nnx_shard._errors import UsageError, short
from nnx_shard._mesh import option
from nnx_shard._parallel import pipeline
from nnx_shard._parallel.collective_matmul import check_tokens
from nnx_shard._weighting import mean_over
from nnx_shard.models import _kv_cache as kv_cache
from nnx_shard.models._layers import RMSNorm, dense_init, new_param
from nnx_shard.models._masks import NO_EXTRAS, Extras, check_token_ids, prepare
from nnx_shard.models._ops import constrain, cross_entropy, einsum, lookup, project, whole
from nnx_shard.models._transformer_config import (
    TransformerConfig,
    remat_policy,
)

__all__ = ["IGNORE_INDEX", "Transformer", "lm_loss"]

RESIDUAL = ("batch", "length", None)
GATHERED = ("batch", None, None)
# The embedding tables' logical names: their parameters' and what lookup reads them as.
TOKEN_TABLE = ("vocab", "embed")
POS_TABLE = (None, "embed")


def seq_names(names: tuple[Any, ...]) -> tuple[Any, ...]:
    """``names`` with the sequence kept split under context parallelism (the
    ``attention`` option of the ``cp`` presets): there the sequence stays on its
    ``length`` axes through the whole block, and only the attention op gathers
    keys and values, in its own way. Elsewhere ``names`` as given (sequence
    parallelism gathers the sequence at these points)."""
    if option("attention", "local") in ("ring", "allgather"):
        return (names[0], "length", *names[2:])
    return names


def _norm(cfg: TransformerConfig, rngs: nnx.Rngs) -> RMSNorm:
    # The Transformer's norms: over ``embed``, eps 1e-6, weights starting at 1.
    return RMSNorm(cfg.embed, ("embed",), 1e-6, cfg.dtype, cfg.param_dtype, rngs=rngs)


class Attention(nnx.Module):
    """Causal multi-head self-attention; Q/K/V split column-wise and O row-wise over ``heads``."""

    #: The kernels projected through ``project`` (where ``ns.lora`` adapters apply).
    lora_kernels = ("q", "k", "v", "o")

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        e, h, k, dt = cfg.embed, cfg.heads, cfg.head_dim, cfg.param_dtype
        qkv = ("embed", "heads", "kv")
        self.q = new_param(rngs, dense_init(e), (e, h, k), qkv, dt)
        self.k = new_param(rngs, dense_init(e), (e, h, k), qkv, dt)
        self.v = new_param(rngs, dense_init(e), (e, h, k), qkv, dt)
        self.o = new_param(rngs, dense_init(h * k), (h, k, e), ("heads", "kv", "embed"), dt)
        self.dtype = cfg.dtype
        self.kernel = cfg.attention

    def __call__(self, x: jax.Array, extras: Extras = NO_EXTRAS) -> jax.Array:
        dt = self.dtype
        heads = seq_names(("batch", None, "heads", "kv"))
        q = project("ble,ehk->blhk", x, self, "q", dt, heads, seq="l")
        k = project("ble,ehk->blhk", x, self, "k", dt, heads, seq="l")
        v = project("ble,ehk->blhk", x, self, "v", dt, heads, seq="l")
        out = attention(q, k, v, causal=True, mask=extras.mask, segment_ids=extras.segment_ids,
                        implementation=self.kernel)
        return project("blhk,hke->ble", out, self, "o", dt, RESIDUAL, seq="l",
                       reduce=seq_names(GATHERED))

    def init_cache(self, batch: int, length: int, layers: int | None = None) -> None:
        """Creates the key/value cache ``[batch, length, heads, head_dim]`` (``layers``
        stacked in front for scanned blocks), named :data:`kv_cache.CACHE_AXES`."""
        kv_cache.init_attention(self, batch, length, layers)

    def decode(self, x: jax.Array, index: jax.Array, valid: jax.Array | None = None
               ) -> jax.Array:
        """Attention of ``x [batch, T, embed]`` at positions ``index ..`` against
        the cache, after storing its keys and values there (``valid``: which cache
        positions hold real keys, :func:`kv_cache.valid_keys`)."""
        dt = self.dtype
        heads = ("batch", None, "heads", "kv")
        off: dict[str, Any] = {"deterministic": True}  # no adapter dropout while decoding
        q = project("ble,ehk->blhk", x, self, "q", dt, heads, **off)
        k = project("ble,ehk->blhk", x, self, "k", dt, heads, **off)
        v = project("ble,ehk->blhk", x, self, "v", dt, heads, **off)
        out = kv_cache.store_and_attend(self, q, k, v, index, valid)
        return project("blhk,hke->ble", constrain(out, heads), self, "o", dt, RESIDUAL, **off)


class MLP(nnx.Module):
    """Two-layer GELU MLP; ``up`` split column-wise and ``down`` row-wise over ``mlp``."""

    #: The kernels projected through ``project`` (where ``ns.lora`` adapters apply).
    lora_kernels = ("up", "down")

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        e, m, dt = cfg.embed, cfg.mlp, cfg.param_dtype
        self.up = new_param(rngs, dense_init(e), (e, m), ("embed", "mlp"), dt)
        self.down = new_param(rngs, dense_init(m), (m, e), ("mlp", "embed"), dt)
        self.dtype = cfg.dtype

    def __call__(self, x: jax.Array, deterministic: bool | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        """``deterministic=True``: no adapter dropout (decoding)."""
        dt = self.dtype
        off: dict[str, Any] = {"deterministic": deterministic}
        h = jax.nn.gelu(project("ble,em->blm", x, self, "up", dt,
                                seq_names(("batch", None, "mlp")), seq="l", **off))
        return (project("blm,me->ble", h, self, "down", dt, RESIDUAL, seq="l",
                        reduce=seq_names(GATHERED), **off),
                jnp.zeros(()))


class MoE(nnx.Module):
    """Mixture-of-experts MLP: a top-k softmax router and per-expert MLPs.

    Tokens are dispatched GShard-style with a fixed capacity per sequence and
    expert (``capacity_factor``); tokens over capacity skip the layer (the
    residual carries them). Returns the output and the load-balancing loss
    ``experts * sum_e(fraction routed to e * mean router probability of e)``.
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        e, m, x, dt = cfg.embed, cfg.mlp, cfg.experts, cfg.param_dtype
        self.router = new_param(rngs, dense_init(e), (e, x), ("embed", None), dt)
        self.up = new_param(rngs, dense_init(e), (x, e, m), ("expert", "embed", "mlp"), dt)
        self.down = new_param(rngs, dense_init(m), (x, m, e), ("expert", "mlp", "embed"), dt)
        self.top_k = cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.dtype = cfg.dtype

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(dispatch, combine, aux)`` for ``x [batch, length, embed]``.

        ``dispatch [batch, length, experts, capacity]`` is 1 where a token takes
        a slot of an expert's buffer (each slot holds at most one token, each
        token at most ``top_k`` slots); ``combine`` holds the token's
        renormalised gate there instead. ``aux`` is the load-balancing loss.

        >>> cfg = TransformerConfig(experts=4, top_k=2, capacity_factor=0.5)
        >>> moe = MoE(cfg, rngs=nnx.Rngs(0))
        >>> dispatch, combine, aux = moe.route(jnp.ones((2, 16, cfg.embed)))
        >>> dispatch.shape, float(dispatch.sum(axis=1).max())   # capacity 4, never over
        ((2, 16, 4, 4), 1.0)
        """
        dt = self.dtype
        b, length, _ = x.shape
        n_exp = self.router.shape[-1]
        k = self.top_k
        logits = einsum("ble,ex->blx", x, self.router[...].astype(dt), GATHERED)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        gates, idx = jax.lax.top_k(probs, k)  # [b, l, k]
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        capacity = max(1, math.ceil(k * length * self.capacity_factor / n_exp))
        # Slot of each (token, choice) in its expert's buffer: first choices of
        # every token are served before second choices, in sequence order.
        chosen = jax.nn.one_hot(idx, n_exp, dtype=jnp.int32)  # [b, l, k, x]
        order = jnp.swapaxes(chosen, 1, 2).reshape(b, k * length, n_exp)
        slot = jnp.cumsum(order, axis=1) * order - 1
        slot = jnp.swapaxes(slot.reshape(b, k, length, n_exp), 1, 2)  # [b, l, k, x]
        keep = (slot >= 0) & (slot < capacity)
        onehot_slot = jax.nn.one_hot(jnp.where(keep, slot, -1), capacity, dtype=jnp.float32)
        dispatch = jnp.sum(onehot_slot, axis=2)  # [b, l, x, c]
        combine = jnp.sum(onehot_slot * gates[..., None, None], axis=2)
        dispatch = constrain(dispatch.astype(dt), ("batch", None, None, None))
        combine = constrain(combine.astype(dt), ("batch", None, None, None))
        routed = jnp.mean(jnp.sum(chosen, axis=2).astype(jnp.float32), axis=(0, 1)) / k
        aux = n_exp * jnp.sum(routed * jnp.mean(probs, axis=(0, 1)))
        return dispatch, combine, aux

    def __call__(self, x: jax.Array, deterministic: bool | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        """``deterministic``: :class:`MLP`'s argument; the experts take no adapters."""
        dt = self.dtype
        dispatch, combine, aux = self.route(x)
        expert_in = einsum("blxc,ble->xbce", dispatch, x, ("expert", "batch", None, None))
        h = jax.nn.gelu(einsum("xbce,xem->xbcm", expert_in, self.up[...].astype(dt),
                               ("expert", "batch", None, "mlp")))
        expert_out = einsum("xbcm,xme->xbce", h, self.down[...].astype(dt),
                            ("expert", "batch", None, None))
        out = einsum("xbce,blxc->ble", expert_out, combine, RESIDUAL)
        return out, aux


class Block(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = _norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = _norm(cfg, rngs)
        self.mlp = MoE(cfg, rngs=rngs) if cfg.experts else MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, extras: Extras = NO_EXTRAS) -> tuple[jax.Array, jax.Array]:
        x = x + self.attn(constrain(self.attn_norm(x), block_input_names()), extras)
        x = constrain(x, RESIDUAL)
        y, aux = self.mlp(constrain(self.mlp_norm(x), block_input_names()))
        return constrain(x + y, RESIDUAL), aux

    def decode(self, x: jax.Array, index: jax.Array, valid: jax.Array | None = None
               ) -> jax.Array:
        """The block on new positions ``index ..`` only, attending through the cache."""
        x = x + self.attn.decode(constrain(self.attn_norm(x), GATHERED), index, valid)
        x = constrain(x, RESIDUAL)
        y, _ = self.mlp(constrain(self.mlp_norm(x), GATHERED), deterministic=True)
        return constrain(x + y, RESIDUAL)


def block_input_names() -> tuple[str | None, ...]:
    # Collective matmuls gather the sequence inside the projections, block by
    # block: the input stays in the residual layout until then.
    return RESIDUAL if option("collective_matmul", False) else seq_names(GATHERED)


def _call_block(block: Block, x: jax.Array, extras: Extras) -> tuple[jax.Array, jax.Array]:
    return block(x, extras)


def _block_runner(cfg: TransformerConfig) -> Any:
    if cfg.remat == "none":
        return _call_block
    # Inside scan the loop boundary already keeps XLA from merging the forward
    # and backward recomputation, so CSE prevention would only cost speed (see
    # jax.checkpoint's docs); unrolled blocks need it.
    return nnx.remat(_call_block, policy=remat_policy(cfg.remat),
                     prevent_cse=not cfg.scan_layers)


class Transformer(nnx.Module):
    """Decoder-only transformer LM: ``int32 [batch, length] -> float32 logits
    [batch, length, vocab]``.

    Token and position embeddings, ``cfg.layers`` pre-norm blocks (multi-head
    attention, then a dense or mixture-of-experts MLP), a final norm and an
    output projection (tied to the token embedding if ``cfg.tie_embeddings``).
    Annotated only with logical names: pick a layout with a
    :mod:`nnx_shard.strategies` preset or any :class:`nnx_shard.Rules`.

    Args:
      cfg: the configuration (:class:`TransformerConfig`, e.g. ``get_config("small")``).
      rngs: the random streams the parameters are drawn from.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_shard.models import Transformer, TransformerConfig
    >>> cfg = TransformerConfig()
    >>> model = Transformer(cfg, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 128)
    >>> model.blocks[0].attn.q.get_metadata("out_sharding")
    ('embed', 'heads', 'kv')
    """

    #: The kernels projected through ``project`` (where ``ns.lora`` adapters apply).
    lora_kernels = ("unembed",)

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        if not isinstance(cfg, TransformerConfig):
            raise UsageError(f"Transformer: cfg must be a TransformerConfig, got "
                             f"{type(cfg).__name__} {short(cfg, 60)}. Fix: e.g. "
                             "Transformer(ns.models.get_config('tiny'), rngs=nnx.Rngs(0))")
        self.cfg = cfg
        remat_policy(cfg.remat)  # an unsupported policy fails here, not at the first step
        e, dt = cfg.embed, cfg.param_dtype
        self.token_embed = new_param(rngs, nnx.initializers.normal(1.0), (cfg.vocab, e),
                                  TOKEN_TABLE, dt)
        self.pos_embed = new_param(rngs, nnx.initializers.normal(0.02), (cfg.length, e),
                                POS_TABLE, dt)
        if cfg.scan_layers:

            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(r: nnx.Rngs) -> Block:
                return Block(cfg, rngs=r)

            self.blocks: Any = make(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.final_norm = _norm(cfg, rngs)
        self.unembed: nnx.Param | None = nnx.data(
            None if cfg.tie_embeddings
            else new_param(rngs, dense_init(e), (e, cfg.vocab), ("embed", "vocab"), dt)
        )

    def forward(self, tokens: jax.Array, *, attention_mask: jax.Array | None = None,
                positions: jax.Array | None = None, segment_ids: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
        """``(logits, aux)``: the logits and the summed mixture-of-experts
        load-balancing loss (0 for a dense MLP).

        ``attention_mask``, ``positions`` and ``segment_ids`` (each ``[batch,
        length]``, optional) have transformers' meanings (see
        :mod:`nnx_shard.models._masks`): padding is never attended to and, on the
        left, shifts the positions; packed segments attend within themselves, their
        positions restarting at 0.

        Concrete token ids (a call outside ``jit``) outside ``0 .. vocab - 1`` are a
        :class:`~nnx_shard._errors.UsageError` naming them; traced ids cannot be read
        (``Trainer.fit`` checks its batches on the host before its compiled step).

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from nnx_shard.models import Transformer, TransformerConfig
        >>> model = Transformer(TransformerConfig(experts=4, top_k=2), rngs=nnx.Rngs(0))
        >>> logits, aux = model.forward(jnp.zeros((2, 16), jnp.int32))
        >>> logits.shape, bool(aux > 0)
        ((2, 16, 128), True)
        """
        cfg = self.cfg
        empty_tokens(tokens, "Transformer.forward")
        length = tokens.shape[1]
        if length > cfg.length:
            raise UsageError(
                f"tokens have length {length} but the model has {cfg.length} positions "
                "(TransformerConfig.length). Fix: cut the tokens to the last "
                f"{cfg.length}, or a config with length >= {length}."
            )
        if option("collective_matmul", False):
            check_tokens(tokens.shape)
        check_token_ids(tokens, cfg.vocab, "Transformer.forward")
        extras = prepare(tokens, attention_mask=attention_mask, positions=positions,
                         segment_ids=segment_ids, caller="Transformer.forward",
                         max_positions=cfg.length).laid_out()
        x = lookup(self.token_embed[...].astype(cfg.dtype), tokens, RESIDUAL, TOKEN_TABLE)
        if extras.positions is None:
            x = constrain(x + whole(self.pos_embed[...])[:length].astype(cfg.dtype), RESIDUAL)
        else:
            x = constrain(x + lookup(self.pos_embed[...].astype(cfg.dtype), extras.positions,
                                     RESIDUAL, POS_TABLE), RESIDUAL)
        # The blocks read the masks; the positions are in the embedding already.
        extras = extras._replace(positions=None)
        aux = jnp.zeros((), jnp.float32)
        run = _block_runner(cfg)
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.blocks)

            def body(carry: Any, layer: Any) -> tuple[Any, None]:
                h, total, ex = carry
                h, a = run(nnx.merge(graphdef, layer), h, ex)
                return (h, total + a, ex), None

            # The plain scan, or a pipeline under a pp strategy (nnx_shard.pipeline). The
            # masks ride in the carry: a pipeline cuts them into microbatches with x.
            (x, aux, _), _ = pipeline.scan(body, (x, aux, extras), state)
        else:
            for block in self.blocks:
                x, a = run(block, x, extras)
                aux = aux + a
        return self._logits(x), aux

    def _logits(self, x: jax.Array, deterministic: bool | None = None) -> jax.Array:
        cfg = self.cfg
        x = constrain(self.final_norm(x), seq_names(GATHERED))
        if self.unembed is None:
            logits = einsum("ble,ve->blv", x, self.token_embed[...].astype(cfg.dtype),
                            seq_names(("batch", None, "vocab")))
        else:
            logits = project("ble,ev->blv", x, self, "unembed", cfg.dtype,
                             seq_names(("batch", None, "vocab")), deterministic=deterministic)
        return logits.astype(jnp.float32)

    def __call__(self, tokens: jax.Array, *, attention_mask: jax.Array | None = None,
                 positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """The logits of :meth:`forward` (same arguments).

        >>> model = Transformer(TransformerConfig(), rngs=nnx.Rngs(0))
        >>> seq = jnp.arange(1, 6, dtype=jnp.int32)[None]
        >>> padded = jnp.pad(seq, ((0, 0), (3, 0)))                  # 3 pads on the left
        >>> out = model(padded, attention_mask=padded != 0)
        >>> bool(jnp.allclose(out[:, 3:], model(seq), atol=1e-5))
        True
        """
        return self.forward(tokens, attention_mask=attention_mask, positions=positions,
                            segment_ids=segment_ids)[0]

    @property
    def max_length(self) -> int:
        """The context: the most positions a sequence can have (``cfg.length``)."""
        return self.cfg.length

    def init_cache(self, batch: int, length: int) -> None:
        """Creates an empty key/value cache for ``batch`` sequences of up to
        ``length`` positions (what :func:`nnx_shard.models.generate` calls inside
        its compiled prefill): ``cached_key`` and ``cached_value`` on every
        attention layer, named ``cache_batch``, ``cache_length``,
        ``cache_kv_heads``, ``cache_head_dim`` (``layers`` first for stacked
        blocks), and the position of the next token, ``cache_index``.

        >>> from flax import nnx
        >>> from nnx_shard.models import Transformer, TransformerConfig
        >>> model = Transformer(TransformerConfig(), rngs=nnx.Rngs(0))
        >>> model.init_cache(batch=2, length=16)
        >>> model.blocks[0].attn.cached_key.shape, int(model.cache_index[...])
        ((2, 16, 4, 8), 0)
        """
        self.cache_index, self.cache_rows = kv_cache.init_model(self.blocks, self.cfg,
                                                                batch, length)

    def decode(self, tokens: jax.Array, *, attention_mask: jax.Array | None = None,
               logits_to_keep: int = 0) -> jax.Array:
        """Logits ``[batch, T, vocab]`` of ``tokens [batch, T]`` placed after the
        ones already in the cache (from :meth:`init_cache`), whose keys and values
        it stores. The logits equal those of :meth:`__call__` on the whole
        sequence at these positions (up to float rounding).

        ``logits_to_keep`` (transformers' meaning): 0 for every position, else the
        logits of the last ``logits_to_keep`` positions only, ``[batch,
        logits_to_keep, vocab]``: the final norm and the unembedding run on those
        alone (generation's prefill keeps 1, instead of ``[prompt, vocab]`` float32).

        ``attention_mask [batch, T]`` (0: padding), for a prompt run into an empty
        cache (the prefill of :func:`nnx_shard.models.generate`): its padded
        positions are never attended to and the positions of the real tokens
        count from the first one (``cumsum(mask) - 1``), as ``__call__`` with the
        mask computes. The cache keeps the mask (``cache_rows``): later calls,
        given a mask too (ones for new tokens), skip the padded keys and continue
        each row's positions.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from nnx_shard.models import Transformer, TransformerConfig
        >>> model = Transformer(TransformerConfig(), rngs=nnx.Rngs(0))
        >>> tokens = jnp.arange(6, dtype=jnp.int32)[None]
        >>> model.init_cache(batch=1, length=8)
        >>> first, last = model.decode(tokens[:, :5]), model.decode(tokens[:, 5:])
        >>> full = model(tokens)
        >>> bool(jnp.allclose(last[:, 0], full[:, 5], atol=1e-4)), int(model.cache_index[...])
        (True, 6)
        """
        cfg = self.cfg
        check_token_ids(tokens, cfg.vocab, "Transformer.decode")
        index = self.cache_index[...]
        steps = tokens.shape[1]
        x = lookup(self.token_embed[...].astype(cfg.dtype), tokens, RESIDUAL, TOKEN_TABLE)
        valid = None
        if attention_mask is None:
            positions = jax.lax.dynamic_slice_in_dim(whole(self.pos_embed[...]), index, steps)
            x = constrain(x + positions.astype(cfg.dtype), RESIDUAL)
        else:
            positions, valid = kv_cache.masked_positions(self, tokens, attention_mask, index,
                                                         "Transformer.decode")
            x = constrain(x + lookup(self.pos_embed[...].astype(cfg.dtype), positions,
                                     RESIDUAL, POS_TABLE), RESIDUAL)
        x = kv_cache.decode_layers(self.blocks, cfg.scan_layers, x,
                                   lambda block, h: block.decode(h, index, valid))
        self.cache_index[...] = index + steps
        return self._logits(last_positions(x, logits_to_keep, "Transformer.decode"),
                            deterministic=True)


def last_positions(x: jax.Array, logits_to_keep: Any, caller: str) -> jax.Array:
    """The hidden states ``x [batch, T, embed]`` of the positions whose logits
    ``decode(..., logits_to_keep=)`` returns: all for 0, else the last ones."""
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int | np.integer) \
            or logits_to_keep < 0:
        raise UsageError(f"{caller}: logits_to_keep={short(logits_to_keep, 40)} must be an int "
                         ">= 0 (0: every position, n: the last n). Fix: e.g. logits_to_keep=1.")
    keep = int(logits_to_keep)
    return x if keep == 0 or keep >= x.shape[1] else x[:, x.shape[1] - keep:]


def empty_tokens(tokens: Any, caller: str) -> None:
    """Refuses tokens with no rows or no positions: attention has no key to attend to
    and the router no token to route, and their reductions have no empty form.

    >>> empty_tokens(jnp.zeros((2, 0), jnp.int32), "Llama.forward")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: Llama.forward: tokens of shape (2, 0) hold no token (a batch of 2 rows of 0 positions). Fix: at least one row of at least one token, e.g. tokens of shape (2, 1).
    """
    shape = tuple(getattr(tokens, "shape", ()))
    if len(shape) == 2 and 0 in shape:
        raise UsageError(f"{caller}: tokens of shape {shape} hold no token (a batch of "
                         f"{shape[0]} rows of {shape[1]} positions). Fix: at least one row of at "
                         f"least one token, e.g. tokens of shape ({max(shape[0], 1)}, "
                         f"{max(shape[1], 1)}).")


def _check_batch(batch: Any) -> None:
    fix = ("Fix: pass {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]} (what "
           "nnx_shard.corpus.CharCorpus.batches yields).")
    if not isinstance(batch, Mapping):
        raise UsageError(
            "lm_loss: the batch must be a dict with keys 'inputs' and 'targets' (int32 "
            f"[batch, length]); got {type(batch).__name__} of shape {np.shape(batch)}. {fix}"
        )
    if "inputs" not in batch or "targets" not in batch:
        raise KeyError(
            "lm_loss: the batch needs keys 'inputs' and 'targets' (int32 [batch, length]); "
            f"got a dict with keys {list(batch)}. {fix}"
        )


#: The target id :func:`lm_loss` skips (transformers' and PyTorch's ``ignore_index``).
IGNORE_INDEX = -100

#: The batch keys :func:`lm_loss` hands to the model besides ``inputs``.
MODEL_KEYS = ("attention_mask", "positions", "segment_ids")


def _check_targets(targets: Any, vocab: Any) -> None:
    """On the host, when the targets are concrete: ids in the vocabulary or
    :data:`IGNORE_INDEX`, and at least one kept."""
    if isinstance(targets, jax.core.Tracer) or not getattr(targets, "is_fully_addressable", True):
        return  # traced, or spread over processes: nothing to read here
    host = np.asarray(targets)
    kept = host != IGNORE_INDEX
    if not kept.any():
        raise UsageError(
            f"lm_loss: every target of the batch (shape {host.shape}) is {IGNORE_INDEX} "
            "(ignored), so the mean over kept tokens is 0/0. Fix: keep at least one target "
            "per batch (e.g. pack prompt-masked examples together with ns.pack), "
            "or drop the batch.")
    if isinstance(vocab, int) and host.size:
        bad = kept & ((host < 0) | (host >= vocab))
        if bad.any():
            raise UsageError(
                f"lm_loss: targets hold {int(host[bad][0])}, neither a token id of the "
                f"vocabulary (0 .. {vocab - 1}) nor {IGNORE_INDEX} (ignored). Fix: mark "
                f"targets to skip with {IGNORE_INDEX}, as transformers' labels do.")


def _kept_targets(batch: dict[str, jax.Array]) -> jax.Array:
    """The number of targets :func:`lm_loss` averages over (those not ``-100``)."""
    _check_batch(batch)
    return jnp.sum(jnp.asarray(batch["targets"]) != IGNORE_INDEX)


@mean_over(_kept_targets)
def lm_loss(model: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy of ``batch = {"inputs", "targets"}`` (int32
    ``[batch, length]``) over the targets not equal to ``-100``
    (:data:`IGNORE_INDEX`: prompt tokens, padding), plus ``aux_loss_weight``
    times the load-balancing loss for a mixture of experts. ``model`` is a
    :class:`Transformer` or any model with its ``forward(tokens) -> (logits,
    aux)`` and a ``cfg`` (e.g. :class:`nnx_shard.models.Llama`).

    As transformers' causal-LM loss (``labels=``): the sum of the cross-entropy
    over kept targets divided by their number. The batch keys
    ``attention_mask``, ``positions`` and ``segment_ids``, where present, go to
    ``model.forward`` as keyword arguments.

    With microbatches (``Trainer(..., microbatches=M)``, ``multistep(...,
    microbatches=M)``, ``value_and_grad(..., microbatches=M)``) the loss is
    declared a mean over its kept targets (:func:`nnx_shard.mean_over`): the
    step's kept targets are counted before the batch is split and each
    microbatch weighs as many as it keeps (its summed cross-entropy over the
    step's count, transformers' ``num_items_in_batch``), so the step's loss and
    update are those of M = 1 (up to float rounding), and a microbatch keeping
    none adds nothing. The load-balancing loss of a mixture of experts is
    weighted the same way (it is a mean over each microbatch's tokens, so it
    differs slightly from M = 1's).

    A batch with no kept target has no mean: with concrete targets (called
    outside ``jit``) that is a :class:`nnx_shard._errors.UsageError`; inside a
    compiled step, where values are unknown when it is traced, the loss is NaN
    (0/0; the gradients are zero, every term being masked), a step that
    :class:`nnx_shard.Trainer`'s guard reports and skips, with microbatches as
    with one.

    Args:
      model: a :class:`Transformer`, a :class:`Llama`, or a model with ``forward(tokens) -> (logits,
        aux)`` and a ``cfg``.
      batch: ``{"inputs", "targets"}`` int32 ``[batch, length]``, optionally ``attention_mask``,
        ``positions``, ``segment_ids``.

    >>> import optax
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_shard.models import Transformer, TransformerConfig, lm_loss
    >>> model = Transformer(TransformerConfig(), rngs=nnx.Rngs(0))
    >>> tokens = jnp.zeros((2, 16), jnp.int32)
    >>> float(lm_loss(model, {"inputs": tokens, "targets": tokens})) > 0
    True
    >>> half = tokens.at[:, :8].set(-100)                   # only the last 8 targets count
    >>> bool(jnp.isclose(lm_loss(model, {"inputs": tokens, "targets": half}),
    ...                  optax.softmax_cross_entropy_with_integer_labels(
    ...                      model(tokens)[:, 8:], tokens[:, 8:]).mean()))
    True
    >>> lm_loss(model, {"x": tokens})
    Traceback (most recent call last):
    ...
    KeyError: "lm_loss: the batch needs keys 'inputs' and 'targets' (int32 [batch, length]); got a dict with keys ['x']. ..."
    """
    _check_batch(batch)
    _check_targets(batch["targets"], getattr(getattr(model, "cfg", None), "vocab", None))
    extra = {k: batch[k] for k in MODEL_KEYS if k in batch}
    logits, aux = model.forward(batch["inputs"], **extra)
    # Targets arrive laid out like the inputs (under sequence parallelism: split
    # along ``length``); they must match the logits' layout, split along ``vocab``.
    targets = constrain(batch["targets"], seq_names(("batch", None)))
    kept = targets != IGNORE_INDEX
    ce = jnp.where(kept, cross_entropy(logits, targets), 0.0)
    # 0/0 = NaN when nothing is kept (see the docstring).
    ce = jnp.sum(ce) / jnp.sum(kept).astype(jnp.float32)
    if getattr(model.cfg, "experts", 0):  # other models (e.g. Llama) have no experts
        return ce + model.cfg.aux_loss_weight * aux
    return ce
