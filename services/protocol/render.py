"""OpenAI response shapes as bytes: SSE chunks, choice objects and usage; pure functions of a response's state.

The tokenizer processes render with these (they scale out); the api process only merges the bytes queued for a
request into one write. The api keeps the same renderers for a tokenizer that sends text (TextDeltas) instead.

A renderer reads its response through `ResponseView`: the api's Generation (every prompt of the response) or a
tokenizer's `PromptView` (the one prompt it serves). Choice index = prompt index * n + completion index.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import msgspec

from pagoda.services.protocol.chat_output import ChatOutputSpec, ChatStreams, whole_message
from pagoda.shared.messages import ANSWERED, FinishReason, PositionLogprobs, RenderSpec, TextDelta, TokenLogprob

_encoder = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"
COMPLETION, CHAT = 0, 1  # RenderSpec.route


def encode_json(obj: Any) -> bytes:
    return _encoder.encode(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclass(slots=True)
class Choice:
    """One completion of the response: choice index = prompt index * n + completion index."""

    index: int
    num_prompt_tokens: int = 0  # its prompt's, for continuous usage stats
    texts: list[str] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # filled when the deltas carry them (return_token_ids)
    finish_reason: int = -1  # a FinishReason once it ends
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_ids id that ended it
    last_token_at: float = 0.0  # time.monotonic() of its latest tokens, for inter-token latency
    rendered: bytes | None = None  # its JSON object, rendered by the tokenizer (non-streaming responses)

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def apply(self, delta: TextDelta) -> None:
        self.texts.append(delta.text)
        self.logprobs.extend(delta.logprobs)
        self.token_ids.extend(delta.token_ids)
        self.num_tokens += delta.num_new_tokens
        if delta.finish_reason >= 0:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


class ResponseView(Protocol):
    """What a renderer reads of a response; the lists are indexed by prompt index."""

    n: int
    choices: list[Choice]
    prompt_texts: Any  # prompt index -> its text (echo)
    prompt_token_ids: Any  # prompt index -> its ids (return_token_ids)
    prompt_logprobs: Any  # prompt index -> its scored tokens (echo + logprobs)


@dataclass(slots=True)
class PromptView:
    """A tokenizer's part of a response: one prompt and its n choices (indices offset by the prompt's place)."""

    n: int
    choices: list[Choice]
    prompt_texts: dict[int, str]
    prompt_token_ids: dict[int, list[int]]
    prompt_logprobs: dict[int, list[PositionLogprobs]]


def _finish_name(reason: int) -> str | None:
    return FinishReason(reason).openai_name if reason >= 0 else None


def _tools_finish(reason: int, calls_tools: bool) -> str | None:
    """OpenAI's "tool_calls" when a choice that ended normally called tools."""
    if calls_tools and reason == FinishReason.STOP:
        return "tool_calls"
    return _finish_name(reason)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def running_usage(choice: Choice) -> dict[str, Any]:
    """vLLM's continuous_usage_stats: one choice's usage so far, on each of its chunks."""
    return {"prompt_tokens": choice.num_prompt_tokens, "completion_tokens": choice.num_tokens,
            "total_tokens": choice.num_prompt_tokens + choice.num_tokens}


MIN_LOGPROB = -9999.0  # vLLM's floor for a logprob in JSON (-inf has no JSON form)


def _name(token: TokenLogprob, as_ids: bool) -> str:
    """A logprob entry's token: its text, or vLLM's "token_id:N" (return_tokens_as_token_ids)."""
    return f"token_id:{token.token_id}" if as_ids else token.token


class TextCursor:
    """Where a choice's next token starts in its text (legacy completions' text_offset). A token starts where the
    character holding its first byte does: the offset advances by the characters the tokens' bytes finish (the
    decoder holds a character's first bytes until its last come), not by the lengths of the tokens' own strings,
    which give each token of part of a character a U+FFFD of its own. A stream keeps one per choice."""

    __slots__ = ("offset", "_decoder")

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, token: TokenLogprob) -> int:
        """The token's offset; the cursor moves past the characters it finishes."""
        start = self.offset
        self.offset += len(self._decoder.decode(bytes(token.bytes)))
        return start


