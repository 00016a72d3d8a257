"""Files the library reads from a folder it was pointed at (a checkpoint, an adapter,
a tokenizer, an export's source), opened once: whatever is checked about a file (a
regular file, inside the folder) is checked on the descriptor every byte is then read
from, so a file swapped for a link (or a FIFO) between a check and the read changes
nothing that is read.

:func:`open_within` and :func:`read_within` open and read; :func:`folder_roots` gives a
checkpoint folder's roots (the folder, and its hub cache repository), :data:`ANYWHERE`
the roots of a file whose links may lead anywhere. The errors they raise,
:class:`~nnx_shard._errors.LinkedOut` and :class:`~nnx_shard._errors.NotAFile`, are of
the one error family in :mod:`nnx_shard._errors`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from nnx_shard._errors import LinkedOut, NotAFile, mode_kind

__all__ = ["ANYWHERE", "folder_roots", "open_within", "read_within", "roots_words"]

#: The roots of a file whose symbolic links may lead anywhere (a checkpoint's weight
#: shards: the hub cache, and stores laid out like it, link each one to a blob kept
#: outside the folder). The file is still opened once, without following a link
#: swapped in after its path was resolved, and must be a regular file.
ANYWHERE: tuple[str, ...] = (os.path.abspath(os.sep),)


def folder_roots(folder: str | os.PathLike[str]) -> list[str]:
    """The folders a file of the checkpoint folder ``folder`` may lead into (real
    paths): the folder, and, for a snapshot of the Hugging Face hub cache
    (``models--org--name/snapshots/<revision>``), its repository folder, since the
    snapshot's files link to ``../../blobs/<hash>``.

    >>> folder_roots("/cache/models--org--tiny/snapshots/abc")
    ['/cache/models--org--tiny/snapshots/abc', '/cache/models--org--tiny']
    >>> folder_roots("/ckpt/llama")
    ['/ckpt/llama']
    """
    real = Path(os.path.realpath(folder))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return [str(real), str(real.parent.parent)]
    return [str(real)]


def roots_words(roots: Sequence[str]) -> str:
    """:func:`folder_roots`' folders, in a message's words.

    >>> roots_words(["/ckpt"])
    '/ckpt'
    >>> roots_words(folder_roots("/cache/models--org--tiny/snapshots/abc"))
    '/cache/models--org--tiny/snapshots/abc or its hub cache repository /cache/models--org--tiny'
    """
    return " or its hub cache repository ".join(roots)


def _within(target: str, roots: Sequence[str]) -> bool:
    # commonpath: '/ckpt/a' is not inside '/ckpt/ab', as a prefix test would say
    return any(os.path.commonpath([target, root]) == root for root in roots)


def _opened_at(fd: int) -> str | None:
    """Where the open file ``fd`` is, as the kernel resolved it when it was opened
    (None where the system cannot say)."""
    try:
        where = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        where = ""
        try:
            import fcntl

            getpath = getattr(fcntl, "F_GETPATH", None)  # macOS
            if getpath is not None:
                where = os.fsdecode(fcntl.fcntl(fd, getpath, bytes(1024)).rstrip(b"\0"))
        except (ImportError, OSError):
            pass
    # A file removed (replaced) after it was opened still reads as what was opened.
    where = where.removesuffix(" (deleted)")
    return where if os.path.isabs(where) else None


@contextlib.contextmanager
def open_within(path: str | os.PathLike[str], roots: Sequence[str | os.PathLike[str]] | None
                ) -> Iterator[BinaryIO]:
    """The regular file at ``path``, opened once for reading: everything read of it
    comes from that one descriptor, so a file swapped for a link between a check and
    the read cannot lead anywhere else.

    With ``roots`` (folders) a symbolic link is followed only when it resolves inside
    one of them, the resolved file is opened without following a link in its last
    component (``O_NOFOLLOW``), and where the opened file really is (the kernel's
    record of the descriptor) must be inside one of them too: that covers a folder
    on the way swapped for a link. With :data:`ANYWHERE` a link is followed wherever
    it resolves, and only the opened file's kind is checked. Without ``roots`` no link
    is followed at all.

    Raises:
      LinkedOut: the file leads out of ``roots``.
      NotAFile: it is a folder, a FIFO or a device (a FIFO is never waited on).
      OSError: it cannot be opened.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> with open(os.path.join(d, "a.txt"), "w") as f:
    ...     _ = f.write("hi")
    >>> with open_within(os.path.join(d, "a.txt"), [d]) as f:
    ...     f.read()
    b'hi'
    >>> os.symlink("/etc/hostname", os.path.join(d, "b.txt"))
    >>> with open_within(os.path.join(d, "b.txt"), [d]) as f:
    ...     pass
    Traceback (most recent call last):
    ...
    nnx_shard._errors.LinkedOut: ...b.txt leads to /etc/hostname, outside the folder ...
    """
    path = os.fspath(path)
    flags = (os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_CLOEXEC", 0))
    if roots is None:
        real, inside = path, None
    else:
        inside = [os.path.realpath(r) for r in roots]
        real = os.path.realpath(path)
        if not _within(real, inside):
            raise LinkedOut(path, real)
    try:
        fd = os.open(real, flags)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EMLINK):  # EMLINK: the BSDs' O_NOFOLLOW
            raise
        target = os.path.realpath(real)
        if inside is not None and not _within(target, inside):
            raise LinkedOut(path, target) from None
        raise NotAFile(path, "a symbolic link") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotAFile(path, mode_kind(info.st_mode))
        if inside is not None:
            where = _opened_at(fd)
            if where is None:  # no record: the path must still resolve to the opened file
                again = os.path.realpath(real)
                try:
                    same = os.path.samestat(info, os.stat(again))
                except OSError:
                    same = False
                if not (same and again == real):
                    raise LinkedOut(path, f"{again} (it changed while it was opened)")
                where = again
            if not _within(where, inside):
                raise LinkedOut(path, where)
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def read_within(path: str | os.PathLike[str], roots: Sequence[str | os.PathLike[str]] | None
                ) -> bytes:
    """The bytes of the regular file at ``path``, read as :func:`open_within` opens it.

    >>> read_within("pyproject.toml", ["."])[:9]
    b'[build-sy'
    """
    with open_within(path, roots) as f:
        return f.read()
