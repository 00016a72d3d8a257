"""save_safetensors replaces an export whole or not at all, and deletes only what it
proves it wrote (nnx_shard.hf._export_dir).

The trials: a save over a previous export fails with ENOSPC after N bytes (for
N spread over every byte it writes), or its process is SIGKILLed at points
through the write and around the swap; after each the previous export must be
byte for byte what it was (so it loads bitwise the same), and no folder left
behind may load.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard import _safetensors_io as st
from nnx_shard import hf
from nnx_shard.hf import _export_dir as export_dir
from nnx_shard.models import Decoder, DecoderConfig
from tests.conftest import needs_devices

pytestmark = needs_devices(8)
HERE = Path(__file__).resolve().parent
SHARD = 30_000  # several files and an index: every kind of file is written


def _model(seed: int) -> Decoder:
    return ns.sharded_init(
        lambda: Decoder(DecoderConfig(), rngs=nnx.Rngs(seed)), "data=8", ns.strategies.get("fsdp"))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _arrays(model: Any) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(nnx.state(model))}


def _load(folder: Path) -> dict[str, np.ndarray]:
    target = ns.abstract_init(
        lambda: Decoder(DecoderConfig(), rngs=nnx.Rngs(0)), "data=8", ns.strategies.get("fsdp"))
    return _arrays(hf.load_safetensors(folder, target))


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _others(out: Path) -> list[Path]:
    return sorted(p for p in out.parent.iterdir() if p != out)


def _never_loads(folder: Path) -> None:
    with pytest.raises((ns.NnxShardError, FileNotFoundError, ValueError)):
        _load(folder)


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes], Any]:
    """A folder with a finished export of the model of seed 0: its bytes and arrays."""
    out = tmp_path_factory.mktemp("prev") / "export"
    model = _model(0)
    hf.save_safetensors(out, model, max_shard_bytes=SHARD)
    return out, _files(out), _arrays(model)


def _fresh_previous(tmp_path: Path, previous: tuple[Path, dict[str, bytes], Any]) -> Path:
    out = tmp_path / "export"
    out.mkdir(parents=True)
    for name, raw in previous[1].items():
        (out / name).write_bytes(raw)
    (out / "notes.txt").write_text("the user's")
    return out


# --------------------------------------------------------------------------- ENOSPC


def _written_bytes(tmp_path: Path, model: Any) -> int:
    total = [0]
    real = st._pwrite

    def counting(fd: int, data: Any, offset: int) -> int:
        total[0] += len(data)
        return real(fd, data, offset)

    st._pwrite = counting
    try:
        hf.save_safetensors(tmp_path / "count", model, max_shard_bytes=SHARD)
    finally:
        st._pwrite = real
    return total[0]


def enospc_trials(tmp_path: Path, previous: Any, monkeypatch: pytest.MonkeyPatch,
                  n: int = 12) -> int:
    """Fails a save over ``previous`` with ENOSPC after N bytes for ``n`` values of N
    spread over every byte a save writes (the last fails the marker's last write);
    returns how many trials ran."""
    new = _model(1)
    total = _written_bytes(tmp_path, new)
    points = sorted({0, 1, 7, total - 1, *np.linspace(8, total - 2, n - 4).astype(int).tolist()})
    assert len(points) == n
    out = _fresh_previous(tmp_path / "x", previous)
    before = _files(out)
    real = st._pwrite
    for n_bytes in points:
        budget = [n_bytes]

        def full(fd: int, data: Any, offset: int, budget: list[int] = budget) -> int:
            if len(data) > budget[0]:
                if budget[0]:
                    real(fd, memoryview(data)[:budget[0]], offset)
                budget[0] = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            budget[0] -= len(data)
            return real(fd, data, offset)

        monkeypatch.setattr(st, "_pwrite", full)
        with pytest.raises(export_dir.ExportError, match=r"could not write the export to .*"
                           r"No space left on device.*previous export there .* is untouched"
                           r".*Fix: free space"):
            hf.save_safetensors(out, new, max_shard_bytes=SHARD)
        assert _files(out) == before, n_bytes
        assert _others(out) == [], n_bytes  # the staging folder went with the failure
    monkeypatch.setattr(st, "_pwrite", real)
    _same(_load(out), previous[2])
    return len(points)


@pytest.mark.slow
def test_enospc_partway_leaves_the_previous_export(tmp_path, previous, monkeypatch) -> None:
    trials = enospc_trials(tmp_path, previous, monkeypatch)
    assert trials >= 12
    print(f"{trials} ENOSPC trials: previous export intact in all")


def test_a_failed_swap_leaves_the_previous_export(tmp_path, previous, monkeypatch) -> None:
    out = _fresh_previous(tmp_path, previous)
    before = _files(out)

    def broken(a: Any, b: Any) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(export_dir, "_exchange", broken)
    with pytest.raises(export_dir.ExportError, match="Input/output error"):
        hf.save_safetensors(out, _model(1), max_shard_bytes=SHARD)
    assert _files(out) == before and _others(out) == []


# --------------------------------------------------------------------------- SIGKILL

# Of every byte a save writes: within the first write and within the last one, a staging
# folder barely begun and one all but whole (each trial is a process of its own, ~2.5 CPU-s;
# the ENOSPC trials above cover twelve points, from the first byte on, in-process).
BYTE_POINTS = (0.001, 0.999)
PHASES = ("before_swap", "after_swap")


def _killed(out: Path, point: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(HERE / "export_trial.py"), str(out), "1", point],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == -signal.SIGKILL, (point, done.returncode, done.stderr[-2000:])


def kill_trials(tmp_path: Path, previous: Any) -> tuple[int, int]:
    """SIGKILLs saves over ``previous`` at points through the write and around the
    swap; returns (trials before the swap, trials after it)."""
    new, next_model = _model(1), _model(2)
    new_arrays = _arrays(new)
    total = _written_bytes(tmp_path, new)
    before_swap = after_swap = 0
    for point in [f"bytes:{int(f * total)}" for f in BYTE_POINTS] + [
            f"phase:{p}" for p in PHASES]:
        out = _fresh_previous(tmp_path / point.replace(":", "_"), previous)
        before = _files(out)
        _killed(out, point)
        left = _others(out)
        assert len(left) == 1 and left[0].name.startswith(".export.nnx_shard-export-"), left
        if point != "phase:after_swap":
            assert _files(out) == before, point  # bitwise the previous export
            if point != "phase:before_swap":
                _never_loads(left[0])  # the unfinished export
            before_swap += 1
        else:  # killed after the atomic swap: the new export is whole and in place
            _same(_load(out), new_arrays)
            assert (out / "notes.txt").read_text() == "the user's"
            after_swap += 1
        # The next save removes what the killed one left (its process is gone).
        hf.save_safetensors(out, next_model, max_shard_bytes=SHARD)
        assert _others(out) == [] and (out / "notes.txt").read_text() == "the user's"
    _same(_load(out), _arrays(next_model))
    return before_swap, after_swap


@pytest.mark.slow
def test_killed_saves_leave_the_previous_export(tmp_path, previous) -> None:
    before, after = kill_trials(tmp_path, previous)
    assert before == len(BYTE_POINTS) + 1 and after == 1
    _same(_load(previous[0]), previous[2])
    print(f"{before + after} kill trials: previous export intact in all {before} killed "
          f"before the swap, the new export whole in the {after} killed after it")


# --------------------------------------------------------------------------- markers


def _forged(out: Path, body: Any) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    (out / export_dir.MARKER).write_bytes(raw)


def _digested(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "digest": export_dir._digest(body)}


@pytest.mark.parametrize("label,body,why", [
    ("legacy", {"files": ["precious.txt", "model.safetensors"]}, "not of this nnx_shard's"),
    ("list", ["precious.txt"], "not of this nnx_shard's"),
    ("corrupt", b"\xff\x00{not json", "unreadable"),
    ("digest", {"format": 2, "writer": "nnx_shard.save_safetensors", "files": {},
                "digest": "0"}, "digest does not match"),
    ("names", _digested({"format": 2, "writer": "nnx_shard.save_safetensors", "token": "a" * 32,
                         "target": "export", "host": "h", "pid": 1, "complete": True,
                         "files": {"precious.txt": {"size": 4, "sha256": "x"}}}),
     "'precious.txt', a name save_safetensors never writes"),
])
def test_a_marker_not_ours_deletes_nothing(tmp_path, label, body, why) -> None:
    out = tmp_path / "export"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    _forged(out, body)
    before = _files(out)
    with pytest.raises(export_dir.ExportError, match=f"is not a record save_safetensors wrote "
                       rf"\(.*{why}.*nothing was deleted or written. Fix: remove"):
        hf.save_safetensors(out, _model(0))
    assert _files(out) == before and _others(out) == []


def test_a_file_changed_since_the_save_is_not_ours(tmp_path, previous) -> None:
    out = _fresh_previous(tmp_path, previous)
    name = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))[0]
    (out / name).write_bytes(b"the user's own weights")
    before = _files(out)
    with pytest.raises(FileExistsError, match=f"already holds {name}, which save_safetensors "
                       "did not write there"):
        hf.save_safetensors(out, _model(1), max_shard_bytes=SHARD)
    assert _files(out) == before


def test_the_previous_export_is_replaced_and_the_users_files_stay(tmp_path, previous) -> None:
    out = _fresh_previous(tmp_path, previous)
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / "vocab.txt").write_text("a b c")
    new = _model(1)
    hf.save_safetensors(out, new)  # one file now: the previous shards and index go
    assert sorted(os.listdir(out)) == [".nnx_shard_safetensors", "config.json",
                                       "model.safetensors", "notes.txt", "tokenizer"]
    assert (out / "tokenizer" / "vocab.txt").read_text() == "a b c"
    assert _others(out) == []
    _same(_load(out), _arrays(new))


def test_leftovers_are_removed_only_when_proven_ours(tmp_path) -> None:
    out = tmp_path / "export"
    head = ".export.nnx_shard-export-"
    users = tmp_path / (head + "b" * 32)  # the name of a staging folder, not ours
    users.mkdir()
    (users / "model.safetensors").write_text("mine")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid_gone = int(dead.stdout)
    stale, running = tmp_path / (head + "c" * 32), tmp_path / (head + "d" * 32)
    for folder, token in ((stale, "c" * 32), (running, "d" * 32)):
        folder.mkdir()
        st.create(str(folder / "model.safetensors"), {"w": ("F32", (4,))})
        export_dir.write_marker(folder, token, "export", None)
    _rewrite_pid(stale, pid_gone)
    _rewrite_pid(running, os.getppid())  # alive: a save in flight is not touched
    with pytest.warns(UserWarning, match="left .*bbbb.* in place .*no marker"):
        hf.save_safetensors(out, _model(0))
    assert not stale.exists()
    assert running.is_dir() and users.is_dir()
    assert (users / "model.safetensors").read_text() == "mine"
    _never_loads(running)


def _rewrite_pid(folder: Path, pid: int) -> None:
    data = json.loads((folder / export_dir.MARKER).read_text())
    data["pid"] = pid
    data.pop("digest")
    (folder / export_dir.MARKER).write_text(json.dumps(_digested(data)))


# --------------------------------------------------------------------------- refused input


def test_an_abstract_model_is_refused_before_writing(tmp_path, previous) -> None:
    out = _fresh_previous(tmp_path, previous)
    before = _files(out)
    factory = lambda: Decoder(DecoderConfig(), rngs=nnx.Rngs(0))  # noqa: E731
    for abstract in (nnx.eval_shape(factory),
                     ns.abstract_init(factory, "data=8", ns.strategies.get("fsdp"))):
        with pytest.raises(ns.NnxShardError, match=r"save_safetensors: parameter "
                           r"'blocks/0/attn/k' is abstract \(ShapeDtypeStruct.*Nothing was "
                           r"written. Fix: save a model with values"):
            hf.save_safetensors(out, abstract)
        with pytest.raises(ns.NnxShardError, match="is abstract"):
            hf.save_safetensors(tmp_path / "new", abstract)
    assert _files(out) == before and not (tmp_path / "new").exists()


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.bool_, "uint8"])
def test_non_float_dtypes_are_refused(tmp_path, dtype) -> None:
    with pytest.raises(ns.NnxShardError, match=r"dtype \w+ is not a floating-point dtype.*"
                       "Fix: e.g. dtype=jnp.bfloat16"):
        hf.save_safetensors(tmp_path / "o", _model(0), dtype=dtype)
    assert not (tmp_path / "o").exists()


def test_paths_that_cannot_hold_an_export(tmp_path, previous, monkeypatch) -> None:
    model = _model(0)
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(export_dir.ExportError, match=r"'.*afile/sub' is under '.*afile', which "
                       "is not a directory"):
        hf.save_safetensors(tmp_path / "afile" / "sub", model)
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    with pytest.raises(export_dir.ExportError, match=r"'.*dangling' is a symbolic link to "
                       r"'.*gone', which does not exist"):
        hf.save_safetensors(tmp_path / "dangling", model)
    assert (tmp_path / "afile").read_text() == "keep" and not (tmp_path / "gone").exists()
    # A link to a folder: the export goes into the folder, the link stays.
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    hf.save_safetensors(tmp_path / "link", model)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "model.safetensors").is_file()
    # Read-only: the staging folder cannot be made, or its files cannot be written.
    out = _fresh_previous(tmp_path / "ro", previous)
    before = _files(out)

    def read_only(*a: Any, **k: Any) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(a[0]))

    with monkeypatch.context() as m:
        m.setattr(os, "mkdir", read_only)
        with pytest.raises(export_dir.ExportError, match=r"could not write the export to .*ro/"
                           r"export: Read-only file system.*Fix: save to a writable"):
            hf.save_safetensors(out, model)
    with monkeypatch.context() as m:
        m.setattr(st, "_pwrite", lambda *a: (_ for _ in ()).throw(
            PermissionError(errno.EACCES, os.strerror(errno.EACCES))))
        with pytest.raises(export_dir.ExportError, match=r"Permission denied.*Fix: save to a "
                           "directory you may write"):
            hf.save_safetensors(out, model)
    assert _files(out) == before and _others(out) == []


def test_an_unfinished_export_does_not_load(tmp_path) -> None:
    folder = tmp_path / "half"
    folder.mkdir()
    st.create(str(folder / "model.safetensors"), {"w": ("F32", (4,))})
    export_dir.write_marker(folder, "e" * 32, "half", None)
    with pytest.raises(export_dir.ExportError, match="is an unfinished save_safetensors export"):
        _load(folder)


def test_one_process_token_is_fresh() -> None:
    assert jax.process_count() == 1
    assert export_dir.new_token() != export_dir.new_token()


# --------------------------------------------------------------------------- modes and places


def _mode(p: Path) -> int:
    return p.stat().st_mode & 0o7777


def test_a_private_folder_stays_private(tmp_path) -> None:
    out = tmp_path / "private"
    out.mkdir()
    os.chmod(out, 0o700)
    model = _model(0)
    for _ in range(2):  # into the empty folder, then over its export
        hf.save_safetensors(out, model, max_shard_bytes=SHARD)
        assert _mode(out) == 0o700
        modes = {p.name: _mode(p) for p in out.iterdir()}
        assert modes and all(m & 0o077 == 0 for m in modes.values()), modes
    assert _others(out) == []
    # A group-readable folder lets the group read the files, others not.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o750)
    hf.save_safetensors(shared, model)
    assert _mode(shared) == 0o750
    assert all(_mode(p) & 0o007 == 0 for p in shared.iterdir())


def test_a_new_folder_takes_the_umask_and_files_no_wider_than_before(tmp_path) -> None:
    old = os.umask(0o027)
    try:
        hf.save_safetensors(tmp_path / "new", _model(0))
    finally:
        os.umask(old)
    assert _mode(tmp_path / "new") == 0o750
    assert {_mode(p) for p in (tmp_path / "new").iterdir()} == {0o640}
    # A file of the previous export the owner closed stays closed in the new one.
    out = tmp_path / "open"
    hf.save_safetensors(out, _model(0))
    os.chmod(out, 0o755)
    os.chmod(out / "model.safetensors", 0o600)
    hf.save_safetensors(out, _model(1))
    assert _mode(out / "model.safetensors") == 0o600
    assert _mode(out / "config.json") & 0o044 == 0o044  # the umask's, not narrowed


@pytest.mark.parametrize("how", [".", "cwd", "parent", ".."])
def test_the_working_directory_and_folders_above_it_are_refused(tmp_path, monkeypatch,
                                                                  how) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("the user's")
    monkeypatch.chdir(work)
    target = {"cwd": work, "parent": tmp_path}.get(how, how)
    with pytest.raises(export_dir.ExportError, match=r"working directory.*Fix: save to a "
                       r"subfolder, e\.g\. save_safetensors\(.*export'"):
        hf.save_safetensors(target, _model(0))
    assert os.getcwd() == str(work) and sorted(os.listdir(tmp_path)) == ["work"]
    assert os.listdir(work) == ["notes.txt"]
    # A subfolder of the working directory is fine.
    hf.save_safetensors("export", _model(0))
    assert (work / "export" / "model.safetensors").is_file() and os.getcwd() == str(work)


def test_a_mount_point_is_refused(tmp_path, monkeypatch) -> None:
    out = tmp_path / "mnt"
    out.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == str(out) or real(p))
    with pytest.raises(export_dir.ExportError, match=r"'.*mnt'.* is a mount point.*Fix: save to "
                       "a subfolder"):
        hf.save_safetensors(out, _model(0))
    assert os.listdir(out) == [] and _others(out) == []


@pytest.mark.parametrize("name", ["model-00002-of-00005.safetensors",
                                  "model.safetensors.index.json", "config.json",
                                  ".nnx_shard_safetensors.tmp"])
def test_a_full_disk_names_the_file_being_written(tmp_path, monkeypatch, name) -> None:
    real = st._pwrite

    def full(fd: int, data: Any, offset: int) -> int:
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # no file name, as a write
        return real(fd, data, offset)

    monkeypatch.setattr(st, "_pwrite", full)
    out = tmp_path / "out"
    with pytest.raises(export_dir.ExportError, match=rf"No space left on device \(writing "
                       rf"{name.removesuffix('.tmp')}\).*Fix: free space"):
        hf.save_safetensors(out, _model(0), max_shard_bytes=SHARD)
    assert os.listdir(tmp_path) == []  # no export, no staging folder, no partial file


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may give a folder to another user")
def test_the_destinations_owner_is_kept(tmp_path) -> None:
    out = tmp_path / "theirs"
    out.mkdir()
    os.chown(out, 12345, 23456)
    hf.save_safetensors(out, _model(0))
    assert (out.stat().st_uid, out.stat().st_gid) == (12345, 23456)
    assert {(p.stat().st_uid, p.stat().st_gid) for p in out.iterdir()} == {(12345, 23456)}
