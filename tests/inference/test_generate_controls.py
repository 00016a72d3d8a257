"""nnx_shard.inference.generate's controls against transformers: min_new_tokens,
no_repeat_ngram_size, stop_strings and num_return_sequences.

Outside reference: ``generate_options.npz`` beside the tiny Decoder
(tests/fixtures/make_hf_generate_options.py): transformers' greedy tokens with
each control (an eos greedy emits at step 1 with and without ``min_new_tokens``,
n-gram bans of sizes 2 and 1, stop strings across a token boundary, ending
inside a token and starting in the prompt, decoded by the ``hf_llama_text``
tokenizer), and the shape of a sampled ``num_return_sequences=3`` run; JAX's
compile log.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard import hf
from nnx_shard._errors import UsageError
from nnx_shard.inference import GenerationConfig, Tokenizer, generate, stream
from nnx_shard.models import Decoder, DecoderConfig
from tests.conftest import needs_devices

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@functools.cache
def _expected() -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / "hf_llama" / "generate_options.npz"))


@functools.cache
def _model() -> Decoder:
    cfg = DecoderConfig.from_hf(FIXTURES / "hf_llama")
    s = ns.strategies.get("dp")
    target = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), s.make_mesh(1), s)
    return hf.load_safetensors(FIXTURES / "hf_llama", target)


@functools.cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(FIXTURES / "hf_llama_text")


def _new(e: dict[str, np.ndarray]) -> int:
    return e["plain"].shape[1] - e["prompt"].shape[1]


def test_min_new_tokens_equals_transformers() -> None:
    e = _expected()
    eos, least, new = int(e["eos_id"]), int(e["min_new"]), _new(e)
    # transformers' fixture was made with pad_token_id=0 (not its default, the eos)
    early = np.asarray(generate(_model(), e["prompt"], GenerationConfig(
        max_new_tokens=new, eos_token_id=eos, pad_token_id=0)))
    np.testing.assert_array_equal(early, e["eos_out"])
    assert (early[0, 8 + int(e["eos_step"]) + 1:] == 0).all()   # the eos ended row 0 early
    out = np.asarray(generate(_model(), e["prompt"], GenerationConfig(
        max_new_tokens=new, eos_token_id=eos, pad_token_id=0, min_new_tokens=least)))
    np.testing.assert_array_equal(out, e["min_new_out"])
    assert (out[:, 8:8 + least] != eos).all()


def test_no_repeat_ngram_size_equals_transformers() -> None:
    e = _expected()
    plain = np.asarray(generate(_model(), e["prompt"], GenerationConfig(max_new_tokens=_new(e))))
    np.testing.assert_array_equal(plain, e["plain"])
    for size in (2, 1):
        out = np.asarray(generate(_model(), e["prompt"], GenerationConfig(
            max_new_tokens=_new(e), no_repeat_ngram_size=size)))
        np.testing.assert_array_equal(out, e[f"ngram_out_{size}"], err_msg=str(size))
        for row in out:   # an n-gram ending in a new token occurs nowhere before it
            grams = [tuple(row[i:i + size]) for i in range(len(row) - size + 1)]
            for i in range(8 - size + 1, len(grams)):
                assert grams[i] not in grams[:i], (size, row, i)
    assert (e["ngram_out_2"] != e["plain"]).any()   # the ban changes the tokens


def test_no_repeat_ngram_leaves_the_padding_out() -> None:
    # A padded row bans what the row alone bans: the padding is no part of its n-grams.
    # The padded batch has the fixture prompt's shape: the programs the test above compiled.
    e = _expected()
    rows = [e["prompt"][0].tolist(), e["prompt"][1, 5:].tolist(), e["prompt"][2].tolist()]
    config = GenerationConfig(max_new_tokens=_new(e), no_repeat_ngram_size=2)
    both = np.asarray(generate(_model(), rows, config))
    alone = np.asarray(generate(_model(), rows[1:2], config))
    np.testing.assert_array_equal(both[1, 5:], alone[0])
    np.testing.assert_array_equal(both[[0, 2]], e["ngram_out_2"][[0, 2]])  # the others' own


def _stop_config(e: dict[str, np.ndarray], strings: list[str], **kw: bool) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=_new(e), pad_token_id=int(e["pad_id"]),
                            eos_token_id=int(e["stop_eos"]), stop_strings=strings, **kw)


def _stop_run(e: dict[str, np.ndarray], strings: list[str], **kw):  # type: ignore[no-untyped-def]
    return generate(_model(), e["text_ids"], _stop_config(e, strings, **kw),
                    attention_mask=e["text_mask"], tokenizer=_tokenizer())


def test_stop_strings_equal_transformers() -> None:
    e = _expected()
    strings = e["stop_strings"].tolist()
    # The encoded prompts are transformers' (the fixture's tokenizer, bos first).
    assert [_tokenizer().encode(t) for t in e["text_prompts"].tolist()] == [
        row[m == 1].tolist() for row, m in zip(e["text_ids"], e["text_mask"], strict=True)]
    out, logprobs = _stop_run(e, strings, return_logprobs=True)
    np.testing.assert_array_equal(np.asarray(out), e["stop_out"])
    width = e["text_ids"].shape[1]
    assert (np.asarray(logprobs)[0, 5:] == 0).all() and (np.asarray(logprobs)[0, :5] < 0).all()
    texts = [_tokenizer().decode(row[width:], skip_special_tokens=False) for row in e["stop_out"]]
    assert texts[0].split("<|pad|>")[0].endswith(strings[0])   # the stop string's tokens kept
    assert strings[1] in texts[1] and not texts[1].split("<|pad|>")[0].endswith(strings[1])
    one = np.asarray(_stop_run(e, e["prompt_stop"].tolist()))   # starts in the prompt
    np.testing.assert_array_equal(one, e["prompt_stop_out"])
    # stream yields the same tokens, and ends when every row has stopped.
    steps = list(stream(_model(), e["text_ids"], _stop_config(e, strings),
                        attention_mask=e["text_mask"], tokenizer=_tokenizer(), chunk=3))
    assert len(steps) == 8
    np.testing.assert_array_equal(np.stack(steps, 1), e["stop_out"][:, width:width + 8])


def test_stop_strings_without_an_eos_pad_the_stopped_rows() -> None:
    # transformers pads a stopped row only when an eos is set; here it is always padded.
    e = _expected()
    config = GenerationConfig(max_new_tokens=_new(e), pad_token_id=int(e["pad_id"]),
                              stop_strings=e["stop_strings"].tolist())
    out = np.asarray(generate(_model(), e["text_ids"], config, attention_mask=e["text_mask"],
                              tokenizer=_tokenizer()))
    np.testing.assert_array_equal(out, e["stop_out"])


def test_num_return_sequences_repeats_each_prompt() -> None:
    e = _expected()
    new = _new(e)
    sampled = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=1.0, top_k=None,
                               num_return_sequences=3)
    out, logprobs = generate(_model(), e["prompt"], sampled.replace(return_logprobs=True), seed=3)
    out = np.asarray(out)
    assert out.shape == tuple(e["nrs_shape"]) == (9, 28)
    assert np.asarray(logprobs).shape == (9, new)
    np.testing.assert_array_equal(out[:, :8], np.repeat(e["prompt"], 3, axis=0))
    for row in range(3):
        copies = out[3 * row:3 * row + 3, 8:]
        assert len({tuple(c) for c in copies}) == 3, copies   # each copy sampled apart
    again = np.asarray(generate(_model(), e["prompt"], sampled, seed=3))
    np.testing.assert_array_equal(again, out)   # the seed decides


def test_unknown_option_lists_the_valid_ones() -> None:
    prompt = _expected()["prompt"]
    with pytest.raises(UsageError, match=r"unknown option num_beams=.*it takes a GenerationConfig"
                                         r" and attention_mask, tokenizer.*beam search"):
        generate(_model(), prompt, GenerationConfig(max_new_tokens=4), num_beams=4)
    with pytest.raises(UsageError, match=r"stream: unknown option .*did you mean temperature"):
        stream(_model(), prompt, GenerationConfig(max_new_tokens=4), temprature=0.5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_new_tokens=-1), "min_new_tokens=-1"),
    (dict(min_new_tokens=5), "min_new_tokens=5 is more than max_new_tokens=4"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size=-1"),
    (dict(no_repeat_ngram_size=True), "no_repeat_ngram_size=True .*a bool"),
    (dict(stop_strings=["ab", ""]), r"stop_strings\[1\]"),
    (dict(stop_strings=["ab"]), "stop_strings need the tokenizer"),
    (dict(stop_strings=[]), "stop_strings=\\[\\] must be a non-empty list"),
    (dict(num_return_sequences=0), "num_return_sequences=0"),
    (dict(num_return_sequences=2), "num_return_sequences=2 with do_sample=False"),
])
def test_bad_controls_name_their_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        generate(_model(), _expected()["prompt"], GenerationConfig(max_new_tokens=4, **kwargs))


@pytest.mark.parametrize("size", [2**31, 2**31 - 1, 10**30, np.int64(2**40)])
def test_no_repeat_ngram_size_past_the_context_is_refused(size) -> None:
    model = _model()
    with pytest.raises(UsageError) as e:
        generate(model, _expected()["prompt"],
                 GenerationConfig(max_new_tokens=4, no_repeat_ngram_size=size))
    assert (f"no_repeat_ngram_size={int(size)} is longer than the model's context of "
            f"{model.max_length} positions (max_length)") in str(e.value)
    assert f"at most {model.max_length}" in str(e.value)


def test_no_repeat_ngram_longer_than_the_rows_bans_nothing() -> None:
    # The fixture's shapes: the programs the tests above compiled, none of
    # test_control_values_compile_nothing's.
    e = _expected()
    prompt, new = e["prompt"], _new(e)
    plain = np.asarray(generate(_model(), prompt, GenerationConfig(max_new_tokens=new)))
    for size in (29, 30, 500):  # 8 + 20 positions: no such n-gram fits, within the context
        config = GenerationConfig(max_new_tokens=new, no_repeat_ngram_size=size)
        np.testing.assert_array_equal(np.asarray(generate(_model(), prompt, config)), plain)
    banned = np.asarray(generate(_model(), prompt,
                                 GenerationConfig(max_new_tokens=new, no_repeat_ngram_size=1)))
    assert not np.array_equal(banned, plain)  # a ban that fits does act on these rows


def test_num_return_sequences_past_memory_is_refused_with_the_most_that_fit() -> None:
    import os

    prompt = _expected()["prompt"]
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for copies in (2**31, 10**20):
        with pytest.raises(UsageError) as e:
            generate(_model(), prompt, GenerationConfig(max_new_tokens=4, do_sample=True,
                                                        num_return_sequences=copies))
        message = str(e.value)
        assert (f"num_return_sequences={copies} makes {len(prompt)} prompt(s) x {copies} = "
                f"{len(prompt) * copies:,} rows of {prompt.shape[1] + 4} positions") in message
        assert f"this host's {host / 2**30:,.1f} GiB of memory" in message
        most = int(message.split("num_return_sequences <= ")[1].split()[0])
        assert 1 < most < 2**31
    # the bound is computed, not guessed: the most that fit are accepted by the check
    from nnx_shard.inference._generation import _check_copies

    _check_copies(_model(), prompt.shape, most, 4, None, None, "generate")
    with pytest.raises(UsageError, match="num_return_sequences"):
        _check_copies(_model(), prompt.shape, 2 * most + 2, 4, None, None, "generate")


def _compiles(caplog: pytest.LogCaptureFixture) -> list[str]:
    names = [r.getMessage().split()[1] for r in caplog.records
             if r.getMessage().startswith("Compiling ")]
    return sorted(n[4:-1] for n in names if n in ("jit(_prefill)", "jit(_decode)"))


def test_control_values_compile_nothing(caplog: pytest.LogCaptureFixture) -> None:
    e = _expected()
    model, prompt = _model(), e["prompt"][:, :5]
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True):
        generate(model, prompt, GenerationConfig(max_new_tokens=5))
        assert _compiles(caplog) == ["_decode", "_prefill"]
        for kwargs in (dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=4),
                       dict(min_new_tokens=3, eos_token_id=[5, 6]), dict(stop_strings="ab")):
            generate(model, prompt, GenerationConfig(max_new_tokens=5, **kwargs),
                     tokenizer=_tokenizer())
        assert _compiles(caplog) == ["_decode", "_prefill"]


@pytest.mark.slow
@needs_devices(8)
def test_controls_sharded_equal_transformers() -> None:
    # tp: 3 and 2 rows over data=2, padded with dummy rows; the host's halt reaches them.
    e = _expected()
    s = ns.strategies.get("tp")
    mesh = s.make_mesh(8)
    cfg = DecoderConfig.from_hf(FIXTURES / "hf_llama")
    model = hf.load_safetensors(FIXTURES / "hf_llama", ns.abstract_init(
        lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, s))
    with ns.use(mesh, s.rules):
        ngram = generate(model, e["prompt"],
                         GenerationConfig(max_new_tokens=_new(e), no_repeat_ngram_size=2))
        config = GenerationConfig(max_new_tokens=_new(e), pad_token_id=int(e["pad_id"]),
                                  stop_strings=e["stop_strings"].tolist())
        stopped = generate(model, e["text_ids"], config, attention_mask=e["text_mask"],
                           tokenizer=_tokenizer())
    np.testing.assert_array_equal(np.asarray(ngram), e["ngram_out_2"])
    np.testing.assert_array_equal(np.asarray(stopped), e["stop_out"])
