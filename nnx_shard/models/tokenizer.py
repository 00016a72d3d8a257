"""Text to token ids and back for a Hugging Face checkpoint: :class:`Tokenizer`
reads ``tokenizer.json`` with Hugging Face's ``tokenizers`` package and renders
the checkpoint's chat template with ``jinja2`` as transformers does, so the ids
equal ``AutoTokenizer``'s without torch or transformers installed.

Both packages are the optional extra ``nnx_shard[text]`` and are imported only
when a tokenizer is loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from nnx_shard.errors import NnxShardError, UsageError, check_path, short

__all__ = ["Tokenizer"]

EXTRA = "pip install 'nnx_shard[text]'"
#: The named special tokens transformers hands a chat template (its ``special_tokens_map``).
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
# transformers' clean_up_tokenization (applied only where the config asks, never to BPE).
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _require(module: str) -> Any:
    """The optional package ``module``, or an error naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise NnxShardError(f"Tokenizer needs the {module!r} package, which is not installed "
                            f"({e}). Fix: {EXTRA}") from None


def _read(path: str) -> Any:
    """The JSON file at ``path``, or ``None`` where there is none."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: is not a JSON file ({e}). Fix: download the tokenizer's "
                         "files again.") from None


def _content(value: Any) -> str | None:
    """A special token as the configs write it: text, or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _plain(value: Any) -> Any:
    """What a chat template may see: JSON values only (anything else becomes a
    ``<type>`` placeholder, as transformers does, so no object's methods reach the
    sandbox)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, np.generic):
        return _plain(value.item())
    for kind in (bool, str, int, float):  # subclasses (enums ...) carry methods of their own
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _compile(source: str, where: str) -> Any:
    """The chat template as transformers compiles it: a sandbox that cannot change
    what it is given, blocks trimmed, ``raise_exception``, ``strftime_now`` and a
    ``tojson`` that leaves HTML alone."""
    jinja2 = _require("jinja2")
    from jinja2 import ext, sandbox

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise UsageError(f"{where}: the chat template does not compile (line {e.lineno}: "
                         f"{e.message}). Fix: correct the template, or download the tokenizer's "
                         "files again.") from None


def _messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` checked (a non-empty list of dicts, each with a text ``role`` and
    a ``content``) and copied as plain data, keys holding ``None`` dropped."""
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
        out.append(_plain(message))
    return out


