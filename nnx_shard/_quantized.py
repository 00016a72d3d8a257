"""Frozen kernels stored quantized (QLoRA's base), built on qwix.

:func:`quantize_kernel` turns a projection kernel ``[*stack, *in, *out]`` into a
:class:`QuantizedKernel`: codes with the kernel's shape and logical names, and
absmax scales. ``quantize="nf4"`` stores the 16 NormalFloat levels of QLoRA
(qwix's ``"nf4"``, 4-bit codes); ``"int4"`` and ``"int8"`` symmetric integers.
The scales are block-wise by default: one float32 scale per ``block`` (64)
consecutive entries of the kernel's last input axis, per output channel (qwix's
``tiled_axes``), as QLoRA / bitsandbytes define it; ``block=None`` keeps one
scale per output channel. The scales keep the kernel's rank and names (the block
axis is named after the input axis it splits), so every preset shards them with
the codes. ``double_quant=True`` stores the block scales themselves as int8 in
groups of up to 256 (QLoRA's double quantization: the scales less their mean,
absmax-quantized by ``qwix.quantize``; only the mean offset is kept by hand, as
qwix has no offset form of the calibration).

The reference models' projections read the kernel through
:meth:`QuantizedKernel.contract`: ``x @ W`` is summed over groups of blocks, each
group's tile dequantized (``qwix.dequantize``) just before its matmul and again in
the backward pass, so a forward/backward step never holds a float copy of the
whole kernel. Reading ``kernel[...]`` (stock layers, :func:`nnx_shard.merge_lora`)
dequantizes the whole kernel. The stored arrays are ``QuantizedValue`` Variables,
not ``nnx.Param``: no optimizer ``wrt=nnx.Param`` or ``wrt=nnx.LoRAParam`` touches
them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard._errors import NnxShardError, UsageError, short

__all__ = ["QUANT_TYPES", "QuantSpec", "QuantizedKernel", "QuantizedValue", "check_blocks",
           "check_quantize", "quantize_kernel", "read_whole"]

#: The storage types of a quantized base, by name (qwix's qtypes).
QUANT_TYPES: dict[str, Any] = {"nf4": "nf4", "int4": jnp.int4, "int8": jnp.int8}
QLORA_EXTRA = "pip install 'nnx_shard[qlora]'"
BLOCK = 64  # QLoRA's block of the 4-bit codes
SCALE_GROUP = 256  # QLoRA's group of the 8-bit block scales (double quantization)
#: Float bytes of one dequantized tile in :meth:`QuantizedKernel.contract`; kernels
#: no bigger are dequantized whole (a loop would only add steps).
TILE_BYTES = 4 << 20


def qwix_module() -> Any:
    """qwix, imported on first use (the optional ``qlora`` extra)."""
    try:
        import qwix
    except ImportError as e:
        raise NnxShardError(
            f"a quantized base needs qwix, which is not installed ({e}). "
            f"Fix: {QLORA_EXTRA} (or pip install qwix), or quantize=None.") from e
    return qwix


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How :func:`nnx_shard.lora` stores a frozen base: ``qtype`` (a key of
    :data:`QUANT_TYPES`), ``block`` (entries of the last input axis per scale, or
    ``None`` for one scale per output channel) and ``double`` (int8 scales)."""

    qtype: str
    block: int | None = BLOCK
    double: bool = False


def check_quantize(quantize: Any, block: Any = BLOCK, double: Any = False) -> QuantSpec | None:
    """``quantize``, ``quant_block`` and ``double_quant`` as given to
    :func:`nnx_shard.lora`, checked: ``None``, or the :class:`QuantSpec` they name.

    >>> check_quantize("nf4", 64, True)
    QuantSpec(qtype='nf4', block=64, double=True)
    >>> check_quantize(None) is None
    True
    """
    if quantize is not None and not (isinstance(quantize, str) and quantize in QUANT_TYPES):
        raise UsageError(
            f"lora quantize must be None, 'nf4', 'int4' or 'int8', got {short(quantize, 60)} "
            f"({type(quantize).__name__}). Fix: quantize='nf4' (QLoRA's 4-bit NormalFloat), "
            "'int4' (the same size) or 'int8' (twice the bytes), or None for a full-precision "
            "base.")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int)
                              or block < 1):
        raise UsageError(
            f"lora quant_block must be a positive int or None, got {short(block, 60)} "
            f"({type(block).__name__}). Fix: quant_block=64 (QLoRA's block of the input "
            "axis), or None for one scale per output channel.")
    if not isinstance(double, bool):
        raise UsageError(f"lora double_quant must be True or False, got {short(double, 60)}. "
                         "Fix: double_quant=True stores the block scales in 8 bits (QLoRA)")
    if quantize is None:
        return None
    if double and block is None:
        raise UsageError(
            "lora double_quant=True needs block scales, got quant_block=None (one scale per "
            "output channel, too few to be worth quantizing). Fix: quant_block=64, or "
            "double_quant=False.")
    return QuantSpec(quantize, block, double)


