"""A save_safetensors killed (SIGKILL, by itself) at a chosen point, for the kill trials
of tests/hf/test_export_dir.py.

  python tests/hf/export_trial.py OUT SEED bytes:N   killed once N bytes are written
  python tests/hf/export_trial.py OUT SEED phase:P   killed at P: before_swap | after_swap

Without a point (``none``) the save runs to its end. Nothing here runs on import.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    out, seed, point = argv[0], int(argv[1]), argv[2]
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard import _safetensors_io as st
    from nnx_shard.hf import _export_dir as export_dir
    from nnx_shard.models import Decoder, DecoderConfig

    model = ns.sharded_init(
        lambda: Decoder(DecoderConfig(), rngs=nnx.Rngs(seed)), "data=8", ns.strategies.get("fsdp"))
    kind, _, arg = point.partition(":")
    if kind == "bytes":
        budget = [int(arg)]
        real = st._pwrite

        def pwrite(fd: int, data: Any, offset: int) -> int:
            if len(data) >= budget[0]:
                if budget[0]:
                    real(fd, memoryview(data)[:budget[0]], offset)
                _die()
            budget[0] -= len(data)
            return real(fd, data, offset)

        st._pwrite = pwrite
    elif point == "phase:before_swap":
        export_dir.swap_in = lambda *a: _die()  # type: ignore[assignment]
    elif point == "phase:after_swap":
        exchange = export_dir._exchange

        def exchanged(a: Any, b: Any) -> None:
            exchange(a, b)
            _die()

        export_dir._exchange = exchanged  # type: ignore[assignment]
    ns.hf.save_safetensors(out, model, max_shard_bytes=30_000)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
