"""nnx_shard.inference.generate's options and stream against transformers.

Outside references: ``generate.npz`` beside the tiny Llama / Qwen3 fixtures
(tests/fixtures/make_hf_generate.py): transformers' greedy tokens of left-padded
ragged prompts and of each row alone, with an eos id and with repetition
penalties, the log-probabilities of its raw logits, and which tokens its top-p,
min-p and chained warpers keep on real logits; JAX's compile log (the programs
compiled).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard import hf
from nnx_shard._errors import UsageError
from nnx_shard.inference import GenerationConfig, generate, stream
from nnx_shard.inference._generation import Options, warp
from nnx_shard.models import Decoder, DecoderConfig
from tests.conftest import needs_devices

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@functools.cache
def _expected(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / name / "generate.npz"))


@functools.cache
def _model(name: str, strategy: str | None = None) -> Decoder:
    cfg = DecoderConfig.from_hf(FIXTURES / name)
    s = ns.strategies.get(strategy or "dp")
    target = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)),
                              s.make_mesh(1 if strategy is None else 8), s)
    return hf.load_safetensors(FIXTURES / name, target)


def _rows(e: dict[str, np.ndarray]) -> list[list[int]]:
    return [t[m == 1].tolist() for t, m in zip(e["ragged_tokens"], e["ragged_mask"], strict=True)]


def _check_ragged(model: Decoder, e: dict[str, np.ndarray]) -> None:
    new = e["alone_new"].shape[1]
    out, logprobs = generate(model, _rows(e), GenerationConfig(max_new_tokens=new,
                                                               return_logprobs=True))
    out = np.asarray(out)
    np.testing.assert_array_equal(out, e["ragged_out"])          # transformers, padded batch
    np.testing.assert_array_equal(out[:, -new:], e["alone_new"])  # transformers, each row alone
    err = float(np.abs(np.asarray(logprobs) - e["ragged_logprobs"]).max())
    assert err < 1e-3, err
    # The array and its mask: the same tokens.
    same = generate(model, e["ragged_tokens"], GenerationConfig(max_new_tokens=new),
                    attention_mask=e["ragged_mask"])
    np.testing.assert_array_equal(np.asarray(same), out)
    eos = generate(model, _rows(e), GenerationConfig(
        max_new_tokens=new, eos_token_id=[int(e["eos_id"])], pad_token_id=0))
    np.testing.assert_array_equal(np.asarray(eos), e["eos_out"])


@pytest.mark.parametrize("name", ["hf_qwen3", pytest.param("hf_llama", marks=pytest.mark.slow)])
def test_ragged_eos_and_logprobs_equal_transformers(name: str) -> None:
    e = _expected(name)
    assert float(e["ragged_margins"].min()) > 1e-3 * float(np.abs(e["ragged_margins"]).max())
    # The eos stops some rows early and not others: the test bites.
    stopped = (e["eos_out"][:, -1] == 0).sum()
    assert 0 < stopped < len(e["eos_out"])
    _check_ragged(_model(name), e)


@needs_devices(8)
@pytest.mark.parametrize("strategy", ["dp", pytest.param("fsdp_tp", marks=pytest.mark.slow),
                                      "tp"])
def test_ragged_eos_and_logprobs_sharded(strategy: str) -> None:
    # 4 rows over data=8 (dp) or data=2 x model=4 (tp): dummy rows pad the batch.
    model = _model("hf_qwen3", strategy)
    with ns.use(ns.strategies.get(strategy).make_mesh(8), ns.strategies.get(strategy).rules):
        _check_ragged(model, _expected("hf_qwen3"))


@pytest.mark.parametrize("name", ["hf_qwen3", pytest.param("hf_llama", marks=pytest.mark.slow)])
def test_repetition_penalty_equals_transformers(name: str) -> None:
    e = _expected(name)
    new = e["alone_new"].shape[1]
    for penalty, key in ((1.3, "rep_out_13"), (0.8, "rep_out_08")):
        out = generate(_model(name), e["rep_prompt"],
                       GenerationConfig(max_new_tokens=new, repetition_penalty=penalty))
        np.testing.assert_array_equal(np.asarray(out), e[key], err_msg=str(penalty))
    plain = generate(_model(name), e["rep_prompt"], GenerationConfig(max_new_tokens=new))
    assert (np.asarray(plain) != e["rep_out_13"]).any()  # the penalty changes the tokens


# -- the warpers --------------------------------------------------------------------


def _hf_top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """transformers' TopPLogitsWarper's kept tokens, rewritten in NumPy."""
    order = np.argsort(logits, axis=-1, kind="stable")
    asc = np.take_along_axis(logits, order, -1)
    probs = np.exp(asc - asc.max(-1, keepdims=True))
    cum = np.cumsum(probs / probs.sum(-1, keepdims=True), -1)
    drop = cum <= 1 - p
    drop[:, -1] = False
    keep = np.ones_like(drop)
    np.put_along_axis(keep, order, ~drop, -1)
    return keep


def _hf_min_p(logits: np.ndarray, m: float) -> np.ndarray:
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs >= m * probs.max(-1, keepdims=True)) | (
        np.arange(logits.shape[-1]) == probs.argmax(-1)[:, None])


@pytest.mark.parametrize("name", ["hf_llama", "hf_qwen3"])
def test_warpers_keep_what_transformers_keeps(name: str) -> None:
    e = _expected(name)
    logits = jnp.asarray(e["warp_logits"])
    cases = [(Options(temperature=1.0, top_p=0.8), e["keep_top_p"]),
             (Options(temperature=1.0, min_p=0.1), e["keep_min_p"]),
             (Options(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05), e["keep_chain"])]
    for options, keep in cases:
        assert 1 < keep.sum(-1).max() < keep.shape[-1]  # real filtering, not all or one
        got = np.asarray(jax.jit(warp)(logits, options.traced())) > -np.inf
        np.testing.assert_array_equal(got, keep, err_msg=str(options))
    # The NumPy rewrites the sampling tests check with are transformers' warpers.
    np.testing.assert_array_equal(_hf_top_p(e["warp_logits"], 0.8), e["keep_top_p"])
    np.testing.assert_array_equal(_hf_min_p(e["warp_logits"], 0.1), e["keep_min_p"])


@pytest.mark.parametrize("option, value, keep", [("top_p", 0.8, _hf_top_p),
                                                 ("min_p", 0.2, _hf_min_p)])
def test_samples_stay_inside_transformers_filter(option: str, value: float, keep) -> None:  # type: ignore[no-untyped-def]
    model = _model("hf_qwen3")
    prompt = _expected("hf_qwen3")["rep_prompt"]
    length, new = prompt.shape[1], 12
    greedy = np.asarray(generate(model, prompt, GenerationConfig(max_new_tokens=new)))
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))  # one program, not op by op
    sampled = 0
    for seed in range(3):
        config = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=1.0,
                                  top_k=None, **{option: value})
        out = np.asarray(generate(model, prompt, config, seed=seed))
        logits = np.asarray(forward(state, jnp.asarray(out)), np.float32)[:, length - 1:-1]
        for step in range(new):
            kept = keep(logits[:, step], value)
            token = out[:, length + step]
            assert kept[np.arange(len(token)), token].all(), (seed, step)
            sampled += int((kept.sum(-1) > 1).sum())
        assert (out != greedy).any() or seed < 2
    assert sampled > 0  # some steps had a choice


# -- one program per shape ------------------------------------------------------------


def _compiles(caplog: pytest.LogCaptureFixture) -> list[str]:
    names = [r.getMessage().split()[1] for r in caplog.records
             if r.getMessage().startswith("Compiling ")]
    return sorted(n[4:-1] for n in names if n in ("jit(_prefill)", "jit(_decode)"))


def test_option_values_compile_nothing(caplog: pytest.LogCaptureFixture) -> None:
    model = _model("hf_qwen3")
    e = _expected("hf_qwen3")
    prompt, mask = e["ragged_tokens"], e["ragged_mask"]
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True):
        generate(model, prompt, GenerationConfig(max_new_tokens=6), attention_mask=mask)
        assert _compiles(caplog) == ["_decode", "_prefill"]
        sample = dict(max_new_tokens=6, do_sample=True)
        calls = [(dict(sample, temperature=0.7, top_k=5), 1),
                 (dict(sample, temperature=1.3, top_p=0.9), 0),
                 (dict(sample, temperature=0.5, min_p=0.1), 7),
                 (dict(max_new_tokens=6, repetition_penalty=1.2), 0),
                 (dict(max_new_tokens=6, eos_token_id=[3, 4], pad_token_id=5,
                       return_logprobs=True), 0),
                 (dict(sample, temperature=1.0, top_k=3, top_p=0.5, min_p=0.3,
                       repetition_penalty=0.9), 0)]
        for settings, seed in calls:
            generate(model, (prompt + 1) % 128, GenerationConfig(**settings),  # type: ignore[arg-type]
                     attention_mask=mask[::-1], seed=seed)
        generate(model, _rows(e)[::-1],
                 GenerationConfig(max_new_tokens=6))  # a ragged list of the same longest length
        for chunk in (1, 4, 16):
            list(stream(model, prompt, GenerationConfig(max_new_tokens=6), attention_mask=mask,
                        chunk=chunk))
        assert _compiles(caplog) == ["_decode", "_prefill"]


# -- stream ---------------------------------------------------------------------------


@pytest.mark.slow
def test_stream_equals_generate() -> None:
    model = _model("hf_llama")
    e = _expected("hf_llama")
    new = e["alone_new"].shape[1]
    eos = int(e["eos_id"])
    config = GenerationConfig(max_new_tokens=new, eos_token_id=eos, return_logprobs=True)
    out, logprobs = generate(model, _rows(e), config)
    steps = list(stream(model, _rows(e), config, chunk=5))
    assert len(steps) == new and steps[0][0].shape == (4,)
    np.testing.assert_array_equal(np.stack([t for t, _ in steps], 1), np.asarray(out)[:, -new:])
    np.testing.assert_array_equal(np.stack([p for _, p in steps], 1), np.asarray(logprobs))
    # Every row stopped: the stream ends there; generate holds pad after.
    e2 = [[int(e["eos_id"])]] * 3
    ends = GenerationConfig(max_new_tokens=new, eos_token_id=[99, 59], pad_token_id=0)
    short = list(stream(model, _rows(e)[:1], ends, chunk=3))
    full = np.asarray(generate(model, _rows(e)[:1], ends))[:, -new:]
    assert len(short) == 1 and short[0].tolist() == [99] and (full[0, 1:] == 0).all(), e2
    sample = GenerationConfig(max_new_tokens=7, do_sample=True, temperature=0.9, top_k=8)
    sampled = np.stack(list(stream(model, e["rep_prompt"], sample, seed=2, chunk=2)), 1)
    again = generate(model, e["rep_prompt"], sample, seed=2)
    np.testing.assert_array_equal(sampled, np.asarray(again)[:, -7:])


# -- bad input ------------------------------------------------------------------------


def test_bad_options_one_clear_error_each() -> None:
    model = _model("hf_qwen3")
    good = _expected("hf_qwen3")["rep_prompt"]
    cases = [
        ("top_p=0", dict(top_p=0)), ("top_p=1.5", dict(top_p=1.5)),
        ("top_p must be a number", dict(top_p="0.9")),
        ("min_p=-0.1", dict(min_p=-0.1)), ("min_p=2", dict(min_p=2)),
        ("repetition_penalty=0", dict(repetition_penalty=0)),
        ("repetition_penalty=nan", dict(repetition_penalty=float("nan"))),
        ("eos_token_id=128 is not a token id .*0 .. 127", dict(eos_token_id=128)),
        ("eos_token_id must be a token id .* got \\[2, -1\\]", dict(eos_token_id=[2, -1])),
        ("eos_token_id must be .* non-empty list of them, got \\[\\]", dict(eos_token_id=[])),
        ("pad_token_id=500", dict(pad_token_id=500)),
        ("attention_mask must be \\[batch, length\\] = \\[2, 8\\]",
         dict(attention_mask=np.ones((2, 7)))),
        ("attention_mask must hold only 0 and 1", dict(attention_mask=np.full((2, 8), 2))),
        ("attention_mask row 1 has padding after a real token",
         dict(attention_mask=np.array([[1] * 8, [1] * 7 + [0]]))),
        ("attention_mask row 0 is all padding", dict(attention_mask=np.zeros((2, 8)))),
        ("seed must be an int", dict(seed="a")),
        ("return_logprobs must be True or False", dict(return_logprobs="yes")),
    ]
    fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    for match, kwargs in cases:
        settings = {k: v for k, v in kwargs.items() if k in fields}
        with pytest.raises(UsageError, match=match):
            generate(model, good, GenerationConfig(max_new_tokens=4, **settings),
                     **{k: v for k, v in kwargs.items() if k not in fields})
    with pytest.raises(UsageError, match="prompt row 1 is empty"):
        generate(model, [[1, 2], []], GenerationConfig(max_new_tokens=4))
    with pytest.raises(UsageError, match=r"generate \(row 1\): prompt_tokens\[0, 0\] is 300, "
                                         r"outside the model's vocabulary of 128 ids"):
        generate(model, [[1, 2], [300]], GenerationConfig(max_new_tokens=4))
    with pytest.raises(UsageError, match="stream: chunk must be a positive int"):
        stream(model, good, GenerationConfig(max_new_tokens=4), chunk=0)
