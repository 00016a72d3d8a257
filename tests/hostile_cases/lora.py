"""Hostile cases of the LoRA surface: ``ns.lora`` / ``ns.merge_lora`` arguments,
PEFT adapter folders for ``ns.hf.load_lora`` (bad configs, stray or mis-shaped
tensors, modules the model does not have), ``ns.hf.save_lora`` of models it cannot
write, and ``nnx-shard plan --lora-rank``."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

PEFT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                    "peft_llama")


def build(hs: Any) -> None:
    F = hs.F
    NAN, INF = float("nan"), float("inf")

    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    def lin() -> Any:
        from flax import nnx

        return nnx.Linear(4, 3, rngs=nnx.Rngs(0))

    def lora(*args: Any, **kw: Any) -> Any:
        kw.setdefault("targets", "kernel")
        return ns().lora(lin(), *args, **kw)

    # ns.lora's arguments ---------------------------------------------------------------------
    for label, rank in [("zero", 0), ("negative", -2), ("bool", True), ("float", 2.5),
                        ("none", None), ("str", "4")]:
        hs.api(f"lora/rank_{label}", "rank", lambda r=rank: lora(r, 8.0))
    for label, alpha in [("nan", NAN), ("inf", INF), ("bool", False), ("none", None),
                         ("str", "16"), ("complex", 1j)]:
        hs.api(f"lora/alpha_{label}", "alpha", lambda a=alpha: lora(4, a))
    for label, p in [("one", 1.0), ("nan", NAN), ("str", "0"), ("negative", -0.1)]:
        hs.api(f"lora/dropout_{label}", "dropout", lambda p=p: lora(2, 4.0, dropout=p))
    hs.api("lora/targets_none", "targets", lambda: lora(2, 4.0, targets=None))
    hs.api("lora/targets_bad_regex", "targets", lambda: lora(2, 4.0, targets="(["))
    hs.api("lora/targets_match_nothing", ("targets", "kernel"), lambda: lora(2, 4.0, targets="q$"))
    hs.api("lora/targets_a_bias", ("bias", "projection"), lambda: lora(2, 4.0, targets="bias"))
    hs.api("lora/targets_a_norm", ("scale", "projection"),
           lambda: ns().lora(hs._tiny_llama(), 2, 4.0, targets="norm/scale$"))
    hs.api("lora/rngs_str", "rngs", lambda: lora(2, 4.0, rngs="seed"))
    hs.api("lora/dtype_int", "dtype", lambda: lora(2, 4.0, dtype="int32"))
    hs.api("lora/dtype_unknown", "dtype", lambda: lora(2, 4.0, dtype="float99"))
    hs.api("lora/model_none", "targets", lambda: ns().lora(None, 2, 4.0))

    def twice() -> Any:
        m = lora(2, 4.0)
        return ns().lora(m, 2, 4.0, targets="kernel")

    hs.api("lora/twice", "adapters", twice)
    hs.api("lora/merge_without_adapters", "adapters", lambda: ns().merge_lora(lin()))

    def merge_abstract() -> Any:
        from flax import nnx

        return ns().merge_lora(nnx.eval_shape(lambda: lora(2, 4.0)))

    hs.api("lora/merge_abstract", "abstract", merge_abstract)

    # ns.hf.load_lora: PEFT folders ----------------------------------------------------------------
    def folder(name: str, config: Any = "keep", tensors: dict[str, Any] | None = None) -> str:
        out = F.path(f"peft_{name}")
        if not os.path.isdir(out):
            shutil.copytree(PEFT, out)
            if config != "keep":
                text = config if isinstance(config, str) else json.dumps(config)
                with open(os.path.join(out, "adapter_config.json"), "w") as f:
                    f.write(text)
            if tensors is not None:
                import numpy as np

                from nnx_shard import _safetensors_io as st

                file = os.path.join(out, "adapter_model.safetensors")
                os.remove(file)
                st.create(file, {k: (st.dtype_name(v.dtype), v.shape) for k, v in tensors.items()})
                header = st.read_header(file)
                for k, v in tensors.items():
                    st.write_slice(file, header, k, [slice(None)] * v.ndim,
                                   np.ascontiguousarray(v))
        return out

    def config(**changes: Any) -> dict[str, Any]:
        with open(os.path.join(PEFT, "adapter_config.json")) as f:
            return json.load(f) | changes

    def factors(**extra: Any) -> dict[str, Any]:
        import numpy as np

        pre = "base_model.model.model.layers.0.self_attn.q_proj"
        return {f"{pre}.lora_A.weight": np.zeros((4, 32), np.float32),
                f"{pre}.lora_B.weight": np.zeros((32, 4), np.float32), **extra}

    def load(path: Any, model: Any = None) -> Any:
        return ns().hf.load_lora(path, hs._tiny_llama() if model is None else model)

    hs.api("lora/load_path_none", "path", lambda: load(None))
    hs.api("lora/load_path_missing", "directory", lambda: load(F.path("no_such_adapter")))
    hs.api("lora/load_path_file", "directory", lambda: load(F.file("adapter.txt", "x")))
    hs.api("lora/load_no_config", "adapter_config.json", lambda: load(F.dir("empty_adapter")))
    hs.api("lora/load_config_not_json", "adapter_config.json",
           lambda: load(folder("notjson", "{r: 4")))
    hs.api("lora/load_config_list", "adapter_config.json", lambda: load(folder("list", "[4]")))
    hs.api("lora/load_config_binary", "adapter_config.json",
           lambda: load(folder("binary", "\x00\x01")))
    hs.api("lora/load_r_zero", "r", lambda: load(folder("r0", config(r=0))))
    hs.api("lora/load_r_bool", "r", lambda: load(folder("rbool", config(r=True))))
    hs.api("lora/load_r_string", "r", lambda: load(folder("rstr", config(r="4"))))
    hs.api("lora/load_alpha_nan", "lora_alpha", lambda: load(folder("anan", config(lora_alpha=NAN))))
    hs.api("lora/load_alpha_list", "lora_alpha", lambda: load(folder("alist", config(lora_alpha=[8]))))
    hs.api("lora/load_dora", "use_dora", lambda: load(folder("dora", config(use_dora=True))))
    # bias="all" on a model with no biases loads, as peft loads it: nothing to train there.
    hs.api("lora/load_bias", "bias", lambda: load(folder("bias", config(bias="some"))))
    # modules_to_save and rank_pattern load as peft reads them (a module the model lacks is
    # skipped, as peft's default skips it); a malformed value, or factors of another rank
    # than the pattern gives, are refused.
    hs.api("lora/load_modules_to_save", "modules_to_save",
           lambda: load(folder("mts", config(modules_to_save=5))))
    hs.api("lora/load_rank_pattern", ("lora_A", "rank"),
           lambda: load(folder("rp", config(rank_pattern={"q_proj": 8}))))
    hs.api("lora/load_not_lora", "peft_type", lambda: load(folder("ia3", config(peft_type="IA3"))))
    hs.api("lora/load_r_mismatch", ("lora_A", "rank"), lambda: load(folder("r8", config(r=8))))
    def no_weights() -> Any:
        path = folder("noweights")
        with_weights = os.path.join(path, "adapter_model.safetensors")
        if os.path.exists(with_weights):
            os.remove(with_weights)
        return load(path)

    hs.api("lora/load_no_weights", "adapter_model.safetensors", no_weights)
    hs.api("lora/load_stray_tensor", ("not LoRA factors", "embed"), lambda: load(folder(
        "stray", tensors=factors(**{"model.embed_tokens.weight": __import__("numpy").zeros(
            (2, 2), "float32")}))))
    hs.api("lora/load_half_pair", "lora_B", lambda: load(folder("half", tensors={
        k: v for k, v in factors().items() if "lora_A" in k})))
    hs.api("lora/load_wrong_shape", ("q_proj", "lora_A"), lambda: load(folder("shape", tensors={
        k: (v[:, :16] if "lora_A" in k else v) for k, v in factors().items()})))
    hs.api("lora/load_lm_head", ("lm_head", "projections"), lambda: load(folder("head", tensors={
        "base_model.model.lm_head.lora_A.weight": __import__("numpy").zeros((4, 32), "float32"),
        "base_model.model.lm_head.lora_B.weight": __import__("numpy").zeros((128, 4), "float32"),
    })))
    hs.api("lora/load_layer_out_of_range", ("layers.7", "projections"), lambda: load(folder(
        "layer7", tensors={k.replace("layers.0", "layers.7"): v for k, v in factors().items()})))
    hs.api("lora/load_onto_linear", ("Linear", "mapping"), lambda: load(PEFT, lin()))
    hs.api("lora/load_model_none", ("NoneType", "mapping"), lambda: ns().hf.load_lora(PEFT, None))

    # ns.hf.save_lora ----------------------------------------------------------------------------
    hs.api("lora/save_without_adapters", "adapters",
           lambda: ns().hf.save_lora(F.path("out_none"), hs._tiny_llama()))
    hs.api("lora/save_path_none", "path",
           lambda: ns().hf.save_lora(None, ns().lora(hs._tiny_llama(), 2, 4.0)))
    hs.api("lora/save_path_file", "directory", lambda: ns().hf.save_lora(
        F.file("taken.txt", "x"), ns().lora(hs._tiny_llama(), 2, 4.0)))
    hs.api("lora/save_linear", ("Linear", "mapping"),
           lambda: ns().hf.save_lora(F.path("out_lin"), lora(2, 4.0)))
    # Mixed ranks (rank_pattern / alpha_pattern) and embedding adapters save as peft writes
    # them: tests/hf/test_peft_names.py reads them back through peft's fixtures.

    # nnx-shard plan --lora-rank ----------------------------------------------------------------
    plan = ("plan", "--model", "tiny", "--mesh", "data=8", "--no-compile", "--batch", "8",
            "--seq", "16")
    hs.cli("lora/plan_rank_zero", "--lora-rank", *plan, "--lora-rank", "0")
    hs.cli("lora/plan_rank_negative", "--lora-rank", *plan, "--lora-rank", "-4")
    hs.cli("lora/plan_rank_text", "--lora-rank", *plan, "--lora-rank", "big")
    hs.cli("lora/plan_targets_bad_regex", "targets", *plan, "--lora-rank", "4",
           "--lora-targets", "([")
    hs.cli("lora/plan_targets_nothing", "targets", *plan, "--lora-rank", "4",
           "--lora-targets", "nothing$")
    hs.cli("lora/plan_targets_norm", ("scale", "projection"), *plan, "--lora-rank", "4",
           "--lora-targets", "norm/scale$")
    hs.cli("lora/plan_targets_alone", "--lora-targets", *plan, "--lora-targets", "q$")
    hs.cli("lora/plan_with_generate", "--lora-rank", *plan, "--lora-rank", "4", "--generate")
