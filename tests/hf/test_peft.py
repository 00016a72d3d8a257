"""PEFT adapter folders: ns.hf.load_lora against peft's own logits under dp, tp, fsdp and
fsdp_tp, merge_lora, save_lora's files (exact PEFT names and config; read back bitwise),
and adapter-only AdamW training against peft's own loss curve."""

import functools
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import nnx_shard as ns
from nnx_shard import _safetensors_io as st
from nnx_shard._low_rank import adapters
from nnx_shard.hf import load_pretrained
from nnx_shard.models import Decoder, DecoderConfig, lm_loss
from tests._shared import adapter_copy
from tests.conftest import needs_devices

FIXTURES = Path(__file__).parent.parent / "fixtures"
PEFT = FIXTURES / "peft_llama"
HF_VENV = Path("/work/hf-venv/bin/python")


def _expected():
    return np.load(PEFT / "expected.npz")


def _base(strategy, mesh, scan=False):
    cfg = DecoderConfig.from_hf(FIXTURES / "hf_llama" / "config.json")
    if scan:
        import dataclasses
        cfg = dataclasses.replace(cfg, scan_layers=True)
    target = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
    return ns.hf.load_safetensors(FIXTURES / "hf_llama", target)


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
    model = ns.hf.load_lora(PEFT, _base(strategy, mesh))
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
    model = ns.hf.load_lora(PEFT, load_pretrained(FIXTURES / "hf_llama", mesh=mesh,
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
    strategy = ns.strategies.get("dp")
    mesh = strategy.make_mesh(2)
    model = ns.hf.load_lora(PEFT, _base(strategy, mesh))
    ns.hf.save_lora(tmp_path / "out", model, base_model_name_or_path="hf_llama")
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
    stacked = ns.hf.load_lora(tmp_path / "out", _base(strategy, mesh, scan=True))
    q = stacked.blocks.attn.lora_q
    np.testing.assert_array_equal(np.asarray(q.lora_a[...][1]),
                                  np.asarray(model.blocks[1].attn.lora_q.lora_a[...]))


@pytest.mark.slow
@pytest.mark.skipif(not HF_VENV.exists(), reason="no torch/peft virtual environment")
def test_peft_reads_what_save_lora_writes(tmp_path):
    strategy = ns.strategies.get("dp")
    mesh = strategy.make_mesh(2)
    model = ns.lora(_base(strategy, mesh), 2, 6.0, targets=r"attn/k$|mlp/(gate|up)$", rngs=3)
    for node in adapters(model).values():
        node.lora_b.set_value(0.3 * jax.random.normal(jax.random.key(1), node.lora_b.shape))
    out = tmp_path / "adapter"
    ns.hf.save_lora(out, model)
    np.save(out / "expected_logits.npy", _logits(model, strategy, mesh, _expected()["tokens"]))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(HF_VENV), str(FIXTURES / "make_peft.py"), "--check", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["ok"] is True


def _copy(tmp_path, **config):
    return adapter_copy(PEFT, tmp_path / "bad", **config)


@pytest.mark.parametrize(("config", "words"), [
    ({"r": 0}, "r is 0, not a positive int"),
    ({"lora_alpha": "x"}, "lora_alpha is 'x'"),
    ({"use_dora": True}, "use_dora=True"),
    ({"peft_type": "IA3"}, "not 'LORA'"),
    ({"r": 8}, "lora_A (4, 32)"),
])
def test_load_lora_errors(tmp_path, config, words):
    strategy = ns.strategies.get("dp")
    mesh = strategy.make_mesh(2)
    with pytest.raises(ns.NnxShardError, match="Fix:") as info:
        ns.hf.load_lora(_copy(tmp_path, **config), _base(strategy, mesh))
    assert words in str(info.value)


def test_load_lora_missing_folder(tmp_path):
    with pytest.raises(ns.NnxShardError, match="is not a directory"):
        ns.hf.load_lora(tmp_path / "nope", nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


# --- factors under the adapter name "default" -----------------------------------------------------
def _named(key, name="default"):
    """``key`` with the adapter ``name`` PEFT's model gives its parameters put in."""
    for factor in ("lora_A", "lora_B"):
        key = key.replace(f".{factor}.weight", f".{factor}.{name}.weight")
    for factor in ("lora_embedding_A", "lora_embedding_B"):
        key = key.replace(f".{factor}", f".{factor}.{name}") if key.endswith(factor) else key
    return key


def _rekeyed(tmp_path, source, change):
    out = tmp_path / "rekeyed"
    shutil.copytree(source, out)
    file = out / "adapter_model.safetensors"
    save_file(change(load_file(file)), file)
    return out


def _factors(folder):
    strategy = ns.strategies.get("dp")
    model = ns.hf.load_lora(folder, _base(strategy, strategy.make_mesh(2)))
    return {k: (np.asarray(n.lora_a[...]), np.asarray(n.lora_b[...]), n.scale)
            for k, n in adapters(model).items()}


@functools.cache
def _plain(folder):
    return _factors(folder)


@pytest.mark.parametrize(("source", "which"), [
    (PEFT, "every"), (PEFT, "attention"), (PEFT, "beside equal"),
    (FIXTURES / "peft_kinds" / "embedding", "every"),
])
def test_load_lora_reads_the_default_adapter_s_factors(tmp_path, source, which):
    """PEFT 0.21's from_pretrained loads ...lora_A.default.weight (lora_embedding_A.default)
    into the adapter it names "default", as the plain keys: in place of them, beside them
    for other modules, or beside equal copies of them. The factors are the plain file's."""
    def change(tensors):
        if which == "every":
            return {_named(k): v for k, v in tensors.items()}
        if which == "attention":
            return {_named(k) if "self_attn" in k else k: v for k, v in tensors.items()}
        return tensors | {_named(k): v.copy() for k, v in tensors.items() if "lora_" in k}

    folder = _rekeyed(tmp_path, source, change)
    names = load_file(folder / "adapter_model.safetensors")
    assert any(".default" in k for k in names) and (which == "every") != any(
        ".lora_A.weight" in k for k in names)
    got, want = _factors(folder), _plain(source)
    assert sorted(got) == sorted(want) and len(got) >= 4
    for k, (a, b, scale) in got.items():
        assert np.array_equal(a, want[k][0]) and np.array_equal(b, want[k][1])
        assert scale == want[k][2]


def test_load_lora_refuses_a_factor_twice_with_different_values(tmp_path):
    """Two different tensors for one parameter: PEFT keeps whichever it reads last, which
    depends on how the file was written; refused, naming both keys."""
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    folder = _rekeyed(tmp_path, PEFT, lambda t: t | {_named(key): t[key] + 1.0})
    strategy = ns.strategies.get("dp")
    with pytest.raises(ns.UsageError, match="Fix:") as info:
        ns.hf.load_lora(folder, _base(strategy, strategy.make_mesh(2)))
    text = str(info.value)
    assert key in text and _named(key) in text and "different values" in text
    assert "keep one" in text


def test_load_lora_still_refuses_other_adapter_names(tmp_path):
    folder = _rekeyed(tmp_path, PEFT, lambda t: {_named(k, "other"): v for k, v in t.items()})
    strategy = ns.strategies.get("dp")
    with pytest.raises(ns.UsageError, match="named adapter") as info:
        ns.hf.load_lora(folder, _base(strategy, strategy.make_mesh(2)))
    assert ".lora_A.other.weight" in str(info.value) or ".lora_B.other.weight" in str(info.value)


# --- load_lora reads what PEFT's config selects, as PEFT does ------------------------------------
CASES = FIXTURES / "peft_cases"
ALL = {"attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down"}


@pytest.mark.parametrize(("case", "loaded"), [
    ("full", {f"blocks/{i}/{p}" for i in (0, 1) for p in ALL}),
    ("all_linear", {f"blocks/{i}/{p}" for i in (0, 1) for p in ALL}),
    ("narrow_targets", {f"blocks/{i}/{p}" for i in (0, 1) for p in ("attn/q", "mlp/down")}),
    ("regex_targets", {"blocks/1/attn/q", "blocks/1/attn/k"}),
    ("layers_to_transform", {"blocks/1/attn/q", "blocks/1/attn/v", "blocks/1/mlp/up"}),
    ("layers_pattern", {"blocks/0/attn/o", "blocks/0/mlp/gate"}),
    ("exclude_list", {f"blocks/{i}/{p}" for i in (0, 1) for p in ALL - {"mlp/down"}}
     - {"blocks/0/attn/q"}),
    ("exclude_regex", {f"blocks/{i}/attn/{p}" for i in (0, 1) for p in "qkvo"}),
    ("no_alpha", {f"blocks/{i}/{p}" for i in (0, 1) for p in ("attn/k", "mlp/up")}),
])
def test_load_lora_selects_modules_as_peft_does(case, loaded):
    """Every file holds factors of all 14 projections; PEFT loads only those its config
    selects (and lora_alpha defaults to 8): our logits are PEFT's on each folder."""
    exp = np.load(CASES / "expected.npz")
    strategy = ns.strategies.get("dp")
    mesh = strategy.make_mesh(2)
    model = ns.hf.load_lora(CASES / case, _base(strategy, mesh))
    assert set(adapters(model)) == loaded
    want = exp[f"logits_{case}"]
    tol = 2e-4 * np.abs(want).max()
    got = _logits(model, strategy, mesh, exp["tokens"])
    assert np.abs(got - want).max() <= tol
    assert np.abs(exp["logits_base"] - want).max() > 100 * tol  # the adapter moves the logits
    if case == "no_alpha":
        assert {n.scale for n in adapters(model).values()} == {8 / 2}


def test_load_lora_layers_to_transform_onto_stacked_blocks():
    exp = np.load(CASES / "expected.npz")
    strategy = ns.strategies.get("dp")
    mesh = strategy.make_mesh(2)
    model = ns.hf.load_lora(CASES / "layers_to_transform", _base(strategy, mesh, scan=True))
    assert set(adapters(model)) == {"blocks/attn/q", "blocks/attn/v", "blocks/mlp/up"}
    q = model.blocks.attn.lora_q
    assert not np.asarray(q.lora_b[...][0]).any() and np.asarray(q.lora_b[...][1]).any()
    want = exp["logits_layers_to_transform"]
    got = _logits(model, strategy, mesh, exp["tokens"])
    assert np.abs(got - want).max() <= 2e-4 * np.abs(want).max()


# --- save_lora replaces the folder whole, never through a link -----------------------------------
def _tiny(rank=2, alpha=4.0, targets=r"attn/q$", seed=0):
    from nnx_shard.models import get_config

    model = ns.lora(Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0)), rank, alpha,
                    targets=targets, rngs=seed)
    for i, node in enumerate(adapters(model).values()):
        node.lora_b.set_value(jax.random.normal(jax.random.key(seed * 100 + i), node.lora_b.shape))
    return model


def _files(folder):
    """The adapter in ``folder``: its config and every tensor, as read from disk."""
    cfg = json.loads((folder / "adapter_config.json").read_text())
    header = st.read_header(str(folder / "adapter_model.safetensors"))
    return cfg, {n: st.read_slice(header, n, [slice(None)] * len(i.shape))
                 for n, i in header.tensors.items()}


def _same(a, b):
    return a[0] == b[0] and sorted(a[1]) == sorted(b[1]) and all(
        np.array_equal(a[1][k], b[1][k]) for k in a[1])


def _saved(model, tmp_path, name):
    ns.hf.save_lora(tmp_path / name, model)
    return _files(tmp_path / name)


def test_save_lora_some_layers_reads_back_through_its_regex(tmp_path):
    model = _tiny(targets=r"blocks/1/attn/q$|blocks/0/mlp/up$")
    ns.hf.save_lora(tmp_path / "a", model)
    assert isinstance(json.loads((tmp_path / "a" / "adapter_config.json").read_text())[
        "target_modules"], str)
    back = ns.hf.load_lora(tmp_path / "a", Decoder(model.cfg, rngs=nnx.Rngs(0)))
    assert sorted(adapters(back)) == ["blocks/0/mlp/up", "blocks/1/attn/q"]
    np.testing.assert_array_equal(np.asarray(back.blocks[1].attn.lora_q.lora_b[...]),
                                  np.asarray(model.blocks[1].attn.lora_q.lora_b[...]))


def test_save_lora_never_writes_through_links(tmp_path):
    out = tmp_path / "adapter"
    out.mkdir()
    outside = {n: tmp_path / n for n in ("config.txt", "weights.bin", "partial.bin")}
    for p in outside.values():
        p.write_bytes(b"precious")
    (out / "adapter_config.json").symlink_to(outside["config.txt"])
    (out / "adapter_model.safetensors").symlink_to(outside["weights.bin"])
    (out / "adapter_model.safetensors.partial").symlink_to(outside["partial.bin"])
    model = _tiny()
    ns.hf.save_lora(out, model)
    assert all(p.read_bytes() == b"precious" for p in outside.values())
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not any((out / n).is_symlink() for n in os.listdir(out))
    assert _same(_files(out), _saved(model, tmp_path, "fresh"))


def test_save_lora_keeps_the_folder_mode_and_other_files(tmp_path):
    out = tmp_path / "adapter"
    ns.hf.save_lora(out, _tiny(rank=4, alpha=16.0, targets=r"attn/(q|v)$"))
    (out / "README.md").write_text("mine")
    (out / "runs").mkdir()
    (out / "runs" / "log.txt").write_text("log")
    (out / "link").symlink_to(tmp_path / "elsewhere")
    out.chmod(0o750)
    model = _tiny()
    ns.hf.save_lora(out, model)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert (out / "README.md").read_text() == "mine"
    assert (out / "runs" / "log.txt").read_text() == "log"
    assert os.readlink(out / "link") == str(tmp_path / "elsewhere")
    cfg, tensors = _files(out)
    assert (cfg["r"], cfg["lora_alpha"]) == (2, 4)  # the new adapter only: no old v_proj
    assert not any("v_proj" in k for k in tensors)
    assert sorted(os.listdir(tmp_path)) == ["adapter"]  # no staging folder left
    out.chmod(0o555)  # read-only: the mode is set after the files are written
    ns.hf.save_lora(out, _tiny(rank=4, alpha=16.0))
    assert stat.S_IMODE(out.stat().st_mode) == 0o555
    assert _files(out)[0]["r"] == 4 and (out / "README.md").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["adapter"]


def test_save_lora_new_folder_takes_the_umask_and_link_is_followed(tmp_path):
    old = os.umask(0o027)
    try:
        ns.hf.save_lora(tmp_path / "a" / "b", _tiny())
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o750
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")
    ns.hf.save_lora(tmp_path / "via", _tiny())
    assert (tmp_path / "via").is_symlink()
    assert sorted(os.listdir(tmp_path / "real")) == ["adapter_config.json",
                                                     "adapter_model.safetensors"]


@pytest.mark.parametrize("where", ["weights", "config", "swap"])
def test_save_lora_failing_midway_keeps_the_previous_adapter_whole(tmp_path, monkeypatch, where):
    from nnx_shard.hf import _lora_folder as peft_io

    out = tmp_path / "adapter"
    ns.hf.save_lora(out, _tiny(rank=4, alpha=16.0, targets=r"attn/(q|v)$"))
    before = _files(out)

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    target = {"weights": (peft_io.st, "write_slice"), "config": (peft_io.st, "write_file"),
              "swap": (peft_io.export_dir, "_exchange")}[where]
    monkeypatch.setattr(*target, boom)
    with pytest.raises(ns.NnxShardError, match="No space left") as info:
        ns.hf.save_lora(out, _tiny())
    assert str(out) in str(info.value) and "Fix:" in str(info.value)
    assert _same(_files(out), before)
    assert sorted(os.listdir(tmp_path)) == ["adapter"]
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]


