"""Docstring examples of private helpers that run in the slow tier (the root conftest.py marks
them): each starts Python processes or compiles collective matmuls, a few seconds apiece."""

SLOW_DOCTESTS = frozenset({
    "nnx_shard._parallel.collective_matmul.projection",
    "nnx_shard._simulated.Workers",
    "nnx_shard._simulated.run_requests",
    "nnx_shard.planner._compile.compiled_memory_subprocess",
    "nnx_shard.planner._hardware.calibrate_subprocess",
})
