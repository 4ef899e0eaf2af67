"""A command line written for `vllm serve` starts `pagoda serve`: vLLM's flags map onto pagoda's settings, the small
ones pagoda implements (--chat-template, --response-role, --root-path, CORS, several --served-model-name,
--stream-interval) work
through a real server, the ones it cannot honour stop it with one line naming the flag, and the ones that change
nothing here are logged once (docs/vllm-compat.md#server-flags)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pagoda.cli import build_parser, main
from pagoda.shared.config import (
    VLLM_NO_OP_FLAGS,
    VLLM_REFUSED_FLAGS,
    EngineConfig,
    ServerConfig,
    apply_vllm_serve_args,
    engine_config_from_args,
    env_names,
    parse_token_count,
    server_config_from_args,
)
from pagoda.shared.errors import ConfigError
from tests.harness import HTTP, die_with_parent, free_port, named_events, server_env

ROOT = Path(__file__).resolve().parent.parent


def configs(*argv: str) -> tuple[EngineConfig, ServerConfig, list[str]]:
    """The configs `pagoda serve ARGV` would start with, and the no-op notes it would log."""
    args = build_parser().parse_args(["serve", *argv])
    notes = apply_vllm_serve_args(args)
    return engine_config_from_args(args), server_config_from_args(args), notes


def test_the_positional_model_and_vllms_spellings_map_onto_pagodas_settings() -> None:
    engine, server, notes = configs(
        "some/model", "-tp", "2", "-dp", "3", "--max-model-len", "32k", "--max-num-batched-tokens", "4K",
        "--max-num-seqs", "64", "--gpu-memory-utilization", "0.8", "--dtype", "half", "--kv-cache-dtype", "fp8_e4m3",
        "--quantization", "fp8", "--load-format", "safetensors", "--swap-space", "4", "--block-size", "32",
        "--enforce-eager", "--served-model-name", "first", "second", "--api-server-count", "2",
        "--uvicorn-log-level", "trace", "--no-enable-prefix-caching", "--async-scheduling")
    assert engine.model == "some/model"
    assert (engine.tensor_parallel_size, server.data_parallel_size, server.api_workers) == (2, 3, 2)
    assert (engine.max_model_len, engine.max_num_batched_tokens, engine.max_num_seqs) == (32000, 4096, 64)
    assert (engine.gpu_memory_utilization, engine.dtype, engine.kv_cache_dtype) == (0.8, "float16", "fp8_e4m3")
    assert (engine.quantization, engine.load_format, engine.swap_space, engine.block_size) == ("fp8", "auto", 4, 32)
    assert engine.enforce_eager and engine.async_scheduling is True and engine.enable_prefix_caching is False
    assert server.served_model_names() == ["first", "second"] and server.log_level == "debug"
    assert notes == []
    assert configs("m", "--enable-prefix-caching")[0].enable_prefix_caching is True
    assert configs("m", "--no-prefix-caching")[0].enable_prefix_caching is False
    assert configs("--model", "m", "--dtype", "float")[0].dtype == "float32"
    assert configs("--max-model-len", "25.6k")[0].max_model_len == 25600


@pytest.mark.parametrize("value", ["auto", "-1", "32x", "1.5"])
def test_a_length_that_is_not_a_count_of_tokens_is_refused_naming_the_flag(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model-len", value])
    err = capsys.readouterr().err
    assert "--max-model-len" in err and "tokens" in err


def test_token_counts_are_exact_and_refusals_name_their_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert [parse_token_count(t) for t in ("0.1k", "25.6k", "32K", "2048")] == [100, 25600, 32768, 2048]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-num-batched-tokens", "8x"])
    assert "--max-num-batched-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [
    (["--enable-lora"], "--enable-lora"), (["--lora-modules", "a=/x", "b=/y"], "--lora-modules"),
    (["--speculative-config", '{"method": "ngram"}'], "--speculative-config"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill"), (["-pp", "2"], "--pipeline-parallel-size"),
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend"),
    (["--limit-mm-per-prompt", '{"image": 2}'], "--limit-mm-per-prompt"), (["--cuda-graph-sizes", "8", "16"],
                                                                          "--cuda-graph-sizes"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode"), (["--quantization", "awq"], "--quantization"),
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype"), (["--load-format", "gguf"], "--load-format"),
    (["--chat-template", "no/such/template.jinja"], "--chat-template"), (["--root-path", "llm"], "--root-path"),
    (["--allowed-origins", '["http://a"'], "--allowed-origins"),
    (["--tool-call-parser", "pythonic"], "--tool-call-parser"),
    (["--reasoning-parser", "granite"], "--reasoning-parser"),
    (["--allow-credentials"], "--allow-credentials"),  # CORS settings without origins: CORS would stay off
    (["--allowed-methods", "GET,POST"], "--allowed-methods"),
    (["--allowed-origins", "*", "--allow-credentials"], "--allow-credentials"),  # any page, the visitor's cookies
    (["--stream-interval", "0"], "--stream-interval"),
    (["--logprobs-mode", "processed_logprobs"], "--logprobs-mode"),  # pagoda's logprobs are the raw ones only
])
def test_a_flag_pagoda_cannot_honour_stops_it_with_one_line_naming_the_flag(
        argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "models/none", *argv]) == 2  # refused before any process starts
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagoda: error: ") and named in err and "\n" not in err, err
    assert "unrecognized arguments" not in err


def test_every_refused_and_no_op_flag_is_declared_once() -> None:
    assert not set(VLLM_NO_OP_FLAGS) & set(VLLM_REFUSED_FLAGS)
    for flag, (num_values, _) in VLLM_REFUSED_FLAGS.items():
        argv = ["m", flag, *(["1"] if num_values else [])]
        with pytest.raises(ConfigError, match=flag):
            configs(*argv)


def test_flags_that_change_nothing_here_are_accepted_and_each_said_once() -> None:
    argv = ["m"]
    for flag, (num_values, _) in VLLM_NO_OP_FLAGS.items():
        argv += [flag, *(["1"] if num_values else [])]
    _, _, notes = configs(*argv, "--distributed-executor-backend", "mp", "--limit-mm-per-prompt", '{"image": 0}',
                          "--seed", "7", "-pp", "1", "--tokenizer-mode", "auto", "--logprobs-mode", "raw_logprobs")
    said = [note.split(" ")[0] for note in notes]
    assert sorted(said) == sorted([*VLLM_NO_OP_FLAGS, "--distributed-executor-backend", "--limit-mm-per-prompt",
                                   "--seed", "--logprobs-mode"])
    assert all("changes nothing here" in note or "changes no sampling" in note for note in notes)
    assert configs("--shape", "tiny", "--seed", "7")[2] == []  # the seed draws dummy weights: not a no-op


def test_the_new_settings_are_environment_variables_too(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("CHAT_TEMPLATE", "RESPONSE_ROLE", "ROOT_PATH", "ALLOWED_ORIGINS", "ALLOW_CREDENTIALS", "LOG_REQUESTS",
                 "STREAM_INTERVAL", "ENABLE_REQUEST_ID_HEADERS"):
        assert f"PAGODA_{name}" in env_names()
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    monkeypatch.setenv("PAGODA_CHAT_TEMPLATE", str(template))
    monkeypatch.setenv("PAGODA_SERVED_MODEL_NAME", "a,b")
    monkeypatch.setenv("PAGODA_SHAPE", "tiny")
    monkeypatch.setenv("PAGODA_STREAM_INTERVAL", "4")
    engine, server, _ = configs()
    assert engine.chat_template_text() == "{{ messages[0].content }}"
    assert server.served_model_names() == ["a", "b"] and server.stream_interval == 4
    assert configs("--stream-interval", "6")[1].stream_interval == 6 and ServerConfig().stream_interval == 1
    assert (engine.model, engine.load_format) == ("tiny", "dummy")


def test_a_chat_template_that_does_not_compile_stops_the_tokenizer_naming_the_flag(smollm2_dir: Path) -> None:
    from pagoda.services.tokenizer.tokenizer import Tokenizer

    with pytest.raises(ConfigError, match="--chat-template is not a valid Jinja template"):
        Tokenizer(smollm2_dir, "{% for x %}")


def test_a_chat_template_is_a_file_or_the_template_itself() -> None:
    inline = EngineConfig(chat_template="{% for m in messages %}{{ m.content }}\\n{% endfor %}")
    assert inline.chat_template_text() == "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    with pytest.raises(ConfigError, match="looks like a file path"):
        EngineConfig(chat_template="templates/missing.jinja")


# ------------------------------------------------------------------ one server from a vLLM command line

TEMPLATE = ("{% for message in messages %}[{{ message.role | upper }}] {{ message.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[BOT]{% endif %}")


@pytest.fixture(scope="module")
def vllm_server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`pagoda serve` started with a command line as vLLM's users write it: the model positional, vLLM's names."""
    folder = tmp_path_factory.mktemp("vllm_flags")
    (folder / "chat.jinja").write_text(TEMPLATE)
    port, log_path = free_port(), folder / "stderr.log"
    argv = [sys.executable, "-m", "pagoda.cli", "serve", str(smollm2_dir), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "smol", "smol-alias", "--max-model-len", "1k", "--max-num-seqs", "8",
            "-tp", "1", "--dtype", "float", "--gpu-memory-utilization", "0.9", "--enable-prefix-caching",
            "--enable-chunked-prefill", "--trust-remote-code", "--disable-log-requests", "--enable-log-requests",
            "--chat-template", str(folder / "chat.jinja"), "--response-role", "bot", "--root-path", "/llm",
            "--allowed-origins", '["http://app.example"]', "--api-key", "k", "--uvicorn-log-level", "info",
            "--stream-interval", "3", "--enable-request-id-headers", "--trust-request-chat-template",
            "--runtime-dir", str(folder / "run"), "--heartbeat-timeout", "3"]
    (folder / "run").mkdir()
    with log_path.open("w") as log:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=server_env(),
                                   preexec_fn=die_with_parent)
        try:
            assert process.stdout is not None
            line = process.stdout.readline()  # the launcher prints one line once every process is healthy
            assert "serving" in line, f"server did not start: {line!r}\n{log_path.read_text()[-3000:]}"
            yield f"http://127.0.0.1:{port}", log_path
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=20)


