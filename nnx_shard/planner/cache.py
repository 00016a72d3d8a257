"""The planner's compile results by request: in memory for the process, and in a
JSON file across runs (``nnx-shard plan --auto`` keeps ``~/.cache/nnx_shard/planner.json``).
A key names the model, the candidate, the batch and the versions of jax, flax and
nnx_shard's own sources, so a changed library never reads an old figure.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, ClassVar

import flax
import jax

__all__ = ["Cache", "default_cache", "versions"]

# nnx_shard's sources: any change to them (a layout, the trainer) can change a compile.
_SOURCES = Path(__file__).resolve().parents[1]


class Cache:
    """Compile results by key, in memory and optionally in a JSON file ``path``.

    >>> c = Cache(None, shared=False)
    >>> c.put("k", {"total": 1}); c.get("k"), c.get("other")
    ({'total': 1}, None)
    """

    shared: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, path: str | os.PathLike[str] | None, shared: bool = True) -> None:
        # Results of a replaced compile (compile_fn) stay out of the process-wide table.
        self.memory = self.shared if shared else {}
        self.path = Path(path) if path else None
        self.disk: dict[str, dict[str, Any]] = {}
        if self.path and self.path.is_file():
            try:
                self.disk = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self.disk = {}

    def get(self, key: str) -> dict[str, Any] | None:
        return self.memory.get(key) or self.disk.get(key)

    def put(self, key: str, value: dict[str, Any]) -> None:
        self.memory[key] = value
        if self.path and "error" not in value:
            self.disk[key] = value

    def save(self) -> None:
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.disk))
            tmp.replace(self.path)


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
