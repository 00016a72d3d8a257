"""The import graph of nnx_shard: no circle, and the command line alone on the top floor.

Every module's ``import`` statements are read with ``ast``, at module level and
inside functions alike (an import deferred into a function still ties the two
modules together; it only hides the tie from the interpreter until the call).
"""

import ast
from pathlib import Path

import nnx_shard

PACKAGE = Path(nnx_shard.__file__).resolve().parent
CLI = "nnx_shard.cli"


def modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (its file, whether it is a package's ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def imported(name: str, path: Path, is_package: bool, known: set[str]) -> set[str]:
    """The nnx_shard modules ``name`` imports: ``from a.b import c`` is ``a.b.c`` where
    that is a module, else ``a.b``; ``import a.b`` is ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    here = here.rpartition(".")[0]
                base = f"{here}.{base}" if node.module else here
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imported(name, path, is_package, known)
            for name, (path, is_package) in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def in_cli(name: str) -> bool:
    return name == CLI or name.startswith(CLI + ".")


def test_the_walk_sees_the_package():
    edges = graph()
    assert {"nnx_shard", "nnx_shard.strategies", "nnx_shard.planner._search", CLI,
            "nnx_shard.cli._plan"} <= set(edges)
    assert "nnx_shard.strategies._presets" in edges["nnx_shard.strategies"]
    assert "nnx_shard.strategies._strategy" in edges["nnx_shard.strategies"]


def test_the_walk_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_nnx_shard_modules():
    assert cycles(graph()) == []


def test_nothing_outside_the_cli_imports_it():
    users = sorted(name for name, targets in graph().items()
                   if not in_cli(name) and any(in_cli(t) for t in targets))
    assert users == []


#: docs/architecture.md's floors, top to bottom: a module may import its own floor and the
#: ones below. A name matches its module and everything under it; the longest match wins.
FLOORS: list[list[str]] = [
    ["cli"],
    ["planner", "_simulated"],
    ["_train", "_checkpoint", "_metrics", "hf", "inference", "preference"],
    ["models", "_parallel", "_attention", "_stage_report", "_low_rank", "_lora_checks",
     "_quantized", "pipeline", "collective_matmul", "tp_layers"],
    ["strategies", "_parallel.schedule"],
    ["_rules", "_annotate", "_mesh", "_init", "_optstate", "_report", "distributed"],
    ["_compat", "_errors", "_trusted_files", "_axes", "_units", "_optimizers",
     "_safetensors_io", "_pack", "_weighting", "corpus", "_offload"],
]


def floor_of(name: str) -> int | None:
    """0 for the top floor; None for a module the table does not place."""
    best: tuple[int, int] | None = None  # (length of the match, floor)
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            full = f"nnx_shard.{prefix}"
            if (name == full or name.startswith(full + ".")) and (
                    best is None or len(full) > best[0]):
                best = (len(full), level)
    return None if best is None else best[1]


def test_floors_place_the_longest_match():
    assert floor_of("nnx_shard._parallel.schedule") == 4
    assert floor_of("nnx_shard._attention._op") == 3
    assert floor_of("nnx_shard.cli._plan") == 0
    assert floor_of("nnx_shard.nowhere") is None


def test_every_module_has_a_floor_and_imports_point_down():
    edges = graph()
    unplaced = sorted(m for m in edges if m != "nnx_shard" and floor_of(m) is None)
    assert unplaced == [], f"add these modules to FLOORS (and docs/architecture.md): {unplaced}"
    up = []
    for name, targets in sorted(edges.items()):
        here = floor_of(name)
        if here is None:
            continue  # the package root re-exports everything
        for target in sorted(targets):
            there = floor_of(target)
            if there is not None and there < here:
                up.append(f"{name} -> {target}")
    assert up == [], f"imports that point up a floor (docs/architecture.md): {up}"
