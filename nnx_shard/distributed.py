"""Several processes, one program: ``jax.distributed`` set-up and process-local data.

JAX's multi-controller runtime runs the same script once per host (or per
process); every process sees every device of the job, and a global
``jax.Array`` is laid out over all of them, each process holding only the
shards of its own devices. :func:`initialize` joins that job,
:func:`process_slice` / :func:`local_part` tell each process which rows of the
global batch to load, and ``shard_batch`` / ``Trainer.fit`` build global arrays
from those process-local rows (``jax.make_array_from_process_local_data``).

Where the coordinates come from, first found wins, per field:

1. arguments of :func:`initialize`;
2. ``NNX_SHARD_COORDINATOR`` (``host:port``), ``NNX_SHARD_NUM_PROCESSES``,
   ``NNX_SHARD_PROCESS_ID`` (set by ``nnx-shard launch``), and JAX's own
   ``JAX_COORDINATOR_ADDRESS``;
3. JAX's cluster auto-detection (SLURM, Open MPI, Cloud TPU, Kubernetes);
4. none of these: a single process, and :func:`initialize` does nothing.

Failures JAX itself reports late or not at all become a
:class:`DistributedError` (a ``RuntimeError``) within the initialization
timeout: a coordinator that cannot be reached, processes that disagree on the
number of processes, and processes with different numbers of devices. A peer
that never connects makes JAX abort the process (``SIGABRT``) at the timeout;
a message naming the coordinator and the expected processes is printed first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from nnx_shard import _compat
from nnx_shard._errors import NnxShardError, count, short
from nnx_shard._mesh import make_mesh
from nnx_shard._rules import Rules, as_rules

__all__ = ["Coordinates", "DistributedError", "gather", "initialize", "is_main", "local_part",
           "process_slice"]

ENV_COORDINATOR = "NNX_SHARD_COORDINATOR"
ENV_NUM_PROCESSES = "NNX_SHARD_NUM_PROCESSES"
ENV_PROCESS_ID = "NNX_SHARD_PROCESS_ID"
ENV_INIT_TIMEOUT = "NNX_SHARD_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "NNX_SHARD_HEARTBEAT_TIMEOUT"

_JAX_INIT_TIMEOUT = 300
_JAX_HEARTBEAT_TIMEOUT = 100


class DistributedError(NnxShardError, RuntimeError):
    """Processes of one job cannot work together: unreachable coordinator,
    inconsistent process counts, uneven devices, bad coordinates.

    >>> from nnx_shard import NnxShardError
    >>> from nnx_shard.distributed import DistributedError
    >>> issubclass(DistributedError, RuntimeError), issubclass(DistributedError, NnxShardError)
    (True, True)
    """


@dataclasses.dataclass(frozen=True)
class Coordinates:
    """Where this process sits in the job, and where that was read from.

    ``coordinator_address`` is ``None`` for a single process (nothing to join).

    Args:
      coordinator_address: ``host:port`` of process 0, ``None`` for a single process.
      num_processes: the processes in the job.
      process_id: this process's index.
      source: where the values were read from (the arguments, the environment).

    >>> from nnx_shard.distributed import Coordinates
    >>> Coordinates("10.0.0.1:1234", 2, 1, "arguments")
    Coordinates(coordinator_address='10.0.0.1:1234', num_processes=2, process_id=1, source='arguments')
    """

    coordinator_address: str | None
    num_processes: int
    process_id: int
    source: str


# --------------------------------------------------------------------------- resolution


def _env_int(environ: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise DistributedError(
            f"environment variable {name}={raw!r} is not an integer. Fix: set it to an "
            f"integer >= {minimum}, or unset it."
        ) from None
    if value < minimum:
        raise DistributedError(f"environment variable {name}={value} must be >= {minimum}. Fix: "
                               f"set it to an integer >= {minimum}, or unset it.")
    return value


def _split_address(address: str, where: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        port_i = int(port)
    except ValueError:
        port_i = -1
    if not sep or not host or not 0 < port_i < 65536:
        raise DistributedError(
            f"coordinator address {address!r} ({where}) is not 'host:port' with a port in "
            "1..65535. Fix: e.g. '10.0.0.1:1234' (the address of process 0 and a free port)."
        )
    return host, port_i


# JAX has no public API for these two, so nnx_shard/_compat.py reads them (tests/test_compat.py
# pins both, to fail loudly when JAX moves them):
# - which cluster its auto-detection would pick: ``jax.distributed.initialize``
#   detects and joins in one call, and it must run before any other JAX call, so
#   it cannot be tried to find out whether this is a single process;
# - the runtime's key-value client and coordinator address, which
#   ``jax.experimental.multihost_utils`` itself reads from the same private state.


def _jax_cluster_kinds() -> list[Any]:
    """JAX's cluster detectors (SLURM, Open MPI, Cloud TPU, Kubernetes, ...), in its order."""
    return _compat.cluster_kinds()