KEY = {"Authorization": "Bearer k"}


def test_a_vllm_command_line_serves_a_chat_rendered_by_its_chat_template(vllm_server: tuple[str, Path]) -> None:
    url, _ = vllm_server
    chat = [{"role": "user", "content": "Say hi."}]
    answer = HTTP.post(url + "/v1/chat/completions", headers=KEY, timeout=60,
                       json={"model": "smol-alias", "messages": chat, "max_tokens": 4, "temperature": 0}).json()
    assert answer["model"] == "smol"  # the first --served-model-name is the one reported
    assert answer["choices"][0]["message"]["role"] == "bot"  # --response-role
    assert answer["usage"]["completion_tokens"] >= 1
    # the prompt the server tokenized is the custom template's rendering, not the model's own template
    ids = HTTP.post(url + "/tokenize", headers=KEY, timeout=30, json={"model": "smol", "messages": chat}).json()
    text = HTTP.post(url + "/detokenize", headers=KEY, timeout=30,
                     json={"model": "smol", "tokens": ids["tokens"]}).json()["prompt"]
    assert text == "[USER] Say hi.\n[BOT]"
    assert ids["count"] == answer["usage"]["prompt_tokens"]
    listed = HTTP.get(url + "/v1/models", headers=KEY, timeout=10).json()["data"]
    assert [card["id"] for card in listed] == ["smol", "smol-alias"]
    assert HTTP.get(url + "/v1/models/smol-alias", headers=KEY, timeout=10).json()["id"] == "smol-alias"
    # without a generation prompt the answer continues the last message, in its role (vLLM's rule)
    continued = HTTP.post(url + "/v1/chat/completions", headers=KEY, timeout=60,
                          json={"model": "smol", "messages": chat, "max_tokens": 2, "temperature": 0,
                                "add_generation_prompt": False}).json()
    assert continued["choices"][0]["message"]["role"] == "user"


