"""Reasoning parsers: `<think>...</think>` becomes `reasoning_content`, the rest `content`; whole or streamed.

- qwen3: reasoning only when the output opens with `<think>` (enable_thinking=False gives none).
- deepseek_r1: the template opens the think block in the prompt, so the output starts inside it and
  everything up to `</think>` is reasoning; an output that never closes it is all reasoning.

Either parser follows the prompt (vLLM's `prompt_is_reasoning_end`, and its qwen3 parser for Qwen3-Thinking-2507
and Qwen3.5, whose templates open the block): a prompt inside a think block it opened starts the output inside it;
one that ends by closing it (enable_thinking=False) makes the whole output content.

vLLM's thinking_token_budget bounds that block: `thinking_budget` says what the worker enforces (its
ThinkingCounter, services/worker/thinking.py), from the same reading of where the prompt left it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pagoda.shared.messages import ThinkingBudget

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"
PROMPT_OPENED, PROMPT_CLOSED = "opened", "closed"  # where the prompt left the think block; "" neither


def prompt_reasoning(prompt_text: str, turn_markers: Iterable[str] = ()) -> str:
    """Whether the rendered prompt ends inside a think block it opened (its last marker is `<think>`: the template's,
    or an assistant prefill's thinking begun), or after one it closed (its last marker is `</think>`: Qwen3's
    enable_thinking=False, or a prefill of an answer after an empty block), or neither. Either only where none of
    `turn_markers` (the tokenizer's special tokens: `<|im_end|>`, ...; `<think>` and `</think>` themselves aside,
    which some tokenizers list) follows that marker: a `<think>` a system or user message mentions ("reason inside
    <think> tags") opens nothing, and an earlier turn's block kept in the history (Qwen3's tool turns) closes
    nothing of this answer. The grammar of a constrained answer starts where this says (constrain_after_reasoning)."""
    start, end = prompt_text.rfind(THINK_START), prompt_text.rfind(THINK_END)
    if start < 0 and end < 0:
        return ""
    word, tail = (PROMPT_OPENED, prompt_text[start + len(THINK_START):]) if start > end \
        else (PROMPT_CLOSED, prompt_text[end + len(THINK_END):])
    if any(marker and marker in tail for marker in turn_markers if marker not in (THINK_START, THINK_END)):
        return ""
    return word


def thinking_budget(budget: int, parser: str, prompt: str, prompt_text: str,
                    encode: Callable[[str], list[int]]) -> ThinkingBudget | None:
    """vLLM's thinking_token_budget for one chat prompt (`prompt`: prompt_reasoning's word for `prompt_text`; `encode`:
    text -> the tokenizer's ids, no special tokens added), or None where the prompt closed the block (the output
    has no reasoning to bound). The output starts inside the block where the prompt opened it, or always under
    deepseek_r1 (as ReasoningStream reads it); under qwen3 otherwise only an output that opens with `<think>` has
    one. As vLLM's, the tokens a prompt wrote inside the block it left open (an assistant prefill's thinking,
    DeepSeek-R1's newline after `<think>`) are spent already: its text after the opener, tokenized on its own."""
    assert parser in REASONING_PARSERS, parser
    if prompt == PROMPT_CLOSED:
        return None
    spent = 0
    if prompt == PROMPT_OPENED:
        spent = len(encode(prompt_text[prompt_text.rfind(THINK_START) + len(THINK_START):]))
    inside = parser == "deepseek_r1" or prompt == PROMPT_OPENED
    return ThinkingBudget(max_tokens=max(budget - spent, 0), end=THINK_END, end_token_ids=encode(THINK_END),
                          start="" if inside else THINK_START)


def split_reasoning(parser: str, text: str, prompt: str = "") -> tuple[str | None, str]:
    """(reasoning_content or None, content) of a finished output; `prompt` is prompt_reasoning's word."""
    stream = ReasoningStream(parser, prompt)
    reasoning, content = stream.push(text)
    more_reasoning, more_content = stream.close()
    reasoning += more_reasoning
    content += more_content
    return (reasoning if stream.saw_reasoning else None), content


@dataclass(slots=True)
class ReasoningStream:
    """Splits streamed text; holds back a tail that may be the start of a marker."""

    parser: str
    prompt: str = ""  # prompt_reasoning's word for the prompt this output continues
    state: str = "start"  # start -> reasoning -> content (or start -> content)
    pending: str = ""
    saw_reasoning: bool = False
    strip_newlines: bool = False  # just after </think>: the template's newlines are not content
    opening: bool = False  # the prompt opened the block and none of the reasoning was seen yet: a repeated
    # opener may stand here
    # whitespace while the start is undecided (a `<think>` may follow), in pieces joined once something else comes:
    # `pending += text` and its lstrip() copied and scanned all of it on every token (a model looping on newlines:
    # 128k of them, 11 s of the tokenizer's CPU). While it holds any, `pending` is empty.
    space: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.parser in REASONING_PARSERS, self.parser
        assert self.prompt in ("", PROMPT_OPENED, PROMPT_CLOSED), self.prompt
        if self.prompt == PROMPT_CLOSED:
            self.state = "content"  # the template closed the block: the model writes no reasoning
        elif self.parser == "deepseek_r1" or self.prompt == PROMPT_OPENED:
            self.state, self.saw_reasoning, self.opening = "reasoning", True, True

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can be sent now."""
        if (self.state == "start" or self.opening) and not self.pending and not text.strip():
            self.space.append(text)  # undecided either way: whitespace decides nothing
            return "", ""
        if self.space:
            self.pending, self.space = "".join(self.space), []
        self.pending += text
        reasoning = content = ""
        if self.state == "start":
            stripped = self.pending.lstrip()
            if stripped.startswith(THINK_START):
                self.state, self.saw_reasoning = "reasoning", True
                self.pending = stripped[len(THINK_START):]
            elif THINK_START.startswith(stripped):
                return "", ""  # could still become "<think>"
            else:
                self.state = "content"
        if self.state == "reasoning":
            if self.opening:  # some models repeat the opener the template wrote: dropped
                stripped = self.pending.lstrip()
                if len(stripped) < len(THINK_START) and THINK_START.startswith(stripped):
                    return "", ""  # may still become the opener, cut across tokens
                if stripped.startswith(THINK_START):
                    self.pending = stripped[len(THINK_START):]
                self.opening = False  # only at the start: a "<think>" later is the reasoning's text
            end = self.pending.find(THINK_END)
            if end < 0:
                keep = _partial_suffix(self.pending, THINK_END)
                cut = len(self.pending) - keep
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning = self.pending[:end]
            self.pending = self.pending[end + len(THINK_END):]
            self.state, self.strip_newlines = "content", True
        content, self.pending = self.pending, ""
        if self.strip_newlines:
            content = content.lstrip("\n")
            self.strip_newlines = not content
        return reasoning, content

    def close(self) -> tuple[str, str]:
        rest, self.pending, self.space = "".join(self.space) + self.pending, "", []
        if self.state == "reasoning":
            return rest, ""
        return "", rest.lstrip("\n") if self.strip_newlines else rest


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
