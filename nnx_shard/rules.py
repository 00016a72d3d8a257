"""Rules: the table that turns logical axis names into mesh axes.

A rules table is an ordered list of entries ``(logical name, placement)``. A
placement is

* a mesh axis name (``"model"``): shard the dimension over that axis;
* a tuple of mesh axis names (``("data", "fsdp")``): shard over their product;
* ``None``: replicate the dimension;
* ``PartitionSpec.UNCONSTRAINED`` (activations only): let the compiler choose.

Resolution (:meth:`Rules.spec`) is the one of Flax linen's
``logical_to_mesh_axes`` and MaxText: the table is walked **in order**, and an
entry ``(logical, placement)`` applies to the dimension carrying that logical
name when the dimension is still unassigned and none of the entry's mesh axes
shards another dimension yet. A logical name given more than once therefore
lists fallbacks (the first that applies wins), and an earlier entry claims a
mesh axis before a later one, whatever the order of the array's dimensions.
Flax NNX's own resolver turns the table into a dict, where the *last* entry of
a repeated name wins and the others are dropped; we keep linen's table order.

Two checks are ours: an entry whose mesh axis is not in the mesh, or whose axes'
product does not divide the dimension, does not fit, and the walk goes on to the
next entry. Where no entry fits a named dimension, Flax silently replicates it;
we raise a ``ShardingError`` that names the array, its shape and logical names,
every entry tried and why it failed, and a fix (give the table a ``None`` entry
for that name, or ``Rules(..., indivisible="replicate")`` for dimensions that
only fail to divide). A mesh axis of size 1 shards nothing, so when nothing else
fits, an entry blocked only by an already used size-1 axis applies without it.
A logical name with no entry that is itself a mesh axis maps to that axis.

Two ways to write a table:

* ``Rules({...})`` / ``Rules([(logical, value), ...])``: a value is a placement
  or a Python **list** of placements, the ordered candidates of that name (they
  become consecutive entries); a product of axes is a **tuple**.
* ``Rules.from_pairs(pairs)`` and :meth:`Rules.from_file` read tables as Flax and
  MaxText write them: a list **or** tuple value is a product of mesh axes,
  ``[]`` / ``None`` / ``""`` replicate, and a repeated name is the next candidate.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import stat
import tomllib
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import numpy as np
from jax.sharding import PartitionSpec

from nnx_shard.axes import mesh_sizes, sizes_str
from nnx_shard.errors import ShardingError, ShardingWarning, short

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED
if TYPE_CHECKING:
    # The singleton's class is private to jax; checks read `is UNCONSTRAINED`.
    _Unconstrained: TypeAlias = Any
else:
    _Unconstrained = type(UNCONSTRAINED)

#: One placement: the mesh axes a dimension is sharded over (``()`` replicates), or
#: ``PartitionSpec.UNCONSTRAINED``.
Placement: TypeAlias = tuple[str, ...] | _Unconstrained
RuleValue: TypeAlias = (
    str | tuple[str, ...] | list[str | tuple[str, ...] | None] | _Unconstrained | None
)
LogicalNames: TypeAlias = Sequence[str | None]
Indivisible = Literal["error", "replicate"]

__all__ = ["MAX_FILE_BYTES", "MAX_YAML_NODES", "Rules", "declare_option", "known_options"]

#: A rules file larger than this is refused (MaxText's base.yml is ~40 KB).
MAX_FILE_BYTES = 16 << 20
#: A YAML rules file whose aliases expand to more nodes than this is refused.
MAX_YAML_NODES = 100_000

# The execution options some registered op reads (nnx_shard.parallel.registry declares
# them as ops register): Rules(options=...) refuses any other name.
_KNOWN_OPTIONS: set[str] = set()


def declare_option(name: str) -> None:
    """Makes ``name`` a valid key of ``Rules(options=...)``: what an op registered
    with :func:`nnx_shard.parallel.registry.register` does for the option it reads.

    >>> declare_option("my_op"); "my_op" in known_options()
    True
    """
    _KNOWN_OPTIONS.add(name)


def known_options() -> tuple[str, ...]:
    """The option names ``Rules(options=...)`` accepts, sorted.

    >>> import nnx_shard
    >>> [o for o in known_options() if o in ("attention", "collective_matmul", "pipeline")]
    ['attention', 'collective_matmul', 'pipeline']
    """
    return tuple(sorted(_KNOWN_OPTIONS))


def _product(axes: tuple[Any, ...], logical: str, shown: Any, fix: str) -> tuple[str, ...]:
    """Validates a product of mesh axes (``shown`` is the value as the user wrote it)."""
    for a in axes:
        if a == "":
            raise ShardingError(
                f"rule {short(logical)} -> {short(shown)}: an empty string is not a mesh axis name. "
                f"Fix: name a mesh axis, or use None to replicate, e.g. {fix}."
            )
        if not isinstance(a, str):
            raise ShardingError(
                f"rule {short(logical)} -> {short(shown)}: a product of mesh axes must list mesh "
                f"axis names (strings), got {short(a)}. Fix: e.g. {fix}."
            )
    if len(set(axes)) != len(axes):
        raise ShardingError(
            f"rule {short(logical)} -> {short(shown)} names a mesh axis twice. "
            f"Fix: list each mesh axis once, e.g. {short(tuple(dict.fromkeys(axes)))}."
        )
    return tuple(axes)


def _placement(value: Any, logical: str) -> Placement:
    """One placement as ``Rules({...})`` writes it: str | tuple[str, ...] | None | UNCONSTRAINED."""
    fix = f"Rules({{{short(logical)}: None}})"
    if value is None:
        return ()
    if value is UNCONSTRAINED:
        return UNCONSTRAINED
    if isinstance(value, str):
        if not value:
            raise ShardingError(
                f"rule {short(logical)} -> '': an empty string is not a mesh axis name (it would "
                f"silently replicate). Fix: use None to replicate, e.g. {fix}."
            )
        return (value,)
    if isinstance(value, tuple):
        return _product(value, logical, value, fix)
    hint = ""
    if isinstance(value, list):
        hint = (
            " In Rules({...}) a list holds candidates and a product of axes is a tuple; "
            "Rules.from_pairs reads lists as products, as Flax and MaxText write them."
        )
    raise ShardingError(
        f"rule {short(logical)} -> {short(value)}: a rule value must be a mesh axis name, a "
        "tuple of mesh axis names, None (replicate), PartitionSpec.UNCONSTRAINED or a list of "
        f"those (ordered candidates).{hint} Fix: e.g. Rules({{{short(logical)}: 'model'}}) or "
        f"{fix}."
    )


def _candidates(value: Any, logical: str) -> tuple[Placement, ...]:
    if isinstance(value, list):
        if not value:
            raise ShardingError(
                f"rule {short(logical)} -> []: an empty candidate list can never fit. "
                f"Fix: use None to replicate, e.g. Rules({{{short(logical)}: None}})."
            )
        return tuple(_placement(v, logical) for v in value)
    return (_placement(value, logical),)


def _pair_placement(value: Any, logical: str) -> Placement:
    """One placement as Flax / MaxText write it: a list or tuple is a product of axes."""
    if value is None or (isinstance(value, str | list | tuple) and len(value) == 0):
        return ()
    if value is UNCONSTRAINED:
        return UNCONSTRAINED
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple):
        fix = f"[{short(logical)}, ['data', 'fsdp']] or [{short(logical)}, None]"
        return _product(tuple(value), logical, value, fix)
    raise ShardingError(
        f"rule {short(logical)} -> {short(value)}: in a table of [logical, mesh] pairs the mesh "
        "side must be a mesh axis name, a list or tuple of mesh axis names (their product), "
        f"None / [] / '' (replicate) or PartitionSpec.UNCONSTRAINED. "
        f"Fix: e.g. [{short(logical)}, 'model'] or [{short(logical)}, ['data', 'fsdp']]."
    )


def _one(p: Placement) -> str | tuple[str, ...] | _Unconstrained | None:
    """The public form of one placement: None, an axis name, a tuple, or UNCONSTRAINED."""
    if p is UNCONSTRAINED:
        return UNCONSTRAINED
    if not p:
        return None
    return p[0] if len(p) == 1 else p


def _public_value(cands: tuple[Placement, ...]) -> RuleValue:
    if len(cands) == 1:
        return _one(cands[0])
    return [_one(c) for c in cands]


def _check_logical(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ShardingError(
            f"logical axis name {short(name)} ({type(name).__name__}) in a rules table: "
            "logical names must be non-empty strings. Fix: e.g. Rules({'embed': 'fsdp'})."
        )
    return name


def _mesh_sizes(mesh: Any) -> dict[str, int]:
    """Axis name -> size for a jax Mesh / AbstractMesh or a plain mapping."""
    try:
        return mesh_sizes(mesh)
    except ValueError as e:
        raise ShardingError(f"{e}. Fix: e.g. mesh={{'data': 4, 'model': 2}}, or a mesh from "
                            "nnx_shard.make_mesh('data=4,model=2').") from None
    except TypeError:
        pass
    raise ShardingError(
        f"expected a jax.sharding.Mesh or a mapping of axis name to size, got "
        f"{type(mesh).__name__} {short(mesh)}. "
        "Fix: build one with nnx_shard.make_mesh('data=4,model=2')."
    )


def _fmt_mesh(sizes: Mapping[str, int]) -> str:
    return sizes_str(sizes, ", ", "no axes")


def _fmt_value(v: Any) -> str:
    """repr() of a rule value, with UNCONSTRAINED written as code that builds it."""
    if v is UNCONSTRAINED:
        return "P.UNCONSTRAINED"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt_value(c) for c in v) + "]"
    return repr(v)


def describe(path: str, shape: Sequence[int] | None, names: Any) -> str:
    """The phrase that opens every error about one array."""
    what = f"parameter {short(path)}" if path else "array"
    parts = []
    if shape is not None:
        shown = tuple(shape) if isinstance(shape, list | tuple) else shape
        parts.append(f"shape {short(shown)}")
    parts.append(f"logical axes {short(tuple(names) if isinstance(names, list) else names)}")
    return f"{what} ({', '.join(parts)})"


def _check_shape(shape: Any, path: str, names: Any) -> tuple[int, ...] | None:
    """``shape`` as a tuple of sizes; a size that is not an int >= 0 is an error (a
    negative or float size would be checked for divisibility as if it were one)."""
    if shape is None:
        return None
    if isinstance(shape, str | bytes) or not isinstance(shape, Sequence | np.ndarray):
        raise ShardingError(
            f"{describe(path, None, names)}: shape {short(shape)} is not a sequence of sizes. "
            "Fix: pass the array's shape, e.g. shape=(1024, 4096) or shape=x.shape."
        )
    for i, d in enumerate(shape):
        if isinstance(d, bool | np.bool_) or not isinstance(d, int | np.integer) or d < 0:
            raise ShardingError(
                f"{describe(path, tuple(shape), names)}: dimension {i} of shape has size {short(d)} "
                f"({type(d).__name__}); sizes are ints >= 0. Fix: pass the array's shape, e.g. "
                "shape=x.shape."
            )
    return tuple(int(d) for d in shape)


def _read_text(path: Path) -> str:
    """The UTF-8 text of a rules file: a regular file (never a FIFO, a device or a
    folder, which would block or never end) of at most :data:`MAX_FILE_BYTES`."""
    where = f"rules file {short(str(path), 1000)}"
    try:
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer; what was opened
        # is checked with fstat (no race with a path swapped after a stat).
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: no such file. Fix: the path of a .json, .toml "
                                "or .yaml rules file") from None
    except IsADirectoryError:
        fd = None
    except OSError as e:
        raise ShardingError(f"{where} cannot be opened: {e.strerror or e}. Fix: a readable "
                            ".json, .toml or .yaml rules file") from None
    try:
        mode = os.fstat(fd).st_mode if fd is not None else stat.S_IFDIR
        if not stat.S_ISREG(mode):
            kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
            raise ShardingError(f"{where} is {kind}, not a regular file. Fix: the path of a "
                                ".json, .toml or .yaml rules file")
        assert fd is not None
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = None
            data = f.read(MAX_FILE_BYTES + 1)
    finally:
        if fd is not None:
            os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise ShardingError(f"{where} is larger than {MAX_FILE_BYTES >> 20} MiB, too large for "
                            "a rules table. Fix: the path of the rules file itself")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ShardingError(f"{where} is not UTF-8 text (byte {data[e.start]:#04x} at offset "
                            f"{e.start}). Fix: save it as UTF-8 text") from None


def _no_duplicates(pairs: list[tuple[Any, Any]], where: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ShardingError(f"{where} holds the key {short(k)} twice (a later one would "
                                "silently replace the first). Fix: keep one of them; to list "
                                "candidates of one logical name use a list, e.g. "
                                "mlp = ['model', '']")
        out[k] = v
    return out


def _yaml(text: str, where: str) -> Any:
    """YAML through PyYAML's safe loader, refusing duplicate keys and aliases that
    expand past :data:`MAX_YAML_NODES` nodes (a few hundred bytes of nested aliases
    can stand for billions of values)."""
    try:
        import yaml
    except ImportError as e:
        raise ImportError(
            f"{where} is YAML, which needs PyYAML. "
            "Fix: pip install nnx_shard[yaml] (or pip install pyyaml), or use .json/.toml."
        ) from e

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                keys = [self.construct_object(k, deep=True) for k, _ in node.value
                        if k.tag != "tag:yaml.org,2002:merge"]
                _no_duplicates([(k, None) for k in keys if isinstance(k, str | int | float)],
                               where)
            return super().construct_mapping(node, deep=deep)

    def children(node: Any) -> list[Any]:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        if isinstance(node, yaml.MappingNode):
            return [x for kv in node.value for x in kv]
        return []

    def expanded(root: Any) -> int:
        # Values as constructed, aliases expanded: a post-order walk, each distinct node
        # once with the expanded size of its children (memoised: linear in the file).
        sizes: dict[int, int] = {}
        seen: set[int] = set()
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                sizes[id(node)] = min(1 + sum(sizes.get(id(c), 1) for c in children(node)),
                                      MAX_YAML_NODES + 1)
            elif id(node) not in seen:
                seen.add(id(node))
                stack.append((node, True))
                stack.extend((c, False) for c in children(node) if id(c) not in seen)
        return sizes[id(root)]

    loader = Loader(text)
    try:
        node = loader.get_single_node()
        if node is not None and expanded(node) > MAX_YAML_NODES:
            raise ShardingError(f"{where}: its aliases expand to more than {MAX_YAML_NODES:,} "
                                "values, far more than a rules table holds. Fix: write the "
                                "table out without nested aliases")
        return None if node is None else loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ShardingError(f"{where} could not be parsed: {' '.join(str(e).split())[:400]}") from None
    finally:
        loader.dispose()


def _load(path: Path) -> Any:
    """The parsed content of a .json / .toml / .yaml rules file."""
    where = f"rules file {short(str(path), 1000)}"
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml", ".yaml", ".yml"):
        raise ShardingError(
            f"{where}: unknown format {short(path.suffix)}. "
            "Fix: use a .json, .toml or .yaml/.yml file."
        )
    text = _read_text(path)
    try:
        if suffix in (".yaml", ".yml"):
            return _yaml(text, where)
        if suffix == ".json":
            return json.loads(text, object_pairs_hook=lambda kv: _no_duplicates(kv, where))
        return tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ShardingError(f"{where} could not be parsed: {' '.join(str(e).split())[:400]}") from None
    except RecursionError:
        raise ShardingError(f"{where} is nested too deeply to be a rules table. Fix: the "
                            "path of the rules file itself") from None


def _file_value(v: Any) -> Any:
    """A value of the dict file format: "" replicates (TOML has no null); in a
    candidate list, a nested list is a product of mesh axes."""
    if v == "":
        return None
    if isinstance(v, list):
        return [tuple(c) if isinstance(c, list) else (None if c == "" else c) for c in v]
    return v


_UNASSIGNED: Any = object()


class Rules(Mapping[str, RuleValue]):
    """A frozen, ordered table mapping logical axis names to mesh axes.

    Rules are walked in table order, as Flax linen's ``logical_to_mesh_axes``
    and MaxText do: an entry applies to the dimension with its logical name if
    that dimension is still unassigned and none of its mesh axes is used yet.
    Our additions: an entry whose axis is missing from the mesh or whose axes do
    not divide the dimension does not fit (the walk tries the next entry), and a
    named dimension that no entry fits is a ``ShardingError`` where Flax would
    silently replicate it. Flax NNX's dict-based resolver lets the last entry of
    a repeated name win; here the first entry that fits wins.

    Args:
      table: a mapping ``{logical: value}``, a sequence of ``(logical, value)``
        pairs, or another ``Rules``. A value is a mesh axis name, a **tuple** of
        mesh axis names (their product), ``None`` (replicate),
        ``PartitionSpec.UNCONSTRAINED`` (activations only), or a Python **list**
        of those: ordered candidates of that name, entered consecutively. A
        logical name repeated in a sequence of pairs adds its values as further
        entries at that place in the table. An empty string is an error (use
        ``None``). For tables written as Flax and MaxText write them, where a
        list means a *product* of mesh axes, use :meth:`from_pairs`.
      indivisible: what to do when a dimension does not divide by its mesh axes
        and no other entry fits: ``"error"`` (default) raises a
        ``ShardingError``; ``"replicate"`` replicates that dimension and emits a
        ``ShardingWarning``.
      options: execution options a strategy passes to the model's sharding-aware
        operations along with the table (e.g. how attention runs when the
        sequence is split); read under :func:`nnx_shard.use` with
        :func:`nnx_shard.mesh.option`. Values must be hashable. See
        :meth:`with_options`.

    >>> rules = Rules({"batch": "data", "embed": None, "mlp": ["model", None]})
    >>> rules.spec(("embed", "mlp"), shape=(16, 32), mesh={"data": 2, "model": 4})
    P(None, 'model')
    >>> rules.spec(("embed", "mlp"), shape=(16, 30), mesh={"data": 2, "model": 4})
    P(None, None)
    >>> (rules | {"embed": "data"})["embed"]
    'data'
    >>> Rules([("mlp", "model"), ("mlp", "data")])["mlp"]
    ['model', 'data']

    Table order, not dimension order, decides which name gets a contested axis:

    >>> pairs = [("a", "model"), ("b", "model"), ("b", "data")]
    >>> Rules(pairs).spec(("b", "a"), shape=(4, 4), mesh={"data": 2, "model": 2})
    P('data', 'model')
    """

    __slots__ = ("_entries", "_indivisible", "_options", "_table")

    _entries: tuple[tuple[str, Placement], ...]
    _table: dict[str, tuple[Placement, ...]]
    _indivisible: Indivisible
    _options: tuple[tuple[str, Any], ...]

    def __init__(
        self,
        table: Mapping[str, RuleValue] | Iterable[tuple[str, RuleValue]] | Rules = (),
        *,
        indivisible: Indivisible | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        entries: list[tuple[str, Placement]] = []
        if isinstance(table, Rules):
            entries = list(table._entries)
            if indivisible is None:
                indivisible = table._indivisible
            if options is None:
                options = table.options
        elif isinstance(table, Mapping):
            for name, value in table.items():
                name = _check_logical(name)
                entries += [(name, p) for p in _candidates(value, name)]
        elif isinstance(table, str | bytes) or not isinstance(table, Iterable):
            raise ShardingError(
                f"Rules expects a mapping or a sequence of (logical, value) pairs, got "
                f"{short(table)}. "
                "Fix: Rules({'batch': 'data', 'mlp': 'model'})."
            )
        else:
            for item in table:
                if not (isinstance(item, tuple | list) and len(item) == 2):
                    raise ShardingError(
                        f"rules entry {short(item)} is not a (logical, value) pair. "
                        "Fix: Rules([('batch', 'data'), ('mlp', 'model')])."
                    )
                name = _check_logical(item[0])
                entries += [(name, p) for p in _candidates(item[1], name)]
        self._set(entries, indivisible, options)

    def _set(self, entries: Iterable[tuple[str, Placement]], indivisible: Any,
             options: Mapping[str, Any] | None = None) -> None:
        object.__setattr__(self, "_options", _check_options({} if options is None else options))
        indivisible = "error" if indivisible is None else indivisible
        if not isinstance(indivisible, str) or indivisible not in ("error", "replicate"):
            raise ShardingError(
                f"indivisible={short(indivisible)}: expected 'error' or 'replicate'. "
                "Fix: Rules(..., indivisible='replicate'), or leave it out ('error')."
            )
        entries = tuple(entries)
        table: dict[str, tuple[Placement, ...]] = {}
        for name, p in entries:
            table[name] = (*table.get(name, ()), p)
        object.__setattr__(self, "_entries", entries)
        object.__setattr__(self, "_table", table)
        object.__setattr__(self, "_indivisible", indivisible)

    @classmethod
    def from_pairs(
        cls,
        pairs: Iterable[Sequence[Any]],
        *,
        indivisible: Indivisible | None = None,
    ) -> Rules:
        """A table written as Flax linen and MaxText write ``logical_axis_rules``.

        ``pairs`` is a sequence of ``[logical, mesh]`` items, in priority order.
        Unlike ``Rules({...})``, a list **or** tuple on the mesh side is a
        *product* of mesh axes; ``[]``, ``None`` and ``""`` (TOML has no null)
        replicate; ``PartitionSpec.UNCONSTRAINED`` leaves an activation
        dimension to the compiler; and a repeated logical name is the next
        candidate for that name. Resolution is the table walk described on
        :class:`Rules`.

        >>> rules = Rules.from_pairs([
        ...     ["batch", "data"],
        ...     ["vocab", ["tensor", "autoregressive"]],   # a product, as in MaxText
        ...     ["embed", ["fsdp", "tensor"]],
        ...     ["embed", "fsdp"],                         # embed's next candidate
        ...     ["norm", []],                              # replicated
        ... ])
        >>> rules["vocab"], rules["embed"], rules["norm"]
        (('tensor', 'autoregressive'), [('fsdp', 'tensor'), 'fsdp'], None)
        >>> mesh = {"data": 1, "fsdp": 2, "tensor": 2, "autoregressive": 2}
        >>> rules.spec(("embed", "vocab"), shape=(8, 16), mesh=mesh)
        P('fsdp', ('tensor', 'autoregressive'))
        >>> rules.spec(("embed", "norm"), shape=(8, 16), mesh=mesh)
        P(('fsdp', 'tensor'), None)
        """
        if isinstance(pairs, str | bytes | Mapping) or not isinstance(pairs, Iterable):
            raise ShardingError(
                f"Rules.from_pairs expects a sequence of [logical, mesh] pairs, got "
                f"{short(pairs)}. "
                "Fix: e.g. Rules.from_pairs([['batch', 'data'], ['vocab', ['tensor', 'expert']]])"
                "; for a {logical: value} mapping use Rules({...})."
            )
        entries: list[tuple[str, Placement]] = []
        for item in pairs:
            if isinstance(item, str | bytes) or not (
                isinstance(item, Sequence) and len(item) == 2
            ):
                raise ShardingError(
                    f"rules entry {short(item)} is not a [logical, mesh] pair. "
                    "Fix: e.g. ['batch', 'data'] or ['vocab', ['tensor', 'expert']]."
                )
            name = _check_logical(item[0])
            entries.append((name, _pair_placement(item[1], name)))
        rules = cls.__new__(cls)
        rules._set(entries, indivisible)
        return rules

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
        return (self._entries == other._entries and self._indivisible == other._indivisible
                and self._options == other._options)

    def __hash__(self) -> int:
        return hash((self._entries, self._indivisible, self._options))

    def __or__(self, other: Mapping[str, RuleValue] | Rules) -> Rules:
        """A new table where ``other``'s entries replace all of ``self``'s entries for
        the same names, at the place of the first of them; new names go last."""
        if not isinstance(other, Mapping):
            return NotImplemented
        right = other if isinstance(other, Rules) else Rules(other)
        entries: list[tuple[str, Placement]] = []
        placed: set[str] = set()
        for name, p in self._entries:
            if name not in right._table:
                entries.append((name, p))
            elif name not in placed:
                placed.add(name)
                entries += [(name, c) for c in right._table[name]]
        entries += [(n, p) for n, p in right._entries if n not in self._table]
        merged = Rules.__new__(Rules)
        merged._set(entries, self._indivisible, {**self.options, **right.options})
        return merged

    def alias(self, aliases: Mapping[str, str]) -> Rules:
        """A table where each ``alias`` resolves as the logical name it maps to: the
        alias gets that name's entries, placed right after them (so it claims mesh axes
        in that name's turn). For models whose metadata speaks its own names.

        >>> r = Rules({"batch": "data", "embed": "data", "mlp": "model"})
        >>> r.alias({"fsdp": "embed", "tp": "mlp"}).to_pairs()
        [('batch', 'data'), ('embed', 'data'), ('fsdp', 'data'), ('mlp', 'model'), ('tp', 'model')]
        """
        for alias, target in aliases.items():
            _check_logical(alias)
            if not isinstance(target, str) or target not in self._table:
                known = ", ".join(self._table) or "none"
                raise ShardingError(
                    f"alias {alias!r} -> {target!r}: {target!r} is not a logical name of this "
                    f"table (its names: {known}). Fix: map {alias!r} to one of them, or give "
                    f"it mesh axes directly, rules | {{{alias!r}: 'data'}}."
                )
        last = {n: i for i, (n, _) in enumerate(self._entries)}
        entries: list[tuple[str, Placement]] = []
        for i, (name, p) in enumerate(self._entries):
            if name not in aliases:  # an alias replaces any entries of its own
                entries.append((name, p))
            if last[name] == i:
                entries += [(a, c) for a, t in aliases.items() if t == name
                            for c in self._table[t]]
        out = Rules.__new__(Rules)
        out._set(entries, self._indivisible, self.options)
        return out

    @property
    def options(self) -> Mapping[str, Any]:
        """The execution options carried with the table (read-only).

        >>> Rules({"batch": "data"}).with_options(attention="ring").options["attention"]
        'ring'
        """
        return types.MappingProxyType(dict(self._options))

    def with_options(self, **options: Any) -> Rules:
        """A copy with ``options`` merged into :attr:`options` (``None`` removes one).

        >>> r = Rules({"length": "context"}).with_options(attention="ring")
        >>> r.options == {"attention": "ring"}, r.with_options(attention=None).options == {}
        (True, True)
        """
        merged = {**self.options, **options}
        out = Rules.__new__(Rules)
        out._set(self._entries, self._indivisible,
                 {k: v for k, v in merged.items() if v is not None})
        return out

    @property
    def indivisible(self) -> Indivisible:
        """The policy for dimensions that do not divide by their mesh axes."""
        return self._indivisible

    def candidates(self, name: str) -> tuple[Placement, ...]:
        """Ordered candidate placements of ``name`` (each a tuple of mesh axes, or
        ``PartitionSpec.UNCONSTRAINED``).

        >>> Rules({"mlp": ["model", None]}).candidates("mlp")
        (('model',), ())
        """
        return self._table[name]

    def to_pairs(self) -> list[tuple[str, Any]]:
        """The entries in table order, as ``(logical, mesh)`` pairs: a mesh axis name,
        a tuple (product), ``None`` or ``PartitionSpec.UNCONSTRAINED``. The result is
        a table for :meth:`from_pairs`, ``Rules(...)`` and Flax linen alike.

        >>> Rules([("mlp", "model"), ("embed", ("data", "fsdp")), ("mlp", None)]).to_pairs()
        [('mlp', 'model'), ('embed', ('data', 'fsdp')), ('mlp', None)]
        """
        return [(name, _one(p)) for name, p in self._entries]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (candidate lists as lists, axis products as lists in a list).

        Candidates are grouped by name; when entries of different names interleave,
        :meth:`to_pairs` keeps the exact table order. ``PartitionSpec.UNCONSTRAINED``
        stays that object (JSON has no spelling for it).

        >>> Rules({"embed": ("data", "fsdp"), "mlp": "model"}).to_dict()
        {'embed': [['data', 'fsdp']], 'mlp': 'model'}
        """
        def one(c: Placement) -> Any:
            if c is UNCONSTRAINED:
                return UNCONSTRAINED
            return list(c) if len(c) > 1 else (c[0] if c else None)

        out: dict[str, Any] = {}
        for name, cands in self._table.items():
            if len(cands) == 1 and (cands[0] is UNCONSTRAINED or len(cands[0]) <= 1):
                out[name] = one(cands[0])
            else:
                out[name] = [one(c) for c in cands]
        return out

    def _grouped(self) -> bool:
        """Whether each name's entries are consecutive (a dict shows the table exactly)."""
        names = [n for i, (n, _) in enumerate(self._entries)
                 if i == 0 or self._entries[i - 1][0] != n]
        return len(names) == len(set(names))

    def __repr__(self) -> str:
        extra = "" if self._indivisible == "error" else f", indivisible={self._indivisible!r}"
        if self._options:
            extra += f", options={dict(self._options)!r}"
        if self._grouped():
            body = ", ".join(f"{k!r}: {_fmt_value(v)}" for k, v in self.items())
            return f"Rules({{{body}}}{extra})"
        body = ", ".join(f"({k!r}, {_fmt_value(v)})" for k, v in self.to_pairs())
        return f"Rules([{body}]{extra})"

    def __str__(self) -> str:
        if not self._table:
            return "Rules (empty)"

        def shown(v: Any) -> str:
            if v is UNCONSTRAINED:
                return "unconstrained"
            return "replicated" if v is None else _fmt_value(v)

        width = max(len("logical"), *(len(k) for k in self._table))
        if self._grouped():
            rows = list(self.items())
            head = f"{'logical':<{width}}  mesh"
        else:
            rows = self.to_pairs()
            head = f"{'logical':<{width}}  mesh (in priority order)"
        return "\n".join([head, *(f"{name:<{width}}  {shown(v)}" for name, v in rows)])

    # -- files ---------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> Rules:
        """Loads rules from a ``.json``, ``.toml`` or ``.yaml``/``.yml`` file.

        Two layouts are read:

        * a list of ``[logical, mesh]`` pairs, as Flax and MaxText write them
          (see :meth:`from_pairs`: a list is a product of mesh axes, ``[]`` or
          ``""`` replicates, a repeated name is the next candidate): the whole
          file (JSON/YAML), or under a ``logical_axis_rules`` or ``rules`` key,
          other keys ignored, so MaxText's ``base.yml`` loads unchanged;
        * a table of logical name to value, at the top level or under a
          ``rules`` key, read as ``Rules({...})``: a string names a mesh axis,
          ``null`` or ``""`` (TOML has no null) replicates, an array lists
          ordered candidates, where a nested array is a product of mesh axes.

        An optional top-level ``indivisible`` sets the policy. YAML needs PyYAML
        (``pip install nnx_shard[yaml]``)::

            # rules.toml, pairs                       # rules.toml, table
            logical_axis_rules = [                    [rules]
              ["batch", "data"],                      batch = "data"
              ["vocab", ["tensor", "expert"]],        vocab = [["tensor", "expert"]]
              ["mlp", "model"], ["mlp", ""],          mlp = ["model", ""]
            ]

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "r.toml")
        >>> _ = open(p, "w").write('[rules]\\nbatch = "data"\\nmlp = ["model", ""]\\n')
        >>> Rules.from_file(p)
        Rules({'batch': 'data', 'mlp': ['model', None]})
        >>> _ = open(p, "w").write('logical_axis_rules = [["batch", "data"], '
        ...                        '["vocab", ["tensor", "expert"]], ["mlp", "model"], ["mlp", ""]]')
        >>> Rules.from_file(p)
        Rules({'batch': 'data', 'vocab': ('tensor', 'expert'), 'mlp': ['model', None]})
        """
        if isinstance(path, bytes) or not isinstance(path, str | os.PathLike):
            raise TypeError(
                f"Rules.from_file: path must be a str or os.PathLike, got "
                f"{type(path).__name__} {short(path, 60)}. Fix: e.g. "
                "Rules.from_file('rules.toml')."
            )
        text = os.fspath(path)
        if not isinstance(text, str) or not text:
            raise TypeError(f"Rules.from_file: path {short(text, 60)} names no file. Fix: e.g. "
                            "Rules.from_file('rules.toml').")
        path = Path(text)
        where = f"rules file {short(str(path), 1000)}"
        data = _load(path)
        indivisible = None
        table: Any = data
        if isinstance(data, dict):
            indivisible = data.get("indivisible")
            keys = [k for k in ("logical_axis_rules", "rules") if k in data]
            if len(keys) == 2:
                raise ShardingError(
                    f"{where} holds both 'logical_axis_rules' and 'rules'. Fix: keep one of them."
                )
            if keys:
                table = data[keys[0]]
            else:
                table = {k: v for k, v in data.items() if k != "indivisible"}
        if not isinstance(table, list | dict):
            raise ShardingError(
                f"{where} must hold a list of [logical, mesh] pairs or a table "
                f"of logical name to value, got {short(table)}. Fix: e.g. "
                "logical_axis_rules = [['batch', 'data'], ['mlp', 'model']]."
            )
        try:
            if isinstance(table, list):
                return cls.from_pairs(table, indivisible=indivisible)
            return cls({k: _file_value(v) for k, v in table.items()}, indivisible=indivisible)
        except ShardingError as e:
            raise ShardingError(f"{where}: {e}") from None

    # -- resolution ----------------------------------------------------------

    def spec(
        self,
        names: LogicalNames,
        shape: Sequence[int] | None = None,
        mesh: Any = None,
        *,
        path: str = "",
        allow_unconstrained: bool = True,
    ) -> PartitionSpec:
        """Resolves logical ``names`` to a validated ``PartitionSpec``.

        Args:
          names: one logical name (or ``None``) per dimension. A tuple of mesh
            axis names in place of a name shards that dimension over them directly.
          shape: the array shape; when given, the rank and divisibility are checked.
          mesh: a ``jax.sharding.Mesh`` (or a mapping of axis name to size);
            when given, mesh axes must exist in it.
          path: the parameter path, used in error messages.
          allow_unconstrained: ``False`` for a stored array (a parameter), whose
            layout must be definite: a dimension resolving to
            ``PartitionSpec.UNCONSTRAINED`` is then an error.

        Raises:
          ShardingError: naming the path, shape, logical names, the rules tried and a fix.

        The table is walked in order (see :class:`Rules`): an entry applies to the
        still-unassigned dimension with its name when its mesh axes are unused,
        exist in ``mesh`` and divide the dimension. A name without a rule that is
        itself a mesh axis of ``mesh`` maps to that axis, so models annotated for
        Flax with mesh axis names keep working.

        >>> rules = Rules({"embed": "fsdp", "mlp": "model"})
        >>> rules.spec(("embed", "mlp"), shape=(8, 4), mesh={"fsdp": 2, "model": 2})
        P('fsdp', 'model')
        >>> rules.spec(("embed", "mpl"), path="layer/kernel")
        Traceback (most recent call last):
        ...
        nnx_shard.errors.ShardingError: logical axis 'mpl' of parameter 'layer/kernel' ...
        """
        shape = _check_shape(shape, path, names)
        names_t = self._check_names(names, shape, path)
        sizes = _mesh_sizes(mesh)
        has_mesh = mesh is not None
        head = describe(path, shape, names_t)

        def size(dim: int) -> int | None:
            return None if shape is None else int(shape[dim])

        out: list[Any] = [_UNASSIGNED] * len(names_t)
        taken: dict[str, int] = {}

        def claim(dim: int, placement: Placement) -> None:
            if placement is not UNCONSTRAINED:
                # Only a reused size-1 axis can be taken here: it shards nothing, drop it.
                placement = tuple(a for a in placement if a not in taken)
                for axis in placement:
                    taken[axis] = dim
            out[dim] = placement

        dims_of: dict[str, list[int]] = {}
        for dim, name in enumerate(names_t):
            if name is None:
                out[dim] = ()
            elif name is UNCONSTRAINED:
                out[dim] = UNCONSTRAINED
            elif isinstance(name, tuple):
                # Mesh axes given directly (Flax style) are fixed before any rule applies.
                why = self._why_not(name, size(dim), sizes, has_mesh, taken, lenient=True)
                if why is not None:
                    raise self._error(name, f"{name!r} (mesh axes given directly)", dim, head, sizes,
                                      [(name, why)])
                claim(dim, name)
            else:
                dims_of.setdefault(name, []).append(dim)

        tried: dict[tuple[int, int], str] = {}
        for index, (logical, placement) in enumerate(self._entries):
            for dim in dims_of.get(logical, ()):
                if out[dim] is not _UNASSIGNED:
                    continue
                why = self._why_not(placement, size(dim), sizes, has_mesh, taken, lenient=False)
                if why is None:
                    claim(dim, placement)
                    break
                tried[index, dim] = why

        for dim, name in enumerate(names_t):
            if out[dim] is _UNASSIGNED:
                claim(dim, self._leftover(name, dim, size(dim), head, sizes, has_mesh, taken, tried))

        if not allow_unconstrained and any(p is UNCONSTRAINED for p in out):
            dim = next(d for d, p in enumerate(out) if p is UNCONSTRAINED)
            name = names_t[dim]
            raise ShardingError(
                f"{head}: dimension {dim} ({name!r}) resolves to PartitionSpec.UNCONSTRAINED, "
                "which only an activation constraint can use: a stored array needs a definite "
                f"layout. Fix: give {name!r} a mesh axis or None for this array (e.g. rules | "
                f"{{{name!r}: None}}), and keep UNCONSTRAINED for a logical name only "
                "activations use, e.g. 'activation_embed'."
            )
        return PartitionSpec(*(_one(p) for p in out))

    def _leftover(
        self,
        name: str,
        dim: int,
        dim_size: int | None,
        head: str,
        sizes: dict[str, int],
        has_mesh: bool,
        taken: dict[str, int],
        tried: dict[tuple[int, int], str],
    ) -> Placement:
        """The placement of a named dimension no entry fitted in the table walk,
        or the ShardingError that explains why there is none."""
        if name in self._table:
            indexed = [(i, p) for i, (n, p) in enumerate(self._entries) if n == name]
            rule_txt = f"rule {name!r} -> {_fmt_value(self[name])}"
        elif has_mesh and name in sizes:
            indexed = [(-1, (name,))]
            rule_txt = f"{name!r} (a mesh axis, used directly)"
        else:
            close = difflib.get_close_matches(name, list(self._table), n=3, cutoff=0.6)
            known = short(", ".join(sorted(self._table)) or "none", 600).strip("'")
            mean = f" Did you mean {' or '.join(short(c) for c in close)}?" if close else ""
            raise ShardingError(
                f"logical axis {short(name)} of {head} has no rule.{mean} Known logical axes: "
                f"{known}. Fix: add a rule, e.g. rules | {{{short(name)}: 'model'}}, or "
                f"rules | {{{short(name)}: None}} to replicate it."
            )
        for _, p in indexed:
            # A size-1 mesh axis shards nothing: an entry blocked only by reusing one applies.
            if self._why_not(p, dim_size, sizes, has_mesh, taken, lenient=True) is None:
                return p
        failures = [
            (p, tried.get((i, dim)) or self._why_not(p, dim_size, sizes, has_mesh, taken,
                                                     lenient=True) or "")
            for i, p in indexed
        ]
        if self._indivisible == "replicate" and all(f.startswith("size ") for _, f in failures):
            warnings.warn(
                f"{head}: dimension {dim} (size {dim_size}) does not divide by its mesh axes "
                f"({rule_txt}); replicating it as Rules(indivisible='replicate') allows.",
                ShardingWarning,
                stacklevel=4,
            )
            return ()
        raise self._error(name, rule_txt, dim, head, sizes, failures)

    @staticmethod
    def _error(
        key: str | tuple[str, ...],
        rule_txt: str,
        dim: int,
        head: str,
        sizes: dict[str, int],
        failures: list[tuple[Placement, str]],
    ) -> ShardingError:
        detail = "; ".join(f"{_cand_txt(c)}: {f}" for c, f in failures)
        first = _cand_txt(failures[0][0])
        if any(f.startswith("not in the mesh") for _, f in failures):
            missing = sorted({a for c, _ in failures if c is not UNCONSTRAINED
                              for a in c if a not in sizes})
            return ShardingError(
                f"{rule_txt} names a mesh axis that is not in the mesh (axes: {_fmt_mesh(sizes)}) "
                f"for dimension {dim} of {head}: {detail}. Fix: build the mesh with axis "
                f"{' and '.join(repr(m) for m in missing)}, or map {key!r} to an existing axis "
                f"({_fmt_mesh(sizes)}) or None: rules | {{{key!r}: None}}."
            )
        if any(f.startswith("already used") for _, f in failures):
            return ShardingError(
                f"{rule_txt} cannot shard dimension {dim} of {head}: {detail}. A mesh axis can "
                "shard only one dimension of an array, and rules claim mesh axes in table "
                f"order. Fix: map {key!r} to another axis, or add None as a last candidate, "
                f"e.g. rules | {{{key!r}: [{first}, None]}}."
            )
        return ShardingError(
            f"{rule_txt} cannot shard dimension {dim} of {head}: {detail}. "
            f"Fix: make the dimension divisible, add None as a last candidate "
            f"(rules | {{{key!r}: [{first}, None]}}), or pass "
            "Rules(..., indivisible='replicate') to replicate such dimensions with a warning."
        )

    def _check_names(self, names: Any, shape: Any, path: str) -> tuple[Any, ...]:
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise ShardingError(
                f"{describe(path, shape, names)}: logical axes must be a tuple with one name "
                "(or None) per dimension. Fix: e.g. ('embed', 'mlp') instead of "
                f"{short(names)}."
            )
        names_t = tuple(names)
        for i, n in enumerate(names_t):
            ok = n is None or n is UNCONSTRAINED or (isinstance(n, str) and n) or (
                isinstance(n, tuple)
                and n
                and all(isinstance(a, str) and a for a in n)
                and len(set(n)) == len(n)
            )
            if not ok:
                raise ShardingError(
                    f"{describe(path, shape, names_t)}: entry {i} is {short(n)} "
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

    @staticmethod
    def _why_not(
        cand: Placement,
        dim_size: int | None,
        sizes: dict[str, int],
        has_mesh: bool,
        taken: dict[str, int],
        *,
        lenient: bool,
    ) -> str | None:
        """Why ``cand`` cannot shard the dimension now (``None``: it fits). ``lenient``
        lets an already used mesh axis of size 1 pass."""
        if cand is UNCONSTRAINED:
            return None
        for axis in cand:
            if has_mesh and axis not in sizes:
                return f"not in the mesh (mesh axis {axis!r})"
        for axis in cand:
            if axis in taken and not (lenient and has_mesh and sizes.get(axis) == 1):
                return f"already used by dimension {taken[axis]} (mesh axis {axis!r})"
        if dim_size is not None and has_mesh:
            prod = math.prod(sizes[a] for a in cand)
            if dim_size % prod:
                return f"size {dim_size} is not divisible by {prod}"
        return None


def _check_options(options: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    if not isinstance(options, Mapping):
        raise TypeError(f"Rules options must be a mapping of option name to a hashable value, "
                        f"got {type(options).__name__} {short(options)}. Fix: e.g. "
                        "Rules({...}, options={'attention': 'ring'}).")
    for key, value in options.items():
        if not isinstance(key, str):
            raise TypeError(f"Rules option names must be str, got {short(key)}. Fix: e.g. "
                            "options={'attention': 'ring'}.")
        if key not in _KNOWN_OPTIONS:
            close = difflib.get_close_matches(key, sorted(_KNOWN_OPTIONS), n=1, cutoff=0.6)
            mean = f" Did you mean {close[0]!r}?" if close else ""
            raise ShardingError(
                f"Rules option {short(key)} is not an option any operation reads (it would be "
                f"silently ignored).{mean} Known options: {', '.join(known_options())}. Fix: "
                "spell it as one of those; an op of your own declares its option by "
                "registering with nnx_shard.parallel.registry.register(ParallelOp(name, "
                "option))."
            )
        try:
            hash(value)
        except TypeError:
            raise TypeError(
                f"Rules option {key}={short(value)} is not hashable (rules are hashed into "
                "compiled programs' cache keys). Fix: use a tuple or a frozen dataclass."
            ) from None
    return tuple(sorted(options.items()))


def _cand_txt(c: Placement) -> str:
    if c is UNCONSTRAINED:
        return "P.UNCONSTRAINED"
    if not c:
        return "None"
    return repr(c[0]) if len(c) == 1 else repr(c)


def as_rules(rules: Rules | Mapping[str, RuleValue] | Iterable[tuple[str, RuleValue]]) -> Rules:
    """``rules`` itself when it is a ``Rules``, else a ``Rules`` built from it."""
    return rules if isinstance(rules, Rules) else Rules(rules)
