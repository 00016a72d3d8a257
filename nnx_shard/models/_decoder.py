"""The shared decoder of every model family (Llama 2/3, Qwen2/3, Mistral, Gemma, Gemma 2/3,
OLMo 2, Phi-3, the mixtures of experts Mixtral and Qwen3-MoE, and the reference model:
learned positions, multi-head attention, an ungated MLP or GShard's capacity-factor
experts), annotated only with logical names.

The architecture of Hugging Face's ``LlamaForCausalLM``: token embedding, ``layers``
blocks (RMSNorm, grouped-query attention with rotary position embeddings, RMSNorm,
gated MLP), a final RMSNorm and an output projection (optionally tied to the
embedding). What a family changes comes from its record
(:class:`~nnx_shard.models._families.Family`, one module each in
:mod:`nnx_shard.models._family`), never from a test of which family it is: its block
class (:class:`DecoderBlock` pre-norm, :class:`PostNormBlock` for OLMo 2,
:class:`SandwichBlock` for Gemma 2 / 3, :class:`DecoderMoEBlock` for the MoE layers), its
q/k norm and biases, its norm's offset, and hooks on the embeddings (Gemma's scale)
and the logits (Gemma 2's soft-cap). Attention options that are values (a sliding
window, in every layer or in some; a score soft-cap; a query scale) are fields of the
family's config class, which only the families that have them declare.
:meth:`DecoderConfig.from_hf` reads a transformers ``config.json``;
:func:`nnx_shard.hf.load_safetensors` fills the parameters from a Hugging Face
checkpoint.

Parameters carry the logical names ``vocab``, ``embed``, ``heads``, ``kv``, ``mlp``,
``layers``, plus ``kv_heads``, the key/value heads of grouped-query attention (``kv``
is the width of one head; the reference model names its keys and values ``heads``).
Activations are constrained at the points of :mod:`nnx_shard.models._layout`, so every
preset applies unchanged:
dp, zero1, fsdp, tp, fsdp_tp, sp, async_tp, cp, fsdp_cp, and pp / pp_fsdp /
pp_tp with ``scan_layers=True``. The ``ep`` preset shards the experts of the MoE
layers (:class:`DecoderMoEBlock`) over ``expert``; a dense model trains under it as
plain data parallelism over both mesh axes.

Tensor-parallel presets split ``kv_heads`` over the model axis where it
divides, and replicate the key/value projections where it does not (e.g. 8
key/value heads on a model axis of 16): the rule is ``[model, None]``.

>>> from flax import nnx
>>> cfg = DecoderConfig()
>>> model = Decoder(cfg, rngs=nnx.Rngs(0))
>>> model(jnp.zeros((2, 16), jnp.int32)).shape
(2, 16, 128)
>>> model.blocks[0].attn.k.get_metadata("out_sharding")
('embed', 'kv_heads', 'kv')
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_shard._errors import UsageError, short
from nnx_shard._mesh import option
from nnx_shard._parallel import pipeline
from nnx_shard._parallel.collective_matmul import check_tokens
from nnx_shard.models import _kv_cache as kv_cache
from nnx_shard.models._decoder_config import ROPE_TYPES as ROPE_TYPES
from nnx_shard.models._decoder_config import DecoderConfig
from nnx_shard.models._decoder_layers import (
    CappedAttention,
    DecoderAttention,
    DecoderMLP,
    norm_of,
)
from nnx_shard.models._families import family_of
from nnx_shard.models._fields import remat_policy
from nnx_shard.models._layers import RMSNorm, dense_init, new_param
from nnx_shard.models._layout import (
    GATHERED,
    POS_TABLE,
    RESIDUAL,
    TOKEN_TABLE,
    block_input_names,
    empty_tokens,
    last_positions,
    seq_names,
)
from nnx_shard.models._masks import NO_EXTRAS, Extras, check_token_ids, prepare
from nnx_shard.models._moe import DecoderMoE, RouterStats, add_stats, aux_loss, no_stats
from nnx_shard.models._ops import constrain, einsum, lookup, project, whole
from nnx_shard.models._rotary import (
    own_local_rotation,
    rotary_at,
    rotary_of,
    rotary_tables,
    scaled_at,
    times,
)

__all__ = ["Decoder", "DecoderAttention", "DecoderBlock", "DecoderConfig", "DecoderMLP", "DecoderMoEBlock",
           "PostNormBlock", "SandwichBlock"]


def _pick(local: Any, tables: Any, local_tables: Any) -> Any:
    """The rotary tables of a layer: ``local_tables`` (the sliding layers' base) where
    ``local``, else ``tables``."""
    if local_tables is None or local is None:
        return tables
    return tuple(jnp.where(local, lt, t) for t, lt in zip(tables, local_tables, strict=True))


class DecoderBlock(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``. Transformers'
    ``LlamaDecoderLayer``; :class:`Decoder` holds ``cfg.layers`` of the family's block
    class (``Family.block``) in ``blocks``. :class:`PostNormBlock` and
    :class:`SandwichBlock` place the norms differently; the forward pass is the same,
    each norm applied where the variant has it.

    >>> block = DecoderBlock(DecoderConfig(), rngs=nnx.Rngs(0))
    >>> type(block.attn).__name__, type(block.mlp).__name__, block.attn_norm.scale.shape
    ('DecoderAttention', 'DecoderMLP', (32,))
    """

    #: Norms before attention and MLP (on their inputs) and after (on their outputs).
    pre_norms, post_norms = True, False
    #: Norm weights of ``embed`` entries per block (``DecoderConfig.num_params``).
    norms = 2
    #: The attention layer's class (a family's own where its parameters differ).
    attention: Any = DecoderAttention

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs) -> None:
        def norm(on: bool) -> RMSNorm | None:
            return norm_of(cfg, cfg.embed, ("embed",), rngs) if on else None

        self.attn_norm: RMSNorm | None = nnx.data(norm(self.pre_norms))
        self.attn = self.attention(cfg, rngs=rngs)
        self.attn_post_norm: RMSNorm | None = nnx.data(norm(self.post_norms))
        self.mlp_norm: RMSNorm | None = nnx.data(norm(self.pre_norms))
        self.mlp: Any = self._mlp(cfg, rngs)
        self.mlp_post_norm: RMSNorm | None = nnx.data(norm(self.post_norms))

    def _mlp(self, cfg: DecoderConfig, rngs: nnx.Rngs) -> Any:
        return DecoderMLP(cfg, rngs=rngs)

    @staticmethod
    def _apply(norm: RMSNorm | None, x: jax.Array) -> jax.Array:
        return x if norm is None else norm(x)

    def _feed(self, h: jax.Array, extras: Extras) -> tuple[jax.Array, RouterStats | None]:
        """The MLP on the normed ``h`` and its router statistics (``None``: dense)."""
        return self.mlp(h), None

    def _feed_decode(self, h: jax.Array) -> jax.Array:
        """The MLP on the normed ``h`` while decoding (no adapter dropout)."""
        return self.mlp(h, deterministic=True)

    def __call__(self, x: jax.Array, cos: Any, sin: Any, extras: Extras = NO_EXTRAS,
                 local: Any = None) -> Any:
        """``x`` after the block, with the MLP's router statistics for a MoE block:
        ``(x, stats)``."""
        n = self._apply
        y = self.attn(constrain(n(self.attn_norm, x), block_input_names()), cos, sin, extras, local)
        x = constrain(x + n(self.attn_post_norm, y), RESIDUAL)
        y, stats = self._feed(constrain(n(self.mlp_norm, x), block_input_names()), extras)
        x = constrain(x + n(self.mlp_post_norm, y), RESIDUAL)
        return x if stats is None else (x, stats)

    def decode(self, x: jax.Array, index: jax.Array, cos: Any,
               sin: Any, valid: jax.Array | None = None, local: Any = None) -> jax.Array:
        """The block on new positions ``index ..`` only, attending through the cache."""
        n = self._apply
        y = self.attn.decode(constrain(n(self.attn_norm, x), GATHERED), index, cos, sin, valid,
                             local)
        x = constrain(x + n(self.attn_post_norm, y), RESIDUAL)
        y = self._feed_decode(constrain(n(self.mlp_norm, x), GATHERED))
        return constrain(x + n(self.mlp_post_norm, y), RESIDUAL)


