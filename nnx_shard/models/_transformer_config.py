"""The configuration of :class:`~nnx_shard.models.Transformer`:
:class:`TransformerConfig` (sizes and options), the named configurations
:data:`TRANSFORMER_CONFIGS`, the remat policies every model config names
(:data:`REMAT_POLICIES`, :func:`remat_policy`), and the field checks the model
configs share (:func:`check_fields`, :func:`check_kernel_and_remat`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard._attention import KERNELS
from nnx_shard._errors import UsageError, short

__all__ = ["REMAT_POLICIES", "TRANSFORMER_CONFIGS", "TransformerConfig", "check_fields",
           "check_kernel_and_remat", "remat_policy"]


REMAT_POLICIES: dict[str, str] = {
    "none": "keep every intermediate of each block for the backward pass (no remat)",
    "full": "save only each block's input; recompute the rest of the block in the backward "
            "pass (jax.checkpoint_policies.nothing_saveable)",
    "dots": "save matmul outputs without batch dimensions, recompute the rest "
            "(jax.checkpoint_policies.dots_with_no_batch_dims_saveable)",
    "offload": "as 'dots', but move the saved matmul outputs to pinned host memory "
               "(jax.checkpoint_policies.offload_dot_with_no_batch_dims)",
}


def check_fields(cfg: Any, counts: tuple[str, ...], *, whole0: tuple[str, ...] = (),
                 positive: tuple[str, ...] = (), finite: tuple[str, ...] = (),
                 flags: tuple[str, ...] = ()) -> None:
    """A config's fields checked by kind, each failure a ``UsageError`` naming the
    field: ``counts`` whole numbers >= 1, ``whole0`` whole numbers (their range is
    checked by the config), ``positive`` finite numbers > 0, ``finite`` finite
    numbers, ``flags`` bools; ``dtype`` and ``param_dtype`` NumPy/JAX dtypes. A bool
    is no count and ``"128"`` no size: both would fail deep inside a layer."""
    where = type(cfg).__name__

    def bad(f: str, want: str) -> UsageError:
        return UsageError(f"{where}.{f} must be {want}, got {short(getattr(cfg, f), 60)} "
                          f"({type(getattr(cfg, f)).__name__}). Fix: e.g. "
                          f"{where}({f}={getattr(type(cfg), f, 4)!r})")

    def is_int(v: Any) -> bool:
        return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)

    def is_real(v: Any) -> bool:
        return isinstance(v, int | float | np.integer | np.floating) and not isinstance(
            v, bool | np.bool_) and math.isfinite(v)

    for f in counts:
        if not is_int(getattr(cfg, f)) or getattr(cfg, f) < 1:
            raise bad(f, ">= 1 (a whole count)")
    for f in whole0:
        if not is_int(getattr(cfg, f)):
            raise bad(f, "a whole number")
    for f in positive:
        if not is_real(getattr(cfg, f)) or getattr(cfg, f) <= 0:
            raise bad(f, "a finite number > 0")
    for f in finite:
        if not is_real(getattr(cfg, f)):
            raise bad(f, "a finite number")
    for f in flags:
        if not isinstance(getattr(cfg, f), bool):
            raise bad(f, "True or False")
    _check_dtypes(cfg, where)


def check_kernel_and_remat(cfg: Any) -> None:
    """``cfg.attention`` names an attention kernel and ``cfg.remat`` a remat policy
    (shared by every model config)."""
    where = type(cfg).__name__
    if cfg.attention not in KERNELS:
        raise UsageError(
            f"{where}.attention={cfg.attention!r} is not an attention kernel; "
            "valid: " + ", ".join(repr(k) for k in KERNELS) + ". Fix: e.g. "
            f"{where}(attention='auto')."
        )
    if cfg.remat not in REMAT_POLICIES:
        raise UsageError(
            f"{where}.remat={cfg.remat!r} is not a remat policy; valid: "
            + ", ".join(repr(k) for k in REMAT_POLICIES) + f". Fix: e.g. {where}(remat='full')."
        )


def _check_dtypes(cfg: Any, where: str) -> None:
    for f in ("dtype", "param_dtype"):
        try:
            jnp.dtype(getattr(cfg, f))
        except TypeError:
            raise UsageError(f"{where}.{f} must be a dtype, got {short(getattr(cfg, f), 60)}. "
                             f"Fix: e.g. {f}=jnp.float32 or {f}='bfloat16'") from None


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes and options of :class:`Transformer` (frozen: derive variants with
    ``dataclasses.replace``).

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
        ``top_k`` assignments of a sequence (tokens over capacity are dropped).
      aux_loss_weight: weight of the load-balancing loss :func:`lm_loss` adds.
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
    >>> from nnx_shard.models import TransformerConfig
    >>> cfg = TransformerConfig(vocab=64, embed=16, heads=2, head_dim=8, mlp=32, layers=1)
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
    capacity_factor: float = 2.0
    aux_loss_weight: float = 0.01
    scan_layers: bool = False
    tie_embeddings: bool = False
    remat: str = "none"
    attention: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        check_fields(self, ("vocab", "length", "embed", "heads", "head_dim", "mlp", "layers"),
                     whole0=("experts", "top_k"), positive=("capacity_factor",),
                     finite=("aux_loss_weight",), flags=("scan_layers", "tie_embeddings"))
        if self.experts < 0 or (self.experts and not 1 <= self.top_k <= self.experts):
            raise UsageError(
                f"TransformerConfig: experts={self.experts}, top_k={self.top_k}; need experts "
                ">= 0 and, with experts, 1 <= top_k <= experts. Fix: e.g. experts=4, top_k=2, "
                "or experts=0 for a dense MLP."
            )
        check_kernel_and_remat(self)

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


TRANSFORMER_CONFIGS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(),
    "tiny_moe": TransformerConfig(experts=4, top_k=2),
    "small": TransformerConfig(
        vocab=512, length=128, embed=128, heads=4, head_dim=32, mlp=512, layers=4
    ),
    "125m": TransformerConfig(
        vocab=50304, length=2048, embed=768, heads=12, head_dim=64, mlp=3072, layers=12,
        tie_embeddings=True,
    ),
    "1b": TransformerConfig(
        vocab=32000, length=2048, embed=2048, heads=16, head_dim=128, mlp=8192, layers=16,
        scan_layers=True,
    ),
    "7b": TransformerConfig(
        vocab=32000, length=4096, embed=4096, heads=32, head_dim=128, mlp=16384, layers=32,
        scan_layers=True, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
    ),
}


def remat_policy(name: str) -> Any:
    """The ``jax.checkpoint`` policy of a :data:`REMAT_POLICIES` name: ``None``
    for ``"none"`` (no remat at all), else the callable ``nnx.remat`` gets.

    ``"offload"`` needs host memory on the default backend and raises a
    :class:`~nnx_shard.UsageError` naming the alternatives where there is none.

    Args:
      name: one of :data:`REMAT_POLICIES` (``none``, ``full``, ``dots``, ``offload``).

    >>> import jax
    >>> from nnx_shard.models import remat_policy
    >>> remat_policy("none") is None
    True
    >>> remat_policy("full") is jax.checkpoint_policies.nothing_saveable
    True
    >>> remat_policy("everything")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: unknown remat policy 'everything'; valid: 'none', 'full', 'dots', 'offload'. Fix: e.g. remat='full'.
    """
    if name not in REMAT_POLICIES:
        raise UsageError(f"unknown remat policy {name!r}; valid: "
                         + ", ".join(repr(k) for k in REMAT_POLICIES) + ". Fix: e.g. remat='full'.")
    cp = jax.checkpoint_policies
    if name == "none":
        return None
    if name == "full":
        return cp.nothing_saveable
    if name == "dots":
        return cp.dots_with_no_batch_dims_saveable
    device = jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" not in kinds:
        raise UsageError(
            f"remat='offload' moves saved activations to pinned host memory, but the "
            f"{device.platform} backend ({device.device_kind}) has no 'pinned_host' memory "
            f"(its memories: {', '.join(sorted(kinds))}). Fix: use remat='dots' (same "
            "activations kept on the device) or remat='full' (least memory)."
        )
    return cp.offload_dot_with_no_batch_dims("device", "pinned_host")