REQUEST_TEMPLATE = "{% for m in messages %}<{{ m.content }}>{% endfor %}{% if add_generation_prompt %}={% endif %}"


def test_a_request_chat_template_renders_its_prompt_under_the_trust_flag(vllm_server: tuple[str, Path]) -> None:
    """--trust-request-chat-template: a chat's or /tokenize's own chat_template renders its prompt in place of
    --chat-template's ("" is the server's); one that does not compile is a 400 naming it, as is one on /tokenize
    without messages. (Without the flag the field is refused: tests/test_vllm_compat.py's field table.)"""
    url, _ = vllm_server
    chat = [{"role": "user", "content": "Say hi."}]

    def rendered(template: str | None) -> tuple[str, int]:
        body = {"model": "smol", "messages": chat, **({} if template is None else {"chat_template": template})}
        ids = HTTP.post(url + "/tokenize", headers=KEY, timeout=30, json=body).json()
        text = HTTP.post(url + "/detokenize", headers=KEY, timeout=30,
                         json={"model": "smol", "tokens": ids["tokens"]}).json()["prompt"]
        return text, ids["count"]

    text, count = rendered(REQUEST_TEMPLATE)
    assert text == "<Say hi.>="
    assert rendered("")[0] == rendered(None)[0] == "[USER] Say hi.\n[BOT]"
    answer = HTTP.post(url + "/v1/chat/completions", headers=KEY, timeout=60,
                       json={"model": "smol", "messages": chat, "max_tokens": 2, "temperature": 0,
                             "chat_template": REQUEST_TEMPLATE}).json()
    assert answer["usage"]["prompt_tokens"] == count
    for route, body in (("/v1/chat/completions", {"messages": chat, "max_tokens": 2}),
                        ("/tokenize", {"messages": chat}), ("/tokenize", {"prompt": "Hi"})):
        template = "{% for m in messages %}" if "messages" in body else REQUEST_TEMPLATE
        refused = HTTP.post(url + route, headers=KEY, timeout=30,
                            json={"model": "smol", **body, "chat_template": template})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template", refused.text


