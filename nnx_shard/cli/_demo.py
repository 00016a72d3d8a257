"""``nnx-shard demo``: the reference transformer trained as a character-level
language model on the Python standard library's sources, sharded with a
strategy, showing every piece working: the sharding report, training with a
progress bar, held-out loss against the unigram baseline, a loss-curve PNG
(matplotlib, the ``plot`` extra) and a JSON summary, a checkpoint restored onto
a different mesh and strategy, and a text sample from the restored model.

The command line (flags, errors) is :mod:`nnx_shard.cli`'s; this module runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nnx_shard._axes import sizes_str
from nnx_shard.cli import _demo_outputs as demo_outputs
from nnx_shard.cli._common import PROG
from nnx_shard.cli._common import UsageError as _Usage
from nnx_shard.cli._common import mesh_sizes as _mesh_sizes
from nnx_shard.cli._common import simulate_devices as _simulate_devices
from nnx_shard.cli._common import strategy as _strategy
from nnx_shard.cli._demo_args import check_demo_args, check_size, demo_config

if TYPE_CHECKING:
    from nnx_shard.strategies import Strategy

__all__ = ['plot_losses']

PLOT_EXTRA = "pip install 'nnx_shard[plot]'"


def _sample(model: Any, prompt: Any, n: int, temperature: float, seed: int) -> Any:
    """``n`` tokens after the 1-D ``prompt`` through the cached path
    (:func:`nnx_shard.inference.generate`), in chunks of half the model's context,
    each prompted with the last half-context of the text so far: every chunk has
    the same shapes, so one prefill and one decode program serve them all."""
    import numpy as np

    from nnx_shard.inference import GenerationConfig, generate

    if n < 1:
        return np.zeros((0,), np.int32)
    context = model.max_length
    new = min(max(context // 2, 1), n)
    # every character may be drawn (top_k=None): the demo's samples as they always were
    config = GenerationConfig(max_new_tokens=new, do_sample=temperature > 0,
                              temperature=temperature, top_k=None)
    text = np.asarray(prompt, np.int32)
    for chunk in range(-(-n // new)):
        window = text[-(context - new):][None]
        out = np.asarray(generate(model, window, config, seed=seed + chunk))
        text = np.concatenate([text, out[0, window.shape[1]:]])
    return text[len(prompt):len(prompt) + n]


def plot_losses(path: str | os.PathLike[str], train: Sequence[tuple[float, float]],
                heldout: Sequence[tuple[float, float]], baseline: float) -> None:
    """Writes the demo's loss curves as a PNG with matplotlib (the ``plot`` extra):
    training loss (line), held-out loss (dots) and the unigram baseline (dashes)
    against the step, in nats per character. Raises ``ImportError`` naming the
    extra when matplotlib is not installed.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "loss.png")
    >>> plot_losses(p, [(1, 4.0), (2, 3.0), (3, 2.5)], [(3, 2.6)], 3.2)
    >>> open(p, "rb").read(8)
    b'\\x89PNG\\r\\n\\x1a\\n'
    """
    try:
        # A Figure of its own, not pyplot: no display needed, and the
        # backend the caller chose for pyplot is left alone.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"the loss plot needs matplotlib: {PLOT_EXTRA}") from e
    fig = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train, strict=True), color="tab:blue", linewidth=1.2,
                label="training loss")
    if heldout:
        ax.plot(*zip(*heldout, strict=True), color="tab:orange", marker="o", linestyle="--",
                linewidth=1, label="held-out loss")
    ax.axhline(baseline, color="grey", linestyle=":", linewidth=1.5,
               label=f"unigram baseline ({baseline:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/char)")
    ax.set_title("nnx-shard demo: character-level language model")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(os.fspath(path), format="png")


# --------------------------------------------------------------------------- what the demo wrote

#: The demo's record, in ``--out``, of the outputs it wrote there (JSON).
MARKER = demo_outputs.MARKER
_Outputs = demo_outputs.Outputs


def _strict_json(value: Any) -> Any:
    """``value`` with non-finite floats as ``None``: JSON has no NaN or Infinity.

    >>> _strict_json({"a": [1.0, float("nan")], "b": float("inf"), "c": "x"})
    {'a': [1.0, None], 'b': None, 'c': 'x'}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(v) for v in value]
    return value


