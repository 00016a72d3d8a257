"""Low-rank adapters (LoRA) on the projections of any NNX model.

:func:`lora` replaces each matching projection kernel ``W`` by an
:class:`Adapted` node holding ``W`` (as ``base``) and two ``nnx.LoRAParam``
factors ``lora_a`` and ``lora_b``; reading it (``kernel[...]``, as the reference
models and ``nnx.Linear`` do) gives ``W + (alpha / rank) * A @ B`` in the
kernel's own layout, so no model code changes. The factors carry logical names
derived from the kernel's (A: its input axes and an unsharded rank axis; B: the
rank axis and its output axes), so every preset shards them with their layer.
Train only them with ``wrt=nnx.LoRAParam``; :func:`merge_lora` folds them back.
With ``quantize="int8" | "int4"`` the frozen ``W`` is stored quantized (QLoRA,
:mod:`nnx_shard._quantized`) and dequantized where the layer reads it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard._annotate import logical_names, path_str
from nnx_shard._errors import NnxShardError, ShardingError, UsageError, count, short
from nnx_shard._quantized import QuantizedKernel, check_quantize, quantize_kernel, qwix_module

__all__ = ["DEFAULT_TARGETS", "Adapted", "adapters", "lora", "merge_lora"]

#: The projections PEFT adapts in a Llama by default (``q_proj``, ``v_proj``).
DEFAULT_TARGETS = r"attn/(q|v)$"
_STACK = ("layers",)  # leading logical axes of stacked (scanned) blocks


class Adapted(nnx.Module):
    """A projection kernel with a low-rank adapter: reads as
    ``base + scale * A @ B`` in the kernel's layout (``[*stack, *in, *out]``).

    >>> layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> _ = lora(layer, rank=2, alpha=4.0, targets="kernel")
    >>> type(layer.kernel).__name__, layer.kernel.shape, layer.kernel.lora_a.shape
    ('Adapted', (4, 3), (4, 2))
    """

    def __init__(self, base: nnx.Variable[Any] | QuantizedKernel, lora_a: nnx.LoRAParam[Any],
                 lora_b: nnx.LoRAParam[Any], *, scale: float, stack: int, n_in: int) -> None:
        self.base = base
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.scale = float(scale)
        self.stack = int(stack)
        self.n_in = int(n_in)

    @property
    def rank(self) -> int:
        """The adapter's rank ``r``."""
        return int(self.lora_a.shape[-1])

    def delta(self) -> jax.Array:
        """``scale * A @ B`` in the kernel's layout (float32 or wider)."""
        return _delta(self, self.lora_a[...], self.lora_b[...])

    def merged(self) -> jax.Array:
        """The adapted kernel ``base + scale * A @ B`` (in the wider of the two dtypes)."""
        w = self.base[...]
        d = self.delta()
        dt = jnp.promote_types(w.dtype, self.lora_a.dtype)
        return w.astype(dt) + d.astype(dt)

    def __getitem__(self, key: Any) -> jax.Array:
        return self.merged()[key]

    @property
    def value(self) -> jax.Array:
        return self.merged()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def ndim(self) -> int:
        return len(self.base.shape)

    @property
    def dtype(self) -> Any:
        return self.base.dtype

    def get_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The base kernel's metadata (its logical names)."""
        return self.base.get_metadata(*args, **kwargs)


