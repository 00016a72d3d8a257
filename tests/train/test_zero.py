"""ZeRO-1 and ZeRO-2 (``strategies.get("zero1")``, ``"zero2"``) against data parallelism.

Both keep the parameters replicated and shard the optimizer state 1/N over ``data``
along ``embed``; they differ in where the reduced gradients live, which the rules
option ``gradients`` sets and :func:`nnx_shard.value_and_grad` applies inside the
compiled step: zero1 keeps each gradient whole on every device (its parameters'
table), zero2 reduces it straight to the 1/N slice its optimizer state owns (the
optimizer state's table), and with microbatches keeps the running sum at 1/N too.

(a) the same losses and weights as dp after 5 AdamW steps through :class:`ns.Trainer`
    (zero2 also with 2 microbatches);
(b) the partitioned HLO of the gradient program with 2 microbatches: under zero2 every
    gradient is reduced inside the accumulation loop and sliced to its 1/N shard at
    once, the loop carries 1/N accumulators (zero1's are whole, dp reduces no gradient
    to a slice);
(c) XLA's bytes: the gradient program's outputs are dp's with every ``embed``-sharded
    gradient at 1/N; the whole train step's temporaries are smaller under zero2 by a
    part of the gradients' bytes.

The quick tier runs zero2's HLO proof (one small compile); the rest compiles seven
programs (~7 CPU-s) and runs in the slow tier. tests/test_strategies.py's preset matrix
checks zero2's values, per-device bytes and collectives in the quick tier.

Meshes are the presets' default (Auto axes). On them XLA's sharding propagation may
shard zero1's accumulators too (it does in the whole Trainer step, where the sharded
update pulls the sum's layout into the loop), so (b) reads the gradient program, whose
outputs are the gradients themselves: there each preset's ``gradients`` table alone
decides the layout.

Why all-reduce + slice and not reduce-scatter: XLA's SPMD partitioner lowers a sum
whose result is sharded as an all-reduce followed by a ``dynamic-slice`` at the
device's offset; XLA's GPU compiler then rewrites that pair into one ``reduce-scatter``
(its ``ReduceScatterCreator`` pass). The CPU compiler runs no such pass, so on these
simulated devices the program keeps the pair: the whole sum is
formed in a temporary and only the 1/N slice stays live, which is what the byte
counts below see. The criterion read here, an all-reduce over ``data`` whose only
users are slices of one ``embed`` dimension to ``embed / N``, is exactly the pattern
those passes turn into a reduce-scatter.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard.models import Decoder, get_config, lm_loss
from nnx_shard.planner import compiled_collectives, partitioned_hlo
from tests._close import assert_close
from tests._lm import lm_batches
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

N = 8  # the data axis: every preset here runs on data=8
STEPS, BATCH, LR = 5, 16, 1e-3
# The presets sum the same per-device partial gradients in the same all-reduce; only
# where the sum is kept differs, so the runs agree to float rounding.
RTOL = 1e-5
# One layer: every block is the same program; a second adds compilation, not coverage.
CFG = dataclasses.replace(get_config("tiny"), layers=1)


def _factory() -> Decoder:
    return Decoder(CFG, rngs=nnx.Rngs(0))


def _host_batches() -> list[dict[str, np.ndarray]]:
    stacked = lm_batches(STEPS, BATCH, CFG.length, CFG.vocab)
    return [{k: v[i] for k, v in stacked.items()} for i in range(STEPS)]


@dataclasses.dataclass(frozen=True)
class Trained:
    losses: np.ndarray
    params: Any  # host copies after the steps
    temp: int  # temp_size_in_bytes of the compiled call fit ran


@functools.cache
def _trained(name: str, microbatches: int) -> Trained:
    """STEPS AdamW steps of ``name`` through Trainer.fit, in one compiled call."""
    s = ns.strategies.get(name)
    mesh = s.make_mesh(N)
    model = ns.sharded_init(_factory, mesh, s)
    opt = ns.sharded_optimizer(model, optax.adamw(LR), mesh, s)
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=s.rules, steps_per_call=STEPS,
                         microbatches=microbatches, batch_names=("batch", "length"))
    # The program fit compiles next (read back from the compilation cache there).
    stacked = lm_batches(STEPS, BATCH, CFG.length, CFG.vocab)
    temp = trainer.lower(stacked).compile().memory_analysis().temp_size_in_bytes
    history = trainer.fit(_host_batches(), STEPS, progress=False)
    assert trainer.traces == 1
    return Trained(np.asarray(history["loss"]), jax.device_get(nnx.state(model, nnx.Param)),
                   temp)


# --------------------------------------------------------------------------- (a) values


@pytest.mark.slow
@pytest.mark.parametrize(("name", "microbatches"), [("zero1", 1), ("zero2", 1), ("zero2", 2)])
def test_trains_like_dp(name: str, microbatches: int) -> None:
    ref, run = _trained("dp", 1), _trained(name, microbatches)
    assert run.losses[-1] < run.losses[0]  # it trains
    assert_close(run.losses, ref.losses, RTOL, f"{name} losses")
    assert_close(run.params, ref.params, RTOL, f"{name} params after {STEPS} steps")


# --------------------------------------------------------------------------- HLO


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*"
                    r"(\((?:[^()]|\([^()]*\))*\)|[a-z][a-z0-9]*\[[0-9,]*\])\S*\s+"
                    r"([a-z][\w-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    computation: str
    op: str
    type: str  # "f32[4,8]" or a tuple "(s32[], f32[4,8], ...)"
    operands: tuple[str, ...]
    line: str


def _dims(type_txt: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of an array type, or of each element of a tuple type."""
    return [(d, tuple(int(x) for x in dims.split(",") if x))
            for d, dims in _ARRAY.findall(re.sub(r"\{[0-9,]*\}", "", type_txt))]


