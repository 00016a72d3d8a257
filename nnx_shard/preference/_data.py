"""TRL's preference data (``prompt`` / ``chosen`` / ``rejected``, plain text or
conversations) tokenised as TRL 1.16's ``DPOTrainer`` tokenises and collates it, into
the batch of :func:`nnx_shard.preference.loss`."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np

from nnx_shard._errors import UsageError, short
from nnx_shard.inference import Tokenizer
from nnx_shard.models._loss import IGNORE_INDEX

__all__ = ["tokenize"]


def _conversational(value: Any) -> bool:
    """TRL's ``is_conversational``: a list of messages (dicts with a ``role``)."""
    return isinstance(value, list | tuple) and bool(value) and isinstance(value[0], Mapping) \
        and "role" in value[0]


def _prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


#: apply_chat_template's own arguments, which TRL's tokenize_fn sets itself.
_OWN = ("messages", "add_generation_prompt", "tokenize", "return_dict",
        "return_assistant_tokens_mask")


def _template_kwargs(example: Mapping[str, Any], i: int) -> dict[str, Any]:
    """The example's ``tools`` (a list, or its JSON text) and ``chat_template_kwargs`` (a
    dict) as TRL's ``tokenize_fn`` hands them to ``apply_chat_template``."""
    tools = example.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise UsageError(f"preference.tokenize: example {i}'s 'tools' is text but not JSON "
                             f"({e}). Fix: a list of the tools' JSON schemas, or its "
                             "json.dumps.") from None
    if tools is not None and not isinstance(tools, list | tuple):
        raise UsageError(f"preference.tokenize: example {i}'s 'tools' must be a list of the "
                         f"tools' JSON schemas (or that list's JSON text) or None, got "
                         f"{type(tools).__name__} {short(tools, 60)}.")
    extra = example.get("chat_template_kwargs")
    if extra is None:  # absent, or a row datasets filled with None
        extra = {}
    if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
        raise UsageError(f"preference.tokenize: example {i}'s 'chat_template_kwargs' must be a "
                         f"dict of template variables by name (e.g. {{'enable_thinking': "
                         f"False}}) or None, got {short(extra, 60)}.")
    own = [k for k in extra if k in _OWN]
    if own:
        raise UsageError(f"preference.tokenize: example {i}'s 'chat_template_kwargs' sets "
                         f"{', '.join(map(repr, own))}, which tokenize sets itself (as TRL "
                         "does). Fix: drop it from chat_template_kwargs.")
    return {"tools": tools, **extra}  # TRL's order: the kwargs' own "tools" wins


def _pair(tokenizer: Tokenizer, example: Any, i: int) -> tuple[list[int], list[int], list[int]]:
    """One example's prompt, chosen and rejected ids (TRL's ``tokenize_fn``)."""
    if not isinstance(example, Mapping) or not {"prompt", "chosen", "rejected"} <= set(example):
        raise UsageError(f"preference.tokenize: example {i} must be a dict with 'prompt', "
                         f"'chosen' and 'rejected' (TRL's explicit-prompt preference format), "
                         f"got {short(example, 80)}.")
    prompt, chosen, rejected = example["prompt"], example["chosen"], example["rejected"]
    if _conversational(prompt):
        if not (_conversational(chosen) and _conversational(rejected)):
            raise UsageError(f"preference.tokenize: example {i}'s prompt is a conversation, so "
                             "'chosen' and 'rejected' must be lists of messages too, e.g. "
                             "[{'role': 'assistant', 'content': '...'}].")

        options = _template_kwargs(example, i)

        def chat(messages: Any, generation: bool) -> list[int]:
            ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation,
                                                **options)
            return cast(list[int], ids)  # tokenize=True, return_dict=False: the ids

        prompt_ids = chat(prompt, True)
        full = [chat([*prompt, *chosen], False), chat([*prompt, *rejected], False)]
    else:
        if not all(isinstance(v, str) for v in (prompt, chosen, rejected)):
            raise UsageError(f"preference.tokenize: example {i}'s prompt, chosen and rejected "
                             "must be all text or all conversations (lists of messages), got "
                             f"{type(prompt).__name__}, {type(chosen).__name__} and "
                             f"{type(rejected).__name__}.")
        eos = tokenizer.eos_token
        if eos is None:
            raise UsageError("preference.tokenize: the tokenizer has no eos token, which TRL "
                             "appends to every plain-text answer. Fix: give tokenizer_config.json "
                             "an eos_token.")
        # TRL appends the eos as text, then tokenises with the special tokens (a bos).
        answers = [a if a.endswith(eos) else a + eos for a in (chosen, rejected)]
        prompt_ids = tokenizer.encode(prompt)
        full = [tokenizer.encode(prompt + a) for a in answers]
    # The answer starts where prompt and prompt + answer diverge (a token may merge across
    # the boundary, or a template render the prompt alone differently), as TRL cuts it.
    cut = min(_prefix(prompt_ids, full[0]), _prefix(prompt_ids, full[1]))
    return prompt_ids[:cut], full[0][cut:], full[1][cut:]