_KILLED = r"""
import os, signal, sys
from pathlib import Path
import nnx_shard as ns
from nnx_shard.hf import _lora_folder as peft_io
from tests.hf.test_peft import _tiny

real = peft_io.st.write_file
def write_file(path, data):  # the weights are on disk: die before the config is
    os.kill(os.getpid(), signal.SIGKILL)
peft_io.st.write_file = write_file
ns.hf.save_lora(Path(sys.argv[1]), _tiny())
"""


@pytest.mark.slow  # a fresh process importing JAX
def test_save_lora_killed_midway_leaves_the_previous_adapter(tmp_path):
    out = tmp_path / "adapter"
    old = _tiny(rank=4, alpha=16.0, targets=r"attn/(q|v)$")
    ns.hf.save_lora(out, old)
    before = _files(out)
    done = subprocess.run([sys.executable, "-c", _KILLED, str(out)], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == -9, done.stderr
    assert _same(_files(out), before)
    back = ns.hf.load_lora(out, Decoder(old.cfg, rngs=nnx.Rngs(0)))
    assert {n.scale for n in adapters(back).values()} == {4.0}
    left, = [p for p in os.listdir(tmp_path) if p != "adapter"]  # the killed save's folder
    assert left.startswith(".adapter.save_lora-")
    ns.hf.save_lora(out, old)  # the next save tidies it
    assert os.listdir(tmp_path) == ["adapter"]


def test_save_lora_tidies_only_folders_of_dead_saves(tmp_path):
    from nnx_shard.hf import _lora_folder as peft_io

    out = tmp_path / "adapter"
    ns.hf.save_lora(out, _tiny())
    (out / "README.md").write_text("mine")
    host, _, pid = peft_io.owner().partition("-")
    token = "0" * 32
    dead = tmp_path / f".adapter.save_lora-{host}-{2**30}-{token}"  # no such process
    mine = tmp_path / f".adapter.save_lora-{host}-{pid}-{token}"  # a save in flight
    other = tmp_path / f".adapter.save_lora-ffffffff-{2**30}-{token}"  # another host's
    for d in (dead, mine, other):
        d.mkdir()
        (d / "adapter_config.json").write_text("{}")
    (dead / "notes.txt").write_text("moved back")  # a user's file of a swapped-out folder
    os.link(out / "README.md", dead / "README.md")
    ns.hf.save_lora(out, _tiny())
    assert sorted(os.listdir(tmp_path)) == sorted(["adapter", mine.name, other.name])
    assert (out / "notes.txt").read_text() == "moved back"
    assert (out / "README.md").read_text() == "mine"


def test_concurrent_save_lora_leaves_one_whole_adapter(tmp_path):
    """Two threads save different adapters into one folder at once, ten times over:
    the folder holds exactly one of the two, whole, and nothing is left beside it."""
    import threading

    models = [_tiny(), _tiny(rank=4, alpha=16.0, targets=r"attn/(q|v)$|mlp/up$", seed=1)]
    want = [_saved(m, tmp_path, f"want{i}") for i, m in enumerate(models)]
    out = tmp_path / "shared" / "adapter"
    seen = set()
    for trial in range(10):
        gate = threading.Barrier(2)
        errors = []

        def save(model, gate=gate, errors=errors):
            try:
                gate.wait()
                ns.hf.save_lora(out, model)
            except BaseException as e:  # reported below, not lost in the thread
                errors.append(e)

        threads = [threading.Thread(target=save, args=(m,)) for m in models[::(-1) ** trial]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        got = _files(out)
        match = [i for i, w in enumerate(want) if _same(got, w)]
        assert len(match) == 1, (trial, got[0])
        seen.add(match[0])
        assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
        assert os.listdir(out.parent) == ["adapter"]
    assert seen  # at least one whole adapter each time (which one is up to the scheduler)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
