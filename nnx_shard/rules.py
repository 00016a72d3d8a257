"""Rules: the table that turns logical axis names into mesh axes.

A rule value is one of

* a mesh axis name (``"model"``): shard the dimension over that axis;
* a tuple of mesh axis names (``("data", "fsdp")``): shard over their product;
* ``None``: replicate the dimension;
* a list of the above (``["model", "data", None]``): ordered candidates, the
  first that fits wins. A candidate fits when every axis exists in the mesh, is
  not used by an earlier dimension of the same array, and the product of the
  axis sizes divides the dimension.

Built from a sequence of pairs, a logical name given more than once collects its
values as ordered candidates, first fit wins. That is how Flax linen and MaxText
read their tables; Flax NNX's own resolver turns the table into a dict where the
*last* entry wins. We chose first-fit on purpose: it lets one table say "shard
over 'model' if possible, else over 'data', else replicate", and it never drops
an entry silently.
"""

from __future__ import annotations

import difflib
import json
import math
import tomllib
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeAlias

from jax.sharding import PartitionSpec

from nnx_shard.errors import ShardingError, ShardingWarning

#: One candidate placement: the mesh axes a dimension is sharded over (``()`` replicates).
Placement: TypeAlias = tuple[str, ...]
RuleValue: TypeAlias = str | tuple[str, ...] | list[str | tuple[str, ...] | None] | None
LogicalNames: TypeAlias = Sequence[str | None]
Indivisible = Literal["error", "replicate"]

__all__ = ["Rules"]


def _placement(value: Any, logical: str) -> Placement:
    """Normalises one candidate (str | tuple[str, ...] | None) to a tuple of axes."""
    if value is None:
        return ()
    if isinstance(value, str):
        if not value:
            return ()
        return (value,)
    if isinstance(value, tuple) and all(isinstance(a, str) and a for a in value):
        if len(set(value)) != len(value):
            raise ShardingError(
                f"rule {logical!r} -> {value!r} names a mesh axis twice. "
                f"Fix: list each mesh axis once, e.g. {tuple(dict.fromkeys(value))!r}."
            )
        return value
    raise ShardingError(
        f"rule {logical!r} -> {value!r}: a rule value must be a mesh axis name, a tuple of "
        "mesh axis names, None (replicate) or a list of those (ordered candidates). "
        f"Fix: e.g. Rules({{{logical!r}: 'model'}}) or Rules({{{logical!r}: None}})."
    )


def _candidates(value: Any, logical: str) -> tuple[Placement, ...]:
    if isinstance(value, list):
        if not value:
            raise ShardingError(
                f"rule {logical!r} -> []: an empty candidate list can never fit. "
                f"Fix: use None to replicate, e.g. Rules({{{logical!r}: None}})."
            )
        return tuple(_placement(v, logical) for v in value)
    return (_placement(value, logical),)


def _public_value(cands: tuple[Placement, ...]) -> RuleValue:
    def one(p: Placement) -> str | tuple[str, ...] | None:
        if not p:
            return None
        return p[0] if len(p) == 1 else p

    if len(cands) == 1:
        return one(cands[0])
    return [one(c) for c in cands]