def _write_summary(path: Path, summary: dict[str, Any]) -> None:
    path.write_text(json.dumps(_strict_json(summary), indent=1, allow_nan=False))


@dataclasses.dataclass(frozen=True)
class _Layouts:
    """What :func:`_setup` checked before anything runs: the strategies, the devices, the
    meshes to train and to restore on, the model's config and factory, the restore target."""

    strategy: Strategy
    restore_strategy: Strategy
    devices: list[Any]
    sizes: dict[str, int]
    axis_types: str
    mesh: Any
    cfg: Any
    factory: Callable[[], Any]
    restore_sizes: dict[str, int]
    restore_mesh: Any
    target: Any

    @property
    def n(self) -> int:
        return len(self.devices)


@dataclasses.dataclass
class _Run:
    """The state one demo run carries from phase to phase."""

    args: argparse.Namespace
    out: Path
    outputs: _Outputs
    simulated: bool
    t_start: float
    layouts: _Layouts
    stage: demo_outputs.Stage
    corpus: Any = None
    baseline: float = 0.0
    heldout_host: Any = None
    evaluate: Any = None
    model: Any = None
    optimizer: Any = None
    report: Any = None
    trainer: Any = None
    history: Any = None
    evals: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    marks: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    tokens_per_step: int = 0


def _demo(args: argparse.Namespace) -> int:
    run = _setup(args)
    try:
        _load_data(run)
        _train(run)
        if run.history.stop_reason is not None:
            return _report_stop(run)
        first, final, tokens_s = _report_training(run)
        ckpt, restored, restored_loss = _checkpoint_restore(run, final)
        prompt, sample = _sample_restored(run, restored)
        png = _plot(run)
        _finish(run, first=first, final=final, tokens_s=tokens_s, ckpt=ckpt,
                restored_loss=restored_loss, prompt=prompt, sample=sample, png=png)
        return 0
    finally:
        # What the run wrote but did not move into place (it failed or stopped early).
        run.stage.remove()


def _setup(args: argparse.Namespace) -> _Run:
    """Checks the flags and every layout before anything is trained or written."""
    check_demo_args(args)
    out = Path(args.out)
    outputs = _Outputs(out)
    outputs.check()
    simulated = _simulate_devices()
    import jax
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import Decoder

    t_start = time.perf_counter()
    strategy = _strategy(args.strategy)
    restore_name = args.restore_strategy or ("fsdp" if strategy.name == "tp" else "tp")
    restore_strategy = _strategy(restore_name, "--restore-strategy")
    devices = jax.devices()
    if len(devices) == 1 and len(jax.devices("cpu")) > 1:
        devices = jax.devices("cpu")  # one accelerator: use the simulated CPU devices
    n = len(devices)
    if args.mesh:
        sizes = _mesh_sizes(args.mesh)
    else:
        sizes = strategy.mesh_for(n)
    need = math.prod(sizes.values())
    if need > n:
        raise _Usage(f"--mesh {sizes_str(sizes)} needs {need} devices but {n} are available")
    axis_types = args.axis_types or "explicit"
    mesh = ns.make_mesh(sizes, devices=devices[:need], axis_types=axis_types)
    try:
        cfg = demo_config(args, strategy.name)
    except ValueError as e:
        raise _Usage(str(e)) from None
    check_size(cfg)

    def factory() -> Decoder:
        return Decoder(cfg, rngs=nnx.Rngs(args.seed))

    # Every layout is checked before training, so a bad flag never costs a run.
    strategy.check(nnx.eval_shape(factory), sizes)
    if args.restore_mesh:
        restore_sizes = _mesh_sizes(args.restore_mesh, "--restore-mesh")
        if math.prod(restore_sizes.values()) > n:
            raise _Usage(f"--restore-mesh {args.restore_mesh} needs more than the {n} "
                         "devices available")
    else:
        restore_sizes = (restore_strategy.suggest_mesh(nnx.eval_shape(factory), need)
                         or restore_strategy.mesh_for(need))
    restore_mesh = ns.make_mesh(restore_sizes,
                                devices=devices[: math.prod(restore_sizes.values())])
    layouts = _Layouts(strategy, restore_strategy, list(devices), sizes, axis_types, mesh, cfg,
                       factory, restore_sizes, restore_mesh,
                       ns.abstract_init(factory, restore_mesh, restore_strategy))

    out.mkdir(parents=True, exist_ok=True)
    # Everything is written here first; the previous run's outputs stay until this one
    # has succeeded (_commit).
    return _Run(args=args, out=out, outputs=outputs, simulated=simulated, t_start=t_start,
                layouts=layouts, stage=demo_outputs.Stage.create(out))


