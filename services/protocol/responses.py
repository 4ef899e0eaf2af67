"""OpenAI's Responses API (POST /v1/responses): its body turned into a chat request, and its answer built from the
completion's text as output items (reasoning, message, function calls), whole or as the stream's events.

The request side maps onto chat: `input` items become chat messages (`instructions` a system message first,
function_call / function_call_output items assistant tool calls and tool messages), Responses' flat function tools
chat's nested ones, `text.format` chat's `response_format`; chat's own checks and wire message follow. The answer
side reads the text through chat's ChoiceStream (the tool-call and reasoning parsers), one stream for both modes,
so a streamed answer ends with exactly the response a non-streamed one returns. The api renders it (the tokenizer
sends text): every event needs the items before it and the final response the whole output.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from pagoda.services.protocol.chat_output import ChatOutputSpec, ChoiceStream
from pagoda.services.protocol.render import Choice, Renderer, ResponseView, chat_logprobs, encode_json
from pagoda.services.protocol.schemas import MAX_TURNS, ChatBody, MessageBody, check_reasoning_effort, decode_body
from pagoda.services.protocol.schemas import reject_unknown_keys as _keys
from pagoda.services.protocol.schemas import require as _require
from pagoda.shared.errors import InvalidRequestError, PagodaError
from pagoda.shared.messages import FinishReason, PositionLogprobs, TextDelta

LOGPROBS_INCLUDE = "message.output_text.logprobs"
REASONING_INCLUDE = "reasoning.encrypted_content"  # taken: the reasoning comes back as text (see _include)
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds

# Fields of OpenAI's (or vLLM's) Responses request that pagoda refuses unless null: field -> why (the 400's message).
REFUSED_FIELDS = {
    "previous_response_id": "responses are not stored here (the server keeps them with --responses-store N): send the "
                            "whole conversation in input",
    "conversation": "conversations are not stored here: send the whole conversation in input",
    "prompt": "stored prompt templates are not served: send instructions and input",
    "max_tool_calls": "it bounds calls to built-in tools, which pagoda does not have (parallel_tool_calls: false "
                      "allows one function call)",
    "prompt_cache_retention": "the prefix cache keeps blocks while memory allows; its retention is not set per request",
    "prompt_cache_options": "the prefix cache keeps blocks while memory allows; its retention is not set per request",
    "context_management": "server-side context compaction is not implemented",
    "enable_response_messages": "the rendered prompt is not returned; use /tokenize",
    "previous_input_messages": "send the conversation in input",
    "request_id": "a response's id is the server's here (chat and completions take vLLM's request_id and the "
                  "X-Request-Id header)",
}
# A field taken at the values that change nothing here: field -> (those values, why others are refused).
NO_OP_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    # taken by the api when the response store is kept (services/api/background.py)
    "background": ((None, False), "background responses need the response store (--responses-store N)"),
    "truncation": ((None, "disabled"), "truncation 'auto' (dropping the conversation's first items) is not "
                                       "implemented: a conversation past the context is refused"),
}
ITEM_STATUSES = ("in_progress", "completed", "incomplete")  # an output item's, as a client may send it back
# Fields of function_call and function_call_output items that the openai SDK writes, null, when it serializes one
# (model_dump(by_alias=True)): field -> why a value is refused.
CALL_NULL_FIELDS = {
    "async": "calls run as the client runs them; pagoda has no asynchronous tool calls",
    "caller": "only the model calls functions here (no programmatic tool calling)",
    "namespace": "tools are not grouped in namespaces here",
}
INPUT_PART_KINDS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}


class ResponsesBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/responses; every field is honoured, taken at a value that changes nothing, or refused."""

    # items: at most MAX_TURNS. Optional as OpenAI's (instructions alone make a prompt; input_tokens counts them)
    input: str | Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_TURNS)] | None = None
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    # metadata only: echoed in the response, they change nothing about the answer
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None  # either value: nothing is kept after the answer (docs/vllm-compat.md)
    # chat's routing key (echoed too): requests with the same key go to the same data-parallel replica
    prompt_cache_key: str | None = None
    service_tier: str | None = None  # chat's (auto and default: the server's one tier)
    # NO_OP_VALUES
    background: bool | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None  # effort: chat's reasoning_effort; any other key only null (no summaries)
    # vLLM's extensions of its ResponsesRequest, as chat takes them; chat_template_kwargs and truncation as chat's
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = None
    cache_salt: str | None = None
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, str | int | float | bool] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    # REFUSED_FIELDS: null is taken as not given
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    context_management: Any = None
    enable_response_messages: Any = None
    previous_input_messages: Any = None
    request_id: Any = None


def decode_responses_body(data: bytes) -> ResponsesBody:
    return decode_body(data, ResponsesBody)


# OpenAI's POST /v1/responses/input_tokens takes the fields that make the prompt (and chat_template_kwargs, which the
# template reads); the others would change no count, so they are refused rather than taken and ignored.
INPUT_TOKENS_FIELDS = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                       "reasoning", "truncation", "conversation", "previous_response_id", "chat_template_kwargs")


