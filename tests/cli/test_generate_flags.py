"""``nnx-shard generate``'s controls: ``--stop``, ``--min-new-tokens`` and
``--no-repeat-ngram-size`` on the tiny Llama with its own tokenizer, against the
text transformers generated (``tests/fixtures/hf_llama_text/expected.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nnx_shard import cli
from tests.conftest import needs_devices

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TEXT = FIXTURES / "hf_llama_text"
MODEL = FIXTURES / "hf_llama"
EXPECTED = json.loads((TEXT / "expected.json").read_text())


def _cli(capsys, *argv: str):  # type: ignore[no-untyped-def]
    code = cli.main(["generate", "--model", str(MODEL), "--tokenizer", str(TEXT),
                     "--strategy", "dp", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@needs_devices(8)
def test_cli_stops_at_a_stop_string(capsys) -> None:  # type: ignore[no-untyped-def]
    g = EXPECTED["generate"]
    full = g["texts"][1]                       # 'har1y wPhWh capitalzhar'
    code, out, err = _cli(capsys, "--prompt", g["prompts"][1], "--max-new-tokens",
                          str(g["max_new_tokens"]), "--chunk", "3", "--stop", "zzz",
                          "--stop", " capi")
    assert code == 0, err
    # the token that completes the string is kept whole (' capital'), nothing after it
    assert out == full[:full.index(" capital") + len(" capital")] + "\n"


@needs_devices(8)
def test_cli_no_repeat_ngram_changes_a_repeating_text(capsys) -> None:  # type: ignore[no-untyped-def]
    g = EXPECTED["generate"]
    full = g["texts"][1]                       # 'har' repeats
    code, out, err = _cli(capsys, "--prompt", g["prompts"][1], "--max-new-tokens",
                          str(g["max_new_tokens"]), "--no-repeat-ngram-size", "1",
                          "--min-new-tokens", "2")
    assert code == 0, err
    assert out.startswith("har1y") and out != full + "\n"
    assert out.count("har") == 1, out


@pytest.mark.parametrize(("argv", "words"), [
    (("--min-new-tokens", "-1"), "--min-new-tokens -1"),
    (("--min-new-tokens", "9", "--max-new-tokens", "4"), "--min-new-tokens 9"),
    (("--no-repeat-ngram-size", "-1"), "--no-repeat-ngram-size -1"),
    (("--stop", ""), "--stop ''"),
    (("--no-repeat-ngram-size", str(2**31)),
     "--no-repeat-ngram-size: stream: no_repeat_ngram_size=2147483648 is longer than the "
     "model's context of 131072 positions"),
    (("--max-new-tokens", str(2**31)), "--max-new-tokens: stream: prompt (3 tokens) + "
     "max_new_tokens (2147483648)"),
])
def test_cli_bad_controls_are_one_line(capsys, argv, words) -> None:  # type: ignore[no-untyped-def]
    code, out, err = _cli(capsys, "--prompt", "Hi", *argv)
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nnx-shard: error: "), err
    assert words in lines[0], err


def _settings(*argv: str, vocab: int = 128):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from nnx_shard.cli._generate import _settings as settings
    from nnx_shard.cli._parser import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "Hi", *argv])
    return settings(args, SimpleNamespace(cfg=SimpleNamespace(vocab=vocab)))


def test_flags_replace_the_checkpoints_generation_config() -> None:
    # hf_publish's generation_config.json: do_sample, temperature 0.7, top_p 0.9, eos [2, 3]
    publish = str(FIXTURES / "hf_publish")
    config = _settings("--model", publish)
    assert (config.do_sample, config.temperature, config.top_p, config.top_k) == (
        True, 0.7, 0.9, 50)
    assert (config.eos_token_id, config.pad_token_id, config.max_new_tokens) == ((2, 3), 0, 64)
    flagged = _settings("--model", publish, "--temperature", "0.5", "--top-k", "0",
                        "--max-new-tokens", "8", "--stop", "User:")
    assert (flagged.temperature, flagged.top_k, flagged.top_p, flagged.max_new_tokens,
            flagged.stop_strings) == (0.5, 0, 0.9, 8, ("User:",))
    assert _settings("--model", publish, "--temperature", "0").do_sample is False
    # a checkpoint without settings of its own: greedy, as before
    plain = _settings("--model", str(MODEL))
    assert (plain.do_sample, plain.eos_token_id, plain.max_new_tokens) == (False, None, 64)


def test_a_checkpoint_eos_the_model_has_not_names_the_file() -> None:
    from nnx_shard._errors import UsageError

    with pytest.raises(UsageError, match=r"--model: .*hf_publish/generation_config.json: "
                                         r"eos_token_id \[2, 3\] is not an id of this model"):
        _settings("--model", str(FIXTURES / "hf_publish"), vocab=3)
