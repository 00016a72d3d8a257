"""Fine-tuning inputs of the reference models: ignored targets, padding, packing.

Ground truth is transformers' own (tests/fixtures/hf_llama/masks.npz, written by
tests/fixtures/make_hf_masks.py from the Llama fixture): its ``labels=`` loss with
-100 targets, its logits for a padded batch with ``attention_mask``, and each
sequence run alone. Floats are compared with tolerances scaled to max|logit|
(tests/_close.py).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard import hf
from nnx_shard._attention import _kernels as kernels
from nnx_shard._errors import UsageError
from nnx_shard.models import Decoder, DecoderConfig, get_config, lm_loss
from nnx_shard.models._masks import derive_positions, prepare
from tests._close import assert_close
from tests.conftest import needs_devices

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf_llama"
# float32 logits up to ~25, summed in other orders than torch's (as tests/hf/test_hf.py).
RTOL = 1e-5


@functools.cache
def _expected() -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURE / "masks.npz"))


# Compiled, one program per model and shape: called eagerly, each op of the model compiles a
# program of its own. The values are the same; the eager-only checks are tested where they live.
_forward = nnx.jit(lambda model, tokens, kw: model(tokens, **kw))
_loss = nnx.jit(lm_loss)


def _call(model: Decoder, tokens: object, **kw: object) -> np.ndarray:
    """``model(tokens, **kw)`` as one compiled program."""
    return np.asarray(_forward(model, tokens, kw))


def _scale() -> float:
    return float(np.abs(_expected()["alone_logits"]).max())


def _shifted(labels: np.ndarray) -> np.ndarray:
    """transformers' unshifted ``labels`` as this library's targets (next token's label)."""
    return np.concatenate([labels[:, 1:], np.full((labels.shape[0], 1), -100, labels.dtype)], 1)


def _sequences() -> list[np.ndarray]:
    e = _expected()
    return [row[mask == 1] for row, mask in zip(e["pad_tokens"], e["pad_mask"], strict=True)]


def _alone(i: int) -> np.ndarray:
    e = _expected()
    return e["alone_logits"][i][e["pad_mask"][i] == 1]


@functools.cache
def _fixture_model(strategy: str = "dp", mesh_spec: str | None = None, **overrides: object
                   ) -> tuple[Decoder, jax.sharding.Mesh]:
    """The fixture on one device (``mesh_spec="one"``) or laid out by ``strategy`` on 8
    (``mesh_spec`` the axis types, Auto by default)."""
    s = ns.strategies.get(strategy)
    mesh = (ns.make_mesh("data=1", devices=jax.devices()[:1]) if mesh_spec == "one"
            else s.make_mesh(8, axis_types=mesh_spec or "auto"))
    cfg = DecoderConfig.from_hf(FIXTURE, **overrides)
    return hf.load_safetensors(FIXTURE, ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)),
                                                         mesh, s)), mesh


# --------------------------------------------------------------------------- positions


