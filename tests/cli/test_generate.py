"""``nnx-shard generate``: the tiny Llama checkpoint with its own tokenizer prints
transformers' text (``tests/fixtures/hf_llama_text/expected.json``); bad flags and
folders are one error line naming the flag."""

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
    code = cli.main(["generate", "--model", str(MODEL), "--tokenizer", str(TEXT), *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
@needs_devices(8)
def test_cli_prints_transformers_text(capsys) -> None:  # type: ignore[no-untyped-def]
    g = EXPECTED["generate"]
    code, out, err = _cli(capsys, "--prompt", g["prompts"][1], "--max-new-tokens",
                          str(g["max_new_tokens"]), "--chunk", "3")
    assert code == 0, err
    assert out == g["texts"][1] + "\n"


@pytest.mark.parametrize(("argv", "words"), [
    (("--prompt", "  "), "--prompt '  ' is empty"),
    (("--prompt", "Hi", "--max-new-tokens", "0"), "--max-new-tokens 0"),
    (("--prompt", "Hi", "--max-new-tokens", "many"), "--max-new-tokens"),
    (("--prompt", "Hi", "--top-p", "0"), "--top-p 0.0"),
    (("--prompt", "Hi", "--min-p", "nan"), "--min-p nan"),
    (("--prompt", "Hi", "--temperature", "-1"), "--temperature"),
    (("--prompt", "Hi", "--repetition-penalty", "0"), "--repetition-penalty"),
    (("--prompt", "Hi", "--strategy", "tpp"), "--strategy 'tpp'"),
    (("--prompt", "Hi", "--mesh", "data=16"), "--mesh data=16 needs 16 devices"),
    (("--prompt", "Hi", "--tokenizer", str(MODEL)), "--tokenizer: Tokenizer.from_pretrained: "
                                                    "no tokenizer.json"),
])
def test_cli_bad_input_is_one_line(capsys, argv, words) -> None:  # type: ignore[no-untyped-def]
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nnx-shard: error: "), err
    assert words in lines[0], err


def test_cli_missing_model_folder(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code = cli.main(["generate", "--model", str(tmp_path / "none"), "--prompt", "Hi"])
    _, err = capsys.readouterr()
    assert code == 2 and "--model" in err and "is not a folder" in err, err