class Tokenizer:
    """A Hugging Face tokenizer (``tokenizer.json``) with its special tokens and
    chat template, read from the checkpoint folder as transformers reads them.

    Load it with :meth:`from_pretrained`; :func:`nnx_shard.models.generate_text`
    turns text into text with it.

    >>> tok = Tokenizer.from_pretrained("tests/fixtures/hf_llama_text")
    >>> ids = tok.encode("Hello world")
    >>> ids[0] == tok.bos_token_id, tok.decode(ids)
    (True, 'Hello world')
    """

    def __init__(self, backend: Any, *, path: str, config: Mapping[str, Any],
                 special_map: Mapping[str, Any] | None = None,
                 generation: Mapping[str, Any] | None = None,
                 chat_template: str | None = None) -> None:
        self.backend = backend
        self.path = path
        self.config = dict(config)
        self.chat_template = chat_template
        self._generation = dict(generation or {})
        # tokenizer_config.json's value first, the legacy special_tokens_map.json's after.
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_NAMES:
            token = _content(self.config.get(name))
            if token is None and special_map:
                token = _content(special_map.get(name))
            if token is not None:
                self.special_tokens[name] = token
        self._template: Any = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer of the folder ``path``: ``tokenizer.json`` (required),
        ``tokenizer_config.json`` (special tokens, ``chat_template``),
        ``special_tokens_map.json`` (older special tokens), ``chat_template.jinja``
        (which transformers prefers to the config's template) and
        ``generation_config.json`` (the ids generation stops at).

        Raises:
          FileNotFoundError: ``path`` is not a folder, or has no ``tokenizer.json``.
          UsageError: a file that is not JSON, a special token not in the vocabulary.
          NnxShardError: ``tokenizers`` or ``jinja2`` not installed
            (``pip install 'nnx_shard[text]'``).

        >>> Tokenizer.from_pretrained("tests/fixtures/hf_llama").eos_token_id
        Traceback (most recent call last):
        ...
        FileNotFoundError: Tokenizer.from_pretrained: no tokenizer.json in tests/fixtures/hf_llama ...
        """
        if isinstance(path, bytes) or not isinstance(path, str | os.PathLike) or not str(path):
            raise UsageError(f"Tokenizer.from_pretrained: path must be the folder holding "
                             f"tokenizer.json, got {type(path).__name__} {short(path, 60)}. Fix: "
                             "e.g. Tokenizer.from_pretrained('checkpoints/llama3-8b')")
        folder = os.fspath(path)
        check_path(folder, "Tokenizer.from_pretrained",
                   fix="pass the checkpoint folder holding tokenizer.json.")
        file = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"Tokenizer.from_pretrained: no tokenizer.json in {folder} (only "
                f"tokenizers' own format is read, not sentencepiece's tokenizer.model). Fix: pass "
                "the folder holding it, or convert the tokenizer once with transformers: "
                "AutoTokenizer.from_pretrained(folder).save_pretrained(folder).")
        tokenizers = _require("tokenizers")
        try:
            backend = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # the Rust reader's own error type
            raise UsageError(f"{file}: tokenizers cannot read it ({short(str(e), 200)}). Fix: "
                             "download the tokenizer's files again.") from None
        config = _read(os.path.join(folder, "tokenizer_config.json")) or {}
        template = config.get("chat_template")
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        tok = cls(backend, path=folder, config=config,
                  special_map=_read(os.path.join(folder, "special_tokens_map.json")),
                  generation=_read(os.path.join(folder, "generation_config.json")),
                  chat_template=template)
        for name in tok.special_tokens:
            tok._id(name)  # an unknown special token is named now, not at first use
        return tok

    # -- special tokens ---------------------------------------------------------------

    def _id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        if token is None:
            return None
        found = self.backend.token_to_id(token)
        if found is None:
            raise UsageError(f"{self.path}: {name} {token!r} (tokenizer_config.json or "
                             "special_tokens_map.json) is not in tokenizer.json's vocabulary. "
                             "Fix: name a token of the vocabulary, or download the tokenizer's "
                             "files again.")
        return int(found)

    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sequence token's text (``None``: the tokenizer has none)."""
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token's text (``None``: none)."""
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        """The padding token's text (``None``: none)."""
        return self.special_tokens.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        """The id of :attr:`bos_token`."""
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The id of :attr:`eos_token` (the tokenizer's; generation stops at
        :attr:`eos_token_ids`)."""
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """The id of :attr:`pad_token`."""
        return self._id("pad_token")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids generation stops at, as transformers' ``generate`` takes them:
        ``generation_config.json``'s ``eos_token_id`` (an id or a list: Llama 3
        instruct stops at several), else the tokenizer's :attr:`eos_token_id`.

        >>> Tokenizer.from_pretrained("tests/fixtures/hf_llama_text").eos_token_ids
        (14,)
        """
        value = self._generation.get("eos_token_id")
        found = (value,) if isinstance(value, int) and not isinstance(value, bool) else \
            tuple(value) if isinstance(value, list) and value and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value) else None
        if found is not None:
            n = self.vocab_size
            bad = [i for i in found if not 0 <= i < n]
            if bad:  # generation would never stop at it
                raise UsageError(
                    f"{os.path.join(self.path, 'generation_config.json')}: eos_token_id "
                    f"{short(value, 60)}: {bad[0]} is not an id of the tokenizer's vocabulary "
                    f"(0..{n - 1}), so generation would never stop at it. Fix: correct "
                    "eos_token_id there, or download the model's files again.")
            return found
        own = self.eos_token_id
        return () if own is None else (own,)

    @property
    def generation_pad_token_id(self) -> int | None:
        """The pad id generation fills with: ``generation_config.json``'s
        ``pad_token_id``, else the tokenizer's :attr:`pad_token_id`."""
        value = self._generation.get("pad_token_id")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        return self.pad_token_id

    @property
    def vocab_size(self) -> int:
        """Ids of the vocabulary, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    # -- text -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; ``add_special_tokens`` adds what the tokenizer's
        post-processor adds (e.g. the bos token in front).

        >>> tok = Tokenizer.from_pretrained("tests/fixtures/hf_llama_text")
        >>> tok.encode("Hello", add_special_tokens=False) == tok.encode("Hello")[1:]
        True
        """
        if not isinstance(text, str):
            raise UsageError(f"Tokenizer.encode: text must be a str, got {type(text).__name__} "
                             f"{short(text, 60)}. Fix: e.g. tok.encode('Hello')")
        if not isinstance(add_special_tokens, bool | np.bool_):
            raise UsageError(f"Tokenizer.encode: add_special_tokens must be True or False, got "
                             f"{short(add_special_tokens, 40)}.")
        return list(self.backend.encode(text, add_special_tokens=bool(add_special_tokens)).ids)

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        """The text of token ``ids`` (a sequence or a 1-D array of ints), special
        tokens left out unless ``skip_special_tokens=False``. Ids past the
        vocabulary (a model's padded embedding table) decode to nothing, as in
        transformers.

        >>> tok = Tokenizer.from_pretrained("tests/fixtures/hf_llama_text")
        >>> tok.decode(tok.encode("Hello")), tok.decode(tok.encode("Hello"), skip_special_tokens=False)
        ('Hello', '<|begin_of_text|>Hello')
        """
        try:
            arr = np.asarray(ids)
        except (TypeError, ValueError):
            arr = np.asarray(None)
        if arr.ndim == 0 and arr.dtype != object and np.issubdtype(arr.dtype, np.integer):
            arr = arr.reshape(1)
        if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise UsageError(f"Tokenizer.decode: ids must be a sequence of token ids (ints), got "
                             f"{type(ids).__name__} {short(ids, 60)}. Fix: one row at a time, "
                             "e.g. tok.decode(tokens[0]).")
        if arr.size and arr.min() < 0:
            raise UsageError(f"Tokenizer.decode: ids holds {int(arr.min())}; token ids are 0 or "
                             "more. Fix: drop the padding marker before decoding.")
        if not isinstance(skip_special_tokens, bool | np.bool_):
            raise UsageError(f"Tokenizer.decode: skip_special_tokens must be True or False, got "
                             f"{short(skip_special_tokens, 40)}.")
        text = str(self.backend.decode([int(i) for i in arr],
                                       skip_special_tokens=bool(skip_special_tokens)))
        # transformers cleans up only where the config asks, and never after a BPE model.
        if self.config.get("clean_up_tokenization_spaces") is True and \
                type(self.backend.model).__name__ != "BPE":
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text

    # -- chat -------------------------------------------------------------------------

    def _chat_source(self) -> str:
        template = self.chat_template
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
            if template is None:
                raise UsageError(f"{self.path}: tokenizer_config.json has several chat "
                                 f"templates ({', '.join(map(str, named))}) and none named "
                                 "'default'. Fix: name one 'default'.")
        if not isinstance(template, str) or not template:
            raise UsageError(f"{self.path}: the tokenizer has no chat template (no chat_template "
                             "in tokenizer_config.json, no chat_template.jinja): it is likely a "
                             "base model, not a chat one. Fix: pass plain text (no --chat), or "
                             "use the instruct model's tokenizer.")
        return template

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int] | str:
        """``messages`` (``[{"role": "user", "content": "..."}, ...]``) rendered
        with the tokenizer's chat template as transformers renders it, then
        encoded without adding special tokens (the template writes them):
        the ids of ``AutoTokenizer.apply_chat_template``, or the text with
        ``tokenize=False``. ``add_generation_prompt`` (default ``True``, unlike
        transformers: here the next turn is the model's) ends with the
        assistant's header.

        Raises:
          UsageError: malformed ``messages``, no chat template, a template that
            does not compile or raises (``raise_exception``, e.g. on an unknown
            role).

        >>> tok = Tokenizer.from_pretrained("tests/fixtures/hf_llama_text")
        >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
        '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n'
        """
        chat = _messages(messages)
        for name, value in (("add_generation_prompt", add_generation_prompt),
                            ("tokenize", tokenize)):
            if not isinstance(value, bool | np.bool_):
                raise UsageError(f"apply_chat_template: {name} must be True or False, got "
                                 f"{short(value, 40)}.")
        if self._template is None:
            self._template = _compile(self._chat_source(), self.path)
        jinja2 = _require("jinja2")
        try:
            text = self._template.render(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=bool(add_generation_prompt),
                                         **self.special_tokens)
        except jinja2.TemplateError as e:
            said = str(e) if len(str(e)) <= 300 else str(e)[:297] + "..."
            raise UsageError(f"apply_chat_template: the chat template of {self.path} refused the "
                             f"messages: {said.rstrip('.')}. Fix: give the roles and fields "
                             "the template expects (e.g. 'system', 'user', 'assistant').") from e
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return (f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token!r}, eos={self.eos_token!r})")
