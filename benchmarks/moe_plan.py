"""The planner's formula against XLA's compiled bytes for the mixtures of experts on 64 devices.

``nnx-shard plan`` of Mixtral-8x7B and Qwen3-30B-A3B (bfloat16, scanned layers, AdamW,
``--remat full``) under ``fsdp_ep`` and ``ep``, at the plan's default batch and at a small
one (64 x 256, where the weights dominate): the formula's total per device, XLA's total
per device for the same step compiled on 64 simulated CPU devices (the ``compiled``
block of ``plan --json``), and their ratio. The planner guide quotes these ratios.

Run (about two minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/moe_plan.py

Results go to ``benchmarks/results/moe_plan.json``; ``--quick`` runs Mixtral under
``fsdp_ep`` on ``data=8,expert=8`` at the default batch only.
"""

from __future__ import annotations

import os

from _common import bytes_parser, machine, print_table, simulated_cpu, write_json

os.environ.update(simulated_cpu(64))  # before jax is imported

import contextlib
import io
import json
from pathlib import Path

from nnx_shard import cli

RESULTS = Path(__file__).resolve().parent / "results" / "moe_plan.json"
CASES = (("mixtral-8x7b", "fsdp_ep", "data=8,expert=8"),
         ("mixtral-8x7b", "fsdp_ep", "data=16,expert=4"),
         ("qwen3-30b-a3b", "fsdp_ep", "data=8,expert=8"),
         ("mixtral-8x7b", "ep", "data=8,expert=8"))
SMALL = ("--batch", "64", "--seq", "256")
GIB = 2**30


def plan(model: str, strategy: str, mesh: str, extra: tuple[str, ...]) -> dict:
    """One ``nnx-shard plan --json`` run: its formula and compiled totals per device."""
    out = io.StringIO()
    argv = ["plan", "--model", model, "--strategy", strategy, "--mesh", mesh, "--remat",
            "full", "--json", *extra]
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    if code not in (0, 1):  # 1: does not fit the default device memory, still measured
        raise SystemExit(f"nnx-shard {' '.join(argv)} exited with {code}")
    result = json.loads(out.getvalue())
    formula, compiled = result["bytes_per_device"]["total"], result["compiled"]["total"]
    return {"model": model, "strategy": strategy, "mesh": mesh,
            "batch": result.get("batch"), "seq": result.get("seq"),
            "command": "nnx-shard " + " ".join(argv),
            "formula": formula, "compiled": compiled, "ratio": formula / compiled}


def main() -> None:
    args = bytes_parser(__doc__, "Mixtral fsdp_ep data=8,expert=8, default batch only",
                        RESULTS).parse_args()
    cases = CASES[:1] if args.quick else CASES
    sizes = ((),) if args.quick else ((), SMALL)
    rows = [plan(model, strategy, mesh, extra) for model, strategy, mesh in cases
            for extra in sizes]
    print(f"\n{machine()}; per-device GiB, formula / XLA's compiled total\n")
    print_table(["model", "strategy", "mesh", "batch x seq", "formula", "compiled", "ratio"],
                [[r["model"], r["strategy"], r["mesh"], f"{r['batch']} x {r['seq']}",
                  f"{r['formula'] / GIB:.2f}", f"{r['compiled'] / GIB:.2f}",
                  f"{r['ratio']:.2f}"] for r in rows])
    write_json(args.out, {"config": {"devices": 64, "remat": "full", "optimizer": "adamw"},
                          "rows": rows})


if __name__ == "__main__":
    main()
