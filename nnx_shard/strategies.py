"""Parallelism strategies as rules presets: a change of table, never of model code.

Each preset returns a :class:`Strategy`: the :class:`~nnx_shard.Rules` for
parameters and activations, a separate table for optimizer state where the
strategy needs one (ZeRO-1), the mesh axes it expects and a default mesh shape.
Models annotated with the logical names ``batch``, ``length``, ``embed``,
``heads``, ``kv_heads``, ``kv``, ``mlp``, ``vocab``, ``layers`` and ``expert`` (as
:class:`nnx_shard.models.Transformer` and :class:`nnx_shard.models.Llama` are) run
under any of them. ``kv_heads`` (grouped-query attention's key/value heads) follows
``heads`` onto the model axis where it divides it, else it is replicated. The key/value
cache of :func:`nnx_shard.models.generate` is named ``cache_batch`` (as ``batch``),
``cache_kv_heads`` (as ``kv_heads``), ``cache_length`` (over ``context`` under cp and
fsdp_cp, else replicated) and ``cache_head_dim`` (replicated).

=========  ===============  ================================================  ==========================================
name       mesh axes        sharded                                           collectives per train step (XLA CPU)
=========  ===============  ================================================  ==========================================
dp         data             batch                                             all-reduce over data (gradients)
zero1      data             batch; optimizer state over ``embed``             all-reduce over data (gradients),
                                                                              all-gather over data (updated parameters)
fsdp       data             batch; params, grads, opt. state over ``embed``   all-gather over data (parameters),
                                                                              all-reduce over data (gradients) [1]_
tp         data, model      batch; heads, mlp, vocab over model (Megatron)    all-reduce over model (row-parallel
                                                                              outputs), all-gather over model (the
                                                                              embedding table), all-reduce over data
fsdp_tp    data, model      fsdp over data and tp over model (2D)             all of fsdp's and tp's
sp         data, model      tp, plus ``length`` over model outside            all-gather over model (sequence),
                            attention and MLP                                 all-reduce over model (row-parallel
                                                                              outputs) [1]_, all-reduce over data
ep         data, expert     batch over data x expert; experts over expert     all-to-all over expert (token dispatch
                                                                              and return), all-gather over expert,
                                                                              all-reduce (gradients)
async_tp   data, model      tp's parameters; sp's activations; projections    collective-permute over model (ring
                            as collective matmuls (option collective_matmul)  steps in place of the projections'
                                                                              all-gather / all-reduce), all-gather
                                                                              over model (embedding table, logits'
                                                                              input), all-reduce over model (logits,
                                                                              norm gradients), all-reduce over data
pp         stage, data      ``layers`` (the stacked blocks) over stage,       collective-permute over stage (between
                            batch over data; GPipe, or circular with          stages), all-reduce over stage (the
                            ``repeats=V`` (:mod:`nnx_shard.pipeline`)         activations in and out), all-reduce over
                                                                              data; circular adds all-to-all over stage
                                                                              (the stack's re-layout) [2]_
pp_fsdp    stage, data      pp, plus params over data along ``embed``         pp's and fsdp's; XLA also moves the
                                                                              embedding and head between groups
                                                                              (all-to-all, permutes, an all-gather
                                                                              over stage of the head's weight)
pp_tp      stage, data,     pp, plus tp over model inside each stage          pp's and tp's
           model
cp         data, context    batch; ``length`` over context everywhere, ring   collective-permute over context (ring
                            attention (option ``attention="ring"``)           K/V blocks, zig-zag reorder),
                                                                              all-reduce over data and over context
                                                                              (gradients), all-gather over context
                                                                              (the position embedding's gradient)
fsdp_cp    data, context    fsdp over data and cp over context                all of fsdp's and cp's
=========  ===============  ================================================  ==========================================

The collectives are those the compiled train step of the reference transformer
contains on 8 CPU devices with Explicit mesh axes, where the model spells out
each layout change (tests/test_strategies.py reads them, with the mesh axes
each runs over, from the HLO with :func:`compiled_collectives`). On Auto axes,
the default of :meth:`Strategy.make_mesh`, XLA's partitioner chooses them and
may use others for the same layouts (e.g. an all-to-all or collective-permute
where a layout changes).

.. [1] The textbook collective here is a reduce-scatter (each device keeps only
   its slice of the summed gradients, or of the sequence under sp). On XLA's
   CPU backend the partitioned train step contains the equivalent all-reduce
   followed by a local slice instead, so that is what the CPU HLO and
   :attr:`Strategy.collectives` show. Backends that rewrite that pattern into
   a reduce-scatter may show one instead.

.. [2] The pipeline presets run only on Auto axes (tests/test_pipeline.py reads
   their collectives there), with a stacked layer axis and the trainer's
   ``microbatches=M`` (at least the number of stages).

>>> import nnx_shard as ns
>>> s = ns.strategies.get("fsdp_tp")
>>> s.mesh_axes, s.mesh_for(8)
(('data', 'model'), {'data': 4, 'model': 2})
>>> s.rules["embed"], s.rules["heads"]
('data', 'model')
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from nnx_shard.annotate import path_str
from nnx_shard.axes import mesh_sizes
from nnx_shard.errors import ShardingError
from nnx_shard.hlo import KINDS, Collective, compiled_collectives  # noqa: F401 (re-exported)
from nnx_shard.init import _abstract, abstract_init, sharded_init, sharded_optimizer
from nnx_shard.mesh import make_mesh, variable_spec
from nnx_shard.pipeline import Schedule, check_stack
from nnx_shard.report import Report, explain
from nnx_shard.rules import Rules

__all__ = [
    "NAMES", "Collective", "Strategy", "async_tp", "auto", "compiled_collectives", "cp", "dp", "ep",
    "fsdp", "fsdp_cp", "fsdp_tp", "get", "pp", "pp_fsdp", "pp_tp", "sp", "tp", "zero1",
]

M = TypeVar("M", bound=nnx.Module)

NAMES: tuple[str, ...] = ("dp", "zero1", "fsdp", "tp", "fsdp_tp", "sp", "ep", "async_tp", "cp",
                          "fsdp_cp", "pp", "pp_fsdp", "pp_tp")

#: Every logical name the presets give a rule (replicated unless a preset says otherwise),
#: the key/value cache's (nnx_shard.models.generate) last.
LOGICAL = ("batch", "length", "embed", "heads", "kv_heads", "kv", "mlp", "vocab", "layers",
           "expert", "cache_batch", "cache_length", "cache_kv_heads", "cache_head_dim")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A named parallelism strategy: rules for parameters and activations, optional
    rules for optimizer state, and the mesh axes it expects.

    Attributes:
      name: the preset's name (one of :data:`NAMES`).
      rules: logical names -> mesh axes for parameters, gradients, batches and activations.
      opt_rules: a separate table for optimizer state (``None``: as ``rules``).
      mesh_axes: the mesh axes the rules use, in mesh order.
      sizes: preferred sizes of every axis but the first (which takes the rest).
      collectives: the collectives a train step under this strategy contains.

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

    def mesh_for(self, n_devices: int | None = None) -> dict[str, int]:
        """A default mesh shape over :attr:`mesh_axes` for ``n_devices`` (default: all).

        >>> get("tp").mesh_for(8), get("tp").mesh_for(6), get("dp").mesh_for(8)
        ({'data': 2, 'model': 4}, {'data': 3, 'model': 2}, {'data': 8})
        """
        n = jax.device_count() if n_devices is None else int(n_devices)
        if n < 1:
            raise ValueError(f"n_devices must be >= 1, got {n}")
        rest = n
        tail = []
        for pref in self.sizes:
            size = math.gcd(pref, rest)
            tail.append(size)
            rest //= size
        return dict(zip(self.mesh_axes, (rest, *tail), strict=True))

    def make_mesh(self, n_devices: int | None = None, *, axis_types: str = "auto") -> Mesh:
        """``nnx_shard.make_mesh(self.mesh_for(n_devices), axis_types=...)``.

        Auto axes by default, so models built from stock Flax layers train as
        written; ``axis_types="explicit"`` opts in to JAX's sharding-in-types.

        >>> mesh = get("ep").make_mesh()
        >>> dict(mesh.shape), mesh.axis_types
        ({'data': 2, 'expert': 4}, (Auto, Auto))
        """
        n = jax.device_count() if n_devices is None else n_devices
        return make_mesh(self.mesh_for(n), axis_types=axis_types, devices=jax.devices()[:n])

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

        >>> from nnx_shard.models import Transformer, get_config
        >>> model = nnx.eval_shape(lambda: Transformer(get_config("tiny"), rngs=nnx.Rngs(0)))
        >>> get("tp").suggest_mesh(model, 8, prefer={"data": 1, "model": 8})
        {'data': 2, 'model': 4}
        """
        n = jax.device_count() if n_devices is None else int(n_devices)
        state = model if isinstance(model, nnx.State) else nnx.state(model)
        prefer = dict(prefer) if prefer else self.mesh_for(n)
        best, best_cost = None, math.inf
        for shape in _factorizations(n, len(self.mesh_axes)):
            sizes = dict(zip(self.mesh_axes, shape, strict=True))
            cost = sum(abs(math.log(sizes[a] / max(prefer.get(a, 1), 1))) for a in sizes)
            if cost < best_cost and not self._problems(state, sizes):
                best, best_cost = sizes, cost
        return best

    def check(self, model: Any, mesh: Mesh | str | Mapping[str, int]) -> None:
        """Raises a ``ShardingError`` if the mesh lacks one of :attr:`mesh_axes` or a
        parameter of ``model`` (concrete or abstract) cannot be laid out, naming the
        parameter and suggesting a mesh shape with the same devices that works.

        >>> from nnx_shard.models import Transformer, get_config
        >>> model = nnx.eval_shape(lambda: Transformer(get_config("tiny"), rngs=nnx.Rngs(0)))
        >>> get("tp").check(model, {"data": 1, "model": 8})
        Traceback (most recent call last):
        ...
        nnx_shard.errors.ShardingError: strategy 'tp' cannot lay out this model on mesh data=1, model=8: ... 'blocks/0/attn/k' ... Suggested mesh: {'data': 2, 'model': 4} ...
        """
        sizes = _sizes(mesh)
        state = model if isinstance(model, nnx.State) else nnx.state(model)
        if isinstance(self.rules.options.get("pipeline"), Schedule):
            check_stack(state, sizes, self.rules.options["pipeline"])
        missing = [a for a in self.mesh_axes if a not in sizes]
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

    # -- conveniences over the library calls -------------------------------------

    def abstract_init(self, factory: Callable[[], M], mesh: Mesh | str | Mapping[str, int]) -> M:
        """:func:`nnx_shard.abstract_init` with this strategy's rules, after :meth:`check`.

        >>> from nnx_shard.models import Transformer, get_config
        >>> m = get("fsdp").abstract_init(
        ...     lambda: Transformer(get_config("tiny"), rngs=nnx.Rngs(0)), "data=8")
        >>> m.blocks[0].mlp.up.get_value().sharding.spec
        P('data', None)
        """
        mesh = make_mesh(mesh)
        self.check(_abstract(factory, mesh, "abstract_init")[1], mesh)
        return abstract_init(factory, mesh, self.rules)

    def sharded_init(self, factory: Callable[[], M], mesh: Mesh | str | Mapping[str, int]) -> M:
        """:func:`nnx_shard.sharded_init` with this strategy's rules, after :meth:`check`.

        >>> from nnx_shard.models import Transformer, get_config
        >>> m = get("tp").sharded_init(
        ...     lambda: Transformer(get_config("tiny"), rngs=nnx.Rngs(0)), "data=2,model=4")
        >>> m.blocks[0].attn.o.get_value().sharding.spec
        P('model', None, None)
        """
        mesh = make_mesh(mesh)
        self.check(_abstract(factory, mesh, "sharded_init")[1], mesh)
        return sharded_init(factory, mesh, self.rules)

    def optimizer(self, model: nnx.Module, tx: optax.GradientTransformation,
                  mesh: Mesh | str | Mapping[str, int], *, wrt: Any = nnx.Param) -> nnx.Optimizer:
        """:func:`nnx_shard.sharded_optimizer` with ``rules`` and ``opt_rules``.

        >>> from nnx_shard.models import Transformer, get_config
        >>> s = get("zero1")
        >>> m = s.sharded_init(lambda: Transformer(get_config("tiny"), rngs=nnx.Rngs(0)), "data=8")
        >>> opt = s.optimizer(m, optax.adam(1e-3), "data=8")
        >>> opt.opt_state[0].mu["unembed"].get_value().sharding.spec
        P('data', None)
        """
        return sharded_optimizer(model, tx, mesh, self.rules, wrt=wrt, opt_rules=self.opt_rules)

    def explain(self, model: Any, mesh: Mesh | str | Mapping[str, int],
                optimizer: optax.GradientTransformation | None = None) -> Report:
        """:func:`nnx_shard.explain` with ``rules`` and ``opt_rules``.

        >>> from nnx_shard.models import Transformer, get_config
        >>> m = nnx.eval_shape(lambda: Transformer(get_config("tiny"), rngs=nnx.Rngs(0)))
        >>> r = get("fsdp").explain(m, "data=8", optax.adam(1e-3))
        >>> r.param_bytes_per_device * 8 == r.total_bytes
        True
        """
        return explain(model, mesh, self.rules, optimizer, opt_rules=self.opt_rules)


