"""The folder :func:`~nnx_shard.hf.save_safetensors` writes, replaced whole or not at all.

An export is written into a staging folder beside its destination,
``.<name>.nnx_shard-export-<token>``, and swapped into place by one atomic
``renameat2(RENAME_EXCHANGE)`` once every byte is on disk: a failed write (disk
full, read-only, a killed process) leaves the previous export as it was, and the
staging folder's marker says the export is unfinished, which
:func:`~nnx_shard.hf.load_safetensors` refuses. After the swap the previous
export sits under the staging name and is removed.

Deletion is by proof only. The marker ``.nnx_shard_safetensors`` records the
export's token and, for each file, its size and a SHA-256 of its first and last
MiB, and carries a digest of itself; a file is removed only when its name is one
save_safetensors writes and its size and digest are the recorded ones. A marker
that is not such a record (corrupt, forged, from an older nnx_shard) is an
error, never a list of files to delete. The files copied from a model's source
(``generation_config.json``, the tokenizer's) are written and recorded like the
weights. Files of the user's in the destination (a README; a tokenizer when the
export copies none) are hard-linked into the new export before the swap, or
moved back after it. A staging folder left by a killed save is removed by the
next save to the same destination, and only when its marker (token, host and
process id) proves it is a save of ours whose process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import json
import os
import re
import secrets
import socket
import stat
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from nnx_shard import _safetensors_io as st
from nnx_shard._errors import NnxShardError, NotAFile
from nnx_shard._trusted_files import open_within

__all__ = ["TOKENIZER_FILES", "ExportError", "Marker", "Modes", "clean_leftovers", "make_stage",
           "new_token", "owned", "pid_running", "read_marker", "remove_stage", "staging",
           "swap_in", "write_fix", "write_marker", "writing"]

MARKER = ".nnx_shard_safetensors"
_FORMAT = 2
_WRITER = "nnx_shard.save_safetensors"
_STAGE = ".nnx_shard-export-"
_TOKEN = re.compile(r"[0-9a-f]{32}")
#: the tokenizer files save_safetensors copies from a model's source checkpoint.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")
#: the names of the files save_safetensors writes (and so may ever delete).
OUR_NAMES = re.compile(r"model\.safetensors|model-[0-9]{5}-of-[0-9]{5}\.safetensors"
                       r"|model\.safetensors\.index\.json|config\.json|generation_config\.json|"
                       + "|".join(map(re.escape, TOKENIZER_FILES)))
_PROBE = 1 << 20
_MAX_MARKER = 1 << 20
# Tokens of the saves this process has in flight: their staging folders are not leftovers.
_ACTIVE: set[str] = set()


class ExportError(NnxShardError, OSError):
    """save_safetensors could not write its export, or found something in its way;
    the previous export (if any) is untouched.

    >>> issubclass(ExportError, OSError)
    True
    """


def new_token() -> str:
    """A fresh token for one export (32 hex digits).

    >>> len(new_token())
    32
    """
    return secrets.token_hex(16)


def staging(out: Path, token: str) -> Path:
    """The staging folder of the export ``token`` to ``out``.

    >>> staging(Path("/ckpt/llama"), "0" * 32).name
    '.llama.nnx_shard-export-00000000000000000000000000000000'
    """
    return out.parent / f".{out.name}{_STAGE}{token}"


def write_fix(code: int | None, written: str, folder: str = "folder", need: str = "") -> str:
    """The fix for an ``OSError`` of errno ``code`` met while writing ``written`` (the
    export, the adapter) beside its ``folder``: more space (``need`` says how much), a
    writable file system or permission; anything else asks to check the path and disk.

    >>> write_fix(errno.EACCES, "the adapter")
    'save to a folder you may write (and its parent: the adapter is written beside it first)'
    >>> write_fix(None, "the export")
    'check the path and the disk, and save again'
    """
    denied = (f"save to a {folder} you may write (and its parent: {written} is written "
              "beside it first)")
    fixes = {errno.ENOSPC: f"free space on that disk{need}, or save elsewhere",
             errno.EDQUOT: "free space in your disk quota, or save elsewhere",
             errno.EROFS: "save to a writable file system",
             errno.EACCES: denied, errno.EPERM: denied}
    return fixes.get(code or 0, "check the path and the disk, and save again")


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Names ``path`` in an OSError raised without a file name (a full disk fails a
    ``write`` with a bare ``[Errno 28]``): the error then says which file it was.

    >>> with writing(Path("/x/model.safetensors")):
    ...     raise OSError(28, "No space left on device")
    Traceback (most recent call last):
    ...
    OSError: [Errno 28] No space left on device: '/x/model.safetensors'
    """
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


