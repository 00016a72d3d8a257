"""No preset's compiled training step replicates what its rules keep sharded.

When XLA's SPMD partitioner cannot move a tensor between two layouts efficiently, it logs
"Involuntary full rematerialization" from C++ on stderr, gathers the whole tensor on every
device and cuts it again: nothing fails, the step only costs more (memory and bytes moved
in proportion to the tensor). Each preset's fused training step of the reference
transformer (tiny shapes, the preset's own mesh of 8 devices with Auto axes, as
``Strategy.make_mesh`` and the README's ``Trainer`` build it) is compiled here, and

(a) XLA writes no such message while compiling it;
(b) the compiled program all-gathers no parameter whole that the rules keep split while it
    is used: FSDP gathers each parameter's ``embed`` dimension before use by design, but
    the tensor-parallel, expert and pipeline axes stay split (a stacked layer gathered
    over ``stage``, a ``heads``-split kernel gathered over ``model``, is replication).

XLA logs through its own C++ logging, past ``sys.stderr``: the compile runs with file
descriptor 2 sent to a file. A reshard XLA cannot do efficiently under either supported
jax (``test_capture_sees_xla_message``) proves that the capture sees the message, so an
empty log means no message, not a hidden one; a kernel gathered on purpose
(``test_a_whole_gather_is_seen``) proves that (b) sees a whole gather. The quick tier
compiles fsdp_tp (the README's preset: FSDP and tensor parallelism at once); the slow
tier every preset. Explicit meshes are not covered: there the reference models gather
the token embedding whole before the lookup on purpose (``models._ops.lookup``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import nnx_shard as ns
from nnx_shard.models import Decoder, get_config, lm_loss
from nnx_shard.planner import compiled_collectives
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

MESSAGE = "Involuntary full rematerialization"
STEPS, BATCH = 2, 16  # fused steps per call; rows per step (divides every preset's batch split)


@contextlib.contextmanager
def _fd2_to_file() -> Iterator[list[str]]:
    """What is written to file descriptor 2 inside the block, appended to the yielded list
    when the block ends (XLA's C++ logging writes there directly, not through
    ``sys.stderr``, so pytest's own capture does not hold it apart)."""
    sys.stderr.flush()
    saved = os.dup(2)
    got: list[str] = []
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield got
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            got.append(sink.read().decode(errors="replace"))


def _salt() -> jax.Array:
    # A constant unique to this compile. The test run shares one persistent compilation
    # cache (the root conftest.py), and a program read back from it is not partitioned
    # again: XLA would log nothing. With the constant among the outputs, no other compile
    # has this program's key.
    return jnp.asarray(np.frombuffer(os.urandom(16), np.int32))


def _compile_logged(lower: Callable[[], jax.stages.Lowered]) -> tuple[str, str]:
    """``lower()`` compiled: what XLA logged meanwhile, and the compiled HLO text."""
    with _fd2_to_file() as log:
        hlo = lower().compile().as_text()
    assert hlo is not None
    return log[0], hlo


def _remat_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if MESSAGE in line]


