"""Hostile cases of what ``save_safetensors`` and ``Tokenizer.from_pretrained`` read and
write: a source's tokenizer file (or the source folder itself) swapped for a link to a
private file between its check and its open, or replaced by a FIFO; the files a load
reads from its checkpoint or adapter folder (``config.json``, ``generation_config.json``,
the index, a weight shard, ``adapter_config.json``, ``adapter_model.safetensors``)
swapped the same way while ``load_pretrained``, ``DecoderConfig.from_hf`` or ``load_lora``
reads them; a model resized
away from its source's vocabulary while the source's tokenizer would be copied beside
it; a ``tokenizer=`` that is not a Tokenizer, has more ids than the model, or comes with
``copy_tokenizer=False``; a model with LoRA adapters (or a QLoRA base), and variables
that hold no array, for ``save_safetensors`` and ``save_lora``.

Every case must leave the destination as it was: an export or a staging folder left
behind makes the case ``raw`` (an AssertionError of this file), whatever the error said,
and so does a private file's content read anywhere.
"""

from __future__ import annotations

import builtins
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ADDED = ["<tool_call>", "</tool_call>", "<think>"]


def build(hs: Any) -> None:
    F = hs.F

    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    load = hs.load_dp

    def source(label: str) -> Path:
        """A fresh copy of the hf_publish checkpoint (a tokenizer of 128 ids)."""
        shutil.rmtree(F.path(f"r6export_{label}"), ignore_errors=True)
        return hs.hf_publish_copy(Path(F.path(f"r6export_{label}")) / "src")

    def save_nothing(label: str, model: Any, **kw: Any) -> Any:
        """Saves to a fresh destination that must stay absent, with nothing beside it."""
        return hs.save_nothing(F.dir(f"r6export_{label}_parent"), model, **kw)

    # -- files swapped for links between their check and their open -------------------------

    def swapping(folder: Path, name: str, how: str, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` while the first open of a file called ``name`` first replaces it
        (``how="file"``) or ``folder`` (``"folder"``) by a link to private files."""
        swap = hs.private_swap(folder, name, how)
        swapped: list[str] = []

        def wrap(real: Any) -> Any:
            def opener(file: Any, *args: Any, **kwargs: Any) -> Any:
                if not swapped and isinstance(file, str | os.PathLike) and \
                        os.path.basename(os.fspath(file)) == name:
                    swapped.append(name)
                    swap()
                return real(file, *args, **kwargs)
            return opener

        real_open, real_os_open = builtins.open, os.open
        builtins.open, os.open = wrap(real_open), wrap(real_os_open)  # type: ignore[assignment]
        try:
            result = fn()
        except Exception as e:
            if "PRIVATE KEY" in str(e):
                raise AssertionError("a private file's content is in the error: it was read "
                                     "through the swapped link") from e
            raise
        finally:
            builtins.open, os.open = real_open, real_os_open  # type: ignore[assignment]
        if not swapped:
            raise AssertionError(f"{name} was never opened: the case proves nothing")
        if "PRIVATE KEY" in repr(result):
            raise AssertionError("a private file's content was read through the swapped link")
        return result

    def export_swapped(label: str, how: str) -> Any:
        folder = source(label)
        model = load(folder)
        return swapping(folder, "tokenizer.json", how, lambda: save_nothing(label, model))

    hs.api("r6export/tokenizer_swapped_for_a_link_after_its_check", "tokenizer.json",
           lambda: export_swapped("swap_file", "file"))
    hs.api("r6export/source_folder_swapped_for_a_link_after_its_check", "tokenizer.json",
           lambda: export_swapped("swap_folder", "folder"))

    def tokenizer_swapped(label: str, how: str) -> Any:
        folder = source(label)
        return swapping(folder, "chat_template.jinja", how, lambda: ns().inference.Tokenizer
                        .from_pretrained(folder).chat_template)

    hs.api("r6export/chat_template_swapped_for_a_link_while_a_tokenizer_loads",
           "chat_template.jinja", lambda: tokenizer_swapped("tok_swap_file", "file"))
    hs.api("r6export/tokenizer_folder_swapped_for_a_link_while_it_loads",
           "chat_template.jinja", lambda: tokenizer_swapped("tok_swap_folder", "folder"))

    def fifo_in_place(label: str, name: str, export: bool) -> Any:
        folder = source(label)
        model = load(folder) if export else None
        (folder / name).unlink()
        os.mkfifo(folder / name)
        if export:
            return save_nothing(label, model)
        return ns().inference.Tokenizer.from_pretrained(folder)

    hs.api("r6export/tokenizer_replaced_by_a_fifo_after_loading", ("tokenizer.json", "FIFO"),
           lambda: fifo_in_place("fifo_export", "tokenizer.json", True))
    hs.api("r6export/tokenizer_folder_chat_template_a_fifo", ("chat_template.jinja", "FIFO"),
           lambda: fifo_in_place("fifo_tok", "chat_template.jinja", False))

    # -- a checkpoint's or an adapter's files swapped while they load ---------------------

    def config_swapped(label: str, how: str) -> Any:
        folder = source(label)
        return swapping(folder, "config.json", how,
                        lambda: ns().models.DecoderConfig.from_hf(folder))

    def load_swapped(label: str, name: str, how: str = "file") -> Any:
        folder = source(label)
        if name.endswith(".index.json"):
            hs.one_shard(folder)
        return swapping(folder, name, how, lambda: load(folder))

    index = "model.safetensors.index.json"
    for case, name, fn in [
        ("config_json_swapped_for_a_link_while_it_loads", "config.json",
         lambda: config_swapped("cfg_swap_file", "file")),
        ("checkpoint_folder_swapped_for_a_link_while_its_config_loads", "config.json",
         lambda: config_swapped("cfg_swap_folder", "folder")),
        ("generation_config_swapped_for_a_link_while_it_loads", "generation_config.json",
         lambda: load_swapped("gen_swap", "generation_config.json")),
        ("index_swapped_for_a_link_while_it_loads", index,
         lambda: load_swapped("index_swap", index)),
        ("checkpoint_folder_swapped_for_a_link_while_its_index_loads", index,
         lambda: load_swapped("index_swap_folder", index, "folder")),
    ]:
        hs.api(f"r6export/{case}", (name, "outside the checkpoint folder"), fn)

    def shard_fifo() -> Any:
        folder = source("shard_fifo")
        done: list[str] = []
        real_os_open = os.open

        def opener(file: Any, *args: Any, **kwargs: Any) -> Any:
            if not done and isinstance(file, str | os.PathLike) and \
                    os.path.basename(os.fspath(file)) == "model.safetensors":
                done.append("model.safetensors")
                (folder / "model.safetensors").unlink()
                os.mkfifo(folder / "model.safetensors")
            return real_os_open(file, *args, **kwargs)

        os.open = opener  # type: ignore[assignment]
        try:
            return load(folder)
        finally:
            os.open = real_os_open  # type: ignore[assignment]
            if not done:
                raise AssertionError("model.safetensors was never opened: the case proves "
                                     "nothing")

    hs.api("r6export/shard_swapped_for_a_fifo_before_it_opens", ("model.safetensors", "FIFO"),
           shard_fifo)

    def adapter_swapped(label: str, name: str, how: str) -> Any:
        base = load(source(label))  # hf_llama's weights: the adapter's base
        folder = Path(F.path(f"r6export_{label}")) / "adapter"
        shutil.copytree(FIXTURES / "peft_llama", folder)
        return swapping(folder, name, how, lambda: ns().hf.load_lora(folder, base))

    hs.api("r6export/adapter_config_swapped_for_a_link_while_it_loads",
           ("adapter_config.json", "outside the adapter folder"),
           lambda: adapter_swapped("adapter_cfg_swap", "adapter_config.json", "file"))
    hs.api("r6export/adapter_weights_swapped_for_a_link_while_they_load",
           ("adapter_model.safetensors", "outside the adapter folder"),
           lambda: adapter_swapped("adapter_w_swap", "adapter_model.safetensors", "file"))
    hs.api("r6export/adapter_folder_swapped_for_a_link_while_its_weights_load",
           ("adapter_model.safetensors", "outside the adapter folder"),
           lambda: adapter_swapped("adapter_dir_swap", "adapter_model.safetensors", "folder"))

    # -- the tokenizer of a resized model ----------------------------------------------------

    def resized(label: str, new: int, pad: int | None = None, **kw: Any) -> Any:
        model = load(source(label))
        # New rows drawn plainly: the refusal reads the vocabulary, never the rows, and
        # the mean-and-covariance draw compiles for a second per size.
        ns().models.resize_token_embeddings(model, new, pad_to_multiple_of=pad,
                                            mean_resizing=False)
        return save_nothing(label, model, **kw)

    hs.api("r6export/resized_for_added_tokens_with_the_sources_tokenizer",
           ("tokenizer=", "vocab_size 128", "131"), lambda: resized("grown", 131))
    hs.api("r6export/resized_and_padded_with_the_sources_tokenizer",
           ("tokenizer=", "vocab_size 128", "136"), lambda: resized("padded", 131, 8))
    hs.api("r6export/shrunk_below_the_sources_tokenizer", ("tokenizer", "100", "128 ids"),
           lambda: resized("shrunk", 100))

    def grown_tokenizer(folder: Path) -> Any:
        tok = ns().inference.Tokenizer.from_pretrained(folder)
        tok.backend.add_tokens(ADDED)
        return tok

    def tokenizer_too_large() -> Any:
        folder = source("tok_large")
        return save_nothing("tok_large", load(folder), tokenizer=grown_tokenizer(folder))

    hs.api("r6export/tokenizer_with_more_ids_than_the_model", ("tokenizer", "131", "128"),
           tokenizer_too_large)
    for label, value in (("str", "tokenizer.json"), ("folder", "FOLDER"), ("int", 3)):
        def wrong(label: str = label, value: Any = value) -> Any:
            folder = source(f"tok_{label}")
            given = str(folder) if value == "FOLDER" else value
            return save_nothing(f"tok_{label}", load(folder), tokenizer=given)

        hs.api(f"r6export/tokenizer_given_as_a_{label}", ("tokenizer", "Tokenizer"), wrong)

    def tokenizer_without_copy() -> Any:
        folder = source("tok_nocopy")
        return save_nothing("tok_nocopy", load(folder), copy_tokenizer=False,
                            tokenizer=ns().inference.Tokenizer.from_pretrained(folder))

    hs.api("r6export/tokenizer_with_copy_tokenizer_false", ("tokenizer=", "copy_tokenizer"),
           tokenizer_without_copy)

    # -- adapters and values that are not arrays --------------------------------------------

    def adapted(quantize: str | None) -> Any:
        model = hs._tiny_llama()
        if quantize is None:
            return ns().lora(model, 4, 8.0)
        return ns().lora(model, 4, 8.0, quantize=quantize, quant_block=32)

    hs.api("r6export/lora_model", ("merge_lora", "save_lora"),
           lambda: save_nothing("lora", adapted(None)))
    hs.api("r6export/qlora_int4_model", ("merge_lora", "save_lora", "quantized"),
           lambda: save_nothing("qlora", adapted("int4")))
    hs.api("r6export/qlora_nf4_model", ("merge_lora", "save_lora", "quantized"),
           lambda: save_nothing("qlora_nf4", adapted("nf4")))

    def listed(save_lora: bool) -> Any:
        model = adapted(None) if save_lora else hs._tiny_llama()
        model.blocks[0].attn.k.set_value([[0.0] * 4] * 32)
        if save_lora:
            out = Path(F.path("r6export_lora_list"))
            try:
                return ns().hf.save_lora(out, model)
            finally:
                if out.exists():
                    raise AssertionError(f"{out}: an adapter was written")
        return save_nothing("param_list", model)

    hs.api("r6export/parameter_holding_a_list", ("blocks/0/attn/k", "not an array"),
           lambda: listed(False))
    hs.api("r6export/save_lora_parameter_holding_a_list", ("blocks/0/attn/k", "not an array"),
           lambda: listed(True))
