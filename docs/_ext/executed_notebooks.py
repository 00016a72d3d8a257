"""MkDocs hook: the notebook pages show the outputs of the test suite's run of them.

The notebooks are stored without outputs. ``tests/test_notebooks.py::test_notebook_runs`` (the
slow tier, which CI runs before the docs build) executes each one and, when it passes, writes the
executed copy to ``build/notebooks/<name>.ipynb`` with the hash of the stored notebook's cells in
its metadata. At build time this hook points each notebook page at its executed copy when that
hash is the stored notebook's current one, so mkdocs-jupyter (``execute: false``) renders the
outputs of a real run; a missing copy, or one of an older version of the notebook, is ignored and
the stored notebook is rendered without outputs. Only the file read changes: the page's path, URL
and nav entry stay the stored notebook's.

mkdocs-jupyter reads a notebook page from ``page.file.abs_src_path`` (to render it, for its TOC,
its cache key and the downloadable copy), and matches that path against its ``include`` patterns:
the folder is named ``notebooks`` so that ``notebooks/*.ipynb`` matches the executed copies too.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# Ignored by git (build/ in .gitignore); rebuilt by every run of the slow notebook tests.
EXECUTED_DIR = ROOT / "build" / "notebooks"
STAMP_KEY = "nnx_shard_source_sha256"


def _text(source: str | list[str]) -> str:
    # On disk a cell's source may be a list of lines; nbformat.read joins them.
    return source if isinstance(source, str) else "".join(source)


def source_hash(notebook: Mapping[str, Any]) -> str:
    """sha256 of a notebook's cells (type and source, not outputs), as stored.

    Markdown cells count too: the executed copy's text is what the page shows.

    Example:
        >>> a = {"cells": [{"cell_type": "code", "source": ["x = 1\\n", "x"], "outputs": []}]}
        >>> b = {"cells": [{"cell_type": "code", "source": "x = 1\\nx", "outputs": ["1"]}]}
        >>> source_hash(a) == source_hash(b)
        True
    """
    cells = [[c["cell_type"], _text(c["source"])] for c in notebook["cells"]]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()


def save_executed(executed: Mapping[str, Any], *, name: str, stamp: str,
                  executed_dir: Path = EXECUTED_DIR) -> Path:
    """Write an executed notebook as ``executed_dir/name``, stamped with ``stamp``, the
    ``source_hash`` of the stored notebook it was run from.

    Written to a temporary file, then renamed: a docs build running beside the tests never reads
    half a notebook.

    Example:
        >>> import tempfile
        >>> nb = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_executed(nb, name="a.ipynb", stamp=source_hash(nb), executed_dir=Path(d)).name
        'a.ipynb'
    """
    executed_dir.mkdir(parents=True, exist_ok=True)
    executed = {**executed, "metadata": {**executed.get("metadata", {}), STAMP_KEY: stamp}}
    fd, tmp = tempfile.mkstemp(dir=executed_dir, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(executed, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would carry over to the copy the site serves
    target = executed_dir / name
    os.replace(tmp, target)
    return target


def executed_copy(stored: Path, executed_dir: Path = EXECUTED_DIR) -> Path | None:
    """The executed copy of the stored notebook ``stored``, or None when there is none for its
    current cells (never run, or run before the notebook last changed).

    Example:
        >>> executed_copy(Path("notebooks/none.ipynb"), Path("no/such/folder")) is None
        True
    """
    candidate = executed_dir / stored.name
    try:
        executed = json.loads(candidate.read_text(encoding="utf-8"))
        current = source_hash(json.loads(stored.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return candidate if executed.get("metadata", {}).get(STAMP_KEY) == current else None


def on_files(files: Any, config: Any) -> Any:
    """Point each notebook page at its fresh executed copy, if any."""
    for file in files:
        if file.src_uri.startswith("notebooks/") and file.src_uri.endswith(".ipynb"):
            executed = executed_copy(Path(file.abs_src_path))
            if executed is not None:
                file.abs_src_path = str(executed)
    return files
