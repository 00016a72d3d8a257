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


def run(args: argparse.Namespace) -> int:
    """Writes the checkpoint and prints its folder.

    >>> import tempfile
    >>> from nnx_shard.cli import main
    >>> main(["tiny-checkpoint", tempfile.mkdtemp(), "--family", "gpt2"])
    2
    """
    from nnx_shard.hf import tiny_checkpoint

    if args.layers is not None and args.layers < 1:
        raise UsageError(f"--layers {args.layers}: must be at least 1, e.g. --layers 2")
    overrides = {} if args.layers is None else {"layers": args.layers}
    out = tiny_checkpoint(args.path, args.family, tokenizer=not args.no_tokenizer,
                          seed=args.seed, **overrides)
    print(f"wrote a tiny {args.family} checkpoint to {out}")
    return 0
