"""Hostile checkpoint files on the read path: safetensors headers that do not describe
their bytes, index files that are not indexes or point outside the checkpoint folder,
config.json files transformers would refuse, and ``mapping=`` values of no documented
form. Every file is built under the sweep's folder when its case runs.

Each case passes only on an ``NnxShardError`` whose message holds every word listed
(the file, the tensor or field, and a ``Fix:``); any other exception, or one that
leaves a word out, is reported as raw.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from typing import Any

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192}
_HF = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 4096,
       "rope_scaling": _ROPE}


def _strict(fn: Callable[[], Any], *words: str) -> Callable[[], Any]:
    """``fn`` whose error must be of nnx_shard's family and hold every word."""

    def run() -> Any:
        from nnx_shard._errors import NnxShardError

        try:
            return fn()
        except NnxShardError as e:
            missing = [w for w in (*words, "Fix:") if w.lower() not in str(e).lower()]
            if missing:
                raise AssertionError(f"the message lacks {missing}: {e}") from None
            raise
        except Exception as e:
            raise AssertionError(f"{type(e).__name__} is not an NnxShardError: {e}") from None

    return run


def _entry(dtype: str, shape: Any, begin: Any, end: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def build(hs: Any) -> None:
    F = hs.F

    def raw(name: str, header: Any, size: int, length: int | None = None) -> str:
        text = header if isinstance(header, bytes) else json.dumps(header).encode()
        return F.file(f"{name}.safetensors", struct.pack(
            "<Q", len(text) if length is None else length) + text + bytes(size))

    def load(path: str) -> Any:
        import nnx_shard as ns

        return ns.hf.load_safetensors(path, hs._tiny_llama())

    # safetensors headers: wrong weights if trusted, or a raw error today ------------------
    for label, header, size, tensor in [
        ("negative_offsets", {"x": _entry("F32", [2], -4, 4)}, 8, "x"),
        ("shared_bytes", {"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 0, 8)}, 8,
         "b"),
        ("f16_declared_for_f32", {"x": _entry("F16", [2], 0, 8)}, 8, "x"),
        ("bf16_declared_for_f32", {"x": _entry("BF16", [4], 0, 16)}, 16, "x"),
        ("f64_declared_for_f32", {"x": _entry("F64", [2], 0, 8)}, 8, "x"),
        ("gap", {"a": _entry("F32", [1], 0, 4), "b": _entry("F32", [1], 8, 12)}, 12, "b"),
        ("not_from_zero", {"a": _entry("F32", [1], 4, 8)}, 8, "a"),
        ("trailing_bytes", {"a": _entry("F32", [1], 0, 4)}, 12, "a"),
        ("past_the_end", {"a": _entry("F32", [4], 0, 16)}, 8, "a"),
        ("unknown_dtype", {"a": _entry("F99", [1], 0, 4)}, 4, "a"),
        ("dtype_int", {"a": _entry(5, [1], 0, 4)}, 4, "a"),  # type: ignore[arg-type]
        ("float_shape", {"a": _entry("F32", [2.0], 0, 8)}, 8, "a"),
        ("negative_shape", {"a": _entry("F32", [-1, -2], 0, 8)}, 8, "a"),
        ("bool_shape", {"a": _entry("U8", [True], 0, 1)}, 1, "a"),
        ("shape_string", {"a": _entry("U8", "1", 0, 1)}, 1, "a"),
        ("offsets_float", {"a": _entry("U8", [1], 0.0, 1.0)}, 1, "a"),
        ("offsets_three", {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 1]}}, 1,
         "a"),
        ("entry_list", {"a": [1, 2]}, 0, "a"),
        ("missing_dtype", {"a": {"shape": [1], "data_offsets": [0, 4]}}, 4, "a"),
        ("missing_shape", {"a": {"dtype": "F32", "data_offsets": [0, 4]}}, 4, "a"),
        ("missing_offsets", {"a": {"dtype": "F32", "shape": [1]}}, 4, "a"),
        ("metadata_list", {"__metadata__": [1], "a": _entry("U8", [1], 0, 1)}, 1,
         "__metadata__"),
        ("metadata_int_value", {"__metadata__": {"format": 1}, "a": _entry("U8", [1], 0, 1)},
         1, "format"),
        ("header_list", [1, 2], 0, "list"),
        ("header_number", 5, 0, "int"),
        ("header_null", None, 0, "null"),
    ]:
        hs.api(f"headers/st_{label}", ("safetensors",), _strict(
            lambda label=label, header=header, size=size: load(raw(label, header, size)),
            f"{label}.safetensors", f"'{tensor}'" if tensor not in ("list", "int", "null")
            else tensor))
    for label, header, length, word in [
        ("longer_than_file", b"{}", 1 << 20, "header length"),
        ("not_utf8", b"\xff\xfe{}", None, "UTF-8"),
        ("not_json", b'{"a": 1', None, "not JSON"),
        ("duplicate_name", b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
         b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', None, "twice"),
        ("nan", b'{"a": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, 1]}}', None, "NaN"),
        ("shorter_than_length", b"", 0, "8 of its header length"),
    ]:
        def fn(label: str = label, header: bytes = header, length: int | None = length) -> Any:
            if label == "shorter_than_length":
                return load(F.file(f"{label}.safetensors", b"abc"))
            return load(raw(label, header, 1, length))

        hs.api(f"headers/st_{label}", ("safetensors",), _strict(fn, f"{label}.safetensors",
                                                                 word))

    # a real checkpoint whose final norm points at layer 0's bytes
    def shared_norm() -> Any:
        folder = F.dir("shared_norm")
        shutil.copy(os.path.join(FIXTURES, "hf_llama", "model.safetensors"), folder)
        hs.norm_on_layer0(os.path.join(folder, "model.safetensors"))
        return load(folder)

    hs.api("headers/st_fixture_shared_bytes", ("safetensors",),
           _strict(shared_norm, "model.safetensors", "overlaps"))

    # index files -----------------------------------------------------------------------------
    def index(label: str, content: Any, shard: bool = True) -> Callable[[], Any]:
        def fn() -> Any:
            folder = F.dir(f"index_{label}")
            if shard:  # as a shard: an index beside model.safetensors is never read
                shutil.copy(os.path.join(FIXTURES, "hf_llama", "model.safetensors"),
                            os.path.join(folder, "model-00001-of-00001.safetensors"))
            text = content if isinstance(content, str) else json.dumps(content)
            with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
                f.write(text)
            return load(folder)

        return fn

    def outside(label: str, name: Callable[[str], str]) -> Callable[[], Any]:
        def fn() -> Any:
            elsewhere = F.dir(f"elsewhere_{label}")
            shutil.copy(os.path.join(FIXTURES, "hf_llama", "model.safetensors"), elsewhere)
            shard = name(os.path.join(elsewhere, "model.safetensors"))
            return index(label, {"weight_map": {"model.norm.weight": shard}}, shard=False)()

        return fn

    for label, fn, word in [
        ("not_json", index("not_json", "{not json"), "not JSON"),
        ("list", index("list", "[1, 2]"), "a list"),
        ("null", index("null", "null"), "a null"),
        ("no_weight_map", index("no_weight_map", {"metadata": {}}), "weight_map"),
        ("weight_map_list", index("weight_map_list", {"weight_map": ["model.safetensors"]}),
         "weight_map"),
        ("weight_map_int_value", index("weight_map_int_value",
                                       {"weight_map": {"model.norm.weight": 1}}),
         "model.norm.weight"),
        ("weight_map_empty", index("weight_map_empty", {"weight_map": {}}), "empty"),
        ("missing_file", index("missing_file", {"weight_map": {"a": "model-2.safetensors"}}),
         "model-2.safetensors"),
        ("parent_path", outside("parent_path", lambda p: os.path.join(
            "..", os.path.basename(os.path.dirname(p)), "model.safetensors")),
         "outside the checkpoint folder"),
        ("absolute_path", outside("absolute_path", lambda p: p),
         "outside the checkpoint folder"),
    ]:
        hs.api(f"headers/index_{label}", ("index",),
               _strict(fn, "model.safetensors.index.json", word))

    # config.json -----------------------------------------------------------------------------
    def config(label: str, content: Any) -> Callable[[], Any]:
        def fn() -> Any:
            from nnx_shard.models import DecoderConfig

            folder = F.dir(f"config_{label}")
            text = content if isinstance(content, str | bytes) else json.dumps(content)
            mode = "wb" if isinstance(text, bytes) else "w"
            with open(os.path.join(folder, "config.json"), mode) as f:
                f.write(text)
            return DecoderConfig.from_hf(folder)

        return fn

    for label, content, word in [
        ("not_json", "{not json", "not JSON"),
        ("not_utf8", b"\xff\xfe", "UTF-8"),
        ("list", "[1, 2]", "a list"),
        ("null", "null", "a null"),
        ("nan_size", '{"model_type": "llama", "vocab_size": NaN}', "NaN"),
        ("inf_size", json.dumps({**_HF, "hidden_size": float("inf")}), "Infinity"),
        ("vocab_null", {**_HF, "vocab_size": None}, "vocab_size"),
        ("kv_heads_zero", {**_HF, "num_key_value_heads": 0}, "num_key_value_heads"),
        ("head_dim_zero", {**_HF, "head_dim": 0}, "head_dim"),
        ("float_size", {**_HF, "hidden_size": 32.7}, "hidden_size"),
        ("bool_layers", {**_HF, "num_hidden_layers": True}, "num_hidden_layers"),
        ("kv_not_dividing", {**_HF, "num_key_value_heads": 3}, "kv_heads"),
        ("string_bool", {**_HF, "tie_word_embeddings": "false"}, "tie_word_embeddings"),
        ("string_theta", {**_HF, "rope_theta": "10000"}, "rope_theta"),
        ("negative_eps", {**_HF, "rms_norm_eps": -1e-5}, "rms_norm_eps"),
        ("rope_scaling_string", {**_HF, "rope_scaling": "llama3"}, "rope_scaling"),
        ("rope_factor_zero", {**_HF, "rope_scaling": {**_ROPE, "factor": 0}}, "factor"),
        ("rope_factor_negative", {**_HF, "rope_scaling": {**_ROPE, "factor": -2.0}}, "factor"),
        ("rope_original_zero", {**_HF, "rope_scaling": {
            **_ROPE, "original_max_position_embeddings": 0}},
         "original_max_position_embeddings"),
        ("rope_equal_freq_factors", {**_HF, "rope_scaling": {
            **_ROPE, "low_freq_factor": 4.0}}, "low_freq_factor"),
        ("rope_unknown_type", {**_HF, "rope_scaling": {"rope_type": "ntk", "factor": 2.0}},
         "ntk"),
        ("rope_parameters_string", {**_HF, "rope_scaling": None, "rope_parameters": "yarn"},
         "rope_parameters"),
        ("yarn_without_theta", {**{k: v for k, v in _HF.items() if k != "rope_theta"},
                                "rope_scaling": None,
                                "rope_parameters": {"rope_type": "yarn", "factor": 0.5}},
         "factor"),
        ("partial_rotary", {**_HF, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ]:
        hs.api(f"headers/config_{label}", ("config.json",),
               _strict(config(label, content), f"config_{label}", word))

    # mapping= of load_safetensors and save_safetensors -------------------------------------
    for label, value, word in [
        ("triple", ("token_embed", "copy", "extra"), "tuple of 3"),
        ("single", ("token_embed",), "tuple of 1"),
        ("int", 5, "int"),
        ("path_int", (5, "copy"), "model path"),
        ("transform_int", ("token_embed", 5), "transform"),
        ("transform_list", ("token_embed", ["copy"]), "transform"),
        ("group_not_captured", r"blocks/\3/attn", "group 3"),
    ]:
        for side in ("load", "save"):
            def fn(value: Any = value, side: str = side, label: str = label) -> Any:
                import nnx_shard as ns

                table = {**ns.hf.LLAMA_MAPPING, r"model\.embed_tokens\.weight": value}
                if side == "load":
                    return ns.hf.load_safetensors(os.path.join(FIXTURES, "hf_llama"),
                                               _fixture_llama(), mapping=table)
                return ns.hf.save_safetensors(F.path(f"mapping_{label}"), hs._tiny_llama(),
                                           mapping=table)

            hs.api(f"headers/mapping_{side}_{label}", ("mapping",),
                   _strict(fn, r"model\.embed_tokens\.weight", word))
    hs.api("headers/mapping_pattern_int", ("mapping",), _strict(
        lambda: __import__("nnx_shard").hf.load_safetensors(
            os.path.join(FIXTURES, "hf_llama"), _fixture_llama(), mapping={5: "token_embed"}),
        "pattern 5"))


def _fixture_llama() -> Any:
    """A Llama of the fixture's own config (a mismatched one is refused before the mapping
    is read)."""
    from flax import nnx

    from nnx_shard.models import Decoder, DecoderConfig

    return Decoder(DecoderConfig.from_hf(os.path.join(FIXTURES, "hf_llama")), rngs=nnx.Rngs(0))
