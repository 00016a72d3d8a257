"""Text generation with a key/value cache laid out by the rules.

:func:`generate` runs two compiled programs per shape: the **prefill** creates
the cache inside the program, each device allocating only its slice (the
layout the rules give the cache's logical names), runs the whole prompt through
the model in one call and picks the first new token; the **decode** program
runs every further token in one ``jax.lax.fori_loop``, each step feeding one
token per sequence and attending through the cache, which is passed in place
(donated) and never gathered.

The cache has its own logical names, :data:`CACHE_AXES` (``cache_batch``,
``cache_length``, ``cache_kv_heads``, ``cache_head_dim``, plus ``layers`` in
front for stacked blocks); every preset of :mod:`nnx_shard.strategies` gives
them a rule (batch over the data axis; key/value heads over the model axis
under the tensor-parallel presets; length over the context axis under the
context-parallel ones). A table without them gets them from its own entries
(:func:`generation_rules`).

Any model that implements two methods can be driven (the reference
:class:`~nnx_shard.models.Transformer` and :class:`~nnx_shard.models.Llama`
do):

* ``init_cache(batch, length)``: create its ``nnx.Cache`` variables for
  ``batch`` sequences of up to ``length`` positions, annotated with logical
  names (e.g. with :func:`nnx_shard.annotate` after stock
  ``nnx.MultiHeadAttention.init_cache``);
* ``decode(tokens)``: logits ``[batch, T, vocab]`` of ``tokens [batch, T]``
  placed after those already cached, storing theirs.

A ``max_length`` attribute, where the model has one, is its context:
:func:`generate` refuses prompts and lengths past it.

A model of stock Flax layers: ``nnx.MultiHeadAttention`` keeps its cache in
``nnx.Cache`` variables (``cached_key``, ``cached_value`` ``[batch, length,
heads, head_dim]``, and ``cache_index``) created by its ``init_cache`` and read
with ``decode=True``. Naming them :data:`CACHE_AXES` with
:func:`nnx_shard.annotate` is all the rules need to lay the cache out (here the
batch over ``data`` and the heads over ``model``, as ``tp`` says); without the
names :func:`generate` warns that the cache is replicated.

>>> import jax.numpy as jnp
>>> import nnx_shard as ns
>>> class StockLM(nnx.Module):
...     max_length = 16
...     def __init__(self, rngs):
...         self.embed = nnx.Embed(64, 32, rngs=rngs)
...         self.pos = nnx.Embed(self.max_length, 32, rngs=rngs)
...         self.attn = nnx.MultiHeadAttention(4, 32, decode=False, rngs=rngs)
...         self.out = nnx.Linear(32, 64, rngs=rngs)
...     def __call__(self, tokens):  # training: the whole sequence, causal
...         x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))
...         return self.out(x + self.attn(x, mask=nnx.make_causal_mask(tokens)))
...     def init_cache(self, batch, length):
...         self.attn.init_cache((batch, length, 32))
...         ns.annotate(self, {r"attn/cached_(key|value)$": CACHE_AXES})
...     def decode(self, tokens):  # one position at a time through the cache
...         steps = []
...         for t in range(tokens.shape[1]):
...             x = self.embed(tokens[:, t:t + 1]) + self.pos(self.attn.cache_index[...])
...             steps.append(self.out(x + self.attn(x, decode=True)))
...         return jnp.concatenate(steps, axis=1)
>>> model = StockLM(nnx.Rngs(0))
>>> generate(model, [[1, 2, 3]], max_new_tokens=5).shape
(1, 8)
>>> mesh = AbstractMesh((2, 4), ("data", "model"))
>>> report = explain_cache(model, mesh, ns.strategies.get("tp").rules, batch=8, length=16)
>>> [(r.path, r.spec) for r in report.rows if r.path.endswith("cached_key")]
[('attn/cached_key', P('data', None, 'model', None))]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from nnx_shard.annotate import logical_names, path_str
from nnx_shard.axes import mesh_sizes
from nnx_shard.errors import ShardingError, ShardingWarning, UsageError, short
from nnx_shard.mesh import apply_sharding, current, make_mesh, use, variable_spec
from nnx_shard.models._ops import whole
from nnx_shard.models.kv_cache import CACHE_AXES
from nnx_shard.report import Report, _rows
from nnx_shard.rules import Rules, as_rules

__all__ = ["CACHE_AXES", "explain_cache", "generate", "generation_rules"]

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
            f"{what}. Fix: implement both (see nnx_shard.models.generation: a model of stock "
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
    _check_ids(arr, _config_vocab(model), caller)
    return arr.astype(np.int32)


def _config_vocab(model: Any) -> int | None:
    vocab = getattr(getattr(model, "cfg", None), "vocab", None)
    return int(vocab) if isinstance(vocab, int | np.integer) and not isinstance(vocab, bool) \
        else None


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


def _check_temperature(temperature: Any, caller: str) -> float:
    if isinstance(temperature, bool | np.bool_ | str | bytes):
        # float(True) is 1.0 and float("0.5") is 0.5: neither is a temperature given.
        raise UsageError(f"{caller}: temperature must be a number, got {short(temperature, 40)} "
                         f"({'a bool' if isinstance(temperature, bool | np.bool_) else 'text'}). "
                         "Fix: temperature=0.0 (greedy) or e.g. temperature=0.8.")
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise TypeError(f"{caller}: temperature must be a number, got {temperature!r:.40}.") from None
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"{caller}: temperature={temperature!r}; use 0 (greedy) or a positive "
                         "number.")
    return t


def _check_top_k(top_k: Any, vocab: int | None, caller: str) -> int | None:
    if top_k is None:
        return None
    if isinstance(top_k, bool | np.bool_) or not isinstance(top_k, int | np.integer) \
            or top_k < 1 or (vocab is not None and top_k > vocab):
        raise UsageError(f"{caller}: top_k={short(top_k, 40)}; use None (every token) or an int "
                         f"from 1 to the vocabulary size{f' ({vocab})' if vocab else ''}. "
                         "Fix: e.g. top_k=40.")
    return int(top_k)


def _check_sampling(temperature: Any, top_k: Any, model: Any, caller: str) -> tuple[float, int | None]:
    return _check_temperature(temperature, caller), _check_top_k(top_k, _config_vocab(model),
                                                                 caller)


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
            f"init_cache, e.g. nnx_shard.annotate(self, {{r'cached_(key|value)$': {CACHE_AXES}}}).",
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


# -- sampling ------------------------------------------------------------------------


def pick(logits: jax.Array, key: jax.Array, position: Any, temperature: jax.Array,
         greedy: bool, top_k: int | None) -> jax.Array:
    """The token (int32 ``[batch]``) at ``position`` from float ``logits [batch,
    vocab]``: the argmax when ``greedy``, else a sample at ``temperature`` among
    the ``top_k`` largest (all when ``None``) with the key ``fold_in(key,
    position)``, so each position's draw depends on the seed and the position
    only (the same under any layout or loop)."""
    if greedy:
        return whole(jnp.argmax(logits, axis=-1).astype(jnp.int32))
    scaled = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    sample = jax.random.categorical(jax.random.fold_in(key, position), scaled, axis=-1)
    # Replicated on Explicit meshes, where the tokens join the replicated output.
    return whole(sample.astype(jnp.int32))


# -- the compiled programs -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Programs:
    prefill: Any   # (cache, rest, prompt, key, temperature, mask) -> (cache, first token)
    decode: Any    # (rest, cache, prompt, first, key, temperature) -> (tokens, cache)


@functools.lru_cache(maxsize=32)
def _programs(graphdef: Any, with_cache: Any, mesh: Mesh | None, rules: Rules | None,
              batch: int, prompt_len: int, new: int, greedy: bool,
              top_k: int | None) -> _Programs:
    """The prefill and decode programs of one shape (cached: a second call with
    the same model graph, layout and shape compiles nothing)."""
    length = prompt_len + new

    def _prefill(old: Any, rest: Any, prompt: Any, key: Any, temperature: Any,
                 mask: Any = None) -> Any:
        # ``mask [batch, prompt_len]`` (0: padding) reaches the model's decode as its
        # attention_mask: a left-padded row's first token is the one of the row alone.
        model = nnx.merge(graphdef, old, rest)
        model.init_cache(batch, length)
        nnx.update(model, _constrain_cache(nnx.state(model, nnx.Cache), mesh, rules))
        out = model.decode(prompt) if mask is None else model.decode(prompt, attention_mask=mask)
        logits = out[:, -1]
        first = pick(logits, key, prompt_len, temperature, greedy, top_k)
        return _constrain_cache(nnx.state(model, nnx.Cache), mesh, rules), first

    def _decode(rest: Any, cache: Any, prompt: Any, first: Any, key: Any,
                temperature: Any) -> Any:
        tokens = jnp.zeros((batch, length), jnp.int32).at[:, :prompt_len].set(prompt)
        tokens = tokens.at[:, prompt_len].set(first)

        def step(i: Any, carry: Any) -> Any:
            tokens, last, cache = carry
            model = nnx.merge(with_cache, cache, rest)
            logits = model.decode(last[:, None])[:, -1]
            position = prompt_len + 1 + i
            token = pick(logits, key, position, temperature, greedy, top_k)
            tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, position))
            return tokens, token, _constrain_cache(nnx.state(model, nnx.Cache), mesh, rules)

        tokens, _, cache = jax.lax.fori_loop(0, new - 1, step, (tokens, first, cache))
        return tokens, cache

    return _Programs(prefill=jax.jit(_prefill), decode=jax.jit(_decode, donate_argnums=(1,)))


@dataclasses.dataclass(frozen=True)
class _Run:
    """Everything one call of :func:`generate` needs, checked."""

    programs: _Programs
    old: Any
    rest: Any
    prompt: np.ndarray
    key: jax.Array
    temperature: jax.Array
    mesh: Mesh | None
    rules: Rules | None

    def context(self) -> Any:
        if self.mesh is None or self.rules is None:
            return contextlib.nullcontext()
        return use(self.mesh, self.rules)

    def prefill(self, attention_mask: Any = None) -> Any:
        """The compiled prefill; ``attention_mask [batch, prompt_len]`` (0: padding)
        masks the prompt's padding (the decode loop does not keep it yet)."""
        with self.context():
            if attention_mask is None:
                return self.programs.prefill(self.old, self.rest, self.prompt, self.key,
                                             self.temperature)
            return self.programs.prefill(self.old, self.rest, self.prompt, self.key,
                                         self.temperature, np.asarray(attention_mask, np.int32))

    def decode(self, cache: Any, first: Any) -> Any:
        with self.context():
            return self.programs.decode(self.rest, cache, self.prompt, first, self.key,
                                        self.temperature)


