"""The execution options: every option a strategy's rules may carry
(:attr:`nnx_shard.Rules.options`) and model code may read (``nnx_shard._mesh.option``),
listed in one table, :data:`OPTIONS`, with its default and what it means.

A sharding-aware op reads its option to learn how the active strategy wants it to
run (ring attention, collective matmuls, a pipeline schedule), so switching strategy
never edits model code. ``Rules(options=...)`` accepts only the names listed here;
an op of one's own adds its row with :func:`declare_option` (what
``nnx_shard._parallel.registry.register`` does for the option the op reads). What
each value means is the reading op's to check, where it reads it, so that its error
names the op.

>>> [(name, OPTIONS[name].default) for name in ("attention", "collective_matmul", "pipeline")]
[('attention', 'local'), ('collective_matmul', None), ('pipeline', None)]
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from nnx_shard._errors import ShardingError, UsageError, short

__all__ = ["OPTIONS", "Option", "check_options", "declare_option", "known_options", "option_row"]


@dataclasses.dataclass(frozen=True)
class Option:
    """One execution option: its ``name`` (the key of ``Rules(options=...)``), the
    ``default`` its reader gets where the rules do not set it, and ``doc``."""

    name: str
    default: Any
    doc: str


#: Every execution option, by name.
OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("attention", "local",
           "how the attention op splits the sequence over the mesh axes of 'length': "
           "'local' (no context parallelism), 'ring' or 'allgather' (strategies cp, fsdp_cp)"),
    Option("collective_matmul", None,
           "projections as ppermute rings overlapping their collectives (strategy async_tp): "
           "True, 'bidirectional' or 'unidirectional'; None or False: plain einsums"),
    Option("pipeline", None,
           "the pipeline Schedule pipeline.scan runs a stacked layer loop with over its "
           "stage axis (strategies pp, pp_fsdp, pp_tp); None: a plain scan"),
    Option("gradients", None,
           "the Rules table value_and_grad lays each gradient out by, inside the compiled "
           "step (strategy zero2: the optimizer state's, so each gradient is reduce-scattered "
           "to the shard its state owns, and microbatch sums are kept sharded); None: where "
           "XLA puts them (like the parameters)"),
)}


def declare_option(name: str, default: Any = None, doc: str = "") -> Option:
    """Adds the row of option ``name`` to :data:`OPTIONS` (a row already there is kept)
    and returns it: what an op registered with
    :func:`nnx_shard._parallel.registry.register` does for the option it reads.

    >>> declare_option("my_op").default, "my_op" in known_options()
    (None, True)
    >>> del OPTIONS["my_op"]  # the table is global: leave it as it was
    """
    return OPTIONS.setdefault(name, Option(name, default, doc or f"read by the op {name!r}"))


def known_options() -> tuple[str, ...]:
    """The option names ``Rules(options=...)`` accepts, sorted.

    >>> import nnx_shard
    >>> [o for o in known_options() if o in ("attention", "collective_matmul", "pipeline")]
    ['attention', 'collective_matmul', 'pipeline']
    """
    return tuple(sorted(OPTIONS))


def option_row(name: Any) -> Option:
    """The row of option ``name``; a name not in :data:`OPTIONS` is a
    :class:`~nnx_shard.UsageError` naming the known ones.

    >>> option_row("attention").default
    'local'
    """
    row = OPTIONS.get(name) if isinstance(name, str) else None
    if row is None:
        raise UsageError(f"option {short(name)} is not an execution option.{_did_you_mean(name)} "
                         f"Known options: {', '.join(known_options())}. Fix: read one of "
                         "those, or declare your op's option with "
                         "nnx_shard._parallel.registry.register(ParallelOp(name, option)).")
    return row


def _did_you_mean(name: Any) -> str:
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, sorted(OPTIONS), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def check_options(options: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """``Rules(options=...)`` checked against :data:`OPTIONS` (and hashable), as sorted
    pairs."""
    if not isinstance(options, Mapping):
        raise ShardingError(f"Rules options must be a mapping of option name to a hashable value, "
                            f"got {type(options).__name__} {short(options)}. Fix: e.g. "
                            "Rules({...}, options={'attention': 'ring'}).")
    for key, value in options.items():
        if not isinstance(key, str):
            raise ShardingError(f"Rules option names must be str, got {short(key)}. Fix: e.g. "
                                "options={'attention': 'ring'}.")
        if key not in OPTIONS:
            raise ShardingError(
                f"Rules option {short(key)} is not an option any operation reads (it would be "
                f"silently ignored).{_did_you_mean(key)} Known options: "
                f"{', '.join(known_options())}. Fix: spell it as one of those; an op of your "
                "own declares its option by registering with "
                "nnx_shard._parallel.registry.register(ParallelOp(name, option))."
            )
        try:
            hash(value)
        except TypeError:
            raise ShardingError(
                f"Rules option {key}={short(value)} is not hashable (rules are hashed into "
                "compiled programs' cache keys). Fix: use a tuple or a frozen dataclass."
            ) from None
    return tuple(sorted(options.items()))