def _jax_distributed_state() -> Any:
    """The ``jax.distributed`` runtime state: ``client``, ``coordinator_address``."""
    return _compat.distributed_state()


def _detected_cluster(environ: Mapping[str, str]) -> str | None:
    """The name of the cluster JAX would auto-detect here, if any."""
    if environ is not os.environ:
        # Detection reads os.environ; a test passing its own mapping sees SLURM only.
        slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
        return "slurm" if all(k in environ for k in slurm) else None
    try:
        kinds = _jax_cluster_kinds()
    except (ImportError, AttributeError):  # private API moved: let JAX decide alone
        return None
    for kind in kinds:
        if kind.opt_in_only_method:
            continue
        with contextlib.suppress(Exception):
            if kind.is_env_present():
                return kind.name or kind.__name__
    return None


def _tasks_on_node(environ: Mapping[str, str]) -> int | None:
    # "2(x3),1" style in SLURM_STEP_TASKS_PER_NODE; the node's own count is what matters,
    # and one task per node on every node is the case that needs all local devices.
    raw = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not raw:
        return None
    counts = {part.split("(")[0] for part in raw.split(",")}
    return int(counts.pop()) if len(counts) == 1 and next(iter(counts)).isdigit() else None


def _check_arguments(address: Any, n: Any, pid: Any, local_device_ids: Any, init_timeout: Any,
                     heartbeat: Any) -> None:
    """:func:`initialize`'s arguments checked before anything is joined (a bad one
    would otherwise wait on a coordinator that was never asked for)."""
    if address is not None:
        if not isinstance(address, str):
            raise DistributedError(
                f"initialize: coordinator_address must be 'host:port', got "
                f"{type(address).__name__} {short(address, 60)}. Fix: e.g. '10.0.0.1:1234'")
        _split_address(address, "coordinator_address")
    if n is not None:
        count(n, "initialize: num_processes", fix="e.g. num_processes=2")
    if pid is not None:
        count(pid, "initialize: process_id", least=0, fix="0 .. num_processes - 1")
        if n is not None and pid >= n:
            raise DistributedError(f"initialize: process_id={pid} is not below num_processes="
                                   f"{n}. Fix: process_id in 0 .. {n - 1}")
    if local_device_ids is not None and (
            isinstance(local_device_ids, str | bytes) or not isinstance(local_device_ids, Sequence)
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                       for i in local_device_ids)):
        raise DistributedError(
            f"initialize: local_device_ids must be a list of device numbers >= 0, got "
            f"{short(local_device_ids, 60)}. Fix: e.g. local_device_ids=[0, 1]")
    for name, value in (("initialization_timeout", init_timeout),
                        ("heartbeat_timeout", heartbeat)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and value >= 1):
            raise DistributedError(f"initialize: {name} must be a finite number of seconds "
                                   f">= 1, got {short(value, 60)}. Fix: e.g. {name}=300")


