"""The ``nnx-shard`` command: ``demo``, ``plan``, ``explain`` and ``launch``.

* ``nnx-shard demo`` trains the reference transformer as a character-level
  language model on the Python standard library's sources, sharded with a
  strategy (``fsdp_tp`` by default), and shows every piece working: the
  sharding report, training with a progress bar, held-out loss against the
  unigram baseline, a loss-curve PNG and a JSON summary, a checkpoint restored
  onto a different mesh and strategy, and a text sample from the restored model.
  With a single device it simulates 8 CPU devices.
* ``nnx-shard plan`` answers "will this model fit on that many devices with that
  strategy?" without allocating anything: it compiles the train step for the mesh
  on as many simulated CPU devices in a subprocess (XLA's per-device bytes decide),
  next to a formula's estimate of parameters, gradients, optimizer state and
  activations.
* ``nnx-shard explain module:factory`` prints the per-parameter report of your own model.
* ``nnx-shard launch`` starts a local multi-process job (see :mod:`nnx_shard.launch`).

This module is the parser and the dispatch: each command runs from its own
module (:mod:`nnx_shard.demo`; :mod:`nnx_shard.commands` for ``plan`` and
``explain``; :mod:`nnx_shard.launch`), imported when the command runs.

The demo asks for simulated devices (``jax_num_cpu_devices``) before JAX starts
its backends (importing jax does not start them; the first ``jax.devices()``
does).

>>> main(["plan", "--model", "tiny", "--mesh", "data=4,model=2", "--batch", "8",
...       "--seq", "16", "--json", "--no-compile"])  # doctest: +ELLIPSIS
{"model": "tiny", ...}
0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["main"]

PROG = "nnx-shard"
_FORCE = "--xla_force_host_platform_device_count"
SIMULATED_DEVICES = 8


class _Usage(Exception):
    """A bad command line: reported as one ``nnx-shard: error: ...`` line, exit 2."""


DEMO_MAX_STEPS = 1_000_000
COMPILE_MAX_DEVICES = 512

DEBUG_ENV = "NNX_SHARD_DEBUG"
_DEBUG_HINT = f"(--debug or {DEBUG_ENV}=1 shows the traceback)"


class _Parser(argparse.ArgumentParser):
    """argparse, with errors on one line (no usage dump) and no exit from inside parsing."""

    def error(self, message: str) -> NoReturn:
        raise _Usage(f"{message} (see '{self.prog} --help')")


def _simulate_devices(n: int = SIMULATED_DEVICES) -> bool:
    """Asks JAX for ``n`` CPU devices unless its backends already started or a
    device count is set; returns whether it did.

    The count only shapes the CPU platform, so on a machine with accelerators it
    changes nothing there; on a laptop it turns one CPU into ``n`` devices.
    """
    if _FORCE in os.environ.get("XLA_FLAGS", "") or os.environ.get("JAX_NUM_CPU_DEVICES"):
        return False
    import jax

    if jax.config.jax_num_cpu_devices >= 0:  # set by the user (config or env at import)
        return False
    try:
        # JAX's public route: importing jax starts no backend; the first
        # jax.devices() does, and from then on this update raises.
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        print(f"{PROG}: JAX already started with {jax.device_count()} device(s), too late to "
              f"simulate {n} CPU devices; run it in a fresh process or set "
              f"JAX_NUM_CPU_DEVICES={n} before the first JAX call", file=sys.stderr)
        return False
    return True




def _parse_bytes(text: str) -> int:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30, ``"512MiB"``, ``"1e9"``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B?|B)?\s*", text)
    if not m:
        raise _Usage(f"--device-memory {text!r} is not a size; use e.g. 80GB, 80GiB or 512MiB")
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    powers = {"B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
              "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    return int(float(m.group(1)) * powers[unit])


def _mesh_sizes(text: str) -> dict[str, int]:
    from nnx_shard.mesh.build import _parse_axes

    sizes = _parse_axes(text)
    if any(v == -1 for v in sizes.values()):
        raise _Usage(f"--mesh {text!r}: give every axis a size (-1 needs real devices)")
    return sizes






def _optimizer(name: str, lr: float = 1e-3) -> Any:
    import optax

    makers = {"adamw": lambda: optax.adamw(lr), "adam": lambda: optax.adam(lr),
              "sgd": lambda: optax.sgd(lr)}
    if name not in makers:
        raise _Usage(f"unknown optimizer {name!r}; known: {', '.join(makers)}")
    return makers[name]()


def _strategy(name: str) -> Any:
    from nnx_shard import strategies

    return strategies.get(name)


# --------------------------------------------------------------------------- plan

















# --------------------------------------------------------------------------- explain










# --------------------------------------------------------------------------- demo














def _finite_positive(text: str) -> float:
    """argparse type of --lr: a finite number > 0 (NaN would train to NaN and save it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; use e.g. --lr 3e-3") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a finite number greater than 0, got {text!r}; use e.g. --lr 3e-3")
    return value


