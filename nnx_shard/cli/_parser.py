"""The ``nnx-shard`` command line: every command's flags, parsed into one
namespace whose ``command_name`` names the handler :mod:`nnx_shard.cli` dispatches to.
Errors are one line (a :class:`~nnx_shard._errors.UsageError`), never a usage dump.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import NoReturn

from nnx_shard._train._guard import DEFAULT_GUARD, GUARDS
from nnx_shard.cli import _launch as launch
from nnx_shard.cli import _tiny as tiny
from nnx_shard.cli._common import COMPILE_MAX_DEVICES, DEBUG_ENV, DEMO_MAX_STEPS, PROG, UsageError
from nnx_shard.models import REMAT_POLICIES
from nnx_shard.strategies._strategy import OFFLOADS

__all__ = ["Parser", "build_parser", "finite_non_negative", "finite_positive", "finite_seconds"]


class Parser(argparse.ArgumentParser):
    """argparse, with errors on one line (no usage dump) and no exit from inside parsing."""

    def error(self, message: str) -> NoReturn:
        # argparse quotes the value it refused whole: a value of thousands of characters
        # would make the one-line error as long.
        message = _LONG_QUOTE.sub(lambda m: f"{m.group(1)}...' ({len(m.group(0)) - 2:,} "
                                  "characters)", message)
        raise UsageError(f"{message} (see '{self.prog} --help')")


#: A quoted value over 80 characters in argparse's message: its first 60 kept.
_LONG_QUOTE = re.compile(r"('[^'\n]{60})[^'\n]{21,}'")


def _finite(text: str, ok: Callable[[float], bool], must: str, nan_text: str | None = None
            ) -> float:
    """``text`` as a finite float that is ``ok``, else argparse's error ``must``
    (``nan_text`` instead where ``text`` is no number at all and that has words of its own)."""
    try:
        value = float(text)
    except ValueError:
        if nan_text is not None:
            raise argparse.ArgumentTypeError(nan_text) from None
        value = math.nan
    if not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(must)
    return value


def finite_positive(text: str) -> float:
    """argparse type of --lr: a finite number > 0 (NaN would train to NaN and save it)."""
    return _finite(text, lambda v: v > 0, f"must be a finite number greater than 0, got "
                   f"{text!r}; use e.g. 3e-3 or 120", f"{text!r} is not a number; use e.g. 3e-3")


def finite_non_negative(text: str) -> float:
    """argparse type of --temperature: a finite number >= 0."""
    return _finite(text, lambda v: v >= 0,
                   f"must be a finite number >= 0 (0 for greedy), got {text!r}")


def finite_seconds(text: str) -> float:
    """argparse type of --link-latency: a finite number of seconds >= 0."""
    return _finite(text, lambda v: 0 <= v < 3600, "must be a finite number of seconds >= 0 "
                   f"(and under an hour), got {text!r}; use e.g. 5e-6, or 0 to leave latency out")


def build_parser() -> Parser:
    """The parser of every command; ``args.command_name`` names the one given.

    >>> build_parser().parse_args(["launch", "-n", "2", "--", "python", "x.py"]).command_name
    'launch'
    """
    parser = Parser(prog=PROG, description="Sharded training for Flax NNX: demo, memory "
                     "planner, sharding reports, text generation and a local multi-process "
                     "launcher.",
                     epilog="Exit status 2 and one 'nnx-shard: error: ...' line for bad "
                     "input (flags, files, your factory raising); an internal error shows "
                     "its traceback (exit 1).")
    parser.add_argument("--debug", action="store_true",
                        help=f"on bad input, also print the traceback (or set {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    _add_demo(sub)
    _add_plan(sub)
    _add_explain(sub)
    _add_generate(sub)
    la = sub.add_parser("launch", help="run N local processes of one multi-process JAX job",
                        description="Run N local processes of one multi-process JAX job on "
                        "loopback, e.g. nnx-shard launch -n 2 -- python train.py")
    launch.add_arguments(la)
    tiny.add_arguments(sub.add_parser(
        "tiny-checkpoint", help="write a tiny Hugging Face checkpoint of random weights",
        description="Writes a tiny Hugging Face checkpoint (config.json, model.safetensors "
        "and a tokenizer with a chat template) of random weights: something to try generate, "
        "fine-tuning and the guides on without a download."))
    for name, command in sub.choices.items():
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="on bad input, also print the traceback")
        # launch's own ``command`` (what its processes run) overwrites args.command.
        command.set_defaults(command_name=name)
    return parser



def _command(sub: argparse._SubParsersAction[Parser], name: str, summary: str,
             description: str) -> Parser:
    """The parser of the command ``name``: ``summary`` in the list of commands, and
    ``description`` in its own help, each prose with its line breaks made spaces."""
    return sub.add_parser(name, help=" ".join(summary.split()),
                          description=" ".join(description.split()))

def _add_demo(sub: argparse._SubParsersAction[Parser]) -> None:
    d = _command(sub, "demo", """train a sharded char-level transformer on Python's standard
        library, checkpoint, restore on another mesh, sample""", """
        Train the reference transformer as a character-level LM on the Python standard
        library's sources, sharded with a strategy; checkpoint it, restore it onto a
        different mesh and strategy, and sample text from the restored model. With one
        device, 8 CPU devices are simulated.""")
    d.add_argument("--strategy", default="fsdp_tp", help="dp, zero1, fsdp, tp, fsdp_tp (default), sp, ep")
    d.add_argument("--mesh", default=None, help="e.g. data=4,model=2 (default: the strategy's "
                   "shape for all devices)")
    d.add_argument("--steps", type=int, default=1000,
                   help=f"training steps (default 1000, at most {DEMO_MAX_STEPS:,})")
    d.add_argument("--steps-per-call", type=int, default=25,
                   help="steps fused into one compiled call (default 25)")
    d.add_argument("--out", default="nnx_shard_demo",
                   help="output folder for loss.png, summary.json, checkpoint/ (default ./nnx_shard_demo)")
    d.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    d.add_argument("--seq", type=int, default=64, help="characters per sequence (default 64)")
    d.add_argument("--embed", type=int, default=128)
    d.add_argument("--heads", type=int, default=4)
    d.add_argument("--mlp", type=int, default=512)
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--experts", type=int, default=None,
                   help="mixture-of-experts MLP (default: 4 with --strategy ep, else dense)")
    d.add_argument("--lr", type=finite_positive, default=3e-3,
                   help="peak learning rate, a finite number > 0 (default 3e-3)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--evals", type=int, default=8, help="held-out evaluations during training")
    d.add_argument("--restore-strategy", default=None,
                   help="strategy to restore the checkpoint with (default tp, or fsdp after tp)")
    d.add_argument("--restore-mesh", default=None, help="mesh to restore onto (default: the "
                   "restore strategy's shape for the same devices)")
    d.add_argument("--sample-chars", type=int, default=200)
    d.add_argument("--temperature", type=finite_non_negative, default=0.7,
                   help="sampling temperature, 0 for greedy (default 0.7)")
    d.add_argument("--axis-types", choices=("explicit", "auto"), default=None,
                   help="mesh axis types of the training mesh (default explicit, JAX's "
                   "default)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar on a terminal")


_DTYPES = ("float32", "bfloat16")


def _add_plan(sub: argparse._SubParsersAction[Parser]) -> None:
    p = _command(sub, "plan", "per-device memory of a model under a strategy and mesh, without "
                 "allocating", """
        Per-device bytes of parameters, gradients, optimizer state and activations of a
        reference model config on any mesh (no devices needed), the largest tensors, and
        whether it fits. Exit status: 0 fits (or no --device-memory), 1 does not fit, 2
        bad input or a sharding error.""")
    p.add_argument("--model", default=None,
                   help="tiny, tiny_moe, small, 125m, 1b, 7b (the reference transformer); "
                        "llama3-8b, llama3-70b, llama3-405b, qwen3-0.6b, mistral-7b, "
                        "qwen2.5-7b, gemma2-9b, and the mixtures of experts mixtral-8x7b "
                        "and qwen3-30b-a3b (the Llama family); or "
                        "--factory for your own model")
    p.add_argument("--mesh", default=None, help="e.g. data=8,model=8 (required without --auto)")
    p.add_argument("--strategy", default="fsdp_tp")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="plan LoRA fine-tuning: adapters of this rank on --lora-targets, "
                        "gradients and optimizer state for the adapters only")
    p.add_argument("--lora-targets", default=None,
                   help=r"regex over parameter paths of the adapted kernels (default "
                        r"'attn/(q|v)$', PEFT's for Decoder)")
    p.add_argument("--quantize-base", default=None, metavar="{nf4,int4,int8}",
                   help="with --lora-rank, plan QLoRA: the adapted kernels' frozen base stored "
                        "nf4 (QLoRA's 4-bit NormalFloat), int4 or int8 with float32 absmax "
                        "scales per --quant-block inputs and output channel (needs qwix)")
    p.add_argument("--quant-block", default=None, metavar="N|none",
                   help="with --quantize-base: entries of the last input axis per scale "
                        "(default 64, QLoRA's), or 'none' for one scale per output channel")
    p.add_argument("--double-quant", action="store_true",
                   help="with --quantize-base: store the block scales in 8 bits too (QLoRA's "
                        "double quantization)")
    p.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd")
    p.add_argument("--guard", choices=GUARDS, default=DEFAULT_GUARD,
                   help=f"Trainer.fit's NaN guard: {DEFAULT_GUARD} (default, Trainer's: no copy "
                   "of the state), full (keeps one more copy of the parameters and optimizer "
                   "state per device to undo any non-finite step) or off")
    p.add_argument("--batch", type=int, default=256, help="global batch (default 256)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--remat", choices=tuple(REMAT_POLICIES), default="none",
                   help="ReferenceConfig.remat policy of the compiled model: none (default), "
                   "full, dots, offload (saved activations to pinned host memory)")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the blocks as one scanned layer (default: the model's; "
                   "1b and 7b scan); XLA CPU lowers the temp bytes by remat only when scanned")
    p.add_argument("--param-dtype", choices=_DTYPES, default=None,
                   help="dtype of the parameters, the master weights (default: the model's; "
                   "the llama3/qwen3 configs and 1b/7b are bfloat16)")
    p.add_argument("--compute-dtype", choices=_DTYPES, default=None,
                   help="dtype the model computes in (default: the model's). With "
                   "--param-dtype float32 --compute-dtype bfloat16: mixed precision, the "
                   "trainer's ns.Precision; the formula adds the bfloat16 copy of the weights")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the train step on as many simulated CPU devices as the mesh "
                   f"has, in a subprocess (default: yes up to {COMPILE_MAX_DEVICES} devices)")
    p.add_argument("--compile-timeout", type=finite_positive, default=300.0,
                   help="seconds the compile may take (default 300)")
    p.add_argument("--device-memory", default=None, help="e.g. 80GB (1e9) or 80GiB (2**30)")
    p.add_argument("--offload", choices=OFFLOADS[1:], default=None,
                   help="keep the optimizer state (optimizer) or it and the parameters "
                   "(optimizer+params) in host memory between steps (Strategy.with_offload): "
                   "device and host bytes are shown apart. With --auto: not given, the search "
                   "turns it on where nothing fits without it")
    p.add_argument("--host-memory", default=None,
                   help="host memory per device the offloaded state may take, e.g. 256GB "
                   "(default: not checked; with --auto, the --hardware profile's)")
    p.add_argument("--top", type=int, default=5, help="largest tensors to list")
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--generate", action="store_true",
                   help="plan text generation (nnx_shard.inference.generate) instead of training: "
                   "parameters plus the key/value cache per device for --batch sequences of "
                   "--seq positions (prompt + new tokens), laid out by the strategy's rules")
    _add_auto(p)
    _add_own(p)


def _add_own(p: Parser) -> None:
    o = p.add_argument_group("your own model (with --auto --devices N; compiled in this process)")
    o.add_argument("--factory", default=None, help="module:function (or path/to/file.py:"
                   "function) returning your nnx.Module")
    o.add_argument("--loss", default=None, help="module:function, loss(model, batch) -> scalar")
    o.add_argument("--batch-spec", default=None, help="one step's global batch, "
                   "name=dtype[dims],... e.g. inputs=int32[16,128],targets=int32[16,128] (the "
                   "first dim of each the global batch; a.b=... nests)")
    o.add_argument("--alias", default=None, help="model names resolved as the presets' own "
                   "names, e.g. fsdp=embed,tp=mlp (Strategy.with_rules)")


def _add_auto(p: Parser) -> None:
    a = p.add_argument_group("--auto: choose the strategy, mesh, remat and microbatches")
    a.add_argument("--auto", action="store_true", help="enumerate presets x meshes x remat x "
                   "microbatches for --devices, drop what does not fit, rank the rest by "
                   "predicted step time (--top of them shown)")
    a.add_argument("--devices", type=int, default=None, help="device count to plan for")
    a.add_argument("--hardware", default=None, help="a100-80gb, h100-sxm (default), h200, "
                   "tpu-v5e, tpu-v5p: peak FLOP/s, link bandwidth and memory")
    a.add_argument("--peak-flops", type=finite_positive, default=None,
                   help="FLOP/s per device (overrides the profile's)")
    a.add_argument("--link-bandwidth", type=finite_positive, default=None,
                   help="bytes/s per device and direction (overrides the profile's)")
    a.add_argument("--link-latency", type=finite_seconds, default=None,
                   help="seconds per collective (default 0, or measured by --calibrate)")
    a.add_argument("--calibrate", action="store_true", help="measure this machine's "
                   "matmul FLOP/s and collective bandwidth on --devices simulated devices")
    a.add_argument("--strategies", default=None, help="comma-separated presets to try "
                   "(default all)")
    a.add_argument("--max-compiles", type=int, default=64,
                   help="at most this many compiles (default 64)")
    a.add_argument("--no-cache", action="store_true",
                   help="do not read or write the compile cache (~/.cache/nnx_shard)")


def _add_explain(sub: argparse._SubParsersAction[Parser]) -> None:
    e = _command(sub, "explain", "per-parameter sharding report of your model factory (imports "
                 "and runs your module)", """
        Imports the module (running its top-level code) and calls the factory under
        nnx.eval_shape (no parameter array allocated), then prints how every variable is
        laid out on the mesh by the rules. The module is found on sys.path, then in the
        current directory (searched last); a path/to/file.py is run as given.""")
    e.add_argument("factory", help="module:function (or path/to/file.py:function) returning "
                   "an nnx.Module")
    e.add_argument("--mesh", required=True, help="e.g. data=4,model=2 (any size)")
    for flag, text in [
        ("--rules", "rules file: .toml, .json or .yaml (a table, or Flax/MaxText [logical, "
         "mesh] pairs)"),
        ("--strategy", "a strategy preset instead of --rules"),
        ("--alias", "model names resolved as the rules' own names, e.g. fsdp=embed,tp=mlp "
         "(Strategy.with_rules / Rules.alias)"),
        ("--rules-extra", "rules laid over the table (and the optimizer's), e.g. "
         "norm=none,fsdp=data or fsdp=data+model (a product)"),
        ("--optimizer", "also report this optimizer's state"),
    ]:
        e.add_argument(flag, default=None, help=text)
    e.add_argument("--markdown", action="store_true")
    e.add_argument("--generate", action="store_true",
                   help="also report the key/value cache nnx_shard.inference.generate allocates "
                   "(the model needs init_cache and decode) for --batch x --seq")
    e.add_argument("--batch", type=int, default=None,
                   help="with --generate: sequences generated at once")
    e.add_argument("--seq", type=int, default=None,
                   help="with --generate: positions per sequence (prompt + new tokens)")


def _add_generate(sub: argparse._SubParsersAction[Parser]) -> None:
    g = _command(sub, "generate", "continue a prompt with a Hugging Face checkpoint, sharded, "
                 "printing the text as it is decoded", """
        Loads a Hugging Face checkpoint (nnx_shard.hf.load_pretrained) laid out by a
        strategy on a mesh, encodes the prompt with its tokenizer.json (pip install
        'nnx_shard[text]') and prints the continuation as it streams, up to
        --max-new-tokens or the end-of-sequence token. The settings are the checkpoint's
        generation_config.json where it has one, each flag given replacing its value.""")
    g.add_argument("--model", required=True, help="checkpoint folder (config.json and "
                   "*.safetensors, as save_pretrained writes it)")
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--tokenizer", default=None,
                   help="folder with tokenizer.json (default: the --model folder)")
    g.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate at most (default 64)")
    g.add_argument("--temperature", type=finite_non_negative, default=None,
                   help="0 for greedy, above 0 samples (default: the checkpoint's "
                   "generation_config.json, else greedy)")
    kind: type
    for flag, kind, text in [  # None: the checkpoint's generation_config.json decides
        ("--top-k", int, "sample among the k most likely (0: all; default 50)"),
        ("--top-p", float, "nucleus sampling, in (0, 1]"),
        ("--min-p", float, "min-p sampling, in [0, 1]"),
        ("--repetition-penalty", float, "above 1 discourages repeats (default off)"),
        ("--min-new-tokens", int, "tokens before the end-of-sequence token may end the text"),
        ("--no-repeat-ngram-size", int, "n: no n-gram of tokens occurs twice (default 0: off)"),
    ]:
        g.add_argument(flag, type=kind, default=None, help=text)
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop once the text contains TEXT (repeat for several)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    g.add_argument("--chat", action="store_true",
                   help="render the prompt as a user message with the chat template")
    g.add_argument("--strategy", default="tp",
                   help="dp, fsdp, tp (default), fsdp_tp, ...: how the weights are laid out")
    g.add_argument("--mesh", default=None,
                   help="e.g. data=2,model=4 (default: the strategy's shape for all devices)")
    g.add_argument("--chunk", type=int, default=8,
                   help="tokens decoded per compiled call between prints (default 8)")
