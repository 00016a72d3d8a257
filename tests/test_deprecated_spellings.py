"""Nothing of the package, the docs, the notebooks, the examples or the benchmarks calls
a deprecated spelling: each shows the one call per task (README's table)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
WHERE = ["nnx_shard", "docs", "examples", "notebooks", "benchmarks", "README.md"]

#: Strategy.abstract_init / sharded_init: any receiver but the package itself.
INIT = re.compile(r"([\w\]\)]+)\.(abstract_init|sharded_init)\(")
#: Strategy.optimizer / explain, on the names strategies go by.
METHOD = re.compile(r"(\bget\([^()]*\)|\bstrateg\w*|\bstrat|\bs|\bfsdp\w*|\btp|\bzero1|\bpp\w*|"
                    r"\bdp)\.(optimizer|explain)\(")
OTHER = re.compile(r"pipeline\.explain\(|(?<!def )restore_into\(")


def deprecated_calls(line: str) -> list[str]:
    hits = [m.group(0) for m in INIT.finditer(line)
            if m.group(1) not in ("ns", "nnx_shard", "init")]
    return hits + [m.group(0) for m in METHOD.finditer(line)] + [
        m.group(0) for m in OTHER.finditer(line)]


@pytest.mark.parametrize(("line", "found"), [
    ('model = s.abstract_init(factory, "data=8")', True),
    ("get('tp').sharded_init(f, mesh)", True),
    ("opt = fsdp.optimizer(model, tx, mesh)", True),
    ("print(strategy.explain(model, mesh))", True),
    ("r = ns.pipeline.explain(m, mesh, pp, carry=x, microbatches=4)", True),
    ("step, extra = restore_into(d, model, None)", True),
    ("model = ns.sharded_init(factory, mesh, s)", False),
    ("report = ns.explain(model, mesh, s, tx)", False),
    ("r = ns.pipeline.stage_report(m, mesh, pp, carry=x, microbatches=4)", False),
    ("def restore_into(", False),
])
def test_the_scan_sees_a_deprecated_call(line, found):
    assert bool(deprecated_calls(line)) is found


def test_no_deprecated_spelling_is_shown_or_used():
    offenders = []
    for top in WHERE:
        base = ROOT / top
        paths = [base] if base.is_file() else sorted(base.rglob("*"))
        for path in paths:
            if path.suffix not in {".py", ".md", ".ipynb"}:
                continue
            lines = path.read_text(encoding="utf-8").splitlines()
            for i, line in enumerate(lines):
                # a deprecated spelling's own doctest, inside pytest.warns
                if i and "pytest.warns(DeprecationWarning" in lines[i - 1]:
                    continue
                offenders += [f"{path.relative_to(ROOT)}:{i + 1}: {hit}"
                              for hit in deprecated_calls(line)]
    assert not offenders, "\n".join(offenders)


def test_the_guards_old_layout_name_warns_and_is_guard_layout() -> None:
    import nnx_shard.train.guard as guard

    with pytest.warns(DeprecationWarning, match=r"guard\.Layout is now GuardLayout"):
        assert guard.Layout is guard.GuardLayout
    with pytest.raises(AttributeError, match="Layuot"):
        guard.Layuot  # noqa: B018
    # Outside pytest.warns the project's warning filters make the old name an error, so no
    # test or module of the suite can start using it again.
    with pytest.raises(DeprecationWarning):
        guard.Layout  # noqa: B018
