from nnx_shard.annotate import annotate, get_logical_axes, logical_axes, with_logical
from nnx_shard.errors import ShardingError, ShardingWarning
from nnx_shard.init import abstract_init, sharded_init, sharded_optimizer
from nnx_shard.mesh import constrain, make_mesh, shardings, use
from nnx_shard.report import Report, explain
from nnx_shard.rules import Rules

__all__ = [
    "Report",
    "Rules",
    "ShardingError",
    "ShardingWarning",
    "abstract_init",
    "annotate",
    "constrain",
    "explain",
    "get_logical_axes",
    "logical_axes",
    "make_mesh",
    "sharded_init",
    "sharded_optimizer",
    "shardings",
    "use",
    "with_logical",
]
