"""The presets: each a :class:`~nnx_shard.strategies._strategy.Strategy` built from small tables
composed with ``Rules.__or__``, registered by :func:`~nnx_shard.strategies._strategy.preset`.

A preset's table is :data:`~nnx_shard.strategies._strategy.REPLICATED` (every logical name,
replicated, in one order) with the tables of the parallelisms it combines laid over
it: ``fsdp_tp`` is ``REPLICATED | _fsdp(data) | _tp(data, model)``. A new preset is
one decorated function here; :data:`NAMES`, :func:`get` and the planner's search
take it from the registry. See :mod:`nnx_shard.strategies` for what each preset
communicates.
"""

from __future__ import annotations

import difflib
import inspect

from nnx_shard._errors import ShardingError, short
from nnx_shard._parallel.schedule import Schedule
from nnx_shard._rules import Fallbacks, Rules
from nnx_shard.strategies._strategy import PRESETS, REPLICATED, Strategy, preset, replicated

__all__ = [
    "NAMES", "async_tp", "cp", "dp", "ep", "fsdp", "fsdp_cp", "fsdp_ep", "fsdp_tp", "get", "hsdp", "pp",
    "pp_fsdp", "pp_tp", "sp", "tp", "zero1", "zero2",
]

# -- the tables presets combine: each names only the logical axes it shards ---------------


def _dp(data: str) -> Rules:
    """Data parallelism: the batch (and the generation cache's) over ``data``."""
    return Rules({"batch": data, "cache_batch": data})


def _fsdp(data: str) -> Rules:
    """FSDP: the batch, and parameters along ``embed``, over ``data``."""
    return _dp(data) | {"embed": data}


def _tp(data: str, model: str) -> Rules:
    """Megatron tensor parallelism over ``model``, the batch over ``data``.

    Grouped-query attention's key/value heads (``kv_heads``) follow the query heads
    onto ``model`` where they divide it, else stay replicated (e.g. 8 of them on
    ``model=16``): the second candidate of the rule; the generation cache's key/value
    heads (``cache_kv_heads``) do the same.
    """
    return _dp(data) | {"heads": model, "kv_heads": Fallbacks(model, None), "mlp": model,
                        "vocab": model, "cache_kv_heads": Fallbacks(model, None)}


def _sp(data: str, model: str) -> Rules:
    """:func:`_tp`, with the sequence over ``model`` between the blocks."""
    return _tp(data, model) | {"length": model}


def _ep(data: str, expert: str) -> Rules:
    """The experts over ``expert``; the batch over ``data`` x ``expert`` outside the
    expert computation, over ``data`` for the dispatched tokens (which keep ``expert``
    for their experts: the presets put ``expert`` ahead of ``batch``)."""
    both = Fallbacks((data, expert), data)
    return Rules({"batch": both, "expert": expert, "cache_batch": both})


def _cp(data: str, context: str) -> Rules:
    """The sequence over ``context`` everywhere, attention as a ring; the generation
    cache's positions (``cache_length``) over ``context`` too."""
    return Rules({"batch": data, "cache_batch": data, "length": context,
                  "cache_length": context}, options={"attention": "ring"})


def _pp(stage: str, data: str, repeats: int, allow_few_microbatches: bool,
        remat: bool) -> Rules:
    """The stacked layers over ``stage``, run by :func:`nnx_shard._parallel.pipeline.scan`."""
    schedule = Schedule(axis=stage, repeats=repeats,
                        allow_few_microbatches=allow_few_microbatches, remat=remat)
    return Rules({"batch": data, "cache_batch": data, "layers": stage},
                 options={"pipeline": schedule})


def _pp_collectives(repeats: int) -> tuple[str, ...]:
    # Circular: the contiguously stored stack is re-laid out to the circular order
    # in each step (an all-to-all over stage on XLA CPU), gradients back the same way.
    moves = ("all-to-all",) if repeats > 1 else ()
    return ("collective-permute", "all-reduce", *moves)


