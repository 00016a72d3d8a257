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
import stat
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from nnx_shard._errors import NnxShardError, UsageError, check_path, short
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


def _json_file(path: str) -> dict[str, Any]:
    from nnx_shard.models._hf_config import read_json

    return read_json(path)[0]


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
    hf = _json_file(folder) if config is None else config
    gen_path = os.path.join(folder, GENERATION)
    gen = _json_file(gen_path) if os.path.isfile(gen_path) else None
    tokenizer = tuple(n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n)))
    return Source(folder, json.dumps(hf, sort_keys=True),
                  None if gen is None else json.dumps(gen, sort_keys=True), tokenizer)


def remember_source(model: Any, source: Source | str | os.PathLike[str]) -> Any:
    """Records ``source`` (a :class:`Source`, or a checkpoint folder) as ``model``'s
    (its ``hf_source`` attribute) and returns the model.

    >>> import tempfile
    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> from nnx_shard.models import Llama, LlamaConfig
    >>> folder = ns.hf.tiny_checkpoint(tempfile.mkdtemp(), tokenizer=False)
    >>> m = remember_source(Llama(LlamaConfig.from_hf(folder), rngs=nnx.Rngs(0)), folder)
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
        from nnx_shard.models._llama_config import differences

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


def _hub_repo(folder: str) -> str | None:
    """The repository folder of the Hugging Face hub cache (``models--org--name``)
    holding the snapshot ``folder`` (``.../snapshots/<revision>``), None otherwise."""
    p = Path(folder)
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return str(p.parent.parent)
    return None


def _linked_inside(source: Source, name: str) -> str:
    """The path of the source's file ``name``; where it is a link, the file it leads to,
    which must be inside the checkpoint folder, or inside its hub cache repository (a
    snapshot's files link to ``../../blobs/<hash>``): the export is for publishing, and
    a link elsewhere (a key, a system file) must not copy a file of the machine into it."""
    path = os.path.join(source.folder, name)
    if not os.path.islink(path):
        return path
    folder = os.path.realpath(source.folder)
    target = os.path.realpath(path)
    repo = _hub_repo(folder)
    roots = [folder] if repo is None else [folder, repo]
    if any(os.path.commonpath([target, root]) == root for root in roots):
        return target
    within = folder if repo is None else f"{folder} or its hub cache repository {repo}"
    raise UsageError(
        f"save_safetensors: the source's {name} ({path}) is a symbolic link to {target}, "
        f"outside {within}: the export is for publishing, and only the checkpoint's own files "
        "are copied into it. Nothing was written. Fix: replace the link with a copy of the "
        f"file if it belongs to the model (cp --remove-destination {target} {path}), pass "
        "copy_tokenizer=False to leave the tokenizer out, or source=False.")


def _read(source: Source, name: str) -> bytes:
    path = os.path.join(source.folder, name)
    real = _linked_inside(source, name)
    try:
        with open(real, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise OSError(0, "not a regular file")
            raw = f.read()
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


def export_files(model: Any, source: Any, copy_tokenizer: Any, dtype: Any
                 ) -> tuple[dict[str, bytes], Any]:
    """The files ``save_safetensors`` writes beside the weights (name -> bytes) and the
    tensors' dtype (``dtype``, else the source's, else None: each parameter's own).

    ``source``: None for the model's remembered one, False for none, or a folder.
    Without a source, only a :class:`~nnx_shard.models.Llama`'s own ``config.json``.

    >>> files, dtype = export_files(object(), False, True, None)
    >>> files, dtype
    ({}, None)
    """
    if not isinstance(copy_tokenizer, bool):
        raise UsageError(f"save_safetensors: copy_tokenizer must be True or False, got "
                         f"{short(copy_tokenizer, 40)}. Fix: copy_tokenizer=False to leave "
                         "the tokenizer files out")
    if source is None:
        found = source_of(model)
    elif source is False:
        found = None
    elif isinstance(source, Source):
        found = source
    elif isinstance(source, bool):
        raise UsageError("save_safetensors: source=True is not a folder. Fix: source=None for "
                         "the model's own, source=False for none, or a checkpoint folder")
    else:
        found = read_source(source)
    cfg = getattr(model, "cfg", None)
    if found is None:
        if cfg is None or not hasattr(cfg, "to_hf"):
            return {}, dtype
        config = cfg.to_hf()
        if dtype is not None:
            config["torch_dtype"] = jnp.dtype(dtype).name
        return {"config.json": _dumps(config)}, dtype
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
    if copy_tokenizer:
        files.update({n: _read(found, n) for n in found.tokenizer})
    return files, dtype
