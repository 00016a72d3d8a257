"""The compiles of one :func:`nnx_shard.planner.search.auto` call.

:class:`Problem` is what the search works on (the options, checked, and the model,
built abstractly); :class:`Search` compiles the plain layouts (:meth:`Search.plain`),
then remat policies and microbatches for the layouts that do not fit
(:meth:`Search.variants`), and ranks what fits (:meth:`Search.rank`). It compiles in
long-lived children (:class:`nnx_shard.simulated.Workers`), each program once
(:mod:`nnx_shard.planner.twins`), and leaves out what cannot be chosen: what the
formula alone puts past the memory, a pipeline over one stage whose layout another
candidate has (:meth:`Search.one_stage`), and the variants whose predicted time a
compiled step of their layout bounds above the best fitting one's
(:data:`REMAT_TIME_FLOORS`, :data:`VARIANT_TIME_FLOOR`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import AbstractMesh
from tqdm.auto import tqdm

from nnx_shard.axes import entry_axes
from nnx_shard.errors import ShardingError
from nnx_shard.models import LlamaConfig, TransformerConfig
from nnx_shard.parallel.schedule import stage_count
from nnx_shard.planner.cache import Cache, versions
from nnx_shard.planner.compile import compile_step, config_dict
from nnx_shard.planner.formula import (
    PRUNE_MARGIN,
    abstract_report,
    formula_bytes,
    stage_formula_bytes,
)
from nnx_shard.planner.hardware import Hardware
from nnx_shard.planner.options import AutoOptions
from nnx_shard.planner.plan import Candidate, Plan
from nnx_shard.planner.trust import compiled_trusted
from nnx_shard.planner.twins import activation_entries, signature
from nnx_shard.planner.user import UserModel, user_request
from nnx_shard.presets import get
from nnx_shard.report import fmt_bytes
from nnx_shard.rules import Rules
from nnx_shard.simulated import Workers
from nnx_shard.strategy import Strategy

__all__ = ["REMAT_TIME_FLOORS", "VARIANT_TIME_FLOOR", "Problem", "Search", "apply_result",
           "batch_problem"]


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



@dataclasses.dataclass
class Problem:
    """The options, checked, and the model, resolved and built abstractly."""

    opts: AutoOptions
    hw: Hardware
    memory: int | None
    names: list[str]
    tx: Any
    cfg: TransformerConfig | LlamaConfig | None  # a reference config, compiled in a subprocess
    model: Any                     # what the user gave
    model_name: str | None
    takes_remat: bool              # a factory with a remat keyword
    policies: list[str | None]
    abstract: Any
    mbs: list[int]
    user: UserModel | None = None  # a factory with its own loss and batch

    def strategy(self, name: str) -> Strategy:
        """Preset ``name`` as the search lays it out (a user model's aliases applied)."""
        return self.user.strategy(name) if self.user is not None else get(name)

    def batch_problem(self, strat: Strategy, sizes: dict[str, int], mb: int) -> str | None:
        """Why ``mb`` microbatches cannot run under ``strat`` on ``sizes`` (``None``:
        they can), known before any compile."""
        stages = stage_count(strat.rules, sizes)
        if stages is not None:
            sched = strat.rules.options["pipeline"]
            if mb < stages and not (sched.allow_few_microbatches and sched.repeats == 1):
                return (f"a pipeline over {stages} stages needs at least {stages} "
                        f"microbatches, not {mb}")
        if self.user is not None:
            return self.user.batch_problem(strat, sizes, mb)
        return batch_problem(strat, sizes, self.opts.batch, self.opts.seq, mb)

    def idle_axes(self, strat: Strategy, sizes: dict[str, int], mb: int) -> list[str]:
        """The mesh axes of size > 1 that lay out nothing of the step under ``strat`` on
        ``sizes``: no parameter, optimizer state, batch array (nor, for a reference
        model, activation) is split over them, so every device along one would repeat
        the same step (``ep`` on a dense model where the batch does not divide over
        ``data`` x ``expert``). Empty where that cannot be told here: the compile says."""
        big = [a for a, n in sizes.items() if n > 1]
        if not big:
            return []
        mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
        try:
            rows = abstract_report(self.abstract, sizes, strat.rules, self.tx,
                                   strat.opt_rules).rows
            entries = [tuple(entry_axes(e) for e in tuple(r.spec)) for r in rows]
            if self.cfg is not None:
                entries += activation_entries(strat, sizes, self.cfg, batch=self.opts.batch,
                                              seq=self.opts.seq, microbatches=mb)
            elif self.user is not None:
                for x in jax.tree_util.tree_leaves(self.user.spec):
                    spec = strat.rules.spec(("batch", *(None,) * (len(x.shape) - 1)),
                                            shape=x.shape, mesh=mesh)
                    entries.append(tuple(entry_axes(e) for e in spec))
        except Exception:  # a layout the rules refuse: the compile will say what is wrong
            return []
        used = {a for spec in entries for e in spec for a in e}
        return [a for a in big if a not in used]

    def first_mb(self, strat: Strategy, sizes: dict[str, int]) -> tuple[int | None, str]:
        """The fewest microbatches of the search's counts that can run under ``strat``
        on ``sizes`` (``None`` and why, if none can)."""
        why = ""
        for mb in self.mbs:
            why = self.batch_problem(strat, sizes, mb) or ""
            if not why:
                return mb, ""
        stages = stage_count(strat.rules, sizes) or 1
        if stages > max(self.mbs):
            why = (f"a pipeline over {stages} stages needs at least {stages} microbatches; "
                   f"the counts searched are {', '.join(map(str, self.mbs))}. Fix: "
                   f"microbatches=[..., {stages}], or fewer stages")
        return None, why


def batch_problem(strat: Strategy, sizes: dict[str, int], batch: int, seq: int,
                   microbatches: int) -> str | None:
    """Why the batch cannot be laid out under ``strat`` on ``sizes`` (``None``: it can).

    >>> batch_problem(get("dp"), {"data": 8}, 16, 128, 1) is None
    True
    >>> batch_problem(get("dp"), {"data": 8}, 16, 128, 4)
    '4 microbatches do not divide the 2 rows per device'
    """
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    try:
        spec = strat.rules.spec((None, "batch", "length"), shape=(1, batch, seq), mesh=mesh,
                                path="batch['inputs']")
    except ShardingError as e:
        msg = " ".join(str(e).split())
        return f"batch {batch} x seq {seq} cannot be laid out: {msg[:200]}"
    entry = tuple(spec)[1] if len(tuple(spec)) > 1 else None
    axes = entry_axes(entry)
    rows = batch // math.prod(sizes[a] for a in axes)
    if rows % microbatches:
        return f"{microbatches} microbatches do not divide the {rows} rows per device"
    return None


# -- phases 3 to 5: compile, retry with remat and microbatches, rank ---------------------------


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _bar(total: int, progress: bool, desc: str) -> Any:
    if not progress or total == 0:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="compile", file=sys.stderr, leave=False)


