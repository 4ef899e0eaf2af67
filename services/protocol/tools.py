"""Tool calling: tools into the prompt (the model's template, else the Hermes default) and tool calls out of
the text (Hermes/Qwen `<tool_call>`, Llama 3.x JSON, Mistral `[TOOL_CALLS]`). Pure functions; no torch.

Output modes (chosen by the api from tool_choice):
- "auto": the model may answer in text or call tools in its family's format; `parse_tool_calls` finds them.
- "required": constrained decoding to a JSON array `[{"name": ..., "parameters": {...}}, ...]` (one entry per
  call, each validated against its function's parameter schema); `parse_required` reads it.
- "named": constrained decoding to the named function's arguments object; the text IS the arguments.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from pagoda.shared.schema_walk import map_keywords

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")

HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(slots=True, frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""

    def to_openai(self, call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


MISTRAL_ID_ALPHABET = string.ascii_letters + string.digits


# Parsers whose start marker is a special token in some tokenizers (Mistral's [TOOL_CALLS]; <tool_call> in some
# Hermes-format ones): their text must keep special tokens, or the marker is gone and calls come back as content.
PARSERS_WITH_SPECIAL_MARKERS = ("hermes", "mistral")


def keeps_special_tokens(tool_mode: str, tool_parser: str) -> bool:
    """Whether a chat request's text must keep special tokens so its tool calls can be read (vLLM's hermes and
    mistral parsers set skip_special_tokens false the same way; a client that sends the field keeps its choice)."""
    return tool_mode == "auto" and tool_parser in PARSERS_WITH_SPECIAL_MARKERS


def new_call_id(parser: str = "") -> str:
    """A tool call's id. Mistral's chat templates raise on any id that is not 9 alphanumerics ("Tool call IDs should be
    alphanumeric strings with length 9!") when the call comes back in the conversation, so under the mistral parser
    the ids are those (vLLM's MistralToolCall ids); OpenAI's form elsewhere."""
    if parser == "mistral":
        return "".join(secrets.choice(MISTRAL_ID_ALPHABET) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def default_tool_parser(model_names: list[str]) -> str:
    """The parser for a model family, by its name: Hermes where the name says so (Hermes-3 is a Llama 3.1), Llama 3.x
    JSON, Mistral, else Hermes (Qwen, and every model whose template takes no tools, which get the Hermes prompt)."""
    names = " ".join(model_names).lower()
    if "hermes" in names:
        return "hermes"
    if re.search(r"llama-?3", names):
        return "llama3_json"
    if re.search(r"mistral|mixtral|ministral|devstral|magistral|codestral|pixtral", names):  # Mistral AI's names
        return "mistral"
    return "hermes"


# --------------------------------------------------------------------------------------------
# tools into the prompt


def template_takes_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


def template_renders_tool_turns(chat_template: str | None) -> bool:
    """Whether the template writes assistant tool calls itself (DeepSeek-V3's reads `tool_calls` but no tool list)."""
    return bool(chat_template) and "tool_calls" in chat_template  # type: ignore[operator]


def tool_conversation(chat_template: str | None, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: as they are when it takes tools, else the tool list in the Hermes
    format (then the template gets no tools argument) and the tool turns too unless the template writes its own
    (tool call arguments become objects when the template renders: conversation.template_conversation)."""
    has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not tools and not has_tool_turns:
        return messages, None
    if template_takes_tools(chat_template):
        return messages, tools
    if template_renders_tool_turns(chat_template):
        return hermes_system(messages, tools), None
    return hermes_messages(messages, tools), None


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation for a template that knows nothing of tools: the tool list joins the system prompt,
    assistant tool calls become `<tool_call>` text, tool results become a user turn in `<tool_response>`: the
    results of one turn's calls (consecutive tool messages) share one user turn, as Qwen2.5's Hermes template writes
    them, and a user message right after them joins it too (Anthropic's user turn of tool_result blocks and text),
    so that a template that requires user and assistant turns to alternate takes either."""
    out: list[dict[str, Any]] = []
    previous = ""  # the role of the message before this one
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{json.dumps(_call_dict(c), ensure_ascii=False)}\n</tool_call>"
                              for c in message["tool_calls"])
            out.append({"role": "assistant", "content": f"{_text(message.get('content'))}\n{calls}".strip()})
        elif role == "tool":
            response = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        elif role == "user" and previous == "tool":
            out[-1]["content"] += "\n" + _text(message.get("content"))
        else:
            out.append({key: value for key, value in message.items()
                        if key in ("role", "content", "name", "reasoning")})
        previous = role
    return hermes_system(out, tools)


def hermes_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation with the Hermes tool list joining its system prompt (a first one when it has none)."""
    if not tools:
        return messages
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    system = HERMES_SYSTEM.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{_text(messages[0]['content'])}\n\n{system}"}, *messages[1:]]
    return [{"role": "system", "content": system}, *messages]


def _text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's content as text: its text parts joined by newlines, as a text template reads them."""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content or ""


def _call_dict(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function", {})
    arguments = function.get("arguments")
    parsed = _loads(arguments) if isinstance(arguments, str) else arguments
    return {"name": function.get("name"), "arguments": parsed if isinstance(parsed, dict) else arguments}


# --------------------------------------------------------------------------------------------
# constrained schemas for tool_choice required / named


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each one of the tools with arguments matching its parameters. Each tool's parameters
    sit inside this array's schema, so their local $refs (pydantic's "#/$defs/Model") are rebased to where they
    now sit: left as written they pointed at this schema's root, which has no $defs (a 400 for every nested
    pydantic model)."""
    def variant(tool: dict[str, Any], at: str) -> dict[str, Any]:
        return {"type": "object",
                "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                               "parameters": rebase_refs(_parameters(tool), f"{at}/properties/parameters")},
                "required": ["name", "parameters"], "additionalProperties": False}

    item = (variant(tools[0], "/items") if len(tools) == 1
            else {"anyOf": [variant(t, f"/items/anyOf/{i}") for i, t in enumerate(tools)]})
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def rebase_refs(schema: Any, pointer: str) -> Any:
    """`schema` moved to JSON pointer `pointer` of a larger schema: each local "$ref" ("#", "#/...") rewritten to
    resolve where it did before (a "$ref" inside data, a const or an enum, stays as written). A schema with its own
    "$id" is its own resource, where its refs resolve already."""
    if not isinstance(schema, dict) or "$id" in schema:
        return schema

    def rebase(key: str, value: Any, at: str) -> Any:
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            return "#" + pointer + value[1:]
        return value

    return map_keywords(schema, rebase)


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return _parameters(tool)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameter schema; none given (or {}) is OpenAI's "empty parameter list": the object {} only. It
    allowed any object, so a forced call of a tool that takes nothing had the model invent arguments."""
    parameters = tool["function"].get("parameters")
    return (parameters if isinstance(parameters, dict) and parameters
            else {"type": "object", "properties": {}, "additionalProperties": False})


# --------------------------------------------------------------------------------------------
# tool calls out of the text


def tool_start_marker(parser: str) -> str:
    """Where calls begin in a model's output; llama3_json has none (the answer is a JSON object)."""
    return {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "{"}[parser]


def parse_tool_calls(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """(content left over, calls) of a finished text; no calls when the text holds none that parse."""
    if parser == "hermes":
        return _parse_hermes(text)
    if parser == "mistral":
        return _parse_mistral(text)
    if parser == "llama3_json":
        return _parse_llama3(text)
    raise ValueError(f"unknown tool call parser {parser!r}")


HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """Each `<tool_call>` holds one JSON object, then `</tool_call>` (or the end of the text: the last tag may be
    left open). The object is read as JSON, not cut at the first `</tool_call>`: an argument may hold that text."""
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    decoder = json.JSONDecoder()
    calls, at = [], start
    while at >= 0:
        try:
            obj, end = decoder.raw_decode(text, _skip_space(text, at + len(HERMES_START)))
        except json.JSONDecodeError:
            return text, []
        end = _skip_space(text, end)
        call = _call_from_object(obj)
        if call is None or not (end == len(text) or text.startswith(HERMES_END, end)):
            return text, []
        calls.append(call)
        at = text.find(HERMES_START, end)
    return text[:start].rstrip(), calls  # whitespace before the calls is no content (streamed: never sent)


def _skip_space(text: str, index: int) -> int:
    while index < len(text) and text[index].isspace():
        index += 1
    return index


def _parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    body = text[start + len("[TOOL_CALLS]"):].strip()
    parsed = _loads(body)
    if parsed is None:  # newer Mistral templates: [TOOL_CALLS]name[ARGS]{...}
        calls = []
        for chunk in body.split("[TOOL_CALLS]"):
            name, sep, arguments = chunk.partition("[ARGS]")
            call = _call_from_object({"name": name.strip(), "arguments": _loads(arguments)}) if sep else None
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].rstrip(), calls
    objects = parsed if isinstance(parsed, list) else [parsed]
    calls = [_call_from_object(o) for o in objects]
    if not calls or any(c is None for c in calls):
        return text, []
    return text[:start].rstrip(), calls  # type: ignore[return-value]


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    """Llama 3.x: the whole answer is `{"name": ..., "parameters": {...}}`, several joined by `;`."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in _split_objects(body):
        call = _call_from_object(_loads(part))
        if call is None:
            return text, []
        calls.append(call)
    return "", calls


def _split_objects(body: str) -> list[str]:
    decoder = json.JSONDecoder()
    parts, index = [], 0
    while index < len(body):
        try:
            _, end = decoder.raw_decode(body, index)
        except json.JSONDecodeError:
            return [body]  # not a sequence of objects: the whole body fails to parse later
        parts.append(body[index:end])
        index = end
        while index < len(body) and body[index] in " \n\t;":
            index += 1
    return parts


def parse_required(text: str) -> list[ToolCall]:
    """The constrained `required` output: [{"name", "parameters"}, ...]. A text cut short (max_tokens, a stop
    string) still holds its calls, as OpenAI's and a named call's do: the whole ones, then the one being written
    once its name is, with the arguments written so far (JSON cut short, as `finish_reason: length` says);
    before, the raw array came back as the message's content."""
    parsed = _loads(text)
    if not isinstance(parsed, list):
        return _required_cut_short(text)
    calls = [_call_from_object(o) for o in parsed]
    return [c for c in calls if c is not None]


# the call being written when the tokens ran out: its name whole, then its parameters so far
_CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(?:\s*,\s*"parameters"\s*:\s*(.*))?', re.DOTALL)


def _required_cut_short(text: str) -> list[ToolCall]:
    """The calls of a `required` array whose text ends before its `]`."""
    decoder, calls = json.JSONDecoder(), []
    index = len(text) - len(text.lstrip())
    if not text.startswith("[", index):
        return []
    index += 1
    while True:
        while index < len(text) and text[index] in " \n\t\r,":
            index += 1
        try:
            obj, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            break
        call = _call_from_object(obj)
        if call is not None:
            calls.append(call)
    cut = _CUT_CALL.match(text, index)
    if cut is not None:
        calls.append(ToolCall(json.loads(cut.group(1)), cut.group(2) or ""))
    return calls


def _call_from_object(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None
