"""Collective matmuls: tensor-parallel matmuls whose collective is a ring of
``ppermute`` steps, each overlapping one block's matmul (asynchronous TP).

Megatron tensor parallelism with a sequence-sharded residual stream (as under
:func:`~nnx_shard.strategies._presets.sp`) all-gathers the sequence before each
column-parallel matmul (Q/K/V, the MLP's up projection) and reduce-scatters
it after each row-parallel one (the attention output, the MLP's down
projection). Both collectives here are decomposed into ``N - 1`` ring steps
over the ``N`` devices of the model axis:

* :func:`all_gather_matmul`: each device starts with its block of the
  sequence, multiplies it by its slice of the weight, passes the block to its
  neighbour and multiplies the block it receives, until every block has
  passed every device;
* :func:`matmul_reduce_scatter`: each device computes the partial product of
  one block, adds it to the running sum it received from its neighbour and
  passes the sum on; after ``N - 1`` steps each device holds the full sum of
  its own block.

While one block travels the next is multiplied: the collective-permute and
the dot of each step are independent, so on an accelerator XLA's scheduler
can run the transfer behind the matmul. (XLA's CPU backend runs them one
after the other: there is nothing to gain on CPU, see benchmarks/async_tp.py.) Bidirectional (the default on
rings of more than 2 devices whose blocks split evenly in two): half of every
block goes each way round the ring, so each link carries half the bytes per
step in each direction.

The ops run inside ``jax.shard_map``, manual over the model axis. Where the
layout over the other mesh axes is known (Explicit axes, or the rules under
:func:`nnx_shard.use`) the map is manual over those too and keeps that
layout (the batch over ``data``); otherwise the partitioner keeps it. Gradients come
from JAX's transpose rules: the backward pass is again a ring of
collective-permutes (a reduce-scatter ring for the gathered operand, and the
other way round).

The reference transformer's projections call them when the active rules carry
the option ``collective_matmul`` (the ``async_tp`` strategy sets it):

>>> import nnx_shard as ns
>>> ns.strategies.get("async_tp").rules.options["collective_matmul"]
True
"""

from nnx_shard._parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]