def test_derived_positions() -> None:
    left = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    assert derive_positions(left, None, 5, 3).tolist() == [
        [0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 1, 1, 1]]
    seg = jnp.array([[1, 1, 2, 2, 2, 3, 0, 0]])
    assert derive_positions(None, seg, 8, 1).tolist() == [[0, 1, 0, 1, 2, 0, 0, 1]]
    # A mask and segments: padding is not counted, each segment restarts at 0.
    mask = jnp.array([[0, 1, 1, 1, 1, 1, 0, 0]])
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 3, 3]])
    assert derive_positions(mask, seg, 8, 1).tolist() == [[0, 0, 1, 0, 1, 2, 0, 0]]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"attention_mask": np.ones((2, 3))}, r"Decoder.forward: attention_mask must be integers "
     r"\(or bools\) of the tokens' shape \(2, 4\), got float64 of shape \(2, 3\)\. Fix:"),
    ({"attention_mask": np.full((2, 4), 2)}, r"attention_mask must hold 0 \(padding\) and 1 "
     r"\(a real token\) only, got values \[2\]\. Fix"),
    ({"segment_ids": np.ones((2, 4), np.float32)}, r"segment_ids must be integers .* got "
     r"float32 of shape \(2, 4\)"),
    ({"positions": np.full((2, 4), -1)}, r"positions must be >= 0, got -1"),
    ({"positions": np.full((2, 4), 99)}, r"positions go up to 99, but the model has 16 "
     r"positions \(0 \.\. 15\)\. Fix"),
    ({"segment_ids": "abcd"}, r"segment_ids must be integers"),
])
def test_bad_mask_arguments(kwargs: dict, match: str) -> None:
    args = {"attention_mask": None, "positions": None, "segment_ids": None} | kwargs
    with pytest.raises(UsageError, match=match):
        prepare(jnp.zeros((2, 4), jnp.int32), caller="Decoder.forward", max_positions=16, **args)


# --------------------------------------------------------------------------- lm_loss


@pytest.mark.slow
def test_ignored_targets_loss_equals_transformers() -> None:
    e = _expected()
    model, _ = _fixture_model("dp", "one")
    loss = _loss(model, {"inputs": e["loss_tokens"], "targets": _shifted(e["loss_labels"])})
    assert e["loss"] > 10 and (e["loss_labels"] == -100).sum() == 15  # the ignored tokens bite
    assert_close(loss, e["loss"], RTOL, "loss with -100 targets")
    # The padded batch: the mask goes from the batch to the model, padding is -100.
    batch = {"inputs": e["pad_tokens"], "targets": _shifted(e["pad_labels"]),
             "attention_mask": e["pad_mask"]}
    assert_close(_loss(model, batch), e["pad_loss"], RTOL, "padded loss")
    # Without the mask the padded rows attend to padding: another (wrong) loss.
    del batch["attention_mask"]
    assert abs(float(_loss(model, batch)) - float(e["pad_loss"])) > 1e-2


def test_loss_is_the_mean_over_kept_targets() -> None:
    model = Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 128, jnp.int32)
    targets = np.asarray(jax.random.randint(jax.random.key(1), (2, 8), 0, 128, jnp.int32))
    ignored = targets.copy()
    ignored[0, :5] = ignored[1, 7] = -100
    logits = _call(model, tokens).astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    kept = ignored != -100
    picked = np.take_along_axis(logp, np.where(kept, ignored, 0)[..., None], -1)[..., 0]
    want = -picked[kept].sum() / kept.sum()
    assert_close(_loss(model, {"inputs": tokens, "targets": ignored}), want, 1e-6, "loss")
    assert_close(_loss(model, {"inputs": tokens, "targets": targets}),
                 -np.take_along_axis(logp, targets[..., None], -1).mean(), 1e-6, "all kept")


