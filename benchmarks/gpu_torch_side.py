"""The transformers + peft side of ``benchmarks/gpu.py``: one row, one JSON line.

Run by ``gpu.py --torch-python PATH`` (never imported by the project, which does not
depend on torch) with the row's shapes as ``--spec JSON`` (``gpu.Spec``'s fields):
a randomly initialised ``LlamaForCausalLM`` (``MixtralForCausalLM`` with experts) in
bf16 with ``sdpa`` attention, one training step of ``torch.optim.AdamW`` (``fused``
on CUDA) over what is trained: every parameter (``train: full``), rank-``rank`` PEFT
LoRA adapters (alpha 2 x rank) on q/k/v/o/gate/up/down (``lora``), the same over an
NF4 base of bitsandbytes ``Linear4bit`` layers (``qlora``); ``remat: full`` turns on
gradient checkpointing. ``--compile``: the model under ``torch.compile``.

Prints ``{"status": "ok", "step_ms", "tokens_per_s", "peak_bytes_device", ...}``
(the median of ``--rounds`` rounds of ``--steps`` steps after two warm-up steps; peak:
``torch.cuda.max_memory_allocated()``, CUDA only), or ``{"status": "not run: ..."}``
when a package is missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(spec: dict[str, Any], device: Any) -> Any:
    """The bf16 model of ``spec`` on ``device``, adapters and NF4 base as it asks."""
    import torch
    import transformers

    m = spec["model"]
    common = dict(vocab_size=m["vocab"], hidden_size=m["embed"], intermediate_size=m["mlp"],
                  num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                  num_key_value_heads=m["kv_heads"], head_dim=m["head_dim"],
                  tie_word_embeddings=m["tie"], max_position_embeddings=spec["seq"],
                  attn_implementation="sdpa", use_cache=False)
    if "experts" in m:
        config: Any = transformers.MixtralConfig(**common, num_local_experts=m["experts"],
                                                 num_experts_per_tok=m["top_k"])
        cls: Any = transformers.MixtralForCausalLM
    else:
        config = transformers.LlamaConfig(**common, rope_theta=500000.0)
        cls = transformers.LlamaForCausalLM
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = cls(config)
    torch.set_default_dtype(torch.float32)
    if spec["train"] == "qlora":
        _to_nf4(model, device)
    if spec["remat"] == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if spec["train"] != "full":
            model.enable_input_require_grads()
    if spec["train"] != "full":
        import peft

        lora = peft.LoraConfig(r=spec["rank"], lora_alpha=2 * spec["rank"], lora_dropout=0.0,
                               target_modules=TARGETS, bias="none", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, lora)
    return model


def _to_nf4(model: Any, device: Any) -> None:
    """Replaces the decoder blocks' linear layers by bitsandbytes NF4 ``Linear4bit``
    (block 64, bf16 compute), as ``from_pretrained(quantization_config=...)`` does."""
    import bitsandbytes as bnb
    import torch

    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name in TARGETS:
                old = getattr(parent, name, None)
                if not isinstance(old, torch.nn.Linear):
                    continue
                new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=False,
                                        compute_dtype=torch.bfloat16, quant_type="nf4")
                new.weight = bnb.nn.Params4bit(old.weight.data.to("cpu"), requires_grad=False,
                                               quant_type="nf4", blocksize=64)
                setattr(parent, name, new.to(device))
                del old
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, help="the row's shapes, JSON (gpu.Spec)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--quick", action="store_true", help="one round of one step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    spec = json.loads(args.spec)
    needs = ["torch", "transformers"] + ([] if spec["train"] == "full" else ["peft"])
    needs += ["bitsandbytes"] if spec["train"] == "qlora" else []
    for name in needs:
        try:
            __import__(name)
        except ImportError as e:
            print(json.dumps({"status": f"not run: cannot import {name} ({e})"}))
            return
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    if spec["train"] == "qlora" and not cuda:
        print(json.dumps({"status": "not run: bitsandbytes NF4 needs CUDA"}))
        return
    device = torch.device("cuda" if cuda else "cpu")
    model = build(spec, device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=cuda)
    fwd = torch.compile(model) if args.compile else model
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = torch.randint(0, spec["model"]["vocab"], (spec["batch"], spec["seq"]),
                           device=device, generator=gen)
    labels = torch.roll(inputs, -1, dims=1)

    def step() -> None:
        loss = fwd(input_ids=inputs, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    for _ in range(1 if args.quick else 2):  # warm-up (and torch.compile's compile)
        step()
    sync()
    warm_s = time.perf_counter() - t0
    rounds, steps = (1, 1) if args.quick else (args.rounds, args.steps)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append((time.perf_counter() - t0) / steps)
    ms = statistics.median(times) * 1e3
    print(json.dumps({
        "status": "ok", "step_ms": ms, "tokens_per_s": spec["batch"] * spec["seq"] / (ms / 1e3),
        "peak_bytes_device": torch.cuda.max_memory_allocated() if cuda else None,
        "warmup_s": warm_s, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "trained_params": sum(p.numel() for p in params),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     **({"peft": __import__("peft").__version__}
                        if spec["train"] != "full" else {})}}))


if __name__ == "__main__":
    main()