def _resolve(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    local_device_ids: Sequence[int] | None,
    environ: Mapping[str, str],
) -> tuple[dict[str, Any], str] | None:
    """The keyword arguments for ``jax.distributed.initialize`` and their source;
    ``None`` when there is nothing to join (a single process)."""
    sources = []
    address, n, pid = coordinator_address, num_processes, process_id
    if (address, n, pid) != (None, None, None):
        sources.append("arguments")
    env_address = environ.get(ENV_COORDINATOR) or None
    env_n = _env_int(environ, ENV_NUM_PROCESSES, 1)
    env_pid = _env_int(environ, ENV_PROCESS_ID, 0)
    if (env_address, env_n, env_pid) != (None, None, None):
        sources.append("NNX_SHARD_* environment")
    address = address if address is not None else env_address
    n = n if n is not None else env_n
    pid = pid if pid is not None else env_pid
    if address is None and environ.get("JAX_COORDINATOR_ADDRESS"):
        address = environ["JAX_COORDINATOR_ADDRESS"]
        sources.append("JAX_COORDINATOR_ADDRESS")
    cluster = None
    if None in (address, n, pid):
        cluster = _detected_cluster(environ)
        if cluster is not None:
            sources.append(f"cluster auto-detection ({cluster})")
    if not sources:
        return None
    kwargs: dict[str, Any] = {}
    if cluster is None:
        missing = [
            what
            for what, v in (
                (f"coordinator_address ({ENV_COORDINATOR})", address),
                (f"num_processes ({ENV_NUM_PROCESSES})", n),
                (f"process_id ({ENV_PROCESS_ID})", pid),
            )
            if v is None
        ]
        if missing:
            raise DistributedError(
                f"multi-process coordinates are incomplete: {', '.join(missing)} not given "
                f"(found from {', '.join(sources)}), and no cluster was detected to fill them "
                "in. Fix: give all three (the same address and count on every process, a "
                "distinct process_id 0..num_processes-1), or start with `nnx-shard launch`."
            )
    if n is not None and (not isinstance(n, int) or n < 1):
        raise DistributedError(f"num_processes must be a positive int, got {n!r}. Fix: the "
                               "number of processes in the job, the same on every one.")
    if pid is not None and (not isinstance(pid, int) or pid < 0):
        raise DistributedError(f"process_id must be a non-negative int, got {pid!r}. Fix: "
                               "0..num_processes-1, a distinct one per process.")
    if n is not None and pid is not None and pid >= n:
        raise DistributedError(
            f"process_id={pid} is not below num_processes={n}: ids run 0..{n - 1}. Fix: give "
            "every process the same num_processes and a distinct id in that range."
        )
    if address is not None:
        _split_address(address, " and ".join(sources))
    if (
        cluster == "slurm"
        and local_device_ids is None
        and not environ.get("JAX_LOCAL_DEVICE_IDS")
        and _tasks_on_node(environ) == 1
    ):
        # JAX's SLURM detection restricts each process to the one GPU numbered by its
        # local task id; with one process per host that hides all but the first GPU.
        # An empty list is "given" (so detection leaves it alone, while still filling
        # address, count and id) and restricts nothing (JAX sets visible devices only
        # for a non-empty list).
        local_device_ids = []
    kwargs.update(coordinator_address=address, num_processes=n, process_id=pid)
    if local_device_ids is not None:
        kwargs["local_device_ids"] = list(local_device_ids)
    return kwargs, " and ".join(sources)


# --------------------------------------------------------------------------- initialize


def _wait_for_coordinator(address: str, pid: int, n: int, timeout: float) -> None:
    """Raises instead of letting JAX abort when the coordinator never answers."""
    host, port = _split_address(address, "coordinator")
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(1.0, timeout)):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    raise DistributedError(
        f"process {pid} of {n} could not reach the coordinator at {address} within "
        f"{timeout:g} s ({last}). Process 0 serves the coordinator on that port. Fix: start "
        "process 0, give every process the same coordinator address and port (process "
        "0's host), and check that the port is open between the hosts."
    )