def _sizes(mesh: Mesh | str | Mapping[str, int]) -> dict[str, int]:
    return mesh_sizes(mesh if isinstance(mesh, Mapping) else make_mesh(mesh))


def _factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return [c for c in itertools.product(divisors, repeat=k) if math.prod(c) == n]


def _table(first: tuple[str, ...] = (), **entries: Any) -> Rules:
    # Rules claim mesh axes in table order: names in ``first`` go ahead of the rest.
    order = (*first, *(n for n in LOGICAL if n not in first))
    # Grouped-query attention's key/value heads follow the query heads over the model
    # axis where they divide it, else stay replicated (e.g. 8 of them on model=16).
    entries.setdefault("kv_heads", [entries["heads"], None] if entries.get("heads") else None)
    # The generation cache [batch, length, kv_heads, head_dim]: batch as the batch, key/value
    # heads as kv_heads; its length only where a preset says (context parallelism).
    entries.setdefault("cache_batch", entries.get("batch"))
    entries.setdefault("cache_kv_heads", entries["kv_heads"])
    return Rules({name: entries.get(name) for name in order})


def _distinct(name: str, **axes: str) -> None:
    for k, v in axes.items():
        if not isinstance(v, str) or not v:
            raise ShardingError(f"strategy {name!r}: mesh axis {k}={v!r} must be a non-empty string")
    if len(set(axes.values())) != len(axes):
        raise ShardingError(f"strategy {name!r}: mesh axes {axes} must be distinct")


