"""Sharded initialization: build a model, and its optimizer, directly in their sharded layout.

The textbook recipe, ``jax.jit(init, out_shardings=...)``, only *places* the
outputs; how much memory the program needs on the way is up to the compiler, and
on JAX's default (Explicit) mesh axes it draws every random initializer at full
size on every device before slicing. Three choices keep every device at about
its own shard:

* The factory is traced under an Auto-typed copy of the mesh (same devices and
  axis names), and every Variable is constrained to its resolved sharding, so
  the partitioner pushes the layout back into the random number generation.
  The program still returns arrays on the caller's mesh, Explicit or Auto.
* On CPU, JAX lowers the threefry hash as a rolled loop whose two ``uint32``
  state arrays (plus a copy) live beside the output: three times the largest
  parameter shard in temporaries. Our init programs are lowered with the
  unrolled lowering that GPU and TPU use, which fuses into the output and needs
  no temporaries; the override goes with our lowering alone, so programs
  lowered elsewhere keep JAX's rules. The bits are the same (see
  ``_fused_threefry``).
* Flax's eager sharding is switched off while the factory runs, so models
  annotated with ``nnx.with_partitioning`` are resolved by our rules, never by
  Flax at Variable creation.

With ``jax_threefry_partitionable`` (JAX's default), values do not depend on
the layout: a sharded init is bitwise equal to the same factory on one device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, TypeAlias, TypeVar, runtime_checkable

import jax
import numpy as np
import optax
from flax import errors as flax_errors
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from nnx_shard import _compat
from nnx_shard import _optstate as optstate
from nnx_shard._annotate import path_str
from nnx_shard._errors import ShardingError, UsageError, sharding_types, short
from nnx_shard._mesh import make_mesh, mesh_str, shardings
from nnx_shard._offload import check_host_memory, host_where, is_host, offloads, on_device
from nnx_shard._rules import Rules, as_rules

__all__ = ["abstract_init", "sharded_init", "sharded_optimizer"]

M = TypeVar("M", bound=nnx.Module)

#: What every entry point takes as its rules: a rules table (or a mapping), or a strategy (its
#: ``rules`` and ``opt_rules``, checked against the model and mesh first).
RulesLike: TypeAlias = "Rules | Mapping[str, Any] | StrategyLike"


@runtime_checkable
class StrategyLike(Protocol):
    """What the entry points read of a :class:`~nnx_shard.strategies.Strategy`.

    Spelled as a protocol because the strategy module builds on this one: an
    import of it from here would be a cycle.
    """

    @property
    def name(self) -> str: ...

    @property
    def rules(self) -> Rules: ...

    @property
    def opt_rules(self) -> Rules | None: ...

    def check(self, model: Any, mesh: Any) -> None: ...


def tables(rules: Any, opt_rules: Any, caller: str) -> tuple[Rules, Rules | None, StrategyLike | None]:
    """``(rules, opt_rules, strategy or None)`` of what an entry point was given.

    A :class:`~nnx_shard.strategies.Strategy` brings both of its tables; a rules
    table is only that (its optimizer state is laid out by ``opt_rules``, else by
    the table itself): pass the strategy, or ``strategy.rules`` with
    ``opt_rules=strategy.opt_rules``.

    >>> from nnx_shard.strategies import get
    >>> r, o, s = tables(get("zero1"), None, "sharded_optimizer")
    >>> s.name, r["embed"], o["embed"], tables(get("zero1").rules, None, "x")[1]
    ('zero1', None, 'data', None)
    """
    if isinstance(rules, StrategyLike) and not isinstance(rules, Rules | Mapping):
        if opt_rules is not None:
            raise ShardingError(
                f"{caller}: opt_rules= given together with strategy {rules.name!r}, which "
                "brings its own optimizer-state rules. Fix: pass the strategy alone, or "
                "strategy.rules with opt_rules=... to override them.")
        return rules.rules, rules.opt_rules, rules
    table = as_rules(rules)
    if opt_rules is None:
        return table, None, None
    return table, as_rules(opt_rules), None


# Helpers
# ------------------------------------------------------------------------------


def auto_typed_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis typed Auto."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _on_mesh(tree: Any, mesh: Mesh) -> Any:
    # In device memory: the traced program computes there; only its outputs may be
    # placed in host memory (out_shardings), never a constraint inside it.
    return jax.tree.map(lambda s: NamedSharding(mesh, s.spec, memory_kind=on_device(s).memory_kind),
                        tree)


def _params_offloaded(tree: Any, strategy: Any) -> Any:
    """``tree`` of shardings with the parameters' in host memory where ``strategy``
    offloads them (``offload="optimizer+params"``)."""
    if not offloads(strategy)[1]:
        return tree
    check_host_memory("sharded_init", getattr(strategy, "offload", None))
    return host_where(tree, lambda var: isinstance(var, nnx.Param))


def _constrain(state: Any, tree_of_shardings: Any) -> Any:
    return jax.tree.map(jax.lax.with_sharding_constraint, state, tree_of_shardings)


def _fused_threefry() -> Any | None:
    """Lowering parameters that use JAX's generic (unrolled) threefry rule on CPU too.

    JAX registers a CPU-only rule that rolls threefry's five rounds into a
    ``while`` loop to save compile time; the loop keeps two ``uint32`` arrays the
    size of the parameter shard alive, so an init program holds two extra
    shard-sized arrays in temporaries on CPU (docs/architecture.md lists this
    site). The generic rule (what GPU and TPU use) computes
    the same bits with straight-line code that XLA fuses into the output.
    The override travels with our own lowering only (JAX's rule registry is not
    touched), so programs other threads lower at the same time keep JAX's rules.
    Both the parameters and the registry are private JAX (read in
    nnx_shard/_compat.py); if they move, we get ``None`` and JAX's default (correct,
    just more temporary memory), and tests/test_compat.py fails naming the jax version.
    """
    try:
        return _compat.threefry_lowering_parameters()
    except ImportError:  # pragma: no cover - JAX moved; tests/test_compat.py says so
        return None


def _lower(jitted: Any, *args: Any) -> Any:
    """``jitted.lower(*args)``, with the fused threefry lowering where available."""
    params = _fused_threefry()
    traced = jitted.trace(*args)
    return traced.lower() if params is None else traced.lower(_private_parameters=params)


@contextlib.contextmanager
def _trace_context(mesh: Mesh) -> Iterator[None]:
    # Eager sharding off: logical names in `out_sharding` are not mesh axes, and
    # layout is our job. The Auto mesh: under an Explicit mesh context, values
    # created without an input (random draws, zeros) are typed replicated and
    # get materialised whole before any constraint can slice them.
    with nnx.use_eager_sharding(False), jax.sharding.use_abstract_mesh(
        auto_typed_mesh(mesh).abstract_mesh
    ):
        yield


def _name(factory: Callable[..., Any]) -> str:
    return getattr(factory, "__qualname__", None) or repr(factory)


def _build(factory: Callable[[], Any], caller: str) -> nnx.Module:
    """Calls ``factory`` and checks that it gave a Module, with errors that say which."""
    try:
        with sharding_types(f"{caller}: the factory {_name(factory)}"):
            module = factory()
    except ShardingError:
        raise
    except Exception as e:
        if isinstance(e, flax_errors.TraceContextError):
            hint = (
                "The factory runs under JAX tracing, so it cannot update state created "
                "outside it: create the nnx.Rngs (and any Variable) inside the factory"
            )
        else:
            hint = "It is called with no arguments and must build the module"
        raise RuntimeError(
            f"{caller}: the factory {_name(factory)} raised {type(e).__name__}: {e}. "
            f"{hint}, e.g. lambda: MyModel(cfg, rngs=nnx.Rngs(0))."
        ) from e
    if not isinstance(module, nnx.Module):
        raise UsageError(
            f"{caller}: the factory {_name(factory)} returned {type(module).__name__}, not an "
            "nnx.Module. Fix: pass a zero-argument callable that builds the module, e.g. "
            "lambda: MyModel(cfg, rngs=nnx.Rngs(0)) (not the module itself, not a function of rngs)."
        )
    return module


def _check_factory(factory: Any, caller: str) -> None:
    if isinstance(factory, nnx.Module):
        raise UsageError(
            f"{caller}: factory is an already built {type(factory).__name__}; pass a factory "
            "instead. Fix: e.g. lambda: MyModel(cfg, rngs=nnx.Rngs(0)), so it is built sharded."
        )
    if not callable(factory):
        raise UsageError(f"{caller}: factory must be a zero-argument callable, got "
                         f"{short(factory, 80)}. Fix: e.g. lambda: MyModel(cfg, rngs=nnx.Rngs(0))")


def _split_shapes(fn: Callable[..., Any], *args: Any) -> tuple[nnx.GraphDef, Any]:
    """``nnx.split`` of what ``fn(*args)`` returns, by shape only (nothing is computed).

    Not ``nnx.eval_shape``: under a mesh context it would turn each Variable's
    ``out_sharding`` into a NamedSharding itself, failing on logical names.
    The graphdef is static data, so carrying it out of the trace is safe.
    """
    box: dict[str, nnx.GraphDef] = {}

    def shapes(*a: Any) -> Any:
        graphdef, state = nnx.split(fn(*a))
        box["graphdef"] = graphdef
        return state

    state = jax.eval_shape(shapes, *args)
    return box["graphdef"], state


def abstract_graph(factory: Callable[[], Any], mesh: Mesh, caller: str) -> tuple[nnx.GraphDef, Any]:
    _check_factory(factory, caller)

    def build() -> nnx.Module:
        with _trace_context(mesh):
            return _build(factory, caller)

    return _split_shapes(build)


def _with_shardings(state: Any, tree_of_shardings: Any) -> Any:
    def one(value: Any, sharding: NamedSharding) -> Any:
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            return value
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

    return jax.tree.map(one, state, tree_of_shardings)


def _is_abstract(state: Any) -> bool:
    leaves = jax.tree.leaves(state)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


# Model
# ------------------------------------------------------------------------------


def abstract_init(
    factory: Callable[[], M],
    mesh: Mesh | str | Mapping[str, int],
    rules: RulesLike,
) -> M:
    """The model ``factory`` would build, with ``jax.ShapeDtypeStruct`` leaves carrying
    the sharding each Variable resolves to; nothing is allocated.

    Use it as the restore target of a checkpoint, as the input of
    :func:`nnx_shard.explain`, or to validate rules: every ``ShardingError``
    (naming the parameter path) is raised here, before anything is compiled.

    Args:
      factory: a zero-argument callable that builds the module, e.g.
        ``lambda: MyModel(cfg, rngs=nnx.Rngs(0))``.
      mesh: a ``jax.sharding.Mesh`` or a spec for :func:`nnx_shard.make_mesh`.
      rules: the logical-to-mesh table, or a strategy (``ns.strategies.get("fsdp")``),
        whose :meth:`~nnx_shard.strategies.Strategy.check` runs first.

    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> init = ns.with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    >>> model = ns.abstract_init(lambda: nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0)),
    ...                          "data=4,model=2", {"embed": "data", "mlp": "model"})
    >>> k = model.kernel.get_value()
    >>> type(k).__name__, k.shape, k.sharding.spec
    ('ShapeDtypeStruct', (8, 16), P('data', 'model'))
    """
    mesh = make_mesh(mesh)
    table, _, strategy = tables(rules, None, "abstract_init")
    graphdef, state = abstract_graph(factory, mesh, "abstract_init")
    if strategy is not None:
        strategy.check(state, mesh)
    placed = _params_offloaded(shardings(state, mesh, table), strategy)
    return nnx.merge(graphdef, _with_shardings(state, placed))


def sharded_init(
    factory: Callable[[], M],
    mesh: Mesh | str | Mapping[str, int],
    rules: RulesLike,
) -> M:
    """Builds the model ``factory`` returns directly in its sharded layout.

    One compiled program creates every Variable with the ``NamedSharding`` its
    logical names resolve to under ``rules`` (replicated where unannotated);
    no device ever holds more than about its own shard, on meshes with Explicit
    (JAX's default) or Auto axes. Values are bitwise those of ``factory()`` on
    one device. Works for models annotated with :func:`nnx_shard.with_logical`,
    :func:`nnx_shard.logical_axes`, :func:`nnx_shard._annotate` (called inside
    the factory) or ``nnx.with_partitioning``, and for layers stacked with
    ``nnx.vmap``/``nnx.scan`` given ``transform_metadata={nnx.PARTITION_NAME: ...}``.

    A strategy with ``offload="optimizer+params"`` places the parameters
    (``nnx.Param``) in host memory (``pinned_host``, same layout); the rest of
    the model's state stays on the devices. The fused call (``ns.multistep``,
    ``ns.Trainer``) brings them to the devices inside its compiled step. It is
    the parameters themselves that move, not a separate float32 master copy:
    the model holds one copy of its weights (mixed precision reads them in the
    compute dtype inside the step, :class:`~nnx_shard.Precision`), so offloading
    that copy frees its whole size on the devices between steps and keeps
    checkpoints and restore as they are; a master-weight split would keep a
    second, device-resident copy. An eager call of the model outside the fused
    step mixes host parameters with device inputs, which JAX refuses ("memory_space
    of all inputs ... must be the same"); move them to the devices first:
    ``nnx.update(model, jax.tree.map(lambda x: jax.device_put(x,
    x.sharding.with_memory_kind("device")), nnx.state(model)))``.

    Args:
      factory: a zero-argument callable that builds the module, e.g.
        ``lambda: MyModel(cfg, rngs=nnx.Rngs(0))``. It is traced twice (once
        for shapes, once compiled), so it must not depend on side effects.
      mesh: a ``jax.sharding.Mesh`` or a spec for :func:`nnx_shard.make_mesh`.
      rules: the logical-to-mesh table, or a strategy (``ns.strategies.get("tp")``),
        whose :meth:`~nnx_shard.strategies.Strategy.check` runs first.

    Raises:
      ShardingError: a Variable cannot be laid out (raised before compiling).
      UsageError: ``factory`` is not callable or does not return an ``nnx.Module``.
      RuntimeError: ``factory`` raised; the original exception is chained.

    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> from nnx_shard import sharded_init
    >>> init = ns.with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    >>> model = sharded_init(lambda: nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0)),
    ...                      "data=4,model=2", {"embed": "data", "mlp": "model"})
    >>> model.kernel.get_value().sharding.spec, model.bias.get_value().sharding.spec
    (P('data', 'model'), P())
    >>> m = sharded_init(lambda: nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0)),
    ...                  "data=8", ns.strategies.get("fsdp"))
    >>> m.kernel.get_value().sharding.spec
    P('data', None)
    """
    graphdef, lowered = lower_init(factory, mesh, rules)
    return nnx.merge(graphdef, lowered.compile()())


def lower_init(
    factory: Callable[[], nnx.Module],
    mesh: Mesh | str | Mapping[str, int],
    rules: RulesLike,
) -> tuple[nnx.GraphDef, jax.stages.Lowered]:
    """The graphdef and the lowered (not yet compiled) init program of :func:`sharded_init`.

    Exposed so the memory figures of exactly the program ``sharded_init`` runs
    can be read (``lowered.compile().memory_analysis()``) by tests and benchmarks;
    ``nnx.merge(graphdef, lowered.compile()())`` is the model.

    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> init = ns.with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    >>> graphdef, lowered = lower_init(
    ...     lambda: nnx.Linear(64, 128, kernel_init=init, use_bias=False, rngs=nnx.Rngs(0)),
    ...     "data=8", {"embed": "data", "mlp": None})
    >>> m = lowered.compile().memory_analysis()
    >>> m.output_size_in_bytes + m.temp_size_in_bytes <= 64 * 128 * 4 // 8 + 64  # ~one shard
    True
    """
    mesh = make_mesh(mesh)
    table, _, strategy = tables(rules, None, "sharded_init")
    graphdef, abstract_state = abstract_graph(factory, mesh, "sharded_init")
    if strategy is not None:
        strategy.check(abstract_state, mesh)
    out_shardings = _params_offloaded(shardings(abstract_state, mesh, table), strategy)
    inner = _on_mesh(out_shardings, auto_typed_mesh(mesh))

    def init() -> Any:
        with _trace_context(mesh):
            return _constrain(nnx.state(_build(factory, "sharded_init")), inner)

    lowered = _lower(jax.jit(init, out_shardings=out_shardings))
    return graphdef, lowered


# Optimizer
# ------------------------------------------------------------------------------


def _opt_shardings(opt_state: Any, owners: Any, mesh: Mesh, rules: Rules) -> Any:
    """A NamedSharding for every optimizer-state Variable, as :mod:`nnx_shard._optstate`
    decides (the same decision :func:`nnx_shard.explain` reports)."""

    def make(path: str, leaf: Any, leaf_spec: optstate.StateLeafSpec) -> Any:
        sharding = NamedSharding(mesh, leaf_spec.spec)
        if not isinstance(leaf, nnx.Variable):
            return sharding
        # A Variable holding no array (multi_transform's MaskedNode) keeps its empty value,
        # so this tree has the state's structure.
        return leaf.replace(sharding) if hasattr(leaf.get_value(), "shape") else leaf

    return optstate.leaf_specs(opt_state, owners, mesh, rules, make=make)


def _check_same_mesh(state: Any, mesh: Mesh) -> None:
    """Raises a ShardingError naming an array laid out on another mesh than ``mesh``
    (other axes, sizes or devices): its layout cannot be read on ``mesh``."""
    elsewhere: list[tuple[str, Any, Any]] = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        sharding = getattr(value, "sharding", None)
        if not isinstance(sharding, NamedSharding) or isinstance(sharding.mesh, AbstractMesh):
            continue  # one device, or unplaced: jit lays it out on the way in
        theirs = sharding.mesh
        if dict(theirs.shape) != dict(mesh.shape) or not np.array_equal(
            theirs.device_ids, mesh.device_ids
        ):
            elsewhere.append((path_str(path), value.shape, sharding))
    if not elsewhere:
        return
    # Name a sharded parameter if there is one: its spec shows why the mesh matters.
    named, shape, sharding = max(elsewhere, key=lambda e: any(x is not None for x in e[2].spec))
    theirs = sharding.mesh
    if dict(theirs.shape) == dict(mesh.shape):
        where = (f"mesh {mesh_str(theirs)} over devices {np.ravel(theirs.device_ids).tolist()}, "
                 f"not {np.ravel(mesh.device_ids).tolist()}")
    else:
        where = f"mesh {mesh_str(theirs)}"
    more = f" (and {len(elsewhere) - 1} more parameters)" if len(elsewhere) > 1 else ""
    raise ShardingError(
        f"sharded_optimizer: parameter {named!r} (shape {tuple(shape)}) is laid out as "
        f"{sharding.spec} on {where}{more}, but mesh={mesh_str(mesh)!r} was given. The "
        "optimizer state is built on the mesh of its model. Fix: pass the model's mesh (the "
        "one given to sharded_init), or lay the model out on the new mesh first: "
        "ns.sharded_init(factory, mesh, rules), or "
        "ns.restore(directory, model=ns.abstract_init(factory, mesh, rules))."
    )


def _check_params_follow_rules(state: Any, expected: Any, mesh: Mesh) -> None:
    """With ``opt_rules=None`` the optimizer state is laid out by ``rules``; that is
    'like its param' only if the model was laid out by the same rules."""
    flat_state = nnx.to_flat_state(state)
    flat_expected = dict(nnx.to_flat_state(expected))
    wrong = []
    for path, var in flat_state:
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        actual = getattr(value, "sharding", None)
        want = flat_expected[path]
        want = want.get_value() if isinstance(want, nnx.Variable) else want
        if not isinstance(actual, NamedSharding):
            continue  # e.g. a single-device array: jit lays it out on the way in
        same_devices = actual.mesh.axis_names == mesh.axis_names and np.array_equal(
            actual.mesh.device_ids, mesh.device_ids
        )
        # Where the array lives (device or host memory, as offload puts it) is not its layout.
        want = want.with_memory_kind(actual.memory_kind)
        if not (same_devices and actual.is_equivalent_to(want, len(value.shape))):
            wrong.append(f"{path_str(path)}: model has {actual.spec}, rules give {want.spec}")
    if wrong:
        raise ShardingError(
            "sharded_optimizer: parameters are not laid out as `rules` says on this mesh, so "
            "their optimizer state would be laid out differently from them: "
            + "; ".join(wrong[:5])
            + (f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else "")
            + ". Fix: pass the rules and mesh the model was built with (sharded_init), or "
            "opt_rules=... to lay the optimizer state out on purpose."
        )


def sharded_optimizer(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh | str | Mapping[str, int],
    rules: RulesLike,
    wrt: Any = nnx.Param,
    *,
    opt_rules: Rules | Mapping[str, Any] | None = None,
) -> nnx.Optimizer:
    """An ``nnx.Optimizer`` whose state is built sharded, never whole on one device.

    Each piece of optimizer state that belongs to a parameter (e.g. Adam's
    ``mu`` and ``nu``) gets that parameter's sharding; scalars such as the step
    count are replicated. With ``opt_rules`` the state's logical names are
    resolved by that table instead, e.g. ZeRO-1: parameters replicated by
    ``rules``, optimizer state sharded by ``opt_rules``. A strategy passed as
    ``rules`` brings its own ``opt_rules``; its ``rules`` table alone is a plain
    table (``zero1.rules`` lays the state out like the parameters: pass ``zero1``,
    or ``opt_rules=zero1.opt_rules`` with it).

    A strategy with ``offload="optimizer"`` (or ``"optimizer+params"``) places
    the whole optimizer state in host memory (``NamedSharding(...).with_memory_kind(
    "pinned_host")``, each array in its usual layout), built there by the init
    program's outputs; the fused call (``ns.multistep``, ``ns.Trainer``) moves it to
    the devices inside the compiled step and back after it.

    Given an abstract model (from :func:`abstract_init`) it returns an abstract
    optimizer, with ``ShapeDtypeStruct`` leaves carrying the shardings (a
    checkpoint restore target), without allocating anything.

    Args:
      model: the model, laid out by ``rules`` on ``mesh`` (as :func:`sharded_init` makes it).
      tx: an optax transformation.
      mesh: a ``jax.sharding.Mesh`` or a spec for :func:`nnx_shard.make_mesh`.
      rules: the table the model was built with, or the strategy it was built with.
      wrt: which Variables the optimizer updates (as in ``nnx.Optimizer``).
      opt_rules: a separate table for the optimizer state (default: the strategy's
        ``opt_rules``, else ``rules``); not together with a strategy.

    Raises:
      ShardingError: optimizer state cannot be laid out, the model's arrays live on
        another mesh than ``mesh`` (the parameter and both meshes are named), or
        (without ``opt_rules``) the model's parameters are not laid out as ``rules`` says.
      UsageError: ``model`` is not an ``nnx.Module`` or ``tx`` not an optax transformation.

    Optimizer-state layouts are decided by :mod:`nnx_shard._optstate`, the same
    function :func:`nnx_shard.explain` reports with: state shaped like its
    parameter is laid out like it, a reduced statistic (Adafactor's factored
    rows/columns) keeps the layout of the dimensions it kept, the rest is replicated.

    >>> import optax
    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> from nnx_shard import sharded_init, sharded_optimizer
    >>> init = ns.with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    >>> rules = ns.Rules({"embed": "data", "mlp": "model"})
    >>> model = sharded_init(lambda: nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0)),
    ...                      "data=4,model=2", rules)
    >>> opt = sharded_optimizer(model, optax.adam(1e-3), "data=4,model=2", rules)
    >>> opt.opt_state[0].mu["kernel"].get_value().sharding.spec
    P('data', 'model')
    >>> zero1 = ns.strategies.get("zero1")
    >>> model = sharded_init(lambda: nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0)),
    ...                      "data=8", zero1)
    >>> opt = sharded_optimizer(model, optax.adam(1e-3), "data=8", zero1)
    >>> model.kernel.get_value().sharding.spec, opt.opt_state[0].mu["kernel"].get_value().sharding.spec
    (P(None, None), P('data', None))
    """
    if not isinstance(model, nnx.Module):
        raise UsageError(
            f"sharded_optimizer: model must be an nnx.Module, got {type(model).__name__}. "
            "Fix: sharded_optimizer(model, optax.adamw(1e-3), mesh, rules) with the model itself"
        )
    opt_graphdef, lowered, args = _lower_optimizer(model, tx, mesh, rules, wrt, opt_rules)
    if isinstance(lowered, Mapping):  # an abstract model: the abstract optimizer state
        return nnx.merge(opt_graphdef, lowered["abstract"])
    return nnx.merge(opt_graphdef, lowered.compile()(args))


def _lower_optimizer(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh | str | Mapping[str, int],
    rules: RulesLike,
    wrt: Any,
    opt_rules: Rules | Mapping[str, Any] | None,
) -> tuple[nnx.GraphDef, Any, Any]:
    """(optimizer graphdef, lowered init program, its arguments) of :func:`sharded_optimizer`;
    for an abstract model, the lowered slot holds ``{"abstract": state}`` instead."""
    optstate.check_transformation(tx, "sharded_optimizer")
    mesh = make_mesh(mesh)
    rules, own_opt_rules, strategy = tables(rules, opt_rules, "sharded_optimizer")
    o_rules = rules if own_opt_rules is None else own_opt_rules
    graphdef, state = nnx.split(model)
    _check_same_mesh(state, mesh)
    auto = auto_typed_mesh(mesh)
    # The params are seen through the Auto mesh, like everything else traced
    # here, so constraints on the state (which may differ from the params'
    # layout, as in ZeRO-1) propagate freely.
    abstract_in = jax.tree.map(lambda x: _auto_view(x, auto), state)

    def make(model_state: Any) -> nnx.Optimizer:
        with _trace_context(mesh):
            return nnx.Optimizer(nnx.merge(graphdef, model_state), tx, wrt=wrt)

    opt_graphdef, abstract_state = _split_shapes(make, abstract_in)
    owners = optstate.owner_shapes(nnx.state(model, wrt))
    out_shardings = _opt_shardings(abstract_state, owners, mesh, o_rules)
    if offloads(strategy)[0]:
        check_host_memory("sharded_optimizer", getattr(strategy, "offload", None))
        out_shardings = host_where(out_shardings, lambda _: True)
    if _is_abstract(state):
        return opt_graphdef, {"abstract": _with_shardings(abstract_state, out_shardings)}, None
    if own_opt_rules is None:
        params = nnx.state(model, wrt)
        _check_params_follow_rules(params, shardings(params, mesh, rules), mesh)
    inner = _on_mesh(out_shardings, auto)

    def init(model_state: Any) -> Any:
        # Parameters in host memory (offload="optimizer+params") are read on the device:
        # the state built from them (zeros like them) is computed there.
        model_state = jax.tree.map(
            lambda x, a: jax.device_put(x, on_device(a.sharding)) if is_host(a.sharding) else x,
            model_state, abstract_in)
        opt = make(model_state)
        with _trace_context(mesh):
            return _constrain(nnx.state(opt), inner)

    lowered = _lower(jax.jit(init, out_shardings=out_shardings), abstract_in)
    args = jax.tree.map(lambda x, a: rewrap(x, a.sharding), state, abstract_in)
    return opt_graphdef, lowered, args


def _auto_view(x: Any, auto: Mesh) -> jax.ShapeDtypeStruct:
    s = getattr(x, "sharding", None)
    spec = s.spec if isinstance(s, NamedSharding) else PartitionSpec()
    kind = s.memory_kind if isinstance(s, NamedSharding) else None
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=NamedSharding(auto, spec, memory_kind=kind))


def rewrap(x: Any, sharding: NamedSharding) -> Any:
    """``x`` viewed with ``sharding``: the same buffers when only the mesh's axis
    types differ (no copy), else a transfer."""
    s = getattr(x, "sharding", None)
    if s == sharding or isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(s, NamedSharding) and s.spec == sharding.spec and np.array_equal(
        s.mesh.device_ids, sharding.mesh.device_ids
    ):
        return jax.make_array_from_single_device_arrays(
            x.shape, sharding, [shard.data for shard in x.addressable_shards]
        )
    return jax.device_put(x, sharding)
