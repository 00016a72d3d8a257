"""benchmarks/generate.py's comparison with transformers: what it reports when
there is no Python to run transformers with, and how it counts equal tokens
(torch is never imported here: the reference side runs in its own process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from tests._shared import load_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "generate.py"


def _module():  # type: ignore[no-untyped-def]
    return load_file(SCRIPT, "bench_generate")


def test_without_a_transformers_python_the_comparison_is_skipped_by_name(tmp_path):
    missing = tmp_path / "no-python"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "hf", "--hf-python",
                           str(missing)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "skipping the comparison with transformers" in proc.stdout
    assert str(missing) in proc.stdout and "--hf-python" in proc.stdout


def test_a_python_without_torch_is_skipped_with_its_import_error(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\n"
                      "exit 1\n")
    python.chmod(0o755)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "hf", "--hf-python",
                           str(python)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "cannot import torch and transformers" in proc.stdout
    assert "No module named 'torch'" in proc.stdout


def test_agreement_counts_equal_rows_and_the_first_difference():
    ours = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    theirs = np.array([[1, 2, 3, 4], [5, 6, 0, 8], [9, 0, 9, 9]])
    got = _module()._agreement(ours, theirs)
    assert got["rows_equal"] == 1 and got["rows"] == 3
    assert got["first_difference_at"] == 1
    assert got["tokens_equal_before_first_difference"] == (4 + 2 + 1) / 12


def test_agreement_of_equal_tokens_has_no_difference():
    tokens = np.arange(12).reshape(3, 4)
    got = _module()._agreement(tokens, tokens.copy())
    assert got == {"rows_equal": 3, "rows": 3, "first_difference_at": None,
                   "tokens_equal_before_first_difference": 1.0}
