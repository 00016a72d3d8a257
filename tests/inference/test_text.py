"""Text in and out of generation: Tokenizer against transformers' AutoTokenizer (ids,
text, chat template), generate_text and stream_text against transformers' greedy
generate (the command: tests/cli/test_generate.py).

The ground truth is ``tests/fixtures/hf_llama_text/expected.json``, written by
``tests/fixtures/make_tokenizer.py`` with transformers; the model is ``hf_llama``."""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import nnx_shard as ns
from nnx_shard import NnxShardError
from nnx_shard._errors import UsageError
from nnx_shard.hf import load_pretrained
from nnx_shard.inference import GenerationConfig, Tokenizer, generate, generate_text, stream_text
from tests.conftest import needs_devices

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TEXT = FIXTURES / "hf_llama_text"
MODEL = FIXTURES / "hf_llama"
EXPECTED = json.loads((TEXT / "expected.json").read_text())


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(TEXT)


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return load_pretrained(MODEL, mesh="data=8", rules=ns.strategies.get("dp").rules)


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "tok"
    shutil.copytree(TEXT, folder)
    return folder


def _with_config(tmp_path: Path, **changes) -> Path:  # type: ignore[no-untyped-def]
    folder = _copy(tmp_path)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return folder


# -- the tokenizer against transformers ------------------------------------------------


def test_encode_equals_transformers(tok: Tokenizer) -> None:
    assert len(EXPECTED["encode"]) == 10
    for case in EXPECTED["encode"]:
        assert tok.encode(case["text"], add_special_tokens=case["add_special_tokens"]) == \
            case["ids"], case


def test_config_bos_eos_flags_keep_the_post_processor_as_transformers(tmp_path: Path) -> None:
    # transformers 5's PreTrainedTokenizerFast keeps tokenizer.json's post-processor whatever
    # add_bos_token / add_eos_token say; so does Tokenizer
    for i, case in enumerate(EXPECTED["encode_flags"]):
        folder = _with_config(tmp_path / str(i), add_bos_token=case["add_bos_token"],
                              add_eos_token=case["add_eos_token"])
        assert Tokenizer.from_pretrained(folder).encode(case["text"]) == case["ids"]


def test_decode_equals_transformers(tok: Tokenizer) -> None:
    for case in EXPECTED["decode"]:
        assert tok.decode(case["ids"], skip_special_tokens=case["skip_special_tokens"]) == \
            case["text"], case
        assert tok.decode(np.asarray(case["ids"], np.int32),
                          skip_special_tokens=case["skip_special_tokens"]) == case["text"]


def test_special_ids_equal_transformers(tok: Tokenizer) -> None:
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        EXPECTED["bos_token_id"], EXPECTED["eos_token_id"], EXPECTED["pad_token_id"])
    # bos from a plain string, eos from an AddedToken dict (tokenizer_config.json), pad from
    # the legacy special_tokens_map.json
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|begin_of_text|>", "<|eot_id|>", "<|pad|>")
    assert tok.eos_token_ids == (EXPECTED["eos_token_id"],)
    assert tok.vocab_size == 128


def test_chat_template_equals_transformers(tok: Tokenizer) -> None:
    assert len(EXPECTED["chat"]) == 4
    for case in EXPECTED["chat"]:
        g = case["add_generation_prompt"]
        assert tok.apply_chat_template(case["messages"], add_generation_prompt=g) == case["ids"]
        assert tok.apply_chat_template(case["messages"], add_generation_prompt=g,
                                       tokenize=False) == case["text"]


def test_config_values_win_over_special_tokens_map(tmp_path: Path) -> None:
    folder = _with_config(tmp_path, pad_token="<|end_header_id|>")
    assert Tokenizer.from_pretrained(folder).pad_token_id == 2


def test_generation_config_sets_the_stop_and_pad_ids(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [14, 85], "pad_token_id": 3}))
    tok = Tokenizer.from_pretrained(folder)
    assert tok.eos_token_ids == (14, 85)
    assert tok.eos_token_id == 14  # the tokenizer's own is unchanged
    assert tok.generation_pad_token_id == 3
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 85}))
    assert Tokenizer.from_pretrained(folder).eos_token_ids == (85,)