def _check_logical(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ShardingError(
            f"logical axis name {name!r} ({type(name).__name__}) in a rules table: "
            "logical names must be non-empty strings. Fix: e.g. Rules({'embed': 'fsdp'})."
        )
    return name


def _mesh_sizes(mesh: Any) -> dict[str, int]:
    """Axis name -> size for a jax Mesh / AbstractMesh or a plain mapping."""
    if mesh is None:
        return {}
    shape = getattr(mesh, "shape", mesh)
    if isinstance(shape, Mapping):
        return {str(k): int(v) for k, v in shape.items()}
    raise ShardingError(
        f"expected a jax.sharding.Mesh or a mapping of axis name to size, got {mesh!r}. "
        "Fix: build one with nnx_shard.make_mesh('data=4,model=2')."
    )


def _fmt_mesh(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) or "no axes"


def _fmt_value(v: RuleValue) -> str:
    return repr(v)


def describe(path: str, shape: Sequence[int] | None, names: Any) -> str:
    """The phrase that opens every error about one array."""
    what = f"parameter {path!r}" if path else "array"
    parts = []
    if shape is not None:
        parts.append(f"shape {tuple(shape)}")
    parts.append(f"logical axes {tuple(names) if isinstance(names, list) else names!r}")
    return f"{what} ({', '.join(parts)})"


class Rules(Mapping[str, RuleValue]):
    """A frozen table mapping logical axis names to mesh axes.

    Args:
      table: a mapping ``{logical: value}``, a sequence of ``(logical, value)``
        pairs (a repeated logical name adds ordered candidates, first fit wins),
        or another ``Rules``.
      indivisible: what to do when a dimension does not divide by its mesh axes
        and no candidate fits: ``"error"`` (default) raises a ``ShardingError``;
        ``"replicate"`` replicates that dimension and emits a ``ShardingWarning``.

    >>> rules = Rules({"batch": "data", "embed": None, "mlp": ["model", None]})
    >>> rules.spec(("embed", "mlp"), shape=(16, 32), mesh={"data": 2, "model": 4})
    P(None, 'model')
    >>> rules.spec(("embed", "mlp"), shape=(16, 30), mesh={"data": 2, "model": 4})
    P(None, None)
    >>> (rules | {"embed": "data"})["embed"]
    'data'
    >>> Rules([("mlp", "model"), ("mlp", "data")])["mlp"]
    ['model', 'data']
    """

    __slots__ = ("_indivisible", "_table")

    _table: dict[str, tuple[Placement, ...]]
    _indivisible: Indivisible

    def __init__(
        self,
        table: Mapping[str, RuleValue] | Iterable[tuple[str, RuleValue]] | Rules = (),
        *,
        indivisible: Indivisible | None = None,
    ) -> None:
        parsed: dict[str, tuple[Placement, ...]] = {}
        if isinstance(table, Rules):
            parsed = dict(table._table)
            if indivisible is None:
                indivisible = table._indivisible
        elif isinstance(table, Mapping):
            for name, value in table.items():
                parsed[_check_logical(name)] = _candidates(value, name)
        elif isinstance(table, str | bytes) or not isinstance(table, Iterable):
            raise ShardingError(
                f"Rules expects a mapping or a sequence of (logical, value) pairs, got {table!r}. "
                "Fix: Rules({'batch': 'data', 'mlp': 'model'})."
            )
        else:
            for item in table:
                if not (isinstance(item, tuple | list) and len(item) == 2):
                    raise ShardingError(
                        f"rules entry {item!r} is not a (logical, value) pair. "
                        "Fix: Rules([('batch', 'data'), ('mlp', 'model')])."
                    )
                name, value = item
                parsed[_check_logical(name)] = parsed.get(name, ()) + _candidates(value, name)
        indivisible = indivisible or "error"
        if indivisible not in ("error", "replicate"):
            raise ShardingError(
                f"indivisible={indivisible!r}: expected 'error' or 'replicate'."
            )
        object.__setattr__(self, "_table", parsed)
        object.__setattr__(self, "_indivisible", indivisible)

    # -- frozen mapping ------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Rules are frozen; build a new table with `rules | {...}`")

    def __getitem__(self, name: str) -> RuleValue:
        return _public_value(self._table[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Rules):
            return NotImplemented
        return self._table == other._table and self._indivisible == other._indivisible

    def __hash__(self) -> int:
        return hash((tuple(self._table.items()), self._indivisible))

    def __or__(self, other: Mapping[str, RuleValue] | Rules) -> Rules:
        """Entries of ``other`` replace whole entries of ``self`` (candidates included)."""
        if not isinstance(other, Mapping):
            return NotImplemented
        merged = Rules(self)
        table = dict(merged._table)
        table.update(Rules(other)._table)
        object.__setattr__(merged, "_table", table)
        return merged

    @property
    def indivisible(self) -> Indivisible:
        """The policy for dimensions that do not divide by their mesh axes."""
        return self._indivisible

    def candidates(self, name: str) -> tuple[Placement, ...]:
        """Ordered candidate placements of ``name`` (each a tuple of mesh axes).

        >>> Rules({"mlp": ["model", None]}).candidates("mlp")
        (('model',), ())
        """
        return self._table[name]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (candidate lists as lists, axis products as lists in a list).

        >>> Rules({"embed": ("data", "fsdp"), "mlp": "model"}).to_dict()
        {'embed': [['data', 'fsdp']], 'mlp': 'model'}
        """
        out: dict[str, Any] = {}
        for name, cands in self._table.items():
            if len(cands) == 1 and len(cands[0]) <= 1:
                out[name] = cands[0][0] if cands[0] else None
            else:
                out[name] = [list(c) if len(c) > 1 else (c[0] if c else None) for c in cands]
        return out

    def __repr__(self) -> str:
        body = ", ".join(f"{k!r}: {_fmt_value(v)}" for k, v in self.items())
        extra = "" if self._indivisible == "error" else f", indivisible={self._indivisible!r}"
        return f"Rules({{{body}}}{extra})"

    def __str__(self) -> str:
        if not self._table:
            return "Rules (empty)"
        width = max(len("logical"), *(len(k) for k in self._table))
        lines = [f"{'logical':<{width}}  mesh"]
        for name, value in self.items():
            shown = "replicated" if value is None else _fmt_value(value)
            lines.append(f"{name:<{width}}  {shown}")
        return "\n".join(lines)

    # -- files ---------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> Rules:
        """Loads rules from a ``.json`` or ``.toml`` file.

        The file holds a table of logical name to value, either at the top
        level or under a ``rules`` key; an optional top-level ``indivisible``
        sets the policy. Values: a string names a mesh axis; ``null`` (JSON)
        or ``""`` (TOML has no null) replicates; an array lists ordered
        candidates, where a nested array is a product of mesh axes::

            # rules.toml
            [rules]
            batch = "data"
            embed = [["data", "fsdp"]]   # shard over data x fsdp
            mlp = ["model", ""]          # model if it fits, else replicate

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "r.toml")
        >>> _ = open(p, "w").write('[rules]\\nbatch = "data"\\nmlp = ["model", ""]\\n')
        >>> Rules.from_file(p)
        Rules({'batch': 'data', 'mlp': ['model', None]})
        """
        path = Path(path)
        text = path.read_text()
        try:
            if path.suffix == ".json":
                data = json.loads(text)
            elif path.suffix == ".toml":
                data = tomllib.loads(text)
            else:
                raise ShardingError(
                    f"rules file {str(path)!r}: unknown format {path.suffix!r}. "
                    "Fix: use a .json or .toml file."
                )
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
            raise ShardingError(f"rules file {str(path)!r} could not be parsed: {e}") from e
        if not isinstance(data, dict):
            raise ShardingError(f"rules file {str(path)!r} must hold a table, got {data!r}")
        indivisible = data.pop("indivisible", None)
        table = data.get("rules", data)

        def convert(v: Any) -> Any:
            if isinstance(v, list):
                return [tuple(c) if isinstance(c, list) else c for c in v]
            return v

        return cls({k: convert(v) for k, v in table.items()}, indivisible=indivisible)

    # -- resolution ----------------------------------------------------------

    def spec(
        self,
        names: LogicalNames,
        shape: Sequence[int] | None = None,
        mesh: Any = None,
        *,
        path: str = "",
    ) -> PartitionSpec:
        """Resolves logical ``names`` to a validated ``PartitionSpec``.

        Args:
          names: one logical name (or ``None``) per dimension.
          shape: the array shape; when given, the rank and divisibility are checked.
          mesh: a ``jax.sharding.Mesh`` (or a mapping of axis name to size);
            when given, mesh axes must exist in it.
          path: the parameter path, used in error messages.

        Raises:
          ShardingError: naming the path, shape, logical names, the rule and a fix.

        A name without a rule that is itself a mesh axis of ``mesh`` maps to
        that axis, so models annotated for Flax with mesh axis names keep working.
        Mesh axes of size 1 always fit.

        >>> rules = Rules({"embed": "fsdp", "mlp": "model"})
        >>> rules.spec(("embed", "mlp"), shape=(8, 4), mesh={"fsdp": 2, "model": 2})
        P('fsdp', 'model')
        >>> rules.spec(("embed", "mpl"), path="layer/kernel")
        Traceback (most recent call last):
        ...
        nnx_shard.errors.ShardingError: logical axis 'mpl' of parameter 'layer/kernel' ...
        """
        names_t = self._check_names(names, shape, path)
        sizes = _mesh_sizes(mesh)
        has_mesh = mesh is not None
        used: dict[str, int] = {}
        out: list[str | tuple[str, ...] | None] = []
        for dim, name in enumerate(names_t):
            if name is None:
                out.append(None)
                continue
            dim_size = None if shape is None else int(shape[dim])
            placement = self._place(name, dim, dim_size, names_t, shape, sizes, has_mesh, used, path)
            for axis in placement:
                used[axis] = dim
            out.append(None if not placement else placement[0] if len(placement) == 1 else placement)
        return PartitionSpec(*out)

    def _check_names(self, names: Any, shape: Any, path: str) -> tuple[Any, ...]:
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise ShardingError(
                f"{describe(path, shape, names)}: logical axes must be a tuple with one name "
                "(or None) per dimension. Fix: e.g. ('embed', 'mlp') instead of "
                f"{names!r}."
            )
        names_t = tuple(names)
        for i, n in enumerate(names_t):
            ok = n is None or (isinstance(n, str) and n) or (
                isinstance(n, tuple)
                and n
                and all(isinstance(a, str) and a for a in n)
                and len(set(n)) == len(n)
            )
            if not ok:
                raise ShardingError(
                    f"{describe(path, shape, names_t)}: entry {i} is {n!r} "
                    f"({type(n).__name__}); logical names must be non-empty strings, or None "
                    "for a replicated dimension. Fix: e.g. ('embed', None)."
                )
        if shape is not None and len(names_t) != len(shape):
            hint = ""
            if len(names_t) == len(shape) - 1:
                hint = (
                    " If the layers were stacked with nnx.vmap / nnx.scan, the stacked axis has no "
                    "logical name: pass transform_metadata={nnx.PARTITION_NAME: 'layers'} to the "
                    "transform (and give 'layers' a rule) so the layer axis is named."
                )
            raise ShardingError(
                f"{describe(path, shape, names_t)}: {len(names_t)} logical names for an array "
                f"of rank {len(shape)}.{hint} Fix: give exactly one logical name (or None) per "
                "dimension."
            )
        return names_t

    def _place(
        self,
        name: str | tuple[str, ...],
        dim: int,
        dim_size: int | None,
        names: tuple[Any, ...],
        shape: Any,
        sizes: dict[str, int],
        has_mesh: bool,
        used: dict[str, int],
        path: str,
    ) -> Placement:
        head = describe(path, shape, names)
        if isinstance(name, tuple):
            # A Flax-style entry naming several mesh axes directly.
            cands: tuple[Placement, ...] = (name,)
            rule_txt = f"{name!r} (mesh axes given directly)"
            key = name
        elif name in self._table:
            cands = self._table[name]
            rule_txt = f"rule {name!r} -> {_fmt_value(self[name])}"
            key = name
        elif has_mesh and name in sizes:
            cands = ((name,),)
            rule_txt = f"{name!r} (a mesh axis, used directly)"
            key = name
        else:
            close = difflib.get_close_matches(name, list(self._table), n=3, cutoff=0.6)
            known = ", ".join(sorted(self._table)) or "none"
            mean = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ShardingError(
                f"logical axis {name!r} of {head} has no rule.{mean} Known logical axes: "
                f"{known}. Fix: add a rule, e.g. rules | {{{name!r}: 'model'}}, or "
                f"rules | {{{name!r}: None}} to replicate it."
            )
        failures: list[str] = []
        for cand in cands:
            why = self._why_not(cand, dim_size, sizes, has_mesh, used)
            if why is None:
                # A size-1 axis shards nothing, so reusing one is harmless: drop it.
                return tuple(a for a in cand if not (a in used and sizes.get(a) == 1))
            failures.append(why)
        indivisible_only = all(f.startswith("size ") for f in failures)
        if indivisible_only and self._indivisible == "replicate":
            warnings.warn(
                f"{head}: dimension {dim} (size {dim_size}) does not divide by its mesh axes "
                f"({rule_txt}); replicating it as Rules(indivisible='replicate') allows.",
                ShardingWarning,
                stacklevel=4,
            )
            return ()
        detail = "; ".join(f"{_cand_txt(c)}: {f}" for c, f in zip(cands, failures, strict=True))
        if any(f.startswith("not in the mesh") for f in failures):
            missing = sorted({a for c in cands for a in c if a not in sizes})
            fix = (
                f"Fix: build the mesh with axis {' and '.join(repr(m) for m in missing)}, or map "
                f"{key!r} to an existing axis ({_fmt_mesh(sizes)}) or None: rules | {{{key!r}: None}}."
            )
            raise ShardingError(
                f"{rule_txt} names a mesh axis that is not in the mesh (axes: {_fmt_mesh(sizes)}) "
                f"for dimension {dim} of {head}: {detail}. {fix}"
            )
        if any(f.startswith("already used") for f in failures):
            raise ShardingError(
                f"{rule_txt} cannot shard dimension {dim} of {head}: {detail}. A mesh axis can "
                f"shard only one dimension of an array. Fix: map {key!r} to another axis, or "
                f"give candidates, e.g. rules | {{{key!r}: [{_cand_txt(cands[0])}, None]}}."
            )
        raise ShardingError(
            f"{rule_txt} cannot shard dimension {dim} of {head}: {detail}. Fix: make the "
            f"dimension divisible, add None as a last candidate "
            f"(rules | {{{key!r}: [{_cand_txt(cands[0])}, None]}}), or pass "
            "Rules(..., indivisible='replicate') to replicate such dimensions with a warning."
        )

    @staticmethod
    def _why_not(
        cand: Placement,
        dim_size: int | None,
        sizes: dict[str, int],
        has_mesh: bool,
        used: dict[str, int],
    ) -> str | None:
        for axis in cand:
            if has_mesh and axis not in sizes:
                return f"not in the mesh (mesh axis {axis!r})"
        for axis in cand:
            if axis in used and not (has_mesh and sizes.get(axis) == 1):
                return f"already used by dimension {used[axis]} (mesh axis {axis!r})"
        if dim_size is not None and has_mesh:
            prod = math.prod(sizes[a] for a in cand)
            if dim_size % prod:
                return f"size {dim_size} is not divisible by {prod}"
        return None


def _cand_txt(c: Placement) -> str:
    if not c:
        return "None"
    return repr(c[0]) if len(c) == 1 else repr(c)


def as_rules(rules: Rules | Mapping[str, RuleValue] | Iterable[tuple[str, RuleValue]]) -> Rules:
    """``rules`` itself when it is a ``Rules``, else a ``Rules`` built from it."""
    return rules if isinstance(rules, Rules) else Rules(rules)
