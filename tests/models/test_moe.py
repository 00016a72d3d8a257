"""The mixture-of-experts families (Mixtral, Qwen3-MoE) against transformers:
tests/fixtures/make_moe.py wrote tiny random checkpoints and transformers' logits,
greedy tokens, loss and load-balancing loss."""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard.models import Decoder, DecoderConfig, Qwen3MoeConfig, get_config
from nnx_shard.models._families import family_of
from nnx_shard.models._moe import DecoderMoE

FIXTURES = pathlib.Path(__file__).parent.parent / "fixtures" / "moe"
FAMILIES = ("mixtral", "qwen3_moe")


def _one() -> tuple[jax.sharding.Mesh, object]:
    return (jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
            ns.strategies.get("dp").rules)


@functools.cache
def _expected(family: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / family / "expected.npz"))


def _layout(strategy: str) -> tuple[jax.sharding.Mesh, object]:
    """The mesh (8 devices) and rules of a preset."""
    s = ns.strategies.get(strategy)
    return s.mesh_for(8), s.rules


@functools.cache
def _loaded(family: str, strategy: str) -> Decoder:
    if strategy == "one":
        mesh, rules = _one()
    else:
        mesh, rules = _layout(strategy)
    model = ns.hf.load_pretrained(FIXTURES / family, mesh=mesh, rules=rules)
    assert isinstance(model, Decoder)
    return model


def _logits(family: str, strategy: str) -> np.ndarray:
    ids = _expected(family)["ids"]
    if strategy == "one":  # compiled: eagerly each op of the tiles compiles on its own
        return np.asarray(nnx.jit(lambda m, t: m(t))(_loaded(family, strategy), ids))
    mesh, rules = _layout(strategy)
    host = np.tile(ids, (4, 1))  # a batch every data shard divides
    with ns.use(mesh, rules):
        out = nnx.jit(lambda m, t: m(t))(_loaded(family, strategy), host)
    return np.asarray(out)[:ids.shape[0]]


def test_configs_are_read_and_written_back() -> None:
    mixtral = DecoderConfig.from_hf(FIXTURES / "mixtral")
    assert (mixtral.experts, mixtral.top_k, mixtral.expert_mlp, mixtral.norm_topk_prob,
            mixtral.moe_layers(), mixtral.aux_loss_weight) == (4, 2, 96, True, (True, True), 0.02)
    qwen = DecoderConfig.from_hf(FIXTURES / "qwen3_moe")
    assert (qwen.experts, qwen.top_k, qwen.moe_mlp, qwen.mlp, qwen.norm_topk_prob,
            qwen.family.qk_norm,
            qwen.moe_layers()) == (8, 2, 48, 96, False, "head",
                                    (True, False, True))
    for cfg in (mixtral, qwen, get_config("mixtral-8x7b"), get_config("qwen3-30b-a3b")):
        assert DecoderConfig.from_hf(cfg.to_hf(), scan_layers=cfg.scan_layers,
                                   dtype=cfg.dtype, param_dtype=cfg.param_dtype) == cfg
    assert family_of("mixtral").architectures == ("MixtralForCausalLM",)
    assert qwen.to_hf()["num_experts"] == 8 and mixtral.to_hf()["num_local_experts"] == 4


def test_named_configs_have_the_published_counts() -> None:
    mixtral, qwen = get_config("mixtral-8x7b"), get_config("qwen3-30b-a3b")
    assert round(mixtral.num_params / 1e9, 1) == 46.7
    assert round(mixtral.active_params / 1e9, 1) == 12.9
    assert round(qwen.num_params / 1e9, 1) == 30.5
    assert int(qwen.active_params / 1e8) == 33  # the published 3.3B
    model = nnx.eval_shape(lambda: Decoder(get_config("qwen3-tiny").with_family(
        "qwen3_moe", experts=4, moe_mlp=16), rngs=nnx.Rngs(0)))
    counted = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert counted == model.cfg.num_params


