"""Training metrics to disk: JSON lines always, TensorBoard when tensorboardX is installed.

:class:`MetricsWriter` is a :meth:`nnx_shard.Trainer.fit` callback. JSON lines
need nothing beyond the standard library and are easy to read back (pandas,
``jq``, a plain loop); TensorBoard event files come from ``tensorboardX``
(``pip install 'nnx_shard[tensorboard]'``), which writes them without
TensorFlow or PyTorch.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import jax
import numpy as np

from nnx_shard._errors import UsageError, check_path

JSONL_NAME = "metrics.jsonl"
#: Rows a later run wrote again (see :class:`MetricsWriter`) move here, not away.
REPLACED_NAME = "metrics.replaced.jsonl"


def _value(v: Any) -> Any:
    """One metric as strict JSON: a number, or nested lists for an array metric (a
    vector aux metric); NaN/Inf become ``null`` (json.dumps would write ``NaN``), a
    complex number ``{"re": ..., "im": ...}``."""
    a = np.asarray(v)
    if a.ndim:
        return [_value(x) for x in a]
    x = a.item()
    if isinstance(x, complex):
        return {"re": _value(x.real), "im": _value(x.imag)}
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if not isinstance(x, bool | int | float):
        raise UsageError(f"MetricsWriter: a metric holds {x!r} ({type(x).__name__}), not a "
                         "number. Fix: return numbers or numeric arrays as metrics.")
    return x


def _row_step(line: str) -> int | None:
    """The ``step`` of one complete JSON line the writer wrote (``None``: not one)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _directory(directory: Any) -> Path:
    if isinstance(directory, bytes) or not isinstance(directory, str | os.PathLike):
        raise UsageError(
            f"MetricsWriter: directory must be a str or os.PathLike path, got "
            f"{type(directory).__name__} {directory!r:.60}. Fix: e.g. MetricsWriter('logs')."
        )
    text = os.fspath(directory)
    if not isinstance(text, str) or text == "":
        raise UsageError(
            f"MetricsWriter: directory {text!r:.60} is empty (it would mean the current "
            "directory). Fix: name a folder, e.g. MetricsWriter('logs') or "
            "MetricsWriter('.') for the current one."
        )
    check_path(text, "MetricsWriter", name=f"directory {text!r:.200}", missing_ok=True,
               kind_error=NotADirectoryError, fix="name a folder (created if missing).")
    return Path(text)


