"""What the planner's search found: each :class:`Candidate` it considered, and the
:class:`Plan` that ranks those that fit, says why the others were dropped, and
prints the Python and the ``nnx-shard plan`` command for the best.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from nnx_shard._report import fmt_bytes
from nnx_shard._train._guard import DEFAULT_GUARD
from nnx_shard.planner._hardware import PROFILES, Hardware  # noqa: F401 (PROFILES: the examples)
from nnx_shard.planner._user import user_python

__all__ = ["OFFLOAD_ESTIMATE", "Candidate", "Plan", "clip", "plan_json"]

#: ``Candidate.decided_by`` of an offloading candidate whose compile gives no
#: device/host split: the compiled step's bytes less the offloaded state, plus its
#: streamed copy (the formula's).
OFFLOAD_ESTIMATE = "compiled less offloaded"


@dataclasses.dataclass
class Candidate:
    """One configuration the planner considered.

    Attributes:
      strategy: preset name; mesh: axis -> size; remat: policy (``None``: the
        factory's own); microbatches: per step.
      fits: whether it fits (``None``: not decided).
      reason: why it was dropped (``None`` if it was not).
      bytes_per_device: the figure that decided ``fits``: XLA's compiled total,
        or the formula's where ``compiled`` is False or ``decided_by`` is
        ``"stage formula"`` (a pipeline, whose XLA CPU figure is an upper bound:
        :mod:`nnx_shard.planner._trust`); temp: XLA's temporaries.
      flops, collective_bytes, collectives, memory_bytes: per device per step.
      predicted_s: the cost model's step time.
      offload: what it keeps in host memory between steps
        (:attr:`nnx_shard.strategies.Strategy.offload`; ``None``: nothing).
      host_bytes: with ``offload``, the host memory it takes per device
        (``bytes_per_device`` is then the device's).

    >>> from nnx_shard.planner import Candidate
    >>> c = Candidate("dp", {"data": 8})
    >>> c.label
    'dp data=8 remat=none mb=1'
    >>> Candidate("fsdp", {"data": 8}, offload="optimizer").label
    'fsdp data=8 remat=none mb=1 offload=optimizer'
    """

    strategy: str
    mesh: dict[str, int]
    remat: str | None = "none"
    microbatches: int = 1
    fits: bool | None = None
    reason: str | None = None
    compiled: bool = False
    bytes_per_device: int | None = None
    temp: int | None = None
    flops: float | None = None
    collective_bytes: float | None = None
    collectives: int | None = None
    memory_bytes: float | None = None
    predicted_s: float | None = None
    compile_s: float | None = None
    by_kind: dict[str, float] = dataclasses.field(default_factory=dict)
    decided_by: str = "compiled"
    offload: str | None = None
    host_bytes: int | None = None

    @property
    def label(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        return (f"{self.strategy} {mesh} remat={self.remat or 'own'} mb={self.microbatches}"
                + (f" offload={self.offload}" if self.offload else ""))

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "label": self.label}


@dataclasses.dataclass
class Plan:
    """What :func:`auto` found: ``ranked`` (fitting candidates, fastest predicted
    first), ``dropped`` (with reasons), ``pruned`` (what the search skipped, in
    words), the ``hardware``, the request and ``twins`` (fitting candidates left
    out of ``ranked`` as they compile to the program of a better-ranked one).

    Attributes:
      ranked: the fitting candidates, the fastest predicted first.
      dropped: the candidates that do not fit or failed, each with its ``reason``.
      pruned: what the search skipped, in words.
      hardware: the :class:`Hardware` profile the costs were predicted for.
      request: what was asked (model, devices, batch, ...), as the report shows it.
      twins: fitting candidates left out of ``ranked``: they compile to the program of
        a better-ranked one.

    >>> from nnx_shard.planner import Plan, hardware
    >>> Plan([], [], [], hardware("h100-sxm"), {}).best is None
    True
    """

    ranked: list[Candidate]
    dropped: list[Candidate]
    pruned: list[str]
    hardware: Hardware
    request: dict[str, Any]
    twins: list[Candidate] = dataclasses.field(default_factory=list)

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    def families(self) -> dict[str, str]:
        """Per preset without a fitting candidate: why (its dropped candidates' reasons,
        those of compiled candidates first, then those of candidates the search left out,
        then those of layouts that cannot be laid out: the most telling first).

        >>> from nnx_shard.planner import Candidate, Plan, hardware
        >>> Plan([], [Candidate("tp", {"data": 1, "model": 8}, reason="x"),
        ...           Candidate("tp", {"data": 4, "model": 2}, reason="y", compiled=True)], [],
        ...      hardware("h100-sxm"), {}).families()
        {'tp': 'data=4,model=2: y; data=1,model=8: x'}
        """
        # preset -> reason -> the candidates it applies to (one reason said once)
        out: dict[str, dict[str, list[str]]] = {}
        # A preset whose fitting layout is another's program (ep on a dense model) fits.
        ok = {c.strategy for c in self.ranked + self.twins}
        for c in self.dropped:
            if c.strategy in ok:
                continue
            mesh = ",".join(f"{k}={v}" for k, v in c.mesh.items())
            extra = "" if c.remat in ("none", None) and c.microbatches == 1 else \
                f" (remat={c.remat}, mb={c.microbatches})"
            out.setdefault(c.strategy, {}).setdefault(str(c.reason), []).append(mesh + extra)
        rank: dict[str, int] = {}
        for c in self.dropped:
            r = 0 if c.compiled else 1 if str(c.reason).startswith("not compiled") else 2
            rank[str(c.reason)] = min(rank.get(str(c.reason), r), r)
        return {k: "; ".join(f"{' and '.join(_dedupe(who))}: {why}"
                             for why, who in sorted(v.items(), key=lambda item: rank[item[0]]))
                for k, v in out.items()}

    def python(self) -> str:
        """Python that trains with the best candidate.

        >>> from nnx_shard.planner import Plan, hardware
        >>> Plan([], [], [], hardware("h100-sxm"), {}).python()
        ''
        """
        c = self.best
        if c is None:
            return ""
        if "loss" in self.request:  # a model of the user's own, with its loss
            return user_python(self.request, c.strategy, c.mesh, c.microbatches)
        model = self.request.get("model_name")
        guard = self.request.get("guard", DEFAULT_GUARD)
        mesh = ", ".join(f'"{k}": {v}' for k, v in c.mesh.items())
        if model:
            make = (f"cfg = dataclasses.replace(get_config({model!r}), remat={c.remat!r})\n"
                    "factory = lambda: Decoder(cfg, rngs=nnx.Rngs(0))\n")
            head = ("import dataclasses\n\nimport optax\nfrom flax import nnx\n\n"
                    "import nnx_shard as ns\n"
                    "from nnx_shard.models import Decoder, get_config, lm_loss\n\n")
        else:
            make = ("factory = my_factory" + (f"  # with remat={c.remat!r}" if c.remat else "")
                    + "\n")
            head = "import optax\n\nimport nnx_shard as ns\nfrom nnx_shard.models import lm_loss\n\n"
        offload = f".with_offload({c.offload!r})" if c.offload else ""
        return (
            f"{head}strategy = ns.strategies.get({c.strategy!r}){offload}\n"
            f"mesh = ns.make_mesh({{{mesh}}})\n{make}"
            "model = ns.sharded_init(factory, mesh, strategy)\n"
            f"opt = ns.sharded_optimizer(model, optax.{self.request.get('optimizer', 'adamw')}"
            "(1e-3), mesh, strategy)\n"
            "trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=strategy.rules,\n"
            f"                     microbatches={c.microbatches}, batch_names=(\"batch\", \"length\")"
            + (f",\n                     guard={guard!r})\n" if guard != DEFAULT_GUARD else ")\n")
            + f"# trainer.fit(batches)  # batches: {{'inputs', 'targets'}} int32 "
            f"[{self.request.get('batch')}, {self.request.get('seq')}]\n"
        )

    def command(self) -> str:
        """The ``nnx-shard plan`` command that shows the best candidate's memory in detail.

        >>> from nnx_shard.planner import Plan, hardware
        >>> Plan([], [], [], hardware("h100-sxm"), {}).command()
        ''
        """
        c = self.best
        model = self.request.get("model_name")
        if c is None or not model:
            return ""
        mesh = ",".join(f"{k}={v}" for k, v in c.mesh.items())
        guard = self.request.get("guard", DEFAULT_GUARD)
        return (f"nnx-shard plan --model {model} --strategy {c.strategy} --mesh {mesh} "
                f"--batch {self.request['batch']} --seq {self.request['seq']} "
                f"--remat {c.remat} --optimizer {self.request.get('optimizer', 'adamw')}"
                + (f" --guard {guard}" if guard != DEFAULT_GUARD else "")
                + (f" --offload {c.offload}" if c.offload else ""))

    def table(self, top: int = 5) -> str:
        """The ranked candidates as a text table.

        >>> from nnx_shard.planner import Plan, hardware
        >>> print(Plan([], [], [], hardware("h100-sxm"), {}).table())
        (no candidate fits)
        """
        if not self.ranked:
            return "(no candidate fits)"
        offload = any(c.offload for c in self.ranked[:top])
        head: tuple[str, ...] = (
            "rank", "strategy", "mesh", "remat", "mb", "bytes/device", "collective B",
            "GFLOP/dev", "predicted")
        if offload:  # the device's bytes, then what is in host memory
            head = (*head[:5], "offload", "device B", "host B/device", *head[6:])
        rows = [head]
        for i, c in enumerate(self.ranked[:top], 1):
            row: tuple[str, ...] = (
                str(i), c.strategy, ",".join(f"{k}={v}" for k, v in c.mesh.items()),
                str(c.remat or "own"), str(c.microbatches),
                fmt_bytes(c.bytes_per_device or 0)
                + ("*" if c.decided_by == "stage formula" else ""),
                fmt_bytes(c.collective_bytes or 0),
                f"{(c.flops or 0) / 1e9:.4g}", _secs(c.predicted_s or 0.0))
            if offload:
                row = (*row[:5], str(c.offload or "-"), row[5],
                       fmt_bytes(c.host_bytes) if c.host_bytes is not None else "-", *row[6:])
            rows.append(row)
        left = 6 if offload else 5  # the text columns, left-aligned
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(x.ljust(w) if j < left else x.rjust(w)
                           for j, (x, w) in enumerate(zip(r, widths, strict=True)))
                 for r in rows]
        if any(c.decided_by == "stage formula" for c in self.ranked[:top]):
            lines.append("* a pipeline's per-stage formula (XLA CPU's compiled figure for a "
                         "pipeline is an upper bound; a floor: leave headroom)")
        if any(c.decided_by == OFFLOAD_ESTIMATE for c in self.ranked[:top]):
            lines.append("device B of an offloading candidate: the compiled step without "
                         "offload less the offloaded state the formula counts, plus its copy "
                         "streamed in during the step (the compile gives no device/host split)")
        return "\n".join(lines)

    def __str__(self) -> str:
        r = self.request
        hw = self.hardware
        mem = "unlimited" if r.get("device_memory") is None else fmt_bytes(r["device_memory"])
        if r.get("offload_tried"):
            host = r.get("host_memory")
            mem += ", host memory " + ("not checked" if host is None else fmt_bytes(host))
        out = [f"plan --auto: model {r.get('model_label')}, {r.get('devices')} devices, batch "
               f"{r.get('batch')} x seq {r.get('seq')}, {r.get('optimizer')}, memory {mem} "
               "per device",
               *_params_line(r),
               f"hardware: {hw.name}: {hw.peak_flops / 1e12:.3g} TFLOP/s ({hw.precision}), "
               f"link {hw.link_bandwidth / 1e9:.3g} GB/s"
               + (f", memory {hw.memory_bandwidth / 1e9:.4g} GB/s" if hw.memory_bandwidth
                  else "")
               + (f", latency {hw.link_latency * 1e6:.0f} us" if hw.link_latency else ""),
               f"considered {r.get('considered', 0)} candidates, compiled "
               f"{r.get('compiled', 0)} ({r.get('cached', 0)} from cache), "
               f"{len(self.ranked)} fit", "", self.table(r.get("top", 5)), ""]
        fams = self.families()
        if fams:
            out.append("dropped (per preset with nothing that fits):")
            out += [f"  {k}: {clip(v)}" for k, v in fams.items()]
            out.append("")
        if self.pruned:
            out.append("pruned:")
            out += [f"  - {p}" for p in self.pruned]
            out.append("")
        if self.best is not None:
            offload = self.best.offload
            if offload:
                what = {"optimizer": "the optimizer state", "optimizer+params":
                        "the optimizer state and the parameters"}.get(offload, offload)
                out.append(f"offloads {what} to host memory ({fmt_bytes(self.best.host_bytes or 0)} "
                           "per device): nothing fits in device memory without it")
            out.append(f"chosen: {self.best.label}; train with:")
            out.append("")
            out += [("    " + ln).rstrip() for ln in self.python().splitlines()]
            if self.command():
                out += ["", f"check its memory in detail: {self.command()}"]
        out.append("")
        out.append("predicted = matmul FLOPs/device / peak + collective bytes sent/device / link"
                   " bandwidth + collectives x latency + memory traffic / memory bandwidth; "
                   "bytes/device is XLA CPU's buffer assignment of the compiled step (a GPU/TPU "
                   "compile can differ).")
        return "\n".join(out)


def clip(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _dedupe(items: Iterable[str]) -> list[str]:
    seen: list[str] = []
    for x in items:
        if x not in seen:
            seen.append(x)
    return seen


def _secs(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"




def plan_json(plan: Plan, error: str | None) -> dict[str, Any]:
    """``plan`` as ``nnx-shard plan --auto --json`` prints it (``error``: why nothing fits).

    >>> sorted(plan_json(Plan([], [], [], PROFILES["h100-sxm"], {}), None))
    ['command', 'dropped', 'error', 'families', 'hardware', 'pruned', 'python', 'ranked', 'request']
    """
    return {"request": plan.request, "hardware": dataclasses.asdict(plan.hardware),
            "ranked": [c.as_dict() for c in plan.ranked],
            "dropped": [c.as_dict() for c in plan.dropped], "families": plan.families(),
            "pruned": plan.pruned, "python": plan.python(), "command": plan.command(),
            "error": error}


def _params_line(request: dict[str, Any]) -> list[str]:
    """``parameters: 46.7B, 12.9B active per token`` (a mixture of experts: the
    experts a token is not routed to do not count), or nothing when not known.

    >>> _params_line({"params": 46_702_792_704, "active_params": 12_879_925_248})
    ['parameters: 46.7B, 12.9B active per token (mixture of experts)']
    >>> _params_line({})
    []
    """
    if "params" not in request:
        return []
    def count(n: int) -> str:
        return (f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6
                else f"{n:,}")
    line = f"parameters: {count(request['params'])}"
    if "active_params" in request:
        line += f", {count(request['active_params'])} active per token (mixture of experts)"
    return [line]