def test_experts_carry_the_expert_axis() -> None:
    model = _loaded("mixtral", "one")
    moe = model.blocks[0].mlp
    assert isinstance(moe, DecoderMoE)
    assert moe.gate.shape == (4, 64, 96)
    assert moe.down.get_metadata("out_sharding") == ("expert", "mlp", "embed")
    assert ns.strategies.get("ep").rules["expert"] == "expert"


def test_bad_expert_settings_are_refused() -> None:
    with pytest.raises(ns.UsageError, match="experts"):
        DecoderConfig.for_model("llama", experts=2, top_k=3)
    # A mixture-of-experts type without experts would be written as num_experts 0,
    # which transformers reads as a dense model.
    for kind, key in (("mixtral", "num_local_experts"), ("qwen3_moe", "num_experts")):
        with pytest.raises(ns.UsageError, match=rf"experts=0: model_type='{kind}' is a "
                                                rf"mixture-of-experts family.*{key} >= 1.*Fix"):
            DecoderConfig.for_model(kind, experts=0)
        with pytest.raises(ns.UsageError, match="top_k=3"):
            DecoderConfig.for_model(kind, experts=2, top_k=3)
    with pytest.raises(ns.UsageError, match="scan_layers"):
        DecoderConfig.for_model("qwen3_moe", layers=2, experts=4, mlp_only_layers=(1,),
                                scan_layers=True)


def test_qwen3_moe_fields_live_on_its_own_config_class() -> None:
    cfg = DecoderConfig.for_model("qwen3_moe", layers=3, experts=4, moe_mlp=16,
                                  mlp_only_layers=[1])
    assert type(cfg) is Qwen3MoeConfig
    assert (cfg.mlp_only_layers, cfg.expert_mlp, cfg.moe_layers()) == ((1,), 16,
                                                                        (True, False, True))
    assert dataclasses.replace(cfg, layers=4).moe_layers() == (True, False, True, True)
    assert DecoderConfig.from_hf(cfg.to_hf()) == cfg
    mixtral = DecoderConfig.for_model("mixtral", experts=4)
    assert type(mixtral).__name__ == "MixtralConfig"
    assert (mixtral.norm_topk_prob, mixtral.expert_mlp) == (True, mixtral.mlp)
    assert "moe_intermediate_size" not in mixtral.to_hf()
    with pytest.raises(ns.UsageError, match=r"moe_mlp=16 .*'mixtral'.*Fix: "
                                            r"DecoderConfig.for_model\('qwen3_moe'"):
        DecoderConfig.for_model("mixtral", experts=4, moe_mlp=16)
    with pytest.raises(ns.UsageError, match=r"Qwen3MoeConfig: model_type='mixtral'.*Fix"):
        Qwen3MoeConfig(experts=4, model_type="mixtral")


def test_mlp_only_layers_must_be_a_list_in_config_json() -> None:
    hf = DecoderConfig.from_hf(FIXTURES / "qwen3_moe").to_hf()
    for value in (0, False, "", {}, 1):
        with pytest.raises(ns.UsageError, match=r"mlp_only_layers must be a list of layer "
                                                r"indices, got .*Fix"):
            DecoderConfig.from_hf({**hf, "mlp_only_layers": value})
    assert DecoderConfig.from_hf({**hf, "mlp_only_layers": None}).mlp_only_layers == ()
    assert DecoderConfig.from_hf({**hf, "mlp_only_layers": []}).moe_layers() == (True,) * 3


def test_no_tokens_are_refused_by_shape() -> None:
    # The shape is checked before any weight is read: an abstract model refuses the same.
    model = nnx.eval_shape(lambda: Decoder(DecoderConfig.for_model("mixtral", experts=4),
                                           rngs=nnx.Rngs(0)))
    for shape in ((0, 8), (2, 0)):
        with pytest.raises(ns.UsageError, match=rf"Decoder.forward: tokens of shape "
                                                rf"\({shape[0]}, {shape[1]}\) hold no token"):
            model(jnp.zeros(shape, jnp.int32))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family: str) -> None:
    want = _expected(family)["logits"]
    got = _logits(family, "one")
    assert np.abs(got - want).max() <= 2e-4 * np.abs(want).max()


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_dot_gives_the_same_logits_as_the_tiles(family: str) -> None:
    want = _expected(family)["logits"]
    cfg = DecoderConfig.from_hf(FIXTURES / family, expert_matmul="ragged_dot")
    model = ns.hf.load_safetensors(FIXTURES / family, ns.abstract_init(
        lambda: Decoder(cfg, rngs=nnx.Rngs(0)), *_one()))
    got = np.asarray(nnx.jit(lambda m, t: m(t))(model, _expected(family)["ids"]))
    assert np.abs(got - want).max() <= 2e-4 * np.abs(want).max()
    assert model.blocks[0].mlp.matmul == "ragged_dot"