@dataclasses.dataclass(frozen=True)
class Modes:
    """The permissions and owner an export takes: the destination folder's when it
    exists (a private 0700 folder stays private), else a new folder's; its files
    never more open than the folder lets them be read, nor than the files they
    replace."""

    folder: int
    files: int
    owner: tuple[int, int] | None
    replaced: dict[str, int]

    def apply(self, stage: Path, names: Iterable[str]) -> None:
        """Gives the written ``names`` in ``stage`` and ``stage`` itself their modes."""
        for name in names:
            p = stage / name
            with writing(p):
                os.chmod(p, self.files & self.replaced.get(name, 0o7777))
            self._own(p)
        with writing(stage):
            os.chmod(stage, self.folder)
        self._own(stage)

    def _own(self, p: Path) -> None:
        if self.owner is None:
            return
        info = os.lstat(p)
        if (info.st_uid, info.st_gid) != self.owner:
            # Only root may give a file away; a group of the user's may be taken.
            with contextlib.suppress(OSError):
                os.chown(p, self.owner[0], self.owner[1], follow_symlinks=False)
            with contextlib.suppress(OSError):
                os.chown(p, -1, self.owner[1], follow_symlinks=False)


def make_stage(stage: Path, out: Path) -> Modes:
    """Makes the staging folder ``stage`` of an export to ``out``, readable by this
    user only while it is written, and returns the modes the export takes.

    >>> import tempfile
    >>> out = Path(tempfile.mkdtemp())
    >>> os.chmod(out, 0o700)
    >>> modes = make_stage(staging(out, "0" * 32), out)
    >>> oct(modes.folder), oct(modes.files & 0o077)
    ('0o700', '0o0')
    """
    # A plain mkdir's mode (the umask's) is what a new destination gets; the folder is
    # empty until it is closed to others.
    os.mkdir(stage)
    fresh = stat.S_IMODE(os.stat(stage).st_mode)
    os.chmod(stage, 0o700)
    if not out.is_dir():
        return Modes(fresh, fresh & 0o666, None, {})
    info = os.stat(out)
    folder = stat.S_IMODE(info.st_mode)
    reach = 0o700 | (0o070 if folder & 0o010 else 0) | (0o007 if folder & 0o001 else 0)
    replaced = {}
    for p in out.iterdir():
        if OUR_NAMES.fullmatch(p.name) and not p.is_symlink() and p.is_file():
            replaced[p.name] = stat.S_IMODE(p.stat().st_mode) | 0o600
    return Modes(folder, fresh & 0o666 & reach, (info.st_uid, info.st_gid), replaced)


def _fingerprint(path: Path) -> dict[str, Any]:
    """The size of ``path`` and a SHA-256 of its first and last MiB (a safetensors
    header, with every tensor's name, shape and offset, is in the first); read through
    one descriptor of the file itself, never what a link in its place leads to."""
    with open_within(path, None) as f:
        size = os.fstat(f.fileno()).st_size
        h = hashlib.sha256(f.read(_PROBE))
        if size > _PROBE:
            f.seek(max(_PROBE, size - _PROBE))
            h.update(f.read(_PROBE))
    return {"size": size, "sha256": h.hexdigest()}


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


@dataclasses.dataclass(frozen=True)
class Marker:
    """A marker save_safetensors wrote: its export's token, destination folder name,
    writer (host, process id), whether the export is finished, and its files."""

    token: str
    target: str
    host: str
    pid: int
    complete: bool
    files: dict[str, dict[str, Any]]


def write_marker(folder: Path, token: str, target: str, files: Iterable[str] | None) -> None:
    """Writes ``folder``'s marker (atomically): unfinished when ``files`` is None, else
    finished, with the size and digest of each of ``files`` (already written).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> write_marker(d, "a" * 32, "out", None)
    >>> read_marker(d).complete
    False
    """
    body = {"format": _FORMAT, "writer": _WRITER, "token": token, "target": target,
            "host": socket.gethostname(), "pid": os.getpid(), "complete": files is not None,
            "files": {n: _fingerprint(folder / n) for n in sorted(files or ())}}
    raw = (json.dumps({**body, "digest": _digest(body)}, indent=1) + "\n").encode()
    tmp = folder / (MARKER + ".tmp")
    with writing(folder / MARKER):
        st.write_file(str(tmp), raw)
        info = os.stat(folder)  # the export's mode and owner are the folder's by now
        os.chmod(tmp, stat.S_IMODE(info.st_mode) & 0o666)
        Modes(0, 0, (info.st_uid, info.st_gid), {})._own(tmp)
        os.replace(tmp, folder / MARKER)


