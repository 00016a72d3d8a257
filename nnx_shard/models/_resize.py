"""A model's vocabulary resized in place, as transformers' ``resize_token_embeddings``
does it: the token embedding ``token_embed [vocab, embed]`` and the output projection
``unembed [embed, vocab]`` (absent when tied) grow or shrink at the end, new rows are
drawn around the old rows' mean, and the config's ``vocab`` follows. LoRA adapters on
either table (:func:`nnx_shard.lora`) have their vocabulary factor resized with it,
new tokens' rows zero. Each resized parameter keeps its layout on its mesh (or takes
the one the given rules resolve for the new shape), so a sharded model stays sharded;
a table its devices' memory cannot hold is refused before anything changes."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._annotate import logical_names
from nnx_shard._axes import entry_axes, mesh_sizes
from nnx_shard._errors import NnxShardError, ShardingError, UsageError, count, flag, short
from nnx_shard._init import auto_typed_mesh, rewrap, tables
from nnx_shard._low_rank import Adapter, adapter_name
from nnx_shard._mesh import nbytes
from nnx_shard._quantized import QuantizedKernel

__all__ = ["memory_shortfall", "resize_token_embeddings"]

#: Transformers scales the old rows' covariance by this before sampling new rows
#: (``_init_added_embeddings_weights_with_mean``): new rows sit very near the mean.
COVARIANCE_SCALE = 1e-9
#: ``initializer_range`` of transformers' configs when the source gives none: the
#: standard deviation of new rows with ``mean_resizing=False``.
INITIALIZER_RANGE = 0.02

#: The most ids a vocabulary can have: the models take int32 token ids.
MAX_VOCAB = 2**31 - 1

_WHO = "resize_token_embeddings"
_MODEL_FIX = ("Fix: pass a model with a token_embed [vocab, embed] parameter and a cfg with "
              "a vocab field, e.g. ns.models.Decoder.")
#: What each resized table's rows start as: the ``mean_resizing`` draw, or zeros (a
#: LoRA factor: the adapter adds nothing to a new token until it is trained).
_DRAWN, _ZEROS = "drawn", "zeros"


def _fields(cfg: Any) -> set[str]:
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name for f in dataclasses.fields(cfg)}
    return set()


def _check_model(model: Any) -> tuple[nnx.Param[Any], nnx.Param[Any] | None, Any]:
    """``(token_embed, unembed or None, cfg)`` of ``model``, or a UsageError naming it."""
    cfg: Any = getattr(model, "cfg", None)
    embed = getattr(model, "token_embed", None)
    for name, var in (("token_embed", embed), ("unembed", getattr(model, "unembed", None))):
        if isinstance(model, nnx.Module) and isinstance(var, QuantizedKernel):
            raise UsageError(
                f"{_WHO}: model's {name} is quantized ({var.qtype} codes with their scales, "
                "from ns.lora(..., quantize=)), whose rows cannot be drawn anew. Fix: resize "
                "before ns.lora, or ns.merge_lora(model) first (a full-precision table), "
                "resize, then ns.lora again.")
    if not isinstance(model, nnx.Module) or not isinstance(embed, nnx.Param):
        raise UsageError(f"{_WHO}: model must have a token embedding, got "
                         f"{type(model).__name__} {short(model, 60)}, which has no "
                         f"token_embed nnx.Param. {_MODEL_FIX}")
    if "vocab" not in _fields(cfg):
        raise UsageError(f"{_WHO}: model {type(model).__name__} has no cfg with a vocab field "
                         f"(cfg is {short(cfg, 60)}). {_MODEL_FIX}")
    head = getattr(model, "unembed", None)
    if head is not None and not isinstance(head, nnx.Param):
        raise UsageError(f"{_WHO}: model's unembed is a {type(head).__name__}, not an nnx.Param "
                         f"[embed, vocab]. {_MODEL_FIX}")
    for name, var, axis in (("token_embed", embed, 0), ("unembed", head, 1)):
        if var is None:
            continue
        value = var.get_value()
        if not isinstance(value, jax.Array) or value.ndim != 2 or (
                value.shape[axis] != cfg.vocab):
            raise UsageError(
                f"{_WHO}: model's {name} is {type(value).__name__} of shape "
                f"{getattr(value, 'shape', None)}, not an array with {cfg.vocab} (cfg.vocab) "
                f"on axis {axis}. {_MODEL_FIX} An abstract model (abstract_init) holds no "
                "values: resize the loaded one.")
    return embed, head, cfg


def _adapter_factors(model: Any, vocab: int) -> list[tuple[str, nnx.Variable[Any], int]]:
    """``(path, factor, vocab axis)`` of the LoRA factors that carry the vocabulary:
    ``A [vocab, r]`` of an adapter on ``token_embed`` (the rows its lookup reads),
    ``B [r, vocab]`` of one on ``unembed`` (the logits' columns)."""
    out = []
    for kernel, factor, axis in (("token_embed", "lora_a", 0), ("unembed", "lora_b", 1)):
        node = getattr(model, adapter_name(kernel), None)
        if node is None:
            continue
        path = f"{adapter_name(kernel)}/{factor}"
        var = getattr(node, factor, None) if isinstance(node, Adapter) else None
        value = var.get_value() if isinstance(var, nnx.Variable) else None
        if not isinstance(var, nnx.Variable) or not isinstance(value, jax.Array) or (
                value.ndim != 2 or value.shape[axis] != vocab):
            raise UsageError(
                f"{_WHO}: model's LoRA adapter {path} is {type(value).__name__} of shape "
                f"{getattr(value, 'shape', None)}, not an array with {vocab} (cfg.vocab) on "
                f"axis {axis}. Fix: ns.merge_lora(model) first, resize, then ns.lora again.")
        out.append((path, var, axis))
    return out


def _host_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - no sysconf
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def memory_shortfall(need: Mapping[Any, int]) -> str | None:
    """What is short when each device of ``need`` must take that many more bytes, or
    None when they fit: a device that reports its memory (a GPU or TPU) has
    ``bytes_limit - bytes_in_use`` free; CPU devices share the host's memory (all
    of it counted: a bound past which the allocation cannot succeed).

    >>> import jax
    >>> memory_shortfall({jax.devices()[0]: 1 << 20}) is None
    True
    >>> "more than" in memory_shortfall({jax.devices()[0]: 1 << 62})
    True
    """
    shared = 0
    for device, n in need.items():
        stats = device.memory_stats() if callable(getattr(device, "memory_stats", None)) else None
        limit = (stats or {}).get("bytes_limit")
        if not isinstance(limit, int):
            shared += n
            continue
        free = limit - int((stats or {}).get("bytes_in_use", 0))
        if n > free:
            return (f"{_gib(n)} on {device}, more than its {_gib(free)} free "
                    f"(of {_gib(limit)})")
    host = _host_memory()
    if host is not None and shared > host:
        return f"{_gib(shared)} in all, more than this host's {_gib(host)} of memory"
    return None


def _new_size(old: int, new_vocab: Any, pad_to_multiple_of: Any) -> int:
    multiple = None if pad_to_multiple_of is None else count(
        pad_to_multiple_of, "pad_to_multiple_of", fix="e.g. pad_to_multiple_of=64")
    if new_vocab is None:
        if multiple is None:
            raise UsageError(f"{_WHO}: new_vocab is None and no pad_to_multiple_of: nothing to "
                             "resize. Fix: e.g. new_vocab=len(tokenizer) or "
                             "new_vocab=tokenizer.vocab_size")
        size = old
    else:
        size = count(new_vocab, "new_vocab", fix=f"e.g. new_vocab={old + 1}")
    if multiple is not None:
        size = -(-size // multiple) * multiple
    if size > MAX_VOCAB:
        padded = "" if multiple is None else f" (padded to a multiple of {multiple})"
        raise UsageError(f"{_WHO}: new_vocab {size}{padded} is more ids than int32 token "
                         f"ids address ({MAX_VOCAB}). Fix: the tokenizer's size, e.g. "
                         "new_vocab=tokenizer.vocab_size")
    return size


def _mean_rows(old: jax.Array, added: int, key: jax.Array) -> jax.Array:
    """``added`` rows drawn from a normal with the mean of ``old``'s rows and
    ``COVARIANCE_SCALE`` times their covariance; the mean itself where that covariance
    is not positive definite (as transformers: its Cholesky fails)."""
    x = old.astype(jnp.float32)
    mean = jnp.mean(x, axis=0)
    centered = x - mean
    cov = jnp.matmul(centered.T, centered, precision=jax.lax.Precision.HIGHEST) / x.shape[0]
    tril = jnp.linalg.cholesky(COVARIANCE_SCALE * cov)
    definite = jnp.all(jnp.isfinite(tril))
    z = jax.random.normal(key, (added, x.shape[1]), jnp.float32)
    sampled = mean + jnp.matmul(z, jnp.where(definite, tril, 0.0).T,
                                precision=jax.lax.Precision.HIGHEST)
    return jnp.where(definite, sampled, jnp.broadcast_to(mean, sampled.shape))


def _resized(old: jax.Array, size: int, axis: int, fill: str, mean_resizing: bool, std: float,
             key: jax.Array) -> jax.Array:
    rows = old if axis == 0 else old.T
    n = rows.shape[0]
    if size <= n:
        out = rows[:size]
    else:
        added = size - n
        if fill == _ZEROS:
            new = jnp.zeros((added, rows.shape[1]), rows.dtype)
        elif mean_resizing:
            new = _mean_rows(rows, added, key)
        else:
            new = std * jax.random.normal(key, (added, rows.shape[1]), jnp.float32)
        out = jnp.concatenate([rows, new.astype(rows.dtype)], axis=0)
    return out if axis == 0 else out.T


def _spec(var: nnx.Variable[Any], name: str, shape: tuple[int, ...], axis: int, mesh: Any,
          old_spec: PartitionSpec, table: Any, size: int) -> PartitionSpec:
    """The layout of the resized ``var``: the rules' for the new shape, or else its own
    when its vocab axes divide the new size."""
    fix = "pass pad_to_multiple_of= a multiple of those devices"
    if table is not None:
        names = logical_names(var, name)
        if names is None:
            return old_spec
        try:
            return table.spec(names, shape=shape, mesh=mesh, path=name, allow_unconstrained=False)
        except ShardingError as e:
            raise ShardingError(f"{_WHO}: rules= cannot lay out {name} at the new vocab {size} "
                                f"(new_vocab, pad_to_multiple_of): {e} (Where the size does "
                                f"not divide: {fix}.)") from None
    entries = tuple(old_spec) + (None,) * (len(shape) - len(tuple(old_spec)))
    sizes = mesh_sizes(mesh)
    devices = int(np.prod([sizes[a] for a in entry_axes(entries[axis])], dtype=np.int64))
    if size % devices:
        raise ShardingError(
            f"{_WHO}: new vocab {size} (new_vocab, pad_to_multiple_of) does not divide over "
            f"the {devices} devices {name} {tuple(shape)} splits its vocab axis over "
            f"({old_spec}). Fix: {fix}, e.g. pad_to_multiple_of={devices}, or pass rules= "
            "to lay it out anew (a table with indivisible='replicate' replicates it).")
    return PartitionSpec(*entries)


def _std(model: Any) -> float:
    source = getattr(model, "hf_source", None)
    value = getattr(source, "config", {}).get("initializer_range") if source else None
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return INITIALIZER_RANGE


def resize_token_embeddings(model: Any, new_vocab: int | None, *,
                            pad_to_multiple_of: int | None = None, mean_resizing: bool = True,
                            seed: int = 0, rules: Any = None) -> Any:
    """Resizes ``model``'s vocabulary to ``new_vocab`` tokens in place and returns the
    model, as transformers' ``model.resize_token_embeddings(new_vocab,
    pad_to_multiple_of, mean_resizing)``: for tokens added to a tokenizer
    (``new_vocab=tokenizer.vocab_size``, which counts its added tokens), or to pad
    the vocabulary to a multiple of the devices that split it.

    The token embedding ``token_embed [vocab, embed]`` and, when the model has its
    own, the output projection ``unembed [embed, vocab]`` keep their first
    ``min(old, new)`` rows (columns); a tied model stays tied (one table). New rows
    are drawn from a normal with the old rows' mean and ``1e-9`` times their
    covariance (transformers' ``mean_resizing``: the new tokens' logits start near
    the old tokens' average, so the model's next-token distribution barely moves);
    where that covariance is not positive definite they are the mean. With
    ``mean_resizing=False`` they are ``normal(0, initializer_range)`` (the source
    checkpoint's ``initializer_range``, else 0.02). ``model.cfg.vocab`` becomes
    the new size, so :func:`nnx_shard.hf.save_safetensors` exports ``vocab_size``.

    Each resized parameter stays on its mesh in its layout; ``rules`` (a table or a
    strategy) lays it out anew for the new shape instead. A new size that its vocab
    axis's devices do not divide is a :class:`~nnx_shard.ShardingError`: pad it
    with ``pad_to_multiple_of``. Resize before making the optimizer: an optimizer
    state made earlier has the old shapes.

    LoRA adapters (:func:`nnx_shard.lora`) on ``token_embed`` or ``unembed`` are
    resized with their table: the factor that carries the vocabulary (``A [vocab,
    r]`` of the embedding's, ``B [r, vocab]`` of the head's) keeps its first rows
    (columns) and gets zeros for new tokens, so the adapter changes nothing for them
    until trained and the old tokens' outputs stay as they were; :func:`nnx_shard.merge_lora`
    folds it in at the new size. A quantized table (``lora(..., quantize=)``) is
    refused: merge first, or resize before adapting.

    The new tables' bytes are checked against the memory of the devices that will
    hold them (GPUs' free memory; CPU devices share the host's) before any is
    made, and the model changes only once all of them exist: a refused or failed
    resize leaves it as it was.

    Args:
      model: a :class:`~nnx_shard.models.Decoder` or :class:`~nnx_shard.models.Decoder`
        (any module with a ``token_embed`` parameter, an optional ``unembed`` and a
        dataclass ``cfg`` with a ``vocab`` field).
      new_vocab: the new number of tokens (smaller drops the last rows); ``None``
        with ``pad_to_multiple_of`` pads the current size.
      pad_to_multiple_of: round the size up to a multiple of this.
      mean_resizing: draw new rows around the old mean (default), or from
        ``normal(0, initializer_range)``.
      seed: the random draw's seed.
      rules: lay the resized parameters out by these rules (or a strategy's) on
        their mesh; default: keep each one's layout.

    Raises:
      UsageError: a bad argument (named), a model without a token embedding, a
        quantized table, or new tables that the devices' memory cannot hold.
      ShardingError: the new size does not divide over the devices of its axis.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, get_config, resize_token_embeddings
    >>> model = Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))
    >>> old = model.token_embed[...]
    >>> model = resize_token_embeddings(model, 131, pad_to_multiple_of=8)
    >>> model.cfg.vocab, model.token_embed.shape, model.unembed.shape
    (136, (136, 32), (32, 136))
    >>> bool(jnp.allclose(model.token_embed[128:], old.mean(0), atol=1e-3))
    True
    >>> import nnx_shard as ns
    >>> _ = ns.lora(model, rank=2, alpha=4.0, targets="unembed|token_embed")
    >>> model = resize_token_embeddings(model, 144)
    >>> model.lora_token_embed.lora_a.shape, model.lora_unembed.lora_b.shape
    ((144, 2), (2, 144))
    """
    embed, head, cfg = _check_model(model)
    size = _new_size(cfg.vocab, new_vocab, pad_to_multiple_of)
    mean_resizing = flag(mean_resizing, "mean_resizing")
    seed = count(seed, "seed", least=0, fix="e.g. seed=0")
    if seed >= 2**63:
        raise UsageError(f"{_WHO}: seed must be below 2**63 (jax.random.key takes an int64), "
                         f"got {seed}. Fix: e.g. seed=0")
    try:
        table = None if rules is None else tables(rules, None, _WHO)[0]
    except ShardingError as e:
        raise ShardingError(f"{_WHO}: rules= {e}") from None
    resized: list[tuple[str, nnx.Variable[Any], int, str]] = [
        (name, var, axis, _DRAWN)
        for name, var, axis in (("token_embed", embed, 0), ("unembed", head, 1))
        if var is not None]
    resized += [(*factor, _ZEROS) for factor in _adapter_factors(model, cfg.vocab)]
    if size == cfg.vocab:
        return model
    try:
        new_cfg = dataclasses.replace(cfg, vocab=size)
    except (ValueError, TypeError) as e:
        if isinstance(e, NnxShardError):
            raise
        raise UsageError(f"{_WHO}: new_vocab {size}: {e}") from None
    # Every layout and the memory they take are settled before the first table is made.
    plans = []
    need: dict[Any, int] = {}
    for name, var, axis, fill in resized:
        old = var.get_value()
        shape = tuple(size if d == axis else n for d, n in enumerate(old.shape))
        sharding = old.sharding
        spec = None
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            spec = _spec(var, name, shape, axis, sharding.mesh, sharding.spec, table, size)
            target: jax.sharding.Sharding = NamedSharding(sharding.mesh, spec)
        else:
            target = sharding
        each = nbytes(target.shard_shape(shape), old.dtype)
        for device in target.device_set:
            need[device] = need.get(device, 0) + each
        plans.append((var, axis, fill, spec))
    short_of = memory_shortfall(need)
    if short_of is not None:
        listed = ", ".join(f"{n} {tuple(v.shape)}" for n, v, *_ in resized)
        raise UsageError(
            f"{_WHO}: new_vocab {size} (new_vocab, pad_to_multiple_of) makes tables "
            f"({listed} now) that need {short_of}; the model is left unchanged. Fix: the "
            "tokenizer's size, e.g. new_vocab=len(tokenizer), or shard the tables over more "
            "devices (rules=).")
    key = jax.random.key(seed)
    std = _std(model)
    updates = []
    try:
        for i, (var, axis, fill, spec) in enumerate(plans):
            old = var.get_value()
            sub = jax.random.fold_in(key, i)

            def grow(x: jax.Array, k: jax.Array, axis: int = axis, fill: str = fill
                     ) -> jax.Array:
                return _resized(x, size, axis, fill, mean_resizing, std, k)

            sharding = old.sharding
            if spec is not None:
                mesh = sharding.mesh
                # Traced on the mesh's Auto-typed twin: the partitioner lays out the
                # statistics of a table split over devices itself (Explicit axes would ask
                # for an output sharding at each contraction); the buffers are viewed, not
                # copied.
                auto = auto_typed_mesh(mesh)
                fn = jax.jit(grow, in_shardings=(NamedSharding(auto, sharding.spec), None),
                             out_shardings=NamedSharding(auto, spec))
                new = rewrap(fn(rewrap(old, NamedSharding(auto, sharding.spec)), sub),
                             NamedSharding(mesh, spec))
            else:
                new = jax.jit(grow, out_shardings=sharding)(old, sub)
            updates.append((var, new))
        # Made, not only dispatched: a failed allocation leaves the model as it was.
        jax.block_until_ready([new for _, new in updates])
    except jax.errors.JaxRuntimeError as e:
        raise UsageError(f"{_WHO}: new_vocab {size}: the resized tables could not be made "
                         f"({' '.join(str(e).split())[:300]}); the model is left unchanged. "
                         "Fix: a smaller new_vocab, or shard the tables over more devices "
                         "(rules=).") from None
    for var, new in updates:
        var.set_value(new)
    model.cfg = new_cfg
    return model
