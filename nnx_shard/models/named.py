"""The named model configurations the planner and ``nnx-shard plan`` know: the
reference Transformer's (:data:`~nnx_shard.models.CONFIGS`) and the Llama
family's published shapes (``llama3-8b``, ``llama3-70b``, ``llama3-405b``,
``qwen3-0.6b``, ``mistral-7b``, ``qwen2.5-7b``, ``gemma2-9b`` from
:data:`~nnx_shard.models.LLAMA_CONFIGS`), with the one
function that builds either.

>>> sorted(n for n in NAMED if n.startswith(("llama", "qwen")))
['llama3-405b', 'llama3-70b', 'llama3-8b', 'qwen2.5-7b', 'qwen3-0.6b']
>>> max_length(named_config("llama3-8b")), max_length(named_config("small"))
(131072, 128)
"""

from __future__ import annotations

import difflib
from typing import Any

from flax import nnx

from nnx_shard.errors import UsageError
from nnx_shard.models.llama import LLAMA_CONFIGS, Llama, LlamaConfig
from nnx_shard.models.transformer import CONFIGS, Transformer, TransformerConfig

__all__ = ["LLAMA_PLANNED", "NAMED", "build", "max_length", "named_config"]

#: The Llama-family configurations with published shapes (the test-sized ``tiny``
#: ones are not planned by name: ``tiny`` names the reference Transformer's).
LLAMA_PLANNED = ("llama3-8b", "llama3-70b", "llama3-405b", "qwen3-0.6b", "mistral-7b",
                 "qwen2.5-7b", "gemma2-9b")

#: Every config the planner knows by name.
NAMED: dict[str, TransformerConfig | LlamaConfig] = {
    **CONFIGS, **{name: LLAMA_CONFIGS[name] for name in LLAMA_PLANNED}}


def named_config(name: str) -> TransformerConfig | LlamaConfig:
    """The config called ``name`` in :data:`NAMED`; an unknown name is a
    :class:`~nnx_shard.errors.UsageError` naming the known ones.

    >>> named_config("llama-8b")
    Traceback (most recent call last):
    ...
    nnx_shard.errors.UsageError: unknown model 'llama-8b'. Did you mean 'llama3-8b'? Known: tiny, tiny_moe, small, 125m, 1b, 7b, llama3-8b, llama3-70b, llama3-405b, qwen3-0.6b, mistral-7b, qwen2.5-7b, gemma2-9b. Fix: one of those
    """
    if name in NAMED:
        return NAMED[name]
    close = difflib.get_close_matches(str(name), NAMED, n=1)
    mean = f" Did you mean {close[0]!r}?" if close else ""
    raise UsageError(f"unknown model {name!r}.{mean} Known: {', '.join(NAMED)}. Fix: one of those")


def build(cfg: TransformerConfig | LlamaConfig, rngs: nnx.Rngs) -> Any:
    """The model of ``cfg``: a :class:`~nnx_shard.models.Llama` for a
    :class:`~nnx_shard.models.LlamaConfig`, else a :class:`~nnx_shard.models.Transformer`.

    >>> type(nnx.eval_shape(lambda: build(named_config("qwen3-0.6b"), nnx.Rngs(0)))).__name__
    'Llama'
    """
    if isinstance(cfg, LlamaConfig):
        return Llama(cfg, rngs=rngs)
    return Transformer(cfg, rngs=rngs)


def max_length(cfg: TransformerConfig | LlamaConfig) -> int:
    """The longest sequence ``cfg`` takes (``length``, or Llama's ``max_length``)."""
    return int(cfg.max_length if isinstance(cfg, LlamaConfig) else cfg.length)
