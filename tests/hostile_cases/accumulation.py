"""Hostile cases of gradient accumulation over a loss's items: ``ns.mean_over`` given no
function or decorating no loss, item counts that are no counts (per row, text, a mean
that does not add up, negative, NaN), and ``lm_loss`` split into microbatches of a
batch without its keys."""

from __future__ import annotations

from typing import Any


def build(hs: Any) -> None:
    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    def masked_mse(model: Any, batch: Any) -> Any:
        import jax.numpy as jnp

        err = (model(batch["x"])[:, 0] - batch["y"]) ** 2
        return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])

    def step(items: Any, m: int = 4) -> Any:
        import jax.numpy as jnp
        from flax import nnx

        batch = {"x": jnp.ones((8, 3)), "y": jnp.ones(8),
                 "mask": jnp.array([1.0, 0, 0, 0, 1, 0, 0, 1])}
        loss_fn = ns().mean_over(items)(masked_mse)
        return ns().value_and_grad(loss_fn, microbatches=m)(nnx.Linear(3, 1, rngs=nnx.Rngs(0)),
                                                           batch)

    # ns.mean_over's arguments ----------------------------------------------------------------
    for label, items in [("int", 3), ("none", None), ("str", "mask")]:
        hs.api(f"accumulation/mean_over_items_{label}", "items",
               lambda i=items: ns().mean_over(i))
    for label, loss in [("str", "loss"), ("none", None), ("int", 0)]:
        hs.api(f"accumulation/mean_over_decorates_{label}", "mean_over",
               lambda x=loss: ns().mean_over(len)(x))

    # item counts that are no counts ----------------------------------------------------------
    def per_row(b: Any) -> Any:
        return b["mask"]

    def text(b: Any) -> Any:
        return "3"

    def nothing(b: Any) -> Any:
        return None

    def mean(b: Any) -> Any:
        import jax.numpy as jnp

        return jnp.mean(b["mask"])

    def negative(b: Any) -> Any:
        import jax.numpy as jnp

        return -jnp.sum(b["mask"])

    def nan(b: Any) -> Any:
        import jax.numpy as jnp

        return jnp.sum(b["mask"]) * jnp.nan

    def inf(b: Any) -> Any:
        import jax.numpy as jnp

        return jnp.sum(b["mask"]) + jnp.inf

    def complex_count(b: Any) -> Any:
        import jax.numpy as jnp

        return jnp.sum(b["mask"]) * 1j

    for label, items in [("per_row", per_row), ("text", text), ("none", nothing),
                         ("mean", mean), ("negative", negative), ("nan", nan), ("inf", inf),
                         ("complex", complex_count)]:
        hs.api(f"accumulation/items_{label}", "items", lambda i=items: step(i))

    # lm_loss in microbatches of a batch without its keys -------------------------------------
    def lm(batch: Any) -> Any:
        from flax import nnx

        from nnx_shard.models import Decoder, get_config, lm_loss

        model = Decoder(get_config("tiny"), rngs=nnx.Rngs(0))
        return ns().value_and_grad(lm_loss, microbatches=2)(model, batch)

    def tokens() -> Any:
        import jax.numpy as jnp

        return jnp.zeros((4, 8), jnp.int32)

    hs.api("accumulation/lm_loss_no_targets", "targets", lambda: lm({"inputs": tokens()}))
    hs.api("accumulation/lm_loss_not_a_dict", "inputs", lambda: lm(tokens()))