def read_marker(folder: Path) -> Marker | None:
    """``folder``'s marker, None when it has none; an :class:`ExportError` naming the
    marker when it is not a record save_safetensors wrote (nothing is deleted on its
    word then).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / MARKER).write_text('{"files": ["precious.txt"]}')
    >>> read_marker(d)
    Traceback (most recent call last):
    ...
    nnx_shard.hf._export_dir.ExportError: save_safetensors: ...
    """
    path = folder / MARKER
    if not os.path.lexists(path):
        return None
    why = _marker_problem(path)
    if isinstance(why, Marker):
        return why
    raise ExportError(
        f"save_safetensors: {path} is not a record save_safetensors wrote ({why}), so it "
        f"proves nothing about the files in {folder}; nothing was deleted or written. Fix: "
        f"remove {path} (and any files of an export in {folder} you no longer need) "
        "yourself, or save to another directory.")


def _marker_problem(path: Path) -> Marker | str:
    if path.is_symlink() or not path.is_file():
        return "not a regular file"
    try:
        with open_within(path, None) as f:
            if os.fstat(f.fileno()).st_size > _MAX_MARKER:
                return "too large"
            data = json.loads(f.read())
    except NotAFile:  # swapped for a link or a pipe since the look above
        return "not a regular file"
    except (OSError, ValueError, RecursionError) as e:
        return f"unreadable: {type(e).__name__}"
    if not isinstance(data, dict) or data.get("format") != _FORMAT or \
            data.get("writer") != _WRITER:
        return "not of this nnx_shard's format: no sizes and digests of its files"
    body = {k: v for k, v in data.items() if k != "digest"}
    if data.get("digest") != _digest(body):
        return "its digest does not match its content"
    files, token = data.get("files"), data.get("token")
    if not (isinstance(token, str) and _TOKEN.fullmatch(token) and isinstance(files, dict)
            and isinstance(data.get("target"), str) and isinstance(data.get("host"), str)
            and isinstance(data.get("pid"), int) and isinstance(data.get("complete"), bool)):
        return "fields missing or of the wrong type"
    for name, info in files.items():
        if not OUR_NAMES.fullmatch(name):
            return f"it lists {name!r}, a name save_safetensors never writes"
        if not (isinstance(info, dict) and isinstance(info.get("size"), int)
                and isinstance(info.get("sha256"), str)):
            return f"no size and digest for {name!r}"
    return Marker(token, data["target"], data["host"], data["pid"], data["complete"], files)


def owned(folder: Path, marker: Marker | None) -> set[str]:
    """The files of ``folder`` provably written by the save ``marker`` records: a
    name save_safetensors writes, a regular file, the recorded size and digest.

    >>> owned(Path("/nonexistent"), None)
    set()
    """
    if marker is None:
        return set()
    mine = set()
    for name, info in marker.files.items():
        p = folder / name
        try:
            if not p.is_symlink() and p.is_file() and _fingerprint(p) == {
                    "size": info["size"], "sha256": info["sha256"]}:
                mine.add(name)
        except OSError:
            continue
    return mine


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samestat(os.lstat(a), os.lstat(b))
    except OSError:
        return False


def remove_stage(stage: Path, token: str, out: Path | None = None, *,
                 mine: bool = False) -> bool:
    """Removes the staging folder ``stage`` of the export ``token``: the files of the
    forms save_safetensors writes, the user's files it hard-linked from ``out``, its
    marker, the folder. Anything else in it is left (with the folder); returns
    whether the folder is gone. Unless ``mine`` (this process made it, under a fresh
    token), its marker must name ``token``.

    >>> remove_stage(Path("/nonexistent/.x.nnx_shard-export-" + "0" * 32), "0" * 32)
    True
    """
    if not mine:
        try:
            marker = read_marker(stage)
        except (ExportError, OSError):
            return not os.path.lexists(stage)
        if marker is None or marker.token != token:
            return not os.path.lexists(stage)
    if stage.is_symlink() or not stage.is_dir():
        return not os.path.lexists(stage)
    for p in list(stage.iterdir()):
        if OUR_NAMES.fullmatch(p.name) or p.name == MARKER + ".tmp":
            if not p.is_symlink() and p.is_file():
                _unlink(p)
        elif out is not None and _same_file(p, out / p.name):
            _unlink(p)
    _unlink(stage / MARKER)
    return _rmdir(stage)


def _unlink(p: Path) -> None:
    try:
        p.unlink()
    except FileNotFoundError:
        pass


def _rmdir(p: Path) -> bool:
    try:
        p.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _alive(marker: Marker) -> bool:
    """Whether the process that wrote ``marker`` may still run (always, when it ran on
    another host: that cannot be known from here)."""
    if marker.host != socket.gethostname():
        return True
    if marker.pid == os.getpid():
        return marker.token in _ACTIVE
    return pid_running(marker.pid)


