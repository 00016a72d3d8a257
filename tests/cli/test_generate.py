"""``nnx-shard generate``: the tiny Llama checkpoint with its own tokenizer prints
transformers' text (``tests/fixtures/hf_llama_text/expected.json``); bad flags and
folders are one error line naming the flag."""

from __future__ import annotations

import json
import shutil
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
    (("--prompt", "\udcffHi"), "--prompt is not UTF-8 text (position 0: '\\udcff')"),
    (("--prompt", "Hi", "--mesh", "foo=8"), "--mesh foo=8 has no 'data' or 'model' axis"),
    (("--prompt", "Hi", "--mesh", "data=1,model=8"),
     "--strategy tp on --mesh data=1,model=8: 4 variables cannot be sharded: rule 'heads'"),
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


@pytest.mark.slow
@needs_devices(8)
@pytest.mark.parametrize("name", ["cp", "fsdp_cp"])
def test_cli_context_parallel_strategies_generate(capsys, name: str) -> None:  # type: ignore[no-untyped-def]
    # prompt + new tokens = 9 positions, which the context axis does not divide: the cache's
    # positions are kept whole on each device, and the text is dp's
    argv = ("--prompt", "Hello there how are you", "--max-new-tokens", "3", "--chat")
    code, out, err = _cli(capsys, *argv, "--strategy", "dp")
    assert code == 0, err
    for mesh in ((), ("--mesh", "data=2,context=4")):
        code, cp_out, err = _cli(capsys, *argv, "--strategy", name, *mesh)
        assert code == 0, err
        assert cp_out == out and out.strip()


def test_generation_rules_keep_uneven_caches_whole() -> None:
    from jax.sharding import PartitionSpec as P

    import nnx_shard as ns
    from nnx_shard._rules import Fallbacks
    from nnx_shard.cli._generate import _generation_rules

    rules = _generation_rules(ns.strategies.get("cp").rules)
    assert rules["cache_length"] == Fallbacks("context", None)
    assert rules.spec(("cache_length",), shape=(9,), mesh={"context": 4}) == P(None)
    assert rules.spec(("cache_length",), shape=(8,), mesh={"context": 4}) == P("context")
    dp = ns.strategies.get("dp").rules
    assert _generation_rules(dp) is dp


def _template_folder(tmp_path: Path, **files: str) -> Path:
    folder = tmp_path / "tok"
    shutil.copytree(TEXT, folder)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize(("files", "words"), [
    ({"chat_template.jinja": "{% for i in range(100000) %}{% for j in range(100000) %}"
                             "{% endfor %}{% endfor %}"},
     ["--chat: ", "chat_template.jinja was stopped", "1,000,000"]),
    ({"chat_template.jinja": "{{ 'a' * 10**10 }}"}, ["past the limit of 16,777,216"]),
    ({"chat_template.jinja": "{{ 1 / 0 }}"}, ["chat_template.jinja failed", "ZeroDivisionError"]),
    ({"tokenizer_config.json": "[1, 2]"}, ["--tokenizer: ", "tokenizer_config.json: holds a "
                                                            "JSON list"]),
    ({"generation_config.json": '{"eos_token_id": "x"}'}, ["generation_config.json: "
                                                            "eos_token_id must be"]),
])
def test_cli_bad_tokenizer_files_are_one_line(capsys, tmp_path: Path, files, words) -> None:  # type: ignore[no-untyped-def]
    code = cli.main(["generate", "--model", str(MODEL), "--tokenizer",
                     str(_template_folder(tmp_path, **files)), "--prompt", "Hi", "--chat",
                     "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nnx-shard: error: "), err
    for word in words:
        assert word in lines[0], err


def test_cli_refuses_a_template_linked_out_of_the_folder(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder = _template_folder(tmp_path)
    (folder / "chat_template.jinja").symlink_to("/etc/passwd")
    code = cli.main(["generate", "--model", str(MODEL), "--tokenizer", str(folder), "--prompt",
                     "Hi", "--chat"])
    _, err = capsys.readouterr()
    assert code == 2 and "chat_template.jinja: is a link to '/etc/passwd'" in err, err
    assert "root:" not in err
