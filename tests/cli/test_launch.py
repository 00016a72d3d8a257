"""nnx_shard.cli._launch: local multi-process jobs that never hang and leave no process behind.

Most jobs here run tiny ``python -c`` programs (no JAX, fast); one runs real JAX
processes whose peer is killed mid-job.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nnx_shard.cli import _launch as launch

HERE = Path(__file__).resolve().parents[1]  # tests/
SCRIPT = str(HERE / "distributed_script.py")
PY = sys.executable


def gone(pid: int, within: float = 120.0) -> bool:
    """True once ``pid`` no longer runs (reaped, or a zombie awaiting its reaper); the
    wait is a hang guard only, a stopped process is gone at once."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def pids_in(text: str, tag: str = "pid") -> list[int]:
    return [int(line.split(f"{tag} ")[1].split()[0]) for line in text.splitlines()
            if f"{tag} " in line]


def run_main(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = launch.main(list(argv))
    out, err = capfd.readouterr()
    return code, out, err


def test_every_process_gets_its_coordinates_and_output_is_prefixed(capfd):
    prog = ("import os; e = os.environ; print('id', e['NNX_SHARD_PROCESS_ID'], 'of', "
            "e['NNX_SHARD_NUM_PROCESSES'], e['NNX_SHARD_COORDINATOR'], "
            "e['JAX_NUM_CPU_DEVICES'], e.get('XLA_FLAGS'), e['JAX_PLATFORMS'])")
    code, out, err = run_main(capfd, "-n", "3", "--devices-per-process", "2", "--port", "29123",
                                 "--", PY, "-c", prog)
    assert code == 0, out + err
    # The forced device count of the test shell is dropped (2 devices each, not 8); its
    # other XLA flags (conftest's rendezvous wait) pass through.
    rest = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                    if not f.startswith("--xla_force_host_platform_device_count")) or None
    for i in range(3):
        assert f"[{i}] id {i} of 3 127.0.0.1:29123 2 {rest} cpu\n" in out
    assert "nnx-shard launch: 3 processes x 2 CPU devices, coordinator 127.0.0.1:29123" in err


