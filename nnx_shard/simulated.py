"""A fresh Python with N simulated CPU devices: its environment, and a runner that
calls one function of nnx_shard there on a list of JSON requests.

XLA reads the host device count once, when JAX starts its CPU backend; a process
that needs another count (the planner compiling for 256 devices, a test of an
8-device job) starts a child with :func:`simulated_env`. :func:`run_requests` is
the one way nnx_shard does that for its own work (``nnx-shard plan``'s compile,
the planner's search and calibration): requests go in as one JSON list on stdin,
results come back one JSON line each, as they finish.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["run_requests", "serve", "simulated_env"]

FORCE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")
# The directory nnx_shard is imported from, so a child imports the same code.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def simulated_env(n: int, base: Mapping[str, str] | None = None, *,
                  importable: bool = False) -> dict[str, str]:
    """The environment of a child Python with ``n`` simulated CPU devices: a copy of
    ``base`` (default ``os.environ``) whose ``XLA_FLAGS`` keep their other flags and
    force ``n`` host devices, on the CPU platform. ``JAX_NUM_CPU_DEVICES`` is dropped
    (it would disagree). The flag must be set before jax loads: hence a child.
    ``importable=True`` puts this nnx_shard's directory first on ``PYTHONPATH``.

    >>> env = simulated_env(4, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --a=1"})
    >>> env["XLA_FLAGS"], env["JAX_PLATFORMS"]
    ('--a=1 --xla_force_host_platform_device_count=4', 'cpu')
    """
    env = dict(os.environ if base is None else base)
    flags = FORCE_COUNT.sub("", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    if importable:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    return env


def _target(spec: str) -> Callable[[dict[str, Any]], Mapping[str, Any]]:
    module, _, name = spec.partition(":")
    fn: Callable[[dict[str, Any]], Mapping[str, Any]] = getattr(
        importlib.import_module(module), name)
    return fn


def serve(spec: str, error_chars: int = 1000) -> None:
    """The child's side of :func:`run_requests`: reads a JSON list of requests from
    stdin, calls the function ``spec`` (``"module:function"``) on each and prints one
    JSON line per request, ``{"i": index, **result}``, or ``{"i": index, "error":
    "Type: message"}`` if it raised."""
    fn = _target(spec)
    for i, request in enumerate(json.loads(sys.stdin.read())):
        try:
            result = dict(fn(request))
        except Exception as e:  # reported to the parent as one line
            msg = " ".join(str(e).split()) or type(e).__name__
            result = {"error": f"{type(e).__name__}: {msg}"[:error_chars]}
        print(json.dumps({"i": i, **result}), flush=True)


def run_requests(spec: str, requests: Sequence[Mapping[str, Any]], n_devices: int, *,
                 timeout: float, on_result: Callable[[int, dict[str, Any]], None],
                 error_chars: int = 1000) -> None:
    """Calls the function ``spec`` (``"module:function"``, taking a request dict and
    returning a JSON-able dict) on each of ``requests`` in one fresh Python with
    ``n_devices`` simulated CPU devices, and ``on_result(index, result)`` here as
    each finishes. ``result`` is the function's dict, ``{"error": "Type: message"}``
    if it raised, or ``{"failed": why, "timed_out": bool}`` for a request the child
    did not answer: it ran past ``timeout`` seconds (all requests together) or died
    (``why`` is its last line of stderr, or its exit status).

    >>> got = []
    >>> run_requests("builtins:dict", [{"a": 1}, {"b": 2}], 2, timeout=120,
    ...              on_result=lambda i, r: got.append((i, r)))
    >>> got
    [(0, {'a': 1}), (1, {'b': 2})]
    >>> run_requests("os:fspath", [{}], 2, timeout=120, on_result=lambda i, r: print(r))
    {'error': 'TypeError: expected str, bytes or os.PathLike object, not dict'}
    """
    code = f"from nnx_shard.simulated import serve; serve({spec!r}, {int(error_chars)})"
    proc = subprocess.Popen([sys.executable, "-c", code],
                            env=simulated_env(n_devices, importable=True),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(list(requests)))
        proc.stdin.close()
        seen = set()
        for line in proc.stdout:
            if line.startswith("{"):
                result = json.loads(line)
                i = result.pop("i")
                seen.add(i)
                on_result(i, result)
        proc.wait()
        err = (proc.stderr.read() if proc.stderr else "").strip().splitlines()
        timed_out = not timer.is_alive()
        why = (f"took longer than {timeout:g} s" if timed_out
               else (err[-1] if err else f"exit {proc.returncode}"))
        for i in range(len(requests)):
            if i not in seen:
                on_result(i, {"failed": why, "timed_out": timed_out})
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
