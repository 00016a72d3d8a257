"""The settings of one generation: :class:`GenerationConfig`, transformers' names and
defaults, each field checked once where it is built, and read from a checkpoint's
``generation_config.json`` as transformers reads it."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from nnx_shard._errors import UsageError, check_path, short
from nnx_shard.inference._tokenizer_files import json_type, read_json

__all__ = ["FILE", "GenerationConfig", "check_temperature", "check_top_k", "count_option",
           "number"]

#: The file a checkpoint folder keeps its generation settings in.
FILE = "generation_config.json"

_WHO = "GenerationConfig"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """How :func:`~nnx_shard.inference.generate` (and :func:`~nnx_shard.inference.stream`,
    :func:`~nnx_shard.inference.generate_text`, :func:`~nnx_shard.inference.stream_text`,
    ``nnx-shard generate``) chooses
    tokens: transformers' ``GenerationConfig`` fields of the same names, defaults
    and meaning, each checked when the config is built (one
    :class:`~nnx_shard.UsageError` naming the field). What is not a setting (the
    model, the prompts, their mask, the seed, the mesh and rules, a ``stream``'s
    chunk, the ``tokenizer`` that decodes ``stop_strings``) stays an argument of
    the call.

    Greedy unless ``do_sample=True`` (then ``temperature``, ``top_k``, ``top_p``
    and ``min_p`` shape the distribution sampled; as in transformers, ``top_k``
    is 50 unless set, and 0 or ``None`` turns it off). The processors apply in
    transformers' order: ``repetition_penalty``, ``no_repeat_ngram_size`` and
    ``min_new_tokens``, then temperature, top-k, top-p and min-p.

    A row stops at any of ``eos_token_id`` (an id or a list of ids; a list is
    kept as a tuple) or once its text contains one of ``stop_strings``, and
    holds ``pad_token_id`` after it (``None``: the first eos id, else 0, as
    transformers pads). ``max_new_tokens`` bounds the new tokens; without it,
    ``max_length`` (20) bounds the prompt and new tokens together.

    One field has no transformers counterpart: ``return_logprobs`` returns
    ``(tokens, logprobs)``, each new token's log-probability under the model's
    unprocessed distribution (transformers returns the logits or processed
    scores, ``output_logits`` / ``output_scores`` with
    ``return_dict_in_generate``, from which ``compute_transition_scores`` derives
    them). transformers' other fields (beam search, ``typical_p``, ``bad_words_ids``
    ...) are not implemented: :meth:`from_dict` ignores them, as it ignores any
    key it does not know.

    Attributes:
      max_new_tokens: the most new tokens a row gets (``None``: up to ``max_length``).
      max_length: the most positions of prompt and new tokens, when
        ``max_new_tokens`` is ``None``.
      min_new_tokens: the eos ids are masked until a row has that many new tokens.
      do_sample: sample (``True``) or take the most likely token (``False``).
      temperature: divides the logits when sampling (a positive number).
      top_k: sample among the k most likely tokens (0 or ``None``: all; more than the
        vocabulary: all).
      top_p: sample from the most likely tokens whose probabilities reach it (1: off).
      min_p: drop tokens less than ``min_p`` times as likely as the most likely.
      repetition_penalty: divides a seen token's positive logit, multiplies a
        negative one (1: off; greedy too).
      no_repeat_ngram_size: no n-gram of that size occurs twice in a row (0: off).
      eos_token_id: an id or a list of ids a row stops at (``None``: only the length).
      pad_token_id: pads ragged prompts and follows a row's stop.
      bos_token_id: the beginning-of-sequence id (read and kept, not used).
      stop_strings: a string or a list of them; a call with them needs a tokenizer.
      num_return_sequences: continuations per prompt (above 1 only when sampling).
      return_logprobs: also return the new tokens' log-probabilities (ours).

    >>> from nnx_shard.inference import GenerationConfig
    >>> config = GenerationConfig(max_new_tokens=32, do_sample=True, temperature=0.7,
    ...                           eos_token_id=[2, 3])
    >>> config.top_k, config.top_p, config.eos_token_id
    (50, 1.0, (2, 3))
    >>> GenerationConfig(max_new_tokens=8, top_p=1.5)
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: GenerationConfig: top_p=1.5; the nucleus keeps the most likely tokens whose probabilities sum to top_p: use a number in (0, 1] (1: off), or None. Fix: e.g. top_p=0.9.
    """

    max_new_tokens: int | None = None
    max_length: int = 20
    min_new_tokens: int | None = None
    do_sample: bool = False
    temperature: float | None = 1.0
    top_k: int | None = 50
    top_p: float | None = 1.0
    min_p: float | None = None
    repetition_penalty: float | None = 1.0
    no_repeat_ngram_size: int = 0
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    stop_strings: str | tuple[str, ...] | None = None
    num_return_sequences: int = 1
    return_logprobs: bool = False

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if self.max_new_tokens is not None:
            put("max_new_tokens", count_option(self.max_new_tokens, "max_new_tokens", 1, _WHO,
                                               "the most new tokens a row gets"))
        put("max_length", count_option(self.max_length, "max_length", 1, _WHO,
                                       "the most positions of prompt and new tokens"))
        if self.min_new_tokens is not None:
            put("min_new_tokens", count_option(
                self.min_new_tokens, "min_new_tokens", 0, _WHO,
                "the fewest new tokens before an eos_token_id may end a row"))
        if self.max_new_tokens is not None and (self.min_new_tokens or 0) > self.max_new_tokens:
            raise UsageError(f"{_WHO}: min_new_tokens={self.min_new_tokens} is more than "
                             f"max_new_tokens={self.max_new_tokens}: no row could reach it. "
                             "Fix: min_new_tokens <= max_new_tokens.")
        put("do_sample", _bool(self.do_sample, "do_sample", "do_sample=True (or False: greedy)"))
        put("return_logprobs", _bool(self.return_logprobs, "return_logprobs",
                                     "return_logprobs=True"))
        self._check_sampling(put)
        put("no_repeat_ngram_size", count_option(
            0 if self.no_repeat_ngram_size is None else self.no_repeat_ngram_size,
            "no_repeat_ngram_size", 0, _WHO,
            "the size of the n-grams that may not occur twice in a row; 0: off"))
        put("eos_token_id", _eos(self.eos_token_id))
        for name in ("pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is not None:
                put(name, _token_id(value, name))
        put("stop_strings", _stop_strings(self.stop_strings))
        put("num_return_sequences", count_option(self.num_return_sequences,
                                                 "num_return_sequences", 1, _WHO,
                                                 "the continuations sampled per prompt"))
        if self.num_return_sequences > 1 and not self.do_sample:
            raise UsageError(f"{_WHO}: num_return_sequences={self.num_return_sequences} with "
                             "do_sample=False (greedy) would return the same continuation "
                             "each time (transformers refuses it without beam search too). "
                             "Fix: do_sample=True, or num_return_sequences=1.")

    def _check_sampling(self, put: Any) -> None:
        if self.temperature is not None:
            t = check_temperature(self.temperature, _WHO)
            if self.do_sample and t == 0.0:
                raise UsageError(f"{_WHO}: temperature=0 with do_sample=True; sampling divides "
                                 "the logits by a positive temperature. Fix: do_sample=False "
                                 "for greedy, or e.g. temperature=0.8.")
            put("temperature", t)
        if self.top_k is not None:
            put("top_k", check_top_k(self.top_k, _WHO))
        for name, (ok, rule, example) in _RANGES.items():
            given = getattr(self, name)
            if given is None:
                continue
            value = number(given, name, _WHO)
            if not ok(value):
                raise UsageError(f"{_WHO}: {name}={given!r}; {rule}, or None. Fix: e.g. "
                                 f"{name}={example}.")
            put(name, value)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a tuple of ids (empty for ``None``).

        >>> from nnx_shard.inference import GenerationConfig
        >>> GenerationConfig(eos_token_id=2).eos_ids
        (2,)
        """
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)

    def replace(self, **changes: Any) -> GenerationConfig:
        """A copy with ``changes`` (field names), checked again.

        >>> from nnx_shard.inference import GenerationConfig
        >>> GenerationConfig(max_new_tokens=8).replace(do_sample=True).do_sample
        True
        """
        unknown = sorted(set(changes) - _FIELDS)
        if unknown:
            raise UsageError(f"{_WHO}.replace: {', '.join(f'{n}=' for n in unknown)} is no "
                             f"field; the fields are {', '.join(sorted(_FIELDS))}. Fix: drop "
                             "or rename it.")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], *, source: str | None = None,
                  **changes: Any) -> GenerationConfig:
        """The config of ``mapping`` as ``generation_config.json`` holds it: the
        fields above read, every other key ignored (transformers' own fields this
        library does not implement, ``transformers_version``, ``_from_model_config``
        ...), then ``changes`` applied. ``source`` names where the mapping came from
        in errors (the file, by :meth:`from_pretrained`).

        Raises:
          UsageError: a field of the wrong type or range, naming ``source`` and the key.

        >>> from nnx_shard.inference import GenerationConfig
        >>> config = GenerationConfig.from_dict({"do_sample": True, "top_p": 0.9,
        ...                                      "num_beams": 1}, max_new_tokens=16)
        >>> config.do_sample, config.top_p, config.max_new_tokens
        (True, 0.9, 16)
        """
        where = source or f"{_WHO}.from_dict"
        if not isinstance(mapping, Mapping):
            raise UsageError(f"{where}: must be a JSON object ({{...}}) of generation "
                             f"settings, got {json_type(mapping)}. Fix: e.g. "
                             '{"do_sample": true, "temperature": 0.7}.')
        unknown = sorted(set(changes) - _FIELDS)
        if unknown:
            raise UsageError(f"{_WHO}.from_dict: {', '.join(f'{n}=' for n in unknown)} is no "
                             f"field; the fields are {', '.join(sorted(_FIELDS))}. Fix: drop "
                             "or rename it.")
        # A null in the file is transformers' "unset": the field's default.
        read = {k: v for k, v in mapping.items() if k in _FIELDS and v is not None}
        try:
            base = cls(**read)
        except UsageError as e:
            said = str(e).removeprefix(f"{_WHO}: ").split(" Fix:")[0]
            raise UsageError(f"{where}: {said} Fix: correct it there, or download the "
                             "model's files again.") from None
        return base.replace(**changes) if changes else base

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], **changes: Any) -> GenerationConfig:
        """The config of the folder ``path``'s ``generation_config.json``, read as
        :meth:`from_dict` reads a mapping, then ``changes`` applied. The file is
        opened once through a checked descriptor (a link only inside the folder, or
        its hub cache repository).

        Raises:
          FileNotFoundError: the folder has no ``generation_config.json``.
          UsageError: ``path`` is not a folder; the file is not a JSON object, or a
            field of the wrong type or range (the file and key named).

        >>> import json, os, tempfile
        >>> from nnx_shard.inference import GenerationConfig
        >>> folder = tempfile.mkdtemp()
        >>> with open(os.path.join(folder, "generation_config.json"), "w") as f:
        ...     json.dump({"eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6,
        ...                "transformers_version": "4.57.0"}, f)
        >>> config = GenerationConfig.from_pretrained(folder, max_new_tokens=32)
        >>> config.eos_token_id, config.temperature, config.top_k, config.max_new_tokens
        ((2, 3), 0.6, 50, 32)
        """
        if isinstance(path, bytes) or not isinstance(path, str | os.PathLike) or not str(path):
            raise UsageError(f"{_WHO}.from_pretrained: path must be the checkpoint folder "
                             f"holding {FILE}, got {type(path).__name__} {short(path, 60)}. "
                             "Fix: e.g. GenerationConfig.from_pretrained('checkpoints/llama')")
        folder = os.fspath(path)
        check_path(folder, f"{_WHO}.from_pretrained",
                   fix=f"pass the checkpoint folder holding {FILE}.")
        file = os.path.join(folder, FILE)
        mapping = read_json(file, folder)
        if mapping is None:
            raise FileNotFoundError(f"{_WHO}.from_pretrained: no {FILE} in {folder}. Fix: "
                                    "pass the checkpoint folder holding it, or build a "
                                    "GenerationConfig(...) yourself.")
        return cls.from_dict(mapping, source=file, **changes)


