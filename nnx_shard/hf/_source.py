"""Where a pretrained model came from, so that its export can be published as is.

:func:`~nnx_shard.hf.load_pretrained` remembers the checkpoint folder it read, a
copy of its parsed ``config.json`` and ``generation_config.json`` and the names of
its tokenizer files, as a :class:`Source` in the model's ``hf_source`` attribute.
The attribute is not an ``nnx.Variable``: it is static data of the model's graph,
so it goes through ``nnx.split`` / ``nnx.merge`` / ``nnx.clone``, ``nnx.jit`` and
the trainer's steps with the model, and never into its state (checkpoints,
optimizers and gradients do not see it). A model built by hand has none; give
``save_safetensors(..., source=folder)`` then, or :func:`remember_source`.

:func:`save_safetensors <nnx_shard.hf.save_safetensors>` writes from it the files
beside the weights: ``config.json`` (the source's fields, with the model's sizes),
``generation_config.json`` (the source's, or one made of the config's bos / eos /
pad ids) and copies of the tokenizer files (read at save time from the folder,
which must still be there); the default tensor dtype is the source's.

The export is for publishing, so a file of the source that is a symbolic link is
copied only when the link stays inside the checkpoint folder, or inside its hub
cache repository (``models--org--name``: a snapshot's files link to
``../../blobs/<hash>``); a link elsewhere (a key, ``/etc/hostname``) is an error
naming the file and its target. Tokenizer JSON files must be JSON objects (with
special tokens given as text), and generation token ids ids of the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

from nnx_shard._errors import (
    LinkedOut,
    NnxShardError,
    UsageError,
    check_path,
    short,
)
from nnx_shard._trusted_files import folder_roots, read_within
from nnx_shard.hf._export_dir import TOKENIZER_FILES

__all__ = ["TOKENIZER_FILES", "Source", "export_files", "read_source", "remember_source",
           "source_of"]

GENERATION = "generation_config.json"
ATTR = "hf_source"
_DTYPE_KEYS = ("torch_dtype", "dtype")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# The fields of config.json that come from the model (its sizes), not from the source.
_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclasses.dataclass(frozen=True)
class Source:
    """A checkpoint folder as :func:`read_source` found it: the folder, its
    ``config.json`` and ``generation_config.json`` (as JSON text: the record is
    hashable, as static data of a model must be) and its tokenizer files' names.

    Args:
      folder: the checkpoint folder.
      config_text: its ``config.json``, as JSON text.
      generation_text: its ``generation_config.json`` as JSON text, ``None`` when there is none.
      tokenizer: the tokenizer files present in the folder.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> from nnx_shard.hf._source import read_source
    >>> s = read_source(ns.hf.tiny_checkpoint(tempfile.mkdtemp()))
    >>> s.config["model_type"], s.generation_config["eos_token_id"], s.tokenizer
    ('llama', 2, ('tokenizer.json', 'tokenizer_config.json'))
    """

    folder: str
    config_text: str
    generation_text: str | None
    tokenizer: tuple[str, ...]

    @property
    def config(self) -> dict[str, Any]:
        """The parsed ``config.json`` (a fresh copy)."""
        out: dict[str, Any] = json.loads(self.config_text)
        return out

    @property
    def generation_config(self) -> dict[str, Any] | None:
        """The parsed ``generation_config.json`` (a fresh copy), None without one."""
        return None if self.generation_text is None else json.loads(self.generation_text)


def _json_file(path: str, folder: str) -> dict[str, Any]:
    """The JSON object of the file ``path`` of the checkpoint ``folder``, read through
    one descriptor of a file inside the folder (or its hub cache repository): what is
    read here is published by an export."""
    from nnx_shard.models._hf_config import read_json

    return read_json(path, roots=folder_roots(folder))[0]


def read_source(path: str | os.PathLike[str], config: dict[str, Any] | None = None) -> Source:
    """The :class:`Source` of the checkpoint folder ``path`` (``config``: its
    ``config.json`` already parsed, else read here).

    Raises:
      FileNotFoundError: ``path`` is not a directory, or has no ``config.json``.
      UsageError: its ``config.json`` or ``generation_config.json`` is not a JSON object.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> read_source(ns.hf.tiny_checkpoint(tempfile.mkdtemp(), "qwen3")).config["model_type"]
    'qwen3'
    """
    if isinstance(path, bytes) or not isinstance(path, str | os.PathLike) or not str(path):
        raise UsageError(f"source: must be a checkpoint folder, got {type(path).__name__} "
                         f"{short(path, 60)}. Fix: e.g. source='checkpoints/llama'")
    folder = os.path.abspath(os.fspath(path))
    check_path(folder, "source", expected="a directory",
               fix="pass the folder of the checkpoint the model was loaded from.")
    hf = _json_file(folder, folder) if config is None else config
    gen_path = os.path.join(folder, GENERATION)
    gen = _json_file(gen_path, folder) if os.path.isfile(gen_path) else None
    tokenizer = tuple(n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n)))
    return Source(folder, json.dumps(hf, sort_keys=True),
                  None if gen is None else json.dumps(gen, sort_keys=True), tokenizer)


def remember_source(model: Any, source: Source | str | os.PathLike[str]) -> Any:
    """Records ``source`` (a :class:`Source`, or a checkpoint folder) as ``model``'s
    (its ``hf_source`` attribute) and returns the model.

    >>> import tempfile
    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> from nnx_shard.models import Decoder, DecoderConfig
    >>> folder = ns.hf.tiny_checkpoint(tempfile.mkdtemp(), tokenizer=False)
    >>> m = remember_source(Decoder(DecoderConfig.from_hf(folder), rngs=nnx.Rngs(0)), folder)
    >>> source_of(nnx.clone(m)).config["vocab_size"]
    128
    """
    setattr(model, ATTR, source if isinstance(source, Source) else read_source(source))
    return model


def source_of(model: Any) -> Source | None:
    """The :class:`Source` ``model`` remembers, None when it has none.

    Args:
      model: a model, e.g. one of :func:`load_pretrained`.

    >>> from nnx_shard.hf import source_of
    >>> source_of(object()) is None
    True
    """
    found = getattr(model, ATTR, None)
    return found if isinstance(found, Source) else None


def _dtype_of(config: dict[str, Any], folder: str) -> Any:
    """The dtype the source's ``config.json`` names (``torch_dtype`` / ``dtype``), None
    when it names none."""
    named = {k: config[k] for k in _DTYPE_KEYS if config.get(k) is not None}
    if len(set(map(str, named.values()))) > 1:
        raise UsageError(
            f"save_safetensors: the source's {folder}/config.json names two dtypes "
            f"({', '.join(f'{k}={v!r}' for k, v in named.items())}), so the export's is not "
            "known. Fix: pass dtype= (e.g. dtype=jnp.bfloat16).")
    if not named:
        return None
    name = next(iter(named.values()))
    if not isinstance(name, str) or name not in _DTYPES:
        raise UsageError(
            f"save_safetensors: the source's {folder}/config.json names the dtype "
            f"{short(name, 40)}, not one of {', '.join(_DTYPES)}. Fix: pass dtype= (e.g. "
            "dtype=jnp.bfloat16).")
    return _DTYPES[name]


def _config(model: Any, source: Source, dtype: Any) -> dict[str, Any]:
    """The source's ``config.json`` with the model's sizes and the export's dtype; an
    error when the model computes something else than the source describes."""
    config = source.config
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "to_hf"):
        ours = cfg.to_hf()
        config.update({k: ours[k] for k in _SHAPE_KEYS if k in ours})
        from nnx_shard.models._decoder_config import differences

        found = differences(config, cfg)
        if found:
            raise UsageError(
                f"save_safetensors: the model differs from its source {source.folder} beyond "
                f"its sizes; {len(found)} field(s):\n" + "\n".join(f"- {d}" for d in found[:8])
                + "\nFix: pass source=False to write the model's own config.json, or source= "
                "the checkpoint folder that describes it.")
    keys = [k for k in _DTYPE_KEYS if k in config] or ["torch_dtype"]
    for k in keys:
        config[k] = jnp.dtype(dtype).name
    return config


def _roots(source: Source) -> list[str]:
    """The folders a file of ``source`` may lead into: the checkpoint folder, and its
    hub cache repository (a snapshot's files link to ``../../blobs/<hash>``)."""
    return folder_roots(source.folder)


def _linked_out(source: Source, name: str, target: str) -> UsageError:
    path = os.path.join(source.folder, name)
    folder, *repo = _roots(source)
    within = f"{folder} or its hub cache repository {repo[0]}" if repo else folder
    how = "is a symbolic link to" if os.path.islink(path) else "leads to"
    return UsageError(
        f"save_safetensors: the source's {name} ({path}) {how} {target}, "
        f"outside {within}: the export is for publishing, and only the checkpoint's own files "
        "are copied into it. Nothing was written. Fix: replace the link with a copy of the "
        f"file if it belongs to the model (cp --remove-destination {target} {path}), pass "
        "copy_tokenizer=False to leave the tokenizer out, or source=False.")


def _linked_inside(source: Source, name: str) -> None:
    """Refuses the source's file ``name`` where it is a link out of the checkpoint
    folder (or its hub cache repository): the export is for publishing, and a link
    elsewhere (a key, a system file) must not pass for a file of the model."""
    path = os.path.join(source.folder, name)
    if os.path.islink(path):
        target = os.path.realpath(path)
        if not any(os.path.commonpath([target, r]) == r for r in _roots(source)):
            raise _linked_out(source, name, target)


def _read(source: Source, name: str) -> bytes:
    """The bytes of the source's file ``name``, read through one descriptor of the file
    found inside the checkpoint folder (:func:`~nnx_shard._trusted_files.read_within`): a file
    swapped for a link while the export runs cannot copy what the link leads to."""
    path = os.path.join(source.folder, name)
    try:
        raw = read_within(path, _roots(source))
    except LinkedOut as e:
        raise _linked_out(source, name, e.target) from None
    except OSError as e:
        gone = "" if os.path.isdir(source.folder) else " (the folder is gone)"
        raise NnxShardError(
            f"save_safetensors: cannot copy the tokenizer file {path} of the model's source"
            f"{gone}: {e.strerror or e}. Nothing was written. Fix: restore the source folder, "
            "pass source= a folder with the tokenizer files, or copy_tokenizer=False.") from None
    if name.endswith(".json"):
        _check_tokenizer_json(path, name, raw)
    return raw


# The entries of tokenizer_config.json / special_tokens_map.json that name a token:
# its text, or transformers' AddedToken record with the text as "content".
_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
               "mask_token")


