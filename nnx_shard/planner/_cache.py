"""The planner's compile results by request: in memory for the process, and in a
JSON file across runs (``nnx-shard plan --auto`` keeps ``~/.cache/nnx_shard/planner.json``).
A key names the model, the candidate, the batch and the versions of jax, flax and
nnx_shard's own sources, so a changed library never reads an old figure.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, ClassVar

import flax
import jax

from nnx_shard._errors import UsageError, short

__all__ = ["Cache", "default_cache", "versions"]

# nnx_shard's sources: any change to them (a layout, the trainer) can change a compile.
_SOURCES = Path(__file__).resolve().parents[1]


_FIX = ("Fix: delete it (compile results are computed again and saved), or leave the cache "
        "out (--no-cache, cache=None)")
# A compile result's numbers: what the search reads (see evaluate.apply_result).
_COUNTS = ("total", "temp")
_FIGURES = ("flops", "collective_bytes", "collectives", "memory_bytes")


def _entry_problem(value: Any) -> str | None:
    """Why a cached compile result cannot be one (``None``: it can)."""
    if not isinstance(value, dict):
        return f"{short(value, 40)}, not an object of figures"
    if "error" in value:
        return "a failed compile (never saved)"
    for key in (*_COUNTS, *_FIGURES):
        if key not in value and key in ("total", "flops", "collective_bytes"):
            return f"no {key!r}"
        x = value.get(key, 0)
        ok = isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
        if not ok or (key in _COUNTS and x != int(x)):
            return f"{key!r} is {short(x, 40)}, not a {'byte count' if key in _COUNTS else 'figure'} >= 0"
    kinds = value.get("by_kind", {})
    if not isinstance(kinds, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            and math.isfinite(v) for k, v in kinds.items()):
        return "'by_kind' is not an object of figures"
    seconds = value.get("compile_s")
    if seconds is not None and (not isinstance(seconds, int | float) or isinstance(seconds, bool)
                                or not math.isfinite(seconds)):
        return f"'compile_s' is {short(seconds, 40)}"
    return None


class Cache:
    """Compile results by key, in memory and optionally in a JSON file ``path``.

    The file is read once: one that is not a JSON object (corrupt, or written by
    something else) is a :class:`~nnx_shard._errors.UsageError` naming it, and so
    is an entry the search looks up that is not a compile result (a negative or
    non-finite byte count would make a layout "fit"); entries never looked up
    are left alone. :meth:`save` writes what was added, best effort: a cache
    that cannot be written costs the next run its compiles, never this run's plan.

    >>> c = Cache(None, shared=False)
    >>> c.put("k", {"total": 1, "flops": 0.0, "collective_bytes": 0.0}); c.get("k")
    {'total': 1, 'flops': 0.0, 'collective_bytes': 0.0}
    >>> c.get("other") is None
    True
    """

    shared: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, path: str | os.PathLike[str] | None, shared: bool = True) -> None:
        # Results of a replaced compile (compile_fn) stay out of the process-wide table.
        self.memory = self.shared if shared else {}
        self.path = Path(path) if path else None
        self.disk: dict[str, Any] = {}
        if self.path and self.path.exists():
            where = f"planner cache {short(str(self.path), 1000)}"
            if not self.path.is_file():
                raise UsageError(f"{where} is not a regular file. {_FIX}")
            try:
                data = self.path.read_bytes()
            except OSError as e:
                raise UsageError(f"{where} cannot be read ({e.strerror or e}). {_FIX}") from None
            try:
                disk = json.loads(data.decode("utf-8"))
            except (ValueError, RecursionError):
                disk = None
            if not isinstance(disk, dict):
                raise UsageError(f"{where} is not a JSON object of compile results "
                                 f"(corrupt, or not written by nnx_shard). {_FIX}")
            self.disk = disk

    def get(self, key: str) -> dict[str, Any] | None:
        hit = self.memory.get(key)
        if hit is not None:
            return hit
        if key not in self.disk:
            return None
        value = self.disk[key]
        why = _entry_problem(value)
        if why is not None:
            raise UsageError(f"planner cache {short(str(self.path), 1000)}: the entry for this "
                             f"compile is {why}. {_FIX}")
        return value

    def put(self, key: str, value: dict[str, Any]) -> None:
        self.memory[key] = value
        if self.path and "error" not in value:
            self.disk[key] = value

    def save(self) -> str | None:
        """Writes the file (atomically: a temporary file renamed over it); returns why
        it could not be written, or ``None``."""
        if not self.path:
            return None
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.disk))
            tmp.replace(self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            return (f"planner cache {short(str(self.path), 1000)} could not be written "
                    f"({e.strerror or type(e).__name__}); the next run compiles again")
        return None


def default_cache() -> Path:
    """Where ``nnx-shard plan --auto`` keeps compile results (``$XDG_CACHE_HOME``
    or ``~/.cache``, then ``nnx_shard/planner.json``).

    >>> default_cache().name
    'planner.json'
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nnx_shard" / "planner.json"


def versions() -> str:
    """jax's and flax's versions and a digest of nnx_shard's sources, for cache keys.

    >>> versions().startswith(f"jax{jax.__version__}-flax{flax.__version__}-")
    True
    """
    digest = hashlib.sha1()
    for f in sorted(_SOURCES.rglob("*.py")):
        digest.update(f.read_bytes())
    return f"jax{jax.__version__}-flax{flax.__version__}-{digest.hexdigest()[:12]}"