def _finite_non_negative(text: str) -> float:
    """argparse type of --temperature: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"must be a finite number >= 0 (0 for greedy), got {text!r}")
    return value


















# --------------------------------------------------------------------------- main


def _build_parser() -> _Parser:
    parser = _Parser(prog=PROG, description="Sharded training for Flax NNX: demo, memory "
                     "planner, sharding reports and a local multi-process launcher.",
                     epilog="Exit status 2 and one 'nnx-shard: error: ...' line for bad "
                     "input (flags, files, your factory raising); an internal error shows "
                     "its traceback (exit 1).")
    parser.add_argument("--debug", action="store_true",
                        help=f"on bad input, also print the traceback (or set {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    d = sub.add_parser("demo", help="train a sharded char-level transformer on Python's "
                       "standard library, checkpoint, restore on another mesh, sample",
                       description="Train the reference transformer as a character-level LM "
                       "on the Python standard library's sources, sharded with a strategy; "
                       "checkpoint it, restore it onto a different mesh and strategy, and "
                       "sample text from the restored model. With one device, 8 CPU devices "
                       "are simulated.")
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
    d.add_argument("--lr", type=_finite_positive, default=3e-3,
                   help="peak learning rate, a finite number > 0 (default 3e-3)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--evals", type=int, default=8, help="held-out evaluations during training")
    d.add_argument("--restore-strategy", default=None,
                   help="strategy to restore the checkpoint with (default tp, or fsdp after tp)")
    d.add_argument("--restore-mesh", default=None, help="mesh to restore onto (default: the "
                   "restore strategy's shape for the same devices)")
    d.add_argument("--sample-chars", type=int, default=200)
    d.add_argument("--temperature", type=_finite_non_negative, default=0.7,
                   help="sampling temperature, 0 for greedy (default 0.7)")
    d.add_argument("--axis-types", choices=("explicit", "auto"), default=None,
                   help="mesh axis types of the training mesh (default explicit, JAX's "
                   "default)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar on a terminal")
    d.set_defaults(run=_runner("nnx_shard.demo", "_demo"))

    p = sub.add_parser("plan", help="per-device memory of a model under a strategy and mesh, "
                       "without allocating", description="Per-device bytes of parameters, "
                       "gradients, optimizer state and activations of a reference model "
                       "config on any mesh (no devices needed), the largest tensors, and "
                       "whether it fits. Exit status: 0 fits (or no --device-memory), 1 does "
                       "not fit, 2 bad input or a sharding error.")
    p.add_argument("--model", required=True, help="tiny, tiny_moe, small, 125m, 1b, 7b")
    p.add_argument("--mesh", default=None, help="e.g. data=8,model=8 (required without --auto)")
    p.add_argument("--strategy", default="fsdp_tp")
    p.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd")
    p.add_argument("--batch", type=int, default=256, help="global batch (default 256)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    from nnx_shard.models import REMAT_POLICIES

    p.add_argument("--remat", choices=tuple(REMAT_POLICIES), default="none",
                   help="TransformerConfig.remat policy of the compiled model: none (default), "
                   "full, dots, offload (saved activations to pinned host memory)")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the blocks as one scanned layer (default: the model's; "
                   "1b and 7b scan); XLA CPU lowers the temp bytes by remat only when scanned")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the train step on as many simulated CPU devices as the mesh "
                   f"has, in a subprocess (default: yes up to {COMPILE_MAX_DEVICES} devices)")
    p.add_argument("--compile-timeout", type=_finite_positive, default=300.0,
                   help="seconds the compile may take (default 300)")
    p.add_argument("--device-memory", default=None, help="e.g. 80GB (1e9) or 80GiB (2**30)")
    p.add_argument("--top", type=int, default=5, help="largest tensors to list")
    p.add_argument("--json", action="store_true", help="print JSON only")
    a = p.add_argument_group("--auto: choose the strategy, mesh, remat and microbatches")
    a.add_argument("--auto", action="store_true", help="enumerate presets x meshes x remat x "
                   "microbatches for --devices, drop what does not fit, rank the rest by "
                   "predicted step time (--top of them shown)")
    a.add_argument("--devices", type=int, default=None, help="device count to plan for")
    a.add_argument("--hardware", default=None, help="a100-80gb, h100-sxm (default), h200, "
                   "tpu-v5e, tpu-v5p: peak FLOP/s, link bandwidth and memory")
    a.add_argument("--peak-flops", type=_finite_positive, default=None,
                   help="FLOP/s per device (overrides the profile's)")
    a.add_argument("--link-bandwidth", type=_finite_positive, default=None,
                   help="bytes/s per device and direction (overrides the profile's)")
    a.add_argument("--link-latency", type=float, default=None,
                   help="seconds per collective (default 0, or measured by --calibrate)")
    a.add_argument("--calibrate", action="store_true", help="measure this machine's "
                   "matmul FLOP/s and collective bandwidth on --devices simulated devices")
    a.add_argument("--strategies", default=None, help="comma-separated presets to try "
                   "(default all)")
    a.add_argument("--max-compiles", type=int, default=64,
                   help="at most this many compiles (default 64)")
    a.add_argument("--no-cache", action="store_true",
                   help="do not read or write the compile cache (~/.cache/nnx_shard)")
    p.set_defaults(run=_runner("nnx_shard.commands", "_plan"))

    e = sub.add_parser("explain", help="per-parameter sharding report of your model factory",
                       description="Builds module:factory abstractly (nothing allocated) and "
                       "prints how every variable is laid out on the mesh by the rules.")
    e.add_argument("factory", help="module:function (or path/to/file.py:function) returning "
                   "an nnx.Module")
    e.add_argument("--mesh", required=True, help="e.g. data=4,model=2 (any size)")
    e.add_argument("--rules", default=None, help="rules file: .toml, .json or .yaml (a table, or Flax/MaxText [logical, mesh] pairs)")
    e.add_argument("--strategy", default=None, help="a strategy preset instead of --rules")
    e.add_argument("--optimizer", default=None, help="also report this optimizer's state")
    e.add_argument("--markdown", action="store_true")
    e.set_defaults(run=_runner("nnx_shard.commands", "_explain"))

    from nnx_shard import launch

    la = sub.add_parser("launch", help="run N local processes of one multi-process JAX job",
                        description="Run N local processes of one multi-process JAX job on "
                        "loopback, e.g. nnx-shard launch -n 2 -- python train.py")
    launch.add_arguments(la)
    la.set_defaults(run=launch.run)
    for command in sub.choices.values():  # also accepted after the command's name
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="on bad input, also print the traceback")
    return parser


def _runner(module: str, name: str) -> Any:
    """A command's entry point, imported when the command runs: ``nnx-shard --help``
    and the other commands never load the demo's or the planner's modules."""

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), name)(args)

    return run


def _check_out(args: argparse.Namespace) -> None:
    """``--out`` must be a folder or not exist yet; say so before any work is done."""
    out = getattr(args, "out", None)
    if out is None:
        return
    path = Path(out)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"is inside {str(p)!r}, which is a file"
                raise _Usage(f"--out {out!r} {where}; give a folder (created if missing), "
                             "e.g. --out nnx_shard_demo")
            return


# Bad input that surfaces as an exception: a path that is a file, a missing file, a layout
# that does not fit. Anything else is a bug of ours and keeps its traceback.
_USER_OS_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                   PermissionError)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``nnx-shard`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Bad input is one line on stderr, ``nnx-shard: error: ...``, and exit status 2:
    bad flags, paths that are files or missing, sharding errors, and a FACTORY that
    cannot be imported, needs arguments or raises. ``--debug`` (or
    ``NNX_SHARD_DEBUG=1``) adds the traceback. Other exceptions are bugs: their
    traceback is shown as Python shows it.

    >>> main(["plan", "--model", "huge", "--mesh", "data=8"])
    2
    """
    from nnx_shard.errors import ShardingError

    parser = _build_parser()
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        args = parser.parse_args(argv)
        debug = debug or args.debug
        if args.command is None:
            parser.print_help()
            return 2
        _check_out(args)
        return int(args.run(args) or 0)
    except (_Usage, ShardingError, *_USER_OS_ERRORS) as e:
        if debug:
            import traceback

            traceback.print_exception(e)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # ``python -m nnx_shard.cli`` runs this file as ``__main__``; the command modules
    # import ``nnx_shard.cli``, a second copy whose ``_Usage`` this copy would not
    # catch. Run the imported one.
    from nnx_shard.cli import main as _main

    with contextlib.suppress(BrokenPipeError):
        sys.exit(_main())
