"""What ``nnx-shard demo`` writes in ``--out``, and what it may replace there.

A run writes its checkpoint, plot and summary into a staging folder inside
``--out`` (``.nnx_shard_demo-run-<token>``) and moves them into place only once
it has succeeded: a run that stops early (the NaN guard) or fails leaves the
previous run's outputs as they were.

The record :data:`MARKER` lists, for each output, the proof that the demo wrote
it: a SHA-256 of a file's bytes, a checkpoint step's manifest digest, and it
carries a digest of itself. An output is replaced or deleted only when it still
matches its proof; a record the demo did not write (forged, corrupt, older)
proves nothing, so the outputs it names are the user's and the run is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any

from nnx_shard.cli._common import UsageError as _Usage

__all__ = ["MARKER", "Outputs", "Stage"]

#: The demo's record, in ``--out``, of the outputs it wrote there (JSON).
MARKER = ".nnx_shard_demo.json"
#: The outputs a run writes at the top of ``--out``.
FILES = ("summary.json", "summary.stopped.json", "loss.png")
_FORMAT = 2
_WRITER = "nnx-shard demo"
_STEP = re.compile(r"checkpoint/(0|[1-9][0-9]*)")
_STAGE = ".nnx_shard_demo-run-"
_STAGE_RECORD = ".nnx_shard_demo_run.json"
_TOKEN = re.compile(r"[0-9a-f]{32}")
_MAX = 1 << 20


def _digest(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


def proof(path: Path) -> str | None:
    """What proves ``path`` is the output the demo wrote: a file's size and SHA-256, a
    checkpoint step's manifest digest (the step whole), ``"dir"`` for the checkpoint
    folder; None when it is none of these.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "summary.json").write_text("{}")
    >>> proof(d / "summary.json")[:8]
    'file:2:4'
    """
    from nnx_shard._checkpoint._internal import not_whole

    if path.is_symlink():
        return None
    if path.is_file():
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return f"file:{path.stat().st_size}:{h.hexdigest()}"
    if not path.is_dir():
        return None
    if path.name == "checkpoint":
        return "dir"
    if not_whole(path) is not None:
        return None
    try:
        digest = json.loads((path / "manifest" / "metadata").read_bytes()).get("digest")
    except (OSError, ValueError, AttributeError):
        return None
    return f"step:{digest}" if isinstance(digest, str) else None


class Outputs:
    """The demo's record in ``out``: each output's accepted proofs.

    >>> import tempfile
    >>> out = Path(tempfile.mkdtemp())
    >>> _ = (out / "summary.json").write_text("{}")
    >>> Outputs(out).prove("summary.json")
    >>> Outputs(out).owns("summary.json")
    True
    >>> _ = (out / "summary.json").write_text("the user's now")
    >>> Outputs(out).owns("summary.json")
    False
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.proofs: dict[str, list[str]] = {}
        self.ignored = ""  # why a record found there proves nothing
        path = out / MARKER
        if not os.path.lexists(path):
            return
        why = self._read(path)
        if why:
            self.proofs, self.ignored = {}, f"its record {MARKER} {why}"

    def _read(self, path: Path) -> str:
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size > _MAX:
                return "is not a file the demo wrote"
            data = json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError):
            return "cannot be read"
        if not (isinstance(data, dict) and data.get("format") == _FORMAT
                and data.get("writer") == _WRITER and isinstance(data.get("outputs"), dict)):
            return "is not one this demo wrote"
        if data.get("digest") != _digest(data["outputs"]):
            return "does not match its digest"
        for name, proofs in data["outputs"].items():
            if not (name in FILES or name == "checkpoint" or _STEP.fullmatch(name)) or \
                    not isinstance(proofs, list) or not all(isinstance(p, str) for p in proofs):
                return f"names {name!r}, which the demo never writes"
        self.proofs = {k: list(v) for k, v in data["outputs"].items()}
        return ""

    @property
    def wrote(self) -> list[str]:
        return sorted(self.proofs)

    def owns(self, name: str) -> bool:
        """Whether ``out/name`` is there and still what the demo wrote."""
        if name not in self.proofs or not os.path.lexists(self.out / name):
            return False
        return proof(self.out / name) in self.proofs[name]

    def steps(self) -> list[int]:
        """The checkpoint steps of earlier runs that are still what the demo wrote."""
        return sorted(int(n.split("/")[1]) for n in self.proofs
                      if _STEP.fullmatch(n) and self.owns(n))

    def check(self) -> None:
        """Refuses (one line) an output path that exists but is not the demo's."""
        for name in (*FILES, "checkpoint"):
            if os.path.lexists(self.out / name) and not self.owns(name):
                more = f" ({self.ignored})" if self.ignored else ""
                raise _Usage(
                    f"--out {str(self.out)!r} already holds {name}, which the demo did not "
                    f"write{more}; choose another --out, or move it")

    def prove(self, name: str, *, keep_old: bool = False) -> None:
        """Records ``out/name`` as it is now (with its previous proofs too while it is
        being replaced: ``keep_old``)."""
        p = proof(self.out / name)
        if p is None:
            return
        self.proofs[name] = [*(self.proofs.get(name, []) if keep_old else []), p]
        self._save()

    def expect(self, name: str, source: Path) -> None:
        """Records ``source`` as what ``out/name`` is about to become (its old proofs
        kept), before it is moved there: a kill between leaves it recorded."""
        p = proof(source)
        if p is not None:
            self.proofs[name] = [*self.proofs.get(name, []), p]
            self._save()

    def forget(self, name: str) -> None:
        if self.proofs.pop(name, None) is not None:
            self._save()

    def _save(self) -> None:
        data = {"format": _FORMAT, "writer": _WRITER, "outputs": self.proofs,
                "digest": _digest(self.proofs)}
        tmp = self.out / (MARKER + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.out / MARKER)


