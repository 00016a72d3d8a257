"""The package's layering, read from its source: modules share only public names (or
their package's ``_internal`` helpers), public class names are unique, ``nnx_shard._rules``
re-exports nothing private, no module aliases itself in ``sys.modules``, and measured
figures stay in the benchmarks' output and the docs, not in code."""

from __future__ import annotations

import ast
import collections
import pathlib
import re
import types

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "nnx_shard"

#: Private names still imported across modules, by (importer, source module). Each entry
#: is to be made public in its module or moved to an ``_internal`` helper; the list only
#: shrinks.
STILL_SHARED: dict[tuple[str, str], set[str]] = {
    # The standard library's regex parser: the one way to see a pattern as re reads it
    # (its counted repeats and literal braces) before the bounded regex engine compiles it.
    # tests/hf/test_peft_config.py fails at once if it moves.
    ("nnx_shard.hf._peft_config", "re"): {"_parser"},
}


def _modules(root: pathlib.Path = PACKAGE) -> dict[str, tuple[pathlib.Path, ast.Module]]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (path, ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_module(package: str, name: str) -> bool:
    """Whether ``from package import name`` imports a module (a private module is how a
    package shares its implementation: its public names are the package's to use)."""
    folder = PACKAGE.parent.joinpath(*package.split("."), name)
    return folder.with_suffix(".py").is_file() or (folder / "__init__.py").is_file()


def _package(module: str, path: pathlib.Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _source(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package(module, path).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_imports(root: pathlib.Path = PACKAGE) -> dict[tuple[str, str], set[str]]:
    """(importer, source) -> the private names imported, leaving out a package's own
    ``_internal`` module imported by that package's modules."""
    found: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for module, (path, tree) in _modules(root).items():
        pkg = _package(module, path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            src = _source(module, path, node)
            if src.endswith("._internal") and (pkg + ".").startswith(src[: -len("_internal")]):
                continue
            names = {a.name for a in node.names if _private(a.name) and not _is_module(src, a.name)}
            if names:
                found[(module, src)] |= names
    return dict(found)


def test_modules_import_no_private_name_of_another_module():
    found = private_imports()
    new = {k: v - STILL_SHARED.get(k, set()) for k, v in found.items()}
    new = {k: sorted(v) for k, v in new.items() if v}
    assert not new, f"private names imported across modules (make them public): {new}"
    gone = {k: sorted(v - found.get(k, set())) for k, v in STILL_SHARED.items()}
    gone = {k: v for k, v in gone.items() if v}
    assert not gone, f"no longer imported: drop them from STILL_SHARED: {gone}"


def public_classes(root: pathlib.Path = PACKAGE) -> dict[str, list[str]]:
    """Public class name -> the modules defining it (a ``class`` statement at module level;
    an import or a module ``__getattr__`` alias defines nothing)."""
    where: dict[str, list[str]] = collections.defaultdict(list)
    for module, (_, tree) in _modules(root).items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(module)
    return dict(where)


def test_public_class_names_are_unique():
    twice = {n: m for n, m in public_classes().items() if len(m) > 1}
    assert twice == {}, f"public classes defined in more than one module (rename one): {twice}"


def test_rules_reexports_nothing_private():
    import nnx_shard._rules as rules

    _, tree = _modules()["nnx_shard._rules"]
    imported = [a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                for a in n.names]
    assert imported and [n for n in imported if _private(n)] == []
    assert [n for n, v in vars(rules).items() if _private(n) and not n.startswith("_internal")
            and not isinstance(v, types.ModuleType)] == []


def test_no_module_assigns_sys_modules():
    hits = []
    for module, (_, tree) in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "modules" and \
                    isinstance(node.value, ast.Name) and node.value.id in ("sys", "_sys"):
                parent_calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)
                                and isinstance(c.func, ast.Attribute)
                                and c.func.value is node and c.func.attr in ("setdefault",
                                                                             "update", "pop")]
                stores = [t for t in ast.walk(tree) if isinstance(t, ast.Subscript)
                          and t.value is node and isinstance(t.ctx, ast.Store | ast.Del)]
                if parent_calls or stores:
                    hits.append(module)
    assert hits == []


#: A measured figure: a ratio (``1.07x``), a percentage after ``~``/``about``, or the
#: word "measured" followed closely by a number.
MEASURED = re.compile(
    r"(?<![\w.{])\d+\.\d+x(?!\w)"
    r"|(?:~|about )\d+(?:\.\d+)?\s?%"
    r"|measured[^\n]{0,40}?\b\d+(?:\.\d+)?\s?(?:x|%)(?!\w)")


def measured_figures(root: pathlib.Path = PACKAGE) -> list[str]:
    return [f"{path.relative_to(root.parent)}:{i}: {line.strip()}"
            for path in sorted(root.rglob("*.py"))
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if MEASURED.search(line)]


def test_measured_figures_live_in_the_docs_not_in_code():
    assert measured_figures() == [], "point to docs/benchmarks.md or the guide instead"


def test_the_scans_catch_what_they_look_for(tmp_path):
    pkg = tmp_path / "nnx_shard"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "_internal.py").write_text("_X = 1\n")
    (pkg / "a" / "m.py").write_text(
        "from nnx_shard.a._internal import _X\nfrom nnx_shard.a.n import _y\n"
        "# took 1.16x the time\n")
    (pkg / "b.py").write_text("from nnx_shard.a._internal import _X\nfrom .a.n import _z\n")
    assert private_imports(pkg) == {("nnx_shard.a.m", "nnx_shard.a.n"): {"_y"},
                                    ("nnx_shard.b", "nnx_shard.a._internal"): {"_X"},
                                    ("nnx_shard.b", "nnx_shard.a.n"): {"_z"}}
    assert measured_figures(pkg) == ["nnx_shard/a/m.py:3: # took 1.16x the time"]
    (pkg / "c.py").write_text(
        "from nnx_shard.b import Norm\nclass Block: ...\nclass _Own: ...\n"
        "def __getattr__(name):\n    return Block\n")
    (pkg / "a" / "d.py").write_text("class Block: ...\nclass Norm: ...\n")
    assert public_classes(pkg) == {"Block": ["nnx_shard.a.d", "nnx_shard.c"],
                                   "Norm": ["nnx_shard.a.d"]}
