"""A Checkpointer on a full disk inside ``Trainer.fit``: the few bytes of the claim a
save (or the deletion of an old step) writes first fail with a bare ``[Errno 28]``
(a full disk names no file); the error names the checkpoint directory, the file and
the fix, and leaves no temporary file. The disk is made full by failing the write,
never by filling it.
"""

from __future__ import annotations

import errno
import os
import pathlib
from typing import Any

import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard._checkpoint._exits import CheckpointWriteError
from tests.conftest import needs_devices

pytestmark = needs_devices(8)


def _fit(ckpt: ns.Checkpointer) -> Any:
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    trainer = ns.Trainer(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
                         lambda m, b: ((m(b) - 1.0) ** 2).mean(), mesh="data=8",
                         rules={"batch": "data"}, steps_per_call=2)
    return trainer.fit([np.ones((8, 2), np.float32)] * 4, 4, checkpointer=ckpt, progress=False)


def _full_for(monkeypatch: pytest.MonkeyPatch, kind: str | None) -> None:
    """Claims (of ``kind``, any when None) fail as a full disk fails a write."""
    real = pathlib.Path.write_text

    def write_text(self: pathlib.Path, data: str, *a: Any, **k: Any) -> int:
        if ".nnx_shard-claim-" in self.name and (kind is None or f'"{kind}"' in data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data, *a, **k)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)


def _temporaries(folder: pathlib.Path) -> list[str]:
    return [n for n in os.listdir(folder) if n.endswith(".tmp") or "tmp" in n]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_in_fit_names_the_checkpoint_directory(tmp_path, monkeypatch,
                                                          async_save) -> None:
    ckpt = ns.Checkpointer(tmp_path / "ck", every=2, async_save=async_save)
    with monkeypatch.context() as m:
        _full_for(m, None)
        with pytest.raises(CheckpointWriteError, match=rf"Checkpointer: the save of step 2 to "
                           rf"{tmp_path / 'ck'} failed: No space left on device .*\.nnx_shard-"
                           r"claim-.*that step was not written.*Fix: free disk space") as e:
            _fit(ckpt)
    assert isinstance(e.value, OSError) and isinstance(e.value, ns.NnxShardError)
    assert e.value.errno == errno.ENOSPC
    assert _temporaries(tmp_path / "ck") == [] and ckpt.steps() == []
    # Space again: the next save goes through.
    ckpt.save(2, model=nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    ckpt.close()
    assert ckpt.steps() == [2]


def test_a_full_disk_while_deleting_old_steps_keeps_them(tmp_path, monkeypatch) -> None:
    ckpt = ns.Checkpointer(tmp_path / "ck", every=2, keep=1, async_save=False)
    with monkeypatch.context() as m:
        _full_for(m, "trash")
        with pytest.raises(CheckpointWriteError, match=r"step 4 was saved to .*ck, but deleting "
                           r"the checkpoints beyond keep=1 failed: .*No space left on device.*"
                           r"finished steps: \[2, 4\].*Fix: free disk space"):
            _fit(ckpt)
    assert _temporaries(tmp_path / "ck") == [] and ckpt.steps() == [2, 4]
    ckpt.save(6, model=nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    ckpt.close()
    assert ckpt.steps() == [6]