# -- the presets, in the order of NAMES -------------------------------------------------


@preset
def dp(*, data: str = "data") -> Strategy:
    """Data parallelism (DDP): parameters and optimizer state replicated, the batch
    sharded over ``data``.

    Mesh axes: ``data``. Collectives: one all-reduce of the gradients per step
    (XLA inserts it where the gradient of a replicated parameter meets a
    batch-sharded activation).

    >>> dp().rules["batch"], dp().rules["embed"]
    ('data', None)
    """
    return Strategy(name="dp", rules=REPLICATED | _dp(data), opt_rules=None, mesh_axes=(data,),
                    collectives=("all-reduce",))


@preset
def zero1(*, data: str = "data") -> Strategy:
    """ZeRO stage 1: parameters replicated as in :func:`dp`, optimizer state (Adam's
    ``mu``/``nu``) sharded over ``data`` along ``embed``.

    Mesh axes: ``data``. Collectives: the gradient all-reduce of DP, then each
    device updates its slice of the optimizer state and an all-gather of the
    updated parameters restores the replicas. Pass the strategy itself to
    :func:`nnx_shard.sharded_optimizer` and :func:`nnx_shard.explain` (it brings
    its ``opt_rules``; its ``rules`` table alone lays the state out like the
    parameters). Train with
    :func:`nnx_shard.multistep` or :class:`nnx_shard.Trainer`, which keep every
    array in its layout: a plain ``nnx.jit`` step returns the updated
    parameters sharded like the optimizer state (the layout of the update), so
    the run silently becomes :func:`fsdp`.

    >>> s = zero1()
    >>> s.rules["embed"], s.opt_rules["embed"]
    (None, 'data')
    """
    params = REPLICATED | _dp(data)
    return Strategy(name="zero1", rules=params.with_options(gradients=params),
                    opt_rules=REPLICATED | _fsdp(data),
                    mesh_axes=(data,), collectives=("all-reduce", "all-gather"))


@preset
def zero2(*, data: str = "data") -> Strategy:
    """ZeRO stage 2: :func:`zero1` with the gradients partitioned too. Parameters stay
    replicated; inside the compiled step each gradient is reduced straight to the
    1/N slice its optimizer state owns (the rules option ``gradients``, read by
    :func:`nnx_shard.value_and_grad`), so no device holds a whole reduced gradient,
    and with microbatches the accumulated gradients stay 1/N per device too.

    Mesh axes: ``data``. Collectives: a reduce-scatter of each gradient over ``data``
    in place of DP's all-reduce (XLA CPU compiles it as an all-reduce and a local
    slice), the update of each device's slice, and an all-gather of the updated
    parameters. Train with :func:`nnx_shard.multistep` or :class:`nnx_shard.Trainer`
    (their gradients come from :func:`nnx_shard.value_and_grad`); pass the strategy
    itself to :func:`nnx_shard.sharded_optimizer` as for :func:`zero1`.

    >>> s = zero2()
    >>> s.rules["embed"], s.opt_rules["embed"], s.rules.options["gradients"]["embed"]
    (None, 'data', 'data')
    """
    sharded = REPLICATED | _fsdp(data)
    return Strategy(name="zero2", rules=(REPLICATED | _dp(data)).with_options(gradients=sharded),
                    opt_rules=sharded, mesh_axes=(data,),
                    collectives=("reduce-scatter", "all-gather"))


@preset
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
    return Strategy(name="fsdp", rules=REPLICATED | _fsdp(data), opt_rules=None,
                    mesh_axes=(data,), collectives=("all-gather", "all-reduce"))


