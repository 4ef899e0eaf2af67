"""Tool calling: tools into the prompt (the model's template, else the Hermes default, or DeepSeek's own for its
templates) and tool calls out of the text (Hermes/Qwen `<tool_call>`, Llama 3.x JSON, Mistral `[TOOL_CALLS]`,
DeepSeek-V3 / V3.1 `<｜tool▁calls▁begin｜>`, Qwen3-Coder's XML). Pure functions; no torch.

Output modes (chosen by the api from tool_choice):
- "auto": the model may answer in text or call tools in its family's format; `parse_tool_calls` finds them.
- "required": constrained decoding to a JSON array `[{"name": ..., "parameters": {...}}, ...]` (one entry per
  call, each validated against its function's parameter schema); `parse_required` reads it.
- "named": constrained decoding to the named function's arguments object; the text IS the arguments.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.shared.config import TOOL_CALL_PARSERS as TOOL_CALL_PARSERS  # the names live with the flag
from pagoda.shared.schema_walk import map_keywords

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


# Parsers whose markers are special tokens in some tokenizers (Mistral's [TOOL_CALLS]; <tool_call> in some
# Hermes-format ones, and Qwen3-Coder writes the same <tool_call>): their text must keep special tokens, or the marker
# is gone and calls come back as content. DeepSeek's <｜tool▁...｜> markers are added tokens of its tokenizer, which
# DeepSeek's own tokenizer.json does not flag special (vLLM's deepseek parsers read them with special tokens skipped);
# they are kept all the same: for a tokenizer that does not flag them, keeping special tokens changes nothing in a
# DeepSeek answer (its only special tokens are the begin and end of sentence, and the end stops the answer before
# it is text), and a converted or fine-tuned tokenizer that flags them (as V3.2's DSML marker is) still works.
PARSERS_WITH_SPECIAL_MARKERS = ("hermes", "mistral", "deepseek_v3", "deepseek_v31", "qwen3_coder", "glm45", "glm47")

# Parsers that read the request's tools: Qwen3-Coder and GLM-4.5 write each argument as raw text (GLM: a string
# as it is, anything else as JSON), typed by its parameter schema.
PARSERS_WITH_SCHEMAS = ("qwen3_coder", "glm45", "glm47")


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
    """The parser for a model family, by its names (each one's last path component: directories say nothing of the
    model; a Hugging Face cache's snapshot path gives its repository's name), version tokens matched whole
    (`/srv/v3-cluster/deepseek-llm-7b-chat` is no V3): Hermes where a name says so (Hermes-3 is a Llama 3.1), DeepSeek
    (V3.1 and V3.2-Exp write calls without V3's fenced JSON; V2-Chat and V2-Lite-Chat have no tool format, their
    templates write no calls, so they get the Hermes prompt and parser; V3.2 and V3.2-Speciale write DSML, which no
    parser here reads, so they get what an unknown name gets), Qwen3-Coder's XML, GLM-4.5's, Llama 3.x JSON,
    Mistral, else Hermes (Qwen, and every model whose template takes no tools, which get the Hermes prompt)."""
    names = [_model_name(name) for name in model_names]

    def named(pattern: str) -> bool:
        return any(re.search(pattern, name) for name in names)

    if named("hermes"):
        return "hermes"
    deepseek = [parser for name in names if "deepseek" in name and (parser := _deepseek_parser(name))]
    if deepseek:
        return "deepseek_v31" if "deepseek_v31" in deepseek else "deepseek_v3"
    if named(r"qwen3[-_]?coder"):
        return "qwen3_coder"
    if named(r"glm[-_]?4(?![._-]?\d*v)"):  # GLM-4.5, 4.6, 4.7 (Air, FP8); not the vision GLM-4.xV
        return "glm45"
    if named(r"llama-?3(?!\d)"):  # not LLaMA-30B
        return "llama3_json"
    if named(r"mistral|mixtral|ministral|devstral|magistral|codestral|pixtral"):  # Mistral AI's names
        return "mistral"
    return "hermes"


def _model_name(name: str) -> str:
    """A --model path's or served name's last component, lower case; `.../models--org--name/snapshots/HASH` (a
    Hugging Face cache) gives `name`."""
    parts = [part for part in name.lower().split("/") if part]
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].rsplit("--", 1)[-1]
    return parts[-1] if parts else ""


_VERSION_START, _VERSION_END = r"(?:(?<![a-z0-9])|(?<=deepseek))", r"(?!\d)"  # v3 whole: not v30, nor xv3; R1T is R1


def _deepseek_parser(name: str) -> str | None:
    """The parser of a DeepSeek release by its name, None: one with no DeepSeek calls (V2, V2-Lite, Coder-V2-Lite,
    deepseek-llm) or with DSML's (V3.2, V3.2-Speciale)."""
    def version(pattern: str) -> bool:
        return re.search(_VERSION_START + pattern + _VERSION_END, name) is not None

    if version(r"v3[._-]?2[._-]?exp"):
        return "deepseek_v31"
    if version(r"v3[._-]?2"):  # no "(?!exp)" needed: "v3.2" must end there
        return None
    if version(r"v3[._-]?1|v31"):
        return "deepseek_v31"
    if version(r"v3|r1|v2[._-]5"):
        return "deepseek_v3"
    return None