def completion_logprobs(positions: list[PositionLogprobs], cursor: TextCursor, end: int | None = None,
                        as_ids: bool = False) -> dict[str, Any]:
    """The legacy shape; `cursor` is where the first token starts in the choice's text, and moves past these
    tokens. With `end` (the length of the text these tokens make), offsets never pass it: a token whose string is
    not in the text (a special token the text skips) keeps the offsets monotone and inside the text. Offsets follow
    the text also when tokens are named by id (`as_ids`)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float | None] | None] = []
    text_offset: list[int] = []
    for position in positions:
        sampled = position.sampled
        name = _name(sampled, as_ids)
        tokens.append(name)
        token_logprobs.append(sampled.logprob)
        if sampled.logprob is None:  # a prompt's first token (echo): nothing before it to score it
            top_logprobs.append(None)
        else:
            alternatives = {_name(t, as_ids): t.logprob for t in position.top}
            alternatives.setdefault(name, sampled.logprob)  # vLLM's convention: the pick is listed
            top_logprobs.append(alternatives)
        offset = cursor.advance(sampled)
        text_offset.append(offset if end is None else min(offset, end))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(positions: list[PositionLogprobs], as_ids: bool = False) -> dict[str, Any]:
    if as_ids:  # vLLM's bytes are then those of the "token_id:N" text
        content = [{"token": (name := _name(p.sampled, True)), "logprob": p.sampled.logprob,
                    "bytes": list(name.encode()),
                    "top_logprobs": [{"token": (alt := _name(t, True)), "logprob": t.logprob,
                                      "bytes": list(alt.encode())} for t in p.top]}
                   for p in positions]
    else:
        content = [{"token": p.sampled.token, "logprob": p.sampled.logprob, "bytes": p.sampled.bytes,
                    "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in p.top]}
                   for p in positions]
    return {"content": content, "refusal": None}


def prompt_logprobs_json(positions: list[PositionLogprobs]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}} holding the prompt's own token (first) and the top k (ranks 1..k)."""
    out: list[dict[str, Any] | None] = []
    for position in positions:
        sampled = position.sampled
        if sampled.logprob is None:
            out.append(None)
            continue
        entry = {str(sampled.token_id): {"logprob": max(sampled.logprob, MIN_LOGPROB), "rank": sampled.rank or None,
                                         "decoded_token": sampled.token}}
        for rank, alt in enumerate(position.top, start=1):
            entry.setdefault(str(alt.token_id), {"logprob": max(alt.logprob if alt.logprob is not None
                                                                else MIN_LOGPROB, MIN_LOGPROB),
                                                 "rank": rank, "decoded_token": alt.token})
        out.append(entry)
    return out