@preset
def hsdp(*, replica: str = "replica", data: str = "data") -> Strategy:
    """Hybrid sharded data parallelism (as MaxText's and torchtitan's HSDP): :func:`fsdp`
    within each replica over ``data``, data parallelism across replicas over
    ``replica``. Parameters, gradients and optimizer state are sharded over ``data``
    along ``embed`` and replicated across ``replica``; the batch is split over both.

    ``replica`` is the strategy's :attr:`~Strategy.across` axis: :meth:`Strategy.make_mesh`
    lays it across the processes (or slices) of a ``jax.distributed`` job, one
    replica per process with ``data`` its local devices by default, so the
    parameter all-gathers run over the fast links inside a host and only the
    gradient reduction crosses the slow ones (``nnx_shard.make_mesh(...,
    across="replica")`` builds the same by hand). On one process the mesh is an
    ordinary one: 8 devices give ``replica=2, data=4``.

    Mesh axes: ``replica``, ``data``. Collectives (measured on 8 CPU devices with
    Auto axes, the default: tests/strategies/test_hsdp.py): the all-gathers of
    each parameter over ``data`` only, never across ``replica``; the gradients
    reduced to each device's 1/data slice within ``data`` (a reduce-scatter; XLA
    CPU compiles it as an all-reduce and a local slice) and across ``replica``
    once per step, on the slices (the small ones, norm scales and the position
    table, whole in one all-reduce over both axes). So a replica sends about
    1/data of the gradients over the slow links, where :func:`fsdp` over the
    same devices would reduce whole gradients and gather every parameter across
    them. On Explicit axes XLA reduces the gradients in one all-reduce over
    ``replica`` x ``data`` instead.

    >>> s = hsdp()
    >>> s.rules["batch"], s.rules["embed"], s.across, s.mesh_for(8)
    (('replica', 'data'), 'data', 'replica', {'replica': 2, 'data': 4})
    """
    both = (replica, data)
    rules = REPLICATED | _fsdp(data) | {"batch": both, "cache_batch": both}
    return Strategy(name="hsdp", rules=rules, opt_rules=None, mesh_axes=both, sizes=(4,),
                    collectives=("all-gather", "all-reduce"), across=replica)


@preset
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
    return Strategy(name="tp", rules=REPLICATED | _tp(data, model), opt_rules=None,
                    mesh_axes=(data, model), sizes=(4,), collectives=("all-reduce", "all-gather"))


@preset
def fsdp_tp(*, data: str = "data", model: str = "model") -> Strategy:
    """2D: FSDP over ``data`` (parameters sharded along ``embed``) and Megatron
    tensor parallelism over ``model`` (``heads``, ``mlp``, ``vocab``).

    Mesh axes: ``data``, ``model``. Collectives: FSDP's all-gather and gradient
    reduction over ``data`` and TP's all-reduce (and embedding all-gather) over
    ``model``.

    >>> fsdp_tp().rules["embed"], fsdp_tp().rules["mlp"]
    ('data', 'model')
    """
    return Strategy(name="fsdp_tp", rules=REPLICATED | _fsdp(data) | _tp(data, model),
                    opt_rules=None, mesh_axes=(data, model), sizes=(2,),
                    collectives=("all-gather", "all-reduce"))


@preset
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
    return Strategy(name="sp", rules=REPLICATED | _sp(data, model), opt_rules=None,
                    mesh_axes=(data, model), sizes=(4,), collectives=("all-gather", "all-reduce"))


