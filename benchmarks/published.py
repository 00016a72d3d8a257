"""Planned vs published per-device memory: torchtitan's Llama 3.1 8B and Megatron's GPT.

Each layout below is a published training run: its model, parallel degrees, batch,
sequence length, activation checkpointing and the per-device memory it reported
(or, where none was reported, the memory of the devices it ran on). The script plans
the same layout with nnx_shard's formula (``nnx_shard.planner._formula``: parameters,
gradients, optimizer state, the NaN guard's copy, and the activations of
``nnx_shard.models._memory``, memory-efficient attention included) and, with
``--compile``, XLA's compiled figure of the call ``Trainer.fit`` makes, on as many
simulated CPU devices as the layout has (layouts of at most ``--compile-max``
devices, default 8; each compile takes seconds on 2 CPU cores, so ``--compile-max
128`` or ``512`` with ``--only`` compiles the larger layouts too).

Published facts (carried as numbers, the sources' own words are not copied):

* torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md`` (H100 with 96 GB HBM2e;
  memory in GiB, read at iteration 90; torchtitan 9dec370, Dec 2024) and its
  ``train_configs/llama3_8b.toml`` at that commit (seq_len 8192, selective op AC):
  Table 1, Llama 3.1 8B on 8 GPUs, FSDP 8, local batch 2, selective AC, FSDP without
  compile: 82.4 GiB. Table 3, the same on 128 GPUs (FSDP 128, local batch 2): 67.0 GiB.
  Table 2 (torch.compile and Float8, full AC, local batch 1): FSDP 8 at seq 32768:
  83.9 GiB; FSDP 4 x CP 2 at seq 65536: 84.2 GiB. FSDP keeps float32 parameters and
  AdamW state, sharded, and computes in bfloat16 (``mixed_precision_param``).
* Megatron-LM (Narayanan et al. 2021, arXiv 2104.04473, Table 1; the repository's
  README of that time: vocabulary 51,200, sequence 2048, 80 GB A100s): GPT 1.7B
  (24 layers, hidden 2304, 24 heads) on 32 GPUs, tensor parallel 1, pipeline 1, batch
  512; GPT 7.5B (36 layers, hidden 4096, 32 heads) on 128 GPUs, tensor parallel 4,
  pipeline 1, batch 512. Activations recomputed (the paper's FLOP count has four
  forward passes' worth per step). No per-device memory is published: the figure
  compared with is the 80 GB the run had, so the ratio says "fits", not "matches".
  Plain data parallelism (no distributed optimizer at the time); the per-replica batch
  (512 / data-parallel size = 16 sequences) is planned as one step, an upper bound
  for a run that splits it into microbatches (Table 1 does not give their size).

Models are planned with float32 parameters and optimizer state and bfloat16
activations (the published runs' mixed precision; Megatron's fp16 weights plus fp32
master copy are 2 bytes/parameter more). Each row reports the NaN guard's copy (the
previous state ``Trainer.fit`` keeps to roll a non-finite call back) separately, with
the total with and without it: the published runs keep no such copy.

Run::

    .venv/bin/python benchmarks/published.py [--compile] [--compile-max 8] [--only NAME,...]

writes ``benchmarks/results/published.json`` (rows of layouts not run keep their last
figures) and prints the table. Under a pipeline the compiled figure is XLA CPU's upper
bound, not trusted (:mod:`nnx_shard.planner._trust`): the formula decides there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from _common import print_table, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "published.json"
GIB = 2**30
GB = 10**9


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    source: str
    model: str            # "llama3-8b", "megatron-1.7b", "megatron-7.5b"
    strategy: str
    mesh: dict[str, int]
    batch: int            # global sequences per step
    seq: int
    remat: str            # the nnx_shard policy closest to the published checkpointing
    published_ac: str
    published_bytes: int  # reported per-device memory, or the device's capacity
    measured: bool        # False: published_bytes is the device capacity
    attention: str = "auto"  # the model's kernel (auto: blockwise on CPU)
    extra: tuple[tuple[str, str], ...] = ()  # rules laid over the preset's (with_rules)
    microbatches: int = 1     # per step (a pipeline needs at least its stage count)
    layers: int | None = None  # replaces the model's layer count (None: as published)


LAYOUTS = [
    Layout("tt-8b-8gpu", "torchtitan Table 1 (FSDP)", "llama3-8b", "fsdp", {"data": 8}, 16,
           8192, "dots", "selective (op)", int(82.4 * GIB), True),
    Layout("tt-8b-8gpu-full", "torchtitan Table 1, planned with full remat", "llama3-8b",
           "fsdp", {"data": 8}, 16, 8192, "full", "selective (op)", int(82.4 * GIB), True),
    Layout("tt-8b-8gpu-full-dense", "torchtitan Table 1, full remat, dense attention kernel",
           "llama3-8b", "fsdp", {"data": 8}, 16, 8192, "full", "selective (op)",
           int(82.4 * GIB), True, attention="dense"),
    Layout("tt-8b-128gpu", "torchtitan Table 3 (FSDP)", "llama3-8b", "fsdp", {"data": 128},
           256, 8192, "dots", "selective (op)", int(67.0 * GIB), True),
    Layout("tt-8b-128gpu-full", "torchtitan Table 3, planned with full remat", "llama3-8b",
           "fsdp", {"data": 128}, 256, 8192, "full", "selective (op)", int(67.0 * GIB), True),
    Layout("tt-8b-32k", "torchtitan Table 2 (FSDP 8, CP 1)", "llama3-8b", "fsdp", {"data": 8},
           8, 32768, "full", "full", int(83.9 * GIB), True),
    Layout("tt-8b-64k-cp2", "torchtitan Table 2 (FSDP 4, CP 2)", "llama3-8b", "fsdp_cp",
           {"data": 4, "context": 2}, 4, 65536, "full", "full", int(84.2 * GIB), True),
    # Table 4: Llama 3.1 70B, FSDP 32 x TP 8 on 256 GPUs, local batch 16 (global 512),
    # full AC, torch.compile + Float8, 71.9 GiB (67.6 with AsyncTP). torchtitan's TP
    # shards the norms' sequence too (sequence parallelism): the second row adds it.
    Layout("tt-70b-256gpu", "torchtitan Table 4 (FSDP 32, TP 8)", "llama3-70b", "fsdp_tp",
           {"data": 32, "model": 8}, 512, 8192, "full", "full", int(71.9 * GIB), True),
    Layout("tt-70b-256gpu-sp", "torchtitan Table 4, TP with the sequence over model between "
           "blocks", "llama3-70b", "fsdp_tp", {"data": 32, "model": 8}, 512, 8192, "full",
           "full", int(71.9 * GIB), True, extra=(("length", "model"),)),
    # Table 5: Llama 3.1 405B, FSDP 8 x TP 8 x PP 8 on 512 GPUs, local batch 32 (global
    # 256), full AC, 1F1B, 82.5 GiB. nnx_shard's pipeline needs the layers to divide
    # into the stages: 126 do not into 8, so it is planned with 128 (+1.6% parameters).
    Layout("tt-405b-512gpu", "torchtitan Table 5 (FSDP 8, TP 8, PP 8, 1F1B)", "llama3-405b",
           "pp_tp", {"stage": 8, "data": 8, "model": 8}, 256, 8192, "full", "full",
           int(82.5 * GIB), True, extra=(("embed", "data"), ("length", "model")),
           microbatches=8, layers=128),
    Layout("mg-1.7b", "Megatron Table 1 (TP 1, 32 GPUs)", "megatron-1.7b", "dp",
           {"data": 32}, 512, 2048, "full", "full recompute", 80 * GB, False),
    Layout("mg-7.5b", "Megatron Table 1 (TP 4, 128 GPUs)", "megatron-7.5b", "tp",
           {"data": 32, "model": 4}, 512, 2048, "full", "full recompute", 80 * GB, False),
]


def config(model: str, remat: str, attention: str = "auto", layers: int | None = None):
    """The nnx_shard config of a published model: float32 parameters, bfloat16 compute."""
    import jax.numpy as jnp

    from nnx_shard.models import ReferenceConfig, get_config

    mixed = dict(param_dtype=jnp.float32, dtype=jnp.bfloat16, scan_layers=True, remat=remat,
                 attention=attention)
    if layers is not None:
        mixed["layers"] = layers
    if model.startswith("llama3-"):
        return dataclasses.replace(get_config(model), **mixed)
    gpt = dict(vocab=51200, length=2048, tie_embeddings=True, **mixed)
    if model == "megatron-1.7b":
        return ReferenceConfig(embed=2304, heads=24, head_dim=96, mlp=4 * 2304, layers=24,
                                 **gpt)
    if model == "megatron-7.5b":
        return ReferenceConfig(embed=4096, heads=32, head_dim=128, mlp=4 * 4096, layers=36,
                                 **gpt)
    raise ValueError(model)


def strategy(layout: Layout):
    """The layout's preset, with its extra rules laid over."""
    from nnx_shard import strategies

    strat = strategies.get(layout.strategy)
    return strat.with_rules(dict(layout.extra)) if layout.extra else strat


