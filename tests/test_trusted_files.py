"""nnx_shard._trusted_files: a file of a folder opened once, where a link may lead only
into the folder's roots, and the opened descriptor (not the path) checked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nnx_shard._errors import LinkedOut, NotAFile
from nnx_shard._trusted_files import ANYWHERE, folder_roots, open_within, read_within


def test_open_within_reads_links_inside_and_refuses_everything_else(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"inside")
    (tmp_path / "d" / "link").symlink_to("a")
    (tmp_path / "out").write_bytes(b"outside")
    (tmp_path / "d" / "escape").symlink_to(tmp_path / "out")
    assert read_within(tmp_path / "d" / "link", [tmp_path / "d"]) == b"inside"
    with pytest.raises(LinkedOut) as e:
        read_within(tmp_path / "d" / "escape", [tmp_path / "d"])
    assert e.value.target == str(tmp_path / "out")
    with pytest.raises(NotAFile, match="a symbolic link, not a regular file"):
        read_within(tmp_path / "d" / "link", None)  # no roots: no link is followed
    os.mkfifo(tmp_path / "d" / "fifo")
    with pytest.raises(NotAFile, match="a FIFO"):
        read_within(tmp_path / "d" / "fifo", [tmp_path / "d"])
    with pytest.raises(NotAFile, match="a folder"):
        read_within(tmp_path / "d", [tmp_path])
    with open_within(tmp_path / "d" / "a", [tmp_path / "d"]) as f:
        assert f.read(2) == b"in"


def test_anywhere_follows_a_link_out_but_still_refuses_what_is_no_file(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "blob").write_bytes(b"weights")
    (tmp_path / "d" / "shard").symlink_to(tmp_path / "blob")
    assert read_within(tmp_path / "d" / "shard", ANYWHERE) == b"weights"
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "d" / "piped").symlink_to(tmp_path / "pipe")
    with pytest.raises(NotAFile, match="a FIFO, not a regular file"):
        read_within(tmp_path / "d" / "piped", ANYWHERE)


def test_a_link_swapped_in_after_the_path_was_resolved_is_never_followed(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"inside")
    (tmp_path / "private").write_bytes(b"PRIVATE")
    real_open = os.open
    swapped: list[str] = []

    def swap_then_open(path, *args, **kwargs):
        if not swapped:  # between the resolve and the open: another process's swap
            swapped.append(os.fspath(path))
            (tmp_path / "d" / "a").unlink()
            (tmp_path / "d" / "a").symlink_to(tmp_path / "private")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", swap_then_open)
    # Inside roots: the link leads out, so it is named; ANYWHERE: a link that was not
    # there when the path was resolved is still not followed.
    for roots, refusal in (([tmp_path / "d"], LinkedOut), (ANYWHERE, NotAFile)):
        swapped.clear()
        (tmp_path / "d" / "a").unlink()
        (tmp_path / "d" / "a").write_bytes(b"inside")
        with pytest.raises(refusal) as e:
            read_within(tmp_path / "d" / "a", roots)
        assert swapped and "PRIVATE" not in str(e.value)
    assert e.value.kind == "a symbolic link"


def test_folder_roots_add_the_hub_cache_repository_of_a_snapshot(tmp_path):
    snap = tmp_path / "models--org--tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    assert folder_roots(snap) == [str(snap), str(tmp_path / "models--org--tiny")]
    plain = tmp_path / "ckpt"
    plain.mkdir()
    (tmp_path / "via").symlink_to(plain)
    assert folder_roots(tmp_path / "via") == [str(plain)]  # real paths
    assert folder_roots(Path("relative")) == [os.path.realpath("relative")]
