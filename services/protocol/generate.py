"""vLLM's token-in / token-out API: the request its render routes answer with (a prompt's token ids and the sampling
params it runs with) and /inference/v1/generate, which takes that request and answers with the generated token ids.

The generate body becomes a completions body with a token-id prompt (so it is checked and run as one), and its
answer is rendered here in vLLM's GenerateResponse shape (choices of token ids, logprobs named "token_id:N")."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from pagoda.services.protocol.render import (
    SSE_DONE,
    Choice,
    Renderer,
    ResponseView,
    _finish_name,
    chat_logprobs,
    prompt_logprobs_json,
    running_usage,
    sse,
)
from pagoda.services.protocol.schemas import CompletionBody, StreamOptions, decode_body
from pagoda.shared.errors import InvalidRequestError, PagodaError
from pagoda.shared.messages import SamplingParams, TextDelta

# vLLM's SamplingParams fields that /inference/v1/generate serves: each is the completions field of the same name
# (checked and run as completions run it). The render routes write these (the last three only when set).
SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "logit_bias",
    "allowed_token_ids", "bad_words", "logprob_token_ids", "structured_outputs", "truncate_prompt_tokens",
    "truncation_side", "repetition_detection", "stream_interval",
)

# vLLM's SamplingParams fields that generate refuses (a 400 naming sampling_params.<field>), with the reason.
REFUSED_SAMPLING_FIELDS = {
    "thinking_token_budget": "a think block's budget needs the chat prompt it starts in; use /v1/chat/completions",
    "output_kind": "the output's kind follows `stream` (deltas when streaming, the whole output otherwise)",
    "logits_processors": "per-request logits processors are not implemented",
    "extra_args": "custom extension arguments are not accepted",
    "guided_decoding": "use structured_outputs",
    "flat_logprobs": "logprobs come in the response's own shape only",
    "skip_reading_prefix_cache": "the prefix cache is always read (a request with prompt_logprobs skips it)",
    "best_of": "beam search and best_of are not served here; use /v1/completions",
    "use_beam_search": "beam search is not served here; use /v1/completions",
}

# Top-level fields of vLLM's GenerateRequest that only the rendering of other inputs fills: refused unless null.
REFUSED_FIELDS = {
    "features": "multimodal inputs are not accepted",
    "kv_transfer_params": "disaggregated prefill (KV transfer) is not implemented",
    "token_offsets": "token offsets are not made here (the render routes refuse return_token_offsets)",
    "assistant_tokens_mask": "assistant token masks are not made here",
}

# Fields of an inference body that the request the render routes answer with cannot carry: refused when set there.
RENDER_REFUSED = {
    "use_beam_search": "beam search is not served by the render routes (as vLLM's)",
    "echo": "the rendered request does not echo its prompt; its token_ids are the prompt",
    "return_tokens_as_token_ids": "the generate route always names logprob tokens \"token_id:N\"",
    "prompt_cache_key": "the rendered request carries no routing key",
}


class GenerateBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's GenerateRequest as /inference/v1/generate takes it."""

    token_ids: Annotated[list[int], msgspec.Meta(min_length=1)]
    sampling_params: dict[str, msgspec.Raw]
    request_id: str | None = None
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int | None = None
    features: Any = None
    kv_transfer_params: Any = None
    token_offsets: Any = None
    assistant_tokens_mask: Any = None


def check_render_fields(body: msgspec.Struct) -> None:
    """A 400 naming the first field of RENDER_REFUSED that an inference body sets (false and null are not set), or
    chat's include_reasoning false: generate answers with token ids, there is no reasoning text to drop."""
    for name, reason in RENDER_REFUSED.items():
        if getattr(body, name, None):
            raise InvalidRequestError(f"{name} is not served by the render routes: {reason}", param=name)
    if getattr(body, "include_reasoning", None) is False:
        raise InvalidRequestError("include_reasoning is not served by the render routes: generate answers with "
                                  "token ids, which hold the reasoning", param="include_reasoning")


