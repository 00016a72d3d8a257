"""The per-device attention kernels of :func:`nnx_shard._attention.attention`.

Three kernels compute ``softmax(q k^T / sqrt(head_dim) [masked]) v`` on one
device (or on each device's share under context parallelism, see
:mod:`nnx_shard._attention._context_parallel`). "Dense" in nnx_shard names the
first of them and nothing else:

* ``"dense"``: the plain masked softmax. It keeps the float32 scores and
  probabilities ``[batch, heads, q_len, kv_len]`` for the backward pass:
  memory grows with the square of the sequence.
* ``"blockwise"``: queries in blocks of ``block`` rows against key/value blocks
  of ``block`` columns, accumulated with an online (log-sum-exp) softmax; a
  ``jax.custom_vjp`` whose backward pass recomputes each tile's scores from
  ``q, k, v`` and the per-row log-sum-exp instead of storing any. It keeps
  ``q, k, v``, the output and the log-sum-exp (``[batch, heads, q_len]``)
  and, while it runs, a few ``[batch, heads, block, block]`` tiles: memory
  grows linearly with the sequence. Under a causal mask a query block visits
  only the key blocks at or before its last row (and in the backward pass a
  key block only the query blocks at or after its first column): fully masked
  tiles are never computed, about half the work of the unmasked problem.
  Sequences that are not a multiple of ``block`` are padded to one and the
  padded keys masked.
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``, the
  fused flash-attention kernel of NVIDIA GPUs (float16/bfloat16, head_dim a
  multiple of 8 up to 128, or 256 on Hopper). Masks reach it as a dense bias,
  so ``"auto"`` picks it only without masks or segment ids.

``"auto"`` is ``"cudnn"`` where it applies (a GPU backend, no context
parallelism, half precision, a supported head size, no mask or segment ids,
as many queries as keys) and ``"blockwise"`` everywhere else (CPU, TPU, the
ring and all-gather modes).

Grouped-query attention (fewer key/value heads than query heads) is computed
without repeating K/V, and a query row that sees no key gets zeros in every
kernel but ``"cudnn"``; the block math behind both, which the ring mode of
:mod:`nnx_shard._attention._context_parallel` runs at each ring step too, is
:mod:`nnx_shard._attention._blocks`.

>>> import jax.numpy as jnp
>>> q = jax.random.normal(jax.random.key(0), (1, 40, 4, 8))
>>> kv = jax.random.normal(jax.random.key(1), (1, 40, 2, 8))   # 2 kv heads for 4 query heads
>>> out = attention_local(q, kv, kv, Masks(), causal=True, kernel="blockwise", block=16)
>>> ref = attention_local(q, kv, kv, Masks(), causal=True, kernel="dense", block=16)
>>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5))
((1, 40, 4, 8), True)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from nnx_shard._attention._blocks import (
    MASKED,
    Masks,
    capped,
    delta,
    finish,
    grads,
    stats,
    tile_mask,
)
from nnx_shard._errors import UsageError
from nnx_shard._mesh import current

__all__ = ["BLOCK", "KERNELS", "attention_local", "blockwise", "dense", "resolve"]

#: The per-device kernels :func:`nnx_shard._attention.attention` accepts (its ``implementation``).
KERNELS = ("auto", "blockwise", "dense", "cudnn")

#: Default query and key/value block size of the blockwise kernel.
BLOCK = 512

_F32 = jnp.float32


# --------------------------------------------------------------------------- kernels


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def blockwise(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, q_offset: Any,
              causal: bool, block: int, softcap: float | None = None) -> jax.Array:
    """The blockwise kernel on grouped queries ``[b, q_len, kv_heads, group, d]``; query
    row ``i`` sits at key position ``q_offset + i`` for the causal mask."""
    return _blockwise_fwd(q, k, v, masks, q_offset, causal, block, softcap)[0]


def _blockwise_fwd(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, q_offset: Any,
                   causal: bool, block: int, softcap: float | None = None
                   ) -> tuple[jax.Array, Any]:
    out, lse = finish(stats(q, k, v, masks, causal=causal, q_offset=q_offset, block=block,
                            softcap=softcap), q.dtype)
    return out, (q, k, v, masks, q_offset, out, lse)


def _blockwise_bwd(causal: bool, block: int, softcap: float | None, res: Any, g: jax.Array
                   ) -> tuple[Any, ...]:
    q, k, v, masks, q_offset, out, lse = res
    do = g.astype(_F32)
    dq, dk, dv = grads(q, k, v, do, lse, delta(do, out), masks, causal=causal,
                       q_offset=q_offset, block=block, softcap=softcap)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def dense(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, causal: bool,
          q_offset: Any = 0, softcap: float | None = None) -> jax.Array:
    """The masked softmax on ``q [b, q_len, heads, d]``, ``k, v [b, kv_len, kv_heads, d]``
    (``masks`` in the grouped layout), differentiated by JAX: it keeps the scores and
    probabilities ``[b, heads, q_len, kv_len]``."""
    hk = k.shape[2]
    g = q.shape[2] // hk
    mask = tile_mask(masks, causal, q_offset, 0, q.shape[1], 0, k.shape[1], None)
    if g == 1:
        # Multi-head attention: the reference transformer's original core, operation
        # for operation, so that its numbers do not change.
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=_F32)
        mask = None if mask is None else mask[:, :, 0] if mask.ndim == 5 else mask
    else:
        qg = q.reshape(*q.shape[:2], hk, g, q.shape[3])
        scores = jnp.einsum("bqhgk,bshk->bhgqs", qg, k, preferred_element_type=_F32)
    scores = capped(scores / math.sqrt(q.shape[-1]), softcap)
    if mask is not None:
        scores = jnp.where(mask, scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    if mask is not None and masks.present:
        probs = jnp.where(jnp.any(mask, axis=-1, keepdims=True), probs, 0.0)
    probs = probs.astype(q.dtype)
    if g == 1:
        return jnp.einsum("bhqs,bshk->bqhk", probs, v)
    out = jnp.einsum("bhgqs,bshk->bqhgk", probs, v)
    return out.reshape(*q.shape[:3], v.shape[-1])


def _cudnn(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, causal: bool) -> jax.Array:
    mask = tile_mask(masks, False, 0, 0, q.shape[1], 0, k.shape[1], None)
    if mask is not None:  # grouped [b, kv_heads|1, group|1, q, k] -> [b, heads|1, q, k]
        mask = jnp.broadcast_to(mask, (*mask.shape[:3], q.shape[1], k.shape[1]))
        mask = mask.reshape(mask.shape[0], -1, *mask.shape[3:])
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                        implementation="cudnn")


def _platform() -> str:
    """The platform the active mesh's devices are on (the default backend without one)."""
    active = current()
    if active is not None and hasattr(active[0], "devices"):
        return str(active[0].devices.flat[0].platform)
    return jax.default_backend()