def test_loss_with_nothing_kept() -> None:
    model = Decoder(get_config("tiny"), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    none_kept = {"inputs": tokens, "targets": jnp.full((2, 8), -100, jnp.int32)}
    with pytest.raises(UsageError, match=r"lm_loss: every target of the batch \(shape \(2, 8\)\) "
                       r"is -100 \(ignored\), so the mean over kept tokens is 0/0\. Fix"):
        lm_loss(model, none_kept)
    # Traced, the values are unknown: the documented NaN (the Trainer's guard skips it).
    loss, grads = nnx.jit(nnx.value_and_grad(lm_loss))(model, none_kept)
    assert np.isnan(float(loss))
    assert not np.any(jax.tree.leaves(jax.tree.map(lambda g: np.asarray(g).any(), grads)))
    with pytest.raises(UsageError, match=r"targets hold 128, neither a token id of the "
                       r"vocabulary \(0 \.\. 127\) nor -100"):
        lm_loss(model, {"inputs": tokens, "targets": jnp.full((2, 8), 128, jnp.int32)})


# --------------------------------------------------------------------------- padding


def _padded_check(model: Decoder, tokens: np.ndarray, mask: np.ndarray, what: str,
                  **kw: object) -> None:
    e = _expected()
    out = _call(model, tokens, attention_mask=mask, **kw)
    width = out.shape[1]
    want = e["pad_logits"][:, -width:] if width <= e["pad_logits"].shape[1] else None
    for i in range(len(_sequences())):
        real = mask[i] == 1
        assert_close(out[i][real], _alone(i), RTOL, f"{what} row {i} vs alone",
                     scale=_scale())
        if want is not None:
            assert_close(out[i][real], e["pad_logits"][i][e["pad_mask"][i] == 1], RTOL,
                         f"{what} row {i} vs transformers' padded", scale=_scale())


@pytest.mark.parametrize("kernel", ["dense", "blockwise"])
def test_padded_rows_equal_each_sequence_alone(kernel: str) -> None:
    e = _expected()
    model, _ = _fixture_model("dp", "one", attention=kernel)
    _padded_check(model, e["pad_tokens"], e["pad_mask"], kernel)
    # The positions transformers would be given are the ones derived from the mask.
    _padded_check(model, e["pad_tokens"], e["pad_mask"], kernel,
                  positions=e["pad_positions"])


def test_padding_must_be_masked() -> None:
    # Without the mask a left-padded row computes something else: the check bites.
    e = _expected()
    model, _ = _fixture_model("dp", "one")
    out = _call(model, e["pad_tokens"])
    real = e["pad_mask"][0] == 1
    assert np.abs(out[0][real] - _alone(0)).max() > 1e-2 * _scale()


# --------------------------------------------------------------------------- packing


def _packed() -> tuple[dict[str, np.ndarray], list[tuple[int, int, slice]]]:
    """The fixture's four sequences packed into rows of 16, and where each went."""
    seqs = _sequences()
    batch = ns.pack([s.tolist() for s in seqs], 16)
    where = []
    for i, s in enumerate(seqs):
        for r in range(batch["inputs"].shape[0]):
            row = batch["inputs"][r]
            for start in range(16 - len(s) + 1):
                if (row[start:start + len(s)] == s).all() and batch["positions"][r, start] == 0:
                    where.append((i, r, slice(start, start + len(s))))
                    break
            else:
                continue
            break
    assert len(where) == len(seqs)
    return batch, where


def _packed_check(model: Decoder, what: str, *, positions: bool) -> None:
    batch, where = _packed()
    kw = {"positions": batch["positions"]} if positions else {}
    out = _call(model, batch["inputs"], segment_ids=batch["segment_ids"], **kw)
    for i, r, span in where:
        assert_close(out[r, span], _alone(i), RTOL, f"{what} sequence {i}", scale=_scale())


@pytest.mark.parametrize("kernel", ["dense", "blockwise"])
def test_packed_segments_equal_each_sequence_alone(kernel: str) -> None:
    model, _ = _fixture_model("dp", "one", attention=kernel)
    assert _packed()[0]["inputs"].shape == (2, 16)   # 12 + 4 and 7 + 9 tokens
    _packed_check(model, kernel, positions=False)      # positions derived from the segments
    _packed_check(model, kernel, positions=True)
    # Without segment ids the later sequences attend to the earlier ones.
    batch, where = _packed()
    i, r, span = next(w for w in where if w[2].start > 0)
    out = _call(model, batch["inputs"], positions=batch["positions"])
    assert np.abs(out[r, span] - _alone(i)).max() > 1e-2 * _scale()


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("kernel", ["dense", "blockwise"])
def test_transformer_padding_and_packing(kernel: str, scan: bool) -> None:
    cfg = dataclasses.replace(get_config("tiny"), attention=kernel, scan_layers=scan)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    a = jax.random.randint(jax.random.key(0), (1, 6), 1, 128, jnp.int32)
    b = jax.random.randint(jax.random.key(1), (1, 10), 1, 128, jnp.int32)
    alone_a, alone_b = _call(model, a), _call(model, b)
    scale = float(max(np.abs(alone_a).max(), np.abs(alone_b).max()))
    padded = jnp.concatenate([jnp.pad(a, ((0, 0), (10, 0))), jnp.pad(b, ((0, 0), (6, 0)))])
    out = _call(model, padded, attention_mask=padded != 0)
    assert_close(out[0, 10:], alone_a[0], RTOL, "left-padded a", scale=scale)
    assert_close(out[1, 6:], alone_b[0], RTOL, "left-padded b", scale=scale)
    packed = ns.pack([np.asarray(a[0]).tolist(), np.asarray(b[0]).tolist()], 16)
    out = _call(model, packed["inputs"], segment_ids=packed["segment_ids"])
    assert packed["segment_ids"].tolist() == [[1] * 10 + [2] * 6]   # longest first
    assert_close(out[0, :10], alone_b[0], RTOL, "packed b", scale=scale)
    assert_close(out[0, 10:], alone_a[0], RTOL, "packed a", scale=scale)


@pytest.mark.slow
def test_mask_gradients_agree_between_kernels() -> None:
    batch = _packed()[0] | {"attention_mask": (_packed()[0]["segment_ids"] > 0).astype(np.int32)}
    results = {}
    for kernel in ("dense", "blockwise"):
        cfg = dataclasses.replace(get_config("llama-tiny"), attention=kernel)
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        loss, grads = nnx.jit(nnx.value_and_grad(lm_loss))(model, batch)
        results[kernel] = (loss, jax.tree.map(np.asarray, nnx.to_pure_dict(grads)))
    assert_close(results["blockwise"], results["dense"], 1e-5, "loss and grads")


def test_cudnn_kernel_builds_the_same_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: the cuDNN call is replaced by jax's XLA implementation of the same
    # function with the same arguments, so what is checked is the mask the kernel
    # builds from the padding and the segments (and that it gets one at all).
    calls = []
    original = jax.nn.dot_product_attention

    def xla(q, k, v, *, mask=None, is_causal=False, implementation=None):  # type: ignore[no-untyped-def]
        calls.append((implementation, None if mask is None else mask.shape, is_causal))
        return original(q, k, v, mask=mask, is_causal=is_causal)

    monkeypatch.setattr(jax.nn, "dot_product_attention", xla)
    monkeypatch.setattr(kernels, "_platform", lambda: "gpu")
    model, _ = _fixture_model("dp", "one", attention="cudnn")
    e = _expected()
    _padded_check(model, e["pad_tokens"], e["pad_mask"], "cudnn")
    assert calls[-1] == ("cudnn", (4, 1, 12, 12), True)
    _packed_check(model, "cudnn", positions=False)


def test_cudnn_off_a_gpu_is_refused() -> None:
    if jax.default_backend() == "gpu":
        pytest.skip("cuDNN runs here")
    model = Decoder(dataclasses.replace(get_config("llama-tiny"), attention="cudnn"),
                  rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"implementation='cudnn' is cuDNN's fused kernel, for "
                       r"NVIDIA GPUs; this runs on cpu\. Fix: implementation='auto'"):
        model(jnp.zeros((1, 8), jnp.int32), attention_mask=jnp.ones((1, 8), jnp.int32))


# --------------------------------------------------------------------------- layouts

LAYOUTS = ("dp", "tp", "fsdp_tp", "sp", "async_tp", "cp", "fsdp_cp")


def _tile8(x: np.ndarray) -> np.ndarray:
    return np.tile(x, (8 // x.shape[0],) + (1,) * (x.ndim - 1))


@pytest.mark.slow
@needs_devices(8)
@pytest.mark.parametrize("strategy", LAYOUTS)
def test_masks_under_layouts(strategy: str) -> None:
    """Padding, packing and ignored targets under data, tensor, sequence and context
    (ring) parallelism, on Explicit mesh axes: the same logits as transformers, loss and
    gradients as on one device. Lengths divide into cp's 2 x 4 zig-zag chunks: the
    padded rows get 4 more pads on the left (positions derived from the mask do not
    move)."""
    e = _expected()
    s = ns.strategies.get(strategy)
    model, mesh = _fixture_model(strategy, "explicit")
    tokens = _tile8(np.pad(e["pad_tokens"], ((0, 0), (4, 0))))
    mask = _tile8(np.pad(e["pad_mask"], ((0, 0), (4, 0))))
    packed = {k: _tile8(v) for k, v in _packed()[0].items()}
    loss_batch = {"inputs": _tile8(e["loss_tokens"]), "targets": _tile8(_shifted(e["loss_labels"]))}
    train_batch = packed | {"attention_mask": (packed["segment_ids"] > 0).astype(np.int32)}
    with ns.use(mesh, s.rules):
        call = nnx.jit(lambda m, t, kw: m(t, **kw))
        padded = np.asarray(call(model, tokens, {"attention_mask": mask}))
        out = np.asarray(call(model, packed["inputs"], {"segment_ids": packed["segment_ids"]}))
        loss = nnx.jit(lm_loss)(model, loss_batch)
        got = nnx.jit(nnx.value_and_grad(lm_loss))(model, train_batch)
    for i in range(4):
        real = mask[i] == 1
        assert_close(padded[i][real], _alone(i), RTOL, f"{strategy} padded {i}", scale=_scale())
        assert_close(padded[i][real], e["pad_logits"][i][e["pad_mask"][i] == 1], RTOL,
                     f"{strategy} padded {i} vs transformers", scale=_scale())
    for i, r, span in _packed()[1]:
        assert_close(out[r, span], _alone(i), RTOL, f"{strategy} packed {i}", scale=_scale())
    assert_close(loss, e["loss"], RTOL, f"{strategy} loss")
    assert_close(jax.tree.map(np.asarray, (got[0], nnx.to_pure_dict(got[1]))),
                 _one_device_loss_and_grads(), 1e-5, f"{strategy} loss and grads")


@functools.cache
def _one_device_loss_and_grads() -> tuple[np.ndarray, dict]:
    """The fixture's loss and gradients on the packed training batch, on one device: one
    compiled program for every layout (eagerly, each op compiles a program of its own)."""
    packed = {k: _tile8(v) for k, v in _packed()[0].items()}
    batch = packed | {"attention_mask": (packed["segment_ids"] > 0).astype(np.int32)}
    loss, grads = nnx.jit(nnx.value_and_grad(lm_loss))(_fixture_model("dp", "one")[0], batch)
    return jax.tree.map(np.asarray, (loss, nnx.to_pure_dict(grads)))


@pytest.mark.slow
@needs_devices(8)
@pytest.mark.parametrize("variant", ["pp", "allgather"])
def test_masks_through_the_pipeline_and_allgather(variant: str) -> None:
    """The masks ride in the pipeline's carry (cut into microbatches with the
    activations) and travel with the keys under all-gather context parallelism."""
    e = _expected()
    if variant == "pp":  # the fixture's 2 layers, one per stage
        rules = ns.strategies.get("pp").rules
        mesh = ns.make_mesh({"stage": 2, "data": 4}, axis_types="auto")
        cfg = DecoderConfig.from_hf(FIXTURE, scan_layers=True)
    else:
        s = ns.strategies.get("cp")
        rules, mesh = s.rules.with_options(attention="allgather"), s.make_mesh(8)
        cfg = DecoderConfig.from_hf(FIXTURE)
    model = hf.load_safetensors(FIXTURE, ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)),
                                                          mesh, rules))
    tokens = _tile8(np.pad(e["pad_tokens"], ((0, 0), (4, 0))))
    mask = _tile8(np.pad(e["pad_mask"], ((0, 0), (4, 0))))
    packed = {k: _tile8(v) for k, v in _packed()[0].items()}
    with ns.use(mesh, rules):
        call = nnx.jit(lambda m, t, kw: m(t, **kw))
        padded = np.asarray(call(model, tokens, {"attention_mask": mask}))
        out = np.asarray(call(model, packed["inputs"], {"segment_ids": packed["segment_ids"]}))
    for i in range(4):
        assert_close(padded[i][mask[i] == 1], _alone(i), RTOL, f"{variant} padded {i}",
                     scale=_scale())
    for i, r, span in _packed()[1]:
        assert_close(out[r, span], _alone(i), RTOL, f"{variant} packed {i}", scale=_scale())


