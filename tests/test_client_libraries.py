"""What client libraries written for OpenAI and vLLM send a served SmolLM2, through the openai SDK or raw HTTP: an
answer's message sent back as the SDK hands it over, a response format beside a forced tool call (the openai SDK's
parse() with tools, instructor's Responses tools mode), OpenAI's stream options, the reasoning under vLLM's current
name. (langchain, litellm and instructor themselves are not installed here: these are the bodies they send.)"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import openai
import pydantic
import pytest

from pagoda.services.protocol.chat_output import ChatOutputSpec, ChoiceStream, whole_message
from pagoda.services.protocol.schemas import ChatBody, chat_output_spec, chat_request, decode_body
from pagoda.shared.errors import InvalidRequestError
from tests.harness import HTTP, SERVED, Server


class City(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]  # a few short values: the answer ends within its token budget


CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
               "required": ["city"], "additionalProperties": False}
CITY_TOOL = {"type": "function", "function": {"name": "record_city", "parameters": CITY_SCHEMA}}
QUESTION = {"role": "user", "content": "Which city is the capital of France?"}


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    return smollm2_server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client(timeout=120)


def chat(server: Server, body: dict[str, Any]) -> Any:
    return HTTP.post(server.url + "/v1/chat/completions", json={"model": SERVED, "max_tokens": 4, **body},
                     timeout=120)


# --------------------------------------------------------------------------------------------
# an answer's message sent back


def test_an_answer_message_dumped_by_the_sdk_is_taken_back(server: Server, client: openai.OpenAI) -> None:
    """`messages.append(answer.choices[0].message.model_dump())`: the SDK writes every field of its message type,
    null where the answer had none (refusal, annotations, audio, function_call, tool_calls)."""
    answer = client.chat.completions.create(model=SERVED, messages=[QUESTION], max_tokens=4).choices[0].message
    dumped = answer.model_dump()
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(dumped)
    again = client.chat.completions.create(
        model=SERVED, messages=[QUESTION, dumped, {"role": "user", "content": "Why?"}], max_tokens=4)
    assert again.choices[0].message.content


def test_a_tool_call_answer_dumped_by_the_sdk_is_taken_back(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=SERVED, messages=[QUESTION], tools=[CITY_TOOL],
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=30)
    message = answer.choices[0].message
    assert message.tool_calls and message.content is None
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "recorded"}
    again = client.chat.completions.create(model=SERVED, messages=[QUESTION, message.model_dump(), result],
                                           tools=[CITY_TOOL], tool_choice="none", max_tokens=4)
    assert again.choices[0].message.content


def test_a_parsed_answer_is_taken_back_as_the_sdk_sends_it(client: openai.OpenAI) -> None:
    """parse()'s message object in the next request's messages: the SDK sends its `parsed` field too."""
    answer = client.chat.completions.parse(model=SERVED, messages=[QUESTION], response_format=City, max_tokens=30)
    message = answer.choices[0].message
    assert isinstance(message.parsed, City)
    again = client.chat.completions.create(
        model=SERVED, messages=[QUESTION, message, {"role": "user", "content": "Why?"}], max_tokens=4)  # type: ignore[list-item]
    assert again.choices[0].message.content


@pytest.mark.parametrize(("field", "value"), [
    ("refusal", "I can't help with that."), ("annotations", [{"type": "url_citation"}]),
    ("audio", {"id": "audio_1"}), ("function_call", {"name": "f", "arguments": "{}"})])
def test_what_an_answer_message_would_add_to_the_turn_is_refused(server: Server, field: str, value: Any) -> None:
    """Only the values that add nothing are taken: a refusal, citations, an audio answer or a legacy function call
    would be dropped from the prompt, so each is a 400 naming it."""
    sent_back = {"role": "assistant", "content": "Paris", field: value}
    response = chat(server, {"messages": [QUESTION, sent_back, {"role": "user", "content": "Why?"}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == f"messages[1].{field}"


# --------------------------------------------------------------------------------------------
# a response format beside a forced tool call


def test_a_named_tool_call_with_a_response_format_is_the_call(client: openai.OpenAI) -> None:
    """The openai SDK's parse() with tools: the format shapes the message's text, which a forced call does not
    write (OpenAI takes both); the call's arguments follow the tool's schema."""
    tool = openai.pydantic_function_tool(City, name="record_city")
    answer = client.chat.completions.parse(
        model=SERVED, messages=[QUESTION], response_format=City, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "record_city"}}, max_tokens=30)
    message = answer.choices[0].message
    assert message.content is None and message.parsed is None
    assert message.tool_calls and isinstance(message.tool_calls[0].function.parsed_arguments, City)


def chat_of(body: dict[str, Any]) -> Any:
    return chat_request(decode_body(msgspec.json.encode(body), ChatBody), "r", 0.0)


def test_a_response_format_beside_a_forced_call_is_still_checked() -> None:
    body = {"model": SERVED, "messages": [QUESTION], "tools": [CITY_TOOL], "tool_choice": "required"}
    with_format = chat_of({**body, "response_format": {"type": "json_object"}})
    assert with_format.params.structured_outputs == chat_of(body).params.structured_outputs  # the call's schema
    with pytest.raises(InvalidRequestError) as bad:
        chat_of({**body, "response_format": {"type": "json_schema"}})
    assert bad.value.param == "response_format.json_schema"
    for extension in ({"structured_outputs": {"choice": ["a"]}}, {"guided_regex": "a"}):
        with pytest.raises(InvalidRequestError) as conflict:  # vLLM's constraints shape the whole output
            chat_of({**body, **extension})
        assert conflict.value.param == "tool_choice" and next(iter(extension)) in conflict.value.message


def test_responses_text_format_beside_a_named_tool(server: Server, client: openai.OpenAI) -> None:
    """instructor's RESPONSES_TOOLS mode sends the model's schema as text.format and as the one named tool."""
    strict = openai.lib._pydantic.to_strict_json_schema(City)
    response = client.responses.create(
        model=SERVED, input="Which city is the capital of France?", max_output_tokens=30,
        text={"format": {"type": "json_schema", "name": "City", "schema": strict, "strict": True}},
        tools=[{"type": "function", "name": "City", "parameters": strict, "strict": True}],
        tool_choice={"type": "function", "name": "City"})
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(calls) == 1 and calls[0].name == "City"
    City.model_validate_json(calls[0].arguments)
    assert response.text.format.type == "json_schema"  # echoed as asked


def test_responses_include_encrypted_reasoning_is_taken(server: Server) -> None:
    """litellm's Anthropic-to-Responses bridge (an openai/ model behind litellm.anthropic.messages, as Claude Code
    through a litellm proxy) and Codex ask for reasoning.encrypted_content on every request: a 400 broke every
    turn. The reasoning a stateless client sends back is the reasoning item's text, which the next turn reads."""
    body = {"model": SERVED, "max_output_tokens": 4, "include": ["reasoning.encrypted_content"],
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]}
    response = HTTP.post(server.url + "/v1/responses", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert [item["type"] for item in response.json()["output"]] == ["message"]
    sent_back = [*body["input"], {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None,
                                  "content": [{"type": "reasoning_text", "text": "A greeting."}]},
                 {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
                 {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again"}]}]
    again = HTTP.post(server.url + "/v1/responses", json={**body, "input": sent_back}, timeout=120)
    assert again.status_code == 200, again.text
    refused = HTTP.post(server.url + "/v1/responses", json={**body, "include": ["web_search_call.results"]},
                        timeout=120)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "include[0]"


# --------------------------------------------------------------------------------------------
# stream options


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_stream_obfuscation_off_is_taken_on_is_refused(server: Server, route: str) -> None:
    """OpenAI's stream_options.include_obfuscation (the SDK's types carry it): false is what pagoda streams."""
    body: dict[str, Any] = {"model": SERVED, "max_tokens": 2, "stream": True}
    body.update({"messages": [QUESTION]} if "chat" in route else {"prompt": "Hello"})
    with HTTP.stream("POST", server.url + route, timeout=120,
                     json={**body, "stream_options": {"include_obfuscation": False}}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and all("obfuscation" not in line for line in lines)
    refused = HTTP.post(server.url + route, json={**body, "stream_options": {"include_obfuscation": True}},
                        timeout=120)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "stream_options.include_obfuscation"


# --------------------------------------------------------------------------------------------
# reasoning under vLLM's current name


def test_reasoning_comes_under_both_names_whole_and_streamed() -> None:
    """vLLM (0.11 on) and OpenRouter return the think block as `reasoning`; clients written before read
    `reasoning_content`: both carry it."""
    spec = ChatOutputSpec(reasoning_parser="qwen3")
    text = "<think>two and two</think>Four."
    message, _ = whole_message(spec, text)
    assert message["reasoning"] == message["reasoning_content"] == "two and two" and message["content"] == "Four."
    stream = ChoiceStream(spec)
    deltas = [d for piece in ("<think>two", " and two</think>", "Four.") for d in stream.push(piece)]
    deltas += stream.finish()[0]
    reasoning = [d for d in deltas if "reasoning" in d or "reasoning_content" in d]
    assert reasoning and all(d["reasoning"] == d["reasoning_content"] for d in reasoning)
    assert "".join(d["reasoning"] for d in reasoning) == "two and two"


# --------------------------------------------------------------------------------------------
# a forced call cut short, a tool that takes nothing


def test_a_required_call_cut_short_is_still_a_call() -> None:
    """tool_choice required with too few tokens: the whole calls, then the one being written with its arguments
    so far, as OpenAI answers (and as a named call was); the raw array came back as the message's content, which
    langchain, litellm and the agents SDK read as the model's text answer."""
    spec = ChatOutputSpec(tool_mode="required")
    cut = '[{"name": "f", "parameters": {"x": 3}}, {"name": "g", "parameters": {"city": "Pa'
    # `finished` (finish_reason "tool_calls" had it stopped) is False: the array was cut before its `]`
    message, finished = whole_message(spec, cut)
    assert not finished and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("f", '{"x": 3}'), ("g", '{"city": "Pa')]
    message, finished = whole_message(spec, '[{"name": "f", "param')
    assert not finished and [c["function"]["arguments"] for c in message["tool_calls"]] == [""]
    assert whole_message(spec, '[{"name": "f')[0]["content"] == '[{"name": "f'  # no name yet: no call to give
    stream = ChoiceStream(spec)
    assert stream.push(cut[:30]) == [] and stream.push(cut[30:]) == []
    deltas, finished = stream.finish()
    assert not finished and [d["tool_calls"][0].get("function", {}).get("arguments") for d in deltas] == [
        "", '{"x": 3}', "", '{"city": "Pa']


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_out_of_tokens_comes_back_as_a_call(client: openai.OpenAI, stream: bool) -> None:
    body: dict[str, Any] = {"model": SERVED, "messages": [QUESTION], "tools": [CITY_TOOL], "tool_choice": "required",
                            "max_tokens": 12, "temperature": 0}
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert choice.finish_reason == "length" and choice.message.content is None
    else:
        chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
        assert not any(c.choices[0].delta.content for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        names = [t.function.name for c in chunks for t in c.choices[0].delta.tool_calls or [] if t.function.name]
        arguments = "".join(t.function.arguments or "" for c in chunks for t in c.choices[0].delta.tool_calls or [])
        calls = [(name, arguments) for name in names]
    assert calls and calls[0][0] == "record_city"
    assert not calls[0][1] or not calls[0][1].endswith("}")  # cut short, not a whole object


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "now"}}])
def test_a_tool_without_parameters_is_called_with_none(client: openai.OpenAI, tool_choice: Any) -> None:
    """OpenAI: "omitting parameters defines a function with an empty parameter list"; the forced call's arguments
    were any object, so the model wrote some."""
    tool = {"type": "function", "function": {"name": "now", "description": "The time now."}}
    choice = client.chat.completions.create(model=SERVED, messages=[QUESTION], tools=[tool], tool_choice=tool_choice,
                                            parallel_tool_calls=False, max_tokens=30, temperature=0).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == [("now", "{}")]


# --------------------------------------------------------------------------------------------
# routes a library calls that pagoda does not serve


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations", "/v1/files"])
def test_a_form_to_a_route_not_served_is_a_404(server: Server, client: openai.OpenAI, path: str) -> None:
    """The openai SDK posts multipart forms (client.audio.transcriptions.create, client.files.create): the answer
    is the route's 404, not a 415 telling it to send JSON to a route that is not there."""
    response = HTTP.post(server.url + path, files={"file": ("a.wav", b"RIFF0000")}, data={"model": SERVED},
                         timeout=120)
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model=SERVED, file=("a.wav", b"RIFF0000"))
    form = HTTP.post(server.url + "/v1/chat/completions", files={"file": ("a", b"x")}, timeout=120)
    assert form.status_code == 415  # a route that is served still says what it reads


