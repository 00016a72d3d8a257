import json
import struct
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard._metrics import MetricsWriter


def mse(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def batches(n):
    rng = np.random.default_rng(0)
    for _ in range(n):
        yield {"x": rng.normal(size=(8, 4)).astype(np.float32),
               "y": rng.normal(size=(8, 1)).astype(np.float32)}


def trainer(k):
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return ns.Trainer(model, opt, mse, mesh="data=8", rules={"batch": "data"}, steps_per_call=k)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_has_one_line_per_step_equal_to_history(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        h = trainer(3).fit(batches(6), num_steps=6, progress=False, callbacks=[writer])
        # Flushed after every call: readable before close.
        assert len(read(writer.path)) == 6
    rows = read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert set(rows[0]) == {"step", "loss", "grad_norm"}
    np.testing.assert_array_equal([r["loss"] for r in rows], h["loss"])
    np.testing.assert_array_equal([r["grad_norm"] for r in rows], h["grad_norm"])
    assert not writer.tensorboard and not list(tmp_path.glob("events.*"))


def test_nonfinite_values_are_written_as_null_and_writing_goes_on(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer(2, {"loss": np.array([np.nan, 1.5], np.float32), "acc": np.array([np.inf, 0.5])})
    writer(3, {"loss": np.array([0.25]), "acc": np.array([1.0])})
    writer.close()
    writer.close()  # idempotent
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert read(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": None, "acc": None},
        {"step": 2, "loss": 1.5, "acc": 0.5},
        {"step": 3, "loss": 0.25, "acc": 1.0},
    ]


def test_only_process_0_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
    with MetricsWriter(tmp_path / "logs", tensorboard=False) as writer:
        writer(1, {"loss": np.array([1.0])})
    assert not (tmp_path / "logs").exists()


def tensorboard_scalars(directory):
    """(tag, step, value) from the event files: TFRecord framing around Event protos."""
    from tensorboardX.proto.event_pb2 import Event

    out = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at: at + 8])
            event = Event.FromString(data[at + 12: at + 12 + n])
            at += 12 + n + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_tensorboard_events_when_tensorboardx_is_installed(tmp_path):
    pytest.importorskip("tensorboardX")
    with MetricsWriter(tmp_path) as writer:  # None: used since it is installed
        assert writer.tensorboard
        h = trainer(2).fit(batches(4), num_steps=4, progress=False, callbacks=[writer])
        writer(5, {"loss": np.array([np.nan]), "grad_norm": np.array([1.0])})
    scalars = tensorboard_scalars(tmp_path)
    loss = [(s, v) for tag, s, v in scalars if tag == "loss"]
    assert [s for s, _ in loss] == [1, 2, 3, 4]  # the NaN is left out
    np.testing.assert_allclose([v for _, v in loss], h["loss"], rtol=1e-6)
    assert ("grad_norm", 5, 1.0) in scalars


def test_tensorboard_true_without_tensorboardx_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'nnx_shard\[tensorboard\]'"):
        MetricsWriter(tmp_path / "a", tensorboard=True)
    assert not (tmp_path / "a").exists()
    with MetricsWriter(tmp_path / "b") as writer:  # None: JSON lines only
        assert not writer.tensorboard
        writer(1, {"loss": np.array([2.0])})
    assert read(tmp_path / "b" / "metrics.jsonl") == [{"step": 1, "loss": 2.0}]


def test_bad_tensorboard_argument(tmp_path):
    with pytest.raises(ns.UsageError, match="tensorboard=.*got 'yes'"):
        MetricsWriter(tmp_path, tensorboard="yes")


def aux_trainer(aux, k=2):
    def loss(model, batch):
        return mse(model, batch), aux(model, batch)

    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return ns.Trainer(model, opt, loss, mesh="data=8", rules={"batch": "data"},
                      steps_per_call=k, has_aux=True)


@pytest.mark.parametrize("name", ["loss", "grad_norm", "step", "applied"])
def test_aux_metrics_named_like_fits_own_are_refused(tmp_path, name):
    trainer = aux_trainer(lambda m, b: {name: 123.0, "acc": 1.0})
    with MetricsWriter(tmp_path, tensorboard=False) as writer, pytest.raises(
            ValueError, match=rf"aux metric '{name}' has the name of one of fit's own.*"
                              rf"Fix: rename it.*'aux_{name}'"):
        trainer.fit(batches(4), num_steps=4, progress=False, callbacks=[writer])
    assert trainer.step == 0 and read(tmp_path / "metrics.jsonl") == []


def test_vector_aux_metric_is_written_as_a_list_and_a_histogram(tmp_path):
    import jax.numpy as jnp

    trainer = aux_trainer(lambda m, b: {"per_out": jnp.stack([mse(m, b), jnp.nan, 2.0])})
    with MetricsWriter(tmp_path) as writer:
        h = trainer.fit(batches(4), num_steps=4, progress=False, callbacks=[writer])
    assert h["per_out"].shape == (4, 3)
    rows = read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["per_out"][1:] for r in rows] == [[None, 2.0]] * 4  # NaN as null
    np.testing.assert_array_equal([r["per_out"][0] for r in rows], h["per_out"][:, 0])
    np.testing.assert_array_equal([r["loss"] for r in rows], h["loss"])
    if writer.tensorboard or list(tmp_path.glob("events.*")):
        from tensorboardX.proto.event_pb2 import Event

        histos = []
        for path in tmp_path.glob("events.out.tfevents.*"):
            data, at = path.read_bytes(), 0
            while at < len(data):
                (n,) = struct.unpack("<Q", data[at: at + 8])
                event = Event.FromString(data[at + 12: at + 12 + n])
                at += 12 + n + 4
                histos += [(v.tag, event.step, v.histo.num) for v in event.summary.value
                           if v.HasField("histo")]
        assert histos == [("per_out", s, 2.0) for s in (1, 2, 3, 4)]  # the finite two


