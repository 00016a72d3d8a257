"""Stock Flax layers (``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``) as
collective matmuls under the ``async_tp`` strategy, with no model edit.

A stock layer computes its projection through an attribute: ``dot_general``
(``Linear``, ``LinearGeneral``) or ``einsum_op`` (``Einsum``). :func:`intercept`
sets that attribute to a :class:`ProjectionOp` that remembers the layer's
kernel names. While the active rules carry the option ``collective_matmul``
(:func:`~nnx_shard.strategies._presets.async_tp`), the op reads the kernel's layout from
those rules and runs the projection through
:func:`nnx_shard._parallel.collective_matmul.projection`:

* a kernel split over the rules' ``length`` mesh axis along an output
  dimension (Megatron's column split: Q/K/V, the MLP's up projection, the
  logits) gathers the sequence in ring steps (``all_gather_matmul``);
* a kernel split along its first contracted dimension (the row split: the
  attention output, the MLP's down projection) reduce-scatters the sequence in
  ring steps (``matmul_reduce_scatter``).

Everywhere else (no collective-matmul option, no active rules, inputs that
are not ``[batch, length, ...]``, a kernel with no split on that axis, an
explicit ``out_sharding``) it is the stock ``jax.lax.dot_general`` /
``jnp.einsum`` with the same arguments, so an intercepted model trains the
same under every other preset. The input's first two dimensions are read as
the logical ``('batch', 'length')`` (as :class:`nnx_shard.Trainer`'s default
``batch_names``).

:func:`nnx_shard.multistep` (and so the Trainer) intercepts the stock layers of
the model it traces by itself while the option is set, on its own traced copy;
call :func:`intercept` for a step you jit yourself under :func:`nnx_shard.use`.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> import nnx_shard as ns
>>> from nnx_shard.tp_layers import intercept
>>> init = ns.with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
>>> layer = nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0))
>>> intercept(layer).dot_general
ProjectionOp(names=('embed', 'mlp'), kind='dot_general')
>>> s = ns.strategies.get("async_tp")
>>> with ns.use("data=2,model=4", s.rules):
...     y = layer(jnp.ones((2, 8, 8)))
>>> y.shape, y.sharding.spec
((2, 8, 16), P('data', None, 'model'))
"""

from nnx_shard._parallel.tp_layers import ProjectionOp, intercept

__all__ = ["ProjectionOp", "intercept"]