class PostNormBlock(DecoderBlock):
    """OLMo 2's block: ``x + norm(attn(x))``, then ``x + norm(mlp(x))`` (norms on the
    outputs only; ``attn_post_norm``, ``mlp_post_norm``).

    >>> block = PostNormBlock(DecoderConfig.for_model("olmo2"), rngs=nnx.Rngs(0))
    >>> block.attn_norm is None, block.attn_post_norm.scale.shape
    (True, (32,))
    """

    pre_norms, post_norms = False, True


class SandwichBlock(DecoderBlock):
    """Gemma 2 / 3's block: four norms, on the inputs and on the outputs of attention
    and MLP: ``x + post(attn(pre(x)))``, then ``x + post(mlp(pre(x)))``; their attention
    soft-caps and scales its scores (:class:`CappedAttention`).

    >>> block = SandwichBlock(DecoderConfig.for_model("gemma2"), rngs=nnx.Rngs(0))
    >>> block.attn_norm.scale.shape, block.mlp_post_norm.scale.shape
    ((32,), (32,))
    """

    pre_norms, post_norms = True, True
    norms = 4
    attention = CappedAttention


class DecoderMoEBlock(DecoderBlock):
    """:class:`DecoderBlock` with the sparse MoE MLP (:class:`~nnx_shard.models._moe.DecoderMoE`,
    ``mlp/router``, ``mlp/gate`` ...): the layers of ``cfg.moe_layers()``. Returns ``(x,
    router statistics)``, which :class:`Decoder` sums into the load-balancing loss."""

    def _mlp(self, cfg: DecoderConfig, rngs: nnx.Rngs) -> Any:
        return DecoderMoE(cfg, rngs=rngs)

    def _feed(self, h: jax.Array, extras: Extras) -> tuple[jax.Array, RouterStats | None]:
        # The router's statistics count the real tokens only.
        valid = None if extras.mask is None else extras.mask[:, 0, 0, :]
        y, stats = self.mlp(h, valid=valid)
        return y, stats

    def _feed_decode(self, h: jax.Array) -> jax.Array:
        return self.mlp(h)[0]


