from nnx_shard import (
    collective_matmul,
    corpus,
    distributed,
    hf,
    inference,
    models,
    pipeline,
    planner,
    preference,
    strategies,
    tp_layers,
)
from nnx_shard._annotate import annotate, get_logical_axes, logical_axes, with_logical
from nnx_shard._checkpoint import Checkpointer, restore, save
from nnx_shard._errors import (
    CompileError,
    NnxShardError,
    ShardingError,
    ShardingWarning,
    UsageError,
)
from nnx_shard._init import abstract_init, sharded_init, sharded_optimizer
from nnx_shard._low_rank import lora, merge_lora
from nnx_shard._mesh import constrain, make_mesh, shardings, use
from nnx_shard._metrics import MetricsWriter
from nnx_shard._pack import pack
from nnx_shard._quantized import QuantizedKernel
from nnx_shard._report import Report, explain
from nnx_shard._rules import Fallbacks, Rules
from nnx_shard._train import (
    DiLoCo,
    Precision,
    Trainer,
    apply_gradients,
    multistep,
    shard_batch,
    value_and_grad,
)
from nnx_shard._train._batches import Batches
from nnx_shard._weighting import mean_over

__all__ = [
    "Batches",
    "Checkpointer",
    "CompileError",
    "DiLoCo",
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
    "UsageError",
    "abstract_init",
    "annotate",
    "apply_gradients",
    "collective_matmul",
    "constrain",
    "corpus",
    "distributed",
    "explain",
    "get_logical_axes",
    "hf",
    "inference",
    "logical_axes",
    "lora",
    "make_mesh",
    "mean_over",
    "merge_lora",
    "models",
    "multistep",
    "pack",
    "pipeline",
    "planner",
    "preference",
    "restore",
    "save",
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