# --------------------------------------------------------------------------- training


@needs_devices(8)
@pytest.mark.slow
def test_trainer_and_batches_carry_the_mask_keys() -> None:
    """A packed dataset through ns.Batches and the Trainer: every key sharded like the
    tokens, and each step's loss the eager loss of its batch (learning rate 0)."""
    rng = np.random.default_rng(0)
    examples = [rng.integers(1, 128, size=n).tolist() for n in rng.integers(3, 12, size=40)]
    data = ns.pack(examples, 16, prompt_lengths=[2] * len(examples))
    rows = data["inputs"].shape[0] // 8 * 8
    data = {k: v[:rows] for k, v in data.items()}
    cfg = get_config("llama-tiny")
    s = ns.strategies.get("dp")
    mesh = s.make_mesh(8)
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, s)
    opt = ns.sharded_optimizer(model, optax.sgd(0.0), mesh, s)
    with ns.use(mesh, s.rules):
        placed = ns.shard_batch(data, mesh, s.rules, ("batch", None))
    specs = {k: v.sharding.spec for k, v in placed.items()}
    assert len(set(specs.values())) == 1, specs
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=s.rules, steps_per_call=2)
    history = trainer.fit(ns.Batches(data, batch_size=8), num_steps=2, progress=False)
    ref = Decoder(cfg, rngs=nnx.Rngs(0))
    want = [float(_loss(ref, {k: v[8 * i:8 * (i + 1)] for k, v in data.items()}))
            for i in range(2)]
    assert_close(history["loss"], np.array(want), 1e-5, "per-step loss")
    # The keys matter: without the segments the loss differs.
    plain = {k: data[k][:8] for k in ("inputs", "targets")}
    assert abs(float(_loss(ref, plain)) - want[0]) > 1e-3


