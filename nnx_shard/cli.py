"""The ``nnx-shard`` command: ``demo``, ``plan``, ``explain`` and ``launch``.

* ``nnx-shard demo`` trains the reference transformer as a character-level
  language model on the Python standard library's sources, sharded with a
  strategy (``fsdp_tp`` by default), and shows every piece working: the
  sharding report, training with a progress bar, held-out loss against the
  unigram baseline, a loss-curve PNG and a JSON summary, a checkpoint restored
  onto a different mesh and strategy, and a text sample from the restored model.
  With a single device it simulates 8 CPU devices.
* ``nnx-shard plan`` answers "will this model fit on that many devices with that
  strategy?" without allocating anything: it compiles the train step for the mesh
  on as many simulated CPU devices in a subprocess (XLA's per-device bytes decide),
  next to a formula's estimate of parameters, gradients, optimizer state and
  activations.
* ``nnx-shard explain module:factory`` prints the per-parameter report of your own model.
* ``nnx-shard launch`` starts a local multi-process job (see :mod:`nnx_shard.launch`).

The demo asks for simulated devices (``jax_num_cpu_devices``) before JAX starts
its backends (importing jax does not start them; the first ``jax.devices()``
does).

>>> main(["plan", "--model", "tiny", "--mesh", "data=4,model=2", "--batch", "8",
...       "--seq", "16", "--json", "--no-compile"])  # doctest: +ELLIPSIS
{"model": "tiny", ...}
0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import textwrap
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["main"]

PROG = "nnx-shard"
_FORCE = "--xla_force_host_platform_device_count"
SIMULATED_DEVICES = 8


class _Usage(Exception):
    """A bad command line: reported as one ``nnx-shard: error: ...`` line, exit 2."""


DEBUG_ENV = "NNX_SHARD_DEBUG"
_DEBUG_HINT = f"(--debug or {DEBUG_ENV}=1 shows the traceback)"


class _Parser(argparse.ArgumentParser):
    """argparse, with errors on one line (no usage dump) and no exit from inside parsing."""

    def error(self, message: str) -> NoReturn:
        raise _Usage(f"{message} (see '{self.prog} --help')")


def _simulate_devices(n: int = SIMULATED_DEVICES) -> bool:
    """Asks JAX for ``n`` CPU devices unless its backends already started or a
    device count is set; returns whether it did.

    The count only shapes the CPU platform, so on a machine with accelerators it
    changes nothing there; on a laptop it turns one CPU into ``n`` devices.
    """
    if _FORCE in os.environ.get("XLA_FLAGS", "") or os.environ.get("JAX_NUM_CPU_DEVICES"):
        return False
    import jax

    if jax.config.jax_num_cpu_devices >= 0:  # set by the user (config or env at import)
        return False
    try:
        # JAX's public route: importing jax starts no backend; the first
        # jax.devices() does, and from then on this update raises.
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        print(f"{PROG}: JAX already started with {jax.device_count()} device(s), too late to "
              f"simulate {n} CPU devices; run it in a fresh process or set "
              f"JAX_NUM_CPU_DEVICES={n} before the first JAX call", file=sys.stderr)
        return False
    return True


def _fmt(n: float) -> str:
    from nnx_shard.report import fmt_bytes

    return fmt_bytes(n)


def _parse_bytes(text: str) -> int:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30, ``"512MiB"``, ``"1e9"``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B?|B)?\s*", text)
    if not m:
        raise _Usage(f"--device-memory {text!r} is not a size; use e.g. 80GB, 80GiB or 512MiB")
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    powers = {"B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
              "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    return int(float(m.group(1)) * powers[unit])


def _mesh_sizes(text: str) -> dict[str, int]:
    from nnx_shard.mesh import _parse_axes

    sizes = _parse_axes(text)
    if any(v == -1 for v in sizes.values()):
        raise _Usage(f"--mesh {text!r}: give every axis a size (-1 needs real devices)")
    return sizes


def _abstract_mesh(sizes: dict[str, int]) -> Any:
    from jax.sharding import AbstractMesh

    return AbstractMesh(tuple(sizes.values()), tuple(sizes))


def _report(model: Any, sizes: dict[str, int], rules: Any, tx: Any = None,
            opt_rules: Any = None) -> Any:
    """:func:`nnx_shard.explain` on an ``AbstractMesh``: any device count, no devices needed."""
    from nnx_shard.report import explain

    return explain(model, _abstract_mesh(sizes), rules, tx, opt_rules=opt_rules)


def _optimizer(name: str, lr: float = 1e-3) -> Any:
    import optax

    makers = {"adamw": lambda: optax.adamw(lr), "adam": lambda: optax.adam(lr),
              "sgd": lambda: optax.sgd(lr)}
    if name not in makers:
        raise _Usage(f"unknown optimizer {name!r}; known: {', '.join(makers)}")
    return makers[name]()


def _strategy(name: str) -> Any:
    from nnx_shard import strategies

    return strategies.get(name)


# --------------------------------------------------------------------------- plan

ACTIVATION_FORMULA = (
    "per device, no rematerialization: tokens/device x [layers x (p(4e/Dl + 4hk/Dh + 2m'/Dm) "
    "+ 4hs/Dh) + 2pe/Dl + 8V/Dv], tokens/device = batch x seq / Db; p = activation bytes, "
    "e = embed, h = heads, k = head_dim, m' = mlp (x top_k x capacity_factor for experts), "
    "s = seq, V = vocab, D* = devices the rules shard batch, length, heads, mlp, vocab over. "
    "Per layer: norm inputs and outputs (4e), q/k/v and attention output (4hk), MLP hidden "
    "before and after GELU (2m'), float32 attention probabilities (4hs); plus the residual "
    "input and float32 logits and their gradient (8V). With --remat full only each block's "
    "input is kept (layers x p x e/Dl per token) plus one layer's activations and the logits; "
    "dots and offload count as none."
)


def _divisor(rules: Any, names: tuple[Any, ...], shape: tuple[int, ...], mesh: Any,
             dim: int) -> int:
    spec = rules.spec(names, shape=shape, mesh=mesh, path="activation")
    entry = tuple(spec)[dim] if dim < len(tuple(spec)) else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(dict(mesh.shape)[a] for a in axes)


def activation_bytes(cfg: Any, rules: Any, sizes: dict[str, int], batch: int, seq: int,
                     remat: str = "none") -> int:
    """Estimated activation bytes per device of one training step of
    :class:`nnx_shard.models.Transformer` (see ``ACTIVATION_FORMULA``).

    >>> from nnx_shard.models import get_config
    >>> from nnx_shard.rules import Rules
    >>> cfg = get_config("tiny")   # embed 32, heads 4 x 8, mlp 64, vocab 128, 2 layers, f32
    >>> tokens = 4 * 16 // 2                 # batch over data=2
    >>> layer = 4 * (4 * 32 + 4 * 4 * 8 + 2 * 64) + 4 * 4 * 16   # p=4 bytes, float32
    >>> edges = 2 * 4 * 32 + 8 * 128
    >>> activation_bytes(cfg, Rules({"batch": "data"}), {"data": 2}, batch=4, seq=16) == (
    ...     tokens * (2 * layer + edges))
    True
    """
    import numpy as np

    from nnx_shard.rules import as_rules

    mesh = _abstract_mesh(sizes)
    rules = as_rules(rules)
    # A name the table does not mention is replicated, as for any activation.
    rules = rules | {n: None for n in ("batch", "length", "heads", "kv", "mlp", "vocab")
                     if n not in rules}
    b, s, e, h, k, v = batch, seq, cfg.embed, cfg.heads, cfg.head_dim, cfg.vocab
    m = cfg.mlp * (cfg.top_k * cfg.capacity_factor if cfg.experts else 1)
    p = np.dtype(cfg.dtype).itemsize
    d_b = _divisor(rules, ("batch",), (b,), mesh, 0)
    d_l = _divisor(rules, ("batch", "length", None), (b, s, e), mesh, 1)
    d_h = _divisor(rules, ("batch", None, "heads", "kv"), (b, s, h, k), mesh, 2)
    d_m = _divisor(rules, ("batch", None, "mlp"), (b, s, cfg.mlp), mesh, 2)
    d_v = _divisor(rules, ("batch", None, "vocab"), (b, s, v), mesh, 2)
    tokens = b * s / d_b
    layer = p * (4 * e / d_l + 4 * h * k / d_h + 2 * m / d_m) + 4 * h * s / d_h
    edges = 2 * p * e / d_l + 8 * v / d_v
    if remat == "full":
        per_token = cfg.layers * p * e / d_l + layer + edges
    else:
        per_token = cfg.layers * layer + edges
    return int(tokens * per_token)


# Meshes up to this many devices are compiled by default (a 256-device compile of
# the small models takes seconds; larger ones grow with the device count).
COMPILE_MAX_DEVICES = 512

_DECIDES = {
    "compiled": (
        "* compiled: XLA's buffer assignment of the fused train step (value_and_grad of "
        "lm_loss + the optimizer update), compiled for this mesh on simulated CPU devices "
        "from abstract inputs (nothing allocated); total = arguments + temp + outputs - "
        "donated buffers. It decides whether the model fits: the formula is off by more than "
        "15% ({ratio}here; 0.29-0.90 over the presets, remat policies and meshes measured), "
        "as it models neither XLA's temporaries nor how remat is scheduled. These are XLA "
        "CPU's figures: a GPU or TPU compile can differ."),
    "formula": (
        "* not compiled (--no-compile, or more than "
        f"{COMPILE_MAX_DEVICES} devices): the formula decides, and it under-counts what XLA "
        "allocates (0.29-0.90 of the compiled total over the presets, remat policies and "
        "meshes measured); leave headroom, or compile with --compile."),
}


def _count(n: int) -> str:
    """935040 -> '935,040'; 124_439_808 -> '124.4 M'; 6_720_000_000 -> '6.72 B'."""
    if n < 1_000_000:
        return f"{n:,}"
    if n < 1_000_000_000:
        return f"{n / 1e6:.1f} M"
    return f"{n / 1e9:.2f} B"


def _plan(args: argparse.Namespace) -> int:
    import jax.numpy as jnp
    from flax import nnx

    from nnx_shard.errors import ShardingError
    from nnx_shard.models import CONFIGS, Transformer

    if args.model not in CONFIGS:
        raise _Usage(f"unknown model {args.model!r}; known: {', '.join(CONFIGS)}")
    if args.batch < 1 or args.seq < 1:
        raise _Usage("--batch and --seq must be at least 1")
    cfg = CONFIGS[args.model]
    strategy = _strategy(args.strategy)
    sizes = _mesh_sizes(args.mesh)
    if args.seq > cfg.length:
        raise _Usage(f"--seq {args.seq} is longer than model {args.model!r} allows ({cfg.length})")
    device_memory = _parse_bytes(args.device_memory) if args.device_memory else None
    tx = _optimizer(args.optimizer)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    out: dict[str, Any] = {
        "model": args.model, "num_params": cfg.num_params, "strategy": strategy.name,
        "mesh": sizes, "devices": math.prod(sizes.values()), "optimizer": args.optimizer,
        "batch": args.batch, "seq": args.seq, "remat": args.remat,
        "scan_layers": cfg.scan_layers if args.scan_layers is None else args.scan_layers,
        "param_dtype": jnp.dtype(cfg.param_dtype).name,
    }
    try:
        strategy.check(model, sizes)
        report = _report(model, sizes, strategy.rules, tx, strategy.opt_rules)
        try:
            acts = activation_bytes(cfg, strategy.rules, sizes, args.batch, args.seq, args.remat)
        except ShardingError as e:
            raise ShardingError(f"activations of --batch {args.batch} x --seq {args.seq}: {e}") from None
    except ShardingError as e:
        out["error"] = str(e)
        if args.json:
            print(json.dumps(out))
        else:
            print(f"{PROG} plan: {args.model} on {args.mesh} with {strategy.name}: cannot lay out")
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    grads = sum(r.bytes_per_device for r in report.rows if r.group == "params" and r.kind == "Param")
    per_device = {
        "params": report.param_bytes_per_device,
        "grads": grads,
        "optimizer": report.opt_bytes_per_device,
        "activations": acts,
    }
    per_device["total"] = sum(per_device.values())
    devices = out["devices"]
    compile_it = args.compile if args.compile is not None else devices <= COMPILE_MAX_DEVICES
    compiled = None
    if compile_it:
        from nnx_shard.compiled import CompileError, compiled_memory_subprocess

        try:
            compiled = compiled_memory_subprocess(
                args.model, sizes, strategy=strategy.name, optimizer=args.optimizer,
                batch=args.batch, seq=args.seq, remat=args.remat,
                scan_layers=args.scan_layers, timeout=args.compile_timeout)
        except CompileError as e:
            raise _Usage(str(e)) from None
    decided_by = "compiled" if compiled is not None else "formula"
    need = compiled["total"] if compiled is not None else per_device["total"]
    largest = sorted((r for r in report.rows if r.group == "params"),
                     key=lambda r: -r.bytes_per_device)[: args.top]
    out.update({
        "bytes_per_device": per_device,
        "compiled": compiled,
        "decided_by": decided_by,
        "bytes_needed": need,
        "bytes_total": {"params": report.total_bytes, "optimizer": report.opt_total_bytes},
        "largest": [
            {"path": r.path, "shape": list(r.shape), "dtype": r.dtype,
             "spec": [None if x is None else x if isinstance(x, str) else list(x) for x in r.spec],
             "bytes_per_device": r.bytes_per_device}
            for r in largest
        ],
        "replicated_params": sum(1 for r in report.replicated if r.group == "params"),
        "activation_formula": ACTIVATION_FORMULA,
        "device_memory": device_memory,
        "fits": None if device_memory is None else need <= device_memory,
        "error": None,
    })
    if args.json:
        print(json.dumps(out))
    else:
        print(f"plan: model {args.model} ({_count(cfg.num_params)} parameters, "
              f"{out['param_dtype']}), strategy {strategy.name}, mesh {_shown(sizes)} "
              f"({devices} devices), {args.optimizer}, batch {args.batch} x seq {args.seq}, "
              f"remat {args.remat}, {'scanned' if out['scan_layers'] else 'unrolled'} layers")
        print()
        if compiled is not None:
            print("per device          compiled*   formula estimate")
            rows = [("params", compiled["params"], per_device["params"]),
                    ("grads", None, per_device["grads"]),
                    ("optimizer", compiled["optimizer"], per_device["optimizer"]),
                    ("temp", compiled["temp"], None),
                    ("activations", None, per_device["activations"]),
                    ("total", compiled["total"], per_device["total"])]
            for label, c, f in rows:
                ctxt = _fmt(c) if c is not None else "(in temp)" if label != "total" else ""
                ftxt = _fmt(f) if f is not None else ""
                print(f"  {label:<13} {ctxt:>12}   {ftxt:>12}")
            print(f"  (compiled in {compiled['compile_s']:.1f} s on {devices} simulated CPU "
                  "devices; total = arguments + temp + outputs - donated)")
        else:
            print("per device (formula estimate; not compiled):")
            for key in ("params", "grads", "optimizer", "activations", "total"):
                print(f"  {key:<13} {_fmt(per_device[key]):>12}")
        print(f"  (unsharded: params {_fmt(report.total_bytes)}, optimizer state "
              f"{_fmt(report.opt_total_bytes)})")
        print()
        print(f"largest parameters per device (of {sum(1 for r in report.rows if r.group == 'params')}; "
              f"{out['replicated_params']} replicated):")
        from nnx_shard.report import _spec_txt

        cols = [(r.path, str(r.shape), _spec_txt(r.spec), _fmt(r.bytes_per_device))
                for r in largest]
        widths = [max(len(c[i]) for c in cols) for i in range(4)] if cols else [0] * 4
        for c in cols:
            print("  " + "  ".join(f"{x:<{w}}" for x, w in zip(c[:3], widths, strict=False))
                  + f"  {c[3]:>{widths[3]}}")
        print()
        if compiled is not None and args.remat != "none" and not out["scan_layers"]:
            print(textwrap.fill(
                f"* remat {args.remat} with unrolled layers: on XLA CPU the compiled temp of "
                "unrolled blocks does not fall with remat (measured on small); --scan-layers "
                "compiles one scanned block, where remat lowers it.",
                width=100, subsequent_indent="  "))
        ratio = (f"formula / compiled = {per_device['total'] / compiled['total']:.2f} "
                 if compiled is not None else "")
        print(textwrap.fill(_DECIDES[decided_by].format(ratio=ratio), width=100,
                            subsequent_indent="  "))
        print(textwrap.fill(f"* formula activations: {ACTIVATION_FORMULA}", width=100,
                            subsequent_indent="  "))
        if device_memory is not None:
            verdict = "fits" if out["fits"] else "does NOT fit"
            print(f"\n{verdict} in {_fmt(device_memory)} per device "
                  f"({100 * need / device_memory:.0f}% used, {decided_by} total)")
    return 0 if out["fits"] in (None, True) else 1


# --------------------------------------------------------------------------- explain


def _load_factory(spec: str) -> Any:
    mod_name, colon, attr = spec.partition(":")
    if not colon or not mod_name or not attr:
        raise _Usage(f"{spec!r} is not 'module:factory' (e.g. mypkg.models:make_model)")
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            path = Path(mod_name)
            if not path.is_file():
                raise _Usage(f"no file {str(path)!r}")
            sp = importlib.util.spec_from_file_location(path.stem, path)
            assert sp is not None and sp.loader is not None
            module = importlib.util.module_from_spec(sp)
            sp.loader.exec_module(module)
        else:
            # Like `python -m`: modules in the current directory are importable.
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise _Usage(f"cannot import {mod_name!r}: {e}") from None
        raise _Usage(f"FACTORY {spec!r}: importing {mod_name!r} raised ModuleNotFoundError: "
                     f"{_one_line(e)} {_DEBUG_HINT}") from e
    except _Usage:
        raise
    except Exception as e:  # the user's module failed while importing: their code, one line
        raise _Usage(f"FACTORY {spec!r}: importing {mod_name!r} raised {type(e).__name__}: "
                     f"{_one_line(e)} {_DEBUG_HINT}") from e
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise _Usage(f"module {mod_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise _Usage(f"{spec!r} is not callable; give a zero-argument function returning a module")
    return factory


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or "(no message)"


def _call_factory(spec: str, factory: Any) -> Any:
    """``nnx.eval_shape(factory)``, with the user's own exceptions as one usage line."""
    import inspect

    from flax import nnx

    from nnx_shard.errors import ShardingError

    try:
        required = [p.name for p in inspect.signature(factory).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                           p.POSITIONAL_OR_KEYWORD,
                                                           p.KEYWORD_ONLY)]
    except (TypeError, ValueError):  # no signature to read (some builtins): just call it
        required = []
    if required:
        raise _Usage(f"FACTORY {spec!r} needs arguments ({', '.join(required)}); give a "
                     "zero-argument function returning an nnx.Module, e.g. "
                     "def make(): return MyModel(cfg, rngs=nnx.Rngs(0))")
    try:
        return nnx.eval_shape(factory)
    except ShardingError:
        raise
    except Exception as e:
        raise _Usage(f"FACTORY {spec!r} raised {type(e).__name__}: {_one_line(e)} "
                     f"{_DEBUG_HINT}") from e


