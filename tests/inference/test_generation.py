"""nnx_shard.inference.generate: a key/value cache laid out by the rules.

Outside references: transformers' greedy ``generate(do_sample=False)`` on the
tiny Llama / Qwen3 fixtures (tests/fixtures, with transformers' own top-2
logit margins per step), the cache-less recompute of the whole sequence per
token, XLA's ``memory_analysis`` of the compiled prefill (the bytes of the
cache each device holds), the compiled decode loop's HLO (its collectives)
and JAX's compile log (the programs compiled).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import nnx_shard as ns
from nnx_shard import UsageError, hf
from nnx_shard.inference import (
    CACHE_AXES,
    GenerationConfig,
    explain_cache,
    generate,
    generation_rules,
)
from nnx_shard.inference import _generation as gen
from nnx_shard.inference._sampling import recompute
from nnx_shard.models import Decoder, DecoderConfig, get_config
from nnx_shard.models._kv_cache import HEADS_FIRST
from nnx_shard.planner._costs import compiled_collectives
from tests._close import assert_close
from tests.conftest import needs_devices

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
STRATEGIES = ("dp", "fsdp", "tp", "fsdp_tp")
# A step of transformers' greedy search is a near-tie when its top-2 margin is
# below this fraction of the logits' scale (max |logit|): our float32 logits
# differ from torch's by up to ~1e-6 of that scale (tests/hf/test_hf.py), so a
# margin of 1e-4 of it is decided the same way by both; a smaller one may not be.
NEAR_TIE = 1e-4
# One layer: every block runs the same cache code, so a second adds compilation, not
# coverage (the stacked model keeps two, for a scan that loops).
CFG = dataclasses.replace(get_config("tiny"), length=24, layers=1)


def _prompt(batch: int = 8, length: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab, (batch, length)).astype(np.int32)


def _build(scan: bool = False) -> Decoder:
    return Decoder(dataclasses.replace(CFG, scan_layers=scan, layers=2 if scan else CFG.layers),
                   rngs=nnx.Rngs(0))


@functools.cache
def _tiny(scan: bool = False) -> Decoder:  # one device, built once
    return _build(scan)


def _sharded(strategy: str, factory, explicit: bool = False,  # type: ignore[no-untyped-def]
             model: nnx.Module | None = None):
    """``factory()`` in the layout ``strategy`` gives it; with ``model`` (a Decoder
    ``factory`` builds), that model's values put on the devices: sharded_init would
    compile an init program per test, and the values, not how they were made, are
    what generate is tested on."""
    s = ns.strategies.get(strategy)
    mesh = s.make_mesh(8, axis_types="explicit" if explicit else "auto")
    if model is None:
        return ns.sharded_init(factory, mesh, s), mesh, s.rules
    graphdef, target = nnx.split(ns.abstract_init(factory, mesh, s))
    values = nnx.state(model)
    placed = jax.tree.map(lambda t, v: jax.device_put(v, t.sharding), target, values)
    return nnx.merge(graphdef, placed), mesh, s.rules


# -- transformers' greedy tokens -----------------------------------------------------


@functools.cache
def _fixture_model(name: str, strategy: str) -> Decoder:
    cfg = DecoderConfig.from_hf(FIXTURES / name)
    s = ns.strategies.get(strategy)
    target = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), s.make_mesh(8), s)
    return hf.load_safetensors(FIXTURES / name, target)


def _compared_steps(expected: dict[str, np.ndarray]) -> int:
    """Steps of transformers' greedy search up to the first near-tie (all if none)."""
    tie = NEAR_TIE * float(np.abs(expected["logits"]).max())
    close = np.flatnonzero(expected["margins"].min(axis=0) < tie)
    return int(close[0]) if close.size else expected["margins"].shape[1]