def test_chat_template_jinja_file_wins_over_the_config(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    tok = Tokenizer.from_pretrained(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   tokenize=False) == "[user]Hi"


def test_named_templates_use_default(tmp_path: Path) -> None:
    folder = _with_config(tmp_path, chat_template=[
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}])
    tok = Tokenizer.from_pretrained(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   tokenize=False) == "<|begin_of_text|>Hi"
    folder = _with_config(tmp_path / "b", chat_template=[{"name": "tool_use", "template": "x"}])
    with pytest.raises(UsageError, match="none named 'default'"):
        Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_globals_and_filters_are_transformers(tmp_path: Path) -> None:
    folder = _with_config(tmp_path, chat_template=(
        "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{{ eos_token }}"))
    text = Tokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": "<b>é</b>", "name": None}], tokenize=False)
    # tojson leaves HTML and non-ASCII alone (jinja's own escapes both); None keys dropped
    assert text == '[{"role": "user", "content": "<b>é</b>"}]|4|<|eot_id|>'


def test_template_blocks_are_trimmed(tmp_path: Path) -> None:
    folder = _with_config(tmp_path, chat_template="{% for m in messages %}\n"
                          "    {% if true %}\n{{ m['content'] }}\n    {% endif %}\n{% endfor %}")
    text = Tokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], tokenize=False)
    assert text == "a\nb\n"


def test_template_sandbox_refuses_changes_and_internals(tmp_path: Path) -> None:
    folder = _with_config(tmp_path, chat_template="{% set x = messages.append(1) %}ok")
    with pytest.raises(UsageError, match="refused the messages"):
        Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "u", "content": "x"}])
    folder = _with_config(tmp_path / "b",
                          chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(UsageError, match="chat template"):
        Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "u", "content": "x"}])


CHAT = FIXTURES / "chat_templates"


def test_real_chat_templates_render_as_transformers(tmp_path: Path) -> None:
    # ChatML, Llama 3.1, Gemma and Mistral templates, rendered within the limits: the text
    # of transformers' apply_chat_template (tests/fixtures/make_chat_templates.py)
    expected = json.loads((CHAT / "expected.json").read_text())["cases"]
    assert {c["template"] for c in expected} == {"chatml.jinja", "llama3.jinja", "gemma.jinja",
                                                 "mistral.jinja"}
    toks = {}
    for case in expected:
        name = case["template"]
        if name not in toks:
            folder = _copy(tmp_path / name)
            shutil.copy(CHAT / name, folder / "chat_template.jinja")
            toks[name] = Tokenizer.from_pretrained(folder)
        assert toks[name].apply_chat_template(
            case["messages"], add_generation_prompt=case["add_generation_prompt"],
            tokenize=False) == case["text"], (name, case["messages"])


MASKS = FIXTURES / "chat_masks"
MASKS_EXPECTED = json.loads((MASKS / "expected.json").read_text())
MASK_TEMPLATES = sorted({c["template"] for c in MASKS_EXPECTED["cases"]})


def _template_tok(tmp_path: Path, template: str) -> Tokenizer:
    folder = _copy(tmp_path / template.replace("/", "_"))
    shutil.copy(FIXTURES / template, folder / "chat_template.jinja")
    return Tokenizer.from_pretrained(folder)


