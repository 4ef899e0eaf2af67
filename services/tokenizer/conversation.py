"""Chat messages as vLLM hands them to a chat template: content as a string or as text parts (whichever the
template reads: vLLM's "auto" content format), tool call arguments as objects, an earlier answer's reasoning under
both of its names. Pure functions of the messages and the template's text."""

from __future__ import annotations

import functools
import json
from typing import Any, Literal

from jinja2 import nodes
from transformers.utils.chat_template_utils import _compile_jinja_template

from pagoda.services.protocol.schemas import check_answer_fields
from pagoda.shared.errors import InvalidRequestError

ContentFormat = Literal["string", "openai"]


@functools.lru_cache(maxsize=16)
def content_format(chat_template: str) -> ContentFormat:
    """vLLM's "auto" detection: "openai" (content as [{"type": "text", "text": ...}, ...]) when the template loops
    over a message's content (`{% for part in message['content'] %}`: vision-era templates, which would loop over a
    string's characters) or over a variable named `content` (`{% for item in content %}`: Qwen3.5's macro that
    renders a message's content, as vLLM reads it too), else "string" (text parts joined by newlines)."""
    try:
        root = _compile_jinja_template(chat_template).environment.parse(chat_template)
    except Exception:  # a template that does not compile fails when it renders, with its own message
        return "string"
    loops = list(root.find_all(nodes.For))
    messages = _aliases(root, "messages")
    message_names = {loop.target.name for loop in loops
                     if isinstance(loop.target, nodes.Name) and _reads(loop.iter, messages)}
    parts = any(_reads(loop.iter, message_names, key="content") or _reads(loop.iter, {"content"}) for loop in loops)
    return "openai" if parts else "string"


@functools.lru_cache(maxsize=16)
def arguments_as_text(chat_template: str) -> bool:
    """Whether the template joins a tool call's arguments to strings with `+` or `~` (DeepSeek's write
    `... + tool['function']['arguments'] + ...`), so it needs them as JSON text: an object there raised "can only
    concatenate str (not "dict") to str". Every other template gets them as an object (they `tojson` them or loop
    over `.items()`), as vLLM gives them."""
    try:
        root = _compile_jinja_template(chat_template).environment.parse(chat_template)
    except Exception:  # a template that does not compile fails when it renders, with its own message
        return False
    joined = (operand for node in root.find_all((nodes.Add, nodes.Concat))
              for operand in ([node.left, node.right] if isinstance(node, nodes.Add) else node.nodes))
    return any(_item_named(operand, "arguments") for operand in joined)


def _item_named(node: nodes.Node, key: str) -> bool:
    """Whether `node` reads an item or attribute called `key` (`x['key']` or `x.key`), unfiltered."""
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == key
    return isinstance(node, nodes.Getattr) and node.attr == key


def _aliases(root: nodes.Template, name: str) -> set[str]:
    """`name` and the variables set from it (`{% set loop_messages = messages[1:] %}`), transitively."""
    names, todo = {name}, [name]
    while todo:
        source = todo.pop()
        for assign in root.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in names and _reads(assign.node, {source}):
                names.add(target.name)
                todo.append(target.name)
    return names


