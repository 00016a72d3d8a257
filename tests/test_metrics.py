import json
import struct
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard.metrics import MetricsWriter


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
    with pytest.raises(TypeError, match="tensorboard=.*got 'yes'"):
        MetricsWriter(tmp_path, tensorboard="yes")