def dp(*, data: str = "data") -> Strategy:
    """Data parallelism (DDP): parameters and optimizer state replicated, the batch
    sharded over ``data``.

    Mesh axes: ``data``. Collectives: one all-reduce of the gradients per step
    (XLA inserts it where the gradient of a replicated parameter meets a
    batch-sharded activation).

    >>> dp().rules["batch"], dp().rules["embed"]
    ('data', None)
    """
    _distinct("dp", data=data)
    return Strategy("dp", _table(batch=data), None, (data,), (), ("all-reduce",))


def zero1(*, data: str = "data") -> Strategy:
    """ZeRO stage 1: parameters replicated as in :func:`dp`, optimizer state (Adam's
    ``mu``/``nu``) sharded over ``data`` along ``embed``.

    Mesh axes: ``data``. Collectives: the gradient all-reduce of DP, then each
    device updates its slice of the optimizer state and an all-gather of the
    updated parameters restores the replicas. Use ``opt_rules`` with
    :func:`nnx_shard.sharded_optimizer` and :func:`nnx_shard.explain` (or
    :meth:`Strategy.optimizer` / :meth:`Strategy.explain`). Train with
    :func:`nnx_shard.multistep` or :class:`nnx_shard.Trainer`, which keep every
    array in its layout: a plain ``nnx.jit`` step returns the updated
    parameters sharded like the optimizer state (the layout of the update), so
    the run silently becomes :func:`fsdp`.

    >>> s = zero1()
    >>> s.rules["embed"], s.opt_rules["embed"]
    (None, 'data')
    """
    _distinct("zero1", data=data)
    return Strategy("zero1", _table(batch=data), _table(batch=data, embed=data), (data,), (),
                    ("all-reduce", "all-gather"))