@needs_devices(8)
@pytest.mark.parametrize("name, strategy", [
    pytest.param(name, strategy, marks=() if (name, strategy) == ("hf_qwen3", "fsdp_tp")
                 else pytest.mark.slow)
    for name in ("hf_qwen3", "hf_llama", "hf_llama_tied") for strategy in STRATEGIES
])
def test_greedy_tokens_match_transformers(name: str, strategy: str) -> None:
    expected = dict(np.load(FIXTURES / name / "expected.npz"))
    rows = expected["prompt"].shape[0]
    prompt = np.tile(expected["prompt"], (8 // rows, 1))  # a batch that splits over 8 devices
    new = expected["generated"].shape[1]
    model = _fixture_model(name, strategy)
    mesh = next(iter(jax.tree.leaves(nnx.state(model)))).sharding.mesh
    with ns.use(mesh, ns.strategies.get(strategy).rules):
        out = np.asarray(generate(model, prompt, GenerationConfig(max_new_tokens=new)))
    steps = _compared_steps(expected)
    assert steps >= 8  # the fixtures' margins are far above the threshold: the test bites
    np.testing.assert_array_equal(out[:, :prompt.shape[1]], prompt)
    for start in range(0, 8, rows):
        np.testing.assert_array_equal(out[start:start + rows, prompt.shape[1]:][:, :steps],
                                      expected["generated"][:, :steps], err_msg=strategy)


# -- the cache against recomputing everything ----------------------------------------


@pytest.mark.slow
def test_decode_logits_equal_the_full_forward() -> None:
    graphdef, state = nnx.split(_tiny())
    tokens = jnp.asarray(_prompt(2, 10))

    @jax.jit
    def both(state: nnx.State, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        m = nnx.merge(graphdef, state)
        full = m(t)
        m.init_cache(2, 16)
        steps = [m.decode(t[:, :8])] + [m.decode(t[:, i:i + 1]) for i in range(8, 10)]
        return jnp.concatenate(steps, axis=1), full

    cached, full = both(state, tokens)
    assert_close(cached, full, 1e-5, "decode vs forward")


@pytest.mark.parametrize("variant", ["dense", "sampled"] + [
    pytest.param(v, marks=pytest.mark.slow) for v in ("llama", "scan", "moe")])
def test_cached_equals_recompute(variant: str) -> None:
    kwargs: dict = {}
    if variant == "moe":
        model: nnx.Module = Decoder(dataclasses.replace(get_config("tiny_moe"), length=24),
                                        rngs=nnx.Rngs(0))
    elif variant == "llama":
        model = Decoder(dataclasses.replace(get_config("llama-tiny"), max_length=24),
                      rngs=nnx.Rngs(0))
    else:
        model = _tiny(scan=variant == "scan")
    config = GenerationConfig(max_new_tokens=16)
    if variant == "sampled":
        kwargs = dict(temperature=0.8, top_k=5, seed=3)
        config = config.replace(do_sample=True, temperature=0.8, top_k=5)
    prompt = _prompt()  # 8 rows by 16 new tokens: the one-device programs of the tests below
    fast = np.asarray(generate(model, prompt, config, seed=kwargs.get("seed", 0)))
    assert not hasattr(model, "cache_index")  # the programs held the cache, not the model
    slow = np.asarray(recompute(model, prompt, 16, **kwargs))
    np.testing.assert_array_equal(fast, slow)
    assert fast.dtype == np.int32 and fast.shape == (8, 24)
    if variant == "sampled":  # the seed matters; the sample is not the greedy path
        greedy = GenerationConfig(max_new_tokens=16)
        assert (fast != np.asarray(generate(model, prompt, greedy))).any()
        assert (fast != np.asarray(generate(model, prompt, config, seed=4))).any()


@needs_devices(8)
@pytest.mark.parametrize("strategy, explicit", [
    pytest.param("tp", False, marks=pytest.mark.slow), ("fsdp_tp", True)])
def test_sharded_stacked_equals_one_device(strategy: str, explicit: bool) -> None:
    # Stacked blocks (one scanned layer body), on Auto and Explicit mesh axes.
    model, mesh, rules = _sharded(strategy, lambda: _build(scan=True), explicit,
                                  _tiny(scan=True))
    prompt = _prompt()
    with ns.use(mesh, rules):
        out = np.asarray(generate(model, prompt, GenerationConfig(max_new_tokens=16)))
    scanned = generate(_tiny(scan=True), prompt, GenerationConfig(max_new_tokens=16))
    np.testing.assert_array_equal(out, np.asarray(scanned))


@needs_devices(8)
@pytest.mark.parametrize("strategy", ["cp", pytest.param("fsdp_cp", marks=pytest.mark.slow)])
def test_cache_length_over_context_equals_one_device(strategy: str) -> None:
    # The cache's positions split over context: each device writes and scores its own.
    model, mesh, rules = _sharded(strategy, _build, model=_tiny())
    prompt = _prompt()
    with ns.use(mesh, rules):
        out = np.asarray(generate(model, prompt, GenerationConfig(max_new_tokens=16)))
    unsharded = generate(_tiny(), prompt, GenerationConfig(max_new_tokens=16))
    np.testing.assert_array_equal(out, np.asarray(unsharded))


# -- where the cache lives -----------------------------------------------------------


def _compiled(model, prompt, new, mesh, rules):  # type: ignore[no-untyped-def]
    """generate's two programs compiled for these arguments, and the prefill's outputs."""
    run = gen._prepare(model, prompt, new, gen.Options(), 0, mesh, rules, "test")
    args = (run.old, run.rest, run.prompt, run.mask, run.real, run.key, run.options)
    with run.context():
        prefill = run.programs.prefill.lower(*args).compile()
        cache, carry = prefill(*args)
        decode = run.programs.decode.lower(run.rest, cache, carry, run.key, run.options,
                                           np.int32(new), np.zeros(len(run.real), bool)
                                           ).compile()
    return prefill, decode, cache, carry


def _cache_transposes(hlo: str, cache: nnx.State, op: str = "transpose") -> list[str]:
    """The transposes (or other ``op``) in optimized ``hlo`` whose output is one device's
    slice of a cache array (``cache``: the prefill's output), its dimensions in any order."""
    slices = {tuple(sorted(x.addressable_shards[0].data.shape))
              for x in jax.tree.leaves(cache) if x.ndim >= 4}
    found = []
    for line in hlo.splitlines():
        m = re.search(rf"= \w+\[([\d,]+)\]\{{[^}}]*\}} {op}\(", line)
        if m and tuple(sorted(int(d) for d in m.group(1).split(","))) in slices:
            found.append(line.strip())
    return found


@needs_devices(8)
@pytest.mark.parametrize("strategy, split", [
    pytest.param("dp", {"cache_batch": 8}, marks=pytest.mark.slow),
    pytest.param("tp", {"cache_batch": 2, "cache_kv_heads": 4}, marks=pytest.mark.slow),
    ("cp", {"cache_batch": 2, "cache_length": 4}),
    ("fsdp_tp", {"cache_batch": 4, "cache_kv_heads": 2}),
])
def test_cache_is_split_and_never_gathered(strategy: str, split: dict[str, int]) -> None:
    if strategy == "fsdp_tp":  # grouped-query attention: 2 key/value heads over model=2
        factory = lambda: Decoder(dataclasses.replace(  # noqa: E731
            get_config("llama-tiny"), max_length=24, layers=1), rngs=nnx.Rngs(0))
        one = factory()
    else:
        factory, one = _build, _tiny()
    model, mesh, rules = _sharded(strategy, factory, model=one)
    prompt, new = _prompt(), 16
    prefill, decode, cache, carry = _compiled(model, prompt, new, mesh, rules)

    report = explain_cache(model, mesh, rules, batch=8, length=24)
    arrays = [r for r in report.rows if r.names == HEADS_FIRST]
    assert len(arrays) == 2 * model.cfg.layers and {r.names for r in arrays} == {HEADS_FIRST}
    divide = int(np.prod(list(split.values())))
    assert divide == 8  # every device holds 1/8 of each cache array
    for row in arrays:
        assert row.bytes_per_device * divide == row.total_bytes, row
        dims = dict(zip(HEADS_FIRST, row.spec, strict=True))
        assert {n: mesh.shape[a] for n, a in dims.items() if a} == split
    # The arrays the compiled prefill outputs, and XLA's count of their bytes.
    for path, var in nnx.to_flat_state(cache):
        want = next(r for r in report.rows if r.path == "/".join(map(str, path)))
        assert var.get_value().sharding.is_equivalent_to(NamedSharding(mesh, want.spec),
                                                         len(want.shape)), path
    # The padding each row remembers: [batch, length] flags and [batch] positions.
    rows = {r.path.rpartition("/")[2]: r for r in report.rows if r.path.startswith("cache_rows")}
    assert rows["valid"].names == CACHE_AXES[:2] and rows["valid"].shape == (8, 24)
    assert rows["next_position"].names == CACHE_AXES[:1]
    carry_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(carry))
    outputs = len(report.rows) + len(jax.tree.leaves(carry))  # a pointer per output
    assert prefill.memory_analysis().output_size_in_bytes == (
        report.param_bytes_per_device + carry_bytes + 8 * outputs)
    # The decode loop moves no cache-shaped array between devices.
    layer = arrays[0].shape
    for c in compiled_collectives(decode.as_text(), mesh):
        for shape in c.shapes:
            assert not (len(shape) == 4 and shape[2] == layer[2] and shape[3] == layer[3]), c
    # ... and transposes none: the products read the cache in the layout it is stored in
    # (stored [batch, length, kv_heads, head_dim], every step transposed every layer's).
    assert _cache_transposes(decode.as_text(), cache) == []


def test_batch_one_decode_updates_the_cache_in_place() -> None:
    # At batch 1 XLA's CPU backend drops the size-1 dimension from the attention
    # products; reading the written cache, it fused the write into their operand and
    # copied every layer's keys and values twice a step. The one-token step reads the
    # cache before writing it: neither a transpose nor a copy of a cache slice is left.
    model = Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))
    prompt = np.arange(1, 6, dtype=np.int32)[None]
    _, decode, cache, _ = _compiled(model, prompt, 4, None, None)
    hlo = decode.as_text()
    assert "dynamic-update-slice" in hlo
    assert _cache_transposes(hlo, cache) == []
    assert _cache_transposes(hlo, cache, "copy") == []


