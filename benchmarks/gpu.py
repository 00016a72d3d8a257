"""One GPU benchmark suite: tokens/s, MFU and peak memory of four training steps,
side by side with transformers + peft on the same shapes.

Rows (bf16 parameters and activations, ``optax.adamw`` on what is trained, batch x seq
random tokens, one jitted step ``value_and_grad(lm_loss)`` + AdamW, its state donated):

* ``full_ft``: full fine-tuning of a Llama-3.2-1B-shaped model (16 layers, embed 2048,
  32 heads x 64, 8 KV heads, mlp 8192, vocab 128256, tied embeddings), seq 4096, batch
  4, with the remat policy the planner picks: ``ns.planner.auto`` (the search of
  ``nnx-shard plan --auto``) over the ``dp`` preset on one device of this machine's
  hardware profile. It tries ``none`` first and a remat policy only where the plain
  step does not fit (``REMAT_ORDER``, cheapest first), so on an 80 GB+ GPU it picks
  ``none`` unless the step does not fit;
* ``lora``: a Llama-3.1-8B-shaped model (``llama3-8b``), rank-16 adapters (alpha 32,
  float32 as PEFT keeps them) on all seven linear layers of every block, the base
  frozen, seq 4096, batch 1, remat ``full`` (gradient checkpointing on the torch side:
  the memory-lean recipe QLoRA is for; the same on both sides);
* ``qlora``: the same with the base stored in NF4 (block 64; bitsandbytes' NF4
  ``Linear4bit`` on the torch side, where bitsandbytes imports);
* ``moe_tiles``, ``moe_ragged_dot``, ``moe_dense``: ``benchmarks/moe_cost.py``'s
  Mixtral-shaped MoE (tile loop, ``jax.lax.ragged_dot``) and its dense model of the
  active width, full fine-tuning, seq 2048, batch 4.

Figures: tokens/s (batch x seq over the median step time), MFU (model FLOPs per step
over the step time over the peak bf16 FLOP/s of the planner's hardware profile of the
detected device, ``--peak-flops`` to override; see :func:`model_flops`) and peak device
memory (the compiled step's ``memory_analysis()``, arguments + outputs - aliased +
temporaries, and on a GPU the process's ``device.memory_stats()['peak_bytes_in_use']``:
each row then runs in a process of its own). The torch rows run ``gpu_torch_side.py``
with ``--torch-python`` (never imported here), eager and with ``torch.compile``.

Targets, printed beside the figures (not asserted): ``full_ft`` MFU >= 40%; ``lora``
tokens/s >= 1.5x transformers + peft's; ``qlora`` peak memory <= 0.4x the bf16 LoRA's.

Run (one GPU, under 8 minutes; ``--quick``: tiny shapes on the CPU in seconds)::

    python benchmarks/gpu.py --torch-python /path/to/torch/venv/bin/python
    python benchmarks/gpu.py --quick --out /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from _common import median_ms, provenance, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "gpu" / "gpu.json"
TORCH_SIDE = Path(__file__).resolve().parent / "gpu_torch_side.py"
ALL = r"attn/(q|k|v|o)$|mlp/(gate|up|down)$"
RANK = 16
ROWS = ("full_ft", "lora", "qlora", "moe_tiles", "moe_ragged_dot", "moe_dense")
#: (row, torch.compile) pairs of the torch side.
#: The eager rows the targets read first, torch.compile's (long compiles) last.
TORCH_ROWS = (("lora", False), ("full_ft", False), ("qlora", False), ("moe_tiles", False),
              ("moe_dense", False), ("lora", True), ("full_ft", True))
#: Seconds one child (a row) may take at most.
ROW_LIMIT = 240.0
#: The user's own setting, restored in the rows' processes.
PREALLOCATE = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
QUICK_XLA_FLAGS = ("--xla_backend_optimization_level=0",
                   "--xla_cpu_parallel_codegen_split_count=1")
#: Device kinds (``jax.Device.device_kind``, substrings) mapped to planner profiles.
#: First match wins; an H100 PCIe (756 TFLOP/s, not the SXM's 989) needs --peak-flops.
KINDS = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"),
         ("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v5p", "tpu-v5p"),
         ("TPU v5", "tpu-v5p"))
MFU_FORMULA = (
    "MFU = model FLOPs per step / step seconds / peak bf16 FLOP/s. Model FLOPs per token "
    "(PaLM's convention, remat recompute not counted, causal mask not discounted): full "
    "fine-tuning 6 N + 12 L s h d; LoRA / QLoRA (frozen base: forward 2 N, input gradients "
    "2 N, no weight gradients) 4 N + 6 N_lora + 12 L s h d. N: the matmul parameters a "
    "token computes with (DecoderConfig.active_params less the input embedding when it is "
    "not tied to the output head), N_lora: the adapters' parameters, L layers, s seq, h "
    "heads, d head_dim.")


class Spec(NamedTuple):
    """One row's shapes, shared by both sides (``gpu_torch_side.py`` reads its dict). A
    named tuple: the tests load this script without registering it as a module, which a
    dataclass's annotations need."""

    row: str
    model: dict[str, Any]  # vocab embed heads kv_heads head_dim mlp layers tie [experts top_k]
    batch: int
    seq: int
    train: str  # "full", "lora" or "qlora"
    remat: str = "none"
    expert_matmul: str | None = None
    rank: int = RANK

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def _widths(cfg: Any) -> dict[str, Any]:
    out = {k: getattr(cfg, k) for k in ("vocab", "embed", "heads", "kv_heads", "head_dim",
                                          "mlp", "layers")}
    out["tie"] = bool(cfg.tie_embeddings)
    if getattr(cfg, "experts", 0):
        out |= {"experts": cfg.experts, "top_k": cfg.top_k}
    return out