def decode_input_tokens_body(data: bytes) -> ResponsesBody:
    """A body of POST /v1/responses/input_tokens: a Responses body of INPUT_TOKENS_FIELDS only."""
    body = decode_body(data, ResponsesBody)
    extra = next((name for name in body.__struct_fields__
                  if name not in INPUT_TOKENS_FIELDS and getattr(body, name) is not None), None)
    _require(extra is None, str(extra), f"Unrecognized request argument supplied: {extra} (input_tokens counts the "
                                        f"prompt; it takes {', '.join(INPUT_TOKENS_FIELDS)})")
    return body


# --------------------------------------------------------------------------------------------
# the request: a chat request


@dataclass(slots=True, frozen=True)
class ChatForm:
    """A Responses body as chat: the body chat_request takes, and what the response echoes of the request."""

    chat: ChatBody
    constraint: str | None  # the Responses field that asked for a constraint (its compile error names it)
    settings: dict[str, Any]  # the request's settings, echoed in every response object


def to_chat(body: ResponsesBody) -> ChatForm:
    """The chat request a Responses body asks for; InvalidRequestError names the Responses field at fault."""
    _check_fields(body)
    # here: chat's check allows max_tokens 0 for prompt scoring, and its message names prompt_logprobs and echo,
    # which Responses does not have (the upper bound stays chat's, renamed)
    _require(body.max_output_tokens is None or body.max_output_tokens >= 1, "max_output_tokens",
             "max_output_tokens must be at least 1")
    want_logprobs = _include(body.include or [])
    _require(want_logprobs or not body.top_logprobs, "top_logprobs",
             f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]")
    chat_tools, echo_tools = _function_tools(body.tools or [])
    response_format, echo_format = _text_format(body.text)
    chat = ChatBody(
        messages=input_messages(body), model=body.model, max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, logprobs=want_logprobs or None,
        top_logprobs=body.top_logprobs if want_logprobs else None, tools=chat_tools or None,
        tool_choice=_tool_choice(body.tool_choice, bool(chat_tools)), parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format, stream=body.stream, user=body.user,
        safety_identifier=body.safety_identifier, metadata=body.metadata, top_k=body.top_k,
        repetition_penalty=body.repetition_penalty, seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos,
        logit_bias=body.logit_bias, skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output, priority=body.priority,
        cache_salt=body.cache_salt, prompt_cache_key=body.prompt_cache_key, structured_outputs=body.structured_outputs,
        chat_template_kwargs=body.chat_template_kwargs, truncate_prompt_tokens=body.truncate_prompt_tokens,
        truncation_side=body.truncation_side, service_tier=body.service_tier, reasoning_effort=_effort(body))
    constraint = None
    if body.tool_choice == "required" or (isinstance(body.tool_choice, dict) and body.tool_choice.get("mode")
                                           != "auto"):
        constraint = "tools"  # decoded under a schema built from the functions' parameters
    elif response_format is not None and response_format["type"] != "text":
        constraint = "text.format"
    elif body.structured_outputs is not None:
        constraint = "structured_outputs"
    settings = {
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "prompt_cache_key": body.prompt_cache_key, "safety_identifier": body.safety_identifier,
        "text": {"format": echo_format}, "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": echo_tools, "top_logprobs": body.top_logprobs if body.top_logprobs is not None else 0,
        "user": body.user, "reasoning": {"effort": _effort(body), "summary": None}}
    return ChatForm(chat, constraint, settings)


def _effort(body: ResponsesBody) -> str | None:
    """`reasoning.effort` (checked by _check_reasoning), or None."""
    return (body.reasoning or {}).get("effort")


def _check_fields(body: ResponsesBody) -> None:
    for name, reason in REFUSED_FIELDS.items():
        _require(getattr(body, name) is None, name, f"{name} is not supported: {reason}")
    for name, (values, reason) in NO_OP_VALUES.items():
        value = getattr(body, name)
        _require(value in values, name, f"{name} {value!r} is not supported: {reason}")
    _check_reasoning(body.reasoning or {})
    _require(body.stream_options is None or bool(body.stream), "stream_options",
             "stream_options is only allowed when stream is true")
    options = body.stream_options or {}
    _keys(options, {"include_obfuscation"}, "stream_options", 'stream_options is {"include_obfuscation": false}')
    _require(not options.get("include_obfuscation"), "stream_options.include_obfuscation",
             "stream obfuscation is not implemented: events carry no obfuscation field")
    metadata = body.metadata or {}
    _require(len(metadata) <= MAX_METADATA_PAIRS and all(
        len(k) <= MAX_METADATA_KEY_CHARS and len(v) <= MAX_METADATA_VALUE_CHARS for k, v in metadata.items()),
        "metadata", f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys of at most {MAX_METADATA_KEY_CHARS} "
                    f"characters and values of at most {MAX_METADATA_VALUE_CHARS}")