def test_expert_matmul_is_an_option_of_the_moe_families_only() -> None:
    cfg = DecoderConfig.for_model("mixtral", experts=4, expert_matmul="tiles")
    assert "expert_matmul" not in cfg.to_hf() and "tiles" not in str(cfg.to_hf())
    assert DecoderConfig.from_hf(cfg.to_hf()).expert_matmul == "auto"
    with pytest.raises(ns.UsageError, match=r"expert_matmul='tiles' is not part of "
                                            r"model_type='llama'.*mixtral, qwen3_moe have it"):
        DecoderConfig.for_model("llama", expert_matmul="tiles")
    with pytest.raises(ns.UsageError, match=r"MixtralConfig.expert_matmul='grouped'; valid: "
                                            r"'auto', 'tiles', 'ragged_dot'"):
        DecoderConfig.for_model("mixtral", experts=4, expert_matmul="grouped")


@pytest.mark.slow
def test_a_training_step_costs_the_active_parameters() -> None:
    """XLA's count of one training step with the tiles is within 1.25x of the dense
    model of the active width (the all-experts product: experts / top_k more)."""
    from nnx_shard.models._grouped import unrolled

    shared = dict(embed=64, heads=4, kv_heads=2, head_dim=16, layers=1, vocab=64)
    moe = DecoderConfig.for_model("mixtral", **shared, mlp=96, experts=4, top_k=2,
                                  expert_matmul="tiles")
    dense = DecoderConfig(**shared, mlp=2 * 96)
    batch = {k: jax.ShapeDtypeStruct((1, 256), jnp.int32) for k in ("inputs", "targets")}

    def flops(cfg: DecoderConfig) -> float:
        graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))

        def step(p: object, b: dict) -> object:
            return jax.value_and_grad(lambda p: ns.models.lm_loss(nnx.merge(graphdef, p), b))(p)

        with unrolled():
            return jax.jit(step).lower(params, batch).compile().cost_analysis()["flops"]

    assert moe.active_params == dense.num_params + 64 * 4  # the router is the difference
    ratio = flops(moe) / flops(dense)
    assert ratio <= 1.25, ratio


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_with_aux_matches_transformers(family: str) -> None:
    exp = _expected(family)
    model = _loaded(family, "one")
    # transformers shifts the labels inside its loss (the targets here are shifted
    # already); its router sees every real position, the last one included.
    full = {"inputs": jnp.asarray(exp["ids"]),
            "targets": jnp.asarray(np.concatenate([exp["labels"][:, 1:],
                                                   np.full((2, 1), -100)], axis=1)),
            "attention_mask": jnp.asarray(exp["mask"])}

    @nnx.jit  # one program (eagerly each op compiles on its own)
    def aux_and_loss(model: Decoder, full: dict) -> tuple[jax.Array, jax.Array]:
        _, aux = model.forward(full["inputs"], attention_mask=full["attention_mask"])
        return aux, ns.models.lm_loss(model, full)

    aux, loss = aux_and_loss(model, full)
    np.testing.assert_allclose(float(aux), exp["aux_loss"], rtol=1e-5)
    np.testing.assert_allclose(float(loss), exp["loss"], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["one", "fsdp_ep"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(family: str, strategy: str) -> None:
    exp = _expected(family)
    model = _loaded(family, strategy)
    # fsdp_ep: the prompt row padded to the 8 rows (data x expert) the dispatch splits,
    # each decoded token routed to its experts' devices by all-to-all.
    layout = {} if strategy == "one" else dict(zip(("mesh", "rules"), _layout(strategy),
                                                   strict=True))
    out = ns.inference.generate(model, jnp.asarray(exp["prompt"]),
                                ns.inference.GenerationConfig(max_new_tokens=6), **layout)
    np.testing.assert_array_equal(np.asarray(out)[:, -6:], exp["greedy"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "fsdp", "tp", "ep", "fsdp_ep", "pp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_under_presets(family: str, strategy: str) -> None:
    want = _expected(family)["logits"]
    got = _logits(family, strategy)
    assert np.abs(got - want).max() <= 2e-4 * np.abs(want).max()


@pytest.mark.parametrize("family", FAMILIES)
def test_save_writes_the_checkpoint_back(family: str, tmp_path: pathlib.Path) -> None:
    from safetensors.numpy import load_file

    model = _loaded(family, "one")
    ns.hf.save_safetensors(tmp_path, model)
    want = load_file(FIXTURES / family / "model.safetensors")
    got = load_file(tmp_path / "model.safetensors")
    assert sorted(got) == sorted(want)  # one tensor per expert, under the family's names
    assert all(np.array_equal(got[k], want[k]) for k in want)
    assert DecoderConfig.from_hf(tmp_path) == model.cfg


@pytest.mark.slow
def test_gradients_under_ep_match_one_device() -> None:
    ids = np.tile(_expected("mixtral")["ids"], (4, 1))
    batch = {"inputs": jnp.asarray(ids), "targets": jnp.asarray(ids)}

    def step(model: Decoder, b: dict) -> tuple:
        return nnx.value_and_grad(lambda m: ns.models.lm_loss(m, b))(model)

    s = ns.strategies.get("ep")
    with ns.use(s.mesh_for(8), s.rules):
        loss, grads = nnx.jit(step)(_loaded("mixtral", "ep"), batch)
    want_loss, want = nnx.jit(step)(_loaded("mixtral", "one"), batch)  # eager: op by op
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    got, ref = (np.asarray(g["blocks"][0]["mlp"]["gate"][...]) for g in (grads, want))
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.slow
def test_adamw_steps_under_fsdp_ep_match_one_device() -> None:
    """Three AdamW steps of the Mixtral checkpoint under fsdp_ep (experts over ``expert``,
    every parameter, the experts' too, over ``data`` along ``embed``) give one device's
    losses and weights, in one fused call."""
    import optax

    from tests._close import assert_close
    from tests._lm import lm_batches
    from tests._shared import host, one_device_run

    steps, tx, s = 3, optax.adamw(1e-3), ns.strategies.get("fsdp_ep")
    batches = lm_batches(steps, 8, 12)  # the checkpoint's vocabulary of 128
    mesh = s.make_mesh(8)
    model = ns.hf.load_pretrained(FIXTURES / "mixtral", mesh=mesh, rules=s.rules)
    assert model.blocks[0].mlp.up[...].sharding.spec == jax.P("expert", "data", None)
    assert model.blocks[0].mlp.down[...].sharding.spec == jax.P("expert", None, "data")
    opt = ns.sharded_optimizer(model, tx, mesh, s)

    def step(model: Decoder, opt: nnx.Optimizer, batch: dict) -> jax.Array:
        loss, grads = ns.value_and_grad(ns.models.lm_loss)(model, batch)
        opt.update(model, grads)
        return loss

    with ns.use(mesh, s.rules):
        losses = ns.multistep(step)(model, opt, ns.shard_batch(
            batches, mesh, s.rules, ("batch", "length"), steps=True))
    one = _one()
    want_losses, want = one_device_run(
        lambda: ns.hf.load_pretrained(FIXTURES / "mixtral", mesh=one[0], rules=one[1]),
        ns.models.lm_loss, tx,
        [{k: v[i] for k, v in batches.items()} for i in range(steps)])
    assert_close(np.asarray(losses), want_losses, 1e-4, "loss")
    # Adam moves an element whose gradient is mostly rounding by up to ~lr a step in
    # either run (tests/test_strategies.py's RTOL_PARAMS).
    assert_close(host(nnx.state(model, nnx.Param)), want, 1e-3, "params after 3 steps")
    assert want_losses[-1] < want_losses[0]


def test_lora_adapts_attention_and_refuses_the_experts() -> None:
    cfg = dataclasses.replace(DecoderConfig.from_hf(FIXTURES / "mixtral"), layers=1)
    model = ns.lora(Decoder(cfg, rngs=nnx.Rngs(0)), rank=2, alpha=4.0)
    ids = jnp.asarray(_expected("mixtral")["ids"])
    # The adapted model runs: traced for shapes (no value is checked, so nothing to compute).
    assert nnx.eval_shape(lambda m: m(ids), model).shape == (2, 12, 128)
    with pytest.raises(ns.ShardingError, match="not a 2-D-like projection kernel"):
        ns.lora(Decoder(cfg, rngs=nnx.Rngs(0)), rank=2, alpha=4.0, targets=r"mlp/gate$")


def _ep_tp() -> tuple[str, object]:
    """``ep`` whose experts' mlp columns are also split over ``model``."""
    pairs = [(k, "model" if k == "mlp" else v) for k, v in ns.strategies.get("ep").rules.to_pairs()]
    return "data=2,expert=2,model=2", ns.Rules.from_pairs(pairs)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep", "fsdp_ep", "ep_tp", "ep_ragged_dot"])
def test_expert_parallelism_moves_tokens_with_all_to_all(layout: str) -> None:
    matmul = "ragged_dot" if layout.endswith("ragged_dot") else "tiles"
    layout = layout.removesuffix("_ragged_dot")
    cfg = DecoderConfig.for_model("mixtral", experts=8, top_k=2, layers=1, vocab=64,
                                  expert_matmul=matmul)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 64, (8, 8)))
    batch = {"inputs": ids, "targets": ids}

    def step(m: Decoder, b: dict) -> tuple:
        return nnx.value_and_grad(lambda m: ns.models.lm_loss(m, b))(m)

    want_loss, want = nnx.jit(step)(Decoder(cfg, rngs=nnx.Rngs(0)), batch)
    mesh, rules = _ep_tp() if layout == "ep_tp" else _layout(layout)
    with ns.use(mesh, rules) as m:
        model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), m, rules)
        state = nnx.state(model)
        compiled = jax.jit(lambda s, b: step(nnx.merge(nnx.graphdef(model), s), b)).lower(
            state, batch).compile()
        loss, grads = compiled(state, batch)
        hlo = compiled.as_text()
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    got, ref = (np.asarray(g["blocks"][0]["mlp"]["up"][...]) for g in (grads, want))
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    # Dispatch and combine, forward and backward, each move slots and their tags.
    assert sum(" all-to-all(" in line for line in hlo.splitlines()) >= 4
    # No device gathers every expert: an all-gather's result never has all 8.
    gathers = [line for line in hlo.splitlines() if " all-gather(" in line]
    assert not [g for g in gathers if "[8,32," in g.split("all-gather(")[0]], gathers


@pytest.mark.parametrize("strategy", ["one", "ep"])
def test_scanned_layers_load_and_save_each_experts_tensor(strategy: str,
                                                          tmp_path: pathlib.Path) -> None:
    from safetensors.numpy import load_file

    path = FIXTURES / "mixtral"
    mesh, rules = _one() if strategy == "one" else _layout(strategy)
    cfg = DecoderConfig.from_hf(path, scan_layers=True)
    model = ns.hf.load_safetensors(path, ns.abstract_init(
        lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, rules))
    assert model.blocks.mlp.up.shape == (2, 4, 64, 96)  # [layers, expert, embed, mlp]
    exp = _expected("mixtral")
    with ns.use(mesh, rules):
        got = np.asarray(nnx.jit(lambda m, t: m(t))(model, np.tile(exp["ids"], (4, 1))))
    want = exp["logits"]
    assert np.abs(got[:len(want)] - want).max() <= 2e-4 * np.abs(want).max()
    ns.hf.save_safetensors(tmp_path, model)
    written, source = (load_file(p / "model.safetensors") for p in (tmp_path, path))
    assert sorted(written) == sorted(source)
    assert all(np.array_equal(written[k], source[k]) for k in source)
