"""Per-device memory and costs of the compiled train step, from abstract inputs only.

:func:`compile_fit` lowers and compiles the call :meth:`nnx_shard.Trainer.fit`
makes (``value_and_grad(lm_loss)``, the optimizer update and fit's NaN guard)
for a model factory on a mesh of the devices JAX has, from
:func:`~nnx_shard.abstract_init`, the optimizer state of that abstract model and
``jax.ShapeDtypeStruct`` batches carrying the batch sharding. Nothing is
allocated; the figures are XLA's buffer assignment for the backend it compiled
for (``compiled.memory_analysis()``). :func:`compiled_memory` reads them for a
reference config (``nnx-shard plan``), :func:`compile_step` adds the costs of
:func:`~nnx_shard.planner._costs.hlo_costs` per step (the planner's search).

:func:`compiled_memory_subprocess` does the same in a fresh Python with ``n``
simulated CPU devices (:func:`nnx_shard._simulated.run_requests`), so that
``nnx-shard plan`` can compile for any mesh size (e.g. 256 devices) whatever
devices the calling process has.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from nnx_shard import _optimizers as optimizers
from nnx_shard._errors import CompileError
from nnx_shard._init import abstract_init, sharded_optimizer
from nnx_shard._mesh import make_mesh, parse_axes
from nnx_shard._parallel.schedule import stage_count
from nnx_shard._simulated import run_one
from nnx_shard._train import Precision, Trainer
from nnx_shard._train._guard import DEFAULT_GUARD
from nnx_shard.models import DecoderConfig, ReferenceConfig, lm_loss
from nnx_shard.models._named import build, get_config
from nnx_shard.planner._costs import hlo_costs
from nnx_shard.strategies._presets import get
from nnx_shard.strategies._strategy import Strategy

__all__ = ["PLAN_COMPILER_OPTIONS", "CompileError", "compile_fit", "compile_step", "compiled_memory",
           "compiled_memory_subprocess", "planned_config", "steps_batch"]


#: XLA options of the planner's compiles, which are never run: no LLVM optimisation
#: of the CPU code. The optimised HLO, its buffer assignment (memory_analysis) and
#: so every figure the planner reads are those of the default compile (a test
#: compares them), and the compile is faster.
PLAN_COMPILER_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}


def compile_fit(factory: Callable[[], Any], strategy: str | Strategy, sizes: str | Mapping[str, int], *,
                batch: int, seq: int, optimizer: str = "adamw", microbatches: int = 1,
                loss: Callable[..., Any] | None = None, steps: int = 2,
                precision: Precision | None = None, guard: str = DEFAULT_GUARD,
                batch_spec: Any = None) -> tuple[Any, Any, float]:
    """Compiles the call :meth:`nnx_shard.Trainer.fit` makes for ``steps`` steps of
    ``factory()``'s model under preset ``strategy`` (a name, or a
    :class:`~nnx_shard.strategies.Strategy` such as one ``with_rules``) on mesh ``sizes`` (of this
    process's devices; ``"data=4,model=2"`` or a dict, read by
    :func:`~nnx_shard._mesh.parse_axes`, every axis sized), from abstract inputs: nothing is allocated. The batch is
    ``{"inputs", "targets"}``, int32 ``[steps, batch, seq]`` tokens laid out by
    the preset's rules; ``loss`` defaults to :func:`nnx_shard.models.lm_loss`;
    ``precision`` is the trainer's (:class:`nnx_shard.Precision`).
    ``batch_spec`` replaces that batch: a pytree of ``jax.ShapeDtypeStruct`` of one
    step's global batch (``batch`` and ``seq`` are then unused), each leaf given a
    leading steps axis and laid out as ``Trainer.fit`` places it by default, its
    first dimension on ``batch`` (see :func:`steps_batch`).

    What is compiled is ``fit``'s own call, NaN guard included (``guard``, the
    Trainer's mode): under ``guard="full"`` the guard keeps the state from before
    the call to put it back if the call is not finite, so it needs one more copy
    of the model and optimizer state than a bare :func:`nnx_shard.multistep`
    step; ``"grads"`` and ``"off"`` keep none. The default two steps compile to the
    rolled loop every ``steps_per_call`` of 2 or more does, whose memory does
    not grow with K (a one-step call is unrolled by XLA, and there the copy of
    a sharded state can vanish: it is not what ``fit`` runs). Returns ``(compiled, trainer, seconds to
    lower and compile)``; the trainer holds the abstract model and optimizer and
    the mesh.

    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, ReferenceConfig
    >>> compiled, trainer, seconds = compile_fit(
    ...     lambda: Decoder(ReferenceConfig(layers=1), rngs=nnx.Rngs(0)), "fsdp", {"data": 4},
    ...     batch=4, seq=8)
    >>> compiled.memory_analysis().temp_size_in_bytes > 0
    True
    """
    sizes = parse_axes(sizes, rest=False)
    strat = strategy if isinstance(strategy, Strategy) else get(strategy)
    n = 1
    for v in sizes.values():
        n *= int(v)
    mesh = make_mesh(dict(sizes), devices=jax.devices()[:n])
    t0 = time.perf_counter()
    abstract = abstract_init(factory, mesh, strat)
    opt = sharded_optimizer(abstract, optimizers.get(optimizer), mesh, strat)
    if batch_spec is not None:
        data = steps_batch(batch_spec, strat.rules, mesh, steps)
    else:
        spec = strat.rules.spec((None, "batch", "length"), shape=(steps, batch, seq),
                                mesh=mesh, path="batch['inputs']")
        tokens = jax.ShapeDtypeStruct((steps, batch, seq), jnp.int32,
                                      sharding=NamedSharding(mesh, spec))
        data = {"inputs": tokens, "targets": tokens}
    trainer = Trainer(abstract, opt, loss or lm_loss, mesh=mesh, rules=strat.rules,
                      steps_per_call=steps, microbatches=microbatches, precision=precision,
                      guard=guard)
    compiled = trainer.lower(data).compile(compiler_options=PLAN_COMPILER_OPTIONS)
    return compiled, trainer, time.perf_counter() - t0


def steps_batch(batch_spec: Any, rules: Any, mesh: Any, steps: int) -> Any:
    """``batch_spec`` (``jax.ShapeDtypeStruct`` leaves of one step's global batch) as
    the ``[steps, ...]`` group ``Trainer.fit`` compiles, each leaf's first dimension
    laid out on ``batch`` by ``rules`` (the trainer's default ``batch_names``).

    >>> from nnx_shard._rules import Rules
    >>> b = steps_batch({"x": jax.ShapeDtypeStruct((8, 3), jnp.float32)},
    ...                 Rules({"batch": "data"}), make_mesh("data=8"), 2)
    >>> b["x"].shape, b["x"].sharding.spec
    ((2, 8, 3), P(None, 'data', None))
    """
    def one(path: Any, leaf: Any) -> jax.ShapeDtypeStruct:
        shape = (steps, *leaf.shape)
        names = (None, "batch", *(None,) * (len(leaf.shape) - 1)) if leaf.shape else (None,)
        spec = rules.spec(names, shape=shape, mesh=mesh,
                          path=f"batch{jax.tree_util.keystr(path)}")
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, batch_spec)


def compiled_memory(model: str | ReferenceConfig | DecoderConfig, sizes: str | Mapping[str, int],
                    strategy: str = "fsdp_tp",
                    optimizer: str = "adamw", batch: int = 8, seq: int = 16,
                    remat: str = "none", scan_layers: bool | None = None,
                    param_dtype: str | None = None,
                    compute_dtype: str | None = None,
                    guard: str = DEFAULT_GUARD) -> dict[str, Any]:
    """Per-device bytes of the call ``Trainer.fit`` compiles for config ``model``
    (a name of :data:`nnx_shard.models.CONFIGS`, the reference model's
    or a Llama family's, or such a config itself) with NaN guard ``guard`` (see
    :func:`compile_fit`; under ``"full"`` the guard's copy of the state is in ``temp``).

    Returns ``params`` and ``optimizer`` (the largest per-device shard of the
    model's and the optimizer's state, from the shardings of the compiled
    step's arguments), ``temp`` (XLA's temporary buffers: activations kept for
    the backward pass, gradients, collective scratch), ``argument``, ``output``,
    ``alias`` and ``total`` = argument + temp + output - alias, and
    ``compile_s`` (lower + compile seconds). ``remat``, ``scan_layers``,
    ``param_dtype`` and ``compute_dtype`` (``None``: the config's) replace those of
    the config; where the parameter and compute dtypes differ the trainer gets
    ``Precision(params=param_dtype, compute=compute_dtype)`` (mixed precision). The
    mesh ``sizes``, ``"data=4,model=2"`` or a dict (read by
    :func:`~nnx_shard._mesh.parse_axes`, every axis sized), must fit in
    ``jax.device_count()``.

    Args:
      model: a name of :data:`nnx_shard.models.CONFIGS`, or such a config.
      sizes: the mesh, ``"data=4,model=2"`` or a dict, within ``jax.device_count()``.
      strategy: a preset name.
      optimizer: ``adamw``, ``adam`` or ``sgd``.
      batch: the global batch (rows).
      seq: the sequence length.
      remat: a name of :data:`nnx_shard.models.REMAT_POLICIES`.
      scan_layers: stack the layers in a scan (``None``: the config's).
      param_dtype: the parameters' dtype (``None``: the config's).
      compute_dtype: the compute dtype (``None``: the config's); differing from ``param_dtype``
        means mixed precision.
      guard: the trainer's NaN guard (``"grads"``, ``"full"`` or ``"off"``).

    >>> from nnx_shard.planner import compiled_memory
    >>> m = compiled_memory("tiny", {"data": 4, "model": 2}, "fsdp_tp", batch=8, seq=16)
    >>> m["total"] == m["argument"] + m["temp"] + m["output"] - m["alias"] > 0
    True
    """
    sizes = parse_axes(sizes, rest=False)
    cfg, precision = planned_config(model, remat=remat, scan_layers=scan_layers,
                                    param_dtype=param_dtype, compute_dtype=compute_dtype)
    # A pipeline strategy needs microbatches: as many as stages (the fewest it takes).
    micro = stage_count(get(strategy).rules, sizes) or 1
    compiled, trainer, seconds = compile_fit(
        lambda: build(cfg, nnx.Rngs(0)), strategy, sizes, batch=batch, seq=seq,
        optimizer=optimizer, microbatches=micro, precision=precision, guard=guard)
    mem = compiled.memory_analysis()

    def per_device(tree: Any) -> int:
        total = 0
        for x in jax.tree.leaves(tree):
            shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
            total += int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
        return total

    params = per_device(nnx.state(trainer.model, nnx.Param))
    opt_bytes = per_device(nnx.state(trainer.optimizer, nnx.optimizer.OptState))
    arg, temp, out = (mem.argument_size_in_bytes, mem.temp_size_in_bytes,
                      mem.output_size_in_bytes)
    alias = mem.alias_size_in_bytes
    return {"params": params, "optimizer": opt_bytes, "temp": int(temp), "argument": int(arg),
            "output": int(out), "alias": int(alias), "total": int(arg + temp + out - alias),
            "compile_s": round(seconds, 3), "backend": jax.default_backend(),
            "devices": int(np.prod(list(sizes.values())))}


def planned_config(model: str | ReferenceConfig | DecoderConfig, *, remat: str = "none", scan_layers: bool | None = None,
                   param_dtype: Any = None, compute_dtype: Any = None,
                   ) -> tuple[ReferenceConfig | DecoderConfig, Precision | None]:
    """The named config ``model`` as ``nnx-shard plan`` compiles it: ``remat``,
    ``scan_layers``, ``param_dtype`` and ``compute_dtype`` (the config's ``dtype``)
    replaced where given, and the :class:`~nnx_shard.Precision` the trainer gets
    (``None`` where the two dtypes are the same).

    >>> cfg, p = planned_config("llama3-8b", param_dtype="float32")
    >>> cfg.param_dtype, cfg.dtype, p
    (dtype('float32'), dtype(bfloat16), Precision(params=float32, compute=bfloat16))
    """
    cfg = get_config(model) if isinstance(model, str) else model
    cfg = dataclasses.replace(cfg, remat=remat)
    if scan_layers is not None:
        cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
    params = jnp.dtype(param_dtype if param_dtype is not None else cfg.param_dtype)
    compute = jnp.dtype(compute_dtype if compute_dtype is not None else cfg.dtype)
    cfg = dataclasses.replace(cfg, param_dtype=params, dtype=compute)
    return cfg, (Precision(params=params, compute=compute) if params != compute else None)


def compile_step(factory: Callable[[], Any], strategy: str | Strategy, sizes: str | Mapping[str, int], *,
                 batch: int, seq: int, optimizer: str = "adamw", microbatches: int = 1,
                 loss: Callable[..., Any] | None = None,
                 guard: str = DEFAULT_GUARD, batch_spec: Any = None) -> dict[str, Any]:
    """Compiles the call :meth:`nnx_shard.Trainer.fit` makes for one step of
    ``factory()``'s model (abstract: nothing allocated; NaN guard included, see
    :func:`compile_fit`) under preset ``strategy`` on mesh
    ``sizes`` of this process's devices, and returns its per-device memory
    (``total``, ``temp``, ``argument``, ``output``, ``alias``), :func:`hlo_costs`
    figures per step and ``compile_s``. The batch is ``{"inputs", "targets"}``,
    int32 ``[batch, seq]`` tokens, and ``loss`` defaults to
    :func:`nnx_shard.models.lm_loss`; ``batch_spec`` replaces the batch as in
    :func:`compile_fit`. The call compiled runs two steps (the
    rolled loop of ``fit``'s calls); the costs are its figures halved, so they
    include half of the guard's once-per-call check.

    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, ReferenceConfig
    >>> r = compile_step(lambda: Decoder(ReferenceConfig(layers=1), rngs=nnx.Rngs(0)),
    ...                  "dp", {"data": 2}, batch=4, seq=8)
    >>> r["total"] > 0 and r["flops"] > 0 and r["collectives"] > 0
    True
    """
    compiled, trainer, seconds = compile_fit(
        factory, strategy, sizes, batch=batch, seq=seq, optimizer=optimizer,
        microbatches=microbatches, loss=loss, guard=guard, batch_spec=batch_spec)
    mem = compiled.memory_analysis()
    costs = hlo_costs(compiled.as_text(), trainer.mesh)
    k = trainer.steps_per_call
    costs = {**costs, "by_kind": {kind: b / k for kind, b in costs["by_kind"].items()},
             **{key: costs[key] / k
                for key in ("flops", "collective_bytes", "collectives", "memory_bytes")}}
    arg, temp, out, alias = (int(mem.argument_size_in_bytes), int(mem.temp_size_in_bytes),
                             int(mem.output_size_in_bytes), int(mem.alias_size_in_bytes))
    return {"total": arg + temp + out - alias, "temp": temp, "argument": arg, "output": out,
            "alias": alias, **costs, "compile_s": round(seconds, 3)}


def config_dict(cfg: ReferenceConfig | DecoderConfig) -> dict[str, Any]:
    """A model config (any family's: :class:`~nnx_shard.models.ReferenceConfig`,
    :class:`~nnx_shard.models.DecoderConfig` or a family's own class) as JSON-able
    fields (dtypes by name); ``model_type`` says which class :func:`config_factory`
    builds again.

    >>> config_dict(get_config("tiny"))["param_dtype"]
    'float32'
    >>> config_dict(get_config("qwen3-0.6b"))["model_type"]
    'qwen3'
    """
    out = {k: (jnp.dtype(v).name if k.endswith("dtype") else v)
           for k, v in dataclasses.asdict(cfg).items()}
    return {**out, "model_type": cfg.model_type}  # a class constant of the reference family


def config_factory(config: Mapping[str, Any], remat: str) -> Callable[[], Any]:
    """A factory of the model of ``config`` (:func:`config_dict`'s fields, its family's
    config class) with remat policy ``remat``."""
    fields = {k: (jnp.dtype(v) if k.endswith("dtype") else v) for k, v in config.items()}
    cfg = DecoderConfig.for_model(fields.pop("model_type"), **{**fields, "remat": remat})
    return lambda: build(cfg, nnx.Rngs(0))


def compile_step_request(request: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`compile_step` of a reference config, as the planner's search asks for it
    in a child Python (see :func:`nnx_shard._simulated.run_requests`)."""
    factory = config_factory(request["config"], request["remat"])
    return compile_step(factory, request["strategy"], request["sizes"], batch=request["batch"],
                        seq=request["seq"], optimizer=request["optimizer"],
                        microbatches=request["microbatches"],
                        guard=request.get("guard", DEFAULT_GUARD))


def compiled_memory_request(request: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`compiled_memory` of ``request`` (its keyword arguments) in a child Python."""
    return compiled_memory(**request)


def compiled_memory_subprocess(model: str, sizes: str | Mapping[str, int], *,
                               timeout: float = 300.0, **kwargs: Any) -> dict[str, Any]:
    """:func:`compiled_memory` in a fresh Python with as many simulated CPU
    devices as the mesh has (``JAX_PLATFORMS=cpu``); raises
    :class:`~nnx_shard._errors.CompileError` with a one-line message if it fails or
    takes longer than ``timeout`` seconds.

    >>> m = compiled_memory_subprocess("tiny", {"data": 2}, strategy="dp", batch=2, seq=8)
    >>> m["devices"], m["backend"]
    (2, 'cpu')
    """
    sizes = parse_axes(sizes, rest=False)
    n = 1
    for v in sizes.values():
        n *= int(v)
    return run_one("nnx_shard.planner._compile:compiled_memory_request",
                   {"model": model, "sizes": dict(sizes), **kwargs}, n, timeout=timeout,
                   what=f"compiling the train step on {n} simulated CPU devices",
                   slow="; use --no-compile for the formula only, or a longer --compile-timeout",
                   error_chars=2000)
