"""Per-device memory of the compiled train step, from abstract inputs only.

:func:`compile_fit` lowers and compiles the call :meth:`nnx_shard.Trainer.fit`
makes (``value_and_grad(lm_loss)``, the optimizer update and fit's NaN guard)
for a reference :class:`~nnx_shard.models.Transformer` config on a mesh of the
devices JAX has, from :func:`~nnx_shard.abstract_init`, the optimizer state of
that abstract model and ``jax.ShapeDtypeStruct`` batches carrying the batch
sharding. :func:`compiled_memory` reads its per-device figures. Nothing is
allocated; the figures are XLA's buffer assignment for the backend it compiled
for (``compiled.memory_analysis()``).

:func:`compiled_memory_subprocess` does the same in a fresh Python with ``n``
simulated CPU devices, so that ``nnx-shard plan`` can compile for any mesh size
(e.g. 256 devices) whatever devices the calling process has.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["CompileError", "compile_fit", "compiled_memory", "compiled_memory_subprocess"]


class CompileError(RuntimeError):
    """The compile in the subprocess failed or timed out; the message is one line."""


def _split(total: int, *parts: int) -> list[int]:
    return [int(p) for p in parts] + [int(total)]


def compile_fit(factory: Callable[[], Any], strategy: str, sizes: Mapping[str, int], *,
                batch: int, seq: int, optimizer: str = "adamw", microbatches: int = 1,
                loss: Callable[..., Any] | None = None, steps: int = 2) -> tuple[Any, Any, float]:
    """Compiles the call :meth:`nnx_shard.Trainer.fit` makes for ``steps`` steps of
    ``factory()``'s model under preset ``strategy`` on mesh ``sizes`` (of this
    process's devices), from abstract inputs: nothing is allocated. The batch is
    ``{"inputs", "targets"}``, int32 ``[steps, batch, seq]`` tokens laid out by
    the preset's rules; ``loss`` defaults to :func:`nnx_shard.models.lm_loss`.

    What is compiled is ``fit``'s own call, NaN guard included: the guard keeps
    the state from before the call to put it back if the call is not finite,
    so it needs one more copy of the model and optimizer state than a bare
    :func:`nnx_shard.multistep` step. The default two steps compile to the
    rolled loop every ``steps_per_call`` of 2 or more does, whose memory does
    not grow with K (a one-step call is unrolled by XLA, and there the copy of
    a sharded state can vanish: it is not what ``fit`` runs). Returns ``(compiled, trainer, seconds to
    lower and compile)``; the trainer holds the abstract model and optimizer and
    the mesh.

    >>> from flax import nnx
    >>> from nnx_shard.models import Transformer, get_config
    >>> compiled, trainer, seconds = compile_fit(
    ...     lambda: Transformer(get_config("tiny"), rngs=nnx.Rngs(0)), "fsdp", {"data": 4},
    ...     batch=4, seq=8)
    >>> compiled.memory_analysis().temp_size_in_bytes > 0
    True
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    import nnx_shard as ns
    from nnx_shard import strategies
    from nnx_shard.cli import _optimizer
    from nnx_shard.models import lm_loss

    strat = strategies.get(strategy)
    n = 1
    for v in sizes.values():
        n *= int(v)
    mesh = ns.make_mesh(dict(sizes), devices=jax.devices()[:n])
    t0 = time.perf_counter()
    abstract = strat.abstract_init(factory, mesh)
    opt = strat.optimizer(abstract, _optimizer(optimizer), mesh)
    spec = strat.rules.spec((None, "batch", "length"), shape=(steps, batch, seq), mesh=mesh,
                            path="batch['inputs']")
    tokens = jax.ShapeDtypeStruct((steps, batch, seq), jnp.int32,
                                  sharding=NamedSharding(mesh, spec))
    trainer = ns.Trainer(abstract, opt, loss or lm_loss, mesh=mesh, rules=strat.rules,
                         steps_per_call=steps, microbatches=microbatches)
    compiled = trainer.lower({"inputs": tokens, "targets": tokens}).compile()
    return compiled, trainer, time.perf_counter() - t0


