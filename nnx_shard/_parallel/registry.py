"""What the parallel ops tell the generic training code, which knows none of them by name.

Each sharding-aware op (:mod:`~nnx_shard._attention` attention, the
:mod:`~nnx_shard._parallel.pipeline`, :mod:`~nnx_shard._parallel.collective_matmul`)
runs the way an execution option of the active rules asks
(:meth:`nnx_shard.Rules.with_options`). On import it registers a
:class:`ParallelOp`: the option key it reads and, where training has to take
part, a hook:

* ``check_step(fn_name)``: a context manager the fused step
  (:func:`nnx_shard.multistep`) enters around every step it traces (see
  :func:`checking_step`). Ring attention raises there when its option asked for
  context parallelism but the step never called it.
* ``microbatched(grad_fn, m, model, batch, *args)``: computes one step's
  gradients over ``m`` microbatches itself, in place of the accumulation loop of
  :func:`nnx_shard.value_and_grad`, while its option is set (see
  :func:`microbatch_owner`). The pipeline runs the microbatches through its
  stages inside one forward pass.
* ``prepare(nodes)``: called on the NNX objects of every traced fused step
  (the step's own copy) before the step runs, while its option is set (see
  :func:`prepare_step`). Collective matmuls set the projection op of the stock
  layers there (:mod:`~nnx_shard._parallel.tp_layers`).

A new op registers here instead of being imported by the fused step.

>>> import nnx_shard  # the ops register when the package loads
>>> sorted((op.name, op.option) for op in registered())
[('attention', 'attention'), ('collective_matmul', 'collective_matmul'), ('pipeline', 'pipeline')]
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from nnx_shard._mesh import option
from nnx_shard._rules import declare_option

__all__ = ["ParallelOp", "checking_step", "microbatch_owner", "prepare_step", "register",
           "registered"]


@dataclasses.dataclass(frozen=True)
class ParallelOp:
    """One op's entry (see the module docs).

    Attributes:
      name: the op's name (one entry per name: registering it again replaces it).
      option: the key of the execution option it reads.
      check_step: entered around every traced fused step, with the step's name.
      microbatched: ``(grad_fn, m, model, batch, *args) -> (out, grads)``, the
        step's gradients over ``m`` microbatches while ``option`` is set.
      prepare: ``(nodes) -> None``, edits the traced step's copy of its NNX objects
        while ``option`` is set.
    """

    name: str
    option: str
    check_step: Callable[[str], AbstractContextManager[Any]] | None = None
    microbatched: Callable[..., tuple[Any, Any]] | None = None
    prepare: Callable[[Any], None] | None = None


_OPS: dict[str, ParallelOp] = {}


def register(op: ParallelOp) -> ParallelOp:
    """Adds ``op`` (replacing an entry of the same name) and returns it; its option
    becomes a name ``Rules(options=...)`` accepts."""
    declare_option(op.option)
    _OPS[op.name] = op
    return op


def registered() -> tuple[ParallelOp, ...]:
    """Every registered op, in registration order."""
    return tuple(_OPS.values())


@contextlib.contextmanager
def checking_step(fn_name: str) -> Iterator[None]:
    """Enters every registered ``check_step`` around the block (a traced step).

    >>> with checking_step("my_step"):
    ...     pass
    """
    with contextlib.ExitStack() as stack:
        for op in _OPS.values():
            if op.check_step is not None:
                stack.enter_context(op.check_step(fn_name))
        yield


def prepare_step(nodes: Any) -> None:
    """Runs every registered ``prepare`` whose option the active rules set on ``nodes``
    (the NNX objects a traced step was given).

    >>> from flax import nnx
    >>> prepare_step([nnx.Linear(2, 2, rngs=nnx.Rngs(0))])  # no rules active: nothing
    """
    for op in _OPS.values():
        if op.prepare is not None and option(op.option) not in (None, False):
            op.prepare(nodes)


def microbatch_owner() -> ParallelOp | None:
    """The registered op that takes the microbatches over under the active rules (its
    option is set and it has ``microbatched``), or ``None``.

    >>> import nnx_shard as ns
    >>> microbatch_owner() is None
    True
    >>> with ns.use("stage=4,data=2", ns.strategies.get("pp").rules):
    ...     microbatch_owner().name
    'pipeline'
    """
    for op in _OPS.values():
        if op.microbatched is not None and option(op.option) is not None:
            return op
    return None