def _nodes(model: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield from nnx.iter_graph(model)


def _owners(model: Any) -> dict[tuple[Any, ...], Any]:
    # iter_graph yields children before their parent: map every path first.
    return {tuple(p): n for p, n in _nodes(model)}


def adapters(model: Any) -> dict[str, Adapted]:
    """The :class:`Adapted` kernels of ``model`` by path.

    >>> layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> list(adapters(lora(layer, 2, 4.0, targets="kernel")))
    ['kernel']
    """
    return {path_str(p): n for p, n in _nodes(model) if isinstance(n, Adapted)}


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


def _check_scalars(rank: Any, alpha: Any, dropout: Any) -> tuple[int, float]:
    r = count(rank, "lora rank", fix="e.g. ns.lora(model, rank=8, alpha=16)")
    if isinstance(alpha, bool | np.bool_) or not isinstance(alpha, int | float | np.number) \
            or not math.isfinite(float(alpha)):
        raise UsageError(f"lora alpha must be a finite number, got {short(alpha, 60)} "
                         f"({type(alpha).__name__}). Fix: e.g. alpha=16 (the update is "
                         "scaled by alpha / rank, as PEFT does)")
    if isinstance(dropout, bool | np.bool_) or not isinstance(dropout, int | float | np.number) \
            or float(dropout) != 0.0:
        raise UsageError(
            f"lora dropout must be 0.0, got {short(dropout, 60)}: the adapter is folded into "
            "the kernel where the layer reads it, so there is no separate adapter input to "
            "drop. Fix: dropout=0.0 (regularise with weight decay on the adapters instead)")
    return r, float(alpha)


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


def adaptable_kernels(model: Any) -> tuple[dict[str, tuple[Any, str | int, Any]], set[str]]:
    """Projection-like Params of ``model`` by path, with their owner and attribute,
    and the paths of kernels already adapted.

    >>> found, done = adaptable_kernels(nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
    >>> sorted(found), done
    (['bias', 'kernel'], set())
    """
    owners = _owners(model)
    found: dict[str, tuple[Any, str | int, Any]] = {}
    done: set[str] = set()
    for path, node in owners.items():
        if isinstance(node, Adapted):
            done.add(path_str(path))
        if not isinstance(node, nnx.Param) or isinstance(node, nnx.LoRAParam) or not path:
            continue
        owner = owners.get(tuple(path[:-1]))
        if isinstance(owner, Adapted):
            continue
        found[path_str(path)] = (owner, path[-1], node)
    return found, done


def lora(model: Any, rank: int, alpha: float, *, targets: str = DEFAULT_TARGETS,
         dropout: float = 0.0, rngs: nnx.Rngs | int = 0, dtype: Any = jnp.float32,
         quantize: str | None = None) -> Any:
    """Adds LoRA adapters in place to the kernels of ``model`` whose path matches
    the regex ``targets`` (``re.search`` on paths like ``blocks/0/attn/q``), and
    returns ``model``.

    Each kernel ``W`` becomes ``W + (alpha / rank) * A @ B`` with ``A``
    ``[*in, rank]`` drawn as PEFT draws it (uniform, bound ``1/sqrt(fan_in)``) and
    ``B`` ``[rank, *out]`` zeros, so the adapted model starts equal to the base.
    ``A`` and ``B`` are ``nnx.LoRAParam`` (``dtype``, float32 by default), named
    after the kernel's logical axes so they shard with it; on a sharded model they
    are created sharded. Works on the reference models (``attn/q|k|v|o``,
    ``mlp/up|gate|down``, stacked blocks too), ``nnx.Linear`` and
    ``nnx.LinearGeneral``, and any layer that reads its kernel with ``[...]``.

    ``quantize="int8"`` or ``"int4"`` (QLoRA; needs the ``qlora`` extra, qwix)
    stores each adapted kernel's frozen ``W`` quantized, with absmax scales per
    output channel (a :class:`~nnx_shard._quantized.QuantizedKernel` keeping the
    kernel's logical names; its scales carry the output axes' names), and
    dequantizes it where the layer reads it, shard by shard.

    >>> import optax
    >>> from nnx_shard.models import Llama, get_config
    >>> model = Llama(get_config("llama-tiny"), rngs=nnx.Rngs(0))
    >>> _ = lora(model, rank=4, alpha=8.0, targets=r"attn/(q|v)$")
    >>> model.blocks[0].attn.q.lora_a.get_metadata("out_sharding")
    ('embed', None)
    >>> opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)  # adapters only
    """
    r, a = _check_scalars(rank, alpha, dropout)
    quant = check_quantize(quantize)
    if quant is not None:
        qwix_module()
    if not isinstance(targets, str):
        raise UsageError(f"lora targets must be a regex string, got {short(targets, 60)} "
                         f"({type(targets).__name__}). Fix: e.g. targets=r'attn/(q|v)$'")
    try:
        rx = re.compile(targets)
    except re.error as e:
        raise UsageError(f"lora targets {targets!r} is not a regex ({e}). "
                         "Fix: e.g. targets=r'attn/(q|v)$'") from e
    if isinstance(rngs, int) and not isinstance(rngs, bool):
        rngs = nnx.Rngs(rngs)
    if not isinstance(rngs, nnx.Rngs):
        raise UsageError(f"lora rngs must be an nnx.Rngs or an int seed, got {short(rngs, 60)}. "
                         "Fix: e.g. rngs=0")
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise UsageError(f"lora dtype {short(dtype, 60)} is not a dtype. "
                         "Fix: e.g. dtype=jnp.float32") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise UsageError(f"lora dtype must be a float type, got {dt}. Fix: dtype=jnp.float32")
    found, done = adaptable_kernels(model)
    again = sorted(p for p in done if rx.search(p))
    if again:
        raise NnxShardError(
            f"lora: {len(again)} kernel(s) matching targets {targets!r} already have adapters "
            f"(e.g. {again[0]!r}). Fix: ns.merge_lora(model) first, or target other kernels.")
    matched = {p: v for p, v in found.items() if rx.search(p)}
    if not matched:
        known = sorted(found)
        shown = ", ".join(known[:12]) + (f", ... ({len(known)} in all)" if len(known) > 12 else "")
        raise UsageError(
            f"lora: no parameter path matches targets {targets!r}. Parameter paths: "
            f"{shown or '(none)'}. Fix: a regex searched in these paths, e.g. "
            r"targets=r'attn/(q|v)$' or r'kernel$'.")
    plans = []
    for path, (owner, attr, var) in matched.items():
        if not jnp.issubdtype(var.dtype, jnp.floating):
            raise ShardingError(f"lora: parameter {path!r} has dtype {var.dtype}, not a float "
                                "kernel. Fix: narrow targets= to the projection kernels.")
        plans.append((path, owner, attr, var, *kernel_axes(path, var, owner)))
    for _, owner, attr, var, stack, n_in, names in plans:
        a_val, b_val = _init_factors(rngs.params(), var, stack, n_in, r, dt)
        a_names = (*names[:stack + n_in], None)
        b_names = (*names[:stack], None, *names[stack + n_in:])
        meta = {"eager_sharding": False}
        la = nnx.LoRAParam(a_val, out_sharding=a_names, **meta)
        lb = nnx.LoRAParam(b_val, out_sharding=b_names, **meta)
        base: Any = var if quant is None else quantize_kernel(var, quant, stack=stack,
                                                              n_in=n_in, names=names)
        node = Adapted(base, la, lb, scale=a / r, stack=stack, n_in=n_in)
        _replace(owner, attr, node)
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

    >>> import numpy as np
    >>> layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> _ = lora(layer, 2, 4.0, targets="kernel")
    >>> layer.kernel.lora_b[...] = jnp.ones((2, 3))
    >>> y = layer(jnp.ones((1, 4)))
    >>> _ = merge_lora(layer)
    >>> type(layer.kernel).__name__, bool(np.allclose(layer(jnp.ones((1, 4))), y, atol=1e-5))
    ('Param', True)
    """
    owners = _owners(model)
    todo = []
    for path, node in owners.items():
        if isinstance(node, Adapted):
            todo.append((owners.get(tuple(path[:-1])), path[-1], node))
    if not todo:
        raise NnxShardError("merge_lora: the model has no LoRA adapters. "
                            "Fix: add them with ns.lora(model, rank, alpha) or ns.hf.load_lora.")
    for owner, attr, node in todo:
        base = node.base
        w = base.qvalue.get_value() if isinstance(base, QuantizedKernel) else base.get_value()
        if not isinstance(w, jax.Array):
            raise NnxShardError("merge_lora: the model is abstract (nnx.eval_shape): there are "
                                "no values to merge. Fix: merge a model with values.")

        def fold(base: Any, a: jax.Array, b: jax.Array, node: Adapted = node) -> jax.Array:
            w = base[...]
            d = _delta(node, a, b)
            return (w.astype(jnp.promote_types(w.dtype, d.dtype)) + d).astype(w.dtype)

        out_sh = w.sharding if isinstance(w.sharding, NamedSharding) else None
        new = nnx.jit(fold, out_shardings=out_sh)(base, node.lora_a.get_value(),
                                                  node.lora_b.get_value())
        if isinstance(base, QuantizedKernel):
            base = nnx.Param(new, out_sharding=base.qvalue.get_metadata().get("out_sharding"),
                             eager_sharding=False)
        else:
            base.set_value(new)
        _replace(owner, attr, base)
    return model


def _delta(node: Adapted, a: jax.Array, b: jax.Array) -> jax.Array:
    # Inside a scan over stacked blocks the leading axes are sliced off: count them.
    n_in = node.n_in
    s = a.ndim - n_in - 1
    n_out = b.ndim - s - 1
    letters = "abcdefghijklmnopq"
    st, ins, outs = letters[:s], letters[s:s + n_in], letters[s + n_in:s + n_in + n_out]
    dt = jnp.promote_types(a.dtype, jnp.float32)
    return jnp.einsum(f"{st}{ins}z,{st}z{outs}->{st}{ins}{outs}", a.astype(dt),
                      b.astype(dt)) * jnp.asarray(node.scale, dt)
