"""Docstring examples that run in the slow tier: each compiles a dozen programs or more, starts
Python processes or compiles collective matmuls, a few seconds apiece on CPU. The guides' and
notebooks' code runs there too; every other example keeps the quick tier's check."""

# Examples of the API reference, run by tests/test_api_examples.py.
SLOW_EXAMPLES = frozenset({
    "nnx_shard.inference.generate",
    "nnx_shard.inference.generate_text",
    "nnx_shard.models.Decoder.decode",
    "nnx_shard.tp_layers",
})

# Private helpers' examples, run by --doctest-modules (the root conftest.py marks them).
SLOW_DOCTESTS = frozenset({
    "nnx_shard.planner._compile.compiled_memory_subprocess",
    "nnx_shard.planner._hardware.calibrate_subprocess",
})
