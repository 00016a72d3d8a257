"""nnx_shard leaves the rest of its user's program alone: importing it, saving and restoring
checkpoints, and opening and closing Checkpointers (synchronous and background saves)
change none of orbax's module functions, absl's logger filters, logging's handlers,
asyncio's event-loop policy, the interpreter's exit hooks (``threading``'s and
``atexit``'s) or its exception hooks. A watcher thread samples the same state all along,
so a change made only while a call runs (and undone after) is caught too."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The ``atexit`` callbacks nnx_shard registers, by module and name: each one must be
#: documented (docs/architecture.md, "Where the library touches process state").
DOCUMENTED_ATEXIT = ["nnx_shard._checkpoint._exits._finish_saves_at_exit"]

_CHILD = textwrap.dedent('''
    import asyncio, atexit, concurrent.futures.thread, json, logging, pathlib, sys
    import tempfile, threading, time, weakref

    import jax
    import jax.numpy as jnp
    import orbax.checkpoint
    from flax import nnx
    from orbax.checkpoint._src.serialization import tensorstore_utils

    # What the libraries below nnx_shard do on their own first use is not nnx_shard's:
    # the stdlib's weakref.finalize registers one atexit callback on its first use, and
    # jax and orbax set up their own state when they first run.
    class _Anything:
        pass
    _anything = _Anything()
    weakref.finalize(_anything, lambda: None)
    jnp.zeros(2).block_until_ready()

    # Every callback registered through atexit's functions from here on, while not taken
    # back (``atexit._ncallbacks`` alone cannot tell: unregistering leaves its slot).
    live, made = [], [0]
    _register, _unregister = atexit.register, atexit.unregister

    def _track_register(func, *args, **kwargs):
        live.append(func)
        made[0] += 1
        return _register(func, *args, **kwargs)

    def _track_unregister(func):
        live[:] = [f for f in live if f != func]
        return _unregister(func)

    def snapshot():
        return {
            "atexit_live": [f"{f.__module__}.{f.__qualname__}" for f in list(live)],
            "tensorstore_utils": dict(vars(tensorstore_utils)),
            "absl_filters": list(logging.getLogger("absl").filters),
            "absl_handlers": list(logging.getLogger("absl").handlers),
            "root_handlers": list(logging.getLogger().handlers),
            "policy": asyncio.get_event_loop_policy(),
            "threading_atexits": list(threading._threading_atexits),
            "atexit_slots": atexit._ncallbacks() - made[0],
            "hooks": (sys.excepthook, sys.unraisablehook, threading.excepthook),
        }

    def changed(before, now, allowed):
        """The names of what differs from ``before`` (objects compared by identity),
        ``allowed``: the atexit callbacks that may be registered now."""
        out = [f"atexit {name}" for name in now["atexit_live"] if name not in allowed]
        # More slots than registrations made through atexit.register: one made around it.
        if now["atexit_slots"] > before["atexit_slots"]:
            out.append("atexit_slots")
        a, b = before["tensorstore_utils"], now["tensorstore_utils"]
        out += [f"tensorstore_utils.{k}" for k in sorted(a.keys() | b.keys())
                if k not in a or k not in b or a[k] is not b[k]]
        for key in ("absl_filters", "absl_handlers", "root_handlers", "threading_atexits",
                    "hooks"):
            if len(before[key]) != len(now[key]) or any(
                    x is not y for x, y in zip(before[key], now[key])):
                out.append(key)
        if before["policy"] is not now["policy"]:
            out.append("policy")
        return out

    before = snapshot()
    atexit.register, atexit.unregister = _track_register, _track_unregister
    seen = set()
    stop = threading.Event()

    def watch():  # a change made only while a call runs, and undone after, is seen here
        while not stop.is_set():
            seen.update(changed(before, snapshot(), DOCUMENTED))
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    phases = {}

    import nnx_shard as ns
    phases["import"] = changed(before, snapshot(), [])

    d = tempfile.mkdtemp()
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    target = nnx.eval_shape(lambda: nnx.Linear(4, 4, rngs=nnx.Rngs(1)))
    ns.save(d + "/plain", 1, model=model)
    ns.restore(d + "/plain", model=target)
    phases["save_restore"] = changed(before, snapshot(), [])

    with ns.Checkpointer(d + "/sync", async_save=False) as ckpt:
        ckpt.save(1, model=model)
        ckpt.restore(model=target)
    phases["sync_checkpointer"] = changed(before, snapshot(), [])

    ckpt = ns.Checkpointer(d + "/async", keep=1, async_save=True)
    ckpt.save(1, model=model)
    phases["async_save_in_flight"] = changed(before, snapshot(), DOCUMENTED)
    phases["atexit_while_open"] = snapshot()["atexit_live"]
    ckpt.save(2, model=model)
    ckpt.wait()
    ckpt.restore(model=target)
    ckpt.close()
    phases["steps"] = [ckpt.steps(), sorted(p.name for p in pathlib.Path(d, "sync").iterdir())]
    phases["async_checkpointer_closed"] = changed(before, snapshot(), [])
    stop.set()
    watcher.join()
    phases["watched"] = sorted(seen)
    print("PHASES" + json.dumps(phases))
''')


def test_nnx_shard_patches_nothing_outside_itself(tmp_path) -> None:
    code = f"DOCUMENTED = {DOCUMENTED_ATEXIT!r}\n" + _CHILD
    env = {**os.environ, "TMPDIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("PHASES"))
    phases = json.loads(line[len("PHASES"):])
    assert phases["steps"] == [[2], [".nnx_shard.lock", "1"]], phases
    for phase in ("import", "save_restore", "sync_checkpointer", "async_save_in_flight",
                  "async_checkpointer_closed", "watched"):
        assert phases[phase] == [], (phase, phases)
    # The one callback registered while a Checkpointer is open: it settles its saves at exit.
    assert phases["atexit_while_open"] == DOCUMENTED_ATEXIT, phases