def formula_row(layout: Layout) -> dict:
    from flax import nnx

    from nnx_shard import _optimizers as optimizers
    from nnx_shard.models._memory import activation_bytes
    from nnx_shard.models._named import build
    from nnx_shard.planner._formula import abstract_report, formula, stage_config

    cfg = config(layout.model, layout.remat, layout.attention, layout.layers)
    strat = strategy(layout)
    model = nnx.eval_shape(lambda: build(cfg, nnx.Rngs(0)))
    report = abstract_report(model, layout.mesh, strat.rules, optimizers.get("adamw"),
                             strat.opt_rules)
    # A pipeline stage keeps its own layers' activations, for every microbatch (GPipe).
    per_stage = stage_config(cfg, strat, layout.mesh) or cfg
    acts = activation_bytes(per_stage, strat.rules, layout.mesh, layout.batch, layout.seq,
                            layout.remat)
    return {"num_params": cfg.num_params, **formula(report, acts)}


def compile_one(index: int) -> dict:
    """XLA's figure of ``fit``'s call for layout ``index`` (run in a child Python with
    the layout's device count)."""
    import jax
    from flax import nnx

    from nnx_shard.models._named import build
    from nnx_shard.planner._compile import compile_fit

    layout = LAYOUTS[index]
    cfg = config(layout.model, layout.remat, layout.attention, layout.layers)
    compiled, _, seconds = compile_fit(lambda: build(cfg, nnx.Rngs(0)), strategy(layout),
                                       layout.mesh, batch=layout.batch, seq=layout.seq,
                                       microbatches=layout.microbatches)
    mem = compiled.memory_analysis()
    total = (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
             - mem.alias_size_in_bytes)
    return {"total": int(total), "temp": int(mem.temp_size_in_bytes),
            "compile_s": round(seconds, 1), "jax": jax.__version__}


