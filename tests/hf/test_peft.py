"""PEFT adapter folders: ns.load_lora against peft's own logits under dp, tp, fsdp and
fsdp_tp, merge_lora, save_lora's files (exact PEFT names and config; read back bitwise),
and adapter-only AdamW training against peft's own loss curve."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard import safetensors_io as st
from nnx_shard.hf import load_pretrained
from nnx_shard.low_rank import adapters
from nnx_shard.models import Llama, LlamaConfig, lm_loss
from tests.conftest import needs_devices

FIXTURES = Path(__file__).parent.parent / "fixtures"
PEFT = FIXTURES / "peft_llama"
HF_VENV = Path("/work/hf-venv/bin/python")


def _expected():
    return np.load(PEFT / "expected.npz")


def _base(strategy, mesh, scan=False):
    cfg = LlamaConfig.from_hf(FIXTURES / "hf_llama" / "config.json")
    if scan:
        import dataclasses
        cfg = dataclasses.replace(cfg, scan_layers=True)
    target = ns.abstract_init(lambda: Llama(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
    return ns.load_safetensors(FIXTURES / "hf_llama", target)


def _logits(model, strategy, mesh, tokens):
    reps = 8 // tokens.shape[0]  # a batch every data axis divides
    with ns.use(mesh, strategy.rules):
        out = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(np.tile(tokens, (reps, 1))))
    return np.asarray(out)[: tokens.shape[0]]


@pytest.mark.parametrize(("name", "devices"), [
    ("dp", 2), ("tp", 2),
    pytest.param("fsdp", 8, marks=needs_devices(8)),  # embed over data=8
    pytest.param("fsdp_tp", 8, marks=needs_devices(8)),  # data=4 x model=2
])
def test_load_lora_matches_peft_then_merge(name, devices):
    strategy = ns.strategies.get(name)
    mesh = strategy.make_mesh(devices)
    model = ns.load_lora(PEFT, _base(strategy, mesh))
    exp = _expected()
    assert sorted(adapters(model))[:4] == ["blocks/0/attn/o", "blocks/0/attn/q",
                                           "blocks/0/attn/v", "blocks/0/mlp/down"]
    tol = 2e-4 * np.abs(exp["logits"]).max()
    got = _logits(model, strategy, mesh, exp["tokens"])
    assert np.abs(got - exp["logits"]).max() <= tol
    ns.merge_lora(model)
    assert not adapters(model)
    merged = _logits(model, strategy, mesh, exp["tokens"])
    assert np.abs(merged - exp["merged_logits"]).max() <= tol


@pytest.mark.slow  # a load and a ten-step compilation
@needs_devices(8)
def test_adapter_only_adamw_follows_peft_loss_curve():
    """Ten steps of AdamW on the adapters alone, through Trainer.fit under fsdp, give
    peft's losses (torch.optim.AdamW, the same batches and hyper-parameters) and leave
    every base weight bitwise as loaded."""
    exp = _expected()
    lr, b1, b2, eps, wd = (float(x) for x in exp["train_hparams"])
    tokens = exp["train_tokens"]
    strategy = ns.strategies.get("fsdp")
    mesh = strategy.make_mesh(8)
    model = ns.load_lora(PEFT, load_pretrained(FIXTURES / "hf_llama", mesh=mesh,
                                               rules=strategy.rules))
    # torch's AdamW: eps outside the square root, decoupled decay on every trained tensor.
    tx = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    opt = ns.sharded_optimizer(model, tx, mesh, strategy, wrt=nnx.LoRAParam)
    base0 = jax.device_get(nnx.state(model, nnx.Not(nnx.LoRAParam)))
    lora0 = jax.device_get(nnx.state(model, nnx.LoRAParam))
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=strategy.rules,
                         steps_per_call=len(tokens), batch_names=("batch", "length"))
    batches = ({"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens)
    history = trainer.fit(batches, num_steps=len(tokens), progress=False)
    got, want = np.asarray(history["loss"]), exp["train_losses"]
    assert got.shape == want.shape == (10,)
    gap = np.abs(got - want) / np.abs(want)
    assert gap.max() <= 2e-3, (got, want, gap)
    assert want[-1] < want[0]  # the curve moves: a frozen adapter would not match it
    base1 = jax.device_get(nnx.state(model, nnx.Not(nnx.LoRAParam)))
    leaves0, leaves1 = jax.tree.leaves(base0), jax.tree.leaves(base1)
    assert len(leaves0) == len(leaves1) > 0
    for a, b in zip(leaves0, leaves1, strict=True):
        np.testing.assert_array_equal(a, b)
    moved = jax.tree.leaves(jax.device_get(nnx.state(model, nnx.LoRAParam)))
    assert all(not np.array_equal(a, b)
               for a, b in zip(jax.tree.leaves(lora0), moved, strict=True))


def test_save_lora_writes_peft_names_and_reads_back_bitwise(tmp_path):
    strategy = ns.strategies.dp()
    mesh = strategy.make_mesh(2)
    model = ns.load_lora(PEFT, _base(strategy, mesh))
    ns.save_lora(tmp_path / "out", model, base_model_name_or_path="hf_llama")
    cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (
        "LORA", 4, 8, "hf_llama")
    assert cfg["target_modules"] == ["down_proj", "o_proj", "q_proj", "v_proj"]
    ours = st.read_header(str(tmp_path / "out" / "adapter_model.safetensors"))
    theirs = st.read_header(str(PEFT / "adapter_model.safetensors"))
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    for name, info in theirs.tensors.items():
        index = [slice(None)] * len(info.shape)
        np.testing.assert_array_equal(st.read_slice(ours, name, index),
                                      st.read_slice(theirs, name, index))
    # onto a model with stacked blocks: the same adapters, layer by layer
    stacked = ns.load_lora(tmp_path / "out", _base(strategy, mesh, scan=True))
    q = stacked.blocks.attn.q
    np.testing.assert_array_equal(np.asarray(q.lora_a[...][1]),
                                  np.asarray(model.blocks[1].attn.q.lora_a[...]))


@pytest.mark.slow
@pytest.mark.skipif(not HF_VENV.exists(), reason="no torch/peft virtual environment")
def test_peft_reads_what_save_lora_writes(tmp_path):
    strategy = ns.strategies.dp()
    mesh = strategy.make_mesh(2)
    model = ns.lora(_base(strategy, mesh), 2, 6.0, targets=r"attn/k$|mlp/(gate|up)$", rngs=3)
    for node in adapters(model).values():
        node.lora_b.set_value(0.3 * jax.random.normal(jax.random.key(1), node.lora_b.shape))
    out = tmp_path / "adapter"
    ns.save_lora(out, model)
    np.save(out / "expected_logits.npy", _logits(model, strategy, mesh, _expected()["tokens"]))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(HF_VENV), str(FIXTURES / "make_peft.py"), "--check", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["ok"] is True


def _copy(tmp_path, **config):
    out = tmp_path / "bad"
    out.mkdir()
    cfg = json.loads((PEFT / "adapter_config.json").read_text()) | config
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    (out / "adapter_model.safetensors").write_bytes(
        (PEFT / "adapter_model.safetensors").read_bytes())
    return out


@pytest.mark.parametrize(("config", "words"), [
    ({"r": 0}, "r is 0, not a positive int"),
    ({"lora_alpha": "x"}, "lora_alpha is 'x'"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"peft_type": "IA3"}, "not 'LORA'"),
    ({"r": 8}, "lora_A (4, 32)"),
])
def test_load_lora_errors(tmp_path, config, words):
    strategy = ns.strategies.dp()
    mesh = strategy.make_mesh(2)
    with pytest.raises(ns.NnxShardError, match="Fix:") as info:
        ns.load_lora(_copy(tmp_path, **config), _base(strategy, mesh))
    assert words in str(info.value)


def test_load_lora_missing_folder(tmp_path):
    with pytest.raises(ns.NnxShardError, match="is not a directory"):
        ns.load_lora(tmp_path / "nope", nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