def _parse(text: str) -> tuple[dict[str, Instr], dict[str, list[str]]]:
    """The instructions of an HLO module by name, and each one's users."""
    instrs: dict[str, Instr] = {}
    computation = ""
    for line in text.splitlines():
        if m := _COMPUTATION.match(line):
            computation = m.group(1)
        elif m := _INSTR.match(line):
            name, type_txt, op, rest = m.groups()
            args = rest.split(")", 1)[0] if op != "while" else rest.split("),", 1)[0]
            instrs[name] = Instr(name, computation, op, type_txt,
                                 tuple(re.findall(r"%([\w.\-]+)", args)), line)
    users: dict[str, list[str]] = collections.defaultdict(list)
    for i in instrs.values():
        for o in i.operands:
            users[o].append(i.name)
    return instrs, users


def _users(instrs: dict[str, Instr], users: dict[str, list[str]], name: str) -> list[Instr]:
    """What reads ``name``'s value, looking through copies (a value moved, not changed)."""
    out = []
    for u in users[name]:
        if instrs[u].op in ("copy", "bitcast"):
            out += _users(instrs, users, u)
        else:
            out.append(instrs[u])
    return out


def _gradient_reduces(text: str, mesh: jax.sharding.Mesh) -> list[Instr]:
    """The float all-reduces over data of rank >= 1: the summed gradients (the loss and
    the token counts are scalars)."""
    instrs, _ = _parse(text)
    found = []
    for i in instrs.values():
        if i.op != "all-reduce":
            continue
        ((dtype, dims),) = _dims(i.type)
        (c,) = compiled_collectives(i.line, mesh)
        if c.axes == ("data",) and dtype.startswith("f") and dims:
            found.append(i)
    return found


def _is_shard_slice(src: Instr, user: Instr) -> bool:
    """``user`` slices ``src`` to 1/N of one ``embed``-sized dimension, keeping the rest."""
    if user.op != "dynamic-slice":
        return False
    ((_, whole),), ((_, part),) = _dims(src.type), _dims(user.type)
    cut = [d for d, (a, b) in enumerate(zip(whole, part, strict=True)) if a != b]
    return len(cut) == 1 and whole[cut[0]] == CFG.embed and part[cut[0]] == CFG.embed // N