class MetricsWriter:
    """A ``Trainer.fit`` callback writing every step's metrics to ``directory``.

    Each step becomes one line of ``directory/metrics.jsonl``:
    ``{"step": 7, "loss": 2.31, "grad_norm": 0.8}`` (strict JSON: a NaN or Inf
    value is written as ``null``; an array metric, such as a vector aux metric,
    as a list), flushed after every fused call, so the file is current while
    training runs. Lines are appended to what a previous run wrote, but the file
    holds each step once: when a run writes a step the file already holds (a
    run resumed from an earlier checkpoint after a crash, or a new run in the
    same directory), the rows from that step on move to
    ``directory/metrics.replaced.jsonl`` (appended, nothing is lost), as does
    a last line cut short by a crash. ``tensorboard=None`` also writes
    TensorBoard scalars (one tag per metric; an array metric as a histogram)
    when ``tensorboardX`` is importable, ``True`` requires it (``ImportError``
    naming the extra otherwise), ``False`` never does; a run that writes steps
    again starts its event file with ``purge_step`` there, so TensorBoard hides
    the replaced ones too. With several processes only process 0 writes. Close
    it with :meth:`close`, or use it as a context manager.

    Args:
      directory: the folder of ``metrics.jsonl`` (created if needed).
      tensorboard: also write TensorBoard event files (needs ``tensorboardX``); ``None``: when it is
        installed.

    >>> import json, os, tempfile
    >>> import numpy as np, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> mse = lambda m, b: jnp.mean((m(b) - 1.0) ** 2)
    >>> trainer = ns.Trainer(model, opt, mse, mesh="data=8", rules={"batch": "data"},
    ...                      steps_per_call=2)
    >>> logdir = tempfile.mkdtemp()
    >>> with ns.MetricsWriter(logdir, tensorboard=False) as writer:
    ...     history = trainer.fit([np.ones((8, 2), np.float32)] * 4, 4, progress=False,
    ...                           callbacks=[writer])
    >>> lines = open(os.path.join(logdir, "metrics.jsonl")).read().splitlines()
    >>> [json.loads(line)["step"] for line in lines]
    [1, 2, 3, 4]
    >>> json.loads(lines[-1])["loss"] == float(history["loss"][-1])
    True
    """

    def __init__(self, directory: str | os.PathLike[str], *,
                 tensorboard: bool | None = None) -> None:
        if tensorboard is not None and not isinstance(tensorboard, bool):
            raise UsageError(
                f"MetricsWriter(tensorboard=...) takes None (when tensorboardX is installed), "
                f"True or False, got {tensorboard!r}. Fix: tensorboard=True, False or None"
            )
        self.directory = _directory(directory)
        self._file: Any = None
        self._tb: Any = None
        self._summary_writer: Any = None
        # The last step in the file (None: not read yet), to notice a step written again.
        self._last: int | None = None
        summary_writer: Any = None
        if tensorboard is not False:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                if tensorboard:
                    raise ImportError(
                        "MetricsWriter(tensorboard=True) needs tensorboardX, which is not "
                        "installed. Fix: pip install 'nnx_shard[tensorboard]', or pass "
                        "tensorboard=None to write TensorBoard files only when it is."
                    ) from e
            else:
                summary_writer = SummaryWriter
        if jax.process_index() != 0:
            return  # one set of files per job
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file = open(self.directory / JSONL_NAME, "a", encoding="utf-8")
        # The event file is opened at the first write, once it is known whether the
        # run writes steps again (then TensorBoard is told to purge from there).
        self._summary_writer = summary_writer

    @property
    def path(self) -> Path:
        """The JSON lines file."""
        return self.directory / JSONL_NAME

    @property
    def tensorboard(self) -> bool:
        """Whether TensorBoard event files are written."""
        return self._summary_writer is not None or self._tb is not None

    def __call__(self, step: int, metrics: dict[str, np.ndarray]) -> None:
        if self._file is None:
            return
        if "step" in metrics:
            raise UsageError(
                "MetricsWriter: a metric is named 'step', which numbers the rows. Fix: "
                "rename it (Trainer.fit refuses such aux metrics up front)."
            )
        # ``step`` is the last of this call's steps; metrics hold one entry per step.
        n = len(next(iter(metrics.values()))) if metrics else 0
        if n == 0:
            return
        first = step - n + 1
        purge = self._take_back(first)
        if self._summary_writer is not None and self._tb is None:
            self._tb = self._summary_writer(str(self.directory), purge_step=purge)
        for i in range(n):
            s = first + i
            row = {key: _value(v[i]) for key, v in metrics.items()}
            self._file.write(json.dumps({"step": s, **row}, allow_nan=False) + "\n")
            if self._tb is not None:
                for key, v in metrics.items():
                    self._tensorboard(key, np.asarray(v[i]), s)
        self._last = step
        self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def _tensorboard(self, key: str, v: np.ndarray, step: int) -> None:
        if np.iscomplexobj(v):
            return  # TensorBoard has no complex scalars; the JSON line holds them
        if v.size == 1:
            x = float(v.reshape(()))
            if math.isfinite(x):
                self._tb.add_scalar(key, x, step)
            return
        finite = v[np.isfinite(v)] if v.dtype.kind == "f" else v.reshape(-1)
        if finite.size:
            self._tb.add_histogram(key, finite.astype(np.float64), step)

    def _take_back(self, first: int) -> int | None:
        """Before steps from ``first`` on are written: rows of the file at or past
        ``first`` (and a last line cut short) move to :data:`REPLACED_NAME`. Returns
        ``first`` when rows moved (TensorBoard's purge step), else ``None``."""
        path = self.directory / JSONL_NAME
        if self._last is not None and first > self._last:
            return None
        self._file.flush()
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines(keepends=True)
        keep, moved = [], []
        last = None
        for line in lines:
            step = _row_step(line) if line.endswith("\n") else None
            if not line.endswith("\n") or (step is not None and step >= first):
                moved.append(line if line.endswith("\n") else line + "\n")
            else:
                keep.append(line)
                last = step if step is not None else last
        self._last = last
        if not moved:
            return None
        # The moved rows are kept first, then the file is replaced whole: a crash in
        # between leaves them in both places, never in neither.
        with open(self.directory / REPLACED_NAME, "a", encoding="utf-8") as f:
            f.writelines(moved)
        tmp = path.with_name(f".{JSONL_NAME}.tmp")
        tmp.write_text("".join(keep), encoding="utf-8")
        self._file.close()
        os.replace(tmp, path)
        self._file = open(path, "a", encoding="utf-8")
        return first

    def close(self) -> None:
        """Flushes and closes the files (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._summary_writer = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