def completion_body(body: GenerateBody) -> CompletionBody:
    """The generate body as the completions body it runs as: its token ids the prompt, its sampling params the
    completions fields of their names; max_tokens unset is what the context leaves (vLLM's generate)."""
    for name, reason in REFUSED_FIELDS.items():
        if getattr(body, name) is not None:
            raise InvalidRequestError(f"{name} is not supported: {reason}", param=name)
    params = dict(body.sampling_params)
    for name in params:
        if name == "detokenize":
            continue
        if name not in SAMPLING_FIELDS:
            reason = REFUSED_SAMPLING_FIELDS.get(name)
            raise InvalidRequestError(f"sampling_params.{name} is not supported: {reason}" if reason else
                                      f"Unrecognized request argument supplied: sampling_params.{name}",
                                      param=f"sampling_params.{name}")
    detokenize = params.pop("detokenize", None)
    if detokenize is not None and msgspec.json.decode(detokenize) is not True:
        raise InvalidRequestError("sampling_params.detokenize must be true: every output is detokenized (stop "
                                  "strings are matched on its text)", param="sampling_params.detokenize")
    fields: dict[str, Any] = {"max_tokens": None, **params, "prompt": body.token_ids, "return_token_ids": True}
    for name in ("model", "stream", "stream_options", "cache_salt", "priority"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    try:
        return decode_body(msgspec.json.encode(fields), CompletionBody)
    except InvalidRequestError as exc:
        raise generate_error(exc) from None


def generate_error(exc: PagodaError) -> PagodaError:
    """A refusal of the completions body (or its run) that names a field as the generate body has it: its prompt
    is token_ids, its sampling fields live under sampling_params."""
    param = exc.param
    if param:
        head = param.split(".", 1)[0].split("[", 1)[0]
        if head == "prompt":
            exc.param = "token_ids" + param[len(head):]
        elif head in SAMPLING_FIELDS:
            exc.param = f"sampling_params.{param}"
        if exc.param != param:  # the message quotes the field by the name it has in the generate body too
            exc.message = exc.message.replace(f"'{param}'", f"'{exc.param}'")
            exc.args = (exc.message,)
    return exc


def sampling_params_json(params: SamplingParams) -> dict[str, Any]:
    """vLLM's SamplingParams as the render routes write them: the params the tokenizer would run the prompt with
    (the generation config's defaults and max_tokens resolved), under the names generate takes back."""
    out: dict[str, Any] = {
        "n": params.n, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
        "min_p": params.min_p, "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty, "repetition_penalty": params.repetition_penalty,
        "seed": params.seed, "max_tokens": params.max_tokens, "min_tokens": params.min_tokens,
        "stop": params.stop, "stop_token_ids": params.stop_token_ids, "ignore_eos": params.ignore_eos,
        "logprobs": params.logprobs, "prompt_logprobs": params.prompt_logprobs,
        "skip_special_tokens": params.skip_special_tokens,
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "logit_bias": {str(token_id): bias for token_id, bias in params.logit_bias.items()} or None,
        "allowed_token_ids": params.allowed_token_ids or None, "bad_words": params.bad_words or None,
        "logprob_token_ids": params.logprob_token_ids or None,
        "structured_outputs": msgspec.to_builtins(params.structured_outputs)
        if params.structured_outputs is not None else None,
    }
    if params.repetition_detection is not None:
        out["repetition_detection"] = msgspec.to_builtins(params.repetition_detection)
    if params.stream_interval is not None:
        out["stream_interval"] = params.stream_interval
    if params.thinking_token_budget is not None:  # generate refuses it: the budget needs the chat prompt
        out["thinking_token_budget"] = params.thinking_token_budget
    return out


def generate_request_json(request_id: str, token_ids: list[int], params: SamplingParams, model: str,
                          stream: bool, stream_options: StreamOptions | None, cache_salt: str | None,
                          priority: int) -> dict[str, Any]:
    """vLLM's GenerateRequest, as the render routes answer: what /inference/v1/generate takes."""
    return {"request_id": request_id, "token_ids": token_ids, "features": None,
            "sampling_params": sampling_params_json(params), "model": model, "stream": stream,
            "stream_options": msgspec.to_builtins(stream_options) if stream and stream_options is not None
            else None, "cache_salt": cache_salt, "priority": priority, "kv_transfer_params": None}


class GenerateRenderer(Renderer):
    """vLLM's GenerateResponse (and its stream's chunks) from the completion's deltas: token ids, logprobs by id."""

    route_name = "generate"

    def _logprobs(self, positions: list[Any]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        logprobs = chat_logprobs(positions, as_ids=True)
        logprobs.pop("refusal")
        return logprobs

    def body(self, view: ResponseView, usage: dict[str, Any]) -> dict[str, Any]:
        choices = [{"index": c.index, "logprobs": self._logprobs(c.logprobs),
                    "finish_reason": _finish_name(c.finish_reason) or "stop", "token_ids": c.token_ids}
                   for c in view.choices]
        prompt_logprobs = prompt_logprobs_json(view.prompt_logprobs[0]) if self.prompt_logprobs else None
        return {"request_id": self.response_id, "choices": choices, "usage": usage,
                "prompt_logprobs": prompt_logprobs, "kv_transfer_params": None}

    def chunks(self, batch: list[tuple[Choice, TextDelta]]) -> bytes:
        """One chunk per delta with new tokens or an end (vLLM's stream skips deltas without tokens)."""
        out = []
        for choice, delta in batch:
            if not delta.token_ids and delta.finish_reason < 0:
                continue
            chunk: dict[str, Any] = {"request_id": self.response_id, "choices": [{
                "index": choice.index, "logprobs": self._logprobs(delta.logprobs),
                "finish_reason": _finish_name(delta.finish_reason), "token_ids": delta.token_ids}]}
            if self.continuous_usage:
                chunk["usage"] = running_usage(choice)
            out.append(sse(chunk))
        return b"".join(out)

    def closing(self, usage: dict[str, Any]) -> bytes:
        if not self.include_usage:
            return SSE_DONE
        return sse({"request_id": self.response_id, "choices": [], "usage": usage}) + SSE_DONE