def fsdp(*, data: str = "data") -> Strategy:
    """Fully sharded data parallelism (ZeRO stage 3): parameters, gradients and
    optimizer state sharded over ``data`` along ``embed``; the batch too.

    Mesh axes: ``data``. Collectives: all-gather of each parameter before use
    and a reduction of the gradients of which every device keeps its 1/N slice
    (a reduce-scatter; XLA CPU compiles it as an all-reduce and a local slice),
    so every device stores 1/N of the parameters, gradients and optimizer state.

    >>> fsdp(data="fsdp").rules["embed"]
    'fsdp'
    """
    _distinct("fsdp", data=data)
    return Strategy("fsdp", _table(batch=data, embed=data), None, (data,), (),
                    ("all-gather", "all-reduce"))


def tp(*, data: str = "data", model: str = "model") -> Strategy:
    """Megatron tensor parallelism over ``model`` (with data parallelism over ``data``):
    Q/K/V and the MLP's up projection split column-wise (``heads``, ``mlp``), the
    attention output and the MLP's down projection row-wise, embeddings and logits
    split over ``vocab``.

    Mesh axes: ``data``, ``model``. Collectives: an all-reduce over ``model`` after
    each row-parallel matmul (forward) and each column-parallel one (backward),
    an all-gather over ``model`` of the vocabulary-sharded token embedding
    before the lookup, plus DP's gradient all-reduce over ``data``. ``heads``,
    ``mlp`` and ``vocab`` must divide by the ``model`` size.

    >>> tp().rules["heads"], tp().rules["mlp"], tp().rules["embed"]
    ('model', 'model', None)
    """
    _distinct("tp", data=data, model=model)
    return Strategy("tp", _table(batch=data, heads=model, mlp=model, vocab=model), None,
                    (data, model), (4,), ("all-reduce", "all-gather"))