def _watchdog(address: str | None, pid: int | None, n: int | None, timeout: float) -> threading.Timer:
    who = f"process {pid} of {n}" if pid is not None and n is not None else "this process"
    where = address or "the auto-detected coordinator"

    def warn() -> None:
        sys.stderr.write(
            f"nnx_shard.distributed: {who} has waited {0.9 * timeout:.3g} s for all "
            f"processes to connect to {where}; JAX stops this process at {timeout:g} s "
            "(initialization_timeout). Check that every process was started, with the same "
            "coordinator address, port and number of processes.\n"
        )
        sys.stderr.flush()

    timer = threading.Timer(0.9 * timeout, warn)
    timer.daemon = True
    timer.start()
    return timer


def _client() -> Any:
    return _jax_distributed_state().client


def _check_process_counts(pid: int, n: int, timeout: float) -> None:
    """Every process must agree on the process count; JAX trusts process 0's silently."""
    client = _client()
    if client is None:
        return
    client.key_value_set(f"nnx_shard/num_processes/{pid}", str(n))
    peers = range(1, n) if pid == 0 else (0,)
    for peer in peers:
        try:
            theirs = int(
                client.blocking_key_value_get(f"nnx_shard/num_processes/{peer}", int(timeout * 1000))
            )
        except Exception as e:  # the runtime reports timeouts as XlaRuntimeError
            raise DistributedError(
                f"process {pid} (num_processes={n}) did not hear from process {peer} within "
                f"{timeout:g} s ({type(e).__name__}). Fix: give every process the same "
                "num_processes and start them all."
            ) from None
        if theirs != n:
            raise DistributedError(
                f"processes disagree on the number of processes: process {pid} was started "
                f"with num_processes={n}, process {peer} with {theirs}. Fix: start every "
                "process with the same num_processes."
            )


