"""The key/value cache of the reference models, laid out by logical names.

Each attention layer keeps its keys and values in ``nnx.Cache`` variables of
shape ``[batch, kv_heads, length, head_dim]`` (with a leading ``layers`` axis
when the blocks are stacked) named :data:`HEADS_FIRST` (the names of
:data:`CACHE_AXES`, heads before positions), so the rules that lay
out training lay out the cache too (``cache_batch`` over the data axis,
``cache_kv_heads`` over the model axis, ``cache_length`` over a context axis;
see :mod:`nnx_shard.strategies`). :func:`write` stores new keys or values at a
traced position and :func:`attend` runs causal attention of new queries
against the whole cache. Both only read and write each device's own slice of
the cache, whatever axes it is split over: nothing gathers the cache.

Heads before positions because that is how the attention products read the
cache: each (row, head) pair's ``[length, head_dim]`` is a contiguous matrix, the
batch dimensions of both dot products lead, and a decode step touches the whole
cache only in those two products (stored ``[batch, length, kv_heads, head_dim]``,
XLA transposed every layer's keys and values at every step). A decode step of one
token attends to the cache as it was plus the new entry and writes the entry last
(:func:`store_and_attend`), so the cache is updated in place even where a device's slice
has a single row (reading the written cache, XLA's CPU backend copied it twice a step
there).

>>> cache = new((2, 1, 8, 4), jnp.float32)
>>> cache.get_metadata("out_sharding")
('cache_batch', 'cache_kv_heads', 'cache_length', 'cache_head_dim')
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from nnx_shard._attention._blocks import Masks
from nnx_shard._attention._kernels import BLOCK, KERNELS, attention_local, resolve
from nnx_shard._axes import entry_axes
from nnx_shard._errors import UsageError
from nnx_shard._mesh import constrain, current
from nnx_shard.models._masks import prepare

__all__ = ["CACHE_AXES", "HEADS_FIRST", "Rows", "attend", "decode_layers", "init_layers", "new",
           "valid_keys", "write"]

#: Logical names of a cache array's dimensions ``[batch, length, kv_heads, head_dim]``
#: (the public names, in the order of a cache such as ``nnx.MultiHeadAttention``'s).
CACHE_AXES: tuple[str, str, str, str] = ("cache_batch", "cache_length", "cache_kv_heads",
                                         "cache_head_dim")
#: The same names in the order the reference models store their caches: ``[batch,
#: kv_heads, length, head_dim]``.
HEADS_FIRST: tuple[str, str, str, str] = ("cache_batch", "cache_kv_heads", "cache_length",
                                          "cache_head_dim")
#: Logical name of the leading axis of the caches of stacked (scanned) blocks.
LAYERS = "layers"


def names(stacked: bool = False) -> tuple[str, ...]:
    """The logical names of a cache array (``layers`` first when stacked).

    >>> names(stacked=True)[0]
    'layers'
    """
    return (LAYERS, *HEADS_FIRST) if stacked else HEADS_FIRST


def new(shape: tuple[int, ...], dtype: Any, layers: int | None = None) -> nnx.Cache:
    """A zero cache ``[batch, kv_heads, length, head_dim]`` (``[layers, ...]``
    with ``layers``), annotated with :data:`HEADS_FIRST`. Its layout is the
    caller's: :func:`nnx_shard.inference.generate` constrains every cache array
    by its names the moment it is created, inside the compiled prefill, so no
    device ever holds more than its slice.

    >>> new((2, 1, 8, 4), jnp.bfloat16, layers=3).shape
    (3, 2, 1, 8, 4)
    """
    full = shape if layers is None else (layers, *shape)
    logical = names(layers is not None)
    return nnx.Cache(jnp.zeros(full, dtype), out_sharding=logical, eager_sharding=False)


def _spec(names: tuple[Any, ...], shape: tuple[int, ...]) -> Any:
    """The active rules' spec for an array of ``shape`` named ``names`` (``None``
    outside :func:`nnx_shard.use`)."""
    active = current()
    if active is None:
        return None
    mesh, rules = active
    return rules.spec(names, shape=shape, mesh=mesh, path="cache")


def _explicit() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and any(t == AxisType.Explicit for t in mesh.axis_types)


def write(cache: jax.Array, new_entries: jax.Array, index: jax.Array) -> jax.Array:
    """``cache [batch, kv_heads, length, head_dim]`` with ``new_entries [batch, T,
    kv_heads, head_dim]`` (the projections' layout) stored at positions ``index ..
    index + T - 1``.

    A dynamic-update-slice writes the T positions in place (only the new entries
    are transposed into the cache's layout). Where the rules split
    the length dimension (a context axis), XLA would gather the cache to
    update it at a traced position, so each device instead selects, position by
    position, between its slice and the new entries: local, at the price of
    rewriting the slice.

    >>> c = write(jnp.zeros((1, 1, 4, 1)), jnp.ones((1, 2, 1, 1)), jnp.int32(1))
    >>> c[0, 0, :, 0].tolist()
    [0.0, 1.0, 1.0, 0.0]
    """
    new_entries = new_entries.astype(cache.dtype).swapaxes(1, 2)  # [batch, kv_heads, T, dim]
    spec = _spec(HEADS_FIRST, cache.shape)
    explicit = spec is not None and _explicit()
    if explicit:  # the new entries laid out as the cache (the same heads over the same axes)
        new_entries = jax.sharding.reshard(new_entries, P(spec[0], spec[1], None, spec[3]))
    if spec is not None and spec[2] is not None:
        length, steps = cache.shape[2], new_entries.shape[2]
        offset = jnp.arange(length) - index
        inside = (offset >= 0) & (offset < steps)
        if steps == 1:
            spread = new_entries  # broadcast along the length
        elif explicit:
            spread = new_entries.at[:, :, jnp.clip(offset, 0, steps - 1)].get(out_sharding=spec)
        else:
            spread = jnp.take(new_entries, jnp.clip(offset, 0, steps - 1), axis=2)
        out = jnp.where(inside[None, None, :, None], spread, cache)
    else:
        out = jax.lax.dynamic_update_slice(cache, new_entries, (0, 0, index, 0))
    return constrain(out, HEADS_FIRST)


def valid_keys(attention_mask: jax.Array | None, index: jax.Array, length: int,
               before: jax.Array | None = None) -> jax.Array | None:
    """Which of a cache's ``length`` positions hold real keys after new tokens with
    ``attention_mask [batch, T]`` (0: padding) are stored at ``index ..``: the
    positions before ``index`` are taken as real (as ``before [batch, length]``
    says where given: what :class:`Rows` remembers), the new ones as the mask says
    (``None`` without a mask: every key is real). Laid out as the cache's
    ``[cache_batch, cache_length]`` dimensions.

    >>> valid_keys(jnp.array([[0, 1, 1]]), jnp.int32(2), 6).astype(int).tolist()
    [[1, 1, 0, 1, 1, 1]]
    """
    if attention_mask is None:
        return None
    batch = attention_mask.shape[0]
    base = jnp.ones((batch, length), bool) if before is None else before.astype(bool)
    mask = attention_mask.astype(bool)
    if before is not None and current() is not None and _explicit():
        # Sharding in types: the new flags split over the batch as the remembered ones.
        spec = _spec(CACHE_AXES[:2], (batch, length))
        mask = jax.sharding.reshard(mask, P(spec[0], None))
        base = jax.sharding.reshard(base, P(spec[0], spec[1]))
    valid = jax.lax.dynamic_update_slice(base, mask, (0, index))
    if current() is None:
        return valid
    if _explicit():
        return jax.sharding.reshard(valid, _spec(CACHE_AXES[:2], (batch, length)))
    return constrain(valid, CACHE_AXES[:2])


class Rows(nnx.Module):
    """What a cache remembers of each row's padding, so that every call after a
    masked one sees it: ``valid [batch, length]`` (which cache positions hold
    real keys, named ``cache_batch``, ``cache_length``) and ``next_position
    [batch]`` (the position the row's next real token takes: the real tokens
    seen so far, named ``cache_batch``).

    A left-padded prompt run with its mask, then one token at a time with a mask
    of ones, attends and embeds as each row alone does.

    >>> rows = Rows(2, 6)
    >>> pos, valid = rows.advance(jnp.array([[0, 1, 1], [1, 1, 1]]), jnp.int32(0))
    >>> pos.tolist(), rows.next_position[...].tolist()
    ([[0, 0, 1], [0, 1, 2]], [2, 3])
    >>> pos, valid = rows.advance(jnp.ones((2, 1), jnp.int32), jnp.int32(3))
    >>> pos.tolist(), valid.astype(int).tolist()
    ([[2], [3]], [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    """

    def __init__(self, batch: int, length: int) -> None:
        self.valid = nnx.Cache(jnp.ones((batch, length), bool), out_sharding=CACHE_AXES[:2],
                               eager_sharding=False)
        self.next_position = nnx.Cache(jnp.zeros((batch,), jnp.int32),
                                       out_sharding=CACHE_AXES[:1], eager_sharding=False)

    def advance(self, attention_mask: jax.Array, index: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
        """The positions ``[batch, T]`` of new tokens with ``attention_mask [batch,
        T]`` (0: padding) stored at ``index ..`` (padding takes its row's next
        position, clipped as transformers' ``cumsum(mask) - 1`` is), and the cache's
        ``valid [batch, length]`` after them; both remembered."""
        mask = attention_mask.astype(jnp.int32)
        start = self.next_position[...]
        if current() is not None and _explicit():  # both split over the batch alike
            spec = _spec(CACHE_AXES[:2], self.valid.shape)
            mask = jax.sharding.reshard(mask, P(spec[0], None))
            start = jax.sharding.reshard(start, P(spec[0]))
        positions = start[:, None] + jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        valid = valid_keys(mask, index, self.valid.shape[1], self.valid[...])
        assert valid is not None
        self.valid[...] = valid
        self.next_position[...] = start + mask.sum(axis=1)
        return positions, valid


def attend(q: jax.Array, keys: jax.Array, values: jax.Array, index: jax.Array,
           valid: jax.Array | None = None, *, window: Any = None,
           softcap: float | None = None, kernel: str = "auto", block: int = BLOCK
           ) -> jax.Array:
    """Causal attention of queries ``q [batch, T, heads, head_dim]`` at positions
    ``index .. index + T - 1`` against the cache ``keys``, ``values [batch,
    kv_heads, length, head_dim]`` (grouped-query: query head ``h`` reads
    key/value head ``h // (heads / kv_heads)``).

    A prefill (``T > 1``) runs the model's attention ``kernel`` (``"auto"``,
    ``"blockwise"``, ``"cudnn"``, ``"dense"``; see :mod:`nnx_shard._attention._kernels`),
    as training does: the memory-efficient ones keep a few ``[block, block]`` tiles of
    scores, never ``[T, length]``, so a prefill's memory grows linearly with the
    prompt (``"auto"`` is the blockwise kernel here: its queries sit after ``index``
    and the cache is longer than the prompt, which cuDNN's causal mask does not
    express). One token at a time (``T == 1``), ``kernel="dense"``, or a cache whose
    positions are split over a context axis attend in one step, in the operation
    order of the dense attention (:func:`nnx_shard.models.attention`): float32
    scores ``[T, length]``, masked softmax, the probabilities cast back to the
    queries' dtype. Both of its products take the cache as it is stored (batch and
    heads leading, each head's positions a contiguous matrix): a decode step reads
    the cache in them and nowhere else.

    Positions of the cache after a query's own are masked, so entries not yet
    written never contribute; so are positions where ``valid [batch, length]``
    (:func:`valid_keys`, e.g. the padding of a left-padded prompt) is ``False``,
    and, with a sliding ``window`` (an int, or traced: a scanned layer's own), those
    ``window`` or more before the query's own. ``softcap`` soft-caps the scaled
    scores as :func:`nnx_shard._attention` does.
    The key/value heads are never repeated: each
    group of query heads reads its cache head where it lies. Under a length
    split over a context axis, each device scores its positions and the
    softmax's sums and the output are reduced over that axis (small
    all-reduces of ``[batch, heads, T]`` values), never the cache gathered.

    >>> q = jnp.ones((1, 1, 2, 4))
    >>> attend(q, jnp.ones((1, 1, 8, 4)), jnp.ones((1, 1, 8, 4)), jnp.int32(3)).shape
    (1, 1, 2, 4)
    >>> q = jax.random.normal(jax.random.key(0), (1, 6, 2, 4))
    >>> kv = jax.random.normal(jax.random.key(1), (1, 1, 8, 4))
    >>> fast = attend(q, kv, kv, jnp.int32(2), window=3, block=4)   # blockwise prefill
    >>> slow = attend(q, kv, kv, jnp.int32(2), window=3, kernel="dense")
    >>> bool(jnp.allclose(fast, slow, atol=1e-6))
    True
    """
    if kernel not in KERNELS:
        raise UsageError(
            f"attend: kernel={kernel!r} is not one of {KERNELS}. Fix: pass one of them "
            "(the model's attention kernel, e.g. DecoderConfig(attention=...)).")
    if q.shape[1] > 1 and kernel != "dense":
        out = _prefill(q, keys, values, index, valid, window, softcap, kernel, block)
        if out is not None:
            return out
    batch, steps, heads, dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    spec = _spec(HEADS_FIRST, keys.shape) if _explicit() else None
    score_spec = out_spec = None
    if spec is not None:
        # Sharding in types: spell out each layout. The query heads take the
        # cache heads' axis (head h sits with key/value head h // group).
        b, g, pos = spec[0], spec[1], spec[2]
        q = jax.sharding.reshard(q, P(b, None, g, None))
        score_spec, out_spec = P(b, g, pos, None, None), P(b, g, None, None, None)
    # The cache is the first operand of the score product, so that its positions are
    # the scores' rows: [batch, kv_heads, length, group, T]. XLA's CPU backend then
    # reads each head's [length, head_dim] as stored (with the cache second, a single
    # query per head, e.g. batch 1 without grouping, is a matrix-vector product it runs
    # on the keys transposed, a copy of them each step); only the small queries and
    # scores move.
    grouped = q.reshape(batch, steps, kv_heads, group, dim).transpose(0, 2, 3, 1, 4)
    scores = jnp.einsum("bgld,bgrtd->bglrt", keys, grouped,
                        out_sharding=score_spec).astype(jnp.float32)
    scores = scores / math.sqrt(dim)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    at = (index + jnp.arange(steps))[None, :]
    positions = jnp.arange(length)[:, None]
    visible = positions <= at                                  # [length, T]
    if window is not None:
        visible = visible & (positions > at - window)
    visible = visible[:, None, :]                              # [length, group, T]
    if valid is not None:
        visible = visible & valid[:, None, :, None, None]
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=2).astype(q.dtype)
    out = jnp.einsum("bglrt,bgld->bgrtd", probs, values, out_sharding=out_spec)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, steps, heads, dim)


def _prefill(q: jax.Array, keys: jax.Array, values: jax.Array, index: jax.Array,
             valid: jax.Array | None, window: Any, softcap: float | None, kernel: str,
             block: int) -> jax.Array | None:
    """:func:`attend` of several queries with a memory-efficient kernel; ``None`` where
    ``kernel`` resolves to ``"dense"``, or the cache's positions are split over a
    context axis (each device then scores its own positions in the one-step path,
    which gathers nothing).

    Under a mesh the kernel runs in a ``jax.shard_map`` manual over the axes of the
    cache's batch and key/value heads: attention is per row and per head, so each
    device attends its own rows and heads to its own slice of the cache and nothing
    moves (the partitioner, left to itself, may gather the cache around the kernel's
    loops)."""
    masks = Masks(kv_valid=valid,
                  window=None if window is None else jnp.asarray(window, jnp.int32))
    batch, kv_heads, length, dim = keys.shape
    seq_first = jax.ShapeDtypeStruct((batch, length, kv_heads, dim), keys.dtype)
    resolved = resolve(kernel, q, seq_first, masks, context_parallel=False, softcap=softcap)
    if resolved == "dense":
        return None
    if resolved == "cudnn" and (masks.present or q.shape[1] != length):
        # cuDNN's causal mask puts query i at key i: right only for a prompt that fills
        # the cache from position 0 (index is traced, so the cache length must say so).
        resolved = "blockwise"

    def run(q: jax.Array, keys: jax.Array, values: jax.Array, index: jax.Array,
            valid: jax.Array | None, window: jax.Array | None) -> jax.Array:
        # The kernels take [batch, length, kv_heads, dim]: one transposed copy of each
        # device's slice per prefill, never per decode step.
        keys, values = keys.swapaxes(1, 2), values.swapaxes(1, 2)
        return attention_local(q, keys, values, Masks(kv_valid=valid, window=window),
                               causal=True, kernel=resolved, block=block, q_offset=index,
                               softcap=softcap)

    args = (q, keys, values, jnp.asarray(index, jnp.int32), masks.kv_valid, masks.window)
    active = current()
    spec = None if active is None else _spec(HEADS_FIRST, keys.shape)
    if active is None or spec is None:
        return run(*args)
    if spec[2] is not None:
        return None
    manual = {a for entry in (spec[0], spec[1]) for a in entry_axes(entry)}
    if not manual:
        return run(*args)
    b, g = spec[0], spec[1]
    qkv, cache = P(b, None, g, None), P(b, g, None, None)
    if _explicit():  # the query heads take the cache heads' axis, as in the one-step path
        args = (jax.sharding.reshard(q, qkv), *args[1:])
    valid_spec = None if valid is None else P(b if valid.shape[0] > 1 else None, None)
    in_specs = (qkv, cache, cache, P(), valid_spec, None if window is None else P())
    return jax.shard_map(run, mesh=active[0], in_specs=in_specs, out_specs=qkv,
                         axis_names=manual, check_vma=False)(*args)


def init_layers(blocks: Any, layers: int | None, batch: int, length: int) -> None:
    """Creates the cache of every block's ``attn``: one per block of an ``nnx.List``,
    or one cache with ``layers`` stacked in front for blocks stacked with
    ``nnx.vmap`` (the layout :func:`decode_layers` scans)."""
    if layers is None:
        for block in blocks:
            block.attn.init_cache(batch, length)
    else:
        blocks.attn.init_cache(batch, length, layers)


def decode_layers(blocks: Any, stacked: bool, x: jax.Array,
                  step: Callable[..., jax.Array], flags: Any = None) -> jax.Array:
    """``x`` through every block, ``step(block, x)`` each, caches updated in place:
    a Python loop over an ``nnx.List`` of blocks, or one ``jax.lax.scan`` over
    blocks stacked with ``nnx.vmap`` (the cache is stacked alike and scanned
    with the parameters; each layer's updated cache comes back as the scan's
    output). With ``flags`` (one per layer), ``step(block, x, flag)`` gets its layer's."""
    if not stacked:
        for i, block in enumerate(blocks):
            x = step(block, x) if flags is None else step(block, x, jnp.asarray(flags[i]))
        return x
    graphdef, cache, rest = nnx.split(blocks, nnx.Cache, ...)  # type: ignore[misc]

    def body(h: jax.Array, layer: Any) -> tuple[jax.Array, Any]:
        *parts, local = layer
        block = nnx.merge(graphdef, *parts)
        h = step(block, h) if flags is None else step(block, h, local)
        return h, nnx.state(block, nnx.Cache)

    x, updated = jax.lax.scan(body, x, (cache, rest, flags))
    nnx.update(blocks, updated)
    return x


# --------------------------------------------------------------------------- shared by the models
# Every family keeps its cache the same way; their attention differs only in how it
# computes q, k and v.


def init_attention(attn: Any, batch: int, length: int, layers: int | None = None) -> None:
    """Creates ``attn.cached_key`` and ``attn.cached_value [batch, kv_heads, length,
    head_dim]`` (``layers`` stacked in front for scanned blocks), sized from its key
    projection ``attn.k [embed, kv_heads, head_dim]``: grouped-query attention caches
    its ``kv_heads`` only, never the repeated ones.

    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, get_config
    >>> attn = Decoder(get_config("tiny"), rngs=nnx.Rngs(0)).blocks[0].attn
    >>> init_attention(attn, batch=2, length=16)
    >>> attn.cached_key.shape
    (2, 4, 16, 8)
    """
    kv_heads, head_dim = attn.k.shape[-2:]
    shape = (batch, kv_heads, length, head_dim)
    attn.cached_key = new(shape, attn.dtype, layers)
    attn.cached_value = new(shape, attn.dtype, layers)


def store_and_attend(attn: Any, q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array,
                     valid: jax.Array | None = None, **options: Any) -> jax.Array:
    """Stores ``k`` and ``v`` in ``attn``'s cache at positions ``index ..``, then
    :func:`attend` of ``q`` to the whole cache (``options``: its ``window``,
    ``softcap``, ``kernel``: ``attn.kernel`` by default, the kernel the model trains
    with).

    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, get_config
    >>> attn = Decoder(get_config("tiny"), rngs=nnx.Rngs(0)).blocks[0].attn
    >>> init_attention(attn, batch=1, length=4)
    >>> x = jnp.ones((1, 2, 4, 8))
    >>> store_and_attend(attn, x, x, x, jnp.asarray(0)).shape
    (1, 2, 4, 8)
    """
    keys, values = attn.cached_key[...], attn.cached_value[...]
    spec = _spec(HEADS_FIRST, keys.shape)
    if q.shape[1] == 1 and not _explicit() and (spec is None or spec[2] is None):
        # One new token: attend to the cache as it was plus the new entry, then write.
        # The products then read the cache the decode loop carries and the write is its
        # last use, so XLA updates it in place. Reading the written cache instead, XLA's
        # CPU backend fused the write into the products' operand where a dimension is 1
        # (batch 1) and copied every layer's cache twice a step. The new entries are
        # made to depend on the output (adding 0 times one of its elements: XLA does not
        # fold a float times 0) so that nothing can order the write before the reads.
        out = _attend_one(q, keys, values, k.astype(keys.dtype), v.astype(values.dtype),
                          index, valid, window=options.get("window"),
                          softcap=options.get("softcap"))
        after = 0 * out[0, 0, 0, 0].astype(k.dtype)
        attn.cached_key[...] = write(keys, k + after, index)
        attn.cached_value[...] = write(values, v + after, index)
        return out
    attn.cached_key[...] = write(keys, k, index)
    attn.cached_value[...] = write(values, v, index)
    # The model's attention kernel, as its training runs it (its ``kernel``, where set).
    options.setdefault("kernel", getattr(attn, "kernel", "auto"))
    return attend(q, attn.cached_key[...], attn.cached_value[...], index, valid, **options)


def _attend_one(q: jax.Array, keys: jax.Array, values: jax.Array, k_new: jax.Array,
                v_new: jax.Array, index: jax.Array, valid: jax.Array | None, *,
                window: Any, softcap: float | None) -> jax.Array:
    """:func:`attend` of one query per row at position ``index``, against the cache
    before it holds the new entry (its positions ``< index``) and the new entry
    ``k_new``, ``v_new [batch, 1, kv_heads, head_dim]``: the same scores, one softmax
    over both."""
    batch, _, heads, dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    grouped = q.reshape(batch, 1, kv_heads, heads // kv_heads, dim).transpose(0, 2, 3, 1, 4)
    old = jnp.einsum("bgld,bgrtd->bglrt", keys, grouped).astype(jnp.float32)
    own = jnp.einsum("bsgd,bgrtd->bgsrt", k_new, grouped).astype(jnp.float32)
    scores = jnp.concatenate([old, own], axis=2) / math.sqrt(dim)   # [b, g, length + 1, r, 1]
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    positions = jnp.arange(length)
    visible = positions < index
    if window is not None:
        visible = visible & (positions > index - window)
    visible = jnp.broadcast_to(visible, (batch, length))
    if valid is not None:
        visible = visible & valid
    visible = jnp.concatenate([visible, jnp.ones((batch, 1), bool)], axis=1)
    scores = jnp.where(visible[:, None, :, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=2).astype(q.dtype)
    out = (jnp.einsum("bglrt,bgld->bgrtd", probs[:, :, :length], values)
           + jnp.einsum("bgsrt,bsgd->bgrtd", probs[:, :, length:], v_new))
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, 1, heads, dim)


def init_model(blocks: Any, cfg: Any, batch: int, length: int) -> tuple[nnx.Cache, Rows]:
    """A model's empty cache: every block's attention (:func:`init_layers`, stacked
    when ``cfg.scan_layers``); returns the model's ``cache_index`` (the position of the
    next token) and ``cache_rows`` (which positions hold real tokens).

    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, get_config
    >>> model = Decoder(get_config("tiny"), rngs=nnx.Rngs(0))
    >>> index, rows = init_model(model.blocks, model.cfg, batch=2, length=16)
    >>> int(index[...]), model.blocks[0].attn.cached_value.shape
    (0, (2, 4, 16, 8))
    """
    init_layers(blocks, cfg.layers if cfg.scan_layers else None, batch, length)
    return nnx.Cache(jnp.zeros((), jnp.int32)), Rows(batch, length)


def masked_positions(model: Any, tokens: jax.Array, attention_mask: Any, index: jax.Array,
                     caller: str) -> tuple[jax.Array, jax.Array]:
    """For ``model.decode`` given ``attention_mask [batch, T]`` (checked as ``caller``):
    the positions of ``tokens`` (each row counting its real tokens only) and which
    cache positions hold real keys, with ``model.cache_rows`` advanced past them.

    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, get_config
    >>> model = Decoder(get_config("tiny"), rngs=nnx.Rngs(0))
    >>> model.init_cache(batch=1, length=4)
    >>> tokens, mask = jnp.ones((1, 3), jnp.int32), jnp.asarray([[0, 1, 1]])
    >>> positions, valid = masked_positions(model, tokens, mask, jnp.asarray(0), "decode")
    >>> positions.tolist()
    [[0, 0, 1]]
    """
    extras = prepare(tokens, attention_mask=attention_mask, positions=None,
                     segment_ids=None, caller=caller)
    assert extras.mask is not None
    return model.cache_rows.advance(extras.mask[:, 0, 0], index)
