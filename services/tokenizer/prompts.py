"""Prompts: a request's prompt field (text, token ids or chat messages) becomes token ids through the model's
tokenizer and chat template (tools included), truncated when the request asks (truncate_prompt_tokens), checked
against the model's limits. Pure functions of a request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from pagoda.services.protocol.tools import tool_conversation
from pagoda.services.tokenizer.conversation import developer_as_system
from pagoda.services.tokenizer.tokenizer import NO_FRAME, SpecialFrame, Tokenizer
from pagoda.shared.errors import ContextLengthError, InvalidRequestError, PagodaError, min_tokens_past_room
from pagoda.shared.messages import (
    TRUNCATE_TO_CONTEXT,
    ChatMessage,
    DetokenizeRequest,
    GenerateRequest,
    ModelInfo,
    SamplingParams,
    TokenizeRequest,
    TokenizeResult,
)


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # the text the ids came from (None for token-id prompts)
    param: str  # the request field errors about this prompt name
    frame: SpecialFrame = NO_FRAME  # the special tokens the tokenizer added around the text's own (a BOS)


def chat_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        # text parts stay parts: a template that loops over them gets them (conversation.content_format)
        content = [{"type": "text", "text": text} for text in message.parts] if message.part_lens else message.content
        entry: dict[str, Any] = {"role": message.role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                "arguments": c.arguments}}
                                   for c in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning is not None:
            entry["reasoning"] = message.reasoning
        out.append(entry)
    return out


def tokenize_prompt(tokenizer: Tokenizer | None, *, prompt_text: str | None, prompt_token_ids: list[int] | None,
                    messages: list[ChatMessage] | None, add_special_tokens: bool = True,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None, tool_parser: str = "",
                    documents: list[dict[str, str]] | None = None, chat_template: str = "") -> Prompt:
    """Token ids of whichever prompt field is set; InvalidRequestError names the field at fault. `tool_parser`: the
    parser that reads the answer's calls, where the template leaves the call form open (tool_conversation).
    `documents`: a chat's retrieval documents, for the template. `chat_template`: the request's own template, or the
    name of one of the model's ("": the model's own)."""
    if sum(field is not None for field in (prompt_text, prompt_token_ids, messages)) != 1:
        raise InvalidRequestError("exactly one of a prompt, prompt token ids or messages must be given",
                                  param="prompt")
    if prompt_token_ids is not None:
        return Prompt(list(prompt_token_ids), None, "prompt")
    param = "messages" if messages is not None else "prompt"
    if tokenizer is None:
        raise InvalidRequestError(f"this model has no tokenizer: send the prompt as token ids, not {param}",
                                  param=param)
    try:
        if messages is not None:
            # render_chat + encode is Tokenizer.apply_chat_template, keeping the text for echo.
            template = (tokenizer.hf.get_chat_template(chat_template or None, tools)
                        if chat_template or tokenizer.hf.chat_template else None)
            # developer turns first, so that a tool list pagoda writes joins the system turn they become
            conversation, tools = tool_conversation(template, developer_as_system(chat_dicts(messages), template),
                                                    tools, tool_parser)
            text = tokenizer.render_chat(conversation, add_generation_prompt, tools=tools,
                                         continue_final_message=continue_final_message,
                                         chat_template_kwargs=chat_template_kwargs, documents=documents,
                                         chat_template=chat_template or None)
            return Prompt(tokenizer.encode(text, add_special_tokens=False), text, param)
        assert prompt_text is not None
        return encode_text_prompt(tokenizer, prompt_text, add_special_tokens, param)
    except PagodaError:
        raise
    except Exception as exc:
        # A template or tokenizer that raises is the request's problem, never the process's.
        raise InvalidRequestError(f"cannot tokenize the {param}: {exc}", param=param) from exc


def encode_text_prompt(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True,
                       param: str = "prompt") -> Prompt:
    """A text prompt's ids, with the special tokens the tokenizer adds (its frame, which truncation keeps)."""
    frame = tokenizer.special_frame if add_special_tokens else NO_FRAME
    return Prompt(tokenizer.encode(text, add_special_tokens=add_special_tokens), text, param, frame)


def context_limit(max_model_len: int, max_num_tokens: int) -> int:
    """The most tokens one sequence may hold, prompt and output: the context, or the KV cache where it is smaller
    (a sequence cannot outgrow the cache, so a max_tokens past it could never be met)."""
    return min(max_model_len, max_num_tokens)


def max_prompt_len(max_model_len: int, max_num_tokens: int) -> int:
    """The most prompt tokens a model takes: at least one token must be generated, in the context and in the KV
    cache (which holds at most `max_num_tokens` tokens of one sequence)."""
    return context_limit(max_model_len, max_num_tokens) - 1


def prompt_room(max_model_len: int, max_num_tokens: int, max_tokens: int | None) -> int:
    """What truncate_prompt_tokens -1 keeps: the most prompt tokens the model takes (max_prompt_len) that also leave
    the request's max_tokens to generate within the context, where it sets them (as vLLM's); at least one (a
    max_tokens the context cannot hold is then refused by check_prompt, naming it)."""
    room = max_prompt_len(max_model_len, max_num_tokens)
    if max_tokens is not None:
        room = min(room, context_limit(max_model_len, max_num_tokens) - max_tokens)
    return max(room, 1)


