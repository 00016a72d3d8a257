"""Fused multi-step training: K steps in one compiled call, batches sharded by logical names.

Three layers, each usable alone:

* :func:`multistep` (:mod:`~nnx_shard._train._fused`) turns an ordinary NNX train
  step into one compiled call that runs it K times (a ``jax.lax.scan``),
  carrying the model, the optimizer and any other NNX object passed, updating
  them in place like ``nnx.jit``.
* :func:`value_and_grad` (:mod:`~nnx_shard._train._microbatch`) is
  ``nnx.value_and_grad`` that can split the batch into microbatches and accumulate
  the gradients (set per call, or by ``multistep(..., microbatches=M)``), weighing
  each by its items for a loss declared with :func:`~nnx_shard.mean_over`;
  :func:`apply_gradients` (:mod:`~nnx_shard._train._stream`) is
  ``optimizer.update`` that streams host-offloaded state a layer at a time.
* :func:`shard_batch` (:mod:`~nnx_shard._train._placement`) turns host NumPy
  batches into global ``jax.Array`` s laid out by logical names;
  :class:`Trainer` (:mod:`~nnx_shard._train._trainer`) puts the three together
  with feeding (:mod:`~nnx_shard._train._feed`: stacking per-step batches or reading
  :class:`~nnx_shard.Batches` windows from :mod:`~nnx_shard._train._batches`), a
  progress bar (:mod:`~nnx_shard._train._progress`), a NaN/Inf stop and the
  gradient norm (:mod:`~nnx_shard._train._guard`), run call by call by
  :mod:`~nnx_shard._train._run`. :class:`Precision`
  (:mod:`~nnx_shard._train._precision`) gives any of them mixed precision.
  :class:`DiLoCo` (:mod:`~nnx_shard._train._diloco`) trains replicas apart over a
  mesh's ``replica`` axis, averaging them every H steps.
"""

from nnx_shard._train._diloco import DiLoCo
from nnx_shard._train._fused import Fused, multistep
from nnx_shard._train._microbatch import value_and_grad
from nnx_shard._train._placement import shard_batch
from nnx_shard._train._precision import Precision
from nnx_shard._train._run import History
from nnx_shard._train._stream import apply_gradients
from nnx_shard._train._trainer import Trainer

__all__ = ["DiLoCo", "Fused", "History", "Precision", "Trainer", "apply_gradients", "multistep",
           "shard_batch", "value_and_grad"]
