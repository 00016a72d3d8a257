"""Loading a Hugging Face checkpoint straight into a sharded model."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnx_shard import _safetensors_io as st
from nnx_shard._annotate import path_str
from nnx_shard._errors import UsageError, short
from nnx_shard._init import rewrap
from nnx_shard.hf import _fused as fused
from nnx_shard.hf._files import layouts, open_checkpoint, program
from nnx_shard.hf._mapping import Leaf, MappingValue, compile_rules, leaves_of, mapping_for, match

__all__ = ['load_opened', 'load_safetensors', 'separate_head']

HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
_CHUNK = 1 << 24


def separate_head(header: st.Header) -> bool:
    """Whether the checkpoint holds an output head ``lm_head.weight`` that is not a copy
    of its embedding. transformers (5) then keeps the two apart whatever
    ``tie_word_embeddings`` says (it ties them only when the file's values agree), so
    the model computes its logits with that head.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> untied = ns.hf.tiny_checkpoint(tempfile.mkdtemp(), tokenizer=False)
    >>> tied = ns.hf.tiny_checkpoint(tempfile.mkdtemp(), tokenizer=False, tie_embeddings=True)
    >>> with open_checkpoint(untied) as header:
    ...     separate_head(header)
    True
    >>> with open_checkpoint(tied) as header:
    ...     separate_head(header)
    False
    """
    head, embed = header.tensors.get(HEAD), header.tensors.get(EMBED)
    if head is None:
        return False
    if embed is None or (head.dtype, head.shape, head.nbytes) != (
            embed.dtype, embed.shape, embed.nbytes):
        return True
    for start in range(0, head.nbytes, _CHUNK):
        if st.read_bytes(header, HEAD, start, _CHUNK) != st.read_bytes(header, EMBED, start,
                                                                        _CHUNK):
            return True
    return False


def _read_leaf(header: st.Header, leaf: Leaf) -> jax.Array:
    shape, hf, model = layouts(leaf)
    file_dtype = header.tensors[next(iter(leaf.keys.values()))].dtype
    cache: dict[Any, np.ndarray] = {}

    def read(index: tuple[slice, ...] | None) -> np.ndarray:
        assert index is not None  # a sharded array's every device has an index
        # Devices holding the same slice (replicas) share one read.
        box = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        if box not in cache:
            if leaf.layers and leaf.depth == 2:
                # Experts under scanned layers: slice (layer, expert) is one tensor.
                (l0, l1), (e0, e1), rest = box[0], box[1], index[2:]
                cache[box] = np.stack([np.stack([
                    st.read_slice(header, leaf.keys[i * leaf.shape[1] + j], rest)
                    for j in range(e0, e1)]) for i in range(l0, l1)])
            elif leaf.layers:
                (l0, l1), rest = box[0], index[1:]
                cache[box] = np.stack([st.read_slice(header, leaf.keys[i], rest)
                                       for i in range(l0, l1)])
            else:
                cache[box] = st.read_slice(header, leaf.keys[None], index)
        return cache[box]

    x = jax.make_array_from_callback(shape, hf, read)
    cache.clear()
    if leaf.transform == "copy" and hf == model and st.DTYPES[file_dtype] == np.dtype(leaf.dtype):
        y = x
    else:
        y = program(leaf, "load", leaf.dtype)(x)
        del x
    if not isinstance(y, jax.core.Tracer):  # traced (nnx.eval_shape, jit): nothing to wait for
        y.block_until_ready()  # the Hugging Face-layout copy is freed before the next read
    return rewrap(y, leaf.sharding)


def _check_config(path: str | os.PathLike[str], target: Any, header: st.Header,
                  mapping: Any, config: Mapping[str, Any] | None, separate: bool | None
                  ) -> None:
    """Refuses a built-in model whose configuration differs from the checkpoint's
    ``config.json`` (beside the weights): tensors of the same shapes can belong to
    another family (a Gemma checkpoint fills a Llama of its sizes tensor for
    tensor) and would load into silently wrong logits. A separate ``lm_head.weight``
    unties the embeddings, as in transformers. ``config`` and ``separate``, where
    given, are the file as already read and :func:`separate_head` as already found."""
    from nnx_shard._trusted_files import folder_roots
    from nnx_shard.models._decoder import Decoder
    from nnx_shard.models._decoder_config import differences
    from nnx_shard.models._hf_config import read_json

    if not isinstance(target, Decoder):
        return
    untied = separate_head(header) if separate is None else separate
    if untied and target.cfg.tie_embeddings and mapping is None:
        raise UsageError(
            f"load_safetensors: the checkpoint {os.fspath(path)} holds {HEAD} apart from "
            f"its embedding (other values), which transformers computes the logits with "
            "(whatever tie_word_embeddings says); the target ties its output head to the "
            "embedding and has no place for it. Fix: build the target untied, "
            "dataclasses.replace(cfg, tie_embeddings=False), or load it with "
            "nnx_shard.hf.load_pretrained(path, mesh=..., rules=...), which does.")
    folder = os.fspath(path)
    folder = folder if os.path.isdir(folder) else os.path.dirname(folder)
    config_file = os.path.join(folder, "config.json")
    if config is not None:
        hf = dict(config)  # a copy: the caller's dict is what its export writes
    elif os.path.isfile(config_file):
        hf, _ = read_json(config_file, roots=folder_roots(folder))
    else:
        return
    if untied:
        hf["tie_word_embeddings"] = False
    found = differences(hf, target.cfg)
    if found:
        raise UsageError(
            f"load_safetensors: the checkpoint's {config_file} describes another model than "
            f"the target; {len(found)} field{'s differ' if len(found) > 1 else ' differs'}:\n"
            + "\n".join(f"- {d}" for d in found)
            + "\nFix: build the target from the checkpoint's config "
            "(DecoderConfig.from_hf(path)), or load it with "
            "nnx_shard.hf.load_pretrained(path, mesh=..., rules=...).")


def load_safetensors(path: str | os.PathLike[str], target: Any,
                     mapping: Mapping[str, MappingValue] | None = None) -> Any:
    """A concrete model with ``target``'s structure, every parameter read from the
    Hugging Face checkpoint at ``path`` straight into the sharding ``target``
    gives it.

    Args:
      path: a directory with ``model.safetensors`` or a sharded
        ``model.safetensors.index.json`` (what ``save_pretrained`` writes), or
        one ``.safetensors`` file. With both, ``model.safetensors`` is read, as
        transformers reads it.
      target: the model to fill, abstract (:func:`nnx_shard.abstract_init`:
        nothing allocated) or concrete and sharded; every variable must carry a
        ``NamedSharding``. Its dtypes decide the loaded dtypes (a bfloat16 file
        loads into float32 parameters, and back).
      mapping: regular expression on the Hugging Face name (full match) ->
        ``"model/path"`` (``\\1``... substitute groups), ``("model/path",
        transform)`` (one of :data:`TRANSFORMS`), or ``None`` to skip the
        tensor; the first matching pattern wins. A path with a layer index
        (``blocks/3/attn/q``) also fills layer 3 of a stacked ``blocks/attn/q``.
        Default: :func:`mapping_for` (built in for
        :class:`~nnx_shard.models.Decoder`).

    When the checkpoint has a ``config.json`` (beside the weights) and ``target``
    is a built-in :class:`~nnx_shard.models.Decoder`, the two configurations must
    agree on everything that decides the logits (model type, activation, norm,
    sizes, biases, rotary and window settings): same-shaped tensors of another
    family would load into wrong logits without a single shape error.

    A checkpoint holding an ``lm_head.weight`` other than its embedding is untied,
    whatever ``tie_word_embeddings`` says (transformers computes the logits with
    that head): a built-in target must then be untied too.

    Raises:
      UsageError: the checkpoint's ``config.json`` and the target's configuration
        differ: one error listing each differing field; or the checkpoint holds a
        separate ``lm_head.weight`` and the target ties its head to the embedding.
      UsageError: one error listing every problem: tensors the mapping does not
        place (unused), parameters no tensor fills (missing), shapes and dtypes
        that do not fit; each names the Hugging Face key, the model path, both
        shapes and the fix.
      UsageError: (a ValueError of :class:`~nnx_shard.NnxShardError`'s family) a file
        that is not what its format requires, named with the fix: a safetensors
        header whose entries do not describe its bytes exactly (unknown dtype, offsets
        out of range, overlapping or leaving gaps, a span that is not the shape's
        size), an index that is not a JSON ``weight_map`` of file names or names a
        file outside the checkpoint folder; or a ``mapping`` value of none of the
        forms above.
      CheckpointNotFound: (a FileNotFoundError of the same family) no checkpoint at
        ``path``, or files its index lists are absent.

    >>> import dataclasses
    >>> import tempfile
    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> from nnx_shard.hf import load_safetensors
    >>> from nnx_shard.models import Decoder, DecoderConfig
    >>> ckpt = ns.hf.tiny_checkpoint(tempfile.mkdtemp(), "qwen3", tokenizer=False)
    >>> cfg = DecoderConfig.from_hf(ckpt)
    >>> fsdp_tp = ns.strategies.get("fsdp_tp")
    >>> target = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), fsdp_tp.make_mesh(),
    ...                           fsdp_tp)
    >>> model = load_safetensors(ckpt, target)
    >>> model.blocks[1].mlp.up.get_value().sharding.spec
    P('data', 'model')
    >>> wrong = dataclasses.replace(cfg, kv_heads=4)   # not the checkpoint's sizes
    >>> dp = ns.strategies.get("dp")
    >>> load_safetensors(ckpt, ns.abstract_init(
    ...     lambda: Decoder(wrong, rngs=nnx.Rngs(0)), dp.make_mesh(), dp))
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: load_safetensors: the checkpoint's .../config.json describes another model than the target; 1 field differs:
    - num_key_value_heads: checkpoint 2, model 4
    Fix: ...
    """
    if not nnx.graph.is_graph_node(target):
        raise UsageError(f"load_safetensors: target must be an nnx.Module (abstract or concrete) "
                         f"giving the structure and shardings, got {type(target).__name__} "
                         f"{short(target, 60)}. Fix: e.g. ns.abstract_init(lambda: Decoder(cfg, "
                         "rngs=nnx.Rngs(0)), mesh, rules)")
    with open_checkpoint(path) as raw:
        return load_opened(path, raw, target, mapping)


def load_opened(path: str | os.PathLike[str], raw: st.Header, target: Any,
                mapping: Mapping[str, MappingValue] | None = None, *,
                config: Mapping[str, Any] | None = None, separate: bool | None = None) -> Any:
    """:func:`load_safetensors` of the checkpoint at ``path`` whose header ``raw``
    :func:`~nnx_shard.hf._files.open_checkpoint` opened (every tensor is read from the
    files it holds open). ``config`` is the checkpoint's ``config.json`` where the
    caller has already read it, and ``separate`` :func:`separate_head` of ``raw`` where
    it has already found it (:func:`~nnx_shard.hf.load_pretrained` has both): neither
    file nor head is then read again; without them they are read here.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, DecoderConfig
    >>> ckpt = ns.hf.tiny_checkpoint(tempfile.mkdtemp(), tokenizer=False)
    >>> dp = ns.strategies.get("dp")
    >>> target = ns.abstract_init(lambda: Decoder(DecoderConfig.from_hf(ckpt), rngs=nnx.Rngs(0)),
    ...                           dp.make_mesh(), dp)
    >>> with open_checkpoint(ckpt) as header:
    ...     model = load_opened(ckpt, header, target)
    >>> model.final_norm.scale.get_value().shape
    (32,)
    """
    _check_config(path, target, raw, mapping, config, separate)
    # Phi-3's fused tensors are read as their parts (views of their bytes).
    header = fused.split(raw, fused.fusions_for(target), os.fspath(path))
    rules = compile_rules(mapping_for(target) if mapping is None else mapping)
    graphdef, state = nnx.split(target)
    leaves = leaves_of(state, "load_safetensors")
    match(header, leaves, rules, os.fspath(path))
    values = {p: _read_leaf(header, leaf) for p, leaf in leaves.items()}
    flat = [(k, v.replace(values[path_str(k)]) if isinstance(v, nnx.Variable)
             else values[path_str(k)]) for k, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