def fsdp_tp(*, data: str = "data", model: str = "model") -> Strategy:
    """2D: FSDP over ``data`` (parameters sharded along ``embed``) and Megatron
    tensor parallelism over ``model`` (``heads``, ``mlp``, ``vocab``).

    Mesh axes: ``data``, ``model``. Collectives: FSDP's all-gather and gradient
    reduction over ``data`` and TP's all-reduce (and embedding all-gather) over
    ``model``.

    >>> fsdp_tp().rules["embed"], fsdp_tp().rules["mlp"]
    ('data', 'model')
    """
    _distinct("fsdp_tp", data=data, model=model)
    return Strategy(
        "fsdp_tp", _table(batch=data, embed=data, heads=model, mlp=model, vocab=model), None,
        (data, model), (2,), ("all-gather", "all-reduce"),
    )


def sp(*, data: str = "data", model: str = "model") -> Strategy:
    """Sequence parallelism: :func:`tp`, with the residual stream (norms, residual
    adds, dropout) sharded along ``length`` over ``model`` between attention and
    MLP blocks, so those activations take 1/N of the memory.

    Mesh axes: ``data``, ``model``. Collectives: an all-gather of the sequence
    over ``model`` before each attention/MLP block and a reduce-scatter after it
    in place of TP's all-reduce (XLA CPU compiles it as an all-reduce and a
    local slice), plus DP's gradient all-reduce. ``length`` must divide by the
    ``model`` size.

    >>> sp().rules["length"], sp().rules["heads"]
    ('model', 'model')
    """
    _distinct("sp", data=data, model=model)
    return Strategy(
        "sp", _table(batch=data, length=model, heads=model, mlp=model, vocab=model), None,
        (data, model), (4,), ("all-gather", "all-reduce"),
    )