@pytest.mark.parametrize("template", MASK_TEMPLATES)
def test_assistant_masks_equal_transformers(tmp_path: Path, template: str) -> None:
    # ids and assistant_masks of transformers' apply_chat_template(..., return_dict=True,
    # return_assistant_tokens_mask=True) (tests/fixtures/make_chat_masks.py), token for token
    tok = _template_tok(tmp_path, template)
    blocks = "generation %}" in (FIXTURES / template).read_text()
    cases = [c for c in MASKS_EXPECTED["cases"] if c["template"] == template]
    assert len(cases) == 6
    for case in cases:
        messages = MASKS_EXPECTED["messages"][case["messages"]]
        prompt = case["add_generation_prompt"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = tok.apply_chat_template(messages, add_generation_prompt=prompt,
                                          return_dict=True, return_assistant_tokens_mask=True)
        assert isinstance(out, dict)
        assert out["input_ids"] == case["input_ids"], (template, case["messages"], prompt)
        assert out["assistant_masks"] == case["assistant_masks"], (template, case["messages"])
        assert out["attention_mask"] == [1] * len(case["input_ids"])
        # the same rendering with and without the tracking
        assert tok.apply_chat_template(messages, add_generation_prompt=prompt,
                                       tokenize=False) == case["text"]
        assert tok.apply_chat_template(messages, add_generation_prompt=prompt) == \
            case["input_ids"]
        warned = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        if blocks:
            assert not warned
        else:  # transformers warns and gives zeros
            assert len(warned) == 1 and "no {% generation %} block" in warned[0], warned
            assert "chat_template.jinja" in warned[0]
            assert not any(case["assistant_masks"])
    if blocks:
        three = next(c for c in cases if c["messages"] == "three_turns")
        assert 0 < sum(three["assistant_masks"]) < len(three["input_ids"])


def test_assistant_masks_mark_the_turns_and_tokens_cut_by_a_block(tmp_path: Path) -> None:
    tok = _template_tok(tmp_path, "chat_masks/llama3.jinja")
    messages = MASKS_EXPECTED["messages"]["three_turns"]
    out = tok.apply_chat_template(messages, add_generation_prompt=False, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert isinstance(out, dict)
    kept = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    eot = tok.eos_token_id
    # each assistant turn's text and its <|eot_id|>, nothing of the user's or the headers
    turns = [[*tok.encode(m["content"], add_special_tokens=False), eot]
             for m in messages if m["role"] == "assistant"]
    assert kept == [t for turn in turns for t in turn]
    # edges.jinja opens a block inside the word "is" (" i" outside, "s" inside): the token
    # " is" starts before the block and is marked, transformers' overlap rule (a rule of
    # tokens starting inside a block would not mark it)
    edges = _template_tok(tmp_path, "chat_masks/edges.jinja")
    out = edges.apply_chat_template(MASKS_EXPECTED["messages"]["ends_with_user"],
                                     add_generation_prompt=False, return_dict=True,
                                     return_assistant_tokens_mask=True)
    assert isinstance(out, dict)
    (word,) = edges.encode(" is", add_special_tokens=False)
    at = out["input_ids"].index(word)
    assert out["assistant_masks"][at - 1:at + 2] == [0, 1, 1]


def test_return_dict_and_mask_arguments(tok: Tokenizer) -> None:
    user = [{"role": "user", "content": "Hi"}]
    out = tok.apply_chat_template(user, return_dict=True)
    assert isinstance(out, dict) and sorted(out) == ["attention_mask", "input_ids"]
    assert out["input_ids"] == tok.apply_chat_template(user)
    # as transformers: return_dict means nothing without tokenize
    assert tok.apply_chat_template(user, return_dict=True, tokenize=False) == \
        tok.apply_chat_template(user, tokenize=False)
    for kw in ({}, {"tokenize": False, "return_dict": True}):
        with pytest.raises(UsageError, match=r"return_assistant_tokens_mask=True needs "
                                             r"return_dict=True and tokenize=True"):
            tok.apply_chat_template(user, return_assistant_tokens_mask=True, **kw)
    for name in ("return_dict", "return_assistant_tokens_mask"):
        with pytest.raises(UsageError, match=rf"{name} must be True or False, got 'yes'"):
            tok.apply_chat_template(user, **{name: "yes"})


def test_generation_blocks_count_against_the_items_limit(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from nnx_shard.inference import _chat_template

    folder = _copy(tmp_path)
    (folder / "chat_template.jinja").write_text(
        "{% for i in range(9) %}{% generation %}x{% endgeneration %}{% endfor %}")
    monkeypatch.setattr(_chat_template, "MAX_ITEMS", 8)
    tok = Tokenizer.from_pretrained(folder)
    user = [{"role": "user", "content": "Hi"}]
    # only tracked renderings record the blocks
    assert tok.apply_chat_template(user, tokenize=False) == "x" * 9
    with pytest.raises(UsageError, match=r"stopped: the generation blocks rendered would be 9 "
                                         r"blocks, past the limit of 8"):
        tok.apply_chat_template(user, return_dict=True, return_assistant_tokens_mask=True)


@needs_devices(8)
def test_multi_turn_sft_trains_on_the_packed_assistant_turns(tmp_path: Path) -> None:
    import optax

    from nnx_shard.models import lm_loss

    tok = _template_tok(tmp_path, "chat_masks/llama3.jinja")
    examples = [tok.apply_chat_template(m, add_generation_prompt=False, return_dict=True,
                                        return_assistant_tokens_mask=True)
                for m in MASKS_EXPECTED["messages"].values()]
    rows = ns.pack(examples, 256)
    kept = sum(sum(e["assistant_masks"][1:]) for e in examples)  # type: ignore[index]
    assert int((rows["targets"] != -100).sum()) == kept
    # 16 rows: 2 per device of data=8 for 2 microbatches
    batch = {k: np.tile(v, (8, 1)) for k, v in rows.items()}
    dp = ns.strategies.get("dp")
    mesh = dp.make_mesh()
    model = load_pretrained(MODEL, mesh=mesh, rules=dp.rules)
    opt = ns.sharded_optimizer(model, optax.adam(1e-2), mesh, dp)
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=dp.rules,
                         microbatches=2, steps_per_call=1)
    history = trainer.fit([batch] * 2, num_steps=2, progress=False)
    losses = [float(x) for x in history["loss"]]
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0]


def test_bounded_rendering_equals_jinja_on_filters_and_methods(tmp_path: Path) -> None:
    # every checked operation gives Python's own value
    import jinja2.sandbox

    source = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}{% endfor %}"
              "{{ '%s-%05d' % ('a', 3) }}{{ '{:>5}|{x}'.format('y', x=2) }}"
              "{{ ['a', 'b'] | join(', ') }}{{ range(4) | sum }}{{ 'ab' | center(6) }}|"
              "{{ messages | tojson(indent=2) }}{{ [1, 2, 3] | slice(2) | list }}"
              "{% for x in [3, 1, 2] | sort %}{{ loop.index }}{{ loop.last }}{{ loop.length }}"
              "{% else %}none{% endfor %}{% for x in [] %}{% else %}empty{% endfor %}"
              "{% set ns = namespace(a='') %}{% for i in range(3) %}{% set ns.a = ns.a ~ i %}"
              "{% endfor %}{{ ns.a }}{{ 'a\nb' | indent(2, true) }}{{ 'x' * 3 }}{{ [0] * 2 }}"
              "{{ 2 ** 10 }}{{ 'abc'.replace('b', 'BB') }}{{ '-'.join(['p', 'q']) }}"
              "{{ 'ab'.ljust(4, '.') }}{{ [1, 2] + [3] }}{{ 'q' + 'r' }}{{ 7 % 3 }}"
              "{{ [[1, 2], [3]] | sum(start=[]) }}{{ [1, 2, 3] | batch(2, 0) | list }}"
              "{{ 'a b c d' | wordwrap(3) }}{{ {'k': [1, {'z': none}]} }}{{ '%(n)s' % {'n': 5} }}"
              "{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
              "{{ f(3) }}{% for a in [[1, [2]], [3, [4]]] recursive %}{{ a }}{% endfor %}")
    folder = _with_config(tmp_path, chat_template=source)
    messages = [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "yo"}]
    ours = Tokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                              indent=indent)
    plain = env.from_string(source).render(messages=messages, add_generation_prompt=True)
    assert ours == plain
    assert "a-00003" in ours and "    y|2" in ours and "012" in ours