def _check_tokenizer_json(path: str, name: str, raw: bytes) -> None:
    """Refuses a JSON tokenizer file that transformers cannot read: not JSON, or not
    an object; special tokens that are neither text nor a record with a ``content``."""
    fix = ("Fix: download the tokenizer's files again, or pass copy_tokenizer=False to leave "
           "them out.")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = getattr(e, "msg", None) or getattr(e, "reason", None) or type(e).__name__
        raise UsageError(f"save_safetensors: the source's tokenizer file {path} is not JSON "
                         f"({why}); nothing was written. {fix}") from None
    if not isinstance(data, dict):
        raise UsageError(f"save_safetensors: the source's tokenizer file {path} is "
                         f"{_kind(data)}, not a JSON object; nothing was written. {fix}")
    if name not in ("tokenizer_config.json", "special_tokens_map.json"):
        return
    for key in _TOKEN_KEYS:
        value = data.get(key)
        if value is None or isinstance(value, str) or (
                isinstance(value, dict) and isinstance(value.get("content"), str)):
            continue
        raise UsageError(f"save_safetensors: the source's {path} gives {key} as "
                         f"{_kind(value)}, not the token's text (or a "
                         "record with its 'content'); nothing was written. " + fix)
    extra = data.get("additional_special_tokens")
    if extra is not None and not isinstance(extra, list):
        raise UsageError(f"save_safetensors: the source's {path} gives additional_special_tokens"
                         f" as {_kind(extra)}, not a list of tokens; nothing was written. " + fix)


