"""benchmarks/gpu.py --quick: the GPU suite's code run on the CPU with tiny shapes, in
this process (torch is never imported here: its rows say they were not run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests._shared import load_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"


@pytest.mark.slow
def test_quick_run_writes_every_row_with_its_figures_and_provenance(tmp_path, monkeypatch):
    gpu = load_file(SCRIPT, "bench_gpu")
    out = tmp_path / "gpu.json"
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # gpu.py reuses moe_cost.configs
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--quick", "--out", str(out)])
    gpu.main()
    got = json.loads(out.read_text())
    quick = gpu.specs(True)
    rows = {(r["row"], r["framework"], r["variant"]): r for r in got["rows"]}
    for name in gpu.ROWS:
        row = rows[(name, "nnx_shard", "jit")]
        assert row["status"] == "ok", row
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] <= 1, row
        assert row["peak_bytes_compiled"] > 0 and row["temp_bytes"] >= 0, row
        assert row["model_flops_per_step"] == gpu.model_flops(quick[name])
    # The MFU formula's parameter counts are the models': bf16 base, float32 adapters.
    full = rows[("full_ft", "nnx_shard", "jit")]
    assert full["trained_bytes"] == 2 * gpu.decoder_config(quick["full_ft"]).num_params
    assert rows[("lora", "nnx_shard", "jit")]["trained_bytes"] == 4 * gpu.lora_params(
        quick["lora"])
    # The planner chose the full fine-tuning's remat (on the CPU nothing caps memory).
    assert rows[("full_ft", "nnx_shard", "jit")]["planner"] == "dp data=1 remat=none mb=1"
    assert rows[("lora", "nnx_shard", "jit")]["remat"] == "full"
    torch_rows = [r for r in got["rows"] if r["framework"] != "nnx_shard"]
    assert len(torch_rows) == len(gpu.TORCH_ROWS)
    assert {r["status"] for r in torch_rows} == {"not run: no --torch-python"}
    prov = got["provenance"]
    assert prov["versions"]["jax"] and prov["versions"]["flax"]
    assert prov["device_kind"] == "cpu" and prov["platform"] == "cpu"
    assert "--quick" in prov["command"] and str(out) in prov["command"]
    assert set(got["targets"]) == {"full_ft", "lora", "qlora"}
    assert got["targets"]["lora"]["value"] is None  # no torch rows to compare with
    table = out.with_suffix(".md").read_text()
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + len(gpu.ROWS) + len(gpu.TORCH_ROWS)  # header + a line a row
    assert "6 N + 12 L s h d" in table and "not run: no --torch-python" in table
