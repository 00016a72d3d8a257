"""The documentation site: its pages exist and are in the nav, every public name has a reference
page, README stays short and its links resolve, and every ```python block of every page runs.

The site itself is built by ``mkdocs build --strict`` (``.ci/docs``; here the slow
``test_site_builds_strictly``, skipped where the ``docs`` extra is not installed).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import nnx_shard
from tests._shared import load_file
from tests.conftest import needs_devices
from tests.test_readme import README, ROOT, python_blocks, run_blocks

DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"
# One page per README section that moved; each must hold at least one python block that runs.
GUIDES = [
    "annotate", "rules", "sharded-init", "training", "strategies", "your-model", "async-tp",
    "pipeline", "context", "attention", "checkpoints", "pretrained", "fine-tuning", "lora",
    "preference",
    "generation", "multi-host", "slow-links", "planner", "memory",
]
GUIDES_WITHOUT_PYTHON = ["cli"]  # shell commands only


def _load(name: str) -> ModuleType:
    return load_file(DOCS / "_ext" / f"{name}.py", name)


def _nav_files(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [f for item in nav for f in _nav_files(item)]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in _nav_files(value)]
    return []


def _nav() -> list[object]:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(MKDOCS_YML.read_text())["nav"]


def _pages_with_python() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md")
                  if "_ext" not in p.parts and python_blocks(p.read_text()))


def test_every_nav_entry_exists_and_every_page_is_in_the_nav():
    listed = _nav_files(_nav())
    assert "index.md" in listed and "getting-started.md" in listed
    missing = [f for f in listed if not (DOCS / f).exists()]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")
             if "_ext" not in p.parts and p.parent.name != "notebooks"}
    assert not pages - set(listed) - {"api/index.md"}, "pages missing from the nav"
    for guide in GUIDES + GUIDES_WITHOUT_PYTHON:
        assert f"guides/{guide}.md" in listed, guide
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert [f"notebooks/{n}" for n in notebooks] == [f for f in listed if f.endswith(".ipynb")]


def test_every_guide_has_python_blocks_that_name_the_package():
    for guide in GUIDES:
        blocks = python_blocks((DOCS / "guides" / f"{guide}.md").read_text())
        assert blocks, f"guides/{guide}.md has no python block"
        assert any("nnx_shard" in code for _, code in blocks), (
            f"guides/{guide}.md's blocks never import nnx_shard: the page is not self-contained"
        )
    for guide in GUIDES_WITHOUT_PYTHON:
        assert (DOCS / "guides" / f"{guide}.md").exists()
    # The README sections moved here with their 20 examples, and the pages their set-up blocks.
    assert sum(len(python_blocks(p.read_text())) for p in _pages_with_python()) >= 25


def test_every_public_name_has_a_reference_page():
    api = _load("api_pages")
    pages = api.reference()
    for name in nnx_shard.__all__:
        text = pages.get(f"api/{name}.md")
        assert text is not None, f"nnx_shard.{name} has no API page"
        assert f"::: nnx_shard.{name}\n" in text
        obj = getattr(nnx_shard, name)
        if inspect.ismodule(obj):
            for member in getattr(obj, "__all__", []):
                assert f"        - {member}\n" in text, f"nnx_shard.{name}.{member} not rendered"
    nav = [{"API reference": []}]
    api.on_config({"nav": nav})
    assert set(_nav_files(nav)) == {"api/index.md"} | {f"api/{n}.md" for n in nnx_shard.__all__}
    overview = (DOCS / "api" / "index.md").read_text()
    assert not [n for n in nnx_shard.__all__ if f"]({n}.md)" not in overview], (
        "docs/api/index.md's table does not link every public name"
    )


def test_a_name_added_to_all_gets_its_page(monkeypatch):
    api = _load("api_pages")
    monkeypatch.setattr(nnx_shard, "__all__", [*nnx_shard.__all__, "use_later"])
    monkeypatch.setattr(nnx_shard, "use_later", nnx_shard.use, raising=False)
    assert "::: nnx_shard.use_later\n" in api.reference()["api/use_later.md"]


def test_docstrings_become_markdown():
    pytest.importorskip("griffe")
    to_markdown = _load("griffe_rst").to_markdown
    assert to_markdown("See :func:`~nnx_shard._mesh.use` and :class:`nnx_shard.Rules`.") == (
        "See `use` and `nnx_shard.Rules`."
    )
    assert to_markdown("On disk::\n\n    a/b") == "On disk:\n\n    a/b"
    assert to_markdown("Text.\n\n>>> 1 + 1\n2\n\nMore.") == (
        "Text.\n\n```pycon\n>>> 1 + 1\n2\n```\n\nMore."
    )
    table = "====  ==========\nname  what\n====  ==========\ndp    all-reduce [1]_\n      over data\n====  ==========\n"
    assert to_markdown(table) == (
        "| name | what |\n| --- | --- |\n| dp | all-reduce [1] over data |"
    )
    grouped = to_markdown("Args:\n  mesh, rules: where batches go.\n  k: steps.")
    assert grouped == (
        "Args:\n  mesh: see ``rules``.\n  rules: (with ``mesh``) where batches go.\n  k: steps."
    )


def test_readme_is_short_and_keeps_its_contracts():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    # .ci/run reads the test command from between these markers.
    command = text.split("<!-- tests:begin -->", 1)[1].split("<!-- tests:end -->", 1)[0]
    assert '-m "not slow"' in command and ".[dev]" in command
    assert 'pip install -e ".[plot]" && .venv/bin/nnx-shard demo' in text
    slow = text.split("<!-- slow:begin -->", 1)[1].split("<!-- slow:end -->", 1)[0]
    assert "-m slow" in slow and "not slow" not in slow
    ci = (README.parent / ".ci" / "run").read_text()
    # Each tier runs README's command, the quick tier at both ends of the supported versions.
    assert "<!-- $1:begin -->" in ci
    # (the slow tier runs in the background, its output to a log)
    assert {"run_tier tests", "run_tier tests .venv-newest", "run_tier slow"} <= {
        line.strip().split(" >", 1)[0] for line in ci.splitlines()}
    # docs/getting-started.md includes README's set-up and quickstart sections.
    started = (DOCS / "getting-started.md").read_text()
    for section in re.findall(r'--8<-- "README\.md:(\w+)"', started):
        assert f"--8<-- [start:{section}]" in text and f"--8<-- [end:{section}]" in text


def test_readme_links_resolve():
    text = README.read_text()
    headings = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", text, re.M)}
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        if target.startswith("#"):
            assert target[1:] in headings, f"README links to a missing heading {target}"
        else:
            assert (ROOT / target.split("#", 1)[0]).exists(), f"README links to missing {target}"
    guides = re.findall(r"\(docs/guides/([\w-]+)\.md\)", text)
    assert sorted(set(guides)) == sorted(GUIDES + GUIDES_WITHOUT_PYTHON)


@pytest.mark.slow
@needs_devices(8)
@pytest.mark.parametrize(
    "page", _pages_with_python(), ids=lambda p: str(p.relative_to(DOCS)).removesuffix(".md"),
)
def test_docs_page_python_blocks_run_as_written(page, tmp_path):
    run_blocks(page, tmp_path)


@pytest.mark.slow
def test_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    for name in nnx_shard.__all__:
        html = (site / "api" / name / "index.html").read_text()
        obj = getattr(nnx_shard, name)
        members = getattr(obj, "__all__", []) if inspect.ismodule(obj) else [None]
        for member in members:
            anchor = f"nnx_shard.{name}" + (f".{member}" if member else "")
            assert f'id="{anchor}"' in html, f"{anchor} has no entry in the built reference"
    assert (site / "guides" / "sharded-init" / "index.html").exists()
    assert (site / "notebooks" / "01_annotate_and_rules" / "index.html").exists()
