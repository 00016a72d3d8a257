"""nnx_shard.hf: Hugging Face checkpoints loaded sharded and saved back.

Ground truth from outside: tests/fixtures/<name>/ hold tiny LlamaForCausalLM
(untied with llama3 rope scaling; tied with biases) and Qwen3ForCausalLM
(sharded files with an index) checkpoints written by transformers'
``save_pretrained``, with transformers' float32 logits and greedy continuations
(tests/fixtures/make_hf.py, run by hand; versions in versions.json). Loaded
under dp, fsdp, tp and fsdp_tp on 8 simulated devices, the model must give
those logits, hold every array in the strategy's layout, read each byte of the
checkpoint once, and save back bitwise.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import nnx_shard as ns
from nnx_shard import _safetensors_io as safetensors_io
from nnx_shard import hf
from nnx_shard.hf import _files as files
from nnx_shard.hf import _mapping as mapping
from nnx_shard.models import Decoder, DecoderConfig
from nnx_shard.planner import compiled_collectives
from tests._close import assert_close
from tests.conftest import needs_devices
from tests.hostile_sweep import norm_on_layer0

pytestmark = needs_devices(8)

HERE = Path(__file__).resolve().parents[1]  # tests/
FIXTURES = HERE / "fixtures"
NAMES = ("hf_llama", "hf_llama_tied", "hf_qwen3")
STRATEGIES = ("dp", "fsdp", "tp", "fsdp_tp")
# float32 logits of up to ~25 in magnitude, summed in other orders than torch's:
# measured up to 9e-7 x max|logit| (tests print nothing; see the report in README).
RTOL = 1e-5


def _expected(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / name / "expected.npz"))


def _mesh(strategy: str) -> jax.sharding.Mesh:
    if strategy == "pp":  # the fixtures have 2 layers: 2 stages
        return ns.make_mesh({"stage": 2, "data": 4})
    return ns.strategies.get(strategy).make_mesh(8)


def _target(name: str, strategy: str, **overrides: object) -> Decoder:
    cfg = DecoderConfig.from_hf(FIXTURES / name, **overrides)
    s = ns.strategies.get(strategy)
    return ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), _mesh(strategy), s)


def _hf_tensors(path: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@functools.cache
def _forward(strategy: str):  # one jitted call per strategy: traced under its rules
    return nnx.jit(lambda m, t: m(t))


def _logits(model: Decoder, strategy: str, tokens: np.ndarray) -> np.ndarray:
    s = ns.strategies.get(strategy)
    mesh = next(iter(jax.tree.leaves(nnx.state(model)))).sharding.mesh
    rows = tokens.shape[0]
    host = np.tile(tokens, (8 // rows, 1))  # the batch splits over up to 8 devices
    with ns.use(mesh, s.rules):
        out = _forward(strategy)(model, host)
    return np.asarray(out)[:rows]


def _same_arrays(a: Decoder, b: Decoder) -> None:
    for (path, x), (_, y) in zip(nnx.to_flat_state(nnx.state(a)),
                                 nnx.to_flat_state(nnx.state(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()),
                                      err_msg=str(path))


@functools.cache
def _loaded(name: str, strategy: str) -> Decoder:
    return hf.load_safetensors(FIXTURES / name, _target(name, strategy))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", NAMES)
def test_fixture_logits_match_transformers(name: str, strategy: str) -> None:
    model = _loaded(name, strategy)
    # Every array carries the sharding the strategy gives it.
    want = ns.shardings(model, _mesh(strategy), ns.strategies.get(strategy).rules)
    assert jax.tree.map(lambda x: x.sharding.spec, nnx.state(model)) == jax.tree.map(
        lambda s: s.spec, want)
    expected = _expected(name)
    logits = _logits(model, strategy, expected["tokens"])
    assert_close(logits, expected["logits"], RTOL, f"{name} {strategy} logits")
    assert float(expected["logits"].std()) > 5  # far from uniform: the comparison bites


def test_explicit_mesh_axes() -> None:
    # A target on Explicit axes (JAX's sharding in types) gets arrays typed so.
    cfg = DecoderConfig.from_hf(FIXTURES / "hf_qwen3")
    s = ns.strategies.get("fsdp_tp")
    mesh = s.make_mesh(8, axis_types="explicit")
    model = hf.load_safetensors(FIXTURES / "hf_qwen3", ns.abstract_init(
        lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, s))
    q = model.blocks[0].attn.q.get_value()
    assert q.sharding.mesh.axis_types == (jax.sharding.AxisType.Explicit,) * 2
    assert q.sharding.spec == jax.P("data", "model", None)
    _same_arrays(model, _loaded("hf_qwen3", "fsdp_tp"))


@pytest.mark.parametrize("name", NAMES)
def test_greedy_continuation_matches_transformers(name: str) -> None:
    # Without a cache: the whole sequence again at each step, padded to one length
    # (causal, so the padding never reaches the positions read).
    model = _loaded(name, "fsdp_tp")
    expected = _expected(name)
    prompt, new = expected["prompt"], expected["generated"].shape[1]
    seq = np.zeros((prompt.shape[0], prompt.shape[1] + new), np.int32)
    seq[:, :prompt.shape[1]] = prompt
    for t in range(new):
        pos = prompt.shape[1] + t
        seq[:, pos] = _logits(model, "fsdp_tp", seq)[:, pos - 1].argmax(-1)
    np.testing.assert_array_equal(seq[:, prompt.shape[1]:], expected["generated"])
    assert expected["margins"].min() > 1e-3  # every step decided, far above the logits error


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counted = {"bytes": 0, "calls": 0}
    read = safetensors_io.read_slice

    def counting(header, name, index):  # type: ignore[no-untyped-def]
        out = read(header, name, index)
        counted["bytes"] += out.nbytes
        counted["calls"] += 1
        return out

    monkeypatch.setattr(safetensors_io, "read_slice", counting)
    return counted


@pytest.mark.parametrize("strategy, overrides", [
    ("dp", {}), ("fsdp", {}), ("fsdp_tp", {}), ("fsdp", {"scan_layers": True}),
    ("pp", {"scan_layers": True}), ("pp_tp", {"scan_layers": True}),
])
def test_every_byte_is_read_once(strategy: str, overrides: dict,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Replicated slices are read once for all their devices, split ones slice by
    # slice; stacked layers split over pipeline stages are read by their stage.
    counted = _count_reads(monkeypatch)
    name = "hf_llama"
    model = hf.load_safetensors(FIXTURES / name, _target(name, strategy, **overrides))
    total = sum(v.nbytes for v in _hf_tensors(FIXTURES / name).values())
    assert counted["bytes"] == total
    flat = _loaded(name, "dp")
    if overrides.get("scan_layers"):
        q = model.blocks.attn.q.get_value()
        for i in range(2):
            np.testing.assert_array_equal(np.asarray(q[i]),
                                          np.asarray(flat.blocks[i].attn.q.get_value()))
        if strategy.startswith("pp"):
            assert q.sharding.spec[0] == "stage"


@pytest.mark.parametrize("strategy", ["fsdp_tp", "pp_tp"])
def test_transforms_are_local(strategy: str) -> None:
    # Each parameter's compiled transform, both ways, moves nothing between devices:
    # the Hugging Face-layout input is laid out so that every device transforms
    # the slice it holds.
    name = "hf_qwen3"
    target = _target(name, strategy, scan_layers=strategy.startswith("pp"))
    header = safetensors_io.read_header(*files.checkpoint_files(FIXTURES / name))
    leaves = mapping.leaves_of(nnx.state(target), "test")
    mapping.match(header, leaves, mapping.compile_rules(hf.mapping_for(target)), name)
    checked = 0
    mesh = _mesh(strategy)
    for leaf in leaves.values():
        shape, hf_sharding, model_sharding = files.layouts(leaf)
        for direction, arg in (("load", jax.ShapeDtypeStruct(shape, jnp.float32,
                                                             sharding=hf_sharding)),
                               ("save", jax.ShapeDtypeStruct(leaf.shape, jnp.float32,
                                                             sharding=model_sharding))):
            hlo = files.program(leaf, direction, jnp.float32).lower(arg).compile().as_text()
            assert compiled_collectives(hlo, mesh) == [], (leaf.path, direction)
            checked += 1
    assert checked == 2 * len(leaves) and any(leaf.transform == "heads_out"
                                              for leaf in leaves.values())


def test_save_then_load_is_bitwise_and_transformers_layout(tmp_path) -> None:
    name = "hf_qwen3"
    model = _loaded(name, "fsdp_tp")
    hf.save_safetensors(tmp_path / "one", model)
    # The saved tensors are the fixture's, bit for bit, in transformers' layout.
    saved, original = _hf_tensors(tmp_path / "one"), _hf_tensors(FIXTURES / name)
    assert saved.keys() == original.keys()
    for key in original:
        np.testing.assert_array_equal(saved[key], original[key], err_msg=key)
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    assert DecoderConfig.from_hf(config) == model.cfg
    # From a stacked model on a pipeline mesh, split over files: the same checkpoint.
    stacked = hf.load_safetensors(tmp_path / "one", _target(name, "pp_tp", scan_layers=True))
    hf.save_safetensors(tmp_path / "many", stacked, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "many" / files.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 2 and index["weight_map"].keys() == \
        original.keys()
    back = hf.load_safetensors(tmp_path / "many", _target(name, "fsdp_tp"))
    _same_arrays(back, model)


def test_bfloat16_parameters_and_files(tmp_path) -> None:
    name = "hf_llama"
    f32 = _loaded(name, "fsdp")
    bf16 = hf.load_safetensors(FIXTURES / name, _target(name, "fsdp",
                                                         param_dtype=jnp.bfloat16))
    for (_, a), (_, b) in zip(nnx.to_flat_state(nnx.state(bf16)),
                              nnx.to_flat_state(nnx.state(f32)), strict=True):
        assert a.get_value().dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a.get_value()),
                                      np.asarray(b.get_value()).astype(ml_dtypes.bfloat16))
    hf.save_safetensors(tmp_path, f32, dtype=jnp.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = hf.load_safetensors(tmp_path, _target(name, "tp", param_dtype=jnp.bfloat16))
    _same_arrays(back, bf16)


# --------------------------------------------------------------------------- bad input


def _checkpoint(tmp_path: Path, tensors: dict[str, np.ndarray]) -> Path:
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path


def test_every_problem_in_one_error(tmp_path) -> None:
    tensors = _hf_tensors(FIXTURES / "hf_llama")
    tensors.pop("model.layers.1.mlp.up_proj.weight")  # missing
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # unused
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors[
        "model.layers.0.mlp.down_proj.weight"].T.copy()  # shape
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)  # dtype
    path = _checkpoint(tmp_path, tensors)
    with pytest.raises(ValueError) as info:
        hf.load_safetensors(path, _target("hf_llama", "fsdp"))
    text = str(info.value)
    assert text.startswith(f"load_safetensors: 4 problems between the checkpoint {path} "
                           "and the model:\n")
    assert ("- missing: model path 'blocks/1/mlp/up' [32, 64] float32 has no tensor in the "
            "checkpoint; expected HF key 'model.layers.1.mlp.up_proj.weight' [64, 32]") in text
    assert ("- unused: HF key 'model.layers.0.self_attn.rotary_emb.inv_freq' [4] F32 matches "
            "no pattern of the mapping. Fix: map it") in text
    assert ("- shape: HF key 'model.layers.0.mlp.down_proj.weight' [64, 32] F32 maps to model "
            "path 'blocks/0/mlp/down' [64, 32] float32, which needs HF shape [32, 64] "
            "(transform 'transpose'). Fix: build the model from the checkpoint's own "
            "config.json") in text
    assert ("- dtype: HF key 'model.norm.weight' [32] I32 maps to model path "
            "'final_norm/scale' [32] float32: I32 does not load into float32.") in text
    # The mapping can skip what the model does not need; a stacked target reports
    # the missing layer by number.
    skip = {r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq": None, **hf.LLAMA_MAPPING}
    with pytest.raises(ValueError, match=r"- missing: model path 'blocks/mlp/up' \[2, 32, 64\] "
                       r"float32, layers 1 has no tensor"):
        hf.load_safetensors(path, _target("hf_llama", "fsdp", scan_layers=True), mapping=skip)


def test_two_tensors_for_one_parameter(tmp_path) -> None:
    tensors = _hf_tensors(FIXTURES / "hf_llama")
    tensors["model.embed_tokens.weight_copy"] = tensors["model.embed_tokens.weight"].copy()
    path = _checkpoint(tmp_path, tensors)
    mapping = {r"model\.embed_tokens\.weight(_copy)?": "token_embed", **hf.LLAMA_MAPPING}
    with pytest.raises(ValueError, match=r"1 problem between .*\n- conflict: HF key "
                       r"'model.embed_tokens.weight_copy' \[128, 32\] F32 and "
                       r"'model.embed_tokens.weight' both map to model path 'token_embed'"):
        hf.load_safetensors(path, _target("hf_llama", "dp"), mapping=mapping)


def test_missing_files_and_targets(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="holds neither model.safetensors nor"):
        hf.load_safetensors(tmp_path, _target("hf_llama", "dp"))
    (tmp_path / files.INDEX).write_text(json.dumps({"weight_map": {"a": "part-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="lists 1 files that are not there: "
                       "part-1.safetensors"):
        hf.load_safetensors(tmp_path, _target("hf_llama", "dp"))
    plain = nnx.eval_shape(lambda: Decoder(DecoderConfig.from_hf(FIXTURES / "hf_llama"),
                                         rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"carry no NamedSharding .* Fix: build the target "
                       r"with ns.abstract_init"):
        hf.load_safetensors(FIXTURES / "hf_llama", plain)
    with pytest.raises(ValueError, match="names transform 'flip'; known: copy, transpose"):
        hf.load_safetensors(FIXTURES / "hf_llama", _target("hf_llama", "dp"),
                            mapping={"x": ("y", "flip")})


def test_a_custom_mapping_for_stock_layers(tmp_path) -> None:
    # A torch-style Linear ([out, in] weight) into a stock nnx.Linear, and back.
    rng = np.random.default_rng(0)
    weight, bias = rng.normal(size=(6, 4)).astype(np.float32), np.arange(6, dtype=np.float32)
    (tmp_path / "in").mkdir()
    path = _checkpoint(tmp_path / "in", {"dense.weight": weight, "dense.bias": bias})
    mapping = {r"dense\.weight": ("kernel", "transpose"), r"dense\.bias": "bias"}
    target = ns.abstract_init(lambda: nnx.Linear(4, 6, rngs=nnx.Rngs(0)), "data=8", {})
    layer = hf.load_safetensors(path, target, mapping=mapping)
    np.testing.assert_array_equal(np.asarray(layer.kernel.get_value()), weight.T)
    x = rng.normal(size=(2, 4)).astype(np.float32)
    assert_close(layer(x), x @ weight.T + bias, 1e-6, "Linear")
    hf.save_safetensors(tmp_path / "out", layer, mapping=mapping)
    back = load_file(tmp_path / "out" / "model.safetensors")
    np.testing.assert_array_equal(back["dense.weight"], weight)
    assert not (tmp_path / "out" / "config.json").exists()
    with pytest.raises(ValueError, match=r"'kernel' \[4, 6\] float32 has no Hugging Face name"):
        hf.save_safetensors(tmp_path / "other", layer, mapping={r"dense\.w.*": "kernel"})


def test_save_never_overwrites_foreign_files(tmp_path) -> None:
    model = _loaded("hf_llama_tied", "dp")
    (tmp_path / "model.safetensors").write_bytes(b"not ours")
    with pytest.raises(FileExistsError, match="already holds model.safetensors, which "
                       "save_safetensors did not write there"):
        hf.save_safetensors(tmp_path, model)
    assert (tmp_path / "model.safetensors").read_bytes() == b"not ours"
    mine = tmp_path / "mine"
    hf.save_safetensors(mine, model, max_shard_bytes=30_000)
    (mine / "notes.txt").write_text("keep")
    hf.save_safetensors(mine, model)  # our own files are replaced, nothing else
    assert sorted(os.listdir(mine)) == [".nnx_shard_safetensors", "config.json",
                                        "model.safetensors", "notes.txt"]
    _same_arrays(hf.load_safetensors(mine, _target("hf_llama_tied", "fsdp")), model)


# --------------------------------------------------------------------------- two processes

JOB_TIMEOUT = 120


def _job(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "nnx_shard.cli._launch", "-n", "2", "--devices-per-process", "4",
           "--timeout", str(JOB_TIMEOUT - 10), "--init-timeout", "30",
           "--heartbeat-timeout", "20", "--", sys.executable, str(HERE / "hf_script.py"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT,
                          cwd=HERE.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def two_process_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One two-process job that loads the fixture, runs it and saves it back (a job per
    test would start two more processes): the load's outputs and the saved folder."""
    folder = tmp_path_factory.mktemp("two_processes")
    out, ckpt = folder / "load", folder / "ckpt"
    _job("load+save", str(out), str(ckpt))
    return out, ckpt


