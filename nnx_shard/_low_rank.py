"""Low-rank adapters (LoRA) on the projections of any NNX model, applied to the
activations.

:func:`lora` leaves each matching projection kernel ``W`` a plain ``nnx.Param``
and puts beside it an :class:`Adapter`: two ``nnx.LoRAParam`` factors ``lora_a``
``[*in, r]`` and ``lora_b`` ``[r, *out]``, the scale ``alpha / rank`` and an
``nnx.Dropout``. The projection then computes ``x @ W + s * (dropout(x) @ A) @ B``:
the adapter's two thin matmuls cost ``2 r (in + out)`` FLOPs a token instead of
rebuilding ``W + s * A @ B`` (``in * out * r``) at every read, and the backward
pass of adapter-only training never forms a gradient of ``W``'s size. Where the
adapter lives, one layout per kind of layer:

- the reference models (:mod:`nnx_shard.models`) hold it as a sibling attribute of
  the kernel, ``lora_<kernel>`` (``blocks/0/attn/lora_q``), which their
  ``project`` call sites (:func:`nnx_shard.models._ops.project`) read; a module
  says which of its kernels it projects that way in ``lora_kernels``;
- stock ``nnx.Linear`` / ``nnx.LinearGeneral`` / ``nnx.Einsum`` hold it in place of
  their ``dot_general`` / ``einsum_op`` (``q_proj/dot_general``), which it calls and
  adds its own term to, so the stock ``__call__`` runs unchanged.

Both keep the adapter a child of the module that owns the kernel, so it is sliced
with it by a scan over stacked blocks and sharded from its own logical names
(A: the kernel's input axes and an unsharded rank axis; B: the rank axis and its
output axes; a stacked ``layers`` axis in front). Train only the factors with
``wrt=nnx.LoRAParam``; :func:`merge_lora` folds them back into ``W`` and removes
the adapters. With ``quantize="nf4" | "int4" | "int8"`` the frozen ``W`` is stored
quantized (QLoRA, :mod:`nnx_shard._quantized`) and dequantized where it is read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard._annotate import logical_names, path_str
from nnx_shard._errors import NnxShardError, ShardingError, UsageError
from nnx_shard._lora_checks import as_rngs, check_dtype, check_scalars, check_targets
from nnx_shard._quantized import (
    BLOCK,
    QuantizedKernel,
    check_blocks,
    check_quantize,
    quantize_kernel,
    qwix_module,
    read_whole,
)

__all__ = ["DEFAULT_TARGETS", "Adapter", "adapter_name", "adapters", "lora", "lora_equations",
           "merge_lora", "without_adapters"]

#: The projections PEFT adapts in a Llama by default (``q_proj``, ``v_proj``).
DEFAULT_TARGETS = r"attn/(q|v)$"
_STACK = ("layers",)  # leading logical axes of stacked (scanned) blocks
# Stock layers: the attribute the adapter stands in for, and its kind.
_STOCK: tuple[tuple[type, str, str], ...] = (
    (nnx.Einsum, "einsum_op", "einsum"),
    (nnx.LinearGeneral, "dot_general", "dot_general"),
    (nnx.Linear, "dot_general", "dot_general"))


def adapter_name(kernel: str) -> str:
    """The attribute holding the adapter of the kernel attribute ``kernel`` on a
    module that projects through :func:`nnx_shard.models._ops.project`.

    >>> adapter_name("q")
    'lora_q'
    """
    return f"lora_{kernel}"


def lora_equations(eq: str) -> tuple[str, str]:
    """The einsums ``x @ A`` and ``(x @ A) @ B`` of a projection ``eq`` (``x, W -> y``):
    the input letters are those ``x`` and ``W`` share, the output letters the rest
    of ``W``'s, and a new letter is the rank.

    >>> lora_equations("ble,ehk->blhk")
    ('ble,ez->blz', 'blz,zhk->blhk')
    >>> lora_equations("blhk,hke->ble")
    ('blhk,hkz->blz', 'blz,ze->ble')
    """
    ins, out = eq.replace(" ", "").split("->")
    xl, wl = ins.split(",")
    inl = "".join(c for c in wl if c in xl)
    outl = "".join(c for c in wl if c not in xl)
    rest = "".join(c for c in xl if c not in inl)
    z = next(c for c in "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in eq)
    return f"{xl},{inl}{z}->{rest}{z}", f"{rest}{z},{z}{outl}->{out}"


class Adapter(nnx.Module):
    """The low-rank adapter of one projection kernel: the factors ``lora_a``
    ``[*stack, *in, r]`` and ``lora_b`` ``[*stack, r, *out]`` (``nnx.LoRAParam``),
    ``scale`` (``alpha / r``) and ``dropout`` (an ``nnx.Dropout`` on the adapter's
    input, ``None`` at rate 0). ``kernel`` names the kernel attribute it adapts;
    ``op`` is the stock op it wraps (``"dot_general"`` or ``"einsum"``; ``None``
    on the reference models, whose ``project`` reads it).

    >>> layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> _ = lora(layer, rank=2, alpha=4.0, targets="kernel")
    >>> type(layer.kernel).__name__, type(layer.dot_general).__name__
    ('Param', 'Adapter')
    >>> layer.dot_general.lora_a.shape, layer.dot_general.lora_b.shape, layer.dot_general.scale
    ((4, 2), (2, 3), 2.0)
    """

    def __init__(self, lora_a: nnx.LoRAParam[Any], lora_b: nnx.LoRAParam[Any], *, scale: float,
                 n_in: int, kernel: str, op: str | None = None, inner: Any = None,
                 dropout: nnx.Dropout | None = None) -> None:
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.scale = float(scale)
        self.n_in = int(n_in)
        self.kernel = str(kernel)
        self.op = op
        self.inner = inner  # the stock op this one wraps (static: a function)
        self.dropout: nnx.Dropout | None = nnx.data(dropout)

    @property
    def rank(self) -> int:
        """The adapter's rank ``r``."""
        return int(self.lora_a.shape[-1])

    def dropped(self, x: jax.Array, deterministic: bool | None = None) -> jax.Array:
        """``x`` through the adapter's dropout (``x`` itself at rate 0, in
        evaluation mode (``model.eval()``) or with ``deterministic=True``)."""
        if self.dropout is None:
            return x
        return self.dropout(x, deterministic=deterministic)

    def delta(self) -> jax.Array:
        """``scale * A @ B`` in the kernel's layout (float32 or wider): what
        :func:`merge_lora` adds to the kernel."""
        return _delta(self, self.lora_a[...], self.lora_b[...])

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        """The op it stands in for (``dot_general(x, w, dims, ...)`` or
        ``einsum(eq, x, w, ...)``: Flax's, or a :class:`~nnx_shard.tp_layers.ProjectionOp`
        that ``tp_layers.intercept`` put there) plus the adapter's term."""
        if self.op == "einsum":
            eq, x, w = args[:3]
            if "..." in eq or eq.count(",") != 1:  # fold it into the kernel instead
                return self.inner(eq, x, self._folded(w), *args[3:], **kwargs)
            y = self._base(eq, x, w, args[3:], kwargs)
            eq_a, eq_b = lora_equations(eq)
            a, b = self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype)
            h = jnp.einsum(eq_a, self.dropped(x), a) * jnp.asarray(self.scale, x.dtype)
            return y + jnp.einsum(eq_b, h, b).astype(y.dtype)
        x, w, dims = args[:3]
        (lc, rc), (lb, rb) = dims
        if lb or rb or tuple(rc) != tuple(range(self.n_in)):
            return self.inner(x, self._folded(w), dims, *args[3:], **kwargs)
        y = self._base(_dot_equation(x.ndim, w.ndim, tuple(lc), self.n_in), x, w, args[3:],
                       kwargs, dims)
        a, b = self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype)
        h = jax.lax.dot_general(self.dropped(x), a, ((tuple(lc), tuple(range(self.n_in))),
                                                     ((), ())))
        h = h * jnp.asarray(self.scale, x.dtype)
        d = jax.lax.dot_general(h, b, (((h.ndim - 1,), (0,)), ((), ())))
        return y + d.astype(y.dtype)

    def _base(self, eq: str, x: jax.Array, w: jax.Array, rest: tuple[Any, ...],
              kwargs: dict[str, Any], dims: Any = None) -> jax.Array:
        """The wrapped op on the kernel ``w``; on a quantized kernel read whole by the
        stock layer (and Flax's own op, no options), its codes contracted tile by tile
        (:meth:`~nnx_shard._quantized.QuantizedKernel.contract`) so the float kernel is
        never whole in memory: ``w`` is then unused and ``jit`` drops its dequantization."""
        source = read_whole(w)
        plain = self.inner in (jax.lax.dot_general, jnp.einsum) and not rest and not any(
            v is not None for v in kwargs.values())
        if source is not None and plain and x.dtype == w.dtype:
            return source.contract(eq, x, w.dtype)
        if dims is None:
            return self.inner(eq, x, w, *rest, **kwargs)
        return self.inner(x, w, dims, *rest, **kwargs)

    def _folded(self, w: jax.Array) -> jax.Array:
        return (w + self.delta().astype(w.dtype)).astype(w.dtype)


