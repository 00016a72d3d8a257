"""What a loss is a mean over, so that gradient accumulation can weigh microbatches.

:func:`mean_over` marks a loss function with a count of the items of a batch it
averages over; :func:`nnx_shard.value_and_grad` reads the mark
(:func:`items_counter`) and weighs each microbatch by its share of the step's
items (see :mod:`nnx_shard._train._microbatch` for why). Here, below the models and
the training loop, so that both can use it: :func:`nnx_shard.models.lm_loss` is
declared a mean over its kept targets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

from nnx_shard._errors import UsageError, short

__all__ = ["items_counter", "mean_over"]

# The attribute of a declared loss that holds its count of items.
_ITEMS = "__nnx_shard_mean_over__"
LossFn = TypeVar("LossFn", bound=Callable[..., Any])


def mean_over(items: Callable[[Any], Any]) -> Callable[[LossFn], LossFn]:
    """Declares a loss a mean over ``items(batch)`` items (a scalar count, e.g. the
    targets a mask keeps), so that microbatches (``Trainer(..., microbatches=M)``,
    ``multistep(..., microbatches=M)``, :func:`nnx_shard.value_and_grad`) weigh as many items
    as they hold: a step's loss and update are those of the whole batch at once
    whatever M is, as transformers' ``num_items_in_batch``.

    Use it as a decorator on ``loss_fn(model, batch, *args)``, which must return
    the sum of its items' losses divided by ``items(batch)``. The step's items are
    counted once, before the batch is split, and microbatch ``j``'s loss (aux,
    gradients) is weighted by its items over the step's; one with no item adds
    nothing. The microbatches' counts must add up to the step's (a count, not a
    mean), finite and not negative: known ones that do not are a
    :class:`~nnx_shard._errors.UsageError`, traced ones make the loss NaN. A step with no item at all has no mean: its microbatches then count
    alike. It returns a new function (``loss_fn`` itself is left unmarked);
    :func:`nnx_shard.models.lm_loss` is declared so (over its kept targets). A loss
    without it counts every microbatch alike (their means averaged).

    Args:
      items: ``items(batch)``: the number of items the loss averages over (e.g. the targets a mask
        keeps).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> @ns.mean_over(lambda batch: jnp.sum(batch["mask"]))
    ... def masked_mse(model, batch):
    ...     err = (model(batch["x"])[:, 0] - batch["y"]) ** 2
    ...     return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> mask = jnp.array([1.0, 0, 0, 0, 1, 0, 1, 1])    # microbatch 1 (rows 1, 5) keeps none
    >>> batch = {"x": jnp.arange(24.0).reshape(8, 3), "y": jnp.ones(8), "mask": mask}
    >>> l1, g1 = ns.value_and_grad(masked_mse)(model, batch)
    >>> l4, g4 = ns.value_and_grad(masked_mse, microbatches=4)(model, batch)
    >>> bool(jnp.allclose(l1, l4)), bool(jnp.allclose(g1["kernel"][...], g4["kernel"][...]))
    (True, True)
    """
    if not callable(items):
        raise UsageError(
            f"mean_over: items must be a function items(batch) -> the number of items the "
            f"loss averages over, got {short(items, 80)}. Fix: e.g. "
            "ns.mean_over(lambda batch: jnp.sum(batch['mask'])).")

    def declare(loss_fn: LossFn) -> LossFn:
        if not callable(loss_fn):
            raise UsageError(
                f"mean_over(...) decorates a loss function loss_fn(model, batch), got "
                f"{short(loss_fn, 80)}. Fix: put @ns.mean_over(items) above the loss's def.")

        @functools.wraps(loss_fn)
        def loss(*args: Any, **kwargs: Any) -> Any:
            return loss_fn(*args, **kwargs)

        setattr(loss, _ITEMS, items)
        return cast(LossFn, loss)

    return declare


def items_counter(loss_fn: Any) -> Callable[[Any], Any] | None:
    """The ``items`` :func:`mean_over` declared ``loss_fn`` a mean over, or ``None``.

    >>> items_counter(mean_over(len)(lambda model, batch: 0.0)) is len
    True
    >>> items_counter(lambda model, batch: 0.0) is None
    True
    """
    items = getattr(loss_fn, _ITEMS, None)
    return items if callable(items) else None