def pid_running(pid: int) -> bool:
    """Whether the process ``pid`` of this host may still run: it exists, or it is
    one this process may not signal (so it cannot be proven gone).

    >>> pid_running(os.getpid())
    True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def clean_leftovers(out: Path) -> None:
    """Removes what killed saves to ``out`` left beside it: staging folders proven ours
    whose process is gone, and previous exports whose swap finished. Anything not
    proven ours is left, with a warning.

    >>> clean_leftovers(Path("/nonexistent/out"))
    """
    if not out.parent.is_dir():
        return
    head = f".{out.name}{_STAGE}"
    for p in sorted(out.parent.iterdir()):
        token = p.name[len(head):] if p.name.startswith(head) else ""
        if not _TOKEN.fullmatch(token) or p.is_symlink() or not p.is_dir():
            continue
        try:
            left = _clean_one(p, token, out)
        except (ExportError, OSError) as e:
            left = f"{type(e).__name__}: {e}"
        if left:
            warnings.warn(f"save_safetensors: left {p} in place ({left}).", stacklevel=3)


def _clean_one(p: Path, token: str, out: Path) -> str:
    marker = read_marker(p)
    if marker is None and _nascent(p):
        return ""
    if marker is None or marker.target != out.name:
        return "it has no marker of a save_safetensors export to this destination"
    if marker.token == token:  # a staged export never swapped in
        if _alive(marker):
            return ""  # a save in flight
        return "" if remove_stage(p, token, out) else "it holds files save_safetensors did not write"
    # The previous export, swapped out by the save ``token``: once ``out`` holds that save.
    try:
        now = read_marker(out)
    except ExportError:
        now = None
    if now is None or now.token != token:
        return "the save that replaced it did not finish"
    return "" if _drop_previous(p, out, marker) else \
        "it holds files that could not be moved back"


_HEAD = b'{\n "format": 2,\n "writer": "nnx_shard.save_safetensors"'


def _nascent(p: Path) -> bool:
    """Removes ``p`` when it holds nothing but the start of a marker being written (a
    save killed before its marker was in place: no data of anyone's); True if done."""
    tmp = p / (MARKER + ".tmp")
    if [q.name for q in p.iterdir()] != [tmp.name] or tmp.is_symlink() or not tmp.is_file():
        return False
    try:
        with open_within(tmp, None) as f:
            head = f.read(len(_HEAD) + 1)
    except OSError:
        return False
    if not (_HEAD.startswith(head) or head.startswith(_HEAD)):
        return False
    _unlink(tmp)
    return _rmdir(p)


def _drop_previous(old: Path, out: Path, marker: Marker) -> bool:
    """Removes the previous export ``old`` (swapped out of ``out``): its proven files
    go, the user's files come back to ``out`` (hard-linked there already, or moved)."""
    mine = owned(old, marker)
    for p in list(old.iterdir()):
        if p.name in mine:
            _unlink(p)
        elif p.name == MARKER:
            continue
        elif _same_file(p, out / p.name):
            _unlink(p)
        elif not os.path.lexists(out / p.name):
            os.rename(p, out / p.name)
    if [p.name for p in old.iterdir()] == [MARKER]:
        _unlink(old / MARKER)
    return _rmdir(old)


def carry_over(out: Path, stage: Path, previous: set[str]) -> None:
    """Hard-links the user's regular files of ``out`` (all but the ``previous``
    export's and its marker) into ``stage``, so they are in the new export from the
    moment it is swapped in; others are moved back after the swap."""
    if not out.is_dir():
        return
    for p in out.iterdir():
        if p.name in previous or p.name == MARKER or os.path.lexists(stage / p.name):
            continue
        if not p.is_symlink() and p.is_file():
            try:
                os.link(p, stage / p.name, follow_symlinks=False)
            except OSError:
                continue  # moved back after the swap instead


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> None:
    """Swaps the folders ``a`` and ``b`` atomically (Linux ``renameat2``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(a))


def swap_in(stage: Path, out: Path, token: str) -> None:
    """Puts the finished export ``stage`` at ``out``: renamed there when ``out`` is
    absent or an empty folder, else swapped with it (the previous export then goes)."""
    if not os.path.lexists(out):
        os.rename(stage, out)
        return
    try:
        os.rmdir(out)  # empty: nothing to keep
    except OSError:
        pass
    else:
        os.rename(stage, out)
        return
    fsync_dir(out.parent)
    _exchange(stage, out)
    fsync_dir(out.parent)
    # The export is in place: what follows only tidies, and never fails the save.
    try:
        previous = read_marker(stage)
        if previous is None:  # the user's files only (no export was there before)
            previous = Marker(token, out.name, "", 0, True, {})
        gone = _drop_previous(stage, out, previous)
    except (ExportError, OSError):
        gone = False
    if not gone:
        warnings.warn(f"save_safetensors: the previous export's folder {stage} holds files "
                      f"that could not be moved back to {out}; it is left in place.",
                      stacklevel=3)


def fsync_dir(path: Path) -> None:
    """Flushes a folder's entries to disk (a rename is durable only then)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