def check_blocks(spec: QuantSpec | None,
                 kernels: list[tuple[str, tuple[int, ...], int, int]]) -> None:
    """Raises :class:`~nnx_shard.UsageError` unless ``spec.block`` divides the last
    input axis of each kernel ``(path, shape [*stack, *in, *out], stack, n_in)``.

    >>> check_blocks(QuantSpec("nf4"), [("q", (128, 8), 0, 1)])
    >>> check_blocks(QuantSpec("nf4"), [("o", (4, 8, 32), 0, 2)])
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: lora quantize='nf4': parameter 'o' of shape (4, 8, 32) ...
    """
    if spec is None or spec.block is None:
        return
    for path, shape, stack, n_in in kernels:
        _check_block(path, shape, stack + n_in - 1, spec.qtype, spec.block)


def _check_block(path: str, shape: tuple[int, ...], axis: int, qtype: str, block: int) -> None:
    size = shape[axis]
    if size % block == 0:
        return
    divisors = [d for d in (256, 128, 64, 32, 16, 8) if size % d == 0 and d < block]
    hint = f"quant_block={divisors[0]} (a divisor of {size}), or " if divisors else ""
    raise UsageError(
        f"lora quantize={qtype!r}: parameter {path!r} of shape {shape} has a last input "
        f"axis (axis {axis}) of size {size}, which quant_block={block} does not divide: "
        f"the block scales split that axis into blocks of {block}. Fix: {hint}"
        "quant_block=None (one scale per output channel), or narrow targets= to kernels "
        f"whose input size divides by {block}.")


class QuantizedValue(nnx.Variable[Any]):
    """The stored codes or scales of a :class:`QuantizedKernel` (frozen: not a Param)."""