#: The float fields with a range: what holds, the rule as errors state it, an example.
_RANGES: dict[str, tuple[Any, str, float]] = {
    "top_p": (lambda p: 0.0 < p <= 1.0, "the nucleus keeps the most likely tokens whose "
              "probabilities sum to top_p: use a number in (0, 1] (1: off)", 0.9),
    "min_p": (lambda m: 0.0 <= m <= 1.0, "it keeps tokens at least min_p times as likely as "
              "the most likely one: use a number in [0, 1]", 0.05),
    "repetition_penalty": (lambda r: math.isfinite(r) and r > 0, "use a finite number above 0 "
                           "(1: off, above 1 discourages repeats)", 1.2),
}

#: The field names, what :meth:`GenerationConfig.from_dict` reads.
_FIELDS = frozenset(f.name for f in dataclasses.fields(GenerationConfig))


def _bool(value: Any, name: str, fix: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise UsageError(f"{_WHO}: {name} must be True or False, got {type(value).__name__} "
                         f"{short(value, 40)}. Fix: {fix}.")
    return bool(value)


def _token_id(value: Any, name: str) -> int:
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer) \
            or value < 0:
        raise UsageError(f"{_WHO}: {name} must be a token id (an int 0 or more), got "
                         f"{type(value).__name__} {short(value, 40)}. Fix: e.g. {name}=2, the "
                         "tokenizer's id.")
    return int(value)


