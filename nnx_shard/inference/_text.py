"""Text in and out of :func:`~nnx_shard.models.generate`: prompts encoded with a
:class:`~nnx_shard.models.Tokenizer`, the new tokens decoded up to the first
end-of-sequence id. :func:`generate_text` returns whole continuations,
:func:`stream_text` yields one continuation's text as :func:`~nnx_shard.models.stream`
decodes it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np

from nnx_shard._errors import UsageError, count, flag, short
from nnx_shard.inference._generation import check_options, generate, stream
from nnx_shard.inference._tokenizer import Tokenizer

__all__ = ["generate_text", "stream_text"]

#: The options of :func:`~nnx_shard.models.generate` that pass through as given.
OPTIONS = ("eos_token_id", "pad_token_id", "temperature", "top_k", "top_p", "min_p",
           "repetition_penalty", "min_new_tokens", "no_repeat_ngram_size", "stop_strings",
           "num_return_sequences", "seed", "mesh", "rules")
# What the text functions decide themselves.
_OWN = {"attention_mask": "prompts of any lengths are padded and masked here",
        "return_logprobs": "the text has no per-token values; call generate for them"}


def _options(options: dict[str, Any], tokenizer: Tokenizer, caller: str,
             model: Any) -> dict[str, Any]:
    """The options for generate: eos and pad from the tokenizer unless given (an id
    the model has not is named with the file it was read from)."""
    for name in options:
        if name in _OWN:
            raise UsageError(f"{caller}: {name}= is not taken ({_OWN[name]}). Fix: drop it.")
        if name not in OPTIONS:
            raise UsageError(f"{caller}: unknown option {name}=; it takes generate's "
                             f"{', '.join(OPTIONS)}. Fix: drop or rename it.")
    out = dict(options)
    if out.get("stop_strings") is not None:  # decoded with the prompts' tokenizer
        out["tokenizer"] = tokenizer
    if out.get("eos_token_id") is None:
        eos = tokenizer.eos_token_ids
        out["eos_token_id"] = list(eos) if eos else None
        if eos:
            _model_has(model, tokenizer, "eos_token_id", list(eos), caller)
    if "pad_token_id" not in out:
        pad = tokenizer.generation_pad_token_id
        eos = out["eos_token_id"]
        first = eos[0] if isinstance(eos, list | tuple) and eos else eos
        # transformers' choice too: no pad token, the (first) eos pads.
        out["pad_token_id"] = pad if pad is not None else first if first is not None else 0
        if pad is not None:
            _model_has(model, tokenizer, "pad_token_id", pad, caller)
    return out


def _model_has(model: Any, tokenizer: Tokenizer, name: str, value: Any, caller: str) -> None:
    """The tokenizer's stop or pad ids checked against the model's vocabulary."""
    try:
        check_options(model, **{name: value})
    except UsageError as e:
        said = str(e).split(": ", 1)[-1].split(". Fix")[0]
        raise UsageError(f"{caller}: {name} {value} read from {tokenizer.stop_source(name)} "
                         f"is not an id of this model ({said}). Fix: pass {name}= explicitly, "
                         "or use the model's own tokenizer folder.") from None


def _stops(eos: Any) -> set[int]:
    if eos is None:
        return set()
    values = list(eos) if isinstance(eos, list | tuple | np.ndarray) else [eos]
    return {int(v) for v in values}


def _encode(tokenizer: Any, prompts: Any, chat: Any, caller: str) -> list[list[int]]:
    if not isinstance(tokenizer, Tokenizer):
        raise UsageError(f"{caller}: tokenizer must be a nnx_shard.models.Tokenizer, got "
                         f"{type(tokenizer).__name__} {short(tokenizer, 60)}. Fix: "
                         "Tokenizer.from_pretrained(checkpoint_folder).")
    if isinstance(prompts, str) or not isinstance(prompts, list | tuple) or not prompts or \
            not all(isinstance(p, str) for p in prompts):
        one = " (one prompt is a list of one string)" if isinstance(prompts, str) else ""
        raise UsageError(f"{caller}: prompts must be a non-empty list of strings{one}, got "
                         f"{type(prompts).__name__} {short(prompts, 60)}. Fix: e.g. "
                         "['Once upon a time'].")
    as_chat = flag(chat, f"{caller}: chat")
    rows = []
    for i, text in enumerate(prompts):
        ids = cast("list[int]", tokenizer.apply_chat_template(
            [{"role": "user", "content": text}])) if as_chat else tokenizer.encode(text)
        if not ids:
            raise UsageError(f"{caller}: prompts[{i}] {short(text, 40)} encodes to no tokens (the "
                             "tokenizer adds no bos token). Fix: give it some text.")
        rows.append(ids)
    return rows


def _text(tokenizer: Tokenizer, new: Any, stops: set[int]) -> str:
    """The text of one row's new tokens, up to its first stop id."""
    ids = [int(t) for t in new]
    end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return tokenizer.decode(ids[:end], skip_special_tokens=True)