@pytest.mark.slow
def test_two_processes_read_only_their_own_slices(two_process_job) -> None:
    out = two_process_job[0]
    infos = [json.loads(Path(f"{out}.{i}.json").read_text()) for i in range(2)]
    total = infos[0]["total"]
    # fsdp over data=8: every parameter has an embed dimension split 8 ways, and
    # each process reads the 4 slices its devices hold: half of every tensor.
    for info in infos:
        assert info["read"] == total // 2, info
        assert info["local_shards"] == 4 and info["q_spec"] == "P(None, 'data', None, None)"
    logits = np.load(f"{out}.npz")["logits"][:2]
    assert_close(logits, _expected("hf_llama")["logits"], RTOL, "two-process logits")


@pytest.mark.slow
def test_two_processes_save_one_checkpoint(two_process_job) -> None:
    ckpt = two_process_job[1]
    saved, original = _hf_tensors(ckpt), _hf_tensors(FIXTURES / "hf_llama")
    assert saved.keys() == original.keys()
    for key in original:
        np.testing.assert_array_equal(saved[key], original[key], err_msg=key)
    assert (ckpt / files.INDEX).is_file()



# --------------------------------------------------------------------------- wrong arguments


def _small_llama():
    return nnx.eval_shape(lambda: Decoder(DecoderConfig(), rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("path", [None, 5, b"dir", ""])
def test_paths_that_are_not_paths_are_named(path):
    with pytest.raises(ns.UsageError, match=r"load_safetensors: path must be a directory path"):
        hf.load_safetensors(path, _small_llama())
    with pytest.raises(ns.UsageError, match=r"save_safetensors: path must be a directory path"):
        hf.save_safetensors(path, Decoder(DecoderConfig(), rngs=nnx.Rngs(0)))


def test_save_and_load_refuse_wrong_arguments(tmp_path):
    model = Decoder(DecoderConfig(), rngs=nnx.Rngs(0))
    (tmp_path / "afile").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"path '.*afile' is a file, not a directory"):
        hf.save_safetensors(tmp_path / "afile", model)
    assert (tmp_path / "afile").read_text() == "keep me"
    with pytest.raises(ns.UsageError, match=r"dtype 'float99' is not a dtype"):
        hf.save_safetensors(tmp_path / "o", model, dtype="float99")
    for size in (0, True, float("nan")):
        with pytest.raises(ns.NnxShardError, match=r"max_shard_bytes must be a positive int"):
            hf.save_safetensors(tmp_path / "o", model, max_shard_bytes=size)
    with pytest.raises(ns.UsageError, match=r"save_safetensors: model must be an nnx.Module, got int"):
        hf.save_safetensors(tmp_path / "o", 5)
    assert not (tmp_path / "o").exists()
    with pytest.raises(ns.UsageError, match=r"load_safetensors: target must be an nnx.Module"):
        hf.load_safetensors(tmp_path, 5)
    with pytest.raises(FileNotFoundError, match=r"path '.*nowhere' is not a directory"):
        hf.load_safetensors(tmp_path / "nowhere", _small_llama())


# --------------------------------------------------------------------------- hostile files


def _llama_copy(tmp_path: Path, name: str = "ckpt") -> Path:
    """A folder holding hf_llama's config and weights, to be broken by a test."""
    out = tmp_path / name
    out.mkdir()
    for f in ("config.json", "model.safetensors"):
        (out / f).write_bytes((FIXTURES / "hf_llama" / f).read_bytes())
    return out


def _index(folder: Path, content: object) -> Path:
    # An index beside model.safetensors is never read (as in transformers): the
    # single file goes, its bytes stay as a shard.
    if (folder / files.SINGLE).exists():
        (folder / files.SINGLE).rename(folder / "model-00001-of-00001.safetensors")
    text = content if isinstance(content, str) else json.dumps(content)
    (folder / files.INDEX).write_text(text)
    return folder / files.INDEX


def test_index_shards_outside_the_folder_are_refused(tmp_path) -> None:
    # The weights sit next to the folder: a weight_map naming '../x' or an absolute
    # path would read them (and any file the process can read) as the checkpoint's.
    outside = _llama_copy(tmp_path, "outside") / "model.safetensors"
    keys = list(safetensors_io.read_header(str(outside)).tensors)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for shard in ("../outside/model.safetensors", str(outside),
                  "sub/../../outside/model.safetensors"):
        index = _index(ckpt, {"weight_map": {k: shard for k in keys}})
        with pytest.raises(ns.NnxShardError) as info:
            hf.load_safetensors(ckpt, _target("hf_llama", "dp"))
        text = str(info.value)
        assert str(index) in text and repr(shard) in text and "outside the checkpoint" in text
        assert "Fix:" in text


def test_index_shards_inside_the_folder_and_symlinked_shards_load(tmp_path) -> None:
    # Hugging Face's hub cache links each shard of a snapshot to a blob elsewhere:
    # a link is followed, only the name in the index must stay inside.
    blobs = _llama_copy(tmp_path, "blobs")
    ckpt = tmp_path / "snapshot"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "sub" / "part.safetensors").symlink_to(blobs / "model.safetensors")
    keys = list(safetensors_io.read_header(str(blobs / "model.safetensors")).tensors)
    _index(ckpt, {"weight_map": {k: "sub/./part.safetensors" for k in keys}})
    _same_arrays(hf.load_safetensors(ckpt, _target("hf_llama", "dp")), _loaded("hf_llama", "dp"))


