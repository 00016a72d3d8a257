"""save / restore / Checkpointer and Trainer.fit(checkpointer=..., resume=True).

Restores are checked bit for bit (parameters, optimizer state, RNG state) and
layout for layout; resuming is checked against an uninterrupted run, with the
second half in a fresh process; a save killed with SIGKILL is checked to leave
the previous checkpoint as the latest.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

import nnx_shard as ns
from nnx_shard._checkpoint._restore import restore_in_place
from nnx_shard._simulated import simulated_env
from nnx_shard._train._feed import group_sizes as _group_sizes
from tests._shared import MLP
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

TESTS = pathlib.Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
# Auto axes: with JAX's default Explicit axes, FSDP's embed-sharded weights and
# batch-sharded activations would need explicit resharding inside the model.
# Built only where the module runs: with other device counts it is skipped, not an
# import error.
_RUNS = jax.device_count() == 8
MESH8 = ns.make_mesh("data=8", axis_types="auto") if _RUNS else None
MESH42 = ns.make_mesh("data=4,model=2", axis_types="auto") if _RUNS else None
FSDP = {"batch": "data", "embed": "data", "mlp": None}
FSDP_TP = {"batch": "data", "embed": "data", "mlp": "model"}
CHILD_ENV = {
    # The parent's other XLA flags too: bitwise equality with a child holds only
    # when both compile the same code (another ISA rounds differently).
    **simulated_env(8),
    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
}


# Orbax abandons the sibling reads of one that failed on the damage: their late reports
# ("Event loop is closed", "Exception ignored in: <coroutine ...>") go to sys.unraisablehook,
# orbax's and tensorstore's own (nnx_shard changes no event-loop policy to hide them).
_ABANDONED_READS = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


# ----------------------------------------------------------------------------- helpers


def factory(seed=0, **kw):
    return lambda: MLP(nnx.Rngs(params=seed, dropout=seed + 1), **kw)


def build(mesh, rules, seed=0):
    model = ns.sharded_init(factory(seed), mesh, rules)
    return model, ns.sharded_optimizer(model, optax.adam(1e-2), mesh, rules)


def targets(mesh, rules):
    model = ns.abstract_init(factory(), mesh, rules)
    return model, ns.sharded_optimizer(model, optax.adam(1e-2), mesh, rules)


def values(obj):
    """path -> NumPy copy of every Variable (PRNG keys as their key data)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(obj)):
        x = var.get_value()
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out["/".join(map(str, path))] = np.asarray(jax.device_get(x))
    return out


def specs(obj):
    return {
        "/".join(map(str, p)): v.get_value().sharding for p, v in nnx.to_flat_state(nnx.state(obj))
    }


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


def assert_laid_out_as(restored, target):
    got, want = specs(restored), specs(target)
    assert got.keys() == want.keys()
    for k, s in want.items():
        g = got[k]
        if isinstance(s, NamedSharding):
            assert isinstance(g, NamedSharding), k
            assert g.mesh.shape == s.mesh.shape and g.spec == s.spec, (k, g, s)
            assert g.mesh.device_ids.tolist() == s.mesh.device_ids.tolist(), k
        else:
            assert g.device_set == s.device_set, k


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batch_at(i):
    rng = np.random.default_rng(1000 + i)
    return {
        "x": rng.normal(size=(16, 16)).astype(np.float32),
        "y": rng.normal(size=(16, 16)).astype(np.float32),
    }


def data_from(position):
    """Batch i of the stream depends only on i: a data source that can seek."""
    i = position
    while True:
        yield batch_at(i)
        i += 1