def _block(cfg: DecoderConfig, i: int, rngs: nnx.Rngs) -> DecoderBlock:
    family = cfg.family
    block: type[DecoderBlock] = family.moe_block if cfg.moe_layers()[i] else family.block
    return block(cfg, rngs=rngs)


def _mixed(cfg: DecoderConfig) -> bool:
    """Whether the layers differ (sliding and global ones, and their rotary bases)."""
    flags = cfg.local_layers()
    return any(flags) and not all(flags)


def _block_runner(cfg: DecoderConfig, length: int) -> Any:
    every_local = all(cfg.local_layers())
    # A family with learned positions adds them to the embeddings: no rotation.
    tables = (None, None) if cfg.family.learned_positions else rotary_tables(
        cfg, length, every_local)
    # Mixed layers whose sliding ones rotate by their own base pick tables by their flag.
    local = _mixed(cfg) and own_local_rotation(cfg)
    local_tables = rotary_tables(cfg, length, True) if local else None

    def call(block: DecoderBlock, x: jax.Array, extras: Extras, local: Any) -> jax.Array:
        if extras.positions is None:
            c, s = _pick(local, tables, local_tables)
            return block(x, c, s, extras, local)
        # Per-token positions: each layer rebuilds its tables from them (a few
        # elementwise ops) rather than taking traced tables by closure.
        c, s = _pick(local, rotary_of(cfg, extras.positions, every_local),
                     None if local_tables is None else rotary_of(cfg, extras.positions, True))
        return block(x, c, s, extras, local)

    if cfg.remat == "none":
        return call
    # As in the reference transformer: scan's loop boundary already prevents CSE.
    return nnx.remat(call, policy=remat_policy(cfg.remat), prevent_cse=not cfg.scan_layers)


