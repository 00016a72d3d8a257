from nnx_shard import distributed, hf, models, strategies
from nnx_shard.annotate import annotate, get_logical_axes, logical_axes, with_logical
from nnx_shard.checkpoint import Checkpointer, restore, save
from nnx_shard.data import pack
from nnx_shard.errors import NnxShardError, ShardingError, ShardingWarning
from nnx_shard.hf import load_safetensors, save_safetensors
from nnx_shard.hf.peft import load_lora, save_lora
from nnx_shard.init import abstract_init, sharded_init, sharded_optimizer
from nnx_shard.low_rank import lora, merge_lora
from nnx_shard.mesh import constrain, make_mesh, shardings, use
from nnx_shard.metrics import MetricsWriter
from nnx_shard.parallel import collective_matmul, pipeline, tp_layers
from nnx_shard.quantized import QuantizedKernel
from nnx_shard.report import Report, explain
from nnx_shard.rules import Fallbacks, Rules
from nnx_shard.train import Precision, Trainer, multistep, shard_batch, value_and_grad
from nnx_shard.train.batches import Batches
from nnx_shard.weighting import mean_over

__all__ = [
    "Batches",
    "Checkpointer",
    "Fallbacks",
    "MetricsWriter",
    "NnxShardError",
    "Precision",
    "QuantizedKernel",
    "Report",
    "Rules",
    "ShardingError",
    "ShardingWarning",
    "Trainer",
    "abstract_init",
    "annotate",
    "collective_matmul",
    "constrain",
    "distributed",
    "explain",
    "get_logical_axes",
    "hf",
    "load_lora",
    "load_safetensors",
    "logical_axes",
    "lora",
    "make_mesh",
    "mean_over",
    "merge_lora",
    "models",
    "multistep",
    "pack",
    "pipeline",
    "restore",
    "save",
    "save_lora",
    "save_safetensors",
    "shard_batch",
    "sharded_init",
    "sharded_optimizer",
    "shardings",
    "strategies",
    "tp_layers",
    "use",
    "value_and_grad",
    "with_logical",
]
