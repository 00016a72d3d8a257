"""Hostile cases of generation's controls: ``min_new_tokens``,
``no_repeat_ngram_size``, ``stop_strings`` (and their ``tokenizer``),
``num_return_sequences``, unknown options, ``decode(logits_to_keep=)``, through
``generate``, ``stream``, the text functions and ``nnx-shard generate``."""

from __future__ import annotations

import os
from typing import Any

_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "fixtures")
_TEXT = os.path.join(_FIXTURES, "hf_llama_text")
_MODEL = os.path.join(_FIXTURES, "hf_llama")


def build(hs: Any) -> None:
    def tiny() -> Any:
        from flax import nnx

        from nnx_shard.models import Decoder, get_config

        return Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))

    def tok() -> Any:
        from nnx_shard.inference import Tokenizer

        return Tokenizer.from_pretrained(_TEXT)

    def gen(new: Any = 4, **kw: Any) -> Any:
        import numpy as np

        from nnx_shard.inference import generate

        config, rest = hs.generation_config(new, kw)
        return generate(tiny(), np.ones((2, 4), np.int32), config, **rest)

    def streamed(**kw: Any) -> Any:
        import numpy as np

        from nnx_shard.inference import stream

        config, rest = hs.generation_config(4, kw)
        return list(stream(tiny(), np.ones((2, 4), np.int32), config, **rest))

    def text(fn: str, **kw: Any) -> Any:
        return hs.hf_text(fn, 4, kw)

    def keep(value: Any) -> Any:
        import jax.numpy as jnp
        from flax import nnx

        model = tiny()
        model.init_cache(1, 8)
        # Traced: the check of the Python value comes after the layers, which run eagerly
        # would compile op by op (seconds); a trace reaches it and compiles nothing.
        return nnx.jit(lambda m, t: m.decode(t, logits_to_keep=value))(
            model, jnp.ones((1, 3), jnp.int32))

    sampled = {"temperature": 1.0}
    for label, fn, arg in [
        ("min_new_negative", lambda: gen(min_new_tokens=-1, eos_token_id=3), "min_new_tokens"),
        ("min_new_past_max", lambda: gen(min_new_tokens=5, eos_token_id=3),
         ("min_new_tokens", "max_new_tokens")),
        ("min_new_bool", lambda: gen(min_new_tokens=True), "min_new_tokens"),
        ("min_new_float", lambda: gen(min_new_tokens=2.0), "min_new_tokens"),
        ("min_new_str", lambda: gen(min_new_tokens="2"), "min_new_tokens"),
        ("ngram_negative", lambda: gen(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
        ("ngram_bool", lambda: gen(no_repeat_ngram_size=True), "no_repeat_ngram_size"),
        ("ngram_float", lambda: gen(no_repeat_ngram_size=2.5), "no_repeat_ngram_size"),
        ("ngram_none_str", lambda: gen(no_repeat_ngram_size="3"), "no_repeat_ngram_size"),
        ("stop_empty_string", lambda: gen(stop_strings="", tokenizer=tok()), "stop_strings"),
        ("stop_list_with_empty", lambda: gen(stop_strings=["ab", ""], tokenizer=tok()),
         "stop_strings"),
        ("stop_list_with_int", lambda: gen(stop_strings=["ab", 3], tokenizer=tok()),
         "stop_strings"),
        ("stop_int", lambda: gen(stop_strings=5, tokenizer=tok()), "stop_strings"),
        ("stop_set", lambda: gen(stop_strings={"ab"}, tokenizer=tok()), "stop_strings"),
        ("stop_empty_list", lambda: gen(stop_strings=[], tokenizer=tok()), "stop_strings"),
        ("stop_bytes", lambda: gen(stop_strings=[b"ab"], tokenizer=tok()), "stop_strings"),
        ("stop_no_tokenizer", lambda: gen(stop_strings=["ab"]), ("stop_strings", "tokenizer")),
        ("stop_tokenizer_int", lambda: gen(stop_strings=["ab"], tokenizer=5),
         ("stop_strings", "tokenizer")),
        ("stop_tokenizer_path", lambda: gen(stop_strings=["ab"], tokenizer=_TEXT),
         ("stop_strings", "tokenizer")),
        ("returns_zero", lambda: gen(num_return_sequences=0, **sampled), "num_return_sequences"),
        ("returns_negative", lambda: gen(num_return_sequences=-2, **sampled),
         "num_return_sequences"),
        ("returns_bool", lambda: gen(num_return_sequences=True, **sampled),
         "num_return_sequences"),
        ("returns_float", lambda: gen(num_return_sequences=2.0, **sampled),
         "num_return_sequences"),
        ("returns_greedy", lambda: gen(num_return_sequences=2),
         ("num_return_sequences", "temperature")),
        ("unknown_option", lambda: gen(num_beams=4), ("num_beams", "unknown option")),
        ("unknown_misspelt", lambda: gen(max_new_token=4), ("max_new_token", "unknown option")),
        ("unknown_two", lambda: gen(do_sample=True, top_a=0.1), ("do_sample", "unknown")),
        ("stream_unknown", lambda: streamed(temprature=0.5), ("temprature", "unknown")),
        ("stream_min_new_past_max", lambda: streamed(min_new_tokens=9), "min_new_tokens"),
        ("stream_ngram_negative", lambda: streamed(no_repeat_ngram_size=-1),
         "no_repeat_ngram_size"),
        ("stream_stop_no_tokenizer", lambda: streamed(stop_strings="x"), "stop_strings"),
        ("stream_returns_greedy", lambda: streamed(num_return_sequences=3),
         "num_return_sequences"),
        ("text_stop_empty", lambda: text("generate_text", stop_strings=[""]), "stop_strings"),
        ("text_ngram_negative", lambda: text("generate_text", no_repeat_ngram_size=-1),
         "no_repeat_ngram_size"),
        ("text_unknown", lambda: text("generate_text", num_beams=2), "num_beams"),
        ("stream_text_returns", lambda: text("stream_text", num_return_sequences=2,
                                             temperature=1.0), "num_return_sequences"),
        ("stream_text_min_new", lambda: text("stream_text", min_new_tokens=-3),
         "min_new_tokens"),
        ("decode_keep_negative", lambda: keep(-1), "logits_to_keep"),
        ("decode_keep_bool", lambda: keep(True), "logits_to_keep"),
        ("decode_keep_float", lambda: keep(1.0), "logits_to_keep"),
    ]:
        hs.api(f"generate_options/{label}", arg, fn)

    cmd = ("generate", "--model", _MODEL, "--tokenizer", _TEXT, "--prompt", "Hi")
    for label, flag, argv in [
        ("cli_min_new_negative", "--min-new-tokens", ("--min-new-tokens", "-1")),
        ("cli_min_new_past_max", "--min-new-tokens", ("--min-new-tokens", "70")),
        ("cli_min_new_text", "--min-new-tokens", ("--min-new-tokens", "two")),
        ("cli_ngram_negative", "--no-repeat-ngram-size", ("--no-repeat-ngram-size", "-1")),
        ("cli_ngram_float", "--no-repeat-ngram-size", ("--no-repeat-ngram-size", "1.5")),
        ("cli_stop_empty", "--stop", ("--stop", "")),
        ("cli_stop_no_value", "--stop", ("--stop",)),
    ]:
        hs.cli(f"generate_options/{label}", flag, *cmd, *argv)
