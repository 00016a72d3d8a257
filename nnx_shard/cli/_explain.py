"""``nnx-shard explain module:factory``: the per-parameter sharding report of a
user's model factory on a mesh of any size.

This runs the user's code: the module is imported (its top-level code runs) and the
factory is called, under ``nnx.eval_shape`` so no parameter array is allocated. A
module name is looked up on ``sys.path`` as it is, then in the current directory
(appended last, for this import only, so a file there never shadows an installed
module). The user's own failures (an import, a factory raising, ``sys.exit`` or
``os._exit``) are one line and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from flax import nnx

from nnx_shard._axes import abstract_mesh
from nnx_shard._errors import ShardingError
from nnx_shard._report import fmt_bytes
from nnx_shard._rules import Rules
from nnx_shard.cli._common import DEBUG_HINT, UsageError, mesh_sizes, optimizer, strategy
from nnx_shard.planner._formula import abstract_report

__all__ = ["run"]


class _HardExit(BaseException):
    """``os._exit(code)`` called by the user's code: a BaseException, so their own
    ``except Exception`` does not swallow it on its way out."""

    def __init__(self, code: Any) -> None:
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def _no_hard_exit() -> Iterator[None]:
    # os._exit ends the process at once, skipping every handler: a factory calling
    # os._exit(0) would end explain with status 0 and no report, read as success.
    # While the user's code runs it raises instead (posix._exit itself stays).
    real = os._exit

    def refuse(status: int) -> NoReturn:
        raise _HardExit(status)

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


def import_factory_module(spec: str, mod_name: str) -> Any:
    """The module of ``module:factory``: a file path or an importable name."""
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            path = Path(mod_name)
            if not path.is_file():
                raise UsageError(f"no file {str(path)!r}. Fix: the path of a .py file defining the "
                                 "factory")
            sp = importlib.util.spec_from_file_location(path.stem, path)
            if sp is None or sp.loader is None:  # importlib reads .py (and compiled) files only
                raise UsageError(f"FACTORY {spec!r}: {str(path)!r} is not a .py file, so Python "
                                 "cannot import it. Fix: the path of a .py file defining the "
                                 "factory (rename it), or an importable module name")
            module = importlib.util.module_from_spec(sp)
            with _no_hard_exit():
                sp.loader.exec_module(module)
            return module
        with _no_hard_exit():
            return _import_name(mod_name)
    except ModuleNotFoundError as e:
        if e.name and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise UsageError(f"cannot import {mod_name!r}: {e}. Fix: run from the directory "
                             "holding it, or put it on PYTHONPATH") from None
        raise UsageError(f"FACTORY {spec!r}: importing {mod_name!r} raised "
                         f"ModuleNotFoundError: {_one_line(e)} {DEBUG_HINT}") from e
    except UsageError:
        raise
    except (SystemExit, _HardExit) as e:  # the module's top level would end the process
        call = "os._exit" if isinstance(e, _HardExit) else "sys.exit"
        raise UsageError(f"FACTORY {spec!r}: importing {mod_name!r} called "
                         f"{call}({e.code!r}). Fix: keep {call} under "
                         "`if __name__ == '__main__':`") from None
    except Exception as e:  # the user's module failed while importing: their code, one line
        raise UsageError(f"FACTORY {spec!r}: importing {mod_name!r} raised "
                         f"{type(e).__name__}: {_one_line(e)} {DEBUG_HINT}") from e


def _import_name(mod_name: str) -> Any:
    """``importlib.import_module(mod_name)`` with the current directory searched last
    (like ``python -m``, which puts it first, but never shadowing an installed or
    standard module), and ``sys.path`` left as it was."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.import_module(mod_name)
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _load_factory(spec: str) -> Any:
    mod_name, colon, attr = spec.partition(":")
    if not colon or not mod_name or not attr:
        raise UsageError(f"{spec!r} is not 'module:factory' (e.g. mypkg.models:make_model)")
    factory = import_factory_module(spec, mod_name)
    module = factory
    for part in attr.split("."):
        if not hasattr(factory, part):
            where = getattr(module, "__file__", None) or "a built-in module"
            raise UsageError(f"module {mod_name!r} (imported from {where}) has no attribute "
                             f"{attr!r}. Fix: name a function it defines (a module of the same "
                             "name installed or in the standard library comes before the "
                             "current directory)")
        factory = getattr(factory, part)
    if not callable(factory):
        raise UsageError(f"{spec!r} is not callable; give a zero-argument function returning "
                         "a module")
    return factory


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or "(no message)"