@pytest.mark.parametrize("content, match", [
    ("{not json", "is not JSON"),
    ("[1, 2]", r"is a list \(\[1, 2\]\), not a JSON object"),
    ("null", "is a null"),
    ({"metadata": {}}, "has no 'weight_map'"),
    ({"weight_map": ["model.safetensors"]}, "'weight_map' is a list"),
    ({"weight_map": {"model.norm.weight": 1}}, r"maps 'model.norm.weight' to an int \(1\)"),
    ({"weight_map": {"model.norm.weight": ""}}, "maps 'model.norm.weight' to ''"),
    ({"weight_map": {}}, "'weight_map' is empty"),
    ({"weight_map": {"model.norm.weight": "a\x00b"}}, "maps 'model.norm.weight' to"),
])
def test_index_files_that_are_not_indexes(tmp_path, content, match) -> None:
    ckpt = _llama_copy(tmp_path)
    index = _index(ckpt, content)
    with pytest.raises(ns.NnxShardError, match=match) as info:
        hf.load_safetensors(ckpt, _target("hf_llama", "dp"))
    assert str(index) in str(info.value) and "Fix:" in str(info.value)


def test_index_naming_a_missing_file(tmp_path) -> None:
    ckpt = _llama_copy(tmp_path)
    index = _index(ckpt, {"weight_map": {"model.norm.weight": "model-2.safetensors"}})
    with pytest.raises(ns.NnxShardError, match="lists 1 files that are not there: "
                       "model-2.safetensors") as info:
        hf.load_safetensors(ckpt, _target("hf_llama", "dp"))
    assert isinstance(info.value, FileNotFoundError) and str(index) in str(info.value)


