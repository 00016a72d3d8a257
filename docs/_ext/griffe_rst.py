"""Griffe extension: the package's docstrings, written for doctest and Sphinx-style roles, as
Markdown that mkdocstrings renders.

The docstrings stay as they are (``python -m pytest --doctest-modules`` runs their examples);
only the copy the site renders changes:

* ``:func:`~nnx_shard.x.y``` and other roles become code spans (``y`` for a ``~`` target);
* a run of ``>>>`` lines and their output becomes a fenced ``pycon`` block;
* a paragraph ending in ``::`` (reST's literal-block marker) ends in ``:``, the indented block
  after it already being a Markdown code block;
* reST simple tables (``====  ====`` borders, rows continued where the first column is
  blank) become Markdown tables;
* ``.. [1]`` footnote labels and ``[1]_`` references become plain ``[1]``;
* an ``Args:`` entry naming several parameters (``mesh, rules: ...``) becomes one entry per
  name, as the Google style the renderer parses has no grouped form.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc|const):`(~?)([^`]+)`")


def _role(m: re.Match[str]) -> str:
    target = m.group(2).strip()
    if "<" in target and target.endswith(">"):  # :func:`label <target>`
        target = target.split("<", 1)[0].strip()
    if m.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def _fence_doctests(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(lines[i])
                i += 1
            out.append(f"{indent}```")
            continue
        out.append(line)
        i += 1
    return out


_BORDER = re.compile(r"^=+( +=+)+$")


def _columns(border: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"=+", border)]


def _cells(line: str, cols: list[tuple[int, int]]) -> list[str]:
    # The last column runs to the end of the line: its text may pass the border's width.
    bounds = [start for start, _ in cols] + [len(line) + 1]
    return [line[bounds[i]:bounds[i + 1]].strip() for i in range(len(cols))]


def _rst_tables(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not _BORDER.match(lines[i]):
            out.append(lines[i])
            i += 1
            continue
        cols = _columns(lines[i])
        rows: list[list[str]] = []
        borders = 1
        i += 1
        while i < len(lines) and borders < 3:
            line = lines[i]
            i += 1
            if _BORDER.match(line):
                borders += 1
                continue
            cells = _cells(line, cols)
            if rows and not cells[0] and borders > 1:
                rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
            else:
                rows.append(cells)
        header, body = rows[0], rows[1:]
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + " --- |" * len(header))
        out += ["| " + " | ".join(row) + " |" for row in body]
    return out


_GROUPED = re.compile(r"^(\s+)(\w+(?:, \w+)+):(.*)$")


def _split_grouped_args(lines: list[str]) -> list[str]:
    out: list[str] = []
    in_args = False
    for line in lines:
        if re.match(r"^\s*(Args|Arguments|Parameters):\s*$", line):
            in_args = True
        elif line.strip() and not line[:1].isspace():
            in_args = False
        m = _GROUPED.match(line) if in_args else None
        if m is None:
            out.append(line)
            continue
        indent, names, rest = m.group(1), m.group(2).split(", "), m.group(3)
        out += [f"{indent}{n}: see ``{names[-1]}``." for n in names[:-1]]
        others = ", ".join(f"``{n}``" for n in names[:-1])
        out.append(f"{indent}{names[-1]}: (with {others}){rest}")
    return out


def to_markdown(text: str) -> str:
    """The Markdown the site shows for one docstring.

    >>> to_markdown("Calls :func:`~nnx_shard._mesh.use`::")
    'Calls `use`:'
    """
    text = _ROLE.sub(_role, text)
    text = re.sub(r"^(\s*)\.\. \[(\d+)\]", r"\1[\2]", text, flags=re.M)
    text = re.sub(r"\[(\d+)\]_", r"[\1]", text)
    text = re.sub(r"(\S)::[ \t]*$", r"\1:", text, flags=re.M)
    text = re.sub(r"^([ \t]*)::[ \t]*$", "", text, flags=re.M)
    lines = _rst_tables(_split_grouped_args(text.splitlines()))
    return "\n".join(_fence_doctests(lines))


class RstToMarkdown(griffe.Extension):
    """Rewrites every docstring the site loads (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