def test_finite_steps_of_a_call_cut_short_by_nan_reach_the_callbacks(tmp_path):
    seen = []

    def data():
        for i, b in enumerate(batches(10)):
            if i == 7:  # step 8, the third of the second call of 5
                b["x"][0, 0] = np.nan
            yield b

    with MetricsWriter(tmp_path, tensorboard=False) as writer, pytest.warns(
            RuntimeWarning, match="at step 8"):
        h = trainer(5).fit(data(), num_steps=10, progress=False,
                           callbacks=[writer, lambda step, m: seen.append((step, len(m["loss"])))])
    assert h["step"].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert seen == [(5, 5), (7, 2)]
    rows = read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == h["step"].tolist()
    np.testing.assert_array_equal([r["loss"] for r in rows], h["loss"])


class Crash(Exception):
    pass


def test_resume_after_a_crash_writes_each_step_once(tmp_path):
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"

    def crash_at(step):
        def cb(s, metrics):
            if s == step:
                raise Crash

        return cb

    first = trainer(1)
    with MetricsWriter(logs, tensorboard=False) as writer, pytest.raises(Crash):
        first.fit(batches(8), num_steps=8, progress=False, callbacks=[writer, crash_at(5)],
                  checkpointer=ns.Checkpointer(ckpt, every=2, async_save=False))
    assert [r["step"] for r in read(logs / "metrics.jsonl")] == [1, 2, 3, 4, 5]

    again = trainer(1)  # a new process: resumes from the checkpoint of step 4
    with MetricsWriter(logs, tensorboard=False) as writer:
        h = again.fit(batches(8), num_steps=8, progress=False, callbacks=[writer], resume=True,
                      checkpointer=ns.Checkpointer(ckpt, every=2, async_save=False))
    assert h["step"].tolist() == [5, 6, 7, 8]
    rows = read(logs / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8]
    np.testing.assert_array_equal([r["loss"] for r in rows[4:]], h["loss"])
    assert [r["step"] for r in read(logs / "metrics.replaced.jsonl")] == [5]


def test_a_line_cut_short_and_rows_written_again_move_aside(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\nnot json\n{"step": 3, "lo')
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer(3, {"loss": np.array([2.5, 3.5])})  # steps 2 and 3 again
        writer(4, {"loss": np.array([4.5])})
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [
        '{"step": 1, "loss": 1.0}', "not json", '{"step": 2, "loss": 2.5}',
        '{"step": 3, "loss": 3.5}', '{"step": 4, "loss": 4.5}']
    assert (tmp_path / "metrics.replaced.jsonl").read_text().splitlines() == [
        '{"step": 2, "loss": 2.0}', '{"step": 3, "lo']


@pytest.mark.parametrize("directory, error, match", [
    (None, ns.UsageError, "directory must be a str"), (5, ns.UsageError, "directory must be a str"),
    ("", ns.UsageError, "is empty"), (b"logs", ns.UsageError, "directory must be a str")])
def test_bad_directories_are_refused(directory, error, match):
    with pytest.raises(error, match=match):
        MetricsWriter(directory, tensorboard=False)


def test_a_file_as_directory_is_refused(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(NotADirectoryError, match="is a file"):
        MetricsWriter(tmp_path / "f", tensorboard=False)
    assert (tmp_path / "f").read_text() == "mine"