@preset
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
    ('expert', Fallbacks(('data', 'expert'), 'data'))
    """
    # expert ahead of batch: the dispatched tokens ("expert", "batch", ...) keep the
    # expert axis for the experts and fall back to data for the batch.
    rules = replicated(first=("expert",)) | _ep(data, expert)
    return Strategy(name="ep", rules=rules, opt_rules=None, mesh_axes=(data, expert), sizes=(4,),
                    collectives=("all-to-all", "all-gather", "all-reduce"))


@preset
def fsdp_ep(*, data: str = "data", expert: str = "expert") -> Strategy:
    """2D for mixture-of-experts models on more devices than experts: :func:`ep`'s
    experts over ``expert`` and its token all-to-all, with every parameter FSDP-sharded
    over ``data`` along ``embed`` (the experts' too, so each device holds
    1/(data x expert) of them), the optimizer state alike.

    Mesh axes: ``data``, ``expert``. Collectives: ep's all-to-alls over ``expert``
    (token dispatch and return) and all-gathers where the router and the combine
    step need a whole ``data`` shard of the batch, FSDP's all-gathers of parameters
    over ``data`` before use and the reduction of their gradients to each device's
    slice.

    >>> s = fsdp_ep()
    >>> s.rules["expert"], s.rules["embed"], s.mesh_for(8)
    ('expert', 'data', {'data': 2, 'expert': 4})
    """
    rules = replicated(first=("expert",)) | _fsdp(data) | _ep(data, expert)
    return Strategy(name="fsdp_ep", rules=rules, opt_rules=None, mesh_axes=(data, expert),
                    sizes=(4,), collectives=("all-to-all", "all-gather", "all-reduce"))


@preset
def async_tp(*, data: str = "data", model: str = "model") -> Strategy:
    """Asynchronous tensor parallelism: :func:`tp`'s parameter layout, with the
    attention and MLP projections run as collective matmuls
    (:mod:`nnx_shard._parallel.collective_matmul`) that overlap their communication with
    the matmul, block by block.

    The residual stream is sharded along ``length`` over ``model`` as under
    :func:`sp`: a column-parallel projection (Q/K/V, MLP up) gathers the
    sequence in ``model - 1`` ring steps of ``ppermute``, multiplying the block
    it holds at each step; a row-parallel one (attention output, MLP down)
    passes partial sums round the ring and adds its own, a reduce-scatter in
    ring steps. The rules carry the option ``collective_matmul=True``, which
    the reference model's projections read (:func:`nnx_shard._mesh.option`).
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
    rules = (REPLICATED | _sp(data, model)).with_options(collective_matmul=True)
    return Strategy(name="async_tp", rules=rules, opt_rules=None, mesh_axes=(data, model),
                    sizes=(4,), collectives=("collective-permute", "all-gather", "all-reduce"))


@preset
def cp(*, data: str = "data", context: str = "context") -> Strategy:
    """Context parallelism: the sequence split over ``context`` through the whole
    model (``length`` of every activation), the batch over ``data``, parameters
    replicated. Attention runs as ring attention (rules option
    ``attention="ring"``, read by :func:`nnx_shard.models.attention`): each device
    keeps its queries and passes key/value blocks around the ``context`` ring, in
    zig-zag chunk order for causal load balance (see :mod:`nnx_shard._attention._context_parallel`).
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
    return Strategy(name="cp", rules=REPLICATED | _cp(data, context), opt_rules=None,
                    mesh_axes=(data, context), sizes=(4,),
                    collectives=("collective-permute", "all-reduce", "all-gather"))


@preset
def fsdp_cp(*, data: str = "data", context: str = "context") -> Strategy:
    """2D: FSDP over ``data`` (parameters, gradients, optimizer state sharded along
    ``embed``) and context parallelism (:func:`cp`, ring attention) over ``context``.

    Mesh axes: ``data``, ``context``. Collectives: FSDP's all-gather and gradient
    reduction over ``data`` and cp's collective-permutes over ``context``.

    >>> fsdp_cp().rules["embed"], fsdp_cp().rules["length"], fsdp_cp().mesh_for(8)
    ('data', 'context', {'data': 4, 'context': 2})
    """
    return Strategy(name="fsdp_cp", rules=REPLICATED | _fsdp(data) | _cp(data, context),
                    opt_rules=None, mesh_axes=(data, context), sizes=(2,),
                    collectives=("all-gather", "all-reduce", "collective-permute"))


@preset
def pp(*, stage: str = "stage", data: str = "data", repeats: int = 1,
       allow_few_microbatches: bool = False, remat: bool = False) -> Strategy:
    """Pipeline parallelism over ``stage`` (with data parallelism over ``data``): the
    stacked layer axis (``layers``) split over ``stage``, each device holding
    ``layers/stages`` consecutive layers and their optimizer state; everything
    else replicated over ``stage``. The rules carry the execution option
    ``pipeline=Schedule(stage, repeats)``, which :func:`nnx_shard._parallel.pipeline.scan`
    reads: ``repeats=1`` is GPipe, ``repeats=V > 1`` the circular schedule.
    Microbatches are the trainer's ``microbatches=M`` (at least the number of
    stages, unless ``allow_few_microbatches=True``: GPipe then runs with idle stages
    and a warning). ``remat=True`` keeps only each stage's input per pipeline
    iteration for the backward pass and recomputes the stage. See
    :mod:`nnx_shard._parallel.pipeline`.

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
    rules = REPLICATED | _pp(stage, data, repeats, allow_few_microbatches, remat)
    return Strategy(name="pp", rules=rules, opt_rules=None, mesh_axes=(stage, data), sizes=(2,),
                    collectives=_pp_collectives(repeats))


