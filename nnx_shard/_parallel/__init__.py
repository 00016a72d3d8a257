"""Sharding-aware ops that a strategy switches on through an execution option of its
rules, never by a model edit:

* :mod:`~nnx_shard._parallel.collective_matmul`: tensor-parallel matmuls as
  ``ppermute`` rings (option ``collective_matmul``);
* :mod:`~nnx_shard._parallel.pipeline`: ``pipeline.scan``, a stacked layer loop run
  as a GPipe or circular pipeline over ``stage`` (option ``pipeline``; its
  schedule arithmetic in :mod:`~nnx_shard._parallel.schedule`).

The attention op, whose option ``attention`` picks ring or all-gather context
parallelism, registers here too but lives with its kernels in
:mod:`nnx_shard._attention`.

Each registers in :mod:`~nnx_shard._parallel.registry` what the fused training
step needs from it. The ops are public as ``nnx_shard.models.attention``,
``nnx_shard._parallel.collective_matmul`` and ``nnx_shard._parallel.pipeline`` (the
latter two also as attributes ``nnx_shard.collective_matmul`` and
``nnx_shard.pipeline``); this package imports
none of them itself, so the registry can be imported alone.
"""
