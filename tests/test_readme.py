"""README.md's Python examples run as written.

Every ```python block of README.md is executed in order, in one namespace (a later block may use
what an earlier one defined, as a reader following the page would), in a fresh process on 8
simulated CPU devices, inside a temporary directory (the examples write checkpoints there).
tests/test_docs.py runs the documentation's pages the same way, one process per page.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests._page_runner import run_page
from tests.conftest import needs_devices

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first code line, code) of every fenced python block, indented ones included."""
    blocks = []
    for m in re.finditer(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```", text, re.S | re.M):
        indent = m.group(1)
        code = "\n".join(line.removeprefix(indent) for line in m.group(2).splitlines())
        line = text.count("\n", 0, m.start()) + 2
        blocks.append((line, code))
    return blocks


def run_blocks(page: Path, tmp_path: Path, timeout: float = 600) -> None:
    """Runs the page's python blocks in order in one namespace, in a fresh process on 8
    simulated devices inside ``tmp_path`` (forked from a server that imported the libraries
    once: tests/_page_runner.py); fails with the failing block's traceback."""
    blocks = python_blocks(page.read_text())
    assert blocks, f"{page} has no python block"
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    status, out = run_page(tmp_path / "blocks.json", str(page.relative_to(ROOT)), tmp_path,
                           timeout)
    assert status == 0 and "ALL BLOCKS RAN" in out, out[-6000:]


def test_python_blocks_are_found():
    # README keeps the quickstart; the guides under docs/ hold the rest (tests/test_docs.py).
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 1
    assert all("nnx_shard" in code or "ns." in code for _, code in blocks)
    assert any("ns.Trainer(" in code and "ns.restore(" in code for _, code in blocks)


@pytest.mark.slow
@needs_devices(8)
def test_readme_python_blocks_run_as_written(tmp_path):
    run_blocks(README, tmp_path)
