"""Exports to publish: a model of ``load_pretrained`` remembers its checkpoint, and
``save_safetensors`` writes its config (the source's fields, the model's sizes),
generation config and tokenizer files, in the source's dtype.

The source is ``tests/fixtures/hf_publish`` (an older-style config with bos 1, eos
``[2, 3]``, a llama3 ``rope_scaling``, ``torch_dtype: bfloat16`` and an unknown
field; a generation config; a tokenizer) (the weights of ``hf_llama``).
transformers' reading of such an export is checked by hand
(``tests/fixtures/check_hf_reads.py``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard import _safetensors_io as st
from nnx_shard._errors import NnxShardError, UsageError
from nnx_shard._low_rank import adapters
from nnx_shard.hf import _export_dir as export_dir
from nnx_shard.hf import load_pretrained, source_of
from nnx_shard.models import Decoder, DecoderConfig
from tests.conftest import needs_devices
from tests.hostile_sweep import one_shard, private_swap

pytestmark = needs_devices(8)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TOKENIZER = ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json")
RULES = ns.strategies.get("fsdp_tp").rules


def make_source(folder: Path, *, generation: bool = True) -> Path:
    folder.mkdir()
    for p in (FIXTURES / "hf_publish").iterdir():
        if generation or p.name != "generation_config.json":
            shutil.copy(p, folder / p.name)
    return folder


def load(folder: Path) -> nnx.Module:
    return load_pretrained(folder, mesh="data=4,model=2", rules=RULES)


def read(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def test_export_carries_the_sources_config_generation_config_tokenizer_and_dtype(tmp_path):
    src = make_source(tmp_path / "src")
    model = load(src)
    assert source_of(model).folder == str(src)
    assert source_of(model).tokenizer == ("tokenizer.json", "tokenizer_config.json",
                                          "chat_template.jinja")
    # Static data of the graph: through split / merge with the model, never in its state.
    graph, state = nnx.split(model)
    assert source_of(nnx.merge(graph, state)) == source_of(model)
    assert all("hf_source" not in str(k) for k, _ in nnx.to_flat_state(state))
    out = tmp_path / "out"
    ns.hf.save_safetensors(out, model)
    config, source = read(out, "config.json"), read(src, "config.json")
    assert config == source  # every field kept; the sizes are the model's, equal here
    assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == ([2, 3], 1, 0)
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["custom_field"] == {"kept": True}
    assert config["torch_dtype"] == "bfloat16" and "dtype" not in config
    assert read(out, "generation_config.json") == read(src, "generation_config.json")
    for name in TOKENIZER:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    header = st.read_header(str(out / "model.safetensors"))
    assert {t.dtype for t in header.tensors.values()} == {"BF16"}
    marker = export_dir.read_marker(out)
    assert set(marker.files) == {"model.safetensors", "config.json", "generation_config.json",
                                 *TOKENIZER}
    # The export is itself a source: loading it and saving again writes the same files.
    again = load(out)
    assert source_of(again).folder == str(out)
    ns.hf.save_safetensors(tmp_path / "out2", again)
    for name in ("config.json", "generation_config.json", *TOKENIZER, "model.safetensors"):
        assert (tmp_path / "out2" / name).read_bytes() == (out / name).read_bytes(), name
    # The bfloat16 weights are the model's, rounded.
    q = np.asarray(model.blocks[0].attn.q.get_value().astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(again.blocks[0].attn.q.get_value()), q)


def test_dtype_given_wins_and_the_tokenizer_can_be_left_out(tmp_path):
    model = load(make_source(tmp_path / "src"))
    out = tmp_path / "out"
    ns.hf.save_safetensors(out, model, dtype=jnp.float32, copy_tokenizer=False)
    assert read(out, "config.json")["torch_dtype"] == "float32"
    header = st.read_header(str(out / "model.safetensors"))
    assert {t.dtype for t in header.tensors.values()} == {"F32"}
    assert not any((out / n).exists() for n in TOKENIZER)
    assert (out / "generation_config.json").exists()


def test_generation_config_derived_from_the_configs_token_ids(tmp_path):
    model = load(make_source(tmp_path / "src", generation=False))
    assert source_of(model).generation_config is None
    ns.hf.save_safetensors(tmp_path / "out", model)
    assert read(tmp_path / "out", "generation_config.json") == {
        "_from_model_config": True, "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0}


def test_vanished_source_folder_is_named_and_nothing_is_written(tmp_path):
    src = make_source(tmp_path / "src")
    model = load(src)
    shutil.rmtree(src)
    with pytest.raises(NnxShardError, match=r"tokenizer file .*src/tokenizer.json.*folder is "
                                            r"gone.*copy_tokenizer=False"):
        ns.hf.save_safetensors(tmp_path / "out", model)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # Config and generation config were read at load time: they still come out.
    ns.hf.save_safetensors(tmp_path / "out", model, copy_tokenizer=False)
    assert read(tmp_path / "out", "config.json")["eos_token_id"] == [2, 3]


def test_source_argument_for_a_model_built_by_hand(tmp_path):
    src = make_source(tmp_path / "src")
    s = ns.strategies.get("fsdp_tp")
    model = ns.hf.load_safetensors(src, ns.abstract_init(
        lambda: Decoder(DecoderConfig.from_hf(src), rngs=nnx.Rngs(0)), "data=4,model=2", s))
    assert source_of(model) is None
    ns.hf.save_safetensors(tmp_path / "plain", model)  # no source: the model's own config only
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == [
        ".nnx_shard_safetensors", "config.json", "model.safetensors"]
    assert "eos_token_id" not in read(tmp_path / "plain", "config.json")
    ns.hf.save_safetensors(tmp_path / "out", model, source=src)
    assert read(tmp_path / "out", "config.json")["eos_token_id"] == [2, 3]
    assert (tmp_path / "out" / "tokenizer.json").exists()
    # source=False turns the remembered one off.
    tuned = load(src)
    ns.hf.save_safetensors(tmp_path / "off", tuned, source=False)
    assert not (tmp_path / "off" / "generation_config.json").exists()


def test_a_model_that_computes_otherwise_than_its_source_is_refused(tmp_path):
    src = make_source(tmp_path / "src")
    cfg = dataclasses.replace(DecoderConfig.from_hf(src), activation="gelu_pytorch_tanh")
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)),
                            "data=8", ns.strategies.get("fsdp"))
    with pytest.raises(UsageError, match=r"(?s)differs from its source .*hidden_act.*source=False"):
        ns.hf.save_safetensors(tmp_path / "out", model, source=src)
    assert not (tmp_path / "out").exists()


def test_conflicting_dtypes_in_the_source_need_dtype(tmp_path):
    src = make_source(tmp_path / "src")
    model = load(src)
    config = read(src, "config.json") | {"dtype": "float16"}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=r"names two dtypes.*torch_dtype='bfloat16'.*"
                                         r"dtype='float16'.*Fix: pass dtype="):
        ns.hf.save_safetensors(tmp_path / "out", model, source=src)
    ns.hf.save_safetensors(tmp_path / "out", model, source=src, dtype=jnp.float16)
    written = read(tmp_path / "out", "config.json")
    assert (written["torch_dtype"], written["dtype"]) == ("float16", "float16")


def test_a_new_export_replaces_the_copied_files_of_the_previous_one(tmp_path):
    model = load(make_source(tmp_path / "src"))
    out = tmp_path / "out"
    ns.hf.save_safetensors(out, model)
    (out / "README.md").write_text("the user's")
    ns.hf.save_safetensors(out, model, copy_tokenizer=False)
    # The marker proved the tokenizer files ours: they go with the previous export.
    assert sorted(p.name for p in out.iterdir()) == [
        ".nnx_shard_safetensors", "README.md", "config.json", "generation_config.json",
        "model.safetensors"]
    assert (out / "README.md").read_text() == "the user's"


def _hub_snapshot(root: Path) -> Path:
    """hf_publish laid out as huggingface_hub caches it: every file of the snapshot a
    link to ../../blobs/<hash>."""
    repo = root / "models--org--tiny"
    snap = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for p in (FIXTURES / "hf_publish").iterdir():
        shutil.copy(p, repo / "blobs" / f"hash-{p.name}")
        (snap / p.name).symlink_to(Path("..", "..", "blobs", f"hash-{p.name}"))
    return snap


def test_a_hub_cache_snapshot_is_exported_with_the_blobs_content(tmp_path):
    snap = _hub_snapshot(tmp_path / "hub")
    model = load(snap)
    out = tmp_path / "out"
    ns.hf.save_safetensors(out, model)
    for name in TOKENIZER:
        assert not (out / name).is_symlink()
        assert (out / name).read_bytes() == (FIXTURES / "hf_publish" / name).read_bytes(), name
    assert read(out, "generation_config.json") == read(snap, "generation_config.json")
    # A link inside the checkpoint folder itself is followed too.
    src = make_source(tmp_path / "src")
    (src / "tok.real").write_bytes((src / "tokenizer.json").read_bytes())
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to("tok.real")
    ns.hf.save_safetensors(tmp_path / "out2", load(src))
    assert (tmp_path / "out2" / "tokenizer.json").read_bytes() == (src / "tok.real").read_bytes()


@pytest.mark.parametrize("where", ["folder", "hub"])
def test_a_link_out_of_the_checkpoint_is_never_copied(tmp_path, where):
    secret = tmp_path / "id_ed25519"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    src = make_source(tmp_path / "src") if where == "folder" else _hub_snapshot(tmp_path / "h")
    model = load(src)
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=r"the source's tokenizer\.json \(.*\) is a symbolic "
                       rf"link to {secret}, outside .*Fix: replace the link with a copy"):
        ns.hf.save_safetensors(out, model)
    assert not out.exists()
    ns.hf.save_safetensors(out, model, copy_tokenizer=False)
    assert not (out / "tokenizer.json").exists()


def test_generation_token_ids_must_be_ids_of_the_model(tmp_path):
    src = make_source(tmp_path / "src")
    model = load(src)
    gen = read(src, "generation_config.json")
    (src / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [2, 128]}))
    with pytest.raises(UsageError, match=r"generation_config\.json gives eos_token_id \[2, 128\]"
                       r", and 128 in it, not a token id of the model \(its vocabulary: 0\.\.127\)"):
        ns.hf.save_safetensors(tmp_path / "out", model, source=src)
    (src / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": 127}))
    ns.hf.save_safetensors(tmp_path / "out", model, source=src)
    assert read(tmp_path / "out", "generation_config.json")["eos_token_id"] == 127


# -- files swapped for links while they are read -------------------------------------------

def _swap_on_open(monkeypatch, name: str, swap) -> list[str]:
    """Calls ``swap()`` once, right before the first open of a file called ``name`` (by
    ``open`` or ``os.open``), whatever was checked about it before: a deterministic
    form of another process replacing the file between a check and the open."""
    import builtins
    import os

    done: list[str] = []

    def wrap(real):
        def opener(file, *args, **kwargs):
            if not done and isinstance(file, str | os.PathLike) and \
                    os.path.basename(os.fspath(file)) == name:
                done.append(os.fspath(file))
                swap()
            return real(file, *args, **kwargs)
        return opener

    monkeypatch.setattr(builtins, "open", wrap(builtins.open))
    monkeypatch.setattr(os, "open", wrap(os.open))
    return done


@pytest.mark.parametrize("how", ["file", "folder"])
def test_a_tokenizer_file_swapped_for_a_link_after_its_check_is_never_followed(
        tmp_path, monkeypatch, how):
    src = make_source(tmp_path / "src")
    model = load(src)
    out = tmp_path / "out"
    opened = _swap_on_open(monkeypatch, "tokenizer.json", private_swap(src, "tokenizer.json",
                                                                        how))
    with pytest.raises(UsageError, match=r"the source's tokenizer\.json \(.*\) (is a symbolic "
                       r"link to|leads to) .*private.*, outside .*Nothing was written"):
        ns.hf.save_safetensors(out, model)
    monkeypatch.undo()
    assert opened, "the swap never ran: the test proves nothing"
    assert not out.exists()


@pytest.mark.parametrize("how", ["file", "folder"])
def test_a_tokenizer_folder_file_swapped_for_a_link_is_never_read(tmp_path, monkeypatch, how):
    from nnx_shard.inference import Tokenizer

    src = make_source(tmp_path / "src")
    opened = _swap_on_open(monkeypatch, "chat_template.jinja",
                           private_swap(src, "chat_template.jinja", how))
    with pytest.raises(UsageError, match=r"chat_template\.jinja: is a link to .*private.*"
                       r"outside the tokenizer's folder"):
        Tokenizer.from_pretrained(src)
    monkeypatch.undo()
    assert opened


def test_a_tokenizer_file_replaced_by_a_fifo_is_named_without_waiting(tmp_path):
    import os

    src = make_source(tmp_path / "src")
    model = load(src)
    (src / "tokenizer.json").unlink()
    os.mkfifo(src / "tokenizer.json")
    with pytest.raises(NnxShardError, match=r"cannot copy the tokenizer file .*tokenizer\.json"
                       r".*: a FIFO, not a regular file\. Nothing was written"):
        ns.hf.save_safetensors(tmp_path / "out", model)
    assert not (tmp_path / "out").exists()


# -- files of a checkpoint or adapter folder swapped while they load ------------------------

@pytest.mark.parametrize("how", ["file", "folder"])
@pytest.mark.parametrize("name", ["config.json", "generation_config.json",
                                  "model.safetensors.index.json"])
def test_a_checkpoint_file_swapped_for_a_link_while_it_loads_is_never_read(
        tmp_path, monkeypatch, name, how):
    src = make_source(tmp_path / "src")
    if name == "model.safetensors.index.json":
        one_shard(src)
    opened = _swap_on_open(monkeypatch, name, private_swap(src, name, how))
    with pytest.raises(UsageError) as e:
        if name == "config.json":  # DecoderConfig.from_hf reads it as load_pretrained does
            DecoderConfig.from_hf(src)
        else:
            load(src)
    monkeypatch.undo()
    assert opened, "the swap never ran: the test proves nothing"
    text = str(e.value)
    assert re.search(rf"{re.escape(name)}:? leads to \S*private\S*, outside the checkpoint "
                     rf"folder {re.escape(str(src))}", text), text
    assert "Fix: put a copy of the" in text and "PRIVATE" not in text


def test_a_checkpoint_config_linked_inside_its_hub_cache_repository_loads(tmp_path):
    snap = _hub_snapshot(tmp_path / "hub")
    assert DecoderConfig.from_hf(snap) == DecoderConfig.from_hf(FIXTURES / "hf_publish")
    # A config.json named itself may be a link anywhere: the name given is what is read.
    (tmp_path / "named.json").symlink_to(snap / "config.json")
    assert DecoderConfig.from_hf(tmp_path / "named.json") == DecoderConfig.from_hf(snap)


def _weights(model: nnx.Module) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_a_shard_replaced_after_its_header_is_read_loads_the_file_that_was_opened(
        tmp_path, monkeypatch):
    import os

    src = one_shard(make_source(tmp_path / "src"))
    shard = src / "model-00001-of-00001.safetensors"
    # Another checkpoint's bytes under the same header: what reads by path after the
    # header would load without a word.
    raw = shard.read_bytes()
    start = min(t.offset for t in st.read_header(str(shard)).tensors.values())
    private = tmp_path / "private.safetensors"
    private.write_bytes(raw[:start] + b"\x3f" * (len(raw) - start))
    check_layout = st._check_layout
    swapped: list[str] = []

    def swap_after_the_header(path, *args):
        check_layout(path, *args)
        if not swapped and os.path.basename(path) == shard.name:
            swapped.append(path)
            shard.unlink()
            shard.symlink_to(private)

    monkeypatch.setattr(st, "_check_layout", swap_after_the_header)
    model = load(src)
    monkeypatch.undo()
    assert swapped, "the swap never ran: the test proves nothing"
    want = _weights(load(make_source(tmp_path / "clean")))
    got = _weights(model)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_shard_swapped_for_a_fifo_before_it_opens_is_named_without_waiting(
        tmp_path, monkeypatch):
    import os

    src = make_source(tmp_path / "src")

    def fifo() -> None:
        (src / "model.safetensors").unlink()
        os.mkfifo(src / "model.safetensors")

    opened = _swap_on_open(monkeypatch, "model.safetensors", fifo)
    with pytest.raises(UsageError, match=r"load_safetensors: .*model\.safetensors is a FIFO, "
                       r"not a file\. Fix: download the checkpoint's files again"):
        load(src)
    monkeypatch.undo()
    assert opened


PEFT = FIXTURES / "peft_llama"


@pytest.mark.parametrize("how", ["file", "folder"])
@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_an_adapter_file_swapped_for_a_link_while_it_loads_is_never_read(
        tmp_path, monkeypatch, name, how):
    folder = tmp_path / "adapter"
    shutil.copytree(PEFT, folder)
    base = load(make_source(tmp_path / "base"))  # hf_llama's weights, the adapter's base
    opened = _swap_on_open(monkeypatch, name, private_swap(folder, name, how))
    with pytest.raises(UsageError) as e:
        ns.hf.load_lora(folder, base)
    monkeypatch.undo()
    assert opened, "the swap never ran: the test proves nothing"
    text = str(e.value)
    assert re.search(rf"load_lora: {re.escape(str(folder))}: {re.escape(name)} leads to "
                     rf"\S*private\S*, outside the adapter folder {re.escape(str(folder))}",
                     text), text
    assert "Fix: put a copy of the file in the folder" in text and "PRIVATE" not in text
    assert not adapters(base)  # refused before a single adapter was added


# -- the tokenizer of a resized model ------------------------------------------------------

ADDED = ["<tool_call>", "</tool_call>", "<think>"]


def _grown(src: Path):
    from nnx_shard.inference import Tokenizer

    # Replicated: 131 rows divide over no mesh axis.
    model = load_pretrained(src, mesh="data=8", rules=ns.strategies.get("dp").rules)
    tok = Tokenizer.from_pretrained(src)
    assert tok.backend.add_tokens(ADDED) == 3 and tok.vocab_size == 131
    ns.models.resize_token_embeddings(model, tok.vocab_size)
    return model, tok


def test_a_resized_model_exports_the_tokenizer_it_is_given(tmp_path):
    from nnx_shard.inference import Tokenizer

    src = make_source(tmp_path / "src")
    model, tok = _grown(src)
    out = tmp_path / "out"
    ns.hf.save_safetensors(out, model, tokenizer=tok)
    assert read(out, "config.json")["vocab_size"] == 131
    back = Tokenizer.from_pretrained(out)
    assert back.vocab_size == 131
    assert back.encode("<think>", add_special_tokens=False) == [130]
    assert back.encode("hello <tool_call>", add_special_tokens=False) == \
        tok.encode("hello <tool_call>", add_special_tokens=False)
    # What the source's files said is kept: special tokens, chat template.
    assert read(out, "tokenizer_config.json") == read(src, "tokenizer_config.json")
    assert (out / "chat_template.jinja").read_bytes() == (src / "chat_template.jinja").read_bytes()
    assert back.eos_token == tok.eos_token == "</s>"
    # The same with no source: the model's config and the tokenizer's files.
    ns.hf.save_safetensors(tmp_path / "bare", model, source=False, tokenizer=tok)
    assert Tokenizer.from_pretrained(tmp_path / "bare").vocab_size == 131
    assert read(tmp_path / "bare", "config.json")["vocab_size"] == 131


def test_the_sources_tokenizer_goes_with_a_model_resized_only_where_it_fits(tmp_path):
    src = make_source(tmp_path / "src")
    model, tok = _grown(src)
    # A vocabulary padded past the tokenizer is normal once the tokenizer is given.
    ns.models.resize_token_embeddings(model, 131, pad_to_multiple_of=8)
    assert model.cfg.vocab == 136
    ns.hf.save_safetensors(tmp_path / "padded", model, tokenizer=tok)
    assert read(tmp_path / "padded", "config.json")["vocab_size"] == 136
    # A source whose tokenizer already had the tokens the model grew into is copied.
    (src / "tokenizer.json").write_text(tok.backend.to_str())
    ns.hf.save_safetensors(tmp_path / "copied", model)
    assert (tmp_path / "copied" / "tokenizer.json").read_text() == tok.backend.to_str()
    # An unresized model with a tokenizer of more ids than its vocabulary: refused.
    with pytest.raises(UsageError, match=r"tokenizer has 131 ids .*more than the model's "
                       r"vocabulary of 128.*resize_token_embeddings"):
        ns.hf.save_safetensors(tmp_path / "small", load(make_source(tmp_path / "s2")),
                               tokenizer=tok)
    assert not (tmp_path / "small").exists()
