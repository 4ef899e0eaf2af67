"""The hostile-input table: several hundred malformed requests, each of which must get a JSON 4xx."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BIG_INTS = [2**63, 2**64, -(2**63) - 1, 10**40]
NOT_INTS = ["7", 1.5, [], {}, True]
BAD_FLOATS = [-1e9, "x", [], {}, True]
USER = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Any = None  # JSON-encoded when `raw` is None
    raw: bytes | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()  # sent as given (several of one name allowed)
    auth: bool = True  # add the right key
    content_type: bytes = b"application/json"
    statuses: frozenset[int] = field(default_factory=lambda: frozenset({400}))


def _routes(extra: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [("/v1/completions", {"prompt": "hi", "max_tokens": 4} | extra),
            ("/v1/chat/completions", {"messages": USER, "max_tokens": 4} | extra)]


def _field_cases() -> list[Case]:
    cases = []
    int_fields = ["n", "max_tokens", "min_tokens", "top_k", "seed", "priority"]
    for name in int_fields:
        for value in BIG_INTS + NOT_INTS:
            for path, body in _routes({name: value}):
                cases.append(Case(f"{path}:{name}={value!r}", path, body))
    for name in ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]:
        for value in BAD_FLOATS:
            for path, body in _routes({name: value}):
                cases.append(Case(f"{path}:{name}={value!r}", path, body))
    for name, value in (("top_p", 2), ("min_p", 2), ("presence_penalty", 3), ("frequency_penalty", -3),
                        ("repetition_penalty", 11), ("repetition_penalty", 0), ("top_p", 0)):
        for path, body in _routes({name: value}):
            cases.append(Case(f"{path}:{name}={value!r}", path, body))
    list_values: dict[str, list[Any]] = {
        "stop_token_ids": [[2**64], [-1], ["a"], 5, [2**31]],
        "logit_bias": [{"99999999999": 1}, {"a": 1}, {"9" * 5000: 1}, {"-1": 1}, [1], {"1": "up"}],
        "stop": [[""], ["a"] * 17, 5, [1]],
        "stream_options": [{"include_usage": True}, {"bogus": 1}],
        "frobnicate": [1, None],
        "store": [True],
        "model": ["gpt-4", 5],
    }
    for name, values in list_values.items():
        for value in values:
            for path, body in _routes({name: value}):
                statuses = frozenset({404}) if name == "model" and isinstance(value, str) else frozenset({400})
                cases.append(Case(f"{path}:{name}={value!r}"[:120], path, body, statuses=statuses))
    completion_only: dict[str, list[Any]] = {
        "prompt": [[2**64], [[2**63]], [], [[]], [-1], {"a": 1}, 12, ["a", 1], [[1], "a"], None, [1.5]],
        "logprobs": [21, -1, 2**64, "1"],  # over --max-logprobs (20), as top_logprobs
        "best_of": [3, 2**64],
        "suffix": ["x"],
        "echo": ["yes"],
    }
    for name, values in completion_only.items():
        for value in values:
            cases.append(Case(f"completions:{name}={value!r}", "/v1/completions",
                              {"prompt": "hi", "max_tokens": 4} | {name: value}))
    cases.append(Case("completions:echo+logprobs+stream", "/v1/completions",
                      {"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}))
    cases.append(Case("completions:context", "/v1/completions", {"prompt": "hi", "max_tokens": 100_000}))
    chat_only: dict[str, list[Any]] = {
        "messages": [[], [{"role": "robot", "content": "x"}], [{"role": "user"}], [{"content": "x"}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
                     [{"role": "user", "content": 5}], "hi", [{"role": "user", "content": "x", "extra": 1}],
                     [{"role": "tool", "content": "x"}], [{"role": "user", "content": [{"type": "text"}]}]],
        "top_logprobs": [21, -1, 2**64],
        "tools": [[{"type": "retrieval"}], [{"type": "function"}], [{"type": "function", "function": {"name": 5}}],
                  5],
        "tool_choice": ["sometimes", 5, {"type": "function", "function": {"name": "missing"}}],
        "response_format": [{"type": "xml"}, 5, {"type": "json_schema"},
                            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}],
        "chat_template_kwargs": [{"k": 2**64}, {"k": [1]}, 5],
        "continue_final_message": ["yes"],
        "max_completion_tokens": [2**64, 0],
    }
    for name, values in chat_only.items():
        for value in values:
            cases.append(Case(f"chat:{name}={value!r}"[:120], "/v1/chat/completions",
                              {"messages": USER, "max_tokens": 4} | {name: value}))
    cases.append(Case("chat:continue_final+add_generation_prompt", "/v1/chat/completions",
                      {"messages": USER, "continue_final_message": True, "add_generation_prompt": True}))
    return cases


def _utility_cases() -> list[Case]:
    cases = []
    for value in [[2**64], [-1], ["a"], 5, [1.5], [10**9]]:
        cases.append(Case(f"detokenize:tokens={value!r}", "/detokenize", {"tokens": value}))
    for body in [{"prompt": 5}, {}, {"prompt": "a", "messages": USER}, {"messages": []}, {"prompt": "a", "x": 1}]:
        cases.append(Case(f"tokenize:{body!r}", "/tokenize", body))
    return cases


def _body_cases() -> list[Case]:
    cases = []
    for depth in (129, 200, 2_000, 100_000):
        for path, key in (("/v1/completions", "metadata"), ("/v1/chat/completions", "response_format")):
            nested = b"[" * depth + b"]" * depth
            chat = b'{"messages": [{"role": "user", "content": "hi"}], '
            base = b'{"prompt": "hi", ' if path == "/v1/completions" else chat
            cases.append(Case(f"{path}:nested {depth}", path, raw=base + b'"' + key.encode() + b'": ' + nested + b"}"))
        cases.append(Case(f"chat:nested content parts {depth}", "/v1/chat/completions",
                          raw=b'{"messages": [{"role": "user", "content": [' + b"[" * depth + b"]" * depth + b"]}]}"))
    for raw in [b"{bad json", b"[1, 2]", b"", b"\xff\xfe", b"null", b"5", b'"x"',
                b'{"prompt": "hi", "max_tokens": 1e400}',
                b'{"prompt": "hi", "n": 123456789012345678901234567890123456789012345678901234567890}',
                b'{"prompt": "hi", "seed": -99999999999999999999999}', b'{"prompt": NaN}', b'{"prompt": "\\ud800"}',
                b'{"prompt": "hi",}', b'{"prompt": "hi"', b"\x00" * 100, b'{"prompt": "hi", "prompt": 5}']:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            cases.append(Case(f"{path}:raw {raw[:40]!r}", path, raw=raw))
    return cases


def _header_cases() -> list[Case]:
    body = {"prompt": "hi", "max_tokens": 2}
    cases = []
    for path in ("/v1/completions", "/v1/models", "/tokenize"):
        cases.append(Case(f"{path}:no key", path, body, auth=False, statuses=frozenset({401})))
        # (the scheme is case-insensitive, RFC 9110: "bearer <the right key>" is let in, tests/test_api.py)
        for value in (b"Bearer \xff\xfe", b"\xc3\x28", b"Bearer " + b"x" * 4000, b"Basic Zm9vOmJhcg==", b"Bearer",
                      b"bearer reliability-kez", b"Basic reliability-key", b"reliability-key"):
            cases.append(Case(f"{path}:Authorization {value[:20]!r}", path, body, auth=False,
                              headers=((b"Authorization", value),), statuses=frozenset({401})))
        cases.append(Case(f"{path}:second wrong key", path, body,
                          headers=((b"Authorization", b"Bearer wrong"),), statuses=frozenset({401})))
    for content_type in (b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x", b"text/xml",
                         b"image/png"):
        cases.append(Case(f"content-type {content_type!r}", "/v1/completions", body, content_type=content_type,
                          statuses=frozenset({415})))
    for path, method_body in (("/v1/nothing", body), ("/v1/models/other-model", None)):
        cases.append(Case(f"{path}:not found", path, method_body, statuses=frozenset({404, 405})))
    return cases


def all_cases(max_prompt_bytes: int) -> list[Case]:
    big = "x" * (max_prompt_bytes + 1)
    prompt_cases = [Case("completions:prompt over --max-prompt-bytes", "/v1/completions", {"prompt": big}),
                    Case("chat:content over --max-prompt-bytes", "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": big}]}),
                    Case("tokenize:prompt over --max-prompt-bytes", "/tokenize", {"prompt": big}),
                    # 1,025 one-token prompts x n=4 = 4,100 completions, past --max-completions-per-request's 4,096
                    Case("completions:prompts x n over --max-completions-per-request", "/v1/completions",
                         {"prompt": [[1]] * 1025, "n": 4, "max_tokens": 1})]
    return _field_cases() + _utility_cases() + _body_cases() + _header_cases() + prompt_cases
