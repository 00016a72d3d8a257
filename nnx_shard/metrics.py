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

JSONL_NAME = "metrics.jsonl"


def _value(v: Any) -> float | int | None:
    """One metric as strict JSON: NaN/Inf become ``null`` (json.dumps would write ``NaN``)."""
    v = np.asarray(v).item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsWriter:
    """A ``Trainer.fit`` callback writing every step's metrics to ``directory``.

    Each step becomes one line of ``directory/metrics.jsonl``:
    ``{"step": 7, "loss": 2.31, "grad_norm": 0.8}`` (strict JSON: a NaN or Inf
    value is written as ``null``), appended to what a previous run wrote and
    flushed after every fused call, so the file is current while training
    runs. ``tensorboard=None`` also writes TensorBoard scalars (one tag per
    metric) when ``tensorboardX`` is importable, ``True`` requires it
    (``ImportError`` naming the extra otherwise), ``False`` never does. With
    several processes only process 0 writes. Close it with :meth:`close`, or
    use it as a context manager.

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
        if tensorboard not in (None, True, False):
            raise TypeError(
                f"MetricsWriter(tensorboard=...) takes None (when tensorboardX is installed), "
                f"True or False, got {tensorboard!r}"
            )
        self.directory = Path(directory)
        self._file: Any = None
        self._tb: Any = None
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
        if summary_writer is not None:
            self._tb = summary_writer(str(self.directory))

    @property
    def path(self) -> Path:
        """The JSON lines file."""
        return self.directory / JSONL_NAME

    @property
    def tensorboard(self) -> bool:
        """Whether TensorBoard event files are written."""
        return self._tb is not None

    def __call__(self, step: int, metrics: dict[str, np.ndarray]) -> None:
        if self._file is None:
            return
        # ``step`` is the last of this call's steps; metrics hold one entry per step.
        n = len(next(iter(metrics.values()))) if metrics else 0
        for i in range(n):
            s = step - n + 1 + i
            row = {key: _value(v[i]) for key, v in metrics.items()}
            self._file.write(json.dumps({"step": s, **row}, allow_nan=False) + "\n")
            if self._tb is not None:
                for key, v in row.items():
                    if v is not None:
                        self._tb.add_scalar(key, v, s)
        self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flushes and closes the files (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
