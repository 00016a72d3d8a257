"""What a chat template is given by
:meth:`~nnx_shard.inference.Tokenizer.apply_chat_template`: the messages checked (a
non-empty list of dicts, each with a text ``role`` and a ``content``) and copied as
plain JSON values nested at most :data:`MAX_MESSAGE_DEPTH` deep, so that no object of
the caller's, nor its methods, reaches the template's sandbox.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from nnx_shard._errors import UsageError, short

__all__ = ["MAX_MESSAGE_DEPTH", "check_messages", "plain"]

#: How deep a message's values may nest (a tool's JSON schema nests a few levels).
MAX_MESSAGE_DEPTH = 100


def plain(value: Any, where: str, depth: int = 0) -> Any:
    """What a chat template may see: JSON values only (anything else becomes a
    ``<type>`` placeholder, as transformers does, so no object's methods reach the
    sandbox), nested at most :data:`MAX_MESSAGE_DEPTH` deep.

    >>> plain({"n": np.int64(3), "f": print, "t": (1, None)}, "messages[0]")
    {'n': 3, 'f': '<builtin_function_or_method>', 't': [1, None]}
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, np.generic):
        return plain(value.item(), where, depth)
    for kind in (bool, str, int, float):  # subclasses (enums ...) carry methods of their own
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping | list | tuple) and depth >= MAX_MESSAGE_DEPTH:
        raise UsageError(f"apply_chat_template: {where} nests lists and dicts more than "
                         f"{MAX_MESSAGE_DEPTH} deep. Fix: pass plain messages (text content, "
                         "or a list of content parts).")
    if isinstance(value, Mapping):
        return {plain(k, where, depth + 1): plain(v, where, depth + 1)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v, where, depth + 1) for v in value]
    return f"<{type(value).__name__}>"


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` checked (a non-empty list of dicts, each with a text ``role`` and
    a ``content``) and copied as plain data, keys holding ``None`` dropped.

    >>> check_messages([{"role": "user", "content": "Hi", "name": None}])
    [{'role': 'user', 'content': 'Hi'}]
    """
    example = "e.g. [{'role': 'user', 'content': 'Hello'}]"
    if not isinstance(messages, list | tuple) or not messages:
        raise UsageError(f"apply_chat_template: messages must be a non-empty list of "
                         f"{{'role', 'content'}} dicts, got {short(messages, 80)}. Fix: {example}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise UsageError(f"apply_chat_template: messages[{i}] must be a dict with 'role' and "
                             f"'content', got {type(message).__name__} {short(message, 60)}. "
                             f"Fix: {example}")
        message = {k: v for k, v in message.items() if v is not None}
        role = message.get("role")
        if not isinstance(role, str) or "content" not in message:
            missing = "a text 'role'" if not isinstance(role, str) else "a 'content'"
            raise UsageError(f"apply_chat_template: messages[{i}] has no {missing}: "
                             f"{short(message, 80)}. Fix: {example}")
        out.append(plain(message, f"messages[{i}]"))
    return out
