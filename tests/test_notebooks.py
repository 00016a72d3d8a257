"""The notebooks run top to bottom on 8 simulated CPU devices, and are stored without outputs."""

import sys
from pathlib import Path

import pytest

from nnx_shard._simulated import simulated_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


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