def _eos(value: Any) -> int | tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple | np.ndarray):
        return _token_id(value, "eos_token_id")
    ids = list(value)
    ok = lambda v: not isinstance(v, bool | np.bool_) and isinstance(v, int | np.integer) \
        and v >= 0  # noqa: E731
    if not ids or not all(ok(v) for v in ids):
        raise UsageError(f"{_WHO}: eos_token_id must be a token id (an int 0 or more) or a "
                         f"non-empty list of them, got {short(value, 60)}. Fix: e.g. "
                         "eos_token_id=[2, 3], or None (no end but the length).")
    return tuple(int(v) for v in ids)


def _stop_strings(value: Any) -> str | tuple[str, ...] | None:
    if value is None:
        return None
    strings = [value] if isinstance(value, str) else value
    fix = "Fix: e.g. stop_strings=['\\n\\n', 'User:']."
    if not isinstance(strings, list | tuple) or not strings:
        raise UsageError(f"{_WHO}: stop_strings={short(value, 60)} must be a non-empty list "
                         f"of non-empty strings (or one string). {fix}")
    for i, text in enumerate(strings):
        if not isinstance(text, str) or not text:
            raise UsageError(f"{_WHO}: stop_strings[{i}] is {short(text, 40)} "
                             f"({type(text).__name__}); each stop string must be non-empty "
                             f"text. {fix}")
    return value if isinstance(value, str) else tuple(strings)


