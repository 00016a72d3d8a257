"""Preference tuning (nnx_shard.preference) against TRL 1.16.

Ground truth: tests/fixtures/preference/ (written by tests/fixtures/make_preference.py
with torch, transformers and trl; never imported here): DPOTrainer's batch of a
plain-text set and of a conversational set, the reference model's log-probabilities of
each row, and for each objective TRL's one-batch loss and every metric it logs (the
policy is the tiny Llama ``hf_llama``, the reference ``hf_llama_tied``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard import preference
from nnx_shard._errors import UsageError
from nnx_shard.inference import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DATA = FIXTURES / "preference"
RTOL = 1e-5


@functools.cache
def _expected() -> dict[str, Any]:
    return json.loads((DATA / "expected.json").read_text())


@functools.cache
def _arrays() -> dict[str, np.ndarray]:
    return dict(np.load(DATA / "batches.npz"))


def _trl_batch(data: str) -> dict[str, np.ndarray]:
    """DPOTrainer's batch as this library's: target k is token k + 1 where it is an
    answer token."""
    a = _arrays()
    ids, answer = a[f"{data}_input_ids"], a[f"{data}_completion_mask"]
    targets = np.full_like(ids, -100)
    targets[:, :-1] = np.where(answer[:, 1:] == 1, ids[:, 1:], -100)
    return {"inputs": ids, "targets": targets, "attention_mask": a[f"{data}_attention_mask"]}


def _pairs(data: str) -> list[dict[str, Any]]:
    return [dict(zip(("prompt", "chosen", "rejected"), row, strict=True))
            for row in _expected()["meta"][data]]


#: (the case in expected.json, the loss of nnx_shard.preference it is).
CASES = {
    "sigmoid": ("sigmoid", {}),
    "ipo": ("ipo", {}),
    "hinge": ("hinge", {"beta": 0.5}),
    "robust": ("robust", {"label_smoothing": 0.2}),
    "simpo": ("simpo", {"beta": 2.0, "gamma": 0.5}),
    "simpo_nll": ("simpo", {"beta": 2.0, "gamma": 1.0, "cpo_alpha": 1.0,
                            "label_smoothing": 0.1}),
    "orpo": ("orpo", {}),
    "chat_sigmoid": ("sigmoid", {}),
}


def _close(ours: float, theirs: float, what: str) -> None:
    assert abs(ours - theirs) <= RTOL * abs(theirs), (what, ours, theirs)


@pytest.fixture(scope="module")
def models() -> tuple[nnx.Module, nnx.Module]:
    """The policy and the reference, on one device."""
    mesh = ns.make_mesh("data=1", devices=jax.devices()[:1])
    dp = ns.strategies.get("dp")
    return (ns.hf.load_pretrained(FIXTURES / "hf_llama", mesh=mesh, rules=dp),
            ns.hf.load_pretrained(FIXTURES / "hf_llama_tied", mesh=mesh, rules=dp))


@pytest.fixture(scope="module")
def outputs(models) -> dict[str, Any]:
    """Every case's (loss, metrics) and each set's reference log-probabilities, from one
    compiled function per data set."""
    policy, ref = models

    @nnx.jit(static_argnums=2)
    def run(policy, ref, data, batch):
        with_ref = dict(batch, ref_logps=preference.reference_logps(ref, batch))
        losses = {case: preference.loss(kind, **kw)(policy, with_ref)
                  for case, (kind, kw) in CASES.items()
                  if (case == "chat_sigmoid") == (data == "chat")}
        return with_ref["ref_logps"], losses

    out: dict[str, Any] = {}
    for data in ("text", "chat"):
        out[f"{data}_ref"], losses = run(policy, ref, data, _trl_batch(data))
        out.update(losses)
    return out


def test_tokenize_gives_trls_ids():
    tok = Tokenizer.from_pretrained(FIXTURES / "hf_llama_text")
    max_length = _expected()["meta"]["max_length"]
    with pytest.warns(UserWarning, match="dropped 1 of 5 pairs"):
        text = preference.tokenize(tok, _pairs("text"), max_length=max_length)
    chat = preference.tokenize(tok, _pairs("chat"), max_length=None)
    for data, ours in (("text", text), ("chat", chat)):
        for key, want in _trl_batch(data).items():
            np.testing.assert_array_equal(ours[key], want, err_msg=f"{data} {key}")
            assert ours[key].dtype == np.int32
    padded = preference.tokenize(tok, _pairs("chat"), max_length=None, length=80)
    assert padded["inputs"].shape == (8, 80)
    np.testing.assert_array_equal(padded["targets"][:, :71], chat["targets"])
    assert (padded["targets"][:, 71:] == -100).all() and (padded["inputs"][:, 71:] == 4).all()


def test_reference_logps_equal_trls(outputs):
    for data in ("text", "chat"):
        want = _arrays()[f"{data}_ref_logps"]
        np.testing.assert_allclose(np.asarray(outputs[f"{data}_ref"]), want, rtol=RTOL)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_metrics_equal_trls(outputs, case):
    want = _expected()["expected"][case]
    loss, metrics = outputs[case]
    assert set(metrics) == set(want) - {"loss"}
    _close(float(loss), want["loss"], "loss")
    for name, value in metrics.items():
        _close(float(value), want[name], name)


def test_the_fused_trainer_under_fsdp_with_microbatches_starts_from_trls_loss():
    """One Trainer step on 8 devices (fsdp) with 2 microbatches: the step's loss and
    metrics are TRL's. The batch holds each pair twice (16 rows: the chosen twice, then
    the rejected twice), which changes no mean over pairs; each microbatch (rows j, j + 2,
    ...) then holds whole pairs, chosen first."""
    fsdp = ns.strategies.get("fsdp")
    mesh = fsdp.make_mesh()
    policy = ns.hf.load_pretrained(FIXTURES / "hf_llama", mesh=mesh, rules=fsdp)
    one = dict(_trl_batch("text"), ref_logps=_arrays()["text_ref_logps"])
    batch = {k: np.concatenate([v[:4], v[:4], v[4:], v[4:]]) for k, v in one.items()}
    opt = ns.sharded_optimizer(policy, optax.adamw(1e-3), mesh, fsdp)
    trainer = ns.Trainer(policy, opt, preference.loss("sigmoid"), mesh=mesh, rules=fsdp,
                         has_aux=True, steps_per_call=1, microbatches=2)
    history = trainer.fit([batch], num_steps=1, progress=False)
    want = _expected()["expected"]["sigmoid"]
    for name, value in want.items():
        _close(float(history[name][0]), value, name)


def test_misuse_is_refused():
    batch = _trl_batch("text")
    with pytest.raises(UsageError, match="kind must be one of"):
        preference.loss("kto")
    with pytest.raises(UsageError, match="label_smoothing=0.1 is read only by 'robust'"):
        preference.loss("sigmoid", label_smoothing=0.1)
    with pytest.raises(UsageError, match=r"label_smoothing must be a number in \[0, 0.5\)"):
        preference.loss("robust", label_smoothing=0.5)
    with pytest.raises(UsageError, match="cpo_alpha must be a finite number not below 0"):
        preference.loss("simpo", cpo_alpha=-1.0)
    with pytest.raises(UsageError, match="beta must be a finite number above 0"):
        preference.loss("orpo", beta=0)
    with pytest.raises(KeyError, match="'ref_logps' \\[2 \\* pairs\\]"):
        preference.loss("ipo")(None, batch)
    with pytest.raises(UsageError, match=r"must be \[2 \* pairs, length\].*\(7, 32\)"):
        preference.loss("simpo")(None, {k: v[:7] for k, v in batch.items()})
    with pytest.raises(KeyError, match="needs 'attention_mask'"):
        preference.loss("orpo")(None, {k: batch[k] for k in ("inputs", "targets")})
    with pytest.raises(UsageError, match=r"'ref_logps' must be \[2 \* pairs\] = \(8,\)"):
        preference.loss("sigmoid")(None, dict(batch, ref_logps=np.zeros(4)))
    tok = Tokenizer.from_pretrained(FIXTURES / "hf_llama_text")
    pairs = _pairs("text")[:2]
    with pytest.raises(UsageError, match="length=8 is shorter than the longest sequence"):
        preference.tokenize(tok, pairs, length=8)
    with pytest.raises(UsageError, match="no pair is left"), pytest.warns(UserWarning):
        preference.tokenize(tok, pairs, max_length=2)
    with pytest.raises(UsageError, match="tokenizer must be an nnx_shard.inference.Tokenizer"):
        preference.tokenize("gpt2", pairs)
    with pytest.raises(UsageError, match="pad_id must be a token id"):
        preference.tokenize(tok, pairs, pad_id=True)
    with pytest.raises(UsageError, match="must be all text or all conversations"):
        preference.tokenize(tok, [dict(pairs[0], chosen=[{"role": "assistant",
                                                          "content": "x"}])])
