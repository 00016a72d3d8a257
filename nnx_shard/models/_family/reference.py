"""The reference model (GPT-style, for tests, demos and planning) as a family of the
shared decoder: its own config, :class:`ReferenceConfig`, with only its fields and
named configurations ``tiny`` ... ``7b``; learned position embeddings in place of
rotary ones; multi-head attention (keys and values named ``heads`` like the queries);
an ungated GELU MLP, or a mixture of experts with GShard's capacity-factor dispatch
(``capacity_factor``; ``None``: the dropless dispatch); RMSNorms of epsilon 1e-6. It
has no Hugging Face checkpoints: ``model_type`` ``"reference"`` is not among
:func:`~nnx_shard.models._families.model_types`.

>>> from flax import nnx
>>> from nnx_shard.models import Decoder
>>> model = Decoder(CONFIGS["tiny"], rngs=nnx.Rngs(0))
>>> model.pos_embed.shape, model.blocks[0].attn.k.get_metadata("out_sharding")
((16, 32), ('embed', 'heads', 'kv'))
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
from flax import nnx

from nnx_shard._errors import UsageError
from nnx_shard.models._decoder import DecoderAttention, DecoderBlock, DecoderMoEBlock
from nnx_shard.models._families import Family, family_of, register
from nnx_shard.models._fields import check_fields, check_kernel_and_remat
from nnx_shard.models._layers import dense_init, new_param

__all__ = ["CONFIGS", "FAMILY", "ReferenceAttention", "ReferenceConfig"]


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
    """Sizes and options of the reference model (frozen: derive variants with
    ``dataclasses.replace``), built by the shared decoder
    (:class:`~nnx_shard.models.Decoder`) as the family ``"reference"``.

    Attributes:
      vocab: vocabulary size.
      length: maximum sequence length (learned position embeddings).
      embed: width of the residual stream.
      heads: attention heads; ``head_dim``: width of each.
      mlp: hidden width of the MLP (of each expert, for a mixture of experts).
      layers: number of blocks.
      experts: experts of a mixture-of-experts MLP; 0 is a dense MLP.
      top_k: experts each token is sent to.
      capacity_factor: expert capacity, as a multiple of an even share of the
        ``top_k`` assignments of a sequence (tokens over capacity are dropped: GShard's
        dispatch); ``None``: every routed token computed (the dropless grouped
        dispatch of the Hugging Face mixtures of experts).
      aux_loss_weight: weight of the load-balancing loss
        :func:`~nnx_shard.models.lm_loss` adds (transformers' load-balancing loss over
        every MoE layer's tokens).
      scan_layers: stack the blocks (``nnx.vmap``, leading ``layers`` axis)
        and run them with ``jax.lax.scan``: one compiled block for any depth.
      tie_embeddings: reuse the token embedding as the output projection.
      remat: what each block keeps for the backward pass, one of
        :data:`REMAT_POLICIES`: ``"none"`` (everything), ``"full"`` (only the
        block's input; recompute the rest), ``"dots"`` (matmul outputs without
        batch dimensions), ``"offload"`` (those, in pinned host memory; needs a
        backend with host memory spaces; on CPU, where device memory is host
        memory, it compiles to the ``"dots"`` program). Applied per block (per
        scanned block with ``scan_layers``) with ``nnx.remat``; the values are
        unchanged. On XLA CPU only scanned blocks show the memory saving:
        unrolled blocks recompute, but the scheduler keeps the peak.
      attention: the attention kernel on each device (see
        :mod:`nnx_shard._attention._kernels`): ``"auto"`` (default: cuDNN's fused kernel on
        GPUs where it applies, else blockwise), ``"blockwise"`` (online softmax over
        query x key/value blocks, recomputed in the backward pass: activations linear
        in the sequence), ``"dense"`` (the float32 ``[batch, heads, seq, seq]``
        probabilities kept for the backward pass) or ``"cudnn"``. Context parallelism
        (the strategy's ``attention`` option, ``cp`` presets) splits the sequence
        over devices and runs this kernel on each device's share.
      dtype: activation dtype; ``param_dtype``: parameter dtype.

    >>> import dataclasses
    >>> from nnx_shard.models import ReferenceConfig
    >>> cfg = ReferenceConfig(vocab=64, embed=16, heads=2, head_dim=8, mlp=32, layers=1)
    >>> dataclasses.replace(cfg, experts=4).experts
    4
    >>> dataclasses.replace(cfg, remat="full").remat
    'full'
    """

    vocab: int = 128
    length: int = 16
    embed: int = 32
    heads: int = 4
    head_dim: int = 8
    mlp: int = 64
    layers: int = 2
    experts: int = 0
    top_k: int = 2
    capacity_factor: float | None = 2.0
    aux_loss_weight: float = 0.01
    scan_layers: bool = False
    tie_embeddings: bool = False
    remat: str = "none"
    attention: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        check_fields(self, ("vocab", "length", "embed", "heads", "head_dim", "mlp", "layers"),
                     whole0=("experts", "top_k"),
                     positive=() if self.capacity_factor is None else ("capacity_factor",),
                     finite=("aux_loss_weight",), flags=("scan_layers", "tie_embeddings"))
        if self.experts < 0 or (self.experts and not 1 <= self.top_k <= self.experts):
            raise UsageError(
                f"ReferenceConfig: experts={self.experts}, top_k={self.top_k}; need experts "
                ">= 0 and, with experts, 1 <= top_k <= experts. Fix: e.g. experts=4, top_k=2, "
                "or experts=0 for a dense MLP."
            )
        check_kernel_and_remat(self)

    #: The family the shared decoder builds (not a field: one value).
    model_type: ClassVar[str] = "reference"
    #: The decoder's settings this family fixes (not fields: one value each).
    norm_eps: ClassVar[float] = 1e-6
    activation: ClassVar[str] = "gelu_pytorch_tanh"
    norm_topk_prob: ClassVar[bool] = True
    expert_matmul: ClassVar[str] = "auto"

    @property
    def family(self) -> Family:
        """The reference family's record (:data:`FAMILY`)."""
        return family_of(self.model_type)

    @property
    def max_length(self) -> int:
        """The positions of the learned table: ``length``."""
        return self.length

    @property
    def expert_mlp(self) -> int:
        """Each expert's hidden width: ``mlp``."""
        return self.mlp

    @property
    def kv_heads(self) -> int:
        """The key/value heads: ``heads`` (multi-head attention: each query head has its
        own, where :attr:`~nnx_shard.models.DecoderConfig.kv_heads` groups them)."""
        return self.heads

    def moe_layers(self) -> tuple[bool, ...]:
        """Every layer a MoE layer with experts, none without."""
        return (bool(self.experts),) * self.layers

    def local_layers(self) -> tuple[bool, ...]:
        """No sliding window: every layer attends to every earlier key."""
        return (False,) * self.layers

    @property
    def num_params(self) -> int:
        """Parameter count, computed from the sizes.

        >>> from nnx_shard.models import get_config
        >>> get_config("tiny").num_params
        25248
        """
        e, m = self.embed, self.mlp
        attn = 4 * e * self.heads * self.head_dim
        ffn = (self.experts * 2 * e * m + e * self.experts) if self.experts else 2 * e * m
        block = attn + ffn + 2 * e
        unembed = 0 if self.tie_embeddings else e * self.vocab
        return self.vocab * e + self.length * e + self.layers * block + e + unembed


#: The reference model's named configurations, ``tiny`` (and ``tiny_moe``) for tests to
#: ``7b`` for planning.
CONFIGS: dict[str, ReferenceConfig] = {
    "tiny": ReferenceConfig(),
    "tiny_moe": ReferenceConfig(experts=4, top_k=2),
    "small": ReferenceConfig(
        vocab=512, length=128, embed=128, heads=4, head_dim=32, mlp=512, layers=4
    ),
    "125m": ReferenceConfig(
        vocab=50304, length=2048, embed=768, heads=12, head_dim=64, mlp=3072, layers=12,
        tie_embeddings=True,
    ),
    "1b": ReferenceConfig(
        vocab=32000, length=2048, embed=2048, heads=16, head_dim=128, mlp=8192, layers=16,
        scan_layers=True,
    ),
    "7b": ReferenceConfig(
        vocab=32000, length=4096, embed=4096, heads=32, head_dim=128, mlp=16384, layers=32,
        scan_layers=True, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
    ),
}


class ReferenceAttention(DecoderAttention):
    """Multi-head causal self-attention without rotation: q, k, v ``[embed, heads,
    head_dim]`` (keys and values named ``heads``, as many as the queries), no biases,
    norms, window, soft-cap or query scale."""

    kv_axis = "heads"

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs) -> None:
        e, h, k, dt = cfg.embed, cfg.heads, cfg.head_dim, cfg.param_dtype
        qkv = ("embed", "heads", "kv")
        self.q = new_param(rngs, dense_init(e), (e, h, k), qkv, dt)
        self.k = new_param(rngs, dense_init(e), (e, h, k), qkv, dt)
        self.v = new_param(rngs, dense_init(e), (e, h, k), qkv, dt)
        self.o = new_param(rngs, dense_init(h * k), (h, k, e), ("heads", "kv", "embed"), dt)
        self.q_bias = self.k_bias = self.v_bias = self.o_bias = nnx.data(None)
        self.q_norm = self.k_norm = nnx.data(None)
        self.kernel, self.dtype = cfg.attention, cfg.dtype
        self.window = self.mixed_window = self.softcap = self.q_factor = None


class ReferenceBlock(DecoderBlock):
    """The pre-norm block with :class:`ReferenceAttention`."""

    attention = ReferenceAttention


class ReferenceMoEBlock(DecoderMoEBlock):
    """The pre-norm mixture-of-experts block with :class:`ReferenceAttention`."""

    attention = ReferenceAttention


#: The reference family: no checkpoints (no architecture, no name table).
FAMILY = register(Family(
    "reference", (), {}, named_configs=("tiny", "tiny_moe", "small", "125m", "1b", "7b"),
    block=ReferenceBlock, moe_block=ReferenceMoEBlock, config=ReferenceConfig,
    gated_mlp=False, learned_positions=True))