def test_every_response_carries_the_request_id_header(vllm_server: tuple[str, Path]) -> None:
    """--enable-request-id-headers: the request's X-Request-Id comes back (a chat's also names its answer), else a
    fresh one per response; errors and streams carry it too."""
    url, _ = vllm_server
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    named = HTTP.post(url + "/v1/chat/completions", headers={**KEY, "X-Request-Id": "trace-1"}, json=body, timeout=60)
    assert named.headers["X-Request-Id"] == "trace-1" and named.json()["id"] == "chatcmpl-trace-1"
    fresh = [HTTP.get(url + "/v1/models", headers=KEY, timeout=10).headers["X-Request-Id"] for _ in range(2)]
    assert fresh[0] != fresh[1] and all(re.fullmatch(r"[0-9a-f]{32}", value) for value in fresh)
    refused = HTTP.post(url + "/v1/chat/completions", headers={"X-Request-Id": "no-key"}, json=body, timeout=10)
    assert refused.status_code == 401 and refused.headers["X-Request-Id"] == "no-key"
    with HTTP.stream("POST", url + "/v1/chat/completions", headers={**KEY, "X-Request-Id": "s-1"},
                     json={**body, "stream": True}, timeout=60) as streamed:
        assert streamed.headers["X-Request-Id"] == "s-1" and streamed.read().endswith(b"data: [DONE]\n\n")


def test_routes_answer_under_the_root_path_behind_the_same_key(vllm_server: tuple[str, Path]) -> None:
    url, _ = vllm_server
    assert HTTP.get(url + "/llm/v1/models", timeout=10).status_code == 401  # the key check sees the route's path
    assert HTTP.get(url + "/llm/v1/models", headers=KEY, timeout=10).json()["data"][0]["id"] == "smol"
    assert HTTP.get(url + "/llm/health", timeout=10).status_code == 200
    assert HTTP.get(url + "/llmx/health", timeout=10).status_code == 404


def test_cors_answers_the_allowed_origin_only(vllm_server: tuple[str, Path]) -> None:
    url, _ = vllm_server
    asked = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    preflight = HTTP.options(url + "/v1/chat/completions", headers={"Origin": "http://app.example", **asked})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert HTTP.options(url + "/v1/chat/completions", headers={"Origin": "http://evil.example", **asked}).status_code \
        == 400
    allowed = HTTP.get(url + "/v1/models", headers={"Origin": "http://app.example", **KEY}, timeout=10)
    assert allowed.headers["access-control-allow-origin"] == "http://app.example"
    other = HTTP.get(url + "/v1/models", headers={"Origin": "http://evil.example", **KEY}, timeout=10)
    assert "access-control-allow-origin" not in other.headers


