"""The language-model batches and train step the strategy tests share."""

import functools

import numpy as np

import nnx_shard as ns
from nnx_shard.models import lm_loss


@functools.cache
def lm_batches(steps: int, batch: int, length: int, vocab: int = 128) -> dict[str, np.ndarray]:
    """``steps`` host batches ``[steps, batch, length]`` of next-token pairs (seed 0)."""
    toks = np.random.default_rng(0).integers(0, vocab, size=(steps, batch, length + 1))
    toks = toks.astype(np.int32)
    return {"inputs": toks[:, :, :-1], "targets": toks[:, :, 1:]}


def lm_step(model, opt, batch):
    """One AdamW/SGD step of ``lm_loss``; returns the loss and the gradients."""
    loss, grads = ns.value_and_grad(lm_loss)(model, batch)
    opt.update(model, grads)
    return {"loss": loss, "grads": grads}