def _check_reasoning(reasoning: dict[str, Any]) -> None:
    """`reasoning.effort` is chat's reasoning_effort (vLLM's Responses passes it to the template the same way);
    summaries are not made (the reasoning comes back whole, as a reasoning item's text), so `summary`,
    `generate_summary` and any other key are taken only null."""
    check_reasoning_effort(reasoning.get("effort"), "reasoning.effort")
    for key, value in reasoning.items():
        _require(key == "effort" or value is None, f"reasoning.{key}",
                 f"reasoning.{key} is not supported: no reasoning summaries are made (with --reasoning-parser the "
                 "reasoning comes back whole, as a reasoning item); reasoning.effort is the one setting taken")


def _include(include: list[str]) -> bool:
    """Whether `include` asks for the message's logprobs. `reasoning.encrypted_content` asks for what a client
    without a response store sends back so the next turn keeps the reasoning: here that is the reasoning item's
    text, always returned and read back from `input`, so it is taken and nothing is encrypted (litellm's
    Anthropic-to-Responses bridge and Codex send it on every request; it was a 400)."""
    for i, name in enumerate(include):
        _require(name in (LOGPROBS_INCLUDE, REASONING_INCLUDE), f"include[{i}]",
                 f"include supports {LOGPROBS_INCLUDE!r} and {REASONING_INCLUDE!r} only; {name!r} asks for values "
                 "of built-in tools or input images, which pagoda does not have")
    return LOGPROBS_INCLUDE in include


def input_messages(body: ResponsesBody) -> list[MessageBody]:
    """`instructions` as a system message, then `input`'s items as chat messages. A reasoning item starts an
    assistant turn with that reasoning (chat's `reasoning`, which the template gets: Qwen3's renders it in tool
    loops), which the answer's message and calls after it join (an answer's items come in that order). A
    function_call item joins the assistant turn just before it (a parallel call, or the text the model wrote before
    calling); its output becomes a tool message."""
    messages = [MessageBody(role="system", content=body.instructions)] if body.instructions is not None else []
    if isinstance(body.input, str):
        return [*messages, MessageBody(role="user", content=body.input)]
    if body.input is None:
        _require(bool(messages), "input", "input is required when there are no instructions: nothing is stored, "
                                          "so a response has no earlier conversation to answer")
        return messages
    _require(len(body.input) > 0, "input", "input must not be empty")
    calls: dict[str, str] = {}  # call_id -> function name, of the function_call items so far
    answered: set[str] = set()
    joinable = False  # the last message is an assistant turn a function call joins
    reasoning_only = False  # the last message is an assistant turn of a reasoning item alone, which its text joins
    item_ids: set[str] = set()
    for i, item in enumerate(body.input):
        param = f"input[{i}]"
        _require(isinstance(item, dict), param, "an input item is an object")
        _unique_id(item, param, item_ids)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            message = _message(item, param)
            if reasoning_only and message.role == "assistant":
                messages[-1].content = message.content
            else:
                messages.append(message)
            joinable = messages[-1].role == "assistant"
            reasoning_only = False
        elif kind == "function_call":
            call = _function_call(item, param)
            _require(call["id"] not in calls, f"{param}.call_id", f"call_id {call['id']!r} is used twice")
            calls[call["id"]] = call["function"]["name"]
            if joinable:  # appended in place: a copy per call made a long run of parallel calls quadratic
                messages[-1].tool_calls = messages[-1].tool_calls or []
                messages[-1].tool_calls.append(call)
            else:
                messages.append(MessageBody(role="assistant", tool_calls=[call]))
                joinable = True
            reasoning_only = False
        elif kind == "function_call_output":
            call_id, output = _function_call_output(item, param)
            _require(call_id in calls, f"{param}.call_id",
                     f"No tool call found for function call output with call_id {call_id!r}: send its function_call "
                     "item before it")
            answered.add(call_id)
            messages.append(MessageBody(role="tool", content=output, tool_call_id=call_id, name=calls[call_id]))
            joinable = reasoning_only = False
        elif kind == "reasoning":
            reasoning = _reasoning(item, param)
            if reasoning_only:  # two in a row: one turn's
                messages[-1].reasoning = f"{messages[-1].reasoning}\n{reasoning}"
            else:
                messages.append(MessageBody(role="assistant", content="", reasoning=reasoning))
            joinable = reasoning_only = True
        elif kind == "item_reference":
            raise InvalidRequestError("item references are not supported: responses are not stored here; send the "
                                      "item itself", param=f"{param}.type")
        else:
            raise InvalidRequestError(f"input items are messages, function_call, function_call_output and reasoning; "
                                      f"{kind!r} items are not accepted (pagoda has no built-in tools)",
                                      param=f"{param}.type")
    missing = next((call_id for call_id in calls if call_id not in answered), None)
    _require(missing is None, "input", f"No tool output found for function call {missing!r}: send a "
                                       "function_call_output item for it")
    return messages


def _unique_id(item: dict[str, Any], param: str, seen: set[str]) -> None:
    """An item's id (its type checked with the item's fields) names one item of the conversation, as OpenAI's: an
    item twice (the previous response's output sent again beside previous_response_id) would be read twice, and
    input_items, which pages by id, could not tell the two apart."""
    item_id = item.get("id")
    if not isinstance(item_id, str):
        return
    _require(item_id not in seen, f"{param}.id",
             f"Duplicate item found with id {item_id!r}: an input item's id names one item (with "
             "previous_response_id, the previous response's items are there already: send only what follows them)")
    seen.add(item_id)


