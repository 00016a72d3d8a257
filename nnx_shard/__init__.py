from nnx_shard import collective_matmul, distributed, hf, models, pipeline, strategies
from nnx_shard.annotate import annotate, get_logical_axes, logical_axes, with_logical
from nnx_shard.batches import Batches
from nnx_shard.checkpoint import Checkpointer, restore, save
from nnx_shard.errors import ShardingError, ShardingWarning
from nnx_shard.hf import load_safetensors, save_safetensors
from nnx_shard.init import abstract_init, sharded_init, sharded_optimizer
from nnx_shard.mesh import constrain, make_mesh, shardings, use
from nnx_shard.metrics import MetricsWriter
from nnx_shard.report import Report, explain
from nnx_shard.rules import Rules
from nnx_shard.train import Trainer, multistep, shard_batch, value_and_grad

__all__ = [
    "Batches",
    "Checkpointer",
    "MetricsWriter",
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
    "load_safetensors",
    "logical_axes",
    "make_mesh",
    "models",
    "multistep",
    "pipeline",
    "restore",
    "save",
    "save_safetensors",
    "shard_batch",
    "sharded_init",
    "sharded_optimizer",
    "shardings",
    "strategies",
    "use",
    "value_and_grad",
    "with_logical",
]