@pytest.mark.parametrize(("source", "words"), [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "loop iterations would be 1,000,001"),
    ("{{ lipsum(10**7) }}", "lipsum(10000000, max=100) would be 1,000,000,000 words"),
    ("{{ 'a' * 10**10 }}", "'a' * 10000000000 would be 10,000,000,000 characters"),
    ("{{ 'x'.center(10**10) }}", "str.center(10000000000)"),
    ("{{ 'x' | center(10**10) }}", "center(10000000000)"),
    ("{{ messages | tojson(indent=10**9) }}", "tojson(indent=1000000000)"),
    ("{{ 10 ** (10 ** 10) }}", "bits"),
    ("{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}"
     "{% endfor %}", "'~' of strings would be 33,554,432 characters"),
    ("{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}"
     "{{ f(60) }}", "time limit of 2 s"),
    ("{% set s = 'a' * 1000000 %}{{ [s] * 100000 }}", "a printed value would be"),
])
def test_runaway_templates_are_stopped(tmp_path: Path, source: str, words: str) -> None:
    folder = _copy(tmp_path)
    (folder / "chat_template.jinja").write_text(source)
    tok = Tokenizer.from_pretrained(folder)
    with pytest.raises(UsageError, match="chat_template.jinja was stopped") as e:
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert words in str(e.value) and "past the" in str(e.value)