def test_a_header_sharing_bytes_between_tensors_is_refused(tmp_path) -> None:
    # model.norm.weight pointed at layer 0's input norm (both [32] F32): trusted, the
    # final norm would load layer 0's weights.
    ckpt = _llama_copy(tmp_path)
    norm_on_layer0(ckpt / "model.safetensors")
    with pytest.raises(ns.NnxShardError, match=r"model\.safetensors: not a safetensors file: "
                       r"tensor '.*' starts at byte \d+ of the data but the tensor before it "
                       r"\('.*'\) ends at \d+: it overlaps it"):
        hf.load_safetensors(ckpt, _target("hf_llama", "dp"))


@pytest.mark.parametrize("value, match", [
    (("token_embed", "copy", "extra"), "a tuple of 3"),
    (("token_embed",), "a tuple of 1"),
    (5, r"an int \(5\)"),
    ((5, "copy"), r"model path 5 \(int\)"),
    (("token_embed", 5), r"transform 5 \(int\)"),
    (("token_embed", ["copy"]), r"transform \['copy'\] \(list\)"),
    (r"blocks/\3/attn", r"refers to group 3 but the pattern has 0"),
])
def test_mapping_values_of_the_wrong_form(value, match, tmp_path) -> None:
    mapping = {**hf.LLAMA_MAPPING, r"model\.embed_tokens\.weight": value}
    for call in (lambda: hf.load_safetensors(FIXTURES / "hf_llama", _target("hf_llama", "dp"),
                                             mapping=mapping),
                 lambda: hf.save_safetensors(tmp_path / "o", _loaded("hf_llama", "dp"),
                                             mapping=mapping)):
        with pytest.raises(ns.NnxShardError, match=match) as info:
            call()
        text = str(info.value)
        assert text.startswith("mapping: ") and r"model\.embed_tokens\.weight" in text, text
        assert "Fix:" in text
    assert not (tmp_path / "o").exists()


