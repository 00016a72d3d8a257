"""The planner's share of host offload: the formula's device/host split, ``plan
--offload`` and ``plan --auto`` turning offload on only where nothing fits without.
Abstract models and fake compiles only: nothing here compiles."""

from __future__ import annotations

import dataclasses
import json

import optax
import pytest
from flax import nnx

from nnx_shard import planner, strategies
from nnx_shard._errors import UsageError
from nnx_shard._report import fmt_bytes
from nnx_shard.cli import _plan as cli_plan
from nnx_shard.cli import main
from nnx_shard.models import Decoder, get_config
from nnx_shard.planner._formula import (
    ARRIVES,
    abstract_report,
    formula,
    formula_bytes,
    formula_parts,
    offload_phases,
)

H = planner.Hardware("test", peak_flops=1e9, link_bandwidth=1e6)
CFG = dataclasses.replace(get_config("tiny"), scan_layers=True)  # 2 stacked layers
ARGS = (8, 16, "none")  # batch, seq, remat


@pytest.fixture(scope="module")
def model():
    return nnx.eval_shape(lambda: Decoder(CFG, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def fsdp_report(model):
    strat = strategies.get("fsdp")
    return abstract_report(model, {"data": 2}, strat.rules, optax.adamw(1e-3), strat.opt_rules)


# ------------------------------------------------------------------------------ the formula


@pytest.mark.parametrize("activations", [0, 10**6])
def test_offload_counts_the_phases_of_the_step_as_the_library_moves_the_state(
        fsdp_report, activations):
    """The device holds, at most: the parts less the optimizer state (forward and
    backward), or parameters + gradients + the optimizer state moved in (the update,
    the activations freed). Where the update moves the whole state (no optimizer known
    to be element-wise here), offloaded parameters arrive at the step's start, so
    "optimizer+params" has the same device peak; it only frees them between steps."""
    r = fsdp_report
    assert ARRIVES == {"params": "step", "optimizer": "update"}
    plain = formula(r, activations)
    assert "host" not in plain and "streamed" not in plain  # no offload: as it was
    p, g, o = plain["params"], plain["grads"], plain["optimizer"]
    opt = formula(r, activations, offload="optimizer")
    assert opt["host"] == o == r.opt_bytes_per_device
    assert opt["total"] == max(plain["total"] - o, p + g + o)
    assert opt["streamed"] == opt["total"] - (plain["total"] - o)
    # Activations over the optimizer state: the forward/backward phase decides, and
    # offloading takes the whole optimizer state off the device's peak.
    assert (opt["total"] == plain["total"] - o) == (activations >= o)
    both = formula(r, activations, offload="optimizer+params")
    assert both["host"] == o + p
    assert both["total"] == opt["total"]
    assert both["streamed"] == both["total"] - (plain["total"] - o - p)
    # The parts stay the state's bytes wherever they live.
    assert {k: both[k] for k in plain if k != "total"} == {
        k: plain[k] for k in plain if k != "total"}


def test_an_elementwise_update_of_stacked_layers_holds_two_layers_of_the_state():
    """Trainer's steps stream an element-wise optimizer's stacked state a layer at a
    time: the update phase holds the state of the leaves that are not stacked, and
    of each stacked leaf the slice moved in and the new one (2/L of it)."""
    layers = 4
    cfg = dataclasses.replace(CFG, layers=layers)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    strat, tx = strategies.get("fsdp"), optax.adamw(1e-3)
    r = abstract_report(abstract, {"data": 2}, strat.rules, tx, strat.opt_rules)
    rows = [row for row in r.rows if row.group == "optimizer"]
    stacked = sum(row.bytes_per_device for row in rows
                  if row.names and row.names[0] == "layers")
    assert 0 < stacked < r.opt_bytes_per_device  # embeddings and final norm are not stacked
    plain = formula(r, 0)
    p, g, o = plain["params"], plain["grads"], plain["optimizer"]
    whole = formula(r, 0, offload="optimizer")
    streamed = formula(r, 0, offload="optimizer", tx=tx)
    assert whole["total"] == p + g + o
    assert streamed["total"] == p + g + o - stacked + 2 * stacked // layers
    assert streamed["host"] == whole["host"] == o
    # A global-norm clip couples the leaves: the whole state moves in.
    clipped = optax.chain(optax.clip_by_global_norm(1.0), tx)
    assert formula(r, 0, offload="optimizer", tx=clipped)["total"] == whole["total"]


def test_streamed_params_hold_two_layers_of_params_and_grads_on_the_device():
    """With "optimizer+params" and a streaming update the stacked parameters stream
    too (tests/train/test_stream_params.py proves the moves on the traced step): the
    device holds the leaves that are not stacked and two layers of each stacked
    parameter and gradient, the stacked gradients come back to host memory, and the
    layer loop keeps what remat="full" keeps (``streamed_activations``)."""
    layers, acts, acts_full = 4, 10**6, 10**5
    cfg = dataclasses.replace(CFG, layers=layers)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    strat, tx = strategies.get("fsdp"), optax.adamw(1e-3)
    r = abstract_report(abstract, {"data": 2}, strat.rules, tx, strat.opt_rules)

    def split(group):
        rows = [row for row in r.rows if row.group == group]
        stacked = [row for row in rows if row.names and row.names[0] == "layers"]
        whole = sum(row.bytes_per_device for row in rows) - sum(
            row.bytes_per_device for row in stacked)
        return whole, sum(row.bytes_per_device for row in stacked), sum(
            2 * row.bytes_per_device // layers for row in stacked)

    p_n, p_s, p_two = split("params")
    o_n, o_s, o_two = split("optimizer")
    assert p_n > 0 and p_s > 0 and o_s > 0  # embeddings apart from the stack
    both = formula(r, acts, offload="optimizer+params", tx=tx, streamed_activations=acts_full)
    # fsdp's gradients are laid out as the parameters: p_n, p_s, p_two of them too.
    assert both["host"] == p_n + p_s + o_n + o_s + p_s
    forward = acts_full + (p_n + p_two) * 2
    update = (p_n + p_two) * 2 + o_n + o_two
    assert both["total"] == max(forward, update)
    assert both["streamed"] == both["total"] - (p_n + acts_full)
    # Against the optimizer alone offloaded (the parameters and gradients whole):
    opt = formula(r, acts, offload="optimizer", tx=tx)
    assert opt["total"] == max(acts + 2 * (p_n + p_s), 2 * (p_n + p_s) + o_n + o_two)
    assert both["total"] < opt["total"]
    # Where the library moves the parameters in whole, so does the formula: two
    # microbatches, a gradients layout option (zero2's), an optimizer that couples leaves.
    whole = formula(r, acts, offload="optimizer+params", tx=tx)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), tx)
    grads = abstract_report(abstract, {"data": 2}, strat.rules)
    for kw in ({"microbatches": 2}, {"grads": grads}, {"tx": clipped}):
        kw = {"tx": tx, **kw}
        out = formula(r, acts, offload="optimizer+params", streamed_activations=acts_full, **kw)
        assert out["host"] == p_n + p_s + o_n + o_s, kw
        assert out["total"] == formula(r, acts, offload="optimizer", **kw)["total"], kw
    assert whole["total"] == max(forward - acts_full + acts, update)


def test_the_guard_copy_of_host_state_stays_on_the_host(fsdp_report):
    # guard="full" keeps the state from before the call; offloaded, in host memory,
    # where its check at the call's end reads and selects it (tests/train/
    # test_stream_params.py proves that on the traced call): no phase moves it in.
    r = fsdp_report
    plain = formula(r, 1000, guard="full")
    o = plain["optimizer"]
    full = formula(r, 1000, guard="full", offload="optimizer")
    assert full["host"] == 2 * o
    phases = offload_phases(plain, "optimizer", "full")
    assert phases == {"host": 2 * o, "kept": plain["total"] - 2 * o,
                      "forward": plain["total"] - 2 * o,
                      "update": plain["total"] - 2 * o - 1000 + o}
    assert full["total"] == max(phases["forward"], phases["update"])
    assert full["streamed"] == full["total"] - phases["kept"]


def test_the_search_compares_the_device_figure(model):
    tx = optax.adamw(1e-3)
    sizes = {"data": 2}
    plain = formula_parts(model, CFG, strategies.get("fsdp"), sizes, tx, *ARGS)
    off = formula_parts(model, CFG, strategies.get("fsdp").with_offload("optimizer"), sizes,
                        tx, *ARGS)
    assert plain is not None and off is not None
    assert off["host"] == plain["optimizer"] and off["total"] < plain["total"]
    assert formula_bytes(model, CFG, strategies.get("fsdp").with_offload("optimizer"), sizes,
                         tx, *ARGS) == off["total"]


# ------------------------------------------------------------------------- plan --offload


PLAN = ["plan", "--model", "tiny", "--strategy", "fsdp", "--mesh", "data=2", "--batch", "8",
        "--seq", "16", "--scan-layers", "--no-compile"]


def test_plan_offload_prints_device_and_host_apart(capsys):
    assert main([*PLAN, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["offload"] is None and plain["host_bytes"] is None
    assert main([*PLAN, "--offload", "optimizer", "--json", "--device-memory",
                 str(plain["bytes_needed"] - 1), "--host-memory", "1MB"]) == 0
    off = json.loads(capsys.readouterr().out)
    per = off["bytes_per_device"]
    assert off["offload"] == "optimizer" and off["decided_by"] == "formula"
    assert off["host_bytes"] == per["host"] == per["optimizer"]
    assert off["bytes_needed"] == per["total"] < plain["bytes_needed"]  # fits only offloaded
    assert off["fits"] and off["host_fits"]
    # Over the host's memory: does not fit, whatever the device's.
    assert main([*PLAN, "--offload", "optimizer+params", "--host-memory", "1KB"]) == 1
    text = capsys.readouterr().out
    assert "device total" in text and "host total" in text
    assert "host: does NOT fit in 1000 B of host memory per device" in text


def test_plan_offload_says_the_compiled_split_is_not_available(capsys, monkeypatch):
    # A compile of the step without offload (no device/host split), faked: nothing compiles.
    fake = {"params": 10, "optimizer": 20, "temp": 30, "total": 10**9, "compile_s": 0.1}
    monkeypatch.setattr(cli_plan, "_compile", lambda *a: fake)
    assert main([*PLAN, "--offload", "optimizer", "--device-memory", "1MB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["compiled_split"] is False and out["decided_by"] == "formula, offload"
    assert out["bytes_needed"] == out["bytes_per_device"]["total"]  # not the compiled 1 GB
    main([*PLAN, "--offload", "optimizer"])
    text = " ".join(capsys.readouterr().out.split())
    assert "host total n/a" in text
    assert "the device/host split of the compiled figure is not available" in text
    # A compile that splits them decides.
    monkeypatch.setattr(cli_plan, "_compile", lambda *a: {**fake, "device": 500, "host": 70})
    assert main([*PLAN, "--offload", "optimizer", "--device-memory", "1KB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["compiled_split"], out["bytes_needed"], out["host_bytes"]) == (True, 500, 70)


@pytest.mark.parametrize("flags, says", [
    (["--auto", "--devices", "2", "--offload", "optimizer"], "turns offload on itself"),
    (["--mesh", "data=2", "--host-memory", "1GB"], "--host-memory checks what --offload"),
    (["--mesh", "data=2", "--offload", "optimizer", "--host-memory", "lots"],
     "--host-memory 'lots' is not a size"),
    (["--mesh", "data=2", "--generate", "--offload", "optimizer"], "drop them with --generate"),
    (["--mesh", "data=2", "--offload", "grads"], "invalid choice: 'grads'"),
])
def test_plan_offload_flags_are_checked(flags, says, capsys):
    assert main(["plan", "--model", "tiny", "--batch", "8", "--seq", "16", *flags]) == 2
    assert says in capsys.readouterr().err


# ----------------------------------------------------------------------------- plan --auto


#: What the fake compile adds to the formula (XLA's temporaries, say).
EXTRA = 1000


def _need(model, name, offload=None):
    strat = strategies.get(name)
    parts = formula_parts(model, CFG, strat.with_offload(offload) if offload else strat,
                          {"data": 2}, optax.adamw(1e-3), *ARGS)
    assert parts is not None
    return parts


def _fake(model):
    """A compile of a candidate's step without offload: its formula + EXTRA bytes, with
    no device/host split."""
    seen: list[planner.Candidate] = []

    def compile_fn(c: planner.Candidate) -> dict:
        seen.append(c)
        return {"total": _need(model, c.strategy)["total"] + EXTRA, "temp": 0, "flops": 1e9,
                "collectives": 0, "collective_bytes": 1e6 * (c.strategy == "dp"),
                "memory_bytes": 0.0}

    compile_fn.seen = seen  # type: ignore[attr-defined]
    return compile_fn


def _auto(fake, memory, **kw):
    return planner.auto(CFG, devices=2, batch=8, seq=16, device_memory=memory, hardware=H,
                        strategies=["dp", "fsdp"], remat=["none"], microbatches=[1],
                        compile_fn=fake, progress=False, **kw)


def test_auto_offloads_only_where_nothing_fits_without(model):
    fake = _fake(model)
    plan = _auto(fake, _need(model, "dp")["total"] + EXTRA)  # both fit: no offload considered
    assert plan.request["offload_tried"] == [] and not any(c.offload for c in fake.seen)
    # Nothing fits: "optimizer" next, device bytes = compiled - host + streamed.
    fsdp, dp = _need(model, "fsdp", "optimizer"), _need(model, "dp", "optimizer")
    memory = fsdp["total"] + EXTRA  # fsdp offloaded just fits, dp does not
    assert dp["total"] + EXTRA > memory and _need(model, "fsdp")["total"] + EXTRA > memory
    plan = _auto(_fake(model), memory)
    best = plan.best
    assert best is not None and best.label == "fsdp data=2 remat=none mb=1 offload=optimizer"
    assert (best.bytes_per_device, best.host_bytes) == (memory, fsdp["host"])
    assert best.decided_by == "compiled less offloaded"
    assert plan.request["offload_tried"] == ["optimizer"]
    assert [c.label for c in plan.ranked] == [best.label]
    text = str(plan)
    assert "offloads the optimizer state to host memory" in text
    assert "get('fsdp').with_offload('optimizer')" in plan.python()
    assert "host offload (optimizer) tried only because no candidate fits" in text


def test_auto_tries_params_too_then_checks_the_host(model):
    opt, both = _need(model, "fsdp", "optimizer"), _need(model, "fsdp", "optimizer+params")
    memory = opt["total"] + EXTRA  # fsdp offloaded fits the device
    # The host's memory is checked too: one byte short of the optimizer state, and the
    # parameters (which add to the host's share, not the device's peak) tried next.
    with pytest.raises(planner.NothingFits) as e:
        _auto(_fake(model), memory, host_memory=opt["host"] - 1)
    assert e.value.plan.request["offload_tried"] == ["optimizer", "optimizer+params"]
    reasons = {c.offload: c.reason for c in e.value.plan.dropped if c.strategy == "fsdp"
               and c.offload}
    assert reasons == {
        off: f"needs {fmt_bytes(need['host'])} of host memory per device for its offloaded "
             f"state, over the {fmt_bytes(opt['host'] - 1)} available"
        for off, need in (("optimizer", opt), ("optimizer+params", both))}
    # offload=[] never offloads.
    with pytest.raises(planner.NothingFits) as e:
        _auto(_fake(model), memory, offload=[])
    assert not any(c.offload for c in e.value.plan.dropped)
    assert e.value.plan.request["offload_tried"] == []


def test_host_memory_defaults_to_the_profile_and_is_checked():
    assert planner.hardware("h100-sxm").host_memory == 250 * 10**9
    assert planner.hardware("tpu-v5e").host_memory is None  # not known: not checked
    with pytest.raises(UsageError, match="host_memory .--host-memory. must be a whole number"):
        planner.Hardware("x", 1.0, 1.0, host_memory=-1)
    from nnx_shard.planner._problem import resolve

    p = resolve("tiny", planner.AutoOptions(devices=2, batch=8, seq=16, host_memory="1GB"))
    assert p.host_memory == 10**9 and p.offloads == ["optimizer", "optimizer+params"]
    assert resolve("tiny", planner.AutoOptions(devices=2, batch=8, seq=16)).host_memory == (
        250 * 10**9)
    with pytest.raises(UsageError, match="unknown offload 'params'"):
        resolve("tiny", planner.AutoOptions(devices=2, batch=8, seq=16, offload=["params"]))
