"""Gradients over microbatches: :func:`value_and_grad` splits a step's batch into M
microbatches and accumulates their gradients (M per call, or from the enclosing
``multistep(..., microbatches=M)`` through :func:`tracing_step`), unless a
parallel op takes the microbatches over (the pipeline, see
:mod:`nnx_shard._parallel.registry`).

How microbatches are weighted. A step with M microbatches must give the loss and
the update of the same step with M = 1, whatever M is. A loss that is a mean over
a varying number of items (the next-token cross-entropy over the targets not
masked by ``-100``) breaks that when each microbatch's mean counts alike: a
microbatch with 2 kept targets would weigh as much as one with 64, and one with
none would make the whole step NaN (0/0). transformers fixed the same defect in
2024 by dividing each microbatch's summed loss by the number of items of the
whole step (``num_items_in_batch``), counted before the step is split.

Here a loss says what it is a mean over, with :func:`~nnx_shard.mean_over`: a count of the
items of a batch (:func:`nnx_shard.models.lm_loss` counts its kept targets).
:func:`value_and_grad` counts the items of the whole step once, before the
split, and weighs microbatch ``j``'s loss, aux and gradients by ``n_j / N``
(its items over the step's): the sum of the per-item losses over ``N``, as with
M = 1 (up to float rounding). The loss keeps its plain ``loss_fn(model, batch)``
signature, so it stays a loss of its own microbatch, callable alone and
testable; transformers' alternative, a ``num_items_in_batch`` argument passed to
every loss, would change the signature of every user loss. A microbatch with no
item adds nothing (its loss, NaN or not, is never used); a step with no item at
all has no mean, and its microbatches then count alike, as without
:func:`~nnx_shard.mean_over`: for ``lm_loss`` a NaN loss with zero gradients, exactly the
M = 1 result, which :class:`~nnx_shard.Trainer`'s guard reports and skips. A
loss without :func:`~nnx_shard.mean_over` keeps equal weights (the microbatch means
averaged): exact for a mean over examples, the microbatches being of equal size.

Under a pipeline strategy the loss sees the whole batch (the pipeline cuts it
into microbatches only inside the stacked layers), so its value is the M = 1
value by construction.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from nnx_shard._annotate import path_str
from nnx_shard._axes import entry_axes
from nnx_shard._errors import ShardingError, UsageError, count, flag, short
from nnx_shard._mesh import Calls, apply_sharding, called, context, entered, variable_spec, watching
from nnx_shard._parallel.registry import microbatch_owner
from nnx_shard._rules import as_rules
from nnx_shard._train._precision import Precision, as_precision
from nnx_shard._train._trees import fmt_shape, is_node, short_repr
from nnx_shard._weighting import items_counter

__all__ = ["TAKEN", "check_device_rows", "check_tracked", "spec_axes", "tracing_step",
           "value_and_grad"]

#: The name :func:`value_and_grad` records in the step's call log when it runs.
TAKEN = "value_and_grad"


@contextlib.contextmanager
def tracing_step(m: int, precision: Precision | None = None) -> Iterator[Calls]:
    """The context :func:`nnx_shard.multistep` traces a step in (the execution
    context with ``microbatches=m`` and ``precision``): :func:`value_and_grad` inside
    it splits the batch into ``m`` microbatches and reads the parameters in
    ``precision`` unless told otherwise. Yields the step's
    :class:`~nnx_shard._mesh.Calls`, which hold :data:`TAKEN` once
    :func:`value_and_grad` ran.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> mse = lambda m, b: jnp.mean(m(b) ** 2)
    >>> with tracing_step(4) as calls:
    ...     _ = value_and_grad(mse)(model, jnp.ones((8, 2)))   # 4 microbatches of 2
    >>> TAKEN in calls
    True
    """
    with entered(microbatches=m, precision=precision), watching() as calls:
        yield calls


def spec_axes(sharding: Any, dim: int) -> tuple[tuple[str, ...], int]:
    """The mesh axes dimension ``dim`` is sharded over by ``sharding``, and how many
    devices that is; ``((), 1)`` when unsharded."""
    spec = getattr(sharding, "spec", None)
    if spec is None or dim >= len(spec) or spec[dim] is None:
        return (), 1
    axes = entry_axes(spec[dim])
    if not all(isinstance(a, str) for a in axes):
        return (), 1
    sizes = dict(sharding.mesh.shape)
    return axes, int(np.prod([sizes[a] for a in axes]))


def _sharded_over(x: Any, dim: int) -> tuple[tuple[str, ...], int]:
    """:func:`spec_axes` of ``x``'s type (Explicit axes put the sharding there)."""
    return spec_axes(getattr(jax.typeof(x), "sharding", None), dim)