@pytest.mark.parametrize(("source", "words"), [
    ("{{ 1 / 0 }}", "failed (line 1): ZeroDivisionError: division by zero"),
    ("{{ 10.0 ** 400 }}", "OverflowError"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurses without end"),
    ("{% include 'other.jinja' %}", "include, import and extends are not available"),
    ("{% extends 'base.jinja' %}", "include, import and extends are not available"),
    ("{% import 'm.jinja' as m %}", "include, import and extends are not available"),
])
def test_template_exceptions_are_named(tmp_path: Path, source: str, words: str) -> None:
    folder = _copy(tmp_path)
    (folder / "chat_template.jinja").write_text(source)
    with pytest.raises(UsageError, match="chat_template.jinja failed") as e:
        Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "user", "content": "x"}])
    assert words in str(e.value)


def test_links_out_of_the_folder_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    for name in ("chat_template.jinja", "tokenizer_config.json", "tokenizer.json",
                 "special_tokens_map.json", "generation_config.json"):
        folder = _copy(tmp_path / name)
        (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to(secret)
        with pytest.raises(UsageError, match=rf"{name}: is a link to .*secret.txt.*outside the "
                                             "tokenizer's folder"):
            Tokenizer.from_pretrained(folder)


def test_links_inside_a_hub_cache_repo_are_read(tmp_path: Path) -> None:
    # huggingface_hub's cache: snapshots/<rev>/file -> ../../blobs/<hash>
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    files = {name: (TEXT / name).read_bytes() for name in
             ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")}
    files["chat_template.jinja"] = template.encode()
    for i, (name, data) in enumerate(files.items()):
        (blobs / f"hash{i}").write_bytes(data)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / f"hash{i}")
    tok = Tokenizer.from_pretrained(snapshot)
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   tokenize=False) == "<user>Hi"
    assert tok.encode("Hello world") == Tokenizer.from_pretrained(TEXT).encode("Hello world")
    # a link inside the folder (no cache around it) is read as well
    folder = _copy(tmp_path / "plain")
    (folder / "real.jinja").write_text(template)
    (folder / "chat_template.jinja").symlink_to("real.jinja")
    assert Tokenizer.from_pretrained(folder).chat_template == template


@pytest.mark.parametrize(("name", "content", "words"), [
    ("tokenizer_config.json", "[1, 2]", "holds a JSON list"),
    ("tokenizer_config.json", '{"bos_token": 5}', "bos_token must be the token's text"),
    ("tokenizer_config.json", '{"eos_token": {"content": 3}}', "eos_token must be"),
    ("tokenizer_config.json", '{"chat_template": 7}', "must be the template's text"),
    ("tokenizer_config.json", '{"chat_template": [{"name": "default", "template": 1}]}',
     "named 'default' must be text"),
    ("special_tokens_map.json", '"x"', "holds a JSON string"),
    ("special_tokens_map.json", '{"pad_token": [1]}', "pad_token must be"),
    ("generation_config.json", "3", "holds a JSON number"),
    ("generation_config.json", '{"eos_token_id": "</s>"}', "eos_token_id must be a token id"),
    ("generation_config.json", '{"eos_token_id": [1, -2]}', "eos_token_id must be"),
    ("generation_config.json", '{"pad_token_id": "0"}', "pad_token_id must be"),
    ("tokenizer.json", "[1, 2]", "holds a JSON list"),
    ("tokenizer.json", "7", "holds a JSON number"),
    ("tokenizer_config.json", b'{"bos_token": "\xff"}', "is not UTF-8 text"),
    ("chat_template.jinja", b"{{ '\xff' }}", "is not UTF-8 text"),
    ("tokenizer_config.json", "[" * 100_000 + "]" * 100_000, "nests too deep"),
])
def test_files_of_the_wrong_kind_are_named(tmp_path: Path, name: str, content, words) -> None:  # type: ignore[no-untyped-def]
    folder = _copy(tmp_path)
    path = folder / name
    if isinstance(content, bytes):
        path.write_bytes(content.decode("unicode_escape").encode("latin-1"))
    else:
        path.write_text(content)
    with pytest.raises(UsageError, match=name.replace(".", r"\.")) as e:
        Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "user", "content": "x"}])
    assert words in str(e.value) and "Fix" in str(e.value)


