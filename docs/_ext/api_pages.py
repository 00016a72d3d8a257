"""MkDocs hook: the API reference, generated from ``nnx_shard.__all__``.

One page per public name: a function or class is rendered whole; a module (``hf``,
``strategies``, ``models``, ...) with every name of its own ``__all__``. The pages are made at
build time, so a name added to ``__all__`` gets its page without an edit here, and a name whose
docstring cannot be found fails ``mkdocs build --strict``. ``tests/test_docs.py`` checks that
every public name has an entry.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE = "nnx_shard"
API_DIR = "api"
GUIDES = Path(__file__).resolve().parents[1] / "guides"


def guides_using(name: str) -> list[tuple[str, str]]:
    """(title, path under docs/) of each guide whose text uses ``nnx_shard.<name>``
    (``ns.<name>``, ``nnx_shard.<name>``, or imported from the package or the module)."""
    word = re.escape(name)
    used = re.compile(rf"\bns\.{word}\b|\bnnx_shard\.{word}\b"
                      rf"|from nnx_shard import [^\n]*\b{word}\b")
    found = []
    for path in sorted(GUIDES.glob("*.md")):
        text = path.read_text()
        if used.search(text):
            title = text.splitlines()[0].lstrip("# ").strip()
            found.append((title, f"guides/{path.name}"))
    return found


def public_names() -> list[str]:
    """``nnx_shard.__all__``, in its order."""
    return list(importlib.import_module(PACKAGE).__all__)


def module_members(module: ModuleType) -> list[str]:
    """The names a public module documents: its ``__all__``, else its public callables."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items()
                 if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__]
    return list(names)


def page(name: str) -> tuple[str, str]:
    """(path under docs/, Markdown) of the reference page of ``nnx_shard.<name>``."""
    obj = getattr(importlib.import_module(PACKAGE), name)
    lines = [f"# `{PACKAGE}.{name}`", ""]
    guides = guides_using(name)
    if guides:
        lines += ["Guides: " + ", ".join(f"[{t}](../{p})" for t, p in guides) + ".", ""]
    if inspect.ismodule(obj):
        members = module_members(obj)
        lines += [
            f"`import {PACKAGE} as ns` then `ns.{name}.<name>`; the module's public names: "
            + ", ".join(f"[`{m}`](#{PACKAGE}.{name}.{m})" for m in members) + ".",
            "",
            f"::: {PACKAGE}.{name}",
            "    options:",
            "      show_root_heading: false",
            "      members:",
            *[f"        - {m}" for m in members],
        ]
    else:
        lines += [f"::: {PACKAGE}.{name}", "    options:", "      show_root_heading: true"]
    return f"{API_DIR}/{name}.md", "\n".join(lines) + "\n"


def reference() -> dict[str, str]:
    """Every generated page: path -> Markdown."""
    return dict(page(name) for name in public_names())


def _nav_entries() -> list[Any]:
    mod = importlib.import_module(PACKAGE)
    names = public_names()
    objects = [n for n in names if not inspect.ismodule(getattr(mod, n))]
    modules = [n for n in names if inspect.ismodule(getattr(mod, n))]
    return [
        {"Overview": f"{API_DIR}/index.md"},
        {"Classes and functions": [{n: f"{API_DIR}/{n}.md"} for n in objects]},
        {"Modules": [{f"{n}": f"{API_DIR}/{n}.md"} for n in modules]},
    ]


def on_config(config: Any) -> Any:
    """Fills the nav's "API reference" entry (left empty in mkdocs.yml) from ``__all__``."""
    for entry in config["nav"] or []:
        if isinstance(entry, dict) and "API reference" in entry:
            entry["API reference"] = _nav_entries()
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, text in reference().items():
        files.append(File.generated(config, path, content=text))
    return files