class Renderer:
    """One response's envelope (id, created, model) and the parts shared by both routes."""

    object_name = ""
    chunk_object_name = ""
    route_name = ""  # the console's name for the route

    def __init__(self, response_id: str, model: str, created: int, *, want_logprobs: bool,
                 include_usage: bool, return_token_ids: bool = False, continuous_usage: bool = False,
                 prompt_logprobs: bool = False, tokens_as_ids: bool = False) -> None:
        self.response_id = response_id
        self.model = model
        self.created = created
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids  # vLLM's: choices carry token_ids, the prompt's ids come too
        self.continuous_usage = continuous_usage  # vLLM's: every chunk carries its choice's usage so far
        self.prompt_logprobs = prompt_logprobs  # vLLM's: the response carries the prompt's scores
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids
        self._text_parts: dict[int, tuple[bytes, bytes]] = {}  # choice index -> a text chunk's bytes around its text

    def prompt_accepted(self, prompt_reasoning: str) -> None:
        """The tokenizer rendered the prompt, which left the think block so (reasoning.prompt_reasoning): a
        renderer that reads reasoning starts there."""

    def _with_ids(self, out: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        """`out` with the choice's token ids, when asked for or when they are all there is (no tokenizer)."""
        if self.return_token_ids or token_ids:
            out["token_ids"] = token_ids
        return out

    def body(self, view: ResponseView, usage: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming response; a choice the tokenizer rendered goes in as its bytes."""
        choices = [msgspec.Raw(c.rendered) if c.rendered is not None else self._choice(view, c)
                   for c in view.choices]
        return {"id": self.response_id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    def choice_json(self, view: ResponseView, choice: Choice) -> bytes:
        """One finished choice of the non-streaming response, as JSON."""
        return encode_json(self._choice(view, choice))

    def _chunk(self, choices: list[dict[str, Any]], choice: Choice | None = None) -> bytes:
        chunk: dict[str, Any] = {"id": self.response_id, "object": self.chunk_object_name, "created": self.created,
                                 "model": self.model, "choices": choices}
        if self.include_usage:
            # OpenAI's convention: only the final chunk carries usage; vLLM's continuous stats: every chunk
            chunk["usage"] = running_usage(choice) if self.continuous_usage and choice is not None else None
        return sse(chunk)

    def _prompt_logprobs(self, view: ResponseView, choice: Choice) -> list[dict[str, Any] | None] | None:
        return prompt_logprobs_json(view.prompt_logprobs[choice.index // view.n]) if self.prompt_logprobs else None

    def opening(self, view: ResponseView) -> bytes:
        """SSE bytes before the first delta."""
        return b""

    def chunks(self, batch: list[tuple[Choice, TextDelta]]) -> bytes:
        """One chunk per delta that says something (text, logprobs or an end), in one write."""
        if len(batch) == 1:  # a streamed token's usual batch (the tokenizer renders one delta at a time)
            choice, delta = batch[0]
            if delta.text and delta.finish_reason < 0 and not delta.logprobs and not delta.token_ids \
                    and self._plain_text:
                return self._text_chunk(choice.index, delta.text)
        return b"".join(self._chunk([self._with_ids(self._delta_choice(choice, delta), delta.token_ids)], choice)
                        for choice, delta in batch
                        if delta.text or delta.logprobs or delta.token_ids or delta.finish_reason >= 0)

    @property
    def _plain_text(self) -> bool:
        """A running delta with text only renders as head + its text as JSON + tail (_text_chunk): no logprobs, no
        token ids, no per-chunk usage asked for."""
        return not (self.want_logprobs or self.return_token_ids or self.continuous_usage)

    def _text_chunk(self, index: int, text: str) -> bytes:
        """The bytes _chunk renders for a running delta that carries only text, from the envelope rendered once per
        choice (per streamed token: one JSON string encoded instead of two dicts)."""
        parts = self._text_parts.get(index)
        if parts is None:
            marker = "\x00"  # a JSON string's encoding never holds it raw: the split point is unambiguous
            rendered = self._chunk([self._delta_choice(Choice(index), TextDelta("", index, marker, 1))])
            head, _, tail = rendered.rpartition(encode_json(marker))  # the text follows the id and the model
            parts = self._text_parts[index] = (head, tail)
        return parts[0] + _encoder.encode(text) + parts[1]

    def closing(self, usage: dict[str, Any]) -> bytes:
        """The usage chunk when asked for, then [DONE]."""
        if not self.include_usage:
            return SSE_DONE
        return sse({"id": self.response_id, "object": self.chunk_object_name, "created": self.created,
                    "model": self.model, "choices": [], "usage": usage}) + SSE_DONE

    def stream_error(self, error: dict[str, Any]) -> bytes:
        """The end of a stream that failed after its status line was sent: the error body as an event, then
        [DONE]."""
        return sse(error) + SSE_DONE

    def _choice(self, view: ResponseView, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def _delta_choice(self, choice: Choice, delta: TextDelta) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    route_name = "completion"

    def __init__(self, response_id: str, model: str, created: int, *, want_logprobs: bool, include_usage: bool,
                 echo: bool, return_token_ids: bool = False, **vllm: bool) -> None:
        super().__init__(response_id, model, created, want_logprobs=want_logprobs, include_usage=include_usage,
                         return_token_ids=return_token_ids, **vllm)
        self.echo = echo
        self._cursors: dict[int, TextCursor] = {}  # choice index -> where its next token starts (streaming)

    def _prompt_text(self, view: ResponseView, choice: Choice) -> str:
        return view.prompt_texts[choice.index // view.n] if self.echo else ""

    def _choice(self, view: ResponseView, choice: Choice) -> dict[str, Any]:
        prompt_text = self._prompt_text(view, choice)
        as_ids = self.tokens_as_ids
        logprobs = completion_logprobs(choice.logprobs, TextCursor(len(prompt_text)), as_ids=as_ids) \
            if self.want_logprobs else None
        if logprobs is not None and self.echo:  # the prompt's tokens first, then the completion's
            prompt = completion_logprobs(view.prompt_logprobs[choice.index // view.n], TextCursor(), len(prompt_text),
                                         as_ids=as_ids)
            logprobs = {key: prompt[key] + logprobs[key] for key in logprobs}
        out = {"index": choice.index, "text": prompt_text + choice.text, "logprobs": logprobs,
               "finish_reason": _finish_name(choice.finish_reason), "stop_reason": choice.stop_reason,
               "prompt_logprobs": self._prompt_logprobs(view, choice)}
        if self.return_token_ids:
            out["prompt_token_ids"] = view.prompt_token_ids[choice.index // view.n]
        return self._with_ids(out, choice.token_ids)

    def opening(self, view: ResponseView) -> bytes:
        """Echo's prompt text, and with return_token_ids the prompt's ids, lead each choice."""
        if not self.echo and not self.return_token_ids:
            return b""
        out = []
        for c in view.choices:
            choice: dict[str, Any] = {"index": c.index, "text": self._prompt_text(view, c), "logprobs": None,
                                      "finish_reason": None}
            if self.return_token_ids:
                choice["prompt_token_ids"] = view.prompt_token_ids[c.index // view.n]
                choice["token_ids"] = []
            out.append(self._chunk([choice], c))
        return b"".join(out)

    def _delta_choice(self, choice: Choice, delta: TextDelta) -> dict[str, Any]:
        logprobs = None
        if self.want_logprobs:
            cursor = self._cursors.setdefault(choice.index, TextCursor())
            logprobs = completion_logprobs(delta.logprobs, cursor, as_ids=self.tokens_as_ids)
        return _with_stop_reason({"index": choice.index, "text": delta.text, "logprobs": logprobs,
                                  "finish_reason": _finish_name(delta.finish_reason)}, delta)


class ChatRenderer(Renderer):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    route_name = "chat"

    def __init__(self, response_id: str, model: str, created: int, *, want_logprobs: bool, include_usage: bool,
                 output: ChatOutputSpec | None = None, return_token_ids: bool = False, echo_text: str = "",
                 role: str = "assistant", **vllm: bool) -> None:
        super().__init__(response_id, model, created, want_logprobs=want_logprobs, include_usage=include_usage,
                         return_token_ids=return_token_ids, **vllm)
        self.output = output if output is not None and output.active else None  # tools / reasoning parsing
        self._streams = ChatStreams(self.output) if self.output is not None else None
        self.echo_text = echo_text  # vLLM's chat echo: leads each choice's content
        self.role = role  # the answer's role (--response-role)

    def prompt_accepted(self, prompt_reasoning: str) -> None:
        if self.output is not None and self.output.reasoning_parser is not None:
            self.output = replace(self.output, prompt_reasoning=prompt_reasoning)
            self._streams = ChatStreams(self.output)

    @property
    def _hides_tokens(self) -> bool:
        """include_reasoning false under a reasoning parser: the choice's logprobs and token ids, which would spell
        the reasoning out, are not returned either (vLLM's)."""
        return self.output is not None and self.output.hides_reasoning

    def _choice(self, view: ResponseView, choice: Choice) -> dict[str, Any]:
        hidden = self._hides_tokens
        logprobs = chat_logprobs(choice.logprobs, self.tokens_as_ids) if self.want_logprobs and not hidden else None
        if self.output is not None:
            message, calls_tools = whole_message(self.output, choice.text)
            finish = _tools_finish(choice.finish_reason, calls_tools)
        else:
            message, finish = {"role": "assistant", "content": choice.text}, _finish_name(choice.finish_reason)
        message["role"] = self.role  # --response-role, or the role of the message the answer continues
        if self.echo_text:
            message["content"] = self.echo_text + (message.get("content") or "")
        out = {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish,
               "stop_reason": choice.stop_reason}
        if self.prompt_logprobs and choice.index == 0:  # carried here, moved to the response by body()
            out["prompt_logprobs"] = self._prompt_logprobs(view, choice)
        return out if hidden else self._with_ids(out, choice.token_ids)

    def body(self, view: ResponseView, usage: dict[str, Any]) -> dict[str, Any]:
        out = super().body(view, usage)
        if self.return_token_ids:
            out["prompt_token_ids"] = view.prompt_token_ids[0]  # one prompt per chat request
        out["prompt_logprobs"] = self._take_prompt_logprobs(out["choices"]) if self.prompt_logprobs else None
        return out

    @staticmethod
    def _take_prompt_logprobs(choices: list[Any]) -> Any:
        """Choice 0 (rendered here or by a tokenizer) carries the prompt's scores; vLLM's response holds them at
        its top level. Only requests that asked pay this decode."""
        first = choices[0] if choices else None
        if isinstance(first, msgspec.Raw):
            first = msgspec.json.decode(first)
            choices[0] = first
        return first.pop("prompt_logprobs", None) if isinstance(first, dict) else None

    def chunks(self, batch: list[tuple[Choice, TextDelta]]) -> bytes:
        if self._streams is None:
            return super().chunks(batch)
        out = []
        for choice, delta in batch:
            stream = self._streams.get(choice.index)
            parts = stream.push(delta.text)
            calls_tools = False
            if delta.finish_reason >= 0:
                more, calls_tools = stream.finish()
                parts += more
            hidden = self._hides_tokens
            logprobs = chat_logprobs(delta.logprobs, self.tokens_as_ids) if self.want_logprobs and not hidden \
                else None
            token_ids = [] if hidden else delta.token_ids
            if (logprobs is not None or token_ids) and not parts:
                parts = [{}]
            for i, part in enumerate(parts):
                first = i == 0
                part_choice = {"index": choice.index, "delta": part, "logprobs": logprobs if first else None,
                               "finish_reason": None}
                out.append(self._chunk([part_choice if hidden else
                                        self._with_ids(part_choice, token_ids if first else [])], choice))
            if delta.finish_reason >= 0:
                out.append(self._chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                                         "finish_reason": _tools_finish(delta.finish_reason, calls_tools),
                                         "stop_reason": delta.stop_reason}], choice))
        return b"".join(out)

    def opening(self, view: ResponseView) -> bytes:
        # Every choice's first chunk carries the role, as OpenAI's do; with echo, its content follows (vLLM's).
        return b"".join(self._opening_chunk(view, c) for c in view.choices)

    def _opening_chunk(self, view: ResponseView, choice: Choice) -> bytes:
        out: dict[str, Any] = {"index": choice.index, "delta": {"role": self.role, "content": ""},
                               "logprobs": None, "finish_reason": None}
        echo = self._chunk([{"index": choice.index, "delta": {"content": self.echo_text}, "logprobs": None,
                             "finish_reason": None}], choice) if self.echo_text else b""
        if not self.return_token_ids:
            return self._chunk([out], choice) + echo
        if not self._hides_tokens:  # hidden: the choice has no token ids, not an empty list of them
            out["token_ids"] = []
        chunk: dict[str, Any] = {"id": self.response_id, "object": self.chunk_object_name, "created": self.created,
                                 "model": self.model, "choices": [out],
                                 "prompt_token_ids": view.prompt_token_ids[choice.index // view.n]}
        if self.include_usage:
            chunk["usage"] = running_usage(choice) if self.continuous_usage else None
        return sse(chunk) + echo

    def _delta_choice(self, choice: Choice, delta: TextDelta) -> dict[str, Any]:
        return _with_stop_reason({"index": choice.index, "delta": {"content": delta.text} if delta.text else {},
                                  "logprobs": chat_logprobs(delta.logprobs, self.tokens_as_ids)
                                  if self.want_logprobs else None,
                                  "finish_reason": _finish_name(delta.finish_reason)}, delta)


def _with_stop_reason(choice: dict[str, Any], delta: TextDelta) -> dict[str, Any]:
    """A streamed choice: its last chunk (the one with a finish_reason) carries vLLM's stop_reason too."""
    if delta.finish_reason >= 0:
        choice["stop_reason"] = delta.stop_reason
    return choice


def renderer_for(spec: RenderSpec, prompt_reasoning: str = "") -> Renderer:
    """The renderer a RenderSpec describes (the api builds the same one for the text path); `prompt_reasoning`:
    where the chat prompt left the think block (reasoning.prompt_reasoning), known once it is rendered."""
    vllm = {"continuous_usage": spec.continuous_usage, "prompt_logprobs": spec.prompt_logprobs,
            "tokens_as_ids": spec.tokens_as_ids}
    if spec.route == CHAT:
        output = ChatOutputSpec(spec.tool_mode, spec.tool_parser, spec.tool_name, spec.reasoning_parser,
                                spec.max_calls, prompt_reasoning, spec.tool_parameters, spec.include_reasoning)
        return ChatRenderer(spec.response_id, spec.model, spec.created, want_logprobs=spec.want_logprobs,
                            include_usage=spec.include_usage, output=output, return_token_ids=spec.return_token_ids,
                            echo_text=spec.echo_text, role=spec.role, **vllm)
    return CompletionRenderer(spec.response_id, spec.model, spec.created, want_logprobs=spec.want_logprobs,
                              include_usage=spec.include_usage, echo=spec.echo,
                              return_token_ids=spec.return_token_ids, **vllm)


class PromptRenderer:
    """The tokenizer's renderer for one prompt of a response: its choices' bytes as their deltas come."""

    def __init__(self, spec: RenderSpec, n: int, prompt_text: str, prompt_token_ids: list[int],
                 prompt_reasoning: str = "") -> None:
        self.stream = spec.stream
        self.renderer = renderer_for(spec, prompt_reasoning)
        self._prompt = spec.first_choice // n
        self.view = PromptView(n, [Choice(spec.first_choice + i, len(prompt_token_ids)) for i in range(n)],
                               {self._prompt: prompt_text}, {self._prompt: prompt_token_ids}, {self._prompt: []})

    def opening(self) -> bytes:
        return self.renderer.opening(self.view) if self.stream else b""

    def render(self, delta: TextDelta) -> bytes:
        """Streaming: this delta's SSE chunks. Otherwise the choice's JSON once it ends normally, else b"".
        An abnormal end (abort, error) renders nothing: the api answers it with an error."""
        if delta.finish_reason >= 0 and delta.finish_reason not in ANSWERED:
            return b""
        choice = self.view.choices[delta.index]
        if self.stream:
            choice.num_tokens += delta.num_new_tokens  # continuous usage stats count them
            return self.renderer.chunks([(choice, delta)])
        choice.apply(delta)
        if delta.prompt_logprobs:
            self.view.prompt_logprobs[self._prompt].extend(delta.prompt_logprobs)
        return self.renderer.choice_json(self.view, choice) if delta.finish_reason >= 0 else b""
