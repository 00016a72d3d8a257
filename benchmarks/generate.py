"""Generation speed: the cached path (``nnx_shard.inference.generate``) vs recomputing.

The reference transformer ``small`` with a context of 256 (4 layers, d=128, 4
heads x 32, mlp 512, vocab 512), a batch of 8 prompts of 64 tokens, 192 new
tokens each (greedy). Per layout:

* ``cached``: ``generate``: one compiled prefill (the cache created in its
  layout, the prompt run at once) and one compiled decode loop; its prefill
  latency, its per-token latency (decode program time / 191 steps) and tokens/s
  (batch x 192 / (prefill + decode));
* ``recompute``: ``nnx_shard.inference._sampling.recompute``, same arguments and
  tokens, the whole sequence (padded to 256) re-run for every new token;
* ``window``: the demo's sampler ``nnx_shard.inference._sampling.generate`` (one
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

Run (about 5 minutes on 2 CPU cores; ``--only cache`` skips the comparison
with transformers below, which takes about 6 minutes there)::

    .venv/bin/python benchmarks/generate.py
    JAX_PLATFORMS=cuda .venv/bin/python benchmarks/generate.py   # on a GPU

Stream: ``nnx_shard.inference.stream`` (16 decode steps per compiled call, each
step's tokens brought to the host) against ``generate`` over 256 new tokens after
a prompt of 16 (batch 8, one device): their tokens/s and the share streaming
costs.

Against transformers (``--only hf`` runs this part alone; the default runs it
after the rest): a Llama of 134.1M parameters (hidden 768, 12 layers, 12 heads,
intermediate 2048, vocab 32000, untied embeddings; random weights, float32) that
``benchmarks/hf_generate_ref.py`` builds from a fixed seed and writes with
``save_pretrained`` to a temporary folder. That script runs in its own process
with a Python that has torch and transformers (``--hf-python``, default
``/work/hf-venv/bin/python``; without one the comparison is skipped, saying so);
this process loads the same checkpoint with ``nnx_shard.hf.load_pretrained`` on
one device. Greedy, prompts of 32 random tokens + 64 new ones (``--new-tokens``,
e.g. 256), batch 1 and 16: transformers' ``generate`` (``use_cache=True``,
``torch.inference_mode``), ``nnx_shard.inference.generate`` and
``nnx_shard.inference.stream`` (chunks of 16), each warmed up first (compiles
excluded; transformers' warm-up call runs 16 tokens), then timed in rounds that
rotate the three (medians; ``--rounds``, default 3). The greedy tokens of the two
libraries are compared row by row.

Threads: ``--threads`` (default 2) a side: ``torch.set_num_threads`` in the
reference process; XLA's CPU client sizes its intra-op pool by the CPUs the process
may run on, so this process is held to that many CPUs where the machine has more
(on 2 cores both sides use 2 as they are). The JSON (``results/generate_hf.json``)
records both counts, the 1-minute load average before and after (and per batch),
the versions and the command: other work on the machine slows either side, so run
it when the load is low::

    .venv/bin/python benchmarks/generate.py --only hf --hf-python /path/to/python

``--quick`` shortens everything (a smoke test of the script; for ``hf``, a Decoder
of 140k parameters and 32 new tokens).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, run_worker, worker_main, write_json

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "generate.json"
HF_RESULTS = HERE / "results" / "generate_hf.json"
HF_PYTHON = "/work/hf-venv/bin/python"
# against transformers: prompts of 32 tokens, 64 new (--new-tokens), batches 1 and 16,
# 3 rounds, 2 threads a side (--threads).
HF_PROMPT, HF_NEW, HF_BATCHES, HF_ROUNDS, HF_THREADS = 32, 64, (1, 16), 3, 2
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
    from nnx_shard.inference import GenerationConfig, generate
    from nnx_shard.inference import _generation as gen
    from nnx_shard.inference import _sampling as sampling
    from nnx_shard.models import Decoder, get_config

    cfg = dataclasses.replace(get_config("small"), length=PROMPT + NEW)
    mesh = rules = None
    if strategy is None:
        model = Decoder(cfg, rngs=nnx.Rngs(0))
    else:
        s = ns.strategies.get(strategy)
        mesh, rules = s.make_mesh(n), s.rules
        model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, s)

    counter = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    config = GenerationConfig(max_new_tokens=new)
    t0 = time.perf_counter()
    with jax.log_compiles(True):
        first = jax.block_until_ready(generate(model, prompts[0], config, mesh=mesh, rules=rules))
        first_call_s = time.perf_counter() - t0
        for p in prompts[1:]:
            jax.block_until_ready(generate(model, p, config, mesh=mesh, rules=rules))
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

    from nnx_shard.inference import GenerationConfig, generate, stream
    from nnx_shard.models import Decoder, get_config

    cfg = dataclasses.replace(get_config("small"), length=STREAM_PROMPT + new)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    prompt = np.random.default_rng(0).integers(0, 512, (BATCH, STREAM_PROMPT)).astype(np.int32)
    config = GenerationConfig(max_new_tokens=new)
    whole = np.asarray(generate(model, prompt, config))
    steps = np.stack(list(stream(model, prompt, config, chunk=STREAM_CHUNK)), 1)
    assert (steps == whole[:, STREAM_PROMPT:]).all(), "stream and generate differ"
    generate_t = _median_time(lambda: generate(model, prompt, config), rounds)
    stream_t = _median_time(lambda: list(stream(model, prompt, config, chunk=STREAM_CHUNK)),
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


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    ap.add_argument("--only", choices=("cache", "hf"), default=None,
                    help="cache: cached vs recompute and stream; hf: against transformers")
    ap.add_argument("--hf-python", default=None,
                    help=f"a Python with torch and transformers (default {HF_PYTHON})")
    ap.add_argument("--rounds", type=int, default=HF_ROUNDS, help="timed rounds of the hf part")
    ap.add_argument("--new-tokens", type=int, default=HF_NEW,
                    help=f"new tokens per row in the hf part (default {HF_NEW}; e.g. 256)")
    ap.add_argument("--threads", type=int, default=HF_THREADS,
                    help=f"CPU threads of each side in the hf part (default {HF_THREADS})")
    return ap.parse_args()


def main() -> int:
    args = _parse()
    if worker_main(args, {"worker": _measure}):
        return 0
    if args.only != "hf":
        _cache_part(args)
    if args.only != "cache":
        _hf_part(args)
    return 0


def _cache_part(args: argparse.Namespace) -> None:
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


def _hf_python(given: str | None) -> str | None:
    """The Python to run the transformers side with, or None (printing why)."""
    path = given or HF_PYTHON
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        print(f"\nskipping the comparison with transformers: no Python at {path} "
              "(pass --hf-python PATH, a Python with torch and transformers)")
        return None
    probe = subprocess.run([path, "-c", "import torch, transformers"], capture_output=True,
                           text=True, timeout=300)
    if probe.returncode != 0:
        print(f"\nskipping the comparison with transformers: {path} cannot import torch and "
              f"transformers ({probe.stderr.strip().splitlines()[-1:]})")
        return None
    return path


class _Reference:
    """transformers' side: ``hf_generate_ref.py --serve`` in its own process, one
    ``generate`` call per request (so that its rounds alternate with ours)."""

    def __init__(self, python: str, folder: str, quick: bool, new: int, threads: int) -> None:
        cmd = [python, str(HERE / "hf_generate_ref.py"), "--serve", "--save", folder,
               "--prompt", str(HF_PROMPT), "--new", str(new), "--threads", str(threads),
               "--device", "cuda" if _gpu() else "cpu"] + (["--quick"] if quick else [])
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.meta = self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"hf_generate_ref.py ended ({self.proc.wait()}) without an answer")
        return json.loads(line)

    def generate(self, prompt: Any, new: int | None = None) -> tuple[float, Any]:
        import numpy as np

        assert self.proc.stdin is not None
        request = {"prompt": prompt.tolist()} | ({"new": new} if new else {})
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        return answer["seconds"], np.asarray(answer["tokens"], np.int32)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _agreement(ours: Any, theirs: Any) -> dict:
    """Rows of equal greedy tokens, and where the first differing row parts."""
    import numpy as np

    same = ours == theirs
    rows = same.all(axis=1)
    first = [int(np.argmin(r)) for r in same if not r.all()]
    return {"rows_equal": int(rows.sum()), "rows": len(rows),
            "first_difference_at": min(first) if first else None,
            "tokens_equal_before_first_difference": float(np.mean(np.cumprod(same, axis=1)))}


def _hf_batch(ref: _Reference, model: Any, batch: int, new: int, rounds: int, vocab: int) -> dict:
    """One batch size: the three sides warmed up, then ``rounds`` rotating rounds."""
    import jax
    import numpy as np

    from nnx_shard.inference import GenerationConfig, generate, stream

    load = os.getloadavg()[0]
    prompt = np.random.default_rng(batch).integers(0, vocab, (batch, HF_PROMPT)).astype(np.int32)

    config = GenerationConfig(max_new_tokens=new)

    def ours() -> Any:
        return np.asarray(jax.block_until_ready(generate(model, prompt, config)))[:, HF_PROMPT:]

    def streamed() -> Any:
        return np.stack(list(stream(model, prompt, config, chunk=STREAM_CHUNK)), 1)

    def timed(fn: Any) -> tuple[float, Any]:
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    sides = {"transformers": lambda: ref.generate(prompt), "generate": lambda: timed(ours),
             "stream": lambda: timed(streamed)}
    # Warm-up: our two compile (at the full length); transformers' first call runs
    # 16 tokens (its first-call costs without another full-length call).
    ref.generate(prompt, 16)
    outs = {name: sides[name]()[1] for name in ("generate", "stream")}
    assert (outs["stream"] == outs["generate"]).all(), "stream and generate differ"
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names[r % 3:] + names[:r % 3]:
            seconds, outs[name] = sides[name]()
            times[name].append(seconds)
        print(f"  batch {batch}, round {r + 1}: " + ", ".join(
            f"{n} {batch * new / times[n][-1]:.1f} tok/s" for n in names), flush=True)
    tps = {n: batch * new / statistics.median(t) for n, t in times.items()}
    return {"batch": batch, "prompt": HF_PROMPT, "new": new, "rounds": rounds,
            "loadavg_1min": [load, os.getloadavg()[0]],
            **{f"{n}_tokens_per_s": v for n, v in tps.items()},
            **{f"{n}_seconds": t for n, t in times.items()},
            "generate_vs_transformers": tps["generate"] / tps["transformers"],
            "stream_vs_generate": tps["stream"] / tps["generate"],
            **_agreement(outs["generate"], outs["transformers"])}


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "")
    except OSError:
        return ""


def _xla_threads(threads: int) -> int:
    """Holds this process (before jax loads) to ``threads`` CPUs where it may use more:
    XLA's CPU client sizes its intra-op thread pool by the CPUs the process may run
    on. Returns that count."""
    cpus = sorted(os.sched_getaffinity(0))
    if 0 < threads < len(cpus):
        os.sched_setaffinity(0, cpus[:threads])
    return len(os.sched_getaffinity(0))


def _hf_part(args: argparse.Namespace) -> None:
    """nnx_shard's generate and stream against transformers' generate, same weights."""
    python = _hf_python(args.hf_python)
    if python is None:
        return
    if not _gpu():
        os.environ.update({"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
    load_before = os.getloadavg()
    xla_threads = _xla_threads(args.threads) if not _gpu() else None
    import platform

    import flax
    import jax
    import numpy

    import nnx_shard as ns
    from nnx_shard.hf import load_pretrained

    new, rounds = (32, 1) if args.quick else (args.new_tokens, args.rounds)
    folder = tempfile.mkdtemp(prefix="nnx_shard_hf_llama_")
    try:
        ref = _Reference(python, folder, args.quick, new, args.threads)
        try:
            model = load_pretrained(folder, mesh="data=1", rules=ns.strategies.get("dp").rules)
            assert model.cfg.num_params == ref.meta["parameters"], (model.cfg.num_params,
                                                                     ref.meta["parameters"])
            rows = [_hf_batch(ref, model, b, new, rounds, model.cfg.vocab) for b in HF_BATCHES]
        finally:
            ref.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    load_after = os.getloadavg()
    shape = ref.meta["config"]
    where = (f"{jax.default_backend()} ({jax.devices()[0].device_kind}), {os.cpu_count()} "
             f"CPU cores, threads: XLA {xla_threads}, torch {ref.meta['threads']}; load "
             f"{load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"\nagainst transformers: Llama of {ref.meta['parameters'] / 1e6:.1f}M parameters "
          f"(hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
          f"vocab {shape['vocab_size']}), float32, greedy, prompt {HF_PROMPT} + {new} new "
          f"tokens, median of {rounds} rounds; {where}\n")
    print_table(
        ["batch", "nnx_shard generate tok/s", "nnx_shard stream tok/s",
         "transformers generate tok/s", "generate / transformers", "stream / generate",
         "rows equal (first difference)"],
        [[r["batch"], f"{r['generate_tokens_per_s']:.1f}", f"{r['stream_tokens_per_s']:.1f}",
          f"{r['transformers_tokens_per_s']:.1f}", f"{r['generate_vs_transformers']:.2f}x",
          f"{r['stream_vs_generate']:.2f}",
          f"{r['rows_equal']}/{r['rows']}" + (f" (token {r['first_difference_at']})"
                                              if r["first_difference_at"] is not None else "")]
         for r in rows])
    meta = {k: v for k, v in ref.meta.items() if k not in ("ready", "checkpoint")}
    write_json(HF_RESULTS, {"meta": meta | {
        "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"), "flax": flax.__version__,
        "numpy": numpy.__version__, "python": platform.python_version(),
        "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
        "cpus": os.cpu_count(), "machine": platform.machine(),
        "processor": platform.processor() or _cpu_model(),
        "xla_threads": xla_threads, "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "loadavg_before": load_before, "loadavg_after": load_after,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "prompt": HF_PROMPT, "new": new, "rounds": rounds, "stream_chunk": STREAM_CHUNK,
        "quick": args.quick}, "results": rows})
    print(json.dumps({"generate_vs_transformers": [round(r["generate_vs_transformers"], 2)
                                                   for r in rows],
                      "stream_vs_generate": [round(r["stream_vs_generate"], 3) for r in rows]}))


if __name__ == "__main__":
    sys.exit(main())
