"""Hostile cases of the Gemma 2, Gemma 3 and Phi-3 options: soft-caps, query scales
and window layers that are no such values (in ``config.json`` and in
``DecoderConfig``), Phi-3 options the model does not implement, a fused tensor of
other rows, cuDNN asked to soft-cap, and a Gemma 2 checkpoint loaded into a model
without its options."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "fixtures")


def build(hs: Any) -> None:
    F = hs.F

    def load(path: Any) -> Any:
        import nnx_shard as ns
        from nnx_shard.hf import load_pretrained

        return load_pretrained(path, mesh="data=8", rules=ns.strategies.get("dp").rules)

    def copy(name: str, change: dict[str, Any]) -> str:
        out = F.path(f"families2_{name}_{abs(hash(json.dumps(change, sort_keys=True)))}")
        if not os.path.isdir(out):
            shutil.copytree(os.path.join(_FIXTURES, name), out)
        config = os.path.join(out, "config.json")
        with open(config) as f:
            hf = json.load(f)
        with open(config, "w") as f:
            json.dump(hf | change, f)
        return out

    def cfg(**kw: Any) -> Any:
        from nnx_shard.models import DecoderConfig

        # the family with these fields
        return DecoderConfig.for_model(kw.pop("model_type", "gemma2"), **kw)

    def into(name: str, **change: Any) -> Any:
        import dataclasses

        from flax import nnx

        import nnx_shard as ns
        from nnx_shard.models import Decoder, DecoderConfig

        c = dataclasses.replace(DecoderConfig.from_hf(os.path.join(_FIXTURES, name)), **change)
        target = ns.abstract_init(lambda: Decoder(c, rngs=nnx.Rngs(0)), "data=8",
                                  ns.strategies.get("dp").rules)
        return ns.hf.load_safetensors(os.path.join(_FIXTURES, name), target)

    def cudnn_softcap() -> Any:
        import jax.numpy as jnp

        from nnx_shard._attention import attention

        q = jnp.ones((1, 8, 2, 8))
        return attention(q, q, q, softcap=5.0, implementation="cudnn")

    def bare_phi3_other_rows() -> Any:
        import dataclasses

        from flax import nnx

        import nnx_shard as ns
        from nnx_shard.models import Decoder, DecoderConfig

        out = F.dir("families2_phi3_bare")
        shutil.copy(os.path.join(_FIXTURES, "hf_phi3", "model.safetensors"), out)
        c = dataclasses.replace(DecoderConfig.from_hf(os.path.join(_FIXTURES, "hf_phi3")),
                                mlp=48)
        target = ns.abstract_init(lambda: Decoder(c, rngs=nnx.Rngs(0)), "data=8",
                                  ns.strategies.get("dp").rules)
        return ns.hf.load_safetensors(out, target)

    softcap = "attn_logit_softcapping"
    for label, fn, names in [
        ("softcap_zero", lambda: load(copy("hf_gemma2", {softcap: 0})), softcap),
        ("softcap_negative", lambda: load(copy("hf_gemma2", {softcap: -50.0})), softcap),
        ("softcap_text", lambda: load(copy("hf_gemma2", {softcap: "50"})), softcap),
        ("softcap_bool", lambda: load(copy("hf_gemma2", {softcap: True})), softcap),
        ("softcap_huge", lambda: load(copy("hf_gemma2", {softcap: 10 ** 400})), softcap),
        ("final_softcap_zero", lambda: load(copy("hf_gemma2", {
            "final_logit_softcapping": 0.0})), "final_logit_softcapping"),
        ("final_softcap_list", lambda: load(copy("hf_gemma2", {
            "final_logit_softcapping": [30]})), "final_logit_softcapping"),
        ("query_scale_zero", lambda: load(copy("hf_gemma2", {"query_pre_attn_scalar": 0})),
         "query_pre_attn_scalar"),
        ("query_scale_text", lambda: load(copy("hf_gemma2", {"query_pre_attn_scalar": "256"})),
         "query_pre_attn_scalar"),
        ("layer_types_short", lambda: load(copy("hf_gemma2", {
            "layer_types": ["sliding_attention"]})), "layer_types"),
        ("layer_types_unknown", lambda: load(copy("hf_gemma3_text", {
            "layer_types": ["chunked_attention"] * 4})), "layer_types"),
        ("pattern_zero", lambda: load(copy("hf_gemma3_text", {
            "layer_types": None, "sliding_window_pattern": 0})), "sliding_window_pattern"),
        ("local_rope_linear", lambda: load(copy("hf_gemma3_text", {"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 8.0}}})),
         ("sliding_attention", "linear")),
        ("local_theta_negative", lambda: load(copy("hf_gemma3_text", {"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": -1}}})),
         "rope_theta"),
        ("config_softcap_zero", lambda: cfg(attn_softcap=0), "attn_softcap"),
        ("config_softcap_nan", lambda: cfg(final_softcap=float("nan")), "final_softcap"),
        ("config_softcap_text", lambda: cfg(attn_softcap="50"), "attn_softcap"),
        ("config_softcap_bool", lambda: cfg(attn_softcap=True), "attn_softcap"),
        ("config_query_scale_negative", lambda: cfg(query_scale=-1.0), "query_scale"),
        ("config_window_layers_length", lambda: cfg(sliding_window=4, window_layers=(True,)),
         "window_layers"),
        ("config_window_layers_ints", lambda: cfg(sliding_window=4, window_layers=(1, 0)),
         "window_layers"),
        ("config_window_layers_no_window", lambda: cfg(window_layers=(True, False)),
         ("window_layers", "sliding_window")),
        ("cudnn_softcap", cudnn_softcap, ("cudnn", "soft-cap")),
        ("phi3_partial_rotary", lambda: load(copy("hf_phi3", {"rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}})),
         "partial_rotary_factor"),
        ("phi3_longrope_short_lists", lambda: load(copy("hf_phi3", {"rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 3,
            "long_factor": [1.0] * 3}})), ("short_factor", "longrope")),
        ("phi3_fused_rows", bare_phi3_other_rows, ("gate_up_proj", "fused")),
        ("gemma2_without_softcaps", lambda: into("hf_gemma2", attn_softcap=None,
                                                 final_softcap=None),
         ("attn_logit_softcapping", "final_logit_softcapping")),
        ("gemma3_without_local_theta", lambda: into("hf_gemma3_text", rope_local_theta=None),
         "rope_local_base_freq"),
    ]:
        hs.api(f"families2/{label}", names, fn)
