"""Hostile cases of the export to publish: ``save_safetensors`` of a model that
remembers its source checkpoint (``load_pretrained``) when the source folder is
gone, a tokenizer file cannot be read, the source names conflicting or unknown
dtypes, or ``source=`` / ``copy_tokenizer=`` are not what they should be.

Every case must leave the destination as it was (no export, or the user's file
untouched): a case that writes anything there is ``raw`` (an AssertionError here).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any


def build(hs: Any) -> None:
    F = hs.F

    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    def source(label: str, **config: Any) -> Path:
        """A fresh copy of the hf_publish checkpoint."""
        folder = hs.hf_publish_copy(F.path(f"export_meta_{label}"))
        if config:
            hs.merge_json(str(folder / "config.json"), config)
        return folder

    load = hs.load_dp

    def save_nothing(label: str, model: Any, **kw: Any) -> Any:
        out = Path(F.path(f"export_meta_{label}_out"))
        try:
            return ns().hf.save_safetensors(out, model, **kw)
        finally:
            if out.exists():
                raise AssertionError(f"{out}: an export was written")

    def vanished() -> Any:
        folder = source("vanished")
        model = load(folder)
        shutil.rmtree(folder)
        return save_nothing("vanished", model)

    hs.api("export_meta/source_folder_vanished", ("tokenizer", "source"), vanished)

    def unreadable(how: str) -> Any:
        folder = source(f"unreadable_{how}")
        model = load(folder)
        tok = folder / "tokenizer.json"
        tok.unlink()
        if how == "dir":
            tok.mkdir()
        else:
            os.symlink(folder / "missing.json", tok)
        return save_nothing(f"unreadable_{how}", model)

    for how in ("dir", "dangling_link"):
        hs.api(f"export_meta/tokenizer_unreadable_{how}", ("tokenizer.json", "tokenizer"),
               lambda how=how: unreadable(how))

    def dtype_case(label: str, **config: Any) -> Any:
        folder = source(label)
        model = load(folder)
        hs.merge_json(str(folder / "config.json"), config)
        return save_nothing(label, model, source=folder)

    hs.api("export_meta/dtype_conflict", "dtype",
           lambda: dtype_case("dtype_conflict", torch_dtype="bfloat16", dtype="float16"))
    for label, value in (("int8", "int8"), ("number", 16), ("empty", "")):
        hs.api(f"export_meta/dtype_unknown_{label}", "dtype",
               lambda label=label, value=value: dtype_case(f"dtype_{label}", torch_dtype=value))

    def bad_arg(label: str, **kw: Any) -> Any:
        return save_nothing(label, load(source(label)), **kw)

    hs.api("export_meta/source_true", "source", lambda: bad_arg("src_true", source=True))
    hs.api("export_meta/source_missing", "source",
           lambda: bad_arg("src_missing", source=F.path("export_meta_no_such_folder")))
    hs.api("export_meta/source_int", "source", lambda: bad_arg("src_int", source=3))
    hs.api("export_meta/copy_tokenizer_str", "copy_tokenizer",
           lambda: bad_arg("copy_str", copy_tokenizer="no"))

    def broken_generation() -> Any:
        folder = source("gen_broken")
        (folder / "generation_config.json").write_text("{not json")
        return load(folder)

    hs.api("export_meta/generation_config_not_json", "generation_config.json", broken_generation)

    def differs() -> Any:
        import dataclasses

        from flax import nnx

        folder = source("differs")
        cfg = dataclasses.replace(ns().models.DecoderConfig.from_hf(folder),
                                  activation="gelu_pytorch_tanh")
        # Zero tables in the dp layout: the export refuses on the config before it reads
        # a value, and a sharded random init compiles for seconds.
        model = hs.zero_filled(ns().abstract_init(
            lambda: ns().models.Decoder(cfg, rngs=nnx.Rngs(0)), "data=8", ns().strategies.get("dp")))
        return save_nothing("differs", model, source=folder)

    hs.api("export_meta/model_differs_from_source", ("source", "hidden_act"), differs)

    def users_tokenizer() -> Any:
        model = load(source("user_tok"))
        out = Path(F.dir("export_meta_user_tok_out"))
        (out / "tokenizer.json").write_text("the user's")
        try:
            return ns().hf.save_safetensors(out, model)
        finally:
            if sorted(p.name for p in out.iterdir()) != ["tokenizer.json"] or \
                    (out / "tokenizer.json").read_text() != "the user's":
                raise AssertionError(f"{out}: the user's tokenizer.json changed")

    hs.api("export_meta/users_tokenizer_in_destination", "tokenizer.json", users_tokenizer)
