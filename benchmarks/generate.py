"""Generation speed: the cached path (``nnx_shard.models.generate``) vs recomputing.

The reference transformer ``small`` with a context of 256 (4 layers, d=128, 4
heads x 32, mlp 512, vocab 512), a batch of 8 prompts of 64 tokens, 192 new
tokens each (greedy). Per layout:

* ``cached``: ``generate``: one compiled prefill (the cache created in its
  layout, the prompt run at once) and one compiled decode loop; its prefill
  latency, its per-token latency (decode program time / 191 steps) and tokens/s
  (batch x 192 / (prefill + decode));
* ``recompute``: ``nnx_shard.models.sampling.recompute``, same arguments and
  tokens, the whole sequence (padded to 256) re-run for every new token;
* ``window``: the demo's sampler ``nnx_shard.models.sampling.generate`` (one
  sequence, a sliding window of the prompt's 64 tokens): what generation was
  before the cache. Batch 1, so its tokens/s counts one sequence.

Compiles: the prefill and decode programs JAX compiled over three ``generate``
calls of the same shape (different prompts), counted from JAX's compile log
(one of each expected, not one per token).

Layouts: one device; on 8 devices ``dp`` (data=8) and ``tp`` (data=2, model=4).
On CPU each device count runs in a subprocess with simulated devices. With
``JAX_PLATFORMS`` naming a GPU (``cuda``/``gpu``/``rocm``) the script uses the
real devices in one process: one device, plus the 8-device layouts when 8 are
present. Timings: each program's median over rounds, the layouts interleaved.

Run (about 5 minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/generate.py
    JAX_PLATFORMS=cuda .venv/bin/python benchmarks/generate.py   # on a GPU

Stream: ``nnx_shard.models.stream`` (16 decode steps per compiled call, each
step's tokens brought to the host) against ``generate`` over 256 new tokens after
a prompt of 16 (batch 8, one device): their tokens/s and the share streaming
costs.

``--quick`` shortens everything (a smoke test of the script).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse, print_table, run_worker, worker_main, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "generate.json"
PROMPT, NEW, BATCH = 64, 192, 8
# stream vs generate: 256 new tokens after a prompt of 16, decoded 16 steps per call.
STREAM_PROMPT, STREAM_NEW, STREAM_CHUNK = 16, 256, 16
GPU_PLATFORMS = ("cuda", "gpu", "rocm")


def _gpu() -> bool:
    return any(p in os.environ.get("JAX_PLATFORMS", "").lower() for p in GPU_PLATFORMS)


class _Compiles(logging.Handler):
    """Counts JAX's 'Compiling <name>' log lines of the generation programs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("Compiling "):  # "Compiling jit(_prefill) with ..."
            name = msg.split()[1]
            if name in ("jit(_prefill)", "jit(_decode)"):
                self.names.append(name[5:-1])


def _median_time(fn, rounds: int) -> float:  # type: ignore[no-untyped-def]
    import jax

    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _layouts(n: int) -> list[tuple[str, str | None]]:
    return [("one device", None)] if n == 1 else [("dp", "dp"), ("tp", "tp")]


def _layout(label: str, strategy: str | None, n: int, new: int, rounds: int,
            prompts: list) -> dict:
    """One layout's row: compiles, prefill and per-token latency, tokens/s of each path."""
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import Transformer, generate, get_config, sampling
    from nnx_shard.models import generation as gen

    cfg = dataclasses.replace(get_config("small"), length=PROMPT + NEW)
    mesh = rules = None
    if strategy is None:
        model = Transformer(cfg, rngs=nnx.Rngs(0))
    else:
        s = ns.strategies.get(strategy)
        mesh, rules = s.make_mesh(n), s.rules
        model = s.sharded_init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)

    counter = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    t0 = time.perf_counter()
    with jax.log_compiles(True):
        first = jax.block_until_ready(generate(model, prompts[0], new, mesh=mesh, rules=rules))
        first_call_s = time.perf_counter() - t0
        for p in prompts[1:]:
            jax.block_until_ready(generate(model, p, new, mesh=mesh, rules=rules))
    logger.removeHandler(counter)

    # The two programs timed apart (the same compiled ones generate ran).
    run = gen._prepare(model, prompts[0], new, gen.Options(), 0, mesh, rules, "benchmark")
    prefill_s, decode_s = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        cache, carry = jax.block_until_ready(run.prefill())
        prefill_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.block_until_ready(run.decode(cache, carry, new))  # donated: a new cache each round
        decode_s.append(time.perf_counter() - t0)
    prefill_t, decode_t = statistics.median(prefill_s), statistics.median(decode_s)

    def slow():  # type: ignore[no-untyped-def]
        return sampling.recompute(model, prompts[0], new, mesh=mesh, rules=rules)

    same = np.asarray(slow()) == np.asarray(first)
    # Greedy tokens agree exactly on CPU. A GPU's float32 matmuls (TF32) round the
    # cached and the recomputed logits differently, and a near-tie can flip a token,
    # after which the continuations part: there the agreement is reported instead.
    if jax.default_backend() == "cpu":
        assert same.all(), "cached and recomputed greedy tokens differ"
    agree = float(np.mean(np.cumprod(same[:, PROMPT:], axis=1)))
    recompute_t = _median_time(slow, rounds)

    def window():  # type: ignore[no-untyped-def]
        if mesh is None:
            return sampling.generate(model, prompts[0][0], new, 0.0, 0)
        with ns.use(mesh, rules | {"batch": None, "length": None}):  # as the demo runs it
            return sampling.generate(model, prompts[0][0], new, 0.0, 0)

    window()
    window_t = _median_time(window, rounds)
    cached_tps = BATCH * new / (prefill_t + decode_t)
    return {
        "layout": label, "devices": n, "batch": BATCH, "prompt": PROMPT, "new": new,
        "compiles": {k: counter.names.count(k) for k in ("prefill", "decode")},
        "generate_calls": len(prompts), "first_call_s": first_call_s,
        "prefill_ms": 1e3 * prefill_t, "per_token_ms": 1e3 * decode_t / (new - 1),
        "cached_tokens_per_s": cached_tps,
        "recompute_tokens_per_s": BATCH * new / recompute_t,
        "window_tokens_per_s": new / window_t,
        "speedup_vs_recompute": cached_tps / (BATCH * new / recompute_t),
        "tokens_equal_before_first_difference": agree,
    }


