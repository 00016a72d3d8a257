"""Trainer.fit's host check of the batch fields the library knows by name: inside the
compiled step the values are traced, so a mask of 2, a target past the vocabulary or a
negative position is refused here, naming the batch, the field and the value, and valid
batches train exactly as they did without the check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard._errors import UsageError
from nnx_shard._train._feed import BatchCheck
from nnx_shard.models import Decoder, DecoderConfig, lm_loss
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

CFG = DecoderConfig(vocab=32, embed=16, heads=2, kv_heads=1, head_dim=8, mlp=32, layers=1,
                  max_length=16)


def llama_trainer(lr: float = 0.1, steps_per_call: int = 2) -> ns.Trainer:
    s = ns.strategies.get("dp")
    mesh = s.make_mesh(8)
    model = ns.sharded_init(lambda: Decoder(CFG, rngs=nnx.Rngs(0)), mesh, s)
    opt = ns.sharded_optimizer(model, optax.sgd(lr), mesh, s)
    return ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=s, steps_per_call=steps_per_call)


def lm_batch(seed: int = 0, **change: np.ndarray) -> dict[str, np.ndarray]:
    """A valid batch: ids in [0, 32), the first two targets ignored (-100), the last
    row's last two tokens padding (mask 0), positions 0 .. 7."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab, size=(8, 9)).astype(np.int32)
    targets = tokens[:, 1:].copy()
    targets[:, :2] = -100
    mask = np.ones((8, 8), np.int32)
    mask[-1, -2:] = 0
    positions = np.broadcast_to(np.arange(8, dtype=np.int32), (8, 8)).copy()
    batch = {"inputs": tokens[:, :-1], "targets": targets, "attention_mask": mask,
             "positions": positions}
    return batch | change


def at(batch: dict[str, np.ndarray], key: str, value: int) -> dict[str, np.ndarray]:
    """``batch`` with ``batch[key][2, 5] = value``."""
    arr = batch[key].copy()
    arr[2, 5] = value
    return batch | {key: arr}


def fit(trainer: ns.Trainer, data: object, num_steps: int) -> object:
    return trainer.fit(data, num_steps, progress=False)


# --------------------------------------------------------------------------- refused


@pytest.mark.parametrize(("key", "value", "words"), [
    ("attention_mask", 2, ["attention_mask", "= 2", "0 (padding)"]),
    ("attention_mask", -1, ["attention_mask", "= -1"]),
    ("attention_mask", 7, ["attention_mask", "= 7"]),
    ("targets", 32, ["targets", "= 32", "-100", "vocabulary has 32"]),
    ("targets", 35, ["targets", "= 35"]),
    ("targets", -101, ["targets", "= -101", "-100"]),
    ("targets", -5, ["targets", "= -5", "-100"]),
    ("targets", -1, ["targets", "= -1", "-100"]),
    ("positions", -1, ["positions", "= -1"]),
    ("positions", 16, ["positions", "= 16", "16 positions"]),
    ("inputs", -1, ["inputs", "= -1", "vocabulary of 32"]),
    ("inputs", 37, ["inputs", "= 37", "vocabulary of 32"]),
])
def test_fit_refuses_a_bad_field_before_the_step(key: str, value: int, words: list[str]) -> None:
    trainer = llama_trainer()
    before = jax.tree.map(np.asarray, nnx.state(trainer.model))
    data = [lm_batch(0), at(lm_batch(1), key, value)]
    with pytest.raises(UsageError, match="batch 1 of data") as err:
        fit(trainer, data, 2)
    msg = str(err.value)
    for w in words:
        assert w in msg, (w, msg)
    assert f"batch['{key}']" in msg and "(at [2, 5])" in msg and "Fix:" in msg
    # Refused before the compiled call: nothing trained.
    assert trainer.step == 0
    jax.tree.map(np.testing.assert_array_equal, before,
                 jax.tree.map(np.asarray, nnx.state(trainer.model)))


def test_the_index_counts_batches_across_groups_batches_and_callables() -> None:
    """The batch named is the index in the data given (in the stream of a callable
    ``data(position)``), in a later group too, read whole or stacked."""
    def mse(m: nnx.Module, b: dict) -> jax.Array:
        return jnp.mean((m(b["x"]) - 1.0) ** 2)

    def user_trainer() -> ns.Trainer:
        model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        return ns.Trainer(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), mse,
                          mesh="data=8", rules={"batch": "data"}, steps_per_call=2)

    x = np.ones((8, 2), np.float32)
    good = {"x": x, "attention_mask": np.ones((8, 4), np.int32)}
    bad = good | {"attention_mask": np.full((8, 4), 3, np.int32)}
    data = [good, good, good, bad, good]
    with pytest.raises(UsageError, match=r"batch 3 of data has batch\['attention_mask'\] = 3"):
        fit(user_trainer(), data, 5)
    arrays = {k: np.concatenate([b[k] for b in data]) for k in good}
    with pytest.raises(UsageError, match=r"batch 3 of data has batch\['attention_mask'\] = 3"):
        fit(user_trainer(), ns.Batches(arrays, batch_size=8), 5)
    t = user_trainer()
    fit(t, data[:3], 2)  # two steps applied: a callable continues at position 2
    assert t.data_position == 2
    with pytest.raises(UsageError, match=r"batch 3 of data has batch\['attention_mask'\] = 3"):
        fit(t, lambda position: iter(data[position:]), 4)


