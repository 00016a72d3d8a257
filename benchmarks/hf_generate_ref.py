"""transformers' ``generate`` on a random-weight Decoder: the reference side of
``benchmarks/generate.py --only hf``.

Runs with a Python that has torch and transformers (never the project's own:
neither the library nor its tests import them), e.g.::

    /work/hf-venv/bin/python benchmarks/hf_generate_ref.py            # batch 1 and 16
    /work/hf-venv/bin/python benchmarks/hf_generate_ref.py --quick    # a small shape

It builds ``LlamaForCausalLM`` from a fixed seed (shape ``full``: hidden 768,
12 layers, 12 heads, intermediate 2048, vocab 32000, untied embeddings, float32),
writes it with ``save_pretrained`` (to ``--save`` or a temporary folder) and
times greedy ``generate`` (``use_cache=True``, ``min_new_tokens`` =
``max_new_tokens``, under ``torch.inference_mode``, a warm-up call first,
``--threads`` torch threads, default 2, on ``--device``, default the CPU) on a
fixed random prompt, printing one JSON line: tokens/s and the new tokens of each
batch.

The configuration has no ``eos_token_id``, so no token is ever suppressed and
the greedy tokens are the plain argmax, as ``nnx_shard.inference.generate``
computes them without ``eos_token_id``.

``--serve``: after writing the checkpoint it prints a ``ready`` line, then
answers each JSON request line on stdin (``{"prompt": [[ids...], ...]}``, and
optionally ``"new"``: fewer tokens, for a warm-up) with
one line ``{"seconds": ..., "tokens": [[new ids...], ...]}``: one ``generate``
call each, so that the caller can alternate its own rounds with these.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import transformers

SHAPES = {
    "full": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 12, "intermediate_size": 2048, "vocab_size": 32000},
    "quick": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512},
}


def build(shape: str, seed: int) -> transformers.LlamaForCausalLM:
    """The random-weight model, the same for the same ``shape`` and ``seed``."""
    cfg = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=2048,
                                   tie_word_embeddings=False, rms_norm_eps=1e-5,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def run(model: transformers.LlamaForCausalLM, prompt: np.ndarray, new: int) -> tuple[float, list]:
    """One greedy ``generate`` call: its seconds and the new tokens."""
    ids = torch.from_numpy(prompt.astype(np.int64)).to(model.device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, use_cache=True,
                             pad_token_id=0)
        if out.is_cuda:  # kernels run asynchronously: wait for the last one
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    return seconds, out[:, prompt.shape[1]:].tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--save", help="checkpoint folder to write (default: a temporary one)")
    ap.add_argument("--quick", action="store_true", help="the small shape, 32 new tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", type=int, default=32, help="prompt length")
    ap.add_argument("--new", type=int, default=None, help="new tokens (default 256, quick 32)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", action="store_true", help="answer requests on stdin")
    ap.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    ap.add_argument("--device", default="cpu", help="torch device of the model (cpu, cuda)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = "quick" if args.quick else "full"
    new = args.new or (32 if args.quick else 256)
    model = build(shape, args.seed)
    folder = args.save or tempfile.mkdtemp(prefix="hf_llama_")
    model.save_pretrained(folder)
    model.to(args.device)
    meta = {"device": args.device, "shape": shape, "config": SHAPES[shape],
            "tied_embeddings": False,
            "parameters": sum(p.numel() for p in model.parameters()), "checkpoint": folder,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "new": new}
    if args.serve:
        print(json.dumps({"ready": True, **meta}), flush=True)
        for line in sys.stdin:
            request = json.loads(line)
            prompt = np.asarray(request["prompt"], np.int64)
            seconds, tokens = run(model, prompt, request.get("new", new))
            print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)
        return 0
    rows = []
    vocab = SHAPES[shape]["vocab_size"]
    for batch in map(int, args.batches.split(",")):
        prompt = np.random.default_rng(args.seed).integers(0, vocab, (batch, args.prompt))
        run(model, prompt, new)  # warm-up
        times, tokens = [], []
        for _ in range(args.rounds):
            seconds, tokens = run(model, prompt, new)
            times.append(seconds)
        rows.append({"batch": batch, "prompt": args.prompt, "new": new,
                     "tokens_per_s": batch * new / statistics.median(times),
                     "seconds": times, "tokens": tokens})
    print(json.dumps({**meta, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
