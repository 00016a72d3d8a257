"""Memory of generation's prefill against the prompt length, from XLA's own count.

:func:`nnx_shard.inference.generate` runs the whole prompt through the model in one
compiled program (the prefill) that also creates the key/value cache. This script
compiles that program (``jax.jit(...).lower(abstract args).compile()``, nothing
allocated: the model is ``nnx.eval_shape``'d) for prompts of 2k to 32k tokens and
reads ``memory_analysis()``: the temporary bytes XLA plans for the program (the
prefill's working memory: activations, attention scores, logits), the argument bytes
(the parameters, prompt and mask) and the output bytes (the cache and the decode
loop's carry).

Two attention kernels, the model's ``DecoderConfig(attention=...)``:

* ``dense`` (before): the prompt's queries against the whole cache in one masked
  softmax, float32 scores ``[heads, prompt, prompt + new]``: quadratic;
* ``auto`` (after): the kernel training runs, blockwise here (a few ``[512, 512]``
  tiles of scores at a time; cuDNN's fused kernel does not take queries placed
  after a cache index): linear.

The model: a one-layer Llama with realistic attention heads (32 query heads, 8
key/value heads of 64, embed 512, mlp 1024, vocab 2048, float32, context 65536),
batch 1, 16 new tokens. ``bytes/token`` is the temporary bytes over the prompt
length; ``slope`` the temporary bytes each token added since the previous length
(flat when memory is linear).

A second table, the logits: the same model with Llama 3's vocabulary (128256) and
the ``auto`` kernel, its prefill as it runs (``last``: the final norm and the
unembedding on the last position only, ``decode(..., logits_to_keep=1)``) against
a model whose ``decode`` returns every position's logits (``all``, before: float32
``[prompt, vocab]``, ~513 KB a token, of which generation reads the last).

Run (about 4 minutes on 2 CPU cores; ``--quick``: prompts of 512 and 1024)::

    .venv/bin/python benchmarks/prefill_memory.py
    .venv/bin/python benchmarks/prefill_memory.py --lengths 2048 8192 --kernels auto
    .venv/bin/python benchmarks/prefill_memory.py --tables logits
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from _common import machine, print_table, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "prefill_memory.json"
LENGTHS = (2048, 4096, 8192, 16384, 32768)
KERNELS = ("dense", "auto")
NEW = 16
MODEL = dict(layers=1, embed=512, heads=32, kv_heads=8, head_dim=64, mlp=1024, vocab=2048,
             max_length=65536)
LARGE_VOCAB = 128256   # Llama 3's
LOGITS = ("last", "all")
TABLES = ("kernels", "logits")


def compiled_prefill(prompt_len: int, kernel: str, new: int = NEW, all_logits: bool = False,
                     **overrides: object):
    """generate's prefill program compiled for a batch of one prompt of ``prompt_len``
    tokens and ``new`` new ones, on an abstract Llama of :data:`MODEL` (``overrides``
    replace fields) whose attention kernel is ``kernel``; ``all_logits``: its decode
    returns every position's logits (it takes no ``logits_to_keep``)."""
    import numpy as np
    from flax import nnx

    from nnx_shard.inference import _generation as gen
    from nnx_shard.models import Decoder, get_config

    class AllLogits(Decoder):
        def decode(self, tokens, *, attention_mask=None):  # type: ignore[no-untyped-def, override]
            return super().decode(tokens, attention_mask=attention_mask)

    cfg = dataclasses.replace(get_config("llama-tiny"), **(MODEL | overrides),  # type: ignore[arg-type]
                              attention=kernel)
    cls = AllLogits if all_logits else Decoder
    model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
    run = gen._prepare(model, np.zeros((1, prompt_len), np.int32), new, gen.Options(), 0,
                       None, None, "prefill_memory")
    args = (run.old, run.rest, run.prompt, run.mask, run.real, run.key, run.options)
    return run.programs.prefill.lower(*args).compile()