def check_top_k(top_k: Any, caller: str) -> int:
    """``top_k`` as an int, 0 meaning every token (``None`` too, as in transformers; a
    ``top_k`` past the vocabulary also keeps every token, which the sampler decides).

    >>> check_top_k(None, "generate"), check_top_k(40, "generate")
    (0, 40)
    """
    if top_k is None:
        return 0
    if isinstance(top_k, bool | np.bool_) or not isinstance(top_k, int | np.integer) or top_k < 0:
        raise UsageError(f"{caller}: top_k={short(top_k, 40)}; use an int 0 or more (0 or "
                         "None: every token). Fix: e.g. top_k=40.")
    return int(top_k)


def check_temperature(temperature: Any, caller: str) -> float:
    """``temperature`` as a float: 0 (greedy) or a positive finite number.

    >>> check_temperature(0.7, "generate")
    0.7
    """
    if isinstance(temperature, bool | np.bool_ | str | bytes):
        # float(True) is 1.0 and float("0.5") is 0.5: neither is a temperature given.
        raise UsageError(f"{caller}: temperature must be a number, got {short(temperature, 40)} "
                         f"({'a bool' if isinstance(temperature, bool | np.bool_) else 'text'}). "
                         "Fix: temperature=0.0 (greedy) or e.g. temperature=0.8.")
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise UsageError(f"{caller}: temperature must be a number, got {temperature!r:.40}. "
                         "Fix: temperature=0.0 (greedy) or e.g. temperature=0.8.") from None
    if not math.isfinite(t) or t < 0:
        raise UsageError(f"{caller}: temperature={temperature!r}; use 0 (greedy) or a positive "
                         "number. Fix: temperature=0.0 (greedy) or e.g. temperature=0.8.")
    return t


def number(value: Any, name: str, caller: str) -> float:
    """``value`` as a float; a bool, text or anything else not a number is refused.

    >>> number(1, "top_p", "generate")
    1.0
    """
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise UsageError(f"{caller}: {name} must be a number, got {type(value).__name__} "
                         f"{value!r:.40}. Fix: pass a number (not text or a bool), e.g. "
                         f"{name}=1.0.")
    return float(value)


def count_option(value: Any, name: str, least: int, caller: str, what: str,
                  off: int | None = None) -> int:
    """An int option of at least ``least`` (``None``: ``off``, else ``least``).

    >>> count_option(3, "no_repeat_ngram_size", 0, "GenerationConfig", "the n-gram size")
    3
    """
    if value is None:
        return least if off is None else off
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer) \
            or value < least:
        got = "a bool" if isinstance(value, bool | np.bool_) else type(value).__name__
        raise UsageError(f"{caller}: {name}={short(value, 40)} ({got}) must be an int >= "
                         f"{least} ({what}), or None. Fix: e.g. {name}={max(least, 2)}.")
    return int(value)
