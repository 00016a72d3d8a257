"""Hostile cases of the fine-tuning inputs: masks, positions, segment ids, -100 targets,
and ``ns.pack``."""

from __future__ import annotations

from typing import Any


def build(hs: Any) -> None:
    nan = float("nan")

    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    def tiny(kind: str = "llama") -> Any:
        from flax import nnx

        from nnx_shard.models import Decoder, get_config

        if kind == "llama":
            return Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))
        return Decoder(get_config("tiny"), rngs=nnx.Rngs(0))

    def call(kind: str = "llama", **kw: Any) -> Any:
        import numpy as np

        return tiny(kind)(np.zeros((2, 8), np.int32), **kw)

    def loss(**batch: Any) -> Any:
        import numpy as np

        from nnx_shard.models import lm_loss

        base = {"inputs": np.zeros((2, 8), np.int32), "targets": np.zeros((2, 8), np.int32)}
        return lm_loss(tiny(), base | batch)

    def arr(value: Any, shape: tuple[int, ...] = (2, 8), dtype: str = "int32") -> Any:
        import numpy as np

        return np.full(shape, value, dtype)

    for label, fn, arg in [
        ("mask_shape", lambda: call(attention_mask=arr(1, (2, 7))), "attention_mask"),
        ("mask_float", lambda: call(attention_mask=arr(1.0, dtype="float32")), "attention_mask"),
        ("mask_two", lambda: call(attention_mask=arr(2)), "attention_mask"),
        ("mask_str", lambda: call(attention_mask="ones"), "attention_mask"),
        ("mask_none_list", lambda: call(attention_mask=[None, None]), "attention_mask"),
        ("positions_negative", lambda: call(positions=arr(-1)), "positions"),
        ("positions_past_context", lambda: call("transformer", positions=arr(16)), "positions"),
        ("positions_nan", lambda: call(positions=arr(nan, dtype="float32")), "positions"),
        ("segments_rank1", lambda: call(segment_ids=arr(1, (8,))), "segment_ids"),
        ("segments_bool_scalar", lambda: call(segment_ids=True), "segment_ids"),
        ("transformer_mask_shape", lambda: call("transformer", attention_mask=arr(1, (1, 8))),
         "attention_mask"),
        ("loss_all_ignored", lambda: loss(targets=arr(-100)), ("targets", "-100")),
        ("loss_target_past_vocab", lambda: loss(targets=arr(128)), ("targets", "vocabulary")),
        ("loss_target_negative", lambda: loss(targets=arr(-5)), ("targets", "-100")),
        ("loss_mask_shape", lambda: loss(attention_mask=arr(1, (2, 3))), "attention_mask"),
        ("loss_segments_float", lambda: loss(segment_ids=arr(0.5, dtype="float32")),
         "segment_ids"),
        ("pack_too_long", lambda: ns().pack([[1] * 9], 8), ("example", "length", "tokens")),
        ("pack_empty_example", lambda: ns().pack([[]], 8), "example"),
        ("pack_str", lambda: ns().pack("hello", 8), "examples"),
        ("pack_none", lambda: ns().pack(None, 8), "examples"),
        ("pack_float_tokens", lambda: ns().pack([[1.5]], 8), "example"),
        ("pack_nested", lambda: ns().pack([[[1, 2]]], 8), "example"),
        ("pack_length_zero", lambda: ns().pack([[1]], 0), "length"),
        ("pack_length_bool", lambda: ns().pack([[1]], True), "length"),
        ("pack_length_nan", lambda: ns().pack([[1]], nan), "length"),
        ("pack_prompt_negative", lambda: ns().pack([[1, 2]], 8, prompt_lengths=[-1]),
         "prompt_lengths"),
        ("pack_prompt_past_example", lambda: ns().pack([[1, 2]], 8, prompt_lengths=[3]),
         "prompt_lengths"),
        ("pack_prompt_count", lambda: ns().pack([[1, 2]], 8, prompt_lengths=[1, 1]),
         "prompt_lengths"),
        ("pack_prompt_float", lambda: ns().pack([[1, 2]], 8, prompt_lengths=[1.0]),
         "prompt_lengths"),
        ("pack_prompt_int", lambda: ns().pack([[1, 2]], 8, prompt_lengths=1), "prompt_lengths"),
        ("pack_pad_str", lambda: ns().pack([[1, 2]], 8, pad_id="0"), "pad_id"),
    ]:
        hs.api(f"masks/{label}", arg, fn)
