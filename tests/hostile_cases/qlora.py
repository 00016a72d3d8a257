"""Hostile cases of QLoRA: ``ns.lora(..., quantize=)`` values, quantizing what is not a
projection kernel, qwix missing, merging an abstract quantized model, and
``nnx-shard plan --quantize-base``."""

from __future__ import annotations

import sys
from typing import Any


def build(hs: Any) -> None:
    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    def lin() -> Any:
        from flax import nnx

        return nnx.Linear(64, 3, rngs=nnx.Rngs(0))  # 64 inputs: one block of scales

    def qlora(quantize: Any, targets: str = "kernel", model: Any = None) -> Any:
        return ns().lora(lin() if model is None else model, 2, 4.0, targets=targets,
                         quantize=quantize)

    for label, q in [("int3", "int3"), ("bits_8", 8), ("bool", True), ("upper", "INT8"),
                     ("fp4", "fp4"), ("dtype", "int8 "), ("list", ["int8"])]:
        hs.api(f"qlora/quantize_{label}", "quantize", lambda q=q: qlora(q))
    hs.api("qlora/quantize_a_bias", ("bias", "projection"), lambda: qlora("int8", "bias"))

    def indivisible() -> Any:
        from flax import nnx

        return ns().lora(nnx.Linear(48, 3, rngs=nnx.Rngs(0)), 2, 4.0, targets="kernel",
                         quantize="nf4")

    hs.api("qlora/quant_block_indivisible", ("quant_block", "(48, 3)"), indivisible)
    hs.api("qlora/quant_block_zero", "quant_block",
           lambda: ns().lora(lin(), 2, 4.0, targets="kernel", quantize="nf4", quant_block=0))
    hs.api("qlora/quantize_a_norm", ("scale", "projection"),
           lambda: qlora("int4", "norm/scale$", hs._tiny_llama()))
    hs.api("qlora/quantize_nothing", "targets", lambda: qlora("int8", "q$"))

    def twice() -> Any:
        return qlora("int4", model=qlora("int8"))

    hs.api("qlora/quantize_twice", "adapters", twice)

    def no_qwix() -> Any:
        saved = sys.modules.get("qwix")
        sys.modules["qwix"] = None  # type: ignore[assignment]  # import qwix now fails
        try:
            return qlora("int8")
        finally:
            if saved is None:
                sys.modules.pop("qwix", None)
            else:
                sys.modules["qwix"] = saved

    hs.api("qlora/without_qwix", ("qwix", "qlora"), no_qwix)

    def merge_abstract() -> Any:
        from flax import nnx

        return ns().merge_lora(nnx.eval_shape(lambda: qlora("int8")))

    hs.api("qlora/merge_abstract", "abstract", merge_abstract)

    plan = ("plan", "--model", "tiny", "--mesh", "data=8", "--no-compile", "--batch", "8",
            "--seq", "16")
    hs.cli("qlora/plan_quantize_int3", "--quantize-base", *plan, "--lora-rank", "4",
           "--quantize-base", "int3")
    hs.cli("qlora/plan_quantize_empty", "--quantize-base", *plan, "--lora-rank", "4",
           "--quantize-base", "")
    hs.cli("qlora/plan_quantize_alone", "--quantize-base", *plan, "--quantize-base", "int8")
    hs.cli("qlora/plan_quant_block_zero", "--quant-block", *plan, "--lora-rank", "4",
           "--quantize-base", "nf4", "--quant-block", "0")
    hs.cli("qlora/plan_double_quant_alone", "--double-quant", *plan, "--lora-rank", "4",
           "--double-quant")
