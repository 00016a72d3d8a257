"""``nnx-shard plan --factory mod:fn --loss mod:fn --batch-spec ...``: the planner's
search (``--auto``) on the user's own model, its loss and batch, compiled in this
process on ``--devices`` simulated CPU devices. Bad input is one line with a Fix.
"""

from __future__ import annotations

import argparse
from typing import Any

from nnx_shard.cli._common import UsageError, simulate_devices
from nnx_shard.cli._explain import import_factory_module, parse_pairs
from nnx_shard.planner._user import UserModel, parse_batch_spec

__all__ = ["user_model"]


def _load(spec: str, flag: str, example: str) -> Any:
    """``module:function`` -> the function, or a usage line naming ``flag``."""
    mod_name, colon, attr = spec.partition(":")
    if not colon or not mod_name or not attr:
        raise UsageError(f"{flag} {spec!r} is not module:function. Fix: e.g. {flag} {example}")
    obj = import_factory_module(spec, mod_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{flag} {spec!r}: module {mod_name!r} has no attribute {attr!r}. "
                             "Fix: name a function it defines")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{flag} {spec!r} is a {type(obj).__name__}, not a function. Fix: "
                         f"name a function, e.g. {flag} {example}")
    return obj


def user_model(args: argparse.Namespace) -> UserModel:
    """The :class:`~nnx_shard.planner._user.UserModel` of ``--factory``, ``--loss``,
    ``--batch-spec`` and ``--alias``, checked (the loss run abstractly on the batch);
    asks JAX for ``--devices`` simulated CPU devices first, as the candidates compile
    in this process.

    >>> from nnx_shard.cli._parser import build_parser
    >>> args = build_parser().parse_args(["plan", "--auto", "--devices", "2", "--factory",
    ...     "m:f", "--loss", "m:loss", "--batch-spec", "x=int32[8"])
    >>> user_model(args)
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: --batch-spec: batch spec 'x=int32[8': 'x=int32[8' is not name=dtype[dims]. Fix: write name=dtype[dims],... e.g. inputs=int32[16,128],targets=int32[16,128]
    """
    missing = [flag for flag, v in (("--factory", args.factory), ("--loss", args.loss),
                                    ("--batch-spec", args.batch_spec)) if not v]
    if missing:
        raise UsageError(f"your own model needs --factory, --loss and --batch-spec; missing "
                         f"{', '.join(missing)}. Fix: e.g. --factory mymodels:make --loss "
                         "mymodels:loss_fn --batch-spec inputs=int32[16,128],targets=int32[16,128]")
    if args.model is not None:
        raise UsageError("--model names a reference config; --factory is your own model. Fix: "
                         "give one of them")
    if args.devices is None or args.devices < 1:
        raise UsageError("plan --factory searches layouts for --devices N. Fix: e.g. --auto "
                         "--devices 8")
    try:
        spec = parse_batch_spec(args.batch_spec)
    except UsageError as e:
        raise UsageError(f"--batch-spec: {e}") from None
    aliases = parse_pairs(args.alias, "--alias", "fsdp=embed,tp=mlp") if args.alias else None
    simulate_devices(args.devices)  # before the factory or loss starts JAX's backends
    factory = _load(args.factory, "--factory", "mymodels:make_model")
    loss = _load(args.loss, "--loss", "mymodels:loss_fn")
    return UserModel(factory, loss, spec, aliases).check()