def _check_devices() -> None:
    counts: dict[int, int] = {}
    for d in jax.devices():
        counts[d.process_index] = counts.get(d.process_index, 0) + 1
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"process {p} has {c}" for p, c in sorted(counts.items()))
        raise DistributedError(
            f"processes have different numbers of devices ({listing}). A mesh over all "
            "devices then splits work unevenly between hosts, or cannot be built. Fix: give "
            "every process the same number of devices (`nnx-shard launch "
            "--devices-per-process`, JAX_NUM_CPU_DEVICES, or CUDA_VISIBLE_DEVICES)."
        )


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    initialization_timeout: float | None = None,
    heartbeat_timeout: float | None = None,
    check: bool = True,
) -> Coordinates:
    """Joins this process to a multi-process job (``jax.distributed.initialize``).

    Call it first, before any other JAX call. Each coordinate is read from the
    arguments, else from ``NNX_SHARD_*`` variables (``nnx-shard launch`` sets
    them), else JAX's ``JAX_COORDINATOR_ADDRESS``, else JAX's cluster
    auto-detection (SLURM, Open MPI, TPU, Kubernetes). When none is found,
    this is a single process: nothing is initialized and the coordinates
    ``(None, 1, 0)`` are returned, so one script runs alone and on a cluster.
    Under SLURM with one task per node every local device stays visible (JAX's
    detection alone would keep one GPU per process).

    Args:
      coordinator_address: ``host:port`` of process 0; the same on every process.
      num_processes: the number of processes; the same on every process.
      process_id: this process, ``0 .. num_processes - 1``.
      local_device_ids: restrict this process to these local GPUs.
      initialization_timeout: seconds to wait for all processes to connect
        (else ``NNX_SHARD_INIT_TIMEOUT``, else JAX's 300).
      heartbeat_timeout: seconds after which a silent peer counts as dead
        (else ``NNX_SHARD_HEARTBEAT_TIMEOUT``, else JAX's 100).
      check: after joining, check that every process agrees on the number of
        processes and has the same number of devices.

    Raises:
      DistributedError: incomplete or invalid coordinates, an unreachable
        coordinator, processes disagreeing on their number or device counts.

    >>> from nnx_shard.distributed import initialize
    >>> initialize()   # no coordinates anywhere: a single process
    Coordinates(coordinator_address=None, num_processes=1, process_id=0, source='single process')
    """
    _check_arguments(coordinator_address, num_processes, process_id, local_device_ids,
                     initialization_timeout, heartbeat_timeout)
    environ = os.environ
    resolved = _resolve(coordinator_address, num_processes, process_id, local_device_ids, environ)
    if resolved is None:
        if jax.distributed.is_initialized():
            return Coordinates(
                _client_address(), jax.process_count(), jax.process_index(), "already initialized"
            )
        return Coordinates(None, 1, 0, "single process")
    kwargs, source = resolved
    init_timeout = (
        initialization_timeout
        if initialization_timeout is not None
        else _env_int(environ, ENV_INIT_TIMEOUT, 1) or _JAX_INIT_TIMEOUT
    )
    heartbeat = (
        heartbeat_timeout
        if heartbeat_timeout is not None
        else _env_int(environ, ENV_HEARTBEAT_TIMEOUT, 1) or _JAX_HEARTBEAT_TIMEOUT
    )
    if jax.distributed.is_initialized():
        here = Coordinates(
            _client_address(), jax.process_count(), jax.process_index(), source
        )
        wanted = (kwargs.get("num_processes"), kwargs.get("process_id"))
        if wanted not in ((here.num_processes, here.process_id), (None, None)):
            raise DistributedError(
                f"jax.distributed is already initialized as process {here.process_id} of "
                f"{here.num_processes}, not {wanted[1]} of {wanted[0]}. Fix: initialize once."
            )
        return here
    address, n, pid = kwargs["coordinator_address"], kwargs["num_processes"], kwargs["process_id"]
    if address is not None and pid is not None and pid != 0:
        _wait_for_coordinator(address, pid, n, float(init_timeout))
    timer = _watchdog(address, pid, n, float(init_timeout))
    try:
        jax.distributed.initialize(
            **kwargs,
            initialization_timeout=int(init_timeout),
            heartbeat_timeout_seconds=int(heartbeat),
            # At exit every process waits for the others; a dead peer must not
            # keep the survivors alive for JAX's default 5 minutes.
            shutdown_timeout_seconds=int(max(init_timeout, heartbeat)),
        )
    except RuntimeError as e:
        raise DistributedError(f"jax.distributed.initialize failed: {e}. Fix: check the "
                               "coordinator address and that every process of the job "
                               "was started.") from e
    finally:
        timer.cancel()
    here = Coordinates(_client_address(), jax.process_count(), jax.process_index(), source)
    if check:
        _check_process_counts(here.process_id, n if n is not None else here.num_processes,
                              float(init_timeout))
        _check_devices()
    return here


def _client_address() -> str | None:
    return _jax_distributed_state().coordinator_address


def is_main() -> bool:
    """True on process 0, the one that prints progress and writes non-array files.

    >>> from nnx_shard.distributed import is_main
    >>> is_main()
    True
    """
    return jax.process_index() == 0


# --------------------------------------------------------------------------- data


