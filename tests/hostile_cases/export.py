"""Hostile cases of the checkpoint-out path: ``save_safetensors`` over an earlier export
(failed writes, abstract models, forged markers, paths that cannot hold an export),
``Checkpointer`` beside folders named like its temporaries, and ``nnx-shard demo
--out`` with a forged record or an empty path.

A case that must leave earlier data alone checks it after the call: data lost makes
the case ``raw`` (an AssertionError of this file), whatever the error said.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from typing import Any


def _tree(folder: str) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = fh.read()
    return out


def _keeps(folder: str, fn: Callable[[], Any], *, beside_too: bool = True) -> Any:
    """Runs ``fn``; raises AssertionError (a raw outcome) if any file under ``folder``
    changed or went, or (``beside_too``) anything beside it appeared and stayed."""
    before, beside = _tree(folder), sorted(os.listdir(os.path.dirname(folder)))
    try:
        return fn()
    finally:
        if _tree(folder) != before:
            raise AssertionError(f"{folder}: earlier data changed or lost")
        if beside_too and sorted(os.listdir(os.path.dirname(folder))) != beside:
            raise AssertionError(f"{os.path.dirname(folder)}: something was left beside it")


def build(hs: Any) -> None:
    F = hs.F

    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    def previous(label: str) -> str:
        """A folder (alone in its own parent) with a finished export and a user's file."""
        out = os.path.join(F.dir(f"export_{label}"), "export")
        if not os.path.isdir(out):
            ns().hf.save_safetensors(out, hs._tiny_llama(), max_shard_bytes=30_000)
            with open(os.path.join(out, "notes.txt"), "w") as f:
                f.write("the user's")
        return out

    def failing_write(label: str, after: int, err: int) -> Any:
        from nnx_shard import _safetensors_io as st

        out = previous(label)
        real, budget = st._pwrite, [after]

        def pwrite(fd: int, data: Any, offset: int) -> int:
            if len(data) > budget[0]:
                raise OSError(err, os.strerror(err))
            budget[0] -= len(data)
            return real(fd, data, offset)

        st._pwrite = pwrite
        try:
            return _keeps(out, lambda: ns().hf.save_safetensors(out, hs._tiny_llama(),
                                                             max_shard_bytes=30_000))
        finally:
            st._pwrite = real

    for after in (0, 5_000, 60_000):
        hs.api(f"export/save_enospc_after_{after}", ("export", "space"),
               lambda after=after: failing_write(f"enospc{after}", after, errno.ENOSPC))
    hs.api("export/save_erofs", ("export", "writable"),
           lambda: failing_write("erofs", 100, errno.EROFS))

    def read_only_dir() -> Any:
        out = previous("ro")
        real = os.mkdir

        def mkdir(*a: Any, **k: Any) -> None:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(a[0]))

        os.mkdir = mkdir  # type: ignore[assignment]
        try:
            return _keeps(out, lambda: ns().hf.save_safetensors(out, hs._tiny_llama()))
        finally:
            os.mkdir = real

    hs.api("export/save_read_only_dir", ("export", "write"), read_only_dir)

    def abstract(how: str) -> Any:
        from flax import nnx

        out = previous(f"abstract_{how}")
        factory = hs._tiny_llama
        model = (nnx.eval_shape(factory) if how == "eval_shape" else
                 ns().abstract_init(factory, "data=8", ns().strategies.get("fsdp")))
        return _keeps(out, lambda: ns().hf.save_safetensors(out, model))

    hs.api("export/save_abstract_eval_shape", ("abstract", "blocks/0"),
           lambda: abstract("eval_shape"))
    hs.api("export/save_abstract_init", ("abstract", "blocks/0"), lambda: abstract("init"))

    def forged(label: str, raw: bytes) -> Any:
        folder = os.path.join(F.dir(f"export_marker_{label}"), "out")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "precious.txt"), "w") as f:
            f.write("keep")
        with open(os.path.join(folder, ".nnx_shard_safetensors"), "wb") as f:
            f.write(raw)
        return _keeps(folder, lambda: ns().hf.save_safetensors(folder, hs._tiny_llama()))

    for label, raw in [
        ("legacy", json.dumps({"files": ["precious.txt"]}).encode()),
        ("list", json.dumps(["precious.txt"]).encode()),
        ("corrupt", b"\xff\x00{{{"),
        ("empty", b""),
        ("files_dict", json.dumps({"format": 2, "writer": "nnx_shard.save_safetensors",
                                   "files": {"precious.txt": {}}}).encode()),
    ]:
        hs.api(f"export/save_marker_{label}", ".nnx_shard_safetensors",
               lambda label=label, raw=raw: forged(label, raw))

    for dtype in ("int8", "int32", "bool", "uint8"):
        hs.api(f"export/save_dtype_{dtype}", "dtype",
               lambda dtype=dtype: ns().hf.save_safetensors(F.path(f"export_dt_{dtype}"),
                                                         hs._tiny_llama(), dtype=dtype))
    hs.api("export/save_under_a_file", ("path", "not a directory"), lambda: ns().hf.save_safetensors(
        os.path.join(F.file("export_plain_file", "x"), "sub"), hs._tiny_llama()))

    def dangling() -> Any:
        link = F.path("export_dangling")
        if not os.path.lexists(link):
            os.symlink(F.path("export_nowhere"), link)
        return ns().hf.save_safetensors(link, hs._tiny_llama())

    hs.api("export/save_dangling_symlink", ("symbolic link", "path"), dangling)

    # Checkpointer: folders named like its temporaries are the user's --------------------------
    def user_folders() -> Any:
        d = F.dir("export_ckpt_users")
        names = ["5.orbax-checkpoint-tmp-1234", "5.orbax-checkpoint-tmp",
                 "7.nnx_shard-deleting-mine"]
        for name in names:
            os.makedirs(os.path.join(d, name), exist_ok=True)
            with open(os.path.join(d, name, "precious.txt"), "w") as f:
                f.write(name)
        ns().Checkpointer(d).close()
        if not all(os.path.isfile(os.path.join(d, n, "precious.txt")) for n in names):
            raise AssertionError("Checkpointer deleted a user's folder")
        raise hs._Documented("folders named like temporaries are kept (documented)")

    hs.api("export/checkpointer_keeps_user_folders", "Checkpointer", user_folders)

    def save_over_user_tmp() -> Any:
        d = F.dir("export_ckpt_tmp")
        tmp = os.path.join(d, "5.orbax-checkpoint-tmp")
        os.makedirs(tmp, exist_ok=True)
        with open(os.path.join(tmp, "precious.txt"), "w") as f:
            f.write("keep")
        return _keeps(tmp, lambda: ns().save(d, 5, model=F.model()), beside_too=False)

    hs.api("export/save_step_over_user_tmp", ("orbax-checkpoint-tmp", "step 5"),
           save_over_user_tmp)
    hs.api("export/checkpointer_unknown_user_tilde", ("directory", "~"),
           lambda: ns().Checkpointer("~no_such_user_xyz/ckpt"))

    # nnx-shard demo --out ---------------------------------------------------------------------
    hs.cli("export/demo_out_empty", "--out", "demo", "--steps", "2", "--out", "")

    def demo_forged(label: str, raw: str) -> Any:
        d = F.path(f"export_demo_{label}")
        os.makedirs(os.path.join(d, "checkpoint", "5"), exist_ok=True)
        with open(os.path.join(d, "checkpoint", "5", "thesis.tex"), "w") as f:
            f.write("mine")
        with open(os.path.join(d, "summary.json"), "w") as f:
            f.write("mine too")
        with open(os.path.join(d, ".nnx_shard_demo.json"), "w") as f:
            f.write(raw)
        return _keeps(d, lambda: hs._run_cli(["demo", "--steps", "2", "--out", d,
                                              "--no-progress"]), beside_too=False)

    names = ["summary.json", "checkpoint", "checkpoint/5"]
    for label, raw in [("legacy", json.dumps({"wrote": names})),
                       ("list", json.dumps(names)), ("corrupt", "\x00{{{")]:
        hs.api(f"export/demo_forged_record_{label}", "--out",
               lambda label=label, raw=raw: demo_forged(label, raw))