def compiled_row(index: int, timeout: float) -> dict:
    from nnx_shard._simulated import simulated_env

    n = math.prod(LAYOUTS[index].mesh.values())
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--compile-one", str(index)],
                          env=simulated_env(n, importable=True), capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", action="store_true",
                    help="also compile the layouts of at most --compile-max devices")
    ap.add_argument("--compile-max", type=int, default=8)
    ap.add_argument("--compile-timeout", type=float, default=1800)
    ap.add_argument("--only", default="", help="comma-separated layout names")
    ap.add_argument("--compile-one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compile_one is not None:
        print(json.dumps(compile_one(args.compile_one)))
        return
    only = {s for s in args.only.split(",") if s}
    rows, table = [], []
    for i, layout in enumerate(LAYOUTS):
        if only and layout.name not in only:
            continue
        f = formula_row(layout)
        devices = math.prod(layout.mesh.values())
        c = (compiled_row(i, args.compile_timeout)
             if args.compile and devices <= args.compile_max else None)
        pub = layout.published_bytes
        from nnx_shard.planner._trust import compiled_trusted

        trusted, _ = compiled_trusted(strategy(layout))
        row = {**dataclasses.asdict(layout), "devices": devices, "formula": f, "compiled": c,
               "compiled_trusted": trusted,
               "formula_over_published": f["total"] / pub,
               "formula_no_guard_over_published": (f["total"] - f["guard"]) / pub}
        if c and "total" in c:
            row["compiled_over_published"] = c["total"] / pub
            # The guard's copy is in XLA's temp; its size is the formula's (params + state).
            row["compiled_no_guard_over_published"] = (c["total"] - f["guard"]) / pub
        rows.append(row)
        mesh = ",".join(f"{k}={v}" for k, v in layout.mesh.items())
        pub_txt = (f"{pub / GIB:.1f} GiB" if layout.measured
                   else f"{pub / GIB:.1f} GiB (80 GB device)")
        if not c:
            ctxt = cng = ""
        elif "total" in c:
            ctxt = (f"{c['total'] / GIB:.1f} GiB ({c['total'] / pub:.2f})"
                    + ("" if trusted else ", not trusted: an upper bound"))
            cng = f"{(c['total'] - f['guard']) / GIB:.1f} GiB ({(c['total'] - f['guard']) / pub:.2f})"
        else:
            ctxt, cng = f"failed: {c['error'][:60]}", ""
        table.append([
            layout.name, f"{layout.model} {layout.strategy} {mesh}",
            f"{layout.batch} x {layout.seq}",
            f"{layout.published_ac} / {layout.remat}"
            + ("" if layout.attention == "auto" else f", {layout.attention} attention"),
            pub_txt, f"{f['total'] / GIB:.1f} GiB", f"{f['total'] / pub:.2f}",
            f"{f['guard'] / GIB:.1f} GiB", f"{(f['total'] - f['guard']) / GIB:.1f} GiB",
            f"{(f['total'] - f['guard']) / pub:.2f}", ctxt, cng])
        print(f"{layout.name}: planned", file=sys.stderr)
    print_table(["layout", "model, strategy, mesh", "batch x seq", "published AC / remat",
                 "published", "plan (formula)", "plan / published", "guard copy",
                 "plan - guard", "(plan - guard) / published", "compiled (/ published)",
                 "compiled - guard (/ published)"],
                table)
    # Rows of layouts not run this time stay as they were.
    kept = []
    if RESULTS.exists():
        names = {r["name"] for r in rows}
        kept = [r for r in json.loads(RESULTS.read_text()).get("rows", [])
                if r.get("name") not in names]
    order = {layout.name: i for i, layout in enumerate(LAYOUTS)}
    merged = sorted(kept + rows, key=lambda r: order.get(r.get("name"), len(order)))
    write_json(RESULTS, {"rows": merged})


if __name__ == "__main__":
    main()
