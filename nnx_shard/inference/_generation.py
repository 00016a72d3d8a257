"""The generation programs (prefill and decode loop) and their driver, documented
where public: :mod:`nnx_shard.inference`."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import math
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from nnx_shard._annotate import logical_names, path_str
from nnx_shard._axes import mesh_sizes
from nnx_shard._errors import ShardingError, ShardingWarning, UsageError, count, flag, short
from nnx_shard._mesh import apply_sharding, current, make_mesh, use, variable_spec
from nnx_shard._report import Report, layout_rows
from nnx_shard._rules import Rules, as_rules
from nnx_shard.inference._decoding import (
    Options,
    banned_tokens,
    check_options,
    check_top_k,
    choose,
    config_vocab,
    warp,
)
from nnx_shard.models._kv_cache import CACHE_AXES
from nnx_shard.models._ops import whole

__all__ = ["CACHE_AXES", "Options", "check_options", "choose", "explain_cache", "generate",
           "generation_rules", "stream", "warp"]

#: Execution options of training layouts that generation does not use: the
#: sequence of new tokens is one position long, so it is neither split over a
#: context axis (ring attention) nor gathered in ring steps (collective
#: matmuls), and the layers run in one loop on every device (no pipeline).
DROPPED_OPTIONS = ("attention", "collective_matmul", "pipeline")


def generation_rules(rules: Rules | Mapping[str, Any]) -> Rules:
    """The table generation runs under: ``rules`` with the activations'
    ``length`` replicated (a decode step has one position; the cache's
    positions are ``cache_length``), the ``layers`` axis of stacked caches
    replicated (the decode loop scans over it: a split would gather each
    layer's slice at every step), without the options of
    :data:`DROPPED_OPTIONS`, and with the cache's names derived where the table
    lacks them: ``cache_batch`` as ``batch``, ``cache_kv_heads`` as ``kv_heads``
    (else ``heads``), ``cache_length`` and ``cache_head_dim`` replicated.

    Parameters keep the layout they have: under a pipeline preset the layers
    split over ``stage`` are gathered by XLA as the loop reaches them
    (generation runs no pipeline schedule).

    >>> r = generation_rules(Rules({"batch": "data", "heads": "model", "length": "model"}))
    >>> r["length"], r["cache_batch"], r["cache_kv_heads"], r["cache_length"]
    (None, 'data', 'model', None)
    """
    rules = as_rules(rules)
    derived: dict[str, Any] = {}
    if "cache_batch" not in rules:
        derived["cache_batch"] = rules["batch"] if "batch" in rules else None
    if "cache_kv_heads" not in rules:
        source = next((n for n in ("kv_heads", "heads") if n in rules), None)
        derived["cache_kv_heads"] = rules[source] if source else None
    for name in ("cache_length", "cache_head_dim"):
        if name not in rules:
            derived[name] = None
    out = rules | {"length": None, "layers": None} | derived
    return out.with_options(**dict.fromkeys(DROPPED_OPTIONS))


# -- checking what the caller passed ------------------------------------------------


def _check_model(model: Any, caller: str) -> None:
    missing = [m for m in ("init_cache", "decode") if not callable(getattr(model, m, None))]
    if not isinstance(model, nnx.Module) or missing:
        what = (f"a {type(model).__name__} without {' and '.join(missing)}"
                if isinstance(model, nnx.Module) else f"{type(model).__name__} {model!r:.60}")
        raise TypeError(
            f"{caller}: model must be an nnx.Module with init_cache(batch, length) and "
            f"decode(tokens) methods (nnx_shard.models.Transformer and Llama have them), got "
            f"{what}. Fix: implement both (see nnx_shard.inference._generation: a model of stock "
            "nnx.MultiHeadAttention(decode=True) layers needs a few lines)."
        )


def _check_prompt(prompt: Any, model: Any, caller: str) -> np.ndarray:
    if isinstance(prompt, jax.Array | np.ndarray | np.generic):
        arr = np.asarray(prompt)
    else:
        try:
            arr = np.asarray(prompt)
        except (TypeError, ValueError):
            arr = np.asarray(None)
        if arr.dtype == object:
            raise TypeError(
                f"{caller}: prompt_tokens must be an integer array [batch, length], got "
                f"{type(prompt).__name__} {prompt!r:.60}. Fix: e.g. np.array([[1, 2, 3]], "
                "np.int32)."
            )
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(
            f"{caller}: prompt_tokens must hold integer token ids, got dtype {arr.dtype} "
            f"(shape {arr.shape}). Fix: pass token ids, e.g. "
            "np.asarray(tokens, np.int32)."
        )
    if arr.ndim != 2:
        fix = ("tokens[None] for one sequence" if arr.ndim == 1
               else "one row of token ids per sequence")
        raise ValueError(
            f"{caller}: prompt_tokens must have rank 2 [batch, length], got shape {arr.shape}. "
            f"Fix: {fix}."
        )
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(
            f"{caller}: prompt_tokens of shape {arr.shape} is empty; generation continues at "
            "least one token of at least one sequence."
        )
    _check_ids(arr, config_vocab(model), caller)
    return arr.astype(np.int32)


def _check_ids(arr: np.ndarray, vocab: int | None, caller: str,
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


def _check_seed(seed: Any, caller: str) -> int:
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


def _logits_vocab(fn: Any, *args: Any) -> int | None:
    """The last dimension of ``fn(*args)``'s output, traced abstractly (nothing runs):
    the vocabulary of a model that does not say its own."""
    out = jax.eval_shape(fn, *args)
    shape: tuple[int, ...] = tuple(getattr(out, "shape", ()))
    return int(shape[-1]) if len(shape) == 3 else None


def _context(model: Any) -> int | None:
    value = getattr(model, "max_length", None)
    return int(value) if isinstance(value, int | np.integer) else None


def _check_lengths(model: Any, prompt_len: int, new: Any, caller: str) -> int:
    if isinstance(new, bool) or not isinstance(new, int | np.integer):
        raise TypeError(f"{caller}: max_new_tokens must be an int, got "
                        f"{type(new).__name__} {new!r:.40}.")
    new = int(new)
    if new < 1:
        raise ValueError(f"{caller}: max_new_tokens={new}; generate at least 1 token.")
    context = _context(model)
    if context is None:
        return new
    if prompt_len > context:
        raise ValueError(
            f"{caller}: the prompt has {prompt_len} tokens but the model's context is {context} "
            f"positions (max_length). Fix: keep the last {context - 1} tokens, e.g. "
            f"prompt_tokens[:, -{context - 1}:], to leave room for new ones."
        )
    if prompt_len + new > context:
        raise ValueError(
            f"{caller}: prompt ({prompt_len} tokens) + max_new_tokens ({new}) = "
            f"{prompt_len + new} positions, past the model's context of {context} (max_length). "
            f"Fix: max_new_tokens <= {context - prompt_len}, or a shorter prompt."
        )
    return new


def _placement(mesh: Any, rules: Any, caller: str) -> tuple[Mesh | None, Rules | None]:
    if mesh is None and rules is None:
        active = current()
        return (None, None) if active is None else active
    if mesh is None or rules is None:
        given, other = ("mesh", "rules") if rules is None else ("rules", "mesh")
        raise TypeError(
            f"{caller}: {given}= was given without {other}=. Fix: pass both (e.g. "
            "mesh=strategy.make_mesh(), rules=strategy.rules), or neither and call it inside "
            "nnx_shard.use(mesh, rules)."
        )
    return make_mesh(mesh), as_rules(rules)


def _check_batch(batch: int, mesh: Any, rules: Rules, caller: str) -> None:
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
                f"rules map {name!r} to (the cache is [batch, length, kv_heads, head_dim] with "
                f"{CACHE_AXES}). Fix: pass a batch that is a multiple of {n or 'that size'} "
                f"(e.g. {multiple} rows: repeat or pad the prompts), or replicate the batch: "
                "rules | {'batch': None, 'cache_batch': None}."
            ) from e


# -- the cache, abstractly ----------------------------------------------------------


def _with_cache(graphdef: Any, cache: Any, rest: Any, batch: int, length: int) -> Any:
    model = nnx.merge(graphdef, cache, rest)
    model.init_cache(batch, length)
    return model


def _abstract_cache(graphdef: Any, cache: Any, rest: Any, batch: int,
                    length: int) -> tuple[Any, nnx.State]:
    """The graph of the model with its cache, and the cache's abstract state:
    shapes, dtypes and logical names from ``init_cache``, nothing allocated."""
    graphs = []

    def build(c: Any, r: Any) -> nnx.State:
        # jax.eval_shape, not nnx.eval_shape: Flax's would read the logical names
        # as mesh axes of the active mesh. The graph is static: it leaves by closure.
        with_cache, cache_state, _ = nnx.split(_with_cache(graphdef, c, r, batch, length),
                                               nnx.Cache, ...)  # type: ignore[misc]
        graphs.append(with_cache)
        return cache_state

    cache_state = jax.eval_shape(build, cache, rest)
    return graphs[0], cache_state


def _warn_unannotated(cache: nnx.State, mesh: Any, caller: str) -> None:
    if mesh is None or math.prod(mesh_sizes(mesh).values()) == 1:
        return
    bare = [f"{path_str(p)} {tuple(v.get_value().shape)}" for p, v in nnx.to_flat_state(cache)
            if isinstance(v, nnx.Variable) and len(getattr(v.get_value(), "shape", ())) >= 2
            and logical_names(v, path_str(p)) is None]
    if bare:
        warnings.warn(
            f"{caller}: cache variables without logical names are replicated on every device: "
            f"{', '.join(bare[:3])}{' ...' if len(bare) > 3 else ''}. Fix: annotate them in "
            f"init_cache, e.g. nnx_shard._annotate(self, {{r'cached_(key|value)$': {CACHE_AXES}}}).",
            ShardingWarning, stacklevel=3)


def _constrain_cache(cache: nnx.State, mesh: Any, rules: Rules | None) -> nnx.State:
    """Each cache array constrained to its layout (inside a compiled program)."""
    if mesh is None or rules is None:
        return cache

    def one(path: Any, var: Any) -> Any:
        spec = variable_spec(var, mesh, rules, path_str(path))
        return var.replace(apply_sharding(var.get_value(), NamedSharding(mesh, spec)))

    return jax.tree_util.tree_map_with_path(one, cache,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


# -- prompts: arrays, masks, ragged lists ----------------------------------------------


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
                         f"{np.unique(arr)[:6].tolist()} ({arr.dtype}).")
    arr = arr.astype(np.int32)
    empty = np.flatnonzero(arr.sum(axis=1) == 0)
    if empty.size:
        raise UsageError(f"{caller}: attention_mask row {int(empty[0])} is all padding; every "
                         "prompt needs at least one real token.")
    right = np.flatnonzero((np.diff(arr, axis=1) < 0).any(axis=1))
    if right.size:
        raise UsageError(f"{caller}: attention_mask row {int(right[0])} has padding after a real "
                         "token; generation continues each row after its last column. Fix: pad "
                         "on the left (tokenizer padding_side='left').")
    return arr


def _prompts(prompts: Any, attention_mask: Any, model: Any, caller: str
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
                                 "least one token.")
            ids = _check_prompt([list(np.asarray(row).tolist())], model, f"{caller} (row {i})")
            rows.append(ids[0])
        longest = max(len(r) for r in rows)
        prompt = np.zeros((len(rows), longest), np.int32)
        mask = np.zeros((len(rows), longest), np.int32)
        for i, row in enumerate(rows):
            prompt[i, longest - len(row):] = row
            mask[i, longest - len(row):] = 1
        return prompt, mask
    prompt = _check_prompt(prompts, model, caller)
    if attention_mask is None:
        return prompt, None
    mask = _check_mask(attention_mask, prompt.shape, caller)
    return prompt, None if mask.all() else mask


def _takes(model: Any, name: str) -> bool:
    """Whether the model's ``decode`` takes the keyword ``name``."""
    try:
        return name in inspect.signature(model.decode).parameters
    except (TypeError, ValueError):
        return False


def _batch_multiple(mesh: Any, rules: Rules) -> int:
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


def _record(carry: dict[str, Any], token: jax.Array, logprob: jax.Array, step: Any,
            column: Any, o: Mapping[str, jax.Array]) -> dict[str, Any]:
    """``carry`` with the token of ``step`` stored at ``column``: the pad of the
    options (and log-probability 0) in rows already stopped; a row stops at an
    end-of-sequence token."""
    done = carry["done"]
    token = jnp.where(done, o["pad"], token)
    logprob = jnp.where(done, 0.0, logprob)
    rows = jnp.arange(token.shape[0])
    return {
        "tokens": jax.lax.dynamic_update_slice(carry["tokens"], token[:, None], (0, column)),
        "logprobs": jax.lax.dynamic_update_slice(carry["logprobs"], logprob[:, None], (0, step)),
        "last": token,
        "done": done | (token[:, None] == o["eos"][None, :]).any(axis=1),
        "seen": carry["seen"].at[rows, token].set(True),
        "start": carry["start"],
        "step": jnp.asarray(step + 1, jnp.int32),
    }


# -- the compiled programs -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Programs:
    prefill: Any   # (old, rest, prompt, mask, real, key, options) -> (cache, carry)
    decode: Any    # (rest, cache, carry, key, options, stop, halt) -> (cache, carry)


@functools.lru_cache(maxsize=32)
def _programs(graphdef: Any, with_cache: Any, mesh: Mesh | None, rules: Rules | None,
              batch: int, prompt_len: int, new: int, masked: bool, last_only: bool
              ) -> _Programs:
    """The prefill and decode programs of one shape (cached: a second call with
    the same model graph, layout and shape compiles nothing; the prompt, mask,
    seed and every option are arguments). ``last_only``: the model's decode takes
    ``logits_to_keep``, and the prefill asks for the last position's logits only."""
    length = prompt_len + new
    keep = {"logits_to_keep": 1} if last_only else {}

    def _prefill(old: Any, rest: Any, prompt: Any, mask: Any, real: Any, key: Any,
                 o: Any) -> Any:
        # ``mask [batch, prompt_len]`` (0: padding) reaches the model's decode as its
        # attention_mask, which the cache keeps: each row decodes as the row alone.
        model = nnx.merge(graphdef, old, rest)
        model.init_cache(batch, length)
        nnx.update(model, _constrain_cache(nnx.state(model, nnx.Cache), mesh, rules))
        out = (model.decode(prompt, attention_mask=mask, **keep) if masked
               else model.decode(prompt, **keep))
        logits = out[:, -1]
        vocab = logits.shape[-1]
        seen = jnp.zeros((batch, vocab), jnp.int32).at[
            jnp.arange(batch)[:, None], prompt].max(mask) > 0
        carry = {"tokens": jnp.full((batch, length), o["pad"], jnp.int32)
                 .at[:, :prompt_len].set(prompt),
                 "logprobs": jnp.zeros((batch, new), jnp.float32), "last": prompt[:, -1],
                 "done": ~real, "seen": whole(seen),
                 "start": (prompt_len - mask.sum(axis=1)).astype(jnp.int32),
                 "step": jnp.int32(0)}
        token, logprob = choose(logits, carry["seen"], key, prompt_len, o,
                                banned_tokens(carry, prompt_len, vocab, o))
        carry = _record(carry, token, logprob, 0, prompt_len, o)
        return _constrain_cache(nnx.state(model, nnx.Cache), mesh, rules), carry

    def _decode(rest: Any, cache: Any, carry: Any, key: Any, o: Any, stop: Any,
                halt: Any) -> Any:
        # ``halt [batch]``: rows the host stopped (a stop string), padded from here on.
        ones = jnp.ones((batch, 1), jnp.int32)
        carry = carry | {"done": carry["done"] | halt}

        def more(state: Any) -> Any:
            _, carry = state
            return (carry["step"] < stop) & ~carry["done"].all()

        def step(state: Any) -> Any:
            cache, carry = state
            model = nnx.merge(with_cache, cache, rest)
            last = carry["last"][:, None]
            out = model.decode(last, attention_mask=ones) if masked else model.decode(last)
            column = prompt_len + carry["step"]
            logits = out[:, -1]
            token, logprob = choose(logits, carry["seen"], key, column, o,
                                    banned_tokens(carry, column, logits.shape[-1], o))
            carry = _record(carry, token, logprob, carry["step"], column, o)
            return _constrain_cache(nnx.state(model, nnx.Cache), mesh, rules), carry

        return jax.lax.while_loop(more, step, (cache, carry))

    return _Programs(prefill=jax.jit(_prefill), decode=jax.jit(_decode, donate_argnums=(1, 2)))


@dataclasses.dataclass(frozen=True)
class _Run:
    """Everything one call of :func:`generate` needs, checked."""

    programs: _Programs
    old: Any
    rest: Any
    prompt: np.ndarray
    mask: np.ndarray
    real: np.ndarray   # [batch] False for the rows added to divide over the mesh
    rows: int          # the caller's rows
    new: int
    key: jax.Array
    options: dict[str, Any]
    mesh: Mesh | None
    rules: Rules | None
    stops: _StopStrings | None = None

    def context(self) -> Any:
        if self.mesh is None or self.rules is None:
            return contextlib.nullcontext()
        return use(self.mesh, self.rules)

    def prefill(self) -> Any:
        """The compiled prefill: ``(cache, carry)``, the first token chosen."""
        with self.context():
            return self.programs.prefill(self.old, self.rest, self.prompt, self.mask,
                                         self.real, self.key, self.options)

    def decode(self, cache: Any, carry: Any, stop: int, halt: np.ndarray | None = None) -> Any:
        """The compiled decode loop, up to ``stop`` new tokens (or every row stopped);
        ``cache`` and ``carry`` are donated. ``halt [batch]``: rows to stop now."""
        if halt is None:
            halt = np.zeros(self.prompt.shape[0], bool)
        with self.context():
            return self.programs.decode(self.rest, cache, carry, self.key, self.options,
                                        np.int32(stop), halt)


class _StopStrings:
    """transformers' StopStringCriteria on the host, between compiled chunks: a row
    stops at the first new token whose text completes a stop string, i.e. the
    string occurs in the row's text (prompt and new tokens, the padding left out)
    ending inside that token's text (it may start in earlier tokens or the prompt;
    the token may run past it). Only the last tokens are decoded, enough for the
    longest string (a token decodes to at least a quarter of a character: a
    4-byte character split over four byte tokens)."""

    def __init__(self, strings: tuple[str, ...], tokenizer: Any, prompt: np.ndarray,
                 mask: np.ndarray, eos: tuple[int, ...]) -> None:
        self.strings = strings
        self.tokenizer = tokenizer
        self.window = 4 * max(len(t) for t in strings) + 8
        self.history = [[int(t) for t in row[m > 0]] for row, m in zip(prompt, mask, strict=True)]
        self.eos = set(eos)
        self.end = np.full(len(self.history), -1)  # the step a row ended at (eos or string)
        self.halted = np.zeros(len(self.history), bool)  # ended by a stop string

    def _text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def _completes(self, ids: list[int]) -> bool:
        before, after = self._text(ids[:-1]), self._text(ids)
        # the text the last token added, from where the two decodings part (a character
        # whose bytes the token completes is rewritten, not appended)
        same = next((i for i, (a, b) in enumerate(zip(before, after, strict=False))
                     if a != b), min(len(before), len(after)))
        return any(t in after[max(0, same - len(t) + 1):] for t in self.strings)

    def scan(self, tokens: np.ndarray, logprobs: np.ndarray, first: int, pad: int
             ) -> tuple[np.ndarray, np.ndarray]:
        """The new ``tokens``/``logprobs [rows, k]`` of steps ``first ..`` with the
        steps after a row's end padded (``pad``, 0); rows ending here are recorded."""
        tokens, logprobs = tokens.copy(), logprobs.copy()
        for r, history in enumerate(self.history):
            for i in range(tokens.shape[1]):
                if self.end[r] >= 0:
                    if self.halted[r]:
                        tokens[r, i], logprobs[r, i] = pad, 0.0
                    continue
                token = int(tokens[r, i])
                history.append(token)
                del history[:-self.window]
                if token in self.eos:
                    self.end[r] = first + i
                elif self._completes(history):
                    self.end[r], self.halted[r] = first + i, True
        return tokens, logprobs

    def last(self) -> int | None:
        """The step at which every row had ended, else ``None``."""
        return int(self.end.max()) if (self.end >= 0).all() else None


def _prepare(model: Any, prompts: Any, max_new_tokens: Any, options: Options, seed: Any,
             mesh: Any, rules: Any, caller: str, attention_mask: Any = None,
             tokenizer: Any = None) -> _Run:
    _check_model(model, caller)
    prompt, mask = _prompts(prompts, attention_mask, model, caller)
    if options.num_return_sequences > 1:  # transformers' order: each prompt's copies together
        prompt = np.repeat(prompt, options.num_return_sequences, axis=0)
        mask = None if mask is None else np.repeat(mask, options.num_return_sequences, axis=0)
    masked = _takes(model, "attention_mask")
    if mask is not None and not masked:
        raise UsageError(f"{caller}: the prompts are padded, but {type(model).__name__}.decode "
                         "takes no attention_mask, so the padding would be attended to. Fix: "
                         "give decode an attention_mask= (as Transformer and Llama have), or "
                         "prompts of one length.")
    rows, prompt_len = prompt.shape
    new = _check_lengths(model, prompt_len, max_new_tokens, caller)
    if options.min_new_tokens > new:
        raise UsageError(f"{caller}: min_new_tokens={options.min_new_tokens} is more than "
                         f"max_new_tokens={new}: no row could reach it. Fix: min_new_tokens <= "
                         "max_new_tokens.")
    seed = _check_seed(seed, caller)
    mesh, rules = _placement(mesh, rules, caller)
    gen_rules = None
    batch = rows
    if mesh is not None:
        gen_rules = generation_rules(rules)
        try:
            multiple = _batch_multiple(mesh, gen_rules)
        except ShardingError:
            multiple = 1
        batch = -(-rows // multiple) * multiple
        _check_batch(batch, mesh, gen_rules, caller)
    if mask is None:
        mask = np.ones_like(prompt)
    real = np.arange(batch) < rows
    if batch > rows:  # dummy rows (a copy of the first) so the batch divides over the mesh
        prompt = np.concatenate([prompt, np.repeat(prompt[:1], batch - rows, 0)])
        mask = np.concatenate([mask, np.repeat(mask[:1], batch - rows, 0)])
    graphdef, old, rest = nnx.split(model, nnx.Cache, ...)  # type: ignore[misc]
    with_cache, cache = _abstract_cache(graphdef, old, rest, batch, prompt_len + new)
    if config_vocab(model) is None:  # a model of the caller's: its logits say the vocabulary
        with (use(mesh, gen_rules) if mesh is not None and gen_rules is not None
              else contextlib.nullcontext()):
            vocab = _logits_vocab(lambda c, r, x: nnx.merge(with_cache, c, r).decode(x), cache,
                                  rest, jax.ShapeDtypeStruct((batch, 1), jnp.int32))
        _check_ids(np.where(mask > 0, prompt, 0), vocab, caller)
        check_top_k(options.top_k or None, vocab, caller)
    if mesh is not None:
        _warn_unannotated(cache, mesh, caller)
        for path, var in nnx.to_flat_state(cache):  # every other layout problem, by path
            variable_spec(var, mesh, gen_rules, path_str(path))  # type: ignore[arg-type]
    programs = _programs(graphdef, with_cache, mesh, gen_rules, batch, prompt_len, new, masked,
                         _takes(model, "logits_to_keep"))
    stops = None
    if options.stop_strings:
        stops = _StopStrings(options.stop_strings, tokenizer, prompt[:rows], mask[:rows],
                             options.eos)
    return _Run(programs, old, rest, prompt, mask, real, rows, new, jax.random.key(int(seed)),
                options.traced(), mesh, gen_rules, stops)


def generate(model: Any, prompts: Any, max_new_tokens: int, *, attention_mask: Any = None,  # noqa: PLR0913
             eos_token_id: int | list[int] | None = None, pad_token_id: int = 0,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             min_p: float | None = None, repetition_penalty: float | None = None,
             min_new_tokens: int | None = None, no_repeat_ngram_size: int | None = None,
             stop_strings: str | list[str] | None = None, tokenizer: Any = None,
             num_return_sequences: int | None = None,
             return_logprobs: bool = False, seed: int = 0,
             mesh: Mesh | str | Mapping[str, int] | None = None,
             rules: Rules | Mapping[str, Any] | None = None, **unknown: Any) -> Any:
    """``prompts`` continued by up to ``max_new_tokens`` tokens: int32 ``[batch,
    length + max_new_tokens]``, the prompt first, each row's new tokens in the
    last ``max_new_tokens`` columns.

    ``prompts``: an int ``[batch, length]`` array (rows padded on the left marked
    by ``attention_mask``, 1: real token, 0: padding) or a list of token-id
    sequences of any lengths (padded on the left with ``pad_token_id`` to the
    longest, and masked). A padded row generates what the row alone generates.

    A row stops at its first ``eos_token_id`` (an id or a list of ids; the eos
    is kept) and holds ``pad_token_id`` after it; the loop ends as soon as
    every row has stopped.

    ``temperature=0`` is greedy (the argmax: deterministic); above 0 tokens are
    sampled with a key that depends on ``seed`` and the column only. The
    options apply in transformers' order and meaning: ``repetition_penalty``
    (a seen token's positive logit divided by it, a negative one multiplied;
    greedy too), then ``temperature``, ``top_k`` (the k most likely),
    ``top_p`` (the nucleus: the most likely tokens whose probabilities reach
    ``top_p``), ``min_p`` (tokens at least ``min_p`` times as likely as the
    most likely). ``return_logprobs=True`` returns ``(tokens, logprobs)``,
    ``logprobs [batch, max_new_tokens]`` float32 the log-probability of each new
    token under the model's unprocessed distribution (0 after a row stopped).

    Controls, in transformers' meaning (its logits processors and stopping
    criteria), inside the compiled loop but for the stop strings:

    * ``min_new_tokens``: the ``eos_token_id`` ids are masked (``-inf``) until a
      row has that many new tokens;
    * ``no_repeat_ngram_size=n``: a token that would repeat an n-gram of the
      row's prompt and new tokens is masked (a vectorised match over the
      token buffer at each step; the padding of ragged prompts is no part of a
      row, so a padded row generates what it generates alone);
    * ``stop_strings`` (a string or a list of them, with the ``tokenizer``
      that decodes the tokens, e.g. :class:`~nnx_shard.models.Tokenizer`): a
      row stops at the new token whose text completes one of them (it may
      start in the prompt or earlier tokens; the token is kept, ``pad_token_id``
      follows). The text is only known on the host: the loop then runs in
      chunks of 16 steps, the rows that stopped are padded from their stop on
      and halted before the next chunk;
    * ``num_return_sequences=n`` (sampling only): each prompt row is
      continued ``n`` times, the output's rows ``[row 0] * n, [row 1] * n,
      ...`` (each copy sampled with its own noise).

    One compiled prefill creates the key/value cache in its layout and runs the
    prompt; one compiled loop decodes the rest through the cache. Both are
    compiled once per shape (model graph, layout, batch, prompt length,
    ``max_new_tokens``) and reused: the prompts' values, the mask, ``seed`` and
    every option's value are arguments of the programs.

    Under :func:`nnx_shard.use` (or with ``mesh=`` and ``rules=``) it runs
    sharded: parameters stay where they are, activations and the cache are laid
    out by :func:`generation_rules` of the rules; a batch that does not divide
    over the batch's mesh axes is padded with dummy rows and cut back.
    ``model`` is any module with ``init_cache`` and ``decode`` (see
    :mod:`nnx_shard.inference`; padded prompts need ``decode(tokens,
    attention_mask=)``); it is not changed (the cache lives in the programs
    only).

    Raises:
      TypeError: ``model`` lacks ``init_cache``/``decode``; ``prompts`` are not
        integers; ``max_new_tokens`` is not an int; ``mesh`` without ``rules``
        or the reverse.
      ValueError: ``prompts`` not of rank 2, empty, or with ids outside the
        vocabulary; the prompt longer than the model's context
        (``max_length``), or ``max_new_tokens`` < 1 or past it; a negative
        ``temperature``, a ``top_k`` out of range; as
        :class:`~nnx_shard.UsageError`: ``top_p``, ``min_p``,
        ``repetition_penalty``, ``eos_token_id``, ``pad_token_id``, ``seed``
        or ``attention_mask`` out of range, a list with an empty row; a
        ``temperature`` given as a bool or text, a ``seed`` that is not an int
        of int64's range (a bool, a float, a key array), prompt ids outside the
        vocabulary (``cfg.vocab``, else the width of ``decode``'s logits; the
        first one named by row and column).
      ShardingError: a cache array does not fit its rule.
      UsageError: ``min_new_tokens`` < 0 or above ``max_new_tokens``,
        ``no_repeat_ngram_size`` < 1, ``stop_strings`` not non-empty text or
        without a ``tokenizer``, ``num_return_sequences`` < 1 or above 1 when
        greedy, an option ``generate`` does not take (the valid ones listed).

    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> from nnx_shard.models import Transformer, get_config
    >>> model = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
    >>> out = generate(model, [[1, 2, 3, 4]], max_new_tokens=6)
    >>> out.shape, out.dtype, out[0, :4].tolist()
    ((1, 10), dtype('int32'), [1, 2, 3, 4])
    >>> ragged = generate(model, [[1, 2, 3, 4], [3, 4]], max_new_tokens=6)
    >>> ragged[1, :2].tolist(), bool((ragged[1, 4:] == generate(model, [[3, 4]], 6)[0, 2:]).all())
    ([0, 0], True)
    >>> tokens, logprobs = generate(model, [[1, 2, 3, 4]], 6, return_logprobs=True)
    >>> logprobs.shape, bool((logprobs <= 0).all())
    ((1, 6), True)
    >>> strategy = ns.strategies.get("tp")
    >>> mesh = strategy.make_mesh()                                   # data=2, model=4
    >>> sharded = ns.sharded_init(lambda: Transformer(get_config("tiny"), rngs=nnx.Rngs(0)),
    ...                           mesh, strategy)
    >>> with ns.use(mesh, strategy.rules):
    ...     again = generate(sharded, [[1, 2, 3, 4]], max_new_tokens=6)   # 1 row of 2: padded
    >>> bool((again == out).all())
    True
    >>> generate(model, [[1, 2, 3, 4]], max_new_tokens=16)
    Traceback (most recent call last):
    ...
    ValueError: generate: prompt (4 tokens) + max_new_tokens (16) = 20 positions, past the model's context of 16 (max_length). Fix: max_new_tokens <= 12, or a shorter prompt.
    >>> no_repeat = generate(model, [[1, 2, 3, 4]], 12, no_repeat_ngram_size=2)[0].tolist()
    >>> pairs = list(zip(no_repeat, no_repeat[1:]))
    >>> len(pairs) == len(set(pairs))
    True
    >>> generate(model, [[1, 2, 3, 4]], 6, temperature=0.8, num_return_sequences=3).shape
    (3, 10)
    """
    _refuse_unknown(unknown, "generate")
    options = check_options(model, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, repetition_penalty=repetition_penalty,
                            eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                            min_new_tokens=min_new_tokens,
                            no_repeat_ngram_size=no_repeat_ngram_size,
                            stop_strings=stop_strings, tokenizer=tokenizer,
                            num_return_sequences=num_return_sequences)
    want_logprobs = flag(return_logprobs, "generate: return_logprobs")
    run = _prepare(model, prompts, max_new_tokens, options, seed, mesh, rules, "generate",
                   attention_mask, tokenizer)
    if run.stops is not None:  # the text is read on the host between chunks
        steps = list(_steps(run, STOP_CHUNK, True))
        tokens = np.full((run.rows, run.prompt.shape[1] + run.new), options.pad, np.int32)
        tokens[:, :run.prompt.shape[1]] = run.prompt[:run.rows]
        logprobs = np.zeros((run.rows, run.new), np.float32)
        if steps:
            tokens[:, run.prompt.shape[1]:run.prompt.shape[1] + len(steps)] = np.stack(
                [t for t, _ in steps], 1)
            logprobs[:, :len(steps)] = np.stack([lp for _, lp in steps], 1)
        return (tokens, logprobs) if want_logprobs else tokens
    cache, carry = run.prefill()
    _, carry = run.decode(cache, carry, run.new)
    tokens = carry["tokens"][:run.rows]
    if want_logprobs:
        return tokens, carry["logprobs"][:run.rows]
    return tokens


#: Steps per compiled call when stop strings are checked on the host between calls.
STOP_CHUNK = 16

#: The keyword options of :func:`generate` (:func:`stream` adds ``chunk``).
OPTION_NAMES = ("attention_mask", "eos_token_id", "pad_token_id", "temperature", "top_k",
                "top_p", "min_p", "repetition_penalty", "min_new_tokens",
                "no_repeat_ngram_size", "stop_strings", "tokenizer", "num_return_sequences",
                "return_logprobs", "seed", "mesh", "rules")


def _refuse_unknown(unknown: Mapping[str, Any], caller: str) -> None:
    if not unknown:
        return
    names = OPTION_NAMES + (("chunk",) if caller == "stream" else ())
    bad = sorted(unknown)
    close = [m for n in bad for m in difflib.get_close_matches(n, names, 1)]
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise UsageError(f"{caller}: unknown option{'s' if len(bad) > 1 else ''} "
                     f"{', '.join(f'{n}=' for n in bad)}{hint}; it takes {', '.join(names)}. "
                     "Fix: drop or rename it (beam search is not implemented).")


def stream(model: Any, prompts: Any, max_new_tokens: int, *, chunk: int = 16,  # noqa: PLR0913
           attention_mask: Any = None, eos_token_id: int | list[int] | None = None,
           pad_token_id: int = 0, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, min_p: float | None = None,
           repetition_penalty: float | None = None, min_new_tokens: int | None = None,
           no_repeat_ngram_size: int | None = None,
           stop_strings: str | list[str] | None = None, tokenizer: Any = None,
           num_return_sequences: int | None = None, return_logprobs: bool = False,
           seed: int = 0, mesh: Mesh | str | Mapping[str, int] | None = None,
           rules: Rules | Mapping[str, Any] | None = None, **unknown: Any) -> Iterator[Any]:
    """:func:`generate` a step at a time: yields each step's new tokens (int32
    numpy ``[batch]``; with ``return_logprobs=True`` ``(tokens, logprobs)``),
    decoding ``chunk`` steps per call of the same compiled decode program that
    :func:`generate` runs (one program whatever ``chunk``: it is an argument).
    It ends after ``max_new_tokens`` steps or the step at which every row has
    stopped (``eos_token_id`` or ``stop_strings``, checked after each chunk);
    what it yields, stacked, equals the new tokens of :func:`generate` up to
    there (``pad_token_id`` after).

    >>> from flax import nnx
    >>> from nnx_shard.models import Transformer, get_config
    >>> model = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
    >>> steps = list(stream(model, [[1, 2, 3, 4]], max_new_tokens=6, chunk=4))
    >>> len(steps), steps[0].shape
    (6, (1,))
    >>> bool((np.stack(steps, 1) == generate(model, [[1, 2, 3, 4]], 6)[:, 4:]).all())
    True
    """
    _refuse_unknown(unknown, "stream")
    options = check_options(model, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, repetition_penalty=repetition_penalty,
                            eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                            min_new_tokens=min_new_tokens,
                            no_repeat_ngram_size=no_repeat_ngram_size,
                            stop_strings=stop_strings, tokenizer=tokenizer,
                            num_return_sequences=num_return_sequences, caller="stream")
    want_logprobs = flag(return_logprobs, "stream: return_logprobs")
    size = count(chunk, "stream: chunk", fix="e.g. chunk=16")
    run = _prepare(model, prompts, max_new_tokens, options, seed, mesh, rules, "stream",
                   attention_mask, tokenizer)
    return _steps(run, size, want_logprobs)


def _steps(run: _Run, size: int, want_logprobs: bool) -> Iterator[Any]:
    cache, carry = run.prefill()
    start = run.prompt.shape[1]
    pad = int(run.options["pad"])
    halt = np.zeros(run.prompt.shape[0], bool)
    done = 0
    while True:
        steps = int(carry["step"])
        tokens = np.array(carry["tokens"][:run.rows, start + done:start + steps])
        logprobs = np.array(carry["logprobs"][:run.rows, done:steps])
        finished = steps >= run.new or bool(np.asarray(carry["done"]).all())
        if run.stops is not None:
            tokens, logprobs = run.stops.scan(tokens, logprobs, done, pad)
            halt[:run.rows] = run.stops.halted
            last = run.stops.last()
            if last is not None:  # every row ended (an eos or a stop string) at step `last`
                finished = True
                steps = min(steps, last + 1)
        if not finished:  # the next chunk runs while these steps are yielded
            cache, carry = run.decode(cache, carry, min(steps + size, run.new), halt.copy())
        for i in range(steps - done):
            yield (tokens[:, i], logprobs[:, i]) if want_logprobs else tokens[:, i]
        done = steps
        if finished:
            return


def explain_cache(model: Any, mesh: Mesh | AbstractMesh | str | Mapping[str, int],
                  rules: Rules | Mapping[str, Any], *, batch: int, length: int) -> Report:
    """The key/value cache :func:`generate` allocates for ``batch`` sequences of
    ``length`` positions (prompt + new tokens), laid out by ``rules`` on
    ``mesh``: one row per cache array with its logical names, spec and bytes
    (total and per device), computed without allocating anything.
    ``model`` may be abstract (``nnx.eval_shape`` or
    :func:`nnx_shard.abstract_init`) and ``mesh`` a ``jax.sharding.AbstractMesh``
    (plan a mesh of any size); the per-device bytes are what the compiled
    prefill program outputs (XLA's ``memory_analysis``).

    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> from nnx_shard.models import Llama, get_config
    >>> model = nnx.eval_shape(lambda: Llama(get_config("llama3-8b"), rngs=nnx.Rngs(0)))
    >>> mesh = jax.sharding.AbstractMesh((4, 8), ("data", "model"))
    >>> report = explain_cache(model, mesh, ns.strategies.get("tp").rules, batch=8, length=8192)
    >>> report.total_bytes // 2**20, report.param_bytes_per_device // 2**20   # MiB
    (8192, 256)
    >>> key = report.rows[0]
    >>> key.path, key.shape, key.spec
    ('blocks/attn/cached_key', (32, 8, 8192, 8, 128), P(None, 'data', None, 'model', None))
    """
    _check_model(model, "explain_cache")
    for name, value in (("batch", batch), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"explain_cache: {name} must be a positive int, got {value!r}.")
    if not isinstance(mesh, AbstractMesh):
        mesh = make_mesh(mesh)
    gen_rules = generation_rules(rules)
    _check_batch(int(batch), mesh, gen_rules, "explain_cache")
    graphdef, old, rest = nnx.split(model, nnx.Cache, ...)  # type: ignore[misc]
    _, cache = _abstract_cache(graphdef, old, rest, int(batch), int(length))
    return Report(rows=tuple(layout_rows(cache, mesh, gen_rules)), mesh_shape=mesh_sizes(mesh))
