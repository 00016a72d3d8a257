"""Choosing each new token: the generation options checked (:class:`Options`,
:func:`check_options`) and applied to the logits in transformers' order
(repetition penalty, banned tokens, then greedy or sampling after top-k, top-p and
min-p). :mod:`nnx_shard.inference` runs these inside its compiled
prefill and decode programs; every option is a traced argument there, so its
value compiles nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard._errors import UsageError, short
from nnx_shard.inference._config import GenerationConfig
from nnx_shard.models._ops import whole

__all__ = ["EOS_SLOTS", "INT32_MAX", "Options", "banned_tokens", "check_options",
           "check_stop_tokenizer", "choose", "config_vocab",
           "first_argmax", "model_context", "pick", "warp"]


# -- the options, checked: sampling ----


def config_vocab(model: Any) -> int | None:
    """The vocabulary size of ``model.cfg.vocab``, or None for a model without one.

    >>> config_vocab(object()) is None
    True
    """
    vocab = getattr(getattr(model, "cfg", None), "vocab", None)
    return int(vocab) if isinstance(vocab, int | np.integer) and not isinstance(vocab, bool) \
        else None


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


# -- the options, checked ------------------------------------------------------------

#: Slots of the traced array of end-of-sequence ids (more ids take the next power
#: of two: another program, which only a longer list of ids asks for).
EOS_SLOTS = 8


@dataclasses.dataclass(frozen=True)
class Options:
    """The checked generation options, host values (traced into the programs as
    arguments, so their values compile nothing)."""

    temperature: float = 0.0
    top_k: int = 0               # 0: off
    top_p: float = 1.0           # 1: off
    min_p: float = 0.0           # 0: off
    repetition_penalty: float = 1.0
    eos: tuple[int, ...] = ()
    pad: int = 0
    min_new_tokens: int = 0
    no_repeat_ngram_size: int = 0  # 0: off
    stop_strings: tuple[str, ...] = ()
    num_return_sequences: int = 1

    def traced(self) -> dict[str, Any]:
        slots = max(EOS_SLOTS, 1 << max(0, len(self.eos) - 1).bit_length())
        eos = np.full((slots,), -1, np.int32)
        eos[:len(self.eos)] = self.eos
        return {"temperature": np.float32(max(self.temperature, 1e-6)),
                "greedy": np.bool_(self.temperature == 0.0), "top_k": np.int32(self.top_k),
                "top_p": np.float32(self.top_p), "min_p": np.float32(self.min_p),
                "penalty": np.float32(self.repetition_penalty), "eos": eos,
                "pad": np.int32(self.pad), "min_new": np.int32(self.min_new_tokens),
                "ngram": np.int32(self.no_repeat_ngram_size)}


def _token_id(value: int, name: str, vocab: int | None, caller: str) -> int:
    if vocab is not None and value >= vocab:
        raise UsageError(f"{caller}: {name}={value!r:.40} is not a token id of the model's "
                         f"vocabulary (0 .. {vocab - 1}). Fix: pass the tokenizer's id, e.g. "
                         "its eos_token_id.")
    return int(value)


def check_options(model: Any, config: GenerationConfig, *, tokenizer: Any = None,
                  caller: str = "generate") -> Options:
    """``config`` (its fields checked when it was built) checked against ``model``
    (the token ids against its vocabulary, the n-gram size against its context;
    ``top_k`` past the vocabulary keeps every token, as in transformers) and the
    ``tokenizer`` its ``stop_strings`` need, as the :class:`Options` the compiled
    programs take. One :class:`~nnx_shard.UsageError` naming the field otherwise.

    >>> from flax import nnx
    >>> from nnx_shard.inference import GenerationConfig
    >>> from nnx_shard.models import Decoder, get_config
    >>> model = Decoder(get_config("tiny"), rngs=nnx.Rngs(0))
    >>> config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, eos_token_id=[2, 3])
    >>> options = check_options(model, config)
    >>> options.eos, options.temperature, options.pad
    ((2, 3), 0.7, 2)
    >>> check_options(model, GenerationConfig(no_repeat_ngram_size=3)).temperature   # greedy
    0.0
    """
    vocab = config_vocab(model)
    t = (1.0 if config.temperature is None else config.temperature) if config.do_sample else 0.0
    k = config.top_k or 0
    if vocab is not None and k > vocab:
        k = 0
    eos = tuple(_token_id(v, "eos_token_id", vocab, caller) for v in config.eos_ids)
    pad = config.pad_token_id
    pad = _token_id(pad, "pad_token_id", vocab, caller) if pad is not None else \
        eos[0] if eos else 0
    ngram = config.no_repeat_ngram_size
    context = model_context(model)
    most, within = ((context, f"the model's context of {context} positions (max_length)")
                    if context is not None else (INT32_MAX, "the int32 the programs take"))
    if ngram > most:
        raise UsageError(f"{caller}: no_repeat_ngram_size={ngram} is longer than {within}: no "
                         f"n-gram that long fits in a row. Fix: e.g. no_repeat_ngram_size=3 "
                         f"(at most {most}), or 0 for off.")
    stops = check_stop_tokenizer(config.stop_strings, tokenizer, caller)
    return Options(t, k, 1.0 if config.top_p is None else config.top_p, config.min_p or 0.0,
                   1.0 if config.repetition_penalty is None else config.repetition_penalty,
                   eos, pad, config.min_new_tokens or 0, ngram, stops,
                   config.num_return_sequences)


#: The largest value an int32 option of the compiled programs holds.
INT32_MAX = 2**31 - 1


def model_context(model: Any) -> int | None:
    """The most positions a sequence of ``model`` can have (its ``max_length``), or
    None for a model that does not say.

    >>> model_context(object()) is None
    True
    """
    value = getattr(model, "max_length", None)
    return int(value) if isinstance(value, int | np.integer) and not isinstance(
        value, bool) else None


def check_stop_tokenizer(stop_strings: str | tuple[str, ...] | None, tokenizer: Any,
                         caller: str) -> tuple[str, ...]:
    """The stop strings as a tuple, once a ``tokenizer`` that decodes the tokens is
    given (the strings themselves were checked by
    :class:`~nnx_shard.inference.GenerationConfig`).

    >>> check_stop_tokenizer(None, None, "generate")
    ()
    """
    if stop_strings is None:
        return ()
    if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
        got = "no tokenizer" if tokenizer is None else f"tokenizer={short(tokenizer, 40)}"
        raise UsageError(f"{caller}: stop_strings need the tokenizer that decodes the tokens "
                         f"(decode(ids)), got {got}. Fix: pass tokenizer=Tokenizer."
                         "from_pretrained(checkpoint_folder) (or transformers' tokenizer).")
    return (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)


# -- choosing a token ------------------------------------------------------------------


def _filtered(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """transformers' TopKLogitsWarper then TopPLogitsWarper (min_tokens_to_keep=1) on
    ``scaled [batch, vocab]``: -inf outside the ``top_k`` largest (all ties of the
    k-th kept), then outside the nucleus (ascending sort, cumulative probability
    ``<= 1 - top_p`` dropped, the largest always kept)."""
    batch, vocab = scaled.shape
    order = jnp.argsort(scaled, axis=-1)                      # ascending
    ascending = jnp.take_along_axis(scaled, order, axis=-1)
    kth = jnp.take_along_axis(ascending, jnp.clip(vocab - top_k, 0, vocab - 1)[None, None]
                              .repeat(batch, 0), axis=-1)
    scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
    ascending = jnp.where((top_k > 0) & (ascending < kth), -jnp.inf, ascending)
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    drop = (cumulative <= 1 - top_p) & (jnp.arange(vocab) < vocab - 1) & (top_p < 1)
    rows = jnp.arange(batch)[:, None]
    drop = jnp.zeros((batch, vocab), bool).at[rows, order].set(drop)
    return jnp.where(drop, -jnp.inf, scaled)


def warp(scores: jax.Array, o: Mapping[str, Any]) -> jax.Array:
    """The sampling scores of float32 ``scores [batch, vocab]``: divided by the
    temperature, then ``-inf`` outside transformers' top-k, top-p and min-p (each
    off at 0, 1 and 0), in that order.

    >>> o = Options(temperature=1.0, top_p=0.5).traced()
    >>> [round(v, 4) for v in warp(jnp.log(jnp.array([[0.1, 0.6, 0.3]])), o)[0].tolist()]
    [-inf, -0.5108, -inf]
    """
    scaled = scores / o["temperature"]
    scaled = jax.lax.cond((o["top_k"] > 0) | (o["top_p"] < 1), _filtered,
                          lambda s, k, q: s, scaled, o["top_k"], o["top_p"])
    probs = jax.nn.softmax(scaled, axis=-1)
    top = jnp.max(probs, axis=-1, keepdims=True)
    keep = (probs >= o["min_p"] * top) | (jnp.arange(probs.shape[-1]) == jnp.argmax(
        probs, axis=-1)[:, None])
    return jnp.where(keep, scaled, -jnp.inf)


def first_argmax(scores: jax.Array) -> jax.Array:
    """``jnp.argmax(scores, axis=-1)`` as int32 (the first of equal maxima; the first
    NaN where there is one), as a max and a min: XLA's CPU backend runs the
    variadic reduction of ``argmax`` element by element, these two vectorised.

    >>> first_argmax(jnp.array([[1.0, 3.0, 3.0], [jnp.nan, 2.0, jnp.nan]])).tolist()
    [1, 0]
    """
    top = jnp.max(scores, axis=-1, keepdims=True)
    hit = (scores == top) | jnp.isnan(scores)
    ids = jnp.arange(scores.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit, ids, jnp.int32(scores.shape[-1])), axis=-1)


def choose(logits: jax.Array, seen: jax.Array, key: jax.Array, position: Any,
           o: Mapping[str, jax.Array], banned: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array]:
    """The next token (int32 ``[batch]``) from ``logits [batch, vocab]`` and its
    log-probability under the unprocessed distribution (``log_softmax`` of the
    logits), the options ``o`` (:meth:`Options.traced`) applied in transformers'
    order: the repetition penalty on the ``seen [batch, vocab]`` tokens (a
    positive logit divided by it, a negative one multiplied), the ``banned
    [batch, vocab]`` tokens at ``-inf`` (repeated n-grams, an eos before
    ``min_new_tokens``: :func:`banned_tokens`), then greedy (the argmax) or
    sampling at ``temperature`` after top-k, top-p and min-p, with the key
    ``fold_in(key, position)``.

    >>> o = Options(repetition_penalty=2.0).traced()
    >>> logits, seen = jnp.array([[1.0, 3.0, 2.0]]), jnp.array([[False, True, False]])
    >>> int(choose(logits, seen, jax.random.key(0), 0, o)[0][0])   # 3 / 2 < 2
    2
    >>> int(choose(logits, seen, jax.random.key(0), 0, o, jnp.array([[0, 0, 1]], bool))[0][0])
    1
    """
    raw = whole(logits.astype(jnp.float32))
    p = o["penalty"]
    scores = jnp.where(seen, jnp.where(raw < 0, raw * p, raw / p), raw)
    if banned is not None:
        scores = jnp.where(banned, -jnp.inf, scores)
    # One branch runs: greedy decoding skips the warpers and the random draw over the
    # vocabulary (most of a step's sampling time at batch 16 on CPU).
    token = jax.lax.cond(
        o["greedy"], lambda s: first_argmax(s),
        lambda s: jax.random.categorical(jax.random.fold_in(key, position), warp(s, o),
                                         axis=-1).astype(jnp.int32), scores)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(raw, axis=-1), token[:, None], axis=-1)
    # Replicated on Explicit meshes, where the tokens join the replicated output.
    return whole(token), whole(logprob[:, 0])


def _repeated_ngrams(tokens: jax.Array, start: jax.Array, column: Any, n: jax.Array,
                     vocab: int) -> jax.Array:
    """``[batch, vocab]`` True for each token that, placed at ``column``, would
    repeat an ``n``-gram of ``tokens[b, start[b]:column]`` (transformers'
    NoRepeatNGramLogitsProcessor, the padding before ``start`` left out): every
    ``j`` whose ``n - 1`` tokens equal the row's last ``n - 1`` bans the token
    after them. One vectorised pass of ``n - 1`` comparisons over the buffer."""
    batch, length = tokens.shape
    ahead = jnp.concatenate([tokens, jnp.full((batch, length), -1, tokens.dtype)], axis=1)

    def same(k: Any, match: jax.Array) -> jax.Array:
        shifted = jax.lax.dynamic_slice_in_dim(ahead, k, length, axis=1)
        recent = jax.lax.dynamic_slice_in_dim(tokens, jnp.maximum(column - n + 1 + k, 0), 1,
                                              axis=1)
        return match & (shifted == recent)

    match = jax.lax.fori_loop(0, n - 1, same, jnp.ones((batch, length), bool))
    j = jnp.arange(length)[None]
    first = start[:, None]
    # the n-gram at j lies in the row (j >= start, its last token before column) and so do
    # the row's last n - 1 tokens (a row of fewer than n - 1 tokens bans nothing)
    match &= (j >= first) & (j + n - 1 < column) & (column - n + 1 >= first)
    after = jax.lax.dynamic_slice_in_dim(ahead, n - 1, length, axis=1)
    ids = jnp.where(match, after, vocab)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], ids.shape)
    return jnp.zeros((batch, vocab), bool).at[rows, ids].set(True, mode="drop")


def banned_tokens(carry: Mapping[str, jax.Array], column: Any, vocab: int,
                  o: Mapping[str, jax.Array]) -> jax.Array:
    """``[batch, vocab]`` True for the tokens the next step may not choose: those
    repeating an n-gram (``no_repeat_ngram_size``, 0: off) and, before
    ``min_new_tokens`` new tokens, the end-of-sequence ids (transformers'
    MinNewTokensLengthLogitsProcessor)."""
    tokens, start = carry["tokens"], carry["start"]
    batch = tokens.shape[0]
    ngrams = jax.lax.cond(o["ngram"] > 0,
                          lambda: _repeated_ngrams(tokens, start, column, o["ngram"], vocab),
                          lambda: jnp.zeros((batch, vocab), bool))
    eos = (jnp.arange(vocab)[None, :] == o["eos"][:, None]).any(axis=0)
    early = carry["step"] < o["min_new"]
    return whole(ngrams | (eos & early)[None, :])
