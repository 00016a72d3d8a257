"""Text in and out of :func:`~nnx_shard.inference.generate`: prompts encoded with a
:class:`~nnx_shard.inference.Tokenizer`, the new tokens decoded up to the first
end-of-sequence id. :func:`generate_text` returns whole continuations,
:func:`stream_text` yields one continuation's text as
:func:`~nnx_shard.inference.stream` decodes it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np
from jax.sharding import Mesh

from nnx_shard._errors import UsageError, count, flag, short
from nnx_shard._rules import Rules
from nnx_shard.inference._config import GenerationConfig
from nnx_shard.inference._decoding import check_options
from nnx_shard.inference._generation import check_config, generate, stream
from nnx_shard.inference._tokenizer import Tokenizer

__all__ = ["generate_text", "stream_text"]

#: The keyword arguments of the text functions besides the config (stream_text adds chunk).
ARGUMENTS = ("chat", "seed", "mesh", "rules")


def _settings(config: Any, unknown: dict[str, Any], tokenizer: Tokenizer, caller: str,
              model: Any) -> GenerationConfig:
    """The config generate runs: eos and pad from the tokenizer unless set (an id
    the model has not is named with the file it was read from)."""
    names = ARGUMENTS + (("chunk",) if caller == "stream_text" else ())
    if "attention_mask" in unknown:
        raise UsageError(f"{caller}: attention_mask= is not taken (prompts of any lengths are "
                         "padded and masked here). Fix: drop it.")
    config = check_config(config, unknown, caller, names)
    if config.return_logprobs:
        raise UsageError(f"{caller}: return_logprobs=True is not taken (the text has no "
                         "per-token values). Fix: call generate for them, or drop it.")
    changes: dict[str, Any] = {}
    if config.eos_token_id is None and tokenizer.eos_token_ids:
        changes["eos_token_id"] = tokenizer.eos_token_ids
        _model_has(model, tokenizer, "eos_token_id", list(tokenizer.eos_token_ids), caller)
    pad = tokenizer.generation_pad_token_id
    if config.pad_token_id is None and pad is not None:
        # transformers' choice too: without a pad token, the (first) eos pads.
        changes["pad_token_id"] = pad
        _model_has(model, tokenizer, "pad_token_id", pad, caller)
    return config.replace(**changes) if changes else config


def _model_has(model: Any, tokenizer: Tokenizer, name: str, value: Any, caller: str) -> None:
    """The tokenizer's stop or pad ids checked against the model's vocabulary."""
    try:
        check_options(model, GenerationConfig(**{name: value}))
    except UsageError as e:
        said = str(e).split(": ", 1)[-1].split(". Fix")[0]
        raise UsageError(f"{caller}: {name} {value} read from {tokenizer.stop_source(name)} "
                         f"is not an id of this model ({said}). Fix: pass {name}= explicitly, "
                         "or use the model's own tokenizer folder.") from None


def _encode(tokenizer: Any, prompts: Any, chat: Any, caller: str) -> list[list[int]]:
    if not isinstance(tokenizer, Tokenizer):
        raise UsageError(f"{caller}: tokenizer must be a nnx_shard.inference.Tokenizer, got "
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
                  config: GenerationConfig | None = None, *, chat: bool = False,
                  seed: int = 0, mesh: Mesh | str | Mapping[str, int] | None = None,
                  rules: Rules | Mapping[str, Any] | None = None,
                  **unknown: Any) -> list[str]:
    """Each of ``prompts`` continued by :func:`~nnx_shard.inference.generate` as
    ``config`` says, as text: only the new tokens, up to (not including) the
    first end-of-sequence id, decoded without special tokens.

    Prompts are encoded with ``tokenizer`` (its bos token added), or with
    ``chat=True`` rendered as one user message each by its chat template; prompts
    of different lengths are padded on the left and masked. ``config``'s
    ``stop_strings`` are decoded with ``tokenizer``; with ``num_return_sequences``
    each prompt's continuations follow one another; its ``eos_token_id`` and
    ``pad_token_id``, where ``None``, are the tokenizer's
    (:attr:`Tokenizer.eos_token_ids`: ``generation_config.json``'s first; the
    pad falls back to the eos, as in transformers).

    Args:
      model: a module with ``init_cache`` and ``decode`` (the reference models).
      tokenizer: the checkpoint's :class:`Tokenizer`.
      prompts: a list of strings.
      config: the generation settings (:class:`~nnx_shard.inference.GenerationConfig`;
        ``return_logprobs`` is refused: the text has no per-token values).
      chat: render each prompt as one user message with the chat template.
      seed: the sampling key's seed (an int).
      mesh: the mesh to run on (with ``rules``).
      rules: the layout's rules (with ``mesh``).
      **unknown: refused; a setting given here names the ``GenerationConfig`` to put it in.

    Returns:
      One string per prompt (``num_return_sequences`` per prompt, in order).

    Raises:
      UsageError: ``prompts`` not a list of strings, a prompt that encodes to
        nothing, an argument it does not take (or ``attention_mask``, or
        ``return_logprobs=True``); plus what
        :func:`~nnx_shard.inference.generate` and
        :meth:`Tokenizer.apply_chat_template` raise.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> from nnx_shard.inference import GenerationConfig, Tokenizer, generate_text
    >>> folder = ns.hf.tiny_checkpoint(tempfile.mkdtemp())   # random weights
    >>> dp = ns.strategies.get("dp")
    >>> model = ns.hf.load_pretrained(folder, mesh=dp.make_mesh(), rules=dp.rules)
    >>> tok = Tokenizer.from_pretrained(folder)
    >>> ten = GenerationConfig(max_new_tokens=10)
    >>> texts = generate_text(model, tok, ["The quick brown fox", "Hello"], ten)
    >>> len(texts), texts[1] == generate_text(model, tok, ["Hello"], ten)[0]
    (2, True)
    """
    rows = _encode(tokenizer, prompts, chat, "generate_text")
    config = _settings(config, unknown, tokenizer, "generate_text", model)
    tokens = np.asarray(generate(model, rows, config, tokenizer=tokenizer, seed=seed,
                                 mesh=mesh, rules=rules))
    width = max(len(r) for r in rows)
    stops = set(config.eos_ids)
    return [_text(tokenizer, row[width:], stops) for row in tokens]


def stream_text(model: Any, tokenizer: Tokenizer, prompt: str,
                config: GenerationConfig | None = None, *, chat: bool = False,
                chunk: int = 8, seed: int = 0,
                mesh: Mesh | str | Mapping[str, int] | None = None,
                rules: Rules | Mapping[str, Any] | None = None,
                **unknown: Any) -> Iterator[str]:
    """One prompt's continuation as :func:`generate_text` returns it, yielded in
    pieces as :func:`~nnx_shard.inference.stream` decodes ``chunk`` tokens at a time:
    the pieces joined are the whole text. A piece ends on whole characters (a
    character split over tokens waits for its last byte); it stops at the
    end-of-sequence id.

    Args:
      model: a module with ``init_cache`` and ``decode``.
      tokenizer: the checkpoint's :class:`Tokenizer`.
      prompt: one string.
      config: as :func:`generate_text`'s (``num_return_sequences`` only 1).
      chat: render the prompt as one user message with the chat template.
      chunk: tokens decoded per call of the compiled program.
      seed: the sampling key's seed (an int).
      mesh: the mesh to run on (with ``rules``).
      rules: the layout's rules (with ``mesh``).
      **unknown: refused, as :func:`generate_text` refuses them.

    Yields:
      Pieces of text, whole characters each.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> from nnx_shard.inference import GenerationConfig, Tokenizer, generate_text, stream_text
    >>> folder = ns.hf.tiny_checkpoint(tempfile.mkdtemp())   # random weights
    >>> dp = ns.strategies.get("dp")
    >>> model = ns.hf.load_pretrained(folder, mesh=dp.make_mesh(), rules=dp.rules)
    >>> tok = Tokenizer.from_pretrained(folder)
    >>> ten = GenerationConfig(max_new_tokens=10)
    >>> pieces = list(stream_text(model, tok, "Hello", ten, chunk=4))
    >>> "".join(pieces) == generate_text(model, tok, ["Hello"], ten)[0]
    True
    """
    if not isinstance(prompt, str):
        raise UsageError(f"stream_text: prompt must be a string, got {type(prompt).__name__} "
                         f"{short(prompt, 60)}. Fix: e.g. 'Once upon a time'.")
    rows = _encode(tokenizer, [prompt], chat, "stream_text")
    config = _settings(config, unknown, tokenizer, "stream_text", model)
    if config.num_return_sequences != 1:
        raise UsageError(f"stream_text: num_return_sequences={config.num_return_sequences}; "
                         "it streams one continuation. Fix: generate_text(..., "
                         "GenerationConfig(num_return_sequences=n, ...)), or drop it.")
    size = count(chunk, "stream_text: chunk", fix="e.g. chunk=8")
    steps = stream(model, rows, config, chunk=size, tokenizer=tokenizer, seed=seed, mesh=mesh,
                   rules=rules)
    return _pieces(tokenizer, steps, set(config.eos_ids), size)


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