# --------------------------------------------------------------------------------------------
# tools into the prompt


def template_takes_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


def template_renders_tool_turns(chat_template: str | None) -> bool:
    """Whether the template writes assistant tool calls itself (DeepSeek-V3's reads `tool_calls` but no tool list)."""
    return bool(chat_template) and "tool_calls" in chat_template  # type: ignore[operator]


def tool_conversation(chat_template: str | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      tool_parser: str = "") -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: as they are when it takes tools, else the tool list in the Hermes
    format (then the template gets no tools argument) and the tool turns too unless the template writes its own
    (tool call arguments become objects when the template renders: conversation.template_conversation). A DeepSeek
    template writes its own turns and takes no tool list: the list goes into the system prompt as DeepSeek's, asking
    for calls in the form the template writes them, which the deepseek parsers read; unless the request's parser
    (`tool_parser`, "": not known) is another, which then gets the Hermes list it reads (`--tool-call-parser hermes`
    on a DeepSeek model)."""
    has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not tools and not has_tool_turns:
        return messages, None
    if template_takes_tools(chat_template):
        return messages, tools
    if template_renders_tool_turns(chat_template):
        deepseek = deepseek_call_form(chat_template) if tool_parser in ("", *DEEPSEEK_PARSERS) else None
        if deepseek is not None:
            return with_system_text(messages, deepseek_tools_prompt(tools, deepseek) if tools else ""), None
        return hermes_system(messages, tools), None
    return hermes_messages(messages, tools), None


DEEPSEEK_PARSERS = ("deepseek_v3", "deepseek_v31")


def deepseek_call_form(chat_template: str | None) -> str | None:
    """The DeepSeek call form a template writes: "deepseek_v3" (V3, V3-0324, R1: `function<｜tool▁sep｜>NAME` then
    the arguments in a ```json fence), "deepseek_v31" (V3.1, V3.2-Exp: `NAME<｜tool▁sep｜>ARGS`), None: not
    DeepSeek's."""
    if not chat_template or DS_SEP not in chat_template:
        return None
    return "deepseek_v3" if "```json" in chat_template else "deepseek_v31"


def deepseek_tools_prompt(tools: list[dict[str, Any]], form: str) -> str:
    """DeepSeek's tool list for the system prompt: the "## Tools" block of DeepSeek-V3.1's model card (DeepSeek's
    templates take no tool list; V3's publish no prompt, so V3 gets the same block with its own call form)."""
    sections = []
    for tool in tools:
        function = tool.get("function", {})
        parameters = json.dumps(function.get("parameters") or {}, ensure_ascii=False)
        sections.append(f"### {function.get('name', '')}\nDescription: {function.get('description') or ''}\n\n"
                        f"Parameters: {parameters}\n")
    if form == "deepseek_v3":
        call = f"{DS_CALL_BEGIN}function{DS_SEP}tool_call_name\n```json\ntool_call_arguments\n```{DS_CALL_END}"
        chain = "chain them with a newline between them"
    else:
        call = f"{DS_CALL_BEGIN}tool_call_name{DS_SEP}tool_call_arguments{DS_CALL_END}"
        chain = "chain them directly without separators or spaces"
    return ("## Tools\nYou have access to the following tools:\n\n" + "\n".join(sections)
            + f"\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n{DS_CALLS_BEGIN}{call}"
            + f"{{additional_tool_calls}}{DS_CALLS_END}\n\nWhere:\n"
            + "- `tool_call_name` must be an exact match to one of the available tools\n"
            + "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
            + f"- For multiple tool calls, {chain}")


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
    return with_system_text(messages, HERMES_SYSTEM.format(tools=listing))


def with_system_text(messages: list[dict[str, Any]], system: str) -> list[dict[str, Any]]:
    """The conversation with `system` after its system prompt's text (a first system message when it has none)."""
    if not system:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{_text(messages[0]['content'])}\n\n{system}"}, *messages[1:]]
    return [{"role": "system", "content": system}, *messages]


def _text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's content as text: its non-empty text parts joined by newlines, as a text template reads them
    (conversation.template_conversation)."""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if part["text"])
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


# DeepSeek-V3's markers: full-width vertical bars (U+FF5C) around words joined by U+2581 (the SentencePiece space)
DS_CALLS_BEGIN, DS_CALLS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL_BEGIN, DS_CALL_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
DS_SEP = "<\uff5ctool\u2581sep\uff5c>"


def tool_start_marker(parser: str) -> str:
    """Where calls begin in a model's output; llama3_json has none (the answer is a JSON object)."""
    return {"hermes": HERMES_START, "mistral": "[TOOL_CALLS]", "llama3_json": "{", "deepseek_v3": DS_CALLS_BEGIN,
            "deepseek_v31": DS_CALLS_BEGIN, "qwen3_coder": HERMES_START, "glm45": HERMES_START,
            "glm47": HERMES_START}[parser]


def tool_parameters(parser: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """What a parser needs of the request's tools: each function's parameter schema by its name, for the parsers
    that type arguments by it (PARSERS_WITH_SCHEMAS); nothing for the others."""
    if parser not in PARSERS_WITH_SCHEMAS:
        return {}
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}


def parse_tool_calls(parser: str, text: str,
                     parameters: Mapping[str, Any] | None = None) -> tuple[str, list[ToolCall]]:
    """(content left over, calls) of a finished text; no calls when the text holds none that parse. `parameters`:
    the offered functions' parameter schemas by name (tool_parameters), which qwen3_coder types arguments by."""
    if parser == "hermes":
        return _parse_hermes(text)
    if parser == "mistral":
        return _parse_mistral(text)
    if parser == "llama3_json":
        return _parse_llama3(text)
    if parser in ("deepseek_v3", "deepseek_v31"):
        return _parse_deepseek(text)
    if parser == "qwen3_coder":
        return _parse_qwen3_coder(text, parameters or {})
    if parser in ("glm45", "glm47"):
        return _parse_glm45(text, parameters or {})
    raise ValueError(f"unknown tool call parser {parser!r}")


HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """Each `<tool_call>` holds one JSON object, then `</tool_call>` (or the end of the text: the last tag may be
    left open). The object is read as JSON, not cut at the first `</tool_call>`: an argument may hold that text."""
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    calls, at = [], start
    while at >= 0:
        decoded = _decode(text, _skip_space(text, at + len(HERMES_START)))
        if decoded is None:
            return text, []
        obj, end = decoded
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


def _parse_deepseek(text: str) -> tuple[str, list[ToolCall]]:
    """DeepSeek's calls: `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>` HEAD `<｜tool▁sep｜>` BODY
    `<｜tool▁call▁end｜>` (whitespace between calls), then `<｜tool▁calls▁end｜>`. V3 writes `function` SEP NAME, a
    newline and the arguments in a ```json fence; V3.1 writes NAME SEP ARGUMENTS. Either form is read under both
    parsers (a model named unlike its version still gets its calls). The arguments are read as JSON, not cut at
    the first marker or fence: an argument may hold that text. The last call may be cut short after its arguments
    (max_tokens); anything else that does not parse makes the whole text content."""
    start = text.find(DS_CALLS_BEGIN)
    if start < 0:
        return text, []
    calls, at = [], start + len(DS_CALLS_BEGIN)
    while True:
        at = _skip_space(text, at)
        if at == len(text) or text.startswith(DS_CALLS_END, at):
            break
        if not text.startswith(DS_CALL_BEGIN, at):
            return text, []
        parsed = _deepseek_call(text, at + len(DS_CALL_BEGIN))
        if parsed is None:
            return text, []
        call, at = parsed
        calls.append(call)
    if not calls:
        return text, []
    return text[:start].rstrip(), calls  # whitespace before the calls is no content (streamed: never sent)


def _deepseek_call(text: str, at: int) -> tuple[ToolCall, int] | None:
    """One call whose head starts at `at`: (the call, where the text after its end marker starts) or None."""
    sep = text.find(DS_SEP, at)
    if sep < 0 or "\n" in text[at:sep] or "<\uff5c" in text[at:sep]:  # a head of one line, in this call
        return None
    head, body = text[at:sep].strip(), _skip_space(text, sep + len(DS_SEP))
    if text.startswith("{", body):  # V3.1: NAME<｜tool▁sep｜>{...}
        name = head
    else:  # V3: function<｜tool▁sep｜>NAME\n```json\n{...}\n```
        line_end = text.find("\n", body)
        if line_end < 0:
            return None
        name, body = text[body:line_end].strip(), _skip_space(text, line_end)
        if not text.startswith("```", body):
            return None
        body = _skip_space(text, body + 3 + (4 if text.startswith("json", body + 3) else 0))
    decoded = _decode(text, body)
    if decoded is None:
        return None
    arguments, end = decoded
    call = _call_from_object({"name": name, "arguments": arguments})
    end = _skip_space(text, end)
    if text.startswith("```", end):
        end = _skip_space(text, end + 3)
    if call is None or not (end == len(text) or text.startswith(DS_CALL_END, end)):
        return None
    return call, min(end + len(DS_CALL_END), len(text))


QWEN_FUNCTION, QWEN_FUNCTION_END = "<function=", "</function>"
QWEN_PARAMETER, QWEN_PARAMETER_END = "<parameter=", "</parameter>"


def _parse_qwen3_coder(text: str, parameters: Mapping[str, Any]) -> tuple[str, list[ToolCall]]:
    """Qwen3-Coder's calls: `<tool_call>` `<function=NAME>`, then per argument `<parameter=KEY>` VALUE
    `</parameter>`, then `</function>` `</tool_call>` (the last may be left open at the end of the text). Each VALUE is
    raw text, one newline trimmed either side as the template writes them, typed by the function's parameter schema
    (_typed_argument). Text after the calls is no content, as for hermes; a call that does not parse (no function,
    an unclosed one) makes the whole text content."""
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    calls, at = [], start
    while at >= 0:
        parsed = _qwen_function(text, _skip_space(text, at + len(HERMES_START)), parameters)
        if parsed is None:
            return text, []
        call, end = parsed
        end = _skip_space(text, end)
        if not (end == len(text) or text.startswith(HERMES_END, end)):
            return text, []
        calls.append(call)
        at = text.find(HERMES_START, end)
    return text[:start].rstrip(), calls


def _qwen_function(text: str, at: int, parameters: Mapping[str, Any]) -> tuple[ToolCall, int] | None:
    """The `<function=NAME>...</function>` at `at`: (the call, where the text after it starts) or None. A value ends
    at its `</parameter>` (so it may hold `</function>` or `<parameter=`); only whitespace between the tags."""
    if not text.startswith(QWEN_FUNCTION, at):
        return None
    name_end = text.find(">", at)
    name = text[at + len(QWEN_FUNCTION):name_end].strip() if name_end >= 0 else ""
    if not name or "\n" in name or "<" in name:
        return None
    schema, arguments, at = parameters.get(name), {}, _skip_space(text, name_end + 1)
    while text.startswith(QWEN_PARAMETER, at):
        key_end = text.find(">", at)
        value_end = text.find(QWEN_PARAMETER_END, key_end)
        key = text[at + len(QWEN_PARAMETER):key_end].strip()
        if key_end < 0 or value_end < 0 or not key or "\n" in key:
            return None
        value = text[key_end + 1:value_end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = _typed_argument(value, _property_schema(schema, key), schema)
        at = _skip_space(text, value_end + len(QWEN_PARAMETER_END))
    written = _arguments_text(arguments)
    if written is None or not text.startswith(QWEN_FUNCTION_END, at):
        return None
    return ToolCall(name, written), at + len(QWEN_FUNCTION_END)


GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_GLM_NAME = re.compile(r"[ \t]*([\w.:/-]+)")  # a function's name, as OpenAI's, MCP's (server.tool, a/b) write them


def _parse_glm45(text: str, parameters: Mapping[str, Any]) -> tuple[str, list[ToolCall]]:
    """GLM-4.5 / 4.6 / 4.7's calls: `<tool_call>NAME`, then per argument `<arg_key>KEY</arg_key>`
    `<arg_value>VALUE</arg_value>` (whitespace between the tags: a newline in 4.5's template, none in 4.7's), then
    `</tool_call>` (the last may be left open at the end of the text). The template writes a string VALUE as it is
    and anything else as JSON: each is typed by the function's parameter schema (_typed_argument, as qwen3_coder's).
    Text after the calls is no content, as for hermes; a call that does not parse makes the whole text content."""
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    calls, at = [], start
    while at >= 0:
        parsed = _glm_call(text, at + len(HERMES_START), parameters)
        if parsed is None:
            return text, []
        call, at = parsed
        calls.append(call)
        at = text.find(HERMES_START, at)
    return text[:start].rstrip(), calls


def _glm_call(text: str, at: int, parameters: Mapping[str, Any]) -> tuple[ToolCall, int] | None:
    """The call whose name starts at `at` (just after `<tool_call>`): (the call, where the text after its
    `</tool_call>` starts) or None. The name is a function's: letters, digits and `_-.:/`, then (after whitespace,
    which 4.5's template writes as a newline and 4.7's not at all) `<arg_key>` or `</tool_call>`, or a newline and
    the end of the text (cut short); anything else after `<tool_call>` is prose ("see <tool_call> in the docs") or
    another format (Hermes JSON), no call. A value ends at its `</arg_value>` (so it may hold `</tool_call>` or
    `<arg_key>`)."""
    named = _GLM_NAME.match(text, at)
    after = _skip_space(text, named.end()) if named is not None else at
    if named is None or not (text.startswith((GLM_KEY, HERMES_END), after)
                             or (after == len(text) and "\n" in text[named.end():])):
        return None
    name = named.group(1)
    schema, arguments, at = parameters.get(name), {}, after
    while text.startswith(GLM_KEY, at):
        key_end = text.find(GLM_KEY_END, at)
        key = text[at + len(GLM_KEY):key_end].strip() if key_end >= 0 else ""
        value_at = _skip_space(text, key_end + len(GLM_KEY_END))
        if not key or "<" in key or not text.startswith(GLM_VALUE, value_at):
            return None
        value_end = text.find(GLM_VALUE_END, value_at)
        if value_end < 0:
            return None
        arguments[key] = _typed_argument(text[value_at + len(GLM_VALUE):value_end], _property_schema(schema, key),
                                         schema)
        at = _skip_space(text, value_end + len(GLM_VALUE_END))
    written = _arguments_text(arguments)
    if written is None or (at < len(text) and not text.startswith(HERMES_END, at)):
        return None
    return ToolCall(name, written), min(at + len(HERMES_END), len(text))


def _property_schema(schema: Any, key: str) -> dict[str, Any] | None:
    """The schema of argument `key` in a function's parameter schema (a local $ref followed); None: none given."""
    if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
        return None
    prop = _resolve(schema["properties"].get(key), schema)
    return prop if isinstance(prop, dict) else None


def _resolve(schema: Any, root: Any) -> Any:
    """`schema` with its local $ref ("#", "#/...") followed in `root`, the function's parameter schema (a chain of
    them, pydantic's "#/$defs/Model"). One that leads nowhere, or round a cycle, is {}: a schema that says nothing."""
    for _ in range(8):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
            return schema
        target: Any = root
        for part in ref[2:].split("/") if ref != "#" else ():
            target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
        schema = target if isinstance(target, dict) else {}
    return {}


_LITERAL_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
                  (dict, "object"), (type(None), "null"))


def _literals(schema: dict[str, Any]) -> list[Any] | None:
    """The values an `enum` or `const` allows; None: neither says."""
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return enum if isinstance(enum, list) else None


def _schema_types(schema: Any, root: Any) -> list[str]:
    """The JSON types a schema allows: its type (a name or a list), else the types of its enum's or const's values,
    else those of its anyOf / oneOf / allOf branches, local $refs followed in `root` (pydantic's Optional[Model]:
    anyOf [{"$ref"}, {"type": "null"}]). A client's schema may be any shape: what is not a schema names no type, and
    at most 64 schemas are read (a cycle of $refs, or branches nested thousands deep, ends there)."""
    types: list[str] = []
    pending, budget = [schema], 64
    while pending and budget:
        budget -= 1
        node = _resolve(pending.pop(), root)
        if not isinstance(node, dict):
            continue
        kind, literals = node.get("type"), _literals(node)
        if isinstance(kind, str | list):
            named = [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)]
        elif literals is not None:
            named = [next(n for t, n in _LITERAL_TYPES if isinstance(v, t)) for v in literals
                     if isinstance(v, tuple(t for t, _ in _LITERAL_TYPES))]
        else:
            branches = [b for key in ("anyOf", "oneOf", "allOf") if isinstance(node.get(key), list) for b in node[key]]
            pending += reversed(branches)  # depth first, in the order written
            continue
        types += [k for k in named if k not in types]
    return types