def truncated_ids(token_ids: list[int], params: SamplingParams, max_len: int,
                  frame: SpecialFrame = NO_FRAME) -> list[int]:
    """vLLM's truncate_prompt_tokens k: the prompt's last k tokens (truncation_side "right": its first k); -1: as
    many as the request has room for (`max_len`, prompt_room's). The ids themselves when not asked or not longer. The
    special tokens of `frame` (a text prompt's BOS) stay where they are and count in k, as in transformers'
    truncation (and so vLLM's): only the text's own tokens are cut."""
    limit = params.truncate_prompt_tokens
    if limit == TRUNCATE_TO_CONTEXT:
        limit = max_len
    if limit is None or len(token_ids) <= limit:
        return token_ids
    start, end = frame.num_before, len(token_ids) - frame.num_after
    own = token_ids[start:end]
    num_kept = max(limit - frame.num_before - frame.num_after, 0)
    kept = own[:num_kept] if params.truncation_side == "right" else own[len(own) - num_kept:]
    return token_ids[:start] + kept + token_ids[end:]


def truncate_prompt(tokenizer: Tokenizer | None, prompt: Prompt, params: SamplingParams, max_len: int) -> Prompt:
    """The prompt truncated as its request asks (truncated_ids). Its text becomes that of the text's own tokens kept
    (decoded, special tokens included; the frame the tokenizer added, a BOS, left out as from a text kept whole), so
    that what reads the text (completions' echo, whose logprobs score the kept tokens; a reasoning model's template
    end) sees the prompt the model runs."""
    token_ids = truncated_ids(prompt.token_ids, params, max_len, prompt.frame)
    if len(token_ids) == len(prompt.token_ids):
        return prompt
    text = None
    if prompt.text is not None and tokenizer is not None:  # the text's own tokens, as an untruncated text is sent
        own = token_ids[prompt.frame.num_before:len(token_ids) - prompt.frame.num_after]
        text = tokenizer.decode(own, skip_special_tokens=False)
    return Prompt(token_ids, text, prompt.param, prompt.frame)