def test_deeply_nested_messages_are_refused(tok: Tokenizer) -> None:
    content: object = "x"
    for _ in range(10**4):
        content = [content]
    with pytest.raises(UsageError, match=r"messages\[0\] nests lists and dicts more than 100"):
        tok.apply_chat_template([{"role": "user", "content": content}])
    nested: object = "x"
    for _ in range(50):
        nested = [nested]
    assert "x" in str(tok.apply_chat_template([{"role": "user", "content": nested}],
                                              tokenize=False))


# -- the tokenizer's errors ------------------------------------------------------------


def test_template_raise_exception_is_named(tok: Tokenizer) -> None:
    with pytest.raises(UsageError, match=r"tokenizer_config.json \(chat_template\) "
                       r"refused the messages \(line 4\): Unknown role: tool\..*Fix"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_chat_template(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(_with_config(tmp_path, chat_template=None))
    assert tok.encode("Hello")[0] == 0  # plain text still works
    with pytest.raises(UsageError, match="no chat template.*base model"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_template_that_does_not_compile(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(_with_config(tmp_path, chat_template="{% for %}"))
    with pytest.raises(UsageError, match="does not compile.*line 1"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize(("messages", "words"), [
    ([], "non-empty list"),
    ("Hello", "non-empty list"),
    (["Hello"], r"messages\[0\] must be a dict"),
    ([{"content": "x"}], r"messages\[0\] has no a text 'role'"),
    ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\] has no a 'content'"),
    ([{"role": 3, "content": "x"}], "text 'role'"),
])
def test_malformed_messages(tok: Tokenizer, messages, words) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match=words):
        tok.apply_chat_template(messages)


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in .*hf_llama.*Fix"):
        Tokenizer.from_pretrained(MODEL)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(UsageError, match="path must be the folder"):
        Tokenizer.from_pretrained(b"tests")  # type: ignore[arg-type]
    folder = _copy(tmp_path)
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(UsageError, match="tokenizer.json: tokenizers cannot read it"):
        Tokenizer.from_pretrained(folder)
    folder = _with_config(tmp_path / "b", bos_token="<s>")
    with pytest.raises(UsageError, match="bos_token '<s>'.*not in tokenizer.json's vocabulary"):
        Tokenizer.from_pretrained(folder)


def test_bad_encode_and_decode_input(tok: Tokenizer) -> None:
    with pytest.raises(UsageError, match="text must be a str"):
        tok.encode(["Hello"])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"text holds '\\udce9' at 3, which is not a character"):
        tok.encode("caf\udce9")
    with pytest.raises(UsageError, match="ids must be a sequence of token ids"):
        tok.decode([[1, 2], [3, 4]])
    with pytest.raises(UsageError, match="ids must be a sequence of token ids"):
        tok.decode("Hello")
    with pytest.raises(UsageError, match="holds -1"):
        tok.decode([3, -1])
    assert tok.decode([]) == "" and tok.decode(109) == tok.decode([109])


@pytest.mark.parametrize("package", ["tokenizers", "jinja2"])
def test_missing_extra_names_the_install(monkeypatch, package: str) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    with pytest.raises(NnxShardError, match=r"needs the '" + package +
                       r"' package.*pip install 'nnx_shard\[text\]'"):
        Tokenizer.from_pretrained(TEXT).apply_chat_template([{"role": "user", "content": "x"}])


# -- text generation against transformers --------------------------------------------


@needs_devices(8)
def test_generate_text_equals_transformers(model, tok: Tokenizer) -> None:  # type: ignore[no-untyped-def]
    g = EXPECTED["generate"]
    # the ragged prompts are encoded as transformers' (left-padded) batch holds them
    for prompt, ids, mask in zip(g["prompts"], g["input_ids"], g["attention_mask"], strict=True):
        assert tok.encode(prompt) == [i for i, m in zip(ids, mask, strict=True) if m]
    texts = generate_text(model, tok, g["prompts"],
                          GenerationConfig(max_new_tokens=g["max_new_tokens"]))
    assert texts == g["texts"]
    # one row stopped at the tokenizer's eos, the other ran to max_new_tokens
    assert tok.eos_token_id in g["new_tokens"][0] and tok.eos_token_id not in g["new_tokens"][1]
    assert texts[0] == tok.decode(g["new_tokens"][0][:g["new_tokens"][0].index(14)])


@pytest.mark.slow
@needs_devices(8)
def test_generate_text_options_pass_through(model, tok: Tokenizer) -> None:  # type: ignore[no-untyped-def]
    g = EXPECTED["generate"]
    # an explicit eos replaces the tokenizer's: row 1 stops at its first 13
    out = generate_text(model, tok, ["Hello"],
                        GenerationConfig(max_new_tokens=g["max_new_tokens"], eos_token_id=[13]))
    assert out == [tok.decode(g["new_tokens"][1][:1])]
    sample = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.0, top_k=None)
    sampled = generate_text(model, tok, ["Hello"], sample, seed=3)
    again = generate_text(model, tok, ["Hello"], sample, seed=3)
    assert sampled == again and isinstance(sampled[0], str)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    new = np.asarray(generate(model, [ids], GenerationConfig(max_new_tokens=5, eos_token_id=14,
                                                             pad_token_id=4)))[0, len(ids):]
    stop = [int(t) for t in new].index(14) if 14 in new else len(new)
    assert generate_text(model, tok, ["Hello"], GenerationConfig(max_new_tokens=5),
                         chat=True) == [tok.decode(new[:stop])]


@pytest.mark.slow
@needs_devices(8)
@pytest.mark.parametrize("chunk", [1, 4])
def test_stream_text_joins_to_generate_text(model, tok: Tokenizer, chunk: int) -> None:  # type: ignore[no-untyped-def]
    g = EXPECTED["generate"]
    for prompt, text in zip(g["prompts"], g["texts"], strict=True):
        config = GenerationConfig(max_new_tokens=g["max_new_tokens"])
        pieces = list(stream_text(model, tok, prompt, config, chunk=chunk))
        assert "".join(pieces) == text
        assert len(pieces) > 1 or chunk > 1


def test_generate_text_errors(tok: Tokenizer) -> None:
    model = object()
    with pytest.raises(UsageError, match="a list of one string"):
        generate_text(model, tok, "Hello",
                      GenerationConfig(max_new_tokens=4))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="non-empty list of strings"):
        generate_text(model, tok, [], GenerationConfig(max_new_tokens=4))
    with pytest.raises(UsageError, match="tokenizer must be a nnx_shard.inference.Tokenizer"):
        generate_text(model, "gpt2", ["Hello"],
                      GenerationConfig(max_new_tokens=4))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="attention_mask= is not taken"):
        generate_text(model, tok, ["Hello"], GenerationConfig(max_new_tokens=4),
                      attention_mask=[[1]])
    with pytest.raises(UsageError, match="unknown option temprature="):
        generate_text(model, tok, ["Hello"], GenerationConfig(max_new_tokens=4), temprature=0.5)
    with pytest.raises(UsageError, match="chat must be True or False"):
        generate_text(model, tok, ["Hello"], GenerationConfig(max_new_tokens=4),
                      chat="yes")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="prompt must be a string"):
        stream_text(model, tok, ["Hello"],
                    GenerationConfig(max_new_tokens=4))  # type: ignore[arg-type]