def test_child_env_keeps_other_xla_flags():
    env = launch.child_env(0, 2, 1234, devices_per_process=4, base={
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x"})
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
    env = launch.child_env(0, 2, 1234, platform="inherit", base={"JAX_PLATFORMS": "cuda"})
    assert env["JAX_PLATFORMS"] == "cuda" and "JAX_NUM_CPU_DEVICES" not in env


def test_a_failing_process_stops_the_others_and_names_itself(capfd):
    # Process 1 fails; 0 and 2 would sleep a minute, and 2 starts a child of its own.
    prog = ("import os, subprocess, sys, time; i = int(os.environ['NNX_SHARD_PROCESS_ID']); "
            "print('pid', os.getpid(), flush=True); "
            "g = subprocess.Popen(['sleep', '60']) if i == 2 else None; "
            "g and print('grandchild', g.pid, flush=True); "
            "time.sleep(0.5); sys.exit(7) if i == 1 else time.sleep(60); print('slept', flush=True)")
    code, out, err = run_main(capfd, "-n", "3", "--", PY, "-c", prog)
    assert code == 7
    assert "nnx-shard launch: process 1 exited with code 7; stopping processes 0, 2" in err
    assert "slept" not in out  # stopped, not waited for
    pids = pids_in(out) + pids_in(out, "grandchild")
    assert len(pids) == 4
    assert all(gone(p) for p in pids), "a process outlived the launcher"


def test_a_process_leaving_early_is_named_before_the_peer_that_then_fails(capfd):
    # Process 1 exits 0 at once; process 0 then fails (as a peer whose collective lost
    # a participant would): the report leads with process 1, the exit code is 0's.
    prog = ("import os, sys, time; i = int(os.environ['NNX_SHARD_PROCESS_ID']); "
            "sys.exit(0) if i == 1 else time.sleep(1.5); sys.exit(4) if i == 0 else "
            "time.sleep(60); print('slept', flush=True)")
    code, out, err = run_main(capfd, "-n", "3", "--", PY, "-c", prog)
    assert code == 4
    assert ("nnx-shard launch: process 1 exited first (code 0) while the others were still "
            "running, then process 0 exited with code 4; stopping process 2") in err, err
    assert "slept" not in out  # process 2 was stopped, not waited for


def test_more_processes_than_the_machine_can_hold_are_refused(capfd, monkeypatch):
    code, out, err = run_main(capfd, "-n", "100000", "--", PY, "-c", "print('started')")
    assert code == 2 and out == ""  # nothing was started
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("nnx-shard launch: -n 100000 is more processes than this machine "
                               f"can run: at most {launch.max_processes()} (8 per CPU core)")
    assert "--devices-per-process" in lines[0]
    monkeypatch.setattr(launch, "max_processes", lambda: 2)
    code, _, err = run_main(capfd, "-n", "3", "--", PY, "-c", "print('started')")
    assert code == 2 and "-n 3 is more processes than this machine can run: at most 2" in err


def test_timeout_stops_everything_with_exit_124(capfd):
    prog = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"
    code, out, err = run_main(capfd, "-n", "2", "--timeout", "1.5", "--", PY, "-c", prog)
    assert code == 124
    assert "nnx-shard launch: timed out after 1.5 s; stopping processes 0, 1" in err
    assert all(gone(p) for p in pids_in(out))


def test_a_process_ignoring_sigterm_is_killed_after_the_grace_period(capfd):
    prog = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('pid', os.getpid(), flush=True); i = int(os.environ['NNX_SHARD_PROCESS_ID']); "
            "time.sleep(0.3); sys.exit(3) if i == 0 else time.sleep(60)")
    code, out, err = run_main(capfd, "-n", "2", "--grace", "0.5", "--", PY, "-c", prog)
    assert code == 3 and "process 0 exited with code 3; stopping process 1" in err
    assert all(gone(p) for p in pids_in(out))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "2"], "no command given"),
        (["-n", "2", "--"], "no command given"),
        (["-n", "0", "--", PY], "-n must be at least 1, got 0"),
        (["-n", "2", "--devices-per-process", "0", "--", PY], "--devices-per-process must be"),
        (["-n", "2", "--devices-per-process", "100000", "--", PY],
         "--devices-per-process must be at most 512, got 100000"),
        (["-n", "2", "--port", "70000", "--", PY], "--port must be in 1..65535, got 70000"),
        (["-n", "2", "--timeout", "0", "--", PY], "--timeout must be a finite number of seconds > 0"),
        (["-n", "2", "--timeout", "nan", "--", PY], "--timeout must be a finite number of seconds"),
        (["-n", "2", "--timeout", "inf", "--", PY], "--timeout must be a finite number of seconds"),
        (["-n", "2", "--grace", "-3", "--", PY], "--grace must be a finite number of seconds >= 0"),
        (["-n", "2", "--grace", "nan", "--", PY], "--grace must be a finite number of seconds"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(capfd, argv, message):
    code, _, err = run_main(capfd, *argv)
    assert code == 2
    assert f"nnx-shard launch: {message}" in err


def test_command_that_cannot_start_is_an_error(capfd):
    code, _, err = run_main(capfd, "-n", "2", "--", "/nonexistent/program")
    assert code == 127
    assert "cannot start /nonexistent/program" in err


def test_terminating_the_launcher_stops_its_processes():
    prog = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"
    p = subprocess.Popen([PY, "-m", "nnx_shard.cli._launch", "-n", "2", "--", PY, "-c", prog],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        lines = [p.stdout.readline(), p.stdout.readline()]
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=20)
    finally:
        p.kill()
    assert p.returncode == 143
    assert "nnx-shard launch: terminated; stopping every process" in err
    assert all(gone(pid) for pid in pids_in("".join(lines)))


def test_killing_the_launcher_outright_takes_its_processes_along():
    prog = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"
    p = subprocess.Popen([PY, "-m", "nnx_shard.cli._launch", "-n", "2", "--", PY, "-c", prog],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    lines = [p.stdout.readline(), p.stdout.readline()]
    p.kill()
    p.wait(timeout=10)
    assert all(gone(pid) for pid in pids_in("".join(lines)))


def test_add_arguments_composes_with_a_subcommand_parser(capfd):
    parser = argparse.ArgumentParser(prog="nnx-shard")
    sub = parser.add_subparsers(dest="cmd")
    launch.add_arguments(sub.add_parser("launch"))
    args = parser.parse_args(["launch", "-n", "1", "--", PY, "-c", "print('ok')"])
    assert launch.run(args) == 0
    assert "[0] ok" in capfd.readouterr().out


@pytest.mark.slow
def test_a_killed_jax_peer_stops_the_job_within_the_timeout():
    done = subprocess.run(
        [PY, "-m", "nnx_shard.cli._launch", "-n", "2", "--devices-per-process", "4",
         "--timeout", "40", "--init-timeout", "20", "--heartbeat-timeout", "10", "--",
         PY, SCRIPT, "die"],
        capture_output=True, text=True, timeout=50, cwd=HERE.parent,
    )
    assert done.returncode == 128 + signal.SIGKILL, done.stdout[-2000:] + done.stderr[-2000:]
    assert "[0] sum 8.0" in done.stdout and "[1] sum 8.0" in done.stdout
    assert "nnx-shard launch: process 1 was killed by SIGKILL; stopping process 0" in done.stderr
    assert "timed out" not in done.stderr  # stopped by the peer's death, not the 40 s limit


@pytest.mark.skipif(
    not (HERE.parent / "nnx_shard" / "cli" / "__init__.py").exists(),
    reason="the nnx-shard CLI is not built",
)
def test_nnx_shard_launch_command(capfd):
    # In this process (a child would start JAX for nothing): the console script's main
    # is what runs it (tests/cli/test_cli.py runs that main in a real process).
    from nnx_shard.cli import main

    code = main(["launch", "-n", "2", "--timeout", "30", "--",
                 PY, "-c", "import os; print('id', os.environ['NNX_SHARD_PROCESS_ID'])"])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert "[0] id 0" in out and "[1] id 1" in out


IGNORES_TERM = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('pid', os.getpid(), flush=True); time.sleep(60)")


def test_a_timeout_kills_processes_that_ignore_sigterm_after_the_grace(capfd):
    code, out, err = run_main(capfd, "-n", "2", "--timeout", "1", "--grace", "0.5", "--",
                                    PY, "-c", IGNORES_TERM)
    assert code == 124 and "timed out after 1 s; stopping processes 0, 1" in err
    pids = pids_in(out)
    assert len(pids) == 2 and all(gone(p) for p in pids)


@pytest.mark.slow
def test_a_second_sigterm_while_stopping_still_kills_what_ignores_the_first():
    """Terminated twice while its processes ignore SIGTERM: the second signal lands in
    the grace period and must neither skip the SIGKILL nor end in a traceback."""
    p = subprocess.Popen([PY, "-m", "nnx_shard.cli._launch", "-n", "2", "--grace", "2", "--",
                          PY, "-c", IGNORES_TERM],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        lines = [p.stdout.readline(), p.stdout.readline()]
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 143, err
    assert "Traceback" not in err and "terminated; stopping every process" in err
    assert all(gone(pid) for pid in pids_in("".join(lines)))