def resolve(kernel: str, q: Any, k: Any, masks: Masks, *, context_parallel: bool,
            softcap: float | None = None) -> str:
    """The kernel ``kernel`` names for these inputs: ``"auto"`` becomes ``"cudnn"`` where
    the fused kernel applies (see the module docs), else ``"blockwise"``; ``"cudnn"``
    under context parallelism (which needs per-block statistics) becomes ``"blockwise"``,
    and elsewhere off a GPU is a ``UsageError`` (cuDNN is an NVIDIA library).

    >>> resolve("auto", jnp.ones((1, 8, 2, 8)), jnp.ones((1, 8, 2, 8)), Masks(),
    ...         context_parallel=False)   # on CPU
    'blockwise'
    >>> resolve("flash", None, None, Masks(), context_parallel=False)
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: attention: implementation='flash' is not one of ('auto', 'blockwise', 'dense', 'cudnn'). Fix: pass one of them (ReferenceConfig(attention=...) for the reference model); 'auto' picks cudnn on GPUs and blockwise elsewhere.
    """
    if kernel not in KERNELS:
        raise UsageError(
            f"attention: implementation={kernel!r} is not one of {KERNELS}. Fix: pass one of "
            "them (ReferenceConfig(attention=...) for the reference model); 'auto' picks "
            "cudnn on GPUs and blockwise elsewhere."
        )
    if kernel == "cudnn" and softcap is not None:
        raise UsageError(
            f"attention: implementation='cudnn' cannot soft-cap the attention logits "
            f"(softcap={softcap}): jax.nn.dot_product_attention's fused kernel has no "
            "soft-capping. Fix: implementation='blockwise' or 'dense' (DecoderConfig(attention="
            "...)), or 'auto', which picks blockwise for soft-capped models."
        )
    if kernel == "cudnn" and context_parallel:
        return "blockwise"
    if kernel == "cudnn" and _platform() != "gpu":
        raise UsageError(
            f"attention: implementation='cudnn' is cuDNN's fused kernel, for NVIDIA GPUs; "
            f"this runs on {_platform()}. Fix: implementation='auto' (cuDNN on GPUs, "
            "blockwise elsewhere) or 'blockwise' (ReferenceConfig(attention=...) for the "
            "reference models)."
        )
    if kernel != "auto":
        return kernel
    if context_parallel or masks.present or softcap is not None or _platform() != "gpu":
        return "blockwise"
    d = q.shape[-1]
    fits = (q.dtype in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= 128
            and q.shape[1] == k.shape[1])
    return "cudnn" if fits else "blockwise"


def attention_local(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, *, causal: bool,
                    kernel: str, block: int = BLOCK, q_offset: Any = 0,
                    softcap: float | None = None) -> jax.Array:
    """Attention of ``q [b, q_len, heads, d]`` and ``k, v [b, kv_len, kv_heads, d]`` on one
    device with a resolved ``kernel`` (``masks`` in the grouped layout)."""
    if kernel == "dense":
        return dense(q, k, v, masks, causal, q_offset, softcap)
    if kernel == "cudnn":
        return _cudnn(q, k, v, masks, causal)
    hk = k.shape[2]
    qg = q.reshape(*q.shape[:2], hk, q.shape[2] // hk, q.shape[3])
    out = blockwise(qg, k, v, masks, jnp.asarray(q_offset, jnp.int32), causal, block, softcap)
    return out.reshape(*q.shape[:3], v.shape[-1])