def specs(quick: bool) -> dict[str, Spec]:
    """Every JAX row's :class:`Spec` (tiny widths with ``quick``)."""
    from moe_cost import configs

    tiny = dict(vocab=256, embed=64, heads=2, kv_heads=1, head_dim=64, mlp=128, layers=1)
    llama1b = dict(vocab=128256, embed=2048, heads=32, kv_heads=8, head_dim=64, mlp=8192,
                   layers=16, tie=True)
    llama8b = dict(vocab=128256, embed=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336,
                   layers=32, tie=False)
    moe, dense = configs()
    if quick:
        llama1b, llama8b = tiny | {"tie": True}, tiny | {"tie": False}
        small = dict(vocab=256, embed=64, heads=2, kv_heads=1, head_dim=64, layers=1)
        moe = dataclasses.replace(moe, **small, mlp=64)
        dense = dataclasses.replace(dense, **small, mlp=128)
    seq, moe_seq, batch = (64, 64, 2) if quick else (4096, 2048, 4)
    return {
        "full_ft": Spec("full_ft", llama1b, batch, seq, "full"),
        "lora": Spec("lora", llama8b, 1, seq, "lora", remat="full"),
        "qlora": Spec("qlora", llama8b, 1, seq, "qlora", remat="full"),
        "moe_tiles": Spec("moe_tiles", _widths(moe), batch, moe_seq, "full",
                          expert_matmul="tiles"),
        "moe_ragged_dot": Spec("moe_ragged_dot", _widths(moe), batch, moe_seq, "full",
                               expert_matmul="ragged_dot"),
        "moe_dense": Spec("moe_dense", _widths(dense), batch, moe_seq, "full"),
    }


def decoder_config(spec: Spec) -> Any:
    """The ``DecoderConfig`` of ``spec``: ``llama3-8b``'s (``mixtral-8x7b``'s with experts)
    with its widths, bf16."""
    import jax.numpy as jnp

    from nnx_shard.models import DecoderConfig, get_config

    m = dict(spec.model)
    widths = dict(vocab=m["vocab"], embed=m["embed"], heads=m["heads"], kv_heads=m["kv_heads"],
                  head_dim=m["head_dim"], mlp=m["mlp"], layers=m["layers"],
                  tie_embeddings=m["tie"], remat=spec.remat, dtype=jnp.bfloat16,
                  param_dtype=jnp.bfloat16)
    if "experts" in m:
        return DecoderConfig.for_model("mixtral", **widths, experts=m["experts"],
                                       top_k=m["top_k"], expert_matmul=spec.expert_matmul)
    return dataclasses.replace(get_config("llama3-8b"), **widths)


def lora_params(spec: Spec) -> int:
    """The adapters' parameters: rank x (fan in + fan out) of q, k, v, o, gate, up, down."""
    m = spec.model
    e, q, kv, f = m["embed"], m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"], m["mlp"]
    per_layer = (e + q) + 2 * (e + kv) + (q + e) + 3 * (e + f)
    return spec.rank * per_layer * m["layers"]