def ep(*, data: str = "data", expert: str = "expert") -> Strategy:
    """Expert parallelism: the experts of a mixture-of-experts layer sharded over
    ``expert``; everything else replicated, with the batch sharded over both axes
    (``data`` x ``expert``) outside the expert computation and over ``data`` inside.

    Mesh axes: ``data``, ``expert``. Collectives: all-to-all over ``expert`` to
    send tokens to the devices holding their experts and back, all-gathers over
    ``expert`` where the router and the combine step need a whole ``data``
    shard of the batch, plus the gradient all-reduces (over ``data`` x
    ``expert`` for replicated parameters, over ``data`` for the experts').
    ``expert`` must divide the number of experts.

    >>> ep().rules["expert"], ep().rules["batch"]
    ('expert', [('data', 'expert'), 'data'])
    """
    _distinct("ep", data=data, expert=expert)
    # expert ahead of batch: the dispatched tokens ("expert", "batch", ...) keep the
    # expert axis for the experts and fall back to data for the batch.
    return Strategy("ep", _table(("expert",), batch=[(data, expert), data], expert=expert), None,
                    (data, expert), (4,), ("all-to-all", "all-gather", "all-reduce"))


def async_tp(*, data: str = "data", model: str = "model") -> Strategy:
    """Asynchronous tensor parallelism: :func:`tp`'s parameter layout, with the
    attention and MLP projections run as collective matmuls
    (:mod:`nnx_shard.collective_matmul`) that overlap their communication with
    the matmul, block by block.

    The residual stream is sharded along ``length`` over ``model`` as under
    :func:`sp`: a column-parallel projection (Q/K/V, MLP up) gathers the
    sequence in ``model - 1`` ring steps of ``ppermute``, multiplying the block
    it holds at each step; a row-parallel one (attention output, MLP down)
    passes partial sums round the ring and adds its own, a reduce-scatter in
    ring steps. The rules carry the option ``collective_matmul=True``, which
    the reference model's projections read (:func:`nnx_shard.mesh.option`).
    Values equal :func:`tp`'s up to float rounding; checkpoints are
    interchangeable with it.

    Mesh axes: ``data``, ``model``. Collectives: collective-permutes over
    ``model`` in place of tp's all-reduces for the projections (forward and
    backward), the all-gathers over ``model`` of the embedding table and of
    the sequence before the logits, plus DP's gradient all-reduce over
    ``data``. ``heads``, ``mlp``, ``vocab`` and the sequence length must
    divide by the ``model`` size.

    >>> s = async_tp()
    >>> s.rules["heads"], s.rules["length"], s.rules.options["collective_matmul"]
    ('model', 'model', True)
    """
    _distinct("async_tp", data=data, model=model)
    rules = _table(batch=data, length=model, heads=model, mlp=model, vocab=model)
    return Strategy("async_tp", rules.with_options(collective_matmul=True), None,
                    (data, model), (4,), ("collective-permute", "all-gather", "all-reduce"))


def _pp(name: str, table: Rules, axes: tuple[str, ...], sizes: tuple[int, ...], stage: str,
        repeats: int, allow_few_microbatches: bool, remat: bool) -> Strategy:
    sched = Schedule(axis=stage, repeats=repeats, allow_few_microbatches=allow_few_microbatches,
                     remat=remat)
    # Circular: the contiguously stored stack is re-laid out to the circular order
    # in each step (an all-to-all over stage on XLA CPU), gradients back the same way.
    moves = ("all-to-all",) if repeats > 1 else ()
    return Strategy(name, table.with_options(pipeline=sched), None, axes, sizes,
                    ("collective-permute", "all-reduce", *moves))


