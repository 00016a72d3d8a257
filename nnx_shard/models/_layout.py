"""The layouts the decoder constrains its activations to, by logical name, where
parallelism strategies differ:

* the residual stream is :data:`RESIDUAL` ``("batch", "length", None)``: sequence
  parallelism maps ``length`` to the model axis there;
* the input of attention and of the MLP is :data:`GATHERED` ``("batch", None, None)``:
  under sequence parallelism this is where the sequence is all-gathered
  (:func:`block_input_names`);
* queries, keys and values are ``("batch", None, "heads", "kv")`` and the MLP hidden
  layer ``("batch", None, "mlp")``: Megatron's column-parallel half; the attention and
  MLP outputs return to the residual layout: the row-parallel half (an all-reduce, or
  a reduce-scatter under sequence parallelism);
* under rules with the option ``collective_matmul`` (``async_tp``) the projections
  gather and scatter the sequence themselves, in ring steps
  (:mod:`nnx_shard.collective_matmul`), so the input of attention and of the MLP stays
  in the residual layout;
* under context parallelism (the rules' ``attention`` option, set by the ``cp``
  presets) the sequence stays split on ``length`` at the dense ones of these points
  (:func:`seq_names`), and the attention op runs as ring (or all-gather-KV) attention.

The embedding dimension of activations is never named: strategies that shard
parameters over ``embed`` (FSDP) use the same mesh axis for ``batch``. Also here: the
checks of a call's tokens every model entry point shares.

>>> seq_names(GATHERED), block_input_names()
(('batch', None, None), ('batch', None, None))
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from nnx_shard._errors import UsageError, short
from nnx_shard._mesh import option

__all__ = ["GATHERED", "POS_TABLE", "RESIDUAL", "TOKEN_TABLE", "block_input_names",
           "empty_tokens", "last_positions", "seq_names"]

RESIDUAL = ("batch", "length", None)
GATHERED = ("batch", None, None)
# The embedding tables' logical names: their parameters' and what lookup reads them as.
TOKEN_TABLE = ("vocab", "embed")
POS_TABLE = (None, "embed")


def seq_names(names: tuple[Any, ...]) -> tuple[Any, ...]:
    """``names`` with the sequence kept split under context parallelism (the
    ``attention`` option of the ``cp`` presets): there the sequence stays on its
    ``length`` axes through the whole block, and only the attention op gathers
    keys and values, in its own way. Elsewhere ``names`` as given (sequence
    parallelism gathers the sequence at these points)."""
    if option("attention", "local") in ("ring", "allgather"):
        return (names[0], "length", *names[2:])
    return names


def block_input_names() -> tuple[str | None, ...]:
    """The layout of the input of attention and of the MLP."""
    # Collective matmuls gather the sequence inside the projections, block by
    # block: the input stays in the residual layout until then.
    return RESIDUAL if option("collective_matmul", False) else seq_names(GATHERED)


def last_positions(x: jax.Array, logits_to_keep: Any, caller: str) -> jax.Array:
    """The hidden states ``x [batch, T, embed]`` of the positions whose logits
    ``decode(..., logits_to_keep=)`` returns: all for 0, else the last ones."""
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int | np.integer) \
            or logits_to_keep < 0:
        raise UsageError(f"{caller}: logits_to_keep={short(logits_to_keep, 40)} must be an int "
                         ">= 0 (0: every position, n: the last n). Fix: e.g. logits_to_keep=1.")
    keep = int(logits_to_keep)
    return x if keep == 0 or keep >= x.shape[1] else x[:, x.shape[1] - keep:]


def empty_tokens(tokens: Any, caller: str) -> None:
    """Refuses tokens with no rows or no positions: attention has no key to attend to
    and the router no token to route, and their reductions have no empty form.

    >>> import jax.numpy as jnp
    >>> empty_tokens(jnp.zeros((2, 0), jnp.int32), "Decoder.forward")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: Decoder.forward: tokens of shape (2, 0) hold no token (a batch of 2 rows of 0 positions). Fix: at least one row of at least one token, e.g. tokens of shape (2, 1).
    """
    shape = tuple(getattr(tokens, "shape", ()))
    if len(shape) == 2 and 0 in shape:
        raise UsageError(f"{caller}: tokens of shape {shape} hold no token (a batch of "
                         f"{shape[0]} rows of {shape[1]} positions). Fix: at least one row of at "
                         f"least one token, e.g. tokens of shape ({max(shape[0], 1)}, "
                         f"{max(shape[1], 1)}).")
