"""Hugging Face safetensors checkpoints, loaded straight into a sharded layout and
saved back from any mesh.

:func:`load_safetensors` fills an abstract model (``ns.abstract_init`` /
``Strategy.abstract_init``: shapes and shardings, nothing allocated) from a
checkpoint directory, one model parameter at a time:

1. every Hugging Face tensor is matched to a parameter by a mapping table
   (:data:`LLAMA_MAPPING`: regular expressions on the Hugging Face name ->
   parameter path and transform, the style of :func:`nnx_shard.annotate`);
   every problem (missing, unused, mis-shaped or mis-typed tensors) is
   collected into one error;
2. the tensor is read in the Hugging Face layout with a sharding derived from
   the parameter's own (``jax.make_array_from_callback``): each process reads,
   with ranged reads (:mod:`nnx_shard.safetensors_io`), only the slices its
   devices hold; a parameter stacked over layers (``scan_layers``) is read as
   one ``[layers, ...]`` array whose layer dimension is split like the
   parameter's (pipeline stages read only their own layers);
3. one compiled call per parameter turns it into the model's layout
   (transpose to ``[in, out]``, split heads, cast dtype; vmapped over stacked
   layers) with the parameter's sharding as output sharding. The derived input
   sharding makes that call local: it contains no collective (the tests read
   its HLO), and the Hugging Face-layout copy is freed before the next
   parameter is read. A process thus holds its devices' shards of the model
   plus those of one parameter in flight (for a stacked parameter, all its
   layers). Calls with equal shapes and shardings reuse one compilation.

:func:`save_safetensors` runs the same transforms backwards, one parameter at a
time, and every process writes the shards it owns straight into their byte
ranges of the output files (the files are created, at their final size, by
process 0): nothing is gathered to one host. Processes must share the
filesystem.

Transforms (the second element of a mapping value): ``"copy"``,
``"transpose"`` (``[out, in] -> [in, out]``), ``"heads_out"`` (``[heads *
head_dim, embed] -> [embed, heads, head_dim]``: q/k/v), ``"heads_in"``
(``[embed, heads * head_dim] -> [heads, head_dim, embed]``: o) and
``"heads_bias"`` (``[heads * head_dim] -> [heads, head_dim]``).

>>> import tempfile
>>> from flax import nnx
>>> import nnx_shard as ns
>>> from nnx_shard.models import Llama, get_llama_config
>>> factory = lambda: Llama(get_llama_config("tiny"), rngs=nnx.Rngs(0))
>>> fsdp = ns.strategies.get("fsdp")
>>> model = fsdp.sharded_init(factory, "data=8")
>>> out = tempfile.mkdtemp()
>>> save_safetensors(out, model)
>>> loaded = load_safetensors(out, ns.strategies.get("tp").abstract_init(factory, "data=2,model=4"))
>>> loaded.blocks[0].attn.q.get_value().sharding.spec
P(None, 'model', None)
>>> bool((loaded.blocks[0].attn.q.get_value() == model.blocks[0].attn.q.get_value()).all())
True
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard import safetensors_io as st
from nnx_shard.annotate import path_str
from nnx_shard.errors import count, short
from nnx_shard.init import _auto_mesh, _rewrap

__all__ = ["LLAMA_MAPPING", "LLAMA_TIED_MAPPING", "TRANSFORMS", "load_safetensors",
           "mapping_for", "save_safetensors"]

MappingValue = str | tuple[str, str] | None

_L = r"model\.layers\.(\d+)\."
#: Hugging Face ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` names -> paths of
#: :class:`nnx_shard.models.Llama` (``blocks/<i>/...``: a model with
#: ``scan_layers`` takes layer ``i`` of its stacked ``blocks/...``).
LLAMA_MAPPING: dict[str, MappingValue] = {
    r"model\.embed_tokens\.weight": "token_embed",
    _L + r"input_layernorm\.weight": r"blocks/\1/attn_norm/scale",
    _L + r"self_attn\.(q|k|v)_proj\.weight": (r"blocks/\1/attn/\2", "heads_out"),
    _L + r"self_attn\.(q|k|v)_proj\.bias": (r"blocks/\1/attn/\2_bias", "heads_bias"),
    _L + r"self_attn\.(q|k)_norm\.weight": r"blocks/\1/attn/\2_norm/scale",
    _L + r"self_attn\.o_proj\.weight": (r"blocks/\1/attn/o", "heads_in"),
    _L + r"self_attn\.o_proj\.bias": r"blocks/\1/attn/o_bias",
    _L + r"post_attention_layernorm\.weight": r"blocks/\1/mlp_norm/scale",
    _L + r"mlp\.(gate|up|down)_proj\.weight": (r"blocks/\1/mlp/\2", "transpose"),
    _L + r"mlp\.(gate|up|down)_proj\.bias": r"blocks/\1/mlp/\2_bias",
    r"model\.norm\.weight": "final_norm/scale",
    r"lm_head\.weight": ("unembed", "transpose"),
}
#: :data:`LLAMA_MAPPING` for tied embeddings: a ``lm_head.weight`` in the file is
#: skipped, as transformers ties it to the embedding.
LLAMA_TIED_MAPPING: dict[str, MappingValue] = {**LLAMA_MAPPING, r"lm_head\.weight": None}


def _keep(heads: Any, inner: Any) -> Any:
    # [heads * head_dim] split like heads: whole heads per block, unless head_dim
    # itself is split (then read it whole; the transform slices locally).
    return heads if inner is None else None


class _Transform(NamedTuple):
    hf_shape: Callable[[tuple[int, ...]], tuple[int, ...]]  # model shape -> HF shape
    hf_spec: Callable[[tuple[Any, ...]], tuple[Any, ...]]  # model spec -> HF spec
    to_model: Callable[[jax.Array, tuple[int, ...]], jax.Array]
    to_hf: Callable[[jax.Array], jax.Array]


_TRANSFORMS: dict[str, _Transform] = {
    "copy": _Transform(lambda s: s, lambda p: p, lambda x, s: x, lambda y: y),
    "transpose": _Transform(lambda s: s[::-1], lambda p: p[::-1], lambda x, s: x.T,
                            lambda y: y.T),
    "heads_out": _Transform(
        lambda s: (s[1] * s[2], s[0]), lambda p: (_keep(p[1], p[2]), p[0]),
        lambda x, s: x.reshape(s[1], s[2], s[0]).transpose(2, 0, 1),
        lambda y: y.transpose(1, 2, 0).reshape(-1, y.shape[0])),
    "heads_in": _Transform(
        lambda s: (s[2], s[0] * s[1]), lambda p: (p[2], _keep(p[0], p[1])),
        lambda x, s: x.T.reshape(s), lambda y: y.reshape(-1, y.shape[2]).T),
    "heads_bias": _Transform(
        lambda s: (s[0] * s[1],), lambda p: (_keep(p[0], p[1]),),
        lambda x, s: x.reshape(s), lambda y: y.reshape(-1)),
}
#: The transforms a mapping value may name.
TRANSFORMS: tuple[str, ...] = tuple(_TRANSFORMS)


def mapping_for(model: Any) -> dict[str, MappingValue]:
    """The built-in mapping table of ``model`` (concrete or abstract):
    :data:`LLAMA_MAPPING`, or :data:`LLAMA_TIED_MAPPING` for a
    :class:`~nnx_shard.models.Llama` with tied embeddings.

    >>> from nnx_shard.models import Llama, get_llama_config
    >>> m = nnx.eval_shape(lambda: Llama(get_llama_config("tiny_qwen3"), rngs=nnx.Rngs(0)))
    >>> mapping_for(m) is LLAMA_TIED_MAPPING
    True
    >>> mapping_for(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    Traceback (most recent call last):
    ...
    ValueError: no built-in safetensors mapping for Linear (built in: nnx_shard.models.Llama). Fix: pass mapping={regex on the Hugging Face name: 'model/path' or ('model/path', transform)}, e.g. {r'dense\\.weight': ('kernel', 'transpose')}.
    """
    from nnx_shard.models.llama import Llama

    if isinstance(model, Llama):
        return LLAMA_TIED_MAPPING if model.cfg.tie_embeddings else LLAMA_MAPPING
    raise ValueError(
        f"no built-in safetensors mapping for {type(model).__name__} (built in: "
        "nnx_shard.models.Llama). Fix: pass mapping={regex on the Hugging Face name: "
        "'model/path' or ('model/path', transform)}, e.g. "
        "{r'dense\\.weight': ('kernel', 'transpose')}."
    )


# -- the mapping table --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Rule:
    pattern: str
    regex: re.Pattern[str]
    template: str | None  # None: skip the tensor
    transform: str

    def describe(self) -> str:
        return f"pattern r'{self.pattern}'"


def _rules(mapping: Mapping[str, MappingValue]) -> list[_Rule]:
    if not isinstance(mapping, Mapping):
        raise TypeError(f"mapping must be a dict of regex -> 'model/path', ('model/path', "
                        f"transform) or None, got {type(mapping).__name__}.")
    out = []
    for pattern, value in mapping.items():
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"mapping: pattern r'{pattern}' is not a regular expression: "
                             f"{e}") from None
        if value is None:
            out.append(_Rule(pattern, regex, None, "copy"))
            continue
        template, transform = (value, "copy") if isinstance(value, str) else tuple(value)
        if transform not in _TRANSFORMS:
            raise ValueError(f"mapping: pattern r'{pattern}' names transform {transform!r}; "
                             f"known: {', '.join(TRANSFORMS)}.")
        out.append(_Rule(pattern, regex, template, transform))
    return out


def _template_regex(template: str) -> re.Pattern[str]:
    """The model paths a template produces, its groups ``\\1``... as named groups."""
    out, seen, pos = [], set(), 0
    for m in re.finditer(r"\\(\d)|\\g<(\d+)>", template):
        out.append(re.escape(template[pos:m.start()]))
        g = m.group(1) or m.group(2)
        out.append(f"(?P=g{g})" if g in seen else f"(?P<g{g}>[^/]+)")
        seen.add(g)
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


def _render(pattern: str, groups: Mapping[int, str]) -> str | None:
    """The one string a literal pattern with capture groups matches, given the
    groups; ``None`` for patterns with other regex syntax (not invertible)."""
    out, i, group = [], 0, 0
    if pattern.startswith("^"):
        i = 1
    end = len(pattern) - 1 if pattern.endswith("$") and not pattern.endswith("\\$") else None
    text = pattern[:end]
    while i < len(text):
        c = text[i]
        if c == "\\":
            if i + 1 >= len(text) or text[i + 1].isalnum():
                return None
            out.append(text[i + 1])
            i += 2
        elif c == "(":
            if text[i + 1:i + 2] == "?":
                return None
            depth, j = 0, i
            while j < len(text):
                if text[j] == "\\":
                    j += 2
                    continue
                if text[j] == "(":
                    depth += 1
                elif text[j] == ")":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            group += 1
            if group not in groups:
                return None
            out.append(groups[group])
            group += text[i + 1:j].count("(") - text[i + 1:j].count("\\(")
            i = j + 1
        elif c in ".^$*+?{}[]|":
            return None
        else:
            out.append(c)
            i += 1
    return "".join(out)


# -- model parameters ------------------------------------------------------------------


@dataclasses.dataclass
class _Leaf:
    path: str
    shape: tuple[int, ...]
    dtype: Any
    sharding: NamedSharding
    names: tuple[Any, ...] | None
    layers: int | None = None  # stacked: the size of the leading layer axis
    transform: str | None = None
    rule: _Rule | None = None
    keys: dict[int | None, str] = dataclasses.field(default_factory=dict)

    @property
    def layer_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.layers else self.shape

    def spec(self) -> tuple[Any, ...]:
        spec = tuple(self.sharding.spec)
        return spec + (None,) * (len(self.shape) - len(spec))

    def describe(self) -> str:
        return f"model path {self.path!r} {list(self.shape)} {np.dtype(self.dtype).name}"


def _leaves(state: Any, caller: str) -> dict[str, _Leaf]:
    out = {}
    bad = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        sharding = getattr(value, "sharding", None)
        if isinstance(sharding, jax.sharding.SingleDeviceSharding) and isinstance(value,
                                                                                  jax.Array):
            # An unsharded model (e.g. built on one device): a mesh of its one device.
            device = next(iter(sharding.device_set))
            sharding = NamedSharding(jax.sharding.Mesh(np.array([device]), ("_",)),
                                     PartitionSpec())
        p = path_str(path)
        if not isinstance(sharding, NamedSharding):
            bad.append(p)
            continue
        names = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
        out[p] = _Leaf(p, tuple(value.shape), value.dtype, sharding,
                       tuple(names) if isinstance(names, tuple | list) else None)
    if bad:
        raise ValueError(
            f"{caller}: {len(bad)} variables carry no NamedSharding (e.g. {bad[0]!r}). Fix: "
            "build the target with ns.abstract_init(factory, mesh, rules) or "
            "strategy.abstract_init(factory, mesh) (shapes and shardings, nothing "
            "allocated)."
        )
    return out


def _resolve(path: str, leaves: Mapping[str, _Leaf]) -> tuple[_Leaf | None, int | None]:
    if path in leaves:
        return leaves[path], None
    parts = path.split("/")
    for i, part in enumerate(parts):
        if part.isdigit():
            leaf = leaves.get("/".join(parts[:i] + parts[i + 1:]))
            if leaf is not None and leaf.shape and int(part) < leaf.shape[0] and (
                    leaf.names is None or leaf.names[0] in ("layers", None)):
                return leaf, int(part)
    return None, None


def _hf_key(rules: Sequence[_Rule], leaf: _Leaf, layer: int | None
            ) -> tuple[str, _Rule] | None:
    """The Hugging Face name of ``leaf`` (layer ``layer`` of a stacked one)."""
    if layer is None:
        candidates = [leaf.path]
    else:
        parts = leaf.path.split("/")
        candidates = ["/".join([*parts[:i], str(layer), *parts[i:]])
                      for i in range(len(parts) + 1)]
    for rule in rules:
        if rule.template is None:
            continue
        model_re = _template_regex(rule.template)
        for cand in candidates:
            m = model_re.fullmatch(cand)
            if m is None:
                continue
            groups = {int(k[1:]): v for k, v in m.groupdict().items()}
            key = _render(rule.pattern, groups)
            if key is None:
                continue
            back = rule.regex.fullmatch(key)
            if back is not None and back.expand(rule.template) == cand:
                return key, rule
    return None


def _natural(key: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def _is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


_FIX_CONFIG = ("Fix: build the model from the checkpoint's own config.json "
               "(LlamaConfig.from_hf(path)), or correct the mapping")


def _match(header: st.Header, leaves: dict[str, _Leaf], rules: Sequence[_Rule],
           where: str) -> None:
    """Assigns every tensor to its parameter; one ValueError listing every problem."""
    problems: list[str] = []
    tried: set[tuple[str, int | None]] = set()  # (path, layer) a tensor was reported for
    for key in sorted(header.tensors, key=_natural):
        info = header.tensors[key]
        file = f"HF key {key!r} {list(info.shape)} {info.dtype}"
        rule = next((r for r in rules if r.regex.fullmatch(key)), None)
        if rule is None:
            problems.append(
                f"unused: {file} matches no pattern of the mapping. Fix: map it, "
                f"mapping={{r'{re.escape(key)}': 'model/path'}}, or skip it with "
                f"{{r'{re.escape(key)}': None}}.")
            continue
        if rule.template is None:
            continue
        target = rule.regex.fullmatch(key).expand(rule.template)  # type: ignore[union-attr]
        leaf, layer = _resolve(target, leaves)
        if leaf is None:
            problems.append(
                f"unused: {file} maps ({rule.describe()}) to model path {target!r}, which the "
                f"model does not have. {_FIX_CONFIG}, or skip the tensor: "
                f"{{r'{re.escape(key)}': None}}.")
            continue
        tried.add((leaf.path, layer))
        t = _TRANSFORMS[rule.transform]
        want = tuple(t.hf_shape(leaf.shape[1:] if layer is not None else leaf.shape))
        mixed = (leaf.keys.get(None) if layer is not None else
                 next(iter(leaf.keys.values()), None) if leaf.layers is not None else None)
        if mixed is not None:
            problems.append(f"conflict: {file} and {mixed!r} both map to {leaf.describe()}, "
                            "one as a whole and one as a layer. Fix: make the patterns "
                            "disjoint.")
            continue
        if info.shape != want:
            problems.append(
                f"shape: {file} maps to {leaf.describe()}"
                + (f" (layer {layer})" if layer is not None else "")
                + f", which needs HF shape {list(want)} (transform {rule.transform!r}). "
                + _FIX_CONFIG + ".")
            continue
        if info.dtype not in st.DTYPES or (_is_float(leaf.dtype)
                                           and not _is_float(st.DTYPES[info.dtype])):
            problems.append(
                f"dtype: {file} maps to {leaf.describe()}: {info.dtype} does not load into "
                f"{np.dtype(leaf.dtype).name}. Fix: skip it ({{r'{re.escape(key)}': None}}) "
                "or map it to a parameter of a compatible dtype.")
            continue
        if layer in leaf.keys:
            problems.append(f"conflict: {file} and {leaf.keys[layer]!r} both map to "
                            f"{leaf.describe()}" + (f" layer {layer}" if layer is not None
                                                   else "") + ". Fix: make the patterns "
                            "disjoint.")
            continue
        first = next(iter(leaf.keys.values()), None)
        if first is not None and header.tensors[first].dtype != info.dtype:
            problems.append(f"dtype: {file} differs from {first!r} "
                            f"({header.tensors[first].dtype}), stacked into one parameter.")
            continue
        if layer is not None:
            leaf.layers = leaf.shape[0]
        leaf.transform, leaf.rule = rule.transform, rule
        leaf.keys[layer] = key
    for leaf in leaves.values():
        if leaf.layers is not None or any((leaf.path, i) in tried for i in range(
                leaf.shape[0] if leaf.shape else 0)):
            n = leaf.shape[0]
            missing = [i for i in range(n) if i not in leaf.keys and (leaf.path, i) not in tried]
            leaf.layers = n
        else:
            missing = [] if leaf.keys or (leaf.path, None) in tried else [None]
        if not missing:
            continue
        shown = ", ".join(str(i) for i in missing[:8]) + (" ..." if len(missing) > 8 else "")
        expected = _hf_key(rules, leaf, missing[0] if leaf.layers else None)
        hint = ""
        if expected is not None:
            key, rule = expected
            shape = _TRANSFORMS[rule.transform].hf_shape(leaf.layer_shape if leaf.layers
                                                         else leaf.shape)
            hint = f"; expected HF key {key!r} {list(shape)} ({rule.describe()})"
        problems.append(
            f"missing: {leaf.describe()}"
            + (f", layers {shown}" if leaf.layers else "")
            + f" has no tensor in the checkpoint{hint}. Fix: check that the checkpoint is "
            "complete (every file its index lists is there) and is the model's, or map the "
            "tensor that holds it.")
    if problems:
        head = (f"load_safetensors: {len(problems)} problem"
                f"{'s' if len(problems) > 1 else ''} between the checkpoint {where} and the "
                "model:\n")
        raise ValueError(head + "\n".join(f"- {p}" for p in problems))


# -- files -----------------------------------------------------------------------------------

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MARKER = ".nnx_shard_safetensors"


def _path(path: Any, who: str) -> Path:
    """``path`` as a Path: a str or os.PathLike (None, bytes or a number would fail
    inside pathlib with no word of which argument)."""
    if isinstance(path, bytes) or not isinstance(path, str | os.PathLike) or not str(path):
        raise TypeError(f"{who}: path must be a directory path (str or os.PathLike), got "
                        f"{type(path).__name__} {short(path, 60)}. Fix: e.g. "
                        f"{who}('checkpoints/llama', ...)")
    return Path(path)


def _files(path: str | os.PathLike[str]) -> list[str]:
    p = _path(path, "load_safetensors")
    if p.is_file() and p.suffix == ".safetensors":
        return [str(p)]
    if not p.is_dir():
        raise FileNotFoundError(f"load_safetensors: path {str(p)!r} is not a directory or a "
                                ".safetensors file. Fix: pass the checkpoint directory (with "
                                f"{SINGLE} or {INDEX}).")
    if (p / INDEX).is_file():
        with open(p / INDEX) as f:
            weight_map = json.load(f).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        absent = [n for n in names if not (p / n).is_file()]
        if absent:
            raise FileNotFoundError(f"load_safetensors: {p / INDEX} lists {len(absent)} files "
                                    f"that are not there: {', '.join(absent)}. Fix: download "
                                    "every shard of the checkpoint.")
        return [str(p / n) for n in names]
    if (p / SINGLE).is_file():
        return [str(p / SINGLE)]
    raise FileNotFoundError(f"load_safetensors: {p} holds neither {SINGLE} nor {INDEX}. Fix: "
                            "pass the directory save_pretrained (or save_safetensors) wrote.")


# -- compiled transforms ---------------------------------------------------------------------


def _layouts(leaf: _Leaf) -> tuple[tuple[int, ...], NamedSharding, NamedSharding]:
    """The Hugging Face-layout shape of ``leaf`` (``[layers, ...]`` when stacked) and
    its sharding, derived from the parameter's so that the transform is local,
    and the parameter's sharding, on the Auto view of the mesh."""
    t = _TRANSFORMS[leaf.transform or "copy"]
    spec = leaf.spec()
    if leaf.layers:
        shape = (leaf.layers, *t.hf_shape(leaf.layer_shape))
        hf = (spec[0], *t.hf_spec(spec[1:]))
    else:
        shape, hf = tuple(t.hf_shape(leaf.shape)), tuple(t.hf_spec(spec))
    mesh = _auto_mesh(leaf.sharding.mesh)
    return shape, NamedSharding(mesh, PartitionSpec(*hf)), NamedSharding(mesh,
                                                                         PartitionSpec(*spec))


_programs: dict[Any, Any] = {}


def _program(leaf: _Leaf, direction: str, dtype: Any) -> Any:
    """The jitted transform of ``leaf`` to the model layout (``direction="load"``,
    casting to the parameter's dtype) or back (``"save"``, casting to ``dtype``)."""
    _, hf, model = _layouts(leaf)
    t = _TRANSFORMS[leaf.transform or "copy"]
    layer_shape = leaf.layer_shape
    key = (direction, leaf.transform, leaf.layers is not None, layer_shape, np.dtype(dtype).name,
           hf, model)
    if key not in _programs:
        if len(_programs) > 256:  # a bound on what a long session keeps compiled
            _programs.clear()
        if direction == "load":
            def one(x: jax.Array) -> jax.Array:
                return t.to_model(x, layer_shape).astype(dtype)
            src, dst = hf, model
        else:
            def one(x: jax.Array) -> jax.Array:
                return t.to_hf(x).astype(dtype)
            src, dst = model, hf
        fn = jax.vmap(one) if leaf.layers else one
        _programs[key] = jax.jit(fn, in_shardings=src, out_shardings=dst)
    return _programs[key]


def _read_leaf(header: st.Header, leaf: _Leaf) -> jax.Array:
    shape, hf, model = _layouts(leaf)
    file_dtype = header.tensors[next(iter(leaf.keys.values()))].dtype
    cache: dict[Any, np.ndarray] = {}

    def read(index: tuple[slice, ...]) -> np.ndarray:
        # Devices holding the same slice (replicas) share one read.
        box = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        if box not in cache:
            if leaf.layers:
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
        y = _program(leaf, "load", leaf.dtype)(x)
        del x
    y.block_until_ready()  # the Hugging Face-layout copy is freed before the next read
    return _rewrap(y, leaf.sharding)


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# -- public ----------------------------------------------------------------------------------


def load_safetensors(path: str | os.PathLike[str], target: Any,
                     mapping: Mapping[str, MappingValue] | None = None) -> Any:
    """A concrete model with ``target``'s structure, every parameter read from the
    Hugging Face checkpoint at ``path`` straight into the sharding ``target``
    gives it.

    Args:
      path: a directory with ``model.safetensors`` or a sharded
        ``model.safetensors.index.json`` (what ``save_pretrained`` writes), or
        one ``.safetensors`` file.
      target: the model to fill, abstract (:func:`nnx_shard.abstract_init`,
        :meth:`Strategy.abstract_init <nnx_shard.strategies.Strategy.abstract_init>`:
        nothing allocated) or concrete and sharded; every variable must carry a
        ``NamedSharding``. Its dtypes decide the loaded dtypes (a bfloat16 file
        loads into float32 parameters, and back).
      mapping: regular expression on the Hugging Face name (full match) ->
        ``"model/path"`` (``\\1``... substitute groups), ``("model/path",
        transform)`` (one of :data:`TRANSFORMS`), or ``None`` to skip the
        tensor; the first matching pattern wins. A path with a layer index
        (``blocks/3/attn/q``) also fills layer 3 of a stacked ``blocks/attn/q``.
        Default: :func:`mapping_for` (built in for
        :class:`~nnx_shard.models.Llama`).

    Raises:
      ValueError: one error listing every problem: tensors the mapping does not
        place (unused), parameters no tensor fills (missing), shapes and dtypes
        that do not fit; each names the Hugging Face key, the model path, both
        shapes and the fix.
      FileNotFoundError: no checkpoint at ``path``, or files its index lists are absent.

    >>> import nnx_shard as ns
    >>> from nnx_shard.models import Llama, LlamaConfig
    >>> ckpt = "tests/fixtures/hf_qwen3"   # transformers' save_pretrained output
    >>> cfg = LlamaConfig.from_hf(ckpt)
    >>> target = ns.strategies.get("fsdp_tp").abstract_init(
    ...     lambda: Llama(cfg, rngs=nnx.Rngs(0)), "data=4,model=2")
    >>> model = load_safetensors(ckpt, target)
    >>> model.blocks[1].mlp.up.get_value().sharding.spec
    P('data', 'model')
    >>> wrong = dataclasses.replace(cfg, kv_heads=4)   # not the checkpoint's sizes
    >>> load_safetensors(ckpt, ns.strategies.get("dp").abstract_init(
    ...     lambda: Llama(wrong, rngs=nnx.Rngs(0)), "data=8"))
    Traceback (most recent call last):
    ...
    ValueError: load_safetensors: 4 problems between the checkpoint tests/fixtures/hf_qwen3 and the model:
    - shape: HF key 'model.layers.0.self_attn.k_proj.weight' [32, 32] F32 maps to model path 'blocks/0/attn/k' [32, 4, 16] float32, which needs HF shape [64, 32] (transform 'heads_out'). Fix: build the model from the checkpoint's own config.json (LlamaConfig.from_hf(path)), or correct the mapping.
    ...
    """
    if not nnx.graph.is_graph_node(target):
        raise TypeError(f"load_safetensors: target must be an nnx.Module (abstract or concrete) "
                        f"giving the structure and shardings, got {type(target).__name__} "
                        f"{short(target, 60)}. Fix: e.g. ns.abstract_init(lambda: Llama(cfg, "
                        "rngs=nnx.Rngs(0)), mesh, rules)")
    files = _files(path)
    header = st.read_header(*files)
    rules = _rules(mapping_for(target) if mapping is None else mapping)
    graphdef, state = nnx.split(target)
    leaves = _leaves(state, "load_safetensors")
    _match(header, leaves, rules, os.fspath(path))
    values = {p: _read_leaf(header, leaf) for p, leaf in leaves.items()}
    flat = [(k, v.replace(values[path_str(k)]) if isinstance(v, nnx.Variable)
             else values[path_str(k)]) for k, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _plan_save(state: Any, rules: Sequence[_Rule]) -> dict[str, _Leaf]:
    leaves = _leaves(state, "save_safetensors")
    problems = []
    for leaf in leaves.values():
        found = _hf_key(rules, leaf, None)
        if found is not None:
            leaf.keys[None], leaf.rule = found
        elif leaf.shape and (layered := _hf_key(rules, leaf, 0)) is not None:
            leaf.layers = leaf.shape[0]
            for i in range(leaf.layers):
                got = _hf_key(rules, leaf, i)
                if got is not None:
                    leaf.keys[i], leaf.rule = got
            leaf.rule = layered[1]
        if leaf.rule is None:
            problems.append(f"{leaf.describe()} has no Hugging Face name: no mapping "
                            "template produces its path (templates of patterns with regex "
                            "syntax beyond literal text and groups cannot be inverted). Fix: "
                            "add a literal pattern for it to the mapping.")
            continue
        leaf.transform = leaf.rule.transform
    if problems:
        raise ValueError(f"save_safetensors: {len(problems)} parameters cannot be named:\n"
                         + "\n".join(f"- {p}" for p in problems))
    return leaves


def _prepare_dir(out: Path, names: Sequence[str]) -> None:
    """Makes ``out`` ready for ``names``: files of an earlier save_safetensors (listed
    in its marker) are removed; anything else in the way is an error."""
    out.mkdir(parents=True, exist_ok=True)
    marker = out / _MARKER
    ours = set(json.loads(marker.read_text())["files"]) if marker.is_file() else set()
    present = {p.name for p in out.iterdir()}
    clash = sorted(((set(names) | {n for n in present if n.endswith(".safetensors")})
                    & present) - ours)
    if clash:
        raise FileExistsError(
            f"save_safetensors: {out} already holds {', '.join(clash)}, which save_safetensors "
            "did not write there. Fix: save to a new or empty directory (nothing is "
            "overwritten).")
    for name in sorted(ours & present):
        (out / name).unlink()
    marker.write_text(json.dumps({"files": sorted(names)}) + "\n")


def save_safetensors(path: str | os.PathLike[str], model: Any,
                     mapping: Mapping[str, MappingValue] | None = None, *,
                     max_shard_bytes: int | None = None, dtype: Any = None) -> None:
    """Writes ``model``'s parameters as a Hugging Face checkpoint in the directory
    ``path``: ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json`` with ``max_shard_bytes``), plus
    ``config.json`` for a :class:`~nnx_shard.models.Llama` (transformers'
    ``from_pretrained`` reads the directory).

    Works from any mesh and any number of processes: parameter by parameter,
    each device's shard is turned back into the Hugging Face layout on device
    and written by its own process into its byte ranges; no array is gathered.
    Every process must call it (processes must share the filesystem).
    :func:`load_safetensors` of the result is bitwise the saved model (for the
    same dtype). Files a previous ``save_safetensors`` wrote to ``path`` are
    replaced; any other file in the way is an error, never overwritten.

    Args:
      path: the output directory (created if needed).
      model: a concrete model with sharded (or single-device) arrays.
      mapping: as in :func:`load_safetensors`; each template must be invertible
        (literal text and groups). Default :func:`mapping_for`.
      max_shard_bytes: split the tensors over files of at most this many bytes
        (a tensor larger than that gets its own file).
      dtype: store every tensor in this dtype (e.g. ``jnp.bfloat16``); default:
        each parameter's own.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> from nnx_shard.models import Llama, get_llama_config
    >>> model = ns.strategies.get("fsdp_tp").sharded_init(
    ...     lambda: Llama(get_llama_config("tiny"), rngs=nnx.Rngs(0)), "data=4,model=2")
    >>> out = tempfile.mkdtemp()
    >>> save_safetensors(out, model, max_shard_bytes=40_000, dtype=jnp.bfloat16)
    >>> sorted(os.listdir(out))[:3]
    ['.nnx_shard_safetensors', 'config.json', 'model-00001-of-00002.safetensors']
    >>> json.load(open(os.path.join(out, "config.json")))["torch_dtype"]
    'bfloat16'
    """
    if _path(path, "save_safetensors").exists() and not Path(path).is_dir():
        raise FileExistsError(f"save_safetensors: path {str(path)!r} is a file, not a directory "
                              "(it is never written over). Fix: a directory path")
    if dtype is not None:
        try:
            st.dtype_name(dtype)
        except TypeError:
            raise TypeError(f"save_safetensors: dtype {short(dtype, 40)} is not a dtype. Fix: "
                            "e.g. dtype=jnp.bfloat16, or None to keep each parameter's") from None
    if not isinstance(model, nnx.Module):
        raise TypeError(f"save_safetensors: model must be an nnx.Module, got "
                        f"{type(model).__name__} {short(model, 60)}. Fix: the model to write")
    if max_shard_bytes is not None:
        count(max_shard_bytes, "save_safetensors: max_shard_bytes",
              fix="bytes per file, e.g. 5 * 10**9, or None for one file")
    rules = _rules(mapping_for(model) if mapping is None else mapping)
    leaves = _plan_save(nnx.state(model), rules)
    tensors: dict[str, tuple[str, tuple[int, ...], _Leaf]] = {}
    for leaf in leaves.values():
        t = _TRANSFORMS[leaf.transform or "copy"]
        shape = tuple(t.hf_shape(leaf.layer_shape))
        kind = st.dtype_name(leaf.dtype if dtype is None else dtype)
        for key in leaf.keys.values():
            tensors[key] = (kind, shape, leaf)
    order = sorted(tensors, key=_natural)
    groups: list[list[str]] = [[]]
    size = 0
    for key in order:
        kind, shape, _ = tensors[key]
        n = st.DTYPES[kind].itemsize * int(np.prod(shape))
        if max_shard_bytes is not None and groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    names = ([SINGLE] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    out = Path(path)
    cfg = getattr(model, "cfg", None)
    extra = ([INDEX] if len(groups) > 1 else []) + (["config.json"] if hasattr(cfg, "to_hf")
                                                     else [])
    if jax.process_index() == 0:
        _prepare_dir(out, names + extra)
        for name, group in zip(names, groups, strict=True):
            st.create(str(out / name), {k: tensors[k][:2] for k in group}, {"format": "pt"})
        if len(groups) > 1:
            total = sum(st.DTYPES[tensors[k][0]].itemsize * int(np.prod(tensors[k][1]))
                        for k in order)
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: n for n, g in zip(names, groups, strict=True) for k in g}}
            (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if hasattr(cfg, "to_hf"):
            config = cfg.to_hf()
            if dtype is not None:
                config["torch_dtype"] = np.dtype(dtype).name
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _barrier("nnx_shard.save_safetensors.create")
    header = st.read_header(*(str(out / n) for n in names))
    arrays = {path_str(k): v.get_value() if isinstance(v, nnx.Variable) else v
              for k, v in nnx.to_flat_state(nnx.state(model))}
    for leaf in leaves.values():
        # The Auto view of the parameter's mesh (the same buffers), as the program takes it.
        x = _rewrap(arrays.pop(leaf.path), _layouts(leaf)[2])
        y = _program(leaf, "save", leaf.dtype if dtype is None else dtype)(x)
        for shard in y.addressable_shards:
            if shard.replica_id != 0:
                continue
            data = np.asarray(shard.data)
            if leaf.layers:
                first = shard.index[0].indices(leaf.layers)[0]
                for i in range(data.shape[0]):
                    st.write_slice(header.tensors[leaf.keys[first + i]].path, header,
                                   leaf.keys[first + i], shard.index[1:], data[i])
            else:
                key = leaf.keys[None]
                st.write_slice(header.tensors[key].path, header, key, shard.index, data)
        del y
    _barrier("nnx_shard.save_safetensors.written")