def _prepare(model: Any, prompt_tokens: Any, max_new_tokens: Any, temperature: Any,
             top_k: Any, seed: int, mesh: Any, rules: Any, caller: str) -> _Run:
    _check_model(model, caller)
    prompt = _check_prompt(prompt_tokens, model, caller)
    batch, prompt_len = prompt.shape
    new = _check_lengths(model, prompt_len, max_new_tokens, caller)
    t, k = _check_sampling(temperature, top_k, model, caller)
    seed = _check_seed(seed, caller)
    mesh, rules = _placement(mesh, rules, caller)
    gen_rules = None
    if mesh is not None:
        gen_rules = generation_rules(rules)
        _check_batch(batch, mesh, gen_rules, caller)
    graphdef, old, rest = nnx.split(model, nnx.Cache, ...)  # type: ignore[misc]
    with_cache, cache = _abstract_cache(graphdef, old, rest, batch, prompt_len + new)
    if _config_vocab(model) is None:  # a model of the caller's: its logits say the vocabulary
        with (use(mesh, gen_rules) if mesh is not None and gen_rules is not None
              else contextlib.nullcontext()):
            vocab = _logits_vocab(lambda c, r, x: nnx.merge(with_cache, c, r).decode(x), cache,
                                  rest, jax.ShapeDtypeStruct((batch, 1), jnp.int32))
        _check_ids(prompt, vocab, caller)
        k = _check_top_k(top_k, vocab, caller)
    if mesh is not None:
        _warn_unannotated(cache, mesh, caller)
        for path, var in nnx.to_flat_state(cache):  # every other layout problem, by path
            variable_spec(var, mesh, gen_rules, path_str(path))  # type: ignore[arg-type]
    programs = _programs(graphdef, with_cache, mesh, gen_rules, batch, prompt_len, new,
                         t == 0.0, k)
    return _Run(programs, old, rest, prompt, jax.random.key(seed),
                jnp.float32(max(t, 1e-6)), mesh, gen_rules)


