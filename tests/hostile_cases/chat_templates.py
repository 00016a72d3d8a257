"""Hostile cases of chat templates and the tokenizer folder's files: links out
of the folder, templates that run without end or ask for gigabytes, template
code that fails, files of the wrong JSON kind or not UTF-8, deeply nested
messages, an eos id the model has not, and ``nnx-shard generate`` given them.

Every bounded template must be refused within a few seconds (the rendering's
time limit is 2 s)."""

from __future__ import annotations

import os
from typing import Any

_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "fixtures")
_TEXT = os.path.join(_FIXTURES, "hf_llama_text")
_MODEL = os.path.join(_FIXTURES, "hf_llama")

# Templates that run without end, or ask for far more memory than a prompt takes.
RUNAWAY = {
    "nested_range": "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}"
                    "{% endfor %}{% endfor %}",
    "triple_range": "{% for i in range(99999) %}{% for j in range(99999) %}"
                    "{% for k in range(99999) %}{% endfor %}{% endfor %}{% endfor %}",
    "lipsum": "{{ lipsum(10**7) }}",
    "str_times": "{{ 'a' * 10**10 }}",
    "times_str": "{{ 10**10 * 'a' }}",
    "list_times": "{{ ([0] * 10**10) | length }}",
    "center": "{{ 'x'.center(10**10) }}",
    "center_filter": "{{ 'x' | center(10**10) }}",
    "ljust": "{{ 'x'.ljust(10**10) }}",
    "zfill": "{{ '1'.zfill(10**10) }}",
    "tojson_indent": "{{ messages | tojson(indent=10**9) }}",
    "power": "{{ 10 ** (10 ** 10) }}",
    "printf_width": "{{ '%1000000000s' % 'x' }}",
    "format_width": "{{ '{:>10000000000}'.format('x') }}",
    "format_nested_width": "{{ '{:>{w}}'.format('x', w=10**10) }}",
    "format_filter": "{{ '%10000000000d' | format(1) }}",
    "replace_blowup": "{% set s = 'a' * 1000000 %}{{ s.replace('a', s) }}",
    "join_blowup": "{% set s = 'a' * 1000000 %}{{ s.join([s] * 1000) }}",
    "join_filter": "{% set s = 'a' * 1000000 %}{{ ([s] * 1000) | join }}",
    "print_list_refs": "{% set s = 'a' * 1000000 %}{{ [s] * 100000 }}",
    "concat_doubling": "{% set ns = namespace(x='ab') %}{% for i in range(64) %}"
                       "{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x | length }}",
    "plus_doubling": "{% set ns = namespace(x='ab') %}{% for i in range(64) %}"
                     "{% set ns.x = ns.x + ns.x %}{% endfor %}{{ ns.x | length }}",
    "block_set_doubling": "{% set ns = namespace(x='ab') %}{% for i in range(64) %}"
                          "{% set y %}{{ ns.x }}{{ ns.x }}{% endset %}{% set ns.x = y %}"
                          "{% endfor %}{{ ns.x | length }}",
    "keep_many_copies": "{% set ns = namespace(l=[]) %}{% set big = 'a' * 10000000 %}"
                        "{% for i in range(100000) %}{% set ns.l = ns.l + [big ~ i] %}"
                        "{% endfor %}{{ ns.l | length }}",
    "exponential_macro": "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                         "{% endmacro %}{{ f(64) }}",
    "loop_over_strings": "{% for a in 'x' * 100000 %}{% for b in 'x' * 100000 %}{% endfor %}"
                         "{% endfor %}",
    "indent_blowup": "{{ ('a\\n' * 1000000) | indent(10000) }}",
    "wordwrap_blowup": "{{ ('a ' * 1000000) | wordwrap(1, wrapstring='x' * 100000) }}",
    "slice_many": "{{ [1] | slice(10**9) | list | length }}",
    "batch_fill": "{{ [1] | batch(10**9, 0) | list | length }}",
    "sum_lists": "{{ ([[1] * 100000] * 100000) | sum(start=[]) | length }}",
    "expandtabs": "{{ ('\\t' * 1000000).expandtabs(100000) }}",
    "to_bytes": "{{ (1).to_bytes(10**10, 'big') }}",
    "markup_format": "{{ ('{:>10000000000}' | safe).format('x') }}",
    "translate": "{% set s = 'a' * 1000000 %}{{ s.translate({97: s}) }}",
}

