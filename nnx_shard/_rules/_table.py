"""The ``Rules`` class: a frozen, ordered table of logical name -> mesh axes, its
constructors, merges and printed forms; resolution is :mod:`nnx_shard._rules._resolve`."""

from __future__ import annotations

import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from jax.sharding import PartitionSpec

from nnx_shard._errors import ShardingError, short
from nnx_shard._rules._files import file_value as _file_value
from nnx_shard._rules._files import read_table
from nnx_shard._rules._options import check_options as _check_options
from nnx_shard._rules._resolve import resolve
from nnx_shard._rules._values import (
    UNCONSTRAINED,
    Indivisible,
    LogicalNames,
    Placement,
    RuleValue,
)
from nnx_shard._rules._values import check_logical as _check_logical
from nnx_shard._rules._values import fmt_value as _fmt_value
from nnx_shard._rules._values import one_placement as _one
from nnx_shard._rules._values import pair_placement as _pair_placement
from nnx_shard._rules._values import placement_candidates as _candidates
from nnx_shard._rules._values import public_value as _public_value


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
        ``PartitionSpec.UNCONSTRAINED`` (activations only), or
        :class:`~nnx_shard.Fallbacks` of those: ordered candidates of that name,
        entered consecutively. A plain list is refused (Flax and MaxText read it
        as a product of mesh axes): write a tuple for a product, ``Fallbacks``
        for fallbacks. A logical name repeated in a sequence of pairs adds its
        values as further entries at that place in the table. An empty string
        is an error (use ``None``). Tables written as Flax and MaxText write
        them, a list being a product, load with :meth:`from_pairs`.
      indivisible: what to do when a dimension does not divide by its mesh axes
        and no other entry fits: ``"error"`` (default) raises a
        ``ShardingError``; ``"replicate"`` replicates that dimension and emits a
        ``ShardingWarning``.
      options: execution options a strategy passes to the model's sharding-aware
        operations along with the table (e.g. how attention runs when the
        sequence is split); read under :func:`nnx_shard.use` with
        :func:`nnx_shard._mesh.option`. Values must be hashable. See
        :meth:`with_options`.

    >>> from nnx_shard import Rules
    >>> from nnx_shard._rules import Fallbacks
    >>> rules = Rules({"batch": "data", "embed": None, "mlp": Fallbacks("model", None)})
    >>> rules.spec(("embed", "mlp"), shape=(16, 32), mesh={"data": 2, "model": 4})
    P(None, 'model')
    >>> rules.spec(("embed", "mlp"), shape=(16, 30), mesh={"data": 2, "model": 4})
    P(None, None)
    >>> (rules | {"embed": "data"})["embed"]
    'data'
    >>> Rules([("mlp", "model"), ("mlp", "data")])["mlp"]
    Fallbacks('model', 'data')

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

        >>> from nnx_shard import Rules
        >>> rules = Rules.from_pairs([
        ...     ["batch", "data"],
        ...     ["vocab", ["tensor", "autoregressive"]],   # a product, as in MaxText
        ...     ["embed", ["fsdp", "tensor"]],
        ...     ["embed", "fsdp"],                         # embed's next candidate
        ...     ["norm", []],                              # replicated
        ... ])
        >>> rules["vocab"], rules["embed"], rules["norm"]
        (('tensor', 'autoregressive'), Fallbacks(('fsdp', 'tensor'), 'fsdp'), None)
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

        >>> from nnx_shard import Rules
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

        >>> from nnx_shard import Rules
        >>> Rules({"batch": "data"}).with_options(attention="ring").options["attention"]
        'ring'
        """
        return types.MappingProxyType(dict(self._options))

    def with_options(self, **options: Any) -> Rules:
        """A copy with ``options`` merged into :attr:`options` (``None`` removes one).

        >>> from nnx_shard import Rules
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

        >>> from nnx_shard import Rules
        >>> from nnx_shard._rules import Fallbacks
        >>> Rules({"mlp": Fallbacks("model", None)}).candidates("mlp")
        (('model',), ())
        """
        return self._table[name]

    def to_pairs(self) -> list[tuple[str, Any]]:
        """The entries in table order, as ``(logical, mesh)`` pairs: a mesh axis name,
        a tuple (product), ``None`` or ``PartitionSpec.UNCONSTRAINED``. The result is
        a table for :meth:`from_pairs`, ``Rules(...)`` and Flax linen alike.

        >>> from nnx_shard import Rules
        >>> Rules([("mlp", "model"), ("embed", ("data", "fsdp")), ("mlp", None)]).to_pairs()
        [('mlp', 'model'), ('embed', ('data', 'fsdp')), ('mlp', None)]
        """
        return [(name, _one(p)) for name, p in self._entries]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (candidate lists as lists, axis products as lists in a list).

        Candidates are grouped by name; when entries of different names interleave,
        :meth:`to_pairs` keeps the exact table order. ``PartitionSpec.UNCONSTRAINED``
        stays that object (JSON has no spelling for it).

        >>> from nnx_shard import Rules
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
          ``null`` or ``""`` (TOML has no null) replicates; an array is refused
          as ambiguous (write products and fallbacks in the pairs layout).

        An optional top-level ``indivisible`` sets the policy. YAML needs PyYAML
        (``pip install nnx_shard[yaml]``)::

            # rules.toml, pairs                       # rules.toml, table
            logical_axis_rules = [                    [rules]
              ["batch", "data"],                      batch = "data"
              ["vocab", ["tensor", "expert"]],        mlp = "model"
              ["mlp", "model"], ["mlp", ""],          norm = ""
            ]

        >>> from nnx_shard import Rules
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "r.toml")
        >>> _ = open(p, "w").write('[rules]\\nbatch = "data"\\nmlp = "model"\\n')
        >>> Rules.from_file(p)
        Rules({'batch': 'data', 'mlp': 'model'})
        >>> _ = open(p, "w").write('logical_axis_rules = [["batch", "data"], '
        ...                        '["vocab", ["tensor", "expert"]], ["mlp", "model"], ["mlp", ""]]')
        >>> Rules.from_file(p)
        Rules({'batch': 'data', 'vocab': ('tensor', 'expert'), 'mlp': Fallbacks('model', None)})
        """
        where, table, indivisible = read_table(path)
        try:
            if isinstance(table, list):
                return cls.from_pairs(table, indivisible=indivisible)
            return cls({k: _file_value(v, k) for k, v in table.items()}, indivisible=indivisible)
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

        >>> from nnx_shard import Rules
        >>> rules = Rules({"embed": "fsdp", "mlp": "model"})
        >>> rules.spec(("embed", "mlp"), shape=(8, 4), mesh={"fsdp": 2, "model": 2})
        P('fsdp', 'model')
        >>> rules.spec(("embed", "mpl"), path="layer/kernel")
        Traceback (most recent call last):
        ...
        nnx_shard._errors.ShardingError: logical axis 'mpl' of parameter 'layer/kernel' ...
        """
        return resolve(self._entries, self._table, self._indivisible, names, shape, mesh,
                       path=path, allow_unconstrained=allow_unconstrained)


def as_rules(rules: Rules | Mapping[str, RuleValue] | Iterable[tuple[str, RuleValue]]) -> Rules:
    """``rules`` itself when it is a ``Rules``, else a ``Rules`` built from it."""
    return rules if isinstance(rules, Rules) else Rules(rules)