def check_device_rows(
    where: str, shape: tuple[int, ...], axes: tuple[str, ...], devices: int, m: int
) -> None:
    """Microbatches split each device's own rows (see _split_microbatches): say so
    when a device holds a number of rows that ``m`` does not divide."""
    rows = shape[0] // devices
    if rows % m:
        raise ShardingError(
            f"microbatches={m} must divide each device's rows of the batch: "
            f"{where} has {shape[0]} rows (shape {tuple(shape)}) sharded over mesh axes "
            f"{', '.join(axes)} ({devices} devices), so {rows} row{'s' if rows != 1 else ''} "
            f"per device, which does not divide by {m}. Fix: a global batch that is a "
            f"multiple of {m} x {devices} = {m * devices}, or a number of microbatches that "
            f"divides {rows}."
        )


def _split_microbatches(batch: Any, m: int) -> Any:
    """[B, ...] -> [m, B/m, ...]; microbatch j holds rows j, j+m, j+2m, ...

    Strided rather than contiguous on purpose: a batch sharded over devices in
    contiguous blocks then gives every device the same share of every
    microbatch, so no data moves between devices. This is exactly optax's
    ``microbatching.reshape_batch_axis`` (which also keeps Explicit shardings on
    the rows), used here after our own checks, whose messages name the leaf.

    Why the loop around it (:func:`_accumulate`) is not ``optax.microbatch``:
    that gives the same numbers (tests/train/test_train.py compares them) but calls
    a pure function with the same arguments for every microbatch and only
    accumulates its outputs; NNX state used by the loss (an ``nnx.Rngs``
    stream drawing a new dropout mask per microbatch, batch statistics) must be
    carried from one microbatch to the next, which it cannot do.
    """

    def one(path: Any, x: Any) -> Any:
        if np.ndim(x) == 0 or x.shape[0] % m:
            raise UsageError(
                f"microbatches={m} must divide the batch dimension (axis 0) of every batch "
                f"leaf, but batch{jax.tree_util.keystr(path)} has shape {fmt_shape(x)}. Fix: "
                f"use a batch size that is a multiple of {m}, or another number of microbatches."
            )
        x = jnp.asarray(x)
        # On Explicit axes the split would need rows of one device in several
        # microbatches: JAX refuses the reshape (a ShardingTypeError).
        check_device_rows(f"batch{jax.tree_util.keystr(path)}", x.shape, *_sharded_over(x, 0), m)
        return optax.microbatching.reshape_batch_axis(x, x.shape[0] // m)

    return jax.tree_util.tree_map_with_path(one, batch)


def _counted(items: Callable[[Any], Any], batch: Any, loss_fn: Any) -> jax.Array:
    """``items(batch)`` as a float32 scalar, or a :class:`UsageError` naming the loss."""
    n = items(batch)
    dtype = n.dtype if hasattr(n, "dtype") else np.result_type(type(n))
    if np.ndim(n) != 0 or not (jnp.issubdtype(dtype, jnp.integer)
                               or jnp.issubdtype(dtype, jnp.floating)):
        name = getattr(loss_fn, "__name__", "loss_fn")
        raise UsageError(
            f"mean_over: the item count of {name} for a batch is {_describe_value(n)} "
            f"({dtype}), not one integer or float. Fix: make items(batch) return one count, e.g. "
            "jnp.sum(batch['mask']).")
    return jnp.asarray(n, jnp.float32)


def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    microbatches: int | None = None,
    wrt: Any = nnx.Param,
    precision: Precision | None = None,
) -> Callable[..., tuple[Any, Any]]:
    """``nnx.value_and_grad`` over the model (first argument) that can accumulate microbatches.

    The returned ``grad_fn(model, batch, *args)`` calls ``loss_fn(model, batch, *args)``.
    With M microbatches, every leaf of ``batch`` is split along axis 0 into M
    equal microbatches (rows ``j, j+M, j+2M, ...`` form microbatch ``j``), the
    loss and gradients are computed one microbatch at a time inside a
    ``jax.lax.scan`` (activations of one microbatch live at a time) and
    combined so that they equal the full-batch result up to float rounding: a
    loss declared with :func:`~nnx_shard.mean_over` (as :func:`nnx_shard.models.lm_loss`,
    a mean over its kept targets) weighs each microbatch by its share of the
    step's items, counted before the split (the sum of the per-item losses over
    the step's items, transformers' ``num_items_in_batch``); any other loss
    has its microbatches averaged alike (exact for a mean over examples).
    ``aux`` (with ``has_aux=True``) is combined the same way. ``args`` are passed to every microbatch unchanged;
    NNX objects among them (e.g. ``nnx.Rngs``) are carried through. Under a
    pipeline strategy (``strategies.get("pp")``) the whole batch goes through
    one forward pass instead, and :func:`nnx_shard.pipeline.scan` runs the M
    microbatches through the stages.

    Args:
      loss_fn: ``loss_fn(model, batch, *args) -> loss`` (or ``(loss, aux)``).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      microbatches: M. ``None`` (default) takes M from the enclosing
        ``multistep(..., microbatches=M)``, else 1 (no splitting).
      wrt: which Variables of the model to differentiate (an NNX filter); of
        those, the float (and complex) ones: an integer parameter (a count kept
        with the weights) has no gradient and is left out of ``grads``.
      precision: a :class:`~nnx_shard.Precision`: inside ``loss_fn`` the model's
        float parameters read in its compute dtype (cast where each is used), the
        stored parameters and the gradients keep theirs. ``None`` (default) takes
        it from the enclosing ``multistep(..., precision=...)``, else none.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_shard import value_and_grad
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros((8, 1))}
    >>> mse = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    >>> loss1, g1 = value_and_grad(mse)(model, batch)
    >>> loss4, g4 = value_and_grad(mse, microbatches=4)(model, batch)
    >>> bool(jnp.allclose(loss1, loss4)), bool(jnp.allclose(g1["kernel"][...], g4["kernel"][...]))
    (True, True)
    >>> import nnx_shard as ns
    >>> _, g = value_and_grad(mse, precision=ns.Precision(compute=jnp.bfloat16))(model, batch)
    >>> g["kernel"][...].dtype          # read in bfloat16 inside mse; gradients float32
    dtype('float32')
    """
    if microbatches is not None:
        count(microbatches, "value_and_grad: microbatches",
              fix="a positive int, or None to take it from the enclosing multistep")
    flag(has_aux, "value_and_grad: has_aux")
    if not callable(loss_fn):
        raise UsageError(f"value_and_grad: loss_fn must be callable, got {short(loss_fn, 80)}. "
                         "Fix: e.g. ns.value_and_grad(lambda model, batch: loss)")
    precision = as_precision(precision, "value_and_grad: precision")
    items = items_counter(loss_fn)
    weigh = None if items is None else functools.partial(_counted, items, loss_fn=loss_fn)
    wrt = nnx.All(wrt, _inexact)  # jax.grad refuses integer inputs
    vg = nnx.value_and_grad(_reading(_checked_loss(loss_fn, has_aux)),
                            argnums=nnx.DiffState(0, wrt), has_aux=has_aux)

    @functools.wraps(loss_fn)
    def grad_fn(model: Any, batch: Any, *args: Any) -> tuple[Any, Any]:
        called(TAKEN)  # for multistep's check that its options were used
        ctx = context()
        m = microbatches if microbatches is not None else ctx.microbatches
        p = precision if precision is not None else ctx.precision
        with entered(reading=p):
            owner = microbatch_owner()
            if owner is not None and owner.microbatched is not None:
                # A parallel op runs the microbatches itself (the pipeline: through its
                # stages inside one forward pass) instead of the accumulation loop.
                out, grads = owner.microbatched(vg, m or 1, model, batch, *args)
                return out, laid_out(grads)
            if m is None or m == 1:
                out, grads = vg(model, batch, *args)
                return out, laid_out(grads)
            return _accumulate(vg, m, wrt, model, batch, args, weigh)

    return grad_fn


