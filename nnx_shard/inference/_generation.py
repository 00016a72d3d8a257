"""The driver of generation: :func:`generate` and :func:`stream` check their
arguments, run the compiled prefill and decode programs (:mod:`._programs`) and
check stop strings on the host between chunks; the cache is laid out by
:func:`~nnx_shard.inference._cache_layout.generation_rules`. Documented where public:
:mod:`nnx_shard.inference`."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from nnx_shard._annotate import logical_names, path_str
from nnx_shard._axes import mesh_sizes
from nnx_shard._errors import ShardingError, ShardingWarning, UsageError, count, short
from nnx_shard._mesh import nbytes, use, variable_spec
from nnx_shard._rules import Rules
from nnx_shard.inference._cache_layout import generation_rules
from nnx_shard.inference._checks import (
    batch_multiple,
    check_batch,
    check_ids,
    check_lengths,
    check_model,
    check_seed,
    decode_takes,
    logits_vocab,
    placement,
    read_prompts,
)
from nnx_shard.inference._config import GenerationConfig
from nnx_shard.inference._decoding import (
    Options,
    check_options,
    choose,
    config_vocab,
    warp,
)
from nnx_shard.inference._programs import Programs, abstract_cache, build_programs
from nnx_shard.models._kv_cache import CACHE_AXES
from nnx_shard.models._resize import memory_shortfall

__all__ = ["CACHE_AXES", "GENERATION_FIELDS", "GenerationConfig", "Options", "check_config",
           "check_options", "choose", "generate", "stream", "warp"]

#: The settings a :class:`GenerationConfig` holds (refused as keywords of the calls).
GENERATION_FIELDS = frozenset(f.name for f in dataclasses.fields(GenerationConfig))

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


@dataclasses.dataclass(frozen=True)
class _Run:
    """Everything one call of :func:`generate` needs, checked."""

    programs: Programs
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
             tokenizer: Any = None, max_length: int = 20) -> _Run:
    check_model(model, caller)
    prompt, mask = read_prompts(prompts, attention_mask, model, caller)
    if max_new_tokens is None:
        max_new_tokens = _from_max_length(prompt.shape[1], max_length, caller)
    if options.num_return_sequences > 1:  # transformers' order: each prompt's copies together
        _check_copies(model, prompt.shape, options.num_return_sequences, max_new_tokens, mesh,
                      rules, caller)
        prompt = np.repeat(prompt, options.num_return_sequences, axis=0)
        mask = None if mask is None else np.repeat(mask, options.num_return_sequences, axis=0)
    masked = decode_takes(model, "attention_mask")
    if mask is not None and not masked:
        raise UsageError(f"{caller}: the prompts are padded, but {type(model).__name__}.decode "
                         "takes no attention_mask, so the padding would be attended to. Fix: "
                         "give decode an attention_mask= (as Decoder has), or "
                         "prompts of one length.")
    rows, prompt_len = prompt.shape
    new = check_lengths(model, prompt_len, max_new_tokens, caller)
    if options.no_repeat_ngram_size > prompt_len + new:
        # No n-gram that long fits in a row, so none is banned: off, rather than a loop
        # of n - 1 comparisons at every step finding nothing.
        options = dataclasses.replace(options, no_repeat_ngram_size=0)
    if options.min_new_tokens > new:
        raise UsageError(f"{caller}: min_new_tokens={options.min_new_tokens} is more than "
                         f"max_new_tokens={new}: no row could reach it. Fix: min_new_tokens <= "
                         "max_new_tokens.")
    seed = check_seed(seed, caller)
    mesh, rules = placement(mesh, rules, caller)
    gen_rules = None
    batch = rows
    if mesh is not None:
        gen_rules = generation_rules(rules)
        try:
            multiple = batch_multiple(mesh, gen_rules)
        except ShardingError:
            multiple = 1
        batch = -(-rows // multiple) * multiple
        check_batch(batch, mesh, gen_rules, caller)
    if mask is None:
        mask = np.ones_like(prompt)
    real = np.arange(batch) < rows
    if batch > rows:  # dummy rows (a copy of the first) so the batch divides over the mesh
        prompt = np.concatenate([prompt, np.repeat(prompt[:1], batch - rows, 0)])
        mask = np.concatenate([mask, np.repeat(mask[:1], batch - rows, 0)])
    graphdef, old, rest = nnx.split(model, nnx.Cache, ...)  # type: ignore[misc]
    with_cache, cache = abstract_cache(graphdef, old, rest, batch, prompt_len + new)
    if config_vocab(model) is None:  # a model of the caller's: its logits say the vocabulary
        with (use(mesh, gen_rules) if mesh is not None and gen_rules is not None
              else contextlib.nullcontext()):
            vocab = logits_vocab(lambda c, r, x: nnx.merge(with_cache, c, r).decode(x), cache,
                                 rest, jax.ShapeDtypeStruct((batch, 1), jnp.int32))
        check_ids(np.where(mask > 0, prompt, 0), vocab, caller)
        if vocab is not None and options.top_k > vocab:  # transformers' top-k: all at most
            options = dataclasses.replace(options, top_k=0)
    if mesh is not None:
        _warn_unannotated(cache, mesh, caller)
        for path, var in nnx.to_flat_state(cache):  # every other layout problem, by path
            variable_spec(var, mesh, gen_rules, path_str(path))  # type: ignore[arg-type]
    programs = build_programs(graphdef, with_cache, mesh, gen_rules, batch, prompt_len, new,
                              masked, decode_takes(model, "logits_to_keep"))
    stops = None
    if options.stop_strings:
        stops = _StopStrings(options.stop_strings, tokenizer, prompt[:rows], mask[:rows],
                             options.eos)
    return _Run(programs, old, rest, prompt, mask, real, rows, new, jax.random.key(int(seed)),
                options.traced(), mesh, gen_rules, stops)


def _from_max_length(prompt_len: int, max_length: int, caller: str) -> int:
    """The new tokens ``max_length`` leaves after the prompt (transformers' bound
    when ``max_new_tokens`` is not set)."""
    if prompt_len >= max_length:
        raise UsageError(f"{caller}: the prompt has {prompt_len} tokens and max_length is "
                         f"{max_length} (prompt and new tokens), so no token is left to "
                         "generate. Fix: set max_new_tokens, e.g. GenerationConfig("
                         "max_new_tokens=32).")
    return max_length - prompt_len


#: Host bytes a row takes per position beyond its cache: its token, mask and
#: log-probability.
_ROW_BYTES = 12


def _check_copies(model: Any, shape: tuple[int, int], copies: int, max_new_tokens: Any,
                  mesh: Any, rules: Any, caller: str) -> None:
    """Refuses ``num_return_sequences`` whose ``rows * copies`` rows (their cache and
    tokens, split over every device at best) the devices' memory cannot hold, before
    the prompt is copied: one UsageError naming the most that fit."""
    rows, prompt_len = shape
    positions = prompt_len + check_lengths(model, prompt_len, max_new_tokens, caller)
    where = placement(mesh, rules, caller)[0]
    devices = list(where.devices.flat) if where is not None else jax.devices()[:1]
    graphdef, old, rest = nnx.split(model, nnx.Cache, ...)  # type: ignore[misc]
    _, cache = abstract_cache(graphdef, old, rest, 1, positions)
    per_row = positions * _ROW_BYTES + sum(nbytes(x.shape, x.dtype)
                                           for x in jax.tree.leaves(cache))

    def short(n: int) -> str | None:
        each = -(-rows * n * per_row // len(devices))
        return memory_shortfall(dict.fromkeys(devices, each))

    problem = short(copies)
    if problem is None:
        return
    low, high = 0, copies  # the most copies that fit: short(low) is None, short(high) is not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if short(mid) is None else (low, mid)
    most = (f"num_return_sequences <= {low} for {rows} prompt(s) of this length" if low
            else "fewer prompts")
    raise UsageError(
        f"{caller}: num_return_sequences={copies} makes {rows} prompt(s) x {copies} = "
        f"{rows * copies:,} rows of {positions} positions, whose cache and tokens need "
        f"{problem}. Fix: {most}, or a smaller max_new_tokens.")


def generate(model: Any, prompts: Any, config: GenerationConfig | None = None, *,
             attention_mask: Any = None, tokenizer: Any = None, seed: int = 0,
             mesh: Mesh | str | Mapping[str, int] | None = None,
             rules: Rules | Mapping[str, Any] | None = None, **unknown: Any) -> Any:
    """``prompts`` continued as ``config`` (a
    :class:`~nnx_shard.inference.GenerationConfig`; default ``GenerationConfig()``)
    says: int32 ``[batch, length + max_new_tokens]``, the prompt first, each row's
    new tokens in the last ``max_new_tokens`` columns.

    ``prompts``: an int ``[batch, length]`` array (rows padded on the left marked
    by ``attention_mask``, 1: real token, 0: padding) or a list of token-id
    sequences of any lengths (padded on the left with the pad id to the longest,
    and masked). A padded row generates what the row alone generates.

    Every generation setting is a field of ``config``, in transformers' meaning:
    greedy (the argmax: deterministic) unless ``do_sample=True``, then tokens are
    sampled with a key that depends on ``seed`` and the column only. The
    processors apply in transformers' order: ``repetition_penalty`` (greedy
    too), ``no_repeat_ngram_size`` (a vectorised match over the row's token
    buffer at each step; the padding of ragged prompts is no part of a row) and
    ``min_new_tokens`` (the eos ids masked until a row has that many), then
    ``temperature``, ``top_k``, ``top_p``, ``min_p``. A row stops at its first
    ``eos_token_id`` (kept) and holds the pad id after it; the loop ends as soon
    as every row has stopped. ``stop_strings`` need the ``tokenizer`` that decodes
    the tokens (e.g. :class:`~nnx_shard.inference.Tokenizer`): the text is only
    known on the host, so the loop then runs in chunks of 16 steps and the rows
    that stopped are padded from their stop on. ``num_return_sequences=n``
    (sampling only) continues each prompt row ``n`` times, the output's rows
    ``[row 0] * n, [row 1] * n, ...``. ``return_logprobs=True`` returns
    ``(tokens, logprobs)``, ``logprobs [batch, max_new_tokens]`` float32 the
    log-probability of each new token under the model's unprocessed
    distribution (0 after a row stopped).

    One compiled prefill creates the key/value cache in its layout and runs the
    prompt; one compiled loop decodes the rest through the cache. Both are
    compiled once per shape (model graph, layout, batch, prompt length,
    ``max_new_tokens``) and reused: the prompts' values, the mask, ``seed`` and
    every setting's value are arguments of the programs.

    Args:
      model: any module with ``init_cache`` and ``decode`` (the reference models).
      prompts: an int ``[batch, length]`` array, or a list of token-id lists.
      config: the generation settings (:class:`~nnx_shard.inference.GenerationConfig`).
      attention_mask: ``[batch, length]``, 1 on tokens and 0 on left padding; built for
        a list of prompts.
      tokenizer: decodes the tokens for ``config.stop_strings``.
      seed: the sampling key's seed (an int).
      mesh: the mesh to run on (with ``rules``); else :func:`nnx_shard.use`'s, if any.
      rules: the layout's rules (with ``mesh``).
      **unknown: refused; a setting given here names the ``GenerationConfig`` to put it in.

    Returns:
      int32 ``[batch * num_return_sequences, length + max_new_tokens]``, or
      ``(tokens, logprobs)`` with ``return_logprobs=True``.

    Under :func:`nnx_shard.use` (or with ``mesh=`` and ``rules=``) it runs
    sharded: parameters stay where they are, activations and the cache are laid
    out by :func:`generation_rules` of the rules; a batch that does not divide
    over the batch's mesh axes is padded with dummy rows and cut back.
    ``model`` is any module with ``init_cache`` and ``decode`` (see
    :mod:`nnx_shard.inference`; padded prompts need ``decode(tokens,
    attention_mask=)``); it is not changed (the cache lives in the programs
    only).

    Raises:
      UsageError: ``config`` not a ``GenerationConfig``; ``model`` lacks
        ``init_cache``/``decode``; ``prompts`` are not integers, not of rank 2,
        empty, or with ids outside the vocabulary (``cfg.vocab``, else the width
        of ``decode``'s logits; the first one named by row and column), a list
        with an empty row; ``max_new_tokens`` past the model's context
        (``max_length``), a prompt that fills it, or one of ``config.max_length``
        tokens without ``max_new_tokens``; ``mesh`` without ``rules`` or the
        reverse; an ``eos_token_id`` or ``pad_token_id`` past the vocabulary;
        ``min_new_tokens`` above the new tokens; ``no_repeat_ngram_size``
        longer than the context; ``stop_strings`` without a ``tokenizer``; more
        ``num_return_sequences`` copies than the devices' memory holds (the
        most that fit named); a ``seed`` that is not an int of int64's range;
        ``attention_mask`` out of range; an argument ``generate`` does not take.
      ShardingError: a cache array does not fit its rule.

    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> from nnx_shard.inference import GenerationConfig, generate
    >>> from nnx_shard.models import Decoder, get_config
    >>> model = Decoder(get_config("tiny"), rngs=nnx.Rngs(0))
    >>> six = GenerationConfig(max_new_tokens=6)
    >>> out = generate(model, [[1, 2, 3, 4]], six)
    >>> out.shape, out.dtype, out[0, :4].tolist()
    ((1, 10), dtype('int32'), [1, 2, 3, 4])
    >>> ragged = generate(model, [[1, 2, 3, 4], [3, 4]], six)
    >>> ragged[1, :2].tolist(), bool((ragged[1, 4:] == generate(model, [[3, 4]], six)[0, 2:]).all())
    ([0, 0], True)
    >>> tokens, logprobs = generate(model, [[1, 2, 3, 4]], six.replace(return_logprobs=True))
    >>> logprobs.shape, bool((logprobs <= 0).all())
    ((1, 6), True)
    >>> strategy = ns.strategies.get("tp")
    >>> mesh = strategy.make_mesh()                                   # data=2, model=4
    >>> sharded = ns.sharded_init(lambda: Decoder(get_config("tiny"), rngs=nnx.Rngs(0)),
    ...                           mesh, strategy)
    >>> with ns.use(mesh, strategy.rules):
    ...     again = generate(sharded, [[1, 2, 3, 4]], six)   # 1 row of 2: padded
    >>> bool((again == out).all())
    True
    >>> generate(model, [[1, 2, 3, 4]], GenerationConfig(max_new_tokens=16))
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: generate: prompt (4 tokens) + max_new_tokens (16) = 20 positions, past the model's context of 16 (max_length). Fix: max_new_tokens <= 12, or a shorter prompt.
    >>> no_repeat = generate(model, [[1, 2, 3, 4]], six.replace(no_repeat_ngram_size=2))
    >>> pairs = list(zip(no_repeat[0].tolist(), no_repeat[0].tolist()[1:]))
    >>> len(pairs) == len(set(pairs))
    True
    >>> sampled = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.8,
    ...                            num_return_sequences=3)
    >>> generate(model, [[1, 2, 3, 4]], sampled, seed=1).shape
    (3, 10)
    """
    config = check_config(config, unknown, "generate")
    options = check_options(model, config, tokenizer=tokenizer)
    run = _prepare(model, prompts, config.max_new_tokens, options, seed, mesh, rules,
                   "generate", attention_mask, tokenizer, config.max_length)
    if run.stops is not None:  # the text is read on the host between chunks
        steps = list(_steps(run, STOP_CHUNK, True))
        tokens = np.full((run.rows, run.prompt.shape[1] + run.new), options.pad, np.int32)
        tokens[:, :run.prompt.shape[1]] = run.prompt[:run.rows]
        logprobs = np.zeros((run.rows, run.new), np.float32)
        if steps:
            tokens[:, run.prompt.shape[1]:run.prompt.shape[1] + len(steps)] = np.stack(
                [t for t, _ in steps], 1)
            logprobs[:, :len(steps)] = np.stack([lp for _, lp in steps], 1)
        return (tokens, logprobs) if config.return_logprobs else tokens
    cache, carry = run.prefill()
    _, carry = run.decode(cache, carry, run.new)
    tokens = carry["tokens"][:run.rows]
    if config.return_logprobs:
        return tokens, carry["logprobs"][:run.rows]
    return tokens


#: Steps per compiled call when stop strings are checked on the host between calls.
STOP_CHUNK = 16

#: The keyword arguments of :func:`generate` (:func:`stream` adds ``chunk``).
OPTION_NAMES = ("attention_mask", "tokenizer", "seed", "mesh", "rules")


def check_config(config: Any, unknown: Mapping[str, Any], caller: str,
                 names: tuple[str, ...] | None = None) -> GenerationConfig:
    """``config`` checked to be a :class:`GenerationConfig` (``None``: the defaults);
    ``unknown`` keywords refused (the call's own are ``names``), a setting among
    them sent to the config.

    >>> check_config(None, {}, "generate").max_length
    20
    >>> check_config(None, {"temperature": 0.7}, "generate")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: generate: temperature= is a setting of GenerationConfig, not an argument of generate. Fix: generate(model, prompts, GenerationConfig(temperature=0.7)).
    """
    settings = sorted(n for n in unknown if n in GENERATION_FIELDS)
    if settings:
        given = ", ".join(f"{n}={short(unknown[n], 30)}" for n in settings)
        raise UsageError(f"{caller}: {', '.join(f'{n}=' for n in settings)} "
                         f"{'is a setting' if len(settings) == 1 else 'are settings'} of "
                         f"GenerationConfig, not an argument of {caller}. Fix: "
                         f"{caller}(model, prompts, GenerationConfig({given})).")
    if unknown:
        if names is None:
            names = OPTION_NAMES + (("chunk",) if caller == "stream" else ())
        bad = sorted(unknown)
        close = [m for n in bad for m in difflib.get_close_matches(
            n, names + tuple(sorted(GENERATION_FIELDS)), 1)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UsageError(f"{caller}: unknown option{'s' if len(bad) > 1 else ''} "
                         f"{', '.join(f'{n}=' for n in bad)}{hint}; it takes a "
                         f"GenerationConfig and {', '.join(names)}. Fix: drop or rename it "
                         "(beam search is not implemented).")
    if config is None:
        return GenerationConfig()
    if not isinstance(config, GenerationConfig):
        example = (f"GenerationConfig(max_new_tokens={int(config)})"
                   if isinstance(config, int | np.integer) and not isinstance(config, bool)
                   else "GenerationConfig(max_new_tokens=32)")
        raise UsageError(f"{caller}: config must be a GenerationConfig, got "
                         f"{type(config).__name__} {short(config, 40)}. Fix: "
                         f"{caller}(model, prompts, {example}).")
    return config


def stream(model: Any, prompts: Any, config: GenerationConfig | None = None, *,
           chunk: int = 16, attention_mask: Any = None, tokenizer: Any = None, seed: int = 0,
           mesh: Mesh | str | Mapping[str, int] | None = None,
           rules: Rules | Mapping[str, Any] | None = None, **unknown: Any) -> Iterator[Any]:
    """:func:`generate` a step at a time: yields each step's new tokens (int32
    numpy ``[batch]``; with ``config.return_logprobs`` ``(tokens, logprobs)``),
    decoding ``chunk`` steps per call of the same compiled decode program that
    :func:`generate` runs (one program whatever ``chunk``: it is an argument).
    It ends after ``max_new_tokens`` steps or the step at which every row has
    stopped (``eos_token_id`` or ``stop_strings``, checked after each chunk);
    what it yields, stacked, equals the new tokens of :func:`generate` up to
    there (the pad id after).

    Args:
      model: as :func:`generate`'s.
      prompts: as :func:`generate`'s.
      config: the generation settings (:class:`~nnx_shard.inference.GenerationConfig`).
      chunk: decode steps per call of the compiled program (a positive int).
      attention_mask: as :func:`generate`'s.
      tokenizer: decodes the tokens for ``config.stop_strings``.
      seed: the sampling key's seed (an int).
      mesh: the mesh to run on (with ``rules``).
      rules: the layout's rules (with ``mesh``).
      **unknown: refused, as :func:`generate` refuses them.

    Yields:
      Each step's new tokens, int32 numpy ``[batch]`` (or ``(tokens, logprobs)``).

    >>> import numpy as np
    >>> from flax import nnx
    >>> from nnx_shard.inference import GenerationConfig, generate, stream
    >>> from nnx_shard.models import Decoder, get_config
    >>> model = Decoder(get_config("tiny"), rngs=nnx.Rngs(0))
    >>> six = GenerationConfig(max_new_tokens=6)
    >>> steps = list(stream(model, [[1, 2, 3, 4]], six, chunk=4))
    >>> len(steps), steps[0].shape
    (6, (1,))
    >>> bool((np.stack(steps, 1) == generate(model, [[1, 2, 3, 4]], six)[:, 4:]).all())
    True
    """
    config = check_config(config, unknown, "stream")
    options = check_options(model, config, tokenizer=tokenizer, caller="stream")
    size = count(chunk, "stream: chunk", fix="e.g. chunk=16")
    run = _prepare(model, prompts, config.max_new_tokens, options, seed, mesh, rules, "stream",
                   attention_mask, tokenizer, config.max_length)
    return _steps(run, size, config.return_logprobs)


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