# --------------------------------------------------------------------------------------------
# allowed_tools: a subset of the tools to choose from


WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}


def allowed(mode: str, *names: str) -> dict[str, Any]:
    return {"type": "allowed_tools",
            "allowed_tools": {"mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}


def test_allowed_tools_is_its_mode_over_the_tools_it_names() -> None:
    """pydantic-ai (OpenAIProvider, any base_url) sends OpenAI's allowed_tools tool_choice to restrict a call to
    some tools; it was a 400 naming a 'named tool_choice'."""
    body = {"model": SERVED, "messages": [QUESTION], "tools": [CITY_TOOL, WEATHER_TOOL]}
    required = chat_of({**body, "tool_choice": allowed("required", "weather")})
    only_weather = chat_of({**body, "tool_choice": "required", "tools": [WEATHER_TOOL]})
    assert required.params.structured_outputs == only_weather.params.structured_outputs
    assert [t["function"]["name"] for t in required.tools] == ["weather"]
    auto = chat_of({**body, "tool_choice": allowed("auto", "record_city", "weather")})
    assert auto.params.structured_outputs is None and len(auto.tools) == 2
    spec = chat_output_spec(decode_body(msgspec.json.encode({**body, "tool_choice": allowed("required", "weather")}),
                                        ChatBody), "hermes", None)
    assert spec.tool_mode == "required"
    for choice, param in ((allowed("required", "nope"), "tool_choice.allowed_tools.tools[0]"),
                          (allowed("none", "weather"), "tool_choice.allowed_tools"),
                          (allowed("required"), "tool_choice.allowed_tools"),
                          ({**allowed("auto", "weather"), "extra": 1}, "tool_choice.extra")):
        with pytest.raises(InvalidRequestError) as bad:
            chat_of({**body, "tool_choice": choice})
        assert bad.value.param == param


def test_allowed_tools_required_calls_one_of_them(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=SERVED, messages=[QUESTION], tools=[CITY_TOOL, WEATHER_TOOL], tool_choice=allowed("required", "weather"),
        parallel_tool_calls=False, max_tokens=30, temperature=0)  # type: ignore[arg-type]
    calls = answer.choices[0].message.tool_calls or []
    assert answer.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["weather"]
    response = client.responses.create(
        model=SERVED, input="Which city is the capital of France?", max_output_tokens=30, parallel_tool_calls=False,
        tools=[{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"],
                "strict": True} for t in (CITY_TOOL, WEATHER_TOOL)],
        tool_choice={"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "weather"}]})
    assert [(item.type, getattr(item, "name", None)) for item in response.output] == [("function_call", "weather")]
    with pytest.raises(openai.BadRequestError) as unknown:  # named as the Responses body names it
        client.responses.create(model=SERVED, input="Hi", max_output_tokens=1, tools=[
            {"type": "function", "name": "weather", "parameters": WEATHER_TOOL["function"]["parameters"]}],
            tool_choice={"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "nope"}]})
    assert unknown.value.body["param"] == "tool_choice.tools[0]"  # type: ignore[index]


def test_responses_input_tokens_counts_what_the_response_would_run(server: Server, client: openai.OpenAI) -> None:
    """OpenAI's POST /v1/responses/input_tokens (client.responses.input_tokens.count; litellm's count_tokens for an
    openai/ model, pydantic-ai's count_tokens_before_request): it was a 405."""
    tools = [{"type": "function", "name": "record_city", "parameters": CITY_SCHEMA}]
    for extra in ({}, {"instructions": "Be brief.", "tools": tools}):
        counted = client.responses.input_tokens.count(model=SERVED, input="Which city is the capital of France?",
                                                      **extra)  # type: ignore[arg-type]
        ran = client.responses.create(model=SERVED, input="Which city is the capital of France?",
                                      max_output_tokens=1, **extra)  # type: ignore[arg-type]
        assert counted.object == "response.input_tokens"
        assert ran.usage is not None and counted.input_tokens == ran.usage.input_tokens
    counted = client.responses.input_tokens.count(model=SERVED, instructions="Be brief.")  # input is optional
    ran = client.responses.create(model=SERVED, instructions="Be brief.", max_output_tokens=1)
    assert ran.usage is not None and counted.input_tokens == ran.usage.input_tokens > 0
    refused = HTTP.post(server.url + "/v1/responses/input_tokens", json={"input": "Hi", "max_output_tokens": 4},
                        timeout=120)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_output_tokens"
