"""The one exception family of nnx_shard."""

from __future__ import annotations


class ShardingError(ValueError):
    """A sharding problem: bad rules, annotations, mesh or shapes.

    Messages name the parameter path, its shape, its logical names, the rule
    involved and a fix, so the error can be acted on without a debugger.

    >>> issubclass(ShardingError, ValueError)
    True
    """


class ShardingWarning(UserWarning):
    """A sharding choice the user allowed but should know about (e.g. a dimension
    replicated because it does not divide by its mesh axes)."""