def _kind(value: Any) -> str:
    from nnx_shard._safetensors_io import described

    return described(value)


#: The token ids a generation config (or config.json) may give; eos may be a list.
_GENERATION_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def _check_ids(gen: dict[str, Any], where: str, vocab: int | None) -> None:
    """Refuses token ids of ``gen`` (the file ``where``) that are not ids of the
    model's vocabulary: generation would never stop at such an eos."""
    for key in _GENERATION_IDS:
        value = gen.get(key)
        if value is None:
            continue
        ids = value if isinstance(value, list) and key == "eos_token_id" else [value]
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0 or (
                    vocab is not None and i >= vocab):
                span = f"0..{vocab - 1}" if vocab is not None else "a whole number >= 0"
                held = "" if ids == [value] else f", and {short(i, 30)} in it"
                why = ("generation would never stop at it" if key == "eos_token_id" else
                       "generation would use a token the model does not have")
                raise UsageError(
                    f"save_safetensors: {where} gives {key} {short(value, 60)}{held}, not a "
                    f"token id of the model (its vocabulary: {span}): {why}. Nothing was "
                    f"written. Fix: correct {key} in {where}, or pass source=False.")


def _generation(found: Source, config: dict[str, Any]) -> dict[str, Any]:
    """The export's generation config: the source's, else the config's token ids."""
    vocab = config.get("vocab_size")
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
    gen = found.generation_config
    if gen is None:
        gen = {"_from_model_config": True,
               **{k: config[k] for k in _TOKEN_IDS if config.get(k) is not None}}
        _check_ids(gen, os.path.join(found.folder, "config.json"), vocab)
    else:
        _check_ids(gen, os.path.join(found.folder, GENERATION), vocab)
    return gen


