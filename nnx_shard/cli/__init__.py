"""The ``nnx-shard`` command: ``demo``, ``plan``, ``explain``, ``generate``, ``launch`` and
``tiny-checkpoint``.

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
* ``nnx-shard explain module:factory`` prints the per-parameter report of your own model
  (it imports your module and calls the factory: your code runs).
* ``nnx-shard generate --model DIR --prompt TEXT`` continues a prompt with a Hugging
  Face checkpoint loaded sharded, printing the text as it streams (see
  :mod:`nnx_shard.cli._generate`).
* ``nnx-shard launch`` starts a local multi-process job (see :mod:`nnx_shard.cli._launch`).
* ``nnx-shard tiny-checkpoint PATH --family llama`` writes a tiny Hugging Face checkpoint of
  random weights with a tokenizer (:func:`nnx_shard.hf.tiny_checkpoint`).

The package is the top floor of nnx_shard: nothing in the library imports it. This
module holds the dispatch table, :data:`COMMANDS`; :mod:`~nnx_shard.cli._parser`
the flags; each command runs from its own module (:mod:`~nnx_shard.cli._demo`,
:mod:`~nnx_shard.cli._plan`, :mod:`~nnx_shard.cli._explain`,
:mod:`~nnx_shard.cli._generate`, :mod:`~nnx_shard.cli._launch`), and
:mod:`~nnx_shard.cli._common` holds what they share.

The demo asks for simulated devices (``jax_num_cpu_devices``) before JAX starts
its backends (importing jax does not start them; the first ``jax.devices()``
does).

>>> from nnx_shard.cli import main
>>> main(["plan", "--model", "tiny", "--mesh", "data=4,model=2", "--batch", "8",
...       "--seq", "16", "--json", "--no-compile"])  # doctest: +ELLIPSIS
{"model": "tiny", ...}
0
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from nnx_shard._errors import ShardingError
from nnx_shard.cli import _demo as demo
from nnx_shard.cli import _explain as explain
from nnx_shard.cli import _generate as generate
from nnx_shard.cli import _launch as launch
from nnx_shard.cli import _plan as plan
from nnx_shard.cli import _tiny as tiny
from nnx_shard.cli._common import DEBUG_ENV, PROG, UsageError
from nnx_shard.cli._parser import build_parser

__all__ = ["main"]

#: Each command's handler: the parsed arguments in, the exit status out.
COMMANDS: dict[str, Callable[[argparse.Namespace], int | None]] = {
    "demo": demo._demo,
    "plan": plan.run,
    "explain": explain.run,
    "generate": generate.run,
    "launch": launch.run,
    "tiny-checkpoint": tiny.run,
}


def _check_out(args: argparse.Namespace) -> None:
    """``--out`` must be a folder or not exist yet; say so before any work is done."""
    out = getattr(args, "out", None)
    if out is None:
        return
    if not out.strip():
        # Path("") is "." : the demo would write its outputs into the current directory.
        raise UsageError(f"--out {out!r} is an empty path; give a folder (created if "
                         "missing), e.g. --out nnx_shard_demo")
    path = Path(out)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"is inside {str(p)!r}, which is a file"
                raise UsageError(f"--out {out!r} {where}; give a folder (created if missing), "
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

    Args:
      argv: the command's arguments (default ``sys.argv[1:]``).

    >>> from nnx_shard.cli import main
    >>> main(["plan", "--model", "huge", "--mesh", "data=8"])
    2
    """
    parser = build_parser()
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        args = parser.parse_args(argv)
        debug = debug or args.debug
        if args.command is None:
            parser.print_help()
            return 2
        _check_out(args)
        return int(COMMANDS[args.command_name](args) or 0)
    except (UsageError, ShardingError, *_USER_OS_ERRORS) as e:
        if debug:
            traceback.print_exception(e)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
