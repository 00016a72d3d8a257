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


def raise_collected(errors: list[str], what: str = "variables") -> None:
    """Raises one ShardingError for every problem found in a pass over a tree, so a
    single run shows every parameter that needs a fix (no-op when ``errors`` is empty)."""
    if len(errors) == 1:
        raise ShardingError(errors[0])
    if errors:
        raise ShardingError(
            f"{len(errors)} {what} cannot be sharded:\n" + "\n".join(f"- {e}" for e in errors)
        )
