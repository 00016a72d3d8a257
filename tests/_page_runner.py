"""Runs a page's python blocks in a child process forked from one server per test process.

Each page runs in its own fresh process, as a reader's script would, but a fresh Python pays
~1.6 CPU-s importing jax, flax, optax, orbax and nnx_shard before its first block: some twenty
pages and README paid it once each. The server (a child Python on 8 simulated devices) imports
them once, never creating a JAX backend, and forks one process per page: the fork starts from
the imported modules and creates its backend itself, so the ``XLA_FLAGS`` and device count of
the server's environment (read when the backend is made) take effect in every page.

A fork is safe here: the server runs no Python thread and holds no JAX backend, device or
lock when it forks (numpy's BLAS pool registers its own fork handlers). The page's process
ends as the script's did: ``sys.exit`` after the blocks, so exit hooks (a checkpointer's
pending save) run and a non-zero status fails the test.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from nnx_shard._simulated import simulated_env

ROOT = Path(__file__).resolve().parents[1]

# The server: imports the pages' libraries (no backend), then forks one process per request
# line {"blocks": file, "page": name, "cwd": dir, "out": file}; answers {"pid": ...} after the
# fork and {"status": ..., "cpu": ...} when that process ends.
_SERVER = r"""
import importlib, json, os, sys, traceback, warnings
import numpy, jax, jax.numpy, optax, orbax.checkpoint
from flax import nnx
import nnx_shard, nnx_shard.models, nnx_shard.hf, nnx_shard.inference, nnx_shard.corpus
import nnx_shard.planner
for extra in ("qwix", "tokenizers", "jinja2", "tqdm.auto", "yaml"):   # where installed
    try:
        importlib.import_module(extra)
    except ImportError:
        pass
from nnx_shard._compat import private  # JAX's private modules are read there alone
assert not private("jax._src.xla_bridge", "_backends"), (
    "the server must not create a JAX backend before it forks")


def run_page(request):
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]                  # as `python run.py` in that folder
    fd = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)                              # the server's requests are not the page's
    sys.stdin = open(0, closefd=False)
    sys.argv = ["run.py", request["blocks"], request["page"]]
    blocks, page = json.load(open(request["blocks"])), request["page"]
    ns = {"__name__": "__readme__"}
    for line, code in blocks:
        print(f"== {page} block at line {line}", flush=True)
        try:
            exec(compile(code, f"{page}:{line}", "exec"), ns)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED {page} block at line {line}", flush=True)
            sys.exit(1)
    print("ALL BLOCKS RAN", flush=True)
    sys.exit(0)


for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        # Python 3.12 warns of any OS thread at fork; the only one is numpy's BLAS pool.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        run_page(request)                         # exits with the page's status
    print(json.dumps({"pid": pid}), flush=True)
    _, status, usage = os.wait4(pid, 0)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status),
                      "cpu": usage.ru_utime + usage.ru_stime}), flush=True)
"""


class _Server:
    def __init__(self) -> None:
        env = simulated_env(8)
        self.log = tempfile.TemporaryFile()      # the server's own stderr (import warnings)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], env=env, cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log)
        self._pending = b""

    def _answer(self, timeout: float) -> dict[str, Any]:
        # Read from the pipe's descriptor with our own buffer: a buffered reader could hold
        # the next answer while select waits on the empty pipe.
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                self.log.seek(0)
                raise RuntimeError(f"the page server died: {self.log.read()[-6000:].decode(errors='replace')}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, request: dict[str, str], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        pid = self._answer(300)["pid"]         # the first waits for the imports
        try:
            return self._answer(timeout)
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._answer(60)
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(60)


_server: _Server | None = None


def _the_server() -> _Server:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
        atexit.register(_server.close)
    return _server


def run_page(blocks: Path, page: str, cwd: Path, timeout: float) -> tuple[int, str]:
    """Runs the blocks saved in ``blocks`` (JSON list of (line, code)) in a process forked
    from the server, inside ``cwd``; returns its exit status and its output (stdout and
    stderr, interleaved as written)."""
    out = cwd / "output.txt"
    request = {"blocks": str(blocks), "page": page, "cwd": str(cwd), "out": str(out)}
    try:
        answer = _the_server().run(request, timeout)
    except TimeoutError:
        return -9, out.read_text() + f"\n(killed after {timeout} s)"
    # The page's process is the server's child: its CPU reaches this process's rusage (and
    # a per-test profiler) only when the server exits. Printed for `pytest -rP`.
    print(f"{page}: {answer['cpu']:.1f} CPU-s in the page's process")
    return answer["status"], out.read_text()