def _explain(args: argparse.Namespace) -> int:
    from flax import nnx

    from nnx_shard.rules import Rules

    sizes = _mesh_sizes(args.mesh)
    opt_rules = None
    if args.rules:
        if not Path(args.rules).is_file():
            raise _Usage(f"--rules {args.rules!r}: no such file")
        try:
            rules = Rules.from_file(args.rules)
        except (ValueError, TypeError, OSError, ImportError) as e:
            raise _Usage(f"--rules {args.rules!r}: {_one_line(e)}") from e
    elif args.strategy:
        strategy = _strategy(args.strategy)
        rules, opt_rules = strategy.rules, strategy.opt_rules
    else:
        raise _Usage("give --rules FILE (.toml, .json or .yaml) or --strategy NAME")
    factory = _load_factory(args.factory)
    model = _call_factory(args.factory, factory)
    if not isinstance(model, nnx.Module):
        raise _Usage(f"FACTORY {args.factory!r} returned {type(model).__name__}, not an "
                     "nnx.Module")
    tx = _optimizer(args.optimizer) if args.optimizer else None
    report = _report(model, sizes, rules, tx, opt_rules)
    print(report.to_markdown() if args.markdown else report)
    return 0


# --------------------------------------------------------------------------- demo


PLOT_EXTRA = "pip install 'nnx_shard[plot]'"


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


