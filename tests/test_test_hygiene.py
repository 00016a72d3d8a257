"""The tests assert behaviour, never the wall clock: a time limit in an assert fails on
a loaded machine while the code is right. A deadline in a loop or a subprocess timeout
(a hang guard) is fine; an assert on a clock reading is not, unless its line carries
``# wall-clock: allowed`` with a reason."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ALLOW = "# wall-clock: allowed"
CLOCKS = {"time", "perf_counter", "monotonic", "time_ns", "perf_counter_ns", "monotonic_ns",
          "process_time"}
# Names that hold a duration by convention, e.g. returned by a helper that timed a call.
DURATION_NAMES = {"took", "elapsed", "seconds", "duration", "wall"}


def _is_clock_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr in CLOCKS:
        return isinstance(f.value, ast.Name) and f.value.id == "time"
    return isinstance(f, ast.Name) and f.id in CLOCKS - {"time"}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _compares_a_duration(node: ast.AST) -> bool:
    for cmp in (n for n in ast.walk(node) if isinstance(n, ast.Compare)):
        if any(isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE) for op in cmp.ops):
            if _names(cmp) & DURATION_NAMES:
                return True
    return False


def wall_clock_asserts(source: str) -> list[int]:
    """Line numbers of the asserts in ``source`` that read the clock: directly, through a
    name bound from a clock reading (in any scope of the file), or a duration-named one.

    >>> wall_clock_asserts("import time\\nt0 = time.monotonic()\\nassert time.monotonic() - t0 < 5\\n")
    [3]
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    tainted: set[str] = set()
    changed = True
    while changed:  # names bound from clock readings, or from such names
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                value = node.value
                if value is None:
                    continue
                if any(_is_clock_call(n) for n in ast.walk(value)) or _names(value) & tainted:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        new = _names(t) - tainted
                        if new:
                            tainted |= new
                            changed = True
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        reads = (any(_is_clock_call(n) for n in ast.walk(node.test))
                 or bool(_names(node.test) & tainted) or _compares_a_duration(node.test))
        if reads and ALLOW not in lines[node.lineno - 1]:
            found.append(node.lineno)
    return sorted(found)


def test_the_scan_finds_each_kind_of_wall_clock_assert() -> None:
    src = (
        "import time\n"
        "from time import perf_counter\n"
        "def a():\n"
        "    start = time.monotonic()\n"
        "    took = time.monotonic() - start\n"
        "    assert took < 20\n"                          # 6: bound from a reading
        "def b():\n"
        "    t0 = perf_counter()\n"
        "    assert perf_counter() - t0 < 5 and True\n"   # 9: a reading in the assert
        "def c(run):\n"
        "    code, seconds = run()\n"
        "    assert code == 0 and seconds < 25\n"         # 12: a duration-named value
        "def d():\n"
        "    deadline = time.monotonic() + 60\n"
        "    while time.monotonic() < deadline:\n"       # a hang guard: fine
        "        pass\n"
        "    assert len('x') < 5\n"                       # no clock: fine
        "    assert time.time() > 0  " + ALLOW + " the clock is the subject\n"
    )
    assert wall_clock_asserts(src) == [6, 9, 12]


def test_no_test_asserts_on_the_wall_clock() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if "fixtures" in path.parts:
            continue
        for line in wall_clock_asserts(path.read_text()):
            offenders.append(f"{path.relative_to(TESTS.parent)}:{line}")
    assert offenders == [], (
        "asserts on the wall clock (flaky on a loaded machine; assert progress, order of "
        f"events or a result instead, or mark the line '{ALLOW}' with why): {offenders}")
