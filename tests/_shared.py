"""Helpers the tests share: host copies of trees and models, the bytes each device holds,
and the one-device reference run that layouts are compared with."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nnx_shard as ns


def load_file(path: Path, name: str) -> ModuleType:
    """The Python file ``path`` (a benchmark script, a docs hook) imported as module
    ``name``, its folder importable while it loads (benchmarks import their ``_common``)."""
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


def host(tree: Any) -> Any:
    """``tree`` with every array as a numpy copy on the host (PRNG keys as their bits)."""

    def one(x: Any) -> np.ndarray:
        if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)


def host_copy(model: Any) -> Any:
    """A copy of the NNX ``model`` whose arrays are host numpy arrays (no device layout)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, host(state))


def device_bytes(tree: Any) -> dict[int, int]:
    """Bytes of the arrays in ``tree`` that each device holds, by device id."""
    per: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            per[shard.device.id] = per.get(shard.device.id, 0) + shard.data.nbytes
    return per


def one_device_run(make: Callable[[], Any], loss_fn: Callable[[Any, Any], jax.Array],
                   tx: optax.GradientTransformation, batches: Iterable[Any],
                   what: Any = nnx.Param) -> tuple[np.ndarray, Any]:
    """The reference every layout is compared with: ``make()`` trained by a plain
    ``nnx.jit`` loop of ``loss_fn`` and ``tx`` over ``batches`` on the first device, with
    Flax's eager sharding off (logical names are not mesh axes). Returns the losses and
    a host copy of the final ``nnx.state(model, what)``."""
    with jax.default_device(jax.devices()[0]), nnx.use_eager_sharding(False):
        model = make()
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model: Any, opt: nnx.Optimizer, batch: Any) -> jax.Array:
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
            opt.update(model, grads)
            return loss

        losses = [float(step(model, opt, jax.tree.map(jnp.asarray, b))) for b in batches]
    return np.asarray(losses), host(nnx.state(model, what))


class MLP(nnx.Module):
    """A two-layer MLP annotated through ``ns.with_logical``: kernels ``('embed', 'mlp')``
    and ``('mlp', 'embed')``, the first bias ``('mlp',)``, the second ``down_bias``
    (``None``: unannotated, so replicated). It holds its dropout stream (RNG state
    Variables); ``dropout`` is the rate applied between the layers (0: none)."""

    def __init__(self, rngs: nnx.Rngs, d: int = 16, h: int = 32, *, dropout: float = 0.2,
                 down_bias: tuple[str, ...] | None = ("embed",)):
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.up = nnx.Linear(d, h, kernel_init=ns.with_logical(init, ("embed", "mlp")),
                             bias_init=ns.with_logical(zeros, ("mlp",)), rngs=rngs)
        self.down = nnx.Linear(
            h, d, kernel_init=ns.with_logical(init, ("mlp", "embed")),
            bias_init=zeros if down_bias is None else ns.with_logical(zeros, down_bias),
            rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.drop(nnx.relu(self.up(x))))


def load_refusal(folder: Any, cfg: Any) -> str:
    """The text of the UsageError ``load_safetensors`` raises filling a dp-sharded
    ``Decoder(cfg)`` on ``data=8`` from ``folder`` (fails the test if it loads)."""
    import pytest

    from nnx_shard._errors import UsageError
    from nnx_shard.models import Decoder

    target = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), "data=8",
                              ns.strategies.get("dp").rules)
    with pytest.raises(UsageError) as info:
        ns.hf.load_safetensors(folder, target)
    return str(info.value)


def adapter_copy(source: Path, out: Path, **config: Any) -> Path:
    """A copy at ``out`` of the PEFT adapter folder ``source`` with ``config`` merged into
    its ``adapter_config.json``."""
    import json

    out.mkdir()
    cfg = json.loads((source / "adapter_config.json").read_text()) | config
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    (out / "adapter_model.safetensors").write_bytes(
        (source / "adapter_model.safetensors").read_bytes())
    return out


def mse(model: Any, batch: Any) -> jax.Array:
    """The mean squared error of ``model(batch["x"])`` against ``batch["y"]``."""
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def mse_train_step(model: Any, optimizer: Any, batch: Any) -> dict[str, jax.Array]:
    """One SGD-style step of :func:`mse` through ``ns.value_and_grad``; its metrics."""
    loss, grads = ns.value_and_grad(mse)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss}
