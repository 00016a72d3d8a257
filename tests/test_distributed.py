"""nnx_shard.distributed: coordinates, process-local data, and real multi-process jobs.

The multi-process tests start real processes (2 x 4 CPU devices, coordinator on
127.0.0.1), each under a timeout; the single-process references run here, on
the 8 simulated devices of conftest.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import nnx_shard as ns
from nnx_shard.cli import _launch as launch
from nnx_shard.distributed import DistributedError, _resolve
from tests._close import assert_close
from tests.conftest import needs_devices

HERE = Path(__file__).parent
SCRIPT = str(HERE / "distributed_script.py")
sys.path.insert(0, str(HERE))
import distributed_script  # noqa: E402

# Generous for a 2-core machine loaded by the other tier's tests (a 2-process job that trains
# and then saves has taken over 50 s there); a hang still fails in a few minutes.
JOB_TIMEOUT = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(*args: str, n: int = 2, devices: int = 4) -> subprocess.CompletedProcess[str]:
    """``nnx-shard launch`` of the test script, itself bounded by a timeout."""
    cmd = [
        sys.executable, "-m", "nnx_shard.cli._launch", "-n", str(n),
        "--devices-per-process", str(devices), "--timeout", str(JOB_TIMEOUT - 5),
        "--init-timeout", "20", "--heartbeat-timeout", "10", "--",
        sys.executable, SCRIPT, *args,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT, cwd=HERE.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def spawn(pid: int, n: int, port: int, *, devices: int = 4, init_timeout: int = 5,
          mode: str = "check") -> subprocess.Popen[str]:
    """One process of a hand-made job (no launcher), for the bad-input cases."""
    env = launch.child_env(pid, n, port, devices_per_process=devices,
                           init_timeout=init_timeout, heartbeat_timeout=5)
    return subprocess.Popen(
        [sys.executable, SCRIPT, mode], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def finish(p: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"process {p.args} hung for {timeout} s")
    return p.returncode, out + err


# --------------------------------------------------------------------------- coordinates


def test_resolve_order_arguments_then_launcher_env_then_jax_env():
    env = {"NNX_SHARD_COORDINATOR": "10.0.0.1:1234", "NNX_SHARD_NUM_PROCESSES": "4",
           "NNX_SHARD_PROCESS_ID": "3"}
    kwargs, source = _resolve(None, None, None, None, env)
    assert kwargs == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    assert source == "NNX_SHARD_* environment"
    kwargs, source = _resolve("10.0.0.2:99", None, 0, None, env)
    assert kwargs == {"coordinator_address": "10.0.0.2:99", "num_processes": 4, "process_id": 0}
    assert source == "arguments and NNX_SHARD_* environment"
    kwargs, _ = _resolve(None, 2, 1, [0, 1], {"JAX_COORDINATOR_ADDRESS": "host:5"})
    assert kwargs["coordinator_address"] == "host:5" and kwargs["local_device_ids"] == [0, 1]


def test_resolve_nothing_is_a_single_process():
    assert _resolve(None, None, None, None, {}) is None
    coords = ns.distributed.initialize()
    assert (coords.coordinator_address, coords.num_processes, coords.process_id) == (None, 1, 0)
    assert ns.distributed.is_main()


SLURM = {"SLURM_JOB_ID": "4097", "SLURM_STEP_NODELIST": "gpu[017-018]", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}


def test_slurm_with_one_task_per_node_keeps_every_local_device():
    kwargs, source = _resolve(None, None, None, None, {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1(x2)"})
    # JAX's own detection fills the coordinates but would pin each process to local
    # device [SLURM_LOCALID]; an empty list keeps them all (see the end-to-end test).
    assert kwargs == {"coordinator_address": None, "num_processes": None, "process_id": None,
                      "local_device_ids": []}
    assert "slurm" in source
    kwargs, _ = _resolve(None, None, None, None, {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                                                  "JAX_LOCAL_DEVICE_IDS": "1"})
    assert "local_device_ids" not in kwargs  # the user's own choice of devices stands
    kwargs, _ = _resolve(None, None, None, None, {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "8(x2)"})
    assert kwargs == {"coordinator_address": None, "num_processes": None, "process_id": None}
    kwargs, _ = _resolve(None, None, 0, None, {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1(x2)"})
    assert kwargs["process_id"] == 0  # explicit arguments win over the cluster


def _slurm_job(tasks_per_node: str) -> str:
    """One real process under a fake one-node SLURM step, initialized by JAX's own detection."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NNX_SHARD_", "JAX_COORDINATOR", "JAX_LOCAL_DEVICE", "SLURM_"))}
    port = free_port()
    env.update({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "1",
                "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "JAX_COORDINATOR_PORT": str(port),
                "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(HERE.parent)})
    code = ("import jax, nnx_shard as ns; c = ns.distributed.initialize(initialization_timeout=20); "
            "print(c.coordinator_address, c.num_processes, c.process_id, c.source, '|', "
            "jax.config.values['jax_cuda_visible_devices']); jax.distributed.shutdown()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=JOB_TIMEOUT, env=env, cwd=HERE.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"127.0.0.1:{port} 1 0 cluster auto-detection (slurm) |" in done.stdout, done.stdout
    return done.stdout.split("|")[1].strip()


@pytest.mark.slow
def test_slurm_one_task_per_node_joins_through_jax_detection_with_every_device():
    # JAX picks the address, count and id; only the device restriction is lifted. With
    # several tasks per node nnx_shard passes nothing and JAX's own one-device-per-task
    # pinning applies (test_slurm_with_one_task_per_node_keeps_every_local_device): a
    # process of its own would test JAX.
    assert _slurm_job("1") == "all"


def test_jax_private_state_is_where_nnx_shard_looks_for_it():
    # No public API exposes these (see distributed.py); if JAX moves them this fails
    # here instead of silently losing cluster detection and the process-count check.
    from nnx_shard.distributed import _jax_cluster_kinds, _jax_distributed_state

    names = {kind.name for kind in _jax_cluster_kinds()}
    assert {"slurm", "ompi"} <= names, names
    for kind in _jax_cluster_kinds():
        assert callable(kind.is_env_present) and hasattr(kind, "opt_in_only_method")
    state = _jax_distributed_state()
    assert state is _jax_distributed_state()
    assert hasattr(state, "client") and hasattr(state, "coordinator_address")
    if not jax.distributed.is_initialized():
        assert state.client is None and state.coordinator_address is None


@pytest.mark.parametrize(
    ("args", "env", "match"),
    [
        ((None, 2, 0), {}, r"coordinator_address \(NNX_SHARD_COORDINATOR\) not given"),
        (("h:1", 2, 2), {}, r"process_id=2 is not below num_processes=2"),
        (("h:1", 0, 0), {}, r"num_processes must be a positive int"),
        (("h", 2, 0), {}, r"'h' \(arguments\) is not 'host:port'"),
        (("h:70000", 2, 0), {}, r"port in 1..65535"),
        ((None, None, None), {"NNX_SHARD_COORDINATOR": "h:1", "NNX_SHARD_NUM_PROCESSES": "two",
                              "NNX_SHARD_PROCESS_ID": "0"}, r"NNX_SHARD_NUM_PROCESSES='two'"),
        ((None, None, None), {"NNX_SHARD_COORDINATOR": "h:1", "NNX_SHARD_NUM_PROCESSES": "2",
                              "NNX_SHARD_PROCESS_ID": "-1"}, r"NNX_SHARD_PROCESS_ID=-1 must be >= 0"),
    ],
)
def test_bad_coordinates_are_clear_errors(args, env, match):
    with pytest.raises(DistributedError, match=match):
        _resolve(*args, None, env)


# --------------------------------------------------------------------------- local data


@needs_devices(8)
def test_process_slice_and_local_part_on_one_process():
    assert ns.distributed.process_slice(16, "data=8", {"batch": "data"}) == slice(0, 16)
    assert ns.distributed.process_slice(16, "data=4,model=2", {"batch": None}) == slice(0, 16)
    batch = {"x": np.arange(16), "y": np.zeros((16, 2))}
    part = ns.distributed.local_part(batch, "data=8", {"batch": "data"})
    np.testing.assert_array_equal(part["x"], np.arange(16))
    with pytest.raises(DistributedError, match=r"disagree on the batch size \(axis 0\): \[8, 16\]"):
        ns.distributed.local_part({"x": np.zeros(16), "y": np.zeros(8)}, "data=8", {"batch": "data"})
    with pytest.raises(ns.ShardingError, match="batch"):
        ns.distributed.process_slice(12, "data=8", {"batch": "data"})


def test_gather_returns_numpy():
    mesh = ns.make_mesh({"data": jax.device_count()})
    x = jax.device_put(np.arange(8.0 * jax.device_count()),
                       jax.sharding.NamedSharding(mesh, jax.P("data")))
    out = ns.distributed.gather({"x": x})
    assert isinstance(out["x"], np.ndarray)
    np.testing.assert_array_equal(out["x"], np.arange(8.0 * jax.device_count()))


# --------------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def one_process_run():
    """The same training in this process, on its 8 simulated devices: the reference."""
    return distributed_script.train()


@pytest.fixture(scope="module")
def one_process_diloco():
    """The same DiLoCo training in this process, replica=2 x data=4 on its 8 devices."""
    return distributed_script.diloco()


@pytest.fixture(scope="module")
def two_process_job(tmp_path_factory, one_process_run):
    """The one 2-process job of these tests (each process costs seconds just to start
    JAX): it reports its coordinates and rows, restores the checkpoint this process saved
    of :func:`one_process_run`, then trains and saves a checkpoint, then trains DiLoCo:
    (its output, the checkpoint, process 0's losses and parameters, process 0's restored
    parameters, process 0's DiLoCo results)."""
    tmp = tmp_path_factory.mktemp("two")
    one_ckpt, restored = tmp / "one_ckpt", tmp / "restored.npz"
    _, _, model, opt = one_process_run
    ns.save(one_ckpt, distributed_script.STEPS, model=model, optimizer=opt)
    ckpt, out, diloco = tmp / "ckpt", tmp / "two.npz", tmp / "diloco.npz"
    done = run_job("save", str(ckpt), str(out), str(one_ckpt), str(restored), str(diloco))
    return done, ckpt, dict(np.load(out)), dict(np.load(restored)), dict(np.load(diloco))


@pytest.mark.slow
@needs_devices(8)
def test_two_processes_train_like_one_with_eight_devices(two_process_job, one_process_run):
    done, _, two, *_ = two_process_job
    two = dict(two)
    # Every process trains and reports the same losses; only process 0 writes files.
    lines = [ln for ln in done.stdout.splitlines() if "losses" in ln]
    assert sorted(ln[:3] for ln in lines) == ["[0]", "[1]"], done.stdout[-2000:]
    assert lines[0][4:] == lines[1][4:]
    losses, params, _, _ = one_process_run
    assert_close(two.pop("__loss__"), losses, 1e-5, "losses")
    assert losses.shape == (distributed_script.STEPS,) and losses[-1] < losses[0]
    assert set(two) == set(params) and len(params) > 10  # every parameter of the transformer
    # Adam steps on gradients all-reduced across processes, in another order:
    # tolerance scaled to each parameter (measured up to 9e-7 of max|param|).
    assert_close(two, params, 1e-4, "params")


@pytest.mark.slow
@needs_devices(8)
def test_checkpoint_written_by_two_processes_restores_in_one(two_process_job):
    _, ckpt, two, *_ = two_process_job
    two = {k: v for k, v in two.items() if k != "__loss__"}
    _, _, model, opt = distributed_script.build(abstract=True)
    model, opt, _ = ns.restore(ckpt, model=model, optimizer=opt)
    assert int(opt.step[...]) == distributed_script.STEPS
    mine = distributed_script.params_of(model)
    assert set(mine) == set(two)
    for name, value in two.items():
        np.testing.assert_array_equal(mine[name], value, err_msg=name)
    # Restored straight onto the 8 devices of this process, sharded as fsdp says.
    kernel = model.blocks[0].mlp.up.get_value()
    assert kernel.sharding.spec[0] == "data" and len(kernel.addressable_shards) == 8


@pytest.mark.slow
@needs_devices(8)
def test_checkpoint_written_by_one_process_restores_in_two(two_process_job, one_process_run):
    # The job restores it before it trains: onto fresh targets, as a new program would.
    restored = dict(two_process_job[3])
    _, params, _, _ = one_process_run
    assert int(restored.pop("__step__")) == distributed_script.STEPS
    assert set(restored) == set(params)
    for name, value in params.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


@pytest.mark.slow
@needs_devices(8)
def test_diloco_with_a_replica_per_process_trains_like_one_process(two_process_job,
                                                                    one_process_diloco):
    two, one = dict(two_process_job[4]), dict(one_process_diloco)
    # hsdp's mesh gives each process one replica: every device holding replica r is
    # process r's, so only the sync crosses processes (in one process, all are process 0's).
    np.testing.assert_array_equal(two.pop("__where__"), [[0] * 4, [1] * 4])
    np.testing.assert_array_equal(one.pop("__where__"), [[0] * 4] * 2)
    steps = distributed_script.DILOCO_STEPS
    assert two["__loss__"].shape == (steps, 2)
    assert set(two) == set(one) and len(one) > 20  # the anchor's parameters and the replicas'
    # Per step and replica: the losses, then (after the sync at step 3 and one more inner
    # step) the anchor and every replica; the same programs per replica, the sync's mean
    # reduced across processes (measured up to 3e-7 of max|param|).
    assert_close(two, one, 1e-5, "DiLoCo")
    # The replicas take different rows: their losses differ at every step, and one inner
    # step after the sync they have parted again, each from the other and from the anchor.
    assert np.all(two["__loss__"][:, 0] != two["__loss__"][:, 1])
    for name in (k for k in two if k.startswith("['replicas']")):
        anchor = two[name.replace("['replicas']", "['anchor']")]
        assert not np.array_equal(two[name][0], two[name][1]), name
        assert not np.array_equal(two[name][0], anchor), name


@pytest.mark.slow
@needs_devices(8)
def test_processes_report_coordinates_and_their_rows(two_process_job):
    done = two_process_job[0]
    assert "[0] process 0 of 2 from NNX_SHARD_* environment; 4 local of 8 devices" in done.stdout
    assert "[1] process 1 of 2 from NNX_SHARD_* environment; 4 local of 8 devices" in done.stdout
    # fsdp puts the batch over all 8 devices: each process loads its own half.
    assert "[0] rows 0:8 of 16" in done.stdout and "[1] rows 8:16 of 16" in done.stdout
    # hsdp's mesh: one replica per process, data its 4 local devices; an across axis last
    # spans the processes too (an ordinary data=4,replica=2 mesh would keep both replicas
    # of a data place in one process).
    for p in (0, 1):
        assert (f"[{p}] hybrid replica=2,data=4 processes [[0, 0, 0, 0], [1, 1, 1, 1]]"
                in done.stdout)
        assert (f"[{p}] hybrid data=4,replica=2 processes [[0, 1], [0, 1], [0, 1], [0, 1]]"
                in done.stdout)


@pytest.mark.slow
def test_unreachable_coordinator_is_an_error_not_a_hang():
    # Without its init_timeout the process would wait for the coordinator for good
    # (finish's own limit is the hang guard).
    code, out = finish(spawn(1, 2, free_port(), init_timeout=3))
    assert code == 1, out
    assert "DistributedError: process 1 of 2 could not reach the coordinator at 127.0.0.1:" in out


@pytest.mark.slow
def test_peer_that_never_comes_is_named_before_jax_aborts():
    code, out = finish(spawn(0, 2, free_port(), init_timeout=3))
    assert code != 0
    assert "process 0 of 2 has waited 2.7 s for all processes to connect to 127.0.0.1:" in out


@pytest.mark.slow
def test_processes_disagreeing_on_their_number_fail_clearly():
    port = free_port()
    a, b = spawn(0, 2, port), spawn(1, 3, port)
    (ca, oa), (cb, ob) = finish(a), finish(b)
    assert ca == 1 and cb == 1, oa + ob
    assert "processes disagree on the number of processes: process 0 was started with " \
           "num_processes=2, process 1 with 3" in oa
    assert "process 1 was started with num_processes=3, process 0 with 2" in ob


@pytest.mark.slow
def test_uneven_device_counts_fail_clearly():
    port = free_port()
    a, b = spawn(0, 2, port, devices=4), spawn(1, 2, port, devices=2)
    (ca, oa), (cb, ob) = finish(a), finish(b)
    assert ca == 1 and cb == 1, oa + ob
    for out in (oa, ob):
        assert "different numbers of devices (process 0 has 4, process 1 has 2)" in out


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_processes": True}, r"num_processes must be a positive int, got True \(a bool\)"),
    ({"process_id": True}, r"process_id must be a non-negative int, got True \(a bool\)"),
    ({"process_id": 2}, r"process_id=2 is not below num_processes=2"),
    ({"coordinator_address": 5}, r"coordinator_address must be 'host:port', got int 5"),
    ({"coordinator_address": "localhost"}, r"is not 'host:port'"),
    ({"initialization_timeout": float("nan")}, r"initialization_timeout must be a finite"),
    ({"initialization_timeout": -1}, r"initialization_timeout must be a finite"),
    ({"heartbeat_timeout": 0}, r"heartbeat_timeout must be a finite number of seconds >= 1"),
    ({"local_device_ids": "0"}, r"local_device_ids must be a list of device numbers"),
])
def test_initialize_refuses_bad_arguments_before_joining(kwargs, match, monkeypatch):
    # Checked before anything is joined: a bad value never waits on a coordinator.
    joins: list[dict] = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joins.append(kw))
    args = {"num_processes": 2, "process_id": 0, "coordinator_address": "127.0.0.1:1", **kwargs}
    with pytest.raises(ns.NnxShardError, match=match):
        ns.distributed.initialize(**args)
    assert joins == [] and not jax.distributed.is_initialized()


@needs_devices(8)
def test_local_data_helpers_refuse_values_that_are_not_batches():
    with pytest.raises(ns.NnxShardError, match=r"batch_size must be a positive int, got 0"):
        ns.distributed.process_slice(0, "data=8", {"batch": "data"})
    with pytest.raises(ns.NnxShardError, match=r"batch_size must be a positive int, got True"):
        ns.distributed.process_slice(True, "data=8", {"batch": "data"})
    with pytest.raises(DistributedError, match=r"name must be the batch's logical name"):
        ns.distributed.process_slice(8, "data=8", {"batch": "data"}, name=5)
    with pytest.raises(DistributedError, match=r"local_part: the batch must be arrays"):
        ns.distributed.local_part(5, "data=8", {"batch": "data"})
    with pytest.raises(DistributedError, match=r"gather: a leaf of the tree is str 'abc'"):
        ns.distributed.gather("abc")