def _call_factory(spec: str, factory: Any) -> Any:
    """``nnx.eval_shape(factory)``, with the user's own exceptions as one usage line."""
    try:
        required = [p.name for p in inspect.signature(factory).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                           p.POSITIONAL_OR_KEYWORD,
                                                           p.KEYWORD_ONLY)]
    except (TypeError, ValueError):  # no signature to read (some builtins): just call it
        required = []
    if required:
        raise UsageError(f"FACTORY {spec!r} needs arguments ({', '.join(required)}); give a "
                         "zero-argument function returning an nnx.Module, e.g. "
                         "def make(): return MyModel(cfg, rngs=nnx.Rngs(0))")
    try:
        # Names from nnx.with_partitioning are logical, not mesh axes: Flax must not place
        # them eagerly (there is no mesh here), as sharded_init does not let it either.
        with nnx.use_eager_sharding(False), _no_hard_exit():
            return nnx.eval_shape(factory)
    except ShardingError:
        raise
    except (SystemExit, _HardExit) as e:  # exit 0 with no report would read as success
        call = "os._exit" if isinstance(e, _HardExit) else "sys.exit"
        raise UsageError(f"FACTORY {spec!r} called {call}({e.code!r}) instead of returning "
                         "a module. Fix: return the model from the factory") from None
    except Exception as e:
        raise UsageError(f"FACTORY {spec!r} raised {type(e).__name__}: {_one_line(e)} "
                         f"{DEBUG_HINT}") from e


def parse_pairs(text: str | None, flag: str, example: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        name, eq, value = item.strip().partition("=")
        if not (name.strip() and eq and value.strip()):
            raise UsageError(f"{flag} {text!r}: {item!r} is not name=value. Fix: e.g. "
                             f"{flag} {example}")
        out[name.strip()] = value.strip()
    return out


def run(args: argparse.Namespace) -> int:
    """``nnx-shard explain``: prints the report; exit 0 (bad input raises the usage error)."""
    sizes = mesh_sizes(args.mesh)
    opt_rules = None
    strat = None
    if args.rules and args.strategy:
        raise UsageError(f"--rules and --strategy are alternatives (a rules file, or a preset's "
                         f"rules), got both: --rules {args.rules!r} --strategy "
                         f"{args.strategy!r}. Fix: drop one; to change a preset's rules keep "
                         "--strategy and add --rules-extra (e.g. norm=none)")
    if args.rules:
        if not Path(args.rules).is_file():
            raise UsageError(f"--rules {args.rules!r}: no such file. Fix: the path of a .toml, "
                             ".json or .yaml rules file")
        try:
            rules = Rules.from_file(args.rules)
        except (ValueError, TypeError, OSError, ImportError) as e:
            raise UsageError(f"--rules {args.rules!r}: {_one_line(e)}") from e
    elif args.strategy:
        strat = strategy(args.strategy)
    else:
        raise UsageError("give --rules FILE (.toml, .json or .yaml) or --strategy NAME")
    aliases = parse_pairs(args.alias, "--alias", "fsdp=embed,tp=mlp") if args.alias else {}
    # A one-candidate list: mesh axes, never read as an alias by Strategy.with_rules.
    extra = {k: None if v.lower() == "none" else [tuple(v.split("+")) if "+" in v else v]
             for k, v in (parse_pairs(args.rules_extra, "--rules-extra", "norm=none")
                          if args.rules_extra else {}).items()}
    try:
        if strat is not None:
            strat = strat.with_rules(extra, aliases=aliases)
            rules, opt_rules = strat.rules, strat.opt_rules
        else:
            rules = (rules | extra).alias(aliases)
    except ShardingError as e:
        raise UsageError(f"--alias/--rules-extra: {_one_line(e)}") from e
    factory = _load_factory(args.factory)
    model = _call_factory(args.factory, factory)
    if not isinstance(model, nnx.Module):
        raise UsageError(f"FACTORY {args.factory!r} returned {type(model).__name__}, not an "
                         "nnx.Module. Fix: return the model from the factory")
    if strat is not None:
        try:
            strat.check_names(model, sizes)
        except ShardingError as e:
            raise UsageError(_one_line(e)) from e
    tx = optimizer(args.optimizer) if args.optimizer else None
    report = abstract_report(model, sizes, rules, tx, opt_rules)
    print(report.to_markdown() if args.markdown else report)
    if args.generate:
        _explain_cache(args, model, sizes, rules)
    elif args.batch is not None or args.seq is not None:
        raise UsageError("--batch and --seq size the generation cache: add --generate")
    return 0


def _explain_cache(args: argparse.Namespace, model: Any, sizes: dict[str, int],
                   rules: Rules) -> None:
    """The key/value cache :func:`nnx_shard.inference.generate` allocates, per device."""
    from nnx_shard.inference import explain_cache

    if args.batch is None or args.seq is None or args.batch < 1 or args.seq < 1:
        raise UsageError("--generate needs --batch B and --seq S (sequences, and positions of "
                         "prompt + new tokens each), at least 1. Fix: e.g. --batch 8 --seq 256")
    if not (callable(getattr(model, "init_cache", None))
            and callable(getattr(model, "decode", None))):
        raise UsageError(f"FACTORY {args.factory!r} returned a {type(model).__name__} without "
                         "init_cache(batch, length) and decode(tokens), which generation "
                         "needs. Fix: implement both (see the nnx_shard.inference docs)")
    cache = explain_cache(model, abstract_mesh(sizes), rules, batch=args.batch,
                          length=args.seq)
    print(f"\nkey/value cache for generation, batch {args.batch} x {args.seq} positions: "
          f"{fmt_bytes(cache.total_bytes)} total, {fmt_bytes(cache.param_bytes_per_device)} "
          "per device")
    print(cache.to_markdown() if args.markdown else cache)