@preset
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
    rules = REPLICATED | _fsdp(data) | _pp(stage, data, repeats, allow_few_microbatches, remat)
    return Strategy(name="pp_fsdp", rules=rules, opt_rules=None, mesh_axes=(stage, data),
                    sizes=(2,), collectives=_pp_collectives(repeats))


@preset
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
    rules = (REPLICATED | _tp(data, model)
             | _pp(stage, data, repeats, allow_few_microbatches, remat))
    return Strategy(name="pp_tp", rules=rules, opt_rules=None, mesh_axes=(stage, data, model),
                    sizes=(2, 2), collectives=_pp_collectives(repeats))


#: The presets' names, in the order they are defined above.
NAMES: tuple[str, ...] = tuple(PRESETS)


def get(name: str, *, offload: str | None = None, **axes: str) -> Strategy:
    """The preset ``name`` (one of :data:`NAMES`), with mesh-axis names overridable by
    keyword (``data=``, ``model=``, ``expert=`` as the preset takes them).

    Args:
      name: one of :data:`NAMES` (``"dp"``, ``"fsdp"``, ``"fsdp_tp"``, ...).
      offload: what lives in host memory between steps (:attr:`Strategy.offload`):
        ``None``, ``"optimizer"`` or ``"optimizer+params"``; the same as
        ``get(name).with_offload(offload)``.
      **axes: mesh-axis names to use instead of the preset's (``data=``, ``model=``, ``expert=``,
        ...).

    >>> from nnx_shard.strategies import get
    >>> get("fsdp", data="fsdp").mesh_axes
    ('fsdp',)
    >>> get("fsdp_tp", offload="optimizer").offload
    'optimizer'
    >>> get("ddp")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.ShardingError: unknown strategy 'ddp'. Did you mean 'dp'? Known: dp, zero1, zero2, fsdp, hsdp, tp, fsdp_tp, sp, ...
    """
    if not isinstance(name, str):
        raise ShardingError(f"strategies.get: name must be a preset name (str), got "
                            f"{type(name).__name__} {short(name, 60)}. Known: {', '.join(NAMES)}.")
    if name not in PRESETS:
        close = difflib.get_close_matches(name, NAMES, n=1)
        mean = f" Did you mean {close[0]!r}?" if close else ""
        raise ShardingError(f"unknown strategy {name!r}.{mean} Known: {', '.join(NAMES)}.")
    try:
        strategy = PRESETS[name](**axes)
    except TypeError:
        allowed = list(inspect.signature(PRESETS[name]).parameters)
        raise ShardingError(
            f"strategy {name!r} takes mesh-axis keywords {allowed}, got {sorted(axes)}."
        ) from None
    return strategy if offload is None else strategy.with_offload(offload)
