"""A chat choice's text as OpenAI message parts: reasoning (also as reasoning_content), content and tool_calls,
whole or streamed.

Streaming follows OpenAI: a tool call's first delta carries its index, id, type and name with empty arguments,
later deltas carry argument fragments. Text that may begin a tool call is held back until the choice ends
(auto and required modes); with a named function every token is an argument fragment at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pagoda.services.protocol.reasoning import ReasoningStream, split_reasoning
from pagoda.services.protocol.tools import (
    ToolCall,
    constrained_output_closed,
    new_call_id,
    parse_required,
    parse_tool_calls,
    tool_start_marker,
)


@dataclass(slots=True, frozen=True)
class ChatOutputSpec:
    """How a response's choices are read: tool mode none|auto|required|named, parsers by name."""

    tool_mode: str = "none"
    tool_parser: str = "hermes"
    tool_name: str = ""  # named mode
    reasoning_parser: str | None = None
    max_calls: int = 0  # parallel_tool_calls=false: 1 (the first call is kept); 0: no limit
    prompt_reasoning: str = ""  # where the prompt left the think block (reasoning.prompt_reasoning), once tokenized
    # function name -> parameter schema, for the parsers that type arguments by it (tools.tool_parameters)
    tool_parameters: dict[str, Any] = field(default_factory=dict)
    include_reasoning: bool = True  # vLLM's include_reasoning: false drops the reasoning the parser separates

    @property
    def active(self) -> bool:
        return self.tool_mode != "none" or self.reasoning_parser is not None

    @property
    def hides_reasoning(self) -> bool:
        """The parser separates reasoning and the request asked not to see it (include_reasoning false): no
        reasoning field, and no logprobs or token ids, which would spell it out (vLLM's)."""
        return self.reasoning_parser is not None and not self.include_reasoning


def whole_message(spec: ChatOutputSpec, text: str) -> tuple[dict[str, Any], bool]:
    """The message of a finished choice, and whether its answer is tool calls (finish_reason "tool_calls" when it
    stopped; a `required` array cut before its `]` still shows its calls, but is no finished answer)."""
    reasoning, content = (split_reasoning(spec.reasoning_parser, text, spec.prompt_reasoning) if spec.reasoning_parser
                          else (None, text))
    calls = _calls(spec, content)
    message: dict[str, Any] = {"role": "assistant"}
    if calls is not None:
        leftover, parsed = calls
        message["content"] = leftover or None
        message["tool_calls"] = [c.to_openai(new_call_id(spec.tool_parser)) for c in parsed]
    else:
        message["content"] = content
    if spec.reasoning_parser is not None and spec.include_reasoning:
        message.update(reasoning_fields(reasoning))
    return message, _finished_calls(spec, content, calls)


def _finished_calls(spec: ChatOutputSpec, content: str, calls: tuple[str, list[ToolCall]] | None) -> bool:
    """Whether the choice's answer is tool calls (finish_reason "tool_calls" when it stopped): a `required` array
    that a stop string cut before its `]` holds calls, but is no finished answer; nor is a named call whose
    arguments it cut before their object closed (or before they began: the think block never closed)."""
    if calls is None:
        return False
    if spec.tool_mode == "required":
        return constrained_output_closed(content, list)
    if spec.tool_mode == "named":
        return constrained_output_closed(content)
    return True


