"""Which tensors a checkpoint folder gives, as transformers reads it: a separate
``lm_head.weight`` beside ``tie_word_embeddings: true`` is the model's head, and
``model.safetensors`` is read before an index beside it; each file of the folder is
opened once.

The fixture ``tests/fixtures/hf_tied_head`` (``make_hf_tied_head.py``) holds both
cases at once, with transformers' logits.
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import nnx_shard as ns
from nnx_shard import _safetensors_io as st
from nnx_shard import hf
from nnx_shard._errors import UsageError
from nnx_shard.hf import _files as files
from nnx_shard.models import Decoder, DecoderConfig
from tests._close import assert_close
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TIED_HEAD = FIXTURES / "hf_tied_head"
RULES = ns.strategies.get("dp").rules


def _logits(model: Decoder, tokens: np.ndarray) -> np.ndarray:
    mesh = next(iter(jax.tree.leaves(nnx.state(model)))).sharding.mesh
    host = np.tile(tokens, (8 // tokens.shape[0], 1))
    with ns.use(mesh, RULES):
        out = nnx.jit(lambda m, t: m(t))(model, host)
    return np.asarray(out)[:tokens.shape[0]]


def test_a_separate_head_is_kept_like_transformers() -> None:
    expected = dict(np.load(TIED_HEAD / "expected.npz"))
    model = hf.load_pretrained(TIED_HEAD, mesh="data=8", rules=RULES)
    assert json.loads((TIED_HEAD / "config.json").read_text())["tie_word_embeddings"] is True
    assert model.cfg.tie_embeddings is False
    weights = load_file(TIED_HEAD / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(model.unembed.get_value()).T,
                                  weights["lm_head.weight"])
    # model.safetensors' embedding, not the one of the sharded copy beside it.
    np.testing.assert_array_equal(np.asarray(model.token_embed.get_value()),
                                  weights["model.embed_tokens.weight"])
    logits = _logits(model, expected["tokens"])
    assert_close(logits, expected["logits"], 1e-5, "hf_tied_head logits")
    assert float(expected["logits"].std()) > 5


def test_a_tied_target_has_no_place_for_a_separate_head() -> None:
    cfg = DecoderConfig.from_hf(TIED_HEAD)
    assert cfg.tie_embeddings
    target = ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), "data=8", RULES)
    with pytest.raises(UsageError, match=r"holds lm_head\.weight apart from its embedding.*"
                       r"Fix: build the target untied.*tie_embeddings=False"):
        hf.load_safetensors(TIED_HEAD, target)
    # Untied by hand, the target loads (config.json's tie flag yields to the file).
    untied = dataclasses.replace(cfg, tie_embeddings=False)
    model = hf.load_safetensors(TIED_HEAD, ns.abstract_init(
        lambda: Decoder(untied, rngs=nnx.Rngs(0)), "data=8", RULES))
    expected = dict(np.load(TIED_HEAD / "expected.npz"))
    assert_close(_logits(model, expected["tokens"]), expected["logits"], 1e-5, "untied by hand")


def test_a_head_equal_to_the_embedding_stays_tied(tmp_path: Path) -> None:
    folder = tmp_path / "same"
    shutil.copytree(FIXTURES / "hf_llama_tied", folder)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].copy()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    model = hf.load_pretrained(folder, mesh="data=8", rules=RULES)
    assert model.cfg.tie_embeddings is True


def test_the_export_of_a_separate_head_loads_back_untied(tmp_path: Path) -> None:
    model = hf.load_pretrained(TIED_HEAD, mesh="data=8", rules=RULES)
    out = tmp_path / "out"
    ns.hf.save_safetensors(out, model)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert "lm_head.weight" in load_file(out / "model.safetensors")
    assert not (out / "model.safetensors.index.json").exists()
    expected = dict(np.load(TIED_HEAD / "expected.npz"))
    again = hf.load_pretrained(out, mesh="data=8", rules=RULES)
    assert_close(_logits(again, expected["tokens"]), expected["logits"], 1e-5, "export")


def test_model_safetensors_is_read_before_an_index(tmp_path: Path) -> None:
    folder = tmp_path / "both"
    shutil.copytree(FIXTURES / "hf_llama", folder)
    # An index of shards that are not there: never read while model.safetensors is.
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    assert files.checkpoint_files(folder) == [str(folder / "model.safetensors")]
    model = hf.load_pretrained(folder, mesh="data=8", rules=RULES)
    weights = load_file(folder / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(model.final_norm.scale.get_value()),
                                  weights["model.norm.weight"])
    # Without model.safetensors, the index is what is read (and its shards must be there).
    (folder / "model.safetensors").unlink()
    with pytest.raises(files.CheckpointNotFound, match="lists 1 files that are not there"):
        files.checkpoint_files(folder)


def _count_opens(monkeypatch: pytest.MonkeyPatch, folder: Path) -> collections.Counter[str]:
    """The number of times each file of ``folder`` is opened from now on, by any of
    Python's openers."""
    counts: collections.Counter[str] = collections.Counter()
    inside = os.path.realpath(folder)

    def counting(opener: Callable[..., Any]) -> Callable[..., Any]:
        def opens(path: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(path, str | os.PathLike):
                real = os.path.realpath(path)
                if os.path.dirname(real) == inside:
                    counts[os.path.basename(real)] += 1
            return opener(path, *args, **kwargs)
        return opens

    monkeypatch.setattr(os, "open", counting(os.open))
    monkeypatch.setattr(builtins, "open", counting(builtins.open))
    monkeypatch.setattr(io, "open", counting(io.open))
    return counts


def test_load_pretrained_opens_each_file_once(monkeypatch: pytest.MonkeyPatch) -> None:
    folder = FIXTURES / "hf_qwen3"
    shards = sorted(set(json.loads((folder / files.INDEX).read_text())["weight_map"].values()))
    assert len(shards) == 4
    counts = _count_opens(monkeypatch, folder)
    model = hf.load_pretrained(folder, mesh="data=8", rules=RULES)
    monkeypatch.undo()
    assert model.cfg.model_type == "qwen3"
    # config.json read once (the family, the config and the check against the target);
    # the index once; each shard once (its header and every tensor from one descriptor).
    assert dict(counts) == {"config.json": 1, "generation_config.json": 1, files.INDEX: 1,
                            **dict.fromkeys(shards, 1)}


def test_load_pretrained_compares_the_head_with_the_embedding_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reads: collections.Counter[str] = collections.Counter()
    read_bytes = st.read_bytes

    def counted(header: st.Header, name: str, start: int, n: int) -> bytes:
        reads[name] += 1
        return read_bytes(header, name, start, n)

    monkeypatch.setattr(st, "read_bytes", counted)
    counts = _count_opens(monkeypatch, TIED_HEAD)
    model = hf.load_pretrained(TIED_HEAD, mesh="data=8", rules=RULES)
    monkeypatch.undo()
    assert model.cfg.tie_embeddings is False
    # The tiny tensors are one chunk each: compared once, not again by the config check.
    assert dict(reads) == {"lm_head.weight": 1, "model.embed_tokens.weight": 1}
    assert dict(counts) == {"config.json": 1, "model.safetensors": 1}
