"""How Hugging Face tensor names map onto a model's parameters: the mapping
tables, the layout transforms, and the matching that collects every problem
into one error."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard import _safetensors_io as st
from nnx_shard._annotate import path_str
from nnx_shard._errors import ShardingError, UsageError, short
from nnx_shard.models._families import (
    LLAMA_MAPPING,
    LLAMA_TIED_MAPPING,
    MappingValue,
    family_of,
)

__all__ = ['LLAMA_MAPPING', 'LLAMA_TIED_MAPPING', 'TRANSFORMS', 'TRANSFORM_FNS', 'Leaf', 'MappingValue', 'Rule', 'compile_rules', 'hf_key', 'leaves_of', 'mapping_for', 'match', 'natural']


def _keep(heads: Any, inner: Any) -> Any:
    # [heads * head_dim] split like heads: whole heads per block, unless head_dim
    # itself is split (then read it whole; the transform slices locally).
    return heads if inner is None else None


class Transform(NamedTuple):
    hf_shape: Callable[[tuple[int, ...]], tuple[int, ...]]  # model shape -> HF shape
    hf_spec: Callable[[tuple[Any, ...]], tuple[Any, ...]]  # model spec -> HF spec
    to_model: Callable[[jax.Array, tuple[int, ...]], jax.Array]
    to_hf: Callable[[jax.Array], jax.Array]


TRANSFORM_FNS: dict[str, Transform] = {
    "copy": Transform(lambda s: s, lambda p: p, lambda x, s: x, lambda y: y),
    "transpose": Transform(lambda s: s[::-1], lambda p: p[::-1], lambda x, s: x.T,
                            lambda y: y.T),
    "heads_out": Transform(
        lambda s: (s[1] * s[2], s[0]), lambda p: (_keep(p[1], p[2]), p[0]),
        lambda x, s: x.reshape(s[1], s[2], s[0]).transpose(2, 0, 1),
        lambda y: y.transpose(1, 2, 0).reshape(-1, y.shape[0])),
    "heads_in": Transform(
        lambda s: (s[2], s[0] * s[1]), lambda p: (p[2], _keep(p[0], p[1])),
        lambda x, s: x.T.reshape(s), lambda y: y.reshape(-1, y.shape[2]).T),
    "heads_bias": Transform(
        lambda s: (s[0] * s[1],), lambda p: (_keep(p[0], p[1]),),
        lambda x, s: x.reshape(s), lambda y: y.reshape(-1)),
}
#: The transforms a mapping value may name.
TRANSFORMS: tuple[str, ...] = tuple(TRANSFORM_FNS)


def mapping_for(model: Any) -> dict[str, MappingValue]:
    """The built-in mapping table of ``model`` (concrete or abstract): for a
    :class:`~nnx_shard.models.Decoder`, its family's (by ``cfg.model_type``, e.g.
    :data:`LLAMA_MAPPING`), the tied one (e.g. :data:`LLAMA_TIED_MAPPING`) for tied
    embeddings.

    Args:
      model: a model, concrete or abstract.

    >>> from flax import nnx
    >>> from nnx_shard.hf import mapping_for
    >>> from nnx_shard.models import Decoder, get_config
    >>> m = nnx.eval_shape(lambda: Decoder(get_config("qwen3-tiny"), rngs=nnx.Rngs(0)))
    >>> None in mapping_for(m).values()     # tied: the file's lm_head.weight is skipped
    True
    >>> mapping_for(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: no built-in safetensors mapping for Linear (built in: nnx_shard.models.Decoder). Fix: pass mapping={regex on the Hugging Face name: 'model/path' or ('model/path', transform)}, e.g. {r'dense\\.weight': ('kernel', 'transpose')}.
    """
    from nnx_shard.models._decoder import Decoder

    if isinstance(model, Decoder) and model.cfg.family.architectures:  # a checkpoint family
        return family_of(model.cfg.model_type).table(model.cfg.tie_embeddings)
    raise UsageError(
        f"no built-in safetensors mapping for {type(model).__name__} (built in: "
        "nnx_shard.models.Decoder). Fix: pass mapping={regex on the Hugging Face name: "
        "'model/path' or ('model/path', transform)}, e.g. "
        "{r'dense\\.weight': ('kernel', 'transpose')}."
    )


# -- the mapping table --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str
    regex: re.Pattern[str]
    template: str | None  # None: skip the tensor
    transform: str

    def describe(self) -> str:
        return f"pattern r'{self.pattern}'"


_FORMS = ("Fix: give each pattern 'model/path', ('model/path', transform) with transform one "
          f"of {', '.join(TRANSFORMS)}, or None to skip the tensor, e.g. "
          "{r'dense\\.weight': ('kernel', 'transpose')}.")


def _form(value: Any) -> str:
    return f"{short(value, 80)} ({type(value).__name__})"


def compile_rules(mapping: Mapping[str, MappingValue]) -> list[Rule]:
    """The rules of a ``mapping=`` table, each value checked against the documented
    forms (a :class:`~nnx_shard._errors.UsageError` naming the pattern and what it
    maps to otherwise).

    >>> [(r.pattern, r.template, r.transform) for r in compile_rules({"w": ("kernel", "transpose")})]
    [('w', 'kernel', 'transpose')]
    >>> compile_rules({"w": ("kernel", "transpose", "again")})
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: mapping: pattern r'w' maps to a tuple of 3, ('kernel', 'transpose', 'again'); ...
    """
    if not isinstance(mapping, Mapping):
        raise UsageError(f"mapping must be a dict of regex -> 'model/path', ('model/path', "
                         f"transform) or None, got {_form(mapping)}. {_FORMS}")
    out = []
    for pattern, value in mapping.items():
        if not isinstance(pattern, str):
            raise UsageError(f"mapping: pattern {_form(pattern)} is not a string; patterns are "
                             f"regular expressions on the Hugging Face name. {_FORMS}")
        where = f"mapping: pattern r'{pattern if len(pattern) <= 200 else pattern[:197] + '...'}'"
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise UsageError(f"{where} is not a regular expression: {e}. Fix: escape its "
                             "special characters, e.g. r'model\\.norm\\.weight'.") from None
        if value is None:
            out.append(Rule(pattern, regex, None, "copy"))
            continue
        if isinstance(value, str):
            template, transform = value, "copy"
        elif isinstance(value, tuple | list) and len(value) == 2:
            template, transform = value
        elif isinstance(value, tuple | list):
            raise UsageError(f"{where} maps to a {type(value).__name__} of {len(value)}, "
                             f"{short(value, 120)}; a pair is ('model/path', transform). "
                             + _FORMS)
        else:
            raise UsageError(f"{where} maps to {st.described(value)}. {_FORMS}")
        if not isinstance(template, str):
            raise UsageError(f"{where} maps to model path {_form(template)}, not a string. "
                             + _FORMS)
        if not isinstance(transform, str) or transform not in TRANSFORM_FNS:
            raise UsageError(f"{where} names transform "
                             f"{repr(transform) if isinstance(transform, str) else _form(transform)}; known: "
                             f"{', '.join(TRANSFORMS)}. {_FORMS}")
        refs = [int(m.group(1) or m.group(2))
                for m in re.finditer(r"\\(\d+)|\\g<(\d+)>", template)]
        if any(r > regex.groups for r in refs):
            raise UsageError(f"{where} maps to {template!r}, which refers to group {max(refs)} "
                             f"but the pattern has {regex.groups}. Fix: capture the group in "
                             "the pattern, e.g. r'model\\.layers\\.(\\d+)\\.x' -> "
                             "'blocks/\\1/x'.")
        out.append(Rule(pattern, regex, template, transform))
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
class Leaf:
    path: str
    shape: tuple[int, ...]
    dtype: Any
    sharding: NamedSharding
    names: tuple[Any, ...] | None
    layers: int | None = None  # stacked: the slices along the leading stacked axes
    transform: str | None = None
    rule: Rule | None = None
    # The slice index (flat over the stacked axes, row-major) -> its tensor's name.
    keys: dict[int | None, str] = dataclasses.field(default_factory=dict)
    # Leading axes stacked from one tensor each: 1 (layers, or experts), 2 (experts of
    # scanned layers: ``[layers, expert, ...]``).
    depth: int = 1

    @property
    def layer_shape(self) -> tuple[int, ...]:
        return self.shape[self.depth:] if self.layers else self.shape

    def index(self, flat: int) -> int | tuple[int, int]:
        """The stacked index of slice ``flat``: an int, or ``(layer, expert)``."""
        return flat if self.depth == 1 else divmod(flat, self.shape[1])

    def spec(self) -> tuple[Any, ...]:
        spec = tuple(self.sharding.spec)
        return spec + (None,) * (len(self.shape) - len(spec))

    def describe(self) -> str:
        return f"model path {self.path!r} {list(self.shape)} {np.dtype(self.dtype).name}"


def leaves_of(state: Any, caller: str) -> dict[str, Leaf]:
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
        out[p] = Leaf(p, tuple(value.shape), value.dtype, sharding,
                       tuple(names) if isinstance(names, tuple | list) else None)
    if bad:
        raise ShardingError(
            f"{caller}: {len(bad)} variables carry no NamedSharding (e.g. {bad[0]!r}). Fix: "
            "build the target with ns.abstract_init(factory, mesh, rules) or "
            "ns.abstract_init(factory, mesh, strategy) (shapes and shardings, nothing "
            "allocated)."
        )
    return out


_STACKED = ("layers", "expert", None)


def _resolve(path: str, leaves: Mapping[str, Leaf]
             ) -> tuple[Leaf | None, int | tuple[int, int] | None]:
    if path in leaves:
        return leaves[path], None
    parts = path.split("/")
    digits = [i for i, part in enumerate(parts) if part.isdigit()]
    for i in digits:
        leaf = leaves.get("/".join(parts[:i] + parts[i + 1:]))
        if leaf is not None and leaf.shape and int(parts[i]) < leaf.shape[0] and (
                leaf.names is None or leaf.names[0] in _STACKED):
            return leaf, int(parts[i])
    # A layer's expert (``blocks/3/mlp/up/5``) in experts stacked under scanned layers.
    for a, i in enumerate(digits):
        for j in digits[a + 1:]:
            leaf = leaves.get("/".join(p for k, p in enumerate(parts) if k not in (i, j)))
            if leaf is not None and len(leaf.shape) > 2 and int(parts[i]) < leaf.shape[0] \
                    and int(parts[j]) < leaf.shape[1] and (
                        leaf.names is None or (leaf.names[0] in _STACKED
                        and leaf.names[1] in _STACKED)):
                return leaf, (int(parts[i]), int(parts[j]))
    return None, None


def hf_key(rules: Sequence[Rule], leaf: Leaf, layer: int | tuple[int, int] | None
            ) -> tuple[str, Rule] | None:
    """The Hugging Face name of ``leaf`` (layer ``layer`` of a stacked one; ``(layer,
    expert)`` of experts stacked under scanned layers)."""
    parts = leaf.path.split("/")
    n = len(parts) + 1
    if layer is None:
        candidates = [leaf.path]
    elif isinstance(layer, tuple):
        first, second = (str(x) for x in layer)
        candidates = ["/".join([*parts[:i], first, *parts[i:j], second, *parts[j:]])
                      for i in range(n) for j in range(i, n)]
    else:
        candidates = ["/".join([*parts[:i], str(layer), *parts[i:]]) for i in range(n)]
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


def natural(key: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def _is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


_FIX_CONFIG = ("Fix: build the model from the checkpoint's own config.json "
               "(DecoderConfig.from_hf(path)), or correct the mapping")


def _assign(header: st.Header, key: str, leaves: dict[str, Leaf], rules: Sequence[Rule],
            tried: set[tuple[str, int | None]]) -> str | None:
    """Assigns tensor ``key`` to its parameter (layer); the problem if it cannot be."""
    info = header.tensors[key]
    file = f"HF key {key!r} {list(info.shape)} {info.dtype}"
    rule = next((r for r in rules if r.regex.fullmatch(key)), None)
    if rule is None:
        return (f"unused: {file} matches no pattern of the mapping. Fix: map it, "
                f"mapping={{r'{re.escape(key)}': 'model/path'}}, or skip it with "
                f"{{r'{re.escape(key)}': None}}.")
    if rule.template is None:
        return None
    target = rule.regex.fullmatch(key).expand(rule.template)  # type: ignore[union-attr]
    leaf, at_index = _resolve(target, leaves)
    depth = 2 if isinstance(at_index, tuple) else 1
    if leaf is None:
        return (f"unused: {file} maps ({rule.describe()}) to model path {target!r}, which the "
                f"model does not have. {_FIX_CONFIG}, or skip the tensor: "
                f"{{r'{re.escape(key)}': None}}.")
    # One flat index over the stacked axes (row-major) keys the slice.
    layer = (at_index[0] * leaf.shape[1] + at_index[1] if isinstance(at_index, tuple)
             else at_index)
    tried.add((leaf.path, layer))
    want = tuple(TRANSFORM_FNS[rule.transform].hf_shape(
        leaf.shape[depth:] if layer is not None else leaf.shape))
    mixed = (leaf.keys.get(None) if layer is not None else
             next(iter(leaf.keys.values()), None) if leaf.layers is not None else None)
    first = next(iter(leaf.keys.values()), None)
    at = f" layer {at_index}" if layer is not None else ""
    if mixed is not None:
        return (f"conflict: {file} and {mixed!r} both map to {leaf.describe()}, one as a "
                "whole and one as a layer. Fix: make the patterns disjoint.")
    if info.shape != want:
        return (f"shape: {file} maps to {leaf.describe()}"
                + (f" (layer {at_index})" if layer is not None else "")
                + f", which needs HF shape {list(want)} (transform {rule.transform!r}). "
                + _FIX_CONFIG + ".")
    if info.dtype not in st.DTYPES or (_is_float(leaf.dtype)
                                       and not _is_float(st.DTYPES[info.dtype])):
        return (f"dtype: {file} maps to {leaf.describe()}: {info.dtype} does not load into "
                f"{np.dtype(leaf.dtype).name}. Fix: skip it ({{r'{re.escape(key)}': None}}) "
                "or map it to a parameter of a compatible dtype.")
    if layer in leaf.keys:
        return (f"conflict: {file} and {leaf.keys[layer]!r} both map to {leaf.describe()}"
                f"{at}. Fix: make the patterns disjoint.")
    if first is not None and header.tensors[first].dtype != info.dtype:
        return (f"dtype: {file} differs from {first!r} "
                f"({header.tensors[first].dtype}), stacked into one parameter.")
    if layer is not None:
        leaf.depth = depth
        leaf.layers = math.prod(leaf.shape[:depth])
    leaf.transform, leaf.rule = rule.transform, rule
    leaf.keys[layer] = key
    return None


def _missing(leaf: Leaf, rules: Sequence[Rule], tried: set[tuple[str, int | None]]
             ) -> str | None:
    """The problem if a parameter (or some of its layers) has no tensor."""
    missing: list[int | None]
    if leaf.layers is not None or any((leaf.path, i) in tried for i in range(
            leaf.shape[0] if leaf.shape else 0)):
        n = math.prod(leaf.shape[:leaf.depth])
        missing = [i for i in range(n) if i not in leaf.keys and (leaf.path, i) not in tried]
        leaf.layers = n
    else:
        missing = [] if leaf.keys or (leaf.path, None) in tried else [None]
    if not missing:
        return None
    shown = ", ".join(str(leaf.index(i)) for i in missing[:8] if i is not None) + (
        " ..." if len(missing) > 8 else "")
    expected = hf_key(rules, leaf, leaf.index(missing[0])  # type: ignore[arg-type]
                      if leaf.layers else None)
    hint = ""
    if expected is not None:
        key, rule = expected
        shape = TRANSFORM_FNS[rule.transform].hf_shape(leaf.layer_shape if leaf.layers
                                                       else leaf.shape)
        hint = f"; expected HF key {key!r} {list(shape)} ({rule.describe()})"
    return (f"missing: {leaf.describe()}"
            + (f", layers {shown}" if leaf.layers else "")
            + f" has no tensor in the checkpoint{hint}. Fix: check that the checkpoint is "
            "complete (every file its index lists is there) and is the model's, or map the "
            "tensor that holds it.")


def match(header: st.Header, leaves: dict[str, Leaf], rules: Sequence[Rule],
          where: str) -> None:
    """Assigns every tensor to its parameter; one UsageError listing every problem."""
    tried: set[tuple[str, int | None]] = set()  # (path, layer) a tensor was reported for
    problems = [p for key in sorted(header.tensors, key=natural)
                if (p := _assign(header, key, leaves, rules, tried)) is not None]
    problems += [p for leaf in leaves.values() if (p := _missing(leaf, rules, tried)) is not None]
    if problems:
        head = (f"load_safetensors: {len(problems)} problem"
                f"{'s' if len(problems) > 1 else ''} between the checkpoint {where} and the "
                "model:\n")
        raise UsageError(head + "\n".join(f"- {p}" for p in problems))
