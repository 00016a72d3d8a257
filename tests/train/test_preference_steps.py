"""DPO's reference inside the training step (nnx_shard.preference): a LoRA policy's with
its adapters off, a full policy's frozen copy (preference.WithReference), against TRL 1.16.

Ground truth: tests/fixtures/preference/ (tests/fixtures/make_preference.py, torch, trl and
peft; never imported here). expected.json: TRL's one-batch loss and metrics (the policy
``hf_llama``, the reference ``hf_llama_tied``); trajectories.json: ten AdamW steps of
DPOTrainer on the text set's four pairs for the full policy (reference ``hf_llama_tied``)
with ``sigmoid`` and ``ipo``, and for ``hf_llama`` with the LoRA adapter ``peft_llama``
(reference: its adapters disabled), whose trained adapter peft read back to score each
row.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard import preference
from nnx_shard._errors import UsageError
from nnx_shard._low_rank import adapters

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DATA = FIXTURES / "preference"
RTOL = 1e-5  # one batch, as TRL computes it
TRAJECTORY_RTOL = 1e-4  # ten AdamW steps


@functools.cache
def _json(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


def _text_batch() -> dict[str, np.ndarray]:
    """DPOTrainer's batch of the text set (its four kept pairs) as this library's."""
    a = np.load(DATA / "batches.npz")
    ids, answer = a["text_input_ids"], a["text_completion_mask"]
    targets = np.full_like(ids, -100)
    targets[:, :-1] = np.where(answer[:, 1:] == 1, ids[:, 1:], -100)
    return {"inputs": ids, "targets": targets, "attention_mask": a["text_attention_mask"]}


def _mesh(layout: str) -> tuple[Any, Any]:
    if layout == "one":
        return ns.make_mesh("data=1", devices=jax.devices()[:1]), ns.strategies.get("dp")
    strategy = ns.strategies.get(layout)
    return strategy.make_mesh(), strategy


def _policy(kind: str, mesh: Any, rules: Any) -> tuple[Any, Any, str]:
    """(the model the Trainer trains, the optimizer's wrt, the loss's reference)."""
    policy = ns.hf.load_pretrained(FIXTURES / "hf_llama", mesh=mesh, rules=rules)
    if kind == "lora":
        return ns.hf.load_lora(FIXTURES / "peft_llama", policy), nnx.LoRAParam, "adapters"
    frozen = ns.hf.load_pretrained(FIXTURES / "hf_llama_tied", mesh=mesh, rules=rules)
    return preference.WithReference(policy, frozen), nnx.Param, "frozen"


def _close(ours: Any, theirs: Any, rtol: float, what: str) -> None:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    dev = np.max(np.abs(ours - theirs) / np.abs(theirs))
    assert dev <= rtol, (what, dev, ours, theirs)


def test_in_step_references_equal_trls():
    """One compiled call: the frozen copy's loss and metrics are TRL's with
    ``ref_model=hf_llama_tied``; the LoRA policy's with its adapters off as the reference
    are TRL's first step with a ``peft_config`` (no ref_model); its adapters-off forward
    is the base model's, bit for bit."""
    mesh, dp = _mesh("one")
    pair, _, _ = _policy("full", mesh, dp)
    lora, _, _ = _policy("lora", mesh, dp)
    base = ns.hf.load_pretrained(FIXTURES / "hf_llama", mesh=mesh, rules=dp)
    batch = _text_batch()

    @nnx.jit
    def run(pair, lora, base, batch):
        return (preference.loss("sigmoid", reference="frozen")(pair, batch),
                preference.loss("sigmoid", reference="adapters")(lora, batch),
                preference.reference_logps(base, batch))

    (frozen_loss, frozen_metrics), (lora_loss, lora_metrics), base_logps = run(
        pair, lora, base, batch)
    want = _json("expected.json")["expected"]["sigmoid"]
    _close(frozen_loss, want["loss"], RTOL, "loss")
    assert set(frozen_metrics) == set(want) - {"loss"}
    for name, value in frozen_metrics.items():
        _close(value, want[name], RTOL, name)
    _close(lora_loss, _json("trajectories.json")["trajectories"]["lora_sigmoid"]["losses"][0],
           RTOL, "lora loss")
    # rewards/* are beta times the policy's log-ratio to the reference: the reference's
    # log-probabilities are the base model's.
    pairs = len(base_logps) // 2
    ref_chosen = lora_metrics["logps/chosen"] - lora_metrics["rewards/chosen"] / 0.1
    _close(ref_chosen, np.mean(np.asarray(base_logps)[:pairs]), RTOL, "reference logps")


