"""Hostile cases of the Llama family's configuration and numerics: rotary settings
whose every field passes alone but whose tables are not finite (or divide by zero),
from the constructor, from ``config.json`` and through ``load_pretrained``; MoE
families without experts and Qwen3-MoE's ``mlp_only_layers`` of the wrong type; the
grouped matmul handed ``sizes`` of another length than ``jax.lax.ragged_dot`` takes;
models run on tokens with no row or no position; and ``load_pretrained`` traced by
``nnx.eval_shape`` (the abstract model, a documented behaviour)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "fixtures")


def build(hs: Any) -> None:
    F = hs.F

    def cfg(**kw: Any) -> Any:
        from nnx_shard.models import DecoderConfig

        return DecoderConfig.for_model(kw.pop("model_type", "llama"), **kw)

    def from_hf(change: dict[str, Any], base: str | None = None) -> Any:
        """``DecoderConfig.from_hf`` of the fixture ``base``'s config.json (default: the
        tiny Llama's own, whose rotary keys are top-level) with ``change``."""
        from nnx_shard.models import DecoderConfig

        if base is None:
            hf = DecoderConfig().to_hf()
        else:
            with open(os.path.join(_FIXTURES, base, "config.json")) as f:
                hf = json.load(f)
        return DecoderConfig.from_hf(hf | change)

    def load(change: dict[str, Any], base: str = "hf_llama") -> Any:
        import nnx_shard as ns

        out = F.path(f"r6models_{base.replace('/', '_')}_"
                     f"{abs(hash(json.dumps(change, sort_keys=True)))}")
        if not os.path.isdir(out):
            shutil.copytree(os.path.join(_FIXTURES, base), out)
            with open(os.path.join(out, "config.json")) as f:
                hf = json.load(f)
            with open(os.path.join(out, "config.json"), "w") as f:
                json.dump(hf | change, f)
        return ns.hf.load_pretrained(out, mesh="data=8", rules=ns.strategies.get("dp").rules)

    def forward(config: Any) -> Any:
        """The logits of a model of ``config``: a config that is accepted must give
        finite ones (NaN logits from an accepted config make the case raw)."""
        import jax.numpy as jnp
        import numpy as np
        from flax import nnx

        import nnx_shard as ns

        c = config()
        logits = ns.models.Decoder(c, rngs=nnx.Rngs(0))(jnp.ones((2, 8), jnp.int32))
        if not np.all(np.isfinite(np.asarray(logits))):
            raise AssertionError(f"accepted rotary config gives non-finite logits: {c}")
        return logits

    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
                "original_max_position_embeddings": 1}
    rope_bad: list[tuple[str, dict[str, Any], Any]] = [
        ("dynamic_factor_1e17", {"rope_scaling": {"rope_type": "dynamic", "factor": 1e17}},
         "factor"),
        ("theta_1e-50", {"rope_theta": 1e-50}, "rope_theta"),
        ("yarn_attention_factor_1e300", {"rope_scaling": yarn | {"attention_factor": 1e300}},
         "attention_factor"),
        ("yarn_attention_factor_1e30", {"rope_scaling": yarn | {"attention_factor": 1e30}},
         "attention_factor"),
        ("yarn_mscale_1e308", {"rope_scaling": yarn | {"mscale": 1e308,
                                                       "mscale_all_dim": 1.0}}, "mscale"),
        ("longrope_original_1", {"rope_scaling": longrope}, "original_max_position_embeddings"),
        ("longrope_short_factor_tiny", {"rope_scaling": longrope | {
            "original_max_position_embeddings": 1024, "short_factor": [1e-45] * 4}},
         "short_factor"),
        ("yarn_theta_1", {"rope_theta": 1.0, "rope_scaling": yarn}, "rope_theta"),
        ("dynamic_head_dim_2", {"head_dim": 2, "rope_scaling": {"rope_type": "dynamic",
                                                               "factor": 2.0}}, "head_dim"),
    ]
    for label, kw, names in rope_bad:
        hs.api(f"r6models/DecoderConfig/{label}", names, lambda kw=kw: forward(lambda: cfg(**kw)))
    hs.api("r6models/DecoderConfig/gemma3_local_theta_1e-50", "rope_local_theta",
           lambda: forward(lambda: cfg(model_type="gemma3_text", sliding_window=4,
                                       rope_local_theta=1e-50)))

    # The same values as config.json spells them (rope_scaling, rope_parameters).
    def hf_rope(kw: dict[str, Any]) -> dict[str, Any]:
        out = {}
        if "rope_scaling" in kw:
            out["rope_scaling"] = kw["rope_scaling"]
        if "rope_theta" in kw:
            out["rope_theta"] = kw["rope_theta"]
        if "head_dim" in kw:
            out["head_dim"] = kw["head_dim"]
        return out

    for label, kw, names in rope_bad:
        hs.api(f"r6models/from_hf/{label}", names, lambda kw=kw: from_hf(hf_rope(kw)))
    hs.api("r6models/from_hf/rope_parameters_dynamic_1e17", "factor", lambda: from_hf(
        {"rope_parameters": {"rope_type": "dynamic", "factor": 1e17, "rope_theta": 10000.0}}))
    hs.api("r6models/from_hf/rope_parameters_theta_1e-50", "rope_theta", lambda: from_hf(
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e-50}}))
    hs.api("r6models/load_pretrained/dynamic_1e17", "factor", lambda: load(
        {"rope_scaling": {"rope_type": "dynamic", "factor": 1e17}}))
    hs.api("r6models/load_pretrained/yarn_attention_factor_1e300", "attention_factor",
           lambda: load({"rope_scaling": yarn | {"attention_factor": 1e300}}))

    # Mixture-of-experts families without experts; Qwen3-MoE's dense layers.
    moe = os.path.join("moe", "qwen3_moe")
    for label, fn, names in [
        ("mixtral_experts_0", lambda: cfg(model_type="mixtral", experts=0), "experts"),
        ("qwen3_moe_experts_0", lambda: cfg(model_type="qwen3_moe", experts=0), "experts"),
        ("mixtral_experts_default", lambda: cfg(model_type="mixtral"), "experts"),
        ("mixtral_experts_negative", lambda: cfg(model_type="mixtral", experts=-4), "experts"),
        ("mixtral_top_k_over_experts", lambda: cfg(model_type="mixtral", experts=2, top_k=4),
         ("experts", "top_k")),
        ("qwen3_moe_top_k_over_experts", lambda: cfg(model_type="qwen3_moe", experts=2,
                                                     top_k=3), ("experts", "top_k")),
        ("qwen3_moe_mlp_only_layers_int", lambda: cfg(model_type="qwen3_moe", experts=4,
                                                      mlp_only_layers=0), "mlp_only_layers"),
        ("from_hf_num_experts_0", lambda: from_hf({"num_experts": 0, "num_local_experts": 0},
                                                  moe), ("num_experts", "num_local_experts")),
        ("from_hf_mlp_only_layers_0", lambda: from_hf({"mlp_only_layers": 0}, moe),
         "mlp_only_layers"),
        ("from_hf_mlp_only_layers_false", lambda: from_hf({"mlp_only_layers": False}, moe),
         "mlp_only_layers"),
        ("from_hf_mlp_only_layers_empty_text", lambda: from_hf({"mlp_only_layers": ""}, moe),
         "mlp_only_layers"),
        ("from_hf_mlp_only_layers_dict", lambda: from_hf({"mlp_only_layers": {}}, moe),
         "mlp_only_layers"),
        ("from_hf_mlp_only_layers_past_layers", lambda: from_hf({"mlp_only_layers": [7]}, moe),
         "mlp_only_layers"),
    ]:
        hs.api(f"r6models/moe/{label}", names, fn)

    # The grouped matmul: what jax.lax.ragged_dot refuses, refused in either kind.
    def grouped(sizes: Any, kind: str = "tiles", x: Any = (6, 2), w: Any = (3, 2, 2)) -> Any:
        import jax
        import jax.numpy as jnp

        from nnx_shard.models._grouped import grouped_matmul

        xs, ws = jnp.ones(x), jnp.ones(w)
        try:  # the case means a shape ragged_dot refuses
            jax.lax.ragged_dot(xs, ws, sizes)
        except (TypeError, ValueError):
            pass
        else:
            raise hs._SweepBroken("ragged_dot accepts these shapes")
        return grouped_matmul(xs, ws, sizes, kind)

    def ints(*shape: int, dtype: str = "int32") -> Any:
        import jax.numpy as jnp

        return jnp.ones(shape, dtype)

    for label, fn, names in [
        ("sizes_4_for_3_groups", lambda: grouped(ints(4)), ("group_sizes", "sizes")),
        ("sizes_2_for_3_groups", lambda: grouped(ints(2)), ("group_sizes", "sizes")),
        ("sizes_2_for_3_groups_ragged", lambda: grouped(ints(2), "ragged_dot"),
         ("group_sizes", "sizes")),
        ("sizes_2d", lambda: grouped(ints(3, 1)), ("group_sizes", "sizes")),
        ("sizes_float", lambda: grouped(ints(3, dtype="float32")),
         ("group_sizes", "sizes")),
        ("k_mismatch", lambda: grouped(ints(3), x=(6, 5)), ("x", "w")),
        ("w_2d", lambda: grouped(ints(3), w=(2, 2)), ("x", "w")),
    ]:
        hs.api(f"r6models/grouped_matmul/{label}", names, fn)

    # Tokens with no row or no position.
    def run(model: Any, shape: tuple[int, int], jit: bool = False) -> Any:
        import jax.numpy as jnp
        from flax import nnx

        tokens = jnp.ones(shape, jnp.int32)
        if jit:
            return nnx.jit(lambda m, t: m(t))(model(), tokens)
        return model()(tokens)

    def zeros(build: Any) -> Any:
        """``build``'s model, concrete with zero weights: the shape check comes before any
        weight is read, and an eager random init compiles one program per shape."""
        from flax import nnx

        return hs.zero_filled(nnx.eval_shape(build))

    def build_llama(**kw: Any) -> Any:
        from flax import nnx

        import nnx_shard as ns

        return lambda: ns.models.Decoder(cfg(**kw), rngs=nnx.Rngs(0))

    def llama(**kw: Any) -> Any:
        return lambda: zeros(build_llama(**kw))

    def transformer(**kw: Any) -> Any:
        from flax import nnx

        import nnx_shard as ns

        return lambda: zeros(lambda: ns.models.Decoder(ns.models.ReferenceConfig(**kw),
                                                       rngs=nnx.Rngs(0)))

    def abstract(build: Any) -> Any:
        from flax import nnx

        return lambda: nnx.eval_shape(build)

    mixtral = {"model_type": "mixtral", "experts": 4}
    for label, fn in [
        ("mixtral_batch_0", lambda: run(llama(**mixtral), (0, 8))),
        ("mixtral_batch_0_jit", lambda: run(llama(**mixtral), (0, 8), jit=True)),
        ("qwen3_moe_batch_0", lambda: run(llama(model_type="qwen3_moe", experts=4), (0, 8))),
        ("mixtral_length_0", lambda: run(llama(**mixtral), (2, 0))),
        ("llama_length_0", lambda: run(llama(), (2, 0))),
        ("llama_length_0_jit", lambda: run(llama(), (2, 0), jit=True)),
        # Abstract: the check comes before any weight is read, and a scanned stack's eager
        # init costs seconds.
        ("llama_scan_length_0", lambda: run(abstract(build_llama(scan_layers=True)), (2, 0))),
        ("llama_batch_0", lambda: run(llama(), (0, 8))),
        ("transformer_length_0", lambda: run(transformer(), (2, 0))),
        ("transformer_moe_batch_0", lambda: run(transformer(experts=4), (0, 8))),
        ("transformer_length_0_jit", lambda: run(transformer(), (2, 0), jit=True)),
    ]:
        hs.api(f"r6models/forward/{label}", ("tokens", "shape"), fn)

    def traced_load() -> Any:
        import jax
        from flax import nnx

        import nnx_shard as ns

        path = os.path.join(_FIXTURES, "hf_qwen3")
        rules = ns.strategies.get("dp").rules
        model = nnx.eval_shape(lambda: ns.hf.load_pretrained(path, mesh="data=8", rules=rules))
        value = model.blocks[0].mlp.up.get_value()
        want = ns.models.DecoderConfig.from_hf(path)
        if not isinstance(value, jax.ShapeDtypeStruct) or value.shape != (want.embed, want.mlp):
            raise AssertionError(f"eval_shape(load_pretrained) gave {value!r}")
        raise hs._Documented("nnx.eval_shape(load_pretrained) gives the abstract model "
                             "(the documented behaviour)")

    hs.api("r6models/load_pretrained/under_eval_shape", "load_pretrained", traced_load)
