"""What the reference models take besides the tokens: padding, positions, packing.

Every reference model is called as ``model(tokens, *, attention_mask=None,
positions=None, segment_ids=None)`` with transformers' meanings:

* ``attention_mask [batch, length]`` (1 or ``True``: a real token, 0: padding) is a
  mask of keys: no token attends to a padded one. With padding on the left the
  positions are derived from it as transformers' ``generate`` does,
  ``cumsum(mask) - 1`` clipped at 0, so each row's first real token is at
  position 0 and a padded row computes what the row alone computes;
* ``segment_ids [batch, length]`` (ints) mark packed sequences: a token attends
  only to earlier tokens of its own segment, and the positions restart at each
  segment (a segment is a run of equal ids);
* ``positions [batch, length]`` (ints) override the derived ones.

:func:`prepare` checks them and returns what the attention layers read.

>>> import jax.numpy as jnp
>>> extras = prepare(jnp.zeros((1, 5), jnp.int32), attention_mask=jnp.array([[0, 0, 1, 1, 1]]),
...                  positions=None, segment_ids=None, caller="model")
>>> extras.positions.tolist(), extras.mask.shape
([[0, 0, 0, 1, 2]], (1, 1, 1, 5))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard._attention import LOCAL, context_mode
from nnx_shard._errors import UsageError, short
from nnx_shard._mesh import constrain

__all__ = ["NO_EXTRAS", "Extras", "check_token_ids", "derive_positions", "prepare"]


class Extras(NamedTuple):
    """The per-token inputs of the attention layers (each ``None`` when not given):
    ``mask [batch, 1, 1, length]`` bool (key padding, the layout
    :func:`nnx_shard.models.attention` carries with the key/value blocks),
    ``segment_ids [batch, length]`` int32, ``positions [batch, length]`` int32."""

    mask: jax.Array | None = None
    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None

    def laid_out(self) -> Extras:
        """The fields constrained like the activations that meet them: the batch
        split as the tokens', the sequence whole (split on ``length`` under context
        parallelism, where the attention op moves them with the key/value blocks)."""
        def seq(names: tuple[Any, ...]) -> tuple[Any, ...]:
            if context_mode() != LOCAL:
                return (*names[:-1], "length")
            return names

        return Extras(
            None if self.mask is None else constrain(self.mask, seq(("batch", None, None, None))),
            None if self.segment_ids is None else constrain(self.segment_ids, seq(("batch", None))),
            None if self.positions is None else constrain(self.positions, seq(("batch", None))))


#: No mask, segment ids or positions: the models' unmasked program.
NO_EXTRAS = Extras()


def derive_positions(attention_mask: jax.Array | None, segment_ids: jax.Array | None,
                     length: int, batch: int) -> jax.Array:
    """Positions ``[batch, length]`` (int32) of the real tokens: counted from 0 at the
    first real token of each segment (runs of equal ``segment_ids``), padding
    (``attention_mask`` 0) not counted, clipped at 0 (padding before a row's first
    token sits at 0, as transformers' ``cumsum(mask) - 1`` does).

    >>> derive_positions(jnp.array([[0, 1, 1, 1, 1, 0]]), jnp.array([[1, 1, 1, 2, 2, 0]]),
    ...                  6, 1).tolist()
    [[0, 0, 1, 0, 1, 0]]
    """
    ones = jnp.ones((batch, length), jnp.int32)
    m = ones if attention_mask is None else attention_mask.astype(jnp.int32)
    counted = jnp.cumsum(m, axis=1)
    if segment_ids is None:
        return jnp.maximum(counted - 1, 0)
    seg = segment_ids
    starts = jnp.concatenate([jnp.ones((batch, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    # Tokens counted before each segment's first one; nondecreasing, so a running max
    # carries each segment's value along it.
    before = jax.lax.cummax(jnp.where(starts, counted - m, 0), axis=1)
    return jnp.maximum(counted - before - 1, 0)


def _concrete(x: Any) -> np.ndarray | None:
    """``x`` on the host when its values are known now (not a tracer)."""
    if isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True):
        return None  # traced, or spread over processes: nothing to read here
    try:
        return np.asarray(x)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
        return None


def check_token_ids(tokens: Any, vocab: int, caller: str) -> None:
    """Concrete ``tokens`` (a call outside ``jit``) are ids ``0 .. vocab - 1``: an
    embedding lookup clamps or wraps any other (-1 reads the last row, ``vocab + 5``
    gives NaN) without an error. Traced tokens cannot be read: ``Trainer.fit`` checks
    its batches on the host before its compiled step instead.

    >>> check_token_ids(jnp.array([[3, -1, 130]]), 128, "Decoder.forward")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: Decoder.forward: tokens hold ids [-1, 130], outside the vocabulary of 128 (ids 0 .. 127). Fix: encode with the model's tokenizer; pad with a real id (e.g. 0) and mask it with attention_mask.
    """
    dtype = getattr(tokens, "dtype", None)
    if dtype is None or not np.issubdtype(np.dtype(dtype), np.integer):
        return  # not ids: the lookup's own error names them
    host = _concrete(tokens)
    if host is None or not host.size or (host.min() >= 0 and host.max() < vocab):
        return
    bad = np.unique(host[(host < 0) | (host >= vocab)])
    shown = [int(v) for v in (bad if bad.size <= 4 else (*bad[:3], bad[-1]))]
    raise UsageError(f"{caller}: tokens hold ids {shown}, outside the vocabulary of {vocab} "
                     f"(ids 0 .. {vocab - 1}). Fix: encode with the model's tokenizer; pad "
                     "with a real id (e.g. 0) and mask it with attention_mask.")


def _array(name: str, x: Any, shape: tuple[int, ...], caller: str, *, mask: bool = False
           ) -> jax.Array:
    fix = ("Fix: pass one value per token, int or bool [batch, length] like the tokens"
           + (", 1 for a real token and 0 for padding (transformers' attention_mask)."
              if mask else "."))
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        try:
            x = np.asarray(x)
        except (TypeError, ValueError):
            raise UsageError(f"{caller}: {name} must be an array [batch, length], got "
                             f"{type(x).__name__} {short(x, 60)}. {fix}") from None
    dtype = np.dtype(x.dtype) if not jnp.issubdtype(x.dtype, jax.dtypes.extended) else None
    ok_kind = dtype is not None and (np.issubdtype(dtype, np.integer) or dtype == np.bool_)
    if tuple(x.shape) != shape or not ok_kind:
        raise UsageError(f"{caller}: {name} must be integers (or bools) of the tokens' shape "
                         f"{shape}, got {x.dtype} of shape {tuple(x.shape)}. {fix}")
    host = _concrete(x)
    if host is not None:
        if mask and not np.isin(host, (0, 1)).all():
            bad = sorted(set(np.unique(host).tolist()) - {0, 1})[:4]
            raise UsageError(f"{caller}: attention_mask must hold 0 (padding) and 1 (a real "
                             f"token) only, got values {bad}. {fix}")
        if name == "positions" and host.size and host.min() < 0:
            raise UsageError(f"{caller}: positions must be >= 0, got {int(host.min())}. {fix}")
    return jnp.asarray(x)


def prepare(tokens: jax.Array, *, attention_mask: Any, positions: Any, segment_ids: Any,
            caller: str, max_positions: int | None = None) -> Extras:
    """The checked :class:`Extras` of one call (``caller`` names the method in
    messages). Positions are derived (:func:`derive_positions`) when a mask or
    segment ids are given without them; with none of the three, every field is
    ``None`` and the models run their unmasked program unchanged.

    Raises:
      UsageError: an argument not of the tokens' shape ``[batch, length]`` or not
        integer/bool; a concrete ``attention_mask`` with values other than 0 and 1;
        concrete ``positions`` below 0 or from ``max_positions`` on.

    >>> prepare(jnp.zeros((2, 4), jnp.int32), attention_mask=None, positions=None,
    ...         segment_ids=jnp.zeros((2, 3), jnp.int32), caller="Decoder")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: Decoder: segment_ids must be integers (or bools) of the tokens' shape (2, 4), got int32 of shape (2, 3). Fix: pass one value per token, int or bool [batch, length] like the tokens.
    """
    shape = tuple(tokens.shape)
    if attention_mask is None and positions is None and segment_ids is None:
        return NO_EXTRAS
    mask = seg = pos = None
    if attention_mask is not None:
        mask = _array("attention_mask", attention_mask, shape, caller, mask=True).astype(bool)
    if segment_ids is not None:
        seg = _array("segment_ids", segment_ids, shape, caller).astype(jnp.int32)
    if positions is not None:
        pos = _array("positions", positions, shape, caller).astype(jnp.int32)
        host = _concrete(pos)
        if max_positions is not None and host is not None and host.size \
                and host.max() >= max_positions:
            raise UsageError(
                f"{caller}: positions go up to {int(host.max())}, but the model has "
                f"{max_positions} positions (0 .. {max_positions - 1}). Fix: positions below "
                f"{max_positions}, e.g. restart them per packed sequence.")
    else:
        pos = derive_positions(mask, seg, shape[1], shape[0])
    return Extras(None if mask is None else mask[:, None, None, :], seg, pos)