@dataclasses.dataclass(frozen=True)
class GradProgram:
    text: str  # the HLO right after SPMD partitioning
    output: int  # output_size_in_bytes
    mesh: jax.sharding.Mesh


@functools.cache
def _grad_program(name: str) -> GradProgram:
    """jit of ns.value_and_grad(lm_loss, microbatches=2) under the preset's rules, on its
    default (Auto) mesh, as Trainer and multistep compute gradients."""
    s = ns.strategies.get(name)
    mesh = s.make_mesh(N)
    graphdef, state = nnx.split(ns.abstract_init(_factory, mesh, s))
    grad_fn = ns.value_and_grad(lm_loss, microbatches=2)
    with ns.use(mesh, s.rules):
        batch = ns.shard_batch(_host_batches()[0], mesh, s.rules, ("batch", "length"))
        lowered = jax.jit(lambda st, b: grad_fn(nnx.merge(graphdef, st), b)).lower(state, batch)
        compiled, text = partitioned_hlo(lowered)
    return GradProgram(text, compiled.memory_analysis().output_size_in_bytes, mesh)


def _param_shapes() -> list[tuple[tuple[int, ...], tuple[Any, ...]]]:
    """Each parameter's shape and logical names, in the gradients' leaf order."""
    params = nnx.state(nnx.eval_shape(_factory), nnx.Param)
    names = dict(nnx.to_flat_state(ns.get_logical_axes(params)))
    return [(tuple(v.get_value().shape), names[p]) for p, v in nnx.to_flat_state(params)]