def process_slice(batch_size: int, mesh: Mesh | str | Mapping[str, int],
                  rules: Rules | Mapping[str, Any], name: str | None = "batch") -> slice:
    """The rows of a global batch of ``batch_size`` that this process loads.

    A batch dimension named ``name`` is split over the mesh axes ``rules``
    give it; this process holds the rows on its own devices. Each process
    loads only those rows and passes them to ``shard_batch`` / ``Trainer.fit``,
    which assemble the global batch. Rows replicated across processes (the
    batch not split over a mesh axis that spans processes) are loaded by each
    of them. On one process: every row.

    Args:
      batch_size: the global batch's rows.
      mesh: a ``Mesh`` or a spec for :func:`nnx_shard.make_mesh`.
      rules: the logical-to-mesh table.
      name: the logical name of the batch dimension.

    >>> from nnx_shard.distributed import process_slice
    >>> process_slice(16, "data=8", {"batch": "data"})
    slice(0, 16, None)
    """
    batch_size = count(batch_size, "process_slice: batch_size",
                       fix="the global batch size, e.g. 256")
    if name is not None and (not isinstance(name, str) or not name):
        raise DistributedError(f"process_slice: name must be the batch's logical name (str) or "
                               f"None, got {short(name, 60)}. Fix: e.g. name='batch'")
    mesh = make_mesh(mesh)
    rules = as_rules(rules)
    spec = rules.spec((name,), shape=(batch_size,), mesh=mesh, path="batch")
    index = NamedSharding(mesh, spec).addressable_devices_indices_map((batch_size,))
    spans = sorted({idx[0].indices(batch_size)[:2] for idx in index.values() if idx})
    start, stop = spans[0]
    for lo, hi in spans[1:]:
        if lo > stop:
            raise DistributedError(
                f"the batch rows on this process's devices are not contiguous "
                f"({spans}) with mesh {dict(mesh.shape)} and batch -> {spec}. Fix: build "
                "the mesh so each process's devices are adjacent along the batch axes "
                "(the default device order of make_mesh does this)."
            )
        stop = max(stop, hi)
    return slice(start, stop)


def local_part(batch: Any, mesh: Mesh | str | Mapping[str, int],
               rules: Rules | Mapping[str, Any], name: str | None = "batch") -> Any:
    """This process's rows (:func:`process_slice`) of every leaf of a global host batch.

    For data every process can produce whole (synthetic data, a small
    dataset); large datasets should read only ``process_slice`` rows.

    Args:
      batch: the global host batch (a pytree of arrays, every process the same).
      mesh: a ``Mesh`` or a spec for :func:`nnx_shard.make_mesh`.
      rules: the logical-to-mesh table.
      name: the logical name of the batch dimension.

    >>> import numpy as np
    >>> from nnx_shard.distributed import local_part
    >>> local_part({"x": np.arange(8)}, "data=8", {"batch": "data"})["x"].shape
    (8,)
    """
    leaves = jax.tree.leaves(batch)
    if not leaves or any(np.ndim(x) == 0 for x in leaves):
        raise DistributedError(
            f"local_part: the batch must be arrays with a leading batch axis, got "
            f"{type(batch).__name__} {short(batch, 60)}. Fix: e.g. {{'x': np.ones((256, 8))}}")
    sizes = {np.shape(x)[0] for x in leaves}
    if len(sizes) != 1:
        raise DistributedError(
            f"batch leaves disagree on the batch size (axis 0): {sorted(sizes)}. Fix: give "
            "every leaf the same leading batch dimension."
        )
    rows = process_slice(sizes.pop(), mesh, rules, name)
    return jax.tree.map(lambda x: x[rows], batch)


def gather(tree: Any) -> Any:
    """Every array of ``tree`` as a whole NumPy array, on every process.

    Arrays sharded over devices of other processes are all-gathered (a
    collective: every process must call it with the same tree).

    Args:
      tree: a pytree of arrays (sharded or not).

    >>> import jax.numpy as jnp
    >>> from nnx_shard.distributed import gather
    >>> gather({"w": jnp.ones((2, 3))})["w"].shape
    (2, 3)
    """
    from jax.experimental import multihost_utils

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        out = np.asarray(x)
        if out.dtype.kind in "OUS":  # text or objects: not arrays a process could gather
            raise DistributedError(f"gather: a leaf of the tree is {type(x).__name__} "
                                   f"{short(x, 60)}, not an array. Fix: gather arrays only")
        return out

    return jax.tree.map(one, tree)
