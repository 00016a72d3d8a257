"""How a search's candidates get their figures: :class:`Evaluator` compiles them (in
this process, or in long-lived children, :class:`nnx_shard._simulated.Workers`), reads
them from the cache, or gives a candidate the figures of a twin that compiles to the same
program (:mod:`nnx_shard.planner._twins`); :func:`apply_result` turns one compile's
figures into a candidate's memory need, predicted step time and fit.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

from tqdm.auto import tqdm

from nnx_shard._report import fmt_bytes
from nnx_shard._simulated import Workers
from nnx_shard.planner._cache import Cache, versions
from nnx_shard.planner._compile import compile_step, config_dict
from nnx_shard.planner._formula import abstract_report, formula_parts
from nnx_shard.planner._hardware import Hardware
from nnx_shard.planner._plan import OFFLOAD_ESTIMATE, Candidate
from nnx_shard.planner._problem import Problem
from nnx_shard.planner._twins import signature
from nnx_shard.strategies._strategy import Strategy

__all__ = ["COMPILES_OFFLOAD", "Evaluator", "apply_offload", "apply_result", "layout_key",
           "progress_bar", "worker_count"]

#: Whether the search's compile places an offloading candidate's state in host memory
#: (its request carries :attr:`~nnx_shard.strategies.Strategy.offload`). It does not
#: yet: an offloading candidate's program is then its layout's without offload,
#: compiled and cached once under that one's key, and :func:`apply_offload` takes the
#: offloaded state out of its figure. A compile result with ``device`` and ``host``
#: bytes (``compile_fn``'s, or a compile that splits them) is read as it is.
COMPILES_OFFLOAD = False


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress_bar(total: int, progress: bool, desc: str) -> Any:
    """A tqdm bar of ``total`` compiles on stderr, or one that shows nothing where
    ``progress`` is off or there is nothing to count.

    >>> with progress_bar(3, False, "compiling") as bar:
    ...     bar.update(1)
    """
    if not progress or total == 0:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="compile", file=sys.stderr, leave=False)


def worker_count(asked: int | None) -> int:
    """Compile subprocesses to run side by side: ``asked``, else one per core this
    process may use, at most 4 (each holds a JAX of its own, ~1 GiB or more).

    >>> worker_count(2), worker_count(0)
    (2, 1)
    """
    if asked is not None:
        return max(1, int(asked))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 4))


def layout_key(v: Candidate) -> tuple[str, tuple[tuple[str, int], ...]]:
    """``v``'s layout, its preset and mesh: what its remat and microbatch variants share.

    >>> layout_key(Candidate("tp", {"data": 2, "model": 4}, "full", 2))
    ('tp', (('data', 2), ('model', 4)))
    """
    return (v.strategy, tuple(v.mesh.items()))


class Evaluator:
    """The figures of a search's candidates for problem ``p``: each compiled once (a
    twin's program is not compiled again), cached by its configuration. A subclass
    decides what to skip (:meth:`skip`) and what follows a result (:meth:`applied`)."""

    def __init__(self, p: Problem) -> None:
        self.p = p
        self.opts = p.opts
        self.store = Cache(p.opts.cache, shared=p.opts.compile_fn is None)
        self.version = versions()
        self.counters = {"compiled": 0, "cached": 0}
        self.workers: Workers | None = None
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
        if c.offload is not None and (COMPILES_OFFLOAD or opts.compile_fn is not None):
            what["offload"] = c.offload
        return hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()

    def done(self, c: Candidate, result: dict[str, Any], bar: Any) -> None:
        self.store.put(self.key_of(c), result)
        self.counters["compiled"] += 1
        self.applied(c, result)
        bar.set_postfix_str(c.label, refresh=False)
        bar.update(1)

    def applied(self, c: Candidate, result: Mapping[str, Any]) -> None:
        """Applies a compile's ``result`` to ``c``."""
        apply_result(c, result, self.p.memory, self.p.hw)
        if c.offload is not None and c.compiled:
            p = self.p
            parts = None
            if "device" not in result or "host" not in result:
                parts = formula_parts(p.abstract, p.cfg, p.strategy(c.strategy, c.offload),
                                      c.mesh, p.tx, self.opts.batch // c.microbatches,
                                      self.opts.seq, c.remat or "none", self.opts.guard,
                                      c.microbatches)
            apply_offload(c, result, parts, p.memory, p.host_memory)

    def skip(self, c: Candidate, bar: Any) -> bool:
        """Whether ``c``, about to compile, is not compiled after all (here: never)."""
        return False

    def compile_here(self, todo: list[Candidate], bar: Any) -> None:
        opts, p = self.opts, self.p
        for c in todo:
            if self.skip(c, bar):
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
                return self.skip(todo[i], bar)

        if self.workers is None:
            # XLA's CPU compile of one program keeps about one core busy, so one child
            # per core compiles side by side; they live for the whole search, so each
            # starts (Python, JAX, a first compile's warm-up) once, not once per phase.
            # Which child compiles a candidate changes nothing of its figures.
            self.workers = Workers("nnx_shard.planner._compile:compile_step_request",
                                   opts.devices, size=worker_count(opts.workers),
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
        """:func:`~nnx_shard.planner._twins.signature` of a reference config's candidate
        (under ``strat`` in place of its preset where given)."""
        p = self.p
        strat = strat or p.strategy(c.strategy)
        key = layout_key(c)
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


def apply_offload(c: Candidate, result: Mapping[str, Any], parts: Mapping[str, int] | None,
                  memory: int | None, host_memory: int | None) -> None:
    """Sets the device and host bytes of ``c``, an offloading candidate that
    :func:`apply_result` gave ``result``'s figures, and whether it fits ``memory``
    (device) and ``host_memory`` (``None``: not checked). A ``result`` with ``device``
    and ``host`` bytes splits them itself; else (the compile of its layout without
    offload) the device's is the compiled total less the offloaded state (and its guard
    copy) plus their streamed copy, and the host's the offloaded state, both by the
    formula's ``parts`` (:func:`~nnx_shard.planner._formula.formula_parts`).

    >>> from nnx_shard.planner._hardware import PROFILES
    >>> c = Candidate("fsdp", {"data": 8}, offload="optimizer")
    >>> result = {"total": 300, "flops": 1.0, "collective_bytes": 0.0}
    >>> apply_result(c, result, 200, PROFILES["h100-sxm"])
    >>> apply_offload(c, result, {"host": 150, "streamed": 10}, 200, 100)
    >>> c.bytes_per_device, c.host_bytes, c.decided_by, c.fits
    (160, 150, 'compiled less offloaded', False)
    >>> c.reason
    'needs 150 B of host memory per device for its offloaded state, over the 100 B available'
    """
    if "device" in result and "host" in result:
        device, host, by = int(result["device"]), int(result["host"]), "compiled"
    elif parts is None:
        c.fits, c.reason = False, ("its offloaded state cannot be counted (the formula "
                                   "failed on this layout)")
        return
    else:
        host = int(parts["host"])
        # Offloading state moves no temporary to the host: the compiled temp is a floor.
        device = max(int(result["total"]) - host + int(parts["streamed"]),
                     int(result.get("temp", 0)))
        by = OFFLOAD_ESTIMATE
    c.bytes_per_device, c.host_bytes, c.decided_by = device, host, by
    if memory is not None and device > memory:
        c.fits, c.reason = False, (f"needs {fmt_bytes(device)} of device memory per device "
                                   f"with offload {c.offload} ({by}), over the "
                                   f"{fmt_bytes(memory)} available")
    elif host_memory is not None and host > host_memory:
        c.fits, c.reason = False, (f"needs {fmt_bytes(host)} of host memory per device for "
                                   f"its offloaded state, over the {fmt_bytes(host_memory)} "
                                   "available")
    else:
        c.fits, c.reason = True, None


def apply_result(c: Candidate, result: Mapping[str, Any], memory: int | None, hw: Hardware) -> None:
    """Sets ``c``'s figures from a compile's ``result`` (:func:`~nnx_shard.planner._compile
    .compile_step`'s dict, or ``{"error": ...}``), its predicted step time on ``hw`` and
    whether it fits ``memory`` bytes (``None``: unlimited).

    >>> from nnx_shard.planner._hardware import PROFILES
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