def test_reference_misuse_is_refused():
    batch = _text_batch()
    with pytest.raises(UsageError, match=r"reference must be one of \('batch', 'adapters'"):
        preference.loss("sigmoid", reference="copy")
    with pytest.raises(UsageError, match="'simpo' is reference-free.*Fix: drop reference="):
        preference.loss("simpo", reference="adapters")
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(UsageError, match="reference='frozen' trains a preference.WithReference"):
        preference.loss("sigmoid", reference="frozen")(model, batch)
    with pytest.raises(UsageError, match="has no adapters. Fix: ns.lora"):
        preference.loss("ipo", reference="adapters")(model, batch)
    pair = preference.WithReference(model, nnx.Linear(2, 2, rngs=nnx.Rngs(1)))
    with pytest.raises(UsageError, match=r"Fix: preference.loss\(kind, reference='frozen'\)"):
        preference.loss("sigmoid")(pair, dict(batch, ref_logps=np.zeros(8, np.float32)))
    with pytest.raises(KeyError, match="or the reference computed in the step"):
        preference.loss("sigmoid")(model, batch)
    with pytest.raises(UsageError, match="the reference is the policy itself"):
        preference.WithReference(model, model)
    with pytest.raises(UsageError, match="must be NNX models"):
        preference.WithReference(model, "hf_llama_tied")


def _fit(kind: str, loss_type: str, layout: str, lr: float, steps_per_call: int = 5,
         microbatches: int = 1) -> tuple[Any, Any, np.ndarray]:
    mesh, rules = _mesh(layout)
    model, wrt, reference = _policy(kind, mesh, rules)
    adamw = _json("trajectories.json")["meta"]["adamw"]
    tx = optax.adamw(lr, b1=adamw["adam_beta1"], b2=adamw["adam_beta2"],
                     eps=adamw["adam_epsilon"], weight_decay=adamw["weight_decay"])
    opt = ns.sharded_optimizer(model, tx, mesh, rules, wrt=wrt)
    trainer = ns.Trainer(model, opt, preference.loss(loss_type, reference=reference),
                         mesh=mesh, rules=rules, has_aux=True, steps_per_call=steps_per_call,
                         microbatches=microbatches)
    history = trainer.fit([_text_batch()] * 10, 10, progress=False)
    return model, opt, np.asarray(history["loss"])