def model_flops(spec: Spec) -> float:
    """Model FLOPs of one step of ``spec`` (the formula of :data:`MFU_FORMULA`).

    >>> s = Spec("x", dict(vocab=10, embed=4, heads=1, kv_heads=1, head_dim=4, mlp=8,
    ...                    layers=1, tie=True), batch=1, seq=2, train="full")
    >>> model_flops(s) == 2 * (6 * decoder_config(s).active_params + 12 * 1 * 2 * 1 * 4)
    True
    """
    cfg = decoder_config(spec)
    m = spec.model
    n = cfg.active_params - (0 if m["tie"] else m["vocab"] * m["embed"])
    attention = 12 * m["layers"] * spec.seq * m["heads"] * m["head_dim"]
    per_token = (6 * n if spec.train == "full"
                 else 4 * n + 6 * lora_params(spec)) + attention
    return float(per_token * spec.tokens)


def hardware(peak_flops: float | None) -> tuple[Any, str]:
    """The planner's profile of this machine's device (``KINDS``), ``peak_flops`` replacing
    its peak; a device with no profile is measured (``calibrate``: float32 matmuls) unless
    ``peak_flops`` is given. Also where the peak comes from."""
    import jax

    from nnx_shard.planner import Hardware
    from nnx_shard.planner import hardware as profile
    from nnx_shard.planner._hardware import calibrate

    kind = jax.devices()[0].device_kind
    name = next((p for k, p in KINDS if k.lower() in kind.lower()), None)
    if peak_flops:
        base = profile(name) if name else Hardware("given", peak_flops, 1e9)
        return base.replace(peak_flops=peak_flops), "--peak-flops"
    if name:
        return profile(name), f"planner profile {name!r}"
    hw = calibrate(1, seconds=0.05)
    return hw, f"measured ({hw.precision} matmuls, no profile for {kind!r})"


def planned_remat(spec: Spec, hw: Any) -> dict[str, Any]:
    """The remat policy ``ns.planner.auto`` ranks first for ``spec``'s full fine-tuning
    on one device (preset ``dp``, AdamW, no NaN guard: the step timed here)."""
    import jax
    from flax import nnx

    from nnx_shard.models import Decoder
    from nnx_shard.planner import NothingFits, auto

    cfg = decoder_config(spec)

    def factory(remat: str = "none") -> Any:
        return Decoder(dataclasses.replace(cfg, remat=remat), rngs=nnx.Rngs(0))

    # What JAX may allocate (a GPU's preallocated share), if smaller than the datasheet's.
    limits = [hw.device_memory, (jax.devices()[0].memory_stats() or {}).get("bytes_limit")]
    known = [int(m) for m in limits if m]
    memory = min(known) if known else None
    try:
        plan = auto(factory, devices=1, batch=spec.batch, seq=spec.seq, hardware=hw,
                    device_memory=memory, strategies=["dp"], optimizer="adamw", guard="off",
                    offload=[], progress=False)
    except NothingFits as e:
        return {"remat": "full", "planner": f"nothing fits ({e}); remat full"}
    best = plan.ranked[0]
    return {"remat": best.remat or "none", "planner": best.label}


def _state_bytes(tree: Any) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(tree))