def check_prompt(token_ids: list[int], params: SamplingParams, info: ModelInfo, param: str) -> None:
    """Raise InvalidRequestError unless the scheduler can run this prompt with these params."""
    if not token_ids:
        what = "the chat template rendered the messages as an empty prompt" if param == "messages" \
            else f"the {param} is empty"
        raise InvalidRequestError(what, param=param)
    if min(token_ids) < 0 or max(token_ids) >= info.vocab_size:
        bad = next(t for t in token_ids if not 0 <= t < info.vocab_size)
        raise InvalidRequestError(f"token id {bad} is out of range [0, {info.vocab_size})", param=param)
    max_len = max_prompt_len(info.max_model_len, info.max_num_tokens)
    num_tokens = len(token_ids)
    if num_tokens > max_len:
        raise ContextLengthError.prompt_too_long(num_tokens, param, info.max_model_len, info.max_num_tokens)
    if params.max_tokens is not None and num_tokens + params.max_tokens > context_limit(info.max_model_len,
                                                                                        info.max_num_tokens):
        raise ContextLengthError.max_tokens_too_large(num_tokens, params.max_tokens, info.max_model_len,
                                                      info.max_num_tokens)
    if params.max_tokens is None and num_tokens + params.min_tokens > context_limit(info.max_model_len,
                                                                                   info.max_num_tokens):
        raise min_tokens_past_room(params.min_tokens, num_tokens, context_limit(info.max_model_len,
                                                                               info.max_num_tokens))
    if any(t >= info.vocab_size for t in params.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids must be < {info.vocab_size}", param="stop_token_ids")
    if any(t >= info.vocab_size for t in params.logit_bias):
        raise InvalidRequestError(f"logit_bias token ids must be < {info.vocab_size}", param="logit_bias")


TURN_CHARS = 32  # what a chat template writes around one turn or one tool call besides its own text, at least


def prompt_chars(prompt_text: str | None, messages: list[ChatMessage] | None,
                 tools: list[dict[str, Any]] | None = None, documents: list[dict[str, str]] | None = None) -> int:
    """Characters to render and tokenize, estimated: what decides whether the work moves off the loop. Every turn,
    tool call and retrieval document counts with the text its template writes around it, and the tool definitions
    with their JSON, so a conversation of many empty turns or calls (200k tool calls, 27 MiB: seconds of rendering)
    counts as the work it is and does not hold the loop, and the heartbeats, up."""
    total = len(prompt_text or "")
    for message in messages or []:
        total += TURN_CHARS + len(message.content) + len(message.name or "") + len(message.tool_call_id or "")
        total += len(message.reasoning or "")
        total += sum(TURN_CHARS + len(call.id) + len(call.name) + len(call.arguments) for call in message.tool_calls)
    for document in documents or []:  # each rendered as a turn is
        total += TURN_CHARS + sum(len(key) + len(value) for key, value in document.items())
    if tools:
        total += len(msgspec.json.encode(tools))
    return total


def token_str(tokenizer: Tokenizer, token_id: int) -> str:
    """The vocabulary entry of a token, as vLLM's return_token_strs lists it (byte-level pieces as is)."""
    piece = tokenizer.hf.convert_ids_to_tokens(token_id)
    return piece if isinstance(piece, str) else ""


def generate_prompt(tokenizer: Tokenizer | None, request: GenerateRequest, info: ModelInfo) -> Prompt:
    """A generation request's prompt, truncated as it asks (chat: after its template is applied). The api validated
    the params (SamplingParams.validate, at the edge); what it cannot know, the prompt's length against the context
    and token ids against the vocabulary, check_prompt checks, and the scheduler re-checks only the invariants it
    relies on."""
    prompt = tokenize_prompt(tokenizer, prompt_text=request.prompt_text, prompt_token_ids=request.prompt_token_ids,
                             messages=request.messages, add_special_tokens=request.add_special_tokens,
                             add_generation_prompt=request.add_generation_prompt,
                             continue_final_message=request.continue_final_message,
                             chat_template_kwargs=request.chat_template_kwargs, tools=request.tools or None,
                             tool_parser=request.tool_parser, documents=request.documents,
                             chat_template=request.chat_template)
    room = prompt_room(info.max_model_len, info.max_num_tokens, request.params.max_tokens)
    return truncate_prompt(tokenizer, prompt, request.params, room)


def tokenize_result(tokenizer: Tokenizer | None, request: TokenizeRequest, max_model_len: int) -> TokenizeResult:
    """/tokenize: the prompt's ids (and their vocabulary strings when asked); a chat prompt is rendered as
    generation renders it (tools and chat_template_kwargs included)."""
    prompt = tokenize_prompt(tokenizer, prompt_text=request.prompt_text, prompt_token_ids=None,
                             messages=request.messages, add_special_tokens=request.add_special_tokens,
                             add_generation_prompt=request.add_generation_prompt,
                             continue_final_message=request.continue_final_message,
                             chat_template_kwargs=request.chat_template_kwargs, tools=request.tools or None,
                             tool_parser=request.tool_parser, documents=request.documents,
                             chat_template=request.chat_template)
    token_strs = ([token_str(tokenizer, t) for t in prompt.token_ids]
                  if request.return_token_strs and tokenizer is not None else [])
    return TokenizeResult(request.request_id, prompt.token_ids, max_model_len, token_strs)


def tokenizer_info(tokenizer: Tokenizer | None) -> bytes:
    """/tokenizer_info's JSON (vLLM's shape): the tokenizer's init arguments without file paths, special tokens as
    their text, its class name and chat template. A model without a tokenizer answers with an empty object."""
    if tokenizer is None:
        return b"{}"
    hf = tokenizer.hf
    config = {key: value for key, value in dict(getattr(hf, "init_kwargs", None) or {}).items()
              if key not in ("vocab_file", "merges_file") and not key.endswith("_file")}
    info = _json_safe(config)
    info["tokenizer_class"] = type(hf).__name__
    if getattr(hf, "chat_template", None):
        info["chat_template"] = hf.chat_template
    return msgspec.json.encode(info)


def _json_safe(value: Any) -> Any:
    """Plain JSON values: an added token becomes its text, anything else unknown its str()."""
    if hasattr(value, "content") and isinstance(value.content, str):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


# /detokenize's text at most: its answer travels to the api in one frame, which ZeroMQ refuses past
# shared.transport.MAX_FRAME_BYTES (64 MiB; not imported: the offline engine imports this module, without zmq)
MAX_DETOKENIZED_BYTES = 32 << 20


def detokenize_job(tokenizer: Tokenizer | None, request: DetokenizeRequest,
                   vocab_size: int | None) -> Callable[[], str]:
    """/detokenize: the ids are checked now (InvalidRequestError), the returned job decodes them."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer", param="tokens")
    limit = vocab_size if vocab_size is not None else tokenizer.vocab_size
    bad = next((t for t in request.token_ids if not 0 <= t < limit), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is out of range [0, {limit})", param="tokens")

    def decode() -> str:
        try:
            text = tokenizer.decode(request.token_ids, skip_special_tokens=False)
        except Exception as exc:
            raise InvalidRequestError(f"cannot decode: {exc}", param="tokens") from exc
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_DETOKENIZED_BYTES:  # sent, it would never arrive: refused, and sent again, forever
            raise InvalidRequestError(f"the tokens decode to {size} bytes of text; this server answers at most "
                                      f"{MAX_DETOKENIZED_BYTES}: send fewer tokens a request", param="tokens")
        return text

    return decode


def echo_text(tokenizer: Tokenizer | None, prompt: Prompt) -> str | None:
    """The prompt's text for echo: as sent, or decoded from its ids (special tokens kept: echo's text must be what
    its prompt tokens, logprobs.tokens, join to)."""
    if prompt.text is not None or tokenizer is None:
        return prompt.text
    return tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