def compiled_memory(model: str, sizes: Mapping[str, int], strategy: str = "fsdp_tp",
                    optimizer: str = "adamw", batch: int = 8, seq: int = 16,
                    remat: str = "none", scan_layers: bool | None = None) -> dict[str, Any]:
    """Per-device bytes of the call ``Trainer.fit`` compiles for config ``model``
    (see :func:`compile_fit`; the NaN guard's copy of the state is in ``temp``).

    Returns ``params`` and ``optimizer`` (the largest per-device shard of the
    model's and the optimizer's state, from the shardings of the compiled
    step's arguments), ``temp`` (XLA's temporary buffers: activations kept for
    the backward pass, gradients, collective scratch), ``argument``, ``output``,
    ``alias`` and ``total`` = argument + temp + output - alias, and
    ``compile_s`` (lower + compile seconds). ``remat`` and ``scan_layers``
    (``None``: the config's) replace those of the config. The mesh must fit in
    ``jax.device_count()``.

    >>> m = compiled_memory("tiny", {"data": 4, "model": 2}, "fsdp_tp", batch=8, seq=16)
    >>> m["total"] == m["argument"] + m["temp"] + m["output"] - m["alias"] > 0
    True
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from nnx_shard import strategies
    from nnx_shard.models import CONFIGS, Transformer

    cfg = dataclasses.replace(CONFIGS[model], remat=remat)
    if scan_layers is not None:
        cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
    # A pipeline strategy needs microbatches: as many as stages (the fewest it takes).
    sched = strategies.get(strategy).rules.options.get("pipeline")
    micro = dict(sizes).get(sched.axis, 1) if sched is not None else 1
    compiled, trainer, seconds = compile_fit(
        lambda: Transformer(cfg, rngs=nnx.Rngs(0)), strategy, sizes, batch=batch, seq=seq,
        optimizer=optimizer, microbatches=micro)
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


_CHILD = """
import json, sys
from nnx_shard.compiled import _child
_child(json.loads(sys.argv[1]))
"""


def _child(request: dict[str, Any]) -> None:
    try:
        result = compiled_memory(**request)
    except Exception as e:  # reported to the parent as one line
        msg = " ".join(str(e).split()) or type(e).__name__
        print(json.dumps({"error": f"{type(e).__name__}: {msg}"[:2000]}))
        return
    print(json.dumps(result))


def compiled_memory_subprocess(model: str, sizes: Mapping[str, int], *,
                               timeout: float = 300.0, **kwargs: Any) -> dict[str, Any]:
    """:func:`compiled_memory` in a fresh Python with as many simulated CPU
    devices as the mesh has (``JAX_PLATFORMS=cpu``); raises :class:`CompileError`
    with a one-line message if it fails or takes longer than ``timeout`` seconds.

    >>> m = compiled_memory_subprocess("tiny", {"data": 2}, strategy="dp", batch=2, seq=8)
    >>> m["devices"], m["backend"]
    (2, 'cpu')
    """
    n = 1
    for v in sizes.values():
        n *= int(v)
    from nnx_shard.launch import simulated_env

    env = simulated_env(n)
    # The child imports the same nnx_shard as this process.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    request = {"model": model, "sizes": dict(sizes), **kwargs}
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(request)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CompileError(f"compiling the train step on {n} simulated CPU devices took longer "
                           f"than {timeout:g} s; use --no-compile for the formula only, or "
                           "a longer --compile-timeout") from None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = " ".join((done.stderr or "").strip().splitlines()[-1:]) or f"exit {done.returncode}"
        raise CompileError(f"compiling the train step on {n} simulated CPU devices failed: "
                           f"{tail}")
    result = json.loads(lines[-1])
    if "error" in result:
        raise CompileError(f"compiling the train step on {n} simulated CPU devices failed: "
                           f"{result['error']}")
    return result
