"""Gemma 2, Gemma 3 and Phi-3 beyond their logits (which tests/hf/test_families.py
compares with transformers on one device, under fsdp_tp and under the presets that meet
each family's features): the configs read, that each new
option decides the fixture's logits (dropping it changes them), Phi-3's fused
tensors written back bit for bit (and read by transformers), soft-capping in each
attention kernel, and the config check on load naming the new fields.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import nnx_shard as ns
from nnx_shard._attention import attention
from nnx_shard._errors import UsageError
from nnx_shard.models import Decoder, DecoderConfig
from tests._close import assert_close
from tests._shared import load_refusal
from tests.conftest import needs_devices

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HF_VENV = Path("/work/hf-venv/bin/python")


def _cfg(name: str, **overrides: object) -> DecoderConfig:
    return DecoderConfig.from_hf(FIXTURES / name, **overrides)


def _model(name: str, cfg: DecoderConfig | None = None) -> Decoder:
    """The fixture's weights in a model of ``cfg`` (the fixture's own by default)."""
    own = _cfg(name)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    loaded = ns.hf.load_safetensors(FIXTURES / name, ns.abstract_init(
        lambda: Decoder(own, rngs=nnx.Rngs(0)), mesh, ns.strategies.get("dp").rules))
    if cfg is None:
        return loaded
    return nnx.merge(nnx.graphdef(Decoder(cfg, rngs=nnx.Rngs(0))), nnx.state(loaded))


def _tokens(name: str) -> np.ndarray:
    return np.load(FIXTURES / name / "expected.npz")["tokens"]


def test_new_family_configs_are_read() -> None:
    g2 = _cfg("hf_gemma2")
    assert (g2.model_type, g2.family.block.__name__, g2.attn_softcap, g2.final_softcap,
            g2.query_scale, g2.sliding_window, g2.window_layers, g2.family.norm_offset,
            g2.tie_embeddings) == ("gemma2", "SandwichBlock", 5.0, 20.0, 12.0, 5,
                                   (True, False, True, False), True, True)
    g3 = _cfg("hf_gemma3_text")
    assert (g3.family.qk_norm, g3.rope_theta, g3.rope_local_theta, g3.attn_softcap,
            g3.final_softcap, g3.window_layers) == ("head", 1e6, 100.0, None, None,
                                                    (True, True, False, True))
    phi = _cfg("hf_phi3")
    assert (phi.model_type, phi.head_dim, phi.sliding_window, phi.tie_embeddings) == (
        "phi3", 8, None, False)
    for cfg, name in ((g2, "hf_gemma2"), (g3, "hf_gemma3_text"), (phi, "hf_phi3")):
        assert DecoderConfig.from_hf(cfg.to_hf()) == cfg
        params = nnx.state(_model(name), nnx.Param)
        assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params
    block = _model("hf_gemma2").blocks[0]
    assert all(n is not None for n in (block.attn_norm, block.attn_post_norm, block.mlp_norm,
                                       block.mlp_post_norm))


@pytest.mark.parametrize("name, change, same_first", [
    ("hf_gemma2", {"attn_softcap": None}, 0),
    ("hf_gemma2", {"final_softcap": None}, 0),
    ("hf_gemma2", {"query_scale": 16.0}, 0),
    ("hf_gemma2", {"window_layers": None}, 5),  # every layer windowed: equal on the first 5
    ("hf_gemma2", {"sliding_window": None, "window_layers": None}, 5),
    ("hf_gemma3_text", {"rope_local_theta": None}, 1),  # position 0 is never rotated
])
def test_each_option_decides_the_logits(name: str, change: dict, same_first: int) -> None:
    tokens = _tokens(name)
    base = np.asarray(_model(name)(tokens))
    other = np.asarray(_model(name, dataclasses.replace(_cfg(name), **change))(tokens))
    if same_first:
        assert_close(other[:, :same_first], base[:, :same_first], 1e-5, f"{change} first")
    assert not np.allclose(other[:, same_first:], base[:, same_first:], atol=1e-2), change


@needs_devices(8)
def test_phi3_export_writes_the_fused_tensors_back(tmp_path: Path) -> None:
    s = ns.strategies.get("fsdp_tp")
    cfg = _cfg("hf_phi3", scan_layers=True)
    model = ns.hf.load_safetensors(FIXTURES / "hf_phi3", ns.abstract_init(
        lambda: Decoder(cfg, rngs=nnx.Rngs(0)), s.make_mesh(8), s))
    want = load_file(FIXTURES / "hf_phi3" / "model.safetensors")
    assert want["model.layers.1.self_attn.qkv_proj.weight"].shape == (64, 32)
    for out, kwargs in ((tmp_path / "one", {}), (tmp_path / "split", {"max_shard_bytes": 12_000})):
        ns.hf.save_safetensors(out, model, **kwargs)
        got: dict[str, np.ndarray] = {}
        for f in sorted(out.glob("*.safetensors")):
            got.update(load_file(f))
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        if kwargs:
            files = list(out.glob("*.safetensors"))
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert len(files) > 1 and sorted(index["weight_map"]) == sorted(want)
        again = ns.hf.load_safetensors(out, ns.abstract_init(
            lambda: Decoder(cfg, rngs=nnx.Rngs(0)), s.make_mesh(8), s))
        for a, b in zip(jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(model)),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.skipif(not HF_VENV.exists(), reason="no transformers virtual environment")
@needs_devices(8)
def test_transformers_reads_the_exports(tmp_path: Path) -> None:
    # tests/fixtures/check_hf_reads.py: from_pretrained of each export gives the logits
    # of from_pretrained of its source folder (Phi-3's tensors are bitwise the fixture's,
    # see above).
    script = FIXTURES / "check_hf_reads.py"
    env = {**os.environ, "PYTHONPATH": str(FIXTURES.parents[1])}
    wrote = subprocess.run([sys.executable, str(script), "write", str(tmp_path)],
                           capture_output=True, text=True, env=env, timeout=600)
    assert wrote.returncode == 0, wrote.stderr[-2000:]
    read = subprocess.run([str(HF_VENV), str(script), "read", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert "Traceback" not in read.stderr, read.stderr[-2000:]
    errors = {line.split(":")[0]: float(line.split(" = ", 1)[1].split()[0])
              for line in read.stdout.splitlines() if "max |logits - source's|" in line}
    for name in ("hf_gemma2", "hf_gemma3_text", "hf_phi3"):
        for kind in ("single", "sharded"):
            assert errors[f"{name}_{kind}"] <= 1e-4, (name, kind, read.stdout)


def test_phi3_fused_tensor_of_other_rows_is_named(tmp_path: Path) -> None:
    cfg = dataclasses.replace(_cfg("hf_phi3"), kv_heads=4)  # q/k/v rows 32 + 32 + 32 != 64
    with pytest.raises(UsageError) as info:
        ns.hf.load_safetensors(FIXTURES / "hf_phi3", ns.abstract_init(
            lambda: Decoder(cfg, rngs=nnx.Rngs(0)), "data=8", ns.strategies.get("dp").rules))
    assert "num_key_value_heads: checkpoint 2, model 4" in str(info.value)
    # Without its config.json the tensor itself is checked against the model.
    bare = tmp_path / "phi3"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((FIXTURES / "hf_phi3" / "model.safetensors")
                                             .read_bytes())
    with pytest.raises(UsageError, match=r"fused tensor 'model\.layers\.0\.self_attn\.qkv_proj"
                       r"\.weight' has shape \[64, 32\]; the config stacks 32 \+ 32 \+ 32"):
        ns.hf.load_safetensors(bare, ns.abstract_init(
            lambda: Decoder(cfg, rngs=nnx.Rngs(0)), "data=8", ns.strategies.get("dp").rules))


def test_load_compares_the_new_fields() -> None:
    cfg = _cfg("hf_gemma2")
    plain = dataclasses.replace(cfg, attn_softcap=None, final_softcap=30.0, query_scale=None,
                                window_layers=None)
    text = load_refusal(FIXTURES / "hf_gemma2", plain)
    assert "4 fields differ" in text
    assert "- attn_logit_softcapping: checkpoint 5.0, model None" in text
    assert "- final_logit_softcapping: checkpoint 20.0, model 30.0" in text
    assert "- query_pre_attn_scalar: checkpoint 12.0, model None" in text
    assert ("- layer_types (which layers slide): checkpoint (True, False, True, False), "
            "model None") in text
    g3 = dataclasses.replace(_cfg("hf_gemma3_text"), rope_local_theta=10000.0)
    assert re.search(r"(?s)1 field differs.*rope_local_base_freq: "
                     r"checkpoint 100\.0, model 10000\.0",
                     load_refusal(FIXTURES / "hf_gemma3_text", g3))


def test_load_pretrained_under_eval_shape_gives_the_abstract_model() -> None:
    # Traced, nothing is waited on: the shapes, dtypes and the source come back as
    # load_pretrained's, with no value.
    dp = ns.strategies.get("dp")
    path = FIXTURES / "hf_gemma2"
    model = nnx.eval_shape(lambda: ns.hf.load_pretrained(path, mesh="data=8", rules=dp.rules))
    concrete = ns.hf.load_pretrained(path, mesh="data=8", rules=dp.rules)
    got = jax.tree.leaves(nnx.state(model, nnx.Param))
    want = jax.tree.leaves(nnx.state(concrete, nnx.Param))
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in got)
    assert [(v.shape, v.dtype) for v in got] == [(v.shape, v.dtype) for v in want]
    assert model.cfg == concrete.cfg
    assert ns.hf.source_of(model) is not None


@pytest.mark.parametrize("kernel", ["blockwise", "dense"])
def test_softcap_in_each_kernel_matches_the_formula(kernel: str) -> None:
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 12, 4, 8)) * 3 for i in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # grouped: 2 kv heads

    def reference(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        kk, vv = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(8)
        s = 2.0 * jnp.tanh(s / 2.0)
        s = jnp.where(jnp.tril(jnp.ones((12, 12), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), vv)

    def ours(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return attention(q, k, v, softcap=2.0, implementation=kernel, block_size=4)

    # Each side compiled whole: op by op, the kernels' loops compile many small programs.
    capped = np.asarray(jax.jit(ours)(q, k, v))
    assert_close(capped, np.asarray(jax.jit(reference)(q, k, v)), 1e-5, kernel)
    plain = jax.jit(lambda q, k, v: attention(q, k, v, implementation=kernel, block_size=4))
    assert not np.allclose(np.asarray(plain(q, k, v)), capped, atol=1e-2)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2)))(q, k, v)
    for g, w, n in zip(got, want, "qkv", strict=True):
        assert_close(np.asarray(g), np.asarray(w), 1e-4, f"d{n}")


def test_cudnn_refuses_softcap_by_name() -> None:
    q = jnp.ones((1, 8, 2, 8))
    with pytest.raises(ValueError, match=r"implementation='cudnn' cannot soft-cap the "
                       r"attention logits \(softcap=5\.0\).*Fix: implementation='blockwise'"):
        attention(q, q, q, softcap=5.0, implementation="cudnn")
