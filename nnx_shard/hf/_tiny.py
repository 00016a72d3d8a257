"""Tiny Hugging Face checkpoints of random weights, written without torch or a download:
something to load, fine-tune, generate from and export in examples and tests."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx

from nnx_shard._errors import UsageError, check_path, count, flag, short
from nnx_shard.hf._export_dir import ExportError
from nnx_shard.hf._save import save_safetensors
from nnx_shard.models._decoder import Decoder
from nnx_shard.models._decoder_config import DecoderConfig
from nnx_shard.models._families import family_of, model_types

__all__ = ["MAX_PARAMS", "TEXT_EXTRA", "Names", "tiny_checkpoint", "write_tiny"]

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
#: The vocabulary without a tokenizer.
_NO_TOKENIZER_VOCAB = 128

#: The most parameters a tiny checkpoint may have (the default has 43,168): its weights
#: are made in memory and written whole, and it is a helper for tests and examples, so a
#: size past this is a typo (``layers=1000000``), refused before anything is built.
MAX_PARAMS = 100_000_000
#: The dtypes a tiny checkpoint's weights may have (its random initialisers make floats).
_DTYPES = ("float32", "bfloat16", "float16")
#: Layer counts up to this are built as configurations before their size is checked.
_LAYERS_BUILT = 1000
#: The largest seed: ``nnx.Rngs`` takes an int64.
_SEED_MAX = 2**63 - 1


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


def _hf_config(family: str, vocab: int, layers: int | None) -> dict[str, Any]:
    # The layer count goes into config.json, not over the read config, so that what a
    # family derives from it (Gemma 2 / 3's sliding layers) follows.
    sizes = {**_SIZES, **({} if layers is None else {"num_hidden_layers": layers})}
    return {"model_type": family, "vocab_size": vocab, **sizes, **family_of(family).tiny}


def _write_tokenizer(tok: Any, out: Path, max_length: int) -> dict[str, int]:
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": _END, "pad_token": _PAD, "clean_up_tokenization_spaces": False,
              "model_max_length": max_length, "chat_template": CHATML}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = {"eos_token_id": tok.token_to_id(_END), "pad_token_id": tok.token_to_id(_PAD)}
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    return {"bos_token_id": None, **ids}


@dataclasses.dataclass(frozen=True)
class Names:
    """How the checks name the arguments: ``tiny_checkpoint``'s keywords, or the
    command's flags (``flags``: argument -> flag, e.g. ``{"seed": "--seed"}``).

    >>> Names().given("layers", 3), Names("tiny-checkpoint", {"layers": "--layers"}).given("layers", 3)
    ('layers=3', '--layers 3')
    """

    who: str = "tiny_checkpoint"
    flags: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def name(self, arg: str) -> str:
        """The argument's name in messages."""
        return self.flags.get(arg, arg)

    def given(self, arg: str, value: Any) -> str:
        """``arg=value``, ``--flag value``, or the command with a positional's value."""
        if arg in self.flags:
            flag = self.flags[arg]
            return f"{flag if flag.startswith('-') else self.who} {value}"
        return f"{arg}={short(value, 40)}"


def _check_path(path: Any, names: Names) -> Path:
    """``path`` as a folder the checkpoint can be written to, or a UsageError naming it:
    checked before anything is built."""
    who, arg = names.who, names.name("path")
    if isinstance(path, bytes) or not isinstance(path, str | os.PathLike) or not str(path):
        raise UsageError(f"{who}: {arg} must be a folder, got "
                         f"{type(path).__name__} {short(path, 60)}. Fix: e.g. "
                         f"{names.given('path', 'tiny-llama')}.")
    text = os.fspath(path)
    fix = f"a new folder, e.g. {names.given('path', 'tiny-llama')}"
    if "\0" in str(text):
        raise UsageError(f"{who}: {arg} {short(text, 60)} holds a NUL character, which no "
                         f"file name can. Fix: {fix}.")
    check_path(path, who, name=f"{arg} {short(text, 80)}", missing_ok=True, fix=fix,
               error=UsageError)
    # The export is written beside the folder and swapped in whole: the working
    # directory (or a folder above it) would be pulled away from this process.
    real = Path(os.path.realpath(path))
    try:
        cwd: Path | None = Path(os.path.realpath(os.getcwd()))
    except OSError:
        cwd = None
    if cwd is not None and (cwd == real or real in cwd.parents):
        where = "the working directory" if cwd == real else f"above the working directory {cwd}"
        raise UsageError(f"{who}: {arg} {short(text, 80)} ({real}) is {where}: the checkpoint "
                         "is written beside its folder and swapped in whole, which would move "
                         f"the working directory away. Fix: {fix}.")
    return Path(path)


