"""Size limits of the package's rooms: no module over 700 lines, no function body over 90.

Complexity (ruff's C901, at most 15) and argument counts (PLR0913) are enforced by the ruff
configuration in pyproject.toml; these two limits have no ruff rule, so they live here.
"""

import ast
from pathlib import Path

import nnx_shard

PACKAGE = Path(nnx_shard.__file__).resolve().parent
# Modules are split by job, not by a line count: the caps only catch runaway growth.
MAX_MODULE_LINES = 700
MAX_BODY_LINES = 90


def body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``fn``'s body without its docstring (docstrings hold the examples)."""
    body = fn.body
    first = body[0]
    if (len(body) > 1 and isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        first = body[1]
    assert fn.end_lineno is not None
    return fn.end_lineno - first.lineno + 1


def test_no_module_over_the_limit():
    over = {str(p.relative_to(PACKAGE)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by job): {over}"


def test_no_function_body_over_the_limit():
    over = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (n := body_lines(node)) > MAX_BODY_LINES:
                    over[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = n
    assert not over, f"function bodies over {MAX_BODY_LINES} lines: {over}"


def test_the_limits_bite():
    long_fn = ast.parse("def f():\n    '''doc'''\n" + "    x = 1\n" * 81).body[0]
    assert isinstance(long_fn, ast.FunctionDef)
    assert body_lines(long_fn) == 81


TESTS = Path(__file__).resolve().parent


def test_tests_mirror_the_package_layout():
    # A folder of tests is a package of the library; a test file named after a module of
    # a package lives in that package's folder, not at the top.
    packages = {p.parent.name.lstrip("_") for p in PACKAGE.glob("*/__init__.py")}
    folders = {p.parent.name for p in TESTS.glob("*/test_*.py")}
    assert folders and folders <= packages, folders - packages
    misplaced = []
    for test in TESTS.glob("test_*.py"):
        module = test.stem.removeprefix("test_")
        if any((PACKAGE / f"{m}.py").exists() or (PACKAGE / m).is_dir()
               for m in (module, f"_{module}")):
            continue
        homes = sorted(p.parent.name.lstrip("_") for p in PACKAGE.glob(f"*/{module}.py")) + sorted(
            p.parent.name.lstrip("_") for p in PACKAGE.glob(f"*/_{module}.py"))
        if homes:
            misplaced.append(f"{test.name} -> tests/{homes[0]}/")
    assert misplaced == []