def stored_input_items(given: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`input` (checked by to_chat) as the items a response store lists (GET .../input_items) and a later turn starts
    from, in OpenAI's item shape: a string as a user message; a message with `type` and `status`, its text content as
    one input_text part (output_text for an assistant's); every item with an id (its own, or a new one)."""
    if given is None:
        return []
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    items = []
    for item in given:
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, str):
                part_type = "output_text" if item.get("role") == "assistant" else "input_text"
                part: dict[str, Any] = {"type": part_type, "text": content}
                content = [{**part, "annotations": []} if part_type == "output_text" else part]
            item = {**item, "type": "message", "content": content, "status": item.get("status") or "completed"}
        if not isinstance(item.get("id"), str):
            item = {**item, "id": _new_id("msg" if kind == "message" else "item")}
        items.append(item)
    return items


def _reasoning(item: dict[str, Any], param: str) -> str:
    """A reasoning item's text: its reasoning_text parts (the model's reasoning, as pagoda's answers carry it), or
    without any its summary_text parts (OpenAI's answers carry a summary only), joined by newlines."""
    _keys(item, {"type", "id", "summary", "content", "encrypted_content", "status"}, param,
          "a reasoning item is {type, id, summary, content, encrypted_content, status}")
    _check_echoed(item, param, {"summary": list, "content": list, "encrypted_content": str})
    key, kind = ("content", "reasoning_text") if item.get("content") else ("summary", "summary_text")
    texts = []
    for j, part in enumerate(item.get(key) or []):
        _require(isinstance(part, dict) and part.get("type") == kind and isinstance(part.get("text"), str)
                 and set(part) <= {"type", "text"}, f"{param}.{key}[{j}]",
                 f'a reasoning item\'s {key} holds {{"type": "{kind}", "text": string}} parts')
        texts.append(part["text"])
    return "\n".join(texts)


def _check_echoed(obj: dict[str, Any], param: str, types: dict[str, type], item: bool = True) -> None:
    """Fields a client sends back from an earlier answer and nothing here reads (an item's id and status, a part's
    annotations, ...): null or of their type, else a 400 naming the field rather than a value ignored."""
    if item:
        types = {"id": str, **types}
        status = obj.get("status")
        _require(status is None or (isinstance(status, str) and status in ITEM_STATUSES), f"{param}.status",
                 f"status must be one of {', '.join(ITEM_STATUSES)}, got {status!r}")
    for key, kind in types.items():
        _require(obj.get(key) is None or isinstance(obj[key], kind), f"{param}.{key}",
                 f"{key} must be {'a string' if kind is str else 'an array'}")


def _message(item: dict[str, Any], param: str) -> MessageBody:
    _keys(item, {"type", "role", "content", "id", "status", "phase"}, param,
          "a message item is {type: message, role, content}")
    _check_echoed(item, param, {"phase": str})
    role = item.get("role")
    _require(role in ("user", "system", "developer", "assistant"), f"{param}.role",
             f"role must be one of user, system, developer, assistant, got {role!r}")
    content = item.get("content")
    if isinstance(content, list):
        content = "\n".join(_part_text(part, f"{param}.content[{j}]") for j, part in enumerate(content))
    _require(isinstance(content, str), f"{param}.content", "content must be a string or a list of content parts")
    return MessageBody(role=role, content=content)  # a developer turn reaches the template as chat gives it


def _part_text(part: Any, param: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text"):
        allowed = {"type", "text", "annotations", "logprobs"} if kind == "output_text" else {"type", "text"}
        _require(set(part) <= allowed and isinstance(part.get("text"), str), param,
                 f'an {kind} part is {{"type": "{kind}", "text": string}}')
        _check_echoed(part, param, {"annotations": list, "logprobs": list}, item=False)
        return part["text"]
    if kind == "refusal":
        _require(set(part) <= {"type", "refusal"} and isinstance(part.get("refusal"), str), param,
                 'a refusal part is {"type": "refusal", "refusal": string}')
        return part["refusal"]
    media = INPUT_PART_KINDS.get(kind) if isinstance(kind, str) else None  # a type may be any JSON value
    _require(media is None, f"{param}.type",
             f"{kind} parts are not accepted: pagoda serves text models ({media} input is not read)")
    raise InvalidRequestError(f"content parts are input_text, output_text or refusal, got {kind!r}",
                              param=f"{param}.type" if isinstance(part, dict) else param)


def _check_null_fields(item: dict[str, Any], param: str) -> None:
    """CALL_NULL_FIELDS, which the SDK writes (null) when it serializes a call or its output: taken when null."""
    for key, reason in CALL_NULL_FIELDS.items():
        _require(item.get(key) is None, f"{param}.{key}", f"{key} is not supported: {reason}")


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    _keys(item, {"type", "call_id", "name", "arguments", "id", "status", *CALL_NULL_FIELDS}, param,
          "a function_call item is {type, call_id, name, arguments}")
    _check_echoed(item, param, {})
    _check_null_fields(item, param)
    for key in ("call_id", "name", "arguments"):
        value = item.get(key)
        _require(isinstance(value, str) and (bool(value) or key == "arguments"), f"{param}.{key}",
                 f"{key} must be a {'' if key == 'arguments' else 'non-empty '}string")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _function_call_output(item: dict[str, Any], param: str) -> tuple[str, str]:
    _keys(item, {"type", "call_id", "output", "id", "status", "name", *CALL_NULL_FIELDS}, param,
          "a function_call_output item is {type, call_id, output}")
    _check_echoed(item, param, {"name": str})  # the function's name: the call's is used
    _check_null_fields(item, param)
    call_id, output = item.get("call_id"), item.get("output")
    _require(isinstance(call_id, str) and bool(call_id), f"{param}.call_id", "call_id must be a non-empty string")
    if isinstance(output, list):
        output = "\n".join(_part_text(part, f"{param}.output[{j}]") for j, part in enumerate(output))
    _require(isinstance(output, str), f"{param}.output", "output must be a string or a list of input_text parts")
    return call_id, output


def _function_tools(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(chat's tools, the response's echo) of Responses' flat function tools."""
    chat, echo = [], []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        _require(kind == "function", f"tools[{i}].type",
                 f"only function tools are served; {kind!r} is a built-in tool pagoda does not have")
        _keys(tool, {"type", "name", "description", "parameters", "strict"}, f"tools[{i}]",
              'a tool is {"type": "function", "name", "description"?, "parameters"?, "strict"?}')
        name, description, parameters, strict = (tool.get(key) for key in ("name", "description", "parameters",
                                                                            "strict"))
        _require(isinstance(name, str) and bool(name), f"tools[{i}].name", "name must be a non-empty string")
        _require(description is None or isinstance(description, str), f"tools[{i}].description",
                 "description must be a string")
        _require(parameters is None or isinstance(parameters, dict), f"tools[{i}].parameters",
                 "parameters must be a JSON schema object")
        _require(strict is None or isinstance(strict, bool), f"tools[{i}].strict", "strict must be a boolean")
        function = {key: value for key, value in (("name", name), ("description", description),
                                                  ("parameters", parameters), ("strict", strict))
                    if value is not None}
        chat.append({"type": "function", "function": function})
        echo.append({"type": "function", "name": name, "description": description, "parameters": parameters,
                     "strict": strict})
    return chat, echo


def _tool_choice(choice: str | dict[str, Any] | None, has_tools: bool) -> str | dict[str, Any] | None:
    """Chat's tool_choice (its checks follow: none/auto/required, a function among the tools). 'auto' without tools
    is OpenAI's default, which every response echoes: taken as not given (chat refuses it without tools)."""
    if choice == "auto" and not has_tools:
        return None
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "allowed_tools":  # the Responses form: its mode and tools beside the type
        _keys(choice, {"type", "mode", "tools"}, "tool_choice", 'allowed_tools is {"type": "allowed_tools", '
                                                                '"mode": "auto" | "required", "tools": [...]}')
        refs = choice.get("tools")
        _require(isinstance(refs, list) and all(isinstance(ref, dict) and ref.get("type") == "function"
                                                and set(ref) <= {"type", "name"} for ref in refs),
                 "tool_choice.tools", 'an allowed tool is {"type": "function", "name": string} (pagoda has no '
                                      'built-in tools)')
        assert isinstance(refs, list)
        return {"type": "allowed_tools", "allowed_tools": {
            "mode": choice.get("mode"), "tools": [{"type": "function", "function": {"name": ref.get("name")}}
                                                  for ref in refs]}}
    _require(choice.get("type") == "function", "tool_choice",
             f"tool_choice {choice.get('type')!r} names a built-in tool or tool set pagoda does not have; use none, "
             'auto, required or {"type": "function", "name": ...}')
    _keys(choice, {"type", "name"}, "tool_choice", 'a named tool_choice is {"type": "function", "name": string}')
    _require(isinstance(choice.get("name"), str), "tool_choice.name", "name must be a string")
    return {"type": "function", "function": {"name": choice["name"]}}


def _text_format(text: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(chat's response_format, the response's text.format) of `text`."""
    text = text or {}
    _keys(text, {"format", "verbosity"}, "text", 'text is {"format": {"type": "text" | "json_object" | '
                                                 '"json_schema", ...}}')
    _require(text.get("verbosity") is None, "text.verbosity",
             "text.verbosity is not supported: verbosity is not passed to the model")
    fmt = text.get("format")
    if fmt is None:
        return None, {"type": "text"}
    _require(isinstance(fmt, dict), "text.format", "text.format must be an object")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        _keys(fmt, {"type"}, "text.format", f'this format is {{"type": "{kind}"}}')
        return {"type": kind}, {"type": kind}
    _require(kind == "json_schema", "text.format.type",
             f"text.format type must be text, json_object or json_schema, got {kind!r}")
    _keys(fmt, {"type", "name", "schema", "strict", "description"}, "text.format",
          "a json_schema format is {type, name, schema, strict?, description?}")
    spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
    return {"type": "json_schema", "json_schema": spec}, dict(fmt)


# Chat's names for what a Responses body calls otherwise: a refusal by chat's checks or the tokenizer names the
# Responses field.
_CHAT_PARAMS = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
                ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                ("messages", "input"), ("logprobs", "top_logprobs"),
                ("tool_choice.allowed_tools.tools", "tool_choice.tools"), ("tool_choice.allowed_tools", "tool_choice"))


def responses_param(param: str | None) -> str | None:
    """The Responses field for a chat parameter (max_tokens -> max_output_tokens, response_format -> text.format,
    messages -> input); other names are the same in both."""
    if param is None:
        return None
    for chat, responses in _CHAT_PARAMS:
        if param == chat or param.startswith((f"{chat}.", f"{chat}[")):
            if chat == "messages":
                return "input"  # message indices shift with instructions and joined calls: the input as a whole
            return responses + param[len(chat):]
    return param


def rename_error(exc: PagodaError) -> PagodaError:
    """`exc` naming the Responses field instead of chat's (its message too, for max_tokens)."""
    param = responses_param(exc.param)
    if param != exc.param:
        if exc.param in ("max_tokens", "max_completion_tokens"):
            exc.message = exc.message.replace(exc.param, "max_output_tokens")
        elif exc.param == "messages":
            exc.message = exc.message.replace("(messages)", "(input)")
        exc.args = (exc.message,)
        exc.param = param
    return exc


def own_input_error(exc: PagodaError, num_earlier: int) -> PagodaError:
    """`exc` naming the client's own input item where a continued response's conversation put `num_earlier` items of
    the previous response before it (to_chat counts them): input[k] is the client's input[k - num_earlier]; an
    earlier item at fault is the previous response's."""
    index, rest = _input_index(exc.param)
    if num_earlier == 0 or index is None:
        return exc
    exc.param = f"input[{index - num_earlier}]{rest}" if index >= num_earlier else "previous_response_id"
    return exc


def _input_index(param: str | None) -> tuple[int | None, str]:
    """(k, what follows) of a param "input[k]..."; None when it names no input item."""
    if param is None or not param.startswith("input["):
        return None, ""
    digits, bracket, rest = param[len("input["):].partition("]")
    return (int(digits), rest) if bracket and digits.isascii() and digits.isdigit() else (None, "")


# --------------------------------------------------------------------------------------------
# the answer: output items and events


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass(slots=True)
class OutputItem:
    """One item of the output as it is written: a reasoning item, a message (one output_text part) or a call."""

    kind: str  # "reasoning" | "message" | "function_call"
    id: str
    parts: list[str] = field(default_factory=list)  # its text (message, reasoning) or its arguments (call)
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # a message's tokens
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def part(self, as_ids: bool) -> dict[str, Any]:
        """Its content part (message, reasoning)."""
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        return {"type": "output_text", "text": self.text, "annotations": [],
                "logprobs": _logprobs(self.logprobs, as_ids)}

    def json(self, as_ids: bool) -> dict[str, Any]:
        if self.kind == "function_call":
            return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                    "arguments": self.text, "status": self.status}
        content = [self.part(as_ids)] if self.status != "in_progress" else []
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content, "status": self.status}
        return {"id": self.id, "type": "message", "role": "assistant", "status": self.status, "content": content}


def _logprobs(positions: list[PositionLogprobs], as_ids: bool) -> list[dict[str, Any]]:
    """An output_text part's logprobs (its Logprob: token, logprob, bytes, top_logprobs with bytes)."""
    return chat_logprobs(positions, as_ids)["content"]


def _event_logprobs(positions: list[PositionLogprobs], as_ids: bool) -> list[dict[str, Any]]:
    """output_text.delta and .done's logprobs: OpenAI's ResponseLogProb, which has no bytes (the part's has)."""
    return [{"token": lp["token"], "logprob": lp["logprob"],
             "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]} for top in lp["top_logprobs"]]}
            for lp in _logprobs(positions, as_ids)]


class OutputBuilder:
    """The output items of one completion, from its text as it comes: push() and finish() return the events (dicts
    without sequence numbers) the Responses stream sends for it; `items` is the output so far."""

    def __init__(self, spec: ChatOutputSpec, want_logprobs: bool, as_ids: bool = False) -> None:
        self.stream = ChoiceStream(spec)  # chat's tool-call and reasoning parsing, streamed
        self.want_logprobs = want_logprobs
        self.as_ids = as_ids
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None
        # whitespace-only content not shown yet, before a function call dropped; in pieces joined once (`+= text`
        # copied all of it on every token of a model looping on newlines)
        self.held_space: list[str] = []
        self.pending: list[PositionLogprobs] = []  # logprobs of tokens whose content is not shown yet
        self.num_reasoning_tokens = 0
        # tokens held while they may still open a think block (qwen3: `<`, `think`, ...): the block's if they do
        self.num_undecided_tokens = 0
        self.undecided: list[PositionLogprobs] = []
        self.finish_reason = -1

    def push(self, text: str, logprobs: list[PositionLogprobs], num_new_tokens: int) -> list[dict[str, Any]]:
        reasoning = self.stream.reasoning
        in_reasoning = reasoning is not None and reasoning.state == "reasoning"
        parts = self.stream.push(text)
        if reasoning is not None and reasoning.state == "start":
            self.num_undecided_tokens += num_new_tokens
            self.undecided.extend(logprobs)
        elif reasoning is not None and (in_reasoning or reasoning.state == "reasoning" or reasoning.strip_newlines):
            # the think block's tokens, its markers' and the newlines after it too (none is the message's text);
            # reasoning has no logprobs field: their logprobs are not shown
            self.num_reasoning_tokens += num_new_tokens + self.num_undecided_tokens
            self.num_undecided_tokens, self.undecided = 0, []
        else:
            self._decided_content()
            if self.want_logprobs:
                self.pending.extend(logprobs)
        return self._parts(parts)

    def _decided_content(self) -> None:
        """The tokens held at the start opened no think block: they are the message's."""
        if self.want_logprobs:
            self.pending.extend(self.undecided)
        self.num_undecided_tokens, self.undecided = 0, []

    def finish(self, reason: int) -> list[dict[str, Any]]:
        """The last parts, then the open item closed: incomplete when the completion ran out of tokens."""
        self.finish_reason = reason
        self._decided_content()
        parts, _ = self.stream.finish()
        events = self._parts(parts)
        if self.held_space or not self.items:  # an answer of whitespace (or nothing) is a message still
            events += self._content("", force=True)
        if self.pending and self.open is not None and self.open.kind == "message":
            # tokens with no text of their own at the end (a stop token shown by include_stop_str_in_output): their
            # logprobs come in a delta too, so that the deltas' add up to the message's
            events += self._content("", force=True)
        status = "incomplete" if reason == FinishReason.LENGTH else "completed"
        return events + self._close(status)

    def _parts(self, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for part in parts:
            if "reasoning_content" in part:
                events += self._reasoning(part["reasoning_content"])
            elif "content" in part:
                events += self._content(part["content"] or "")
            else:
                events += self._call(part["tool_calls"][0])
        return events

    def _item(self, kind: str, **fields: str) -> list[dict[str, Any]]:
        """Close the open item unless it is of this kind; open one of this kind if none is."""
        if self.open is not None and self.open.kind == kind and kind != "function_call":
            return []
        events = self._close("completed")
        self.open = OutputItem(kind, _new_id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]),
                               **fields)  # type: ignore[arg-type]
        self.items.append(self.open)
        index = len(self.items) - 1
        events.append({"type": "response.output_item.added", "output_index": index,
                       "item": self.open.json(self.as_ids)})
        if kind != "function_call":
            events.append({"type": "response.content_part.added", "item_id": self.open.id, "output_index": index,
                           "content_index": 0, "part": self.open.part(self.as_ids)})
        return events

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        events = self._item("reasoning")
        assert self.open is not None
        self.open.parts.append(text)
        return events + [{"type": "response.reasoning_text.delta", "item_id": self.open.id,
                          "output_index": len(self.items) - 1, "content_index": 0, "delta": text}]

    def _content(self, text: str, force: bool = False) -> list[dict[str, Any]]:
        if not force and (self.open is None or self.open.kind != "message") and not text.strip():
            if text:
                self.held_space.append(text)  # shown with the content that follows it, dropped before a call
            return []
        text, self.held_space = "".join(self.held_space) + text, []
        events = self._item("message")
        assert self.open is not None
        logprobs, self.pending = self.pending, []
        self.open.parts.append(text)
        self.open.logprobs.extend(logprobs)
        if not text and not logprobs:
            return events
        return events + [{"type": "response.output_text.delta", "item_id": self.open.id,
                          "output_index": len(self.items) - 1, "content_index": 0, "delta": text,
                          "logprobs": _event_logprobs(logprobs, self.as_ids)}]

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        function = delta.get("function", {})
        events: list[dict[str, Any]] = []
        if "id" in delta:  # a call's first delta: its id and name
            self.held_space = []
            self.pending.clear()
            events = self._item("function_call", call_id=delta["id"], name=function.get("name", ""))
        assert self.open is not None and self.open.kind == "function_call"
        arguments = function.get("arguments") or ""
        if arguments:
            self.open.parts.append(arguments)
            events.append({"type": "response.function_call_arguments.delta", "item_id": self.open.id,
                           "output_index": len(self.items) - 1, "delta": arguments})
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        index = len(self.items) - 1  # the open item is the last one (_item); list.index compared it with each before
        assert self.items[index] is item
        events: list[dict[str, Any]] = []
        if item.kind == "function_call":
            events.append({"type": "response.function_call_arguments.done", "item_id": item.id, "output_index": index,
                           "name": item.name, "arguments": item.text})
        else:
            done = "response.reasoning_text.done" if item.kind == "reasoning" else "response.output_text.done"
            text_done = {"type": done, "item_id": item.id, "output_index": index, "content_index": 0,
                         "text": item.text}
            if item.kind == "message":
                text_done["logprobs"] = _event_logprobs(item.logprobs, self.as_ids)
            events += [text_done, {"type": "response.content_part.done", "item_id": item.id, "output_index": index,
                                   "content_index": 0, "part": item.part(self.as_ids)}]
        return events + [{"type": "response.output_item.done", "output_index": index, "item": item.json(self.as_ids)}]


def response_usage(usage: dict[str, Any], num_reasoning_tokens: int) -> dict[str, Any]:
    """Responses' usage from chat's usage_dict. cache_write_tokens counts OpenAI's cache writes with a retention
    (prompt_cache_options), which pagoda does not offer: 0; cached_tokens counts the prefix cache's hits."""
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
            "total_tokens": usage["total_tokens"]}


class ResponsesRenderer(Renderer):
    """One response's answer: its events (streaming) and its response object, from the completion's deltas.

    It sees every batch, streamed or not (the api's Generation calls chunks() for it either way): the output items
    are built once, and the non-streamed body is the object a stream's response.completed carries."""

    route_name = "responses"

    def __init__(self, response_id: str, model: str, created_at: int, settings: dict[str, Any], spec: ChatOutputSpec,
                 *, stream: bool, want_logprobs: bool, temperature: float, top_p: float,
                 tokens_as_ids: bool = False, on_final: Callable[[dict[str, Any]], None] | None = None) -> None:
        super().__init__(response_id, model, created_at, want_logprobs=want_logprobs, include_usage=False,
                         tokens_as_ids=tokens_as_ids)
        self.settings = settings
        self.stream = stream
        self.temperature = temperature
        self.top_p = top_p
        self.builder = OutputBuilder(spec, want_logprobs, tokens_as_ids)
        self.sequence_number = 0
        # the finished response object, before the client has it (--responses-store keeps it: a client that sends
        # its previous_response_id as soon as it reads the answer finds it)
        self.on_final = on_final

    def prompt_accepted(self, prompt_reasoning: str) -> None:
        self.builder.stream.after_prompt(prompt_reasoning)

    def response(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        """The response object: the request's settings, the output so far and, once it ended, usage."""
        incomplete = status == "incomplete"
        return {
            "id": self.response_id, "object": "response", "created_at": self.created, "status": status,
            "background": self.settings.get("background", False),
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.settings["instructions"], "max_output_tokens": self.settings["max_output_tokens"],
            "max_tool_calls": None, "metadata": self.settings["metadata"], "model": self.model,
            "output": [item.json(self.tokens_as_ids) for item in self.builder.items],
            "parallel_tool_calls": self.settings["parallel_tool_calls"],
            "previous_response_id": self.settings.get("previous_response_id"),
            "prompt_cache_key": self.settings["prompt_cache_key"], "reasoning": self.settings["reasoning"],
            "safety_identifier": self.settings["safety_identifier"], "service_tier": "default",
            "temperature": self.temperature, "text": self.settings["text"],
            "tool_choice": self.settings["tool_choice"], "tools": self.settings["tools"],
            "top_logprobs": self.settings["top_logprobs"], "top_p": self.top_p, "truncation": "disabled",
            "usage": None if usage is None else response_usage(usage, self.builder.num_reasoning_tokens),
            "user": self.settings["user"]}

    @property
    def status(self) -> str:
        return "incomplete" if self.builder.finish_reason == FinishReason.LENGTH else "completed"

    def _events(self, events: list[dict[str, Any]]) -> bytes:
        """SSE bytes of these events, numbered in order; b"" when not streaming."""
        if not self.stream:
            return b""
        out = []
        for event in events:
            event["sequence_number"] = self.sequence_number
            self.sequence_number += 1
            out.append(b"event: " + event["type"].encode() + b"\ndata: " + encode_json(event) + b"\n\n")
        return b"".join(out)

    def opening(self, view: ResponseView) -> bytes:
        created = self.response("in_progress", None)
        return self._events([{"type": "response.created", "response": created},
                             {"type": "response.in_progress", "response": created}])

    def chunks(self, batch: list[tuple[Choice, TextDelta]]) -> bytes:
        events: list[dict[str, Any]] = []
        for _, delta in batch:
            if self.builder.finish_reason >= 0:
                continue
            events += self.builder.push(delta.text, delta.logprobs, delta.num_new_tokens)
            if delta.finish_reason >= 0:
                events += self.builder.finish(delta.finish_reason)
        return self._events(events)

    def closing(self, usage: dict[str, Any]) -> bytes:
        status = self.status
        return self._events([{"type": f"response.{status}", "response": self._final(usage)}])

    def body(self, view: ResponseView, usage: dict[str, Any]) -> dict[str, Any]:
        return self._final(usage)

    def _final(self, usage: dict[str, Any]) -> dict[str, Any]:
        response = self.response(self.status, usage)
        if self.on_final is not None:
            self.on_final(response)
        return response

    def stream_error(self, error: dict[str, Any]) -> bytes:
        """The `error` event that ends a stream which failed after its first event."""
        body = error.get("error", {})
        return self._events([{"type": "error", "code": body.get("code"), "message": body.get("message", ""),
                              "param": responses_param(body.get("param"))}])