def _shard(shape: tuple[int, ...], names: tuple[Any, ...]) -> tuple[int, ...]:
    """The 1/N slice of ``shape`` the optimizer state (zero2's gradients table) keeps."""
    return tuple(d // N if n == "embed" else d for d, n in zip(shape, names, strict=True))


def _accumulation_loop(text: str) -> tuple[Instr, list[tuple[int, ...]]]:
    """The one while loop of the gradient program (the microbatch scan) and the shapes of
    the float arrays it carries."""
    instrs, _ = _parse(text)
    (loop,) = [i for i in instrs.values() if i.op == "while"]
    return loop, [dims for dtype, dims in _dims(loop.type) if dtype.startswith("f")]


def _contains_run(seq: list[tuple[int, ...]], run: list[tuple[int, ...]]) -> bool:
    return any(seq[i:i + len(run)] == run for i in range(len(seq) - len(run) + 1))


def test_zero2_reduces_each_gradient_to_its_shard_inside_the_microbatch_loop() -> None:
    prog = _grad_program("zero2")
    instrs, users = _parse(prog.text)
    loop, carried = _accumulation_loop(prog.text)
    body = re.search(r"body=%([\w.\-]+)", loop.line).group(1)
    reduces = _gradient_reduces(prog.text, prog.mesh)
    # Every gradient's sum over data but the token embedding's (the partitioner sends
    # its scatter-add's rows to the shards that own them by an all-to-all: no whole sum
    # at all; jax 0.10 and 0.12 alike) ...
    assert len(reduces) == len(_param_shapes()) - 1
    for r in reduces:
        # ... runs once per microbatch, inside the accumulation loop ...
        assert r.computation == body, r.line
        # ... and only its 1/N slice of embed is read: a reduce-scatter, on CPU.
        read = _users(instrs, users, r.name)
        assert read and all(_is_shard_slice(r, u) for u in read), (r.line, [u.line for u in read])
    # The loop carries the 1/N accumulators, one per parameter, in leaf order.
    assert _contains_run(carried, [_shard(s, n) for s, n in _param_shapes()])


@pytest.mark.slow
def test_zero1_accumulates_whole_gradients_and_dp_slices_none() -> None:
    whole = [s for s, _ in _param_shapes()]
    shards = [_shard(s, n) for s, n in _param_shapes()]
    for name in ("zero1", "dp"):
        prog = _grad_program(name)
        instrs, users = _parse(prog.text)
        reduces = _gradient_reduces(prog.text, prog.mesh)
        assert len(reduces) == len(whole), name  # every gradient summed whole
        assert not any(u.op == "dynamic-slice"
                       for r in reduces for u in _users(instrs, users, r.name)), name
        _, carried = _accumulation_loop(prog.text)
        assert _contains_run(carried, whole) and not _contains_run(carried, shards), name


# --------------------------------------------------------------------------- (c) bytes


@pytest.mark.slow
def test_gradient_bytes_are_dps_with_each_embed_gradient_at_one_nth() -> None:
    dp, zero1, zero2 = (_grad_program(n).output for n in ("dp", "zero1", "zero2"))
    params = _param_shapes()
    assert all("embed" in n for _, n in params)  # so zero2 shards every gradient
    nbytes = [4 * math.prod(s) for s, _ in params]  # float32
    assert zero1 == dp  # whole gradients, like the parameters
    assert zero2 == dp - sum(b - b // N for b in nbytes)


@pytest.mark.slow
def test_zero2_step_needs_fewer_temporaries_than_zero1() -> None:
    """The whole Trainer call: zero2 saves at least one device's shard of the gradients
    and at most all of them but that shard (XLA CPU: 1.5 shards on this model, jax 0.10
    and 0.12: its buffer reuse keeps few of zero1's whole gradients live at once)."""
    grads = sum(4 * math.prod(s) for s, _ in _param_shapes())
    saved = _trained("zero1", 1).temp - _trained("zero2", 1).temp
    assert grads // N <= saved <= grads - grads // N


def test_a_models_own_names_reach_the_gradients_layout():
    # with_rules extends the gradients' table with the other two: an alias of embed is
    # 1/N in zero2's gradients, whole in zero1's.
    z2 = ns.strategies.get("zero2").with_rules({"fsdp": "embed"})
    z1 = ns.strategies.get("zero1").with_rules({"fsdp": "embed"})
    assert (z2.rules["fsdp"], z2.opt_rules["fsdp"], z2.rules.options["gradients"]["fsdp"]) == (
        None, "data", "data")
    assert z1.rules.options["gradients"]["fsdp"] is None
    # A name added to the active rules afterwards (rules | {...}) lays its gradient out as
    # those rules do instead of failing for want of a rule in the gradients' table.
    init = nnx.with_partitioning(nnx.initializers.ones, ("own", "embed"))
    with nnx.use_eager_sharding(False):  # laid out by the jit below, not at creation
        model = nnx.Linear(8, 16, use_bias=False, kernel_init=init, rngs=nnx.Rngs(0))
    rules = ns.strategies.get("zero2").rules | {"own": None}

    def grads(m):
        return ns.value_and_grad(lambda m, x: (m(x) ** 2).mean())(m, jax.numpy.ones((8, 8)))[1]

    with ns.use("data=8", rules):
        g = nnx.jit(grads)(model)
    assert g["kernel"][...].sharding.spec == jax.sharding.PartitionSpec(None, "data")


def test_a_gradients_option_that_is_no_table_is_one_usage_error():
    init = nnx.with_partitioning(nnx.initializers.ones, ("embed", None))
    with nnx.use_eager_sharding(False):
        model = nnx.Linear(8, 2, use_bias=False, kernel_init=init, rngs=nnx.Rngs(0))
    rules = ns.Rules({"embed": None}).with_options(gradients="data")
    grad_fn = ns.value_and_grad(lambda m, x: m(x).sum())
    with ns.use("data=8", rules), pytest.raises(
            ns.UsageError, match=r"the rules option gradients='data' is not a rules table\. "
                                 r"Fix: a Rules table \(or dict\)"):
        nnx.jit(lambda m: grad_fn(m, jax.numpy.ones((8, 8))))(model)