def test_a_user_model_gets_the_checks_of_the_keys_the_library_knows() -> None:
    """No vocabulary: ids and targets are checked from below only; ``inputs`` and float
    fields are the user's, not checked."""
    def loss(m: nnx.Module, b: dict) -> jax.Array:
        return jnp.mean((m(b["x"]) - 1.0) ** 2)

    def run(batch: dict) -> None:
        model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        trainer = ns.Trainer(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), loss,
                             mesh="data=8", rules={"batch": "data"}, steps_per_call=1)
        fit(trainer, [batch], 1)

    x = np.ones((8, 2), np.float32)
    ids = np.full((8, 4), 10**6, np.int64)   # any id: the vocabulary is unknown
    run({"x": x, "inputs": np.full((8, 4), -1, np.int32), "targets": np.full((8, 1), -2.5),
         "labels": ids, "input_ids": ids, "attention_mask": np.ones((8, 4), bool)})
    for key, value in [("labels", -7), ("input_ids", -1), ("tokens", -2), ("positions", -1),
                       ("attention_mask", 2)]:
        with pytest.raises(UsageError, match=rf"batch\['{key}'\] = {value}"):
            run({"x": x, key: np.full((8, 4), value, np.int32)})


# --------------------------------------------------------------------------- valid data


def _counted(monkeypatch: pytest.MonkeyPatch, kinds: set[str]) -> list[int]:
    """The first batch of each group the check reads, asserting the fields it reads."""
    calls: list[int] = []
    real = BatchCheck.__call__

    def counted(self: BatchCheck, fields: tuple, leaves: list, first: int) -> None:
        calls.append(first)
        assert {f.kind for f in fields} == kinds
        real(self, fields, leaves, first)

    monkeypatch.setattr(BatchCheck, "__call__", counted)
    return calls


def test_valid_user_batches_train_exactly_as_without_the_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A user model whose loss reads a 0/1 mask and -100 targets: the same states and
    losses as a fit with the check switched off."""
    def loss(m: nnx.Module, b: dict) -> jax.Array:
        kept = (b["targets"] != -100) & (b["attention_mask"] == 1)
        err = (m(b["x"])[:, 0] - b["targets"].astype(jnp.float32)) ** 2
        return jnp.sum(jnp.where(kept, err, 0.0)) / jnp.maximum(jnp.sum(kept), 1)

    def run() -> tuple[ns.Trainer, object]:
        model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        trainer = ns.Trainer(model, nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param), loss,
                             mesh="data=8", rules={"batch": "data"}, steps_per_call=2)
        rng = np.random.default_rng(0)
        data = [{"x": rng.normal(size=(8, 2)).astype(np.float32),
                 "targets": np.where(rng.random(8) < 0.3, -100, rng.integers(0, 5, 8)),
                 "attention_mask": (rng.random(8) < 0.8).astype(np.int32)} for _ in range(4)]
        return trainer, fit(trainer, data, 4)

    calls = _counted(monkeypatch, {"mask", "targets"})
    a, ha = run()
    assert calls == [0, 2]
    monkeypatch.setattr(BatchCheck, "plan", lambda self, batch: ())
    b, hb = run()
    assert calls == [0, 2]
    np.testing.assert_array_equal(np.asarray(ha["loss"]), np.asarray(hb["loss"]))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(a.model)),
                 jax.tree.map(np.asarray, nnx.state(b.model)))


@pytest.mark.slow
def test_valid_batches_train_exactly_as_without_the_check(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Masks of 0 and 1, targets in [0, vocab) or -100: the same states as a fit with
    the check switched off, and the check did read every group."""
    data = [lm_batch(i) for i in range(4)]
    a = llama_trainer()
    calls = _counted(monkeypatch, {"mask", "targets", "positions", "tokens"})
    ha = fit(a, data, 4)
    assert calls == [0, 2]
    monkeypatch.setattr(BatchCheck, "plan", lambda self, batch: ())
    b = llama_trainer()
    hb = fit(b, data, 4)
    assert calls == [0, 2]
    np.testing.assert_array_equal(np.asarray(ha["loss"]), np.asarray(hb["loss"]))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(a.model)),
                 jax.tree.map(np.asarray, nnx.state(b.model)))
    assert np.isfinite(np.asarray(ha["loss"])).all() and int(a.optimizer.step[...]) == 4


# --------------------------------------------------------------------------- BatchCheck


def test_batch_check_reads_its_bounds_from_the_model() -> None:
    assert BatchCheck.of(Decoder(CFG, rngs=nnx.Rngs(0))) == BatchCheck(vocab=32, max_positions=16)
    assert BatchCheck.of(nnx.Linear(2, 1, rngs=nnx.Rngs(0))) == BatchCheck()


def test_batch_check_values() -> None:
    check = BatchCheck(vocab=10, max_positions=8)

    def run(batch: dict) -> None:
        check(check.plan(batch), jax.tree.leaves(batch), 0)

    ok = np.array([[[-100, 0, 9, -100]]])
    run({"targets": ok, "labels": ok.astype(np.int64), "attention_mask": np.ones((1, 1, 4), bool),
         "inputs": np.array([[[0, 9, 9, 9]]], np.uint8), "positions": np.array([[[0, 7]]]),
         "segment_ids": np.full((1, 1, 4), -3), "nested": {"targets": np.zeros((1, 1, 4), int)}})
    run({"targets": np.zeros((1, 0, 4), np.int32)})   # empty: nothing to read
    with pytest.raises(UsageError, match=r"batch\['nested'\]\['targets'\] = 10"):
        run({"nested": {"targets": np.array([[[10]]])}})
    with pytest.raises(UsageError, match=r"batch\['input_ids'\] = 18446744073709551615"):
        run({"input_ids": np.array([[[1, 2**64 - 1]]], np.uint64)})
    with pytest.raises(UsageError, match=r"batch 2 of data has batch\['targets'\] = -99"):
        check(check.plan({"targets": ok}), [np.stack([ok[0], ok[0], ok[0] + 1])], 0)
