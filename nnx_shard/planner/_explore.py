"""The compiles of one :func:`nnx_shard.planner.auto` call, in phases.

:class:`Search` compiles the plain layouts (:meth:`Search.plain`), then remat policies
and microbatches for the layouts that do not fit (:meth:`Search.variants`), where nothing
fits all of that again with host offload (:meth:`Search.offloaded`), and ranks what fits
(:meth:`Search.rank`); how each candidate gets its figures is its
:class:`~nnx_shard.planner._evaluate.Evaluator`'s. It leaves out what cannot be chosen:
what the formula alone puts past the memory, a pipeline over one stage whose layout
another candidate has (:meth:`Search.one_stage`), and the variants whose predicted time
a compiled step of their layout bounds above the best fitting one's
(:data:`REMAT_TIME_FLOORS`, :data:`VARIANT_TIME_FLOOR`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from nnx_shard._parallel.schedule import stage_count
from nnx_shard._report import fmt_bytes
from nnx_shard._rules import Rules
from nnx_shard.planner._evaluate import Evaluator, layout_key, progress_bar
from nnx_shard.planner._formula import PRUNE_MARGIN, formula_bytes, stage_formula_bytes
from nnx_shard.planner._plan import Candidate, Plan
from nnx_shard.planner._problem import Problem
from nnx_shard.planner._trust import compiled_trusted
from nnx_shard.planner._user import user_request
from nnx_shard.strategies._strategy import Strategy

__all__ = ["REMAT_TIME_FLOORS", "VARIANT_TIME_FLOOR", "Search"]


#: A remat or microbatch variant of a layout is not compiled where its predicted step
#: time cannot be under the best fitting candidate's: each compiled step of its
#: layout bounds it from below, that step's time x the least a variant was measured to
#: take of it. The measure is ``benchmarks/plan_time.py --floors``, a search that
#: prunes nothing by time, over every pair of compiled steps of one layout (the
#: earlier in the search's order first). :data:`REMAT_TIME_FLOORS` holds the floors of
#: a stronger remat policy after a weaker one, and this one every other pair: more
#: microbatches at the same or a weaker policy, a user factory's own remat. Each floor
#: is under the least ratio measured; the measured ratios are in docs/guides/planner.md
#: ("Time floors of remat and microbatch variants").
VARIANT_TIME_FLOOR = 0.7

#: The floors of :data:`VARIANT_TIME_FLOOR` by (earlier step's remat, variant's remat),
#: at any microbatch counts. Recompute can cut a step's predicted time (its saved
#: activations are not written and read back) but by no more than the pairs measured.
REMAT_TIME_FLOORS: dict[tuple[str, str], float] = {
    ("none", "dots"): 0.6, ("none", "full"): 0.45, ("dots", "full"): 0.7}


class Search(Evaluator):
    """The compiles of one :func:`auto` call: the budget, and the candidates as they
    are ranked, dropped or pruned."""

    def __init__(self, p: Problem, layouts: list[Any], dropped: list[Candidate],
                 pruned: list[str]) -> None:
        super().__init__(p)
        self.layouts = layouts
        self.dropped = dropped
        self.pruned = pruned
        self.ranked: list[Candidate] = []
        self.budget = p.opts.max_compiles
        self.counters["considered"] = len(layouts)
        # The layouts' first candidates, laid out or not: the rest are variants.
        self.first_labels: set[str] = {c.label for c in dropped}
        self.best_s: float | None = None             # the fastest fitting step so far
        # Each layout's compiled steps, (remat, predicted seconds): they bound its variants.
        self.steps: dict[Any, list[tuple[str | None, float]]] = {}
        self.slow_pruned = 0
        self.untrusted = 0                           # pipeline candidates dropped on CPU figures
        self.offload_tried: list[str] = []           # host offloads searched (nothing fit without)
        self.offload_firsts = 0                      # their layouts' first candidates

    def formula_over(self, c: Candidate) -> int | None:
        """The formula's bytes where they are past :data:`PRUNE_MARGIN` x the memory."""
        p = self.p
        if p.memory is None or self.opts.compile_fn is not None:
            return None
        est = formula_bytes(p.abstract, p.cfg, p.strategy(c.strategy, c.offload), c.mesh, p.tx,
                            self.opts.batch // c.microbatches, self.opts.seq, c.remat or "none",
                            self.opts.guard, c.microbatches)
        # A pipeline keeps every microbatch of its stage's layers: its stage floor, which
        # decides it (stage_decide), is at least the formula's.
        stage = self.stage_need(c, floor=True)
        if stage is not None and est is not None:
            est = max(est, stage)
        return est if est is not None and est > p.memory * PRUNE_MARGIN else None

    def prune_by_formula(self, c: Candidate) -> bool:
        over = self.formula_over(c)
        if over is None:
            return False
        c.fits, c.bytes_per_device = False, over
        on_device = f" of device memory with offload {c.offload}" if c.offload else ""
        c.reason = (f"the formula alone needs {fmt_bytes(over)}{on_device} per device, over "
                    f"{PRUNE_MARGIN}x the {fmt_bytes(self.p.memory or 0)} available "
                    "(not compiled)")
        return True

    def applied(self, c: Candidate, result: Mapping[str, Any]) -> None:
        """Applies a compile's ``result`` to ``c`` and keeps the times the search
        prunes with."""
        super().applied(c, result)
        if c.compiled:
            self.stage_decide(c)
        if c.predicted_s is None:
            return
        self.steps.setdefault(layout_key(c), []).append((c.remat, c.predicted_s))
        if c.fits:
            self.best_s = min(self.best_s if self.best_s is not None else math.inf,
                              c.predicted_s)

    def stage_need(self, c: Candidate, floor: bool = False) -> int | None:
        """The per-stage formula of a pipeline candidate (``None`` where its compiled
        figure is trusted, or there is no reference config to count); ``floor``: with
        ``dots`` counted as ``full`` remat, a bound under any need (the pruning's)."""
        p = self.p
        strat = p.strategy(c.strategy, c.offload)
        if p.cfg is None or self.opts.compile_fn is not None or compiled_trusted(strat)[0]:
            return None
        remat = c.remat or "none"
        if floor and remat in ("dots", "offload"):
            remat = "full"
        return stage_formula_bytes(p.abstract, p.cfg, strat, c.mesh, p.tx, self.opts.batch,
                                   self.opts.seq, remat, self.opts.guard)

    def stage_decide(self, c: Candidate) -> None:
        """Decides a compiled pipeline candidate that XLA CPU's figure puts over the
        memory with its per-stage formula: for a pipeline that figure is an upper bound
        (:mod:`nnx_shard.planner._trust`), so where it fits the candidate fits."""
        memory, host = self.p.memory, self.p.host_memory
        if not c.compiled or memory is None or c.fits:
            return
        if c.offload is not None and host is not None and (c.host_bytes or 0) > host:
            return  # over the host's memory whatever the device's need
        need = self.stage_need(c)
        if need is None:
            return
        compiled = c.bytes_per_device
        c.bytes_per_device, c.decided_by = need, "stage formula"
        c.fits = need <= memory
        c.reason = None if c.fits else (
            f"needs {fmt_bytes(need)} per device by its per-stage formula (XLA CPU's compiled "
            f"{fmt_bytes(compiled or 0)} is an upper bound for a pipeline), over the "
            f"{fmt_bytes(memory)} available")
        self.untrusted += 1

    def too_slow(self, v: Candidate) -> str | None:
        """Why variant ``v`` cannot be chosen (``None``: it can): a compiled step of its
        layout x the floor of :data:`REMAT_TIME_FLOORS` (else
        :data:`VARIANT_TIME_FLOOR`) is over the best fitting candidate's time."""
        if self.best_s is None:
            return None
        bounds = [(t * REMAT_TIME_FLOORS.get((str(r), str(v.remat)), VARIANT_TIME_FLOOR), r, t)
                  for r, t in self.steps.get(layout_key(v), [])]
        if not bounds:
            return None
        bound, remat, t = max(bounds, key=lambda b: b[0])
        if bound <= self.best_s:
            return None
        return (f"not compiled: predicted at {bound:.3g} s or more (its layout's remat={remat} "
                f"step at {t:.3g} s x {bound / t:g}, the least a remat={v.remat} variant was "
                f"measured to take of it), over the best fitting candidate's {self.best_s:.3g} s")

    def prune_slow(self, v: Candidate) -> bool:
        """Marks ``v`` not compiled where it is too slow to be chosen."""
        why = self.too_slow(v)
        if why is None:
            return False
        v.fits, v.reason = False, why
        self.slow_pruned += 1
        return True

    def skip(self, v: Candidate, bar: Any) -> bool:
        """:meth:`prune_slow` as a compile is about to start: its budget is given back."""
        if not self.prune_slow(v):
            return False
        self.budget += 1  # not compiled after all
        bar.update(1)
        return True

    def one_stage(self, first: list[Candidate]) -> list[Candidate]:
        """``first`` without the pipelines over one stage whose every array is laid out
        as another candidate's of ``first`` (``pp_fsdp stage=1,data=8`` as ``fsdp
        data=8``): a schedule over one stage adds its loop and nothing else, and the
        twin is searched with the same remat policies and microbatch counts. They go
        to the dropped, with why."""
        p = self.p
        if p.cfg is None:  # a model of the user's own: no signature to compare
            return first
        lone: dict[str, Strategy] = {}  # label -> its strategy without the schedule
        for c in first:
            strat = p.strategy(c.strategy)
            if stage_count(strat.rules, c.mesh) == 1:
                lone[c.label] = dataclasses.replace(strat, rules=Rules(strat.rules, options={}))
        if not lone:
            return first
        plain: dict[Any, Candidate] = {}  # the first of twins stands for them
        for c in first:
            if c.label not in lone:
                plain.setdefault(self.signature(c), c)
        plain.pop(None, None)
        out = []
        for c in first:
            twin = plain.get(self.signature(c, lone[c.label])) if c.label in lone else None
            if twin is None:
                out.append(c)
                continue
            mesh = ",".join(f"{k}={v}" for k, v in twin.mesh.items())
            c.reason = (f"not compiled: a pipeline over one stage lays every array out as "
                        f"{twin.strategy} {mesh} does, which is searched (the schedule adds "
                        "its loop and nothing else)")
            self.dropped.append(c)
        if len(out) < len(first):
            self.pruned.append(f"{len(first) - len(out)} pipelines over one stage not compiled: "
                               "each lays the model out as a preset without a pipeline that is "
                               "searched")
        return out

    def plain(self, viable: list[tuple[str, dict[str, int], int]],
              offload: str | None = None) -> list[Candidate]:
        """Phase 3: every viable layout with the first remat policy and the fewest
        microbatches it runs with (none but a pipeline's), within the compile budget;
        with host ``offload`` where given (:meth:`offloaded`)."""
        max_compiles = self.opts.max_compiles
        first = [Candidate(n, s, self.p.policies[0], mb, offload=offload)
                 for n, s, mb in viable]
        self.first_labels |= {c.label for c in first}
        first = self.one_stage(first)
        stage1 = [c for c in first if not self.prune_by_formula(c)]
        if len(stage1) > self.budget:
            self.pruned.append(f"{len(stage1) - self.budget} layouts not compiled "
                               f"(max_compiles={max_compiles})")
            for c in stage1[self.budget:]:
                c.reason = f"not compiled: over max_compiles={max_compiles}"
            stage1 = stage1[:self.budget]
        self.budget -= len(stage1)
        with progress_bar(len(stage1), self.opts.progress, "compiling layouts") as bar:
            self.run(stage1, bar)
        for c in first:
            (self.ranked if c.fits else self.dropped).append(c)
        return first

    def variants_of(self, first: list[Candidate]) -> dict[Any, list[Candidate]]:
        """The remat policies and microbatch counts to try, cheapest first, for each
        layout whose plain step does not fit."""
        p = self.p
        host = p.host_memory
        # Remat and microbatches cut no host bytes: a layout over the host's memory stays so.
        retry = [c for c in first if c.fits is False and c.bytes_per_device is not None
                 and not (host is not None and (c.host_bytes or 0) > host)]
        out = {}
        for c in retry:
            base = c.microbatches
            order = ([(pol, base) for pol in p.policies[1:]]
                     + [(pol, m) for pol in p.policies for m in p.mbs if m > base])
            out[layout_key(c)] = [
                Candidate(c.strategy, c.mesh, pol, m, offload=c.offload) for pol, m in order
                if p.batch_problem(p.strategy(c.strategy), c.mesh, m) is None]
        if retry and len(p.policies) == 1 and len(p.mbs) == 1:
            self.pruned.append("no remat policy or microbatch count to try for layouts that "
                               "do not fit")
        return out

    def variant_round(self, live: dict[Any, list[Candidate]], bar: Any) -> None:
        """One variant per layout still without a fitting one, within the budget."""
        batch_round = []
        for key in list(live):
            # Only the variant next in line is judged: one the layout never reaches
            # (an earlier one fits) is not counted as pruned.
            while live[key] and self.prune_slow(live[key][0]):
                self.dropped.append(live[key].pop(0))
                bar.update(1)
            if not live[key]:
                del live[key]
                continue
            batch_round.append(live[key].pop(0))
        skipped = []
        for v in list(batch_round):
            if self.prune_by_formula(v):
                skipped.append(v)
                batch_round.remove(v)
                bar.update(1)
        for v in batch_round[self.budget:]:  # past the budget: said, not silently lost
            v.reason = f"not compiled: over max_compiles={self.opts.max_compiles}"
            live.setdefault(layout_key(v), []).insert(0, v)
        batch_round = batch_round[:self.budget]
        self.budget -= len(batch_round)
        self.run(batch_round, bar)
        for v in batch_round + skipped:
            if v.fits:
                self.ranked.append(v)
                live.pop(layout_key(v), None)  # the first variant that fits is kept
            else:
                self.dropped.append(v)

    def variants(self, first: list[Candidate]) -> None:
        """Phase 4: remat and microbatches only where the plain step does not fit."""
        variants_of = self.variants_of(first)
        with progress_bar(sum(len(v) for v in variants_of.values()), self.opts.progress,
                  "remat / microbatches") as bar:
            # One round per variant index across layouts, so each layout gets its
            # cheapest variants first within the compile budget.
            live = dict(variants_of)
            while live and self.budget > 0:
                self.variant_round(live, bar)
            left = sum(len(v) for v in live.values())
            if self.slow_pruned:
                self.pruned.append(
                    f"{self.slow_pruned} remat/microbatch variants not compiled: predicted "
                    "slower than the best fitting candidate, by a compiled step of their "
                    "layout x the least a variant was measured to take of it")
            if left:
                self.pruned.append(f"{left} remat/microbatch variants not compiled "
                                   f"(max_compiles={self.opts.max_compiles})")
        if variants_of:
            self.pruned.append("remat policies and microbatches tried only for layouts whose "
                               "plain step does not fit (they add recompute or "
                               "per-microbatch collectives), cheapest first, stopping at the "
                               "first that fits")

    def offloaded(self, viable: list[tuple[str, dict[str, int], int]]) -> None:
        """Phase 5, only where nothing fits device memory: the search again (every
        layout, then remat and microbatches) with each host offload of the problem's in
        turn (``optimizer``, then ``optimizer+params``), stopping at the first under
        which something fits device memory, and its host memory
        (:func:`~nnx_shard.planner._evaluate.apply_offload`)."""
        p = self.p
        if self.ranked or p.memory is None or not p.offloads:
            return
        tried = []
        for mode in p.offloads:
            tried.append(mode)
            self.steps.clear()  # nothing fitted: no time bound carries over
            first = self.plain(viable, offload=mode)
            self.variants(first)
            self.offload_firsts += len(first)
            if self.ranked:
                break
        self.offload_tried = tried
        self.pruned.append(
            "host offload (" + ", then ".join(tried) + ") tried only because no candidate fits "
            "device memory without it: it adds host transfers to every step that the predicted "
            "time does not count")

    def rank(self) -> list[Candidate]:
        """Phase 6: fastest predicted first; of candidates that compile to the same
        program (ep on a dense model is dp's) the first is kept. Returns the twins."""
        self.ranked.sort(key=lambda c: (c.predicted_s, c.bytes_per_device or 0))
        seen: dict[tuple[Any, ...], Candidate] = {}
        twins: list[Candidate] = []
        same: list[str] = []
        for c in self.ranked:
            sig = (c.bytes_per_device, c.temp, c.flops, c.collective_bytes, c.collectives,
                   c.memory_bytes, c.microbatches, c.remat, c.offload)
            if sig in seen:
                twins.append(c)
                if c.label not in self.same:  # said when it was not compiled
                    same.append(f"{c.label} (= {seen[sig].label})")
            else:
                seen[sig] = c
        if twins:
            self.ranked = list(seen.values())
        if same:
            self.pruned.append(f"{len(same)} candidates that compile to the same program as "
                               f"a better-ranked one: {', '.join(same)}")
        return twins

    def plan(self, twins: list[Candidate]) -> Plan:
        p, opts = self.p, self.opts
        label = p.model_name or (
            f"{type(p.cfg).__name__}(embed={p.cfg.embed}, layers={p.cfg.layers})"
            if p.cfg is not None else getattr(p.model, "__name__", None)
            or type(p.model).__name__)
        request: dict[str, Any] = {
            "model_name": p.model_name, "model_label": label, "devices": opts.devices,
            "batch": opts.batch, "seq": opts.seq, "optimizer": opts.optimizer,
            "guard": opts.guard,
            "device_memory": p.memory, "host_memory": p.host_memory,
            "offload_tried": self.offload_tried, **_param_counts(p)}
        if self.same:
            self.pruned.append(f"{len(self.same)} candidates not compiled: the same program as "
                               f"one compiled (every array laid out alike): "
                               + ", ".join(f"{c} (= {lead})" for c, lead in self.same.items()))
        if self.untrusted:
            self.pruned.append(
                f"{self.untrusted} pipeline candidates decided by their per-stage formula: XLA "
                "CPU's compiled figure for a pipeline is an upper bound (nnx_shard.planner._trust)"
                "; the formula, like every formula, is a floor: leave headroom")
        self.pruned[:] = dict.fromkeys(self.pruned)  # the offload phases say some again
        self.counters["considered"] = len(self.layouts) + self.offload_firsts + sum(
            1 for c in self.dropped + self.ranked if c.label not in self.first_labels)
        request.update(self.counters)
        if p.user is not None:
            request.update(user_request(p.user))
        return Plan(self.ranked, self.dropped, self.pruned, p.hw, request, twins)


def _param_counts(p: Problem) -> dict[str, int]:
    """The model's parameter count, and for a mixture of experts the parameters each
    token computes with (``active_params``), for the plan's header."""
    import jax
    from flax import nnx

    try:
        total = sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(p.abstract, nnx.Param)))
    except Exception:
        return {}
    out = {"params": int(total)}
    active = getattr(p.cfg, "active_params", None)
    if active is not None and active != total:
        out["active_params"] = int(active)
    return out
