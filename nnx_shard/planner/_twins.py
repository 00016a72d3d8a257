"""Candidates that compile to the same program, known before compiling them.

Two layouts of a reference model give XLA the same program when every array the
step holds or computes is split the same way over the same groups of devices: ``ep``
on a dense model is ``dp`` (nothing names ``expert``), ``fsdp_tp data=1,model=8`` is
``tp data=1,model=8`` (FSDP over one device splits nothing). :func:`signature` is that
layout in a form where such twins are equal: each array's ``PartitionSpec`` as the
rules resolve it, with mesh axes of size 1 dropped, neighbouring mesh axes that every
array uses together (and in mesh order) merged into one (``("data", "expert")`` on
``data=2,expert=4`` splits like ``data=8``), and the axes then numbered. The arrays
are the parameters and optimizer state (their report rows) and the activations the
reference models lay out by name (:data:`ACTIVATIONS`, and :data:`MOE_ACTIVATIONS` for
a mixture of experts). A preset with execution
options (a ring, a pipeline, collective matmuls) changes the program beyond its
layouts and has no signature.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Sequence
from typing import Any

from nnx_shard._axes import abstract_mesh, entry_axes
from nnx_shard._errors import ShardingError

__all__ = ["ACTIVATIONS", "MOE_ACTIVATIONS", "activation_entries", "signature"]

#: The logical names the decoder (``Decoder``, every family) give their
#: activations when no execution option is set, with each dimension's size: ``B``
#: the global batch, ``b`` a microbatch, ``S`` the sequence, ``E`` embed, ``H`` heads,
#: ``G`` key/value heads, ``K`` head_dim, ``M`` mlp, ``V`` vocab, ``X`` experts.
ACTIVATIONS: tuple[tuple[tuple[str | None, ...], tuple[str, ...]], ...] = (
    ((None, "batch", "length"), ("1", "B", "S")),          # the step's tokens
    (("batch", "length", None), ("b", "S", "E")),          # the residual stream
    (("batch", None, None), ("b", "S", "E")),              # a block's gathered input
    (("batch", None, "heads", "kv"), ("b", "S", "H", "K")),
    (("batch", None, "kv_heads", "kv"), ("b", "S", "G", "K")),
    (("batch", None, "mlp"), ("b", "S", "M")),
    (("batch", None, "vocab"), ("b", "S", "V")),
    (("batch", None), ("b", "S")),                         # the targets
    (("batch", "length"), ("b", "S")),
)

#: Those of a mixture-of-experts layer's dispatch (models with ``experts``).
MOE_ACTIVATIONS: tuple[tuple[tuple[str | None, ...], tuple[str, ...]], ...] = (
    (("expert", "batch", None, None), ("X", "b", "S", "E")),
    (("expert", "batch", None, "mlp"), ("X", "b", "S", "M")),
    (("batch", None, None, None), ("b", "S", "X", "S")),
)


def _sizes(cfg: Any, batch: int, seq: int, microbatches: int) -> dict[str, int]:
    # Only a model with mixture-of-experts layers has the experts' dimension (and only
    # its configs count experts: a dense DecoderConfig has no such field).
    return {"1": 2, "B": batch, "b": max(1, batch // microbatches), "S": seq, "E": cfg.embed,
            "H": cfg.heads, "G": cfg.kv_heads, "K": cfg.head_dim, "M": cfg.mlp, "V": cfg.vocab,
            "X": cfg.experts if any(cfg.moe_layers()) else 1}


def activation_entries(strategy: Any, sizes: dict[str, int], cfg: Any, *, batch: int, seq: int,
                       microbatches: int) -> list[tuple[tuple[str, ...], ...]]:
    """The mesh axes of each dimension of the activations a reference model lays out by
    name (:data:`ACTIVATIONS`, :data:`MOE_ACTIVATIONS` with experts) under ``strategy``
    on ``sizes``; a :class:`~nnx_shard._errors.ShardingError` where the rules refuse one.

    >>> from nnx_shard.models import get_config
    >>> from nnx_shard.strategies._presets import get
    >>> activation_entries(get("dp"), {"data": 4}, get_config("tiny"), batch=8, seq=16,
    ...                    microbatches=1)[0]
    ((), ('data',), ())
    """
    dims = _sizes(cfg, batch, seq, microbatches)
    mesh = abstract_mesh(dict(sizes))
    moe = MOE_ACTIVATIONS if any(cfg.moe_layers()) else ()
    entries = []
    for names, shape_of in (*ACTIVATIONS, *moe):
        shape = tuple(dims[d] for d in shape_of)
        spec = strategy.rules.spec(names, shape=shape, mesh=mesh)
        entries.append(tuple(entry_axes(e) for e in spec))
    return entries


def _canonical(sizes: dict[str, int], entries: list[tuple[tuple[str, ...], ...]]
               ) -> tuple[tuple[int, ...], tuple[tuple[tuple[int, ...], ...], ...]]:
    """The mesh sizes and the entries with size-1 axes dropped, axes always used
    together merged, and axes numbered."""
    axes = [a for a, n in sizes.items() if n > 1]
    size = {a: n for a, n in sizes.items() if n > 1}
    specs = [tuple(tuple(a for a in e if a in size) for e in spec) for spec in entries]
    merged = True
    while merged:
        merged = False
        for a, b in itertools.pairwise(axes):
            together = all(
                (a in e) == (b in e) and (a not in e or e.index(b) == e.index(a) + 1)
                for spec in specs for e in spec)
            if not together:
                continue
            ab = f"{a}*{b}"
            size[ab] = size.pop(a) * size.pop(b)
            axes[axes.index(a):axes.index(b) + 1] = [ab]
            specs = [tuple(tuple(x for y in e for x in ((ab,) if y == a else () if y == b
                                                        else (y,))) for e in spec)
                     for spec in specs]
            merged = True
            break
    number = {a: i for i, a in enumerate(axes)}
    return (tuple(size[a] for a in axes),
            tuple(tuple(tuple(number[a] for a in e) for e in spec) for spec in specs))


def signature(strategy: Any, sizes: dict[str, int], rows: Sequence[Any], cfg: Any, *,
              batch: int, seq: int, microbatches: int, remat: Any) -> Hashable | None:
    """What decides the program of a reference model's train step under ``strategy`` on
    ``sizes``: equal for twins (see the module), ``None`` where it cannot be told
    (execution options, or a layout the rules refuse). ``rows`` are the report rows
    of the model's parameters and optimizer state under ``strategy``.

    >>> from flax import nnx
    >>> from nnx_shard.models import Decoder, get_config
    >>> from nnx_shard.planner._formula import abstract_report
    >>> from nnx_shard.strategies._presets import get
    >>> cfg = get_config("tiny")
    >>> model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    >>> def sig(name, sizes):
    ...     s = get(name)
    ...     rows = abstract_report(model, sizes, s.rules, None, s.opt_rules).rows
    ...     return signature(s, sizes, rows, cfg, batch=8, seq=16, microbatches=1, remat="none")
    >>> sig("ep", {"data": 2, "expert": 4}) == sig("dp", {"data": 8})
    True
    >>> sig("fsdp_tp", {"data": 1, "model": 4}) == sig("tp", {"data": 1, "model": 4})
    True
    >>> sig("fsdp_tp", {"data": 2, "model": 2}) == sig("tp", {"data": 2, "model": 2})
    False
    >>> sig("cp", {"data": 2, "context": 4}) is None
    True
    """
    if strategy.rules.options:
        return None
    try:
        entries = activation_entries(strategy, sizes, cfg, batch=batch, seq=seq,
                                     microbatches=microbatches)
    except ShardingError:
        return None
    for r in rows:
        entries.append(tuple(entry_axes(e) for e in tuple(r.spec)))
    mesh_sizes, specs = _canonical(dict(sizes), entries)
    labels = tuple((r.group, r.path, tuple(r.shape)) for r in rows)
    return (math.prod(sizes.values()), mesh_sizes, specs, labels, str(remat), microbatches)
