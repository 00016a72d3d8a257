"""Hostile cases of the tools around training: ``ns.pack`` with 100,000 examples (in
``n log n``, a documented behaviour), a row ``length`` whose rows would be gigabytes
of padding, a ``None`` mask; ``ns.hf.tiny_checkpoint`` and the ``nnx-shard
tiny-checkpoint`` command with seeds, flags and dtypes of the wrong type, sizes past a
tiny model's, a ``model_type`` of another family, paths it cannot write (the working
directory, under a file) and a disk that takes no more (``RLIMIT_FSIZE``); ``nnx-shard
plan --quant-block`` with digits ``int()`` does not read, and ``plan --model`` of the
named mixtures of experts (a plan with their bytes, a documented behaviour)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any


def build(hs: Any) -> None:
    F = hs.F

    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    def naming(fn: Callable[[], Any], *words: str) -> Callable[[], Any]:
        """``fn``, whose error must hold every one of ``words`` (the sweep's names are
        any one of them): an error without one is an AssertionError, a raw outcome."""
        def call() -> Any:
            try:
                return fn()
            except Exception as e:
                missing = [w for w in words if w not in str(e)]
                if missing:
                    raise AssertionError(f"the error does not name {missing}: {e}") from e
                raise
        return call

    # ns.pack --------------------------------------------------------------------------------
    def pack_many(examples: list[list[int]], length: int, rows: int) -> Any:
        import time

        start = time.perf_counter()
        batch = ns().pack(examples, length)
        took = time.perf_counter() - start
        if batch["inputs"].shape != (rows, length):
            raise AssertionError(f"packed into {batch['inputs'].shape}, not {rows} rows")
        raise hs._Documented(f"pack placed {len(examples):,} examples in {took:.1f} s "
                             "(first fit decreasing on a tree: n log n)")

    hs.api("r6tools/pack/100k_examples_one_per_row", "pack",
           lambda: pack_many([[1 + k % 5] * 8 for k in range(100_000)], 8, 100_000))
    hs.api("r6tools/pack/100k_short_examples", "pack",
           lambda: pack_many([[7] * (1 + k % 8) for k in range(100_000)], 2048, 220))
    for label, length in [("2**31", 2**31), ("2**40", 2**40), ("int32_max", 2**31 - 1),
                          ("2**30", 2**30), ("2**27_for_2_tokens", 2**27)]:
        hs.api(f"r6tools/pack/length_{label}", "length",
               naming(lambda n=length: ns().pack([[1, 2]], n), "length", str(length)))
    hs.api("r6tools/pack/assistant_masks_none", "assistant_masks",
           naming(lambda: ns().pack([[3, 4], {"input_ids": [1, 2], "assistant_masks": None}],
                                    8), "example 1", "assistant_masks", "None"))
    hs.api("r6tools/pack/tuple_mask_none", "mask",
           naming(lambda: ns().pack([([1, 2], None)], 8), "example 0", "mask", "None"))

    # ns.hf.tiny_checkpoint ------------------------------------------------------------------
    def tiny(*args: Any, **kw: Any) -> Any:
        path = args[0] if args else F.path("r6_tiny")
        return ns().hf.tiny_checkpoint(path, *args[1:], **kw)

    for label, seed in [("true", True), ("float", 1.5), ("str", "0"), ("none", None),
                        ("huge", 2**70), ("negative", -1)]:
        hs.api(f"r6tools/tiny_checkpoint/seed_{label}", "seed",
               lambda s=seed: tiny(tokenizer=False, seed=s))
    for label, value in [("str_no", "no"), ("none", None), ("int", 1)]:
        hs.api(f"r6tools/tiny_checkpoint/tokenizer_{label}", "tokenizer",
               lambda v=value: tiny(tokenizer=v))
    hs.api("r6tools/tiny_checkpoint/model_type_of_another_family", "model_type",
           naming(lambda: tiny(F.path("r6_tiny"), "llama", tokenizer=False,
                               model_type="qwen3"), "model_type='qwen3'", "family='llama'"))
    for label, kw in [("param_dtype_int8", {"param_dtype": "int8"}),
                      ("param_dtype_none", {"param_dtype": None}),
                      ("dtype_float64", {"dtype": "float64"}),
                      ("dtype_bool", {"dtype": "bool"})]:
        hs.api(f"r6tools/tiny_checkpoint/{label}", next(iter(kw)),
               lambda kw=kw: tiny(tokenizer=False, **kw))
    for label, kw in [("layers_1e6", {"layers": 1_000_000}), ("vocab_1e9", {"vocab": 10**9}),
                      ("embed_1e6", {"embed": 1_000_000}),
                      ("layers_true", {"layers": True}), ("layers_zero", {"layers": 0})]:
        hs.api(f"r6tools/tiny_checkpoint/{label}", next(iter(kw)),
               lambda kw=kw: tiny(tokenizer=False, **kw))
    for family in ("gemma2", "gemma3_text", "qwen3_moe"):
        hs.api(f"r6tools/tiny_checkpoint/{family}_layers_1e12", "layers",
               lambda f=family: tiny(F.path("r6_tiny"), f, tokenizer=False, layers=10**12))

    @contextlib.contextmanager
    def inside(folder: str) -> Iterator[None]:
        before = os.getcwd()
        os.chdir(folder)
        try:
            yield
        finally:
            os.chdir(before)

    def in_folder(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            with inside(F.dir("r6_cwd")):
                return fn()
        return call

    hs.api("r6tools/tiny_checkpoint/path_working_directory", "path",
           in_folder(lambda: tiny(".", tokenizer=False)))
    hs.api("r6tools/tiny_checkpoint/path_above_working_directory", "path",
           in_folder(lambda: tiny("..", tokenizer=False)))
    hs.api("r6tools/tiny_checkpoint/path_is_a_file", "path",
           lambda: tiny(F.file("r6_afile", "x"), tokenizer=False))
    hs.api("r6tools/tiny_checkpoint/path_under_a_file", "path",
           lambda: tiny(os.path.join(F.file("r6_afile", "x"), "sub"), tokenizer=False))
    hs.api("r6tools/tiny_checkpoint/path_nul", "path", lambda: tiny("a\0b", tokenizer=False))

    @contextlib.contextmanager
    def file_size_limit(limit: int) -> Iterator[None]:
        """Writes past ``limit`` bytes fail with EFBIG ("File too large"), as on a
        full disk."""
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, old_handler)

    def full_disk_tokenizer() -> Any:
        # The tokenizer's files are written before the model is built: nothing but them
        # is written while the limit holds.
        path = F.path("r6_full_tok")
        with file_size_limit(4096):
            try:
                return tiny(path)
            except Exception as e:
                if path not in str(e) or os.path.exists(path):
                    raise AssertionError(f"the path is not named, or was written: {e}") from e
                raise

    hs.api("r6tools/tiny_checkpoint/full_disk_tokenizer", "path", full_disk_tokenizer)

    # the command ------------------------------------------------------------------------------
    def command(*argv: str) -> Callable[[], Any]:
        """``nnx-shard tiny-checkpoint ARGV`` run from a folder of the sweep's own."""
        return in_folder(lambda: hs._run_cli(["tiny-checkpoint", *argv]))

    hs.api("r6tools/cli/tiny_checkpoint_dot", "PATH", command(".", "--no-tokenizer"))
    hs.api("r6tools/cli/tiny_checkpoint_under_a_file", "PATH",
           lambda: hs._run_cli(["tiny-checkpoint", os.path.join(F.file("r6_afile", "x"), "sub"),
                                "--no-tokenizer"]))
    for label, argv, flag in [
        ("seed_2**70", ("--seed", str(2**70)), "--seed"),
        ("seed_negative", ("--seed", "-1"), "--seed"),
        ("seed_superscript", ("--seed", "\u00b2"), "--seed"),
        ("layers_1e6", ("--layers", "1000000"), "--layers"),
        ("layers_zero", ("--layers", "0"), "--layers"),
        ("layers_5000_digits", ("--layers", "9" * 5000), "--layers"),
        ("family_gpt2", ("--family", "gpt2"), "--family"),
    ]:
        hs.api(f"r6tools/cli/tiny_checkpoint_{label}", flag,
               command("r6_cli_out", "--no-tokenizer", *argv))

    def command_on_a_full_disk() -> Any:
        """The command in a child Python whose writes past 64 KiB fail (the weights'
        file is larger): its error, as the sweep reads a command's."""
        out = F.path("r6_full_cli")

        def limit() -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE,
                               (65536, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

        p = subprocess.run([sys.executable, "-m", "nnx_shard.cli", "tiny-checkpoint", out,
                            "--no-tokenizer"], capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL, preexec_fn=limit)
        if p.returncode == 2 and (out not in p.stderr or os.path.exists(out)):
            raise AssertionError(f"the path is not named, or was written: {p.stderr}")
        return ("cli", p.returncode, p.stdout, p.stderr)

    hs.api("r6tools/cli/tiny_checkpoint_full_disk", "PATH", command_on_a_full_disk, slow=True)

    qlora = ("plan", "--model", "tiny", "--mesh", "data=8", "--strategy", "fsdp", "--batch", "8",
             "--seq", "16", "--no-compile", "--lora-rank", "4", "--quantize-base", "int8")
    for label, block in [("superscript_two", "\u00b2"), ("arabic_indic_three", "\u0663"),
                         ("fullwidth_six", "\uff16"), ("5000_digits", "9" * 5000),
                         ("20_digits", "9" * 20), ("negative", "-64"), ("space", " ")]:
        hs.cli(f"r6tools/cli/plan_quant_block_{label}", "--quant-block", *qlora,
               "--quant-block", block)

    # plan of the named mixtures of experts ----------------------------------------------------
    def moe_plan(name: str) -> Any:
        from nnx_shard.models import get_config

        result = hs._run_cli(["plan", "--model", name, "--mesh", "data=4,model=2", "--batch",
                              "8", "--seq", "128", "--json", "--no-compile"])
        _, status, out, _ = result
        if status != 0:
            return result   # an error: the sweep classifies it
        plan = json.loads(out)
        want = 2 * get_config(name).num_params   # bfloat16
        if plan["bytes_total"]["params"] != want or not plan["bytes_per_device"]["activations"]:
            raise AssertionError(f"{name}: params {plan['bytes_total']['params']} bytes, not "
                                 f"{want}; activations {plan['bytes_per_device']['activations']}")
        raise hs._Documented(f"plan --model {name}: {want / 2**30:.1f} GiB of parameters, "
                             f"{plan['bytes_per_device']['total'] / 2**30:.1f} GiB per device")

    for name in ("mixtral-8x7b", "qwen3-30b-a3b"):
        hs.api(f"r6tools/cli/plan_model_{name}", "--model", lambda n=name: moe_plan(n))
