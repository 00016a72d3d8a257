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
import traceback
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nnx_shard._errors import (
    NnxShardError,
    UsageError,
    check_path,
    short,
)
from nnx_shard.inference._chat_messages import check_messages, plain
from nnx_shard.inference._config import GenerationConfig
from nnx_shard.inference._tokenizer_files import (
    FILES,
    as_text,
    json_type,
    load_file,
    read_json,
)

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


def _special(value: Any, name: str, file: str) -> str | None:
    """A special token as the configs write it (text, or an AddedToken object with a
    text ``content``), ``None`` where absent; any other value is refused."""
    if value is None:
        return None
    if isinstance(value, Mapping) and "content" in value:
        value = value["content"]
    if not isinstance(value, str):
        raise UsageError(f"{file}: {name} must be the token's text (or an object with a text "
                         f"'content'), got a JSON {json_type(value)}. Fix: e.g. "
                         f'"{name}": "</s>", or download the tokenizer\'s files again.')
    return value


def _generation_config(folder: str) -> GenerationConfig:
    """The folder's ``generation_config.json`` (the defaults without one)."""
    try:
        return GenerationConfig.from_pretrained(folder)
    except FileNotFoundError:
        return GenerationConfig()


#: transformers' apply_chat_template arguments that it does not hand the template (and that
#: this one does not take): refused rather than rendered as variables of those names.
_NOT_VARIABLES = ("conversation", "conversations", "chat_template", "continue_final_message",
                  "sanitize_control_tokens", "padding", "truncation", "max_length",
                  "return_tensors", "tokenizer_kwargs")


def _template_inputs(tools: Any, documents: Any, variables: Mapping[str, Any]
                     ) -> dict[str, Any]:
    """``tools``, ``documents`` and the extra template variables checked as transformers
    checks them and copied as plain data (:func:`._chat_messages.plain`)."""
    tool_fix = ("Fix: tools=[{'type': 'function', 'function': {'name': ..., 'description': "
                "..., 'parameters': {...}}}] (a Python function's schema is "
                "transformers.utils.get_json_schema(f)).")
    if tools is not None:
        if not isinstance(tools, list | tuple):
            raise UsageError(f"apply_chat_template: tools must be a list of the tools' JSON "
                             f"schemas (dicts) or None, got {type(tools).__name__} "
                             f"{short(tools, 60)}. {tool_fix}")
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise UsageError(f"apply_chat_template: tools[{i}] must be a tool's JSON schema "
                                 f"(a dict), got {type(tool).__name__} {short(tool, 60)}. "
                                 f"{tool_fix}")
    if documents is not None and not (isinstance(documents, list | tuple) and all(
            isinstance(d, Mapping) for d in documents)):
        raise UsageError(f"apply_chat_template: documents must be a list of dicts (e.g. "
                         f"{{'title': ..., 'text': ...}}) or None, got {short(documents, 60)}.")
    for name in variables:
        if name in _NOT_VARIABLES:
            raise UsageError(f"apply_chat_template: {name}= is an argument of transformers' "
                             "apply_chat_template, which it does not hand the template, and this "
                             f"Tokenizer does not take it. Fix: drop {name}=.")
    return {"tools": plain(tools, "tools"), "documents": plain(documents, "documents"),
            **{k: plain(v, f"template variable {k!r}") for k, v in variables.items()}}


def _compile(source: str, where: str) -> Any:
    """The chat template as transformers compiles it (a sandbox that cannot change
    what it is given, blocks trimmed, ``raise_exception``, ``strftime_now`` and a
    ``tojson`` that leaves HTML alone), its rendering bounded
    (:mod:`nnx_shard.inference._chat_template`)."""
    jinja2 = _require("jinja2")
    from nnx_shard.inference._chat_template import Limit, compile_template

    try:
        return compile_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise UsageError(f"{where}: the chat template does not compile (line {e.lineno}: "
                         f"{e.message}). Fix: correct the template, or download the tokenizer's "
                         "files again.") from None
    except (Limit, RecursionError, MemoryError) as e:
        what = e.what if isinstance(e, Limit) else type(e).__name__
        raise UsageError(f"{where}: the chat template does not compile ({what}). Fix: correct "
                         "the template, or download the tokenizer's files again.") from None


