"""``explain``: a per-variable sharding and memory report, computed without allocating."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from nnx_shard import _optstate as optstate
from nnx_shard._annotate import SOURCE_KEY, logical_names, path_str
from nnx_shard._axes import mesh_sizes, sizes_str
from nnx_shard._init import RulesLike, tables
from nnx_shard._mesh import as_state, bytes_per_device, make_mesh, nbytes, variable_spec
from nnx_shard._rules import Rules

__all__ = ["Report", "Row", "explain"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One variable of the report."""

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    names: tuple[Any, ...] | None
    spec: PartitionSpec
    total_bytes: int
    bytes_per_device: int
    source: str  # "annotation", "pattern" or "default (replicated)"
    group: str = "params"  # "params" or "optimizer"


def fmt_bytes(n: float) -> str:
    """Human-readable bytes (powers of 1024)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def spec_txt(spec: PartitionSpec) -> str:
    return "P(" + ", ".join(repr(e) if e is not None else "None" for e in spec) + ")"


@dataclasses.dataclass(frozen=True)
class Report:
    """The result of :func:`explain`: rows plus totals, printable as text or Markdown.

    Args:
      rows: one row per Variable (what :func:`explain` builds).
      mesh_shape: the mesh's axis sizes.
    """

    rows: tuple[Row, ...]
    mesh_shape: Mapping[str, int]

    def _sum(self, group: str, attr: str) -> int:
        return sum(getattr(r, attr) for r in self.rows if r.group == group)

    @property
    def total_bytes(self) -> int:
        """Bytes of all model variables, unsharded."""
        return self._sum("params", "total_bytes")

    @property
    def param_bytes_per_device(self) -> int:
        """Bytes of model variables each device holds."""
        return self._sum("params", "bytes_per_device")

    @property
    def opt_total_bytes(self) -> int:
        """Bytes of optimizer state, unsharded (0 when no optimizer was given)."""
        return self._sum("optimizer", "total_bytes")

    @property
    def opt_bytes_per_device(self) -> int:
        """Bytes of optimizer state each device holds."""
        return self._sum("optimizer", "bytes_per_device")

    @property
    def replicated(self) -> tuple[Row, ...]:
        """Rows whose spec shards nothing."""
        return tuple(r for r in self.rows if all(e is None for e in r.spec))

    def _table(self) -> tuple[list[str], list[list[str]]]:
        head = ["path", "shape", "dtype", "logical", "spec", "total", "per device", "source"]
        body = [
            [
                (r.path if r.group == "params" else f"[opt] {r.path}"),
                str(r.shape),
                r.dtype,
                "-" if r.names is None else str(r.names),
                spec_txt(r.spec),
                fmt_bytes(r.total_bytes),
                fmt_bytes(r.bytes_per_device),
                r.source,
            ]
            for r in self.rows
        ]
        return head, body

    def _totals(self) -> list[str]:
        mesh = sizes_str(self.mesh_shape, ", ")
        lines = [
            f"mesh: {mesh}",
            f"model variables: {fmt_bytes(self.total_bytes)} total, "
            f"{fmt_bytes(self.param_bytes_per_device)} per device",
        ]
        if any(r.group == "optimizer" for r in self.rows):
            lines.append(
                f"optimizer state: {fmt_bytes(self.opt_total_bytes)} total, "
                f"{fmt_bytes(self.opt_bytes_per_device)} per device"
            )
        return lines

    def __str__(self) -> str:
        head, body = self._table()
        widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*head), "  ".join("-" * w for w in widths)]
        lines += [fmt.format(*row) for row in body]
        lines = [line.rstrip() for line in lines]
        return "\n".join([*lines, "", *self._totals()])

    def to_markdown(self) -> str:
        """The report as a Markdown table followed by totals.

        >>> from flax import nnx
        >>> from nnx_shard import Rules, explain, make_mesh
        >>> r = explain(nnx.Linear(2, 4, rngs=nnx.Rngs(0)), make_mesh("data=8"), Rules({}))
        >>> print(r.to_markdown().splitlines()[0])
        | path | shape | dtype | logical | spec | total | per device | source |
        """
        head, body = self._table()
        esc = [[c.replace("|", "\\|") for c in row] for row in body]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in esc]
        return "\n".join([*lines, "", *(f"- {t}" for t in self._totals())])


def _row(path: str, kind: str, value: Any, names: Any, spec: PartitionSpec, source: str,
         mesh: Any, group: str) -> Row | None:
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        return None  # e.g. a non-array Variable value; nothing to place
    shape = tuple(int(d) for d in value.shape)
    return Row(
        path=path,
        kind=kind,
        shape=shape,
        dtype=str(value.dtype),
        names=names,
        spec=spec,
        total_bytes=nbytes(shape, value.dtype),
        bytes_per_device=bytes_per_device(shape, value.dtype, spec, mesh),
        source=source,
        group=group,
    )


def layout_rows(state: Any, mesh: Any, rules: Rules) -> list[Row]:
    leaves = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]
    rows = []
    for p, var in leaves:
        path = path_str(p)
        if isinstance(var, nnx.Variable):
            names = logical_names(var, path)
            spec = variable_spec(var, mesh, rules, path)
            source = ("default (replicated)" if names is None
                      else var.get_metadata().get(SOURCE_KEY, "annotation"))
            row = _row(path, type(var).__name__, var.get_value(), names, spec, source, mesh,
                       "params")
        else:
            row = _row(path, "array", var, None, PartitionSpec(), "default (replicated)", mesh,
                       "params")
        if row is not None:
            rows.append(row)
    return rows


def _opt_rows(opt_state: Any, owners: Any, mesh: Any, rules: Rules) -> list[Row]:
    """Rows of the optimizer state, laid out by the very function sharded_optimizer uses."""
    rows: list[Row] = []

    def make(path: str, leaf: Any, leaf_spec: optstate.StateLeafSpec) -> None:
        var = isinstance(leaf, nnx.Variable)
        row = _row(path, type(leaf).__name__ if var else "array",
                   leaf.get_value() if var else leaf, leaf_spec.names, leaf_spec.spec,
                   leaf_spec.source, mesh, "optimizer")
        if row is not None:
            rows.append(row)

    optstate.leaf_specs(opt_state, owners, mesh, rules, prefix="opt_state/", make=make)
    return rows


def explain(
    model: Any,
    mesh: Mesh | AbstractMesh | str | Mapping[str, int],
    rules: RulesLike,
    optimizer: optax.GradientTransformation | None = None,
    *,
    wrt: Any = nnx.Param,
    opt_rules: Rules | Mapping[str, Any] | None = None,
) -> Report:
    """Explains how every variable of ``model`` is laid out on ``mesh`` by ``rules``.

    Works on concrete models and on abstract ones (``nnx.eval_shape`` or
    ``nnx_shard.abstract_init``) without allocating anything. When an optax
    ``optimizer`` is given, its state is derived abstractly (``jax.eval_shape``
    of ``optimizer.init``) and reported too, laid out by ``opt_rules``
    (default: the strategy's, else ``rules``), the way ``nnx.Optimizer`` stores it.
    ``rules`` may be a strategy (``ns.strategies.get("zero1")``): its two tables.

    Raises ``ShardingError`` exactly where sharding the model would, and
    ``UsageError`` when ``model`` is not a Module/State/abstract model or
    ``optimizer`` not an optax transformation. Optimizer-state layouts come from
    the function :func:`nnx_shard.sharded_optimizer` builds them with
    (:mod:`nnx_shard._optstate`), so the bytes reported are the bytes it allocates.
    A ``jax.sharding.AbstractMesh`` plans a mesh of any size with no devices.

    Args:
      model: a module, concrete or abstract (``nnx.eval_shape``, ``ns.abstract_init``).
      mesh: a ``Mesh``, an ``AbstractMesh`` or a spec for :func:`nnx_shard.make_mesh`.
      rules: the logical-to-mesh table, or a strategy (its rules and optimizer-state rules).
      optimizer: an optax transformation whose state is reported too (``None``: none).
      wrt: the Variables the optimizer updates (as ``nnx.Optimizer(wrt=)``).
      opt_rules: the optimizer state's rules (default: the strategy's, else ``rules``).

    >>> import jax
    >>> import optax
    >>> from flax import nnx
    >>> from nnx_shard import Rules, explain
    >>> from nnx_shard._annotate import with_logical
    >>> init = with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    >>> model = nnx.eval_shape(lambda: nnx.Linear(64, 128, kernel_init=init, rngs=nnx.Rngs(0)))
    >>> report = explain(model, "data=8", Rules({"embed": "data", "mlp": None}), optax.adam(1e-3))
    >>> report.total_bytes, report.param_bytes_per_device, report.opt_bytes_per_device
    (33280, 4608, 9220)
    >>> print(str(report).splitlines()[2])
    bias    (128,)     float32  -                  P()            512 B      512 B      default (replicated)
    >>> big = jax.sharding.AbstractMesh((64,), ("data",))   # more devices than exist
    >>> explain(model, big, Rules({"embed": "data", "mlp": None})).param_bytes_per_device
    1024
    """
    state = as_state(model, "explain", "model")
    if optimizer is not None:
        optstate.check_transformation(optimizer, "explain", "optimizer")
    if not isinstance(mesh, AbstractMesh):
        mesh = make_mesh(mesh)
    rules, own_opt_rules, _ = tables(rules, opt_rules, "explain")
    rows = layout_rows(state, mesh, rules)
    if optimizer is not None:
        o_rules = rules if own_opt_rules is None else own_opt_rules
        # What nnx.Optimizer(model, optimizer, wrt=wrt) initialises, by shape only.
        params = state if isinstance(model, nnx.State) else nnx.state(model, wrt)
        opt_state = jax.eval_shape(optimizer.init, params)
        rows += _opt_rows(opt_state, optstate.owner_shapes(params), mesh, o_rules)
    return Report(rows=tuple(rows), mesh_shape=mesh_sizes(mesh))