def test_capture_sees_xla_message() -> None:
    # A reshard both supported jax versions' partitioners do by replicating: a [8, 8, 8]
    # tensor split on its first dimension over data x model, then over data on its second.
    mesh = jax.make_mesh((4, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def f(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = jax.lax.with_sharding_constraint(
            x * 2, NamedSharding(mesh, PartitionSpec(("data", "model"))))
        y = jax.lax.with_sharding_constraint(y + 1, NamedSharding(mesh, PartitionSpec(None, "data")))
        return y, _salt()

    log, _ = _compile_logged(lambda: jax.jit(f).lower(jax.ShapeDtypeStruct((8, 8, 8), jnp.float32)))
    lines = _remat_lines(log)
    assert len(lines) == 1, (
        "the capture did not see XLA's warning (is TF_CPP_MIN_LOG_LEVEL above 0?):\n" + log)
    assert 'op_name="jit(f)/sharding_constraint"' in lines[0]


# --------------------------------------------------------------------------- the presets


def _config(name: str) -> Any:
    # As the preset matrix builds them (tiny_moe for expert parallelism; for the pipeline
    # presets the layers stacked, four of them: one per stage on 4 stages), with a
    # vocabulary of 160 and an MLP of 96: then no parameter's whole shape is another's
    # (or its own) shape as it is used split, so a whole gather is known by its shape.
    cfg = dataclasses.replace(get_config("tiny_moe" if name == "ep" else "tiny"),
                              vocab=160, mlp=96)
    if name.startswith("pp"):
        cfg = dataclasses.replace(cfg, layers=4, scan_layers=True)
    return cfg


@dataclasses.dataclass
class Compiled:
    """One preset's fused training step, compiled from abstract inputs."""

    strategy: ns.strategies.Strategy
    mesh: jax.sharding.Mesh
    model: Any  # abstract
    log: str  # what XLA wrote on stderr while compiling
    hlo: str


def _compile(name: str) -> Compiled:
    s = ns.strategies.get(name)
    cfg = _config(name)
    mesh = s.make_mesh(8)
    model = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, s)
    opt = ns.sharded_optimizer(model, optax.adam(1e-3), mesh, s)
    spec = s.rules.spec((None, "batch", "length"), shape=(STEPS, BATCH, cfg.length), mesh=mesh)
    tokens = jax.ShapeDtypeStruct((STEPS, BATCH, cfg.length), jnp.int32,
                                  sharding=NamedSharding(mesh, spec))

    def step(model: Any, opt: nnx.Optimizer, batch: dict[str, jax.Array]) -> dict[str, Any]:
        loss, grads = ns.value_and_grad(lm_loss)(model, batch)
        opt.update(model, grads)
        return {"loss": loss, "salt": _salt()}

    fused = ns.multistep(step, microbatches=4 if name.startswith("pp") else 1)

    def lower() -> jax.stages.Lowered:
        with ns.use(mesh, s.rules):
            return fused.lower(model, opt, {"inputs": tokens, "targets": tokens})

    log, hlo = _compile_logged(lower)
    return Compiled(s, mesh, model, log, hlo)


def _path(path: tuple[Any, ...]) -> str:
    return "/".join(str(k) for k in path)


def _value(x: Any) -> Any:
    return x.get_value() if isinstance(x, nnx.Variable) else x


def whole_shapes(model: Any, mesh: jax.sharding.Mesh, rules: ns.Rules) -> dict[tuple[int, ...], str]:
    """The global shapes of the parameters the rules keep split while they are used, each
    with a parameter's path: those whose layout, less the mesh axes of its ``embed``
    dimensions (what FSDP gathers before use), still names a mesh axis. A shape a gather
    may legitimately produce is left out, so that one parameter's gather is never taken
    for another's whole: a parameter split only along ``embed`` (or not at all) gathered
    whole, and any parameter gathered to the layout it is used in."""
    params = nnx.state(model, nnx.Param)
    names = dict(nnx.to_flat_state(ns.get_logical_axes(params)))
    specs = dict(nnx.to_flat_state(ns.shardings(params, mesh, rules)))
    kept: dict[tuple[int, ...], str] = {}
    legitimate: set[tuple[int, ...]] = set()
    for path, var in nnx.to_flat_state(params):
        shape = tuple(var.get_value().shape)
        spec = (*_value(specs[path]).spec, *(None,) * len(shape))[:len(shape)]
        logical = _value(names[path]) or (None,) * len(shape)
        used = [None if name == "embed" else entry
                for entry, name in zip(spec, logical, strict=True)]
        legitimate.add(tuple(n // _size(mesh, e) for n, e in zip(shape, used, strict=True)))
        if any(entry is not None for entry in used):
            kept.setdefault(shape, _path(path))
    return {shape: path for shape, path in kept.items() if shape not in legitimate}


def gathered_whole(hlo: str, mesh: jax.sharding.Mesh, kept: dict[tuple[int, ...], str]
                   ) -> list[str]:
    """The all-gathers of the compiled ``hlo`` whose result (on one device) has the whole
    shape of a parameter in ``kept`` (:func:`whole_shapes`), one line each."""
    return [f"{kept[shape]} {list(shape)} over {c.axes} by {c.op_name or 'an unnamed op'}"
            for c in compiled_collectives(hlo, mesh) if c.kind == "all-gather"
            for shape in c.shapes if shape in kept]


def _size(mesh: jax.sharding.Mesh, entry: Any) -> int:
    """How many ways one ``PartitionSpec`` entry splits its dimension on ``mesh``."""
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    return int(np.prod([mesh.shape[a] for a in axes]))


PRESETS = [n if n == "fsdp_tp" else pytest.param(n, marks=pytest.mark.slow)
           for n in ns.strategies.NAMES]


@pytest.fixture(scope="module", params=PRESETS)
def compiled(request: pytest.FixtureRequest) -> Compiled:
    return _compile(request.param)


def test_xla_replicates_nothing(compiled: Compiled) -> None:
    # (a): not one reshard of the step fell back to replicating its tensor.
    assert _remat_lines(compiled.log) == [], (
        f"{compiled.strategy.name}: XLA replicated tensors while partitioning the step:\n"
        + "\n".join(line[:600] for line in _remat_lines(compiled.log)))


def test_no_parameter_gathered_whole(compiled: Compiled) -> None:
    # (b): the parameters the preset keeps split while computing stay split.
    s = compiled.strategy
    kept = whole_shapes(compiled.model, compiled.mesh, s.rules)
    if s.name in ("tp", "fsdp_tp", "sp", "async_tp", "ep", "pp", "pp_fsdp", "pp_tp"):
        assert kept  # the check has parameters to watch under these presets
    if s.name == "fsdp_tp":
        # Every kernel is split over model (heads, mlp or vocab); q, k and v share a shape,
        # named by the first.
        assert sorted(kept.values()) == [
            "blocks/0/attn/k", "blocks/0/attn/o", "blocks/0/mlp/down", "blocks/0/mlp/up",
            "token_embed", "unembed"]
    found = gathered_whole(compiled.hlo, compiled.mesh, kept)
    assert found == [], f"{s.name}: parameters gathered whole on every device: {found}"


def test_a_whole_gather_is_seen() -> None:
    # The check of (b) finds a kernel gathered whole: the attention output's (split over
    # model along heads), asked for replicated on fsdp_tp's mesh.
    s = ns.strategies.get("fsdp_tp")
    mesh = s.make_mesh(8)
    model = ns.abstract_init(lambda: Decoder(_config("fsdp_tp"), rngs=nnx.Rngs(0)), mesh, s)
    params = nnx.state(model, nnx.Param)
    path = ("blocks", 0, "attn", "o")
    o = dict(nnx.to_flat_state(params))[path].get_value()
    split = _value(dict(nnx.to_flat_state(ns.shardings(params, mesh, s.rules)))[path])

    def f(w: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, PartitionSpec())), _salt()

    hlo = jax.jit(f).lower(jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=split)).compile()
    text = hlo.as_text()
    assert text is not None
    found = gathered_whole(text, mesh, whole_shapes(model, mesh, s.rules))
    assert [line.split(" over ")[0] for line in found] == ["blocks/0/attn/o [4, 8, 32]"]
