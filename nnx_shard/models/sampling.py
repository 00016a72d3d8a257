"""Text generation from the reference transformer (the demo's sample)."""

from __future__ import annotations

from typing import Any

__all__ = ["generate"]


def generate(model: Any, prompt: Any, n: int, temperature: float, seed: int) -> Any:
    """``n`` tokens sampled after ``prompt`` (a window of at most the model's
    length), in one compiled loop; ``temperature=0`` is greedy. Under
    :func:`nnx_shard.use` the model runs sharded, the window replicated.

    >>> from flax import nnx
    >>> from nnx_shard.models import Transformer, get_config
    >>> model = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
    >>> out = generate(model, [1, 2, 3, 4], n=5, temperature=0.0, seed=0)
    >>> out.shape, bool((out == generate(model, [1, 2, 3, 4], 5, 0.0, 1)).all())
    ((5,), True)
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state: Any, window: Any, key: Any) -> Any:
        m = nnx.merge(graphdef, state)

        def body(i: Any, carry: Any) -> Any:
            window, out, key = carry
            logits = m(window[None])[0, -1]
            key, sub = jax.random.split(key)
            if temperature > 0:
                tok = jax.random.categorical(sub, logits / temperature)
            else:
                tok = jnp.argmax(logits)
            tok = tok.astype(jnp.int32)
            return jnp.concatenate([window[1:], tok[None]]), out.at[i].set(tok), key

        init = (window, jnp.zeros((n,), jnp.int32), key)
        return jax.lax.fori_loop(0, n, body, init)[1]

    return run(state, jnp.asarray(prompt, jnp.int32), jax.random.key(seed))