def generate(model: Any, prompt_tokens: Any, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, mesh: Mesh | str | Mapping[str, int] | None = None,
             rules: Rules | Mapping[str, Any] | None = None) -> jax.Array:
    """``prompt_tokens`` (int ``[batch, length]``) continued by ``max_new_tokens``
    tokens: int32 ``[batch, length + max_new_tokens]``, the prompt first.

    One compiled prefill creates the key/value cache in its layout and runs the
    prompt; one compiled loop decodes the rest, a token per sequence per step,
    through the cache. Both are compiled once per shape (model graph, layout,
    batch, prompt length, ``max_new_tokens``, greedy or not, ``top_k``) and
    reused: the prompt's values, ``temperature`` and ``seed`` change nothing.

    ``temperature=0`` is greedy (the argmax: deterministic); above 0 tokens are
    sampled from ``softmax(logits / temperature)`` restricted to the ``top_k``
    most likely (``None``: all), with a key that depends on ``seed`` and the
    position only.

    Under :func:`nnx_shard.use` (or with ``mesh=`` and ``rules=``) it runs
    sharded: parameters stay where they are, activations and the cache are laid
    out by :func:`generation_rules` of the rules. ``model`` is any module with
    ``init_cache`` and ``decode`` (see :mod:`nnx_shard.models.generation`); it is
    not changed (the cache lives in the programs only).

    Raises:
      TypeError: ``model`` lacks ``init_cache``/``decode``; ``prompt_tokens``
        are not integers; ``max_new_tokens`` is not an int; ``mesh`` without
        ``rules`` or the reverse.
      ValueError: ``prompt_tokens`` not of rank 2, empty, or with ids outside
        the vocabulary (``cfg.vocab``, else the width of ``decode``'s logits);
        the prompt longer than the model's context (``max_length``), or
        ``max_new_tokens`` < 1 or past it; a negative ``temperature``, a
        ``top_k`` out of range.
      UsageError (a ValueError): a ``temperature`` given as a bool or text, a
        ``seed`` that is not an int of int64's range (a bool, a float, a key
        array), ids outside the vocabulary (the first one named by row and
        column), a ``top_k`` past the vocabulary.
      ShardingError: the batch does not divide over the mesh axes of
        ``cache_batch`` (or ``batch``), or any cache array does not fit its rule.

    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> from nnx_shard.models import Transformer, get_config
    >>> model = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
    >>> out = generate(model, [[1, 2, 3, 4]], max_new_tokens=6)
    >>> out.shape, out.dtype, out[0, :4].tolist()
    ((1, 10), dtype('int32'), [1, 2, 3, 4])
    >>> strategy = ns.strategies.get("tp")
    >>> mesh = strategy.make_mesh()                                   # data=2, model=4
    >>> sharded = strategy.sharded_init(lambda: Transformer(get_config("tiny"),
    ...                                                     rngs=nnx.Rngs(0)), mesh)
    >>> with ns.use(mesh, strategy.rules):
    ...     again = generate(sharded, [[1, 2, 3, 4]] * 2, max_new_tokens=6)
    >>> bool((again == out).all())
    True
    >>> generate(model, [[1, 2, 3, 4]], max_new_tokens=16)
    Traceback (most recent call last):
    ...
    ValueError: generate: prompt (4 tokens) + max_new_tokens (16) = 20 positions, past the model's context of 16 (max_length). Fix: max_new_tokens <= 12, or a shorter prompt.
    """
    run = _prepare(model, prompt_tokens, max_new_tokens, temperature, top_k, seed, mesh, rules,
                   "generate")
    cache, first = run.prefill()
    tokens, _ = run.decode(cache, first)
    return tokens


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
    >>> from nnx_shard.models import Llama, get_llama_config
    >>> model = nnx.eval_shape(lambda: Llama(get_llama_config("llama3-8b"), rngs=nnx.Rngs(0)))
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
    return Report(rows=tuple(_rows(cache, mesh, gen_rules)), mesh_shape=mesh_sizes(mesh))
