"""The :class:`Strategy` type and the registry presets join with :func:`preset`.

A strategy is data: the :class:`~nnx_shard.Rules` for parameters and activations,
an optional table for optimizer state, the mesh axes it expects, preferred axis
sizes and the collectives a train step under it contains. The presets themselves
are in :mod:`nnx_shard.strategies._presets`; users reach both through :mod:`nnx_shard.strategies`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh

from nnx_shard._annotate import path_str
from nnx_shard._axes import mesh_sizes
from nnx_shard._errors import ShardingError, UsageError, count
from nnx_shard._mesh import granules, make_mesh, parse_axes, variable_spec
from nnx_shard._parallel.schedule import Schedule, check_stack
from nnx_shard._rules import Rules

__all__ = ["LOGICAL", "OFFLOADS", "REPLICATED", "Strategy", "factorizations", "preset", "replicated"]

M = TypeVar("M", bound=nnx.Module)

# The preset name a model's own axis name most often plays the role of (for the example
# in the missing-rule error; the user decides).
_GUESS = {"fsdp": "embed", "tp": "mlp", "tensor": "mlp", "model": "mlp", "data": "batch",
          "sequence": "length", "seq": "length", "context": "length", "experts": "expert",
          "expert": "expert", "exp": "expert", "moe": "expert", "stage": "layers", "layer": "layers", "head": "heads",
          "q_heads": "heads", "ffn": "mlp", "hidden": "mlp", "d_model": "embed", "vocab": "vocab"}

#: Every logical name the presets give a rule (replicated unless a preset says otherwise),
#: the key/value cache's (:func:`nnx_shard.inference.generate`) last.
LOGICAL = ("batch", "length", "embed", "heads", "kv_heads", "kv", "mlp", "vocab", "layers",
           "expert", "cache_batch", "cache_length", "cache_kv_heads", "cache_head_dim")


#: What a strategy may keep in host memory between steps (:attr:`Strategy.offload`).
OFFLOADS = (None, "optimizer", "optimizer+params")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A named parallelism strategy: rules for parameters and activations, optional
    rules for optimizer state, and the mesh axes it expects.

    Attributes:
      name: the preset's name (one of :data:`nnx_shard.strategies.NAMES`).
      rules: logical names -> mesh axes for parameters, gradients, batches and activations.
      opt_rules: a separate table for optimizer state (``None``: as ``rules``).
      mesh_axes: the mesh axes the rules use, in mesh order.
      sizes: preferred sizes of every axis but the first (which takes the rest).
      collectives: the collectives a train step under this strategy contains.
      offload: what lives in host memory (``pinned_host``) between steps: ``None``
        (nothing), ``"optimizer"`` (the optimizer state) or ``"optimizer+params"``
        (the parameters too); see :meth:`with_offload`.
      across: the mesh axis laid across processes or slices, the slow links
        (``replica`` of ``strategies.get("hsdp")``); ``None``: none.
        :meth:`make_mesh` builds the hybrid mesh (``nnx_shard.make_mesh(...,
        across=...)``) and :meth:`mesh_for` gives that axis one place per process.

    >>> from nnx_shard.strategies import get
    >>> s = get("zero1")
    >>> s.rules["embed"] is None, s.opt_rules["embed"]
    (True, 'data')
    """

    name: str
    rules: Rules
    opt_rules: Rules | None
    mesh_axes: tuple[str, ...]
    sizes: tuple[int, ...] = ()
    collectives: tuple[str, ...] = ()
    offload: str | None = None
    across: str | None = None

    def __post_init__(self) -> None:
        if self.offload not in OFFLOADS:
            raise UsageError(
                f"strategy {self.name!r}: offload must be one of "
                f"{', '.join(map(repr, OFFLOADS))}, got {self.offload!r}. Fix: e.g. "
                f"strategies.get({self.name!r}).with_offload('optimizer').")

    def with_offload(self, offload: str | None) -> Strategy:
        """This strategy with ``offload`` (one of :data:`OFFLOADS`): the arrays it names
        are kept in host memory between steps and brought to the devices inside each
        compiled step, where it uses them.

        ``"optimizer"``: :func:`~nnx_shard.sharded_optimizer` builds the optimizer
        state in host memory (each array's usual ``NamedSharding`` with
        ``memory_kind="pinned_host"``). ``"optimizer+params"``:
        :func:`~nnx_shard.sharded_init` (and :func:`~nnx_shard.abstract_init`, for
        restore targets) put the parameters there too. The fused call
        (:func:`~nnx_shard.multistep`, :class:`~nnx_shard.Trainer`) reads where each
        array lives and keeps the host arrays in host memory in its K-step loop: each
        step moves them to device memory and back at its end, so the state stays in
        host memory between steps and calls; checkpoints save from it and restore into
        the target's memory. When they arrive: :class:`~nnx_shard.Trainer`'s steps move
        offloaded parameters in at the step's start (the forward pass reads them) and
        the optimizer state only once the gradients exist (an
        ``optimization_barrier`` ties its host-to-device copies to the gradients), so
        the device holds the optimizer state during the update, with the parameters
        and gradients, not during the forward and backward passes; a step of
        :func:`~nnx_shard.multistep` moves the whole offloaded state in at its start;
        ``Trainer``'s NaN guard checks the call's final state on device copies at the
        call's end (``guard="full"``: the state before the call too). Each move is of
        whole arrays, not layer by layer: the device's peak is the larger of the
        forward/backward phase and the update, which
        :func:`nnx_shard.planner.auto` and ``nnx-shard plan --offload`` count. On XLA
        CPU host and device memory are the same RAM and the moves compile to nothing,
        so a CPU compile cannot show the device peak.
        ``strategies.get(name, offload=...)`` is the same.

        >>> from nnx_shard.strategies import get
        >>> get("fsdp").with_offload("optimizer").offload
        'optimizer'
        >>> get("fsdp").with_offload("grads")
        Traceback (most recent call last):
        ...
        nnx_shard._errors.UsageError: strategy 'fsdp': offload must be one of None, 'optimizer', 'optimizer+params', got 'grads'. ...
        """
        return dataclasses.replace(self, offload=offload)

    def mesh_for(self, n_devices: int | None = None) -> dict[str, int]:
        """A default mesh shape over :attr:`mesh_axes` for ``n_devices`` (default: all):
        the first axis takes what the others' preferred :attr:`sizes` leave.

        A strategy with an :attr:`across` axis, over all the devices (``n_devices``
        left out) of a job whose devices fall into several processes or slices
        (:func:`~nnx_shard._mesh.granules`, equal in size): that axis gets one place
        per group and the other axes split each group's devices, the first of them
        taking the rest (hsdp: ``data`` = the devices of one process).

        >>> from nnx_shard.strategies import get
        >>> get("tp").mesh_for(8), get("tp").mesh_for(6), get("dp").mesh_for(8)
        ({'data': 2, 'model': 4}, {'data': 3, 'model': 2}, {'data': 8})
        """
        n = jax.device_count() if n_devices is None else count(
            n_devices, "mesh_for: n_devices", fix="a positive device count, e.g. 8")
        groups = granules() if self.across is not None and n_devices is None else [()]
        if len(groups) > 1 and len({len(g) for g in groups}) == 1:
            others = tuple(a for a in self.mesh_axes if a != self.across)
            pref = dict(zip(self.mesh_axes[1:], self.sizes, strict=True))
            inner = _split(n // len(groups), others, [pref[a] for a in others[1:]])
            return {a: len(groups) if a == self.across else inner[a] for a in self.mesh_axes}
        return _split(n, self.mesh_axes, self.sizes)

    def make_mesh(self, n_devices: int | None = None, *, axis_types: str = "auto") -> Mesh:
        """``nnx_shard.make_mesh(self.mesh_for(n_devices), axis_types=..., across=self.across)``.

        Auto axes by default, so models built from stock Flax layers train as
        written; ``axis_types="explicit"`` opts in to JAX's sharding-in-types.

        >>> from nnx_shard.strategies import get
        >>> mesh = get("ep").make_mesh()
        >>> dict(mesh.shape), mesh.axis_types
        ({'data': 2, 'expert': 4}, (Auto, Auto))

        With an :attr:`across` axis (hsdp's ``replica``) the mesh is hybrid: that axis
        spans the processes (or slices) of a ``jax.distributed`` job, the others stay
        within one; on one process it is the ordinary mesh.

        >>> dict(get("hsdp").make_mesh().shape)
        {'replica': 2, 'data': 4}
        """
        n = jax.device_count() if n_devices is None else n_devices
        return make_mesh(self.mesh_for(n_devices), axis_types=axis_types,
                         devices=jax.devices()[:n], across=self.across)

    # -- extending ----------------------------------------------------------------

    def with_rules(self, table: Mapping[str, Any] | None = None, *,
                   aliases: Mapping[str, str] | None = None) -> Strategy:
        """This strategy for a model that names its axes its own way, parameters and
        optimizer state alike (``rules`` and ``opt_rules`` are updated together).

        Each entry of ``table`` is either an **alias**, a model name mapped to one of
        the strategy's logical names (a string in :attr:`rules`, e.g. ``'embed'``):
        the name then resolves as that one does under every preset
        (:meth:`nnx_shard.Rules.alias`); or a **rule**, any other value (mesh axes,
        ``None``), laid over both tables as ``rules | {...}``. ``strategy | table``
        is the same. ``aliases`` are aliases only (an unknown target is an error).

        >>> from nnx_shard.strategies import get
        >>> s = get("zero1").with_rules({"fsdp": "embed", "tp": "mlp", "norm": None})
        >>> s.rules["fsdp"], s.opt_rules["fsdp"], s.opt_rules["tp"], s.rules["norm"]
        (None, 'data', None, None)
        >>> (get("fsdp_tp") | {"fsdp": "embed", "tp": "mlp"}).rules.spec(
        ...     ("fsdp", "tp"), shape=(16, 32), mesh={"data": 2, "model": 4})
        P('data', 'model')
        """
        table = {} if table is None else table
        if not isinstance(table, Mapping) or not isinstance(aliases or {}, Mapping):
            raise ShardingError(
                f"with_rules expects a mapping {{model name: logical name or mesh axes}}, "
                f"got {table!r}. Fix: e.g. strategy.with_rules({{'fsdp': 'embed', 'tp': "
                "'mlp'}).")
        named = {k: v for k, v in table.items() if isinstance(v, str) and v in self.rules}
        plain = {k: v for k, v in table.items() if k not in named}
        named |= dict(aliases or {})

        def extend(rules: Rules) -> Rules:
            out = (rules | plain if plain else rules).alias(named)
            # The gradients' table (zero1, zero2) speaks the same names as the others.
            grads = out.options.get("gradients")
            return out if grads is None else out.with_options(gradients=extend(grads))

        return dataclasses.replace(
            self, rules=extend(self.rules),
            opt_rules=None if self.opt_rules is None else extend(self.opt_rules))

    def __or__(self, table: Mapping[str, Any]) -> Strategy:
        if not isinstance(table, Mapping):
            return NotImplemented
        return self.with_rules(table)

    def _unnamed(self, state: Any) -> dict[str, str]:
        """Logical names the model's parameters use that no table of this strategy
        has a rule for (and that are not mesh axes): {name: first parameter path}."""
        tables = [self.rules] + ([self.opt_rules] if self.opt_rules is not None else [])
        out: dict[str, str] = {}
        for path, var in nnx.to_flat_state(state):
            if not isinstance(var, nnx.Variable):
                continue
            for name in var.get_metadata().get("out_sharding") or ():
                if (isinstance(name, str) and name not in out and name not in self.mesh_axes
                        and any(name not in t for t in tables)):
                    out[name] = path_str(path)
        return out

    def check_names(self, model: Any, mesh: Mesh | str | Mapping[str, int] | None = None) -> None:
        """Raises a ``ShardingError`` if ``model`` (concrete or abstract) names logical
        axes this strategy has no rule for, naming the alias fix (:meth:`with_rules`).
        :meth:`check` does this first.

        >>> from flax import nnx
        >>> from nnx_shard.strategies import get
        >>> init = nnx.with_partitioning(nnx.initializers.ones, ("fsdp", "tp"))
        >>> with nnx.use_eager_sharding(False):
        ...     m = nnx.eval_shape(lambda: nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0)))
        >>> get("dp").check_names(m)
        Traceback (most recent call last):
        ...
        nnx_shard._errors.ShardingError: strategy 'dp' cannot lay out this model: the model names logical axes 'fsdp', 'tp' ... Fix: ... strategy.with_rules({'fsdp': 'embed', 'tp': 'mlp'}) ...
        >>> get("dp").with_rules({"fsdp": "embed", "tp": "mlp"}).check_names(m)
        """
        state = model if isinstance(model, nnx.State) else nnx.state(model)
        unnamed = self._unnamed(state)
        if unnamed:
            shown = "" if mesh is None else " on mesh " + ", ".join(
                f"{k}={v}" for k, v in _sizes(mesh).items())
            raise self._alias_error(unnamed, shown)

    def _alias_error(self, unnamed: Mapping[str, str], shown: str) -> ShardingError:
        guess = {n: _GUESS.get(n.lower(), "embed") for n in unnamed}
        example = ", ".join(f"{n!r}: {t!r}" for n, t in guess.items())
        first, path = next(iter(unnamed.items()))
        return ShardingError(
            f"strategy {self.name!r} cannot lay out this model{shown}: the model "
            f"names logical axes {', '.join(map(repr, unnamed))} (e.g. {first!r} of parameter "
            f"{path!r}) that the strategy has no rule for; its names are "
            f"{', '.join(self.rules)}. Fix: map each model name onto the strategy's name "
            f"with the same role, strategy.with_rules({{{example}}}) (an alias resolves as "
            f"that name does under every preset; `nnx-shard explain --alias "
            f"{','.join(f'{n}={t}' for n, t in guess.items())}`), or replicate it, "
            f"strategy.with_rules({{{first!r}: None}})."
        )

    # -- validation --------------------------------------------------------------

    def _problems(self, state: Any, sizes: Mapping[str, int]) -> list[str]:
        out = []
        tables = [self.rules] + ([self.opt_rules] if self.opt_rules is not None else [])
        for path, var in nnx.to_flat_state(state):
            if not isinstance(var, nnx.Variable):
                continue
            for table in tables:
                try:
                    variable_spec(var, sizes, table, path_str(path))
                except ShardingError as e:
                    out.append(str(e))
                    break
        return out

    def suggest_mesh(self, model: Any, n_devices: int | None = None,
                     prefer: Mapping[str, int] | None = None) -> dict[str, int] | None:
        """A mesh shape over :attr:`mesh_axes` with ``n_devices`` on which every
        parameter of ``model`` (concrete or abstract) can be laid out, closest to
        ``prefer`` (default :meth:`mesh_for`); ``None`` if there is none.

        >>> from flax import nnx
        >>> from nnx_shard.strategies import get
        >>> from nnx_shard.models import Decoder, get_config
        >>> model = nnx.eval_shape(lambda: Decoder(get_config("tiny"), rngs=nnx.Rngs(0)))
        >>> get("tp").suggest_mesh(model, 8, prefer={"data": 1, "model": 8})
        {'data': 2, 'model': 4}
        """
        n = jax.device_count() if n_devices is None else int(n_devices)
        state = model if isinstance(model, nnx.State) else nnx.state(model)
        prefer = dict(prefer) if prefer else self.mesh_for(n)
        def cost(sizes: dict[str, int]) -> float:
            return sum(abs(math.log(sizes[a] / max(prefer.get(a, 1), 1))) for a in sizes)

        # Closest first (a stable sort keeps the enumeration's order among equals): the
        # first that fits is the answer, and each shape tried resolves every parameter.
        meshes = sorted((dict(zip(self.mesh_axes, shape, strict=True))
                         for shape in factorizations(n, len(self.mesh_axes))), key=cost)
        return next((sizes for sizes in meshes if not self._problems(state, sizes)), None)

    def check(self, model: Any, mesh: Mesh | str | Mapping[str, int]) -> None:
        """Raises a ``ShardingError`` if the mesh lacks one of :attr:`mesh_axes` or a
        parameter of ``model`` (concrete or abstract) cannot be laid out, naming the
        parameter and suggesting a mesh shape with the same devices that works.

        >>> from flax import nnx
        >>> from nnx_shard.strategies import get
        >>> from nnx_shard.models import Decoder, get_config
        >>> model = nnx.eval_shape(lambda: Decoder(get_config("tiny"), rngs=nnx.Rngs(0)))
        >>> get("tp").check(model, {"data": 1, "model": 8})
        Traceback (most recent call last):
        ...
        nnx_shard._errors.ShardingError: strategy 'tp' cannot lay out this model on mesh data=1, model=8: ... 'blocks/0/attn/k' ... Suggested mesh: {'data': 2, 'model': 4} ...
        """
        if not isinstance(model, nnx.State) and not nnx.graph.is_graph_node(model):
            raise UsageError(f"Strategy.check: model must be an nnx.Module (concrete or "
                             f"abstract) or its nnx.State, got {type(model).__name__} "
                             f"({model!r:.60}). Fix: e.g. nnx.eval_shape(lambda: MyModel(...))")
        sizes = _sizes(mesh)
        state = model if isinstance(model, nnx.State) else nnx.state(model)
        if isinstance(self.rules.options.get("pipeline"), Schedule):
            check_stack(state, sizes, self.rules.options["pipeline"])
        missing = [a for a in self.mesh_axes if a not in sizes]
        self.check_names(state, sizes)
        problems = self._problems(state, sizes) if not missing else []
        if missing:
            using = [
                path_str(p) for p, v in nnx.to_flat_state(state)
                if isinstance(v, nnx.Variable) and self._uses(v, missing)
            ]
            problems = [
                f"the mesh has no axis {' or '.join(map(repr, missing))}"
                + (f", which parameter {using[0]!r}" + (f" (and {len(using) - 1} more)"
                   if len(using) > 1 else "") + " is sharded over" if using else "")
            ]
        if not problems:
            return
        n = math.prod(sizes.values())
        # With an axis missing, the user's sizes say little about the intended
        # split: aim for the strategy's default shape rather than a size-1 axis.
        prefer = None if missing else {a: s for a, s in sizes.items() if a in self.mesh_axes}
        fits = self.suggest_mesh(state, n, prefer=prefer or None)
        shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        if fits is not None:
            spec = ",".join(f"{k}={v}" for k, v in fits.items())
            fix = (f"Suggested mesh: {fits} (nnx_shard.make_mesh({spec!r})) fits every "
                   f"parameter with the same {n} devices.")
        else:
            fix = (f"No mesh over {self.mesh_axes} with {n} devices fits this model: change "
                   "the model's sizes, the device count, or the strategy.")
        raise ShardingError(
            f"strategy {self.name!r} cannot lay out this model on mesh {shown}: "
            f"{problems[0].rstrip('.')}{more}. It expects mesh axes {self.mesh_axes}. {fix}"
        )

    def _uses(self, var: nnx.Variable, axes: list[str]) -> bool:
        names = var.get_metadata().get("out_sharding") or ()
        for table in (self.rules, self.opt_rules):
            if table is None:
                continue
            for name in names:
                if isinstance(name, str) and name in table:
                    cands = [c for c in table.candidates(name) if isinstance(c, tuple)]
                    if any(a in axes for c in cands for a in c):  # not UNCONSTRAINED
                        return True
        return False


def _split(n: int, axes: tuple[str, ...], prefs: Any) -> dict[str, int]:
    """``n`` devices over ``axes``: each but the first its preferred size (as far as
    what is left divides), the first the rest."""
    rest = n
    tail = []
    for pref in prefs:
        size = math.gcd(pref, rest)
        tail.append(size)
        rest //= size
    return dict(zip(axes, (rest, *tail), strict=True))


def _sizes(mesh: Mesh | str | Mapping[str, int]) -> dict[str, int]:
    """The axis sizes a check reads: text through :func:`~nnx_shard._mesh.parse_axes`
    (checking a layout needs no devices, so ``"data=16,model=4"`` is read on any
    machine; only a ``-1`` axis counts this process's devices)."""
    if isinstance(mesh, str):
        axes = parse_axes(mesh)
        return mesh_sizes(make_mesh(axes) if -1 in axes.values() else axes)
    return mesh_sizes(mesh if isinstance(mesh, Mapping) else make_mesh(mesh))


#: The largest device count plan and explain lay out (2**20: far past any machine; a
#: mesh of 10**40 devices would only make the report's arithmetic crawl).
MAX_PLAN_DEVICES = 1 << 20


def divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1`` in increasing order, from its prime factors (trial
    division up to sqrt(n): a billion takes microseconds, not a billion divisions).

    >>> divisors(12), divisors(1), divisors(97)
    ([1, 2, 3, 4, 6, 12], [1], [1, 97])
    """
    out, rest, p = [1], n, 2
    while p * p <= rest:
        power = 1
        while rest % p == 0:
            rest //= p
            power += 1
        out = [d * p**e for d in out for e in range(power)]
        p += 1 if p == 2 else 2
    if rest > 1:
        out = [d * m for d in out for m in (1, rest)]
    return sorted(out)


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every way to write ``n`` as an ordered product of ``k`` positive factors, in
    lexicographic order; built divisor by divisor, so the work is the number of
    answers, not ``n`` (nor the divisor count to the power ``k``).

    >>> factorizations(4, 2)
    [(1, 4), (2, 2), (4, 1)]
    """
    if k < 1:
        return [()] if n == 1 else []
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in divisors(n) for rest in factorizations(n // d, k - 1)]


def replicated(first: tuple[str, ...] = ()) -> Rules:
    """Every name of :data:`LOGICAL` replicated, in table order with ``first`` ahead.

    A preset's table is this with its own entries laid over it (``Rules.__or__``
    keeps each name's place), so every preset names every logical axis, and the
    table order, which decides who claims a contested mesh axis, is the same for all.

    >>> replicated(("expert",)).to_pairs()[:2]
    [('expert', None), ('batch', None)]
    """
    return Rules({name: None for name in (*first, *(n for n in LOGICAL if n not in first))})


#: :func:`replicated` in :data:`LOGICAL` order: the table every preset starts from.
REPLICATED = replicated()

#: Preset name -> the function that builds it, in the order presets were defined.
PRESETS: dict[str, Callable[..., Strategy]] = {}


def _distinct(name: str, **axes: str) -> None:
    for k, v in axes.items():
        if not isinstance(v, str) or not v:
            raise ShardingError(f"strategy {name!r}: mesh axis {k}={v!r} must be a non-empty "
                                f"string. Fix: e.g. {k}={k!r}.")
    if len(set(axes.values())) != len(axes):
        raise ShardingError(f"strategy {name!r}: mesh axes {axes} must be distinct. Fix: give "
                            "each a name of its own.")


def preset(build: Callable[..., Strategy]) -> Callable[..., Strategy]:
    """Registers ``build`` as the preset named after it: :data:`PRESETS` (and so
    ``strategies.NAMES``, ``strategies.get`` and the planner's search) know it from
    then on. ``build`` takes keyword-only arguments; those with a string default
    name mesh axes, which are checked to be non-empty and distinct before it runs.
    The :class:`Strategy` it returns must carry its name.

    Args:
      build: a function of keyword-only mesh-axis names returning the :class:`Strategy` named after
        it.

    >>> from nnx_shard.strategies import LOGICAL, Strategy, get, preset
    >>> @preset
    ... def solo(*, data: str = "data") -> Strategy:
    ...     rules = {name: None for name in LOGICAL} | {"batch": data}
    ...     return Strategy(name="solo", rules=rules, opt_rules=None, mesh_axes=(data,))
    >>> get("solo", data="d").rules["batch"]
    'd'
    >>> from nnx_shard.strategies._strategy import PRESETS
    >>> del PRESETS["solo"]                # the example's preset, unregistered again
    """
    name = build.__name__
    signature = inspect.signature(build)
    axis_params = [p for p in signature.parameters.values() if isinstance(p.default, str)]

    @functools.wraps(build)
    def make(**kwargs: Any) -> Strategy:
        bound = signature.bind(**kwargs)  # an unknown keyword raises TypeError here
        bound.apply_defaults()
        _distinct(name, **{p.name: bound.arguments[p.name] for p in axis_params})
        strategy = build(**kwargs)
        if strategy.name != name:
            raise ShardingError(f"preset {name!r} built a strategy named {strategy.name!r}. "
                                f"Fix: return Strategy(name={name!r}, ...).")
        return strategy

    PRESETS[name] = make
    return make
