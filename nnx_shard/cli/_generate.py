"""``nnx-shard generate --model DIR --prompt TEXT``: a Hugging Face checkpoint
loaded sharded (:func:`nnx_shard.hf.load_pretrained`) continues a prompt, the
text printed as it is decoded (:func:`nnx_shard.inference.stream_text`).

The mesh is ``--mesh`` or the strategy's shape over every device; the tokenizer
is read from ``--tokenizer`` (default: the checkpoint folder). ``--chat`` renders
the prompt as one user message with the tokenizer's chat template.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Any

import jax

from nnx_shard._errors import NnxShardError, ShardingError, short
from nnx_shard.cli._common import UsageError, mesh_sizes, strategy

__all__ = ["run"]


def _check(args: argparse.Namespace) -> None:
    """Flags checked before anything is loaded, each error naming its flag."""
    if not args.prompt.strip():
        raise UsageError(f"--prompt {args.prompt!r} is empty; give the text to continue, "
                         "e.g. --prompt 'Once upon a time'")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes the locale could not decode reach us as surrogates
        raise UsageError(f"--prompt is not UTF-8 text (position {e.start}: "
                         f"{args.prompt[e.start:e.end]!r}); pass the prompt in UTF-8 "
                         "(e.g. set LANG=C.UTF-8)") from None
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--chunk", args.chunk)):
        if value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1, e.g. {flag} 32")
    if args.top_k is not None and args.top_k < 0:
        raise UsageError(f"--top-k {args.top_k}: must be 0 or more (0: every token)")
    if args.top_p is not None and not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise UsageError(f"--top-p {args.top_p}: must be a number in (0, 1] (1: off)")
    if args.min_p is not None and not (math.isfinite(args.min_p) and 0 <= args.min_p <= 1):
        raise UsageError(f"--min-p {args.min_p}: must be a number in [0, 1] (0: off)")
    least = args.min_new_tokens
    if least is not None and not 0 <= least <= args.max_new_tokens:
        raise UsageError(f"--min-new-tokens {least}: must be from 0 to --max-new-tokens "
                         f"({args.max_new_tokens})")
    if args.no_repeat_ngram_size is not None and args.no_repeat_ngram_size < 0:
        raise UsageError(f"--no-repeat-ngram-size {args.no_repeat_ngram_size}: must be 0 "
                         "(off) or more")
    if args.stop is not None and not all(args.stop):
        raise UsageError("--stop '': a stop string must be non-empty text, e.g. --stop 'User:'")
    penalty = args.repetition_penalty
    if penalty is not None and not (math.isfinite(penalty) and penalty > 0):
        raise UsageError(f"--repetition-penalty {penalty}: must be a finite number above 0 "
                         "(1: off)")
    for flag, folder in (("--model", args.model), ("--tokenizer", args.tokenizer)):
        if folder is not None and not os.path.isdir(folder):
            raise UsageError(f"{flag} {short(folder, 120)} is not a folder; give the "
                             "checkpoint folder (config.json, *.safetensors, tokenizer.json)")


def _mesh(args: argparse.Namespace, rules_of: Any) -> Any:
    import nnx_shard as ns

    sizes = mesh_sizes(args.mesh) if args.mesh else rules_of.mesh_for(jax.device_count())
    missing = [a for a in rules_of.mesh_axes if a not in sizes]
    if len(missing) == len(rules_of.mesh_axes):  # some may go unused; none is a wrong mesh
        example = ",".join(f"{k}={v}" for k, v in rules_of.mesh_for(jax.device_count()).items())
        raise UsageError(f"--mesh {args.mesh} has no {' or '.join(repr(a) for a in missing)} "
                         f"axis, which --strategy {args.strategy} shards over "
                         f"({', '.join(rules_of.mesh_axes)}). Fix: e.g. --mesh {example}, or "
                         "leave --mesh out")
    need = math.prod(sizes.values())
    if need > jax.device_count():
        raise UsageError(f"--mesh {args.mesh} needs {need} devices but {jax.device_count()} "
                         "are available")
    return ns.make_mesh(sizes, devices=jax.devices()[:need])


def run(args: argparse.Namespace) -> int:
    """Loads the checkpoint and tokenizer, prints the continuation as it streams."""
    _check(args)
    from nnx_shard.hf import load_pretrained
    from nnx_shard.inference import Tokenizer, stream_text

    preset = strategy(args.strategy)
    rules = _generation_rules(preset.rules)
    try:
        tokenizer = Tokenizer.from_pretrained(args.tokenizer or args.model)
    except (NnxShardError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
        flag = "--tokenizer" if args.tokenizer else "--model"
        hint = "" if args.tokenizer else " (or --tokenizer: the folder holding tokenizer.json)"
        raise UsageError(f"{flag}: {e}{hint}") from e
    mesh = _mesh(args, preset)
    try:
        model = load_pretrained(args.model, mesh=mesh, rules=preset.rules)
    except ShardingError as e:  # the layout: the mesh's sizes do not divide the model
        shape = ",".join(f"{k}={v}" for k, v in mesh.shape.items())
        raise UsageError(_one_line(f"--strategy {args.strategy} on --mesh {shape}: {e}")) from e
    except (NnxShardError, FileNotFoundError) as e:  # no config, or files the loader refuses
        raise UsageError(_one_line(f"--model: {e}")) from e
    config = _settings(args, model)
    try:  # the checks run here, before any token: the prompt, the context, the settings
        pieces = stream_text(model, tokenizer, args.prompt, config, chat=args.chat,
                             chunk=args.chunk, seed=args.seed, mesh=mesh, rules=rules)
    except UsageError as e:
        raise UsageError(_one_line(_flagged(
            f"{'--chat: ' if args.chat and 'chat template' in str(e) else ''}{e}"))) from e
    except (NnxShardError, ValueError, TypeError) as e:
        raise UsageError(_one_line(str(e))) from e
    try:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except NnxShardError as e:  # a layout the mesh refuses, found as the programs compile
        raise UsageError(_one_line(str(e))) from e
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


def _settings(args: argparse.Namespace, model: Any) -> Any:
    """The checkpoint's generation config (the defaults without one) with each flag
    given in place of its field; one continuation, no log-probabilities. The file's
    token ids are checked against the model here, so an error names the file."""
    from nnx_shard.inference import GenerationConfig
    from nnx_shard.inference._decoding import check_options

    try:
        base = GenerationConfig.from_pretrained(args.model)
    except FileNotFoundError:
        base = GenerationConfig()
    except NnxShardError as e:
        raise UsageError(_one_line(f"--model: {e}")) from e
    file = os.path.join(args.model, "generation_config.json")
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(base, name)
        if value is None:
            continue
        try:
            check_options(model, GenerationConfig(**{name: value}))
        except UsageError as e:
            said = str(e).split(": ", 1)[-1].split(". Fix")[0]
            shown = list(value) if isinstance(value, tuple) else value  # as the file has it
            raise UsageError(f"--model: {file}: {name} {short(shown, 60)} is not an id of this "
                             f"model ({said}); correct it there") from e
    changes: dict[str, Any] = {"max_new_tokens": args.max_new_tokens,
                               "num_return_sequences": 1, "return_logprobs": False}
    if args.temperature is not None:  # 0: greedy, as the flag has always meant
        changes["do_sample"] = args.temperature > 0
        if args.temperature > 0:
            changes["temperature"] = args.temperature
    for name in ("top_k", "top_p", "min_p", "repetition_penalty", "min_new_tokens",
                 "no_repeat_ngram_size"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.stop is not None:
        changes["stop_strings"] = list(args.stop)
    try:
        return base.replace(**changes)
    except UsageError as e:
        raise UsageError(_one_line(_flagged(str(e)))) from e


#: The library's names of the options the command passes, and their flags.
_FLAGS = (("max_new_tokens", "--max-new-tokens"), ("min_new_tokens", "--min-new-tokens"),
          ("no_repeat_ngram_size", "--no-repeat-ngram-size"), ("stop_strings", "--stop"),
          ("top_k", "--top-k"), ("top_p", "--top-p"), ("min_p", "--min-p"),
          ("repetition_penalty", "--repetition-penalty"), ("temperature", "--temperature"),
          ("chunk", "--chunk"), ("the prompt has", "--prompt"))


def _flagged(text: str) -> str:
    """``text`` (a library error, which names its arguments as Python does) led by the
    flags of the options it names, so the line names what to change on the command.

    >>> _flagged("stream_text: no_repeat_ngram_size=9 is too long")
    '--no-repeat-ngram-size: stream_text: no_repeat_ngram_size=9 is too long'
    """
    flags = [f for name, f in _FLAGS if re.search(rf"\b{re.escape(name)}\b", text)]
    return f"{', '.join(flags)}: {text}" if flags else text


def _one_line(text: str, limit: int = 1500) -> str:
    """A message of several lines (the loader lists each parameter it refuses) as the
    one error line the command prints."""
    joined = ""
    for line in text.splitlines():
        line = line.strip()
        line = line[2:] if line.startswith("- ") else line
        if line:
            joined += (" " if not joined or joined.endswith(":") else "; ") + line
    joined = joined.strip()
    return joined if len(joined) <= limit else joined[:limit - 3] + "..."


def _generation_rules(rules: Any) -> Any:
    """The strategy's rules with the cache's positions replicated where the context
    axis does not divide them: under the context-parallel presets the cache is
    ``prompt + --max-new-tokens`` positions long, a length the command's user
    chooses, and a cache that does not split evenly is kept whole on each device
    (the rest of the layout is the strategy's)."""
    from nnx_shard._rules import Fallbacks

    placement = rules["cache_length"] if "cache_length" in rules else None
    if placement is None or isinstance(placement, Fallbacks):
        return rules
    return rules | {"cache_length": Fallbacks(placement, None)}