def _say(*parts: Any) -> None:
    print(*parts, flush=True)


def _load_data(run: _Run) -> None:
    """Loads the corpus and its held-out batches, and says what runs on what."""
    from nnx_shard.corpus import load_stdlib

    args, cfg = run.args, run.layouts.cfg
    corpus = run.corpus = load_stdlib()
    run.baseline = corpus.unigram_baseline()
    try:
        run.heldout_host = corpus.heldout_batches(args.batch, cfg.length)
    except ValueError as e:
        raise _Usage(f"--batch {args.batch} x --seq {cfg.length}: {e}") from None
    _say(f"nnx-shard demo: {run.layouts.n} {run.layouts.devices[0].platform.upper()} devices"
         f"{' (simulated)' if run.simulated else ''}, "
         f"strategy {run.layouts.strategy.name}, mesh {sizes_str(run.layouts.sizes)} ({run.layouts.axis_types} axes)")
    _say(f"data: {len(corpus.train):,} training characters from {len(corpus.files)} standard "
         f"library files, {len(corpus.heldout):,} held-out ({', '.join(corpus.heldout_files)})")
    _say(f"model: Decoder {cfg.layers} layers, embed {cfg.embed}, {cfg.heads} heads, "
         f"mlp {cfg.mlp}{f', {cfg.experts} experts' if cfg.experts else ''}, context "
         f"{cfg.length}, {cfg.num_params:,} parameters")


