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
    (("--no-repeat-ngram-size", "0"), "--no-repeat-ngram-size 0"),
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