def pp(*, stage: str = "stage", data: str = "data", repeats: int = 1,
       allow_few_microbatches: bool = False, remat: bool = False) -> Strategy:
    """Pipeline parallelism over ``stage`` (with data parallelism over ``data``): the
    stacked layer axis (``layers``) split over ``stage``, each device holding
    ``layers/stages`` consecutive layers and their optimizer state; everything
    else replicated over ``stage``. The rules carry the execution option
    ``pipeline=Schedule(stage, repeats)``, which :func:`nnx_shard.pipeline.scan`
    reads: ``repeats=1`` is GPipe, ``repeats=V > 1`` the circular schedule.
    Microbatches are the trainer's ``microbatches=M`` (at least the number of
    stages, unless ``allow_few_microbatches=True``: GPipe then runs with idle stages
    and a warning). ``remat=True`` keeps only each stage's input per pipeline
    iteration for the backward pass and recomputes the stage. See
    :mod:`nnx_shard.pipeline`.

    Mesh axes: ``stage``, ``data``. Collectives: collective-permutes over
    ``stage`` (activations passed between stages at every pipeline iteration,
    gradients back), all-reduces over ``stage`` of the activations entering and
    leaving the pipeline, and DP's gradient all-reduce over ``data``.

    >>> s = pp()
    >>> s.rules["layers"], s.rules["batch"], s.rules.options["pipeline"]
    ('stage', 'data', Schedule(axis='stage', repeats=1, allow_few_microbatches=False, remat=False))
    >>> s.mesh_for(8)
    {'stage': 4, 'data': 2}
    """
    _distinct("pp", stage=stage, data=data)
    return _pp("pp", _table(batch=data, layers=stage), (stage, data), (2,), stage, repeats,
               allow_few_microbatches, remat)


def pp_fsdp(*, stage: str = "stage", data: str = "data", repeats: int = 1,
            allow_few_microbatches: bool = False, remat: bool = False) -> Strategy:
    """:func:`pp` with each stage's parameters (and the rest of the model's) sharded
    over ``data`` along ``embed``, FSDP-style.

    Mesh axes: ``stage``, ``data``. Collectives: those of :func:`pp` plus FSDP's
    all-gathers of parameters over ``data`` (inside the pipeline loop, per layer);
    on Auto axes XLA also moves the data-sharded embedding and head between device
    groups (measured on 8 CPU devices: all-to-alls over ``data``, collective-permutes
    over ``stage`` x ``data`` and an all-gather over ``stage`` of the head's weight),
    never a layer of the stack.

    >>> pp_fsdp().rules["embed"], pp_fsdp().rules["layers"]
    ('data', 'stage')
    """
    _distinct("pp_fsdp", stage=stage, data=data)
    return _pp("pp_fsdp", _table(batch=data, embed=data, layers=stage), (stage, data), (2,),
               stage, repeats, allow_few_microbatches, remat)


def pp_tp(*, stage: str = "stage", data: str = "data", model: str = "model",
          repeats: int = 1, allow_few_microbatches: bool = False,
          remat: bool = False) -> Strategy:
    """:func:`pp` with Megatron tensor parallelism over ``model`` inside each stage
    (``heads``, ``mlp``, ``vocab``).

    Mesh axes: ``stage``, ``data``, ``model``. Collectives: those of :func:`pp` plus
    TP's all-reduces over ``model``.

    >>> pp_tp().mesh_for(8), pp_tp().rules["mlp"]
    ({'stage': 2, 'data': 2, 'model': 2}, 'model')
    """
    _distinct("pp_tp", stage=stage, data=data, model=model)
    return _pp("pp_tp", _table(batch=data, heads=model, mlp=model, vocab=model, layers=stage),
               (stage, data, model), (2, 2), stage, repeats, allow_few_microbatches, remat)
def cp(*, data: str = "data", context: str = "context") -> Strategy:
    """Context parallelism: the sequence split over ``context`` through the whole
    model (``length`` of every activation), the batch over ``data``, parameters
    replicated. Attention runs as ring attention (rules option
    ``attention="ring"``, read by :func:`nnx_shard.models.attention`): each device
    keeps its queries and passes key/value blocks around the ``context`` ring, in
    zig-zag chunk order for causal load balance (see :mod:`nnx_shard.ring`).
    ``strategy.rules.with_options(attention="allgather")`` all-gathers K/V instead.

    Mesh axes: ``data``, ``context``. Collectives: collective-permutes over
    ``context`` (the ring's K/V blocks, their gradients, and the zig-zag reorder),
    gradient all-reduces over ``data`` and ``context``, and one small all-gather
    over ``context`` (the gradient of the length-split position embedding); never
    an all-gather of full-length keys and values. The sequence length must
    divide by ``2 x context``; the model must compute attention with
    :func:`nnx_shard.models.attention` (the trainer checks).

    >>> s = cp()
    >>> s.rules["length"], s.rules.options["attention"], s.mesh_for(8)
    ('context', 'ring', {'data': 2, 'context': 4})
    """
    _distinct("cp", data=data, context=context)
    rules = _table(batch=data, length=context, cache_length=context).with_options(
        attention="ring")
    return Strategy("cp", rules, None, (data, context), (4,),
                    ("collective-permute", "all-reduce", "all-gather"))


