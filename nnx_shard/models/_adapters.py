"""Hooks that put :func:`nnx_shard.models.attention` into attention layers written elsewhere.

``nnx.MultiHeadAttention`` takes its softmax core as ``attention_fn``;
:func:`attention_fn` has the signature of flax's own
``flax.nnx.dot_product_attention`` and runs the op instead, so one argument
makes a stock layer memory-efficient (the blockwise or cuDNN kernel) and
context-parallel under the ``cp`` presets::

    nnx.MultiHeadAttention(num_heads, features, attention_fn=ns.models.attention_fn, ...)

A custom attention module needs one line: compute its core with the op,
``out = ns.models.attention(q, k, v, causal=True, mask=mask)`` (``q [batch,
length, heads, head_dim]``, ``k, v [batch, length, kv_heads, head_dim]``), in
place of its ``softmax(q @ k^T) @ v`` or ``jax.nn.dot_product_attention`` call.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax.nnx.nn import dtypes

from nnx_shard._attention import BLOCK, attention
from nnx_shard._errors import UsageError

__all__ = ["attention_fn"]


def attention_fn(  # noqa: PLR0913  # flax's nnx.dot_product_attention signature, as is
        query: jax.Array, key: jax.Array, value: jax.Array, bias: Any = None,
        mask: Any = None, broadcast_dropout: bool = True, dropout_rng: Any = None,
        dropout_rate: float = 0.0, deterministic: bool = False, dtype: Any = None,
        precision: Any = None, module: Any = None,
        promote_dtype: Any = dtypes.promote_dtype, is_causal: bool = False, *,
        implementation: str = "auto", block_size: int = BLOCK) -> jax.Array:
    """``flax.nnx.dot_product_attention`` computed by :func:`nnx_shard.models.attention`:
    pass it as ``nnx.MultiHeadAttention(..., attention_fn=attention_fn)``.

    Same arguments and result (``[batch..., q_len, heads, head_dim]``); ``mask``
    (``[batch..., heads|1, q_len, kv_len]``, ``True``: attend) and ``is_causal`` are
    honoured, key/value heads may be fewer than query heads. Choose the kernel with
    ``functools.partial(attention_fn, implementation="dense")`` (default ``"auto"``).
    Differences from flax's: a query row whose mask is all ``False`` gets zeros (flax:
    the mean of all values); ``precision`` is not used (the op computes scores in
    float32). Attention-weight bias, dropout during training and ``sow_weights`` need
    the probability matrix this path never builds, and raise.

    Args:
      query: ``[batch..., q_len, heads, head_dim]``.
      key: ``[batch..., kv_len, kv_heads, head_dim]`` (``heads`` a multiple of
        ``kv_heads``).
      value: as ``key``.
      bias: must be ``None`` (an additive bias is refused).
      mask: ``None`` or a boolean ``[batch..., heads|1, q_len, kv_len]`` (``True``:
        attend).
      broadcast_dropout: flax's; unused (attention dropout is refused).
      dropout_rng: flax's; unused.
      dropout_rate: must be 0 unless ``deterministic``.
      deterministic: flax's; with it any ``dropout_rate`` is ignored.
      dtype: the dtype ``query``, ``key`` and ``value`` are promoted to (``None``:
        their common one).
      precision: flax's; not used (scores are computed in float32).
      module: must be ``None`` (``sow_weights`` is refused).
      promote_dtype: the function that promotes the inputs (flax's by default).
      is_causal: add the causal mask.
      implementation: the kernel: ``"auto"``, ``"dense"``, ``"blockwise"`` or
        ``"cudnn"`` (see :func:`nnx_shard.models.attention`).
      block_size: the blockwise kernel's query and key/value block.

    Returns:
      ``[batch..., q_len, heads, head_dim]`` in the promoted dtype.

    Raises:
      UsageError: a ``bias``, attention dropout while training, or ``sow_weights``.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_shard.models import attention_fn
    >>> mha = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0),
    ...                              attention_fn=attention_fn)
    >>> x = jnp.ones((1, 5, 8))
    >>> stock = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0))
    >>> bool(jnp.allclose(mha(x, is_causal=True), stock(x, is_causal=True), atol=1e-5))
    True
    """
    fix = "Fix: use flax's own attention_fn (the default) for this layer."
    if bias is not None:
        raise UsageError(f"attention_fn: bias=...: an additive attention bias is not supported. {fix}")
    if dropout_rate > 0.0 and not deterministic:
        raise UsageError(
            f"attention_fn: dropout on the attention weights (dropout_rate={dropout_rate}) "
            "needs the probability matrix, which this path never builds. Fix: "
            "nnx.MultiHeadAttention(..., dropout_rate=0.0), or flax's own attention_fn."
        )
    if module is not None:
        raise UsageError(f"attention_fn: sow_weights=True needs the attention weights. {fix}")
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise UsageError(
            f"attention_fn: query {query.shape}, key {key.shape} and value {value.shape} "
            "need the same batch dimensions. Fix: broadcast them before the call."
        )
    rows = math.prod(batch)
    q, k, v = (x.reshape(rows, *x.shape[-3:]) for x in (query, key, value))
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.ndim < 3:
            raise UsageError(
                f"attention_fn: mask of shape {mask.shape} must be [batch..., heads, q_len, "
                "kv_len]. Fix: build it with nnx.make_attention_mask / nnx.make_causal_mask."
            )
        if not (len(batch) == 1 and mask.ndim == 4):
            mask = jnp.broadcast_to(mask, (*batch, *mask.shape[-3:]))
            mask = mask.reshape(rows, *mask.shape[-3:])
        mask = mask.astype(bool)
    out = attention(q, k, v, causal=is_causal, mask=mask, implementation=implementation,
                    block_size=block_size)
    return out.reshape(*batch, *out.shape[1:])