def trainer(model, opt, mesh=MESH8, rules=FSDP):
    return ns.Trainer(model, opt, loss_fn, mesh=mesh, rules=rules, steps_per_call=5)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of a trained FSDP model (step 7) on 8 devices, and its values."""
    d = tmp_path_factory.mktemp("ckpt")
    model, opt = build(MESH8, FSDP)
    trainer(model, opt).fit(data_from(0), 7, progress=False)
    ns.save(d, 7, model=model, optimizer=opt, extra={"data_position": 7, "cfg": {"d": 16}})
    return d, values(model), values(opt)


# ----------------------------------------------------------------------------- save/restore


def restored_onto(saved, mesh, strategy):
    """``saved`` restored onto targets on ``mesh`` laid out by ``strategy``: (model,
    optimizer, extra), checked bitwise what was saved and laid out as the targets."""
    d, model_values, opt_values = saved
    tm, to = targets(mesh, strategy)
    model, opt, extra = ns.restore(d, model=tm, optimizer=to)
    assert_bitwise(values(model), model_values)
    assert_bitwise(values(opt), opt_values)
    assert_laid_out_as(model, tm)
    assert_laid_out_as(opt, to)
    return model, opt, extra


def test_restore_same_mesh_is_bitwise_with_rng_state_and_extra(saved):
    model, opt, extra = restored_onto(saved, MESH8, FSDP)
    assert extra == {"data_position": 7, "cfg": {"d": 16}}
    assert model.drop.rngs.key.get_value().dtype == jax.random.key(0).dtype
    assert int(opt.step[...]) == 7
    # Every device holds one eighth of the FSDP-sharded kernel.
    shards = model.up.kernel.get_value().addressable_shards
    assert len(shards) == 8 and {s.data.shape for s in shards} == {(2, 32)}


def test_restore_onto_another_mesh_and_strategy(saved):
    model, opt, _ = restored_onto(saved, MESH42, FSDP_TP)
    assert model.up.kernel.get_value().sharding.spec == jax.sharding.PartitionSpec("data", "model")
    assert opt.opt_state[0].mu["up"]["kernel"].get_value().sharding.spec == (
        jax.sharding.PartitionSpec("data", "model")
    )


def test_restore_onto_one_device(saved):
    d, model_values, opt_values = saved
    one = ns.make_mesh("data=1", devices=jax.devices()[:1])
    tm, to = targets(one, FSDP)
    model, opt, _ = ns.restore(d, model=tm, optimizer=to)
    assert_bitwise(values(model), model_values)
    assert_bitwise(values(opt), opt_values)
    for s in specs(model).values():
        assert s.device_set == {jax.devices()[0]}
    # Only the model asked for: the model alone comes back.
    only = ns.restore(d, model=nnx.eval_shape(factory()))
    assert isinstance(only, MLP)
    assert_bitwise(values(only), model_values)
    assert isinstance(only.up.kernel.get_value().sharding, SingleDeviceSharding)


def test_restore_into_concrete_and_eval_shape_targets(saved):
    d, model_values, _ = saved
    other, _ = build(MESH42, FSDP_TP, seed=5)
    before = values(other)
    restored = ns.restore(d, model=other)
    assert_bitwise(values(restored), model_values)
    assert_laid_out_as(restored, other)
    assert_bitwise(values(other), before)  # the target itself is not touched
    # nnx.eval_shape under an Explicit mesh gives shardings on an AbstractMesh (under an
    # Auto one, Flax reads the logical names in out_sharding as mesh axes and fails).
    mesh = ns.make_mesh("data=2,model=4", axis_types="explicit")
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(factory())
    restored = ns.restore(d, model=abstract)
    assert_bitwise(values(restored), model_values)
    assert restored.up.kernel.get_value().sharding.mesh.shape == mesh.shape


def test_save_returns_path_and_refuses_to_overwrite(tmp_path):
    model = MLP(nnx.Rngs(0))
    path = ns.save(tmp_path, 3, model=model)
    assert path == tmp_path.absolute() / "3" and path.is_dir()
    with pytest.raises(FileExistsError, match="step 3 already exists"):
        ns.save(tmp_path, 3, model=model)
    with pytest.raises(ns.UsageError, match=r"extra\[.x.\] is a ndarray .*not JSON data"):
        ns.save(tmp_path, 4, model=model, extra={"x": np.zeros(3)})
    with pytest.raises(ns.UsageError, match="is abstract"):
        ns.save(tmp_path, 5, model=nnx.eval_shape(factory()))
    with pytest.raises(ValueError, match="non-negative int"):
        ns.save(tmp_path, -1, model=model)
    # No pickle in the format: arrays in tensorstore, the rest JSON.
    for f in path.rglob("*"):
        if f.is_file():
            assert b"\x80\x04\x95" not in f.read_bytes()[:3], f


# ----------------------------------------------------------------------------- bad input


def test_structure_mismatch_names_every_differing_path(saved):
    d, _, _ = saved

    class Bigger(MLP):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.extra = nnx.Linear(16, 4, rngs=rngs)

    with pytest.raises(ValueError) as e:
        ns.restore(d, model=nnx.eval_shape(lambda: Bigger(nnx.Rngs(0, dropout=1))))
    msg = str(e.value)
    assert "in the target but not in the checkpoint: extra/bias, extra/kernel" in msg

    class NoDropout(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 32, rngs=rngs)
            self.down = nnx.Linear(32, 16, rngs=rngs)

    with pytest.raises(ValueError) as e:
        ns.restore(d, model=nnx.eval_shape(lambda: NoDropout(nnx.Rngs(0))))
    assert "in the checkpoint but not in the target: drop/rngs/count, drop/rngs/key" in str(e.value)


def test_shape_and_dtype_mismatch_name_path_and_both(saved):
    d, _, _ = saved
    with pytest.raises(ValueError) as e:
        ns.restore(d, model=nnx.eval_shape(lambda: MLP(nnx.Rngs(0), h=64)))
    msg = str(e.value)
    assert "model/up/kernel: checkpoint has shape (16, 32), target has (16, 64)" in msg
    assert "model/down/kernel: checkpoint has shape (32, 16), target has (64, 16)" in msg
    bf16 = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    bf16.up.kernel.set_value(jax.ShapeDtypeStruct((16, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"model/up/kernel: checkpoint has dtype float32, target "
                       r"has bfloat16"):
        ns.restore(d, model=bf16)
    tm, _ = targets(MESH8, FSDP)
    with pytest.raises(ValueError, match="the optimizer target does not match"):
        ns.restore(d, model=tm, optimizer=nnx.eval_shape(
            lambda: nnx.Optimizer(factory()(), optax.sgd(0.1), wrt=nnx.Param)))


def test_missing_directory_step_or_item(tmp_path, saved):
    d, _, _ = saved
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        ns.restore(missing, model=MLP(nnx.Rngs(0)))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 8 .*Finished steps: \[7\]"):
        ns.restore(d, model=MLP(nnx.Rngs(0)), step=8)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
        ns.restore(empty, model=MLP(nnx.Rngs(0)))
    only_model = tmp_path / "m"
    ns.save(only_model, 1, model=MLP(nnx.Rngs(0)))
    tm, to = targets(MESH8, FSDP)
    with pytest.raises(ValueError, match="has no optimizer"):
        ns.restore(only_model, model=tm, optimizer=to)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@_ABANDONED_READS
def test_corrupt_or_unfinished_checkpoint_is_refused(tmp_path, saved):
    d, _, _ = saved
    target = nnx.eval_shape(factory())

    # Bytes overwritten inside a data file: decodes to wrong values, caught by the checksum.
    flipped = _copy(d, tmp_path / "flipped")
    # The array bytes sit in the largest OCDBT data files (which copy is read depends
    # on orbax's layout): damage each of them.
    data_files = [f for f in (flipped / "7" / "model").rglob("*") if f.is_file() and f.parent.name == "d"]
    largest = max(f.stat().st_size for f in data_files)
    for f in data_files:
        if f.stat().st_size == largest:
            raw = bytearray(f.read_bytes())
            mid = len(raw) // 2
            raw[mid : mid + 16] = bytes(16)
            f.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="corrupt"):
        ns.restore(flipped, model=target)

    # A data file gone.
    gone = _copy(d, tmp_path / "gone")
    data_files = [f for f in (gone / "7" / "model").rglob("*") if f.is_file() and f.parent.name == "d"]
    largest = max(f.stat().st_size for f in data_files)
    for f in data_files:
        if f.stat().st_size == largest:
            f.unlink()
    with pytest.raises(ValueError, match="corrupt or incomplete"):
        ns.restore(gone, model=target)

    # The manifest gone: not taken as a checkpoint of ours.
    no_manifest = _copy(d, tmp_path / "nomanifest")
    shutil.rmtree(no_manifest / "7" / "manifest")
    with pytest.raises(FileNotFoundError, match=r"no finished checkpoint .* numbered folders "
                       r"\(7\) have no manifest/metadata: they were not written by nnx_shard"):
        ns.restore(no_manifest, model=target)
    with pytest.raises(FileNotFoundError, match=rf"{no_manifest / '7'} is not a checkpoint "
                       r"written by nnx_shard"):
        ns.restore(no_manifest, model=target, step=7)

    # An interrupted save: only the temporary directory exists.
    unfinished = _copy(d, tmp_path / "unfinished")
    (unfinished / "7").rename(unfinished / "9.orbax-checkpoint-tmp-1234")
    with pytest.raises(FileNotFoundError, match="unfinished"):
        ns.restore(unfinished, model=target, step=9)
    with pytest.raises(FileNotFoundError, match="Only unfinished saves"):
        ns.restore(unfinished, model=target)


# ----------------------------------------------------------------------------- Checkpointer


def test_checkpointer_keeps_last_k_and_leaves_folders_not_its_own(tmp_path):
    junk = tmp_path / "4.orbax-checkpoint-tmp-99"  # named like a temporary save: not ours
    junk.mkdir(parents=True)
    (junk / "half_written").write_bytes(b"x" * 10)
    with ns.Checkpointer(tmp_path, every=2, keep=2) as ckpt:
        assert (junk / "half_written").read_bytes() == b"x" * 10
        model = MLP(nnx.Rngs(0))
        for step in (2, 4, 6):
            model.up.bias.set_value(jnp.full((32,), float(step)))
            ckpt.save(step, model=model)
        ckpt.wait()
        assert ckpt.steps() == [4, 6] and ckpt.latest_step() == 6
        restored = ckpt.restore(model=MLP(nnx.Rngs(1)), step=4)
        assert float(restored.up.bias[0]) == 4.0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".nnx_shard.lock", "4",
                                                          "4.orbax-checkpoint-tmp-99", "6"]
    assert repr(ckpt).endswith("every=2, keep=2, async_save=True)")
    with pytest.raises(ValueError, match="every must be a positive int"):
        ns.Checkpointer(tmp_path, every=0)


def test_group_sizes_cut_at_checkpoint_steps():
    assert _group_sizes(0, 20, 5, None) == [5, 5, 5, 5]
    assert _group_sizes(10, 10, 5, 10) == [5, 5]
    assert _group_sizes(0, 13, 10, 4) == [4, 4, 4, 1]
    assert _group_sizes(7, 6, 10, 5) == [3, 3]


def test_fit_saves_every_n_async_and_guards_the_directory(tmp_path):
    model, opt = build(MESH8, FSDP)
    ckpt = ns.Checkpointer(tmp_path, every=4, keep=None)
    t = trainer(model, opt)
    h = t.fit(data_from(0), 10, progress=False, checkpointer=ckpt)
    assert h["step"].tolist() == list(range(1, 11))
    assert ckpt.steps() == [4, 8, 10]  # every 4, plus the last step
    assert t.traces == 2  # calls of 4 steps (cut at the save steps) and one of 2
    _, _, extra = ns.restore(tmp_path, model=nnx.eval_shape(factory()),
                             optimizer=nnx.eval_shape(lambda: nnx.Optimizer(
                                 factory()(), optax.adam(1e-2), wrt=nnx.Param)), step=8)
    assert extra == {"step": 8, "data_position": 8}
    # A fresh trainer on a directory with later steps must resume or use another directory.
    fresh, fresh_opt = build(MESH8, FSDP)
    with pytest.raises(ValueError, match="resume=True"):
        trainer(fresh, fresh_opt).fit(data_from(0), 4, progress=False, checkpointer=ckpt)
    with pytest.raises(ValueError, match="needs the checkpointer"):
        trainer(fresh, fresh_opt).fit(data_from(0), 4, progress=False, resume=True)
    ckpt.close()


def test_fit_does_not_save_a_diverged_state(tmp_path):
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(1e30), wrt=nnx.Param)
    ckpt = ns.Checkpointer(tmp_path, every=100)
    with warnings.catch_warnings(record=True):
        h = trainer(model, opt).fit(data_from(0), 10, progress=False, checkpointer=ckpt)
    assert h.stop_reason is not None and ckpt.steps() == []


# ----------------------------------------------------------------------------- resume


def straight_run():
    """20 steps without interruption; also the state after step 10."""
    model, opt = build(MESH8, FSDP)
    at10 = {}

    def grab(step, _):
        if step == 10:
            at10["model"], at10["opt"] = values(model), values(opt)

    trainer(model, opt).fit(data_from, 20, progress=False, callbacks=[grab])
    return at10, values(model), values(opt)


@pytest.fixture(scope="module")
def straight():
    return straight_run()


def test_resume_in_process_is_bitwise(tmp_path, straight):
    at10, final_model, final_opt = straight
    model, opt = build(MESH8, FSDP)
    ckpt = ns.Checkpointer(tmp_path, every=10, keep=None)
    # 15 steps: the save at step 10 is written while steps 11-15 run (their calls
    # donate the buffers it was taken from).
    trainer(model, opt).fit(data_from, 15, progress=False, checkpointer=ckpt)
    assert ckpt.steps() == [10, 15]
    tm, to = targets(MESH8, FSDP)
    m10, o10, extra = ns.restore(tmp_path, model=tm, optimizer=to, step=10)
    assert_bitwise(values(m10), at10["model"])
    assert_bitwise(values(o10), at10["opt"])
    assert extra == {"step": 10, "data_position": 10}

    # Resume from step 15 with a callable data source and a differently seeded model.
    model, opt = build(MESH8, FSDP, seed=42)
    t = trainer(model, opt)
    h = t.fit(data_from, 20, progress=False, checkpointer=ckpt, resume=True)
    assert h["step"].tolist() == [16, 17, 18, 19, 20]
    assert t.step == 20 and t.data_position == 20 and int(opt.step[...]) == 20
    assert_bitwise(values(model), final_model)
    assert_bitwise(values(opt), final_opt)
    # Resuming a finished run trains nothing.
    assert len(t.fit(data_from, 20, progress=False, checkpointer=ckpt, resume=True)) == 0
    ckpt.close()


def test_resume_a_fresh_unplaced_model_onto_the_trainers_mesh(tmp_path):
    """A model built eagerly (no mesh, no sharded init) trains on a mesh because its
    fresh values join it replicated; resuming into such a model must keep that true,
    RNG state included (orbax hands back values committed to one device)."""

    class Net(nnx.Module):
        def __init__(self, seed: int):
            self.lin = nnx.Linear(4, 2, rngs=nnx.Rngs(seed))
            self.drop = nnx.Dropout(0.1, rngs=nnx.Rngs(seed + 1))

        def __call__(self, x):
            return self.drop(self.lin(x))

    def mse(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = ns.Batches({"x": x, "y": x[:, :2]}, batch_size=16, epochs=3)

    def run(seed: int, steps: int, resume: bool):
        model = Net(seed)
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        t = ns.Trainer(model, opt, mse, mesh=MESH8, rules={"batch": "data"})
        ckpt = ns.Checkpointer(tmp_path, every=2)
        t.fit(data, steps, progress=False, checkpointer=ckpt, resume=resume)
        ckpt.close()
        return t, model

    run(0, 4, False)
    fresh = Net(7)
    restore_in_place(tmp_path, fresh, None)  # what fit(resume=True) runs
    assert not any(x.committed for x in jax.tree.leaves(nnx.state(fresh)))
    t, model = run(7, 6, True)
    assert t.step == 6
    assert model.lin.kernel[...].sharding.device_set == set(MESH8.devices.flat)


def _resume_child(directory: str) -> None:
    """Runs in a fresh process: resume from step 10, train to 20 (saved at 20)."""
    model, opt = build(MESH8, FSDP, seed=123)
    t = trainer(model, opt)
    # A plain iterable from the start of the stream: fit skips the 10 consumed batches.
    with ns.Checkpointer(directory, every=10) as ckpt:
        h = t.fit(data_from(0), 20, progress=False, checkpointer=ckpt, resume=True)
    print("steps", h["step"].tolist(), t.data_position, flush=True)


@pytest.mark.slow
def test_resume_in_fresh_process_is_bitwise(tmp_path, straight):
    at10, final_model, final_opt = straight
    model, opt = build(MESH8, FSDP)
    with ns.Checkpointer(tmp_path, every=10) as ckpt:
        trainer(model, opt).fit(data_from(0), 10, progress=False, checkpointer=ckpt)
    assert_bitwise(values(model), at10["model"])
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
        f"from tests.checkpoint.test_checkpoint import _resume_child; _resume_child({str(tmp_path)!r})"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=CHILD_ENV, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "steps [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] 20" in out.stdout
    tm, to = targets(MESH8, FSDP)
    model, opt, extra = ns.restore(tmp_path, model=tm, optimizer=to)
    assert extra == {"step": 20, "data_position": 20}
    assert_bitwise(values(model), final_model)
    assert_bitwise(values(opt), final_opt)


# ----------------------------------------------------------------------------- crash safety


def _saving_child(directory: str) -> None:
    """Runs in a fresh process: saves a 64 MB state again and again until killed."""
    mesh = MESH8
    big = ns.sharded_init(lambda: MLP(nnx.Rngs(0), d=2048, h=4096), mesh, FSDP)
    step = 1
    while True:
        ns.save(directory, step, model=big)
        step += 1


@pytest.mark.slow
def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path):
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
        f"from tests.checkpoint.test_checkpoint import _saving_child; _saving_child({str(tmp_path)!r})"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=CHILD_ENV, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    killed_step = None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            tmp = [p for p in tmp_path.glob("*.orbax-checkpoint-tmp*") if (p / "model").exists()]
            if tmp and (tmp_path / "1").exists():
                killed_step = int(tmp[0].name.split(".")[0])
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=30)
    assert killed_step is not None, err.decode()[-3000:]
    finished = sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit())
    assert finished and killed_step not in finished and max(finished) == killed_step - 1
    target = nnx.eval_shape(lambda: MLP(nnx.Rngs(0), d=2048, h=4096))
    restored = ns.restore(tmp_path, model=target)  # the latest finished one
    expected = MLP(nnx.Rngs(0), d=2048, h=4096)
    assert np.array_equal(restored.up.kernel[...], expected.up.kernel[...])
    with pytest.raises(FileNotFoundError, match="unfinished"):
        ns.restore(tmp_path, model=target, step=killed_step)
    with ns.Checkpointer(tmp_path) as ckpt:  # opening one removes the partial save
        assert not list(tmp_path.glob("*.orbax-checkpoint-tmp*"))
        assert ckpt.latest_step() == killed_step - 1


def test_folders_named_like_temporaries_are_never_deleted(tmp_path):
    from nnx_shard._checkpoint import _internal as folders

    users = ["5.orbax-checkpoint-tmp-1234", "5.orbax-checkpoint-tmp", "7.nnx_shard-deleting-mine"]
    for name in users:
        (tmp_path / name).mkdir()
        (tmp_path / name / "precious.txt").write_text(name)
    model = MLP(nnx.Rngs(0), d=2, h=2)
    with ns.Checkpointer(tmp_path, every=1, keep=1) as ckpt:
        for step in (1, 2, 3):  # rotation deletes steps 1 and 2, through claims
            ckpt.save(step, model=model)
        ckpt.wait()
        # Orbax would delete "5.orbax-checkpoint-tmp" to write step 5 there: refused.
        with pytest.raises(FileExistsError, match=r"5.orbax-checkpoint-tmp is in the way of "
                           r"the save of step 5 .* nnx_shard did not make it; it is never "
                           r"deleted. Fix: move it out"):
            ckpt.save(5, model=model)
        assert ckpt.steps() == [3]
    with pytest.raises(FileExistsError, match="in the way of the save of step 5"):
        ns.save(tmp_path, 5, model=model)
    ns.Checkpointer(tmp_path).close()
    for name in users:
        assert (tmp_path / name / "precious.txt").read_text() == name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".nnx_shard.lock", "3", *users])
    # A step being deleted when its process died: claimed, so finished on the next open.
    record = folders._claim(tmp_path, "trash", "3.nnx_shard-deleting-1-abcd", 3)
    folders._pin(record, tmp_path / "3")
    os.rename(tmp_path / "3", tmp_path / "3.nnx_shard-deleting-1-abcd")
    # A claim that names a folder which is not the claimed one (another inode): left.
    (tmp_path / "8.nnx_shard-deleting-9-ffff").mkdir()
    other = folders._claim(tmp_path, "trash", "8.nnx_shard-deleting-9-ffff", 8)
    folders._pin(other, tmp_path / "7.nnx_shard-deleting-mine")
    ns.Checkpointer(tmp_path).close()
    assert not (tmp_path / "3.nnx_shard-deleting-1-abcd").exists()
    assert (tmp_path / "8.nnx_shard-deleting-9-ffff").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".nnx_shard.lock", "8.nnx_shard-deleting-9-ffff", *users])


def test_a_tilde_of_no_known_user_is_named(tmp_path):
    for call in (lambda: ns.Checkpointer("~no_such_user_xyz/ckpt"),
                 lambda: ns.save("~no_such_user_xyz/ckpt", 1, model=MLP(nnx.Rngs(0), d=2, h=2))):
        with pytest.raises(ns.NnxShardError, match=r"the directory '~no_such_user_xyz/ckpt' "
                           r"starts with '~' but the home directory of no_such_user_xyz is not "
                           r"known.*Fix: write the path out"):
            call()


# ----------------------------------------------------------------------------- hostile input


def _key_spans(text):
    """(start, end) of every JSON object key's characters in ``text``."""

    return [(m.start(1), m.end(1)) for m in re.finditer(r'"([^"]*)"\s*:', text)]