def test_no_op_flags_are_logged_once_and_requests_when_asked(vllm_server: tuple[str, Path]) -> None:
    url, log_path = vllm_server
    HTTP.post(url + "/v1/completions", headers=KEY, timeout=60,
              json={"model": "smol", "prompt": "Hello", "max_tokens": 1, "stop": ["SECRET-STOP"]})
    text = log_path.read_text()
    assert "SECRET-STOP" not in text and "stop=<list of 1>" in text  # the client's texts only as kind and size
    for flag in ("--enable-chunked-prefill", "--trust-remote-code", "--disable-log-requests"):
        assert text.count(f"{flag} changes nothing here") == 1, flag
    assert "request cmpl-" in text and "completion, model smol" in text and "Hello" not in text


def test_stream_interval_is_a_floor_that_a_request_may_raise(vllm_server: tuple[str, Path]) -> None:
    """--stream-interval 3: a streamed completion's chunks carry 3 new tokens after its first; a request's 2 is
    raised to 3, its 5 kept (vLLM's clamp). Responses and Messages streams follow the server's interval."""
    url, _ = vllm_server
    base = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 10, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}

    def counts(**fields: object) -> tuple[list[int], str]:
        with HTTP.stream("POST", url + "/v1/completions", headers=KEY, timeout=60,
                         json={**base, "stream": True, **fields}) as response:
            assert response.status_code == 200, response.read()
            choices = [json.loads(line[6:])["choices"][0] for line in response.iter_lines()
                       if line.startswith("data: {")]
        return [len(c["token_ids"]) for c in choices if c["token_ids"]], "".join(c["text"] for c in choices)

    chat = [{"role": "user", "content": "Tell me a story."}]
    routes = [("/v1/responses", {"input": chat, "max_output_tokens": 10},
               lambda r: r["output"][0]["content"][0]["text"],
               lambda e: e["delta"] if e["type"] == "response.output_text.delta" else None),
              ("/v1/messages", {"messages": chat, "max_tokens": 10},
               lambda r: r["content"][0]["text"],
               lambda e: e["delta"]["text"] if e["type"] == "content_block_delta" else None)]
    bodies = [{"model": "smol", "temperature": 0, **body} for _, body, _, _ in routes]

    def post(path: str, body: dict[str, object]) -> Any:
        return HTTP.post(url + path, headers=KEY, timeout=60, json=body)

    with ThreadPoolExecutor(8) as pool:  # all at once (none needs another's answer): the engine batches them
        whole_of = pool.submit(post, "/v1/completions", base)
        counted = [pool.submit(counts, **fields) for fields in ({"stream_interval": 2}, {}, {"stream_interval": 5})]
        answers = [pool.submit(post, path, body) for (path, _, _, _), body in zip(routes, bodies, strict=True)]
        streams = [pool.submit(post, path, {**body, "stream": True})
                   for (path, _, _, _), body in zip(routes, bodies, strict=True)]
        whole = whole_of.result().json()["choices"][0]["text"]
        raised, plain, kept = (future.result() for future in counted)
    assert raised == plain == ([1, 3, 3, 3], whole)
    assert kept == ([1, 5, 4], whole)
    for (path, _, text_of, delta_of), answered, streamed in zip(routes, answers, streams, strict=True):
        answer = text_of(answered.result().json())
        events = named_events(streamed.result().content)
        pieces = [piece for piece in map(delta_of, events) if piece is not None]
        assert "".join(pieces) == answer != "" and len(pieces) <= 4, (path, pieces)  # 10 tokens: 1 + 3 + 3 + 3


def test_refusal_happens_before_any_process_starts(smollm2_dir: Path) -> None:
    """The real command, not only main(): one line on stderr, exit 2, nothing listening."""
    done = subprocess.run([sys.executable, "-m", "pagoda.cli", "serve", str(smollm2_dir), "--enable-lora"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "--enable-lora" in done.stderr


def test_the_docs_table_has_a_row_per_flag() -> None:
    """docs/vllm-compat.md's Server flags table names every flag this module accepts for vLLM."""
    section = (ROOT / "docs/vllm-compat.md").read_text().split("## Server flags", 1)[1].split("\n## ", 1)[0]
    for flag in [*VLLM_NO_OP_FLAGS, *VLLM_REFUSED_FLAGS, "--pipeline-parallel-size", "--distributed-executor-backend",
                 "--limit-mm-per-prompt", "--uvicorn-log-level", "--tokenizer-mode", "--chat-template",
                 "--response-role", "--root-path", "--allowed-origins", "--enable-log-requests", "--stream-interval",
                 "--enable-request-id-headers"]:
        assert f"`{flag}" in section, flag
