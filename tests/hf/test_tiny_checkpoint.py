"""ns.hf.tiny_checkpoint: a checkpoint of every registered family that load_pretrained reads
back (config, shapes, a forward), the tokenizer that Tokenizer reads with its chat template,
the refusals, and the ``nnx-shard tiny-checkpoint`` command.

(transformers reads them too: ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``
of each family, checked by hand; the suite does not import transformers.)
"""

from __future__ import annotations

import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard.cli import main
from nnx_shard.hf import _tiny
from nnx_shard.inference import Tokenizer
from nnx_shard.models import Decoder
from nnx_shard.models._families import family_of, model_types

FAMILIES = ["llama", "qwen3", "qwen2", "mistral", "gemma", "olmo2", "gemma2", "gemma3_text",
            "phi3", "mixtral", "qwen3_moe"]


def test_every_registered_family_is_covered():
    assert set(model_types()) >= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_loads_back_and_runs(family, tmp_path):
    folder = ns.hf.tiny_checkpoint(tmp_path / family, family, tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == family
    assert config["architectures"] == list(family_of(family).architectures)
    model = ns.hf.load_pretrained(folder, mesh="data=-1", rules=ns.strategies.get("fsdp").rules)
    cfg = model.cfg
    assert (cfg.model_type, cfg.vocab, cfg.embed, cfg.layers, cfg.heads, cfg.kv_heads) == (
        family, 128, 32, 2, 4, 2)
    moe = family_of(family).moe_block is not None
    assert any(cfg.moe_layers()) == moe
    assert not moe or cfg.experts == 4
    assert model.token_embed.get_value().shape == (128, 32)
    logits = nnx.jit(lambda m, t: m(t))(model, jnp.array([[1, 5, 9, 3]]))  # one program
    assert logits.shape == (1, 4, 128)
    assert bool(jnp.isfinite(logits).all())


def test_the_seed_decides_the_weights(tmp_path):
    folder = ns.hf.tiny_checkpoint(tmp_path / "a", tokenizer=False, seed=3, layers=3)
    model = ns.hf.load_pretrained(folder, mesh="data=-1", rules=ns.strategies.get("dp").rules)
    assert model.cfg.layers == 3
    again = Decoder(model.cfg, rngs=nnx.Rngs(3))
    other = ns.hf.tiny_checkpoint(tmp_path / "b", tokenizer=False, seed=4)
    assert np.array_equal(model.token_embed.get_value(), again.token_embed.get_value())
    assert (other / "model.safetensors").read_bytes() != (folder / "model.safetensors").read_bytes()


def test_the_tokenizer_reads_and_applies_its_chat_template(tmp_path):
    folder = ns.hf.tiny_checkpoint(tmp_path, "qwen3")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    tok = Tokenizer.from_pretrained(folder)
    assert tok.vocab_size == 384 and tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == json.loads((folder / "config.json").read_text())["eos_token_id"]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # Every byte encodes (the byte alphabet is in the vocabulary).
    assert tok.decode(tok.encode("zebra ~ ü")) == "zebra ~ ü"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
        add_generation_prompt=False, return_dict=True, return_assistant_tokens_mask=True)
    marked = [i for i, m in zip(chat["input_ids"], chat["assistant_masks"], strict=True) if m]
    assert tok.decode(marked, skip_special_tokens=False) == "Yo<|im_end|>"
    # A second export into the folder replaces the first.
    ns.hf.tiny_checkpoint(folder, "llama", seed=1)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"