@pytest.mark.slow
def test_a_flipped_byte_in_the_manifest_is_a_corrupt_checkpoint(tmp_path):
    model = MLP(nnx.Rngs(0), d=2, h=2)  # RNG state too: its entries name a key impl
    ns.save(tmp_path, 3, model=model)
    target = nnx.eval_shape(lambda: MLP(nnx.Rngs(0), d=2, h=2))
    manifest = tmp_path / "3" / "manifest" / "metadata"
    good = manifest.read_bytes()
    text = good.decode()
    positions = sorted({i for a, b in _key_spans(text) for i in range(a, b)})
    # Every byte of every key name, plus values: shapes, dtypes, checksums, the digest.
    positions += [i for i in range(0, len(good), 5) if i not in positions]
    assert len(positions) > 150
    for i in positions:
        raw = bytearray(good)
        raw[i] ^= 0x01
        manifest.write_bytes(bytes(raw))
        with pytest.raises(ValueError, match=rf"checkpoint at {tmp_path / '3'} .*corrupt") as e:
            ns.restore(tmp_path, model=target)
        assert type(e.value) is ns.UsageError, (i, chr(good[i]), e.value)
    manifest.write_bytes(good)
    # A key name flipped: named as the manifest's damage, with the file.
    raw = bytearray(good)
    at = text.index('"checksum"') + 3
    raw[at] ^= 0x01
    manifest.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=rf"is corrupt: its manifest {manifest} does not match "
                       r"the digest.*Fix: restore another step"):
        ns.restore(tmp_path, model=target)
    manifest.write_bytes(good)
    assert_bitwise(values(ns.restore(tmp_path, model=target)), values(model))
    # Every entry is checked on its own too (a manifest with a recomputed digest).
    import json

    from nnx_shard._checkpoint._manifest import manifest_digest

    bad = json.loads(text)
    bad["items"]["model"]["up/kernel"]["checksum"] = [1, 2, 3]
    bad["digest"] = manifest_digest(bad)
    manifest.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"entry model/up/kernel has the checksum \[1, 2, 3\]"):
        ns.restore(tmp_path, model=target)
    # Manifests written before the digest existed are refused, saying so.
    del bad["digest"]
    manifest.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"its manifest .* has no digest \(written by an "
                       r"nnx_shard older than the manifest's digest"):
        ns.restore(tmp_path, model=target)


