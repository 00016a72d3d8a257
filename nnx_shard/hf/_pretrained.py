"""Pretrained Hugging Face checkpoints as sharded models in one call:
:func:`load_pretrained` reads ``config.json``, picks the model family by its
``model_type``, builds the model abstractly under the rules and fills each
device's slices from the safetensors files (on the training floor, beside
:func:`load_safetensors`: the models below it never import the loader)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from nnx_shard._errors import UsageError, check_path, short
from nnx_shard._init import abstract_init
from nnx_shard.hf._files import open_checkpoint
from nnx_shard.hf._load import load_opened, separate_head
from nnx_shard.hf._source import read_source, remember_source
from nnx_shard.models._decoder import Decoder
from nnx_shard.models._decoder_config import DecoderConfig
from nnx_shard.models._families import family_of, model_types
from nnx_shard.models._hf_config import read_json

__all__ = ["load_pretrained"]


def load_pretrained(path: str | os.PathLike[str], *, mesh: Mesh | str | Any, rules: Any,
                    dtype: Any = None, param_dtype: Any = None) -> nnx.Module:
    """The model of the Hugging Face checkpoint directory ``path`` (what
    ``save_pretrained`` writes: ``config.json`` and safetensors files), every
    parameter read straight into the sharding ``rules`` give it on ``mesh``.

    The family comes from ``config.json``'s ``model_type`` through the registry of
    :mod:`nnx_shard.models._families`: ``llama``, ``qwen3``, ``qwen2``, ``mistral``,
    ``gemma``, ``olmo2``, ``gemma2``, ``gemma3_text``, ``phi3``, ``mixtral`` and ``qwen3_moe`` build a
    :class:`~nnx_shard.models.Decoder` from
    :meth:`DecoderConfig.from_hf <nnx_shard.models.DecoderConfig.from_hf>`. The
    equivalent by hand is ``ns.hf.load_safetensors(path, ns.abstract_init(lambda:
    Decoder(DecoderConfig.from_hf(path), rngs=nnx.Rngs(0)), mesh, rules))``.

    Args:
      path: the checkpoint directory.
      mesh: a ``Mesh`` or a spec for :func:`nnx_shard.make_mesh` (``"data=4,model=2"``).
      rules: the logical-to-mesh table, e.g. ``ns.strategies.get("fsdp_tp").rules``.
      dtype: the compute dtype (default float32).
      param_dtype: the parameters' dtype (default float32: master weights for
        training, whatever ``torch_dtype`` the file names).

    A checkpoint with ``tie_word_embeddings: true`` that still holds an
    ``lm_head.weight`` of its own (other values than the embedding) gives an untied
    model computing its logits with that head, as transformers does.

    The model remembers its source (the folder, its ``config.json``,
    ``generation_config.json`` and tokenizer files: :mod:`nnx_shard.hf._source`),
    so that :func:`nnx_shard.hf.save_safetensors` writes an export to publish: the
    source's config with the model's sizes, its generation config and tokenizer,
    in the source's dtype.

    Traced (``nnx.eval_shape(lambda: load_pretrained(...))``) it gives the abstract
    model: its shapes, dtypes and source, no values. The files are still read then;
    ``ns.abstract_init(lambda: Decoder(DecoderConfig.from_hf(path), rngs=nnx.Rngs(0)), mesh,
    rules)`` gives the same abstract model without reading a weight.

    Raises:
      UsageError: a ``model_type`` no family here reads, or a ``config.json``
        value :meth:`DecoderConfig.from_hf` refuses; plus what
        :func:`nnx_shard.hf.load_safetensors` raises.
      FileNotFoundError: no ``config.json`` at ``path``.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> from nnx_shard.hf import load_pretrained
    >>> folder = ns.hf.tiny_checkpoint(tempfile.mkdtemp(), "qwen3", tokenizer=False)
    >>> fsdp_tp = ns.strategies.get("fsdp_tp")
    >>> model = load_pretrained(folder, mesh=fsdp_tp.make_mesh(), rules=fsdp_tp.rules)
    >>> type(model).__name__, model.cfg.model_type, model.blocks[0].mlp.up.get_value().sharding.spec
    ('Decoder', 'qwen3', P('data', 'model'))
    """
    if isinstance(path, bytes) or not isinstance(path, str | os.PathLike) or not str(path):
        raise UsageError(f"load_pretrained: path must be a checkpoint directory, got "
                         f"{type(path).__name__} {short(path, 60)}. Fix: e.g. "
                         "load_pretrained('checkpoints/qwen2.5-7b', mesh=..., rules=...)")
    folder = os.fspath(path)
    check_path(folder, "load_pretrained", expected="a directory",
               fix="pass the checkpoint directory save_pretrained wrote (config.json and "
                   "*.safetensors).")
    hf, where = read_json(folder)
    kind = hf.get("model_type")
    try:
        family_of(kind)
    except UsageError:
        raise UsageError(f"{where}: model_type {short(kind, 60)} is not a family "
                         f"load_pretrained builds (supported: {', '.join(model_types())}). "
                         "Fix: pass a checkpoint of one of these, or build the model yourself "
                         "and fill it with ns.hf.load_safetensors(path, target, mapping=...)."
                         ) from None
    overrides = {k: v for k, v in (("dtype", dtype), ("param_dtype", param_dtype))
                 if v is not None}
    cfg = DecoderConfig.from_hf(hf, **overrides)
    # Each file opened once: the head check and every weight read from one descriptor;
    # config.json and the head check passed down, not read again for the config check.
    with open_checkpoint(folder) as header:
        separate = separate_head(header)
        if cfg.tie_embeddings and separate:
            # transformers keeps a separate lm_head.weight of the file (tie_word_embeddings
            # or not) and computes the logits with it: so does the model.
            cfg = dataclasses.replace(cfg, tie_embeddings=False)
        target = abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, rules)
        model = load_opened(folder, header, target, config=hf, separate=separate)
    # Remembered for save_safetensors: the export then carries the source's config,
    # generation config and tokenizer (nnx_shard.hf._source).
    return remember_source(model, read_source(folder, hf))
