"""Frozen kernels stored quantized (QLoRA's base), built on qwix.

:func:`quantize_kernel` turns a projection kernel into a :class:`QuantizedKernel`:
int8 or int4 values with the kernel's shape and logical names, and one scale per
output channel (per stacked layer too) named after the kernel's output axes, so
every preset shards the values like the kernel and the scales along the output
axes. Reading it (``kernel[...]``) dequantizes with ``qwix.dequantize``; inside a
sharded step that is an elementwise product on each device's own shard, so the
full-precision kernel never exists unsharded. :func:`nnx_shard.lora` uses it for
``quantize="int8" | "int4"``. The values are ``QuantizedValue`` Variables, not
``nnx.Param``: no optimizer ``wrt=nnx.Param`` or ``wrt=nnx.LoRAParam`` touches them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard._errors import NnxShardError, UsageError, short

__all__ = ["QUANT_TYPES", "QuantizedKernel", "QuantizedValue", "quantize_kernel"]

#: The storage types of a quantized base, by name.
QUANT_TYPES = {"int8": jnp.int8, "int4": jnp.int4}
QLORA_EXTRA = "pip install 'nnx_shard[qlora]'"


def qwix_module() -> Any:
    """qwix, imported on first use (the optional ``qlora`` extra)."""
    try:
        import qwix
    except ImportError as e:
        raise NnxShardError(
            f"a quantized base needs qwix, which is not installed ({e}). "
            f"Fix: {QLORA_EXTRA} (or pip install qwix), or quantize=None.") from e
    return qwix


def check_quantize(quantize: Any) -> str | None:
    """``quantize`` as given to :func:`nnx_shard.lora`, checked: ``None``, ``"int8"`` or
    ``"int4"``.

    >>> check_quantize("int4"), check_quantize(None)
    ('int4', None)
    """
    if quantize is None or (isinstance(quantize, str) and quantize in QUANT_TYPES):
        return quantize
    raise UsageError(
        f"lora quantize must be None, 'int8' or 'int4', got {short(quantize, 60)} "
        f"({type(quantize).__name__}). Fix: quantize='int8' (about half the base's bf16 "
        "bytes) or quantize='int4' (about a quarter), or None for a full-precision base.")


class QuantizedValue(nnx.Variable[Any]):
    """The stored values or scales of a :class:`QuantizedKernel` (frozen: not a Param)."""


class QuantizedKernel(nnx.Module):
    """A kernel stored as ``qvalue`` (int8/int4, the kernel's shape and names) and
    ``scale`` (the kernel's dtype, one per output channel); reads dequantized.

    >>> layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> q = quantize_kernel(layer.kernel, "int8", stack=0, n_in=1)
    >>> q.qvalue.dtype, q.scale.shape, q.shape, q.dtype
    (dtype('int8'), (1, 3), (4, 3), dtype('float32'))
    >>> bool(jnp.abs(q[...] - layer.kernel[...]).max() < 0.01)
    True
    """

    def __init__(self, qvalue: QuantizedValue, scale: QuantizedValue, *, qtype: str,
                 dtype: Any) -> None:
        self.qvalue = qvalue
        self.scale = scale
        self.qtype = str(qtype)
        self.dtype_name = jnp.dtype(dtype).name

    @property
    def dtype(self) -> Any:
        """The full-precision kernel's dtype (the dequantized values')."""
        return jnp.dtype(self.dtype_name)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.qvalue.shape)

    @property
    def ndim(self) -> int:
        return len(self.qvalue.shape)

    def dequantized(self) -> jax.Array:
        """``qvalue * scale`` in the kernel's dtype (``qwix.dequantize``)."""
        qwix = qwix_module()
        q = qwix.QArray(self.qvalue[...], self.scale[...], None, QUANT_TYPES[self.qtype])
        return qwix.dequantize(q).astype(self.dtype)

    def __getitem__(self, key: Any) -> jax.Array:
        return self.dequantized()[key]

    @property
    def value(self) -> jax.Array:
        return self.dequantized()

    def get_value(self) -> jax.Array:
        return self.dequantized()

    def get_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The stored values' metadata (the kernel's logical names)."""
        return self.qvalue.get_metadata(*args, **kwargs)


def _sharding(value: Any) -> Any:
    sh = getattr(value, "sharding", None)
    return sh if isinstance(sh, NamedSharding) else None


def _scale_sharding(value: Any, n_in_axes: range) -> Any:
    sh = _sharding(value)
    if sh is None:
        return None
    spec = list(tuple(sh.spec) + (None,) * (len(value.shape) - len(tuple(sh.spec))))
    for i in n_in_axes:
        spec[i] = None  # a size-1 scale axis: nothing to split
    return NamedSharding(sh.mesh, PartitionSpec(*spec))


def quantize_kernel(var: nnx.Variable[Any], qtype: str, *, stack: int, n_in: int,
                    names: tuple[Any, ...] | None = None) -> QuantizedKernel:
    """``var`` (a float kernel ``[*stack, *in, *out]``) as a :class:`QuantizedKernel`
    with absmax scales per output channel and stacked layer (``qwix.quantize``),
    created in ``var``'s sharding (abstract when ``var`` is).

    >>> layer = nnx.Linear(8, 2, rngs=nnx.Rngs(0))
    >>> q = quantize_kernel(layer.kernel, "int4", stack=0, n_in=1)
    >>> str(q.qvalue.dtype), q.scale.shape
    ('int4', (1, 2))
    """
    qwix = qwix_module()
    qt = QUANT_TYPES[qtype]
    w = var.get_value()
    ndim = len(var.shape)
    ins = range(stack, stack + n_in)
    axes = tuple(i for i in range(ndim) if i not in ins)

    def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        q = qwix.quantize(x, qt, channelwise_axes=axes)
        return q.qvalue, q.scale

    q_sh, s_sh = _sharding(w), _scale_sharding(w, ins)
    if not isinstance(w, jax.Array):  # an abstract model (nnx.eval_shape)
        qv, sc = jax.eval_shape(quantize, jax.ShapeDtypeStruct(w.shape, w.dtype))
        qval: Any = jax.ShapeDtypeStruct(qv.shape, qv.dtype, sharding=q_sh)
        scale: Any = jax.ShapeDtypeStruct(sc.shape, sc.dtype, sharding=s_sh)
    elif q_sh is None:
        qval, scale = jax.jit(quantize)(w)
    else:
        qval, scale = jax.jit(quantize, out_shardings=(q_sh, s_sh))(w)
    kernel_names = names if names is not None else (None,) * ndim
    scale_names = tuple(None if i in ins else n for i, n in enumerate(kernel_names))
    meta = {"eager_sharding": False}
    return QuantizedKernel(QuantizedValue(qval, out_sharding=kernel_names, **meta),
                           QuantizedValue(scale, out_sharding=scale_names, **meta),
                           qtype=qtype, dtype=var.dtype)