@pytest.mark.parametrize("how", ["save", "checkpointer"])
def test_concurrent_saves_of_one_step_leave_exactly_one_finished_step(tmp_path, how):
    import threading

    models = [nnx.Linear(4, 8, rngs=nnx.Rngs(i)) for i in range(3)]
    barrier = threading.Barrier(3)
    results: list = [None] * 3

    def run(i):
        try:
            if how == "save":
                barrier.wait()
                results[i] = ns.save(tmp_path, 5, model=models[i])
            else:
                with ns.Checkpointer(tmp_path, async_save=True) as ckpt:
                    barrier.wait()
                    results[i] = ckpt.save(5, model=models[i])
        except Exception as e:  # the outcome is asserted below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [i for i, r in enumerate(results) if isinstance(r, pathlib.Path)]
    lost = [r for r in results if not isinstance(r, pathlib.Path)]
    assert len(won) == 1, results
    assert all(isinstance(r, FileExistsError) for r in lost), results
    assert all(f"a checkpoint for step 5 already exists at {tmp_path / '5'}" in str(r)
               for r in lost)
    # No temporary leftovers; the lock file that saves hold while they write.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".nnx_shard.lock", "5"]
    restored = ns.restore(tmp_path, model=nnx.eval_shape(lambda: nnx.Linear(4, 8, rngs=nnx.Rngs(0))))
    assert_bitwise(values(restored), values(models[won[0]]))


