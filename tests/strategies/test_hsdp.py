"""hsdp, hybrid sharded data parallelism: FSDP over ``data`` within each replica, data
parallelism over ``replica`` across them.

* The hybrid mesh's device order (quick, no compilation): ``make_mesh(...,
  across="replica")`` lays ``replica`` across processes (or slices) and keeps ``data``
  within one, shown on fake devices that name their process and slice; ``mesh_for`` gives
  ``data`` one process's devices. The real two-process job prints its hybrid mesh
  (tests/test_distributed.py::test_processes_report_coordinates_and_their_rows).
* (slow) On 8 simulated devices (``replica=2, data=4``): the same losses, parameters and
  optimizer state as :func:`~nnx_shard.strategies.fsdp` on the same devices after a few
  AdamW steps (fsdp's own values are proved against one device in tests/test_strategies.py),
  each device holding 1/data of every parameter; and the compiled step's collectives,
  with their mesh axes and bytes computed from the parameters' shapes: only the gradient
  reduction crosses ``replica``, on 1/data slices.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard._mesh import _build
from nnx_shard._mesh._build import granules, hybrid_devices
from nnx_shard.models import Decoder, get_config
from nnx_shard.planner import compiled_collectives
from nnx_shard.strategies import _strategy
from tests._close import assert_close
from tests._lm import lm_batches, lm_step
from tests._shared import device_bytes
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

K = 3  # fused AdamW steps
RTOL = 1e-5  # x max|expected| per tensor (tests/_close.py)


# --------------------------------------------------------------------------- device order


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What the mesh's device order reads of a device (create_device_mesh on a CPU)."""

    id: int
    process_index: int
    slice_index: int = 0
    platform: str = "cpu"
    device_kind: str = "cpu"


