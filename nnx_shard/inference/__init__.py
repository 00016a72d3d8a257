"""Text generation with a key/value cache laid out by the rules.

:func:`generate` runs two compiled programs per shape: the **prefill** creates
the cache inside the program, each device allocating only its slice (the
layout the rules give the cache's logical names), runs the whole prompt through
the model in one call (its padding masked; the cache remembers it) and picks
the first new token, attending with the model's attention kernel as training does
(the blockwise one keeps a few tiles of scores, never ``[prompt, cache]``: the
prefill's memory grows linearly with the prompt, see
:func:`nnx_shard.models._kv_cache.attend`); the **decode** program runs every
further token in one ``jax.lax.while_loop``, each step feeding one token per
sequence and attending through the cache, which is passed in place (donated) and
never gathered, until ``max_new_tokens`` or every row has stopped at an
end-of-sequence token.
:func:`stream` runs the same decode program a chunk of steps at a time. Every
generation setting is a field of one :class:`GenerationConfig` (transformers'
names and defaults; :meth:`GenerationConfig.from_pretrained` reads a checkpoint's
``generation_config.json``). The prompts, their mask, the seed and every
setting's value are arguments of the programs, never compiled in.

The cache has its own logical names, :data:`CACHE_AXES` (``cache_batch``,
``cache_length``, ``cache_kv_heads``, ``cache_head_dim``, plus ``layers`` in
front for stacked blocks; the reference models store ``[batch, kv_heads, length,
head_dim]``, the order the attention products read, so a decode step never
transposes the cache); every preset of :mod:`nnx_shard.strategies` gives
them a rule (batch over the data axis; key/value heads over the model axis
under the tensor-parallel presets; length over the context axis under the
context-parallel ones). A table without them gets them from its own entries
(:func:`generation_rules`).

Any model that implements two methods can be driven (the reference
:class:`~nnx_shard.models.Decoder` and :class:`~nnx_shard.models.Decoder`
do):

* ``init_cache(batch, length)``: create its ``nnx.Cache`` variables for
  ``batch`` sequences of up to ``length`` positions, annotated with logical
  names (e.g. with :func:`nnx_shard._annotate` after stock
  ``nnx.MultiHeadAttention.init_cache``);
* ``decode(tokens)``: logits ``[batch, T, vocab]`` of ``tokens [batch, T]``
  placed after those already cached, storing theirs; for padded prompts also
  ``decode(tokens, attention_mask=)`` (0: padding, remembered for later calls,
  which pass a mask of ones). A ``decode`` that takes ``logits_to_keep`` (as
  transformers' models do: 1 returns the last position's logits ``[batch, 1,
  vocab]`` only) is asked for the last one in the prefill, which then never
  holds ``[prompt, vocab]`` logits.

A ``max_length`` attribute, where the model has one, is its context:
:func:`generate` refuses prompts and lengths past it.

A model of stock Flax layers: ``nnx.MultiHeadAttention`` keeps its cache in
``nnx.Cache`` variables (``cached_key``, ``cached_value`` ``[batch, length,
heads, head_dim]``, and ``cache_index``) created by its ``init_cache`` and read
with ``decode=True``. Naming them :data:`CACHE_AXES` with
:func:`nnx_shard._annotate` is all the rules need to lay the cache out (here the
batch over ``data`` and the heads over ``model``, as ``tp`` says); without the
names :func:`generate` warns that the cache is replicated.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> from jax.sharding import AbstractMesh
>>> import nnx_shard as ns
>>> from nnx_shard.inference import CACHE_AXES, GenerationConfig, explain_cache, generate
>>> class StockLM(nnx.Module):
...     max_length = 16
...     def __init__(self, rngs):
...         self.embed = nnx.Embed(64, 32, rngs=rngs)
...         self.pos = nnx.Embed(self.max_length, 32, rngs=rngs)
...         self.attn = nnx.MultiHeadAttention(4, 32, decode=False, rngs=rngs)
...         self.out = nnx.Linear(32, 64, rngs=rngs)
...     def __call__(self, tokens):  # training: the whole sequence, causal
...         x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))
...         return self.out(x + self.attn(x, mask=nnx.make_causal_mask(tokens)))
...     def init_cache(self, batch, length):
...         self.attn.init_cache((batch, length, 32))
...         ns.annotate(self, {r"attn/cached_(key|value)$": CACHE_AXES})
...     def decode(self, tokens):  # one position at a time through the cache
...         steps = []
...         for t in range(tokens.shape[1]):
...             x = self.embed(tokens[:, t:t + 1]) + self.pos(self.attn.cache_index[...])
...             steps.append(self.out(x + self.attn(x, decode=True)))
...         return jnp.concatenate(steps, axis=1)
>>> model = StockLM(nnx.Rngs(0))
>>> generate(model, [[1, 2, 3]], GenerationConfig(max_new_tokens=5)).shape
(1, 8)
>>> mesh = AbstractMesh((2, 4), ("data", "model"))
>>> report = explain_cache(model, mesh, ns.strategies.get("tp").rules, batch=8, length=16)
>>> [(r.path, r.spec) for r in report.rows if r.path.endswith("cached_key")]
[('attn/cached_key', P('data', None, 'model', None))]
"""

from nnx_shard.inference._cache_layout import explain_cache, generation_rules
from nnx_shard.inference._config import GenerationConfig
from nnx_shard.inference._generation import CACHE_AXES, generate, stream
from nnx_shard.inference._text import generate_text, stream_text
from nnx_shard.inference._tokenizer import Tokenizer

__all__ = ["CACHE_AXES", "GenerationConfig", "Tokenizer", "explain_cache", "generate",
           "generate_text", "generation_rules", "stream", "stream_text"]
