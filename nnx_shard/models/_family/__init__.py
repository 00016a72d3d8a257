"""One module per model family of :class:`~nnx_shard.models.Decoder` (the Hugging Face
families and the reference model, :mod:`.reference`): each registers its
:class:`~nnx_shard.models._families.Family` record (architecture, Hugging Face names,
block, what its decoder has, its config class with only its fields) and holds its named
configurations. Importing this package registers every family.

To add a family: a module here with its record and configs, its name below, its
fixtures and tests; nothing in the shared decoder changes.

>>> from nnx_shard.models._family import CONFIGS
>>> CONFIGS["qwen3-tiny"].model_type
'qwen3'
"""

from typing import Any

from nnx_shard.models._family import (
    gemma,
    gemma2,
    gemma3,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    reference,
)

__all__ = ["CONFIGS"]

#: The named configurations of every family, the reference model's first.
CONFIGS: dict[str, Any] = {
    name: cfg
    for module in (reference, llama, qwen3, qwen2, mistral, gemma, olmo2, gemma2, gemma3, phi3, mixtral,
                   qwen3_moe)
    for name, cfg in module.CONFIGS.items()
}