def jax_row(spec: Spec, hw: Any, rounds: int, steps: int) -> dict[str, Any]:
    """Builds, compiles and times one row: its figures."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import Decoder, lm_loss

    out: dict[str, Any] = {}
    if spec.row == "full_ft":
        out |= planned_remat(spec, hw)
        spec = spec._replace(remat=out["remat"])
    cfg = decoder_config(spec)
    adapters = spec.train != "full"

    strategy = ns.strategies.get("dp")
    mesh = ns.make_mesh({"data": 1}, devices=jax.devices()[:1])
    t0 = time.perf_counter()
    # Built eagerly: jax 0.10's CPU backend gives the int4 arrays of a compiled init
    # (sharded_init) a layout the compiled step then refuses; with --quick the rows' equal
    # shapes share the initializers' compiles.
    with jax.default_device(jax.devices()[0]):
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        if adapters:
            ns.lora(model, spec.rank, 2.0 * spec.rank, targets=ALL,
                    quantize="nf4" if spec.train == "qlora" else None)
    parts: Any = nnx.split(model, nnx.LoRAParam if adapters else nnx.Param, ...)
    graphdef, trained, frozen = parts
    del model
    tx = optax.adamw(1e-5)
    held = {"state": (trained, tx.init(trained))}
    inputs = jax.random.randint(jax.random.key(0), (spec.batch, spec.seq), 0, cfg.vocab)
    batch = {"inputs": inputs, "targets": jnp.roll(inputs, -1, axis=1)}

    def step(state: Any, frozen: Any, batch: dict[str, jax.Array]) -> Any:
        params, moments = state
        loss, grads = jax.value_and_grad(
            lambda p: lm_loss(nnx.merge(graphdef, p, frozen), batch))(params)
        updates, moments = tx.update(grads, moments, params)
        return loss, (optax.apply_updates(params, updates), moments)

    with ns.use(mesh, strategy.rules):
        compiled = jax.jit(step, donate_argnums=0).lower(held["state"], frozen, batch).compile()
        out["compile_s"] = time.perf_counter() - t0

        def run() -> None:
            loss, held["state"] = compiled(held["state"], frozen, batch)
            jax.block_until_ready(loss)

        ms = median_ms(run, rounds, steps)
    mem: Any = compiled.memory_analysis()
    stats = jax.devices()[0].memory_stats() or {}
    flops = model_flops(spec)
    out |= {"status": "ok", "remat": spec.remat, "step_ms": ms,
            "tokens_per_s": spec.tokens / (ms / 1e3), "model_flops_per_step": flops,
            "mfu": flops / (ms / 1e3) / hw.peak_flops,
            "peak_bytes_compiled": int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                       - mem.alias_size_in_bytes + mem.temp_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
            "trained_bytes": _state_bytes(trained), "frozen_bytes": _state_bytes(frozen),
            "peak_bytes_device": stats.get("peak_bytes_in_use"),
            "device_kind": jax.devices()[0].device_kind, "platform": jax.default_backend()}
    return out


def _last_json(text: str) -> dict[str, Any]:
    return json.loads(text.strip().splitlines()[-1])


def _child(cmd: list[str], timeout: float) -> dict[str, Any]:
    """Runs ``cmd``, whose last stdout line is a JSON object; a failure as a status. The
    child preallocates its device memory as JAX does by default (this process does not)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    env |= {"XLA_PYTHON_CLIENT_PREALLOCATE": PREALLOCATE} if PREALLOCATE else {}
    timeout = min(timeout, ROW_LIMIT)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": f"failed: over its {timeout:.0f} s"}
    except OSError as e:
        return {"status": f"not run: {e}"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        return {"status": f"failed ({proc.returncode}): {tail[0][:300]}"}
    try:
        return _last_json(proc.stdout)
    except (ValueError, IndexError):
        return {"status": f"failed: no JSON line in {proc.stdout[-300:]!r}"}


def torch_row(python: str, spec: Spec, compiled: bool, quick: bool,
              timeout: float) -> dict[str, Any]:
    """One row of ``gpu_torch_side.py`` run by ``python``, MFU by :func:`model_flops`."""
    cmd = [python, str(TORCH_SIDE), "--spec", json.dumps(spec._asdict())]
    cmd += (["--compile"] if compiled else []) + (["--quick"] if quick else [])
    return _child(cmd, timeout)


def _fmt(row: dict[str, Any], key: str, scale: float = 1.0, digits: int = 1) -> str:
    value = row.get(key)
    return "" if value is None else f"{value / scale:,.{digits}f}"


def targets(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The three targets: the figure, the goal, and whether it is met (None: not measured)."""
    def get(row: str, framework: str = "nnx_shard", variant: str = "jit") -> dict[str, Any]:
        return next((r for r in rows if r["row"] == row and r["framework"] == framework
                     and r["variant"] == variant and r["status"] == "ok"), {})

    def peak(r: dict[str, Any]) -> float | None:
        # The compiled step's: the device peak of the NF4 row's process includes its bf16
        # base, built whole before it is quantized.
        return r.get("peak_bytes_compiled")

    full, lora, qlora = get("full_ft"), get("lora"), get("qlora")
    torch_lora = [r["tokens_per_s"] for r in rows if r["row"] == "lora"
                  and r["framework"] != "nnx_shard" and r["status"] == "ok"]
    out: dict[str, dict[str, Any]] = {}
    mfu = full.get("mfu")
    out["full_ft"] = {"goal": "MFU >= 40%", "value": mfu, "met": None if mfu is None
                      else mfu >= 0.40}
    speed = lora["tokens_per_s"] / max(torch_lora) if lora and torch_lora else None
    out["lora"] = {"goal": "tokens/s >= 1.5x transformers+peft's (its best variant)",
                   "value": speed, "met": None if speed is None else speed >= 1.5}
    q, bf16 = peak(qlora), peak(lora)
    ratio = q / bf16 if q and bf16 else None
    out["qlora"] = {"goal": "peak memory (compiled) <= 0.4x the bf16 LoRA's", "value": ratio,
                    "met": None if ratio is None else ratio <= 0.4}
    return out


def table(rows: list[dict[str, Any]], goals: dict[str, dict[str, Any]]) -> str:
    """The Markdown table of ``rows``, the targets beside their rows, and the notes."""
    def target(r: dict[str, Any]) -> str:
        goal = goals.get(r["row"])
        if r["framework"] != "nnx_shard" or r["variant"] != "jit" or goal is None:
            return ""
        value = goal["value"]
        shown = "not measured" if value is None else (
            f"{value:.1%}" if r["row"] == "full_ft" else f"{value:.2f}x")
        return f"{goal['goal']}: {shown}" + ("" if goal["met"] is None
                                             else (" (met)" if goal["met"] else " (not met)"))

    lines = ["| row | framework | variant | remat | tokens/s | MFU | peak MiB (compiled) "
             "| peak MiB (device) | target | status |", "|" + "---|" * 10]
    for r in rows:
        mfu = r.get("mfu")
        lines.append("| " + " | ".join([
            r["row"], r["framework"], r["variant"], str(r.get("remat", "")),
            _fmt(r, "tokens_per_s"), "" if mfu is None else f"{mfu:.1%}",
            _fmt(r, "peak_bytes_compiled", 2**20, 0), _fmt(r, "peak_bytes_device", 2**20, 0),
            target(r), r["status"]]) + " |")
    return "\n".join(lines)


def run_jax_rows(args: argparse.Namespace, all_specs: dict[str, Spec],
                 deadline: float) -> list[dict[str, Any]]:
    """Every JAX row: in this process (``--quick`` without ``--isolate``), else each in a
    child process of its own (its device peak is its own, its memory freed after it)."""
    rows = []
    for name in ROWS:
        base = {"row": name, "framework": "nnx_shard", "variant": "jit",
                "remat": all_specs[name].remat}
        left = deadline - time.perf_counter()
        if left < 20:
            rows.append(base | {"status": "not run: over the time budget"})
            continue
        if not args.isolate:
            hw, source = args.hw
            t0, c0 = time.perf_counter(), time.process_time()
            got = jax_row(all_specs[name], hw, 1, 1) | {"peak_flops": hw.peak_flops,
                                                        "peak_source": source}
            got["cpu_s"] = time.process_time() - c0
            got["wall_s"] = time.perf_counter() - t0
        else:
            cmd = [sys.executable, __file__, "--row", name, *_passed_flags(args)]
            got = _child(cmd, left)
        rows.append(base | got)
        print(f"  {name}: {rows[-1]['status']}", flush=True)
    return rows


def _passed_flags(args: argparse.Namespace) -> list[str]:
    return ((["--peak-flops", str(args.peak_flops)] if args.peak_flops else [])
            + (["--quick"] if args.quick else []))


def run_torch_rows(args: argparse.Namespace, all_specs: dict[str, Spec],
                   deadline: float, peak_flops: float | None) -> list[dict[str, Any]]:
    """The transformers + peft rows, each in a child ``--torch-python``."""
    rows = []
    for name, compiled in TORCH_ROWS:
        spec = all_specs[name]
        base = {"row": name, "framework": "transformers" + ("" if spec.train == "full"
                                                            else "+peft"),
                "variant": "torch.compile" if compiled else "eager",
                "remat": "gradient checkpointing" if spec.remat == "full" else "none"}
        left = deadline - time.perf_counter()
        if not args.torch_python:
            got: dict[str, Any] = {"status": "not run: no --torch-python"}
        elif left < 20:
            got = {"status": "not run: over the time budget"}
        else:
            got = torch_row(args.torch_python, spec, compiled, args.quick, left)
        if got.get("status") == "ok":
            flops = model_flops(spec)
            got["model_flops_per_step"] = flops
            got["mfu"] = flops / (got["step_ms"] / 1e3) / peak_flops if peak_flops else None
        rows.append(base | got)
        if args.torch_python:
            print(f"  torch {name} ({base['variant']}): {rows[-1]['status']}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes on the CPU, every row in this process (seconds)")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="where the JSON goes (the Markdown table beside it, .md)")
    ap.add_argument("--torch-python", metavar="PATH",
                    help="a Python with torch, transformers and peft for the torch rows")
    ap.add_argument("--peak-flops", type=float,
                    help="peak bf16 FLOP/s per device for MFU (default: the planner's "
                    "profile of the detected device)")
    ap.add_argument("--budget", type=float, default=450.0,
                    help="seconds for the whole run; rows past it are reported not run")
    ap.add_argument("--isolate", action="store_true",
                    help="each JAX row in a process of its own (the default without --quick)")
    ap.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)  # a child's one row
    args = ap.parse_args()
    args.isolate = args.isolate or not args.quick
    if args.quick:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        # Figures of tiny shapes mean nothing: compile fast (tests/conftest.py's flags,
        # those both jaxlib 0.10 and 0.12 know), which cuts --quick's CPU time ~4x.
        flags = os.environ.get("XLA_FLAGS", "")
        for flag in QUICK_XLA_FLAGS:
            if flag.split("=")[0] not in flags:
                flags += " " + flag
        os.environ["XLA_FLAGS"] = flags.strip()
    if args.isolate and not args.row:
        # The parent holds no device memory the rows' processes then lack (jax may
        # initialise its backend here: model_flops reads configs).
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    start = time.perf_counter()
    deadline = start + args.budget
    all_specs = specs(args.quick)
    if args.row:  # a child: one row, one JSON line
        hw, source = hardware(args.peak_flops)
        rounds, steps = (1, 1) if args.quick else (3, 5)
        print(json.dumps(jax_row(all_specs[args.row], hw, rounds, steps)
                         | {"peak_flops": hw.peak_flops, "peak_source": source}))
        return
    if not args.isolate:
        args.hw = hardware(args.peak_flops)
    print(f"JAX rows ({'one process each' if args.isolate else 'in this process'}):",
          flush=True)
    rows = run_jax_rows(args, all_specs, deadline)
    peak = next((r["peak_flops"] for r in rows if r.get("peak_flops")), None)
    rows += run_torch_rows(args, all_specs, deadline, peak)
    goals = targets(rows)
    done = [r for r in rows if r["framework"] == "nnx_shard" and r["status"] == "ok"]
    device = {"device_kind": done[0]["device_kind"] if done else None,
              "platform": done[0]["platform"] if done else None,
              "peak_flops": peak, "peak_source": done[0]["peak_source"] if done else None}
    md = table(rows, goals)
    notes = [
        f"One training step a row, bf16, AdamW; device: {device['device_kind']} "
        f"({device['platform']}), peak {peak or 0:.3g} FLOP/s ({device['peak_source']}).",
        MFU_FORMULA,
        "Peak MiB (compiled): memory_analysis() arguments + outputs - aliased + temporaries "
        "of the compiled step (the QLoRA target's figure); (device): "
        "device.memory_stats()['peak_bytes_in_use'] of the row's process (GPU), the model's "
        "build included (the NF4 row's bf16 base before it is quantized); torch side: "
        "torch.cuda.max_memory_allocated() over the timed steps.",
        "Targets are printed, not asserted." + (" --quick: tiny shapes on the CPU, figures "
                                                "meaningless." if args.quick else ""),
    ]
    text = md + "\n\n" + "\n".join(f"- {n}" for n in notes)
    print()
    print(text)
    shapes = {name: s._asdict() for name, s in all_specs.items()}
    write_json(args.out, {"quick": args.quick, "device": device, "rows": rows,
                          "targets": goals, "shapes": shapes, "mfu_formula": MFU_FORMULA,
                          "seconds": time.perf_counter() - start,
                          "provenance": provenance() | {
                              "device_kind": device["device_kind"],
                              "platform": device["platform"]}})
    args.out.with_suffix(".md").write_text(text + "\n")
    print(f"wrote {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
