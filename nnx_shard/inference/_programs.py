"""The compiled programs of generation: the prefill (the cache created in its layout,
the prompt run, the first token chosen) and the decode loop through the cache, built
once per shape; and the cache's abstract state (shapes and logical names from the
model's ``init_cache``, nothing allocated)."""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from nnx_shard._annotate import path_str
from nnx_shard._mesh import apply_sharding, variable_spec
from nnx_shard._rules import Rules
from nnx_shard.inference._decoding import banned_tokens, choose
from nnx_shard.models._ops import whole


def _with_cache(graphdef: Any, cache: Any, rest: Any, batch: int, length: int) -> Any:
    model = nnx.merge(graphdef, cache, rest)
    model.init_cache(batch, length)
    return model


def _avals(tree: Any) -> tuple[Any, ...]:
    """What tracing sees of ``tree``: its structure and each leaf's shape, dtype and
    sharding (the arrays themselves are not kept: a key of :data:`_ABSTRACT`)."""
    leaves, structure = jax.tree_util.tree_flatten(tree)
    return structure, tuple((np.shape(x), str(getattr(x, "dtype", type(x))),
                             getattr(x, "sharding", None)) for x in leaves)


#: :func:`abstract_cache`'s results by model graph, avals and cache size (the newest last).
_ABSTRACT: collections.OrderedDict[Any, tuple[Any, nnx.State]] = collections.OrderedDict()


def abstract_cache(graphdef: Any, cache: Any, rest: Any, batch: int,
                   length: int) -> tuple[Any, nnx.State]:
    """The graph of the model with its cache, and the cache's abstract state:
    shapes, dtypes and logical names from ``init_cache``, nothing allocated.
    Traced once per model graph, parameter avals and cache size: a second
    ``generate`` call of the same shape traces nothing here."""
    key = (graphdef, _avals(cache), _avals(rest), batch, length,
           jax.sharding.get_abstract_mesh())
    if key not in _ABSTRACT:
        _ABSTRACT[key] = _trace_cache(graphdef, cache, rest, batch, length)
        while len(_ABSTRACT) > 32:
            _ABSTRACT.popitem(last=False)
    _ABSTRACT.move_to_end(key)
    with_cache, state = _ABSTRACT[key]
    return with_cache, jax.tree.map(lambda x: x, state)  # the caller's own copy


def _trace_cache(graphdef: Any, cache: Any, rest: Any, batch: int, length: int
                 ) -> tuple[Any, nnx.State]:
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


def _constrain_cache(cache: nnx.State, mesh: Any, rules: Rules | None) -> nnx.State:
    """Each cache array constrained to its layout (inside a compiled program)."""
    if mesh is None or rules is None:
        return cache

    def one(path: Any, var: Any) -> Any:
        spec = variable_spec(var, mesh, rules, path_str(path))
        return var.replace(apply_sharding(var.get_value(), NamedSharding(mesh, spec)))

    return jax.tree_util.tree_map_with_path(one, cache,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


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


@dataclasses.dataclass(frozen=True)
class Programs:
    prefill: Any   # (old, rest, prompt, mask, real, key, options) -> (cache, carry)
    decode: Any    # (rest, cache, carry, key, options, stop, halt) -> (cache, carry)


@functools.lru_cache(maxsize=32)
def build_programs(graphdef: Any, with_cache: Any, mesh: Mesh | None, rules: Rules | None,
                   batch: int, prompt_len: int, new: int, masked: bool, last_only: bool
                   ) -> Programs:
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

    return Programs(prefill=jax.jit(_prefill), decode=jax.jit(_decode, donate_argnums=(1, 2)))