def test_mapping_patterns_that_are_not_patterns() -> None:
    for table, match in [({5: "token_embed"}, r"pattern 5 \(int\) is not a string"),
                         ({"(": "token_embed"}, r"pattern r'\(' is not a regular expression"),
                         ([("x", "y")], "mapping must be a dict")]:
        with pytest.raises(ns.NnxShardError, match=match):
            hf.load_safetensors(FIXTURES / "hf_llama", _target("hf_llama", "dp"), mapping=table)


def _on_host(model: nnx.Module) -> nnx.Module:
    """A copy of ``model`` whose every variable holds a numpy array."""
    host = nnx.clone(model)
    nnx.update(host, jax.tree.map(np.asarray, nnx.state(host)))
    assert all(type(v.get_value()) is np.ndarray
               for _, v in nnx.to_flat_state(nnx.state(host)))
    return host


def test_host_numpy_values_export_the_same_bytes(tmp_path) -> None:
    model = _loaded("hf_llama", "fsdp")
    host = _on_host(model)
    hf.save_safetensors(tmp_path / "device", model, dtype=jnp.bfloat16)
    hf.save_safetensors(tmp_path / "host", host, dtype=jnp.bfloat16)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "host" / name).read_bytes() == \
            (tmp_path / "device" / name).read_bytes(), name
    assert type(host.token_embed.get_value()) is np.ndarray  # the model is left as it was
    # Adapters too: save_lora writes host factors as it writes device ones.
    adapted = ns.lora(_loaded("hf_llama", "dp"), 4, 8.0)
    adapted.blocks[0].attn.lora_q.lora_b[...] = jnp.full_like(
        adapted.blocks[0].attn.lora_q.lora_b[...], 0.25)
    ns.hf.save_lora(tmp_path / "lora_device", adapted)
    ns.hf.save_lora(tmp_path / "lora_host", _on_host(adapted))
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "lora_host" / name).read_bytes() == \
            (tmp_path / "lora_device" / name).read_bytes(), name
