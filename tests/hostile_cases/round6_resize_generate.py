"""Hostile cases of a QLoRA checkpoint restored into a base of another quantization
kind (NF4 codes read as int4 and back: the same int4 bits, other weights), a damaged
record of that kind, vocabularies resized past the devices' memory or with LoRA
adapters or quantized tables on the embedding and head, and generation options past
what the programs or the memory hold (``no_repeat_ngram_size`` and
``num_return_sequences`` at int32's edge, a prompt that fills the context), through
the API and ``nnx-shard generate``.

A refused resize must leave the model as it was: a table, an adapter factor or a
config changed by a failed call makes the case ``raw`` (an AssertionError of this
file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any


def build(hs: Any) -> None:
    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    # Restore: the quantization kind --------------------------------------------------------
    def qlinear(kind: str) -> Any:
        from flax import nnx

        return ns().lora(nnx.Linear(128, 4, rngs=nnx.Rngs(0)), 2, 4.0, targets="kernel",
                         quantize=kind)

    def saved(kind: str) -> str:
        d = hs.F.path(f"r6rg_{kind}_ckpt")
        if not os.path.isdir(d):
            ns().save(d, 1, model=qlinear(kind))
        return d

    for saved_kind, target_kind in [("nf4", "int4"), ("int4", "nf4")]:
        hs.api(f"r6rg/restore_{saved_kind}_into_{target_kind}", ("quantize", "kernel/qvalue"),
               lambda s=saved_kind, t=target_kind: ns().restore(saved(s), model=qlinear(t)))

    def in_place() -> Any:
        from nnx_shard._checkpoint._restore import restore_in_place

        return restore_in_place(saved("nf4"), qlinear("int4"), None)

    hs.api("r6rg/restore_in_place_nf4_into_int4", ("quantize", "kernel/qvalue"), in_place)

    def abstract_target() -> Any:
        from flax import nnx

        strategy = ns().strategies.get("dp")

        def factory() -> Any:
            model = ns().models.Decoder(ns().models.DecoderConfig(embed=128, mlp=128),
                                      rngs=nnx.Rngs(0))
            return ns().lora(model, 2, 4.0, targets="mlp/(gate|up)$", quantize=kind[0])

        kind = ["nf4"]
        d = hs.F.path("r6rg_llama_nf4")
        if not os.path.isdir(d):
            ns().save(d, 1, model=ns().sharded_init(factory, "data=8", strategy))
        kind[0] = "int4"
        return ns().restore(d, model=ns().abstract_init(factory, "data=8", strategy))

    hs.api("r6rg/restore_abstract_llama_nf4_into_int4", ("quantize", "gate/qvalue"),
           abstract_target, slow=True)

    def bad_record(value: Any) -> Any:
        from nnx_shard._checkpoint._manifest import manifest_digest

        d = hs.F.path(f"r6rg_bad_record_{type(value).__name__}")
        if not os.path.isdir(d):
            ns().save(d, 1, model=qlinear("nf4"))
            path = os.path.join(d, "1", "manifest", "metadata")
            with open(path) as f:
                manifest = json.load(f)
            manifest["items"]["model"]["kernel/qvalue"]["quant"] = value
            manifest["digest"] = manifest_digest(manifest)
            with open(path, "w") as f:
                json.dump(manifest, f)
        return ns().restore(d, model=qlinear("nf4"))

    hs.api("r6rg/restore_record_not_text", ("manifest", "quantization kind"),
           lambda: bad_record(4))
    hs.api("r6rg/restore_record_empty", ("manifest", "quantization kind"),
           lambda: bad_record(""))

    # Resize: memory, adapters, quantized tables ----------------------------------------------
    def state_of(model: Any) -> list[Any]:
        from flax import nnx

        return [model.cfg.vocab, *(v.get_value() for _, v in nnx.to_flat_state(
            nnx.state(model)))]

    def untouched(model: Any, fn: Callable[[Any], Any]) -> Any:
        """Runs ``fn(model)``; raises AssertionError (raw) if a failed call changed it."""
        before = state_of(model)
        try:
            return fn(model)
        finally:
            after = state_of(model)
            if len(after) != len(before) or after[0] != before[0] or any(
                    a is not b for a, b in zip(after[1:], before[1:], strict=True)):
                raise AssertionError("the model changed under a refused resize")

    def resize(model: Any, *args: Any, **kw: Any) -> Any:
        return untouched(model, lambda m: ns().models.resize_token_embeddings(m, *args, **kw))

    # The models below hold zero tables (hs.zero_filled): the refusals read shapes,
    # shardings and the config, never values, and a random init at WIDE compiles for seconds.
    def llama(embed: int = 64, **kw: Any) -> Any:
        from flax import nnx

        return hs.zero_filled(nnx.eval_shape(lambda: ns().models.Decoder(
            ns().models.DecoderConfig(embed=embed, **kw), rngs=nnx.Rngs(0))))

    def adapted(targets: str, quantize: str | None = None, embed: int = 64) -> Any:
        return ns().lora(llama(embed), 2, 4.0, targets=targets, quantize=quantize)

    def sharded() -> Any:
        from flax import nnx

        return hs.zero_filled(ns().abstract_init(lambda: ns().models.Decoder(
            ns().models.DecoderConfig(embed=WIDE), rngs=nnx.Rngs(0)), "data=8",
            ns().strategies.get("fsdp")))

    # Tables of 2**31 rows of WIDE floats: 8 TiB each, past any machine's memory.
    WIDE = 1024
    hs.api("r6rg/resize_int32_max", ("new_vocab", "memory"),
           lambda: resize(llama(WIDE), 2**31 - 1))
    hs.api("r6rg/resize_int32_max_padded", ("new_vocab", "memory"),
           lambda: resize(llama(WIDE), 2**31 - 2**12, pad_to_multiple_of=64))
    hs.api("r6rg/resize_past_memory_sharded", ("new_vocab", "memory"),
           lambda: resize(sharded(), 2**31 - 8))
    hs.api("r6rg/resize_past_memory_lora_embed", ("new_vocab", "memory"),
           lambda: resize(adapted("token_embed|unembed", embed=WIDE), 2**31 - 1))
    hs.api("r6rg/resize_past_memory_tied", ("new_vocab", "memory"),
           lambda: resize(llama(WIDE, tie_embeddings=True), 2**31 - 1))
    hs.api("r6rg/resize_quantized_embed", ("token_embed", "quantize"),
           lambda: resize(adapted("token_embed", "int8"), 136))
    hs.api("r6rg/resize_quantized_head", ("unembed", "quantize"),
           lambda: resize(adapted("unembed", "nf4"), 136))

    def broken_factor(kernel: str, factor: str) -> Any:
        import jax.numpy as jnp

        model = adapted(kernel)
        var = getattr(getattr(model, f"lora_{kernel}"), factor)
        var.set_value(jnp.zeros((7, 2) if factor == "lora_a" else (2, 7)))
        return resize(model, 136)

    hs.api("r6rg/resize_embed_factor_misshaped", "lora_token_embed",
           lambda: broken_factor("token_embed", "lora_a"))
    hs.api("r6rg/resize_head_factor_misshaped", "lora_unembed",
           lambda: broken_factor("unembed", "lora_b"))

    # Generation: options past int32, the context, the memory ---------------------------------
    def tiny() -> Any:
        from flax import nnx

        from nnx_shard.models import Decoder, get_config

        return Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))

    def gen(new: Any = 4, length: int = 4, fn: str = "generate", **kw: Any) -> Any:
        import numpy as np

        from nnx_shard import inference

        prompt = np.ones((2, length), np.int32)
        config, rest = hs.generation_config(new, kw)
        if fn == "stream":
            return list(inference.stream(tiny(), prompt, config, **rest))
        return inference.generate(tiny(), prompt, config, **rest)

    def text(**kw: Any) -> Any:
        return hs.hf_text("generate_text", 4, kw)

    sampled = {"temperature": 1.0}
    for label, fn, arg in [
        ("ngram_int32_overflow", lambda: gen(no_repeat_ngram_size=2**31),
         "no_repeat_ngram_size"),
        ("ngram_int32_max", lambda: gen(no_repeat_ngram_size=2**31 - 1),
         "no_repeat_ngram_size"),
        ("ngram_past_context", lambda: gen(no_repeat_ngram_size=65), "no_repeat_ngram_size"),
        ("ngram_huge", lambda: gen(no_repeat_ngram_size=10**30), "no_repeat_ngram_size"),
        ("ngram_numpy_huge", lambda: gen(no_repeat_ngram_size=__import__("numpy").int64(2**40)),
         "no_repeat_ngram_size"),
        ("stream_ngram_overflow", lambda: gen(fn="stream", no_repeat_ngram_size=2**31),
         "no_repeat_ngram_size"),
        ("text_ngram_overflow", lambda: text(no_repeat_ngram_size=2**31),
         "no_repeat_ngram_size"),
        ("returns_int32_overflow", lambda: gen(num_return_sequences=2**31, **sampled),
         "num_return_sequences"),
        ("returns_huge", lambda: gen(num_return_sequences=10**20, **sampled),
         "num_return_sequences"),
        ("returns_numpy_huge",
         lambda: gen(num_return_sequences=__import__("numpy").int64(2**40), **sampled),
         "num_return_sequences"),
        ("stream_returns_overflow",
         lambda: gen(fn="stream", num_return_sequences=2**31, **sampled),
         "num_return_sequences"),
        ("text_returns_overflow", lambda: text(num_return_sequences=2**31, **sampled),
         "num_return_sequences"),
        ("prompt_fills_context", lambda: gen(1, length=64), ("context", "longer context")),
        ("prompt_past_context", lambda: gen(1, length=70), ("context", "longer context")),
        ("stream_prompt_fills_context", lambda: gen(1, length=64, fn="stream"),
         ("context", "longer context")),
    ]:
        hs.api(f"r6rg/{label}", arg, fn)

    cmd = ("generate", "--model", hs.MODEL_FIXTURE, "--tokenizer", hs.TEXT_FIXTURE, "--prompt",
           "Hi")
    for label, flag, argv in [
        ("cli_ngram_int32_overflow", "--no-repeat-ngram-size",
         ("--no-repeat-ngram-size", str(2**31))),
        ("cli_ngram_huge", "--no-repeat-ngram-size", ("--no-repeat-ngram-size", str(10**30))),
        ("cli_ngram_past_context", "--no-repeat-ngram-size",
         ("--no-repeat-ngram-size", str(2**30))),
        ("cli_max_new_past_context", "--max-new-tokens", ("--max-new-tokens", str(2**31))),
    ]:
        hs.cli(f"r6rg/{label}", flag, *cmd, *argv)
