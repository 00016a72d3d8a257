"""The notebooks run top to bottom on 8 simulated CPU devices, and are stored without outputs.

Each run that passes leaves its executed copy in ``build/notebooks/`` for the docs site
(``docs/_ext/executed_notebooks.py``).
"""

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from nnx_shard._simulated import simulated_env
from tests._shared import load_file

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _executed_notebooks() -> ModuleType:
    return load_file(ROOT / "docs" / "_ext" / "executed_notebooks.py", "executed_notebooks")


def test_the_six_notebooks_exist():
    assert [p.name[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_", "04_", "05_", "06_"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "a notebook with no code"
    assert all(not c.outputs and c.execution_count is None for c in code), (
        f"{path.name} has outputs; strip them before committing"
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    ext = _executed_notebooks()
    # Hashed before the run: the copy is stamped with the version of the notebook that ran.
    stamp = ext.source_hash(json.loads(path.read_text(encoding="utf-8")))
    nb = nbformat.read(path, as_version=4)
    # The kernel must be this interpreter (the project's environment), not another Python 3.
    nb.cells.insert(0, nbformat.v4.new_code_cell(
        f"import sys\nassert sys.prefix == {sys.prefix!r}, sys.prefix"
    ))
    env = simulated_env(8)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=240, resources={"metadata": {"path": str(tmp_path)}}
    )
    # Any cell that raises fails the test (CellExecutionError names the cell and the error).
    client.execute(env=env)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("8 devices" in o.get("text", "") for o in outputs)
    # The site renders this run's outputs (without the cell above, numbered from 1) instead of
    # the empty cells.
    del nb.cells[0]
    for cell in nb.cells:
        for item in [cell, *cell.get("outputs", [])]:
            if item.get("execution_count"):
                item["execution_count"] -= 1
    ext.save_executed(nb, name=path.name, stamp=stamp)


def _notebook(*sources: str) -> dict[str, Any]:
    cells: list[dict[str, Any]] = [{"cell_type": "code", "source": s, "metadata": {}, "outputs": [],
              "execution_count": None} for s in sources]
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def test_site_renders_an_executed_copy_of_the_current_notebook_only(tmp_path):
    ext = _executed_notebooks()
    stored = tmp_path / "notebooks" / "01_x.ipynb"
    stored.parent.mkdir()
    stored.write_text(json.dumps(_notebook("x = 1", "print(x)")))
    executed_dir = tmp_path / "build" / "notebooks"
    assert ext.executed_copy(stored, executed_dir) is None  # never run

    run = _notebook("x = 1", "print(x)")
    run["cells"][1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "1\n"}]
    stamp = ext.source_hash(json.loads(stored.read_text()))
    copy = ext.save_executed(run, name=stored.name, stamp=stamp, executed_dir=executed_dir)
    assert copy == executed_dir / "01_x.ipynb"
    assert ext.executed_copy(stored, executed_dir) == copy
    assert json.loads(copy.read_text())["cells"][1]["outputs"][0]["text"] == "1\n"

    # The notebook changed after the run (code or text): its outputs are stale, the stored one
    # is rendered.
    stored.write_text(json.dumps(_notebook("x = 2", "print(x)")))
    assert ext.executed_copy(stored, executed_dir) is None
    edited = _notebook("x = 1", "print(x)")
    edited["cells"].append({"cell_type": "markdown", "source": "New text.", "metadata": {}})
    stored.write_text(json.dumps(edited))
    assert ext.executed_copy(stored, executed_dir) is None
    # A copy with no stamp, or not a notebook, is never picked.
    stored.write_text(json.dumps(_notebook("x = 1", "print(x)")))
    assert ext.executed_copy(stored, executed_dir) == copy
    copy.write_text(json.dumps(_notebook("x = 1", "print(x)")))
    assert ext.executed_copy(stored, executed_dir) is None
    copy.write_text("{not json")
    assert ext.executed_copy(stored, executed_dir) is None


def test_mkdocs_jupyter_renders_the_executed_copies():
    # mkdocs-jupyter converts a page only when its file's path matches one of its include
    # patterns; the hook swaps in the executed copy's path, so it must match too.
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    ext = _executed_notebooks()
    assert "docs/_ext/executed_notebooks.py" in config["hooks"]
    (jupyter,) = [p["mkdocs-jupyter"] for p in config["plugins"]
                  if isinstance(p, dict) and "mkdocs-jupyter" in p]
    assert jupyter["execute"] is False
    for path in NOTEBOOKS:
        executed = ext.EXECUTED_DIR / path.name
        assert any(executed.match(p) for p in jupyter["include"]), executed
        assert any(path.match(p) for p in jupyter["include"]), path