# Template code that fails as Python would.
FAILING = {
    "zero_division": "{{ 1 / 0 }}",
    "overflow": "{{ 10.0 ** 400 }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "recursive_loop": "{% for m in [messages] recursive %}{{ loop([m]) }}{% endfor %}",
    "include": "{% include 'other.jinja' %}",
    "import": "{% import 'macros.jinja' as m %}{{ m.x() }}",
    "extends": "{% extends 'base.jinja' %}",
    "from_import": "{% from 'macros.jinja' import x %}{{ x() }}",
    "int_digits": "{{ 10 ** 5000 }}",
    "type_error": "{{ 'a' - 1 }}",
}


def build(hs: Any) -> None:
    F = hs.F

    def folder(label: str, files: dict[str, str | bytes] | None = None,
               config: dict[str, Any] | None = None, drop: tuple[str, ...] = ()) -> str:
        return hs.tokenizer_copy(F.path(f"chat_{label}"), config, files, drop)

    def linked(label: str, name: str, target: str) -> str:
        return hs.tokenizer_copy(F.path(f"chat_link_{label}"), drop=(name,), then=lambda out:
                                 os.symlink(target, os.path.join(out, name)))

    def tok(path: str) -> Any:
        from nnx_shard.inference import Tokenizer

        return Tokenizer.from_pretrained(path)

    def chat(path: str, messages: Any = None) -> Any:
        return tok(path).apply_chat_template(
            messages if messages is not None else [{"role": "user", "content": "Hi"}])

    def gen_chat(path: str, *extra: str) -> Any:
        return hs._run_cli(["generate", "--model", _MODEL, "--tokenizer", path, "--prompt", "Hi",
                            "--chat", "--max-new-tokens", "2", *extra])

    # -- links out of the folder --------------------------------------------------------
    secret = F.file("chat_secret.txt", "root:x:0:0:root:/root:/bin/bash\n")
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"):
        for label, target in (("etc_passwd", "/etc/passwd"), ("secret", secret)):
            hs.api(f"chat_templates/link_{name.split('.')[0]}_{label}", (name, "link"),
                   lambda name=name, label=label, target=target: chat(
                       linked(f"{name}_{label}", name, target)))
    hs.api("chat_templates/link_relative_out", ("chat_template.jinja", "link"),
           lambda: chat(linked("relative", "chat_template.jinja",
                               os.path.join("..", "chat_secret.txt"))))
    hs.api("chat_templates/link_dev_zero", ("chat_template.jinja", "link"),
           lambda: chat(linked("dev_zero", "chat_template.jinja", "/dev/zero")))
    def replaced(label: str, name: str, make: str) -> str:
        def put(out: str) -> None:
            path = os.path.join(out, name)
            if make == "dir":
                os.mkdir(path)
            elif make == "fifo":
                os.mkfifo(path)
            else:
                os.symlink(os.path.join(out, "no_such_file"), path)

        return hs.tokenizer_copy(F.path(f"chat_replaced_{label}"), drop=(name,), then=put)

    for name in ("chat_template.jinja", "tokenizer_config.json", "generation_config.json",
                 "tokenizer.json"):
        for make in ("dir", "fifo", "dangling"):
            hs.api(f"chat_templates/{name.split('.')[0]}_is_{make}", name,
                   lambda name=name, make=make: chat(replaced(f"{name}_{make}", name, make)))
    hs.api("chat_templates/cli_link_etc_passwd", ("chat_template.jinja", "--tokenizer"),
           lambda: gen_chat(linked("cli_passwd", "chat_template.jinja", "/etc/passwd")))

    # -- templates that run without end or ask for gigabytes ------------------------------
    for label, source in RUNAWAY.items():
        hs.api(f"chat_templates/runaway_{label}", ("chat_template.jinja", "limit"),
               lambda label=label, source=source: chat(folder(
                   f"runaway_{label}", {"chat_template.jinja": source})))
    hs.api("chat_templates/runaway_in_config", ("tokenizer_config.json", "limit"),
           lambda: chat(folder("runaway_config", config={
               "chat_template": RUNAWAY["nested_range"]})))
    for label in ("nested_range", "lipsum", "str_times", "tojson_indent", "exponential_macro"):
        hs.api(f"chat_templates/cli_runaway_{label}", ("chat_template.jinja", "limit"),
               lambda label=label: gen_chat(folder(f"cli_runaway_{label}", {
                   "chat_template.jinja": RUNAWAY[label]})))

    # -- template code that fails -----------------------------------------------------------
    for label, source in FAILING.items():
        hs.api(f"chat_templates/failing_{label}", "chat_template.jinja",
               lambda label=label, source=source: chat(folder(
                   f"failing_{label}", {"chat_template.jinja": source})))
    hs.api("chat_templates/cli_failing_zero_division", "chat_template.jinja",
           lambda: gen_chat(folder("cli_zero", {"chat_template.jinja": FAILING["zero_division"]})))
    hs.api("chat_templates/cli_failing_include", "chat_template.jinja",
           lambda: gen_chat(folder("cli_include", {"chat_template.jinja": FAILING["include"]})))
    hs.api("chat_templates/template_escape_still_blocked", "chat template", lambda: chat(folder(
        "escape", {"chat_template.jinja": "{{ cycler.__init__.__globals__.os.system('id') }}"})))
    hs.api("chat_templates/template_format_escape", "chat template", lambda: chat(folder(
        "format_escape", {"chat_template.jinja":
                          "{{ '{0.__class__.__mro__}'.format(messages) }}"})))

    # -- files of the wrong kind ------------------------------------------------------------
    wrong: dict[str, dict[str, str | bytes]] = {  # file -> case -> its content
        "tokenizer_config.json": {
            "config_list": "[1, 2, 3]",
            "config_string": '"hello"',
            "config_number": "42",
            "config_null": "null",
            "config_bos_number": '{"bos_token": 5}',
            "config_eos_list": '{"eos_token": ["a"]}',
            "config_eos_content_number": '{"eos_token": {"content": 3}}',
            "config_template_number": '{"chat_template": 7}',
            "config_template_dict": '{"chat_template": {"a": 1}}',
            "config_template_list_str": '{"chat_template": ["x"]}',
            "config_template_default_number":
                '{"chat_template": [{"name": "default", "template": 5}]}',
            "config_not_utf8": b'{"bos_token": "\xff\xfe"}',
            "config_deep": "[" * 100_000 + "]" * 100_000,
            "config_nan_token": '{"pad_token": NaN}',
        },
        "special_tokens_map.json": {
            "map_list": "[]",
            "map_pad_number": '{"pad_token": 0}',
            "map_not_utf8": b"\xff\xfe{}",
        },
        "generation_config.json": {
            "gen_list": "[1]",
            "gen_eos_str": '{"eos_token_id": "</s>"}',
            "gen_eos_negative": '{"eos_token_id": -1}',
            "gen_eos_list_str": '{"eos_token_id": [1, "2"]}',
            "gen_eos_empty_list": '{"eos_token_id": []}',
            "gen_eos_bool": '{"eos_token_id": true}',
            "gen_eos_float": '{"eos_token_id": 2.0}',
            "gen_pad_str": '{"pad_token_id": "0"}',
            "gen_not_utf8": b'{"eos_token_id": 1}\xff',
            "gen_deep": "{\"a\": " + "[" * 100_000 + "]" * 100_000 + "}",
        },
        "tokenizer.json": {
            "tokenizer_list": "[1, 2]",
            "tokenizer_number": "7",
            "tokenizer_string": '"tokenizer"',
            "tokenizer_empty_object": "{}",
            "tokenizer_model_list": '{"model": [1, 2]}',
            "tokenizer_not_utf8": b"\xff\xfe\x00{",
            "tokenizer_deep": '{"model": ' + "[" * 100_000 + "]" * 100_000 + "}",
        },
        "chat_template.jinja": {
            "template_not_utf8": b"{{ 'caf\xe9' }}",
            "template_utf16": "{{ 'x' }}".encode("utf-16"),
        },
    }
    for name, contents in wrong.items():
        for label, content in contents.items():
            hs.api(f"chat_templates/file_{label}", name,
                   lambda label=label, name=name, content=content: chat(folder(
                       f"file_{label}", {name: content})))
    hs.api("chat_templates/cli_file_config_list", ("tokenizer_config.json", "--tokenizer"),
           lambda: gen_chat(folder("cli_config_list", {"tokenizer_config.json": "[1]"})))
    hs.api("chat_templates/cli_file_template_not_utf8", ("chat_template.jinja", "--tokenizer"),
           lambda: gen_chat(folder("cli_not_utf8", {"chat_template.jinja": b"\xff{{ 1 }}"})))

    # -- messages ---------------------------------------------------------------------------
    def nested(depth: int) -> Any:
        value: Any = "x"
        for _ in range(depth):
            value = [value]
        return value

    def nested_dict(depth: int) -> Any:
        value: Any = "x"
        for _ in range(depth):
            value = {"a": value}
        return value

    def cyclic() -> Any:
        value: list[Any] = ["x"]
        value.append(value)
        return value

    hs.api("chat_templates/messages_nested_lists", "messages",
           lambda: chat(_TEXT, [{"role": "user", "content": nested(10**4)}]))
    hs.api("chat_templates/messages_nested_dicts", "messages",
           lambda: chat(_TEXT, [{"role": "user", "content": "x", "extra": nested_dict(10**4)}]))
    hs.api("chat_templates/messages_cycle", "messages",
           lambda: chat(_TEXT, [{"role": "user", "content": cyclic()}]))
    hs.api("chat_templates/messages_deep_tojson", "messages", lambda: chat(
        folder("tojson_messages", {"chat_template.jinja": "{{ messages | tojson }}"}),
        [{"role": "user", "content": nested(10**5)}]))

    # -- an eos id from generation_config.json that the model has not -------------------------
    def text_with(path: str) -> Any:
        import nnx_shard as ns
        from nnx_shard.hf import load_pretrained
        from nnx_shard.inference import GenerationConfig, generate_text

        model = load_pretrained(_MODEL, mesh="data=8", rules=ns.strategies.get("dp").rules)
        return generate_text(model, tok(path), ["Hello"], GenerationConfig(max_new_tokens=2))

    hs.api("chat_templates/gen_eos_past_vocab", "generation_config.json", lambda: text_with(
        folder("eos_past", {"generation_config.json": '{"eos_token_id": [14, 5000]}'})))
    hs.api("chat_templates/gen_pad_past_vocab", "generation_config.json", lambda: text_with(
        folder("pad_past", {"generation_config.json": '{"pad_token_id": 5000}'})))
    hs.api("chat_templates/cli_gen_eos_past_vocab", "generation_config.json", lambda: hs._run_cli(
        ["generate", "--model", _MODEL, "--tokenizer", folder(
            "cli_eos_past", {"generation_config.json": '{"eos_token_id": 4096}'}),
         "--prompt", "Hi", "--max-new-tokens", "2"]))

    # -- the command's other input ------------------------------------------------------------
    gen = ("generate", "--model", _MODEL, "--tokenizer", _TEXT, "--max-new-tokens", "2")
    for label, names, argv in [
        ("cli_prompt_surrogates", "--prompt", ("--prompt", "\udcff\udcfeHi")),
        ("cli_mesh_foreign_axes", "--mesh", ("--prompt", "Hi", "--mesh", "foo=8")),
        ("cli_mesh_not_dividing", ("--mesh", "--strategy"), ("--prompt", "Hi", "--mesh",
                                                              "data=1,model=8")),
        ("cli_mesh_three", ("--mesh", "--strategy"), ("--prompt", "Hi", "--mesh",
                                                       "data=1,model=3")),
    ]:
        hs.cli(f"chat_templates/{label}", names, *gen, *argv)
    hs.api("chat_templates/encode_surrogates", "text",
           lambda: tok(_TEXT).encode("caf\udce9"))

    # -- the real command, in a process of its own (its folders made in the worker's) ----------
    def real_cli(*argv: str) -> Any:
        import subprocess
        import sys

        p = subprocess.run([sys.executable, "-m", "nnx_shard.cli", *argv], capture_output=True,
                           text=True, timeout=300, stdin=subprocess.DEVNULL)
        return ("cli", p.returncode, p.stdout, p.stderr)

    hs.api("chat_templates/proc_runaway_nested_range", ("chat_template.jinja", "limit"),
           lambda: real_cli("generate", "--model", _MODEL, "--tokenizer", folder(
               "proc_runaway", {"chat_template.jinja": RUNAWAY["nested_range"]}),
               "--prompt", "Hi", "--chat", "--max-new-tokens", "2"), slow=True)
    hs.api("chat_templates/proc_link_etc_passwd", ("chat_template.jinja", "--tokenizer"),
           lambda: real_cli("generate", "--model", _MODEL, "--tokenizer", linked(
               "proc_passwd", "chat_template.jinja", "/etc/passwd"), "--prompt", "Hi", "--chat"),
           slow=True)
