"""Every named model configuration, of every family, in one table: the reference
family's (``tiny``, ``tiny_moe``, ``small``, ``125m``, ``1b``, ``7b``) and the Hugging Face
families' (the test-sized ``llama-tiny`` and ``qwen3-tiny``, and the published shapes
``llama3-8b``, ``llama3-70b``, ``llama3-405b``, ``qwen3-0.6b``, ``mistral-7b``,
``qwen2.5-7b``, ``gemma2-9b``, and the mixtures of experts ``mixtral-8x7b`` and
``qwen3-30b-a3b``), with the one getter and the one builder the planner,
the command and users share.

>>> sorted(n for n in CONFIGS if n.startswith(("llama", "qwen")))
['llama-tiny', 'llama3-405b', 'llama3-70b', 'llama3-8b', 'qwen2.5-7b', 'qwen3-0.6b', 'qwen3-30b-a3b', 'qwen3-tiny']
>>> max_length(get_config("llama3-8b")), max_length(get_config("small"))
(131072, 128)
"""

from __future__ import annotations

import difflib
from typing import Any

from flax import nnx

from nnx_shard._errors import UsageError, short
from nnx_shard.models._decoder import Decoder, DecoderConfig
from nnx_shard.models._family import CONFIGS as FAMILY_CONFIGS
from nnx_shard.models._family.reference import ReferenceConfig

__all__ = ["CONFIGS", "build", "get_config", "max_length"]

#: Every configuration known by name: a :class:`~nnx_shard.models.ReferenceConfig` or a
#: :class:`~nnx_shard.models.DecoderConfig`. The large ones are for planning with
#: :func:`nnx_shard.abstract_init` (nothing is allocated).
CONFIGS: dict[str, ReferenceConfig | DecoderConfig] = dict(FAMILY_CONFIGS)


def get_config(name: str) -> ReferenceConfig | DecoderConfig:
    """The configuration called ``name`` in :data:`CONFIGS`: a
    :class:`~nnx_shard.models.ReferenceConfig` for the reference model's names,
    a :class:`~nnx_shard.models.DecoderConfig` for the Llama family's. An unknown name is
    a :class:`~nnx_shard.UsageError` naming the closest and the known ones.

    Args:
      name: a key of :data:`CONFIGS`, e.g. ``"llama3-8b"`` or ``"tiny"``.

    >>> from nnx_shard.models import get_config
    >>> get_config("tiny").layers, get_config("llama3-70b").kv_heads
    (2, 8)
    >>> get_config("llama-8b")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: unknown model config 'llama-8b'. Did you mean 'llama3-8b'? Known: tiny, tiny_moe, small, 125m, 1b, 7b, llama-tiny, llama3-8b, llama3-70b, llama3-405b, qwen3-tiny, qwen3-0.6b, qwen2.5-7b, mistral-7b, gemma2-9b, mixtral-8x7b, qwen3-30b-a3b. Fix: one of those
    """
    if not isinstance(name, str):
        raise UsageError(f"get_config: name must be a config name (str), got "
                         f"{type(name).__name__} {short(name, 60)}. Known: {', '.join(CONFIGS)}.")
    if name in CONFIGS:
        return CONFIGS[name]
    close = difflib.get_close_matches(name, CONFIGS, n=1)
    mean = f" Did you mean {close[0]!r}?" if close else ""
    raise UsageError(f"unknown model config {name!r}.{mean} Known: {', '.join(CONFIGS)}. "
                     "Fix: one of those")


def build(cfg: ReferenceConfig | DecoderConfig, rngs: nnx.Rngs) -> Any:
    """The model of ``cfg``: the shared decoder, :class:`~nnx_shard.models.Decoder`, of
    any family (the reference model's :class:`~nnx_shard.models.ReferenceConfig`
    too).

    >>> type(nnx.eval_shape(lambda: build(get_config("qwen3-0.6b"), nnx.Rngs(0)))).__name__
    'Decoder'
    """
    return Decoder(cfg, rngs=rngs)


def max_length(cfg: ReferenceConfig | DecoderConfig) -> int:
    """The longest sequence ``cfg`` takes (``max_length``; the reference model's
    ``length``)."""
    return int(cfg.max_length)