def generate_text(model: Any, tokenizer: Tokenizer, prompts: Sequence[str],
                  max_new_tokens: int, *, chat: bool = False, **options: Any) -> list[str]:
    """Each of ``prompts`` continued by up to ``max_new_tokens`` tokens of
    :func:`~nnx_shard.inference.generate`, as text: only the new tokens, up to (not
    including) the first end-of-sequence id, decoded without special tokens.

    Prompts are encoded with ``tokenizer`` (its bos token added), or with
    ``chat=True`` rendered as one user message each by its chat template; prompts
    of different lengths are padded on the left and masked. ``options`` are
    :func:`~nnx_shard.models.generate`'s: ``temperature``, ``top_k``, ``top_p``,
    ``min_p``, ``repetition_penalty``, ``min_new_tokens``, ``no_repeat_ngram_size``,
    ``stop_strings`` (decoded with ``tokenizer``), ``num_return_sequences`` (then
    each prompt's continuations follow one another), ``seed``, ``mesh``,
    ``rules``, and ``eos_token_id`` and ``pad_token_id``, which default to the
    tokenizer's (:attr:`Tokenizer.eos_token_ids`: ``generation_config.json``'s
    first; the pad falls back to the eos, as in transformers).

    Args:
      model: a module with ``init_cache`` and ``decode`` (the reference models).
      tokenizer: the checkpoint's :class:`Tokenizer`.
      prompts: a list of strings.
      max_new_tokens: the most tokens each continuation gets.
      chat: render each prompt as one user message with the chat template.
      **options: :func:`~nnx_shard.inference.generate`'s options (above).

    Returns:
      One string per prompt (``num_return_sequences`` per prompt, in order).

    Raises:
      UsageError: ``prompts`` not a list of strings, a prompt that encodes to
        nothing, an option generate does not take (or ``attention_mask`` /
        ``return_logprobs``); plus what :func:`~nnx_shard.models.generate` and
        :meth:`Tokenizer.apply_chat_template` raise.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> from nnx_shard.inference import Tokenizer, generate_text
    >>> folder = ns.hf.tiny_checkpoint(tempfile.mkdtemp())   # random weights
    >>> dp = ns.strategies.get("dp")
    >>> model = ns.hf.load_pretrained(folder, mesh=dp.make_mesh(), rules=dp.rules)
    >>> tok = Tokenizer.from_pretrained(folder)
    >>> texts = generate_text(model, tok, ["The quick brown fox", "Hello"], max_new_tokens=10)
    >>> len(texts), texts[1] == generate_text(model, tok, ["Hello"], max_new_tokens=10)[0]
    (2, True)
    """
    rows = _encode(tokenizer, prompts, chat, "generate_text")
    opts = _options(options, tokenizer, "generate_text", model)
    tokens = np.asarray(generate(model, rows, max_new_tokens, **opts))
    width = max(len(r) for r in rows)
    stops = _stops(opts["eos_token_id"])
    return [_text(tokenizer, row[width:], stops) for row in tokens]


def stream_text(model: Any, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, *,
                chat: bool = False, chunk: int = 8, **options: Any) -> Iterator[str]:
    """One prompt's continuation as :func:`generate_text` returns it, yielded in
    pieces as :func:`~nnx_shard.inference.stream` decodes ``chunk`` tokens at a time:
    the pieces joined are the whole text. A piece ends on whole characters (a
    character split over tokens waits for its last byte); it stops at the
    end-of-sequence id.

    Args:
      model: a module with ``init_cache`` and ``decode``.
      tokenizer: the checkpoint's :class:`Tokenizer`.
      prompt: one string.
      max_new_tokens: the most tokens of the continuation.
      chat: render the prompt as one user message with the chat template.
      chunk: tokens decoded per call of the compiled program.
      **options: as :func:`generate_text`'s (``num_return_sequences`` only 1).

    Yields:
      Pieces of text, whole characters each.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> from nnx_shard.inference import Tokenizer, generate_text, stream_text
    >>> folder = ns.hf.tiny_checkpoint(tempfile.mkdtemp())   # random weights
    >>> dp = ns.strategies.get("dp")
    >>> model = ns.hf.load_pretrained(folder, mesh=dp.make_mesh(), rules=dp.rules)
    >>> tok = Tokenizer.from_pretrained(folder)
    >>> pieces = list(stream_text(model, tok, "Hello", max_new_tokens=10, chunk=4))
    >>> "".join(pieces) == generate_text(model, tok, ["Hello"], max_new_tokens=10)[0]
    True
    """
    if not isinstance(prompt, str):
        raise UsageError(f"stream_text: prompt must be a string, got {type(prompt).__name__} "
                         f"{short(prompt, 60)}. Fix: e.g. 'Once upon a time'.")
    rows = _encode(tokenizer, [prompt], chat, "stream_text")
    if options.get("num_return_sequences") not in (None, 1):
        raise UsageError(f"stream_text: num_return_sequences="
                         f"{short(options['num_return_sequences'], 40)}; it streams one "
                         "continuation. Fix: generate_text(..., num_return_sequences=n), or "
                         "drop it.")
    opts = _options(options, tokenizer, "stream_text", model)
    size = count(chunk, "stream_text: chunk", fix="e.g. chunk=8")
    stops = _stops(opts["eos_token_id"])
    steps = stream(model, rows, max_new_tokens, chunk=size, **opts)
    return _pieces(tokenizer, steps, stops, size)


def _pieces(tokenizer: Tokenizer, steps: Iterator[Any], stops: set[int],
            size: int) -> Iterator[str]:
    ids: list[int] = []
    shown = ""
    for i, step in enumerate(steps, 1):
        token = int(step[0])
        if token in stops:
            break
        ids.append(token)
        if i % size:
            continue
        text = tokenizer.decode(ids)
        # A character still missing bytes, or a decoder that rewrote what was shown: wait.
        if not text.endswith("\ufffd") and text.startswith(shown) and len(text) > len(shown):
            yield text[len(shown):]
            shown = text
    text = tokenizer.decode(ids)
    if text.startswith(shown) and len(text) > len(shown):
        yield text[len(shown):]