def _train(run: _Run) -> None:
    """Initialises the sharded model and optimizer and trains it, evaluating on the way."""
    import numpy as np
    import optax
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import lm_loss

    args, cfg, strategy, mesh = run.args, run.layouts.cfg, run.layouts.strategy, run.layouts.mesh
    # The cosine decays over the steps after the warm-up: at least one (--steps 1: none).
    warmup = min(100, max(1, args.steps // 10), args.steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps,
                                                  args.lr * 0.1)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b2=0.99, weight_decay=0.01))
    model = run.model = ns.sharded_init(run.layouts.factory, mesh, strategy)
    optimizer = run.optimizer = ns.sharded_optimizer(model, tx, mesh, strategy)
    run.report = ns.explain(model, mesh, strategy, tx)
    _say(f"\nsharding report (ns.explain(model, mesh, ns.strategies.get({strategy.name!r}), tx)):")
    _say(_short_report(run.report))

    heldout = [ns.shard_batch(b, mesh, strategy.rules) for b in run.heldout_host]
    eval_loss = nnx.jit(lm_loss)

    def evaluate(m: Any, on_mesh: Any, rules: Any, batches: list[Any]) -> float:
        with ns.use(on_mesh, rules):
            # One call at a time: the result is read before the next is dispatched.
            return float(np.mean([float(eval_loss(m, b)) for b in batches]))

    run.evaluate = evaluate
    tokens_per_step = run.tokens_per_step = args.batch * cfg.length
    every = max(1, args.steps // 10)
    evals, marks = run.evals, run.marks
    tty = sys.stderr.isatty() and not args.no_progress
    next_eval = [max(1, args.steps // args.evals)]
    next_line = [every]

    def on_step(step: int, metrics: dict[str, Any]) -> None:
        marks.append((step, time.perf_counter()))
        if step >= next_eval[0] or step == args.steps:
            evals.append((step, evaluate(model, mesh, strategy.rules, heldout)))
            next_eval[0] = step + max(1, args.steps // args.evals)
        if not tty and (step >= next_line[0] or step == args.steps):
            rate = _rate(marks, tokens_per_step)
            _say(f"step {step}/{args.steps}  loss {float(metrics['loss'][-1]):.3f}"
                 + (f"  {rate:,.0f} tokens/s" if rate else ""))
            while next_line[0] <= step:
                next_line[0] += every

    trainer = run.trainer = ns.Trainer(model, optimizer, lm_loss, mesh=mesh,
                                       rules=strategy.rules,
                                       steps_per_call=args.steps_per_call)
    _say(f"\ntraining {args.steps} steps, batch {args.batch} x {cfg.length} characters, "
         f"{args.steps_per_call} steps per compiled call")
    first = evaluate(model, mesh, strategy.rules, heldout)
    evals.append((0, first))
    with warnings.catch_warnings():
        # A non-finite stop is reported below, as the demo's own error.
        warnings.filterwarnings("ignore", message="Trainer.fit: ", category=RuntimeWarning)
        run.history = trainer.fit(run.corpus.batches(args.batch, cfg.length, seed=args.seed),
                                  args.steps, progress=tty, callbacks=[on_step])


def _report_stop(run: _Run) -> int:
    """A run that did not finish: its summary.json, an error, exit status 1."""
    args, out, history = run.args, run.out, run.history
    losses = history["loss"]
    # No held-out loss, checkpoint or sample of a run that did not finish: the last
    # evaluation would be stale. summary.json says what happened.
    # The previous run's summary (if any) stays: this one goes beside it.
    name = "summary.stopped.json" if run.outputs.owns("summary.json") else "summary.json"
    _write_summary(run.stage.path / name, {
        "strategy": run.layouts.strategy.name, "mesh": run.layouts.sizes, "devices": run.layouts.n,
        "config": _jsonable_config(run.layouts.cfg), "steps": len(losses),
        "steps_requested": args.steps,
        "lr": args.lr, "seed": args.seed, "stop_reason": history.stop_reason,
        "heldout_loss": None, "heldout_evals": [[s, v] for s, v in run.evals],
        "loss": losses.tolist(), "total_seconds": time.perf_counter() - run.t_start,
    })
    _place(run, name)
    kept = " (the previous run's outputs are kept)" if name != "summary.json" else ""
    print(f"{PROG}: error: training stopped after {len(losses)} of {args.steps} steps: "
          f"{history.stop_reason}. No checkpoint was written{kept} (see "
          f"{out / name}); try a lower --lr.", file=sys.stderr)
    return 1


def _place(run: _Run, name: str) -> None:
    """Moves the staged output ``name`` into ``--out``, recorded first (the record
    proves both the old and the new one until the move is done)."""
    src, dst = run.stage.path / name, run.out / name
    if os.path.lexists(dst) and not run.outputs.owns(name):
        raise _Usage(f"--out {str(run.out)!r} now holds {name}, which the demo did not "
                     "write (it appeared during the run); it is kept. Move it, and run again")
    run.outputs.expect(name, src)
    os.replace(src, dst)
    run.outputs.prove(name)


def _commit(run: _Run, png: Path | None) -> None:
    """Moves a finished run's outputs into place, replacing the previous run's (only
    what the record proves the demo wrote): checkpoint step, plot, summary last."""
    from nnx_shard._checkpoint._internal import delete_step

    ckpt = run.out / "checkpoint"
    if os.path.lexists(ckpt) and not run.outputs.owns("checkpoint"):
        raise _Usage(f"--out {str(run.out)!r} now holds checkpoint, which the demo did not "
                     "write (it appeared during the run); it is kept. Move it, and run again")
    ckpt.mkdir(exist_ok=True)
    run.outputs.prove("checkpoint")
    old = run.outputs.steps()
    step = run.trainer.step
    name = f"checkpoint/{step}"
    if step in old:
        delete_step(ckpt, step)
        run.outputs.forget(name)
    elif os.path.lexists(ckpt / str(step)):
        raise _Usage(f"--out {str(run.out)!r} holds {name}, which the demo did not write; "
                     "it is kept. Move it, and run again")
    run.outputs.expect(name, run.stage.path / name)
    os.rename(run.stage.path / name, ckpt / str(step))
    run.outputs.prove(name)
    for s in old:
        if s != step:
            delete_step(ckpt, s)
            run.outputs.forget(f"checkpoint/{s}")
    if png is not None:
        _place(run, "loss.png")
    elif run.outputs.owns("loss.png"):
        # A previous run's plot would pass for this one's.
        (run.out / "loss.png").unlink()
        run.outputs.forget("loss.png")
    _place(run, "summary.json")
    if run.outputs.owns("summary.stopped.json"):  # a stopped run's, older than this one
        (run.out / "summary.stopped.json").unlink()
        run.outputs.forget("summary.stopped.json")


def _report_training(run: _Run) -> tuple[float, float, float]:
    """Says how training went: (first held-out loss, final one, tokens per second)."""
    history = run.history
    losses = history["loss"]
    first = run.evals[0][1]
    final = run.evals[-1][1]
    tokens_s = (_rate(run.marks, run.tokens_per_step)
                or run.tokens_per_step * len(losses) / history.seconds)
    baseline = run.baseline
    _say(f"trained {len(losses)} steps in {history.seconds:.1f} s (compilation included): "
         f"{tokens_s:,.0f} tokens/s after compiling")
    _say(f"held-out loss {final:.3f} nats/char (from {first:.3f} at step 0); unigram baseline "
         f"{baseline:.3f} -> {'below' if final < baseline else 'NOT below'} it by "
         f"{baseline - final:.3f}")
    return first, final, tokens_s


def _checkpoint_restore(run: _Run, final: float) -> tuple[Any, Any, float]:
    """Saves a checkpoint and restores it onto the other mesh and strategy:
    (checkpoint path, restored model, its held-out loss)."""
    import nnx_shard as ns

    trainer, restore_strategy = run.trainer, run.layouts.restore_strategy
    ckpt_dir = run.stage.path / "checkpoint"  # moved to --out once the run has succeeded
    ns.save(ckpt_dir, trainer.step, model=run.model, optimizer=run.optimizer,
            extra={"config": _jsonable_config(run.layouts.cfg), "strategy": run.layouts.strategy.name,
                   "mesh": run.layouts.sizes, "data_position": trainer.data_position})
    ckpt = run.out / "checkpoint" / str(trainer.step)
    _say(f"\nsaved checkpoint {ckpt} ({run.layouts.strategy.name} on {sizes_str(run.layouts.sizes)})")
    restored = ns.restore(ckpt_dir, model=run.layouts.target)
    restored_heldout = [ns.shard_batch(b, run.layouts.restore_mesh, restore_strategy.rules)
                        for b in run.heldout_host]
    restored_loss = run.evaluate(restored, run.layouts.restore_mesh, restore_strategy.rules,
                                 restored_heldout)
    example = "blocks/0/mlp/up"
    before = _spec_of(run.model, example)
    after = _spec_of(restored, example)
    _say(f"restored it as {restore_strategy.name} on {sizes_str(run.layouts.restore_sizes)}: {example} "
         f"{before} -> {after}; held-out loss {restored_loss:.3f} "
         f"({'same' if abs(restored_loss - final) < 1e-3 else 'DIFFERENT'})")
    return ckpt, restored, restored_loss


def _sample_restored(run: _Run, restored: Any) -> tuple[Any, str]:
    """Samples the restored model from a held-out prompt: (prompt tokens, sample text)."""
    import nnx_shard as ns
    from nnx_shard.corpus import decode

    args, corpus = run.args, run.corpus
    window = run.layouts.cfg.length
    text = decode(corpus.heldout)
    at = text.find("\n    def ", window)
    at = at + len("\n    def ") if at >= 0 else window
    prompt = corpus.heldout[at - window: at]
    # One sequence: its batch (and its cache's) replicated.
    gen_rules = run.layouts.restore_strategy.rules | {"batch": None, "cache_batch": None}
    with ns.use(run.layouts.restore_mesh, gen_rules):
        sample = decode(_sample(restored, prompt, args.sample_chars, args.temperature,
                                args.seed))
    _say(f"\nsample from the restored model (temperature {args.temperature}), prompted with "
         f"held-out text:\n{'-' * 60}\n{decode(prompt)}\033[1m{sample}\033[0m\n{'-' * 60}"
         if sys.stdout.isatty() else
         f"\nsample from the restored model (temperature {args.temperature}), prompted with "
         f"held-out text (continuation after '>>>'):\n{'-' * 60}\n{decode(prompt)}>>>"
         f"{sample}\n{'-' * 60}")
    return prompt, sample


def _plot(run: _Run) -> Path | None:
    """Writes loss.png, or says why not: its path, or None without matplotlib."""
    out, history = run.out, run.history
    steps = history["step"].tolist()
    png: Path | None = out / "loss.png"
    try:
        plot_losses(run.stage.path / "loss.png",
                    list(zip(steps, history["loss"].tolist(), strict=True)),
                    run.evals, run.baseline)
    except ImportError:
        png = None
        _say(f"\nno loss plot: matplotlib is not installed ({PLOT_EXTRA} to get loss.png)")
    return png


def _finish(run: _Run, *, first: float, final: float, tokens_s: float, ckpt: Any,
            restored_loss: float, prompt: Any, sample: str, png: Path | None) -> None:
    """Writes summary.json and says where the outputs are."""
    from nnx_shard.corpus import decode

    args, cfg, out, history, report = run.args, run.layouts.cfg, run.out, run.history, run.report
    losses = history["loss"]
    summary = {
        "strategy": run.layouts.strategy.name, "mesh": run.layouts.sizes, "devices": run.layouts.n,
        "platform": run.layouts.devices[0].platform, "simulated_devices": run.simulated,
        "config": _jsonable_config(cfg), "num_params": cfg.num_params,
        "steps": len(losses), "steps_per_call": args.steps_per_call, "batch": args.batch,
        "seq": cfg.length, "lr": args.lr, "seed": args.seed, "stop_reason": None,
        "train_seconds": history.seconds, "tokens_per_s": tokens_s,
        "train_loss_first": float(losses[0]), "train_loss_last": float(losses[-1]),
        "heldout_loss_initial": first, "heldout_loss": final,
        "unigram_baseline": run.baseline, "heldout_evals": [[s, v] for s, v in run.evals],
        "param_bytes_per_device": report.param_bytes_per_device,
        "param_bytes_total": report.total_bytes,
        "opt_bytes_per_device": report.opt_bytes_per_device,
        "checkpoint": str(ckpt), "restore_strategy": run.layouts.restore_strategy.name,
        "restore_mesh": run.layouts.restore_sizes, "heldout_loss_restored": restored_loss,
        "sample_prompt": decode(prompt), "sample": sample,
        "loss": losses.tolist(), "loss_png": None if png is None else str(png),
        "total_seconds": time.perf_counter() - run.t_start,
    }
    _write_summary(run.stage.path / "summary.json", summary)
    _commit(run, png)
    wrote = f"{png} and {out / 'summary.json'}" if png else f"{out / 'summary.json'}"
    _say(f"\nwrote {wrote} ({summary['total_seconds']:.0f} s in all)")


def _rate(marks: list[tuple[int, float]], tokens_per_step: int) -> float | None:
    # From the end of the first compiled call on: compilation is not throughput.
    if len(marks) < 2 or marks[-1][1] <= marks[0][1]:
        return None
    return (marks[-1][0] - marks[0][0]) * tokens_per_step / (marks[-1][1] - marks[0][1])


def _spec_of(model: Any, path: str) -> str:
    from nnx_shard._report import spec_txt

    obj = model
    for part in path.split("/"):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return spec_txt(obj.get_value().sharding.spec)


def _jsonable_config(cfg: Any) -> dict[str, Any]:

    import numpy as np

    return {k: (np.dtype(v).name if k.endswith("dtype") else v)
            for k, v in dataclasses.asdict(cfg).items()}


def _short_report(report: Any) -> str:
    """The explain table with the repeated blocks folded: block 0 shown, the rest counted."""

    shown = tuple(r for r in report.rows
                  if r.group == "params" and not re.match(r"blocks/[1-9]", r.path))
    table = str(dataclasses.replace(report, rows=shown)).partition("\n\n")[0]
    hidden = len(report.rows) - len(shown)
    more = (f"... and {hidden} more rows: blocks 1.. as block 0, and the optimizer state "
            "(laid out like its parameter)\n" if hidden else "")
    return table + "\n" + more + "\n" + str(report).partition("\n\n")[2]