def test_refusals_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ns.UsageError, match=r"unknown family 'gpt2' \(known: gemma, .*llama, "):
        ns.hf.tiny_checkpoint(tmp_path, "gpt2")
    with pytest.raises(ns.UsageError, match="smaller than the tokenizer's 384 ids"):
        ns.hf.tiny_checkpoint(tmp_path, vocab=100)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ns.UsageError, match=r"pip install 'nnx_shard\[text\]'"):
        ns.hf.tiny_checkpoint(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_the_command_writes_one(tmp_path, capsys):
    assert main(["tiny-checkpoint", str(tmp_path / "m"), "--family", "mistral",
                 "--no-tokenizer", "--layers", "1"]) == 0
    assert "tiny mistral checkpoint" in capsys.readouterr().out
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"]) == ("mistral", 1)
    assert main(["tiny-checkpoint", str(tmp_path / "x"), "--family", "gpt2"]) == 2
    assert "llama, mistral" in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"seed": True}, ["seed must be a non-negative int", "True (a bool)"]),
    ({"seed": 1.5}, ["seed must be", "1.5 (float)"]),
    ({"seed": "0"}, ["seed must be", "'0' (str)"]),
    ({"seed": None}, ["seed must be", "None"]),
    ({"seed": -1}, ["seed must be a non-negative int", "-1"]),
    ({"seed": 2**70}, ["seed must be at most 2**63-1", str(2**70)]),
    ({"tokenizer": "no"}, ["tokenizer must be True or False", "'no' (str)"]),
    ({"tokenizer": 1}, ["tokenizer must be True or False"]),
    ({"model_type": "qwen3"}, ["model_type='qwen3' names another family than family='llama'",
                               "Fix: family='qwen3'"]),
    ({"param_dtype": "int8"}, ["param_dtype='int8' is not a float dtype", "float32, bfloat16"]),
    ({"dtype": "float64"}, ["dtype='float64' is not a float dtype"]),
    ({"layers": True}, ["layers must be a positive int", "True (a bool)"]),
    ({"layers": 1_000_000}, ["layers=1000000 would build a model of 9,280,024,608 parameters",
                             "more than the 100,000,000", "smaller layers",
                             "the tiny llama has 43,168"]),
    ({"vocab": 10**7, "embed": 64}, ["vocab=10000000, embed=64 would build",
                                     "smaller vocab and embed"]),
    ({"embed": 0}, ["tiny_checkpoint: DecoderConfig.embed must be >= 1"]),
])
def test_arguments_are_checked_before_anything_is_built(tmp_path, monkeypatch, kwargs, words):
    def no_build(*args, **kw):
        raise AssertionError("a model was built")

    monkeypatch.setattr(_tiny, "Decoder", no_build)
    with pytest.raises(ns.UsageError, match="^tiny_checkpoint: ") as err:
        ns.hf.tiny_checkpoint(tmp_path / "out", "llama", **kwargs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    assert not (tmp_path / "out").exists()


def test_the_model_type_may_repeat_the_family_and_the_layers_follow_it(tmp_path):
    folder = ns.hf.tiny_checkpoint(tmp_path / "l", "llama", tokenizer=False, model_type="llama")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    # Gemma 2's sliding layers come from its layer count: every other one, from the first.
    folder = ns.hf.tiny_checkpoint(tmp_path / "g", "gemma2", tokenizer=False, layers=3)
    model = ns.hf.load_pretrained(folder, mesh="data=-1", rules=ns.strategies.get("dp").rules)
    assert model.cfg.layers == 3 and model.cfg.window_layers == (True, False, True)
    # A trillion layers are counted, not laid out one flag each.
    with pytest.raises(ns.UsageError, match=r"layers=1000000000000 would build a model of "
                                            r"9,344,000,000,004,128 parameters"):
        ns.hf.tiny_checkpoint(tmp_path / "big", "gemma2", tokenizer=False, layers=10**12)


def test_paths_it_cannot_write_are_refused_naming_them(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for path, words in [(afile, "is a file, not a folder"),
                        (afile / "sub", "which is a file, not a folder"),
                        ("a\0b", "holds a NUL character")]:
        with pytest.raises(ns.UsageError, match="^tiny_checkpoint: path ") as err:
            ns.hf.tiny_checkpoint(path, tokenizer=False)
        assert words in str(err.value)
    monkeypatch.chdir(tmp_path)
    for path, words in [(".", "is the working directory"),
                        (os.path.dirname(tmp_path), "is above the working directory")]:
        with pytest.raises(ns.UsageError, match="^tiny_checkpoint: path ") as err:
            ns.hf.tiny_checkpoint(path, tokenizer=False)
        assert words in str(err.value) and "Fix: a new folder" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_tokenizer_that_cannot_be_written_names_the_path(tmp_path, monkeypatch):
    real = _tiny._tokenizer

    class Full:
        """The tokenizer, its save failing as tokenizers' does on a full disk."""

        def __init__(self) -> None:
            self.tok = real()

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def save(self, path):
            raise Exception("File too large (os error 27)")

    def no_build(*args, **kw):
        raise AssertionError("the model was built before the tokenizer's files were written")

    monkeypatch.setattr(_tiny, "_tokenizer", Full)
    monkeypatch.setattr(_tiny, "Decoder", no_build)
    with pytest.raises(OSError, match="could not write the tokenizer files for path ") as err:
        ns.hf.tiny_checkpoint(tmp_path / "out")
    assert isinstance(err.value, ns.NnxShardError)
    assert "File too large (os error 27)" in str(err.value)
    assert str(tmp_path / "out") in str(err.value) and "Fix: free space" in str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("argv", "words"), [
    (["."], ["PATH '.'", "is the working directory"]),
    (["afile/sub"], ["PATH 'afile/sub' is under", "which is a file"]),
    (["out", "--seed", str(2**70)], ["--seed must be at most 2**63-1"]),
    (["out", "--seed", "-3"], ["--seed must be a non-negative int"]),
    (["out", "--layers", "1000000"], ["--layers 1000000 would build a model of",
                                      "Fix: smaller --layers"]),
    (["out", "--layers", "0"], ["--layers must be a positive int"]),
    (["out", "--family", "gpt2"], ["unknown --family 'gpt2'"]),
    (["out", "--layers", "9" * 5000], ["argument --layers: invalid int value: '999",
                                       "...' (5,000 characters)"]),
])
def test_the_command_refuses_in_one_line_naming_the_flag(tmp_path, monkeypatch, capsys, argv,
                                                         words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert main(["tiny-checkpoint", *argv, "--no-tokenizer"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("nnx-shard: error: ") and len(err) < 400
    for w in words:
        assert w in err, (w, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_the_command_reports_a_write_that_fails_in_one_line(tmp_path, monkeypatch, capsys):
    from nnx_shard.hf._export_dir import ExportError

    def failing(*args, **kwargs):
        raise ExportError("save_safetensors: could not write the export to x: File too large")

    monkeypatch.setattr(_tiny, "save_safetensors", failing)
    assert main(["tiny-checkpoint", str(tmp_path / "m"), "--no-tokenizer"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"nnx-shard: error: PATH {str(tmp_path / 'm')!r}: save_safetensors: could "
                   "not write the export to x: File too large")
