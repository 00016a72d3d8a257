"""The checks of what a caller of generation passed (the model, the prompts as arrays,
masks or ragged lists, the lengths, the seed, the mesh and rules, the batch against the
mesh), each failure a :class:`~nnx_shard.UsageError` (a
:class:`~nnx_shard.ShardingError` for the batch's layout) naming the argument, shared by
:func:`~nnx_shard.inference.generate` and the sampling helpers."""

from __future__ import annotations

import inspect
import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from nnx_shard._axes import mesh_sizes
from nnx_shard._errors import ShardingError, UsageError, short
from nnx_shard._mesh import current, make_mesh
from nnx_shard._rules import Rules, as_rules
from nnx_shard.inference._decoding import config_vocab, model_context
from nnx_shard.models._kv_cache import CACHE_AXES


def check_model(model: Any, caller: str) -> None:
    """``model`` is an ``nnx.Module`` with ``init_cache`` and ``decode`` methods."""
    missing = [m for m in ("init_cache", "decode") if not callable(getattr(model, m, None))]
    if not isinstance(model, nnx.Module) or missing:
        what = (f"a {type(model).__name__} without {' and '.join(missing)}"
                if isinstance(model, nnx.Module) else f"{type(model).__name__} {model!r:.60}")
        raise UsageError(
            f"{caller}: model must be an nnx.Module with init_cache(batch, length) and "
            f"decode(tokens) methods (nnx_shard.models.Decoder has them), got "
            f"{what}. Fix: implement both (see nnx_shard.inference: a model of stock "
            "nnx.MultiHeadAttention(decode=True) layers needs a few lines)."
        )


def check_prompt(prompt: Any, model: Any, caller: str) -> np.ndarray:
    """``prompt`` as an int32 array ``[batch, length]`` of ids in the model's vocabulary."""
    if isinstance(prompt, jax.Array | np.ndarray | np.generic):
        arr = np.asarray(prompt)
    else:
        try:
            arr = np.asarray(prompt)
        except (TypeError, ValueError):
            arr = np.asarray(None)
        if arr.dtype == object:
            raise UsageError(
                f"{caller}: prompt_tokens must be an integer array [batch, length], got "
                f"{type(prompt).__name__} {prompt!r:.60}. Fix: e.g. np.array([[1, 2, 3]], "
                "np.int32)."
            )
    if not np.issubdtype(arr.dtype, np.integer):
        raise UsageError(
            f"{caller}: prompt_tokens must hold integer token ids, got dtype {arr.dtype} "
            f"(shape {arr.shape}). Fix: pass token ids, e.g. "
            "np.asarray(tokens, np.int32)."
        )
    if arr.ndim != 2:
        fix = ("tokens[None] for one sequence" if arr.ndim == 1
               else "one row of token ids per sequence")
        raise UsageError(
            f"{caller}: prompt_tokens must have rank 2 [batch, length], got shape {arr.shape}. "
            f"Fix: {fix}."
        )
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise UsageError(
            f"{caller}: prompt_tokens of shape {arr.shape} is empty; generation continues at "
            "least one token of at least one sequence. Fix: pass at least one token id, e.g. "
            "[[1, 2, 3]]."
        )
    check_ids(arr, config_vocab(model), caller)
    return arr.astype(np.int32)


def check_ids(arr: np.ndarray, vocab: int | None, caller: str,
              name: str = "prompt_tokens") -> None:
    """Every id of the host array ``arr`` in ``0 .. vocab - 1`` (an id past the
    embedding table would be read clamped, silently); the first one outside is named."""
    if vocab is None or not arr.size:
        return
    bad = (arr < 0) | (arr >= vocab)
    if not bad.any():
        return
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    at = f"{name}[{', '.join(map(str, where))}]"
    raise UsageError(
        f"{caller}: {at} is {int(arr[where])}, outside the model's vocabulary of {vocab} ids "
        f"(0 .. {vocab - 1}); the prompt holds ids from {arr.min()} to {arr.max()}, "
        f"{int(bad.sum())} outside. "
        f"Fix: tokenize with the model's own tokenizer, or map ids into 0 .. {vocab - 1}."
    )