class QuantizedKernel(nnx.Module):
    """A kernel stored as ``qvalue`` (codes: the kernel's shape and names; NF4's
    level indices 0..15 in int4 bits) and
    ``scale`` (float32 block or channel scales, or their int8 codes with
    ``scale_scale`` and ``scale_offset`` under double quantization); reads
    dequantized. :func:`nnx_shard.lora` builds it (``quantize=``); it is rarely built
    by hand.

    Args:
      qvalue: the codes, with the kernel's shape and logical names.
      scale: the float32 scales (one per ``block`` entries of the last input axis and
        output channel, or per output channel), or their int8 codes.
      qtype: ``"nf4"``, ``"int4"`` or ``"int8"``.
      dtype: the full-precision kernel's dtype, which reads return.
      n_out: the number of output axes (the trailing axes of the kernel).
      block: the block size along the last input axis, ``None`` per output channel.
      scale_scale: under double quantization, the float32 scale of each group of
        scales; else ``None``.
      scale_offset: under double quantization, the mean the scales were quantized
        around; else ``None``.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> layer = nnx.Linear(128, 3, rngs=nnx.Rngs(0))
    >>> w = layer.kernel[...]
    >>> q = ns.lora(layer, 2, 4.0, targets="kernel", quantize="nf4").kernel  # QLoRA's base
    >>> type(q).__name__, q.qtype, str(q.qvalue.dtype), q.scale.shape, q.shape, q.dtype
    ('QuantizedKernel', 'nf4', 'int4', (2, 3), (128, 3), dtype('float32'))
    >>> bool(jnp.abs(q[...] - w).max() <= 0.16 * jnp.abs(w).max())  # half NF4's widest gap
    True
    """

    def __init__(self, qvalue: QuantizedValue, scale: QuantizedValue, *, qtype: str,
                 dtype: Any, n_out: int, block: int | None = None,
                 scale_scale: QuantizedValue | None = None,
                 scale_offset: QuantizedValue | None = None) -> None:
        self.qvalue = qvalue
        self.scale = scale
        self.scale_scale = scale_scale
        self.scale_offset = scale_offset
        self.qtype = str(qtype)
        self.dtype_name = jnp.dtype(dtype).name
        self.n_out = int(n_out)
        self.block = block

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

    def float_scales(self) -> jax.Array:
        """The block (or channel) scales in float32, dequantized first under double
        quantization."""
        scale = self.scale[...]
        if self.scale_scale is None or self.scale_offset is None:
            return scale
        qwix = qwix_module()
        inner = qwix.dequantize(qwix.QArray(scale, self.scale_scale[...], None, jnp.int8))
        return inner + self.scale_offset[...]

    def dequantized(self) -> jax.Array:
        """The whole kernel in its dtype (``qwix.dequantize``)."""
        w = _dequantize(self.qvalue[...], self.float_scales(), self.qtype, self.dtype)
        # A stock layer reads its kernel whole before calling the op its adapter wraps:
        # the adapter finds the codes behind that array and contracts them tile by tile,
        # leaving the whole dequantization unused (jit drops it).
        _LAST_READ.pair = (weakref.ref(w), weakref.ref(self))
        return w

    def contract(self, eq: str, x: jax.Array, dt: Any,
                 einsum: Callable[[str, jax.Array, jax.Array], jax.Array] | None = None
                 ) -> jax.Array:
        """``einsum(eq, x, W)`` (``x`` and ``W`` in ``dt``; ``einsum`` defaults to
        ``jnp.einsum``) with ``W`` dequantized one tile of whole blocks at a time,
        each tile at most :data:`TILE_BYTES` of ``dt``, in the forward and again in
        the backward pass: the float kernel is never whole in memory. ``eq``'s
        kernel letters are the kernel's axes (stacked axes sliced off or not).

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import nnx_shard as ns
        >>> layer = nnx.Linear(256, 8, rngs=nnx.Rngs(0))
        >>> q = ns.lora(layer, 2, 4.0, targets="kernel", quantize="nf4").kernel
        >>> x = jnp.ones((2, 256))
        >>> y = q.contract("bi,io->bo", x, jnp.float32)
        >>> bool(jnp.allclose(y, x @ q[...], atol=1e-4))
        True
        """
        run = einsum if einsum is not None else partial(jnp.einsum)
        codes, scales = self.qvalue[...], self.float_scales()
        axis = codes.ndim - self.n_out - 1  # the blocked (last input) axis
        size = codes.shape[axis]
        # One scale per output channel: tiles of 64 inputs share the channel's scales.
        block = self.block or (BLOCK if size % BLOCK == 0 else size)
        n_blocks = size // block
        per_block = math.prod(codes.shape) // n_blocks * jnp.dtype(dt).itemsize
        group = max((g for g in range(1, n_blocks + 1)
                     if n_blocks % g == 0 and g * per_block <= TILE_BYTES), default=1)
        if group == n_blocks:
            return run(eq, x, _dequantize(codes, scales, self.qtype, dt))
        xl, wl = eq.replace(" ", "").split("->")[0].split(",")
        tiling = _Tiling(eq, run, self.qtype, jnp.dtype(dt).name, axis,
                         xl.index(wl[axis]), group * block, group if self.block else 0)
        return _tiled(tiling, x, codes, scales)

    def __getitem__(self, key: Any) -> jax.Array:
        w = self.dequantized()
        return w if key is Ellipsis else w[key]

    @property
    def value(self) -> jax.Array:
        return self.dequantized()

    def get_value(self) -> jax.Array:
        return self.dequantized()

    def get_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The stored values' metadata (the kernel's logical names)."""
        return self.qvalue.get_metadata(*args, **kwargs)


_LAST_READ = threading.local()


def read_whole(w: Any) -> QuantizedKernel | None:
    """The :class:`QuantizedKernel` whose last whole read on this thread (``kernel[...]``)
    is the array ``w`` itself, else ``None``.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> q = ns.lora(nnx.Linear(128, 4, rngs=nnx.Rngs(0)), 2, 4.0, targets="kernel",
    ...             quantize="nf4").kernel
    >>> w = q[...]
    >>> read_whole(w) is q, read_whole(w + 0) is None
    (True, True)
    """
    pair = getattr(_LAST_READ, "pair", None)
    if pair is None or pair[0]() is not w:
        return None
    return pair[1]()


def _dequantize(codes: jax.Array, scales: jax.Array, qtype: str, dt: Any) -> jax.Array:
    qwix = qwix_module()
    if qtype == "nf4":
        codes = jax.lax.bitcast_convert_type(codes, jnp.uint4)
    return qwix.dequantize(qwix.QArray(codes, scales, None, QUANT_TYPES[qtype])).astype(dt)


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """How :func:`_tiled` walks a kernel: the einsum and its runner, the codes'
    type, the dequantized dtype, the blocked axis of the codes and of ``x``, and
    the entries and scales of one tile along it (0 scales: one per output channel,
    the same for every tile)."""

    eq: str
    run: Callable[..., jax.Array]
    qtype: str
    dt: str
    axis: int
    x_axis: int
    size: int
    scales: int

    def tile(self, codes: jax.Array, scales: jax.Array, i: jax.Array) -> jax.Array:
        c = jax.lax.dynamic_slice_in_dim(codes, i * self.size, self.size, self.axis)
        s = scales if not self.scales else jax.lax.dynamic_slice_in_dim(
            scales, i * self.scales, self.scales, self.axis)
        return _dequantize(c, s, self.qtype, self.dt)

    def part(self, x: jax.Array, i: jax.Array) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(x, i * self.size, self.size, self.x_axis)

    def steps(self, codes: jax.Array) -> int:
        return codes.shape[self.axis] // self.size


def _forward(t: _Tiling, x: jax.Array, codes: jax.Array, scales: jax.Array) -> jax.Array:
    def step(i: jax.Array, acc: jax.Array) -> jax.Array:
        return acc + t.run(t.eq, t.part(x, i), t.tile(codes, scales, i)).astype(acc.dtype)

    first = t.run(t.eq, t.part(x, jnp.int32(0)), t.tile(codes, scales, jnp.int32(0)))
    acc = jax.lax.fori_loop(1, t.steps(codes), step, first.astype(jnp.float32))
    return acc.astype(first.dtype)


# The frozen codes and scales get no cotangent; the backward pass dequantizes each
# tile again rather than keeping the forward's tiles (a whole float kernel) alive.
@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiled(t: _Tiling, x: jax.Array, codes: jax.Array, scales: jax.Array) -> jax.Array:
    return _forward(t, x, codes, scales)


def _tiled_fwd(t: _Tiling, x: jax.Array, codes: jax.Array,
               scales: jax.Array) -> tuple[jax.Array, tuple[Any, ...]]:
    return _forward(t, x, codes, scales), (x, codes, scales)


def _tiled_bwd(t: _Tiling, res: tuple[Any, ...], dy: jax.Array) -> tuple[Any, ...]:
    x, codes, scales = res
    ins, out = t.eq.replace(" ", "").split("->")
    xl, wl = ins.split(",")
    eq_dx = f"{out},{wl}->{xl}"

    def step(i: jax.Array, dx: jax.Array) -> jax.Array:
        part = jnp.einsum(eq_dx, dy, t.tile(codes, scales, i)).astype(dx.dtype)
        return jax.lax.dynamic_update_slice_in_dim(dx, part, i * t.size, t.x_axis)

    dx = jax.lax.fori_loop(0, t.steps(codes), step, jnp.zeros(x.shape, x.dtype))
    return dx, _no_cotangent(codes), _no_cotangent(scales)


def _no_cotangent(a: jax.Array) -> Any:
    if jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.zeros(a.shape, a.dtype)
    return jax.numpy.zeros(a.shape, jax.dtypes.float0)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def _sharding(value: Any) -> Any:
    sh = getattr(value, "sharding", None)
    return sh if isinstance(sh, NamedSharding) else None


def _like(value: Any, shape: tuple[int, ...], keep: set[int]) -> Any:
    """``value``'s sharding for an array of ``shape``: its spec entries on the axes in
    ``keep`` where they still divide, replicated elsewhere."""
    sh = _sharding(value)
    if sh is None:
        return None
    spec = list(tuple(sh.spec) + (None,) * (len(shape) - len(tuple(sh.spec))))
    for i, entry in enumerate(spec):
        axes = entry if isinstance(entry, tuple) else (entry,) if entry is not None else ()
        n = math.prod(sh.mesh.shape[a] for a in axes)
        if i not in keep or shape[i] % n:
            spec[i] = None
    return NamedSharding(sh.mesh, PartitionSpec(*spec))


def _group_tiles(shape: tuple[int, ...], axis: int) -> dict[int, int]:
    """Tiles of up to :data:`SCALE_GROUP` block scales: along the last (output) axis,
    then along the block axis."""
    last = len(shape) - 1
    t_last = math.gcd(shape[last], SCALE_GROUP)
    t_axis = math.gcd(shape[axis], SCALE_GROUP // t_last)
    return {last: t_last, axis: t_axis} if axis != last else {last: t_last}


def _quantizer(spec: QuantSpec, ndim: int, stack: int, n_in: int) -> Callable[..., Any]:
    qwix = qwix_module()
    qt = QUANT_TYPES[spec.qtype]
    axis = stack + n_in - 1
    ins = range(stack, stack + n_in)

    def quantize(w: jax.Array) -> dict[str, jax.Array]:
        w = w.astype(jnp.float32)
        if spec.block is None:
            q = qwix.quantize(w, qt, channelwise_axes=[i for i in range(ndim) if i not in ins])
        else:
            q = qwix.quantize(w, qt, channelwise_axes=[i for i in range(ndim) if i != axis],
                              tiled_axes={axis: spec.block})
        # qwix's NF4 codes are uint4, which checkpoints (tensorstore) cannot hold: the
        # same 4 bits are stored as int4 and read back as uint4.
        codes = q.qvalue if q.qvalue.dtype != jnp.uint4 else jax.lax.bitcast_convert_type(
            q.qvalue, jnp.int4)
        out = {"qvalue": codes, "scale": q.scale}
        if spec.double:
            scale = q.scale
            offset = jnp.mean(scale, axis=tuple(range(stack, ndim)), keepdims=True)
            tiles = _group_tiles(scale.shape, axis)
            qs = qwix.quantize(scale - offset, jnp.int8, tiled_axes=tiles,
                               channelwise_axes=[i for i in range(ndim) if i not in tiles])
            out |= {"scale": qs.qvalue, "scale_scale": qs.scale, "scale_offset": offset}
        return out

    return quantize


@functools.lru_cache(maxsize=256)
def _jitted_quantizer(spec: QuantSpec, ndim: int, stack: int, n_in: int,
                      shardings: tuple[tuple[str, Any], ...] | None) -> Callable[..., Any]:
    # One jitted quantizer per kind of kernel: the kernels of a model's blocks (and of
    # the next model) share its compiled programs instead of compiling one each.
    quantize = _quantizer(spec, ndim, stack, n_in)
    if shardings is None:
        return jax.jit(quantize)
    return jax.jit(quantize, out_shardings=dict(shardings))


def quantize_kernel(var: nnx.Variable[Any], spec: QuantSpec, *, stack: int, n_in: int,
                    names: tuple[Any, ...] | None = None) -> QuantizedKernel:
    """``var`` (a float kernel ``[*stack, *in, *out]``) as a :class:`QuantizedKernel`
    stored as ``spec`` says (``qwix.quantize``: absmax scales per block of the last
    input axis and output channel, or per output channel), created in ``var``'s
    sharding (abstract when ``var`` is).

    >>> layer = nnx.Linear(128, 2, rngs=nnx.Rngs(0))
    >>> q = quantize_kernel(layer.kernel, QuantSpec("int4", 64, double=True), stack=0, n_in=1)
    >>> str(q.qvalue.dtype), q.scale.shape, str(q.scale.dtype), q.scale_scale.shape
    ('int4', (2, 2), 'int8', (1, 1))
    """
    w = var.get_value()
    ndim = len(var.shape)
    quantize = _quantizer(spec, ndim, stack, n_in)
    shapes = jax.eval_shape(quantize, jax.ShapeDtypeStruct(w.shape, w.dtype))
    kernel_names = names if names is not None else (None,) * ndim
    ins = set(range(stack, stack + n_in))
    if spec.block is None:  # a size-1 scale axis on every input axis: nothing to split
        scale_keep = set(range(ndim)) - ins
    else:  # the block axis is named, and split, after the input axis it divides
        scale_keep = set(range(ndim))
    keep = {"qvalue": set(range(ndim)), "scale": scale_keep,
            "scale_scale": set(range(stack)), "scale_offset": set(range(stack))}
    shardings = {k: _like(w, s.shape, keep[k]) for k, s in shapes.items()}
    if not isinstance(w, jax.Array):  # an abstract model (nnx.eval_shape)
        arrays: dict[str, Any] = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[k])
                                  for k, s in shapes.items()}
    else:
        placed = None if shardings["qvalue"] is None else tuple(shardings.items())
        arrays = _jitted_quantizer(spec, ndim, stack, n_in, placed)(w)
    meta = {"eager_sharding": False}
    parts = {k: QuantizedValue(a, out_sharding=tuple(
        n if i in keep[k] else None for i, n in enumerate(kernel_names)), **meta)
        for k, a in arrays.items()}
    return QuantizedKernel(parts.pop("qvalue"), parts.pop("scale"), qtype=spec.qtype,
                           dtype=var.dtype, n_out=ndim - stack - n_in, block=spec.block,
                           **parts)
