"""``nnx-shard plan --lora-rank``: the adapters counted, gradients and optimizer
state for them only."""

import json

import pytest

from nnx_shard import cli

LLAMA_8B = ("plan", "--model", "llama3-8b", "--strategy", "fsdp", "--mesh", "data=8",
            "--device-memory", "80GB", "--batch", "8", "--seq", "2048", "--remat", "full",
            "--no-compile", "--json")


def _plan(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_lora_plan_counts_adapter_state_only(capsys):
    code, out, _ = _plan(capsys, *LLAMA_8B, "--lora-rank", "16")
    lora = json.loads(out)
    code_full, out_full, _ = _plan(capsys, *LLAMA_8B)
    full = json.loads(out_full)
    assert code == code_full == 0 and lora["lora_rank"] == 16 and full["lora_rank"] is None
    mine, theirs = lora["bytes_per_device"], full["bytes_per_device"]
    # q and v adapters of 32 layers: A [4096, 16] + B [16, 4096] / [16, 1024], float32
    adapters = 32 * (4096 * 16 + 16 * 4096 + 4096 * 16 + 16 * 1024) * 4
    assert lora["bytes_total"]["params"] - full["bytes_total"]["params"] == adapters
    assert lora["bytes_total"]["optimizer"] == 2 * adapters + 4  # two moments + the count
    assert mine["optimizer"] < theirs["optimizer"] / 100
    assert mine["grads"] < theirs["grads"] / 100
    assert mine["params"] + mine["optimizer"] < 0.4 * (theirs["params"] + theirs["optimizer"])
    assert mine["total"] < theirs["total"]


def test_lora_plan_text_and_targets(capsys):
    code, out, _ = _plan(capsys, *LLAMA_8B[:-1], "--lora-rank", "8", "--lora-targets",
                         r"mlp/(up|down)$")
    assert code == 0
    assert "LoRA rank 8 on mlp/(up|down)$" in out


@pytest.mark.parametrize(("argv", "words"), [
    (("--lora-rank", "0"), "--lora-rank must be a positive int"),
    (("--lora-rank", "4", "--lora-targets", "nothing"), "no parameter path matches"),
    (("--lora-targets", "q$"), "--lora-targets goes with --lora-rank"),
])
def test_lora_plan_errors(capsys, argv, words):
    code, _, err = _plan(capsys, *LLAMA_8B, *argv)
    assert code == 2
    assert words in err and len(err.strip().splitlines()) == 1


ALL_LINEAR = r"attn/(q|k|v|o)$|mlp/(gate|up|down)$"


@pytest.mark.parametrize(("bits", "quantize"), [(8, "int8"), (4, "int4")])
def test_qlora_plan_counts_the_base_quantized(capsys, bits, quantize):
    lora_argv = ("--lora-rank", "16", "--lora-targets", ALL_LINEAR)
    code, out, _ = _plan(capsys, *LLAMA_8B, *lora_argv)
    code_q, out_q, _ = _plan(capsys, *LLAMA_8B, *lora_argv, "--quantize-base", quantize)
    lora, qlora = json.loads(out), json.loads(out_q)
    assert code == code_q == 0 and qlora["quantize_base"] == quantize
    # the 7 projections of 32 layers: bf16 kernels, then packed ints + a float32 scale per
    # block of 64 inputs and output channel (q, k, v, o, gate, up: 4096 inputs in 64 blocks,
    # down: 14336 in 224; outputs 4096, 1024, 1024, 4096, 14336 x 2, 4096)
    kernels = 32 * (4096 * (4096 + 1024 + 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    scales = 32 * (64 * (4096 + 1024 + 1024 + 4096 + 14336 * 2) + 224 * 4096) * 4
    saved = kernels * 2 - (kernels * bits // 8 + scales)
    assert lora["bytes_total"]["params"] - qlora["bytes_total"]["params"] == saved
    assert qlora["bytes_total"]["optimizer"] == lora["bytes_total"]["optimizer"]
    assert qlora["bytes_per_device"]["params"] < lora["bytes_per_device"]["params"]


def test_qlora_plan_text_and_errors(capsys):
    code, out, _ = _plan(capsys, *LLAMA_8B[:-1], "--lora-rank", "8", "--quantize-base", "int4")
    assert code == 0 and "LoRA rank 8 on attn/(q|v)$, base stored int4" in out
    code, _, err = _plan(capsys, *LLAMA_8B, "--quantize-base", "int8")
    assert code == 2 and "--quantize-base goes with --lora-rank" in err
    code, out, _ = _plan(capsys, *LLAMA_8B[:-1], "--lora-rank", "8", "--quantize-base", "nf4",
                         "--quant-block", "128", "--double-quant")
    assert code == 0 and ("base stored nf4 with a scale per 128 inputs, scales in 8 bits"
                          in out)
    code, out, _ = _plan(capsys, *LLAMA_8B, "--lora-rank", "8", "--quantize-base", "int8",
                         "--quant-block", "none")
    plan = json.loads(out)
    assert code == 0 and (plan["quant_block"], plan["double_quant"]) == (None, False)


@pytest.mark.parametrize(("argv", "words"), [
    (("--quantize-base", "int3"), ["--quantize-base must be one of nf4, int4, int8",
                                   "got 'int3'"]),
    (("--quantize-base", "NF4"), ["got 'NF4'"]),
    (("--quantize-base", "nf4", "--quant-block", "0"),
     ["--quant-block must be a positive int or 'none'", "got '0'"]),
    (("--quantize-base", "nf4", "--quant-block", "x"), ["got 'x'"]),
    (("--quantize-base", "nf4", "--quant-block", "\u00b2"), ["--quant-block", "got '\u00b2'"]),
    (("--quantize-base", "nf4", "--quant-block", "\u0663"), ["--quant-block", "got '\u0663'"]),
    (("--quantize-base", "nf4", "--quant-block", "9" * 5000), ["--quant-block must be", "99..."]),
    (("--quantize-base", "nf4", "--quant-block", "100"), ["--quant-block 64", "4096"]),
    (("--quantize-base", "nf4", "--quant-block", "none", "--double-quant"),
     ["--double-quant needs block scales"]),
    (("--quant-block", "64"), ["--quant-block goes with --quantize-base"]),
    (("--double-quant",), ["--double-quant goes with --quantize-base"]),
])
def test_qlora_plan_refuses_bad_quantization(capsys, argv, words):
    code, _, err = _plan(capsys, *LLAMA_8B, "--lora-rank", "8", *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert all(w in err for w in words), err


def _xla_argument_bytes(quant):
    """XLA's per-device argument bytes of the llama-tiny forward under fsdp on 2 devices,
    all seven projections adapted and stored as ``quant`` (lora's keywords), less the
    tokens'."""
    import jax.numpy as jnp
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import Decoder, get_config

    strategy = ns.strategies.get("fsdp")
    mesh = strategy.make_mesh(2)
    # Shapes and layouts are all the compile reads: no weights made (nor quantized).
    model = ns.abstract_init(lambda: ns.lora(Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0)),
                                             4, 8.0, targets=ALL_LINEAR, **quant), mesh, strategy)
    tokens = jnp.zeros((2, 16), jnp.int32)
    with ns.use(mesh, strategy.rules):
        compiled = nnx.jit(lambda m, t: m(t)).lower(model, tokens).compile()
    return compiled.memory_analysis().argument_size_in_bytes - 16 * 4  # a row of tokens


@pytest.mark.slow  # five compilations
def test_qlora_plan_params_are_xla_argument_bytes(capsys):
    """The plan's parameter bytes per device for each storage of the base (nf4, int4,
    int8; block scales, per-channel scales, 8-bit scales) save exactly the bytes XLA's
    compiled forward saves, and stay within 0.5% of its argument bytes."""
    tiny = ("plan", "--model", "llama-tiny", "--strategy", "fsdp", "--mesh", "data=2",
            "--batch", "2", "--seq", "16", "--no-compile", "--json", "--lora-rank", "4",
            "--lora-targets", ALL_LINEAR)
    cases = [((), {}),
             (("nf4", "8"), {"quantize": "nf4", "quant_block": 8}),
             (("nf4", "8", "--double-quant"), {"quantize": "nf4", "quant_block": 8,
                                                "double_quant": True}),
             (("int4", "8"), {"quantize": "int4", "quant_block": 8}),
             (("int8", "none"), {"quantize": "int8", "quant_block": None})]
    saved = []
    for argv, quant in cases:
        flags = ("--quantize-base", argv[0], "--quant-block", *argv[1:]) if argv else ()
        code, out, err = _plan(capsys, *tiny, *flags)
        assert code == 0, err
        plan, xla = json.loads(out)["bytes_per_device"]["params"], _xla_argument_bytes(quant)
        assert abs(plan - xla) <= 0.005 * xla, (argv, plan, xla)
        saved.append((plan, xla))
    (plan0, xla0), rest = saved[0], saved[1:]
    assert [plan0 - p for p, _ in rest] == [xla0 - x for _, x in rest]
    assert all(plan0 - p > 0.3 * plan0 for p, _ in rest)