# --------------------------------------------------------------------------- pack


def test_pack_targets_segments_and_positions() -> None:
    rng = np.random.default_rng(1)
    examples = [rng.integers(0, 50, size=n).tolist() for n in (5, 9, 3, 16, 1, 7, 8)]
    prompts = [2, 0, 3, 10, 0, 6, 1]
    batch = ns.pack(examples, 16, prompt_lengths=prompts, pad_id=99)
    rows = batch["inputs"].shape[0]
    assert rows == 4 and all(v.dtype == np.int32 and v.shape == (rows, 16)
                             for v in batch.values())
    seen = []
    for r in range(rows):
        seg = batch["segment_ids"][r]
        for sid in sorted(set(seg.tolist()) - {0}):
            span = np.flatnonzero(seg == sid)
            toks = batch["inputs"][r, span]
            i = next(j for j, ex in enumerate(examples) if ex == toks.tolist() and j not in seen)
            seen.append(i)
            assert batch["positions"][r, span].tolist() == list(range(len(span)))
            want = [examples[i][k + 1] if k + 1 >= prompts[i] else -100
                    for k in range(len(span) - 1)] + [-100]
            assert batch["targets"][r, span].tolist() == want
        pad = seg == 0
        assert (batch["inputs"][r, pad] == 99).all() and (batch["targets"][r, pad] == -100).all()
        assert (batch["positions"][r, pad] == 0).all()
    assert sorted(seen) == list(range(len(examples)))


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    (([[1, 2, 3]], 2), {}, r"pack: example 0 has 3 tokens, more than a row's 2\. Fix: truncate"),
    (([[1, 2], []], 4), {}, r"pack: example 1 must be a non-empty list of token ids"),
    (([[1, 2]], 4), {"prompt_lengths": [3]}, r"prompt_lengths\[0\] = 3 is not a count from 0 "
     r"to the example's 2 tokens"),
    (([[1, 2]], 4), {"prompt_lengths": [1, 1]}, r"one count per example \(1\), got 2"),
    (([[1.5, 2]], 4), {}, r"example 0 must be a non-empty list of token ids"),
    (("abc", 4), {}, r"pack: examples must be a list of token lists, got str"),
    (([[1]], 0), {}, r"pack: length must be a whole number of tokens >= 1, got 0"),
    (([[1]], 4), {"pad_id": None}, r"pack: pad_id must be a token id \(int\), got None"),
])
def test_pack_errors(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        ns.pack(*args, **kwargs)


# --------------------------------------------------------------------------- generation


def test_decode_with_a_mask_is_the_masked_call() -> None:
    # The prefill path: a left-padded prompt into an empty cache gives transformers'
    # padded logits, for the fixture Llama and (against its own call) the Decoder.
    e = _expected()
    model, _ = _fixture_model("dp", "one")
    model = nnx.clone(model)
    model.init_cache(batch=4, length=16)
    decode = nnx.jit(lambda m, t, mask: m.decode(t, attention_mask=mask))  # as _call
    out = np.asarray(decode(model, e["pad_tokens"], e["pad_mask"]))
    for i in range(4):
        assert_close(out[i][e["pad_mask"][i] == 1], _alone(i), RTOL, f"decode row {i}",
                     scale=_scale())
    ref = Decoder(dataclasses.replace(get_config("tiny"), scan_layers=True), rngs=nnx.Rngs(0))
    tokens = jnp.asarray(e["pad_tokens"][:, :12])
    want = _call(ref, tokens, attention_mask=e["pad_mask"])
    ref.init_cache(batch=4, length=16)
    got = np.asarray(decode(ref, tokens, e["pad_mask"]))
    real = e["pad_mask"] == 1
    assert_close(got[real], want[real], RTOL, "transformer decode")


@pytest.mark.parametrize("strategy", [None, "tp"])
def test_prefill_takes_an_attention_mask(strategy: str | None) -> None:
    from nnx_shard.inference._generation import Options, _prepare

    e = _expected()
    if strategy is None:
        model, mesh, rules = _fixture_model("dp", "one")[0], None, None
        prompt, mask = e["pad_tokens"], e["pad_mask"]
    else:
        s = ns.strategies.get(strategy)
        model, mesh = _fixture_model(strategy)
        rules = s.rules
        prompt, mask = _tile8(e["pad_tokens"]), _tile8(e["pad_mask"])
    # Rows 0-2 are left-padded (row 3, right-padded, would continue after its padding:
    # generate refuses that mask, so it runs here unmasked).
    mask = np.where((np.arange(len(mask)) % 4 == 3)[:, None], 1, mask)
    length = prompt.shape[1]
    run = _prepare(model, prompt, 4, Options(), 0, mesh, rules, "generate", mask)
    first = run.prefill()[1]["tokens"][:, length]
    want = [int(np.argmax(_alone(i)[-1])) for i in range(3)]
    assert np.asarray(first)[:3].tolist() == want
    unmasked = _prepare(model, prompt, 4, Options(), 0, mesh, rules, "generate").prefill()
    assert np.asarray(unmasked[1]["tokens"][:, length])[:3].tolist() != want  # the mask did it