def test_explain_cache_plans_without_devices() -> None:
    model = nnx.eval_shape(lambda: Decoder(get_config("llama3-70b"), rngs=nnx.Rngs(0)))
    mesh = jax.sharding.AbstractMesh((8, 8), ("data", "model"))
    report = explain_cache(model, mesh, ns.strategies.get("fsdp_tp").rules, batch=32,
                           length=4096)
    # 80 layers x 2 (K, V) x 32 x 4096 x 8 kv heads x 128 x 2 bytes (bfloat16), the
    # index (4 bytes), each row's padding flags (32 x 4096 bools) and next position.
    whole = 80 * 2 * 32 * 4096 * 8 * 128 * 2
    rows = 32 * 4096 + 32 * 4
    assert report.total_bytes - 4 - rows == whole
    assert report.param_bytes_per_device - 4 - rows // 8 == whole // 64   # rows over data=8
    with pytest.raises(ns.ShardingError, match="a batch of 12 prompts does not divide"):
        explain_cache(model, mesh, ns.strategies.get("dp").rules, batch=12, length=4096)


# -- compiled programs ---------------------------------------------------------------


def _compiles(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The generation programs JAX compiled ('Compiling jit(_prefill) with ...')."""
    names = [r.getMessage().split()[1] for r in caplog.records
             if r.getMessage().startswith("Compiling ")]
    return [n[4:-1] for n in names if n in ("jit(_prefill)", "jit(_decode)")]


def test_one_prefill_and_one_decode_program_per_shape(caplog: pytest.LogCaptureFixture) -> None:
    model = Decoder(CFG, rngs=nnx.Rngs(1))
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True):
        a = generate(model, _prompt(2, seed=1), GenerationConfig(max_new_tokens=10))
        # greedy: the seed changes nothing
        b = generate(model, _prompt(2, seed=1), GenerationConfig(max_new_tokens=10), seed=5)
        generate(model, _prompt(2, seed=2), GenerationConfig(max_new_tokens=10))
        assert sorted(_compiles(caplog)) == ["_decode", "_prefill"]
        # another shape: one more of each
        generate(model, _prompt(2), GenerationConfig(max_new_tokens=12))
        assert sorted(_compiles(caplog)) == ["_decode", "_decode", "_prefill", "_prefill"]
        for t in (0.5, 1.5):  # sampling: the same programs whatever the temperature
            generate(model, _prompt(2),
                     GenerationConfig(max_new_tokens=12, do_sample=True, temperature=t))
        assert len(_compiles(caplog)) == 4
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- the cache's names in the rules --------------------------------------------------


def test_every_preset_names_the_cache() -> None:
    expected = {  # cache_batch, cache_length, cache_kv_heads
        "dp": ("data", None, None), "zero1": ("data", None, None),
        "zero2": ("data", None, None), "fsdp": ("data", None, None),
        "hsdp": (("replica", "data"), None, None), "tp": ("data", None, ["model", None]),
        "fsdp_tp": ("data", None, ["model", None]), "sp": ("data", None, ["model", None]),
        "async_tp": ("data", None, ["model", None]), "cp": ("data", "context", None),
        "fsdp_cp": ("data", "context", None), "ep": ([("data", "expert"), "data"], None, None),
        "fsdp_ep": ([("data", "expert"), "data"], None, None),
        "pp": ("data", None, None), "pp_fsdp": ("data", None, None),
        "pp_tp": ("data", None, ["model", None]),
    }
    assert set(expected) == set(ns.strategies.NAMES)
    for name, (batch, length, heads) in expected.items():
        rules = ns.strategies.get(name).rules
        got = (rules["cache_batch"], rules["cache_length"], rules["cache_kv_heads"])
        assert got == (batch, length, heads) and rules["cache_head_dim"] is None, name
        g = generation_rules(rules)
        assert g["length"] is None and g["layers"] is None, name
        assert not set(g.options) & {"attention", "collective_matmul", "pipeline"}, name


def test_generation_rules_derive_missing_cache_names() -> None:
    r = generation_rules(ns.Rules({"batch": ns.Fallbacks("data", None), "kv_heads": "model"}))
    assert r["cache_batch"] == ["data", None] and r["cache_kv_heads"] == "model"
    assert r["cache_length"] is None and r["cache_head_dim"] is None
    own = generation_rules(ns.Rules({"batch": "data", "cache_batch": None}))
    assert own["cache_batch"] is None and own["cache_kv_heads"] is None


# -- a model of stock Flax layers ----------------------------------------------------


class StockLM(nnx.Module):
    """Stock layers; the cache comes from nnx.MultiHeadAttention(decode=True)."""

    max_length = 24

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, *, annotate: bool = True,
                 rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Embed(self.max_length, d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.out = nnx.Linear(d, vocab, rngs=rngs)
        self.annotate = annotate

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))
        return self.out(x + self.attn(x, mask=nnx.make_causal_mask(tokens)))

    def init_cache(self, batch: int, length: int) -> None:
        self.attn.init_cache((batch, length, self.attn.in_features))
        if self.annotate:
            ns.annotate(self, {r"attn/cached_(key|value)$": CACHE_AXES})

    def decode(self, tokens: jax.Array) -> jax.Array:
        steps = []
        for t in range(tokens.shape[1]):
            x = self.embed(tokens[:, t:t + 1]) + self.pos(self.attn.cache_index[...])
            steps.append(self.out(x + self.attn(x, decode=True)))
        return jnp.concatenate(steps, axis=1)


STOCK_PATTERNS = {r"attn/(query|key|value)/kernel$": ("embed", "heads", "kv"),
                  r"attn/(query|key|value)/bias$": ("heads", "kv"),
                  r"attn/out/kernel$": ("heads", "kv", "embed")}


@pytest.mark.slow
@needs_devices(8)
def test_stock_multi_head_attention_cache_sharded() -> None:
    prompt = _prompt(2, 4) % 64  # StockLM's vocabulary
    plain = StockLM(rngs=nnx.Rngs(0))
    expected = np.asarray(generate(plain, prompt, GenerationConfig(max_new_tokens=6)))
    np.testing.assert_array_equal(expected, np.asarray(recompute(plain, prompt, 6)))
    model, mesh, rules = _sharded(
        "tp", lambda: ns.annotate(StockLM(rngs=nnx.Rngs(0)), STOCK_PATTERNS))
    with ns.use(mesh, rules):
        out = np.asarray(generate(model, prompt, GenerationConfig(max_new_tokens=6)))
    np.testing.assert_array_equal(out, expected)
    run = gen._prepare(model, prompt, 6, gen.Options(), 0, mesh, rules, "test")
    key = run.prefill()[0]["attn"]["cached_key"].get_value()  # the programs are compiled
    assert key.sharding.is_equivalent_to(NamedSharding(mesh, jax.P("data", None, "model")), 4)
    # Without the annotation the cache is replicated, and generate says so.
    bare = nnx.eval_shape(lambda: StockLM(annotate=False, rngs=nnx.Rngs(0)))
    with pytest.warns(ns.ShardingWarning, match="replicated on every device: attn/cached_key"):
        gen._prepare(bare, _prompt(8) % 64, 2, gen.Options(), 0, mesh, rules, "generate")


# -- bad input -----------------------------------------------------------------------


def test_bad_input_one_clear_error_each() -> None:
    model = _tiny()
    good = _prompt(2)
    cases = [
        (UsageError, "integer token ids, got dtype float32", good.astype(np.float32), 4, {}),
        (UsageError, "rank 2 .* Fix: tokens\\[None\\]", good[0], 4, {}),
        (ValueError, "ids from 0 to 200", np.array([[0, 200]]), 4, {}),
        (UsageError, "prompt has 30 tokens, which is longer than the model's context of 24",
         _prompt(1, 30), 1, {}),
        (UsageError, "prompt has 24 tokens, which fills the model's context of 24 positions "
         r"\(max_length\): no position is left for a new token\. Fix: a prompt shorter than 24 "
         r"tokens \(keep the last 23.*or a model with a longer context", _prompt(1, 24), 1, {}),
        (UsageError, r"max_new_tokens=0 \(int\) must be an int >= 1", good, 0, {}),
        (UsageError, "max_new_tokens=-3", good, -3, {}),
        (UsageError, r"max_new_tokens=2.0 \(float\) must be an int", good, 2.0, {}),
        (UsageError, "max_new_tokens \\(17\\) = 25 positions, past the model.s context of 24.*<= 16",
         good, 17, {}),
        (ValueError, "temperature=-1", good, 4, {"temperature": -1}),
        (ValueError, "top_k=-1; use an int 0 or more", good, 4, {"top_k": -1, "do_sample": True}),
        (UsageError, "mesh= was given without rules=", good, 4, {"mesh": "data=8"}),
    ]
    fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    for err, match, prompt, new, kwargs in cases:
        settings = {k: v for k, v in kwargs.items() if k in fields}
        with pytest.raises(err, match=match):
            generate(model, prompt, GenerationConfig(max_new_tokens=new, **settings),
                     **{k: v for k, v in kwargs.items() if k not in fields})
    with pytest.raises(UsageError, match="init_cache\\(batch, length\\) and decode"):
        generate(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), good, GenerationConfig(max_new_tokens=4))


@needs_devices(8)
@pytest.mark.slow
def test_batch_that_does_not_divide_is_padded_and_cut_back() -> None:
    model, mesh, rules = _sharded("dp", _build, model=_tiny())
    with ns.use(mesh, rules):  # 3 rows over data=8: 5 dummy rows, cut back
        out = np.asarray(generate(model, _prompt(3), GenerationConfig(max_new_tokens=4)))
    assert out.shape == (3, 12)
    alone = generate(_tiny(), _prompt(3), GenerationConfig(max_new_tokens=4))
    np.testing.assert_array_equal(out, np.asarray(alone))


def test_sampling_arguments_and_seeds_are_checked() -> None:
    model, good = _tiny(), _prompt()
    for value, match in ((True, r"temperature must be a number.*True \(a bool\)"),
                         ("0.5", r"temperature must be a number.*'0.5'")):
        with pytest.raises(ns.NnxShardError, match=f"GenerationConfig: {match}") as info:
            GenerationConfig(max_new_tokens=2, do_sample=True, temperature=value)
        assert "Fix: temperature=" in str(info.value)
    cases = [
        ("seed", {"seed": True}, r"seed must be an int.*True \(a bool\)"),
        ("seed", {"seed": 1.5}, r"seed must be an int.*1.5 \(float\)"),
        ("seed", {"seed": "abc"}, r"seed must be an int.*'abc' \(str\)"),
        ("seed", {"seed": None}, r"seed must be an int.*None"),
        ("seed", {"seed": 2**70}, r"seed must be an int from -2\*\*63 to 2\*\*63-1.*1180591620"),
        ("seed", {"seed": jax.random.key(0)}, r"seed must be an int, got a jax.random key array"),
    ]
    for name, kwargs, match in cases:
        with pytest.raises(ns.NnxShardError, match=f"generate: {match}") as info:
            generate(model, good, GenerationConfig(max_new_tokens=2), **kwargs)
        assert f"Fix: {name}=" in str(info.value)
    # NumPy integers are seeds too, and the same seed gives the same tokens (16 new
    # tokens: the programs test_cached_equals_recompute compiled).
    sample = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=1.0, top_k=None)
    a = generate(model, good, sample, seed=np.int64(3))
    np.testing.assert_array_equal(a, generate(model, good, sample, seed=3))


def test_demo_sampler_checks_temperature_seed_and_ids() -> None:
    from nnx_shard.inference._sampling import generate as window_sample

    model = _tiny()
    with pytest.raises(ns.NnxShardError, match=r"generate: temperature must be a number.*bool"):
        window_sample(model, [1, 2, 3], 2, True, 0)
    with pytest.raises(ns.NnxShardError, match=r"generate: seed must be an int.*bool"):
        window_sample(model, [1, 2, 3], 2, 1.0, True)
    with pytest.raises(ns.NnxShardError, match=rf"prompt\[1\] is {CFG.vocab}, outside .* of {CFG.vocab} ids"):
        window_sample(model, [1, CFG.vocab, 3], 2, 1.0, 0)


def test_custom_model_prompt_ids_and_top_k_checked_against_its_logits() -> None:
    # StockLM has no cfg.vocab: its vocabulary is the width of decode's logits (64).
    model = StockLM(rngs=nnx.Rngs(0))
    prompt = np.array([[1, 2, 3], [4, 64, 70]], np.int32)
    two = GenerationConfig(max_new_tokens=2)
    for fn, new in ((generate, two), (recompute, 2)):
        with pytest.raises(ns.NnxShardError, match=r"prompt_tokens\[1, 1\] is 64, outside the "
                                                   r"model's vocabulary of 64 ids \(0 \.\. 63\)"):
            fn(model, prompt, new)
        with pytest.raises(ns.NnxShardError, match=r"prompt_tokens\[0, 2\] is -1"):
            fn(model, np.array([[1, 2, -1]], np.int32), new)
    # the top-k is transformers', in both: more than the vocabulary keeps every token
    np.testing.assert_array_equal(recompute(model, prompt[:1], 2, temperature=1.0, top_k=65),
                                  recompute(model, prompt[:1], 2, temperature=1.0, top_k=None))
    with pytest.raises(ns.NnxShardError, match=r"recompute: top_k=-1; use an int 0 or more"):
        recompute(model, prompt[:1], 2, temperature=1.0, top_k=-1)
    sample = two.replace(do_sample=True, temperature=1.0)
    every = generate(model, prompt[:1], sample.replace(top_k=None), seed=2)
    np.testing.assert_array_equal(generate(model, prompt[:1], sample.replace(top_k=65), seed=2),
                                  every)
    assert generate(model, prompt[:1], sample.replace(top_k=64), seed=2).shape == (1, 5)