def check_seed(seed: Any, caller: str) -> int:
    """``seed`` as a Python int: ``jax.random.key`` takes an int64 (a bool, a float, text,
    a key array, or an int past int64 fail deep inside JAX)."""
    if isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
        raise UsageError(f"{caller}: seed must be an int, got a jax.random key array: the key "
                         "is made from the seed (jax.random.key(seed)). Fix: seed=<the int the "
                         "key was made from>, e.g. seed=0.")
    if isinstance(seed, bool | np.bool_) or not isinstance(seed, int | np.integer):
        what = "a bool" if isinstance(seed, bool | np.bool_) else type(seed).__name__
        raise UsageError(f"{caller}: seed must be an int, got {' '.join(short(seed, 60).split())} "
                         f"({what}). Fix: seed=0 (any int from -2**63 to 2**63-1).")
    if not -(2**63) <= int(seed) < 2**63:
        raise UsageError(f"{caller}: seed must be an int from -2**63 to 2**63-1 (what "
                         f"jax.random.key takes), got {short(seed, 60)}. Fix: seed=0, or "
                         "seed % 2**63.")
    return int(seed)


def logits_vocab(fn: Any, *args: Any) -> int | None:
    """The last dimension of ``fn(*args)``'s output, traced abstractly (nothing runs):
    the vocabulary of a model that does not say its own."""
    out = jax.eval_shape(fn, *args)
    shape: tuple[int, ...] = tuple(getattr(out, "shape", ()))
    return int(shape[-1]) if len(shape) == 3 else None


def check_lengths(model: Any, prompt_len: int, new: Any, caller: str) -> int:
    """``max_new_tokens`` (``new``) as an int >= 1 that fits the model's context
    (``max_length``, where it has one) after a prompt of ``prompt_len`` tokens."""
    if isinstance(new, bool) or not isinstance(new, int | np.integer):
        raise UsageError(f"{caller}: max_new_tokens must be an int, got "
                         f"{type(new).__name__} {new!r:.40}. Fix: e.g. max_new_tokens=32.")
    new = int(new)
    if new < 1:
        raise UsageError(f"{caller}: max_new_tokens={new}; generate at least 1 token. Fix: "
                         "max_new_tokens >= 1, e.g. max_new_tokens=32.")
    context = model_context(model)
    if context is None:
        return new
    if prompt_len >= context:
        fills = "fills" if prompt_len == context else "is longer than"
        shorter = (f"a prompt shorter than {context} tokens (keep the last {context - 1}, "
                   f"e.g. prompt_tokens[:, -{context - 1}:]), or " if context > 1 else "")
        raise UsageError(
            f"{caller}: the prompt has {prompt_len} tokens, which {fills} the model's context "
            f"of {context} positions (max_length): no position is left for a new token. Fix: "
            f"{shorter}a model with a longer context (max_length)."
        )
    if prompt_len + new > context:
        raise UsageError(
            f"{caller}: prompt ({prompt_len} tokens) + max_new_tokens ({new}) = "
            f"{prompt_len + new} positions, past the model's context of {context} (max_length). "
            f"Fix: max_new_tokens <= {context - prompt_len}, or a shorter prompt."
        )
    return new


def placement(mesh: Any, rules: Any, caller: str) -> tuple[Mesh | None, Rules | None]:
    """The mesh and rules to run under: both given, or the active ones of
    :func:`nnx_shard.use` (``(None, None)`` outside it)."""
    if mesh is None and rules is None:
        active = current()
        return (None, None) if active is None else active
    if mesh is None or rules is None:
        given, other = ("mesh", "rules") if rules is None else ("rules", "mesh")
        raise UsageError(
            f"{caller}: {given}= was given without {other}=. Fix: pass both (e.g. "
            "mesh=strategy.make_mesh(), rules=strategy.rules), or neither and call it inside "
            "nnx_shard.use(mesh, rules)."
        )
    return make_mesh(mesh), as_rules(rules)


