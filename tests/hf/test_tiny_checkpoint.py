"""ns.hf.tiny_checkpoint: a checkpoint of every registered family that load_pretrained reads
back (config, shapes, a forward), the tokenizer that Tokenizer reads with its chat template,
the refusals, and the ``nnx-shard tiny-checkpoint`` command.

(transformers reads them too: ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``
of each family, checked by hand; the suite does not import transformers.)
"""

from __future__ import annotations

import json
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard.cli import main
from nnx_shard.inference import Tokenizer
from nnx_shard.models import Llama
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
    assert cfg.experts == (4 if family_of(family).moe else 0)
    assert model.token_embed.get_value().shape == (128, 32)
    logits = model(jnp.array([[1, 5, 9, 3]]))
    assert logits.shape == (1, 4, 128)
    assert bool(jnp.isfinite(logits).all())


def test_the_seed_decides_the_weights(tmp_path):
    folder = ns.hf.tiny_checkpoint(tmp_path / "a", tokenizer=False, seed=3, layers=3)
    model = ns.hf.load_pretrained(folder, mesh="data=-1", rules=ns.strategies.get("dp").rules)
    assert model.cfg.layers == 3
    again = Llama(model.cfg, rngs=nnx.Rngs(3))
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