def _dumps(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _tokenizer_size(raw: bytes) -> int | None:
    """The ids of a ``tokenizer.json`` (one past the largest of its model's vocabulary
    and its added tokens), None when it does not say."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids = [i for i in (vocab.values() if isinstance(vocab, dict) else ()) if _count(i) is not None]
    if isinstance(vocab, list) and vocab:  # Unigram: [token, score] pairs in id order
        ids.append(len(vocab) - 1)
    added = data.get("added_tokens") if isinstance(data, dict) else None
    for token in added if isinstance(added, list) else ():
        if isinstance(token, dict) and _count(token.get("id")) is not None:
            ids.append(token["id"])
    return max(ids) + 1 if ids else None


_TOKENIZER_FIX = ("Fix: pass tokenizer= the ns.inference.Tokenizer the model was resized for "
                  "(e.g. tokenizer=tok after tok.backend.add_tokens(...) and "
                  "ns.models.resize_token_embeddings(model, tok.vocab_size)), or "
                  "copy_tokenizer=False to leave the tokenizer out.")


def _check_copied_vocab(found: Source, config: dict[str, Any], files: dict[str, bytes]) -> None:
    """Refuses the source's tokenizer beside a model resized away from the source's
    ``vocab_size`` unless the tokenizer has the ids it was resized for: one grown past
    the source's vocabulary must come with a tokenizer grown past it too (tokens added
    to a tokenizer, then the model resized), and no tokenizer may have ids past the
    model's vocabulary. A vocabulary larger than the tokenizer is normal otherwise
    (padded to a multiple), so an unresized model is exported as its source is."""
    vocab, before = _count(config.get("vocab_size")), _count(found.config.get("vocab_size"))
    if vocab is None or before is None or vocab == before:
        return
    size = _tokenizer_size(files["tokenizer.json"]) if "tokenizer.json" in files else None
    if size is not None and size <= vocab and (size > before or vocab < before):
        return
    if size is None:
        has = "whose size cannot be told (no tokenizer.json to count its ids in)"
    elif size > vocab:
        has = (f"with {size} ids, more than the model's {vocab}: ids from {vocab} on would "
               "read past its embedding")
    else:
        has = (f"with {size} ids, none beyond the source's {before}: the tokens the model was "
               "resized for are not in it")
    raise UsageError(
        f"save_safetensors: the model's vocabulary ({vocab} ids) was resized from its source's "
        f"vocab_size {before} ({os.path.join(found.folder, 'config.json')}), but the source's "
        f"tokenizer would be copied beside it, {has}. Nothing was written. {_TOKENIZER_FIX}")


def _tokenizer_files(tokenizer: Any, vocab: int | None) -> dict[str, bytes]:
    """The files of the :class:`~nnx_shard.inference.Tokenizer` ``tokenizer``:
    ``tokenizer.json`` from its backend (tokens added to it included),
    ``tokenizer_config.json`` (its config, with the special tokens it uses) and
    ``chat_template.jinja`` where its template is not the config's."""
    from nnx_shard.inference._tokenizer import Tokenizer

    if not isinstance(tokenizer, Tokenizer):
        raise UsageError(
            f"save_safetensors: tokenizer must be an ns.inference.Tokenizer, got "
            f"{type(tokenizer).__name__} {short(tokenizer, 60)}. Fix: "
            "tokenizer=ns.inference.Tokenizer.from_pretrained(folder), or None (a transformers "
            "tokenizer: save it into the export with its own save_pretrained(path)).")
    size = tokenizer.vocab_size
    if vocab is not None and size > vocab:
        raise UsageError(
            f"save_safetensors: tokenizer has {size} ids (tokenizer.vocab_size, from "
            f"{tokenizer.path}), more than the model's vocabulary of {vocab}: ids from {vocab} "
            "on would read past its embedding. Nothing was written. Fix: "
            "ns.models.resize_token_embeddings(model, tokenizer.vocab_size) first, or pass the "
            "tokenizer the model was trained with.")
    to_str = getattr(tokenizer.backend, "to_str", None)
    if not callable(to_str):
        raise UsageError(
            f"save_safetensors: tokenizer's backend is a {type(tokenizer.backend).__name__}, "
            "not a tokenizers.Tokenizer, so it cannot be written as tokenizer.json. Fix: "
            "tokenizer=ns.inference.Tokenizer.from_pretrained(folder).")
    config = dict(tokenizer.config)
    for name, token in tokenizer.special_tokens.items():
        config.setdefault(name, token)
    try:
        files = {"tokenizer.json": (to_str(pretty=True) + "\n").encode(),
                 "tokenizer_config.json": _dumps(config)}
    except (TypeError, ValueError) as e:
        raise UsageError(
            f"save_safetensors: tokenizer's config (tokenizer.config, from {tokenizer.path}) "
            f"cannot be written as JSON ({e}). Nothing was written. Fix: keep its values "
            "JSON's (text, numbers, lists, dicts).") from None
    template = tokenizer.chat_template
    if isinstance(template, str) and template != config.get("chat_template"):
        files["chat_template.jinja"] = template.encode()
    return files