def _workers(asked: int | None) -> int:
    """Compile subprocesses to run side by side: ``asked``, else one per core this
    process may use, at most 4 (each holds a JAX of its own, ~1 GiB or more)."""
    if asked is not None:
        return max(1, int(asked))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 4))


def _key(v: Candidate) -> tuple[str, tuple[tuple[str, int], ...]]:
    return (v.strategy, tuple(v.mesh.items()))


class Search:
    """The compiles of one :func:`auto` call: the cache, the budget, and the
    candidates as they are ranked, dropped or pruned."""

    def __init__(self, p: Problem, layouts: list[Any], dropped: list[Candidate],
                 pruned: list[str]) -> None:
        self.p = p
        self.opts = p.opts
        self.layouts = layouts
        self.dropped = dropped
        self.pruned = pruned
        self.ranked: list[Candidate] = []
        self.budget = p.opts.max_compiles
        self.store = Cache(p.opts.cache, shared=p.opts.compile_fn is None)
        self.version = versions()
        self.counters = {"compiled": 0, "cached": 0, "considered": len(layouts)}
        self.workers: Workers | None = None
        # The layouts' first candidates, laid out or not: the rest are variants.
        self.first_labels: set[str] = {c.label for c in dropped}
        self.best_s: float | None = None             # the fastest fitting step so far
        # Each layout's compiled steps, (remat, predicted seconds): they bound its variants.
        self.steps: dict[Any, list[tuple[str | None, float]]] = {}
        self.slow_pruned = 0
        self.untrusted = 0                           # pipeline candidates dropped on CPU figures
        # Twins known before compiling (planner.twins): one compile per program.
        self.rows: dict[Any, Any] = {}               # layout -> report rows
        self.programs: dict[Any, Candidate] = {}     # signature -> the candidate compiled
        self.same: dict[str, str] = {}               # label -> its leader's, not compiled

    def key_of(self, c: Candidate) -> str:
        p, opts = self.p, self.opts
        model = p.model
        what = {"model": config_dict(p.cfg) if p.cfg is not None else
                p.user.key() if p.user is not None else
                f"{getattr(model, '__module__', '')}.{getattr(model, '__qualname__', '')}"
                f"#{id(model)}", "strategy": c.strategy, "sizes": c.mesh, "remat": c.remat,
                "microbatches": c.microbatches, "batch": opts.batch, "seq": opts.seq,
                "optimizer": opts.optimizer, "guard": opts.guard, "v": self.version}
        return hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()

    def formula_over(self, c: Candidate) -> int | None:
        """The formula's bytes where they are past :data:`PRUNE_MARGIN` x the memory."""
        p = self.p
        if p.memory is None or self.opts.compile_fn is not None:
            return None
        est = formula_bytes(p.abstract, p.cfg, p.strategy(c.strategy), c.mesh, p.tx,
                            self.opts.batch // c.microbatches, self.opts.seq, c.remat or "none",
                            self.opts.guard)
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
        c.reason = (f"the formula alone needs {fmt_bytes(over)} per device, over "
                    f"{PRUNE_MARGIN}x the {fmt_bytes(self.p.memory or 0)} available "
                    "(not compiled)")
        return True

    def done(self, c: Candidate, result: dict[str, Any], bar: Any) -> None:
        self.store.put(self.key_of(c), result)
        self.counters["compiled"] += 1
        self.applied(c, result)
        bar.set_postfix_str(c.label, refresh=False)
        bar.update(1)

    def applied(self, c: Candidate, result: Mapping[str, Any]) -> None:
        """Applies a compile's ``result`` to ``c`` and keeps the times the search
        prunes with."""
        apply_result(c, result, self.p.memory, self.p.hw)
        if c.compiled:
            self.stage_decide(c)
        if c.predicted_s is None:
            return
        self.steps.setdefault(_key(c), []).append((c.remat, c.predicted_s))
        if c.fits:
            self.best_s = min(self.best_s if self.best_s is not None else math.inf,
                              c.predicted_s)

    def stage_need(self, c: Candidate, floor: bool = False) -> int | None:
        """The per-stage formula of a pipeline candidate (``None`` where its compiled
        figure is trusted, or there is no reference config to count); ``floor``: with
        ``dots`` counted as ``full`` remat, a bound under any need (the pruning's)."""
        p = self.p
        strat = p.strategy(c.strategy)
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
        (:mod:`nnx_shard.planner.trust`), so where it fits the candidate fits."""
        memory = self.p.memory
        if not c.compiled or memory is None or c.fits:
            return
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
                  for r, t in self.steps.get(_key(v), [])]
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

    def skip_slow(self, v: Candidate, bar: Any) -> bool:
        """:meth:`prune_slow` as a compile is about to start: its budget is given back."""
        if not self.prune_slow(v):
            return False
        self.budget += 1  # not compiled after all
        bar.update(1)
        return True

    def compile_here(self, todo: list[Candidate], bar: Any) -> None:
        opts, p = self.opts, self.p
        for c in todo:
            if self.skip_slow(c, bar):
                continue
            try:
                if opts.compile_fn is not None:
                    result = dict(opts.compile_fn(c))
                elif p.user is not None:
                    result = p.user.compile(c.strategy, c.mesh, optimizer=opts.optimizer,
                                            microbatches=c.microbatches)
                else:
                    fac = (lambda c=c: p.model(remat=c.remat)) if p.takes_remat else p.model
                    result = compile_step(fac, c.strategy, c.mesh, batch=opts.batch,
                                          seq=opts.seq, optimizer=opts.optimizer,
                                          microbatches=c.microbatches, guard=opts.guard)
            except Exception as e:  # a candidate that cannot compile is dropped, with why
                result = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
            self.done(c, result, bar)

    def compile_in_child(self, todo: list[Candidate], bar: Any) -> None:
        opts, cfg = self.opts, self.p.cfg
        assert cfg is not None
        reqs = [{"config": config_dict(cfg), "remat": c.remat, "strategy": c.strategy,
                 "sizes": c.mesh, "batch": opts.batch, "seq": opts.seq,
                 "optimizer": opts.optimizer, "microbatches": c.microbatches,
                 "guard": opts.guard} for c in todo]
        lock = threading.Lock()

        def on_result(i: int, result: dict[str, Any]) -> None:
            if "failed" in result:
                result = {"error": f"the compile subprocess failed: {result['failed']}"}
            with lock:  # the children answer from threads of their own
                self.done(todo[i], result, bar)

        def skip(i: int) -> bool:
            with lock:
                return self.skip_slow(todo[i], bar)

        if self.workers is None:
            # XLA's CPU compile of one program keeps about one core busy, so one child
            # per core compiles side by side; they live for the whole search, so each
            # starts (Python, JAX, a first compile's warm-up) once, not once per phase.
            # Which child compiles a candidate changes nothing of its figures.
            self.workers = Workers("nnx_shard.planner.compile:compile_step_request",
                                   opts.devices, size=_workers(opts.workers),
                                   timeout=opts.timeout)
        self.workers.map(reqs, on_result, skip=skip)

    def close(self) -> None:
        """Ends the compile subprocesses."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def run(self, cands: list[Candidate], bar: Any) -> None:
        """Compiles ``cands`` (or reads them from the cache) and applies the results."""
        todo: list[Candidate] = []
        for c in cands:
            hit = self.store.get(self.key_of(c))
            if hit is not None:
                self.counters["cached"] += 1
                self.applied(c, hit)
                bar.update(1)
            else:
                todo.append(c)
        if not todo:
            return
        if self.opts.compile_fn is not None or self.p.cfg is None:
            self.compile_here(todo, bar)
            return
        todo, followers = self.leaders(todo, bar)
        if todo:
            self.compile_in_child(todo, bar)
        for c, lead in followers:
            self.reuse(c, lead, bar)

    def signature(self, c: Candidate, strat: Strategy | None = None) -> Any:
        """:func:`~nnx_shard.planner.twins.signature` of a reference config's candidate
        (under ``strat`` in place of its preset where given)."""
        p = self.p
        strat = strat or p.strategy(c.strategy)
        key = _key(c)
        if key not in self.rows:
            try:
                self.rows[key] = abstract_report(p.abstract, c.mesh, strat.rules, p.tx,
                                                 strat.opt_rules).rows
            except Exception:  # the compile will say what is wrong
                self.rows[key] = None
        rows = self.rows[key]
        if rows is None:
            return None
        return signature(strat, c.mesh, rows, p.cfg, batch=self.opts.batch, seq=self.opts.seq,
                         microbatches=c.microbatches, remat=c.remat)

    def leaders(self, todo: list[Candidate], bar: Any
                ) -> tuple[list[Candidate], list[tuple[Candidate, Candidate]]]:
        """``todo`` without the candidates whose program is another's (compiled before,
        or to compile now: the followers, each with its leader)."""
        out: list[Candidate] = []
        followers: list[tuple[Candidate, Candidate]] = []
        for c in todo:
            sig = self.signature(c)
            lead = self.programs.get(sig) if sig is not None else None
            if lead is None:
                if sig is not None:
                    self.programs[sig] = c
                out.append(c)
            elif self.store.get(self.key_of(lead)) is None:  # compiles in this batch
                followers.append((c, lead))
            else:
                self.reuse(c, lead, bar)
        return out, followers

    def reuse(self, c: Candidate, lead: Candidate, bar: Any) -> None:
        """Gives ``c`` the figures of ``lead``, which compiles to the same program."""
        result = self.store.get(self.key_of(lead))
        if result is None:  # the leader was not compiled after all: compile c itself
            self.compile_in_child([c], bar)
            return
        self.store.put(self.key_of(c), result)
        self.applied(c, result)
        self.same[c.label] = lead.label
        bar.update(1)

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

    def plain(self, viable: list[tuple[str, dict[str, int], int]]) -> list[Candidate]:
        """Phase 3: every viable layout with the first remat policy and the fewest
        microbatches it runs with (none but a pipeline's), within the compile budget."""
        max_compiles = self.opts.max_compiles
        first = [Candidate(n, s, self.p.policies[0], mb) for n, s, mb in viable]
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
        with _bar(len(stage1), self.opts.progress, "compiling layouts") as bar:
            self.run(stage1, bar)
        for c in first:
            (self.ranked if c.fits else self.dropped).append(c)
        return first

    def variants_of(self, first: list[Candidate]) -> dict[Any, list[Candidate]]:
        """The remat policies and microbatch counts to try, cheapest first, for each
        layout whose plain step does not fit."""
        p = self.p
        retry = [c for c in first if c.fits is False and c.bytes_per_device is not None]
        out = {}
        for c in retry:
            base = c.microbatches
            order = ([(pol, base) for pol in p.policies[1:]]
                     + [(pol, m) for pol in p.policies for m in p.mbs if m > base])
            out[_key(c)] = [
                Candidate(c.strategy, c.mesh, pol, m) for pol, m in order
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
            live.setdefault(_key(v), []).insert(0, v)
        batch_round = batch_round[:self.budget]
        self.budget -= len(batch_round)
        self.run(batch_round, bar)
        for v in batch_round + skipped:
            if v.fits:
                self.ranked.append(v)
                live.pop(_key(v), None)  # the first variant that fits is kept
            else:
                self.dropped.append(v)

    def variants(self, first: list[Candidate]) -> None:
        """Phase 4: remat and microbatches only where the plain step does not fit."""
        variants_of = self.variants_of(first)
        with _bar(sum(len(v) for v in variants_of.values()), self.opts.progress,
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

    def rank(self) -> list[Candidate]:
        """Phase 5: fastest predicted first; of candidates that compile to the same
        program (ep on a dense model is dp's) the first is kept. Returns the twins."""
        self.ranked.sort(key=lambda c: (c.predicted_s, c.bytes_per_device or 0))
        seen: dict[tuple[Any, ...], Candidate] = {}
        twins: list[Candidate] = []
        same: list[str] = []
        for c in self.ranked:
            sig = (c.bytes_per_device, c.temp, c.flops, c.collective_bytes, c.collectives,
                   c.memory_bytes, c.microbatches, c.remat)
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
            "device_memory": p.memory}
        if self.same:
            self.pruned.append(f"{len(self.same)} candidates not compiled: the same program as "
                               f"one compiled (every array laid out alike): "
                               + ", ".join(f"{c} (= {lead})" for c, lead in self.same.items()))
        if self.untrusted:
            self.pruned.append(
                f"{self.untrusted} pipeline candidates decided by their per-stage formula: XLA "
                "CPU's compiled figure for a pipeline is an upper bound (nnx_shard.planner.trust)"
                "; the formula, like every formula, is a floor: leave headroom")
        self.counters["considered"] = len(self.layouts) + sum(
            1 for c in self.dropped + self.ranked if c.label not in self.first_labels)
        request.update(self.counters)
        if p.user is not None:
            request.update(user_request(p.user))
        return Plan(self.ranked, self.dropped, self.pruned, p.hw, request, twins)


def apply_result(c: Candidate, result: Mapping[str, Any], memory: int | None, hw: Hardware) -> None:
    """Sets ``c``'s figures from a compile's ``result`` (:func:`~nnx_shard.planner.compile
    .compile_step`'s dict, or ``{"error": ...}``), its predicted step time on ``hw`` and
    whether it fits ``memory`` bytes (``None``: unlimited).

    >>> from nnx_shard.planner.hardware import PROFILES
    >>> c = Candidate("fsdp", {"data": 8})
    >>> apply_result(c, {"total": 300, "flops": 989e12, "collective_bytes": 0.0}, 200,
    ...              PROFILES["h100-sxm"])
    >>> c.fits, c.reason, c.predicted_s
    (False, 'needs 300 B per device (compiled), over the 200 B available', 1.0)
    >>> apply_result(c, {"error": "ShardingError: ..."}, 200, PROFILES["h100-sxm"])
    >>> c.reason
    'does not compile: ShardingError: ...'
    """
    if "error" in result:
        c.fits, c.reason = False, f"does not compile: {result['error']}"
        return
    c.compiled = True
    c.bytes_per_device = int(result["total"])
    c.temp = int(result.get("temp", 0))
    c.flops = float(result["flops"])
    c.collective_bytes = float(result["collective_bytes"])
    c.collectives = round(float(result.get("collectives", 0)))
    c.memory_bytes = float(result.get("memory_bytes", 0.0))
    c.by_kind = dict(result.get("by_kind", {}))
    c.compile_s = result.get("compile_s")
    c.predicted_s = hw.predict(c.flops, c.collective_bytes, c.collectives, c.memory_bytes)
    if memory is not None and c.bytes_per_device > memory:
        c.fits = False
        c.reason = (f"needs {fmt_bytes(c.bytes_per_device)} per device (compiled), over the "
                    f"{fmt_bytes(memory)} available")
    else:
        c.fits, c.reason = True, None
