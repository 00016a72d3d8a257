"""The candidates one :func:`nnx_shard.planner.auto` call considers, each a preset on a
mesh of the devices: every preset on every mesh (:func:`enumerate_candidates`), less those
that cannot be laid out, with why (:func:`viable_candidates`).
"""

from __future__ import annotations

from collections.abc import Sequence

from nnx_shard._errors import ShardingError, UsageError
from nnx_shard.planner._plan import Candidate, Plan, clip
from nnx_shard.planner._problem import Problem
from nnx_shard.strategies._presets import get
from nnx_shard.strategies._strategy import factorizations

__all__ = ["enumerate_candidates", "viable_candidates"]


def enumerate_candidates(n: int, names: Sequence[str]) -> tuple[list[tuple[str, dict[str, int]]],
                                                              list[str]]:
    """Every preset of ``names`` on every factorisation of ``n`` devices over its mesh
    axes, but those with a size-1 axis beyond the first (a preset with fewer axes
    lays the model out the same); and what was skipped, in words.

    >>> candidates, pruned = enumerate_candidates(4, ["dp", "tp"])
    >>> candidates
    [('dp', {'data': 4}), ('tp', {'data': 1, 'model': 4}), ('tp', {'data': 2, 'model': 2})]
    """
    out, pruned = [], []
    skipped = 0
    for name in names:
        strat = get(name)
        for shape in factorizations(n, len(strat.mesh_axes)):
            sizes = dict(zip(strat.mesh_axes, shape, strict=True))
            if n > 1 and len(shape) > 1 and 1 in shape[1:]:
                skipped += 1
                continue
            out.append((name, sizes))
    if skipped:
        pruned.append(f"{skipped} meshes with a size-1 axis beyond the first (the same layout "
                      "as a preset with fewer axes, e.g. tp model=1 is dp)")
    return out, pruned


def viable_candidates(p: Problem) -> tuple[list[tuple[str, dict[str, int]]],
                                   list[tuple[str, dict[str, int], int]], list[Candidate],
                                   list[str]]:
    """Every candidate, those that can be laid out (with the fewest microbatches they
    run with: a pipeline's stage count), the dropped ones (with why) and what the
    enumeration skipped; raises when no preset can use the devices.

    >>> from nnx_shard.planner._problem import resolve
    >>> from nnx_shard.planner._options import AutoOptions
    >>> p = resolve("tiny", AutoOptions(devices=2, batch=3, seq=8, strategies=["dp", "tp"]))
    >>> candidates, viable, dropped, pruned = viable_candidates(p)
    >>> viable, [c.label for c in dropped]
    ([('tp', {'data': 1, 'model': 2}, 1)], ['dp data=2 remat=none mb=1'])
    """
    opts = p.opts
    layouts, pruned = enumerate_candidates(opts.devices, p.names)
    dropped: list[Candidate] = []
    viable: list[tuple[str, dict[str, int], int]] = []
    for name, sizes in layouts:
        strat = p.strategy(name)
        base = Candidate(name, sizes, p.policies[0])
        # The batch first: one rule lookup, where check resolves every parameter (and,
        # failing, every mesh of the devices for a suggestion): with many devices most
        # layouts cannot split the batch, and the search stays linear in the layouts.
        mb, why = p.first_mb(strat, sizes)
        if mb is None:
            base.reason = why
            dropped.append(base)
            continue
        try:
            strat.check(p.abstract, sizes)
        except (ShardingError, ValueError, TypeError) as e:
            # A preset states what it needs of the model by raising from check.
            base.reason = "cannot lay out: " + " ".join(str(e).split())
            dropped.append(base)
            continue
        idle = p.idle_axes(strat, sizes, mb)
        if idle:
            n = sizes[idle[0]]
            base.reason = (f"mesh axis {idle[0]!r} (size {n}) splits nothing of this model: "
                           "no parameter, optimizer state, batch or activation is laid out "
                           f"over it, so its {n} devices would each repeat the same step")
            dropped.append(base)
            continue
        viable.append((name, sizes, mb))
    if not viable:
        fams = Plan([], dropped, pruned, p.hw, {}).families()
        n, batch = opts.devices, opts.batch
        good = [d for d in range(max(1, n - 8), n + 9) if d != n and batch % d == 0 and d > 1]
        hint = (f" Device counts near {n} that divide the batch {batch}: "
                f"{', '.join(map(str, good[:6]))}." if good else "")
        # One line of bounded length, however many presets: each reason gets its share.
        each = max(60, min(160, 1200 // max(len(fams), 1)))
        raise UsageError(
            f"auto: no preset can use {n} devices for this model with batch {batch} x "
            f"seq {opts.seq}: " + "; ".join(f"{k}: {clip(v, each)}" for k, v in fams.items())
            + f".{hint} Fix: a global batch that divides by the data axes, or another "
            "device count")
    return layouts, viable, dropped, pruned

