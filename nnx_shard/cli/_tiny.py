"""``nnx-shard tiny-checkpoint PATH --family llama``: a tiny Hugging Face checkpoint of
random weights with a tokenizer (:func:`nnx_shard.hf.tiny_checkpoint`), to try the
other commands and the guides on without a download."""

from __future__ import annotations

import argparse

from nnx_shard.cli._common import UsageError
from nnx_shard.models._families import model_types

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``tiny-checkpoint``."""
    p.add_argument("path", help="output folder (created if missing)")
    p.add_argument("--family", default="llama",
                   help=f"model_type: {', '.join(model_types())} (default llama)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="write only config.json and the weights (no tokenizers needed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--layers", type=int, default=None, help="layers (default 2)")


#: How the checks of tiny_checkpoint name this command's arguments.
_FLAGS = {"path": "PATH", "family": "--family", "seed": "--seed", "layers": "--layers",
          "tokenizer": "--no-tokenizer"}


def run(args: argparse.Namespace) -> int:
    """Writes the checkpoint and prints its folder.

    >>> import tempfile
    >>> from nnx_shard.cli import main
    >>> main(["tiny-checkpoint", tempfile.mkdtemp(), "--family", "gpt2"])
    2
    """
    from nnx_shard.hf._export_dir import ExportError
    from nnx_shard.hf._tiny import Names, write_tiny  # the hf package only when it runs

    overrides = {} if args.layers is None else {"layers": args.layers}
    try:
        out = write_tiny(args.path, args.family, tokenizer=not args.no_tokenizer,
                         seed=args.seed, overrides=overrides,
                         names=Names("tiny-checkpoint", _FLAGS))
    except ExportError as e:  # a full disk, or a folder in the way found while writing
        raise UsageError(f"PATH {args.path!r}: {e}") from None
    print(f"wrote a tiny {args.family} checkpoint to {out}")
    return 0