@needs_devices(8)
def test_stop_and_pad_ids_the_model_has_not_name_their_file(model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder = _copy(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"pad_token_id": 5000}))
    with pytest.raises(UsageError, match=r"generate_text: pad_token_id 5000 read from .*"
                                         r"generation_config.json \(pad_token_id\) is not an id "
                                         r"of this model .*0 \.\. 127"):
        generate_text(model, Tokenizer.from_pretrained(folder), ["Hello"],
                      GenerationConfig(max_new_tokens=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [14, 4096]}))
    with pytest.raises(UsageError, match=r"generation_config.json: eos_token_id \[14, 4096\]"):
        generate_text(model, Tokenizer.from_pretrained(folder), ["Hello"],
                      GenerationConfig(max_new_tokens=2))
    # given explicitly, the ids are the caller's: nothing read from the file is checked
    tok = Tokenizer.from_pretrained(_copy(tmp_path / "b"))
    padded = generate_text(model, tok, ["Hello"], GenerationConfig(max_new_tokens=2, pad_token_id=3))
    assert padded == generate_text(model, tok, ["Hello"], GenerationConfig(max_new_tokens=2))


def test_a_prompt_that_encodes_to_nothing(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["post_processor"] = None  # no bos added: "" is no tokens
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UsageError, match=r"prompts\[1\] '' encodes to no tokens"):
        generate_text(object(), Tokenizer.from_pretrained(folder), ["Hello", ""],
                      GenerationConfig(max_new_tokens=4))
