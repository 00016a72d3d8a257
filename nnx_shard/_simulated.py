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

__all__ = ["Workers", "run_one", "run_requests", "serve", "serve_lines", "simulated_env"]

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


def _child_code(serve_fn: str, spec: str, error_chars: int) -> str:
    """A child's ``python -c`` code: ``serve_fn(spec, error_chars)`` of this file, loaded
    by its path. This module needs only the standard library; loading it through
    ``nnx_shard`` would import JAX (seconds of CPU) before the target asks for it, in
    a child whose target may never need it."""
    here = os.path.abspath(__file__)
    return ("import importlib.util as u; "
            f"s = u.spec_from_file_location('_nnx_shard_simulated_child', {here!r}); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); "
            f"m.{serve_fn}({spec!r}, {int(error_chars)})")


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
        print(json.dumps({"i": i, **_answer(fn, request, error_chars)}), flush=True)


def _answer(fn: Callable[[Any], Mapping[str, Any]], request: Any,
            error_chars: int) -> dict[str, Any]:
    """``fn(request)`` as a dict, or ``{"error": "Type: message"}`` if it raised."""
    try:
        return dict(fn(request))
    except Exception as e:  # reported to the parent as one line
        msg = " ".join(str(e).split()) or type(e).__name__
        return {"error": f"{type(e).__name__}: {msg}"[:error_chars]}


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
    proc = subprocess.Popen([sys.executable, "-c", _child_code("serve", spec, error_chars)],
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



def run_one(spec: str, request: Mapping[str, Any], n_devices: int, *, timeout: float,
            what: str, slow: str, fix: str = "", error_chars: int = 1000) -> dict[str, Any]:
    """The result of :func:`run_requests` on the one ``request``; a
    :class:`~nnx_shard._errors.CompileError` saying ``what`` took longer than ``timeout``
    (then ``slow``, its way out) or failed (with the child's error, then ``fix``).

    >>> run_one("builtins:dict", {"a": 1}, 2, timeout=120, what="a copy", slow="")
    {'a': 1}
    >>> try:
    ...     run_one("os:fspath", {}, 2, timeout=120, what="a path", slow="", fix=". Fix: none")
    ... except Exception as e:
    ...     print(f"{type(e).__name__}: {str(e)[:30]}...{str(e)[-10:]}")
    CompileError: a path failed: TypeError: ex.... Fix: none
    """
    from nnx_shard._errors import CompileError

    results: list[dict[str, Any]] = []
    run_requests(spec, [request], n_devices, timeout=timeout,
                 on_result=lambda i, r: results.append(r), error_chars=error_chars)
    (result,) = results
    if result.get("timed_out"):
        raise CompileError(f"{what} took longer than {timeout:g} s{slow}")
    if "failed" in result or "error" in result:
        # The child's error (one of nnx_shard's, with its own Fix:) or its last words.
        raise CompileError(f"{what} failed: {result.get('failed') or result.get('error')}{fix}")
    return result

def serve_lines(spec: str, error_chars: int = 1000) -> None:
    """The child's side of :class:`Workers`: one JSON request per line of stdin, one
    JSON result line each (``{"error": ...}`` if the function raised), until stdin
    closes."""
    fn = _target(spec)
    for line in sys.stdin:
        if line.strip():
            answer = _answer(lambda text: fn(json.loads(text)), line, error_chars)
            print(json.dumps(answer), flush=True)


class _Child:
    """One long-lived child of :class:`Workers`."""

    def __init__(self, spec: str, n_devices: int, error_chars: int) -> None:
        code = _child_code("serve_lines", spec, error_chars)
        self.proc = subprocess.Popen([sys.executable, "-c", code],
                                     env=simulated_env(n_devices, importable=True),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self.answered = 0
        # stderr is drained as it comes, so a chatty child never blocks on a full pipe.
        self._drain = threading.Thread(target=self._read_err, daemon=True)
        self._drain.start()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err = [*self.err[-19:], line.rstrip()]

    def ask(self, request: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """The child's answer to ``request``, or ``{"failed": why, "timed_out": bool}``
        (the child is then dead: killed past ``timeout`` seconds, or it died). The
        first request of a child gets 60 s more, for its start."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        fired = threading.Event()

        def kill() -> None:
            fired.set()
            self.proc.kill()

        timer = threading.Timer(timeout + (0 if self.answered else 60), kill)
        timer.start()
        line = ""
        try:
            self.proc.stdin.write(json.dumps(dict(request)) + "\n")
            self.proc.stdin.flush()
            while True:
                line = self.proc.stdout.readline()
                if not line or line.startswith("{"):
                    break
        except OSError:  # a broken pipe: the child is gone
            line = ""
        finally:
            timer.cancel()
        if line:
            self.answered += 1
            result: dict[str, Any] = json.loads(line)
            return result
        self.close()
        self._drain.join(timeout=5)
        why = (f"took longer than {timeout:g} s" if fired.is_set()
               else (self.err[-1] if self.err else f"exit {self.proc.returncode}"))
        return {"failed": why, "timed_out": fired.is_set()}

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        # The pipes are closed too (a garbage-collected open pipe is a ResourceWarning);
        # stderr once the drain thread has read it to its end.
        self._drain.join(timeout=5)
        for pipe in (self.proc.stdin, self.proc.stdout,
                     None if self._drain.is_alive() else self.proc.stderr):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:  # a broken pipe's buffered write fails on close
                    pass


class Workers:
    """Up to ``size`` long-lived children with ``n_devices`` simulated CPU devices,
    each calling the function ``spec`` (``"module:function"``) on one request at a
    time: :meth:`map` hands each request to the next idle child, so the children
    start (Python, JAX, the first compile's warm-up) once for many calls, and a slow
    request never holds the others back. A child that dies or runs past ``timeout``
    seconds on a request is replaced for the next one. Use it as a context manager
    (the children end with it).

    >>> with Workers("builtins:dict", 2, size=2, timeout=120) as w:
    ...     got = {}
    ...     w.map([{"a": 1}, {"b": 2}, {"c": 3}], lambda i, r: got.update({i: r}))
    ...     w.map([{"d": 4}], lambda i, r: got.update({3: r}))
    >>> [got[i] for i in range(4)]
    [{'a': 1}, {'b': 2}, {'c': 3}, {'d': 4}]
    >>> with Workers("os:fspath", 2, size=1, timeout=120) as w:
    ...     w.map([{}], lambda i, r: print(r))
    {'error': 'TypeError: expected str, bytes or os.PathLike object, not dict'}
    """

    def __init__(self, spec: str, n_devices: int, *, size: int, timeout: float,
                 error_chars: int = 1000) -> None:
        self.spec, self.n_devices, self.size = spec, n_devices, max(1, int(size))
        self.timeout, self.error_chars = timeout, error_chars
        self._children: list[_Child | None] = [None] * self.size
        self.started = 0  # children started, replacements included

    def _child(self, slot: int) -> _Child:
        child = self._children[slot]
        if child is None or not child.alive:
            child = _Child(self.spec, self.n_devices, self.error_chars)
            self._children[slot] = child
            self.started += 1
        return child

    def map(self, requests: Sequence[Mapping[str, Any]],
            on_result: Callable[[int, dict[str, Any]], None],
            skip: Callable[[int], bool] | None = None) -> None:
        """Answers ``requests`` (``on_result(index, result)`` as each finishes, from
        the children's threads) and returns when all are answered, but those for
        which ``skip(index)``, asked as a child takes it up, is true (not sent)."""
        pending = list(enumerate(requests))
        lock = threading.Lock()

        def work(slot: int) -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    i, request = pending.pop(0)
                if skip is not None and skip(i):
                    continue
                on_result(i, self._child(slot).ask(request, self.timeout))

        slots = range(min(self.size, len(pending)))
        threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in slots]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def close(self) -> None:
        """Ends the children."""
        for child in self._children:
            if child is not None:
                child.close()
        self._children = [None] * self.size

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