class Decoder(nnx.Module):
    """Llama-family decoder LM: ``int32 [batch, length] -> float32 logits [batch,
    length, vocab]``, for the families of ``config.json``'s ``model_type`` (``llama``:
    Llama 2/3; ``qwen2``, ``qwen3``, ``mistral``, ``gemma``, ``gemma2``, ``gemma3_text``,
    ``olmo2``, ``phi3``, ``mixtral``, ``qwen3_moe``), each built of its family's parts
    (``cfg.family``); sliding windows (in every layer, or Gemma 2 / 3's in some) are
    part of the model.

    Parameter paths (``blocks/<i>/...``, or ``blocks/...`` stacked on a leading
    ``layers`` axis with ``scan_layers``): ``token_embed [vocab, embed]``,
    ``attn_norm/scale``, ``attn/q [embed, heads, head_dim]``, ``attn/k`` and
    ``attn/v [embed, kv_heads, head_dim]``, ``attn/o [heads, head_dim, embed]``
    (``attn/q_norm/scale``, ``attn/k_norm/scale`` for Qwen3, OLMo 2 and Gemma 3;
    ``attn/*_bias`` with ``attention_bias`` or Qwen2's q/k/v biases; ``attn_post_norm``,
    ``mlp_post_norm`` for OLMo 2 and Gemma 2 / 3), ``mlp_norm/scale``, ``mlp/gate``,
    ``mlp/up [embed, mlp]``, ``mlp/down [mlp, embed]``, ``final_norm/scale``,
    ``unembed [embed, vocab]`` (absent when tied). The family's table
    (:func:`nnx_shard.hf.mapping_for`, e.g. :data:`nnx_shard.hf.LLAMA_MAPPING`) maps
    them to Hugging Face names.

    :func:`nnx_shard.models.lm_loss` trains it (next-token cross-entropy).

    Args:
      cfg: the configuration (:class:`DecoderConfig`, e.g. ``get_config("llama3-8b")`` or
        ``DecoderConfig.from_hf(folder)``).
      rngs: the random streams the parameters are drawn from.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, get_config
    >>> cfg = get_config("qwen3-tiny")
    >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape, model.unembed is None
    ((2, 16, 128), True)
    >>> model.blocks[0].attn.q_norm.scale.get_metadata("out_sharding")
    ('kv',)
    """

    #: The kernels projected through ``project`` (where ``ns.lora`` adapters apply).
    lora_kernels = ("unembed", "token_embed")

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs) -> None:
        if not _is_config(cfg):
            raise UsageError(f"{type(self).__name__}: cfg must be a model config (a DecoderConfig "
                             f"or a ReferenceConfig), got {type(cfg).__name__} "
                             f"{short(cfg, 60)}. Fix: e.g. Decoder(ns.models.get_config('llama3-8b'), "
                             "rngs=nnx.Rngs(0)), or DecoderConfig.from_hf(path)")
        self.cfg = cfg
        remat_policy(cfg.remat)  # an unsupported policy fails here, not at the first step
        e, dt = cfg.embed, cfg.param_dtype
        self.token_embed = new_param(rngs, nnx.initializers.normal(1.0), (cfg.vocab, e),
                                  TOKEN_TABLE, dt)
        if cfg.family.learned_positions:
            self.pos_embed = new_param(rngs, nnx.initializers.normal(0.02),
                                       (cfg.max_length, e), POS_TABLE, dt)
        if cfg.scan_layers:

            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(r: nnx.Rngs) -> DecoderBlock:
                return _block(cfg, 0, r)

            self.blocks: Any = make(rngs)
        else:
            self.blocks = nnx.List([_block(cfg, i, rngs) for i in range(cfg.layers)])
        self.final_norm = norm_of(cfg, e, ("embed",), rngs)
        self.unembed: nnx.Param | None = nnx.data(
            None if cfg.tie_embeddings
            else new_param(rngs, dense_init(e), (e, cfg.vocab), ("embed", "vocab"), dt)
        )

    def forward(self, tokens: jax.Array, *, attention_mask: jax.Array | None = None,
                positions: jax.Array | None = None, segment_ids: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
        """``(logits, aux)``: the logits and the load-balancing loss of the MoE layers
        (0 for a dense model), the interface :func:`nnx_shard.models.lm_loss` reads.

        ``attention_mask``, ``positions`` and ``segment_ids`` (each ``[batch,
        length]``, optional) have transformers' meanings (see
        :mod:`nnx_shard.models._masks`): padding is never attended to and, on the
        left, shifts the positions (``cumsum(mask) - 1``); packed segments attend
        within themselves, their positions restarting at 0.

        Concrete token ids (a call outside ``jit``) outside ``0 .. vocab - 1`` are a
        :class:`~nnx_shard._errors.UsageError` naming them; traced ids cannot be read
        (``Trainer.fit`` checks its batches on the host before its compiled step).

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from nnx_shard.models import Decoder, get_config
        >>> model = Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))
        >>> logits, aux = model.forward(jnp.zeros((1, 8), jnp.int32))
        >>> logits.dtype, float(aux)
        (dtype('float32'), 0.0)
        """
        cfg = self.cfg
        empty_tokens(tokens, "Decoder.forward")
        learned = cfg.family.learned_positions
        if learned and tokens.shape[1] > cfg.max_length:
            raise UsageError(
                f"tokens have length {tokens.shape[1]} but the model has {cfg.max_length} "
                f"positions ({type(cfg).__name__}.length). Fix: cut the tokens to the last "
                f"{cfg.max_length}, or a config with length >= {tokens.shape[1]}.")
        if option("collective_matmul", False):
            check_tokens(tokens.shape)
        check_token_ids(tokens, cfg.vocab, "Decoder.forward")
        extras = prepare(tokens, attention_mask=attention_mask, positions=positions,
                         segment_ids=segment_ids, caller="Decoder.forward",
                         max_positions=cfg.max_length).laid_out()
        x = self._embed(tokens, extras.positions)
        if learned:  # the positions are in the embeddings; the blocks read the masks
            extras = extras._replace(positions=None)
        run = _block_runner(cfg, tokens.shape[1])
        # Mixed layers (Gemma 2 / 3): each layer's flag travels with its parameters.
        flags = np.asarray(cfg.local_layers()) if _mixed(cfg) else None
        stats = no_stats(cfg)  # the MoE layers' router statistics, summed
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.blocks)

            def body(carry: Any, layer: Any) -> tuple[Any, None]:
                h, ex, st = carry
                params, local = layer
                h, st = add_stats(run(nnx.merge(graphdef, params), h, ex, local), st)
                return (h, ex, st), None

            # The plain scan, or a pipeline under a pp strategy (nnx_shard.pipeline). The
            # masks and positions ride in the carry: a pipeline cuts them into
            # microbatches with x.
            (x, _, stats), _ = pipeline.scan(body, (x, extras, stats), (state, flags))
        else:
            for i, block in enumerate(self.blocks):
                x, stats = add_stats(run(block, x, extras, None if flags is None
                                         else jnp.asarray(flags[i])), stats)
        return self._logits(x), aux_loss(cfg, stats)

    def _embed(self, tokens: jax.Array, positions: jax.Array | None = None,
               index: jax.Array | None = None) -> jax.Array:
        """The token embeddings, plus the learned positions' (``positions [batch,
        length]``, else ``index ..`` onwards) for a family that has them."""
        cfg = self.cfg
        x = lookup(self.token_embed[...].astype(cfg.dtype), tokens, RESIDUAL, TOKEN_TABLE)
        adapter = getattr(self, "lora_token_embed", None)
        if adapter is not None:  # PEFT's embedding LoRA: A's rows @ B, scaled; no dropout
            h = lookup(adapter.lora_a[...].astype(cfg.dtype), tokens, (*RESIDUAL[:-1], None))
            h = h * jnp.asarray(adapter.scale, cfg.dtype)
            x = x + einsum("blz,ze->ble", h, adapter.lora_b[...].astype(cfg.dtype), RESIDUAL)
        x = cfg.family.embed(x, cfg)
        if not cfg.family.learned_positions:
            return x
        table = self.pos_embed[...]
        if positions is not None:
            return constrain(x + lookup(table.astype(cfg.dtype), positions, RESIDUAL,
                                        POS_TABLE), RESIDUAL)
        rows = (whole(table)[:tokens.shape[1]] if index is None else
                jax.lax.dynamic_slice_in_dim(whole(table), index, tokens.shape[1]))
        return constrain(x + rows.astype(cfg.dtype), RESIDUAL)

    def _logits(self, x: jax.Array, deterministic: bool | None = None) -> jax.Array:
        cfg = self.cfg
        x = constrain(self.final_norm(x), seq_names(GATHERED))
        names = seq_names(("batch", None, "vocab"))
        if self.unembed is None:
            logits = einsum("ble,ve->blv", x, self.token_embed[...].astype(cfg.dtype), names)
        else:
            logits = project("ble,ev->blv", x, self, "unembed", cfg.dtype, names,
                             deterministic=deterministic)
        # The product comes out in the compute dtype and the family's hook casts it up for
        # the softmax and the loss (as MaxText does by default): asking the matmul for
        # float32 output (preferred_element_type) made XLA's partitioner all-gather the
        # unembedding's float32 gradient under fsdp (more gathered bytes than casting
        # after; docs/guides/fine-tuning.md).
        return cfg.family.logits(logits, cfg)

    def __call__(self, tokens: jax.Array, *, attention_mask: jax.Array | None = None,
                 positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """The logits of :meth:`forward` (same arguments).

        >>> model = Decoder(DecoderConfig(), rngs=nnx.Rngs(0))
        >>> a, b = jnp.arange(1, 5, dtype=jnp.int32)[None], jnp.arange(9, 13, dtype=jnp.int32)[None]
        >>> packed = model(jnp.concatenate([a, b], 1), segment_ids=jnp.array([[1] * 4 + [2] * 4]))
        >>> bool(jnp.allclose(packed[:, 4:], model(b), atol=1e-4))   # b as if alone
        True
        """
        return self.forward(tokens, attention_mask=attention_mask, positions=positions,
                            segment_ids=segment_ids)[0]

    @property
    def max_length(self) -> int:
        """The context: the most positions a sequence can have (``cfg.max_length``,
        transformers' ``max_position_embeddings``; ``factor`` times it under ``dynamic``
        scaling, which stretches the rotation past it)."""
        if self.cfg.family.learned_positions:  # the rows of the position table
            return self.cfg.max_length
        scaling = dict(self.cfg.rope_scaling or ())
        if scaling.get("rope_type") == "dynamic":
            return int(self.cfg.max_length * scaling["factor"])
        return self.cfg.max_length

    def init_cache(self, batch: int, length: int) -> None:
        """Creates an empty key/value cache for ``batch`` sequences of up to
        ``length`` positions (what :func:`nnx_shard.inference.generate` calls inside
        its compiled prefill): ``cached_key`` and ``cached_value [batch, kv_heads,
        length, head_dim]`` on every attention layer, named ``cache_batch``,
        ``cache_kv_heads``, ``cache_length``, ``cache_head_dim`` (``layers`` first
        for stacked blocks), and the position of the next token, ``cache_index``.

        >>> from flax import nnx
        >>> from nnx_shard.models import Decoder, get_config
        >>> model = Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))
        >>> model.init_cache(batch=2, length=16)
        >>> model.blocks[0].attn.cached_value.shape    # 2 key/value heads of 8
        (2, 2, 16, 8)
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
        logits_to_keep, vocab]``: the final norm, unembedding and soft-capping run on
        those alone (generation's prefill keeps 1, instead of ``[prompt, vocab]``
        float32).

        ``attention_mask [batch, T]`` (0: padding), for a prompt run into an empty
        cache (the prefill of :func:`nnx_shard.inference.generate`): its padded
        positions are never attended to and the positions of the real tokens
        count from the first one (``cumsum(mask) - 1``), as ``__call__`` with the
        mask computes. The cache keeps the mask (``cache_rows``): later calls,
        given a mask too (ones for new tokens), skip the padded keys and continue
        each row's positions.

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from nnx_shard.models import Decoder, get_config
        >>> model = Decoder(get_config("qwen3-tiny"), rngs=nnx.Rngs(0))
        >>> tokens = jnp.arange(6, dtype=jnp.int32)[None]
        >>> model.init_cache(batch=1, length=8)
        >>> first, last = model.decode(tokens[:, :5]), model.decode(tokens[:, 5:])
        >>> bool(jnp.allclose(last[:, 0], model(tokens)[:, 5], atol=1e-4))
        True
        """
        cfg = self.cfg
        check_token_ids(tokens, cfg.vocab, "Decoder.decode")
        index = self.cache_index[...]
        steps = tokens.shape[1]
        positions = valid = None
        if attention_mask is not None:
            positions, valid = kv_cache.masked_positions(self, tokens, attention_mask, index,
                                                         "Decoder.decode")
        mixed = _mixed(cfg)
        cos, sin, local_tables = _decode_tables(cfg, index, steps, positions)
        x = self._embed(tokens, positions, index)
        flags = np.asarray(cfg.local_layers()) if mixed else None

        def step(block: DecoderBlock, h: jax.Array, local: Any = None) -> jax.Array:
            c, s = _pick(local, (cos, sin), local_tables)
            return block.decode(h, index, c, s, valid, local)

        x = kv_cache.decode_layers(self.blocks, cfg.scan_layers, x, step, flags)
        self.cache_index[...] = index + steps
        return self._logits(last_positions(x, logits_to_keep, "Decoder.decode"), deterministic=True)


def _decode_tables(cfg: Any, index: jax.Array, steps: int, positions: jax.Array | None
                   ) -> tuple[Any, Any, Any]:
    """``(cos, sin, local_tables)`` of ``steps`` new positions from ``index`` (or the
    masked ``positions``); ``None`` for a family with learned positions."""
    if cfg.family.learned_positions:
        return None, None, None
    every_local = all(cfg.local_layers())
    own_local = _mixed(cfg) and own_local_rotation(cfg)
    if positions is None:
        cos, sin = rotary_at(cfg, index, steps, every_local)
        return cos, sin, rotary_at(cfg, index, steps, True) if own_local else None
    where = positions

    # Decoding runs on the gathered sequence (generation's rules): plain tables.
    def tables(local: bool) -> tuple[jax.Array, jax.Array]:
        inv, factor = scaled_at(cfg, local, jnp.max(where) + 1)
        freqs = where.astype(jnp.float32)[..., None] * inv
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return times(jnp.cos(emb), factor), times(jnp.sin(emb), factor)

    cos, sin = tables(every_local)
    return cos, sin, tables(True) if own_local else None


def _is_config(cfg: Any) -> bool:
    """Whether ``cfg`` is a model config: a :class:`DecoderConfig`, or of the config class
    its family registers."""
    if isinstance(cfg, DecoderConfig):
        return True
    try:
        family = family_of(getattr(cfg, "model_type", None))
    except UsageError:
        return False
    return family.config is not None and isinstance(cfg, family.config)
