"""Hostile cases of the attention op's context-parallel mode (the rules' execution option
``attention``): values that are no mode, in the op and in a model's forward pass."""

from __future__ import annotations

from typing import Any


def build(hs: Any) -> None:
    def op(value: Any) -> Any:
        import jax.numpy as jnp

        import nnx_shard as ns
        from nnx_shard._attention import attention

        q = jnp.ones((8, 8, 2, 4))
        rules = ns.Rules({"batch": "data"}).with_options(attention=value)
        with ns.use("data=8", rules):
            return attention(q, q, q)

    def model(value: Any) -> Any:
        import jax.numpy as jnp
        from flax import nnx

        import nnx_shard as ns
        from nnx_shard.models import Decoder, get_config

        rules = ns.strategies.get("dp").rules.with_options(attention=value)
        m = Decoder(get_config("tiny"), rngs=nnx.Rngs(0))
        with ns.use("data=8", rules):
            return m(jnp.zeros((8, 16), jnp.int32), attention_mask=jnp.ones((8, 16), bool))

    for label, value in (("flash", "flash"), ("case", "Local"), ("int", 2), ("tuple", ("ring",)),
                         ("empty", "")):
        hs.api(f"attention_modes/op_{label}", ("attention", "local"), lambda v=value: op(v))
    hs.api("attention_modes/model_flash", ("attention", "local"), lambda: model("flash"))
