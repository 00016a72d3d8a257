"""Generation without a cache: each new token re-runs the model on the whole
sequence. :func:`nnx_shard.inference.generate` (a key/value cache, one prefill and
one decode loop) is the way to generate; these are what it is measured and
tested against.

* :func:`recompute`: the same arguments and result as
  :func:`nnx_shard.inference.generate`, the whole prefix re-run per token;
* :func:`generate`: the demo's sampler, a sliding window of the model's length
  (one sequence, ``n`` tokens, no end but ``n``).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["generate", "recompute"]


def generate(model: Any, prompt: Any, n: int, temperature: float, seed: int) -> Any:
    """``n`` tokens sampled after ``prompt`` (a window of at most the model's
    length), in one compiled loop; ``temperature=0`` is greedy. Under
    :func:`nnx_shard.use` the model runs sharded, the window replicated.

    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, get_config
    >>> model = Decoder(get_config("tiny"), rngs=nnx.Rngs(0))
    >>> out = generate(model, [1, 2, 3, 4], n=5, temperature=0.0, seed=0)
    >>> out.shape, bool((out == generate(model, [1, 2, 3, 4], 5, 0.0, 1)).all())
    ((5,), True)
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from nnx_shard._errors import count
    from nnx_shard.inference import _checks as g
    from nnx_shard.inference._config import check_temperature
    from nnx_shard.inference._decoding import config_vocab

    n = count(n, "generate: n")
    temperature = check_temperature(temperature, "generate")
    seed = g.check_seed(seed, "generate")
    g.check_ids(np.asarray(prompt), config_vocab(model), "generate", "prompt")
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


@functools.lru_cache(maxsize=16)
def _program(graphdef: Any, mesh: Any, rules: Any, batch: int, prompt_len: int, new: int,
             greedy: bool, top_k: int | None) -> Any:
    # mesh and rules key the cache: the program is traced under them.
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_shard.inference._decoding import pick

    def run(state: Any, prompt: Any, key: Any, temperature: Any) -> Any:
        model = nnx.merge(graphdef, state)
        tokens = jnp.zeros((batch, prompt_len + new), jnp.int32).at[:, :prompt_len].set(prompt)

        def step(i: Any, tokens: Any) -> Any:
            # Causal: the zeros after the prefix never reach the position read.
            logits = jax.lax.dynamic_index_in_dim(model(tokens), prompt_len - 1 + i, axis=1,
                                                  keepdims=False)
            token = pick(logits, key, prompt_len + i, temperature, greedy, top_k)
            return jax.lax.dynamic_update_slice(tokens, token[:, None], (0, prompt_len + i))

        return jax.lax.fori_loop(0, new, step, tokens)

    return jax.jit(run)


def recompute(model: Any, prompt_tokens: Any, max_new_tokens: int, *, temperature: float = 0.0,
              top_k: int | None = None, seed: int = 0, mesh: Any = None,
              rules: Any = None) -> Any:
    """:func:`nnx_shard.inference.generate` without a cache: each new token re-runs
    the model on the whole sequence (padded to prompt + new tokens), in one
    compiled loop. Same arguments, checks, layout (the model called under
    :func:`nnx_shard.inference.generation_rules` of the rules) and sampling keys,
    so equal logits give equal tokens; the reference the cached path is tested
    against and the baseline of ``benchmarks/generate.py``.

    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, ReferenceConfig
    >>> from nnx_shard.inference import GenerationConfig, generate
    >>> model = Decoder(ReferenceConfig(layers=1), rngs=nnx.Rngs(0))
    >>> slow = recompute(model, [[1, 2, 3, 4]], max_new_tokens=8)
    >>> bool((slow == generate(model, [[1, 2, 3, 4]], GenerationConfig(max_new_tokens=8))).all())
    True
    """
    import contextlib

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_shard._errors import UsageError
    from nnx_shard._mesh import use
    from nnx_shard.inference import _checks as g
    from nnx_shard.inference._cache_layout import generation_rules
    from nnx_shard.inference._config import check_temperature, check_top_k
    from nnx_shard.inference._decoding import config_vocab

    caller = "recompute"
    if not isinstance(model, nnx.Module):
        raise UsageError(f"{caller}: model must be an nnx.Module, got {type(model).__name__}. "
                         "Fix: pass the model itself, e.g. recompute(model, prompts, ...)")
    prompt = g.check_prompt(prompt_tokens, model, caller)
    batch, prompt_len = prompt.shape
    new = g.check_lengths(model, prompt_len, max_new_tokens, caller)
    t, k = check_temperature(temperature, caller), check_top_k(top_k, caller)
    seed = g.check_seed(seed, caller)
    mesh, rules = g.placement(mesh, rules, caller)
    ctx: Any = contextlib.nullcontext()
    gen_rules = None
    if mesh is not None:
        gen_rules = generation_rules(rules)
        g.check_batch(batch, mesh, gen_rules, caller)
        ctx = use(mesh, gen_rules)
    graphdef, state = nnx.split(model)
    vocab = config_vocab(model)
    if vocab is None:  # a model of the caller's: its logits say the vocabulary
        with ctx:
            vocab = g.logits_vocab(lambda s, x: nnx.merge(graphdef, s)(x), state,
                                   jax.ShapeDtypeStruct(prompt.shape, jnp.int32))
        g.check_ids(prompt, vocab, caller)
    # transformers' top-k: 0, or at least the vocabulary, keeps every token
    top = None if k == 0 or (vocab is not None and k >= vocab) else k
    run = _program(graphdef, mesh, gen_rules, batch, prompt_len, new, t == 0.0, top)
    with ctx:
        return run(state, prompt, jax.random.key(seed), jnp.float32(max(t, 1e-6)))
