"""Where nnx_shard meets JAX and Flax names that differ between the supported versions
(jax 0.10.2 to 0.12.x, flax 0.12.8 to 0.12.12) or that have no public name at all.

Every such name is read here and nowhere else, so a new JAX or Flax release is checked
in one file, and ``tests/test_compat.py`` resolves each one on the installed versions:
when one moves, that test fails naming the name and the version.

- ``ShardingTypeError`` and ``DuplicateSpecError``: what JAX raises when an operation's
  sharding types on Explicit mesh axes do not work out; JAX exports neither.
- ``threefry_lowering_parameters``: lowering parameters that swap JAX's CPU-only
  threefry lowering for its generic one (``jax.interpreters.mlir`` exports the rule
  registry and ``LoweringParameters`` under private names only).
- ``cluster_kinds`` and ``distributed_state``: JAX's cluster detectors and the
  ``jax.distributed`` runtime state, which only ``jax._src`` holds.

Importing this module imports nothing of nnx_shard (it is the bottom floor), so every
module may use it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from typing import Any

__all__ = [
    "FLAX_VERSION",
    "JAX_VERSION",
    "SUPPORTED",
    "DuplicateSpecError",
    "ShardingTypeError",
    "cluster_kinds",
    "distributed_state",
    "private",
    "threefry_lowering_parameters",
]

#: The ranges pyproject.toml allows and CI tests at both ends: (lowest, first excluded).
SUPPORTED = {"jax": ((0, 10, 2), (0, 13)), "flax": ((0, 12, 8), (0, 13))}


def _version(package: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` as ``(0, 12, 0)``: the release's first three numbers."""
    return tuple(int(n) for n in re.findall(r"\d+", importlib.metadata.version(package))[:3])


JAX_VERSION = _version("jax")
FLAX_VERSION = _version("flax")


def _range(package: str) -> str:
    low, high = SUPPORTED[package]
    return f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"


def _moved(what: str) -> ImportError:
    # Not a user's mistake to fix in their input: the installed jax is one whose
    # internals this release of nnx_shard does not know.
    return ImportError(
        f"jax {importlib.metadata.version('jax')} has no {what}, which nnx_shard reads "
        f"(nnx_shard/_compat.py). nnx_shard supports jax{_range('jax')} and "
        f"flax{_range('flax')}. Fix: install a jax in that range, e.g. "
        f"pip install 'jax{_range('jax')}'")


def private(module: str, name: str) -> Any:
    """``module.name`` from JAX's private modules, or an ImportError naming it and the
    installed jax (the supported range too), never a bare AttributeError.

    >>> private("jax._src.core", "ShardingTypeError").__name__
    'ShardingTypeError'
    >>> private("jax._src.core", "NoSuchThing")
    Traceback (most recent call last):
    ...
    ImportError: jax ... has no jax._src.core.NoSuchThing, which nnx_shard reads ...
    """
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise _moved(f"{module}.{name}") from e


# Raised by JAX's sharding-in-types rules on Explicit mesh axes (an operation whose
# operands' shardings do not combine); nnx_shard turns it into a ShardingError naming the
# operation and the fix. In jax._src.core from 0.10.2 through 0.12.
ShardingTypeError: type[Exception] = private("jax._src.core", "ShardingTypeError")
# Raised when an operation's output type would shard two dimensions over one mesh axis,
# e.g. table[(ids,)] with the table and the ids both sharded over 'data'.
DuplicateSpecError: type[Exception] = private("jax._src.named_sharding", "DuplicateSpecError")


def threefry_lowering_parameters() -> Any:
    """Lowering parameters that lower ``threefry2x32`` with JAX's generic rule on CPU too
    (what GPU and TPU use), for ``traced.lower(_private_parameters=...)``.

    The override travels with the one lowering that receives it; JAX's rule registry is
    not touched. Raises ImportError (naming the jax version) where JAX moved the registry.
    """
    from jax.extend.random import threefry2x32_p

    lowerings = private("jax.interpreters.mlir", "_lowerings")
    parameters = private("jax.interpreters.mlir", "LoweringParameters")
    try:
        generic = lowerings[threefry2x32_p].rule
        return parameters(override_lowering_rules=((threefry2x32_p, generic),))
    except (KeyError, AttributeError, TypeError) as e:
        raise _moved("jax.interpreters.mlir._lowerings[threefry2x32_p].rule taken by "
                     "LoweringParameters(override_lowering_rules=...)") from e


def cluster_kinds() -> list[Any]:
    """JAX's cluster detectors (SLURM, Open MPI, Cloud TPU, Kubernetes, ...), in its order.

    ``jax.distributed.initialize`` detects and joins in one call and must come before any
    other JAX call, so it cannot be tried to learn whether this is a single process."""
    kinds = getattr(private("jax._src.clusters", "ClusterEnv"), "_cluster_types", None)
    if not isinstance(kinds, list):
        raise _moved("jax._src.clusters.ClusterEnv._cluster_types (a list)")
    return list(kinds)


def distributed_state() -> Any:
    """The ``jax.distributed`` runtime state (``client``, ``coordinator_address``), which
    ``jax.experimental.multihost_utils`` itself reads from the same private module."""
    return private("jax._src.distributed", "global_state")
