"""What the reference models share: parameters created with their logical names
(:func:`new_param`, :func:`dense_init`) and :class:`RMSNorm`.

One implementation serves :class:`nnx_shard.models.Decoder` and
:class:`nnx_shard.models.Decoder`, so a norm's parameter (``.../scale``), its logical
names, dtype and initial value are made the same way in both, and checkpoints,
Hugging Face mappings and rules tables address them alike.

>>> from flax import nnx
>>> norm = RMSNorm(4, ("embed",), 1e-6, jnp.float32, jnp.float32, rngs=nnx.Rngs(0))
>>> norm.scale.get_metadata("out_sharding"), norm(jnp.full((1, 4), 2.0)).round(4).tolist()
(('embed',), [[1.0, 1.0, 1.0, 1.0]])
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_shard._annotate import with_logical
from nnx_shard.models._ops import whole

__all__ = ["ACTIVATION_FNS", "RMSNorm", "dense_init", "new_param"]

#: The gated MLP's activations, by transformers' ``hidden_act`` name (dense and expert
#: MLPs alike).
ACTIVATION_FNS: dict[str, Any] = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def new_param(rngs: nnx.Rngs, init: Any, shape: tuple[int, ...], names: tuple[Any, ...],
              dtype: Any) -> nnx.Param:
    """An ``nnx.Param`` of ``shape`` and ``dtype`` drawn by ``init`` from
    ``rngs.params()``, carrying the logical ``names`` of its axes.

    >>> p = new_param(nnx.Rngs(0), nnx.initializers.ones, (2, 3), ("embed", "mlp"), jnp.float32)
    >>> p.shape, p.get_metadata("out_sharding")
    ((2, 3), ('embed', 'mlp'))
    """
    return nnx.Param(with_logical(init, names)(rngs.params(), shape, dtype))


def dense_init(fan_in: int) -> Any:
    """The models' projection initializer: normal with standard deviation
    ``1 / sqrt(fan_in)``.

    >>> w = dense_init(4)(jax.random.key(0), (4096,), jnp.float32)
    >>> 0.45 < float(w.std()) < 0.55
    True
    """
    return nnx.initializers.normal(stddev=1.0 / math.sqrt(fan_in))


class RMSNorm(nnx.Module):
    """Root-mean-square norm with a learned ``scale``, computed in float32 (as
    transformers' ``LlamaRMSNorm``) and returned in ``dtype``; with ``offset`` the
    scale is ``1 + weight`` (``GemmaRMSNorm``, whose weights start at 0), else the
    weight itself (starting at 1).

    ``size``: the normalized width, or a tuple of sizes normalized together over
    that many trailing axes; ``names``: the logical names of ``scale``'s axes;
    ``eps``: added to the mean square.

    >>> norm = RMSNorm((2, 3), ("heads", "kv"), 1e-6, jnp.float32, jnp.float32,
    ...                rngs=nnx.Rngs(0), offset=True)
    >>> norm.scale.shape, float(norm.scale[...].sum()), norm(jnp.ones((1, 2, 3))).shape
    ((2, 3), 0.0, (1, 2, 3))
    """

    def __init__(self, size: int | tuple[int, ...], names: tuple[str, ...], eps: float,
                 dtype: Any, param_dtype: Any, *, rngs: nnx.Rngs, offset: bool = False) -> None:
        init = nnx.initializers.zeros if offset else nnx.initializers.ones
        shape = size if isinstance(size, tuple) else (size,)
        self.scale = new_param(rngs, init, shape, names, param_dtype)
        self.eps = eps
        self.offset = offset
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        axes = tuple(range(-self.scale.ndim, 0))
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + self.eps)
        scale = whole(self.scale[...]).astype(jnp.float32)
        return ((1.0 + scale if self.offset else scale) * x32).astype(self.dtype)
