"""The demo's flags checked before JAX starts (one line, exit 2, naming the flag) and the
reference model they configure, refused when its training state would not fit in this
machine's memory.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from nnx_shard.cli._common import DEMO_MAX_STEPS
from nnx_shard.cli._common import UsageError as _Usage

__all__ = ["check_demo_args", "check_size", "demo_config"]


def demo_config(args: argparse.Namespace, strategy_name: str) -> Any:
    """The reference model of the demo's flags (``--experts``: 4 under ``ep``, else 0)."""
    from nnx_shard.corpus import VOCAB
    from nnx_shard.models import ReferenceConfig

    experts = args.experts if args.experts is not None else (4 if strategy_name == "ep" else 0)
    return ReferenceConfig(
        vocab=VOCAB, length=args.seq, embed=args.embed, heads=args.heads,
        head_dim=args.embed // args.heads, mlp=args.mlp, layers=args.layers, experts=experts,
    )


# The demo's integer flags: (attribute, least value, most value or None).
_INT_FLAGS = (
    ("steps", 1, None), ("steps_per_call", 1, None), ("batch", 1, None), ("seq", 1, None),
    ("embed", 1, None), ("heads", 1, None), ("mlp", 1, None), ("layers", 1, None),
    ("experts", 0, None), ("evals", 1, None), ("sample_chars", 0, 100_000),
    ("seed", 0, 2**32 - 1),
)
# Bytes per parameter that training keeps: the parameter, its gradient and AdamW's two
# moments (float32 each); fit's default NaN guard ("grads") keeps no copy of them.
_TRAIN_BYTES_PER_PARAM = 4 * 4


def check_demo_args(args: argparse.Namespace) -> None:
    """The demo's flags that need no devices, checked before JAX starts: one line,
    exit 2, naming the flag (an absent flag is not checked).

    >>> ns = argparse.Namespace(steps=10**12, steps_per_call=25, batch=32, evals=8)
    >>> try:
    ...     check_demo_args(ns)
    ... except _Usage as e:
    ...     print(e)
    --steps 1000000000000 is more than the demo runs (at most 1,000,000, hours on a CPU); ...
    >>> try:
    ...     check_demo_args(argparse.Namespace(heads=0, embed=128))
    ... except _Usage as e:
    ...     print(e)
    --heads 0: must be at least 1
    """
    for name, least, most in _INT_FLAGS:
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if value < least:
            raise _Usage(f"{flag} {value}: must be at least {least}")
        if most is not None and value > most:
            raise _Usage(f"{flag} {value}: must be at most {most:,}")
    steps = getattr(args, "steps", None)
    if steps is not None and steps > DEMO_MAX_STEPS:
        raise _Usage(
            f"--steps {steps} is more than the demo runs (at most {DEMO_MAX_STEPS:,}, "
            "hours on a CPU); use ns.Trainer in your own script for longer runs"
        )
    embed, heads = getattr(args, "embed", None), getattr(args, "heads", None)
    if embed is not None and heads is not None and embed % heads:
        raise _Usage(f"--embed {embed} must divide by --heads {heads}")


def check_size(cfg: Any) -> None:
    """Refuses a model whose training state would not fit in this machine's memory
    (half of it): one line naming the flags, instead of an out-of-memory kill."""
    need = cfg.num_params * _TRAIN_BYTES_PER_PARAM
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - no sysconf
        return
    if need > have / 2:
        raise _Usage(
            f"--embed {cfg.embed} --mlp {cfg.mlp} --layers {cfg.layers} make a model of "
            f"{cfg.num_params:,} parameters; training it needs about {need / 2**30:,.1f} GiB, "
            f"more than half of this machine's {have / 2**30:,.1f} GiB. The demo is for small "
            "models: use ns.Trainer in your own script for big ones"
        )