def _stream_row(new: int, rounds: int) -> dict:
    """``stream`` (chunks of ``STREAM_CHUNK`` steps, each step's tokens on the host)
    against ``generate`` on one device: tokens/s of each over ``new`` new tokens."""
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx

    from nnx_shard.models import Transformer, generate, get_config, stream

    cfg = dataclasses.replace(get_config("small"), length=STREAM_PROMPT + new)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    prompt = np.random.default_rng(0).integers(0, 512, (BATCH, STREAM_PROMPT)).astype(np.int32)
    whole = np.asarray(generate(model, prompt, new))
    steps = np.stack(list(stream(model, prompt, new, chunk=STREAM_CHUNK)), 1)
    assert (steps == whole[:, STREAM_PROMPT:]).all(), "stream and generate differ"
    generate_t = _median_time(lambda: generate(model, prompt, new), rounds)
    stream_t = _median_time(lambda: list(stream(model, prompt, new, chunk=STREAM_CHUNK)),
                            rounds)
    return {"new": new, "chunk": STREAM_CHUNK, "batch": BATCH,
            "generate_tokens_per_s": BATCH * new / generate_t,
            "stream_tokens_per_s": BATCH * new / stream_t,
            "stream_cost": 1 - generate_t / stream_t, "device_kind": jax.devices()[0].device_kind}


def _measure(n: int, quick: bool) -> dict:
    import jax
    import numpy as np

    assert jax.device_count() >= n, (jax.device_count(), n)
    new, rounds = (24, 1) if quick else (NEW, 3)
    prompts = [np.random.default_rng(i).integers(0, 512, (BATCH, PROMPT)).astype(np.int32)
               for i in range(3)]
    rows = [_layout(label, strategy, n, new, rounds, prompts)
            for label, strategy in _layouts(n)]
    extra = {"stream": _stream_row(32 if quick else STREAM_NEW, rounds)} if n == 1 else {}
    return {"rows": rows, **extra, "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__}


def main() -> int:
    args = parse(__doc__)
    if worker_main(args, {"worker": _measure}):
        return 0
    results = []
    if _gpu():
        import jax

        results.append(_measure(1, args.quick))
        if jax.device_count() >= 8:
            results.append(_measure(8, args.quick))
    else:
        for n in (1, 8):
            results.append(run_worker(__file__, n, args.quick, timeout=3600))
    rows = [r for res in results for r in res["rows"]]
    where = ", ".join(sorted({f"{res['backend']} ({res['device_kind']})" for res in results}))
    print(f"\ncached generate vs recompute: prompt {PROMPT} + {rows[0]['new']} new tokens, batch "
          f"{BATCH}, reference transformer 'small' (context {PROMPT + NEW}); {where}\n")
    print_table(
        ["layout", "devices", "compiles (prefill, decode)", "prefill ms", "per-token ms",
         "cached tok/s", "recompute tok/s", "speedup", "window sampler tok/s (batch 1)"],
        [[r["layout"], r["devices"], f"{r['compiles']['prefill']}, {r['compiles']['decode']}",
          f"{r['prefill_ms']:.1f}", f"{r['per_token_ms']:.2f}",
          f"{r['cached_tokens_per_s']:.0f}", f"{r['recompute_tokens_per_s']:.0f}",
          f"{r['speedup_vs_recompute']:.1f}x", f"{r['window_tokens_per_s']:.0f}"]
         for r in rows])
    for res in results:
        if "stream" in res:
            st = res["stream"]
            print(f"\nstream (chunks of {st['chunk']}) vs generate, {st['new']} new tokens, batch "
                  f"{st['batch']}, one device: {st['stream_tokens_per_s']:.0f} vs "
                  f"{st['generate_tokens_per_s']:.0f} tok/s ({100 * st['stream_cost']:.1f}% "
                  "slower)")
    write_json(RESULTS, {"meta": {k: v for k, v in results[0].items() if k not in ("rows",
                                                                                   "stream")} |
                         {"stream": [r["stream"] for r in results if "stream" in r]} |
                         {"quick": args.quick}, "results": rows})
    print(json.dumps({"speedups": [round(r["speedup_vs_recompute"], 1) for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
