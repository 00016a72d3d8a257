"""A model's vocabulary resized in place, as transformers' ``resize_token_embeddings``
does it: the token embedding ``token_embed [vocab, embed]`` and the output projection
``unembed [embed, vocab]`` (absent when tied) grow or shrink at the end, new rows are
drawn around the old rows' mean, and the config's ``vocab`` follows. Each resized
parameter keeps its layout on its mesh (or takes the one the given rules resolve for
the new shape), so a sharded model stays sharded."""

from __future__ import annotations

import dataclasses
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

__all__ = ["resize_token_embeddings"]

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
              "a vocab field, e.g. ns.models.Llama or ns.models.Transformer (LoRA-adapted or "
              "quantized embeddings: ns.merge_lora first).")


def _fields(cfg: Any) -> set[str]:
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name for f in dataclasses.fields(cfg)}
    return set()


def _check_model(model: Any) -> tuple[nnx.Param[Any], nnx.Param[Any] | None, Any]:
    """``(token_embed, unembed or None, cfg)`` of ``model``, or a UsageError naming it."""
    cfg: Any = getattr(model, "cfg", None)
    embed = getattr(model, "token_embed", None)
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


def _resized(old: jax.Array, size: int, axis: int, mean_resizing: bool, std: float,
             key: jax.Array) -> jax.Array:
    rows = old if axis == 0 else old.T
    n = rows.shape[0]
    if size <= n:
        out = rows[:size]
    else:
        added = size - n
        new = (_mean_rows(rows, added, key) if mean_resizing
               else std * jax.random.normal(key, (added, rows.shape[1]), jnp.float32))
        out = jnp.concatenate([rows, new.astype(rows.dtype)], axis=0)
    return out if axis == 0 else out.T


def _spec(var: nnx.Param[Any], name: str, shape: tuple[int, ...], axis: int, mesh: Any,
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

    Args:
      model: a :class:`~nnx_shard.models.Llama` or :class:`~nnx_shard.models.Transformer`
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
      UsageError: a bad argument (named), or a model without a token embedding.
      ShardingError: the new size does not divide over the devices of its axis.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_shard.models import Llama, get_config, resize_token_embeddings
    >>> model = Llama(get_config("llama-tiny"), rngs=nnx.Rngs(0))
    >>> old = model.token_embed[...]
    >>> model = resize_token_embeddings(model, 131, pad_to_multiple_of=8)
    >>> model.cfg.vocab, model.token_embed.shape, model.unembed.shape
    (136, (136, 32), (32, 136))
    >>> bool(jnp.allclose(model.token_embed[128:], old.mean(0), atol=1e-3))
    True
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
    if size == cfg.vocab:
        return model
    key = jax.random.key(seed)
    std = _std(model)
    updates = []
    for i, (name, var, axis) in enumerate((("token_embed", embed, 0), ("unembed", head, 1))):
        if var is None:
            continue
        old = var.get_value()
        shape = tuple(size if d == axis else n for d, n in enumerate(old.shape))
        sub = jax.random.fold_in(key, i)

        def grow(x: jax.Array, k: jax.Array, axis: int = axis) -> jax.Array:
            return _resized(x, size, axis, mean_resizing, std, k)

        sharding = old.sharding
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            mesh = sharding.mesh
            spec = _spec(var, name, shape, axis, mesh, sharding.spec, table, size)
            # Traced on the mesh's Auto-typed twin: the partitioner lays out the
            # statistics of a table split over devices itself (Explicit axes would ask
            # for an output sharding at each contraction); the buffers are viewed, not copied.
            auto = auto_typed_mesh(mesh)
            fn = jax.jit(grow, in_shardings=(NamedSharding(auto, sharding.spec), None),
                         out_shardings=NamedSharding(auto, spec))
            new = rewrap(fn(rewrap(old, NamedSharding(auto, sharding.spec)), sub),
                         NamedSharding(mesh, spec))
        else:
            new = jax.jit(grow, out_shardings=sharding)(old, sub)
        updates.append((var, new))
    try:
        new_cfg = dataclasses.replace(cfg, vocab=size)
    except (ValueError, TypeError) as e:
        if isinstance(e, NnxShardError):
            raise
        raise UsageError(f"{_WHO}: new_vocab {size}: {e}") from None
    for var, new in updates:
        var.set_value(new)
    model.cfg = new_cfg
    return model
