"""``nnx-shard plan --model`` of the named mixtures of experts of the Llama family
(``mixtral-8x7b``, ``qwen3-30b-a3b``): their parameter bytes are the model's, and the
activation formula counts each token's ``top_k`` experts at the experts' own width."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard import cli
from nnx_shard.models import DecoderConfig, get_config
from nnx_shard.models._memory import activation_bytes
from nnx_shard.models._named import build

MOE = ["mixtral-8x7b", "qwen3-30b-a3b"]


def _plan(capsys, *argv):
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _param_bytes(name: str) -> tuple[int, int]:
    """The built model's parameter count and bytes, from its abstract arrays."""
    model = nnx.eval_shape(lambda: build(get_config(name), nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return (sum(math.prod(x.shape) for x in leaves),
            sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves))


@pytest.mark.parametrize("name", MOE)
def test_plan_of_a_named_moe_has_the_models_parameter_bytes(capsys, name):
    count, nbytes = _param_bytes(name)
    code, out, err = _plan(capsys, "--model", name, "--mesh", "data=4,model=2", "--batch", "8",
                           "--seq", "128", "--json", "--no-compile")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["num_params"] == count == get_config(name).num_params
    assert plan["bytes_total"]["params"] == nbytes == 2 * count  # bfloat16
    # fsdp_tp splits every expert matrix over all 8 devices; the norms only over data.
    per = plan["bytes_per_device"]
    assert per["params"] == pytest.approx(nbytes / 8, rel=0.01)
    assert per["optimizer"] == pytest.approx(2 * nbytes / 8, rel=0.01)  # adamw's mu, nu
    cfg = get_config(name)
    rules = ns.strategies.get("fsdp_tp").rules
    assert per["activations"] == activation_bytes(cfg, rules, {"data": 4, "model": 2}, 8, 128)


@pytest.mark.parametrize("name", MOE)
def test_plan_of_a_named_moe_prints_its_experts(capsys, name):
    code, out, err = _plan(capsys, "--model", name, "--mesh", "data=4,model=2", "--batch", "8",
                           "--seq", "128", "--no-compile")
    assert code == 0, err
    assert f"plan: model {name} (" in out
    assert "blocks/mlp/gate" in out and "P(None, None, 'data', 'model')" in out


def test_activation_formula_counts_top_k_experts_at_their_width():
    # embed 32, 4 heads / 2 kv heads x 8, vocab 128, float32; 4 experts of width 16, top 2
    cfg = DecoderConfig.for_model("qwen3_moe", experts=4, top_k=2, moe_mlp=16, mlp=64)
    tokens = 4 * 16 // 2            # batch over data=2
    p = 4
    attn = 4 * 32 + 2 * 4 * 8 + 2 * 2 * 8 + (4 * 8 + 2 * 8)   # norms, q/o, k/v, q/k norms
    moe = p * (attn + 4 * 2 * 16) + 4 * 4      # SwiGLU 4 x (top_k x moe_mlp); log-sum-exp
    dense = p * (attn + 4 * 64) + 4 * 4        # a layer of mlp_only_layers: SwiGLU 4 x mlp
    edges = 2 * p * 32 + 8 * 128
    rules = ns.Rules({"batch": "data"})
    assert activation_bytes(cfg, rules, {"data": 2}, 4, 16) == tokens * (2 * moe + edges)
    mixed = dataclasses.replace(cfg, mlp_only_layers=(1,))
    assert activation_bytes(mixed, rules, {"data": 2}, 4, 16) == tokens * (moe + dense + edges)
    # Expert parallelism (experts over expert=2, which also splits the tokens): each
    # device computes min(2 x top_k, experts) = 4 slots per local token, the receive
    # buffer's room for every peer's slots. A token's rows: (data x expert) = 4 devices.
    # While a layer runs, its dispatch and combine buffers: over those 4 receive rows,
    # embed-wide, 3 in the compute dtype and 6 in 32 bits, and 3 x 32 bits over each of
    # the top_k slots; more than the logits' edges, which are not alive then.
    ep = ns.Rules({"expert": "expert", "batch": ("data", "expert")})
    wide = p * (attn + 4 * 4 * 16) + 4 * 4
    dispatch = 32 * (4 * (3 * p + 6 * 4) + 2 * 3 * 4)
    assert dispatch > edges
    assert activation_bytes(cfg, ep, {"data": 2, "expert": 2}, 4, 16) == (
        4 * 16 // 4 * (2 * wide + dispatch))


@pytest.mark.slow
def test_compiled_plan_of_mixtral_holds_the_formulas_parameters(capsys):
    _, nbytes = _param_bytes("mixtral-8x7b")
    code, out, err = _plan(capsys, "--model", "mixtral-8x7b", "--mesh", "data=4,model=2",
                           "--batch", "8", "--seq", "128", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["decided_by"] == "compiled"
    assert plan["compiled"]["params"] == pytest.approx(nbytes / 8, rel=0.01)
    assert plan["compiled"]["total"] >= plan["bytes_per_device"]["params"] * 3