def reasoning_fields(reasoning: str | None) -> dict[str, str | None]:
    """The think block under both names clients read: `reasoning` (vLLM's since 0.11, OpenRouter's) and
    `reasoning_content` (DeepSeek's, vLLM's before; the renderers of other APIs read this one)."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def _calls(spec: ChatOutputSpec, content: str) -> tuple[str, list[ToolCall]] | None:
    """(content left, calls) when the content holds tool calls, else None."""
    if spec.tool_mode == "named":
        return "", [ToolCall(spec.tool_name, content)]
    leftover, calls = "", []
    if spec.tool_mode == "required":
        calls = parse_required(content)
    elif spec.tool_mode == "auto":
        leftover, calls = parse_tool_calls(spec.tool_parser, content, spec.tool_parameters)
    if not calls:
        return None
    return leftover, calls[:spec.max_calls] if spec.max_calls else calls


@dataclass(slots=True)
class ChoiceStream:
    """One streamed choice: push text, get delta dicts; finish() flushes and says whether the answer is tool calls
    (whole_message's flag)."""

    spec: ChatOutputSpec
    reasoning: ReasoningStream | None = None
    # content that may be a tool call (a named call's arguments, sent as they come), in pieces joined once at the
    # end: `held += text` copied all of it on every token (a 64k-token call: a second of the tokenizer's CPU)
    held: list[str] = field(default_factory=list)
    holding: bool = False
    plain: bool = False  # llama3_json: content was sent, so the answer is no call (its calls are the whole answer)
    num_calls: int = 0

    def __post_init__(self) -> None:
        if self.spec.reasoning_parser is not None:
            self.reasoning = ReasoningStream(self.spec.reasoning_parser, self.spec.prompt_reasoning)

    def after_prompt(self, prompt_reasoning: str) -> None:
        """Before any text: the prompt was rendered, and left the think block so (reasoning.prompt_reasoning)."""
        if self.reasoning is not None:
            self.spec = replace(self.spec, prompt_reasoning=prompt_reasoning)
            self.reasoning = ReasoningStream(self.reasoning.parser, prompt_reasoning)

    def push(self, text: str) -> list[dict[str, Any]]:
        if self.reasoning is None:
            return self._content(text)
        reasoning, content = self.reasoning.push(text)
        return self._reasoning(reasoning) + self._content(content)

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        deltas: list[dict[str, Any]] = []
        if self.reasoning is not None:
            reasoning, content = self.reasoning.close()
            deltas += self._reasoning(reasoning) + self._content(content)
        if self.spec.tool_mode == "named":
            # a call with no arguments written (the tokens ran out first) is still the whole message's call
            arguments = "".join(self.held)
            return deltas + self._named_header(), _finished_calls(self.spec, arguments, _calls(self.spec, arguments))
        held = "".join(self.held)
        if not held:
            return deltas, False
        calls = _calls(self.spec, held)
        if calls is None:
            return deltas + [{"content": held}], False
        leftover, parsed = calls
        if leftover:
            deltas.append({"content": leftover})
        for i, call in enumerate(parsed):
            deltas.append({"tool_calls": [{"index": i, "id": new_call_id(self.spec.tool_parser), "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            if call.arguments:  # none written yet: a call cut short before its arguments
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        return deltas, _finished_calls(self.spec, held, calls)

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        """The reasoning delta of `text`: none when empty, or when the request does not want it."""
        return [reasoning_fields(text)] if text and self.spec.include_reasoning else []

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        mode = self.spec.tool_mode
        if mode == "none":
            return [{"content": text}]
        if mode == "named":  # sent at once, and kept: finish() tells whether the object closed
            self.held.append(text)
            return self._named_header() + [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        if mode == "required" or self.holding:
            self.held.append(text)
            return []
        return self._auto(text)

    def _named_header(self) -> list[dict[str, Any]]:
        """The named call's first delta (its id and name), once."""
        if self.num_calls:
            return []
        self.num_calls = 1
        return [{"tool_calls": [{"index": 0, "id": new_call_id(self.spec.tool_parser), "type": "function",
                                 "function": {"name": self.spec.tool_name, "arguments": ""}}]}]

    def _auto(self, text: str) -> list[dict[str, Any]]:
        """Send content up to where a tool call could start; hold the rest until the end. Whitespace at the end of
        what is sent waits for the text after it: before a call it is no content (parse_tool_calls drops it), so a
        streamed answer is the whole one."""
        if text.isspace() and not self.plain and (len(self.held) > 1 or not self.held or self.held[0].isspace()):
            # whitespace after whitespace waits, as below, without joining what waits on every token (a model
            # looping on newlines); more than one piece held here is whitespace only
            self.held.append(text)
            return []
        marker = tool_start_marker(self.spec.tool_parser)
        pending = "".join(self.held) + text
        self.held = []
        if self.spec.tool_parser == "llama3_json":  # calls are the whole answer: hold if it opens with {
            stripped = pending.lstrip()
            if not stripped and not self.plain:
                self.held = [pending]
                return []
            if not self.plain and (stripped.startswith("{") or "<|python_tag|>".startswith(stripped[:14])):
                self.holding, self.held = True, [pending]
                return []
            self.plain = True
            return [{"content": pending}]
        start = pending.find(marker)
        cut = start if start >= 0 else len(pending) - next(
            (n for n in range(min(len(marker) - 1, len(pending)), 0, -1) if marker.startswith(pending[-n:])), 0)
        send = pending[:cut].rstrip()
        # what is held keeps the whitespace: content again if no call parses out of it
        self.holding, self.held = start >= 0, [pending[len(send):]]
        return [{"content": send}] if send else []


@dataclass(slots=True)
class ChatStreams:
    """The ChoiceStreams of one response, by choice index."""

    spec: ChatOutputSpec
    streams: dict[int, ChoiceStream] = field(default_factory=dict)

    def get(self, index: int) -> ChoiceStream:
        stream = self.streams.get(index)
        if stream is None:
            stream = self.streams[index] = ChoiceStream(self.spec)
        return stream