def _line(e: BaseException) -> str:
    """`` (line N)``: the template's line the error was raised at, where jinja knows it."""
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
             if f.filename == "<template>"]
    return f" (line {lines[-1]})" if lines else ""


def _failed(where: str, e: BaseException) -> UsageError:
    said = " ".join(str(e).split())
    said = said if len(said) <= 200 else said[:197] + "..."
    if isinstance(e, RecursionError):
        why = "it recurses without end (a macro or recursive loop that never stops)"
    elif isinstance(e, MemoryError):
        why = "it ran out of memory"
    elif "no loader" in said:
        why = ("include, import and extends are not available: the template must be whole "
               f"({said})")
    else:
        why = f"{type(e).__name__}: {said}" if said else type(e).__name__
    return UsageError(f"apply_chat_template: the chat template {where} failed{_line(e)}: "
                      f"{why}. Fix: correct the template, or download the tokenizer's files "
                      "again.")


def _assistant_mask(offsets: Sequence[tuple[int, int]],
                    spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters (``offsets``) reach into a generation
    block's (``spans``), 0 elsewhere: transformers' single pass over both, in
    order, step for step (so even a token at an empty block's position, or at
    the position of a block placed out of order, is marked as it marks it)."""
    mask = [0] * len(offsets)
    at = 0
    for i, (start, end) in enumerate(offsets):
        while at < len(spans) and start >= spans[at][1]:
            at += 1
        if at == len(spans):
            break
        if end > spans[at][0]:
            mask[i] = 1
    return mask


class Tokenizer:
    """A Hugging Face tokenizer (``tokenizer.json``) with its special tokens and
    chat template, read from the checkpoint folder as transformers reads them.

    Load it with :meth:`from_pretrained`; :func:`nnx_shard.inference.generate_text`
    turns text into text with it.

    Args:
      backend: the ``tokenizers.Tokenizer`` read from ``tokenizer.json``.
      path: the folder the files were read from (errors name its files).
      config: ``tokenizer_config.json``'s fields (special tokens, ``chat_template``).
      special_map: ``special_tokens_map.json``'s fields, read where the config lacks a
        special token.
      generation: ``generation_config.json``'s fields, or their
        :class:`~nnx_shard.inference.GenerationConfig` (its ``eos_token_id`` and
        ``pad_token_id`` are the ids generation stops at and pads with).
      chat_template: the chat template (a string, or transformers' list), or ``None``.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> from nnx_shard.inference import Tokenizer
    >>> tok = Tokenizer.from_pretrained(ns.hf.tiny_checkpoint(tempfile.mkdtemp()))
    >>> ids = tok.encode("Hello world")
    >>> tok.decode(ids), tok.eos_token
    ('Hello world', '<|im_end|>')
    """

    def __init__(self, backend: Any, *, path: str, config: Mapping[str, Any],
                 special_map: Mapping[str, Any] | None = None,
                 generation: Mapping[str, Any] | GenerationConfig | None = None,
                 chat_template: str | list[Any] | None = None) -> None:
        self.backend = backend
        self.path = path
        self.config = dict(config)
        self.chat_template = chat_template
        #: Where the chat template was read, as its errors name it.
        self.template_file = os.path.join(path, "tokenizer_config.json") + " (chat_template)"
        files = {n: os.path.join(path, n) for n in FILES}
        #: The folder's generation settings (``generation_config.json``; defaults without it).
        self.generation_config = generation if isinstance(generation, GenerationConfig) else \
            GenerationConfig.from_dict(generation or {}, source=files["generation_config.json"])
        # tokenizer_config.json's value first, the legacy special_tokens_map.json's after.
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_NAMES:
            token = _special(self.config.get(name), name, files["tokenizer_config.json"])
            if token is None and special_map:
                token = _special(special_map.get(name), name, files["special_tokens_map.json"])
            if token is not None:
                self.special_tokens[name] = token
        self._compiled: dict[str, Any] = {}  # template text -> compiled

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

        >>> import tempfile
        >>> import nnx_shard as ns
        >>> from nnx_shard.inference import Tokenizer
        >>> folder = ns.hf.tiny_checkpoint(tempfile.mkdtemp(), tokenizer=False)
        >>> Tokenizer.from_pretrained(folder).eos_token_id
        Traceback (most recent call last):
        ...
        FileNotFoundError: Tokenizer.from_pretrained: no tokenizer.json in ...
        """
        if isinstance(path, bytes) or not isinstance(path, str | os.PathLike) or not str(path):
            raise UsageError(f"Tokenizer.from_pretrained: path must be the folder holding "
                             f"tokenizer.json, got {type(path).__name__} {short(path, 60)}. Fix: "
                             "e.g. Tokenizer.from_pretrained('checkpoints/llama3-8b')")
        folder = os.fspath(path)
        check_path(folder, "Tokenizer.from_pretrained",
                   fix="pass the checkpoint folder holding tokenizer.json.")
        file = os.path.join(folder, "tokenizer.json")
        data = load_file(file, folder)
        if data is None:
            raise FileNotFoundError(
                f"Tokenizer.from_pretrained: no tokenizer.json in {folder} (only "
                f"tokenizers' own format is read, not sentencepiece's tokenizer.model). Fix: pass "
                "the folder holding it, or convert the tokenizer once with transformers: "
                "AutoTokenizer.from_pretrained(folder).save_pretrained(folder).")
        tokenizers = _require("tokenizers")
        spec = as_text(file, data)
        if not spec.lstrip().startswith("{"):
            try:
                top = json.loads(spec)
            except (json.JSONDecodeError, RecursionError):
                raise UsageError(f"{file}: is not a JSON file. Fix: download the tokenizer's "
                                 "files again.") from None
            raise UsageError(f"{file}: holds a JSON {json_type(top)}, not the tokenizer's "
                             "object ({...}). Fix: download the tokenizer's files again.")
        try:
            backend = tokenizers.Tokenizer.from_str(spec)
        except BaseException as e:  # the Rust reader's own error type, or its panic
            if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
                raise
            raise UsageError(f"{file}: tokenizers cannot read it ({short(str(e), 200)}). Fix: "
                             "download the tokenizer's files again.") from None
        config = read_json(os.path.join(folder, "tokenizer_config.json"), folder) or {}
        template = config.get("chat_template")
        template_file = os.path.join(folder, "tokenizer_config.json") + " (chat_template)"
        if template is not None and not isinstance(template, str) and not (
                isinstance(template, list) and all(isinstance(t, Mapping) for t in template)):
            raise UsageError(f"{template_file}: must be the template's text or a list of "
                             "{'name', 'template'} objects, got a JSON "
                             f"{json_type(template)}. Fix: download the tokenizer's files "
                             "again.")
        jinja = os.path.join(folder, "chat_template.jinja")
        jinja_data = load_file(jinja, folder)
        if jinja_data is not None:
            template = as_text(jinja, jinja_data)
            template_file = jinja
        tok = cls(backend, path=folder, config=config,
                  special_map=read_json(os.path.join(folder, "special_tokens_map.json"), folder),
                  generation=_generation_config(folder),
                  chat_template=template)
        tok.template_file = template_file
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

        >>> import tempfile
        >>> import nnx_shard as ns
        >>> from nnx_shard.inference import Tokenizer
        >>> Tokenizer.from_pretrained(ns.hf.tiny_checkpoint(tempfile.mkdtemp())).eos_token_ids
        (2,)
        """
        value = self.generation_config.eos_token_id
        shown = list(value) if isinstance(value, tuple) else value  # as the file writes it
        found = self.generation_config.eos_ids or None
        if found is not None:
            n = self.vocab_size
            bad = [i for i in found if not 0 <= i < n]
            if bad:  # generation would never stop at it
                raise UsageError(
                    f"{os.path.join(self.path, 'generation_config.json')}: eos_token_id "
                    f"{short(shown, 60)}: {bad[0]} is not an id of the tokenizer's vocabulary "
                    f"(0..{n - 1}), so generation would never stop at it. Fix: correct "
                    "eos_token_id there, or download the model's files again.")
            return found
        own = self.eos_token_id
        return () if own is None else (own,)

    def stop_source(self, name: str = "eos_token_id") -> str:
        """The file :attr:`eos_token_ids` (``name="eos_token_id"``) or
        :attr:`generation_pad_token_id` (``"pad_token_id"``) was read from, as
        errors name it."""
        if getattr(self.generation_config, name) is not None:
            return f"{os.path.join(self.path, 'generation_config.json')} ({name})"
        token = "eos_token" if name == "eos_token_id" else "pad_token"
        return (f"{os.path.join(self.path, 'tokenizer_config.json')} or "
                f"special_tokens_map.json ({token})")

    @property
    def generation_pad_token_id(self) -> int | None:
        """The pad id generation fills with: ``generation_config.json``'s
        ``pad_token_id``, else the tokenizer's :attr:`pad_token_id`."""
        value = self.generation_config.pad_token_id
        return value if value is not None else self.pad_token_id

    @property
    def vocab_size(self) -> int:
        """Ids of the vocabulary, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    # -- text -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; ``add_special_tokens`` adds what the tokenizer's
        post-processor adds (e.g. the bos token in front).

        >>> import tempfile
        >>> import nnx_shard as ns
        >>> from nnx_shard.inference import Tokenizer
        >>> tok = Tokenizer.from_pretrained(ns.hf.tiny_checkpoint(tempfile.mkdtemp()))
        >>> ids = tok.encode("Hello world")   # this tokenizer adds no bos token
        >>> len(ids), ids == tok.encode("Hello world", add_special_tokens=False)
        (5, True)
        """
        if not isinstance(text, str):
            raise UsageError(f"Tokenizer.encode: text must be a str, got {type(text).__name__} "
                             f"{short(text, 60)}. Fix: e.g. tok.encode('Hello')")
        if not isinstance(add_special_tokens, bool | np.bool_):
            raise UsageError(f"Tokenizer.encode: add_special_tokens must be True or False, got "
                             f"{short(add_special_tokens, 40)}.")
        return list(self._encoding(text, bool(add_special_tokens), "Tokenizer.encode").ids)

    def _encoding(self, text: str, add_special_tokens: bool, where: str) -> Any:
        """The backend's ``Encoding`` of ``text`` (ids and character offsets)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates: tokenizers takes only valid text
            raise UsageError(f"{where}: text holds {text[e.start:e.end]!r} at "
                             f"{e.start}, which is not a character (a lone surrogate, e.g. "
                             "from bytes decoded with errors='surrogateescape'). Fix: decode "
                             "the text as UTF-8 first.") from None
        return self.backend.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        """The text of token ``ids`` (a sequence or a 1-D array of ints), special
        tokens left out unless ``skip_special_tokens=False``. Ids past the
        vocabulary (a model's padded embedding table) decode to nothing, as in
        transformers.

        >>> import tempfile
        >>> import nnx_shard as ns
        >>> from nnx_shard.inference import Tokenizer
        >>> tok = Tokenizer.from_pretrained(ns.hf.tiny_checkpoint(tempfile.mkdtemp()))
        >>> ids = tok.encode("Hello") + [tok.eos_token_id]
        >>> tok.decode(ids), tok.decode(ids, skip_special_tokens=False)
        ('Hello', 'Hello<|im_end|>')
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

    def _chat_source(self, tools: bool = False) -> str:
        template = self.chat_template
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            # transformers' choice: "tool_use" when given tools and there is one.
            template = named.get("tool_use" if tools and "tool_use" in named else "default")
            if template is None:
                raise UsageError(f"{self.path}: tokenizer_config.json has several chat "
                                 f"templates ({', '.join(map(str, named))}) and none named "
                                 "'default'. Fix: name one 'default'.")
            if not isinstance(template, str):
                raise UsageError(f"{self.template_file}: the template named 'default' must be "
                                 f"text, got a JSON {json_type(template)}. Fix: download the "
                                 "tokenizer's files again.")
        if not isinstance(template, str) or not template:
            raise UsageError(f"{self.path}: the tokenizer has no chat template (no chat_template "
                             "in tokenizer_config.json, no chat_template.jinja): it is likely a "
                             "base model, not a chat one. Fix: pass plain text (no --chat), or "
                             "use the instruct model's tokenizer.")
        return template

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, tokenize: bool = True,
                            return_dict: bool = False,
                            return_assistant_tokens_mask: bool = False,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            documents: Sequence[Mapping[str, Any]] | None = None,
                            **template_kwargs: Any) -> list[int] | str | dict[str, list[int]]:
        """``messages`` (``[{"role": "user", "content": "..."}, ...]``) rendered
        with the tokenizer's chat template as transformers renders it, then
        encoded without adding special tokens (the template writes them):
        the ids of ``AutoTokenizer.apply_chat_template``, or the text with
        ``tokenize=False``. ``add_generation_prompt`` (default ``True``, unlike
        transformers: here the next turn is the model's) ends with the
        assistant's header; give ``False`` to encode a whole conversation for
        training.

        ``return_dict=True`` returns ``{"input_ids": [...], "attention_mask":
        [1, ...]}`` instead of the ids (ignored with ``tokenize=False``, as in
        transformers). ``return_assistant_tokens_mask=True`` (with both
        ``return_dict`` and ``tokenize``) adds ``"assistant_masks"``: 1 for each
        token the template rendered inside a ``{% generation %} ...
        {% endgeneration %}`` block (the assistant's turns), 0 elsewhere, by
        transformers' rule: a token is 1 where its characters overlap a block's
        (a token cut by a block's edge counts). :func:`nnx_shard.pack` takes the
        dict as an example and trains on the tokens marked 1. A template with no
        generation block gives a mask of zeros and a ``UserWarning``, as
        transformers gives them.

        ``tools`` (the tools' JSON schemas, ``{"type": "function", "function":
        {...}}``) and ``documents`` (dicts, e.g. ``{"title", "text"}``) are the
        template's ``tools`` and ``documents``, as in transformers; a tokenizer
        with named templates renders its ``"tool_use"`` one when given ``tools``.
        Every other keyword argument is a template variable of that name (e.g.
        ``enable_thinking=False``, ``date_string="3 Dec 2026"``), overriding a
        special token's of the same name (``bos_token``), as transformers' extra
        ``**kwargs``. A template ignores what it does not read.

        Raises:
          UsageError: malformed ``messages``, no chat template, a template that
            does not compile or raises (``raise_exception``, e.g. on an unknown
            role), ``return_assistant_tokens_mask`` without ``return_dict`` and
            ``tokenize``, ``tools`` not a list of dicts (a Python function, or
            the JSON text, is not a schema), ``documents`` not a list of dicts,
            a keyword argument that transformers takes for itself rather than
            handing the template (``chat_template``, ``max_length``, ...).

        >>> import tempfile
        >>> import nnx_shard as ns
        >>> from nnx_shard.inference import Tokenizer
        >>> tok = Tokenizer.from_pretrained(ns.hf.tiny_checkpoint(tempfile.mkdtemp()))
        >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
        '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
        >>> chat = Tokenizer(tok.backend, path=tok.path, config=tok.config, chat_template=(
        ...     "{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}"
        ...     "{% generation %}{{ m.content }}{% endgeneration %}"
        ...     "{% else %}{{ m.content }}{% endif %}\\n{% endfor %}"))
        >>> out = chat.apply_chat_template(
        ...     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        ...     add_generation_prompt=False, return_dict=True, return_assistant_tokens_mask=True)
        >>> sorted(out), chat.decode([i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m])
        (['assistant_masks', 'attention_mask', 'input_ids'], 'Hello')
        >>> chat = Tokenizer(tok.backend, path=tok.path, config=tok.config, chat_template=(
        ...     "{% for t in tools or [] %}{{ t.function.name }} {% endfor %}"
        ...     "{% if terse %}brief: {% endif %}{{ messages[-1].content }}"))
        >>> tool = {"type": "function", "function": {"name": "clock", "parameters": {}}}
        >>> chat.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
        ...                          tools=[tool], terse=True)
        'clock brief: Hi'
        """
        chat = check_messages(messages)
        for name, value in (("add_generation_prompt", add_generation_prompt),
                            ("tokenize", tokenize), ("return_dict", return_dict),
                            ("return_assistant_tokens_mask", return_assistant_tokens_mask)):
            if not isinstance(value, bool | np.bool_):
                raise UsageError(f"apply_chat_template: {name} must be True or False, got "
                                 f"{short(value, 40)}.")
        if return_assistant_tokens_mask and not (return_dict and tokenize):
            raise UsageError("apply_chat_template: return_assistant_tokens_mask=True needs "
                             f"return_dict=True and tokenize=True (got return_dict={return_dict},"
                             f" tokenize={tokenize}): the mask is one value per token. Fix: "
                             "apply_chat_template(messages, return_dict=True, "
                             "return_assistant_tokens_mask=True).")
        variables = _template_inputs(tools, documents, template_kwargs)
        source = self._chat_source(tools is not None)
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = self._compiled[source] = _compile(source, self.template_file)
        jinja2 = _require("jinja2")
        from nnx_shard.inference._chat_template import GENERATION_TAG, Limit, render

        where = self.template_file
        spans: list[tuple[int, int]] | None = [] if return_assistant_tokens_mask else None
        if return_assistant_tokens_mask and not GENERATION_TAG.search(source):
            warnings.warn(f"apply_chat_template: return_assistant_tokens_mask=True, but the chat "
                          f"template {where} has no {{% generation %}} block, so every token's "
                          "mask is 0 (nothing to train on). Fix: wrap each assistant turn's text "
                          "in {% generation %} ... {% endgeneration %} in the template.",
                          UserWarning, stacklevel=2)
        try:
            # transformers' order: the special tokens, the caller's variables over them.
            text = render(compiled, {**self.special_tokens, **variables, "messages": chat,
                                     "add_generation_prompt": bool(add_generation_prompt)},
                          spans)
        except Limit as e:
            raise UsageError(f"apply_chat_template: the chat template {where} was stopped: "
                             f"{e.what}{_line(e)}. A chat template renders in milliseconds; "
                             "this one loops, recurses or builds text without end. Fix: correct "
                             "the template, or download the tokenizer's files again.") from None
        except jinja2.TemplateError as e:
            said = str(e) if len(str(e)) <= 300 else str(e)[:297] + "..."
            raise UsageError(f"apply_chat_template: the chat template {where} refused the "
                             f"messages{_line(e)}: {said.rstrip('.')}. Fix: give the roles and "
                             "fields the template expects (e.g. 'system', 'user', "
                             "'assistant').") from e
        except (Exception, RecursionError, MemoryError) as e:  # the template's own code failed
            raise _failed(where, e) from None
        if not tokenize:
            return text
        encoding = self._encoding(text, False, "apply_chat_template")
        ids = list(encoding.ids)
        if not return_dict:
            return ids
        out = {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if spans is not None:
            out["assistant_masks"] = _assistant_mask(encoding.offsets, spans)
        return out

    def __repr__(self) -> str:
        return (f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token!r}, eos={self.eos_token!r})")
