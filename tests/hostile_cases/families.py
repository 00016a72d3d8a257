"""Hostile cases of ``nnx_shard.hf.load_pretrained`` and of the config check of
``load_safetensors``: paths that are not checkpoint folders, config files that are
not configs or name another family, windows in some layers only, and a checkpoint
of one family loaded into a model of another."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "fixtures")


def build(hs: Any) -> None:
    F = hs.F

    def load(path: Any, **kw: Any) -> Any:
        import nnx_shard as ns
        from nnx_shard.hf import load_pretrained

        args = {"mesh": "data=8", "rules": ns.strategies.get("dp").rules} | kw
        return load_pretrained(path, **args)

    def copy(name: str, change: dict[str, Any] | None = None, raw: str | None = None) -> str:
        out = F.path(f"families_{name}_{abs(hash(json.dumps(change, sort_keys=True)))}_"
                     f"{abs(hash(raw))}")
        if not os.path.isdir(out):
            shutil.copytree(os.path.join(_FIXTURES, name), out)
        config = os.path.join(out, "config.json")
        if raw is not None:
            with open(config, "w") as f:
                f.write(raw)
        elif change is not None:
            with open(config) as f:
                hf = json.load(f)
            with open(config, "w") as f:
                json.dump(hf | change, f)
        return out

    def into_llama(name: str, change: dict[str, Any] | None = None) -> Any:
        from flax import nnx

        import nnx_shard as ns
        from nnx_shard.models import Decoder, DecoderConfig

        # The fixture's sizes as a plain Decoder: only the shared fields kept.
        cfg = DecoderConfig.from_hf(os.path.join(_FIXTURES, name)).with_family(
            "llama", activation="silu")
        target = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), "data=8",
                                  ns.strategies.get("dp").rules)
        return ns.hf.load_safetensors(copy(name, change), target)

    for label, fn, names in [
        ("path_none", lambda: load(None), "path"),
        ("path_bytes", lambda: load(b"tests/fixtures/hf_qwen2"), "path"),
        ("path_empty", lambda: load(""), "path"),
        ("path_missing", lambda: load(F.path("families_nowhere")), "not a directory"),
        ("path_a_file", lambda: load(os.path.join(_FIXTURES, "hf_qwen2", "config.json")),
         "not a directory"),
        ("no_config", lambda: load(F.dir("families_empty")), "config.json"),
        ("config_not_json", lambda: load(copy("hf_mistral", raw="{nope")), "not JSON"),
        ("config_a_list", lambda: load(copy("hf_mistral", raw="[1, 2]")), "config.json"),
        ("model_type_gpt2", lambda: load(copy("hf_mistral", {"model_type": "gpt2"})),
         ("model_type", "gpt2")),
        ("gemma_bidirectional", lambda: load(copy("hf_gemma", {
            "use_bidirectional_attention": True})), "use_bidirectional_attention"),
        ("gemma_act_erf", lambda: load(copy("hf_gemma", {"hidden_act": "gelu_new"})),
         "hidden_act"),
        ("model_type_missing", lambda: load(copy("hf_mistral", {"model_type": None})),
         "model_type"),
        ("window_zero", lambda: load(copy("hf_mistral", {"sliding_window": 0})),
         "sliding_window"),
        ("window_float", lambda: load(copy("hf_mistral", {"sliding_window": 4.5})),
         "sliding_window"),
        ("window_some_layers", lambda: load(copy("hf_qwen2", {
            "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
            "layer_types": None})), ("sliding-window", "some layers")),
        ("layer_types_unknown", lambda: load(copy("hf_qwen2", {"layer_types": ["chunked"] * 2})),
         "layer_types"),
        ("dtype_text", lambda: load(os.path.join(_FIXTURES, "hf_qwen2"), dtype="float99"),
         "dtype"),
        ("mesh_bad", lambda: load(os.path.join(_FIXTURES, "hf_qwen2"), mesh="data=3"),
         "data"),
        ("mistral_into_llama", lambda: into_llama("hf_mistral"),
         ("model_type", "sliding_window")),
        ("qwen2_into_llama", lambda: into_llama("hf_qwen2"), ("model_type", "q/k/v biases")),
        ("gemma_into_llama", lambda: into_llama("hf_gemma"), ("model_type", "hidden_act")),
        ("olmo2_into_llama", lambda: into_llama("hf_olmo2"), ("model_type", "norms after")),
    ]:
        hs.api(f"families/{label}", names, fn)
