"""Anthropic's Messages API (POST /v1/messages): its body turned into a chat request, and its answer built from the
completion's text as content blocks (text, thinking, tool_use), whole or as the stream's events.

The request side maps onto chat, as the Responses API does (services/protocol/responses.py): `system` becomes a
system message, user turns' `tool_result` blocks tool messages, assistant turns' `tool_use` blocks tool calls, a last
assistant turn a prefill the answer continues (chat's continue_final_message); Anthropic's tools and tool_choice
become chat's. The answer side reads the text through chat's ChoiceStream (the tool-call and reasoning parsers), one
stream for both modes, so a streamed answer's events add up to exactly the message a non-streamed one returns.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from pagoda.services.protocol.chat_output import ChatOutputSpec, ChoiceStream
from pagoda.services.protocol.render import Choice, Renderer, ResponseView, encode_json, usage_dict
from pagoda.services.protocol.schemas import (
    MAX_TURNS,
    NO_BUDGET_HINT,
    ChatBody,
    MessageBody,
    check_reasoning_effort,
    decode_body,
)
from pagoda.services.protocol.schemas import reject_unknown_keys as _keys
from pagoda.services.protocol.schemas import require as _require
from pagoda.shared.errors import InvalidRequestError, PagodaError
from pagoda.shared.messages import MAX_INT32, FinishReason, TextDelta

# Fields of Anthropic's request that pagoda refuses unless null: field -> why (the 400's message).
REFUSED_FIELDS = {
    "container": "code-execution containers are not served (pagoda has no server tools)",
    "mcp_servers": "MCP connectors are not served: run the MCP client beside your own tool loop",
    "context_management": "server-side context editing is not implemented: send the conversation to keep",
    "diagnostics": "messages are not stored, so there is no earlier request to compare the cache against",
    "inference_geo": "inference runs where this server runs; no region is chosen per request",
}
# A field taken at the values that change nothing here: field -> (those values, why others are refused).
NO_OP_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "service_tier": ((None, "auto", "standard_only"), "this server has one service tier (standard)"),
    "speed": ((None, "standard"), "this server has one speed (standard)"),
}
# Fields of a tool_use block that the anthropic SDK writes, null, when a client sends an answer's block back whole
# (model_dump()): field -> why a value is refused.
TOOL_USE_NULL_FIELDS = {
    "caller": "only the model calls tools here (no programmatic tool calling)",
    "toolset_name": "tools are not grouped in toolsets here",
}
MEDIA_BLOCKS = {"image": "image", "document": "document", "search_result": "search result",
                "container_upload": "file"}
ERROR_PREFIX = "Error: "  # a tool_result with is_error: chat's tool messages have no error flag; the model reads it
CACHE_TTLS = (None, "5m", "1h")


class MessagesBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/messages; every field is honoured, taken at a value that changes nothing, or refused."""

    model: str
    max_tokens: int
    messages: Annotated[list[Any], msgspec.Meta(max_length=MAX_TURNS)]
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None  # user_id only: chat's user (metadata)
    output_config: dict[str, Any] | None = None  # format: chat's json_schema response_format; effort: reasoning_effort
    thinking: dict[str, Any] | None = None  # enabled (a budget, under --reasoning-parser), adaptive, disabled
    cache_control: dict[str, Any] | None = None  # the prefix cache caches every prompt: checked, changes nothing
    # NO_OP_VALUES
    service_tier: str | None = None
    speed: str | None = None
    # REFUSED_FIELDS: null is taken as not given
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    diagnostics: Any = None
    inference_geo: Any = None


class CountTokensBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/messages/count_tokens: the fields of a Messages body that shape the prompt."""

    model: str
    messages: Annotated[list[Any], msgspec.Meta(max_length=MAX_TURNS)]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    mcp_servers: Any = None
    context_management: Any = None

    def as_messages(self) -> MessagesBody:
        fields = {name: getattr(self, name) for name in self.__struct_fields__}
        return MessagesBody(max_tokens=1, **fields)


def decode_messages_body(data: bytes) -> MessagesBody:
    return decode_body(data, MessagesBody)


def decode_count_tokens_body(data: bytes) -> CountTokensBody:
    return decode_body(data, CountTokensBody)


def _block(obj: Any, param: str) -> tuple[dict[str, Any], str]:
    """A content block and its type."""
    _require(isinstance(obj, dict) and isinstance(obj.get("type"), str), param,
             'a content block is an object with a "type"')
    return obj, obj["type"]


# --------------------------------------------------------------------------------------------
# the request: a chat request


@dataclass(slots=True, frozen=True)
class ChatForm:
    """A Messages body as chat: the body chat_request takes, and the field that asked for a constraint."""

    chat: ChatBody
    constraint: str | None  # the Messages field whose constraint a compile error names


def to_chat(body: MessagesBody, count_only: bool = False) -> ChatForm:
    """The chat request a Messages body asks for; InvalidRequestError names the Messages field at fault.
    count_only: for count_tokens, whose body has no max_tokens to bound a thinking budget."""
    _check_fields(body)
    # here, not in SamplingParams.validate: its words name completions' prompt scoring, which max_tokens 0 allows
    _require(1 <= body.max_tokens <= MAX_INT32, "max_tokens", f"max_tokens must be an integer in [1, {MAX_INT32}]")
    _cache_control(body.cache_control, "cache_control")
    messages = _system(body.system) + conversation(body.messages)
    chat_tools = _tools(body.tools or [])
    tool_choice, parallel = _tool_choice(body.tool_choice, chat_tools)
    constrained = tool_choice == "required" or isinstance(tool_choice, dict)
    for i, tool in enumerate(body.tools or []):
        _require(not tool.get("strict") or constrained, f"tools[{i}].strict",
                 'strict holds only where decoding is constrained: tool_choice "any" or "tool" (under "auto" the '
                 "model writes its calls freely)")
    response_format = _output_format(body.output_config)
    prefill = messages[-1].role == "assistant"  # the answer continues it (Anthropic's prefill)
    user = (body.metadata or {}).get("user_id")
    template_kwargs, budget = _thinking(body.thinking, None if count_only else body.max_tokens)
    chat = ChatBody(
        chat_template_kwargs=template_kwargs, thinking_token_budget=budget,
        reasoning_effort=(body.output_config or {}).get("effort"),  # checked by _output_format
        messages=messages, model=body.model, max_tokens=body.max_tokens, temperature=body.temperature,
        top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences, stream=body.stream, user=user,
        tools=chat_tools or None, tool_choice=tool_choice, parallel_tool_calls=parallel,
        response_format=response_format, continue_final_message=prefill or None,
        add_generation_prompt=False if prefill else None)
    constraint = "tool_choice" if constrained else "output_config.format" if response_format is not None else None
    return ChatForm(chat, constraint)


def _check_fields(body: MessagesBody) -> None:
    for name, reason in REFUSED_FIELDS.items():
        _require(getattr(body, name) is None, name, f"{name} is not supported: {reason}")
    for name, (values, reason) in NO_OP_VALUES.items():
        value = getattr(body, name)
        _require(value in values, name, f"{name} {value!r} is not supported: {reason}")
    metadata = body.metadata or {}
    _keys(metadata, {"user_id"}, "metadata", 'metadata is {"user_id": string}')
    _require(metadata.get("user_id") is None or isinstance(metadata["user_id"], str), "metadata.user_id",
             "user_id must be a string")


MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens


def _thinking(thinking: dict[str, Any] | None, max_tokens: int | None,
              ) -> tuple[dict[str, str | int | float | bool] | None, int | None]:
    """Anthropic's extended thinking as chat's (the template's variables, thinking_token_budget): "enabled" thinks
    within budget_tokens (at least MIN_THINKING_BUDGET and below max_tokens, as Anthropic checks), which needs
    --reasoning-parser (the think block comes back as a thinking block, and the budget bounds it: chat's 400 names
    thinking.budget_tokens otherwise); "adaptive" thinks as the model will (output_config.effort is chat's
    reasoning_effort); "disabled" asks the template not to think. Each sets `enable_thinking`, the switch of the
    templates that have one (Qwen3's); a template without it renders as before. Absent: the template's default."""
    if thinking is None:
        return None, None
    kind = thinking.get("type")
    if kind in ("disabled", "adaptive"):
        _keys(thinking, {"type"}, "thinking", f'thinking is {{"type": "{kind}"}}')
        return {"enable_thinking": kind == "adaptive"}, None
    _require(kind == "enabled", "thinking.type", f'thinking.type is "enabled", "adaptive" or "disabled", got {kind!r}')
    _keys(thinking, {"type", "budget_tokens"}, "thinking", 'thinking is {"type": "enabled", "budget_tokens": int}')
    budget = thinking.get("budget_tokens")
    below = max_tokens if max_tokens is not None else MAX_INT32 + 1
    bound = f"below max_tokens ({max_tokens})" if max_tokens is not None else f"at most {MAX_INT32}"
    _require(isinstance(budget, int) and not isinstance(budget, bool) and MIN_THINKING_BUDGET <= budget < below,
             "thinking.budget_tokens", f"budget_tokens must be an integer of at least {MIN_THINKING_BUDGET} and "
                                       f"{bound}, got {budget!r}")
    assert isinstance(budget, int)
    return {"enable_thinking": True}, budget


def _cache_control(value: Any, param: str) -> None:
    """Anthropic's cache breakpoint: the prefix cache keeps every prompt's blocks anyway, so a valid one changes
    nothing; an invalid one is a 400 rather than a value ignored."""
    if value is None:
        return
    _require(isinstance(value, dict) and value.get("type") == "ephemeral" and value.get("ttl") in CACHE_TTLS
             and set(value) <= {"type", "ttl"}, param,
             'cache_control is {"type": "ephemeral", "ttl"?: "5m" | "1h"}')


def _system(system: str | list[Any] | None) -> list[MessageBody]:
    if system is None:
        return []
    if isinstance(system, str):
        return [MessageBody(role="system", content=system)]
    texts = [_text(block, f"system[{i}]") for i, block in enumerate(system)]
    return [MessageBody(role="system", content="\n".join(texts))] if texts else []


def _text(obj: Any, param: str) -> str:
    """A text block's text (its cache_control checked); any other block is a 400 naming it."""
    block, kind = _block(obj, param)
    media = MEDIA_BLOCKS.get(kind)
    _require(media is None, f"{param}.type", f"{kind} blocks are not accepted: pagoda serves text models ({media} "
                                             "input is not read)")
    _require(kind == "text", f"{param}.type", f"expected a text block here, got {kind!r}")
    _keys(block, {"type", "text", "cache_control", "citations"}, param, 'a text block is {"type": "text", "text"}')
    _require(isinstance(block.get("text"), str), f"{param}.text", "text must be a string")
    _require(not block.get("citations"), f"{param}.citations", "citations are not supported: pagoda makes none")
    _cache_control(block.get("cache_control"), f"{param}.cache_control")
    return block["text"]


def conversation(turns: list[Any]) -> list[MessageBody]:
    """`messages` as chat messages: a user turn's tool_result blocks become tool messages (in order, its text the
    user message around them), an assistant turn's tool_use blocks its tool calls, a system turn (text only) a
    system message where it stands. Every tool_use needs a
    tool_result later, and every tool_result a tool_use before it."""
    _require(len(turns) > 0, "messages", "messages must not be empty")
    out: list[MessageBody] = []
    calls: dict[str, str] = {}  # tool_use id -> tool name, of the tool_use blocks so far
    answered: set[str] = set()
    for i, turn in enumerate(turns):
        param = f"messages[{i}]"
        _require(isinstance(turn, dict), param, "a message is {role, content}")
        _keys(turn, {"role", "content"}, param, 'a message is {"role": "user" | "assistant", "content"}')
        role, content = turn.get("role"), turn.get("content")
        _require(role in ("user", "assistant", "system"), f"{param}.role",
                 f"role must be user, assistant or system, got {role!r}")
        if isinstance(content, str):
            out.append(MessageBody(role=role, content=content))
            continue
        _require(isinstance(content, list), f"{param}.content", "content must be a string or a list of blocks")
        if role == "system":  # a system message mid-conversation (Claude Code sends them): chat's, where it stands
            texts = [_text(block, f"{param}.content[{j}]") for j, block in enumerate(content)]
            out.append(MessageBody(role="system", content="\n".join(texts)))
        elif role == "assistant":
            out.append(_assistant(content, f"{param}.content", calls))
        else:
            out.extend(_user(content, f"{param}.content", calls, answered))
    missing = next((call_id for call_id in calls if call_id not in answered), None)
    _require(missing is None, "messages", f"tool_use id {missing!r} has no tool_result block after it")
    _require(out[-1].role != "assistant" or not out[-1].tool_calls, f"messages[{len(turns) - 1}]",
             "a last assistant turn (a prefill the answer continues) holds text only")
    return out


def _assistant(blocks: list[Any], param: str, calls: dict[str, str]) -> MessageBody:
    texts: list[str] = []
    thinking: list[str] = []  # an earlier answer's reasoning: chat's `reasoning`, which the template gets
    tool_calls: list[dict[str, Any]] = []
    for j, obj in enumerate(blocks):
        where = f"{param}[{j}]"
        block, kind = _block(obj, where)
        if kind == "tool_use":
            _keys(block, {"type", "id", "name", "input", "cache_control", *TOOL_USE_NULL_FIELDS}, where,
                  'a tool_use block is {"type": "tool_use", "id", "name", "input"}')
            for key, reason in TOOL_USE_NULL_FIELDS.items():
                _require(block.get(key) is None, f"{where}.{key}", f"{key} is not supported: {reason}")
            for key in ("id", "name"):
                _require(isinstance(block.get(key), str) and bool(block[key]), f"{where}.{key}",
                         f"{key} must be a non-empty string")
            _require(isinstance(block.get("input"), dict), f"{where}.input", "input must be an object")
            _require(block["id"] not in calls, f"{where}.id", f"tool_use id {block['id']!r} is used twice")
            _cache_control(block.get("cache_control"), f"{where}.cache_control")
            calls[block["id"]] = block["name"]
            tool_calls.append({"id": block["id"], "type": "function",
                               "function": {"name": block["name"],
                                            "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind == "thinking":
            _keys(block, {"type", "thinking", "signature"}, where,
                  'a thinking block is {"type": "thinking", "thinking", "signature"}')
            _require(isinstance(block.get("thinking"), str), f"{where}.thinking", "thinking must be a string")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            raise InvalidRequestError("redacted_thinking blocks are not accepted: pagoda makes none (its thinking "
                                      "blocks are plain text)", param=f"{where}.type")
        else:
            _require(kind in ("text", *MEDIA_BLOCKS), f"{where}.type",
                     f"an assistant turn holds text, tool_use and thinking blocks; {kind!r} blocks are not accepted "
                     "(pagoda has no server tools)")
            texts.append(_text(block, where))
    return MessageBody(role="assistant", content="\n".join(texts), tool_calls=tool_calls or None,
                       reasoning="\n".join(thinking) if thinking else None)


def _user(blocks: list[Any], param: str, calls: dict[str, str], answered: set[str]) -> list[MessageBody]:
    out: list[MessageBody] = []
    texts: list[str] = []
    for j, obj in enumerate(blocks):
        where = f"{param}[{j}]"
        block, kind = _block(obj, where)
        if kind != "tool_result":
            _require(kind in ("text", *MEDIA_BLOCKS), f"{where}.type",
                     f"a user turn holds text and tool_result blocks; {kind!r} blocks are not accepted")
            texts.append(_text(block, where))
            continue
        if texts:  # the text before the result keeps its place
            out.append(MessageBody(role="user", content="\n".join(texts)))
            texts = []
        _keys(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, where,
              'a tool_result block is {"type": "tool_result", "tool_use_id", "content"?, "is_error"?}')
        call_id = block.get("tool_use_id")
        _require(isinstance(call_id, str) and call_id in calls, f"{where}.tool_use_id",
                 f"tool_use_id {call_id!r} names no tool_use block before it")
        _require(call_id not in answered, f"{where}.tool_use_id", f"tool_use id {call_id!r} has two results")
        _require(block.get("is_error") is None or isinstance(block["is_error"], bool), f"{where}.is_error",
                 "is_error must be a boolean")
        _cache_control(block.get("cache_control"), f"{where}.cache_control")
        content = block.get("content", "")
        if isinstance(content, list):
            content = "\n".join(_text(part, f"{where}.content[{k}]") for k, part in enumerate(content))
        _require(isinstance(content, str), f"{where}.content", "content must be a string or a list of text blocks")
        answered.add(call_id)
        text = ERROR_PREFIX + content if block.get("is_error") else content
        out.append(MessageBody(role="tool", content=text, tool_call_id=call_id, name=calls[call_id]))
    if texts or not out:
        out.append(MessageBody(role="user", content="\n".join(texts)))
    return out


def _tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Chat's function tools of Anthropic's client tools (server tools are refused)."""
    chat = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        _require(isinstance(tool, dict), param, "a tool is an object")
        kind = tool.get("type")
        _require(kind in (None, "custom"), f"{param}.type",
                 f"only client tools (type custom, with an input_schema) are served; {kind!r} is a server tool "
                 "pagoda does not have")
        _keys(tool, {"type", "name", "description", "input_schema", "cache_control", "strict"}, param,
              'a tool is {"name", "description"?, "input_schema"}')
        name, description, schema = tool.get("name"), tool.get("description"), tool.get("input_schema")
        _require(isinstance(name, str) and bool(name), f"{param}.name", "name must be a non-empty string")
        _require(description is None or isinstance(description, str), f"{param}.description",
                 "description must be a string")
        _require(isinstance(schema, dict), f"{param}.input_schema", "input_schema must be a JSON schema object")
        _require(tool.get("strict") is None or isinstance(tool["strict"], bool), f"{param}.strict",
                 "strict must be a boolean")
        _cache_control(tool.get("cache_control"), f"{param}.cache_control")
        function = {"name": name, "parameters": schema}
        if description is not None:
            function["description"] = description
        chat.append({"type": "function", "function": function})
    return chat


def _tool_choice(choice: dict[str, Any] | None,
                 tools: list[dict[str, Any]]) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat's tool_choice, chat's parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    _require(kind in ("auto", "any", "tool", "none"), "tool_choice.type",
             f"tool_choice type must be auto, any, tool or none, got {kind!r}")
    allowed = {"type", "name", "disable_parallel_tool_use"} if kind == "tool" else \
        {"type"} if kind == "none" else {"type", "disable_parallel_tool_use"}
    _keys(choice, allowed, "tool_choice", f"this tool_choice is {{{', '.join(sorted(allowed))}}}")
    disable = choice.get("disable_parallel_tool_use")
    _require(disable is None or isinstance(disable, bool), "tool_choice.disable_parallel_tool_use",
             "disable_parallel_tool_use must be a boolean")
    parallel = False if disable else None
    _require(kind in ("auto", "none") or bool(tools), "tool_choice", f"tool_choice {kind!r} needs tools")
    if kind == "auto":
        return ("auto" if tools else None), parallel  # auto without tools: nothing to call
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    name = choice.get("name")
    _require(isinstance(name, str), "tool_choice.name", "name must be a string")
    _require(any(t["function"]["name"] == name for t in tools), "tool_choice.name", f"no tool named {name!r}")
    return {"type": "function", "function": {"name": name}}, parallel


def _output_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's response_format of output_config.format (Anthropic's structured outputs)."""
    config = config or {}
    _keys(config, {"format", "effort"}, "output_config", 'output_config is {"format"?, "effort"?}')
    check_reasoning_effort(config.get("effort"), "output_config.effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    _require(isinstance(fmt, dict) and fmt.get("type") == "json_schema", "output_config.format.type",
             'output_config.format is {"type": "json_schema", "schema": {...}}')
    _keys(fmt, {"type", "schema"}, "output_config.format", 'output_config.format is {"type": "json_schema", "schema"}')
    _require(isinstance(fmt.get("schema"), dict), "output_config.format.schema", "schema must be a JSON object")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# Chat's names for what a Messages body calls otherwise: a refusal by chat's checks or the tokenizer names the
# Messages field.
_CHAT_PARAMS = (("max_completion_tokens", "max_tokens"), ("stop", "stop_sequences"), ("messages", "messages"),
                ("response_format", "output_config.format"), ("user", "metadata.user_id"),
                ("continue_final_message", "messages"), ("thinking_token_budget", "thinking.budget_tokens"))


def messages_param(param: str | None) -> str | None:
    """The Messages field for a chat parameter (stop -> stop_sequences, response_format -> output_config.format);
    chat's message indices shift (system, tool messages): such an error names `messages` as a whole."""
    if param is None:
        return None
    for chat, anthropic in _CHAT_PARAMS:
        if param == chat or param.startswith((f"{chat}.", f"{chat}[")):
            return anthropic if chat in ("messages", "continue_final_message") else anthropic + param[len(chat):]
    return param


CHAT_ONLY_HINT = " (truncate_prompt_tokens: -1 keeps what fits)"  # the tokenizer's, naming a field of chat's only


def rename_error(exc: PagodaError) -> PagodaError:
    """`exc` naming the Messages field instead of chat's (its message too, for the names that differ)."""
    param = messages_param(exc.param)
    if param != exc.param or CHAT_ONLY_HINT in exc.message:
        if exc.param in ("max_completion_tokens", "stop", "thinking_token_budget") and exc.param is not None:
            exc.message = exc.message.replace(exc.param, param or "")
        exc.message = exc.message.replace(CHAT_ONLY_HINT, "").replace(NO_BUDGET_HINT, "")
        exc.args = (exc.message,)
        exc.param = param
    return exc


# --------------------------------------------------------------------------------------------
# errors in Anthropic's shape

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
_PAGODA_TYPES = {"invalid_request_error": 400, "authentication_error": 401, "not_found_error": 404,
                 "requests": 429, "tokens": 429, "server_error": 500}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (other 4xx: invalid_request_error, other 5xx: api_error)."""
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error body; the field at fault leads the message (its error object has no param)."""
    return {"type": "error", "error": {"type": error_type(status),
                                       "message": f"{param}: {message}" if param else message}}


def error_from_body(body: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's error body of pagoda's ({"error": {message, type, param, code}}): a stream's error event."""
    error = body.get("error", {})
    status = 408 if error.get("code") == "request_timeout" else _PAGODA_TYPES.get(error.get("type", ""), 500)
    return anthropic_error(status, error.get("message", ""), messages_param(error.get("param")))


# --------------------------------------------------------------------------------------------
# the answer: content blocks and events


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass(slots=True)
class ContentBlock:
    """One content block as it is written: text, thinking (the reasoning parser's think block) or a tool_use."""

    kind: str  # "text" | "thinking" | "tool_use"
    parts: list[str] = field(default_factory=list)  # its text, or a tool_use's input as JSON text
    id: str = ""
    name: str = ""

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def json(self, started: bool = False) -> dict[str, Any]:
        """The block; `started`: as content_block_start shows it, before any delta."""
        text = "" if started else self.text
        if self.kind == "text":
            return {"type": "text", "text": text}
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": text, "signature": ""}  # nothing is signed here
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": {} if started else tool_input(text)}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the tool_use block's `input`: {} for arguments that are no JSON object (a call cut
    off by max_tokens; the stream's input_json_delta events carry what was written), or that nest past Python's
    recursion limit (a recursive schema's arrays: RecursionError, which was a 500 and lost the answer)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


class BlockBuilder:
    """The content blocks of one completion, from its text as it comes: push() and finish() return the stream's
    events for it (dicts); `blocks` is the content so far."""

    def __init__(self, spec: ChatOutputSpec) -> None:
        self.stream = ChoiceStream(spec)  # chat's tool-call and reasoning parsing, streamed
        self.blocks: list[ContentBlock] = []
        self.open: ContentBlock | None = None
        # whitespace-only text not shown yet, before a tool_use dropped; in pieces joined once (`+= text` copied
        # all of it on every token of a model looping on newlines)
        self.held_space: list[str] = []
        self.finish_reason = -1
        self.stop_sequence: str | None = None
        self.calls_finished = False  # the answer is its tool calls (chat's finish_reason "tool_calls")

    def push(self, text: str) -> list[dict[str, Any]]:
        return self._parts(self.stream.push(text))

    def finish(self, reason: int, stop: str | int | None) -> list[dict[str, Any]]:
        self.finish_reason = reason
        self.stop_sequence = stop if isinstance(stop, str) else None
        parts, self.calls_finished = self.stream.finish()
        events = self._parts(parts)
        if self.held_space and not any(b.kind == "tool_use" for b in self.blocks):
            events += self._text("", force=True)  # _text puts the held space before the text it is given
        return events + self._close()

    @property
    def stop_reason(self) -> str:
        if self.finish_reason == FinishReason.LENGTH:
            return "max_tokens"
        if self.calls_finished:
            return "tool_use"
        if self.stop_sequence is not None:  # what ended the answer, a tool_use (`any`, named) it cut short included
            return "stop_sequence"
        # a tool_use here is no finished call: a named one whose think block never closed (chat's finish "stop")
        return "end_turn"

    def _parts(self, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for part in parts:
            if "reasoning_content" in part:
                events += self._delta("thinking", part["reasoning_content"])
            elif "content" in part:
                events += self._text(part["content"] or "")
            else:
                events += self._call(part["tool_calls"][0])
        return events

    def _start(self, block: ContentBlock) -> list[dict[str, Any]]:
        events = self._close()
        self.open = block
        self.blocks.append(block)
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1,
                          "content_block": block.json(started=True)}]

    def _delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = [] if self.open is not None and self.open.kind == kind else self._start(ContentBlock(kind))
        assert self.open is not None
        self.open.parts.append(text)
        delta = {"type": "text_delta", "text": text} if kind == "text" else \
            {"type": "thinking_delta", "thinking": text}
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def _text(self, text: str, force: bool = False) -> list[dict[str, Any]]:
        if not force and (self.open is None or self.open.kind != "text") and not text.strip():
            if text:
                self.held_space.append(text)  # shown with the text that follows it, dropped before a tool_use
            return []
        text, self.held_space = "".join(self.held_space) + text, []
        return self._delta("text", text) if text else []

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        function = delta.get("function", {})
        events: list[dict[str, Any]] = []
        if "id" in delta:  # a call's first delta: its name
            self.held_space = []
            # Anthropic's id form, except under the mistral parser: Mistral's chat templates refuse any id but the
            # 9 alphanumerics its calls carry (tools.new_call_id) when the tool_use comes back in the next turn
            call_id = delta["id"] if self.stream.spec.tool_parser == "mistral" else new_id("toolu")
            events = self._start(ContentBlock("tool_use", id=call_id, name=function.get("name", "")))
        assert self.open is not None and self.open.kind == "tool_use"
        arguments = function.get("arguments") or ""
        if arguments:
            self.open.parts.append(arguments)
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                           "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def message_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's usage from chat's usage_dict: input_tokens counts the prompt tokens the prefix cache did not
    hold, cache_read_input_tokens those it held (their sum is the prompt); nothing is written on request."""
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": usage["completion_tokens"],
            "service_tier": "standard"}


class MessagesRenderer(Renderer):
    """One message's answer: its events (streaming) and its Message object, from the completion's deltas.

    It sees every batch, streamed or not (the api's Generation calls chunks() for it either way): the blocks are
    built once, and the non-streamed body is the message the stream's events add up to."""

    route_name = "messages"

    def __init__(self, message_id: str, model: str, created: int, spec: ChatOutputSpec, *, stream: bool) -> None:
        super().__init__(message_id, model, created, want_logprobs=False, include_usage=False)
        self.stream = stream
        self.builder = BlockBuilder(spec)
        # message_start waits for the first output, which carries the prefix cache's share of the prompt
        self._start_pending = False
        self._num_prompt_tokens = 0

    def prompt_accepted(self, prompt_reasoning: str) -> None:
        self.builder.stream.after_prompt(prompt_reasoning)

    def message(self, usage: dict[str, Any] | None, num_cached_tokens: int = 0) -> dict[str, Any]:
        """The Message: the content so far and, once it ended, its stop reason and usage; before that (the stream's
        message_start), the prompt split into what the prefix cache held and the rest."""
        done = usage is not None
        return {"id": self.response_id, "type": "message", "role": "assistant", "model": self.model,
                "content": [block.json() for block in self.builder.blocks] if done else [],
                "stop_reason": self.builder.stop_reason if done else None,
                "stop_sequence": self.builder.stop_sequence if done else None,
                "usage": message_usage(usage if usage is not None else usage_dict(
                    self._num_prompt_tokens, 0, num_cached_tokens))}

    def _events(self, events: list[dict[str, Any]]) -> bytes:
        """SSE bytes of these events; b"" when not streaming."""
        if not self.stream:
            return b""
        return b"".join(b"event: " + event["type"].encode() + b"\ndata: " + encode_json(event) + b"\n\n"
                        for event in events)

    def opening(self, view: ResponseView) -> bytes:
        """Nothing yet: message_start goes out with the first output (_start). That output says how many prompt
        tokens the prefix cache held, and message_start's usage splits the prompt by it, as message_delta's does."""
        self._num_prompt_tokens = view.choices[0].num_prompt_tokens if view is not None and view.choices else 0
        self._start_pending = True
        return b""

    def _start(self, num_cached_tokens: int) -> list[dict[str, Any]]:
        """message_start, if the stream has not sent it yet."""
        if not self._start_pending:
            return []
        self._start_pending = False
        return [{"type": "message_start", "message": self.message(None, num_cached_tokens)}]

    def chunks(self, batch: list[tuple[Choice, TextDelta]]) -> bytes:
        events = self._start(batch[0][1].num_cached_tokens) if batch else []
        for _, delta in batch:
            if self.builder.finish_reason >= 0:
                continue
            events += self.builder.push(delta.text)
            if delta.finish_reason >= 0:
                events += self.builder.finish(delta.finish_reason, delta.stop_reason)
        return self._events(events)

    def closing(self, usage: dict[str, Any]) -> bytes:
        final = self.message(usage)
        usage = {key: value for key, value in final["usage"].items() if key != "service_tier"}  # the Message's
        delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
        return self._events([*self._start(usage["cache_read_input_tokens"]),
                             {"type": "message_delta", "delta": delta, "usage": usage}, {"type": "message_stop"}])

    def body(self, view: ResponseView, usage: dict[str, Any]) -> dict[str, Any]:
        return self.message(usage)

    def stream_error(self, error: dict[str, Any]) -> bytes:
        """The `error` event that ends a stream which failed after its HTTP status went out (message_start first, if
        no output came before the failure)."""
        return self._events([*self._start(0), error_from_body(error)])
