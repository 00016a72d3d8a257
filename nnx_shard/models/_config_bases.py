"""The bases a family's own config class builds on where families share fields:
:class:`AttentionBiasConfig` (``attention_bias``), :class:`MLPBiasConfig` (``mlp_bias``),
:class:`WindowConfig` (``sliding_window``) and :class:`MoEConfig` (the experts), each a
frozen :class:`~nnx_shard.models._decoder_config.DecoderConfig` adding its fields, their
checks and their parameters.

>>> from nnx_shard.models._family.mistral import MistralConfig
>>> issubclass(MistralConfig, WindowConfig)
True
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from nnx_shard._errors import UsageError
from nnx_shard.models._decoder_config import DecoderConfig

__all__ = ["AttentionBiasConfig", "MLPBiasConfig", "MoEConfig", "WindowConfig"]


@dataclasses.dataclass(frozen=True)
class AttentionBiasConfig(DecoderConfig):
    """The families with ``attention_bias`` (Llama, Gemma 1-3, OLMo 2, Qwen3, Qwen3-MoE).

    Attributes:
      attention_bias: biases on the q, k, v and o projections (``attention_bias``).
    """

    attention_bias: bool = False

    @property
    def num_params(self) -> int:
        """:attr:`DecoderConfig.num_params` with the attention's biases."""
        h, g, d = self.heads, self.kv_heads, self.head_dim
        bias = h * d + 2 * g * d + self.embed if self.attention_bias else 0
        return super().num_params + self.layers * bias


@dataclasses.dataclass(frozen=True)
class MLPBiasConfig(DecoderConfig):
    """The families with ``mlp_bias`` (Llama).

    Attributes:
      mlp_bias: biases on the gate, up and down projections (``mlp_bias``).
    """

    mlp_bias: bool = False

    @property
    def num_params(self) -> int:
        """:attr:`DecoderConfig.num_params` with the MLP's biases."""
        bias = 2 * self.mlp + self.embed if self.mlp_bias else 0
        return super().num_params + self.layers * bias


@dataclasses.dataclass(frozen=True)
class WindowConfig(DecoderConfig):
    """The families with a sliding window (Mistral, Mixtral, Phi-3, Qwen2, Qwen3,
    Qwen3-MoE, Gemma 2 / 3).

    Attributes:
      sliding_window: ``None``, or the keys each query sees: itself and the
        ``sliding_window - 1`` before it (Mistral's ``sliding_window``, Qwen2's
        with ``use_sliding_window``), in every layer (Gemma 2 / 3: in the layers
        ``window_layers`` marks).
    """

    sliding_window: int | None = None

    def local_layers(self) -> tuple[bool, ...]:
        """Every layer, with a window; none without.

        >>> DecoderConfig.for_model("mistral", layers=2, sliding_window=4).local_layers()
        (True, True)
        """
        return ((self.sliding_window is not None),) * self.layers


@dataclasses.dataclass(frozen=True)
class MoEConfig(DecoderConfig):
    """The mixture-of-experts families (Mixtral, Qwen3-MoE): every layer's MLP (but the
    dense ones its family keeps) is the sparse :class:`~nnx_shard.models._moe.DecoderMoE`.

    Attributes:
      experts: the experts of each MoE layer (Mixtral's ``num_local_experts``,
        Qwen3-MoE's ``num_experts``), >= 1.
      top_k: experts each token is routed to (``num_experts_per_tok``).
      router_aux_loss_coef, output_router_logits: transformers' names: the
        load-balancing loss's weight, added to the training loss only with
        ``output_router_logits`` (:attr:`aux_loss_weight`).
      expert_matmul: how the experts' grouped matmuls run
        (:mod:`nnx_shard.models._grouped`): ``"tiles"`` (a loop over tiles of the
        tokens sorted by expert: the active experts' FLOPs on every backend),
        ``"ragged_dot"`` (``jax.lax.ragged_dot``: a grouped kernel on TPU, every
        expert for every token on XLA's CPU and GPU backends), or ``"auto"`` (the
        default: ``ragged_dot`` on TPU, ``tiles`` elsewhere). Not in ``config.json``.

    A family's class says whether the router renormalises the top-k weights
    (``norm_topk_prob``: Mixtral's always, a field of Qwen3-MoE's) and each expert's
    width (:attr:`expert_mlp`).
    """

    experts: int = 0
    top_k: int = 2
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    expert_matmul: str = "auto"
    #: GShard's capacity factor: ``None`` (the Hugging Face families route every token).
    capacity_factor: ClassVar[float | None] = None

    def _check_own(self) -> None:
        super()._check_own()
        if self.top_k > self.experts:
            raise UsageError(f"{type(self).__name__}.experts={self.experts} must be a whole "
                             f"number >= top_k={self.top_k}. Fix: e.g. experts=8, top_k=2.")
        object.__setattr__(self, "router_aux_loss_coef", float(self.router_aux_loss_coef))
        if self.scan_layers and len(set(self.moe_layers())) > 1:
            raise UsageError(f"{type(self).__name__}: scan_layers=True stacks alike blocks, "
                             "but some layers are MoE layers and some dense (moe_layers()). "
                             "Fix: scan_layers=False.")

    @property
    def expert_mlp(self) -> int:
        """Each expert's hidden width: ``mlp`` (Qwen3-MoE's have a width of their own)."""
        return self.mlp

    @property
    def aux_loss_weight(self) -> float:
        """The load-balancing loss's weight in :func:`nnx_shard.models.lm_loss`:
        ``router_aux_loss_coef`` with ``output_router_logits``, else 0 (as transformers)."""
        return self.router_aux_loss_coef if self.output_router_logits else 0.0

    def moe_layers(self) -> tuple[bool, ...]:
        """Every layer (a family's class may keep some dense)."""
        return (True,) * self.layers

    @property
    def num_params(self) -> int:
        """:attr:`DecoderConfig.num_params` with each MoE layer's router and experts in
        place of its dense MLP."""
        e = self.embed
        moe = e * self.experts + 3 * e * self.expert_mlp * self.experts - 3 * e * self.mlp
        return super().num_params + sum(self.moe_layers()) * moe

    @property
    def active_params(self) -> int:
        """:attr:`num_params` less the experts each token is not routed to
        (``experts - top_k`` per MoE layer).

        >>> from nnx_shard.models import get_config
        >>> round(get_config("mixtral-8x7b").active_params / 1e9, 1)
        12.9
        """
        idle = 3 * self.embed * self.expert_mlp * (self.experts - self.top_k)
        return self.num_params - sum(self.moe_layers()) * idle
