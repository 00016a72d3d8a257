"""Importing nnx_shard, and saving and restoring with it, leaves the process as it
found it: absl's logger filters, logging's handlers, asyncio's event-loop policy,
the interpreter's exit hooks and orbax's module functions (docs/architecture.md,
"Where the library touches process state")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_SNAPSHOT = textwrap.dedent('''
    import asyncio, atexit, json, logging, sys, threading, weakref

    # The stdlib's weakref.finalize registers one atexit callback on its first use
    # (JAX's tracing uses it): made here, so it is not counted against the library.
    class _Anything:
        pass
    _anything = _Anything()
    weakref.finalize(_anything, lambda: None)

    def snapshot():
        orbax = {}
        ts = sys.modules.get("orbax.checkpoint._src.serialization.tensorstore_utils")
        if ts is not None:
            orbax["raw_bytes"] = ts.get_tensorstore_raw_bytes.__module__
        return {
            "absl_filters": [type(f).__name__ for f in logging.getLogger("absl").filters],
            "root_handlers": [type(h).__name__ for h in logging.getLogger().handlers],
            "absl_handlers": [type(h).__name__ for h in logging.getLogger("absl").handlers],
            "policy": type(asyncio.get_event_loop_policy()).__name__,
            "threading_atexits": [getattr(getattr(f, "func", f), "__qualname__", repr(f))
                                  for f in getattr(threading, "_threading_atexits", [])],
            "atexit_count": atexit._ncallbacks(),
            "orbax": orbax,
        }
''')


def _run(body: str) -> dict[str, dict[str, object]]:
    code = _SNAPSHOT + textwrap.dedent(body) + "\nprint('SNAP' + json.dumps(out))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "NNX_SHARD_DEBUG": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("SNAP"))
    return json.loads(line[4:])


def test_import_changes_no_process_state() -> None:
    out = _run('''
        import orbax.checkpoint  # imported first, so its own import-time state is in "before"
        out = {"before": snapshot()}
        import nnx_shard, nnx_shard._checkpoint
        out["after"] = snapshot()
    ''')
    assert out["before"]["orbax"] == {"raw_bytes":
                                      "orbax.checkpoint._src.serialization.tensorstore_utils"}
    assert out["after"] == out["before"]


def test_save_restore_and_checkpointer_put_everything_back(tmp_path) -> None:
    out = _run(f'''
        import orbax.checkpoint
        from flax import nnx
        import nnx_shard
        from nnx_shard._checkpoint import Checkpointer, restore, save
        from nnx_shard._checkpoint import _backend as backend
        out = {{"before": snapshot()}}
        model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        seen = []
        real = backend._no_raw_bytes
        def spy(*a, **k):
            seen.append(snapshot())
            return real(*a, **k)
        backend._no_raw_bytes = spy
        save({str(tmp_path / "a")!r}, 1, model=model)
        restore({str(tmp_path / "a")!r}, model=nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
        out["after_save_restore"] = snapshot()
        ckpt = Checkpointer({str(tmp_path / "b")!r}, every=1, keep=1, async_save=True)
        ckpt.save(1, model=model)
        out["open"] = snapshot()
        ckpt.close()
        out["after_checkpointer"] = snapshot()
        out["during"] = seen[0] if seen else {{}}
    ''')
    before = out["before"]
    assert out["after_save_restore"] == before
    assert out["after_checkpointer"] == before
    # While in use the stand-in and the filter are in place (so the tests above test
    # something), and an open Checkpointer holds its exit hook.
    assert out["during"]["absl_filters"] == [*before["absl_filters"], "_OrbaxRecords"]
    assert out["during"]["orbax"]["raw_bytes"] == "__main__"
    assert out["open"]["threading_atexits"] == [*before["threading_atexits"],
                                                "_finish_saves_at_exit"]
    assert out["open"]["absl_filters"] == [*before["absl_filters"], "_OrbaxRecords"]