#: (layout, case of trajectories.json): sigmoid under every layout, full and LoRA; dp
#: (the replicated layout on every device) once; IPO (another kind through the same step)
#: on one device.
TRAJECTORIES = [*((layout, case) for layout in ("one", "fsdp", "fsdp_tp")
                  for case in ("full_sigmoid", "lora_sigmoid")), ("dp", "full_sigmoid"),
                ("one", "full_ipo")]


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "case"), TRAJECTORIES)
def test_ten_adamw_steps_follow_trls(layout, case, tmp_path):
    """Ten fused AdamW steps (two calls of five) from TRL's start: every step's loss is
    TRL's within 1e-4 relative. The frozen reference is carried through unchanged with no
    optimizer state; the trained adapters, saved as a PEFT folder and read back, score each
    row as TRL's trained adapter does (read back by peft)."""
    meta = _json("trajectories.json")["meta"]["cases"][case]
    want = _json("trajectories.json")["trajectories"][case]
    kind = "lora" if meta["lora"] else "full"
    model, opt, losses = _fit(kind, meta["loss_type"], layout, meta["learning_rate"])
    _close(losses, want["losses"], TRAJECTORY_RTOL, f"{layout} {case}")
    mesh, dp = _mesh("one")
    if kind == "full":
        reference = nnx.state(model.reference)
        assert not nnx.state(model.reference, nnx.Param)
        tracked = [p for p, _ in nnx.to_flat_state(nnx.state(opt))]
        assert any("policy" in p for p in tracked)
        assert not any("reference" in p for p in tracked)
        again = nnx.state(ns.hf.load_pretrained(FIXTURES / "hf_llama_tied", mesh=mesh, rules=dp))
        for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(again), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    elif layout == "fsdp_tp":  # the save and read back of a sharded model, once
        ns.hf.save_lora(tmp_path / "trained", model)
        back = ns.hf.load_lora(tmp_path / "trained", ns.hf.load_pretrained(
            FIXTURES / "hf_llama", mesh=mesh, rules=dp))
        batch = _text_batch()
        np.testing.assert_array_equal(batch["inputs"], want["input_ids"])
        logps = nnx.jit(preference.reference_logps)(back, batch)
        _close(logps, want["trained_logps"], TRAJECTORY_RTOL, "trained adapter's logps")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_the_in_step_reference_runs_under_a_pipeline(kind):
    """Under ``pp`` (GPipe, 4 stages x data 2, 4 microbatches through the stages) the
    reference's forward runs in the same pipelined step: three fused steps' losses equal
    one device's (stacked blocks; random tiny Decoders, a LoRA with non-zero B)."""
    import dataclasses

    import jax.numpy as jnp

    from nnx_shard.models import Decoder, get_config

    cfg = dataclasses.replace(get_config("llama-tiny"), layers=4, scan_layers=True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, cfg.vocab, (16, 16)).astype(np.int32)
    targets = np.full_like(tokens, -100)
    targets[:, 5:15] = tokens[:, 6:]
    targets[8:, 12:] = -100  # rejected answers shorter
    batch = {"inputs": tokens, "targets": targets}

    def run(layout: str, microbatches: int) -> np.ndarray:
        mesh, rules = _mesh(layout)

        def make(seed: int) -> Any:
            return ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(seed)), mesh, rules)

        if kind == "lora":
            model, wrt, reference = ns.lora(make(0), 4, 8.0, rngs=1), nnx.LoRAParam, "adapters"
            for node in adapters(model).values():  # B not zero: policy != reference
                b = node.lora_b.get_value()
                node.lora_b.set_value(jax.device_put(jnp.full(b.shape, 0.1, b.dtype),
                                                     b.sharding))
        else:
            model, wrt, reference = (preference.WithReference(make(0), make(1)), nnx.Param,
                                     "frozen")
        opt = ns.sharded_optimizer(model, optax.adamw(1e-3, weight_decay=0.0), mesh, rules,
                                   wrt=wrt)
        trainer = ns.Trainer(model, opt, preference.loss("sigmoid", reference=reference),
                             mesh=mesh, rules=rules, has_aux=True, steps_per_call=3,
                             microbatches=microbatches)
        return np.asarray(trainer.fit([batch] * 3, 3, progress=False)["loss"])

    one = run("one", 1)
    _close(run("pp", 4), one, 1e-5, "pp")
    assert one[-1] < one[0]


@pytest.mark.slow
def test_in_step_references_add_no_copy_of_the_weights():
    """XLA's bytes of the Trainer's compiled step (one device): the LoRA policy's
    adapters-off reference adds no argument byte over the same step reading precomputed
    ``ref_logps`` (no copy of the weights; its activations, under stop_gradient, add no
    temporary byte here either), and the frozen copy adds exactly its own parameters."""
    mesh, dp = _mesh("one")
    rows, length = _text_batch()["inputs"].shape
    tokens = jax.ShapeDtypeStruct((1, rows, length), np.int32)
    data = {"inputs": tokens, "targets": tokens}
    with_ref = dict(data, ref_logps=jax.ShapeDtypeStruct((1, rows), np.float32))
    tx = optax.adamw(1e-4, weight_decay=0.0)

    def memory(model: Any, wrt: Any, reference: str, batch: Any) -> Any:
        opt = ns.sharded_optimizer(model, tx, mesh, dp, wrt=wrt)
        trainer = ns.Trainer(model, opt, preference.loss("sigmoid", reference=reference),
                             mesh=mesh, rules=dp, has_aux=True, steps_per_call=1)
        return trainer.lower(batch).compile().memory_analysis()

    lora, _, _ = _policy("lora", mesh, dp)
    precomputed, off = (memory(lora, nnx.LoRAParam, ref, batch)
                        for ref, batch in (("batch", with_ref), ("adapters", data)))
    assert off.argument_size_in_bytes == precomputed.argument_size_in_bytes - rows * 4
    assert off.temp_size_in_bytes <= precomputed.temp_size_in_bytes
    pair, _, _ = _policy("full", mesh, dp)
    params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(pair.reference)))
    frozen = memory(pair, nnx.Param, "frozen", data)
    alone = memory(pair.policy, nnx.Param, "batch", with_ref)
    assert frozen.argument_size_in_bytes == alone.argument_size_in_bytes - rows * 4 + params