def _check_seed(seed: Any, names: Names) -> int:
    fix = f"e.g. {names.given('seed', 0)}"
    value = count(seed, f"{names.who}: {names.name('seed')}", least=0, fix=fix)
    if value > _SEED_MAX:
        raise UsageError(f"{names.who}: {names.name('seed')} must be at most 2**63-1 (the "
                         f"random weights' key is an int64), got {value}. Fix: {fix}, or "
                         "the seed % 2**63.")
    return value


def _config(family: str, vocab: int, overrides: dict[str, Any], names: Names) -> DecoderConfig:
    """The tiny configuration of ``family`` with ``overrides``, checked: its type is the
    family's, its weights floats and at most :data:`MAX_PARAMS` of them."""
    who = names.who
    overrides = dict(overrides)
    if overrides.get("model_type", family) != family:
        raise UsageError(f"{who}: {names.given('model_type', overrides['model_type'])} names "
                         f"another family than {names.given('family', family)}: the family "
                         f"is the model type. Fix: {names.given('family', overrides['model_type'])}"
                         " and no model_type.")
    overrides.pop("model_type", None)
    layers = overrides.pop("layers", None)
    if layers is not None:
        layers = count(layers, f"{who}: {names.name('layers')}",
                       fix=f"e.g. {names.given('layers', 2)}")

    def too_big(params: int) -> UsageError:
        changed = ({} if layers is None else {"layers": layers}) | overrides
        given = ", ".join(names.given(k, v) for k, v in changed.items())
        default = DecoderConfig.from_hf(_hf_config(family, vocab, None)).num_params
        return UsageError(f"{who}: {given} would build a model of {params:,} parameters, more "
                          f"than the {MAX_PARAMS:,} a tiny checkpoint is for (its weights are "
                          "made in memory and written whole; nothing was built). Fix: smaller "
                          f"{' and '.join(names.name(k) for k in changed)} (the tiny {family} "
                          f"has {default:,} parameters).")

    if layers is not None and layers > _LAYERS_BUILT:
        # A config holds tuples of one entry per layer (Gemma's sliding layers): the count
        # is projected from one and two layers before a million-entry one is made.
        try:
            one, two = (dataclasses.replace(DecoderConfig.from_hf(_hf_config(family, vocab, n)),
                                            **overrides).num_params for n in (1, 2))
        except UsageError:
            pass  # the configuration built below names what is wrong
        else:
            if one + (two - one) * (layers - 1) > MAX_PARAMS:
                raise too_big(one + (two - one) * (layers - 1))
    cfg = DecoderConfig.from_hf(_hf_config(family, vocab, layers))
    try:
        cfg = dataclasses.replace(cfg, **overrides)
    except UsageError as e:
        raise UsageError(f"{who}: {e}") from None
    for field in ("param_dtype", "dtype"):
        value = getattr(cfg, field)
        if value is None or jnp.dtype(value).name not in _DTYPES:
            raise UsageError(f"{who}: {names.given(field, value)} is not a float dtype a "
                             f"tiny checkpoint's random weights can have ({', '.join(_DTYPES)})"
                             f". Fix: e.g. {field}='bfloat16', or leave it out (float32).")
    if cfg.num_params > MAX_PARAMS:
        raise too_big(cfg.num_params)
    return cfg


def write_tiny(path: Any, family: Any, *, tokenizer: Any, seed: Any,
               overrides: dict[str, Any], names: Names) -> Path:
    """What :func:`tiny_checkpoint` does, its errors naming the arguments as ``names``
    does (the command names its flags)."""
    who = names.who
    if not isinstance(family, str) or family not in model_types():
        raise UsageError(f"{who}: unknown {names.name('family')} {short(family, 60)} (known: "
                         f"{', '.join(model_types())}). Fix: pass one of these.")
    out = _check_path(path, names)
    tokenizer = flag(tokenizer, f"{who}: {names.name('tokenizer')}")
    seed = _check_seed(seed, names)
    vocab = _VOCAB if tokenizer else _NO_TOKENIZER_VOCAB
    cfg = _config(family, vocab, overrides, names)
    if tokenizer and cfg.vocab < vocab:
        raise UsageError(f"{who}: vocab={cfg.vocab} is smaller than the tokenizer's "
                         f"{vocab} ids. Fix: vocab >= {vocab}, or tokenizer=False.")
    tok = _tokenizer() if tokenizer else None
    if tok is not None and tok.get_vocab_size() != vocab:
        # The trainer makes _VOCAB ids from the corpus; should it make fewer, the
        # configuration follows the tokenizer.
        vocab = tok.get_vocab_size()
        cfg = _config(family, vocab, overrides, names)
    # The tokenizer goes in as the export's source: save_safetensors then writes every
    # file (config.json with the token ids, generation_config.json, the tokenizer), so
    # that a later export into the same folder replaces them all. Its files are written
    # first: a disk that cannot take them fails before the weights are made.
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp)
        if tok is not None:
            try:
                ids = _write_tokenizer(tok, source, cfg.max_length)
                (source / "config.json").write_text(json.dumps({**cfg.to_hf(), **ids},
                                                               indent=2))
            # tokenizers' own save raises a bare Exception ("File too large", "No space
            # left on device"): the folder it was writing is what the message must name.
            except Exception as e:
                raise ExportError(
                    f"{who}: could not write the tokenizer files for {names.name('path')} "
                    f"{short(os.fspath(path), 80)} into the temporary folder {tmp} "
                    f"({' '.join(str(e).split())[:200]}). Fix: free space there (or set "
                    "TMPDIR to a folder with room); nothing was written to "
                    f"{short(os.fspath(path), 80)}.") from e
        model = Decoder(cfg, rngs=nnx.Rngs(seed))
        save_safetensors(out, model, source=source if tok is not None else False)
    return out