def _dot_equation(x_ndim: int, w_ndim: int, lc: tuple[int, ...], n_in: int) -> str:
    """The einsum of ``dot_general(x, w, ((lc, range(n_in)), ((), ())))``.

    >>> _dot_equation(3, 2, (2,), 1)
    'abc,cd->abd'
    """
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    xl = [next(letters) for _ in range(x_ndim)]
    wl = [xl[i] for i in lc] + [next(letters) for _ in range(w_ndim - n_in)]
    out = [c for i, c in enumerate(xl) if i not in lc] + wl[n_in:]
    return f"{''.join(xl)},{''.join(wl)}->{''.join(out)}"


def _nodes(model: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield from nnx.iter_graph(model)


def _owners(model: Any) -> dict[tuple[Any, ...], Any]:
    # iter_graph yields children before their parent: map every path first.
    return {tuple(p): n for p, n in _nodes(model)}


def _adapter_sites(model: Any) -> list[tuple[tuple[Any, ...], Any, str, Adapter]]:
    """``(kernel path, owner, attribute holding the adapter, adapter)`` of every adapter."""
    owners = _owners(model)
    out = []
    for path, node in owners.items():
        if isinstance(node, Adapter) and path:
            owner = owners.get(tuple(path[:-1]))
            out.append(((*path[:-1], node.kernel), owner, str(path[-1]), node))
    return out


def adapters(model: Any) -> dict[str, Adapter]:
    """The :class:`Adapter` of each adapted kernel of ``model``, by the kernel's path.

    >>> layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> list(adapters(lora(layer, 2, 4.0, targets="kernel")))
    ['kernel']
    """
    return {path_str(k): node for k, _, _, node in _adapter_sites(model)}


def kernel_axes(path: str, var: nnx.Variable[Any], owner: Any) -> tuple[int, int, tuple[Any, ...]]:
    """``(stack, n_in, names)`` of a kernel: its leading stacked axes, how many of
    the rest are input axes, and its logical names (Nones when unannotated).

    >>> lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> kernel_axes("kernel", lin.kernel, lin)
    (0, 1, (None, None))
    """
    shape = tuple(var.shape)
    names = logical_names(var, path) or (None,) * len(shape)
    stack = 0
    while stack < len(names) and names[stack] in _STACK:
        stack += 1
    rest = names[stack:]
    n = len(shape) - stack
    if isinstance(owner, nnx.LinearGeneral):
        n_in = len(owner.in_features)
        return stack, n_in, tuple(names)
    if n == 2:
        return stack, 1, tuple(names)
    if n == 3 and rest[-1] == "embed" and rest[0] != "embed":
        return stack, 2, tuple(names)  # e.g. attention out [heads, kv, embed]
    if n == 3 and rest[0] == "embed" and rest[-1] != "embed":
        return stack, 1, tuple(names)  # e.g. attention q/k/v [embed, heads, kv]
    raise ShardingError(
        f"lora: parameter {path!r} of shape {shape} (logical names {names}) is not a "
        "2-D-like projection kernel (input axes then output axes, e.g. [embed, mlp] or "
        "[embed, heads, kv]). Fix: narrow targets= to the projection kernels, e.g. "
        f"targets={DEFAULT_TARGETS!r} or r'kernel$'."
    )


def _spec_entries(var: nnx.Variable[Any]) -> tuple[Any, ...] | None:
    sharding = getattr(var.get_value(), "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec)
    return spec + (None,) * (len(var.shape) - len(spec))


def _factor_sharding(var: nnx.Variable[Any], keep: list[int], rank_at: int) -> Any:
    spec = _spec_entries(var)
    if spec is None:
        return None
    entries = [spec[i] for i in keep]
    entries.insert(rank_at, None)
    mesh = var.get_value().sharding.mesh
    return NamedSharding(mesh, PartitionSpec(*entries))


def _init_factors(key: jax.Array, var: nnx.Variable[Any], stack: int, n_in: int, rank: int,
                  dtype: Any) -> tuple[Any, Any]:
    shape = tuple(var.shape)
    st, ins, outs = shape[:stack], shape[stack:stack + n_in], shape[stack + n_in:]
    a_shape, b_shape = (*st, *ins, rank), (*st, rank, *outs)
    a_sh = _factor_sharding(var, list(range(stack + n_in)), stack + n_in)
    b_sh = _factor_sharding(var, [*range(stack), *range(stack + n_in, len(shape))], stack)
    fan_in = math.prod(ins)
    bound = 1.0 / math.sqrt(fan_in)  # PEFT: kaiming_uniform_(a=sqrt(5)) on [r, in]

    def make() -> tuple[jax.Array, jax.Array]:
        a = jax.random.uniform(key, a_shape, dtype, -bound, bound)
        return a, jnp.zeros(b_shape, dtype)

    if not isinstance(var.get_value(), jax.Array):  # an abstract model (eval_shape)
        return (jax.ShapeDtypeStruct(a_shape, dtype, sharding=a_sh),
                jax.ShapeDtypeStruct(b_shape, dtype, sharding=b_sh))
    if a_sh is None or b_sh is None:
        return make()
    return jax.jit(make, out_shardings=(a_sh, b_sh))()


def _stock(owner: Any, attr: str | int) -> tuple[str, str] | None:
    """``(attribute, kind)`` of the op an adapter of ``owner.attr`` stands in for, when
    ``owner`` is a stock layer and ``attr`` its kernel."""
    if attr != "kernel":
        return None
    for cls, op_attr, kind in _STOCK:
        if isinstance(owner, cls):
            return op_attr, kind
    return None


def _site(path: str, owner: Any, attr: str | int) -> tuple[str, str | None]:
    """Where the adapter of ``owner.attr`` goes: ``(attribute, stock op kind or None)``."""
    stock = _stock(owner, attr)
    if stock is not None:
        op_attr, kind = stock
        current = getattr(owner, op_attr, None)
        if isinstance(current, Adapter):
            raise NnxShardError(f"lora: {path!r} already has an adapter. "
                                "Fix: ns.merge_lora(model) first, or target other kernels.")
        if getattr(owner, "dot_general_cls", None) is not None:
            raise UsageError(
                f"lora: {path!r} belongs to a {type(owner).__name__} with a custom "
                "dot_general_cls, whose product the adapter cannot join. Fix: build the layer "
                "with its default dot_general, or narrow targets=.")
        return op_attr, kind
    if isinstance(owner, nnx.Module) and isinstance(attr, str) \
            and attr in getattr(type(owner), "lora_kernels", ()):
        return adapter_name(attr), None
    raise UsageError(
        f"lora: {path!r} belongs to a {type(owner).__name__}, which reads it itself: an adapter "
        "beside it would never be applied. Fix: adapt kernels of nnx.Linear / nnx.LinearGeneral "
        "/ nnx.Einsum or of the reference models (their projections), or narrow targets=.")


def adaptable_kernels(model: Any) -> tuple[dict[str, tuple[Any, str | int, Any]], set[str]]:
    """Projection-like Params of ``model`` by path, with their owner and attribute,
    and the paths of kernels already adapted.

    >>> found, done = adaptable_kernels(nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
    >>> sorted(found), done
    (['bias', 'kernel'], set())
    """
    owners = _owners(model)
    found: dict[str, tuple[Any, str | int, Any]] = {}
    done = {path_str(k) for k, _, _, _ in _adapter_sites(model)}
    for path, node in owners.items():
        if not isinstance(node, nnx.Param) or isinstance(node, nnx.LoRAParam) or not path:
            continue
        owner = owners.get(tuple(path[:-1]))
        if isinstance(owner, Adapter):
            continue
        found[path_str(path)] = (owner, path[-1], node)
    return found, done


def lora(model: Any, rank: int, alpha: float, *, targets: str = DEFAULT_TARGETS,
         dropout: float = 0.0, rngs: nnx.Rngs | int = 0, dtype: Any = jnp.float32,
         quantize: str | None = None, quant_block: int | None = BLOCK,
         double_quant: bool = False) -> Any:
    """Adds LoRA adapters in place to the kernels of ``model`` whose path matches
    the regex ``targets`` (``re.search`` on paths like ``blocks/0/attn/q``), and
    returns ``model``.

    Each projection ``x @ W`` becomes ``x @ W + (alpha / rank) * (dropout(x) @ A) @ B``
    with ``A`` ``[*in, rank]`` drawn as PEFT draws it (uniform, bound
    ``1/sqrt(fan_in)``) and ``B`` ``[rank, *out]`` zeros, so the adapted model starts
    equal to the base. ``W`` stays as it is; ``A`` and ``B`` are ``nnx.LoRAParam``
    (``dtype``, float32 by default) of an :class:`Adapter` beside it, named after
    the kernel's logical axes so they shard with it; on a sharded model they are
    created sharded. Works on the reference models (``attn/q|k|v|o``,
    ``mlp/gate|up|down``, ``unembed``; stacked blocks too), ``nnx.Linear``,
    ``nnx.LinearGeneral`` and ``nnx.Einsum``.

    ``dropout`` (PEFT's ``lora_dropout``) drops inputs of the adapter while the
    model trains (an ``nnx.Dropout``, on from the start; ``model.eval()`` turns it
    off, ``model.train()`` on again) and never in the reference models' decoding
    (generation); it draws from the ``dropout`` stream of ``rngs``. Blocks stacked
    for a scan take no dropout.

    ``quantize="nf4"`` (QLoRA's 4-bit NormalFloat), ``"int4"`` or ``"int8"``
    (needs the ``qlora`` extra, qwix) stores each adapted kernel's frozen ``W``
    quantized (a :class:`~nnx_shard._quantized.QuantizedKernel` keeping the
    kernel's logical names) with float32 absmax scales per ``quant_block`` (64)
    entries of its last input axis and output channel, or per output channel with
    ``quant_block=None``; ``double_quant=True`` stores those scales in 8 bits too.
    The reference models' projections dequantize it tile by tile inside the matmul, and so
    do stock layers running Flax's own op on the kernel in its dtype (their adapter
    contracts the codes; ``jit`` drops the layer's unused whole ``kernel[...]`` read).

    Args:
      model: any NNX model (a reference model, or one holding ``nnx.Linear``,
        ``nnx.LinearGeneral`` or ``nnx.Einsum`` layers), concrete or sharded; changed
        in place.
      rank: the adapters' rank ``r``, a positive int.
      alpha: the scale's numerator: the update is scaled by ``alpha / rank``, as PEFT's
        ``lora_alpha`` (for rsLoRA's ``alpha / sqrt(rank)``, pass ``alpha * sqrt(rank)``).
      targets: a regex searched in the kernels' paths (``blocks/0/attn/q``,
        ``unembed``, ``token_embed``, ``.../kernel``); default ``attn/(q|v)$``, the
        projections PEFT adapts in a Llama by default.
      dropout: the probability of dropping each input of the adapter while training,
        in ``[0, 1)``; 0 on stacked blocks.
      rngs: an ``nnx.Rngs`` or an int seed: ``params`` draws ``A``, ``dropout`` the
        masks.
      dtype: the factors' float dtype (float32 by default, whatever the kernel's).
      quantize: ``None`` (the base stays as it is), ``"nf4"``, ``"int4"`` or ``"int8"``.
      quant_block: entries of the last input axis per scale (64), or ``None`` for one
        scale per output channel; it must divide that axis.
      double_quant: store the block scales as int8 in groups of up to 256, each group
        with a float32 scale.

    Returns:
      ``model``, with the adapters added.

    Raises:
      UsageError: a ``rank``, ``alpha``, ``dropout``, ``rngs``, ``dtype``,
        ``quantize`` or ``quant_block`` out of range, a ``targets`` that is not a regex
        or matches no kernel (the paths listed), ``dropout`` on stacked blocks.
      NnxShardError: a matched kernel already has an adapter, or ``quantize`` without
        qwix installed (``pip install 'nnx_shard[qlora]'``).
      ShardingError: a matched parameter is not a float kernel.

    >>> from flax import nnx
    >>> import optax
    >>> from nnx_shard import lora
    >>> from nnx_shard.models import Decoder, get_config
    >>> model = Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))
    >>> _ = lora(model, rank=4, alpha=8.0, targets=r"attn/(q|v)$")
    >>> model.blocks[0].attn.lora_q.lora_a.get_metadata("out_sharding")
    ('embed', None)
    >>> opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)  # adapters only
    >>> qlayer = lora(nnx.Linear(128, 4, rngs=nnx.Rngs(0)), 2, 4.0, targets="kernel",
    ...               quantize="nf4", double_quant=True)  # QLoRA's base: NF4, block 64
    >>> qlayer.kernel.qtype, qlayer.kernel.scale.shape, str(qlayer.kernel.scale.dtype)
    ('nf4', (2, 4), 'int8')
    """
    r, a, p = check_scalars(rank, alpha, dropout)
    quant = check_quantize(quantize, quant_block, double_quant)
    if quant is not None:
        qwix_module()
    rx = check_targets(targets)
    rngs = as_rngs(rngs)
    dt = check_dtype(dtype)
    found, done = adaptable_kernels(model)
    again = sorted(q for q in done if rx.search(q))
    if again:
        raise NnxShardError(
            f"lora: {len(again)} kernel(s) matching targets {targets!r} already have adapters "
            f"(e.g. {again[0]!r}). Fix: ns.merge_lora(model) first, or target other kernels.")
    matched = {q: v for q, v in found.items() if rx.search(q)}
    if not matched:
        known = sorted(found)
        shown = ", ".join(known[:12]) + (f", ... ({len(known)} in all)" if len(known) > 12 else "")
        raise UsageError(
            f"lora: no parameter path matches targets {targets!r}. Parameter paths: "
            f"{shown or '(none)'}. Fix: a regex searched in these paths, e.g. "
            r"targets=r'attn/(q|v)$' or r'kernel$'.")
    found_axes = []
    for path, (owner, attr, var) in matched.items():
        if not jnp.issubdtype(var.dtype, jnp.floating):
            raise ShardingError(f"lora: parameter {path!r} has dtype {var.dtype}, not a float "
                                "kernel. Fix: narrow targets= to the projection kernels.")
        found_axes.append((path, owner, attr, var, *kernel_axes(path, var, owner)))
    # Every kernel's axes are checked before any owner is (a clearer error first).
    plans = [(*plan, *_site(plan[0], plan[1], plan[2])) for plan in found_axes]
    stacked = [q for q, *_, stack, _, _, _, _ in plans if stack]
    if p and stacked:
        raise UsageError(
            f"lora: dropout={p} on stacked (scanned) blocks ({stacked[0]!r}): the scan would "
            "draw the same mask at every step. Fix: dropout=0.0, or build the model with "
            "scan_layers=False.")
    check_blocks(quant, [(q, tuple(var.shape), stack, n_in)
                         for q, _, _, var, stack, n_in, *_ in plans])
    for _, owner, attr, var, stack, n_in, names, where, op in plans:
        a_val, b_val = _init_factors(rngs.params(), var, stack, n_in, r, dt)
        a_names = (*names[:stack + n_in], None)
        b_names = (*names[:stack], None, *names[stack + n_in:])
        meta = {"eager_sharding": False}
        la = nnx.LoRAParam(a_val, out_sharding=a_names, **meta)
        lb = nnx.LoRAParam(b_val, out_sharding=b_names, **meta)
        drop = nnx.Dropout(p, rngs=rngs) if p else None
        # LinearGeneral's dot_general defaults to None, which it reads as lax.dot_general.
        inner = (getattr(owner, where) or jax.lax.dot_general) if op is not None else None
        node = Adapter(la, lb, scale=a / r, n_in=n_in, kernel=str(attr), op=op, inner=inner,
                       dropout=drop)
        if quant is not None:
            _replace(owner, attr, quantize_kernel(var, quant, stack=stack, n_in=n_in,
                                                  names=names))
        setattr(owner, where, nnx.data(node))
    return model


def _replace(owner: Any, attr: str | int, node: Any) -> None:
    if isinstance(owner, nnx.Module) and isinstance(attr, str):
        setattr(owner, attr, node)
    else:
        owner[attr] = node


def merge_lora(model: Any) -> Any:
    """Folds every adapter into its kernel, ``W <- W + (alpha / rank) * A @ B`` in
    the kernel's dtype and sharding, and removes the adapters (the parameter paths
    are the base model's again, so ``ns.hf.save_safetensors`` exports a plain
    checkpoint). Returns ``model``. A quantized base (``lora(..., quantize=)``) is
    dequantized first: the merged kernel is a full-precision ``nnx.Param`` again
    (the quantization error stays in it; quantize the merged model anew if needed).

    Args:
      model: a model with adapters (from :func:`lora` or ``ns.hf.load_lora``), holding
        values (not abstract); changed in place. Parameters trained in full beside the
        adapters (PEFT's ``modules_to_save``) become ``nnx.Param`` again.

    Returns:
      ``model``, merged.

    Raises:
      NnxShardError: the model has no adapters, or is abstract.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import numpy as np
    >>> from nnx_shard import lora, merge_lora
    >>> layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> _ = lora(layer, 2, 4.0, targets="kernel")
    >>> layer.dot_general.lora_b[...] = jnp.ones((2, 3))
    >>> y = layer(jnp.ones((1, 4)))
    >>> _ = merge_lora(layer)
    >>> sorted(nnx.state(layer)), bool(np.allclose(layer(jnp.ones((1, 4))), y, atol=1e-5))
    (['bias', 'kernel'], True)
    """
    sites = _adapter_sites(model)
    if not sites:
        raise NnxShardError("merge_lora: the model has no LoRA adapters. "
                            "Fix: add them with ns.lora(model, rank, alpha) or ns.hf.load_lora.")
    for _, owner, _, node in sites:
        base = getattr(owner, node.kernel)
        w = base.qvalue.get_value() if isinstance(base, QuantizedKernel) else base.get_value()
        if not isinstance(w, jax.Array):
            raise NnxShardError("merge_lora: the model is abstract (nnx.eval_shape): there are "
                                "no values to merge. Fix: merge a model with values.")
    for _, owner, where, node in sites:
        base = getattr(owner, node.kernel)
        w = base.qvalue.get_value() if isinstance(base, QuantizedKernel) else base.get_value()

        def fold(base: Any, a: jax.Array, b: jax.Array, node: Adapter = node) -> jax.Array:
            w = base[...]
            d = _delta(node, a, b)
            return (w.astype(jnp.promote_types(w.dtype, d.dtype)) + d).astype(w.dtype)

        out_sh = w.sharding if isinstance(w.sharding, NamedSharding) else None
        new = nnx.jit(fold, out_shardings=out_sh)(base, node.lora_a.get_value(),
                                                  node.lora_b.get_value())
        if isinstance(base, QuantizedKernel):
            setattr(owner, node.kernel, nnx.Param(
                new, out_sharding=base.qvalue.get_metadata().get("out_sharding"),
                eager_sharding=False))
        else:
            base.set_value(new)
        delattr(owner, where)
        if node.op is not None:
            setattr(owner, where, nnx.static(node.inner))
    # Parameters trained in full beside the adapters (PEFT's modules_to_save, which
    # ns.hf.load_lora makes LoRAParam) are base weights again once merged.
    owners = _owners(model)
    for path, node in owners.items():
        if isinstance(node, nnx.LoRAParam) and path:
            _replace(owners[tuple(path[:-1])], path[-1],
                     nnx.Param(node.get_value(), **node.get_metadata()))
    return model


def without_adapters(model: Any) -> Any:
    """The base model under ``model``'s adapters: a new graph over the same arrays (no
    weight is copied, inside ``jit`` or out) with every :class:`Adapter` taken out, so its
    projections compute ``x @ W`` alone (no adapter matmul at all). ``model`` is left as it
    is; the result is for reading (e.g. DPO's reference forward inside the training step,
    under ``jax.lax.stop_gradient``), not for training.

    Raises:
      NnxShardError: ``model`` has no adapters.
      UsageError: ``model`` holds parameters trained in full beside its adapters (PEFT's
        ``modules_to_save``, ``nnx.LoRAParam`` outside an adapter): their base values
        are gone, so the base model cannot be read.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> x, y = jnp.ones((1, 4)), layer(jnp.ones((1, 4)))
    >>> _ = lora(layer, 2, 4.0, targets="kernel")
    >>> layer.dot_general.lora_b[...] = jnp.ones((2, 3))
    >>> base = without_adapters(layer)
    >>> bool(jnp.array_equal(base(x), y)), bool(jnp.array_equal(layer(x), y))
    (True, False)
    """
    if not _adapter_sites(model):
        raise NnxShardError("without_adapters: the model has no LoRA adapters to switch off. "
                            "Fix: add them with ns.lora(model, rank, alpha) or ns.hf.load_lora.")
    owners = _owners(model)
    full = sorted(path_str(p) for p, n in owners.items() if isinstance(n, nnx.LoRAParam) and p
                  and not isinstance(owners.get(tuple(p[:-1])), Adapter))
    if full:
        raise UsageError(
            f"without_adapters: {full[0]!r} ({len(full)} in all) is trained in full beside the "
            "adapters (PEFT's modules_to_save), so the base model's value of it is gone. Fix: "
            "adapters alone (no modules_to_save), or a frozen copy of the base as the "
            "reference.")
    base = nnx.merge(*nnx.split(model))
    for _, owner, where, node in _adapter_sites(base):
        delattr(owner, where)
        if node.op is not None:  # a stock layer: its own op again
            setattr(owner, where, nnx.static(node.inner))
    return base


def _delta(node: Adapter, a: jax.Array, b: jax.Array) -> jax.Array:
    # Inside a scan over stacked blocks the leading axes are sliced off: count them.
    n_in = node.n_in
    s = a.ndim - n_in - 1
    n_out = b.ndim - s - 1
    letters = "abcdefghijklmnopq"
    st, ins, outs = letters[:s], letters[s:s + n_in], letters[s + n_in:s + n_in + n_out]
    dt = jnp.promote_types(a.dtype, jnp.float32)
    return jnp.einsum(f"{st}{ins}z,{st}z{outs}->{st}{ins}{outs}", a.astype(dt),
                      b.astype(dt)) * jnp.asarray(node.scale, dt)