def tokenize(tokenizer: Tokenizer, examples: Sequence[Mapping[str, Any]], *,
             max_length: int | None = 1024, length: int | None = None,
             pad_id: int | None = None) -> dict[str, np.ndarray]:
    """Preference pairs as one batch of :func:`nnx_shard.preference.loss`: TRL 1.16's
    ``DPOTrainer`` tokenisation and collation, token for token.

    Each example is ``{"prompt", "chosen", "rejected"}``: plain text, or conversations
    (lists of ``{"role", "content"}`` messages, the answers one assistant message each)
    rendered with the tokenizer's chat template. A conversation's example may also hold
    ``tools`` (the tools' JSON schemas: a list, or its JSON text) and
    ``chat_template_kwargs`` (a dict of template variables, e.g. ``{"enable_thinking":
    False}``), both handed to every rendering of that example as TRL hands them to
    :meth:`~nnx_shard.inference.Tokenizer.apply_chat_template` (``None`` or absent:
    none; plain-text examples ignore them, as TRL does). As TRL does it:

    * text: the eos token is appended to each answer (unless it ends with it), and
      ``prompt`` and ``prompt + answer`` are encoded with the special tokens (e.g. a bos);
      conversations: the prompt's messages with the generation prompt, and the prompt's
      and the answer's messages without;
    * the answer starts where the prompt's ids and the whole sequence's first differ (the
      earlier of the chosen's and the rejected's such point): a token merged across the
      boundary, or a prompt the template renders otherwise alone, goes to the answer;
    * a pair whose prompt alone holds ``max_length`` tokens or more is dropped (a
      ``UserWarning`` says how many), and each sequence keeps its first ``max_length``
      tokens (``truncation_mode="keep_start"``, TRL's default; TRL 1.16 has no
      ``max_prompt_length``);
    * the rows are the ``P`` prompt + chosen sequences, then the ``P`` prompt + rejected
      ones, right-padded to the longest (or to ``length``).

    Returns int32 ``[2P, length]`` arrays: ``inputs`` (the tokens, ``pad_id`` after
    them), ``attention_mask`` (1 on tokens) and ``targets`` (the next token where it is
    part of the answer, ``-100`` on the prompt, the last token and padding), what :func:`nnx_shard.models.lm_loss` takes.

    Args:
      tokenizer: a :class:`nnx_shard.inference.Tokenizer`.
      examples: the pairs.
      max_length: the longest sequence kept, or ``None`` for no truncation (TRL's default
        is 1024).
      length: pad every row to this many tokens (at least the longest kept), so that
        every batch has one shape; ``None``: the longest.
      pad_id: the padding id; default the tokenizer's pad token, else its eos, else 0.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> from nnx_shard.inference import Tokenizer
    >>> from nnx_shard.preference import tokenize
    >>> tok = Tokenizer.from_pretrained(ns.hf.tiny_checkpoint(tempfile.mkdtemp()))
    >>> batch = tokenize(tok, [{"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"},
    ...                        {"prompt": "Hi", "chosen": " Hello!", "rejected": " Bye"}])
    >>> sorted(batch), batch["inputs"].shape[0]          # 2 chosen rows, then 2 rejected
    (['attention_mask', 'inputs', 'targets'], 4)
    >>> tok.decode([t for t in batch["targets"][0] if t != -100], skip_special_tokens=False)
    ' 4<|im_end|>'
    """
    if not isinstance(tokenizer, Tokenizer):
        raise UsageError("preference.tokenize: tokenizer must be an nnx_shard.inference.Tokenizer, "
                         f"got {type(tokenizer).__name__}. Fix: "
                         "Tokenizer.from_pretrained(checkpoint_folder).")
    if isinstance(examples, Mapping) or not isinstance(examples, Sequence) or not examples:
        raise UsageError("preference.tokenize: examples must be a non-empty list of dicts "
                         f"{{'prompt', 'chosen', 'rejected'}}, got {short(examples, 80)}.")
    for name, value in (("max_length", max_length), ("length", length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 2):
            raise UsageError(f"preference.tokenize: {name} must be an int of at least 2 or "
                             f"None, got {short(value, 40)}.")
    if pad_id is not None and (isinstance(pad_id, bool) or not isinstance(pad_id, int)
                               or pad_id < 0):
        raise UsageError(f"preference.tokenize: pad_id must be a token id (an int, 0 or more) or "
                         f"None, got {short(pad_id, 40)}.")
    pairs = [_pair(tokenizer, e, i) for i, e in enumerate(examples)]
    kept = [p for p in pairs if max_length is None or len(p[0]) < max_length]
    if len(kept) < len(pairs):
        warnings.warn(f"preference.tokenize: dropped {len(pairs) - len(kept)} of {len(pairs)} "
                      f"pairs whose prompt alone holds max_length={max_length} tokens or more "
                      "(no answer token would be left), as TRL's DPOTrainer drops them.",
                      UserWarning, stacklevel=2)
    if not kept:
        raise UsageError(f"preference.tokenize: every prompt holds max_length={max_length} "
                         "tokens or more, so no pair is left. Fix: a larger max_length.")
    rows, answer = [], []
    for side in (1, 2):
        for p in kept:
            seq, mask = p[0] + p[side], [0] * len(p[0]) + [1] * len(p[side])
            rows.append(seq[:max_length])
            answer.append(mask[:max_length])
    longest = max(map(len, rows))
    if length is not None and length < longest:
        raise UsageError(f"preference.tokenize: length={length} is shorter than the longest "
                         f"sequence kept ({longest} tokens). Fix: length >= {longest}, or a "
                         "max_length of at most length.")
    width = longest if length is None else length
    if pad_id is None:
        pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id)
                       if i is not None), 0)
    inputs = np.full((len(rows), width), pad_id, np.int32)
    attention = np.zeros((len(rows), width), np.int32)
    targets = np.full((len(rows), width), IGNORE_INDEX, np.int32)
    for r, (seq, mask) in enumerate(zip(rows, answer, strict=True)):
        inputs[r, :len(seq)] = seq
        attention[r, :len(seq)] = 1
        # Target k is token k + 1 where that token is part of the answer.
        nxt = np.asarray(seq[1:], np.int32)
        targets[r, :len(nxt)] = np.where(np.asarray(mask[1:], bool), nxt, IGNORE_INDEX)
    return {"inputs": inputs, "targets": targets, "attention_mask": attention}
