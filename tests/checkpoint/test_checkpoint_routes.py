"""One implementation behind every checkpoint route: ``ns.save`` / ``ns.restore`` by hand,
and ``ns.Checkpointer`` in a run (what ``Trainer.fit(checkpointer=..., resume=True)``
drives). The same bad input raises the same error type and text through each; the same
checkpoint restores to the same bits."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns


def linear(n_in=2, seed=0):
    return nnx.Linear(n_in, 3, rngs=nnx.Rngs(seed))


def mse(m, b):
    return jnp.mean((m(b["x"]) - b["y"]) ** 2)


def _text(e: BaseException) -> str:
    """The message without the name of the call it was raised by (``save:``,
    ``Checkpointer:``): what was found and the fix must be the same."""
    return re.sub(r"^(save|Checkpointer|restore): ", "", str(e))


def _raised(call):
    with pytest.raises(Exception) as e:
        call()
    return type(e.value), _text(e.value)


def _save_routes(d):
    def by_checkpointer(step, **kw):
        with ns.Checkpointer(d, async_save=False) as ckpt:
            return ckpt.save(step, **kw)

    def by_async_checkpointer(step, **kw):
        with ns.Checkpointer(d) as ckpt:
            return ckpt.save(step, **kw)

    return {"ns.save": lambda step, **kw: ns.save(d, step, **kw),
            "Checkpointer.save": by_checkpointer,
            "Checkpointer.save (async)": by_async_checkpointer}


@pytest.mark.parametrize(("step", "kw"), [
    (True, {"model": linear()}),
    (-1, {"model": linear()}),
    (1, {"model": None}),
    (1, {"model": linear(), "extra": [("a", 1)]}),
    (1, {"model": linear(), "extra": {1: "a"}}),
    (1, {"model": linear(), "extra": {"x": float("nan")}}),
    (3, {"model": linear()}),  # step 3 is saved already
])
def test_every_save_route_refuses_alike(tmp_path, step, kw):
    ns.save(tmp_path, 3, model=linear())
    got = {name: _raised(lambda save=save: save(step, **kw))
           for name, save in _save_routes(tmp_path).items()}
    assert len(set(got.values())) == 1, got
    (kind, text), = set(got.values())
    assert issubclass(kind, TypeError | ValueError | FileExistsError), kind
    assert "Fix" in text, text
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["3"]


def test_every_save_route_writes_the_same_checkpoint(tmp_path):
    model = linear()
    for i, save in enumerate(_save_routes(tmp_path / "ckpt").values()):
        save(i + 1, model=model, extra={"step": i + 1})
    back = [ns.restore(tmp_path / "ckpt", model=linear(seed=9), step=i + 1) for i in range(3)]
    for b in back:
        np.testing.assert_array_equal(b.kernel[...], model.kernel[...])


def _resume_route(d, model, optimizer=None, step=None):
    """fit(resume=True): the Trainer's own objects restored in place."""
    opt = optimizer or nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    trainer = ns.Trainer(model, opt, mse, mesh="data=8", rules={"batch": "data"},
                         steps_per_call=1)
    trainer.fit(iter([]), num_steps=0, progress=False, resume=True,
                checkpointer=ns.Checkpointer(d, async_save=False))
    return trainer.model


def _restore_routes(d):
    def by_checkpointer(model, optimizer=None, step=None):
        with ns.Checkpointer(d) as ckpt:
            return ckpt.restore(model=model, optimizer=optimizer, step=step)

    return {
        "ns.restore": lambda model, optimizer=None, step=None: ns.restore(
            d, model=model, optimizer=optimizer, step=step),
        "Checkpointer.restore": by_checkpointer,
    }


@pytest.mark.parametrize("case", ["shape", "structure", "no optimizer", "step", "bool step",
                                  "not a target"])
def test_every_restore_route_refuses_alike(tmp_path, case):
    ns.save(tmp_path, 3, model=linear())
    target = {"shape": lambda: linear(n_in=5), "structure": lambda: nnx.Linear(
        2, 3, use_bias=False, rngs=nnx.Rngs(0))}.get(case, linear)
    kw = {"no optimizer": lambda: {"optimizer": nnx.Optimizer(
        (m := target()), optax.sgd(0.1), wrt=nnx.Param), "model": m},
        "step": lambda: {"model": target(), "step": 4},
        "bool step": lambda: {"model": target(), "step": True},
        "not a target": lambda: {"model": 5}}.get(
            case, lambda: {"model": target()})
    routes = _restore_routes(tmp_path)
    got = {name: _raised(lambda r=r: r(**kw())) for name, r in routes.items()}
    if case in ("shape", "structure", "no optimizer"):  # fit resumes only the latest step
        got["fit(resume=True)"] = _raised(lambda: _resume_route(tmp_path, **kw()))
    assert len(set(got.values())) == 1, got
    (kind, text), = set(got.values())
    words = {"shape": "checkpoint has shape (2, 3), target has (5, 3)",
             "structure": "in the checkpoint but not in the target: bias",
             "no optimizer": "has no optimizer", "step": "step 4",
             "bool step": "step must be a non-negative int, got True",
             "not a target": "model must be an NNX object (nnx.Module or nnx.Optimizer), got int"}[case]
    assert words in text, text
    assert issubclass(kind, ValueError | FileNotFoundError | TypeError)
    assert "Fix" in text or case == "step", text


def test_every_restore_route_reads_the_same_bits(tmp_path):
    model = linear()
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ns.save(tmp_path, 7, model=model, optimizer=opt, extra={"step": 7, "data_position": 7})
    kernels = []
    for route in _restore_routes(tmp_path).values():
        target = linear(seed=5)
        t_opt = nnx.Optimizer(target, optax.adam(1e-2), wrt=nnx.Param)
        kernels.append(np.asarray(route(target, t_opt)[0].kernel[...]))
    target = linear(seed=5)
    resumed = _resume_route(tmp_path, target, nnx.Optimizer(target, optax.adam(1e-2),
                                                            wrt=nnx.Param))
    kernels.append(np.asarray(resumed.kernel[...]))
    for k in kernels:
        np.testing.assert_array_equal(k, model.kernel[...])