def tiny_checkpoint(path: str | os.PathLike[str], family: str = "llama", *,
                    tokenizer: bool = True, seed: int = 0, **config_overrides: Any) -> Path:
    """Writes a tiny Hugging Face checkpoint of random weights into the folder ``path``
    and returns it: ``config.json`` and ``model.safetensors`` (as
    ``save_pretrained`` writes them, so that :func:`load_pretrained` and transformers'
    ``AutoModelForCausalLM.from_pretrained`` read it), and with ``tokenizer`` a
    byte-level BPE tokenizer: ``tokenizer.json``, ``tokenizer_config.json`` with a
    ChatML chat template, and ``generation_config.json`` (the ids generation stops at).
    Nothing is downloaded and torch is not needed: the model is a
    :class:`~nnx_shard.models.Decoder` of the family's tiny configuration (2 layers,
    embedding 32, 4 query and 2 key/value heads of 8; MoE families 4 experts, top 2),
    written by :func:`save_safetensors`.

    Args:
      path: the output folder (created if needed; a previous export of
        :func:`save_safetensors` there is replaced; not the working directory, nor a
        path under a file).
      family: a registered ``model_type``: ``llama``, ``qwen3``, ``qwen2``, ``mistral``,
        ``gemma``, ``olmo2``, ``gemma2``, ``gemma3_text``, ``phi3``, ``mixtral``,
        ``qwen3_moe``.
      tokenizer: also write the tokenizer files (needs ``tokenizers``:
        ``pip install 'nnx_shard[text]'``); the vocabulary is then the tokenizer's (384).
      seed: the random weights' seed, an int from 0 to 2**63-1 (the same seed writes
        the same weights).
      **config_overrides: :class:`~nnx_shard.models.DecoderConfig` fields to change, e.g.
        ``layers=4`` or ``tie_embeddings=True`` (``model_type`` is ``family``'s; the
        weights' dtypes float32, bfloat16 or float16; at most 100 million parameters
        in all).

    Returns:
      ``path`` as a :class:`~pathlib.Path`.

    Raises:
      UsageError: an unknown ``family`` (the message lists the known ones), a ``path``
        that is a file, under one or the working directory, a ``tokenizer`` that is not
        a bool, a ``seed`` that is not an int in range, an override the configuration
        refuses, names another family or makes more than 100 million parameters, or
        ``tokenizer=True`` without ``tokenizers``.
      OSError: the files could not be written, e.g. on a full disk (an ``ExportError``
        naming the folder).

    >>> import tempfile
    >>> import nnx_shard as ns
    >>> folder = ns.hf.tiny_checkpoint(tempfile.mkdtemp(), "qwen3")
    >>> sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    ['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']
    >>> model = ns.hf.load_pretrained(folder, mesh="data=8", rules=ns.strategies.get("fsdp").rules)
    >>> model.cfg.model_type, model.cfg.vocab, model.cfg.layers
    ('qwen3', 384, 2)
    >>> ns.hf.tiny_checkpoint(tempfile.mkdtemp(), layers=100_000)
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: tiny_checkpoint: layers=100000 would build a model of 928,024,608 parameters, more than the 100,000,000 a tiny checkpoint is for ... Fix: smaller layers (the tiny llama has 43,168 parameters).
    """
    return write_tiny(path, family, tokenizer=tokenizer, seed=seed, overrides=config_overrides,
                      names=Names())
