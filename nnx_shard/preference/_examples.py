"""A small preference set that ships with the package, so that preference tuning can
be tried (and its guide run) with nothing downloaded: short questions, each with a
direct, correct answer (chosen) and a hedging, wrong one (rejected)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from nnx_shard._errors import UsageError

__all__ = ["example_pairs"]

SPLITS = ("train", "heldout")


def example_pairs(split: str = "train", *, chat: bool = True) -> list[dict[str, Any]]:
    """The package's own preference pairs in TRL's explicit-prompt format, ready for
    :func:`nnx_shard.preference.tokenize`.

    Each pair is a short question, a direct and correct answer (``chosen``) and a
    hedging, wrong one (``rejected``: "Hmm, maybe 5? I am not sure..."), so a tuned
    model should learn to answer without hedging, which the ``heldout`` questions
    (never in ``train``) measure. ``train`` has 40 pairs, ``heldout`` 8.

    Args:
      split: ``"train"`` or ``"heldout"``.
      chat: conversations (the prompt a user message, each answer an assistant
        message, for a tokenizer with a chat template); ``False``: plain text (the
        prompt ``"Question: ...\\nAnswer:"``, each answer after a space).

    Returns:
      A new list of ``{"prompt", "chosen", "rejected"}`` dicts.

    Raises:
      UsageError: an unknown ``split``.

    >>> from nnx_shard import preference
    >>> pairs = preference.example_pairs()
    >>> len(pairs), pairs[0]["prompt"], pairs[0]["chosen"]
    (40, [{'role': 'user', 'content': 'What is 2 + 2?'}], [{'role': 'assistant', 'content': '2 + 2 is 4.'}])
    >>> preference.example_pairs("heldout", chat=False)[0]
    {'prompt': 'Question: What is 4 + 4?\\nAnswer:', 'chosen': ' 8.', 'rejected': ' Hmm, maybe 9, I am not sure.'}
    """
    if split not in SPLITS:
        raise UsageError(f"preference.example_pairs: split={split!r} is not one of {SPLITS}. "
                         "Fix: split='train' (40 pairs) or 'heldout' (8 pairs, other questions).")
    text = resources.files(__package__).joinpath("pairs.json").read_text(encoding="utf-8")
    rows = json.loads(text)[split]
    if chat:
        return [{"prompt": [{"role": "user", "content": r["prompt"]}],
                 "chosen": [{"role": "assistant", "content": r["chosen"]}],
                 "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows]
    return [{"prompt": f"Question: {r['prompt']}\nAnswer:", "chosen": f" {r['chosen']}",
             "rejected": f" {r['rejected']}"} for r in rows]