class Stage:
    """A run's staging folder inside ``out``: made fresh, removed when the run ends.

    >>> import tempfile
    >>> stage = Stage.create(Path(tempfile.mkdtemp()))
    >>> stage.path.is_dir(), stage.remove(), stage.path.exists()
    (True, True, False)
    """

    def __init__(self, path: Path, token: str) -> None:
        self.path, self.token = path, token

    @classmethod
    def create(cls, out: Path) -> Stage:
        """Removes what killed runs left in ``out`` (proven theirs), then makes a stage."""
        for p in out.iterdir():
            cls._leftover(p)
        token = secrets.token_hex(16)
        path = out / f"{_STAGE}{token}"
        path.mkdir()
        record = {"token": token, "host": socket.gethostname(), "pid": os.getpid()}
        (path / _STAGE_RECORD).write_text(json.dumps(record))
        return cls(path, token)

    @classmethod
    def _leftover(cls, p: Path) -> None:
        token = p.name[len(_STAGE):] if p.name.startswith(_STAGE) else ""
        if not _TOKEN.fullmatch(token) or p.is_symlink() or not p.is_dir():
            return
        try:
            record = json.loads((p / _STAGE_RECORD).read_text())
        except (OSError, ValueError):
            return
        if not isinstance(record, dict) or record.get("token") != token or \
                record.get("host") != socket.gethostname() or \
                not isinstance(record.get("pid"), int):
            return
        try:
            os.kill(record["pid"], 0)
        except ProcessLookupError:
            cls(p, token).remove()
        except OSError:
            return

    def remove(self) -> bool:
        """Removes what a run writes in its stage (its files, its checkpoint folder of
        steps), then the stage; anything else is left, with the stage. True if gone."""
        p = self.path
        if not p.is_dir() or p.is_symlink():
            return not os.path.lexists(p)
        for name in FILES:
            q = p / name
            if q.is_file() and not q.is_symlink():
                q.unlink()
        ckpt = p / "checkpoint"
        if ckpt.is_dir() and not ckpt.is_symlink():
            from nnx_shard._checkpoint._internal import LOCK_FILE, STEP_NAME, TMP_MARK

            for q in ckpt.iterdir():
                if q.is_symlink():
                    continue
                if q.is_dir() and (STEP_NAME.fullmatch(q.name) or (q.name.split(TMP_MARK)[0]
                                   .isdigit() and TMP_MARK in q.name)):
                    shutil.rmtree(q, ignore_errors=True)
                elif q.is_file() and (q.name == LOCK_FILE or q.name.startswith(
                        ".nnx_shard-claim-")):
                    q.unlink()
            with contextlib.suppress(OSError):
                ckpt.rmdir()
        with contextlib.suppress(OSError):
            (p / _STAGE_RECORD).unlink()
        try:
            p.rmdir()
        except OSError:
            return False
        return True
