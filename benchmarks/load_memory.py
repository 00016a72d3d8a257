"""Memory of loading a Hugging Face checkpoint sharded: ns.hf.load_safetensors vs the
naive path.

A Llama of about 2.4 GB (float32: vocab 32000, embed 2048, 16 heads, 8 key/value
heads, mlp 5632, 10 layers) is written once with ``ns.hf.save_safetensors`` (one
``model.safetensors``, transformers' layout). Then, for each variant, a fresh
subprocess with 8 simulated CPU devices loads it under fsdp (``data=8``) and
reports

* peak RSS growth during the load (``VmHWM`` after, with the peak reset through
  ``/proc/self/clear_refs`` just before) as a multiple of the model's bytes:
  every simulated device lives in this process, so holding the model once, in
  shards, is 1.0x;
* the bytes each device holds afterwards (its shards), as a multiple of model / 8;
* wall time.

Variants:

* ``ours``: ``ns.hf.load_safetensors(path, ns.abstract_init(..., strategy))`` with
  unstacked layers (``scan_layers=False``);
* ``ours_scanned``: the same with the layers stacked (``scan_layers=True``):
  the largest parameter in flight is a whole ``[layers, ...]`` stack;
* ``naive``: ``safetensors.numpy.load_file`` (the whole file into host memory),
  each tensor turned into the model's layout with numpy, then ``jax.device_put``
  with the target's sharding.

The checkpoint goes to ``--dir`` (default: a temporary directory, removed at
the end; about 2.4 GB of disk). Run (about 3 minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/load_memory.py

``--quick`` uses a model 1/16 the size (a smoke test of the script only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, simulated_cpu, write_json

N_DEVICES = 8
RESULTS = Path(__file__).resolve().parent / "results" / "load_memory.json"
VARIANTS = ("ours", "ours_scanned", "naive")


def _config(quick: bool, scan: bool = False):  # type: ignore[no-untyped-def]
    from nnx_shard.models import DecoderConfig

    if quick:
        return DecoderConfig(vocab=8000, embed=512, heads=8, kv_heads=4, head_dim=64, mlp=1408,
                           layers=10, scan_layers=scan)
    return DecoderConfig(vocab=32000, embed=2048, heads=16, kv_heads=8, head_dim=128, mlp=5632,
                       layers=10, scan_layers=scan)


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _naive(path: Path, target):  # type: ignore[no-untyped-def]
    """load_file, numpy transforms to the model layout, device_put per parameter."""
    import jax
    import numpy as np
    from flax import nnx
    from safetensors.numpy import load_file

    from nnx_shard._annotate import path_str

    tensors = load_file(path / "model.safetensors")
    cfg = target.cfg
    h, g, d = cfg.heads, cfg.kv_heads, cfg.head_dim

    def host(p: str) -> np.ndarray:
        parts = p.split("/")
        if p == "token_embed":
            return tensors["model.embed_tokens.weight"]
        if p == "unembed":
            return tensors["lm_head.weight"].T
        if p == "final_norm/scale":
            return tensors["model.norm.weight"]
        i, rest = parts[1], "/".join(parts[2:])
        pre = f"model.layers.{i}."
        if rest == "attn_norm/scale":
            return tensors[pre + "input_layernorm.weight"]
        if rest == "mlp_norm/scale":
            return tensors[pre + "post_attention_layernorm.weight"]
        if rest in ("attn/q", "attn/k", "attn/v"):
            heads = h if rest == "attn/q" else g
            w = tensors[pre + f"self_attn.{rest[-1]}_proj.weight"]
            return w.reshape(heads, d, -1).transpose(2, 0, 1)
        if rest == "attn/o":
            return tensors[pre + "self_attn.o_proj.weight"].T.reshape(h, d, -1)
        return tensors[pre + f"mlp.{parts[-1]}_proj.weight"].T

    graphdef, state = nnx.split(target)
    flat = []
    for k, var in nnx.to_flat_state(state):
        x = jax.device_put(np.ascontiguousarray(host(path_str(k))), var.get_value().sharding)
        flat.append((k, var.replace(x)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _worker(variant: str, path: str, quick: bool) -> dict:
    import jax
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import Decoder

    cfg = _config(quick, scan=variant == "ours_scanned")
    s = ns.strategies.get("fsdp")
    mesh = s.make_mesh(N_DEVICES)
    target = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, s)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(target)))
    # JAX's own start-up (backend, threads) happens before the measured window.
    jax.block_until_ready(jax.device_put(jax.numpy.ones(8), jax.devices()[0]))
    before = _status()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    start = time.perf_counter()
    model = ns.hf.load_safetensors(path, target) if variant.startswith("ours") else _naive(
        Path(path), target)
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - start
    after = _status()
    per_device: dict[int, int] = {}
    for x in jax.tree.leaves(nnx.state(model)):
        for shard in x.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return {
        "variant": variant, "model_bytes": total, "seconds": seconds,
        "rss_growth_bytes": after["VmHWM"] - before,
        "rss_growth_x": (after["VmHWM"] - before) / total,
        "rss_after_x": (after["VmRSS"] - before) / total,
        "device_bytes_max": max(per_device.values()),
        "device_x": max(per_device.values()) / (total / N_DEVICES),
    }


def _write_checkpoint(path: Path, quick: bool) -> int:
    """A random model of the benchmark's size, saved with save_safetensors (in a
    subprocess, so its memory is gone before the measurements)."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "from load_memory import _config\n"
        "import nnx_shard as ns\nfrom flax import nnx\nfrom nnx_shard.models import Llama\n"
        "s = ns.strategies.get('fsdp')\n"
        f"m = ns.sharded_init(lambda: Decoder(_config({quick!r}), rngs=nnx.Rngs(0)), s.make_mesh(8), s)\n"
        f"ns.hf.save_safetensors({str(path)!r}, m)\n"
    )
    env = {**os.environ, **simulated_cpu(N_DEVICES)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=1800)
    return (path / "model.safetensors").stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help="where to write the checkpoint (kept); default: a temp dir")
    ap.add_argument("--quick", action="store_true", help="a model 1/16 the size (smoke test)")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.path, args.quick)))
        return
    tmp = None if args.dir else tempfile.mkdtemp(prefix="load_memory_")
    path = Path(args.dir or tmp) / "ckpt"
    try:
        if not (path / "model.safetensors").is_file():
            t0 = time.perf_counter()
            size = _write_checkpoint(path, args.quick)
            print(f"wrote {path} ({size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")
        rows = []
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--worker", variant, "--path", str(path)] + (
                ["--quick"] if args.quick else [])
            env = {**os.environ, **simulated_cpu(N_DEVICES)}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode:
                sys.stderr.write(proc.stderr[-3000:])
                raise SystemExit(f"worker {variant} failed ({proc.returncode})")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)  # the temp dir this run made
    model = rows[0]["model_bytes"]
    print(f"Llama {model / 2**30:.2f} GiB (float32), fsdp on {N_DEVICES} simulated CPU devices")
    print_table(
        ["variant", "peak RSS growth / model", "RSS after / model", "device bytes / (model/8)",
         "seconds"],
        [[r["variant"], f"{r['rss_growth_x']:.2f}x", f"{r['rss_after_x']:.2f}x",
          f"{r['device_x']:.2f}x", f"{r['seconds']:.1f}"] for r in rows])
    write_json(RESULTS, {"platform": platform.platform(), "devices": N_DEVICES,
                         "quick": args.quick, "rows": rows})


if __name__ == "__main__":
    main()