def test_a_file_is_not_a_checkpoint_directory(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
    with pytest.raises(NotADirectoryError, match=rf"Checkpointer: {f} is a file, not a "
                       r"checkpoint directory. Fix: pass a directory"):
        ns.Checkpointer(f)
    with pytest.raises(NotADirectoryError, match=rf"restore: {f} is a file, not a checkpoint "
                       r"directory"):
        ns.restore(f, model=model)
    with pytest.raises(NotADirectoryError, match=rf"save: {f / 'ckpt'} is under {f}, which is "
                       r"a file"):
        ns.save(f / "ckpt", 1, model=model)
    assert f.read_text() == "x"


@pytest.mark.parametrize(
    "extra, match",
    [
        ({1: 2}, r"extra has the key 1 \(int\); JSON object keys are strings, so it would come "
                 r"back as '1'. Fix: use str keys, e.g. '1'"),
        ({"cfg": {None: 1}}, r"extra\['cfg'\] has the key None \(NoneType\).*back as 'null'"),
        ({"lr": np.float32(0.1)}, r"extra\['lr'\] is a float32 .*not JSON data.*float\(x\)"),
        ({"lr": float("nan")}, r"extra\['lr'\] is nan, which strict JSON cannot hold"),
        ({"xs": [1, {2.5: 0}]}, r"extra\['xs'\]\[1\] has the key 2.5 \(float\)"),
        ([("a", 1)], r"extra must be a dict, got list"),
    ],
)
def test_extra_must_come_back_as_given(tmp_path, extra, match):
    with pytest.raises(ns.UsageError, match=match):
        ns.save(tmp_path, 1, model=nnx.Linear(1, 1, rngs=nnx.Rngs(0)), extra=extra)
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_failed_restores_raise_one_error_each(tmp_path):
    """Each failed restore of a damaged checkpoint is one ValueError. Orbax closes its
    event loop while tensorstore still finishes the reads that did not fail; their late
    reports ('Event loop is closed', 'Task exception was never retrieved', 'Exception
    ignored in: <coroutine ...>') are orbax's and asyncio's, left alone (nnx_shard
    changes no event-loop policy or logger), never from nnx_shard's code."""
    script = f"""
import pathlib, sys
from flax import nnx
import nnx_shard as ns
d = pathlib.Path({str(tmp_path)!r})
ns.save(d, 1, model=nnx.Linear(16, 32, rngs=nnx.Rngs(0)))
for f in (d / "1" / "model").rglob("*"):
    if f.is_file() and f.parent.name == "d":
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2: len(raw) // 2 + 16] = bytes(16)
        f.write_bytes(bytes(raw))
target = nnx.eval_shape(lambda: nnx.Linear(16, 32, rngs=nnx.Rngs(0)))
for _ in range(8):
    try:
        ns.restore(d, model=target)
    except ValueError as e:
        # One write a line: print's separate writes of its arguments let the late reports
        # of orbax's abandoned reads (another thread) land between "ERROR:" and the message.
        sys.stderr.write("ERROR: " + str(e).splitlines()[0] + "\\n")
"""
    out = subprocess.run([sys.executable, "-c", script], env=CHILD_ENV, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    ours = [x for x in out.stderr.splitlines() if x.startswith("ERROR: ")]
    assert len(ours) == 8, out.stderr
    assert all(x.startswith(f"ERROR: restore: the checkpoint at {tmp_path / '1'} could not be "
                            "read; it is corrupt or incomplete") for x in ours), out.stderr
    # Anything else on stderr is orbax's and asyncio's reports of the abandoned reads: none
    # of it passes through nnx_shard's code.
    rest = "\n".join(x for x in out.stderr.splitlines() if not x.startswith("ERROR: "))
    assert str(ROOT / "nnx_shard") not in rest, out.stderr


@pytest.mark.slow
def test_a_save_in_flight_at_exit_finishes_or_is_one_line(tmp_path):
    """A Checkpointer never closed: at exit its background save is waited for. Python has
    stopped the thread pools orbax writes with by the time any exit hook runs ('cannot
    schedule new futures after interpreter shutdown'; on 3.12 no new thread starts), so
    the save is either finished or lost and named in one line with the fix; the steps on
    disk are whole either way."""
    script = _QUIET + f"""
from flax import nnx
import nnx_shard as ns
ckpt = ns.Checkpointer({str(tmp_path)!r}, async_save=True)
ckpt.save(1, model=nnx.Linear(16, 32, rngs=nnx.Rngs(1)))
ckpt.save(2, model=nnx.Linear(16, 32, rngs=nnx.Rngs(2)))
"""
    out = subprocess.run([sys.executable, "-c", script], env=CHILD_ENV, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    steps = ns.Checkpointer(tmp_path).steps()
    if out.stderr:
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert re.fullmatch(rf"nnx_shard: error: Checkpointer: the background save of step 2 to "
                            rf"{tmp_path} failed: .*shutdown.*; that step was not "
                            r"written \(finished steps: \[1\]\)\. Fix: wait for background saves "
                            r"before the program ends \(Checkpointer\.wait\(\) or \.close\(\), or "
                            r"a with block\): .*", lines[0]), out.stderr
        assert steps == [1] and not list(tmp_path.glob("2*"))
    else:
        assert steps == [1, 2]
    target = nnx.eval_shape(lambda: nnx.Linear(16, 32, rngs=nnx.Rngs(0)))
    assert_bitwise(values(ns.restore(tmp_path, model=target)),
                   values(nnx.Linear(16, 32, rngs=nnx.Rngs(steps[-1]))))


# ----------------------------------------------------------------------------- whose folders


def test_rotation_and_cleanup_touch_only_our_own_steps(tmp_path):
    """Folders that merely have a number for a name are the user's: never listed,
    rotated, overwritten or deleted."""
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "data.txt").write_text("mine")
    (tmp_path / "2024").mkdir()
    (tmp_path / "2024" / "thesis.tex").write_text("also mine")
    (tmp_path / "007").mkdir()
    (tmp_path / "3").write_text("a file named 3")
    (tmp_path / "12").mkdir()  # an empty folder
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("kept")
    (tmp_path / "9").symlink_to(elsewhere)
    users = sorted(p.name for p in tmp_path.iterdir())
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with ns.Checkpointer(tmp_path, keep=1) as ckpt:
        assert ckpt.steps() == [] and ckpt.latest_step() is None
        for step in (10, 20, 30):
            ckpt.save(step, model=model)
        ckpt.wait()
        assert ckpt.steps() == [30]
        with pytest.raises(FileExistsError, match=rf"{tmp_path / '1'} already exists and is not "
                           r"a checkpoint written by nnx_shard.*Fix: save under another step"):
            ckpt.save(1, model=model)
        with pytest.raises(FileExistsError, match="is not a checkpoint written by nnx_shard"):
            ns.save(tmp_path, 2024, model=model)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*users, "30", ".nnx_shard.lock"])
    assert (tmp_path / "1" / "data.txt").read_text() == "mine"
    assert (tmp_path / "2024" / "thesis.tex").read_text() == "also mine"
    assert (elsewhere / "keep.txt").read_text() == "kept"
    with pytest.raises(FileNotFoundError, match=r"2024 is not a checkpoint written by nnx_shard"):
        ns.restore(tmp_path, model=model, step=2024)


@pytest.mark.parametrize("empty", ["", pathlib.Path("")])
def test_an_empty_path_is_refused(empty):
    model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="Checkpointer: the directory is an empty path"):
        ns.Checkpointer(empty)
    with pytest.raises(ValueError, match="save: the directory is an empty path"):
        ns.save(empty, 1, model=model)
    with pytest.raises(ValueError, match="restore: the directory is an empty path"):
        ns.restore(empty, model=model)
    with pytest.raises(ns.UsageError, match=r"save: the directory must be a path \(str or "
                       r"os.PathLike\), got NoneType"):
        ns.save(None, 1, model=model)


