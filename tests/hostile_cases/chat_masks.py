"""Hostile cases of multi-turn fine-tuning data: ``apply_chat_template``'s
``return_dict`` / ``return_assistant_tokens_mask`` and templates with
``{% generation %}`` blocks, and ``ns.pack`` given examples with their own
per-token masks (dicts ``{"input_ids", "assistant_masks"}`` or ``(ids, mask)``
tuples). Every bad mask is refused naming the example's index.

A template without a generation block is not a case: as transformers, it gives a
mask of zeros and a warning."""

from __future__ import annotations

import os
import shutil
from typing import Any

_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "fixtures")
_TEXT = os.path.join(_FIXTURES, "hf_llama_text")
_LLAMA3 = os.path.join(_FIXTURES, "chat_masks", "llama3.jinja")


def build(hs: Any) -> None:
    F = hs.F

    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    def tok(label: str = "llama3", template: str | None = None) -> Any:
        from nnx_shard.inference import Tokenizer

        out = F.path(f"chat_masks_{label}")
        if not os.path.isdir(out):
            shutil.copytree(_TEXT, out)
            if template is None:
                shutil.copy(_LLAMA3, os.path.join(out, "chat_template.jinja"))
            else:
                with open(os.path.join(out, "chat_template.jinja"), "w") as f:
                    f.write(template)
        return Tokenizer.from_pretrained(out)

    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]

    def masks(label: str = "llama3", template: str | None = None, messages: Any = None,
              **kw: Any) -> Any:
        return tok(label, template).apply_chat_template(
            chat if messages is None else messages, add_generation_prompt=False, **{
                "return_dict": True, "return_assistant_tokens_mask": True, **kw})

    for label, fn, names in [
        ("mask_without_return_dict", lambda: masks(return_dict=False), "return_dict"),
        ("mask_with_tokenize_false", lambda: masks(tokenize=False), "tokenize"),
        ("mask_str", lambda: masks(return_assistant_tokens_mask="yes"),
         "return_assistant_tokens_mask"),
        ("mask_none", lambda: masks(return_assistant_tokens_mask=None),
         "return_assistant_tokens_mask"),
        ("return_dict_int", lambda: masks(return_dict=2), "return_dict"),
        ("return_dict_list", lambda: tok().apply_chat_template(chat, return_dict=[True]),
         "return_dict"),
        ("messages_surrogates", lambda: masks(messages=[
            {"role": "user", "content": "caf\udce9"}]), ("apply_chat_template", "text")),
        ("generation_unclosed", lambda: masks(
            "unclosed", "{% for m in messages %}{% generation %}{{ m.content }}{% endfor %}"),
         "chat template"),
        ("generation_with_args", lambda: masks(
            "args", "{% generation 3 %}{{ messages }}{% endgeneration %}"), "chat template"),
        ("generation_runaway_loops", lambda: masks(
            "runaway", "{% for i in range(100000) %}{% for j in range(100000) %}"
                       "{% generation %}x{% endgeneration %}{% endfor %}{% endfor %}"),
         "chat template"),
        ("generation_many_blocks", lambda: masks(
            "many", "{% for i in range(1000) %}{% for j in range(1000) %}{% generation %}"
                    "{% endgeneration %}{% generation %}{% endgeneration %}{% endfor %}"
                    "{% endfor %}"), "chat template"),
        ("generation_block_bomb", lambda: masks(
            "bomb", "{% generation %}{{ 'a' * 10**10 }}{% endgeneration %}"), "chat template"),
        ("generation_macro_recursion", lambda: masks(
            "recursion", "{% macro f(n) %}{% generation %}{{ f(n + 1) }}{% endgeneration %}"
                         "{% endmacro %}{{ f(0) }}"), "chat template"),
        ("generation_raises", lambda: masks(
            "raises", "{% generation %}{{ raise_exception('no assistant here') }}"
                      "{% endgeneration %}"), "chat template"),
    ]:
        hs.api(f"chat_masks/{label}", names, fn)

    def pack(examples: Any, length: int = 8, **kw: Any) -> Any:
        return ns().pack(examples, length, **kw)

    for label, fn, names in [
        ("pack_mask_short", lambda: pack([[1], ([1, 2, 3], [0, 1])]), "example 1"),
        ("pack_mask_long", lambda: pack([{"input_ids": [1, 2], "assistant_masks": [0, 1, 1]}]),
         "example 0"),
        ("pack_mask_empty", lambda: pack([([1, 2], [])]), "example 0"),
        ("pack_mask_two", lambda: pack([([1, 2, 3], [0, 2, 1])]), "example 0"),
        ("pack_mask_negative", lambda: pack([([1, 2], [0, -1])]), "example 0"),
        ("pack_mask_labels", lambda: pack([{"input_ids": [1, 2],
                                            "assistant_masks": [-100, 2]}]), "example 0"),
        ("pack_mask_huge", lambda: pack([([1, 2], [0, 2**70])]), "example 0"),
        ("pack_mask_uint8_255", lambda: pack([([1, 2], bytearray([0, 255]))]), "example 0"),
        ("pack_mask_float", lambda: pack([([1, 2], [0.0, 1.0])]), "example 0"),
        ("pack_mask_nan", lambda: pack([([1, 2], [0, float("nan")])]), "example 0"),
        ("pack_mask_str", lambda: pack([([1, 2], "01")]), "example 0"),
        ("pack_mask_scalar", lambda: pack([([1, 2], 1)]), "example 0"),
        ("pack_mask_nested", lambda: pack([([1, 2], [[0, 1]])]), "example 0"),
        ("pack_mask_dict", lambda: pack([([1, 2], {"a": 1})]), "example 0"),
        ("pack_mask_and_prompt_lengths", lambda: pack(
            [[1, 2], ([1, 2], [0, 1])], prompt_lengths=[0, 1]), ("example 1", "prompt_lengths")),
        ("pack_dict_unknown_key", lambda: pack([{"input_ids": [1, 2], "mask": [0, 1]}]),
         "example 0"),
        ("pack_dict_labels", lambda: pack([{"input_ids": [1, 2], "labels": [-100, 2]}]),
         "example 0"),
        ("pack_dict_no_ids", lambda: pack([[1], {"assistant_masks": [0, 1]}]), "example 1"),
        ("pack_dict_ids_str", lambda: pack([{"input_ids": "hello"}]), "example 0"),
        ("pack_dict_ids_negative", lambda: pack([{"input_ids": [1, -5],
                                                  "assistant_masks": [0, 1]}]), "example 0"),
        ("pack_dict_ids_too_long", lambda: pack([{"input_ids": [1] * 9,
                                                  "assistant_masks": [1] * 9}]), "example 0"),
        ("pack_dict_attention_zero", lambda: pack([{"input_ids": [1, 2, 0],
                                                    "attention_mask": [1, 1, 0]}]),
         "example 0"),
        ("pack_dict_attention_short", lambda: pack([{"input_ids": [1, 2],
                                                     "attention_mask": [1]}]), "example 0"),
        ("pack_dict_attention_str", lambda: pack([{"input_ids": [1, 2],
                                                   "attention_mask": "11"}]), "example 0"),
        ("pack_dict_key_int", lambda: pack([{"input_ids": [1, 2], 3: [0, 1]}]), "example 0"),
        ("pack_examples_one_dict", lambda: pack({"input_ids": [1, 2],
                                                 "assistant_masks": [0, 1]}), "examples"),
        ("pack_list_pair", lambda: pack([[[1, 2], [0, 1]]]), "example 0"),
        ("pack_pair_ids_empty", lambda: pack([([], [])]), "example 0"),
        ("pack_chat_too_long", lambda: pack([masks()], 4), "example 0"),
        ("pack_ragged_ids", lambda: pack([[1], [[1, 2], [3]]]), "example 1"),
        ("pack_ragged_mask", lambda: pack([([1, 2], [[0], [1, 1]])]), "example 0"),
        ("pack_dict_ragged_ids", lambda: pack([{"input_ids": [[1], [2, 3]]}]), "example 0"),
        ("pack_dict_ragged_attention", lambda: pack([{"input_ids": [1, 2],
                                                      "attention_mask": [[1], [1, 1]]}]),
         "example 0"),
    ]:
        hs.api(f"chat_masks/{label}", names, fn)
