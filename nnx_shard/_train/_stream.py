"""The optimizer update with offloaded state streamed layer by layer.

With the optimizer state in host memory (``Strategy.offload``), moving all of it to
the device for the update needs device room for the whole state next to the
parameters and the gradients: on Llama-3.1-8B in float32 that alone is 64 GB. The
layers of a scanned decoder are stacked on one leading axis (its logical name is
``"layers"``), so the update can run as a loop over that axis instead: each turn
moves one layer's slice of every stacked state leaf in, updates that layer, and
sends the new slice back, and the device holds one layer's state at a time (plus
the state of the leaves that are not stacked: embeddings, the final norm).

That is only the same update when the optimizer treats every element on its own:
AdamW, Adam, SGD, momentum, Lion do; ``optax.clip_by_global_norm`` (one norm over
all leaves) and trust-ratio optimizers (one norm per leaf) do not.
:func:`elementwise` asks the optimizer itself, on a probe, and the update falls
back to moving the whole state in where it says no.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnx_shard._annotate import logical_names
from nnx_shard._errors import UsageError
from nnx_shard._mesh import called, context, variable_spec
from nnx_shard._offload import arrive, arrive_after, host_rows, traced_host, traced_on_device
from nnx_shard._parallel.registry import microbatch_owner
from nnx_shard._train._trees import leaf_path

__all__ = ["APPLIED", "LAYERS", "apply_gradients", "arrive_params", "elementwise", "finite_flags",
           "host_finite", "host_leaf_finite", "not_applied", "offloaded_update", "streamed_update",
           "streams", "streams_params"]

#: The name :func:`apply_gradients` records in the step's call log when it runs
#: (``multistep(..., stream_offload=True)`` checks that the step applied its update so).
APPLIED = "apply_gradients"

#: The logical name of a scanned decoder's layer axis: leaves whose first axis has
#: it are streamed.
LAYERS = "layers"

# The probe: three elements of one leaf and one of another. A transform that treats
# elements on their own gives element 0 of "a" the same update whatever the others'
# gradients are, over two steps (the second catches state that mixes them).
_PROBE_PARAMS = {"a": np.array([0.5, -1.0, 2.0], np.float32),
                 "b": np.array([[1.5]], np.float32)}
_PROBE_GRADS = (
    {"a": np.array([0.1, -0.2, 0.3], np.float32), "b": np.array([[0.4]], np.float32)},
    {"a": np.array([0.1, 5.0, -7.0], np.float32), "b": np.array([[-9.0]], np.float32)},
)


def elementwise(tx: optax.GradientTransformation) -> bool:
    """Whether ``tx`` updates each element from that element's own gradient, state
    and value only (as Adam, AdamW, SGD do), asked of ``tx`` on a small probe; an
    optimizer that fails on the probe counts as not element-wise.

    >>> elementwise(optax.adamw(1e-3)), elementwise(optax.sgd(0.1, momentum=0.9))
    (True, True)
    >>> elementwise(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
    False
    """
    try:
        return _probed(tx)
    except TypeError:  # an optimizer that cannot be a cache key: asked every time
        return _probe(tx)


@functools.lru_cache(maxsize=64)
def _probed(tx: optax.GradientTransformation) -> bool:
    return _probe(tx)


def _probe(tx: optax.GradientTransformation) -> bool:
    try:
        with jax.ensure_compile_time_eval():
            firsts = []
            for grads in _PROBE_GRADS:
                params = {k: jnp.asarray(v) for k, v in _PROBE_PARAMS.items()}
                state = tx.init(params)
                seen = []
                for _ in range(2):
                    updates, state = tx.update(grads, state, params)
                    params = optax.apply_updates(params, updates)
                    seen.append(float(updates["a"][0]))
                firsts.append(seen)
    except Exception:  # any optimizer that cannot run the probe streams not
        return False
    return bool(np.allclose(firsts[0], firsts[1], rtol=1e-6, atol=0.0))


def _first_name(var: Any) -> Any:
    names = logical_names(var) if isinstance(var, nnx.Variable) else None
    return names[0] if names else None


def _variables(tree: Any) -> list[Any]:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _stacks(variables: Sequence[Any], values: Sequence[Any]) -> list[int | None]:
    """Each leaf's layer count where its first axis is the layer axis, else None."""
    return [int(v.shape[0]) if _first_name(var) == LAYERS and np.ndim(v) >= 1 else None
            for var, v in zip(variables, values, strict=True)]


def _layers_split(variables: Sequence[Any], stack: Sequence[int | None]) -> bool:
    """Whether the active rules split the layer axis over devices (a pipeline's
    stages): each device then holds only its own layers' state, and a loop over every
    layer would move each slice across devices instead of streaming it."""
    ctx = context()
    if ctx.mesh is None or ctx.rules is None:
        return False
    var = next(v for v, n in zip(variables, stack, strict=True) if n is not None)
    spec = variable_spec(var, ctx.mesh, ctx.rules)
    return len(spec) > 0 and spec[0] is not None


def _plan(model: Any, optimizer: Any) -> tuple[list[int | None], list[int | None]] | None:
    """The stacked leaves of the parameters and of the optimizer state, or None where
    the update cannot stream (nothing offloaded, nothing stacked, layers split over
    devices, an optimizer that is not element-wise)."""
    if type(optimizer).update is not nnx.Optimizer.update:
        return None  # a subclass's own update: not ours to split
    state_vars = _variables(optimizer.opt_state)
    state = jax.tree.leaves(nnx.as_pure(optimizer.opt_state))
    if not any(map(traced_host, state)):
        return None
    param_vars = _variables(nnx.state(model, optimizer.wrt))
    params = jax.tree.leaves(nnx.as_pure(nnx.state(model, optimizer.wrt)))
    p_stack, s_stack = _stacks(param_vars, params), _stacks(state_vars, state)
    if not any(s_stack):
        return None
    if _layers_split(state_vars, s_stack):
        return None
    # An element-wise optimizer's state mirrors the parameters, and nnx copies each
    # parameter's metadata onto its state leaves, so they name the layer axis too.
    if not elementwise(optimizer.tx):
        return None
    return p_stack, s_stack


def streams(model: Any, optimizer: Any) -> bool:
    """Inside ``jit``: whether :func:`streamed_update` streams this update (some
    optimizer state in host memory, stacked layers, an element-wise optimizer).

    >>> import optax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> streams(model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param))
    False
    """
    return _plan(model, optimizer) is not None


def _stacked_on_host(var: Any, x: Any) -> bool:
    return _first_name(var) == LAYERS and np.ndim(x) >= 1 and traced_host(x)


def streams_params(model: Any, optimizer: Any) -> bool:
    """Inside ``jit``, in a step traced by the fused call: whether the step streams
    the stacked parameters too (:func:`arrive_params`): some stacked parameter in
    host memory, an update that streams (:func:`streams`), one microbatch (the sum
    of microbatch gradients would be computed on host arrays), no pipeline (it runs
    the stack itself) and no ``gradients`` layout option (zero2's constraint on the
    gradients would be one on host arrays).

    >>> import optax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> streams_params(model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param))
    False
    """
    state = nnx.state(model, optimizer.wrt)
    if not any(_stacked_on_host(var, x) for var, x in zip(
            _variables(state), jax.tree.leaves(nnx.as_pure(state)), strict=True)):
        return False
    ctx = context()
    if ctx.microbatches not in (None, 1) or ctx.options.get("gradients") is not None:
        return False
    return microbatch_owner() is None and streams(model, optimizer)


def arrive_params(model: Any, optimizer: Any, stream: bool = True) -> bool:
    """Inside ``jit``: the step-start move of ``model``'s offloaded Variables to the
    device (:func:`nnx_shard._offload.arrive`), leaving the stacked ones in host
    memory where the step streams them (``stream`` and :func:`streams_params`):
    ``nnx_shard.pipeline.scan`` then moves one layer's slice in per turn. Returns
    whether it left them there.

    >>> import optax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> arrive_params(model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param))
    False
    """
    if not (stream and streams_params(model, optimizer)):
        arrive(model)
        return False
    state = nnx.state(model)
    leaves, treedef = jax.tree.flatten(nnx.as_pure(state))
    moved = [x if _stacked_on_host(var, x) else traced_on_device(x)
             for var, x in zip(_variables(state), leaves, strict=True)]
    nnx.update(model, jax.tree.unflatten(treedef, moved))
    return True


def _empty(x: Any) -> Any:
    """A zero-size stand-in for a leaf another pass updates (an element-wise update of
    it costs nothing); scalars (Adam's count) are kept: every pass needs them."""
    if np.ndim(x) == 0:
        return traced_on_device(x)
    return jnp.zeros((0, *np.shape(x)[1:]), jnp.result_type(x))


def _update(tx: Any, treedefs: tuple[Any, Any], grads: list[Any], state: list[Any],
            params: list[Any]) -> tuple[list[Any], list[Any]]:
    """``tx``'s update of flat ``params``/``grads``/``state``: new params and state."""
    ptree, stree = treedefs
    g, p = jax.tree.unflatten(ptree, grads), jax.tree.unflatten(ptree, params)
    updates, new_state = tx.update(g, jax.tree.unflatten(stree, state), p)
    return jax.tree.leaves(optax.apply_updates(p, updates)), jax.tree.leaves(new_state)


def streamed_update(model: Any, optimizer: nnx.Optimizer, grads: Any) -> bool:
    """Inside ``jit``: ``optimizer.update(model, grads)`` with the offloaded stacked
    optimizer state moved in and out one layer at a time; returns False, having done
    nothing, where the update cannot stream (see :func:`elementwise`, ``LAYERS``), so
    the caller moves the whole state in and calls ``optimizer.update``.

    The leaves that are not stacked are updated first, in one pass with the stacked
    leaves standing in as zero-size arrays; then one ``jax.lax.scan`` per layer
    count updates the stacked ones a layer per turn, the non-stacked leaves standing
    in as zero-size arrays. Scalars every pass needs (Adam's count) come from the
    first pass. The parameters are updated in place in the loop's carry; the state
    slices go in from, and back to, host memory.

    >>> import optax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    >>> streamed_update(model, opt, nnx.state(model, nnx.Param))  # nothing offloaded
    False
    """
    plan = _plan(model, optimizer)
    if plan is None:
        return False
    p_stack, s_stack = plan
    tx = optimizer.tx
    param_pure = nnx.as_pure(nnx.state(model, optimizer.wrt))
    params, ptree = jax.tree.flatten(param_pure)
    grads_ = jax.tree.leaves(nnx.as_pure(nnx.state(grads, optimizer.wrt)))
    state_pure = nnx.as_pure(optimizer.opt_state)
    state, stree = jax.tree.flatten(state_pure)
    treedefs = (ptree, stree)
    on_host = [traced_host(x) for x in state]

    # The leaves that are not stacked (and every scalar), the stacked ones standing in
    # as zero-size arrays.
    new_params, new_state = _update(
        tx, treedefs,
        [_empty(x) if n is not None else x for x, n in zip(grads_, p_stack, strict=True)],
        [_empty(x) if n is not None else traced_on_device(x)
         for x, n in zip(state, s_stack, strict=True)],
        [_empty(x) if n is not None else x for x, n in zip(params, p_stack, strict=True)])
    out_params = [new if n is None else old
                  for new, old, n in zip(new_params, params, p_stack, strict=True)]
    out_state = [new if n is None else old
                 for new, old, n in zip(new_state, state, s_stack, strict=True)]

    for count in sorted({n for n in (*p_stack, *s_stack) if n is not None}):
        pi = [i for i, n in enumerate(p_stack) if n == count]
        si = [i for i, n in enumerate(s_stack) if n == count]
        # Stacked parameters in device memory are updated in place in the loop's carry;
        # those in host memory (streamed by the forward pass too, streams_params) go
        # in and back out a slice per turn, as the state does.
        pc = [i for i in pi if not traced_host(params[i])]
        ph = [i for i in pi if traced_host(params[i])]

        def turn(carried: list[Any], xs: tuple[Any, ...], pi: list[int] = pi,
                 si: list[int] = si, pc: list[int] = pc,
                 ph: list[int] = ph) -> tuple[list[Any], tuple[list[Any], list[Any]]]:
            layer, g_slices, s_slices, p_slices = xs
            p_in = [_empty(x) for x in params]
            g_in = [_empty(x) for x in grads_]
            s_in = [_empty(x) for x in state]
            for k, i in enumerate(pc):
                p_in[i] = jax.lax.dynamic_index_in_dim(carried[k], layer, keepdims=False)
            for k, i in enumerate(ph):
                p_in[i] = traced_on_device(p_slices[k])
            for k, i in enumerate(pi):
                g_in[i] = traced_on_device(g_slices[k])
            for k, i in enumerate(si):
                s_in[i] = traced_on_device(s_slices[k])
            new_p, new_s = _update(tx, treedefs, g_in, s_in, p_in)
            carried = [jax.lax.dynamic_update_index_in_dim(c, new_p[i], layer, 0)
                       for c, i in zip(carried, pc, strict=True)]
            back = [jax.device_put(new_s[i], jax.memory.Space.Host) if on_host[i]
                    else new_s[i] for i in si]
            p_back = [jax.device_put(new_p[i], jax.memory.Space.Host) for i in ph]
            return carried, (back, p_back)

        carried, (stacked, p_stacked) = jax.lax.scan(
            turn, [params[i] for i in pc],
            (jnp.arange(count), [grads_[i] for i in pi], [state[i] for i in si],
             [params[i] for i in ph]))
        for k, i in enumerate(pc):
            out_params[i] = carried[k]
        for k, i in enumerate(ph):
            out_params[i] = p_stacked[k]
        for k, i in enumerate(si):
            out_state[i] = stacked[k]

    nnx.update(model, jax.tree.unflatten(ptree, out_params))
    nnx.update(optimizer.opt_state,
               nnx.state(jax.tree.unflatten(stree, out_state), graph=optimizer.graph))
    # The step count may be offloaded too: counted on the device (the step moves it back).
    optimizer.step[...] = traced_on_device(optimizer.step[...]) + 1
    return True


def offloaded_update(model: Any, optimizer: nnx.Optimizer, grads: Any) -> None:
    """Inside ``jit``: ``optimizer.update(model, grads)`` for a step that may hold its
    optimizer state in host memory: streamed layer by layer where
    :func:`streamed_update` can, else the whole state moved in once the gradients
    exist (:func:`nnx_shard._offload.arrive_after`); with nothing offloaded, the
    plain update.

    >>> import optax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    >>> grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    >>> offloaded_update(model, opt, grads)
    >>> model.bias[...].tolist()
    [-0.5, -0.5]
    """
    if not streamed_update(model, optimizer, grads):
        optimizer.update(model, arrive_after(optimizer, grads))


def apply_gradients(model: Any, optimizer: nnx.Optimizer, grads: Any) -> None:
    """``optimizer.update(model, grads)``, streaming what a strategy's ``offload`` keeps
    in host memory: inside a step, the optimizer state (and, where the forward pass
    left them there, the stacked parameters) moves to the device one layer at a time
    where the layers are scanned and the optimizer treats every element on its own
    (AdamW, Adam, SGD, Lion), and whole, once the gradients exist, where not. With
    nothing offloaded it is ``optimizer.update(model, grads)``.

    A step fused with ``nnx_shard.multistep(step, stream_offload=True)`` must apply
    its update with it: that step leaves the optimizer state (and the stacked
    offloaded parameters) in host memory at its start, so a plain
    ``optimizer.update`` would compute on host arrays. State that was in host memory
    is there again after it, inside a compiled step or not.

    Args:
      model: the NNX model the gradients are of.
      optimizer: its ``nnx.Optimizer``.
      grads: the gradients (``nnx.grad``'s or :func:`nnx_shard.value_and_grad`'s).

    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    >>> grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    >>> ns.apply_gradients(model, opt, grads)
    >>> model.bias[...].tolist(), int(opt.step[...])
    ([-0.5, -0.5], 1)
    """
    _check_apply(model, optimizer, grads)
    called(APPLIED)
    nodes = (model, optimizer)
    hosts = [traced_host(x) for x in jax.tree.leaves(nnx.state(nodes))]
    offloaded_update(model, optimizer, grads)
    if any(hosts):
        # What came from host memory goes back there (the update leaves the leaves it
        # moved in whole, and the step count, on the device).
        leaves, treedef = jax.tree.flatten(nnx.state(nodes))
        nnx.update(nodes, jax.tree.unflatten(treedef, [
            jax.device_put(x, jax.memory.Space.Host) if h and not traced_host(x) else x
            for x, h in zip(leaves, hosts, strict=True)]))


def _check_apply(model: Any, optimizer: Any, grads: Any) -> None:
    """UsageErrors for :func:`apply_gradients`' arguments: a model that is no
    ``nnx.Module``, an optimizer that is no ``nnx.Optimizer``, gradients that are not
    those of the optimizer's parameters of the model (each path named)."""
    if not isinstance(model, nnx.Module):
        raise UsageError(
            f"apply_gradients: model is a {type(model).__name__}, not an nnx.Module. Fix: "
            "apply_gradients(model, optimizer, grads) with the model the gradients are of.")
    if not isinstance(optimizer, nnx.Optimizer):
        raise UsageError(
            f"apply_gradients: optimizer is a {type(optimizer).__name__}, not an "
            "nnx.Optimizer. Fix: apply_gradients(model, nnx.Optimizer(model, tx, "
            "wrt=nnx.Param), grads).")

    def paths(tree: Any, inexact: bool = False) -> list[str]:
        return [leaf_path(p) for p, x in jax.tree_util.tree_flatten_with_path(
            nnx.as_pure(tree))[0] if not inexact or jnp.issubdtype(jnp.result_type(x),
                                                                   jnp.inexact)]

    try:
        got = set(paths(grads))
    except Exception:  # not a pytree of arrays at all
        got = set()
    state = nnx.state(model, optimizer.wrt)
    want, need = paths(state), set(paths(state, inexact=True))
    # An integer parameter (a count kept with the weights) has no gradient.
    if not got or not need <= got <= set(want):
        extra, missing = sorted(got - set(want)), sorted(need - got)
        what = (f"is a {type(grads).__name__} holding no gradient" if not got
                else f"holds a gradient for {extra[0]!r}, which the optimizer does not update"
                if extra else f"holds no gradient for {missing[0]!r}")
        raise UsageError(
            f"apply_gradients: grads {what}: it must hold the gradients of the optimizer's "
            f"parameters of the model ({len(want)} leaves, e.g. {want[0] if want else None!r}). "
            "Fix: take them with ns.value_and_grad(loss_fn)(model, batch) or nnx.grad over "
            "the same model.")


def not_applied(fn_name: str) -> UsageError:
    """The error of a step fused with ``stream_offload=True`` that did not apply its
    update with :func:`apply_gradients`."""
    return UsageError(
        f"multistep(..., stream_offload=True): {fn_name} never called "
        "nnx_shard.apply_gradients, which moves the optimizer state the step leaves in "
        "host memory to the device. Fix: apply the update with "
        "ns.apply_gradients(model, optimizer, grads) instead of "
        "optimizer.update(model, grads), or drop stream_offload.")


def host_leaf_finite(var: Any, x: jax.Array) -> jax.Array:
    """Inside ``jit``: whether ``x``, the value of Variable ``var`` in host memory, is
    all finite, read on the device a layer slice at a time where it is stacked
    (:func:`~nnx_shard._offload.host_rows`), whole otherwise.

    >>> from flax import nnx
    >>> bool(host_leaf_finite(None, jnp.array([1.0, jnp.inf])))
    False
    """
    if _first_name(var) == LAYERS and np.ndim(x) >= 1:
        return jnp.all(host_rows(x, lambda row: jnp.all(jnp.isfinite(row))))
    return jnp.all(jnp.isfinite(traced_on_device(x)))


def finite_flags(tree: Any) -> tuple[list[str], list[jax.Array]]:
    """Paths and all-finite flags of the inexact (float/complex) leaves of ``tree`` (a
    state): one reduction per leaf, a leaf in host memory read as
    :func:`host_leaf_finite` reads it; integer leaves (step counts) and RNG keys
    cannot be NaN.

    >>> from flax import nnx
    >>> paths, flags = finite_flags(nnx.state(nnx.Linear(2, 2, rngs=nnx.Rngs(0))))
    >>> paths, [bool(f) for f in flags]
    (['bias', 'kernel'], [True, True])
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    variables = _variables(tree)
    if len(variables) != len(flat):  # a Variable holding a pytree: no layer names to read
        variables = [None] * len(flat)
    paths, flags = [], []
    for (path, x), var in zip(flat, variables, strict=True):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact):
            paths.append(leaf_path(path))
            flags.append(host_leaf_finite(var, x) if traced_host(x)
                         else jnp.all(jnp.isfinite(x)))
    return paths, flags


def host_finite(state: Any) -> tuple[list[Any], list[jax.Array]]:
    """Inside ``jit``: ``state``'s (an ``nnx.State``) leaves split for a finiteness
    check that never holds a stacked host leaf on the device whole: the leaves in
    device memory, returned to be checked as they are, and one flag per inexact
    leaf in host memory (:func:`host_leaf_finite`).

    >>> from flax import nnx
    >>> leaves, flags = host_finite(nnx.state(nnx.Linear(2, 2, rngs=nnx.Rngs(0))))
    >>> len(leaves), flags
    (2, [])
    """
    variables = _variables(state)
    values = jax.tree.leaves(nnx.as_pure(state))
    on_device, flags = [], []
    for var, x in zip(variables, values, strict=True):
        if not traced_host(x):
            on_device.append(x)
        elif jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            flags.append(host_leaf_finite(var, x))
    return on_device, flags