def _typed_argument(value: str, schema: dict[str, Any] | None, root: Any) -> Any:
    """An argument's raw text as its schema's type (`root`: the function's parameter schema, where its $refs point).
    No schema for it (the model named a parameter the function lacks): the text. A type that the text is not (an
    integer parameter given "a few"): the text, as the model wrote it, for the tool to judge; so is a string
    parameter's text that looks like JSON. A None argument is written `null` (GLM's template, tojson) or `None`
    (Qwen3-Coder's, Jinja's none|string): `null` is null where the schema allows null or no string (`anyOf [string,
    null]` given `null` is null, as vLLM's reads it; a string-only parameter keeps the text), `None` where it allows
    no string (where a string is allowed, `None` may be the word). With several types (a list, anyOf), the first
    that reads the text, strings last; an enum or const by its values' types (a text that is one of its strings is
    that string); none named (a bare unresolved $ref or {}): an object or array that reads as JSON, else the text."""
    if schema is None:
        return value
    literals = _literals(schema)
    if literals is not None and value in literals:  # enum ["1", 2] given 1: the string, not the integer
        return value
    types = _schema_types(schema, root)
    if not types:
        parsed = _loads(value.strip())
        return parsed if isinstance(parsed, dict | list) else value
    stripped = value.strip()
    if (stripped == "null" and ("null" in types or "string" not in types)) or (
            stripped == "None" and "string" not in types):
        return None
    for kind in sorted(types, key=lambda k: k == "string"):  # strings last: any text is one
        if kind == "string":
            return value
        if kind == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        if kind in ("integer", "number"):
            number = _loads(stripped)
            if isinstance(number, int) and not isinstance(number, bool):  # any size: no float() of it
                return number
            if isinstance(number, float) and (kind == "number" or number.is_integer()):  # finite: _DECODER
                return int(number) if kind == "integer" else number
        if kind in ("object", "array"):
            parsed = _loads(stripped)
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    return value


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
    parts, index = [], 0
    while index < len(body):
        decoded = _decode(body, index)
        if decoded is None:
            return [body]  # not a sequence of objects: the whole body fails to parse later
        end = decoded[1]
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
    calls = [_required_call(o) for o in parsed]
    return [c for c in calls if c is not None]


