"""Every dotted name the project writes for its readers resolves: ``nnx_shard.X.Y`` and
``ns.X.Y`` (``ns`` is ``nnx_shard``) in the package's docstrings and string literals (its
error messages), the pages under ``docs/``, README.md, CONTRIBUTING.md and the notebooks.
A name resolves when its module imports and the rest is found on it by ``getattr`` (a
dataclass field or an annotated attribute counts); a name moved or removed fails here
naming the file, the line and the closest name that exists. CHANGELOG.md names removed
things on purpose and is not read."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import json
import pkgutil
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import nnx_shard

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nnx_shard"

# A name starts at `nnx_shard` or `ns` not preceded by a word, a dot, a slash or a dash
# (`self.ns`, `tests/ns`, `foo-ns` are not it); it stops at a call's parenthesis, a space
# or trailing punctuation: `ns.Rules(...).explain` is `ns.Rules`.
_NAME = re.compile(r"(?<![\w./\-])(?:nnx_shard|ns)(?:\.[A-Za-z_]\w*)+")
# Dotted tags that name no object: the export marker's writer and the barriers of a save.
_TAGS = ("nnx_shard.save_safetensors",)


@dataclasses.dataclass(frozen=True)
class Found:
    name: str
    where: str  # file:line, relative to the repository


def _in_text(text: str, where: str) -> Iterator[Found]:
    for number, line in enumerate(text.splitlines(), 1):
        for m in _NAME.finditer(line):
            yield Found(m.group(), f"{where}:{number}")


def _in_module(path: Path, where: str) -> Iterator[Found]:
    source = path.read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source, str(path))):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        names = set(_NAME.findall(node.value))
        if not names:
            continue
        # The value's lines need not be the source's (escapes, implicit concatenation):
        # each name is placed on the source lines of the literal that hold it.
        span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
        for name in sorted(names):
            at = [n for n in span if name in lines[n - 1]] or [node.lineno]
            yield from (Found(name, f"{where}:{n}") for n in at)


def _in_notebook(path: Path, where: str) -> Iterator[Found]:
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = cell["source"]
        yield from _in_text("".join(source) if isinstance(source, list) else source,
                            f"{where} cell {i} line")


def _collect() -> list[Found]:
    def rel(path: Path) -> str:
        return path.relative_to(ROOT).as_posix()

    found: list[Found] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += _in_module(path, rel(path))
    docs = ROOT / "docs"
    pages = [p for p in docs.rglob("*.md") if "_ext" not in p.parts]
    for path in [*sorted(pages), ROOT / "README.md", ROOT / "CONTRIBUTING.md"]:
        found += _in_text(path.read_text(), rel(path))
    for path in sorted((docs / "notebooks").glob("*.ipynb")):
        found += _in_notebook(path, rel(path))
    return [f for f in found if not f.name.startswith(_TAGS)]


def _has_field(obj: Any, name: str) -> bool:
    """A name an instance of the class ``obj`` has that the class itself may not: a
    dataclass field, or an attribute annotated on the class or a base."""
    if not isinstance(obj, type):
        return False
    if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
        return True
    return any(name in vars(c).get("__annotations__", {}) for c in obj.__mro__)


def _closest(part: str, obj: Any) -> str | None:
    """The name ``obj`` has that is closest to ``part``, a public one where one is close."""
    names = _choices(obj)
    public = [n for n in names if not n.startswith("_")]
    close = (difflib.get_close_matches(part, public, n=1, cutoff=0.6)
             or difflib.get_close_matches(part, names, n=1, cutoff=0.0))
    return close[0] if close else None


def _choices(obj: Any) -> list[str]:
    names = set(dir(obj))
    path = getattr(obj, "__path__", None) if isinstance(obj, ModuleType) else None
    if path is not None:
        names |= {m.name for m in pkgutil.iter_modules(path)}
    if dataclasses.is_dataclass(obj) and isinstance(obj, type):
        names |= {f.name for f in dataclasses.fields(obj)}
    return sorted(n for n in names if not n.startswith("__"))


def resolve(name: str) -> str | None:
    """None when ``name`` resolves, else what went wrong: the first part not found on
    the object before it and the closest name that object has."""
    parts = name.split(".")
    parts[0] = "nnx_shard"
    obj: Any = nnx_shard
    for i, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if isinstance(obj, ModuleType) and part != "__main__":
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")
                continue
            except ModuleNotFoundError as e:
                if e.name != f"{obj.__name__}.{part}":
                    raise
        if _has_field(obj, part) and i == len(parts) - 1:
            return None
        resolved = ".".join(parts[:i])
        close = _closest(part, obj)
        hint = f"; closest: {resolved}.{close}" if close else ""
        elsewhere = _elsewhere(part)
        if elsewhere:
            hint += f"; {part} is at {', '.join(elsewhere)}"
        return f"{resolved} has no {part!r}{hint}"
    return None


def _elsewhere(attr: str) -> list[str]:
    """The public modules of the package that have ``attr``, not as a submodule (where a
    name moved to)."""
    return sorted(name for name, module in list(sys.modules.items())
                  if (name == "nnx_shard" or name.startswith("nnx_shard."))
                  and not any(p.startswith("_") for p in name.split("."))
                  and module is not None and attr in vars(module)
                  and not isinstance(vars(module)[attr], ModuleType))[:3]


def _order(found: Found) -> tuple[str, int, str]:
    file, line = found.where.rsplit(":", 1)
    return file, int(line), found.name


def test_every_dotted_name_resolves() -> None:
    found = _collect()
    assert len(found) > 500, f"only {len(found)} names found: the collection is broken"
    problems = {name: resolve(name) for name in {f.name for f in found}}
    unresolved = [f"{f.where}: {f.name}: {problems[f.name]}"
                  for f in sorted(set(found), key=_order) if problems[f.name] is not None]
    assert not unresolved, (f"{len(unresolved)} dotted names do not resolve:\n"
                            + "\n".join(unresolved))


def test_the_collector_reads_roles_calls_and_punctuation(tmp_path: Path) -> None:
    text = ("See :func:`~nnx_shard.models.Decoder`, `ns.Rules(...).explain` and\n"
            "nnx_shard.hf.load_pretrained(). Also self.ns.nope and tests/ns.nope.")
    assert list(_in_text(text, "page.md")) == [
        Found("nnx_shard.models.Decoder", "page.md:1"), Found("ns.Rules", "page.md:1"),
        Found("nnx_shard.hf.load_pretrained", "page.md:2")]
    module = tmp_path / "m.py"
    module.write_text('"""Doc.\n\n:func:`nnx_shard.nope`\n"""\nx = ("a " "ns.hf.nope "\n'
                      '     f"b {x} ns.Rules.spec")\n')
    assert sorted(_in_module(module, "m.py"), key=_order) == [
        Found("nnx_shard.nope", "m.py:3"), Found("ns.hf.nope", "m.py:5"),
        Found("ns.Rules.spec", "m.py:6")]


def test_resolve_names_the_closest_name_and_where_a_name_moved() -> None:
    assert resolve("ns.models.Decoder") is None
    assert resolve("nnx_shard.models._families.Family") is None  # private modules resolve
    assert resolve("nnx_shard.models.DecoderConfig.tie_embeddings") is None  # a field
    assert resolve("ns.models.Decodr") == (
        "nnx_shard.models has no 'Decodr'; closest: nnx_shard.models.Decoder")
    moved = resolve("nnx_shard.models.generate")
    assert moved is not None and "nnx_shard.inference" in moved, moved