def check_batch(batch: int, mesh: Any, rules: Rules, caller: str) -> None:
    """A ``ShardingError`` naming the fix where ``batch`` rows do not divide over
    the mesh axes the rules map ``cache_batch`` or ``batch`` to."""
    sizes = mesh_sizes(mesh)
    for name in ("cache_batch", "batch"):
        try:
            rules.spec((name,), shape=(batch,), mesh=mesh, path=f"{caller} {name}")
        except ShardingError as e:
            cand = next((c for c in rules.candidates(name) if isinstance(c, tuple) and c
                         and all(a in sizes for a in c)), ())
            n = math.prod(sizes[a] for a in cand) if cand else 0
            axes = cand[0] if len(cand) == 1 else cand
            over = f"mesh axis {axes!r} (size {n})" if n else "its mesh axes"
            multiple = -(-batch // n) * n if n else batch
            raise ShardingError(
                f"{caller}: a batch of {batch} prompts does not divide over {over}, which the "
                f"rules map {name!r} to (the cache's batch dimension is {CACHE_AXES[0]!r} of "
                f"{CACHE_AXES}). Fix: pass a batch that is a multiple of {n or 'that size'} "
                f"(e.g. {multiple} rows: repeat or pad the prompts), or replicate the batch: "
                "rules | {'batch': None, 'cache_batch': None}."
            ) from e


def _ragged(prompts: Any) -> bool:
    return isinstance(prompts, list | tuple) and len(prompts) > 0 and all(
        isinstance(r, list | tuple | np.ndarray | jax.Array) for r in prompts) and (
        len({len(r) for r in prompts}) > 1 or any(len(r) == 0 for r in prompts))


def _check_mask(mask: Any, shape: tuple[int, int], caller: str) -> np.ndarray:
    try:
        arr = np.asarray(mask)
    except (TypeError, ValueError):
        arr = np.asarray(None)
    if arr.dtype == object or arr.shape != shape:
        raise UsageError(f"{caller}: attention_mask must be [batch, length] = {list(shape)} like "
                         f"the prompt, got {getattr(arr, 'shape', '?')} ({type(mask).__name__}). "
                         "Fix: 1 for real tokens, 0 for the padding on the left.")
    if arr.dtype == bool:
        arr = arr.astype(np.int32)
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)) or \
            not np.isin(arr, (0, 1)).all():
        raise UsageError(f"{caller}: attention_mask must hold only 0 and 1, got values "
                         f"{np.unique(arr)[:6].tolist()} ({arr.dtype}). Fix: 1 for real "
                         "tokens, 0 for the padding on the left.")
    arr = arr.astype(np.int32)
    empty = np.flatnonzero(arr.sum(axis=1) == 0)
    if empty.size:
        raise UsageError(f"{caller}: attention_mask row {int(empty[0])} is all padding; every "
                         "prompt needs at least one real token. Fix: drop that row, or mark its "
                         "tokens with 1.")
    right = np.flatnonzero((np.diff(arr, axis=1) < 0).any(axis=1))
    if right.size:
        raise UsageError(f"{caller}: attention_mask row {int(right[0])} has padding after a real "
                         "token; generation continues each row after its last column. Fix: pad "
                         "on the left (tokenizer padding_side='left').")
    return arr


def read_prompts(prompts: Any, attention_mask: Any, model: Any, caller: str
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    """The prompt ``[batch, length]`` and its mask (``None``: no padding)."""
    if _ragged(prompts):
        if attention_mask is not None:
            raise UsageError(f"{caller}: attention_mask is for an array prompt; a list of "
                             "sequences of different lengths is padded (on the left) and "
                             "masked by generate. Fix: drop attention_mask=.")
        rows = []
        for i, row in enumerate(prompts):
            if len(row) == 0:
                raise UsageError(f"{caller}: prompt row {i} is empty; every prompt needs at "
                                 "least one token. Fix: drop the empty row.")
            ids = check_prompt([list(np.asarray(row).tolist())], model, f"{caller} (row {i})")
            rows.append(ids[0])
        longest = max(len(r) for r in rows)
        prompt = np.zeros((len(rows), longest), np.int32)
        mask = np.zeros((len(rows), longest), np.int32)
        for i, row in enumerate(rows):
            prompt[i, longest - len(row):] = row
            mask[i, longest - len(row):] = 1
        return prompt, mask
    prompt = check_prompt(prompts, model, caller)
    if attention_mask is None:
        return prompt, None
    mask = _check_mask(attention_mask, prompt.shape, caller)
    return prompt, None if mask.all() else mask


def decode_takes(model: Any, name: str) -> bool:
    """Whether the model's ``decode`` takes the keyword ``name``."""
    try:
        return name in inspect.signature(model.decode).parameters
    except (TypeError, ValueError):
        return False


def batch_multiple(mesh: Any, rules: Rules) -> int:
    """The row count the batch must be a multiple of to split as ``cache_batch``
    and ``batch`` ask."""
    sizes = mesh_sizes(mesh)
    whole_mesh = math.prod(sizes.values())
    out = 1
    for name in ("cache_batch", "batch"):
        spec = rules.spec((name,), shape=(whole_mesh,), mesh=mesh, path=name)
        axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],) if spec[0] else ()
        out = math.lcm(out, math.prod(sizes[a] for a in axes))
    return out