def constrained_output_closed(text: str, kind: type = object) -> bool:
    """Whether a constrained output is its whole value, closed: a `required` output its array (kind list), a named
    call's its arguments (an object, or whatever JSON the tool's schema names). A stop string or max_tokens can end
    it earlier, and then its calls (parse_required, or the named call) are no finished answer."""
    start = len(text) - len(text.lstrip())
    try:
        value, end = _PERMISSIVE.raw_decode(text, start)
    except _JSON_ERRORS:
        return False
    return isinstance(value, kind) and not text[end:].strip()


# the call being written when the tokens ran out: its name whole, then its parameters so far
_CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(?:\s*,\s*"parameters"\s*:\s*(.*))?', re.DOTALL)


def _required_cut_short(text: str) -> list[ToolCall]:
    """The calls of a `required` array whose text ends before its `]`."""
    calls: list[ToolCall] = []
    index = len(text) - len(text.lstrip())
    if not text.startswith("[", index):
        return []
    index += 1
    while True:
        while index < len(text) and text[index] in " \n\t\r,":
            index += 1
        decoded = _decode(text, index)
        if decoded is None:
            verbatim = _verbatim_call(text, index)
            if verbatim is None:
                break
            call, index = verbatim
            calls.append(call)
            continue
        obj, index = decoded
        call = _required_call(obj)
        if call is not None:
            calls.append(call)
    cut = _CUT_CALL.match(text, index)
    name = _loads(cut.group(1)) if cut is not None else None
    if isinstance(name, str) and not _SURROGATE.search(name):
        calls.append(ToolCall(name, cut.group(2) or ""))  # type: ignore[union-attr]
    return calls