def measure(prompt_len: int, kernel: str, logits: str = "last", vocab: int = MODEL["vocab"]
            ) -> dict:
    t0 = time.perf_counter()
    mem = compiled_prefill(prompt_len, kernel, all_logits=logits == "all",
                           vocab=vocab).memory_analysis()
    return {"prompt": prompt_len, "kernel": kernel, "logits": logits, "vocab": vocab,
            "temp_bytes": mem.temp_size_in_bytes,
            "argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes,
            "temp_bytes_per_token": mem.temp_size_in_bytes / prompt_len,
            "compile_s": round(time.perf_counter() - t0, 1)}


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help=f"prompt lengths (default {' '.join(map(str, LENGTHS))})")
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS),
                    help="attention kernels to compile (dense: before, auto: after)")
    ap.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES),
                    help="kernels: dense against auto at vocab 2048; logits: the last "
                    f"position's logits against all of them at vocab {LARGE_VOCAB}")
    ap.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="prompts of 512 and 1024 (smoke test)")
    args = ap.parse_args()
    lengths = args.lengths or ((512, 1024) if args.quick else LENGTHS)

    import jax

    rows: list[dict] = []
    if "kernels" in args.tables:
        rows += _kernels_table(args.kernels, lengths)
    if "logits" in args.tables:
        rows += _logits_table(lengths)
    write_json(args.json, {
        "meta": {"jax": jax.__version__, "backend": jax.default_backend(),
                 "machine": machine(), "model": MODEL, "large_vocab": LARGE_VOCAB, "batch": 1,
                 "new_tokens": NEW,
                 "measure": "jax.jit(prefill).lower(abstract args).compile().memory_analysis()"},
        "rows": rows})


def _slope(rows: list[dict], i: int) -> str:
    if not i:
        return ""
    r, prev = rows[i], rows[i - 1]
    return f"{(r['temp_bytes'] - prev['temp_bytes']) / (r['prompt'] - prev['prompt']):,.0f}"


def _logits_table(lengths: list[int]) -> list[dict]:
    rows = []
    for logits in LOGITS:
        for n in lengths:
            rows.append(measure(n, "auto", logits, LARGE_VOCAB))
            r = rows[-1]
            print(f"{logits:>5} {n:>6}: temp {_mb(r['temp_bytes'])} ({r['compile_s']} s)",
                  flush=True)
    by = {(r["logits"], r["prompt"]): r for r in rows}
    table = []
    for i, n in enumerate(lengths):
        last = [by["last", m] for m in lengths]
        every = [by["all", m] for m in lengths]
        table.append([n, _mb(last[i]["temp_bytes"]), f"{last[i]['temp_bytes_per_token']:,.0f}",
                      _slope(last, i), _mb(every[i]["temp_bytes"]), _slope(every, i),
                      _mb(4 * n * LARGE_VOCAB)])
    print(f"\ngenerate's prefill at vocab {LARGE_VOCAB}, XLA memory_analysis ({machine()}); "
          f"one-layer Decoder, auto kernel, batch 1, {NEW} new tokens")
    print_table(["prompt", "temp last", "bytes/token last", "slope last", "temp all",
                 "slope all", "[prompt, vocab] f32"], table)
    return rows


def _kernels_table(kernels: list[str], lengths: list[int]) -> list[dict]:
    rows = []
    for kernel in kernels:
        for n in lengths:
            rows.append(measure(n, kernel))
            r = rows[-1]
            print(f"{kernel:>5} {n:>6}: temp {_mb(r['temp_bytes'])}, args "
                  f"{_mb(r['argument_bytes'])}, outputs {_mb(r['output_bytes'])} "
                  f"({r['compile_s']} s)", flush=True)
    by = {(r["kernel"], r["prompt"]): r for r in rows}
    columns = ["prompt"]
    for kernel in kernels:
        columns += [f"temp {kernel}", f"bytes/token {kernel}", f"slope {kernel}"]
    columns += ["arguments", "outputs"]
    table = []
    for i, n in enumerate(lengths):
        line: list = [n]
        for kernel in kernels:
            r = by[kernel, n]
            slope = ""
            if i:
                prev = by[kernel, lengths[i - 1]]
                added = (r["temp_bytes"] - prev["temp_bytes"]) / (n - prev["prompt"])
                slope = f"{added:,.0f}"
            line += [_mb(r["temp_bytes"]), f"{r['temp_bytes_per_token']:,.0f}", slope]
        last = by[kernels[-1], n]
        line += [_mb(last["argument_bytes"]), _mb(last["output_bytes"])]
        table.append(line)
    print(f"\ngenerate's prefill, XLA memory_analysis ({machine()}); one-layer Decoder, "
          f"batch 1, {NEW} new tokens")
    print_table(columns, table)
    return rows


if __name__ == "__main__":
    main()
