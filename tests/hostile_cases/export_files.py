"""Hostile cases of the files around an export and a checkpoint: ``save_safetensors``
of a source whose files link out of the checkpoint folder (or out of a hub cache
repository), whose tokenizer JSON files are of the wrong type or whose token ids are
not ids of the model; saves into the working directory, a folder above it or a mount
point; full disks while an export or a ``Checkpointer`` inside ``Trainer.fit`` writes;
a tied target for a checkpoint with a separate ``lm_head.weight``; an eos id of
``generation_config.json`` outside the tokenizer's vocabulary.

Every case must leave what was there as it was: an export written, a staging or
temporary file left behind, a working directory moved or data changed is ``raw`` (an
AssertionError of this file), whatever the error said.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def build(hs: Any) -> None:
    F = hs.F

    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    load = hs.load_dp

    def source(label: str, folder: Path | None = None) -> Path:
        """A fresh copy of the hf_publish checkpoint (at ``folder``)."""
        return hs.hf_publish_copy(folder or F.path(f"export_files_{label}"))

    def save_nothing(label: str, model: Any, **kw: Any) -> Any:
        """Saves to a fresh destination that must stay absent, with nothing beside it."""
        return hs.save_nothing(F.dir(f"export_files_{label}_parent"), model, **kw)

    # -- links out of the checkpoint folder ------------------------------------------------

    def secret() -> Path:
        p = Path(F.path("export_files_private_key"))
        p.write_text("-----BEGIN PRIVATE KEY-----\nnot to be published\n")
        return p

    def linked(label: str, name: str, target: Path) -> Any:
        folder = source(label)
        model = load(folder)
        (folder / name).unlink()
        os.symlink(target, folder / name)
        return save_nothing(label, model)

    hs.api("export_files/tokenizer_links_to_a_private_key", "tokenizer.json",
           lambda: linked("key", "tokenizer.json", secret()))
    hostname = Path("/etc/hostname") if os.path.isfile("/etc/hostname") else Path("/etc/passwd")
    hs.api("export_files/tokenizer_config_links_to_etc", ("tokenizer_config.json", str(hostname)),
           lambda: linked("etc", "tokenizer_config.json", hostname))
    hs.api("export_files/chat_template_links_to_a_private_key", "chat_template.jinja",
           lambda: linked("jinja", "chat_template.jinja", secret()))

    def linked_json(label: str, name: str) -> Any:
        outside = Path(F.path(f"export_files_{label}_outside.json"))
        shutil.copy(FIXTURES / "hf_publish" / name, outside)
        return linked(label, name, outside)

    hs.api("export_files/generation_config_links_outside", "generation_config.json",
           lambda: linked_json("gen_out", "generation_config.json"))
    hs.api("export_files/config_links_outside", "config.json",
           lambda: linked_json("cfg_out", "config.json"))

    def relative_escape() -> Any:
        folder = source("relative")
        model = load(folder)
        secret()
        (folder / "tokenizer.json").unlink()
        os.symlink("../export_files_private_key", folder / "tokenizer.json")
        return save_nothing("relative", model)

    hs.api("export_files/tokenizer_relative_link_out", "tokenizer.json", relative_escape)

    def hub_cache(label: str, escape: bool) -> Any:
        """A huggingface_hub cache layout: snapshots/<rev>/file -> ../../blobs/<hash>;
        one file links out of the repository folder."""
        repo = Path(F.path(f"export_files_{label}_hub")) / "models--org--tiny"
        shutil.rmtree(repo.parent, ignore_errors=True)
        snap = repo / "snapshots" / ("0" * 40)
        (repo / "blobs").mkdir(parents=True)
        snap.mkdir(parents=True)
        for p in (FIXTURES / "hf_publish").iterdir():
            blob = repo / "blobs" / f"blob-{p.name}"
            shutil.copy(p, blob)
            os.symlink(os.path.join("..", "..", "blobs", blob.name), snap / p.name)
        model = load(snap)
        if escape:
            (snap / "tokenizer.json").unlink()
            os.symlink(os.path.join("..", "..", "..", "..", "export_files_private_key"),
                       snap / "tokenizer.json")
            secret()
        return save_nothing(label, model)

    hs.api("export_files/hub_cache_link_out_of_the_repo", ("tokenizer.json", "hub cache"),
           lambda: hub_cache("hub_escape", True))

    # -- tokenizer and generation files of the wrong kind ----------------------------------

    def rewritten(label: str, name: str, content: Any, *, raw: bool = False) -> Any:
        folder = source(label)
        model = load(folder)
        (folder / name).write_text(content if raw else json.dumps(content))
        return save_nothing(label, model)

    for label, name, content in (
            ("tokenizer_json_list", "tokenizer.json", [1, 2]),
            ("tokenizer_config_string", "tokenizer_config.json", "eos"),
            ("tokenizer_config_eos_number", "tokenizer_config.json", {"eos_token": 5}),
            ("tokenizer_config_eos_record", "tokenizer_config.json",
             {"eos_token": {"text": "</s>"}}),
            ("tokenizer_config_extra_string", "tokenizer_config.json",
             {"additional_special_tokens": "<x>"})):
        hs.api(f"export_files/{label}", name,
               lambda label=label, name=name, content=content: rewritten(label, name, content))
    hs.api("export_files/tokenizer_json_not_json", "tokenizer.json",
           lambda: rewritten("tok_not_json", "tokenizer.json", "{oops", raw=True))

    def not_utf8() -> Any:
        folder = source("tok_latin1")
        model = load(folder)
        (folder / "tokenizer.json").write_bytes(b'{"k": "\xff"}')
        return save_nothing("tok_latin1", model)

    hs.api("export_files/tokenizer_json_not_utf8", "tokenizer.json", not_utf8)

    def special_map(label: str, content: Any) -> Any:
        folder = source(label)
        (folder / "special_tokens_map.json").write_text(json.dumps(content))
        return save_nothing(label, load(folder))

    hs.api("export_files/special_tokens_map_list", "special_tokens_map.json",
           lambda: special_map("stm_list", ["</s>"]))
    hs.api("export_files/special_tokens_map_pad_number", "special_tokens_map.json",
           lambda: special_map("stm_pad", {"pad_token": 0}))

    def generation(label: str, **fields: Any) -> Any:
        folder = source(label)
        gen = json.loads((folder / "generation_config.json").read_text()) | fields
        (folder / "generation_config.json").write_text(json.dumps(gen))
        return save_nothing(label, load(folder))

    for label, fields in (("eos_out_of_range", {"eos_token_id": 10**6}),
                          ("eos_negative", {"eos_token_id": -1}),
                          ("eos_list_out_of_range", {"eos_token_id": [2, 128]}),
                          ("eos_string", {"eos_token_id": "</s>"}),
                          ("pad_out_of_range", {"pad_token_id": 999}),
                          ("bos_bool", {"bos_token_id": True})):
        hs.api(f"export_files/generation_{label}", "generation_config.json",
               lambda label=label, fields=fields: generation(label, **fields))

    def config_ids() -> Any:
        folder = source("config_ids")
        (folder / "generation_config.json").unlink()
        cfg = json.loads((folder / "config.json").read_text()) | {"eos_token_id": 4096}
        (folder / "config.json").write_text(json.dumps(cfg))
        return save_nothing("config_ids", load(folder))

    hs.api("export_files/config_eos_out_of_range_without_generation", "config.json",
           config_ids)

    def tokenizer_eos() -> Any:
        folder = Path(F.path("export_files_tok_eos"))
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(FIXTURES / "hf_llama_text", folder)
        gen = folder / "generation_config.json"
        data = json.loads(gen.read_text()) if gen.is_file() else {}
        gen.write_text(json.dumps(data | {"eos_token_id": 10**6}))
        return ns().inference.Tokenizer.from_pretrained(folder).eos_token_ids

    hs.api("export_files/tokenizer_eos_outside_vocabulary", "generation_config.json",
           tokenizer_eos)

    # -- destinations the export cannot be swapped into -------------------------------------

    def in_cwd(label: str, how: str) -> Any:
        folder = Path(F.dir(f"export_files_{label}"))
        work = folder / "work"
        work.mkdir(exist_ok=True)
        (work / "notes.txt").write_text("the user's")
        before, cwd = hs.listing(folder), os.getcwd()
        os.chdir(work)
        try:
            target = {"dot": ".", "abs": str(work), "parent": str(folder), "dotdot": ".."}[how]
            return ns().hf.save_safetensors(target, hs._tiny_llama())
        finally:
            moved = os.getcwd() != str(work) or hs.listing(work) != ["notes.txt"] or \
                hs.listing(folder) != before
            os.chdir(cwd)
            if moved:
                raise AssertionError(f"{work}: the working directory or its files changed")

    for how in ("dot", "abs", "parent", "dotdot"):
        hs.api(f"export_files/save_into_the_working_directory_{how}",
               ("working directory", "subfolder"), lambda how=how: in_cwd(f"cwd_{how}", how))

    def mount_point() -> Any:
        found = next((p for p in ("/dev/shm", "/proc", "/sys", "/dev", "/run")
                      if os.path.isdir(p) and os.path.ismount(p)), None)
        if found is None:  # pragma: no cover - a machine without one: refused all the same
            raise OSError(errno.ENOENT, "no mount point to try")
        before = hs.listing(Path(found).parent)
        try:
            return ns().hf.save_safetensors(found, hs._tiny_llama())
        finally:
            if hs.listing(Path(found).parent) != before:
                raise AssertionError(f"{found}: something was left beside the mount point")

    hs.api("export_files/save_into_a_mount_point", ("mount point", "subfolder"), mount_point)

    # -- full disks ------------------------------------------------------------------------

    def enospc_on(label: str, name: str, **kw: Any) -> Any:
        """Fails every write to the export's file ``name`` with a bare ENOSPC."""
        from nnx_shard import _safetensors_io as st

        real = st._pwrite

        def pwrite(fd: int, data: Any, offset: int) -> int:
            if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == name:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, data, offset)

        model = load(source(label)) if kw.pop("published", False) else hs._tiny_llama()
        st._pwrite = pwrite
        try:
            return save_nothing(label, model, **kw)
        finally:
            st._pwrite = real

    shard = "model-00002-of-00005.safetensors"
    for label, name, kw in (
            ("single", "model.safetensors", {}),
            ("shard", shard, {"max_shard_bytes": 30_000}),
            ("index", "model.safetensors.index.json", {"max_shard_bytes": 30_000}),
            ("config", "config.json", {}),
            ("tokenizer", "tokenizer.json", {"published": True}),
            ("marker", ".nnx_shard_safetensors.tmp", {})):
        names = (name.removesuffix(".tmp"),)
        hs.api(f"export_files/enospc_writing_{label}", names,
               lambda label=label, name=name, kw=kw: enospc_on(f"enospc_{label}", name,
                                                               **dict(kw)))

    def checkpointer_full(label: str, *, rotate: bool) -> Any:
        """Trainer.fit with a Checkpointer whose folder's disk is full: the claim a save
        (or the deletion of an old step) writes first fails with a bare ENOSPC."""
        import pathlib

        folder = Path(F.path(f"export_files_{label}"))
        shutil.rmtree(folder, ignore_errors=True)
        real = pathlib.Path.write_text

        def full(self: Path, data: str, *a: Any, **k: Any) -> int:
            # With rotate, the saves' claims go through and the deletion's fails.
            if ".nnx_shard-claim-" in self.name and (not rotate or '"trash"' in data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(self, data, *a, **k)

        ckpt = ns().Checkpointer(folder, every=2, keep=1, async_save=False)
        pathlib.Path.write_text = full  # type: ignore[method-assign]
        try:
            return F.fit(num_steps=4, checkpointer=ckpt)
        finally:
            pathlib.Path.write_text = real  # type: ignore[method-assign]
            left = [n for n in hs.listing(folder) if n.endswith(".tmp") or "tmp" in n]
            try:
                ckpt.close()
            except OSError:
                pass
            if left:
                raise AssertionError(f"{folder}: temporary files left: {left}")

    hs.api("export_files/checkpointer_full_disk_in_fit", ("export_files_ckpt_full", "space"),
           lambda: checkpointer_full("ckpt_full", rotate=False))
    hs.api("export_files/checkpointer_full_disk_deleting_old_steps",
           ("export_files_ckpt_rotate", "keep"),
           lambda: checkpointer_full("ckpt_rotate", rotate=True))

    # -- a separate head for a tied target -------------------------------------------------

    def tied_target() -> Any:
        from flax import nnx

        cfg = ns().models.DecoderConfig.from_hf(FIXTURES / "hf_tied_head")
        target = ns().abstract_init(lambda: ns().models.Decoder(cfg, rngs=nnx.Rngs(0)), "data=8",
                                    ns().strategies.get("dp"))
        return ns().hf.load_safetensors(FIXTURES / "hf_tied_head", target)

    hs.api("export_files/tied_target_for_a_separate_lm_head", ("lm_head.weight", "tie"),
           tied_target)
