"""nnx_shard._errors' path check: one message shape (who, the path, what was expected,
what was found, the fix) and each caller's own error types."""

from __future__ import annotations

import os

import pytest

from nnx_shard import _errors as errors
from nnx_shard._errors import UsageError, check_path, path_kind


def test_a_missing_path_says_nothing_is_there(tmp_path):
    gone = tmp_path / "gone"
    with pytest.raises(FileNotFoundError, match=rf"^load: {gone} is not a folder \(nothing is "
                                                r"there\)\. Fix: pass the checkpoint folder$"):
        check_path(gone, "load", fix="pass the checkpoint folder")


def test_a_file_where_a_folder_is_expected(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match=rf"^save: {f} is a file, not a checkpoint "
                                                 r"directory\. Fix: pass a directory$"):
        check_path(f, "save", expected="a checkpoint directory", kind_error=NotADirectoryError,
                   fix="pass a directory")
    assert f.read_text() == "x"


def test_a_folder_where_a_file_is_expected(tmp_path):
    with pytest.raises(UsageError, match=rf"^read: {tmp_path} is a folder, not a config.json "
                                         r"file\. Fix: pass its config.json$"):
        check_path(tmp_path, "read", want="file", expected="a config.json file",
                   error=UsageError, fix="pass its config.json")


def test_what_is_right_passes(tmp_path):
    (tmp_path / "f").write_text("x")
    assert check_path(tmp_path, "load", fix="-") is None
    assert check_path(tmp_path / "f", "load", want="file", fix="-") is None
    # Created when missing: nothing there, under a folder, is fine.
    assert check_path(tmp_path / "new" / "deeper", "save", missing_ok=True, fix="-") is None


def test_created_when_missing_refuses_a_file_above(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match=rf"^save: {f / 'a' / 'b'} is under {f}, which "
                                                 r"is a file, not a folder\. Fix: a new name$"):
        check_path(f / "a" / "b", "save", missing_ok=True, kind_error=NotADirectoryError,
                   fix="a new name")


def test_the_path_is_named_as_the_caller_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^load: path '.*nowhere' is not a directory"):
        check_path(tmp_path / "nowhere", "load", name=f"path {str(tmp_path / 'nowhere')!r}",
                   expected="a directory", fix="-")


def test_a_dangling_link_is_said_to_be_one(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    assert path_kind(link) == "a symbolic link to nothing"
    with pytest.raises(FileNotFoundError, match="is a symbolic link to nothing, not a folder"):
        check_path(link, "load", fix="-")


def test_a_folder_it_may_not_read(tmp_path, monkeypatch):
    # Root reads everything: the permission is what os.access answers, faked here.
    monkeypatch.setattr(errors.os, "access", lambda path, mode: False)
    with pytest.raises(FileNotFoundError, match=rf"^load: {tmp_path} is a folder this process "
                                                r"may not read\. Fix: give it read permission, "
                                                r"or pass another$"):
        check_path(tmp_path, "load", fix="pass another")


def test_a_fifo_is_named(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(FileNotFoundError, match="is a FIFO, not a file"):
        check_path(fifo, "read", want="file", fix="-")


def test_want_is_folder_or_file():
    with pytest.raises(ValueError, match="want must be 'folder' or 'file'"):
        check_path(".", "x", want="dir", fix="-")


# The plain ValueError / TypeError raises that are not about user input, by module and why;
# every other raise of bad input is a UsageError or a ShardingError.
_NOT_USER_INPUT = {
    ("nnx_shard/_errors.py", "check_path: want is fixed by nnx_shard's own callers"),
    ("nnx_shard/_safetensors_io.py", "write_slice: callers write the slices they created"),
    ("nnx_shard/inference/_chat_template.py", "the TypeError str.format_map itself raises"),
}


def _plain_raises() -> list[tuple[str, int, str]]:
    import ast
    import pathlib

    root = pathlib.Path(errors.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in ("ValueError", "TypeError"):
                found.append((f"nnx_shard/{path.relative_to(root).as_posix()}", node.lineno,
                              exc.id))
    return found


def test_bad_input_is_never_a_plain_value_or_type_error():
    allowed = {module for module, _ in _NOT_USER_INPUT}
    stray = [f"{m}:{line}: raise {kind}" for m, line, kind in _plain_raises() if m not in allowed]
    assert not stray, ("raise UsageError (or ShardingError for rules, meshes and shardings) "
                       "for bad input, naming the argument and ending with a Fix:\n"
                       + "\n".join(stray))


def test_each_plain_raise_left_says_why():
    import linecache

    left = [(m, line) for m, line, _ in _plain_raises()
            if m in {module for module, _ in _NOT_USER_INPUT}]
    assert {m for m, _ in left} == {module for module, _ in _NOT_USER_INPUT}, left
    root = os.path.dirname(os.path.dirname(errors.__file__))
    for m, line in left:
        text = "".join(linecache.getline(os.path.join(root, m), n) for n in (line - 1, line))
        assert "# not user input:" in text, (m, line)