def _found(model: Any, source: Any) -> Source | None:
    """The source ``source`` names: None for the model's remembered one, False for none."""
    if source is None:
        return source_of(model)
    if source is False:
        return None
    if isinstance(source, Source):
        return source
    if isinstance(source, bool):
        raise UsageError("save_safetensors: source=True is not a folder. Fix: source=None for "
                         "the model's own, source=False for none, or a checkpoint folder")
    return read_source(source)


def _own_files(cfg: Any, dtype: Any, tokenizer: Any) -> dict[str, bytes]:
    """The files of an export without a source: a Llama's own ``config.json``, and the
    tokenizer's files where one is given."""
    files: dict[str, bytes] = {}
    vocab = None
    if cfg is not None and hasattr(cfg, "to_hf"):
        config = cfg.to_hf()
        if dtype is not None:
            config["torch_dtype"] = jnp.dtype(dtype).name
        files["config.json"] = _dumps(config)
        vocab = _count(config.get("vocab_size"))
    if tokenizer is not None:
        files.update(_tokenizer_files(tokenizer, vocab))
    return files


def export_files(model: Any, source: Any, copy_tokenizer: Any, dtype: Any,
                 tokenizer: Any = None) -> tuple[dict[str, bytes], Any]:
    """The files ``save_safetensors`` writes beside the weights (name -> bytes) and the
    tensors' dtype (``dtype``, else the source's, else None: each parameter's own).

    ``source``: None for the model's remembered one, False for none, or a folder.
    Without a source, only a :class:`~nnx_shard.models.Decoder`'s own ``config.json``.
    ``tokenizer``: a :class:`~nnx_shard.inference.Tokenizer` written in place of the
    source's tokenizer files.

    >>> files, dtype = export_files(object(), False, True, None)
    >>> files, dtype
    ({}, None)
    """
    if not isinstance(copy_tokenizer, bool):
        raise UsageError(f"save_safetensors: copy_tokenizer must be True or False, got "
                         f"{short(copy_tokenizer, 40)}. Fix: copy_tokenizer=False to leave "
                         "the tokenizer files out")
    if tokenizer is not None and not copy_tokenizer:
        raise UsageError("save_safetensors: tokenizer= was given with copy_tokenizer=False, "
                         "which leaves every tokenizer file out. Fix: drop copy_tokenizer=False "
                         "to write the tokenizer, or pass tokenizer=None.")
    found = _found(model, source)
    cfg = getattr(model, "cfg", None)
    if found is None:
        return _own_files(cfg, dtype, tokenizer), dtype
    if dtype is None:
        dtype = _dtype_of(found.config, found.folder)
    if dtype is None:
        config = found.config  # the model's own dtypes: as the file says, or to_hf's
        if cfg is not None and hasattr(cfg, "to_hf"):
            config = _config(model, found, cfg.param_dtype)
    else:
        config = _config(model, found, dtype)
    for name in ("config.json", GENERATION):
        if os.path.lexists(os.path.join(found.folder, name)):
            _linked_inside(found, name)
    files = {"config.json": _dumps(config), GENERATION: _dumps(_generation(found, config))}
    if tokenizer is not None:
        files.update(_tokenizer_files(tokenizer, _count(config.get("vocab_size"))))
    elif copy_tokenizer:
        copied = {n: _read(found, n) for n in found.tokenizer}
        if copied:
            _check_copied_vocab(found, config, copied)
        files.update(copied)
    return files, dtype