def _demo_config(args: argparse.Namespace, strategy_name: str) -> Any:
    from nnx_shard.data import VOCAB
    from nnx_shard.models import TransformerConfig

    experts = args.experts if args.experts is not None else (4 if strategy_name == "ep" else 0)
    return TransformerConfig(
        vocab=VOCAB, length=args.seq, embed=args.embed, heads=args.heads,
        head_dim=args.embed // args.heads, mlp=args.mlp, layers=args.layers, experts=experts,
    )


def _generate(model: Any, prompt: Any, n: int, temperature: float, seed: int) -> Any:
    """``n`` characters sampled after ``prompt`` (a window of the model's length), in one
    compiled loop; run under :func:`nnx_shard.use` with the batch replicated."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state: Any, window: Any, key: Any) -> Any:
        m = nnx.merge(graphdef, state)

        def body(i: Any, carry: Any) -> Any:
            window, out, key = carry
            logits = m(window[None])[0, -1]
            key, sub = jax.random.split(key)
            if temperature > 0:
                tok = jax.random.categorical(sub, logits / temperature)
            else:
                tok = jnp.argmax(logits)
            tok = tok.astype(jnp.int32)
            return jnp.concatenate([window[1:], tok[None]]), out.at[i].set(tok), key

        init = (window, jnp.zeros((n,), jnp.int32), key)
        return jax.lax.fori_loop(0, n, body, init)[1]

    return run(state, jnp.asarray(prompt, jnp.int32), jax.random.key(seed))


DEMO_MAX_STEPS = 1_000_000


def _check_demo_args(args: argparse.Namespace) -> None:
    """The demo's flags that need no devices, checked before JAX starts (one line, exit 2).

    >>> ns = argparse.Namespace(steps=10**12, steps_per_call=25, batch=32, evals=8)
    >>> try:
    ...     _check_demo_args(ns)
    ... except _Usage as e:
    ...     print(e)
    --steps 1000000000000 is more than the demo runs (at most 1,000,000, hours on a CPU); ...
    """
    if args.steps < 1 or args.steps_per_call < 1 or args.batch < 1 or args.evals < 1:
        raise _Usage("--steps, --steps-per-call, --batch and --evals must be at least 1")
    if args.steps > DEMO_MAX_STEPS:
        raise _Usage(
            f"--steps {args.steps} is more than the demo runs (at most {DEMO_MAX_STEPS:,}, "
            "hours on a CPU); use ns.Trainer in your own script for longer runs"
        )


def _finite_positive(text: str) -> float:
    """argparse type of --lr: a finite number > 0 (NaN would train to NaN and save it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; use e.g. --lr 3e-3") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a finite number greater than 0, got {text!r}; use e.g. --lr 3e-3")
    return value


