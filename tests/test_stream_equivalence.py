"""A streamed answer is the non-streamed answer: with the same deltas (or, on the server, temperature 0), the
stream's chunks or events add up to the body, on every endpoint, judged by the SDKs' own stream accumulators (openai's
ChatCompletionStreamState and ResponseStreamState, anthropic's accumulate_event) and by a plain reassembly.

The first half feeds the renderers the servers use (chat's as the tokenizer renders it, Responses', Messages') the
same text cut at seeded random places (markers split anywhere), streamed and not: content, reasoning, tool calls of
every parser, logprobs, finish and stop reasons, n > 1, usage. The second half asks one served SmolLM2 each question
twice, streamed and not, all at once: completions (echo, logprobs, stop strings, n, usage, token ids), chat (the
same, forced tool calls, json_schema), Responses and Messages; the model serves no reasoning parser, so think blocks
are checked in the first half only. Ids, clock readings and prefix-cache hits differ by request and are not
compared; logprob values are compared within 1e-4 (two requests run in different batches)."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import msgspec
import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from openai import omit
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.lib.streaming.responses import ResponseStreamState
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from pagoda.services.protocol.anthropic import MessagesRenderer
from pagoda.services.protocol.chat_output import ChatOutputSpec, ChoiceStream, whole_message
from pagoda.services.protocol.render import CHAT, PromptRenderer, renderer_for, usage_dict
from pagoda.services.protocol.responses import ResponsesRenderer
from pagoda.shared.messages import FinishReason, PositionLogprobs, RenderSpec, TextDelta, TokenLogprob
from tests.harness import SERVED, Server, http_client, named_events

RESPONSE_EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)  # the SDKs' own event types, strictly
MESSAGE_EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)

# --------------------------------------------------------------------------------------------
# the renderers, fed the same deltas both ways

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2]}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
# (tool_mode, tool_parser, reasoning_parser, max_calls) -> texts a model may write
CHAT_CASES: list[tuple[tuple[str, str, str | None, int], str]] = [
    (("auto", "hermes", None, 0), "Sure.\n" + CALL),
    (("auto", "hermes", None, 0), "\n\n" + CALL + "\n" + CALL2),
    (("auto", "hermes", None, 0), "  Let me see. \n " + CALL),
    (("auto", "hermes", None, 1), CALL + CALL2),
    (("auto", "hermes", None, 0), "Text, then a broken call:\n<tool_call>{not json"),
    (("auto", "hermes", None, 0), "a < b and <tool but no call, ends with space \n"),
    (("auto", "hermes", None, 0), "cut off: " + CALL[:30]),
    (("auto", "mistral", None, 0), 'ok \n[TOOL_CALLS] [{"name": "f", "arguments": {"q": "z"}}]'),
    (("auto", "mistral", None, 0), '[TOOL_CALLS]f[ARGS]{"q": 1}[TOOL_CALLS]g[ARGS]{}'),
    (("auto", "llama3_json", None, 0), ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'),
    (("auto", "llama3_json", None, 0), '<|python_tag|>{"name": "f", "arguments": "{\\"a\\": 2}"}'),
    (("auto", "llama3_json", None, 0), "{not a call} and text"),
    (("auto", "llama3_json", None, 0), 'Text first, so no call: {"name": "f", "parameters": {"a": 1}}'),
    (("required", "hermes", None, 0), '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'),
    (("required", "hermes", None, 0), '[{"name": "f", "param'),
    (("named", "hermes", None, 0), '{"a": 1, "b": "x"}'),
    (("named", "hermes", "deepseek_r1", 0), "all of it is reasoning, the call never starts"),
    (("none", "hermes", "qwen3", 0), "<think>Two and two.\nFour.</think>\n\nThe answer is 4."),
    (("none", "hermes", "qwen3", 0), "No think block </think> here."),
    (("none", "hermes", "qwen3", 0), "<think>cut off inside the think bl"),
    (("none", "hermes", "deepseek_r1", 0), "reasoning first</think>then the answer"),
    (("none", "hermes", "deepseek_r1", 0), "\n<think>The opener again, then <think> in the text.</think>Answer."),
    (("auto", "hermes", "qwen3", 0), "<think>I should call it.</think>\nOn it.\n" + CALL),
    (("auto", "mistral", "deepseek_r1", 0), 'hm</think>[TOOL_CALLS] [{"name": "f", "arguments": {}}]'),
]


def _cuts(text: str, seed: int) -> list[str]:
    """The text as token pieces cut at seeded random places (several cuts per marker, on average)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, max(1, len(text) // 3))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _logprob(token: str, k: int) -> PositionLogprobs:
    top = [TokenLogprob(f"alt{j}", j, -2.0 - j - k / 7, list(f"alt{j}".encode())) for j in range(2)]
    return PositionLogprobs(TokenLogprob(token, 100 + k, -0.5 - k / 10, list(token.encode())), top)


def render_both(spec: RenderSpec, pieces: list[list[str]], reasons: list[int],
                stop_reasons: list[str | int | None]) -> tuple[bytes, dict[str, Any]]:
    """(the SSE bytes, the body) of one prompt whose n = len(pieces) choices write these pieces, one token each,
    rendered as the servers render them: the tokenizer's PromptRenderer, the api's closing and body."""
    n = len(pieces)
    out: dict[bool, Any] = {}
    for stream in (True, False):
        mode = msgspec.structs.replace(spec, stream=stream)
        renderer = PromptRenderer(mode, n, "", [1, 2, 3])
        data, choices = [renderer.opening()], {}
        for k in range(max(map(len, pieces))):  # one step: every running choice gains a token
            for index, choice_pieces in enumerate(pieces):
                if k >= len(choice_pieces):
                    continue
                last = k == len(choice_pieces) - 1
                piece = choice_pieces[k]
                delta = TextDelta("r", index, piece, 1, reasons[index] if last else -1,
                                  [_logprob(piece, k)] if spec.want_logprobs else [],
                                  stop_reason=stop_reasons[index] if last else None)
                rendered = renderer.render(delta)
                if stream:
                    data.append(rendered)
                elif rendered:
                    choices[index] = rendered
        api = renderer_for(mode)
        usage = usage_dict(3, sum(map(len, pieces)), 0)
        if stream:
            out[True] = b"".join(data) + api.closing(usage)
        else:
            view = renderer.view
            for choice in view.choices:
                choice.rendered = choices[choice.index]
            out[False] = json.loads(msgspec.json.encode(api.body(view, usage)))
    return out[True], out[False]


def sse_payloads(data: bytes) -> list[dict[str, Any]]:
    """The JSON of each `data:` event; [DONE] comes exactly once, last."""
    blocks = data.decode().split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("data: ") and "\n" not in b for b in blocks[:-1]), data[:300]
    payloads = [b.removeprefix("data: ") for b in blocks[:-1]]
    assert payloads.count("[DONE]") == 1 and payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def same(got: Any, want: Any, where: str = "") -> None:
    """Equal, but for floats within 1e-4: two requests run in different batches, whose sums may round apart (the
    tokens are the same; their logprobs may differ in the last bits)."""
    if isinstance(want, float) and isinstance(got, float):
        assert got == pytest.approx(want, abs=1e-4), where
    elif isinstance(want, dict) and isinstance(got, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list) and isinstance(got, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            same(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def accumulate_chat(chunks: list[dict[str, Any]]) -> ChatCompletion:
    """The openai SDK's own reassembly of a chat stream (`client.chat.completions.stream`'s snapshot; its final
    completion would refuse a choice cut off by length)."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return ChatCompletion.model_validate(state.current_completion_snapshot.model_dump())


def check_chat_chunks(chunks: list[dict[str, Any]], n: int) -> dict[int, Any]:
    """Every chunk's envelope; each choice's role comes first and once, its finish_reason once and last; each tool
    call's first delta alone carries its id, type and name, every later one only argument text. Returns each
    choice's stop_reason."""
    stop_reasons: dict[int, Any] = {}
    assert len({(c["id"], c["created"], c["model"], c["object"]) for c in chunks}) == 1
    finished: set[int] = set()
    ids: dict[tuple[int, int], str] = {}
    roles: list[int] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            index = choice["index"]
            assert 0 <= index < n and index not in finished, chunk
            delta = choice["delta"]
            if "role" in delta:
                roles.append(index)
            else:
                assert index in roles, "a choice's first chunk carries its role"
            if choice["finish_reason"] is not None:
                finished.add(index)
                stop_reasons[index] = choice["stop_reason"]  # vLLM's field, which the SDK's snapshot leaves out
            for call in delta.get("tool_calls", []):
                key = (index, call["index"])
                if "id" in call:
                    assert key not in ids and call["type"] == "function" and call["function"]["name"]
                    assert re.fullmatch(r"call_[0-9a-f]{24}|[A-Za-z0-9]{9}", call["id"])  # OpenAI's form; Mistral's
                    assert call["function"]["arguments"] == ""
                    ids[key] = call["id"]
                else:
                    assert key in ids and set(call) == {"index", "function"} and set(call["function"]) == {
                        "arguments"}
    assert sorted(roles) == list(range(n)) and finished == set(range(n))
    assert len(set(ids.values())) == len(ids), "tool call ids are unique"
    return stop_reasons


def same_chat_answer(streamed: ChatCompletion, whole: ChatCompletion, *, want_logprobs: bool) -> None:
    """The SDK's reassembled stream and the body: the same choices, in order, field by field (tool call ids are
    random: each side's own, compared by shape)."""
    assert [c.index for c in streamed.choices] == [c.index for c in whole.choices] == list(range(len(whole.choices)))
    for got, want in zip(streamed.choices, whole.choices, strict=True):
        assert (got.message.content or "") == (want.message.content or ""), got.index
        extra_got, extra_want = got.message.model_extra or {}, want.message.model_extra or {}
        for name in ("reasoning", "reasoning_content"):
            assert (extra_got.get(name) or "") == (extra_want.get(name) or ""), name
        calls = [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []]
        assert calls == [(c.function.name, c.function.arguments) for c in want.message.tool_calls or []]
        assert got.finish_reason == want.finish_reason
        if want_logprobs:
            assert got.logprobs is not None and want.logprobs is not None
            same([t.model_dump() for t in got.logprobs.content or []],
                 [t.model_dump() for t in want.logprobs.content or []])
        else:
            assert got.logprobs is None and want.logprobs is None


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("mode", "text"), CHAT_CASES, ids=[f"{c[0][0]}-{c[0][1]}-{c[0][2]}-{i}"
                                                             for i, c in enumerate(CHAT_CASES)])
def test_chat_stream_reassembles_into_the_body(mode: tuple[str, str, str | None, int], text: str, seed: int) -> None:
    tool_mode, tool_parser, reasoning_parser, max_calls = mode
    spec = RenderSpec(CHAT, "chatcmpl-1", "m", 1700000000, True, want_logprobs=seed != 1, include_usage=True,
                      tool_mode=tool_mode, tool_parser=tool_parser, tool_name="f" if tool_mode == "named" else "",
                      reasoning_parser=reasoning_parser, max_calls=max_calls, continuous_usage=seed == 2)
    # n = 2: the second choice writes the same text cut elsewhere and ends by length, the first by a stop string
    pieces = [_cuts(text, seed), _cuts(text, seed + 10)]
    data, body = render_both(spec, pieces, [FinishReason.STOP, FinishReason.LENGTH], ["\n\n", None])
    chunks = sse_payloads(data)
    stop_reasons = check_chat_chunks(chunks[:-1], 2)
    assert stop_reasons == {c["index"]: c["stop_reason"] for c in body["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    if spec.continuous_usage:  # each choice's last chunk counts all its tokens, text held back or not
        last = {c["choices"][0]["index"]: c["usage"]["completion_tokens"] for c in chunks[:-1]}
        assert last == {i: len(p) for i, p in enumerate(pieces)}
    whole = ChatCompletion.model_validate(body)
    same_chat_answer(accumulate_chat(chunks), whole, want_logprobs=spec.want_logprobs)


def test_llama3_json_after_text_is_content_when_streamed_too() -> None:
    """Llama 3's calls are the whole answer: an object after text is content, also when it begins a later token."""
    spec = ChatOutputSpec("auto", "llama3_json")
    pieces = ["Use it:", " ", '{"name": "f", "parameters": {"a": 1}}']
    message, calls_tools = whole_message(spec, "".join(pieces))
    stream = ChoiceStream(spec)
    deltas = [d for piece in pieces for d in stream.push(piece)]
    more, streamed_calls = stream.finish()
    assert not calls_tools and not streamed_calls
    assert "".join(d["content"] for d in deltas + more) == message["content"] == "".join(pieces)


@pytest.mark.parametrize("pieces", [["<th", "ink>", "Hm, <", "think> is a tag.</think>", "Done."],
                                    ["\n", "<think>Hm, ", "<think> is a tag.</think>", "Done."]])
def test_deepseek_r1_drops_a_repeated_opener_only_at_the_start_streamed_too(pieces: list[str]) -> None:
    """Some R1 variants write the `<think>` the template opened already: dropped at the start of the reasoning,
    also when cut across tokens; a `<think>` later in the reasoning is its text, also when a token begins with it."""
    spec = ChatOutputSpec(reasoning_parser="deepseek_r1")
    message, _ = whole_message(spec, "".join(pieces))
    stream = ChoiceStream(spec)
    deltas = [d for piece in pieces for d in stream.push(piece)] + stream.finish()[0]
    assert message["reasoning"] == "".join(d.get("reasoning", "") for d in deltas) == "Hm, <think> is a tag."
    assert message["content"] == "".join(d.get("content", "") for d in deltas) == "Done."


def render_builders(renderer_of: Any, pieces: list[str], want_logprobs: bool) -> tuple[list[dict[str, Any]], Any]:
    """(the stream's events, the body) of a Responses or Messages renderer fed these pieces, one token each, then a
    last token with no text (a stop token shown with include_stop_str_in_output: its logprob, no text)."""
    out: dict[bool, Any] = {}
    deltas = [*pieces, ""]
    usage = usage_dict(3, len(deltas), 0)
    for stream in (True, False):
        renderer = renderer_of(stream)
        data = renderer.opening(None)
        for k, piece in enumerate(deltas):
            last = k == len(deltas) - 1
            data += renderer.chunks([(None, TextDelta("r", 0, piece, 1, FinishReason.STOP if last else -1,
                                                      [_logprob(piece, k)] if want_logprobs else []))])
        out[stream] = named_events(data + renderer.closing(usage)) if stream else renderer.body(None, usage)
        assert stream or data == b""
    return out[True], out[False]


RESPONSE_SETTINGS = {"instructions": None, "max_output_tokens": None, "metadata": {}, "parallel_tool_calls": True,
                     "prompt_cache_key": None, "safety_identifier": None, "text": {"format": {"type": "text"}},
                     "tool_choice": "auto", "tools": [], "top_logprobs": 2, "user": None,
                     "reasoning": {"effort": None, "summary": None}}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("mode", "text"), CHAT_CASES, ids=[f"{c[0][0]}-{c[0][1]}-{c[0][2]}-{i}"
                                                             for i, c in enumerate(CHAT_CASES)])
def test_responses_and_messages_events_add_up_to_the_body(mode: tuple[str, str, str | None, int], text: str,
                                                          seed: int) -> None:
    """The Responses and Messages renderers, fed the same deltas streamed and not: the events' deltas join to each
    item's (block's) text, arguments and logprobs, the SDKs' accumulators agree, and the end is the body."""
    tool_mode, tool_parser, reasoning_parser, max_calls = mode
    spec = ChatOutputSpec(tool_mode, tool_parser, "f" if tool_mode == "named" else "", reasoning_parser, max_calls)
    pieces = _cuts(text, seed)
    events, body = render_builders(lambda stream: ResponsesRenderer(
        "resp_1", "m", 1, RESPONSE_SETTINGS, spec, stream=stream, want_logprobs=True, temperature=0.0, top_p=1.0),
        pieces, want_logprobs=True)
    check_response_events(events, body)
    events, message = render_builders(lambda stream: MessagesRenderer("msg_1", "m", 1, spec, stream=stream),
                                      pieces, want_logprobs=False)
    check_message_events(events, message)


# --------------------------------------------------------------------------------------------
# one served SmolLM2: each question asked streamed and not

PROMPT = "The capital of France is"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {
                                                "type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}},
                                                "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
# A Hermes answer the model is held to (structured_outputs under tool_choice auto): text, then two calls whose
# city the model picks; the parser, not the constraint, finds the calls.
HERMES_ANSWER = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,8}"\}\}\n'
                 r'</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": \{\}\}\n</tool_call>')
PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
SAMPLED = {"temperature": 0.9, "seed": 7}  # n > 1: distinct choices, the same ones each time


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    return smollm2_server  # conftest's one default SmolLM2 server (Hermes tool parser, no reasoning parser)


def ask_both(server: Server, questions: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, tuple[bytes, Any]]:
    """Each question (route, body) asked streamed and not, all at once (the engine batches them): name -> (the
    stream's bytes, the body's JSON)."""
    client = http_client()

    def whole(path: str, body: dict[str, Any]) -> Any:
        body = {key: value for key, value in body.items() if key != "stream_options"}  # a 400 unless streaming
        response = client.post(server.url + path, json={**body, "stream": False}, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()

    def streamed(path: str, body: dict[str, Any]) -> bytes:
        with client.stream("POST", server.url + path, json={**body, "stream": True}, timeout=300) as response:
            data = response.read()
            assert response.status_code == 200, data
            assert response.headers["content-type"].startswith("text/event-stream")
            return data

    with ThreadPoolExecutor(2 * len(questions)) as pool:
        futures = {name: (pool.submit(streamed, *question), pool.submit(whole, *question))
                   for name, question in questions.items()}
        return {name: (s.result(), w.result()) for name, (s, w) in futures.items()}


COMPLETIONS, CHAT_ROUTE, RESPONSES, MESSAGES = "/v1/completions", "/v1/chat/completions", "/v1/responses", \
    "/v1/messages"
USAGE_EVERY_CHUNK = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@pytest.fixture(scope="module")
def answers(server: Server) -> dict[str, tuple[bytes, Any]]:
    """Every first question of this module, asked at once."""
    return ask_both(server, {
        "completion": (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 12, "n": 2, "echo": True, **SAMPLED,
                                     "return_token_ids": True, **USAGE_EVERY_CHUNK}),  # echo + logprobs: a 400
        "completion_greedy": (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2}),
        "chat": (CHAT_ROUTE, {"messages": ASK, "max_tokens": 12, "n": 2, "logprobs": True, "top_logprobs": 2,
                              "return_token_ids": True, **SAMPLED, **USAGE_EVERY_CHUNK}),
        "chat_greedy": (CHAT_ROUTE, {"messages": ASK, "max_tokens": 12, "temperature": 0, "logprobs": True}),
        "chat_auto_calls": (CHAT_ROUTE, {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 60,
                                         "temperature": 0, "logprobs": True, "structured_outputs": {
                                             "regex": HERMES_ANSWER}}),
        "chat_required": (CHAT_ROUTE, {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
                                       "parallel_tool_calls": False, "max_tokens": 40, "temperature": 0}),
        "chat_named": (CHAT_ROUTE, {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 40, "temperature": 0,
                                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        "chat_json": (CHAT_ROUTE, {"messages": ASK, "max_tokens": 40, "temperature": 0, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}}),
        "responses": (RESPONSES, {"input": ASK[0]["content"], "max_output_tokens": 12, "temperature": 0,
                                  "include": ["message.output_text.logprobs"], "top_logprobs": 2}),
        # the stop token shown: its logprob comes with no text, after the answer's last text
        "responses_eos": (RESPONSES, {"input": "Say hi.", "max_output_tokens": 40, "temperature": 0,
                                      "include": ["message.output_text.logprobs"], "include_stop_str_in_output": True}),
        "responses_calls": (RESPONSES, {"input": ASK[0]["content"], "max_output_tokens": 60, "temperature": 0,
                                        "tools": [_flat(WEATHER), _flat(TIME)],
                                        "structured_outputs": {"regex": HERMES_ANSWER}}),
        "responses_json": (RESPONSES, {"input": ASK[0]["content"], "max_output_tokens": 40, "temperature": 0,
                                       "text": {"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                           "strict": True}}}),
        "messages": (MESSAGES, {"model": SERVED, "messages": ASK, "max_tokens": 12, "temperature": 0}),
        "messages_tool": (MESSAGES, {"model": SERVED, "messages": ASK, "max_tokens": 40, "temperature": 0,
                                     "tools": [_anthropic(WEATHER), _anthropic(TIME)],
                                     "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}),
    })


def _flat(tool: dict[str, Any]) -> dict[str, Any]:
    """A chat tool in the Responses API's flat form."""
    return {"type": "function", **tool["function"]}


def _anthropic(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    return {"name": function["name"], "description": function.get("description", ""),
            "input_schema": function["parameters"]}


def accumulate_completions(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """A completions stream reassembled per choice: text and logprobs joined, the finish and stop reasons, and the
    running usage of its last chunk (continuous_usage_stats). The reassembled choices are checked as the SDK's
    Completion (it reads each chunk as one too, unchecked: a chunk's finish_reason is null)."""
    assert len({(c["id"], c["created"], c["model"], c["object"]) for c in chunks}) == 1
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            assert set(choice) <= {"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                                   "prompt_token_ids"}, choice
            entry = choices.setdefault(choice["index"], {"text": "", "logprobs": None, "finish_reason": None})
            assert entry["finish_reason"] is None, "nothing comes after a choice's finish_reason"
            entry["text"] += choice["text"]
            if "token_ids" in choice:  # return_token_ids: the prompt's on the choice's first chunk, once
                entry["token_ids"] = entry.get("token_ids", []) + choice["token_ids"]
                if "prompt_token_ids" in choice:
                    assert "prompt_token_ids" not in entry
                    entry["prompt_token_ids"] = choice["prompt_token_ids"]
            if choice["logprobs"] is not None:
                logprobs = entry["logprobs"] = entry["logprobs"] or {key: [] for key in choice["logprobs"]}
                for key, values in choice["logprobs"].items():
                    logprobs[key] += values
            if choice["finish_reason"] is not None:
                entry["finish_reason"], entry["stop_reason"] = choice["finish_reason"], choice["stop_reason"]
            if chunk.get("usage") is not None:
                entry["usage"] = chunk["usage"]
    return choices


@pytest.mark.slow
def test_a_completions_stream_is_the_completion(answers: dict[str, tuple[bytes, Any]]) -> None:
    """n = 2 with echo, and greedy with logprobs: each choice's chunks join to its text (the prompt first), its
    logprobs (tokens, values, top logprobs and text offsets, in order) and reasons; usage at the end is the body's,
    and each choice's running usage ends at its own share."""
    for name in ("completion", "completion_greedy"):
        data, body = answers[name]
        Completion.model_validate(body)
        chunks = sse_payloads(data)
        usage = chunks.pop()["usage"] if chunks[-1]["choices"] == [] else None
        streamed = accumulate_completions(chunks)
        Completion.model_validate({**chunks[0], "choices": [{"index": i, **{k: v for k, v in c.items() if k != "usage"}}
                                                            for i, c in streamed.items()]})
        assert sorted(streamed) == [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
        for want in body["choices"]:
            got = streamed[want["index"]]
            assert got["text"] == want["text"] and got["text"].startswith(PROMPT if name == "completion" else "")
            assert (got["finish_reason"], got["stop_reason"]) == (want["finish_reason"], want["stop_reason"])
            same(got["logprobs"], want["logprobs"])
            for key in ("token_ids", "prompt_token_ids"):
                assert got.get(key) == want.get(key), key
        if name == "completion":
            assert _without_ids(usage) == _without_ids(body["usage"])
            assert sum(c["usage"]["completion_tokens"] for c in streamed.values()) == usage["completion_tokens"]
            assert all(c["usage"]["prompt_tokens"] == usage["prompt_tokens"] for c in streamed.values())
        else:
            assert usage is None


def chat_pair(answers: dict[str, tuple[bytes, Any]], name: str) -> tuple[list[dict[str, Any]], ChatCompletion,
                                                                        ChatCompletion, dict[str, Any] | None]:
    """(the chunks, the SDK's reassembly of them, the body, the closing usage chunk's usage) of a chat question."""
    data, body = answers[name]
    chunks = sse_payloads(data)
    usage = chunks.pop()["usage"] if chunks[-1]["choices"] == [] else None
    whole = ChatCompletion.model_validate(body)
    stop_reasons = check_chat_chunks(chunks, len(body["choices"]))
    assert stop_reasons == {c["index"]: c["stop_reason"] for c in body["choices"]}
    streamed = accumulate_chat(chunks)
    same_chat_answer(streamed, whole, want_logprobs=body["choices"][0]["logprobs"] is not None)
    if "prompt_token_ids" in body:  # return_token_ids: the prompt's once per choice (its role chunk), then each token's
        assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == \
            [body["prompt_token_ids"]] * len(body["choices"])
        for want in body["choices"]:
            assert [i for c in chunks for choice in c["choices"] if choice["index"] == want["index"]
                    for i in choice.get("token_ids", [])] == want["token_ids"]
    return chunks, streamed, whole, usage


@pytest.mark.slow
def test_a_chat_stream_is_the_answer(answers: dict[str, tuple[bytes, Any]]) -> None:
    """n = 2 (seeded) with top logprobs and usage on every chunk, and greedy with logprobs: the same messages,
    logprobs (token, value, bytes, top alternatives, in order), finish and stop reasons, usage."""
    chunks, _, whole, usage = chat_pair(answers, "chat")
    assert whole.usage is not None and _without_ids(usage) == _without_ids(whole.usage.model_dump(exclude_none=True))
    last: dict[int, dict[str, Any]] = {}
    for chunk in chunks:  # continuous usage stats: each choice's own count so far, on each of its chunks
        for choice in chunk["choices"]:
            assert chunk["usage"]["prompt_tokens"] == whole.usage.prompt_tokens
            assert chunk["usage"]["completion_tokens"] >= last.get(choice["index"], {"completion_tokens": 0})[
                "completion_tokens"]
            last[choice["index"]] = chunk["usage"]
    assert sum(u["completion_tokens"] for u in last.values()) == whole.usage.completion_tokens
    assert len({c.message.content for c in whole.choices}) == 2, "seeded choices differ (else n proves little)"
    _, _, _, usage = chat_pair(answers, "chat_greedy")
    assert usage is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chat_auto_calls", "chat_required", "chat_named"])
def test_streamed_tool_calls_are_the_answers_calls(answers: dict[str, tuple[bytes, Any]], name: str) -> None:
    """Tool calls the Hermes parser finds (tool_choice auto), the constrained calls of required and of a named
    function: names and argument JSON assembled from the deltas, the content beside them, tool_calls as the
    finish_reason, each call's id on its first delta only (check_chat_chunks)."""
    _, streamed, whole, _ = chat_pair(answers, name)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.tool_calls
    for call in message.tool_calls:
        assert call.id.startswith("call_") and isinstance(json.loads(call.function.arguments), dict)
    names = [c.function.name for c in message.tool_calls]
    if name == "chat_auto_calls":  # the text before the calls, without the newline that led to them
        assert names == ["get_weather", "get_time"] and message.content == "Sure."
        assert streamed.choices[0].message.content == "Sure."
        assert whole.choices[0].logprobs is not None
        assert "".join(t.token for t in whole.choices[0].logprobs.content or []).startswith("Sure.\n<tool_call>")
    else:
        assert len(names) == 1 and (name != "chat_named" or names == ["get_weather"])


@pytest.mark.slow
def test_a_streamed_json_schema_answer_is_the_answer(answers: dict[str, tuple[bytes, Any]]) -> None:
    _, streamed, whole, _ = chat_pair(answers, "chat_json")
    assert json.loads(whole.choices[0].message.content or "") == json.loads(streamed.choices[0].message.content or "")
    jsonschema.validate(json.loads(whole.choices[0].message.content or ""), PERSON)


def _without_ids(obj: Any) -> Any:
    """The object with its random ids, clock readings and prefix-cache hits blanked: each side makes its own ids,
    and which of the two found the other's blocks cached depends on which ran first. The SDK's own `parsed` is
    left out too."""
    text = json.dumps(obj)
    text = re.sub(r'"(resp|rs|msg|fc|call|toolu)_[0-9a-f]+"', '"ID"', text)
    text = re.sub(r'"(call_)?id": "[A-Za-z0-9]{9}"', r'"\1id": "ID"', text)  # the mistral parser's call ids
    text = re.sub(r'"(created_at|completed_at|cached_tokens)": \d+', r'"\1": 0', text)
    return json.loads(re.sub(r', "parsed(_arguments)?": null', "", text))


def check_response_events(events: list[dict[str, Any]], body: dict[str, Any]) -> None:
    """The events in OpenAI's order (created, in_progress, each item's added / deltas / done, one terminal
    event, sequence numbers from 0), their deltas joined to each item's text or arguments and the message's
    logprobs (the openai SDK's ResponseStreamState keeps the same snapshots), the terminal event's response the
    body."""
    Response.model_validate(body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == f"response.{body['status']}"
    same(_without_ids(events[-1]["response"]), _without_ids(body))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    snapshots: dict[int, str] = {}  # output index -> the SDK's text or arguments so far
    for event in events:
        for handled in state.handle_event(RESPONSE_EVENTS.validate_python(event)):
            if handled.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
                snapshots[handled.output_index] = handled.snapshot
            final = handled
    assert final.type == events[-1]["type"]
    same(_without_ids(final.response.model_dump(mode="json", exclude_unset=True)["output"]),
         _without_ids(body["output"]))
    joined: dict[int, str] = {}
    logprobs: dict[int, list[Any]] = {}
    open_items: list[int] = []
    output = events[-1]["response"]["output"]  # this stream's own: its ids are the events' ids
    for event in events[2:-1]:
        kind, index = event["type"].removeprefix("response."), event["output_index"]
        if kind == "output_item.added":
            assert index == len(joined) and not open_items, "one item at a time, in order"
            open_items.append(index)
            joined[index] = ""
            assert (event["item"]["id"], event["item"].get("call_id")) == (output[index]["id"],
                                                                            output[index].get("call_id"))
        elif kind == "output_item.done":
            assert open_items.pop() == index and event["item"] == output[index]
        else:
            assert open_items == [index] and event.get("item_id", output[index]["id"]) == output[index]["id"]
            if kind.endswith(".delta"):
                joined[index] += event["delta"]
                logprobs.setdefault(index, []).extend(event.get("logprobs", []))
    assert sorted(joined) == list(range(len(body["output"])))
    for index, item in enumerate(body["output"]):
        text = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert joined[index] == text and snapshots.get(index, "") == (text if item["type"] != "reasoning" else "")
        if item["type"] == "message":  # each delta's logprobs, in order, are the message's (the events' have no bytes)
            same(logprobs.get(index, []), _without_bytes(item["content"][0]["logprobs"]), f"output[{index}] logprobs")


def _without_bytes(logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An output_text part's logprobs in the shape of output_text.delta's (OpenAI's ResponseLogProb: no bytes)."""
    return [{"token": lp["token"], "logprob": lp["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]]}
            for lp in logprobs]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["responses", "responses_eos", "responses_calls", "responses_json"])
def test_a_responses_stream_is_the_response(answers: dict[str, tuple[bytes, Any]], name: str) -> None:
    data, body = answers[name]
    check_response_events(named_events(data), body)
    kinds = [item["type"] for item in body["output"]]
    if name == "responses_calls":
        assert kinds == ["message", "function_call", "function_call"] and body["output"][0]["content"][0][
            "text"] == "Sure."
    if name == "responses":
        assert body["output"][0]["content"][0]["logprobs"]


def check_message_events(events: list[dict[str, Any]], body: dict[str, Any]) -> None:
    """Anthropic's order (message_start, each block's start / deltas / stop, message_delta, message_stop), the
    anthropic SDK's accumulate_event over the events, and the body: the same message."""
    Message.model_validate(body)
    types = " ".join(e["type"] for e in events)
    assert re.fullmatch(r"message_start( content_block_start( content_block_delta)* content_block_stop)* "
                        r"message_delta message_stop", types), types
    snapshot, json_bufs = None, {}  # the SDK's partial input JSON per block, across events
    for event in events:
        snapshot = accumulate_event(event=MESSAGE_EVENTS.validate_python(event), current_snapshot=snapshot,
                                    json_bufs=json_bufs)
    assert snapshot is not None
    got = snapshot.model_dump(mode="json", exclude_unset=True)
    for key in ("content", "stop_reason", "stop_sequence", "role", "model"):
        assert _without_ids(got[key]) == _without_ids(body[key]), key
    usage = {k: v for k, v in got["usage"].items() if v is not None}
    assert usage.keys() == body["usage"].keys() and usage["output_tokens"] == body["usage"]["output_tokens"]
    # the prompt: the tokens the prefix cache held (which of the two found the other's depends on which ran
    # first) and the others
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == \
        body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["messages", "messages_tool"])
def test_a_messages_stream_is_the_message(answers: dict[str, tuple[bytes, Any]], name: str) -> None:
    data, body = answers[name]
    check_message_events(named_events(data), body)
    if name == "messages_tool":
        assert body["stop_reason"] == "tool_use" and [b["type"] for b in body["content"]] == ["tool_use"]


def _stop_across_tokens(tokens: list[str]) -> str:
    """A stop string that spans two tokens of an answer: the end of one and the start of the next, in the middle
    of the answer, where the detokenizer must hold back text that may turn out to be the stop."""
    for k in range(len(tokens) // 2, len(tokens) - 1):
        left, right = tokens[k].strip(), tokens[k + 1]
        if len(left) >= 2 and right.strip():
            return tokens[k][-2:] + right[:2]
    raise AssertionError(f"no two tokens to span in {tokens!r}")


@pytest.fixture(scope="module")
def stopped(server: Server, answers: dict[str, tuple[bytes, Any]]) -> tuple[dict[str, str], dict[str, Any]]:
    """The greedy answers asked again with a stop string spanning two of their tokens, shown and not:
    (route family -> the stop and the answer without it, name -> (stream, body))."""
    completion = answers["completion_greedy"][1]["choices"][0]
    chat = answers["chat_greedy"][1]["choices"][0]
    stops = {"completion": _stop_across_tokens(completion["logprobs"]["tokens"]),
             "chat": _stop_across_tokens([t["token"] for t in chat["logprobs"]["content"]])}
    texts = {"completion": completion["text"], "chat": chat["message"]["content"]}
    questions: dict[str, tuple[str, dict[str, Any]]] = {}
    for shown in (False, True):
        extra = {"include_stop_str_in_output": shown}
        questions[f"completion_stop_{shown}"] = (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                                               "logprobs": 1, "stop": [stops["completion"]], **extra})
        questions[f"chat_stop_{shown}"] = (CHAT_ROUTE, {"messages": ASK, "max_tokens": 12, "temperature": 0,
                                                        "logprobs": True, "stop": [stops["chat"]], **extra,
                                                        **USAGE_EVERY_CHUNK})
        questions[f"responses_stop_{shown}"] = (RESPONSES, {"input": ASK[0]["content"], "max_output_tokens": 12,
                                                            "temperature": 0, "stop": [stops["chat"]], **extra})
    questions["messages_stop"] = (MESSAGES, {"model": SERVED, "messages": ASK, "max_tokens": 12, "temperature": 0,
                                             "stop_sequences": [stops["chat"]]})
    # a stop that the answer's last characters begin and that never comes: the stream holds them back to the end
    never = {family: text[-3:] + "\x07" for family, text in texts.items()}
    questions["completion_held"] = (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 1,
                                                  "stop": [never["completion"]]})
    questions["chat_held"] = (CHAT_ROUTE, {"messages": ASK, "max_tokens": 12, "temperature": 0, "logprobs": True,
                                           "stop": [never["chat"]]})
    questions["responses_held"] = (RESPONSES, {"input": ASK[0]["content"], "max_output_tokens": 12, "temperature": 0,
                                               "stop": [never["chat"]], "include": ["message.output_text.logprobs"]})
    questions["messages_held"] = (MESSAGES, {"model": SERVED, "messages": ASK, "max_tokens": 12, "temperature": 0,
                                             "stop_sequences": [never["chat"]]})
    return {"stops": stops, "texts": texts}, ask_both(server, questions)


@pytest.mark.slow
@pytest.mark.parametrize("shown", [False, True])
def test_a_stop_string_across_tokens_ends_both_answers_alike(stopped: tuple[dict[str, Any], dict[str, Any]],
                                                             shown: bool) -> None:
    """The stream holds back text that may be the stop string and never shows what the body does not: both end
    where the greedy answer first holds the stop (at it, or after it with include_stop_str_in_output), with
    finish_reason stop and the stop as stop_reason, on completions, chat, Responses and Messages."""
    known, asked = stopped
    for family, route in (("completion", "completion"), ("chat", "chat"), ("chat", "responses")):
        stop, full = known["stops"][family], known["texts"][family]
        expected = full[:full.index(stop) + (len(stop) if shown else 0)]
        data, body = asked[f"{route}_stop_{shown}"]
        if route == "completion":
            chunks = sse_payloads(data)
            choice = accumulate_completions(chunks)[0]
            assert choice["text"] == body["choices"][0]["text"] == expected
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
            assert (body["choices"][0]["finish_reason"], body["choices"][0]["stop_reason"]) == ("stop", stop)
            same(choice["logprobs"], body["choices"][0]["logprobs"])
        elif route == "chat":
            _, streamed, whole, usage = chat_pair(asked, f"chat_stop_{shown}")
            assert streamed.choices[0].message.content == whole.choices[0].message.content == expected
            assert whole.choices[0].finish_reason == "stop" and (whole.choices[0].model_extra or {})[
                "stop_reason"] == stop
            assert whole.usage is not None and usage is not None
            assert usage["completion_tokens"] == whole.usage.completion_tokens
        else:
            final = named_events(data)[-1]["response"]
            same(_without_ids(final), _without_ids(body))
            assert body["status"] == "completed" and body["output"][0]["content"][0]["text"] == expected
    if not shown:
        data, body = asked["messages_stop"]
        events = named_events(data)
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        stop, full = known["stops"]["chat"], known["texts"]["chat"]
        assert text == body["content"][0]["text"] == full[:full.index(stop)]
        assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
        assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", stop)


@pytest.mark.slow
def test_prefix_cache_hits_never_exceed_the_prompt(server: Server) -> None:
    """A grammar's forced start is fast-forwarded onto the prompt, and a later request with the same start finds
    those blocks cached too: usage still counts only the prompt's hits (cached_tokens <= prompt_tokens), and
    Anthropic's input_tokens (the prompt less its hits) never goes below 0."""
    forced = {"type": "object", "properties": {"note": {"type": "string", "enum": [
        "a forced start, long enough to fill a block or two of the prefix cache with tokens past the prompt"]}},
        "required": ["note"], "additionalProperties": False}
    client = http_client()
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "note", "schema": forced}}}
    usages = [client.post(server.url + CHAT_ROUTE, json=chat, timeout=120).json()["usage"] for _ in range(2)]
    assert all(u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"] for u in usages), usages
    messages = {"model": SERVED, "messages": chat["messages"], "max_tokens": 40, "temperature": 0,
                "output_config": {"format": {"type": "json_schema", "schema": forced}}}
    usage = client.post(server.url + MESSAGES, json=messages, timeout=120).json()["usage"]
    assert usage["input_tokens"] >= 0 and usage["input_tokens"] + usage["cache_read_input_tokens"] == \
        usages[0]["prompt_tokens"], usage


@pytest.mark.slow
def test_text_held_back_for_a_stop_that_never_comes_ends_both_answers(
        stopped: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """The answer's last characters may begin a stop string when its tokens run out: the stream shows them at the
    end, as the body does, on every route."""
    known, asked = stopped
    texts = known["texts"]
    data, body = asked["completion_held"]
    choice = accumulate_completions(sse_payloads(data))[0]
    assert choice["text"] == body["choices"][0]["text"] == texts["completion"] and choice["finish_reason"] == "length"
    same(choice["logprobs"], body["choices"][0]["logprobs"])
    _, streamed, whole, _ = chat_pair(asked, "chat_held")
    assert streamed.choices[0].message.content == whole.choices[0].message.content == texts["chat"]
    data, body = asked["responses_held"]
    check_response_events(named_events(data), body)
    assert body["output"][0]["content"][0]["text"] == texts["chat"] and body["status"] == "incomplete"
    data, body = asked["messages_held"]
    check_message_events(named_events(data), body)
    assert body["content"][0]["text"] == texts["chat"] and body["stop_reason"] == "max_tokens"
