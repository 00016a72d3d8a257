"""Preference tuning (nnx_shard.preference) against TRL 1.16.

Ground truth: tests/fixtures/preference/ (written by tests/fixtures/make_preference.py
with torch, transformers and trl; never imported here): DPOTrainer's batch of a
plain-text set and of a conversational set, the reference model's log-probabilities of
each row, and for each objective TRL's one-batch loss and every metric it logs, for two
policies: the tiny Llama ``hf_llama`` (its reference ``hf_llama_tied``) and the tiny Qwen3
``hf_qwen3`` (its reference ``preference/hf_qwen3_ref``, its weights moved); and
DPOTrainer's batch of conversations with per-example ``tools`` and
``chat_template_kwargs``.
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


#: family -> (policy, reference) checkpoints.
MODELS = {"llama": (FIXTURES / "hf_llama", FIXTURES / "hf_llama_tied"),
          "qwen3": (FIXTURES / "hf_qwen3", DATA / "hf_qwen3_ref")}


def _want(family: str) -> dict[str, dict[str, float]]:
    """TRL's loss and metrics per case, with the ``family`` policy."""
    return _expected()["expected"] if family == "llama" else _expected()["qwen3"]["expected"]


def _trl_ref(family: str, data: str) -> np.ndarray:
    return _arrays()[f"{data}_ref_logps" if family == "llama" else f"qwen3_{data}_ref_logps"]


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


@pytest.fixture(scope="module", params=list(MODELS))
def outputs(request) -> tuple[str, dict[str, Any]]:
    """For one family's policy and reference (on one device): every case's (loss,
    metrics) and each set's reference log-probabilities, from one compiled function per
    data set."""
    mesh = ns.make_mesh("data=1", devices=jax.devices()[:1])
    dp = ns.strategies.get("dp")
    policy, ref = (ns.hf.load_pretrained(path, mesh=mesh, rules=dp)
                   for path in MODELS[request.param])

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
    return request.param, out


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


def test_tokenize_hands_tools_and_chat_template_kwargs_to_the_template_as_trl():
    """Each conversation's ``tools`` (a list, or its JSON text, which TRL parses) and
    ``chat_template_kwargs`` reach the template: llama3.jinja renders the tools, and its
    ``date_string`` and ``tools_in_user_message`` change the system turn."""
    base = Tokenizer.from_pretrained(FIXTURES / "hf_llama_text")
    spec = _expected()["tools"]
    tok = Tokenizer(base.backend, path=base.path, config=base.config,
                    special_map=base.special_tokens,  # its pad token is in that file
                    chat_template=(FIXTURES / spec["template"]).read_text())
    pairs = [dict(p) for p in spec["pairs"]]
    pairs[0]["tools"] = json.loads(pairs[0]["tools"])  # the list; the second keeps the text
    ours = preference.tokenize(tok, pairs, max_length=None)
    for key, want in _trl_batch("tools").items():
        np.testing.assert_array_equal(ours[key], want, err_msg=f"tools {key}")
    prompt, kw = pairs[1]["prompt"], pairs[1]["chat_template_kwargs"]
    text = tok.apply_chat_template(prompt, tokenize=False, tools=pairs[0]["tools"], **kw)
    assert "Today Date: 1 Jan 2025" in text and '"name": "get_weather"' in text
    assert tok.apply_chat_template(prompt, tokenize=False) != text
    # Named templates: "tool_use" where given tools, as transformers picks it.
    named = Tokenizer(base.backend, path=base.path, config=base.config, chat_template=[
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "{{ tools | length }} tool"}])
    assert named.apply_chat_template(prompt, tokenize=False) == "plain"
    assert named.apply_chat_template(prompt, tokenize=False, tools=[]) == "0 tool"


def test_reference_logps_equal_trls(outputs):
    family, out = outputs
    for data in ("text", "chat"):
        np.testing.assert_allclose(np.asarray(out[f"{data}_ref"]), _trl_ref(family, data),
                                   rtol=RTOL, err_msg=f"{family} {data}")


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_metrics_equal_trls(outputs, case):
    family, out = outputs
    want = _want(family)[case]
    loss, metrics = out[case]
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
    chat = _pairs("chat")[:1]
    for extra, match in (
            ({"tools": 3}, r"example 0's 'tools' must be a list of the tools' JSON schemas"),
            ({"tools": "[{"}, r"example 0's 'tools' is text but not JSON"),
            ({"chat_template_kwargs": ["x"]},
             r"example 0's 'chat_template_kwargs' must be a dict of template variables"),
            ({"chat_template_kwargs": {"add_generation_prompt": True}},
             r"sets 'add_generation_prompt', which tokenize sets itself"),
            ({"tools": [print]}, r"tools\[0\] must be a tool's JSON schema"),
            ({"chat_template_kwargs": {"max_length": 8}},
             r"max_length= is an argument of transformers' apply_chat_template")):
        with pytest.raises(UsageError, match=match):
            preference.tokenize(tok, [dict(chat[0], **extra)])
    with pytest.raises(UsageError, match="documents must be a list of dicts"):
        tok.apply_chat_template(chat[0]["prompt"], documents="notes")