def _reads(node: nodes.Node | None, names: set[str], key: str | None = None) -> bool:
    """Whether `node` is one of `names` (with `key`: its `key` item), under filters, tests and slices."""
    while isinstance(node, (nodes.Filter, nodes.Test)) or (isinstance(node, nodes.Getitem)
                                                           and isinstance(node.arg, nodes.Slice)):
        node = node.node
    if key is not None:
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key:
            node = node.node
        elif isinstance(node, nodes.Getattr) and node.attr == key:
            node = node.node
        else:
            return False
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def template_conversation(messages: object, fmt: ContentFormat = "string", text_arguments: bool = False,
                          chat_template: str | None = None) -> list[dict[str, Any]]:
    """The messages as vLLM gives them to the template, checked for the OpenAI shape (InvalidRequestError): content
    a string (non-empty text parts joined by newlines) or, for an "openai" template, text parts (a tool result stays
    a string); a turn that only calls tools has empty content; tool call arguments sent as JSON text become objects
    ({} where the text is not JSON), an empty tool_calls is dropped; an assistant's reasoning is there as both
    `reasoning` and `reasoning_content` (templates read either); an answer's refusal, annotations, audio or
    function_call is refused unless null, as the server refuses them. Other keys pass as they are.
    `text_arguments` (arguments_as_text): the arguments stay JSON text, for templates that join them as text.
    `chat_template`: the template's text, which decides how developer turns reach it (developer_as_system)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}].role must be a non-empty string", param="messages")
        check_answer_fields(message, f"messages[{i}]")  # the server's refusal of what templates do not render
        entry = {**message, "content": _content(message, i, fmt)}
        if role == "assistant":
            _assistant_fields(entry, text_arguments)
        out.append(entry)
    return developer_as_system(out, chat_template)


def names_developer(chat_template: str) -> bool:
    """Whether the template's text names the developer role (vLLM's test: 'developer' or "developer" in it)."""
    return "'developer'" in chat_template or '"developer"' in chat_template


def developer_as_system(messages: list[dict[str, Any]], chat_template: str | None) -> list[dict[str, Any]]:
    """vLLM's developer turns: as they are for a template that names the role (names_developer); for any other,
    system turns, and then the system turns merged into one, first, their texts joined by a blank line, where one
    stands after another turn or there are several (templates refuse a system turn after the first, or drop a role
    they do not know). The messages' content: a string or text parts."""
    if chat_template is None or names_developer(chat_template) or all(m["role"] != "developer" for m in messages):
        return messages
    turns = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    systems = [m for m in turns if m["role"] == "system"]
    if len(systems) == 1 and turns[0] is systems[0]:
        return turns
    texts = (_text(m.get("content")) for m in systems)
    text = "\n\n".join(text for text in texts if text)
    # as parts where the turns came as parts (a template that loops over them would read a string's characters)
    as_parts = any(isinstance(m.get("content"), list) for m in systems)
    merged = {"role": "system", "content": [{"type": "text", "text": text}] if as_parts else text}
    return [merged, *(m for m in turns if m["role"] != "system")]


def _text(content: object) -> str:
    """A system turn's content as text: a string, or its text parts' non-empty texts joined by newlines."""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if isinstance(part, dict) and part.get("text"))
    return content if isinstance(content, str) else ""


def _content(message: dict[str, Any], i: int, fmt: ContentFormat) -> str | list[dict[str, str]]:
    """messages[i]'s content in `fmt`, as vLLM gives it: "string", its non-empty texts joined by newlines (vLLM
    leaves an empty text part out); "openai", its text parts, a tool result's texts joined back into a string
    (InvalidRequestError where it is neither a string nor text parts, or null outside an assistant turn that calls
    tools)."""
    content = message.get("content")
    if isinstance(content, list):
        texts = [_part_text(part, i) for part in content]
    elif isinstance(content, str):
        texts = [content]
    elif content is None and message.get("role") == "assistant" and message.get("tool_calls"):
        texts = []  # OpenAI lets an assistant turn that only calls tools leave content null
    elif content is None:
        raise InvalidRequestError(f"messages[{i}].content is required", param="messages")
    else:
        raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts",
                                  param="messages")
    if fmt == "string":
        return "\n".join(text for text in texts if text)
    if message.get("role") == "tool":  # most templates write a tool result as a string
        return "\n".join(texts)
    return [{"type": "text", "text": text} for text in texts]


def _part_text(part: object, i: int) -> str:
    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
        raise InvalidRequestError(f"messages[{i}].content parts must be text parts "
                                  '{"type": "text", "text": "..."}', param="messages")
    return part["text"]


def _assistant_fields(entry: dict[str, Any], arguments_as_text: bool = False) -> None:
    """Arguments as objects (templates `tojson` them or loop over `.items()`) unless the template joins them as
    text, reasoning under both names."""
    calls = entry.get("tool_calls")
    if isinstance(calls, list) and not calls:
        del entry["tool_calls"]
    elif isinstance(calls, list):
        entry["tool_calls"] = [_text_call(call) if arguments_as_text else _parsed_call(call) for call in calls]
    reasoning = entry.get("reasoning")
    if reasoning is None:  # a null `reasoning` is absent, as the served path reads it
        reasoning = entry.get("reasoning_content")
    if isinstance(reasoning, str):
        entry["reasoning"] = entry["reasoning_content"] = reasoning


def _text_call(call: Any) -> Any:
    """A tool call with its arguments as JSON text (an object sent is written as JSON); a call of another shape as
    it is."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or isinstance(function.get("arguments"), str):
        return call
    arguments = function.get("arguments")
    text = json.dumps(arguments, ensure_ascii=False) if isinstance(arguments, (dict, list)) else "{}"
    return {**call, "function": {**function, "arguments": text}}


def _parsed_call(call: Any) -> Any:
    """A tool call with its arguments as an object ({} where they are not JSON, or JSON Python does not read: an
    integer past its digit limit, a ValueError; arrays nested past the recursion limit); a call of another shape as
    it is."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = {}
    elif not isinstance(arguments, (dict, list)):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}