def _job(processes: int, per: int, slices: int = 1) -> list[FakeDevice]:
    # Devices listed process by process (jax.devices()' order), processes by slice.
    per_slice = processes // slices
    return [FakeDevice(p * per + i, p, p // per_slice) for p in range(processes)
            for i in range(per)]


def _where(grid: np.ndarray, attr: str = "process_index") -> list[Any]:
    return np.vectorize(lambda d: getattr(d, attr))(grid).tolist()


def test_replica_spans_processes_and_data_stays_within_one() -> None:
    devs = _job(2, 4)
    grid = hybrid_devices({"replica": 2, "data": 4}, "replica", devs)
    assert _where(grid) == [[0, 0, 0, 0], [1, 1, 1, 1]]
    # Whatever the axis order: an ordinary mesh of (data=4, replica=2) would put both
    # replicas of a data place in one process.
    grid = hybrid_devices({"data": 4, "replica": 2}, "replica", devs)
    assert _where(grid) == [[0, 1]] * 4
    # More replicas than processes: each process holds replica/processes of them, whole.
    grid = hybrid_devices({"replica": 4, "data": 2}, "replica", devs)
    assert _where(grid) == [[0, 0], [0, 0], [1, 1], [1, 1]]
    # The listing order does not matter: processes in index order, devices as given.
    grid = hybrid_devices({"replica": 2, "data": 4}, "replica", devs[::-1])
    assert _where(grid) == [[0, 0, 0, 0], [1, 1, 1, 1]]
    assert [d.id for d in grid[0]] == [3, 2, 1, 0]


def test_slices_are_the_groups_where_devices_name_them() -> None:
    devs = _job(4, 2, slices=2)  # 2 slices of 2 processes of 2 devices
    assert [[d.id for d in g] for g in granules(devs)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    grid = hybrid_devices({"replica": 2, "data": 4}, "replica", devs)
    assert _where(grid, "slice_index") == [[0] * 4, [1] * 4]
    assert _where(grid) == [[0, 0, 1, 1], [2, 2, 3, 3]]  # data spans a slice's processes


def test_hybrid_mesh_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ns.ShardingError, match=r"mesh replica=3,data=2: axis 'replica' is laid "
                       r"across the devices' 2 processes, so its size \(3\) must be a multiple "
                       r"of 2\. Fix: e\.g\. replica=2 with the other axes over the 3 devices"):
        hybrid_devices({"replica": 3, "data": 2}, "replica", _job(2, 3))
    with pytest.raises(ns.ShardingError, match=r"the devices fall into 2 processes holding "
                       r"\[2, 4\] devices; a hybrid mesh needs the same number in each"):
        hybrid_devices({"replica": 2, "data": 3}, "replica", _job(2, 4)[:6])
    with pytest.raises(ns.UsageError, match=r"make_mesh: across='model' is not an axis of mesh "
                       r"replica=2,data=4\. Fix: .* e\.g\. across='replica'"):
        ns.make_mesh("replica=2,data=4", across="model")
    # Devices of two slices (faked: the CPU's name none) with no axis across them: jax.make_mesh
    # would refuse them naming a function of its own.
    devs = jax.devices()
    monkeypatch.setattr(_build, "_granule_attr", lambda devices: "slice_index")
    monkeypatch.setattr(_build, "granules", lambda devices: [devs[:4], devs[4:]])
    with pytest.raises(ns.ShardingError, match=r"the 8 devices span 2 slices; mesh "
                       r"replica=2,data=4 needs an axis laid across them .* Fix: "
                       r"make_mesh\('replica=2,data=4', across='replica'\)"):
        ns.make_mesh("replica=2,data=4")


def test_one_process_is_an_ordinary_mesh() -> None:
    mesh = ns.strategies.get("hsdp").make_mesh()
    plain = ns.make_mesh("replica=2,data=4")
    assert dict(mesh.shape) == {"replica": 2, "data": 4}
    assert mesh.devices.tolist() == plain.devices.tolist() and mesh.axis_types == plain.axis_types


def test_mesh_for_gives_data_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    s = ns.strategies.get("hsdp")
    devs = jax.devices()
    for processes in (2, 4, 8):
        per = len(devs) // processes
        monkeypatch.setattr(_strategy, "granules",
                            lambda p=processes, n=per: [devs[i * n:(i + 1) * n] for i in range(p)])
        assert s.mesh_for() == {"replica": processes, "data": per}
        assert s.mesh_for(8) == {"replica": 2, "data": 4}  # a count: no processes to read
    # Renamed, the across axis follows its name.
    r = ns.strategies.get("hsdp", replica="dcn", data="ici")
    assert r.across == "dcn" and r.mesh_for() == {"dcn": 8, "ici": 1}


# --------------------------------------------------------------------------- training (slow)


@dataclasses.dataclass
class Trained:
    mesh: jax.sharding.Mesh
    model: Any
    opt: nnx.Optimizer
    losses: np.ndarray
    hlo: str


CFG = dataclasses.replace(get_config("tiny"), layers=1)


def _train(name: str) -> Trained:
    s = ns.strategies.get(name)
    mesh = s.make_mesh()  # Auto axes, the default: see the collectives test
    model = ns.sharded_init(lambda: Decoder(CFG, rngs=nnx.Rngs(0)), mesh, s)
    opt = ns.sharded_optimizer(model, optax.adamw(1e-3, weight_decay=0.1), mesh, s)
    with ns.use(mesh, s.rules):
        batch = ns.shard_batch(lm_batches(K, 8, CFG.length, CFG.vocab), mesh, s.rules,
                               ("batch", "length"), steps=True)
        fused = ns.multistep(lm_step)
        hlo = fused.lower(model, opt, batch).compile().as_text()
        losses = np.asarray(jax.device_get(fused(model, opt, batch))["loss"])
    return Trained(mesh, model, opt, losses, hlo)


@pytest.fixture(scope="module")
def hsdp() -> Trained:
    return _train("hsdp")


@pytest.mark.slow
def test_same_values_as_fsdp_on_the_same_devices(hsdp: Trained) -> None:
    fsdp = _train("fsdp")
    assert dict(hsdp.mesh.shape) == {"replica": 2, "data": 4}
    assert_close(hsdp.losses, fsdp.losses, RTOL, "loss")
    assert_close(nnx.state(hsdp.model, nnx.Param), nnx.state(fsdp.model, nnx.Param), RTOL,
                 f"params after {K} steps")
    assert_close(hsdp.opt, fsdp.opt, RTOL, f"optimizer state after {K} steps")
    assert hsdp.losses[-1] < hsdp.losses[0]
    # Each device holds 1/data of every parameter (all split along embed), the same
    # slice as its peer in the other replica.
    params = nnx.state(hsdp.model, nnx.Param)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    assert list(device_bytes(params).values()) == [total // 4] * 8
    specs = [x.sharding.spec for x in jax.tree.leaves(params)]
    assert specs == [x.sharding.spec for x in jax.tree.leaves(nnx.state(fsdp.model, nnx.Param))]
    assert all("data" in spec for spec in specs)


# Measured: XLA reduces the small gradients (the norms' scales, the 2 KiB position table)
# with the loss in one all-reduce over both axes; every other one within data, then across
# replica on its 1/data slice.
FLAT = ("attn_norm", "mlp_norm", "final_norm", "pos_embed")


@pytest.mark.slow
def test_collectives_cross_replicas_only_to_reduce_gradients(hsdp: Trained) -> None:
    found = compiled_collectives(hsdp.hlo, hsdp.mesh)
    # Auto axes (the default; Explicit ones compile one all-reduce over both axes).
    assert {(c.kind, c.axes) for c in found} == {
        ("all-gather", ("data",)), ("all-to-all", ("data",)), ("all-reduce", ("data",)),
        ("all-reduce", ("replica",)), ("all-reduce", ("replica", "data"))}

    params = {"/".join(map(str, p)): v.get_value() for p, v in
              nnx.to_flat_state(nnx.state(hsdp.model, nnx.Param))}
    flat = {p: x for p, x in params.items() if set(p.split("/")) & set(FLAT)}
    sliced = {p: x for p, x in params.items() if p not in flat}
    assert sorted(sliced) == ["blocks/0/attn/k", "blocks/0/attn/o", "blocks/0/attn/q",
                              "blocks/0/attn/v", "blocks/0/mlp/down", "blocks/0/mlp/up",
                              "token_embed", "unembed"]

    def of(kind: str, axes: tuple[str, ...]) -> list[Any]:
        return [c for c in found if (c.kind, c.axes) == (kind, axes)]

    def sizes(cs: list[Any]) -> collections.Counter[int]:
        return collections.Counter(math.prod(s) for c in cs for s in c.shapes)

    # Parameters are gathered over data only: each matrix (but the token table, looked up
    # from its slices) whole once per step, 51200 bytes, and the 3 norm scales in the
    # forward and the backward pass; besides, one int32 gather of a replica's 4 rows of
    # the step's tokens.
    shapes = {x.shape for x in params.values()}
    gathers = of("all-gather", ("data",))
    gathered = sum(c.bytes for c in gathers if c.shapes[0] in shapes)
    want = sum(x.nbytes for p, x in params.items() if x.ndim > 1 and p != "token_embed")
    scales = sum(x.nbytes for x in flat.values() if x.ndim == 1)
    assert gathered == want + 2 * scales and want == 51200
    assert [c.shapes for c in gathers if c.shapes[0] not in shapes] == [((1, 4, CFG.length),)]
    # Within each replica: the sliced gradients (all but the head's, reduced through
    # its activations' all-to-all) summed over data, then each device keeps its slice
    # (a reduce-scatter): 49152 bytes.
    within = of("all-reduce", ("data",))
    assert sizes(within) == collections.Counter(
        x.size for p, x in sliced.items() if p != "unembed")
    assert sum(c.bytes for c in within) == sum(x.nbytes for p, x in sliced.items()
                                               if p != "unembed") == 49152
    # Across replicas, once per step: each sliced gradient's 1/data slice (16384 bytes), the
    # small ones whole (2432) and the loss's two scalars: 18824 bytes, where fsdp over the
    # same 8 devices moves all 67968 bytes of gradients (and as many of parameter
    # all-gathers) across them.
    across = of("all-reduce", ("replica",))
    assert len(across) == 1 and sizes(across) == collections.Counter(
        x.size // 4 for x in sliced.values())
    assert across[0].bytes == sum(x.nbytes for x in sliced.values()) // 4 == 16384
    both = of("all-reduce", ("replica", "data"))
    assert sizes(both) == collections.Counter([1] * 2 + [x.size for x in flat.values()])
    assert sum(c.bytes for c in both) == sum(x.nbytes for x in flat.values()) + 8 == 2440
    replica_bytes = sum(c.bytes for c in found if "replica" in (c.axes or ()))
    assert replica_bytes == 18824 and sum(x.nbytes for x in params.values()) == 67968
