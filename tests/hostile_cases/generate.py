"""Hostile cases of generation's options: ragged prompts, masks, eos and pad ids,
top-p, min-p, repetition penalty, log-probabilities, seeds and ``stream``."""

from __future__ import annotations

from typing import Any


def build(hs: Any) -> None:
    nan, inf = float("nan"), float("inf")

    def tiny() -> Any:
        from flax import nnx

        from nnx_shard.models import Decoder, get_config

        return Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))

    def gen(prompts: Any = None, new: Any = 2, **kw: Any) -> Any:
        import numpy as np

        from nnx_shard.inference import generate

        config, rest = hs.generation_config(new, kw)
        return generate(tiny(), np.ones((2, 4), np.int32) if prompts is None else prompts,
                        config, **rest)

    def streamed(**kw: Any) -> Any:
        import numpy as np

        from nnx_shard.inference import stream

        config, rest = hs.generation_config(2, kw)
        return list(stream(tiny(), np.ones((2, 4), np.int32), config, **rest))

    def arr(value: Any, shape: tuple[int, ...] = (2, 4), dtype: str = "int32") -> Any:
        import numpy as np

        return np.full(shape, value, dtype)

    for label, fn, arg in [
        ("top_p_zero", lambda: gen(top_p=0.0, temperature=1.0), "top_p"),
        ("top_p_above_one", lambda: gen(top_p=1.5, temperature=1.0), "top_p"),
        ("top_p_nan", lambda: gen(top_p=nan, temperature=1.0), "top_p"),
        ("top_p_str", lambda: gen(top_p="0.9", temperature=1.0), "top_p"),
        ("min_p_negative", lambda: gen(min_p=-0.1, temperature=1.0), "min_p"),
        ("min_p_above_one", lambda: gen(min_p=1.5, temperature=1.0), "min_p"),
        ("min_p_bool", lambda: gen(min_p=True, temperature=1.0), "min_p"),
        ("penalty_zero", lambda: gen(repetition_penalty=0.0), "repetition_penalty"),
        ("penalty_negative", lambda: gen(repetition_penalty=-1.2), "repetition_penalty"),
        ("penalty_inf", lambda: gen(repetition_penalty=inf), "repetition_penalty"),
        ("penalty_nan", lambda: gen(repetition_penalty=nan), "repetition_penalty"),
        ("eos_past_vocab", lambda: gen(eos_token_id=128), ("eos_token_id", "vocabulary")),
        ("eos_negative", lambda: gen(eos_token_id=-1), "eos_token_id"),
        ("eos_list_bad", lambda: gen(eos_token_id=[1, 1000]), "eos_token_id"),
        ("eos_empty_list", lambda: gen(eos_token_id=[]), "eos_token_id"),
        ("eos_float", lambda: gen(eos_token_id=2.0), "eos_token_id"),
        ("eos_str", lambda: gen(eos_token_id="</s>"), "eos_token_id"),
        ("pad_past_vocab", lambda: gen(pad_token_id=999), "pad_token_id"),
        ("pad_negative", lambda: gen(pad_token_id=-1), "pad_token_id"),
        ("mask_shape", lambda: gen(attention_mask=arr(1, (2, 3))), "attention_mask"),
        ("mask_two", lambda: gen(attention_mask=arr(2)), "attention_mask"),
        ("mask_right_padded", lambda: gen(attention_mask=[[1, 1, 1, 0], [1, 1, 1, 1]]),
         ("attention_mask", "left")),
        ("mask_all_padding", lambda: gen(attention_mask=arr(0)), "attention_mask"),
        ("mask_str", lambda: gen(attention_mask="ones"), "attention_mask"),
        ("mask_with_ragged", lambda: gen([[1, 2], [3]], attention_mask=arr(1)),
         "attention_mask"),
        ("ragged_empty_row", lambda: gen([[1, 2], []]), ("prompt", "empty")),
        ("ragged_past_vocab", lambda: gen([[1, 2], [500]]), ("prompt", "vocabulary")),
        ("ragged_negative", lambda: gen([[1, 2], [-3]]), ("prompt", "vocabulary")),
        ("ragged_float", lambda: gen([[1, 2], [1.5]]), ("prompt", "integer")),
        ("logprobs_str", lambda: gen(return_logprobs="yes"), "return_logprobs"),
        ("seed_str", lambda: gen(seed="x"), "seed"),
        ("seed_float", lambda: gen(seed=1.5), "seed"),
        ("seed_huge", lambda: gen(seed=2**70), "seed"),
        ("stream_chunk_zero", lambda: streamed(chunk=0), "chunk"),
        ("stream_chunk_float", lambda: streamed(chunk=2.5), "chunk"),
        ("stream_top_p", lambda: streamed(top_p=2.0, temperature=1.0), "top_p"),
    ]:
        hs.api(f"generate/{label}", arg, fn)
