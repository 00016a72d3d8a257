"""Attention: the op every model calls, its per-device kernels and its
context-parallel modes, in one package.

How one attention call runs is two independent choices, and each module here
owns one piece of them:

* :mod:`~nnx_shard._attention._op`: :func:`attention`, the op
  (``nnx_shard.models.attention``): checks ``q, k, v`` and the masks, reads the
  mode, and hands the work to a kernel on each device or to context parallelism.
* :mod:`~nnx_shard._attention._kernels`: the **kernel**, the model's choice
  (``implementation``, :data:`KERNELS`): ``"dense"`` (the plain masked softmax),
  ``"blockwise"``, ``"cudnn"`` or ``"auto"``, and which one ``"auto"`` picks.
* :mod:`~nnx_shard._attention._blocks`: the block math under the blockwise kernel
  and the ring (one query block against one key/value block, the online softmax,
  the recomputed backward pass).
* :mod:`~nnx_shard._attention._modes`: the **context-parallel mode**, the
  strategy's choice (the rules' execution option ``attention``, :data:`MODES`):
  ``"local"`` (no context parallelism, the default), ``"ring"`` or ``"allgather"``.
* :mod:`~nnx_shard._attention._context_parallel`: the ring and all-gather
  algorithms (``jax.shard_map``, zig-zag load balance, the backward ring).

"Dense" names a kernel only; the mode without context parallelism is
``"local"`` (see :mod:`~nnx_shard._attention._modes` for why).
The ring lives here rather than in :mod:`nnx_shard._parallel`, beside the other
collective algorithms, because it is attention: it runs the kernels' block math
at every step, and nothing else calls it. Imports point one way: the op reads
the modes and calls the kernels or the context-parallel algorithms, which call
the kernels and the block math.

>>> import jax
>>> import jax.numpy as jnp
>>> import nnx_shard as ns
>>> q = jnp.ones((2, 8, 2, 4))
>>> rules = ns.strategies.get("cp").rules            # attention="ring"
>>> with ns.use("data=4,context=2", rules):
...     ring = jax.jit(attention)(q, q, q)
>>> local = attention(q, q, q, implementation="dense")  # outside use: the "local" mode
>>> bool(jnp.allclose(ring, local, atol=1e-5)), MODES, KERNELS
(True, ('local', 'ring', 'allgather'), ('auto', 'blockwise', 'dense', 'cudnn'))
"""

from nnx_shard._attention._blocks import Masks
from nnx_shard._attention._kernels import BLOCK, KERNELS, attention_local, resolve
from nnx_shard._attention._modes import LOCAL, MODES, OPTION, context_mode
from nnx_shard._attention._op import attention, expect_attention

__all__ = ["BLOCK", "KERNELS", "LOCAL", "MODES", "OPTION", "Masks", "attention",
           "attention_local", "context_mode", "expect_attention", "resolve"]