# reads 1e400 (as inf), still not NaN or Infinity: only to find where a whole call ends
_PERMISSIVE = json.JSONDecoder(parse_constant=lambda name: _no_constant(name))  # defined below


def _verbatim_call(text: str, index: int) -> tuple[ToolCall, int] | None:
    """A whole `required` call at `index` that the strict reader refuses, with its parameters as the model wrote
    them, and the index after it; None: no whole call there. The grammar admits any JSON number, and one past a
    double's range (`80E680792574`) is JSON all the same: the call is the model's, its arguments its own text."""
    try:
        obj, end = _PERMISSIVE.raw_decode(text, index)
    except _JSON_ERRORS:
        return None
    cut = _CUT_CALL.match(text, index)
    if not isinstance(obj, dict) or "parameters" not in obj or cut is None or cut.group(2) is None:
        return None
    name = _loads(cut.group(1))
    arguments = text[cut.start(2):end].rstrip()
    if not isinstance(name, str) or not name or _SURROGATE.search(name) or not arguments.endswith("}"):
        return None
    return ToolCall(name, arguments[:-1].rstrip()), end  # without the call's own closing brace


def _required_call(obj: Any) -> ToolCall | None:
    """One call of a `required` array: its parameters are the arguments whatever JSON they are (the grammar held
    them to the tool's schema, which may name a string, an array, a number: vLLM takes such tools), a string
    included, which is no JSON text of the arguments as some models write them under `auto`."""
    if not _named_object(obj):
        return None
    text = _arguments_text(obj.get("parameters", {}))
    return None if text is None else ToolCall(obj["name"], text)


