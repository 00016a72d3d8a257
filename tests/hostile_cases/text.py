"""Hostile cases of text in and out of generation: ``Tokenizer`` paths, files and
messages, ``generate_text`` / ``stream_text`` arguments, and ``nnx-shard generate``'s
flags."""

from __future__ import annotations

import os
from typing import Any

_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "fixtures")
_TEXT = os.path.join(_FIXTURES, "hf_llama_text")
_MODEL = os.path.join(_FIXTURES, "hf_llama")


def build(hs: Any) -> None:
    F = hs.F

    def tok(path: Any = _TEXT) -> Any:
        from nnx_shard.inference import Tokenizer

        return Tokenizer.from_pretrained(path)

    def copy(label: str, config: dict[str, Any] | None = None,
             files: dict[str, str] | None = None) -> str:
        return hs.tokenizer_copy(F.path(f"text_{label}"), config, files)

    def chat(messages: Any, path: Any = _TEXT, **kw: Any) -> Any:
        return tok(path).apply_chat_template(messages, **kw)

    def text(prompts: Any = ("Hello",), new: Any = 2, **kw: Any) -> Any:
        import nnx_shard as ns
        from nnx_shard.hf import load_pretrained
        from nnx_shard.inference import generate_text

        model = load_pretrained(_MODEL, mesh="data=8", rules=ns.strategies.get("dp").rules)
        config, rest = hs.generation_config(new, kw)
        return generate_text(model, tok(), list(prompts) if isinstance(prompts, tuple)
                             else prompts, config, **rest)

    user = [{"role": "user", "content": "Hi"}]
    for label, fn, arg in [
        ("path_int", lambda: tok(3), "path"),
        ("path_empty", lambda: tok(""), "path"),
        ("path_missing", lambda: tok(F.path("no_such_folder")), "folder"),
        ("path_file", lambda: tok(os.path.join(_TEXT, "tokenizer.json")), "folder"),
        ("no_tokenizer_json", lambda: tok(_MODEL), "tokenizer.json"),
        ("tokenizer_json_garbage", lambda: tok(copy("garbage", files={
            "tokenizer.json": "{not json"})), "tokenizer.json"),
        ("config_garbage", lambda: tok(copy("config_garbage", files={
            "tokenizer_config.json": "[1, 2"})), "tokenizer_config.json"),
        ("bos_not_in_vocab", lambda: tok(copy("bos", {"bos_token": "<s>"})), "bos_token"),
        ("no_chat_template", lambda: chat(user, copy("no_template", {"chat_template": None})),
         "chat template"),
        ("template_syntax", lambda: chat(user, copy("syntax", {"chat_template": "{% if %}"})),
         "chat template"),
        ("template_escape", lambda: chat(user, copy("escape", {
            "chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"})),
         "chat template"),
        ("template_mutates", lambda: chat(user, copy("mutates", {
            "chat_template": "{% set x = messages.append(1) %}"})), "chat template"),
        ("messages_empty", lambda: chat([]), "messages"),
        ("messages_str", lambda: chat("Hi"), "messages"),
        ("messages_not_dicts", lambda: chat(["Hi"]), "messages"),
        ("message_no_role", lambda: chat([{"content": "Hi"}]), ("messages", "role")),
        ("message_no_content", lambda: chat([{"role": "user"}]), ("messages", "content")),
        ("message_bad_role", lambda: chat([{"role": "tool", "content": "x"}]), "role"),
        ("chat_generation_prompt_str", lambda: chat(user, add_generation_prompt="yes"),
         "add_generation_prompt"),
        ("encode_bytes", lambda: tok().encode(b"Hello"), "text"),
        ("encode_special_str", lambda: tok().encode("Hi", add_special_tokens="no"),
         "add_special_tokens"),
        ("decode_str", lambda: tok().decode("Hello"), "ids"),
        ("decode_negative", lambda: tok().decode([1, -5]), "ids"),
        ("decode_2d", lambda: tok().decode([[1], [2]]), "ids"),
        ("decode_floats", lambda: tok().decode([1.5]), "ids"),
        ("text_prompts_str", lambda: text("Hello"), "prompts"),
        ("text_prompts_empty", lambda: text([]), "prompts"),
        ("text_prompts_ints", lambda: text([[1, 2]]), "prompts"),
        ("text_new_zero", lambda: text(new=0), "max_new_tokens"),
        ("text_mask", lambda: text(attention_mask=[[1]]), "attention_mask"),
        ("text_logprobs", lambda: text(return_logprobs=True), "return_logprobs"),
        ("text_unknown_option", lambda: text(temprature=1.0), "temprature"),
        ("text_eos_past_vocab", lambda: text(eos_token_id=500), "eos_token_id"),
        ("text_top_p", lambda: text(top_p=0.0, temperature=1.0), "top_p"),
        ("text_chat_str", lambda: text(chat="yes"), "chat"),
        ("text_tokenizer_str", lambda: __import__("nnx_shard.inference", fromlist=["x"])
         .generate_text(None, "gpt2", ["Hi"]), "tokenizer"),
    ]:
        hs.api(f"text/{label}", arg, fn)

    def stream(prompt: Any = "Hello", **kw: Any) -> Any:
        from nnx_shard.inference import stream_text

        config, rest = hs.generation_config(2, kw)
        return list(stream_text(object(), tok(), prompt, config, **rest))

    hs.api("text/stream_prompt_list", "prompt", lambda: stream(["Hello"]))
    hs.api("text/stream_chunk_zero", "chunk", lambda: stream(chunk=0))

    gen = ("generate", "--model", _MODEL, "--tokenizer", _TEXT)
    for label, flag, value in [  # each flag's value after --prompt Hi (the prompt's own alone)
        ("prompt_empty", "--prompt", ""),
        ("prompt_blank", "--prompt", "   "),
        ("new_zero", "--max-new-tokens", "0"),
        ("new_negative", "--max-new-tokens", "-3"),
        ("new_text", "--max-new-tokens", "lots"),
        ("new_past_context", "--max-new-tokens", "1000000"),
        ("temperature_negative", "--temperature", "-1"),
        ("temperature_nan", "--temperature", "nan"),
        ("top_k_negative", "--top-k", "-1"),
        ("top_k_text", "--top-k", "many"),
        ("top_p_zero", "--top-p", "0"),
        ("top_p_inf", "--top-p", "inf"),
        ("min_p_two", "--min-p", "2"),
        ("penalty_zero", "--repetition-penalty", "0"),
        ("seed_text", "--seed", "x"),
        ("chunk_zero", "--chunk", "0"),
        ("strategy_unknown", "--strategy", "tpp"),
        ("mesh_bad", "--mesh", "data"),
        ("mesh_too_big", "--mesh", "data=64"),
        ("no_prompt", "--prompt", None),
    ]:
        argv = () if value is None else (flag, value) if flag == "--prompt" else (
            "--prompt", "Hi", flag, value)
        # past the context, the error is the API's, naming max_new_tokens
        names = "max_new_tokens" if label == "new_past_context" else flag
        hs.cli(f"text/cli_{label}", names, *gen, *argv)
    hs.cli("text/cli_model_missing", "--model", "generate", "--model", F.path("no_model"),
           "--prompt", "Hi")
    hs.cli("text/cli_model_file", "--model", "generate", "--model",
           os.path.join(_MODEL, "config.json"), "--prompt", "Hi")
    hs.cli("text/cli_no_tokenizer_json", ("--model", "tokenizer.json"), "generate", "--model",
           _MODEL, "--prompt", "Hi")
    hs.cli("text/cli_tokenizer_missing", "--tokenizer", "generate", "--model", _MODEL,
           "--tokenizer", F.path("no_tok"), "--prompt", "Hi")
    hs.cli("text/cli_model_no_config", "--model", "generate", "--model", _TEXT,
           "--tokenizer", _TEXT, "--prompt", "Hi")
    hs.api("text/cli_chat_no_template", ("--chat", "chat template"), lambda: hs._run_cli(
        ["generate", "--model", _MODEL, "--tokenizer", copy("no_template",
                                                             {"chat_template": None}),
         "--prompt", "Hi", "--chat"]))
