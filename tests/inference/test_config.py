"""``GenerationConfig``: transformers' field names and defaults, the checks of each
field, ``generation_config.json`` read as transformers reads it, and the calls that
take it (the settings only there)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from nnx_shard import UsageError
from nnx_shard.inference import GenerationConfig, Tokenizer, generate, generate_text, stream
from nnx_shard.models import Decoder, get_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

#: transformers' GenerationConfig.__init__ defaults of the fields this library takes
#: (src/transformers/generation/configuration_utils.py: ``kwargs.pop(name, default)``).
TRANSFORMERS_DEFAULTS = {
    "max_length": 20, "max_new_tokens": None, "min_new_tokens": None, "stop_strings": None,
    "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None,
    "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "num_return_sequences": 1,
    "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
}
#: The one field of ours: transformers returns logits or scores, not log-probabilities.
OURS = {"return_logprobs": False}


def _tiny() -> Decoder:
    return Decoder(get_config("tiny"), rngs=nnx.Rngs(0))


def test_field_names_and_defaults_are_transformers() -> None:
    got = {f.name: f.default for f in dataclasses.fields(GenerationConfig)}
    assert got == TRANSFORMERS_DEFAULTS | OURS
    assert dataclasses.asdict(GenerationConfig()) == TRANSFORMERS_DEFAULTS | OURS
    with pytest.raises(dataclasses.FrozenInstanceError):
        GenerationConfig().top_k = 5  # type: ignore[misc]


def test_reads_generation_config_json_as_transformers_writes_it(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6,
         "top_p": 0.9, "transformers_version": "4.57.0"}, indent=2))
    config = GenerationConfig.from_pretrained(tmp_path)
    assert (config.bos_token_id, config.eos_token_id, config.do_sample) == (1, (2, 3), True)
    assert (config.temperature, config.top_p, config.top_k) == (0.6, 0.9, 50)  # 50: unset
    assert config.max_new_tokens is None and config.max_length == 20
    # a single eos id stays an int; changes apply on top of the file
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    again = GenerationConfig.from_pretrained(tmp_path, max_new_tokens=8, top_k=0)
    assert (again.eos_token_id, again.eos_ids, again.max_new_tokens, again.top_k) == (
        2, (2,), 8, 0)


def test_unknown_keys_and_nulls_are_ignored() -> None:
    # transformers' own files: metadata, fields of its other modes, nulls for "unset"
    config = GenerationConfig.from_dict({
        "_from_model_config": True, "output_attentions": False, "use_cache": True,
        "num_beams": 1, "typical_p": 1.0, "transformers_version": "5.24.0",
        "top_k": None, "temperature": None, "pad_token_id": None})
    assert config == GenerationConfig()
    published = GenerationConfig.from_pretrained(FIXTURES / "hf_publish")
    assert (published.eos_token_id, published.pad_token_id, published.do_sample,
            published.temperature, published.top_p) == ((2, 3), 0, True, 0.7, 0.9)
    assert GenerationConfig.from_pretrained(FIXTURES / "hf_llama") == GenerationConfig()


@pytest.mark.parametrize(("content", "words"), [
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_k": 2.5}, "top_k=2.5; use an int 0 or more"),
    ({"eos_token_id": "</s>"}, "eos_token_id must be a token id"),
    ({"eos_token_id": [2, True]}, "eos_token_id must be a token id"),
    ({"do_sample": "yes"}, "do_sample must be True or False"),
    ({"do_sample": True, "temperature": 0}, "temperature=0 with do_sample=True"),
    ({"num_return_sequences": 2}, "num_return_sequences=2 with do_sample=False"),
    ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ([1, 2], "holds a JSON list [1, 2], not an object"),
])
def test_a_wrong_field_names_the_file_and_key(tmp_path: Path, content, words: str) -> None:  # type: ignore[no-untyped-def]
    file = tmp_path / "generation_config.json"
    file.write_text(json.dumps(content))
    with pytest.raises(UsageError) as e:
        GenerationConfig.from_pretrained(tmp_path)
    assert str(e.value).startswith(str(file)), e.value
    assert words in str(e.value) and "Fix:" in str(e.value), e.value


def test_from_pretrained_without_the_file_and_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no generation_config.json in"):
        GenerationConfig.from_pretrained(tmp_path)
    with pytest.raises(UsageError, match="path must be the checkpoint folder"):
        GenerationConfig.from_pretrained(3)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="is no field"):
        GenerationConfig.from_dict({}, max_new_token=3)
    with pytest.raises(UsageError, match="is no field"):
        GenerationConfig().replace(temprature=0.5)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"top_p": 0}, "top_p=0;"), ({"min_p": 1.5}, "min_p=1.5;"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty=inf"),
    ({"temperature": True}, "temperature must be a number"),
    ({"temperature": -0.5}, "temperature=-0.5"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size=-1"),
    ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens=5 is more than max_new_tokens=4"),
    ({"stop_strings": [""]}, r"stop_strings[0]"), ({"stop_strings": 5}, "stop_strings=5"),
    ({"pad_token_id": -1}, "pad_token_id must be a token id"),
    ({"return_logprobs": 1}, "return_logprobs must be True or False"),
])
def test_each_field_is_checked_where_it_is_built(kwargs: dict, words: str) -> None:
    with pytest.raises(UsageError) as e:
        GenerationConfig(**kwargs)
    assert str(e.value).startswith("GenerationConfig: ") and words in str(e.value), e.value


def test_settings_are_no_arguments_of_the_calls() -> None:
    model = _tiny()
    with pytest.raises(UsageError, match=r"generate: temperature=, top_k= are settings of "
                                         r"GenerationConfig.*GenerationConfig\(temperature=0.7, "
                                         r"top_k=5\)"):
        generate(model, [[1, 2]], GenerationConfig(max_new_tokens=2), temperature=0.7, top_k=5)
    with pytest.raises(UsageError, match=r"config must be a GenerationConfig, got int 6. Fix: "
                                         r"generate\(model, prompts, GenerationConfig\("
                                         r"max_new_tokens=6\)\)"):
        generate(model, [[1, 2]], 6)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="stream: max_new_tokens= is a setting of"):
        stream(model, [[1, 2]], max_new_tokens=2)


def test_defaults_follow_transformers_in_generate() -> None:
    model, prompt = _tiny(), [[1, 2, 3, 4]]
    # no max_new_tokens: max_length (prompt and new tokens) bounds the row
    assert generate(model, prompt, GenerationConfig(max_length=10)).shape == (1, 10)
    with pytest.raises(UsageError, match="max_length is 4 .* Fix: set max_new_tokens"):
        generate(model, prompt, GenerationConfig(max_length=4))
    # sampling settings without do_sample=True: greedy, as in transformers
    greedy = generate(model, prompt, GenerationConfig(max_new_tokens=6))
    np.testing.assert_array_equal(
        generate(model, prompt, GenerationConfig(max_new_tokens=6, temperature=0.3, top_k=3)),
        greedy)
    # the pad id defaults to the first eos id; rows stop there
    eos = int(np.asarray(greedy)[0, 5])
    out = np.asarray(generate(model, prompt, GenerationConfig(max_new_tokens=6,
                                                              eos_token_id=[eos, 7])))
    assert out[0, 5] == eos and (out[0, 6:] == eos).all()
    # top_k past the vocabulary keeps every token (transformers clamps it)
    sample = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=None)
    np.testing.assert_array_equal(
        generate(model, prompt, sample.replace(top_k=10**6), seed=1),
        generate(model, prompt, sample, seed=1))


def test_text_functions_take_the_config() -> None:
    tok = Tokenizer.from_pretrained(FIXTURES / "hf_llama_text")
    with pytest.raises(UsageError, match="generate_text: return_logprobs=True is not taken"):
        generate_text(object(), tok, ["Hello"], GenerationConfig(return_logprobs=True))
    with pytest.raises(UsageError, match="generate_text: do_sample= is a setting of GenerationConfig"):
        generate_text(object(), tok, ["Hello"], do_sample=True)
    assert tok.generation_config == GenerationConfig()