def _named_object(obj: Any) -> bool:
    """Whether a call's object has a name: a non-empty string with no lone surrogate escape (JSON's "\\ud800": no
    UTF-8 text, so no name)."""
    return isinstance(obj, dict) and isinstance(obj.get("name"), str) and bool(obj["name"]) \
        and not _SURROGATE.search(obj["name"])


def _call_from_object(obj: Any) -> ToolCall | None:
    if not _named_object(obj):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _loads(arguments)
    text = _arguments_text(arguments) if isinstance(arguments, dict) else None
    return None if text is None else ToolCall(obj["name"], text)


# Model text that is no JSON we read: malformed, nested past the recursion limit (RecursionError) or an integer
# past Python's digit limit (ValueError). Where it is read the text is no call (content) or an argument stays text;
# never an error, which would be a 500 for what a model wrote.
_JSON_ERRORS = (ValueError, RecursionError)


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text} is past a double's range")
    return number


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Standard JSON only, one rule for every parser: NaN, Infinity and -Infinity (which Python's json reads) and numbers
# past a double's range (1e400 reads as inf) have no JSON text, so a model's text holding them is no JSON. A call
# whose arguments hold them is content (hermes, mistral, llama3_json, deepseek); a schema-typed argument
# (qwen3_coder, glm45) that is one, or holds one, stays text. So every call's arguments are strict JSON.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


def _loads(text: str) -> Any:
    try:
        return _DECODER.decode(text)
    except (*_JSON_ERRORS, TypeError):
        return None


def _decode(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON value that starts at `at` and the index after it; None: none reads there."""
    try:
        return _DECODER.raw_decode(text, at)
    except _JSON_ERRORS:
        return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _arguments_text(arguments: Any) -> str | None:
    """A call's arguments as JSON text; None where they do not write (nested as deep as the recursion limit). A lone
    surrogate (JSON's "\\ud800", which a model may write) has no UTF-8, so the response could not be sent: such
    arguments keep JSON's escapes."""
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except _JSON_ERRORS:
        return None
    return json.dumps(arguments) if _SURROGATE.search(text) else text
