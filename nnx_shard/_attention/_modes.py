"""The context-parallel modes: the values of the execution option ``attention``.

A strategy says how the attention op splits the sequence through its rules
(``Rules.with_options(attention=...)``), never through a model edit:

* ``"local"`` (or no option): no context parallelism. Each device attends the
  queries and keys it holds with the model's kernel.
* ``"ring"``: ring attention over the mesh axes of logical axis ``length``.
* ``"allgather"``: each device gathers the full-length keys and values.

The first value is called ``"local"`` because that is what it means: the work
stays on the device, whichever kernel does it (``"dense"`` names a kernel,
``implementation="dense"``, never a mode).

>>> import nnx_shard as ns
>>> context_mode()                      # outside ns.use: no context parallelism
'local'
>>> with ns.use("data=4,context=2", ns.strategies.get("cp").rules):
...     context_mode()
'ring'
"""

from __future__ import annotations

from nnx_shard._errors import ShardingError, short
from nnx_shard._mesh import option

__all__ = ["LOCAL", "MODES", "OPTION", "context_mode"]

#: The execution option (``Rules.with_options(attention=...)``) the attention op reads.
OPTION = "attention"

#: No context parallelism: what an unset option means.
LOCAL = "local"

#: The values of the ``attention`` execution option.
MODES = (LOCAL, "ring", "allgather")


def context_mode() -> str:
    """The context-parallel mode the active rules ask for: one of :data:`MODES`
    (``"local"`` outside :func:`nnx_shard.use` or without the option).

    Raises:
      ShardingError: the option holds a value that is not a mode.

    >>> import nnx_shard as ns
    >>> rules = ns.Rules({"batch": "data"}).with_options(attention="rings")
    >>> with ns.use("data=8", rules):
    ...     context_mode()
    Traceback (most recent call last):
    ...
    nnx_shard._errors.ShardingError: attention: execution option attention='rings' is not one of ('local', 'ring', 'allgather'). Fix: rules.with_options(attention='ring') or 'allgather' for context parallelism, or attention='local' (the same as leaving it unset) for none.
    """
    mode = option(OPTION)
    if not isinstance(mode, str) or mode not in MODES:
        raise ShardingError(
            f"attention: execution option attention={short(mode, 60)} is not one of {MODES}. "
            "Fix: rules.with_options(attention='ring') or 'allgather' for context "
            "parallelism, or attention='local' (the same as leaving it unset) for none."
        )
    return mode