def _finite_non_negative(text: str) -> float:
    """argparse type of --temperature: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"must be a finite number >= 0 (0 for greedy), got {text!r}")
    return value


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


def _demo(args: argparse.Namespace) -> int:
    _check_demo_args(args)
    simulated = _simulate_devices()
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.data import decode, load_stdlib
    from nnx_shard.models import Transformer, lm_loss

    t_start = time.perf_counter()
    strategy = _strategy(args.strategy)
    restore_name = args.restore_strategy or ("fsdp" if strategy.name == "tp" else "tp")
    restore_strategy = _strategy(restore_name)
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
        raise _Usage(f"--mesh {_shown(sizes)} needs {need} devices but {n} are available")
    axis_types = args.axis_types or "explicit"
    mesh = ns.make_mesh(sizes, devices=devices[:need], axis_types=axis_types)
    if args.embed % args.heads:
        raise _Usage(f"--embed {args.embed} must divide by --heads {args.heads}")
    try:
        cfg = _demo_config(args, strategy.name)
    except ValueError as e:
        raise _Usage(str(e)) from None

    def factory() -> Transformer:
        return Transformer(cfg, rngs=nnx.Rngs(args.seed))

    # Every layout is checked before training, so a bad flag never costs a run.
    strategy.check(nnx.eval_shape(factory), sizes)
    if args.restore_mesh:
        restore_sizes = _mesh_sizes(args.restore_mesh)
        if math.prod(restore_sizes.values()) > n:
            raise _Usage(f"--restore-mesh {args.restore_mesh} needs more than the {n} "
                         "devices available")
    else:
        restore_sizes = (restore_strategy.suggest_mesh(nnx.eval_shape(factory), need)
                         or restore_strategy.mesh_for(need))
    restore_mesh = ns.make_mesh(restore_sizes,
                                devices=devices[: math.prod(restore_sizes.values())])
    target = restore_strategy.abstract_init(factory, restore_mesh)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "checkpoint"
    if ckpt_dir.exists():  # a previous demo's checkpoint: this run writes its own
        shutil.rmtree(ckpt_dir)

    def say(*parts: Any) -> None:
        print(*parts, flush=True)

    corpus = load_stdlib()
    baseline = corpus.unigram_baseline()
    try:
        heldout_host = corpus.heldout_batches(args.batch, cfg.length)
    except ValueError as e:
        raise _Usage(f"--batch {args.batch} x --seq {cfg.length}: {e}") from None
    say(f"nnx-shard demo: {n} {devices[0].platform.upper()} devices"
        f"{' (simulated)' if simulated else ''}, "
        f"strategy {strategy.name}, mesh {_shown(sizes)} ({axis_types} axes)")
    say(f"data: {len(corpus.train):,} training characters from {len(corpus.files)} standard "
        f"library files, {len(corpus.heldout):,} held-out ({', '.join(corpus.heldout_files)})")
    say(f"model: Transformer {cfg.layers} layers, embed {cfg.embed}, {cfg.heads} heads, "
        f"mlp {cfg.mlp}{f', {cfg.experts} experts' if cfg.experts else ''}, context "
        f"{cfg.length}, {cfg.num_params:,} parameters")

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(100, max(1, args.steps // 10)), args.steps, args.lr * 0.1)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b2=0.99, weight_decay=0.01))
    model = strategy.sharded_init(factory, mesh)
    optimizer = strategy.optimizer(model, tx, mesh)
    report = strategy.explain(model, mesh, tx)
    say(f"\nsharding report (ns.strategies.get({strategy.name!r}).explain):")
    say(_short_report(report))

    heldout = [ns.shard_batch(b, mesh, strategy.rules) for b in heldout_host]
    eval_loss = nnx.jit(lm_loss)

    def evaluate(m: Any, on_mesh: Any, rules: Any, batches: list[Any]) -> float:
        with ns.use(on_mesh, rules):
            # One call at a time: the result is read before the next is dispatched.
            return float(np.mean([float(eval_loss(m, b)) for b in batches]))

    tokens_per_step = args.batch * cfg.length
    every = max(1, args.steps // 10)
    evals: list[tuple[int, float]] = []
    marks: list[tuple[int, float]] = []
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
            say(f"step {step}/{args.steps}  loss {float(metrics['loss'][-1]):.3f}"
                + (f"  {rate:,.0f} tokens/s" if rate else ""))
            while next_line[0] <= step:
                next_line[0] += every

    trainer = ns.Trainer(model, optimizer, lm_loss, mesh=mesh, rules=strategy.rules,
                         steps_per_call=args.steps_per_call)
    say(f"\ntraining {args.steps} steps, batch {args.batch} x {cfg.length} characters, "
        f"{args.steps_per_call} steps per compiled call")
    first = evaluate(model, mesh, strategy.rules, heldout)
    evals.append((0, first))
    with warnings.catch_warnings():
        # A non-finite stop is reported below, as the demo's own error.
        warnings.filterwarnings("ignore", message="Trainer.fit: ", category=RuntimeWarning)
        history = trainer.fit(corpus.batches(args.batch, cfg.length, seed=args.seed),
                              args.steps, progress=tty, callbacks=[on_step])
    losses = history["loss"]
    if history.stop_reason is not None:
        # No held-out loss, checkpoint or sample of a run that did not finish: the last
        # evaluation would be stale. summary.json says what happened.
        _write_summary(out / "summary.json", {
            "strategy": strategy.name, "mesh": sizes, "devices": n,
            "config": _jsonable_config(cfg), "steps": len(losses), "steps_requested": args.steps,
            "lr": args.lr, "seed": args.seed, "stop_reason": history.stop_reason,
            "heldout_loss": None, "heldout_evals": [[s, v] for s, v in evals],
            "loss": losses.tolist(), "total_seconds": time.perf_counter() - t_start,
        })
        print(f"{PROG}: error: training stopped after {len(losses)} of {args.steps} steps: "
              f"{history.stop_reason}. No checkpoint was written (see "
              f"{out / 'summary.json'}); try a lower --lr.", file=sys.stderr)
        return 1
    final = evals[-1][1]
    tokens_s = _rate(marks, tokens_per_step) or tokens_per_step * len(losses) / history.seconds
    say(f"trained {len(losses)} steps in {history.seconds:.1f} s (compilation included): "
        f"{tokens_s:,.0f} tokens/s after compiling")
    say(f"held-out loss {final:.3f} nats/char (from {first:.3f} at step 0); unigram baseline "
        f"{baseline:.3f} -> {'below' if final < baseline else 'NOT below'} it by "
        f"{baseline - final:.3f}")

    ckpt = ns.save(ckpt_dir, trainer.step, model=model, optimizer=optimizer,
                   extra={"config": _jsonable_config(cfg), "strategy": strategy.name,
                          "mesh": sizes, "data_position": trainer.data_position})
    say(f"\nsaved checkpoint {ckpt} ({strategy.name} on {_shown(sizes)})")
    restored = ns.restore(ckpt_dir, model=target)
    restored_heldout = [ns.shard_batch(b, restore_mesh, restore_strategy.rules)
                        for b in heldout_host]
    restored_loss = evaluate(restored, restore_mesh, restore_strategy.rules, restored_heldout)
    example = "blocks/0/mlp/up"
    before = _spec_of(model, example)
    after = _spec_of(restored, example)
    say(f"restored it as {restore_strategy.name} on {_shown(restore_sizes)}: {example} "
        f"{before} -> {after}; held-out loss {restored_loss:.3f} "
        f"({'same' if abs(restored_loss - final) < 1e-3 else 'DIFFERENT'})")

    window = cfg.length
    text = decode(corpus.heldout)
    at = text.find("\n    def ", window)
    at = at + len("\n    def ") if at >= 0 else window
    prompt = corpus.heldout[at - window: at]
    gen_rules = restore_strategy.rules | {"batch": None, "length": None}
    with ns.use(restore_mesh, gen_rules):
        sample = decode(np.asarray(_generate(restored, prompt, args.sample_chars,
                                             args.temperature, args.seed)))
    say(f"\nsample from the restored model (temperature {args.temperature}), prompted with "
        f"held-out text:\n{'-' * 60}\n{decode(prompt)}\033[1m{sample}\033[0m\n{'-' * 60}"
        if sys.stdout.isatty() else
        f"\nsample from the restored model (temperature {args.temperature}), prompted with "
        f"held-out text (continuation after '>>>'):\n{'-' * 60}\n{decode(prompt)}>>>"
        f"{sample}\n{'-' * 60}")

    steps = history["step"].tolist()
    png: Path | None = out / "loss.png"
    try:
        plot_losses(png, list(zip(steps, losses.tolist(), strict=True)), evals, baseline)
    except ImportError:
        png.unlink(missing_ok=True)  # a previous run's plot would pass for this one's
        png = None
        say(f"\nno loss plot: matplotlib is not installed ({PLOT_EXTRA} to get loss.png)")
    summary = {
        "strategy": strategy.name, "mesh": sizes, "devices": n,
        "platform": devices[0].platform, "simulated_devices": simulated,
        "config": _jsonable_config(cfg), "num_params": cfg.num_params,
        "steps": len(losses), "steps_per_call": args.steps_per_call, "batch": args.batch,
        "seq": cfg.length, "lr": args.lr, "seed": args.seed, "stop_reason": None,
        "train_seconds": history.seconds, "tokens_per_s": tokens_s,
        "train_loss_first": float(losses[0]), "train_loss_last": float(losses[-1]),
        "heldout_loss_initial": first, "heldout_loss": final,
        "unigram_baseline": baseline, "heldout_evals": [[s, v] for s, v in evals],
        "param_bytes_per_device": report.param_bytes_per_device,
        "param_bytes_total": report.total_bytes,
        "opt_bytes_per_device": report.opt_bytes_per_device,
        "checkpoint": str(ckpt), "restore_strategy": restore_strategy.name,
        "restore_mesh": restore_sizes, "heldout_loss_restored": restored_loss,
        "sample_prompt": decode(prompt), "sample": sample,
        "loss": losses.tolist(), "loss_png": None if png is None else str(png),
        "total_seconds": time.perf_counter() - t_start,
    }
    _write_summary(out / "summary.json", summary)
    wrote = f"{png} and {out / 'summary.json'}" if png else f"{out / 'summary.json'}"
    say(f"\nwrote {wrote} ({summary['total_seconds']:.0f} s in all)")
    return 0


def _rate(marks: list[tuple[int, float]], tokens_per_step: int) -> float | None:
    # From the end of the first compiled call on: compilation is not throughput.
    if len(marks) < 2 or marks[-1][1] <= marks[0][1]:
        return None
    return (marks[-1][0] - marks[0][0]) * tokens_per_step / (marks[-1][1] - marks[0][1])


def _shown(sizes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items())


def _spec_of(model: Any, path: str) -> str:
    from nnx_shard.report import _spec_txt

    obj = model
    for part in path.split("/"):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return _spec_txt(obj.get_value().sharding.spec)


def _jsonable_config(cfg: Any) -> dict[str, Any]:
    import dataclasses

    import numpy as np

    return {k: (np.dtype(v).name if k.endswith("dtype") else v)
            for k, v in dataclasses.asdict(cfg).items()}


def _short_report(report: Any) -> str:
    """The explain table with the repeated blocks folded: block 0 shown, the rest counted."""
    import dataclasses

    shown = tuple(r for r in report.rows
                  if r.group == "params" and not re.match(r"blocks/[1-9]", r.path))
    table = str(dataclasses.replace(report, rows=shown)).partition("\n\n")[0]
    hidden = len(report.rows) - len(shown)
    more = (f"... and {hidden} more rows: blocks 1.. as block 0, and the optimizer state "
            "(laid out like its parameter)\n" if hidden else "")
    return table + "\n" + more + "\n" + str(report).partition("\n\n")[2]


# --------------------------------------------------------------------------- main


def _build_parser() -> _Parser:
    parser = _Parser(prog=PROG, description="Sharded training for Flax NNX: demo, memory "
                     "planner, sharding reports and a local multi-process launcher.",
                     epilog="Exit status 2 and one 'nnx-shard: error: ...' line for bad "
                     "input (flags, files, your factory raising); an internal error shows "
                     "its traceback (exit 1).")
    parser.add_argument("--debug", action="store_true",
                        help=f"on bad input, also print the traceback (or set {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    d = sub.add_parser("demo", help="train a sharded char-level transformer on Python's "
                       "standard library, checkpoint, restore on another mesh, sample",
                       description="Train the reference transformer as a character-level LM "
                       "on the Python standard library's sources, sharded with a strategy; "
                       "checkpoint it, restore it onto a different mesh and strategy, and "
                       "sample text from the restored model. With one device, 8 CPU devices "
                       "are simulated.")
    d.add_argument("--strategy", default="fsdp_tp", help="dp, zero1, fsdp, tp, fsdp_tp (default), sp, ep")
    d.add_argument("--mesh", default=None, help="e.g. data=4,model=2 (default: the strategy's "
                   "shape for all devices)")
    d.add_argument("--steps", type=int, default=1000,
                   help=f"training steps (default 1000, at most {DEMO_MAX_STEPS:,})")
    d.add_argument("--steps-per-call", type=int, default=25,
                   help="steps fused into one compiled call (default 25)")
    d.add_argument("--out", default="nnx_shard_demo",
                   help="output folder for loss.png, summary.json, checkpoint/ (default ./nnx_shard_demo)")
    d.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    d.add_argument("--seq", type=int, default=64, help="characters per sequence (default 64)")
    d.add_argument("--embed", type=int, default=128)
    d.add_argument("--heads", type=int, default=4)
    d.add_argument("--mlp", type=int, default=512)
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--experts", type=int, default=None,
                   help="mixture-of-experts MLP (default: 4 with --strategy ep, else dense)")
    d.add_argument("--lr", type=_finite_positive, default=3e-3,
                   help="peak learning rate, a finite number > 0 (default 3e-3)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--evals", type=int, default=8, help="held-out evaluations during training")
    d.add_argument("--restore-strategy", default=None,
                   help="strategy to restore the checkpoint with (default tp, or fsdp after tp)")
    d.add_argument("--restore-mesh", default=None, help="mesh to restore onto (default: the "
                   "restore strategy's shape for the same devices)")
    d.add_argument("--sample-chars", type=int, default=200)
    d.add_argument("--temperature", type=_finite_non_negative, default=0.7,
                   help="sampling temperature, 0 for greedy (default 0.7)")
    d.add_argument("--axis-types", choices=("explicit", "auto"), default=None,
                   help="mesh axis types of the training mesh (default explicit, JAX's "
                   "default)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar on a terminal")
    d.set_defaults(run=_demo)

    p = sub.add_parser("plan", help="per-device memory of a model under a strategy and mesh, "
                       "without allocating", description="Per-device bytes of parameters, "
                       "gradients, optimizer state and activations of a reference model "
                       "config on any mesh (no devices needed), the largest tensors, and "
                       "whether it fits. Exit status: 0 fits (or no --device-memory), 1 does "
                       "not fit, 2 bad input or a sharding error.")
    p.add_argument("--model", required=True, help="tiny, tiny_moe, small, 125m, 1b, 7b")
    p.add_argument("--mesh", required=True, help="e.g. data=8,model=8")
    p.add_argument("--strategy", default="fsdp_tp")
    p.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd")
    p.add_argument("--batch", type=int, default=256, help="global batch (default 256)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    from nnx_shard.models import REMAT_POLICIES

    p.add_argument("--remat", choices=tuple(REMAT_POLICIES), default="none",
                   help="TransformerConfig.remat policy of the compiled model: none (default), "
                   "full, dots, offload (saved activations to pinned host memory)")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the blocks as one scanned layer (default: the model's; "
                   "1b and 7b scan); XLA CPU lowers the temp bytes by remat only when scanned")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the train step on as many simulated CPU devices as the mesh "
                   f"has, in a subprocess (default: yes up to {COMPILE_MAX_DEVICES} devices)")
    p.add_argument("--compile-timeout", type=_finite_positive, default=300.0,
                   help="seconds the compile may take (default 300)")
    p.add_argument("--device-memory", default=None, help="e.g. 80GB (1e9) or 80GiB (2**30)")
    p.add_argument("--top", type=int, default=5, help="largest tensors to list")
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.set_defaults(run=_plan)

    e = sub.add_parser("explain", help="per-parameter sharding report of your model factory",
                       description="Builds module:factory abstractly (nothing allocated) and "
                       "prints how every variable is laid out on the mesh by the rules.")
    e.add_argument("factory", help="module:function (or path/to/file.py:function) returning "
                   "an nnx.Module")
    e.add_argument("--mesh", required=True, help="e.g. data=4,model=2 (any size)")
    e.add_argument("--rules", default=None, help="rules file: .toml, .json or .yaml (a table, or Flax/MaxText [logical, mesh] pairs)")
    e.add_argument("--strategy", default=None, help="a strategy preset instead of --rules")
    e.add_argument("--optimizer", default=None, help="also report this optimizer's state")
    e.add_argument("--markdown", action="store_true")
    e.set_defaults(run=_explain)

    from nnx_shard import launch

    la = sub.add_parser("launch", help="run N local processes of one multi-process JAX job",
                        description="Run N local processes of one multi-process JAX job on "
                        "loopback, e.g. nnx-shard launch -n 2 -- python train.py")
    launch.add_arguments(la)
    la.set_defaults(run=launch.run)
    for command in sub.choices.values():  # also accepted after the command's name
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="on bad input, also print the traceback")
    return parser


def _check_out(args: argparse.Namespace) -> None:
    """``--out`` must be a folder or not exist yet; say so before any work is done."""
    out = getattr(args, "out", None)
    if out is None:
        return
    path = Path(out)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"is inside {str(p)!r}, which is a file"
                raise _Usage(f"--out {out!r} {where}; give a folder (created if missing), "
                             "e.g. --out nnx_shard_demo")
            return


# Bad input that surfaces as an exception: a path that is a file, a missing file, a layout
# that does not fit. Anything else is a bug of ours and keeps its traceback.
_USER_OS_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                   PermissionError)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``nnx-shard`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Bad input is one line on stderr, ``nnx-shard: error: ...``, and exit status 2:
    bad flags, paths that are files or missing, sharding errors, and a FACTORY that
    cannot be imported, needs arguments or raises. ``--debug`` (or
    ``NNX_SHARD_DEBUG=1``) adds the traceback. Other exceptions are bugs: their
    traceback is shown as Python shows it.

    >>> main(["plan", "--model", "huge", "--mesh", "data=8"])
    2
    """
    from nnx_shard.errors import ShardingError

    parser = _build_parser()
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        args = parser.parse_args(argv)
        debug = debug or args.debug
        if args.command is None:
            parser.print_help()
            return 2
        _check_out(args)
        return int(args.run(args) or 0)
    except (_Usage, ShardingError, *_USER_OS_ERRORS) as e:
        if debug:
            import traceback

            traceback.print_exception(e)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
