"""Tiny Hugging Face checkpoints of random weights, written without torch or a download:
something to load, fine-tune, generate from and export in examples and tests."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from flax import nnx

from nnx_shard._errors import UsageError, short
from nnx_shard.hf._save import save_safetensors
from nnx_shard.models._families import family_of, model_types
from nnx_shard.models._llama import Llama
from nnx_shard.models._llama_config import LlamaConfig

__all__ = ["TEXT_EXTRA", "tiny_checkpoint"]

#: How to install what the tokenizer is built with.
TEXT_EXTRA = "pip install 'nnx_shard[text]'"

# Sizes of the tiny model (transformers' config.json names); a family's other keys keep
# the defaults transformers gives them.
_SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "max_position_embeddings": 256}

# ChatML, with the assistant's turns inside generation blocks (their tokens are the ones
# trained on with return_assistant_tokens_mask=True).
CHATML = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_PAD, _START, _END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A mesh of devices shards the parameters of the model.",
    "Hello world, this is a tiny tokenizer for examples.",
    "The user asks a question and the assistant answers it.",
    "What is the capital of France? Paris is the capital of France.",
    "Tokens are generated one at a time through the cache.",
    "numbers 0 1 2 3 4 5 6 7 8 9 and symbols: - + = ( ) ! ? , ; :",
] * 4
#: Tokenizer size: the 256 bytes, three special tokens and the merges learned from a few
#: sentences.
_VOCAB = 384


def _tokenizer() -> Any:
    """A byte-level BPE (every text encodes: the 256 bytes are in the vocabulary) trained
    on a few sentences, with ChatML's special tokens."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise UsageError(f"tiny_checkpoint(tokenizer=True) needs the 'tokenizers' package, "
                         f"which is not installed ({e}). Fix: {TEXT_EXTRA}, or pass "
                         "tokenizer=False.") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_VOCAB, special_tokens=[_PAD, _START, _END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    return tok


def _hf_config(family: str, vocab: int) -> dict[str, Any]:
    return {"model_type": family, "vocab_size": vocab, **_SIZES, **family_of(family).tiny}


def _write_tokenizer(tok: Any, out: Path, max_length: int) -> dict[str, int]:
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": _END, "pad_token": _PAD, "clean_up_tokenization_spaces": False,
              "model_max_length": max_length, "chat_template": CHATML}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = {"eos_token_id": tok.token_to_id(_END), "pad_token_id": tok.token_to_id(_PAD)}
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    return {"bos_token_id": None, **ids}


def tiny_checkpoint(path: str | os.PathLike[str], family: str = "llama", *,
                    tokenizer: bool = True, seed: int = 0, **config_overrides: Any) -> Path:
    """Writes a tiny Hugging Face checkpoint of random weights into the folder ``path``
    and returns it: ``config.json`` and ``model.safetensors`` (as
    ``save_pretrained`` writes them, so that :func:`load_pretrained` and transformers'
    ``AutoModelForCausalLM.from_pretrained`` read it), and with ``tokenizer`` a
    byte-level BPE tokenizer: ``tokenizer.json``, ``tokenizer_config.json`` with a
    ChatML chat template, and ``generation_config.json`` (the ids generation stops at).
    Nothing is downloaded and torch is not needed: the model is a
    :class:`~nnx_shard.models.Llama` of the family's tiny configuration (2 layers,
    embedding 32, 4 query and 2 key/value heads of 8; MoE families 4 experts, top 2),
    written by :func:`save_safetensors`.

    Args:
      path: the output folder (created if needed; a previous export of
        :func:`save_safetensors` there is replaced).
      family: a registered ``model_type``: ``llama``, ``qwen3``, ``qwen2``, ``mistral``,
        ``gemma``, ``olmo2``, ``gemma2``, ``gemma3_text``, ``phi3``, ``mixtral``,
        ``qwen3_moe``.
      tokenizer: also write the tokenizer files (needs ``tokenizers``:
        ``pip install 'nnx_shard[text]'``); the vocabulary is then the tokenizer's (384).
      seed: the random weights' seed (the same seed writes the same weights).
      **config_overrides: :class:`~nnx_shard.models.LlamaConfig` fields to change, e.g.
        ``layers=4`` or ``tie_embeddings=True``.

    Returns:
      ``path`` as a :class:`~pathlib.Path`.

    Raises:
      UsageError: an unknown ``family`` (the message lists the known ones), an override
        the configuration refuses, or ``tokenizer=True`` without ``tokenizers``.

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> folder = ns.hf.tiny_checkpoint(tempfile.mkdtemp(), "qwen3")
    >>> sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    ['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']
    >>> model = ns.hf.load_pretrained(folder, mesh="data=8", rules=ns.strategies.get("fsdp").rules)
    >>> model.cfg.model_type, model.cfg.vocab, model.cfg.layers
    ('qwen3', 384, 2)
    """
    if not isinstance(family, str) or family not in model_types():
        raise UsageError(f"tiny_checkpoint: unknown family {short(family, 60)} (known: "
                         f"{', '.join(model_types())}). Fix: pass one of these.")
    if isinstance(path, bytes) or not isinstance(path, str | os.PathLike) or not str(path):
        raise UsageError(f"tiny_checkpoint: path must be a folder, got "
                         f"{type(path).__name__} {short(path, 60)}. Fix: e.g. "
                         "tiny_checkpoint('tiny-llama').")
    tok = _tokenizer() if tokenizer else None
    vocab = tok.get_vocab_size() if tok is not None else 128
    cfg = LlamaConfig.from_hf(_hf_config(family, vocab), **config_overrides)
    if tok is not None and cfg.vocab < vocab:
        raise UsageError(f"tiny_checkpoint: vocab={cfg.vocab} is smaller than the tokenizer's "
                         f"{vocab} ids. Fix: vocab >= {vocab}, or tokenizer=False.")
    out = Path(path)
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    if tok is None:
        save_safetensors(out, model, source=False)
        return out
    # The tokenizer goes in as the export's source: save_safetensors then writes every
    # file (config.json with the token ids, generation_config.json, the tokenizer), so
    # that a later export into the same folder replaces them all.
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp)
        ids = _write_tokenizer(tok, source, cfg.max_length)
        (source / "config.json").write_text(json.dumps({**cfg.to_hf(), **ids}, indent=2))
        save_safetensors(out, model, source=source)
    return out