def fsdp_cp(*, data: str = "data", context: str = "context") -> Strategy:
    """2D: FSDP over ``data`` (parameters, gradients, optimizer state sharded along
    ``embed``) and context parallelism (:func:`cp`, ring attention) over ``context``.

    Mesh axes: ``data``, ``context``. Collectives: FSDP's all-gather and gradient
    reduction over ``data`` and cp's collective-permutes over ``context``.

    >>> fsdp_cp().rules["embed"], fsdp_cp().rules["length"], fsdp_cp().mesh_for(8)
    ('data', 'context', {'data': 4, 'context': 2})
    """
    _distinct("fsdp_cp", data=data, context=context)
    rules = _table(batch=data, embed=data, length=context,
                   cache_length=context).with_options(attention="ring")
    return Strategy("fsdp_cp", rules, None, (data, context), (2,),
                    ("all-gather", "all-reduce", "collective-permute"))


_PRESETS: dict[str, Callable[..., Strategy]] = {
    "dp": dp, "zero1": zero1, "fsdp": fsdp, "tp": tp, "fsdp_tp": fsdp_tp, "sp": sp, "ep": ep,
    "async_tp": async_tp,
    "pp": pp, "pp_fsdp": pp_fsdp, "pp_tp": pp_tp,
    "cp": cp, "fsdp_cp": fsdp_cp,
}


def get(name: str, **axes: str) -> Strategy:
    """The preset ``name`` (one of :data:`NAMES`), with mesh-axis names overridable by
    keyword (``data=``, ``model=``, ``expert=`` as the preset takes them).

    >>> get("fsdp", data="fsdp").mesh_axes
    ('fsdp',)
    >>> get("ddp")
    Traceback (most recent call last):
    ...
    nnx_shard.errors.ShardingError: unknown strategy 'ddp'. Did you mean 'dp'? Known: dp, zero1, fsdp, tp, fsdp_tp, sp, ep, ...
    """
    if name not in _PRESETS:
        import difflib

        close = difflib.get_close_matches(name, NAMES, n=1)
        mean = f" Did you mean {close[0]!r}?" if close else ""
        raise ShardingError(f"unknown strategy {name!r}.{mean} Known: {', '.join(NAMES)}.")
    try:
        return _PRESETS[name](**axes)
    except TypeError:
        import inspect

        allowed = list(inspect.signature(_PRESETS[name]).parameters)
        raise ShardingError(
            f"strategy {name!r} takes mesh-axis keywords {allowed}, got {sorted(axes)}."
        ) from None


# -- choosing a preset ----------------------------------------------------------------


def auto(model: Any = "small", **kwargs: Any) -> Any:
    """Chooses a preset, mesh shape, remat policy and microbatch count for
    ``model`` and ranks what fits by predicted step time:
    :func:`nnx_shard.planner.auto` (see there for the arguments; returns a
    :class:`nnx_shard.planner.Plan`).

    >>> fake = lambda c: {"total": 1, "temp": 1, "flops": 1e9 * len(c.mesh),
    ...                   "collective_bytes": 0.0, "collectives": 0}
    >>> plan = auto("tiny", devices=8, batch=8, seq=16, strategies=["dp", "tp"],
    ...             compile_fn=fake, progress=False)
    >>> plan.best.label
    'dp data=8 remat=none mb=1'
    """
    from nnx_shard.planner import auto as _auto

    return _auto(model, **kwargs)
