"""``nnx-shard launch``: N local processes of one multi-process JAX job, on loopback.

The local stand-in for a cluster: ``nnx-shard launch -n 2 --devices-per-process
4 -- python train.py`` starts two copies of ``train.py`` that find each other
through a coordinator on ``127.0.0.1`` and a free port, each with 4 CPU devices
(gloo collectives), so ``train.py`` sees one job of 8 devices split over 2
processes, as on two hosts. ``train.py`` calls ``ns.distributed.initialize()``,
which reads the coordinates the launcher puts in the environment.

Output of every process is streamed line by line, prefixed with ``[i]``.
When one process fails, the others are stopped and the launcher exits with
the failing process's code, naming it (and the process that exited first, when
one left cleanly while its peers still ran: their failure follows from it);
at most 8 processes per CPU core are started; ``--timeout`` stops everything after
that many seconds (exit 124). Each process runs in its own process group, and
every group is killed on the way out, so nothing outlives the launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from nnx_shard._simulated import FORCE_COUNT
from nnx_shard.distributed import (
    ENV_COORDINATOR,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_INIT_TIMEOUT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

__all__ = ["add_arguments", "child_env", "main", "run"]

_PREFIX = "nnx-shard launch: "


PROCESSES_PER_CPU = 8
#: The most CPU devices one process simulates: as many as the planner compiles on
#: (``COMPILE_MAX_DEVICES``), far past the 4-16 devices of a host it stands in for.
#: XLA's host platform makes every device a client of its own (measured here, jax
#: 0.10.2: 0.27 GB resident at 512, 0.42 GB at 2,048, growing ~0.1 MB a device before
#: any array), and a collective over them runs on a few cores; 100,000 devices grew a
#: process to gigabytes before it printed anything.
MAX_DEVICES_PER_PROCESS = 512


def max_processes() -> int:
    """The most processes ``launch`` starts: ``PROCESSES_PER_CPU`` per CPU core this
    process may use. Each process is a whole JAX runtime (hundreds of MB, its own
    threads); far more than the cores only thrash, or exhaust memory and PIDs.

    >>> max_processes() >= PROCESSES_PER_CPU
    True
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return PROCESSES_PER_CPU * max(cores, 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the launcher's options and the ``-- command ...`` to ``parser``.

    >>> p = argparse.ArgumentParser()
    >>> add_arguments(p)
    >>> a = p.parse_args(["-n", "2", "--", "python", "train.py", "--lr", "1e-3"])
    >>> a.num_processes, a.command
    (2, ['--', 'python', 'train.py', '--lr', '1e-3'])
    """
    parser.add_argument(
        "-n", "--num-processes", type=int, required=True, metavar="N",
        help=f"number of processes to start, at most {PROCESSES_PER_CPU} per CPU core "
        f"(here {max_processes()})",
    )
    parser.add_argument(
        "--devices-per-process", type=int, default=None, metavar="K",
        help="CPU devices per process, 1 to "
        f"{MAX_DEVICES_PER_PROCESS} (default: JAX's, or XLA_FLAGS of this shell)",
    )
    parser.add_argument(
        "--platform", choices=("cpu", "inherit"), default="cpu",
        help="cpu (default): the processes use CPU devices only, whatever accelerators "
        "exist; inherit: leave JAX_PLATFORMS as it is",
    )
    parser.add_argument(
        "--port", type=int, default=None,
        help="coordinator port on 127.0.0.1 (default: a free one)",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS",
        help="stop every process after this many seconds (exit 124); default: no limit",
    )
    parser.add_argument(
        "--init-timeout", type=int, default=60, metavar="SECONDS",
        help="seconds the processes wait for each other at start-up (default 60)",
    )
    parser.add_argument(
        "--heartbeat-timeout", type=int, default=30, metavar="SECONDS",
        help="seconds after which a silent process counts as dead (default 30)",
    )
    parser.add_argument(
        "--grace", type=float, default=5.0, metavar="SECONDS",
        help="after SIGTERM, seconds before remaining processes get SIGKILL (default 5)",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER,
        help="the command each process runs, after '--', e.g. -- python train.py",
    )


def child_env(
    process_id: int,
    num_processes: int,
    port: int,
    *,
    devices_per_process: int | None = None,
    platform: str = "cpu",
    init_timeout: int = 60,
    heartbeat_timeout: int = 30,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of process ``process_id``: its coordinates for
    ``ns.distributed.initialize`` and its CPU device count.

    >>> env = child_env(1, 2, 1234, devices_per_process=4, base={"XLA_FLAGS": ""})
    >>> env["NNX_SHARD_COORDINATOR"], env["NNX_SHARD_PROCESS_ID"], env["JAX_NUM_CPU_DEVICES"]
    ('127.0.0.1:1234', '1', '4')
    """
    env = dict(os.environ if base is None else base)
    env.update({
        ENV_COORDINATOR: f"127.0.0.1:{port}",
        ENV_NUM_PROCESSES: str(num_processes),
        ENV_PROCESS_ID: str(process_id),
        ENV_INIT_TIMEOUT: str(init_timeout),
        ENV_HEARTBEAT_TIMEOUT: str(heartbeat_timeout),
        # Lines reach the launcher as they are printed, not at exit.
        "PYTHONUNBUFFERED": "1",
    })
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    if devices_per_process is not None:
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
        # The forced count of a test or benchmark shell would otherwise disagree.
        flags = FORCE_COUNT.sub("", env.get("XLA_FLAGS", "")).strip()
        if flags:
            env["XLA_FLAGS"] = flags
        else:
            env.pop("XLA_FLAGS", None)
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # Linux only: if the launcher itself is killed (SIGKILL cannot be caught), the
    # kernel stops each process too, so none is orphaned.
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


class _Terminated(Exception):
    pass


class _CannotStart(Exception):
    pass


class _Job:
    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.readers: list[threading.Thread] = []
        # (process index, exit code) in the order the exits happened: a peer's death
        # makes the others fail soon after, and the first one is the cause to report.
        self.exits: list[tuple[int, int]] = []

    def start(self, cmd: Sequence[str], envs: list[dict[str, str]]) -> None:
        # Apart from __init__: a signal that lands while the processes start finds the
        # job already known to the launcher, which stops what did start.
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        for env in envs:
            try:
                proc = subprocess.Popen(
                    list(cmd), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec,
                )
            except OSError as e:
                self.stop(0.0)
                raise _CannotStart(f"cannot start {cmd[0]}: {e.strerror or e}") from None
            self.procs.append(proc)
        for i, p in enumerate(self.procs):
            t = threading.Thread(target=self._pump, args=(i, p), daemon=True)
            t.start()
            self.readers.append(t)
            threading.Thread(target=self._wait, args=(i, p), daemon=True).start()

    def _wait(self, i: int, p: subprocess.Popen[bytes]) -> None:
        code = p.wait()
        with self.lock:
            self.exits.append((i, code))

    def _pump(self, i: int, p: subprocess.Popen[bytes]) -> None:
        assert p.stdout is not None
        for raw in iter(p.stdout.readline, b""):
            line = raw.decode(errors="replace")
            if not line.endswith("\n"):
                line += "\n"
            self.say(f"[{i}] {line}")

    def say(self, text: str) -> None:
        with self.lock:
            self.out.write(text)
            self.out.flush()

    def stop(self, grace: float) -> None:
        """SIGTERM to every process group still running, SIGKILL after ``grace``."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            alive = [p for p in self.procs if p.poll() is None]
            for p in alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)
            deadline = time.monotonic() + wait
            for p in alive:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
        # Whatever a process left behind in its group goes too.
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for t in self.readers:
            t.join(timeout=2.0)


def _check(args: argparse.Namespace) -> tuple[list[str], str | None]:
    cmd = list(args.command or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        return cmd, "no command given. Usage: nnx-shard launch -n 2 -- python train.py"
    if args.num_processes < 1:
        return cmd, f"-n must be at least 1, got {args.num_processes}"
    limit = max_processes()
    if args.num_processes > limit:
        return cmd, (
            f"-n {args.num_processes} is more processes than this machine can run: at most "
            f"{limit} ({PROCESSES_PER_CPU} per CPU core). Fix: fewer processes, each with "
            "more devices (--devices-per-process)"
        )
    if args.devices_per_process is not None and args.devices_per_process < 1:
        return cmd, f"--devices-per-process must be at least 1, got {args.devices_per_process}"
    if args.devices_per_process is not None and args.devices_per_process > MAX_DEVICES_PER_PROCESS:
        return cmd, (
            f"--devices-per-process must be at most {MAX_DEVICES_PER_PROCESS}, got "
            f"{args.devices_per_process}: each simulated CPU device costs the process memory "
            "and threads of its own. Fix: more processes (-n) with fewer devices each, e.g. "
            "-n 2 --devices-per-process 4"
        )
    if args.port is not None and not 0 < args.port < 65536:
        return cmd, f"--port must be in 1..65535, got {args.port}"
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        return cmd, f"--timeout must be a finite number of seconds > 0, got {args.timeout}"
    if not (math.isfinite(args.grace) and args.grace >= 0):
        return cmd, f"--grace must be a finite number of seconds >= 0, got {args.grace}"
    if not (math.isfinite(args.init_timeout) and math.isfinite(args.heartbeat_timeout)) or (
            args.init_timeout < 1 or args.heartbeat_timeout < 1):
        return cmd, "--init-timeout and --heartbeat-timeout must be at least 1 second"
    return cmd, None


def _failure(exits: list[tuple[int, int]], n: int) -> tuple[int, str] | None:
    """The exit code and message of the first process that failed (``None``: none did)."""
    codes: list[int | None] = [None] * n
    for j, cj in exits:
        codes[j] = cj
    failed = [(j, cj) for j, cj in exits if cj != 0]
    if not failed:
        return None
    i, c = failed[0]
    others = [str(j) for j, cj in enumerate(codes) if cj is None]
    message = f"process {i} {_describe(c)}"
    first, first_code = exits[0]
    if first_code == 0 and first != i:
        # A process that leaves early (even cleanly) makes its peers fail:
        # it is the one to look at, not the peer whose collective broke.
        message = (
            f"process {first} exited first (code 0) while the others were "
            f"still running, then {message}"
        )
    message += (
        f"; stopping process{'es' if len(others) > 1 else ''} {', '.join(others)}"
        if others else ""
    )
    return (c if c > 0 else 128 - c), message


def _watch(job: _Job, n: int, timeout: float | None) -> tuple[int, str | None]:
    """Waits until every process exits 0, one fails, or ``timeout`` passes; the exit
    code and what to say."""
    start = time.monotonic()
    while True:
        with job.lock:
            exits = list(job.exits)
        failure = _failure(exits, n)
        if failure is not None:
            return failure
        codes = dict(exits)
        if len(codes) == n:  # every process exited, each with 0
            return 0, None
        if timeout is not None and time.monotonic() - start > timeout:
            running = [str(j) for j in range(n) if j not in codes]
            return 124, (
                f"timed out after {timeout:g} s; stopping process"
                f"{'es' if len(running) > 1 else ''} {', '.join(running)}"
            )
        time.sleep(0.05)


def run(args: argparse.Namespace, *, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Runs the job described by ``args`` (from :func:`add_arguments`); returns the exit code.

    0 when every process exits 0; else the code of the first process that
    failed (128 + signal number when it was killed), 124 on ``--timeout``,
    130 / 143 when the launcher is interrupted, 127 when the command cannot
    start, 2 for bad arguments.

    >>> p = argparse.ArgumentParser()
    >>> add_arguments(p)
    >>> run(p.parse_args(["-n", "2", "--", sys.executable, "-c", "print('hi')"]), err=sys.stdout)
    nnx-shard launch: 2 processes, coordinator 127.0.0.1:...
    [...] hi
    [...] hi
    0
    """
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    cmd, problem = _check(args)
    if problem:
        err.write(_PREFIX + problem + "\n")
        return 2
    n = args.num_processes
    port = args.port if args.port is not None else _free_port()
    envs = [
        child_env(
            i, n, port, devices_per_process=args.devices_per_process, platform=args.platform,
            init_timeout=args.init_timeout, heartbeat_timeout=args.heartbeat_timeout,
        )
        for i in range(n)
    ]
    devices = (
        f" x {args.devices_per_process} CPU devices" if args.devices_per_process else ""
    )
    err.write(f"{_PREFIX}{n} processes{devices}, coordinator 127.0.0.1:{port}\n")
    err.flush()

    previous = None
    if threading.current_thread() is threading.main_thread():

        def on_term(signum: int, frame: Any) -> None:
            raise _Terminated()

        previous = signal.signal(signal.SIGTERM, on_term)
    job = _Job(out)
    code = 0
    message: str | None = None
    try:
        job.start(cmd, envs)
        code, message = _watch(job, n, args.timeout)
    except _CannotStart as e:
        err.write(f"{_PREFIX}{e}\n")
        code = 127
    except KeyboardInterrupt:
        message, code = "interrupted; stopping every process", 130
    except _Terminated:
        message, code = "terminated; stopping every process", 143
    finally:
        if previous is not None:
            # Already stopping: a further SIGTERM must not cut the grace period short
            # by an exception, which would skip the SIGKILL of what ignored the first.
            signal.signal(signal.SIGTERM, lambda signum, frame: None)
        if message:
            err.write(_PREFIX + message + "\n")
            err.flush()
        job.stop(args.grace)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nnx_shard.cli._launch -n 2 -- python train.py``; returns the exit code.

    >>> main(["-n", "1", "--", sys.executable, "-c", "raise SystemExit(3)"])
    3
    """
    parser = argparse.ArgumentParser(
        prog="nnx-shard launch",
        description="Run N local processes of one multi-process JAX job on loopback.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