def laid_out(grads: Any) -> Any:
    """``grads`` (an ``nnx.State`` of gradients, traced) constrained to the layout of the
    context's ``gradients`` option, a :class:`~nnx_shard.Rules` table read on each
    gradient's logical names; unchanged where the option is unset or no mesh is active.

    Under the ``zero2`` preset (:func:`nnx_shard.strategies.get`) the table is the optimizer state's: the
    constraint meets the partial sums of a batch-sharded backward pass, so XLA reduces
    each gradient straight to the 1/N shard its optimizer state owns (a reduce-scatter)
    instead of all-reducing the whole gradient onto every device.

    >>> import jax, jax.numpy as jnp
    >>> from nnx_shard import Rules, use
    >>> from nnx_shard._annotate import with_logical
    >>> init = with_logical(nnx.initializers.ones, ("embed", None))
    >>> model = nnx.Linear(8, 2, use_bias=False, kernel_init=init, rngs=nnx.Rngs(0))
    >>> rules = Rules({"embed": None}, options={"gradients": Rules({"embed": "data"})})
    >>> def grads(model):
    ...     return laid_out(nnx.grad(lambda m: jnp.sum(m(jnp.ones((4, 8)))))(model))
    >>> with use("data=8", rules):
    ...     g = nnx.jit(grads)(model)
    >>> g["kernel"][...].sharding.spec
    P('data',)
    """
    ctx = context()
    table = ctx.options.get("gradients")
    if table is None or ctx.mesh is None:
        return grads
    if not isinstance(table, Mapping):
        raise UsageError(
            f"value_and_grad: the rules option gradients={short(table, 60)} is not a rules "
            "table. Fix: a Rules table (or dict) laying each gradient out by its logical "
            "names, e.g. Rules({'embed': 'data'}) (what strategies.get('zero2') sets), or "
            "gradients=None to leave them where XLA puts them.")
    table = as_rules(table)
    mesh = ctx.mesh
    if ctx.rules is not None:
        # A name the active rules gained after the strategy was built (rules | {...})
        # lays its gradient out as they do; the gradients' table decides the rest.
        table = ctx.rules | table

    def one(path: Any, var: Any) -> Any:
        if not isinstance(var, nnx.Variable):
            return var
        spec = variable_spec(var, mesh, table, path_str(path))
        return var.replace(apply_sharding(var.get_value(), NamedSharding(mesh, spec)))

    return jax.tree.map_with_path(one, grads, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _inexact(path: Any, value: Any) -> bool:
    """An NNX filter: a Variable holding a float or complex array (what has a gradient)."""
    dtype = getattr(value, "dtype", None)
    try:
        return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:  # not a dtype JAX knows
        return False


def check_tracked(model: Any, optimizer: Any, who: str = "Trainer") -> None:
    """Raises a :class:`~nnx_shard._errors.UsageError` naming the integer (or bool)
    Variables ``optimizer`` updates: :func:`value_and_grad` gives them no gradient,
    and an optimizer over them would fail inside the step (or, with weight decay,
    change them). Called when a :class:`~nnx_shard.Trainer` is built.

    >>> class Counted(nnx.Module):
    ...     def __init__(self):
    ...         self.w = nnx.Param(jnp.ones(2))
    ...         self.n = nnx.Param(jnp.array(0))
    >>> m = Counted()
    >>> check_tracked(m, nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param))
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: Trainer: the optimizer tracks integer parameter 'n' (int32): ...
    >>> check_tracked(m, nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.All(nnx.Param, "w")))
    """
    wrt = getattr(optimizer, "wrt", None)
    if wrt is None:
        return
    ints = [(path_str(p), v.dtype) for p, v in nnx.to_flat_state(nnx.state(model, wrt))
            if getattr(v, "dtype", None) is not None and not _inexact(p, v)]
    if not ints:
        return
    (path, dtype), more = ints[0], len(ints) - 1
    raise UsageError(
        f"{who}: the optimizer tracks integer parameter {path!r} ({dtype})"
        + (f" and {more} more" if more else "")
        + ": gradients exist for float parameters only, so nothing could update it. Fix: "
        "keep such a value in a Variable that is not a Param (e.g. "
        "nnx.Variable(jnp.array(0))), or build the optimizer over the float parameters: "
        "nnx.Optimizer(model, tx, wrt=nnx.All(nnx.Param, lambda path, v: "
        "jnp.issubdtype(v.dtype, jnp.floating)))."
    )


def _reading(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``loss_fn`` with the model's parameters read in the precision of the enclosing
    :func:`value_and_grad` call: it runs inside the differentiated function, on the
    model NNX merged there, so the cast is part of what is differentiated."""

    @functools.wraps(loss_fn)
    def read(model: Any, *args: Any) -> Any:
        p = context().reading
        if p is None:
            return loss_fn(model, *args)
        with p.reading(model):
            return loss_fn(model, *args)

    return read


def _checked_loss(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``loss_fn``, with its output checked (at trace time) against ``has_aux``: JAX's
    own error for a tuple loss does not mention ``has_aux``."""
    name = getattr(loss_fn, "__name__", "loss_fn")

    @functools.wraps(loss_fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        out = loss_fn(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple | list) and len(out) == 2):
                raise UsageError(
                    f"{name} returned {_describe_value(out)}, but "
                    "has_aux=True expects a pair (loss, aux), e.g. return loss, {'acc': acc}. "
                    "Fix: return the pair, or drop has_aux=True."
                )
            loss = out[0]
        elif isinstance(out, tuple | list):
            raise UsageError(
                f"{name} returned a {type(out).__name__} of {len(out)} values, not one scalar "
                "loss. Fix: if it returns (loss, aux), pass has_aux=True (Trainer(..., "
                "has_aux=True) or ns.value_and_grad(loss_fn, has_aux=True)); else return "
                "only the loss."
            )
        else:
            loss = out
        if np.ndim(loss) != 0:
            raise UsageError(
                f"{name} returned a loss of shape {fmt_shape(loss)}, not a scalar. Fix: "
                "reduce it over the examples, e.g. jnp.mean(per_example_loss)."
            )
        dtype = getattr(loss, "dtype", None) or np.result_type(type(loss))
        if not jnp.issubdtype(dtype, jnp.floating):
            raise UsageError(
                f"{name} returned a loss of dtype {dtype} ({short(loss, 40)}), not a float: "
                "it cannot be differentiated. Fix: compute the loss from the model's output "
                "in floating point, e.g. jnp.mean((model(x) - y) ** 2).")
        return out

    return checked


def _describe_value(x: Any) -> str:
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of {len(x)} values"
    if hasattr(x, "shape"):
        return f"an array of shape {fmt_shape(x)}"
    return f"{short_repr(x)} ({type(x).__name__})"


def _accumulate(
    vg: Callable[..., Any], m: int, wrt: Any, model: Any, batch: Any, args: tuple[Any, ...],
    weigh: Callable[[Any], jax.Array] | None = None,
) -> tuple[Any, Any]:
    """``vg`` over the ``m`` microbatches of ``batch``, combined: averaged alike, or with
    ``weigh`` (the loss's item count, see :func:`~nnx_shard.mean_over`) weighted by each
    microbatch's share of the whole step's items."""
    micro = _split_microbatches(batch, m)
    counts = total = ok = None
    if weigh is not None:
        # Counted on the whole step, before the split (transformers' num_items_in_batch),
        # and per microbatch, which must add up to it.
        total = weigh(batch)
        counts = jax.vmap(weigh)(micro)
        ok = _check_counts(counts, total, weigh)
    node_pos = [i for i, a in enumerate(args) if is_node(a)]
    graphdef, state = nnx.split((model, *(args[i] for i in node_pos)))
    zeros = laid_out(jax.tree.map(jnp.zeros_like, nnx.state(model, wrt)))
    grads_def: list[Any] = []

    def body(carry: Any, xs: Any) -> Any:
        state, acc = carry
        mb, n = xs
        nodes = nnx.merge(graphdef, state)
        call_args = list(args)
        for i, node in zip(node_pos, nodes[1:], strict=True):
            call_args[i] = node
        out, grads = vg(nodes[0], mb, *call_args)
        # Each microbatch's gradients reach the accumulator already in the gradients'
        # layout (zero2: the sum stays 1/N per device across the microbatches).
        grads = laid_out(grads)
        # Accumulate flat leaves: grads may carry Variable metadata that differs
        # from the zeros' (the structure is the same array for array).
        g_leaves, g_def = jax.tree.flatten(grads)
        grads_def.append(g_def)
        if n is not None and total is not None:
            # A step with no item at all has no mean: its microbatches count alike
            # (the loss is NaN as with one microbatch). Otherwise one with no item
            # adds nothing, whatever its loss (0/0) and gradients are.
            share = jnp.where(total > 0, n / total, 1.0 / m)
            used = (n > 0) | (total <= 0)
            g_leaves = [_part(g, share, used) for g in g_leaves]
            out = jax.tree.map(lambda x: _part(x, share, used), out)
        acc = [a + g for a, g in zip(acc, g_leaves, strict=True)]
        _, state = nnx.split(nodes)
        return (state, acc), out

    (state, acc), outs = jax.lax.scan(body, (state, jax.tree.leaves(zeros)), (micro, counts))
    nnx.update((model, *(args[i] for i in node_pos)), state)
    if ok is not None:
        grads = jax.tree.unflatten(grads_def[0], acc)
        # Counts that are no counts (traced, so not refused by _check_counts) give a NaN
        # loss, which the Trainer's guard stops at, rather than silently wrong weights.
        return jax.tree.map(lambda x: _poison(jnp.sum(x, axis=0), ok), outs), grads
    grads = jax.tree.unflatten(grads_def[0], [a / m for a in acc])
    return jax.tree.map(lambda x: jnp.mean(x, axis=0), outs), grads


def _check_counts(counts: jax.Array, total: jax.Array, weigh: Any) -> jax.Array:
    """Whether the microbatches' item ``counts`` are counts of the step's ``total``:
    finite, not negative, adding up to it. Known values that are not are a
    :class:`UsageError`; traced ones give the returned flag."""
    ok = (jnp.all(jnp.isfinite(counts)) & jnp.all(counts >= 0) & jnp.isfinite(total)
          & (jnp.abs(jnp.sum(counts) - total) <= 1e-5 * jnp.abs(total) + 1e-3))
    if isinstance(ok, jax.core.Tracer) or bool(ok):
        return ok
    loss_fn = getattr(weigh, "keywords", {}).get("loss_fn")
    name = getattr(loss_fn, "__name__", "loss_fn")
    seen = ", ".join(f"{float(c):g}" for c in np.asarray(counts)[:8])
    raise UsageError(
        f"mean_over: the item counts of {name} are no counts of the step: its "
        f"{counts.shape[0]} microbatches count [{seen}{', ...' if counts.shape[0] > 8 else ''}] "
        f"and the whole step {float(total):g}; they must be finite, not negative, and add up "
        "to the step's. Fix: make items(batch) count the batch's items (e.g. "
        "jnp.sum(batch['mask'])), not average or normalise them.")


def _poison(x: jax.Array, ok: jax.Array) -> jax.Array:
    """``x``, or NaN where ``ok`` is false (for float ``x``)."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return jnp.where(ok, x, jnp.asarray(jnp.nan, x.dtype))


def _part(x: Any, share: jax.Array, used: jax.Array) -> jax.Array:
    """One microbatch's part of a weighted sum: ``x * share``, or 0 where not ``used``
    (``where``, not a product: ``x`` may be NaN there). Floats keep their dtype."""
    x = jnp.asarray(x)
    part = jnp.where(used, x * share, jnp.zeros((), share.dtype))
    return part.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else part