# What a program that wants only nnx_shard's own reports does: orbax's log records (absl's
# logger), asyncio's "Task exception was never retrieved" and the reports of the reads orbax
# abandons after one failed ("Event loop is closed", "Exception ignored in: <coroutine ...>",
# through sys.unraisablehook) are the program's to silence; nnx_shard changes none of them.
# Reports whose traceback passes through nnx_shard's code still go through.
_QUIET = """
import logging, sys
logging.getLogger("absl").setLevel(logging.CRITICAL)
logging.getLogger("asyncio").setLevel(logging.CRITICAL)
def _unraisable(report, _default=sys.unraisablehook):
    tb, files = report.exc_traceback, []
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    if any("nnx_shard" in f for f in files):
        _default(report)
sys.unraisablehook = _unraisable
"""


def _run_child(script, timeout=120, env=None):
    """Runs ``script`` in a fresh Python with 8 simulated devices: (rc, stdout, stderr).
    ``timeout`` guards against a hang (a stuck exit raises TimeoutExpired); it is not what
    a test measures."""
    out = subprocess.run([sys.executable, "-c", script], env={**CHILD_ENV, **(env or {})},
                         capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout, out.stderr


@pytest.mark.slow
def test_another_processes_save_in_flight_is_left_alone(tmp_path):
    """Opening a Checkpointer removes temporary folders of killed saves, but never the
    one of a save another process is still writing (it holds the directory's lock)."""
    script = f"""
import time
import orbax.checkpoint._src.checkpointers.async_checkpointer as ac
from flax import nnx
import nnx_shard as ns
commit = ac._background_wait_for_commit_futures
def slow(*args, **kwargs):  # the arrays are written; finishing takes a while
    time.sleep(3)
    return commit(*args, **kwargs)
ac._background_wait_for_commit_futures = slow
with ns.Checkpointer({str(tmp_path)!r}) as ckpt:
    ckpt.save(5, model=nnx.Linear(16, 32, rngs=nnx.Rngs(5)))
print("done", flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], env=CHILD_ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            if list(tmp_path.glob("5.orbax-checkpoint-tmp*")):
                break
            time.sleep(0.02)
        tmp = list(tmp_path.glob("5.orbax-checkpoint-tmp*"))
        assert tmp, proc.communicate(timeout=30)
        with ns.Checkpointer(tmp_path) as ckpt:
            assert tmp[0].exists(), "another process's save in flight was deleted"
            assert ckpt.steps() == []
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and out.strip() == "done", err
    assert ns.Checkpointer(tmp_path).steps() == [5]
    restored = ns.restore(tmp_path, model=nnx.eval_shape(lambda: nnx.Linear(16, 32, rngs=nnx.Rngs(0))))
    assert_bitwise(values(restored), values(nnx.Linear(16, 32, rngs=nnx.Rngs(5))))


def test_sigkill_during_rotation_leaves_only_whole_steps(tmp_path):
    """Killed while deleting an old step, the next run sees only whole steps (the
    half-deleted one is neither listed nor restored) and removes the remains."""
    script = f"""
import os, shutil, signal
from flax import nnx
import nnx_shard as ns
def half_then_die(path, *args, **kwargs):  # SIGKILL half-way through deleting a step
    files = sorted(p for p in __import__("pathlib").Path(path).rglob("*") if p.is_file())
    for f in files[::2]:
        f.unlink()
    os.kill(os.getpid(), signal.SIGKILL)
with ns.Checkpointer({str(tmp_path)!r}, keep=1, async_save=False) as ckpt:
    ckpt.save(1, model=nnx.Linear(16, 32, rngs=nnx.Rngs(1)))
    shutil.rmtree = half_then_die
    ckpt.save(2, model=nnx.Linear(16, 32, rngs=nnx.Rngs(2)))
"""
    rc, _, err = _run_child(script)
    assert rc == -signal.SIGKILL, err
    target = nnx.eval_shape(lambda: nnx.Linear(16, 32, rngs=nnx.Rngs(0)))
    with ns.Checkpointer(tmp_path, keep=1) as ckpt:
        assert ckpt.steps() == [2]
        assert_bitwise(values(ckpt.restore(model=target)), values(nnx.Linear(16, 32, rngs=nnx.Rngs(2))))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".nnx_shard.lock", "2"]


# ----------------------------------------------------------------------------- what the digest covers


def test_editing_extra_or_renaming_a_step_is_detected(tmp_path):
    """extra (step counter, data position) is covered by the manifest's digest, and the
    manifest names its step: an edited ``"step": 30`` or a renamed folder is refused
    instead of resuming with a step counter that does not match the optimizer."""
    model, opt = build(MESH8, FSDP)
    ckpt = ns.Checkpointer(tmp_path, every=10, keep=None)
    trainer(model, opt).fit(data_from, 30, progress=False, checkpointer=ckpt)
    ckpt.close()
    extra = tmp_path / "30" / "extra" / "metadata"
    good = extra.read_text()
    assert '"step": 30' in good
    extra.write_text(good.replace('"step": 30', '"step": 90'))
    tm, to = targets(MESH8, FSDP)
    with pytest.raises(ValueError, match=rf"restore: the checkpoint at {tmp_path / '30'} is "
                       rf"corrupt: {extra} does not match the digest in its manifest"):
        ns.restore(tmp_path, model=tm, optimizer=to)
    fresh, fresh_opt = build(MESH8, FSDP)
    with pytest.raises(ValueError, match=rf"{extra} does not match the digest"):
        trainer(fresh, fresh_opt).fit(data_from, 40, progress=False, resume=True,
                                      checkpointer=ns.Checkpointer(tmp_path, every=10))
    extra.write_text(good)
    (tmp_path / "30").rename(tmp_path / "90")
    with pytest.raises(ValueError, match=rf"{tmp_path / '90'} is corrupt: its manifest .* was "
                       r"written for step 30, not 90"):
        ns.restore(tmp_path, model=tm, optimizer=to)
    (tmp_path / "90").rename(tmp_path / "30")
    _, restored_opt, got = ns.restore(tmp_path, model=tm, optimizer=to)
    assert got == {"step": 30, "data_position": 30} and int(restored_opt.step[...]) == 30


def test_checksums_do_not_collapse_on_constant_round_arrays():
    """Norm scales and biases are often constant and round: every such float32 array
    of a size multiple of 512 used to checksum to [0, 0]."""
    from nnx_shard._checkpoint._manifest import checksums_of

    arrays = [jnp.ones(512), jnp.ones(1024), jnp.full((512,), 2.0), jnp.zeros(512),
              jnp.full((4096,), 0.5), jnp.ones(512, jnp.bfloat16), jnp.full((512,), -1.0),
              jnp.arange(512.0), jnp.arange(512.0)[::-1]]
    sums = [tuple(s) for s in checksums_of(arrays)]
    assert (0, 0) not in sums
    assert len(set(sums)) == len(sums), sums  # each array its own checksum, order too
    # Bits and their row-major positions only: the shape is checked on its own.
    assert checksums_of([jnp.ones((2, 512))]) == checksums_of([jnp.ones(1024)])
    # The same values laid out on 8 devices checksum the same.
    sharded = jax.device_put(jnp.ones(1024), NamedSharding(MESH8, jax.sharding.PartitionSpec("data")))
    assert checksums_of([sharded]) == checksums_of([jnp.ones(1024)])


def test_data_of_another_checkpoint_with_constant_arrays_is_refused(tmp_path):
    """Two checkpoints differing only in a constant bias (ones vs twos, 512 wide): the
    data of one under the manifest of the other is a checksum mismatch, not a silent
    restore of the wrong values."""
    def model(value):
        m = nnx.Linear(4, 512, rngs=nnx.Rngs(0))
        m.bias.set_value(jnp.full((512,), value))
        return m

    ns.save(tmp_path / "a", 1, model=model(1.0))
    ns.save(tmp_path / "b", 1, model=model(2.0))
    shutil.rmtree(tmp_path / "a" / "1" / "model")
    shutil.copytree(tmp_path / "b" / "1" / "model", tmp_path / "a" / "1" / "model")
    with pytest.raises(ValueError, match=r"the data read for model/bias does not match"):
        ns.restore(tmp_path / "a", model=nnx.eval_shape(lambda: model(0.0)))


def test_checkpoints_of_the_previous_format_still_restore(tmp_path):
    """tests/data/checkpoint_format1: written by nnx_shard before the manifest's format 2
    (an MLP(d=2, h=2) with adam, step 5)."""
    d = _copy(TESTS / "data" / "checkpoint_format1", tmp_path / "old")
    assert ns.Checkpointer(d).steps() == [5]
    target = MLP(nnx.Rngs(params=0, dropout=1), d=2, h=2)
    opt = nnx.Optimizer(target, optax.adam(1e-2), wrt=nnx.Param)
    model, restored_opt, extra = ns.restore(d, model=nnx.eval_shape(lambda: target),
                                            optimizer=nnx.eval_shape(lambda: opt))
    assert_bitwise(values(model), values(target))
    assert_bitwise(values(restored_opt), values(opt))
    assert extra == {"step": 5, "data_position": 5}


@_ABANDONED_READS
@pytest.mark.slow
def test_damage_to_orbax_metadata_files_is_an_error_or_harmless(tmp_path):
    """The files orbax reads besides the arrays only steer reading: damage there gives
    an error or the right values, never wrong ones."""
    model = MLP(nnx.Rngs(0), d=2, h=2)
    ns.save(tmp_path, 3, model=model)
    want = values(model)
    target = nnx.eval_shape(lambda: MLP(nnx.Rngs(0), d=2, h=2))
    step = tmp_path / "3"
    files = [step / "_CHECKPOINT_METADATA", step / "model" / "_METADATA",
             step / "model" / "_sharding", step / "model" / "array_metadatas" / "process_0",
             step / "model" / "manifest.ocdbt", step / "extra" / "metadata"]
    tried = 0
    for f in files:
        good = f.read_bytes()
        for i in range(0, len(good), max(1, len(good) // 12)):
            raw = bytearray(good)
            raw[i] ^= 0x04
            f.write_bytes(bytes(raw))
            try:
                got = values(ns.restore(tmp_path, model=target))
            except (ValueError, FileNotFoundError) as e:
                assert "restore: " in str(e), (f, i, e)
            else:
                assert_bitwise(got, want)
            tried += 1
        f.write_bytes(good)
    assert tried > 50


# ----------------------------------------------------------------------------- failed saves, exit

# A child whose files may not grow past 256 KiB (as on a full disk; EFBIG instead of ENOSPC),
# saving 1 MiB of arrays.
_SMALL_DISK = _QUIET + """
import resource, signal, sys
from flax import nnx
import nnx_shard as ns
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
big = nnx.Linear(512, 512, rngs=nnx.Rngs(0))
"""


@pytest.mark.slow
def test_a_failed_background_save_is_raised_at_the_next_save_wait_and_close(tmp_path):
    script = _SMALL_DISK + f"""
ckpt = ns.Checkpointer({str(tmp_path)!r}, keep=None)
ckpt.save(1, model=nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
ckpt.wait()
def attempt(what, call):
    try:
        call()
    except OSError as e:
        print(what, "raised:", e, flush=True)
    else:
        print(what, "ok", flush=True)
ckpt.save(2, model=big)  # fails in the background
attempt("save 3", lambda: ckpt.save(3, model=big))  # not started: 2 failed
attempt("wait", ckpt.wait)
ckpt.save(4, model=big)
attempt("wait", ckpt.wait)
ckpt.save(5, model=big)
attempt("close", ckpt.close)
print("steps", ckpt.steps())
"""
    rc, out, err = _run_child(script)
    assert rc == 0, err
    lines = out.strip().splitlines()

    def failed(step):
        return (rf"raised: Checkpointer: the background save of step {step} to {tmp_path} "
                r"failed: File too large.*; that step was not written \(finished steps: "
                r"\[1\]\)\. Fix: .*")

    assert re.fullmatch("save 3 " + failed(2), lines[0]), lines
    assert lines[1] == "wait ok"
    assert re.fullmatch("wait " + failed(4), lines[2]), lines
    assert re.fullmatch("close " + failed(5), lines[3]), lines
    assert lines[4:] == ["steps [1]"]
    assert err == "", err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".nnx_shard.lock", "1"]


def test_a_failed_save_never_waited_on_is_one_line_at_exit(tmp_path):
    """The save fails on the full disk, or, when the program ends first, because Python
    stops the threads that write it at exit (3.11: its thread pools; 3.12: any new
    thread): one line on stderr either way. The exit status stays the program's own
    (Python has no public way to change it once the program has ended)."""
    script = _SMALL_DISK + f"""
ckpt = ns.Checkpointer({str(tmp_path)!r})
ckpt.save(7, model=big)
print("saving in the background", flush=True)
"""
    rc, out, err = _run_child(script)
    assert out == "saving in the background\n"
    assert rc == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    # "after shutdown": an executor of orbax's that its failing event loop shut meanwhile.
    reason = ("(File too large|cannot schedule new futures after (interpreter )?shutdown|"
              "can't create new thread at interpreter shutdown)")
    assert re.fullmatch(rf"nnx_shard: error: Checkpointer: the background save of step 7 to "
                        rf"{tmp_path} failed: {reason}.*; that step was not written "
                        r"\(finished steps: \[\]\)\. Fix: .*", lines[0]), err
    assert not list(tmp_path.glob("7*"))


@pytest.mark.slow
def test_a_save_to_a_read_only_directory_fails_at_once_and_exit_does_not_hang(tmp_path):
    """Orbax created step folders on a background thread; when that failed (read-only
    file system) the other threads waited 300 s for it, at exit."""
    script = _QUIET + f"""
import errno, os
from flax import nnx
import nnx_shard as ns
mkdir = os.mkdir
def read_only(path, *args, **kwargs):
    if "orbax-checkpoint-tmp" in os.fspath(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
    return mkdir(path, *args, **kwargs)
os.mkdir = read_only
ckpt = ns.Checkpointer({str(tmp_path)!r})
for step in (3, 4):
    try:
        ckpt.save(step, model=nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    except OSError as e:
        print("raised:", e, flush=True)
"""
    # Orbax's threads used to wait 300 s for the folder at exit: past the hang guard.
    rc, out, err = _run_child(script)
    assert rc == 0 and err == "", (rc, err)
    lines = out.splitlines()
    for step, line in zip((3, 4), lines, strict=True):
        assert re.fullmatch(rf"raised: Checkpointer: the save of step {step} to {tmp_path} "
                            r"failed: Read-only file system \(.*\); that step was not written "
                            r"\(finished steps: \[\]\)\. Fix: save to a directory this "
                            r"process can write\.", line), line


@pytest.mark.slow
def test_exit_gives_up_on_a_save_that_makes_no_progress(tmp_path):
    script = _QUIET + f"""
import threading
import orbax.checkpoint._src.checkpointers.async_checkpointer as ac
from flax import nnx
import nnx_shard as ns
ac._background_wait_for_commit_futures = lambda *a, **k: threading.Event().wait()  # stuck
ckpt = ns.Checkpointer({str(tmp_path)!r})
ckpt.save(2, model=nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
"""
    # The save is stuck for good: only the stall limit ends the exit (else the hang guard).
    rc, _, err = _run_child(script, env={"NNX_SHARD_EXIT_STALL": "1"})
    assert rc == 0, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.fullmatch(rf"nnx_shard: error: the save of step 2 to {tmp_path} made no progress "
                        r"for 1 s at exit; it is lost \(NNX_SHARD_EXIT_STALL sets how long to "
                        r"wait\)\.", lines[0]), err


@pytest.mark.slow
def test_failed_saves_and_restores_print_one_line_each(tmp_path):
    """No pages of tracebacks and tensorstore specs from nnx_shard: what failed, once
    (orbax's own log records are the program's to silence, as _QUIET does)."""
    script = _QUIET + f"""
import pathlib, shutil, sys
from flax import nnx
import nnx_shard as ns
d = pathlib.Path({str(tmp_path)!r})
small = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
ns.save(d / "ok", 1, model=small)
ns.save(d / "ok", 2, model=small)
shutil.rmtree(d / "ok" / "1" / "model" / "ocdbt.process_0")
(d / "ok" / "2" / "model" / "manifest.ocdbt").write_bytes(b"garbage")
target = nnx.eval_shape(lambda: nnx.Linear(16, 32, rngs=nnx.Rngs(0)))
for step in (1, 2):
    try:
        ns.restore(d / "ok", model=target, step=step)
    except ValueError as e:
        # One write a line: print's separate writes of its arguments let the late reports
        # of orbax's abandoned reads (another thread) land between "ERROR:" and the message.
        sys.stderr.write("ERROR: " + str(e).splitlines()[0] + "\\n")
""" + _SMALL_DISK + """
try:
    ns.save(d / "full", 1, model=big)
except OSError as e:
    print("ERROR:", e, file=sys.stderr)
ckpt = ns.Checkpointer(d / "full")
ckpt.save(2, model=big)
try:
    ckpt.wait()
except OSError as e:
    print("ERROR:", e, file=sys.stderr)
ckpt.save(3, model=big)
"""
    rc, out, err = _run_child(script)
    assert rc == 0 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 5, err
    for step, line in zip((1, 2), lines, strict=False):
        assert line.startswith(f"ERROR: restore: the checkpoint at {tmp_path / 'ok' / str(step)} "
                               "could not be read; it is corrupt or incomplete"), err
    assert lines[2].startswith(f"ERROR: save: the save of step 1 to {tmp_path / 'full'} failed: "
                               "File too large"), err
    assert lines[3].startswith("ERROR: Checkpointer: the background save of step 2"), err
    assert lines[4].startswith("nnx_shard: error: Checkpointer: the background save of step 3")


# --------------------------------------------------------------------------- wrong types


@pytest.mark.parametrize("kw, match", [
    ({"every": True}, r"every must be a positive int, got True \(a bool\)"),
    ({"every": 1.5}, r"every must be a positive int, got 1.5 \(float\)"),
    ({"keep": True}, r"keep must be a positive int, got True \(a bool\)"),
    ({"keep": 2.0}, r"keep must be a positive int, got 2.0"),
    ({"async_save": "yes"}, r"async_save must be True or False, got 'yes'"),
])
def test_checkpointer_refuses_bools_where_counts_go(tmp_path, kw, match):
    with pytest.raises(ns.NnxShardError, match=match):
        ns.Checkpointer(tmp_path / "c", **kw)
    assert not (tmp_path / "c").exists()


def test_restore_and_should_save_refuse_a_bool_step(tmp_path):
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    ns.save(tmp_path, 1, model=model)
    for step in (True, 1.0, "1", -1):
        with pytest.raises(ns.NnxShardError, match=r"restore: step must be a non-negative int"):
            ns.restore(tmp_path, model=model, step=step)
    ckpt = ns.Checkpointer(tmp_path, every=1)
    with pytest.raises(ns.NnxShardError, match=r"restore: step must be a non-negative int, got True"):
        ckpt.restore(model=model, step=True)
    with pytest.raises(ns.NnxShardError, match=r"should_save: step must be a non-negative int"):
        ckpt.should_save(True)
    assert ckpt.should_save(np.int64(3)) is True
    ckpt.close()


@pytest.mark.parametrize("kw, match", [
    ({"step": True}, r"save: step must be a non-negative int, got True"),
    ({"model": None}, r"save: model must be an nnx.Module, got NoneType"),
])
def test_save_refuses_a_bool_step_and_no_model(tmp_path, kw, match):
    args = {"step": 1, "model": nnx.Linear(2, 1, rngs=nnx.Rngs(0)), **kw}
    with pytest.raises(ns.UsageError, match=match):
        ns.save(tmp_path, args.pop("step"), **args)
    assert list(tmp_path.iterdir()) == []


# A child whose step folders cannot be renamed into place (a read-only file system seen
# by the background commit of an async save; root is not stopped by chmod).
_READ_ONLY_COMMIT = _QUIET + """
import errno, os, sys, threading
from flax import nnx
import nnx_shard as ns
rename = os.rename
def read_only(src, dst, *args, **kwargs):
    if "orbax-checkpoint-tmp" in os.fspath(src):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(src))
    return rename(src, dst, *args, **kwargs)
os.rename = read_only
"""


@pytest.mark.slow
def test_a_background_failure_taken_by_wait_is_not_raised_again_by_any_thread(tmp_path):
    """orbax re-raises a failed save once per thread that waits: closing from another
    thread (as exit does) raised the raw error again and left orbax half closed."""
    script = _READ_ONLY_COMMIT + f"""
for i in range(3):
    ckpt = ns.Checkpointer(os.path.join({str(tmp_path)!r}, str(i)))
    ckpt.save(3, model=nnx.Linear(64, 64, rngs=nnx.Rngs(0)))
    try:
        ckpt.wait()
    except OSError as e:
        print("raised:", e, flush=True)
    if i == 0:  # closed from another thread; the others at exit
        t = threading.Thread(target=ckpt.close)
        t.start(); t.join()
        print("closed", flush=True)
"""
    rc, out, err = _run_child(script)
    assert rc == 0 and err == "", (rc, err)
    lines = out.splitlines()
    assert len(lines) == 4 and lines[1] == "closed", out
    for i, line in zip((0, 1, 2), (lines[0], *lines[2:]), strict=True):
        assert re.fullmatch(rf"raised: Checkpointer: the background save of step 3 to "
                            rf"{tmp_path / str(i)} failed: Read-only file system \(.*\); that "
                            r"step was not written \(finished steps: \[\]\)\. Fix: save to a "
                            r"directory this process can write\.", line), line


@pytest.mark.slow
def test_read_only_async_saves_never_end_in_an_orbax_traceback(tmp_path):
    """Repeated: the failure is one line (raised, or at exit), never followed by a
    traceback of one of orbax's threads. Each process has both: a failed save taken by
    wait (step 3), then one still failing when the interpreter exits (step 4)."""
    script = _READ_ONLY_COMMIT + f"""
waited = ns.Checkpointer({str(tmp_path)!r} + "/waited" + sys.argv[1])
waited.save(3, model=nnx.Linear(64, 64, rngs=nnx.Rngs(0)))
try:
    waited.wait()
except OSError as e:
    print("raised", flush=True)
at_exit = ns.Checkpointer({str(tmp_path)!r} + "/at_exit" + sys.argv[1])
at_exit.save(4, model=nnx.Linear(64, 64, rngs=nnx.Rngs(0)))
"""
    for round_ in range(4):
        done = subprocess.run([sys.executable, "-c", script, str(round_)], env=CHILD_ENV,
                              capture_output=True, text=True, timeout=120)
        assert "Traceback" not in done.stderr, (round_, done.stderr)
        assert done.returncode == 0 and done.stdout == "raised\n", (round_, done.stdout)
        lines = done.stderr.strip().splitlines()  # the taken failure adds nothing at exit
        assert len(lines) == 1 and "the background save of step 4" in lines[0], (
            round_, done.stderr)
