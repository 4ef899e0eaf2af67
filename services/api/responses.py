"""POST /v1/responses, OpenAI's Responses API, on chat's path: the body becomes a chat request that runs as chat's do
(tenants, limits, timeouts, priority, metrics, aborts); the answer is rendered here (services/protocol/responses.py).
Responses are not stored: the routes that would read one back answer 404 saying so."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from pagoda.services.api.handlers import Handlers, json_response
from pagoda.services.protocol.render import CHAT
from pagoda.services.protocol.responses import (
    ResponsesRenderer,
    decode_input_tokens_body,
    decode_responses_body,
    rename_error,
    to_chat,
)
from pagoda.services.protocol.schemas import chat_request, prompt_bytes
from pagoda.services.protocol.vllm import RESPONSES_NOT_STORED
from pagoda.shared.errors import InvalidRequestError, PagodaError
from pagoda.shared.messages import RenderSpec


class ResponseNotFoundError(PagodaError):
    http_status = 404
    error_type = "invalid_request_error"  # OpenAI's, for an id it does not know


class ResponsesRoutes:
    def __init__(self, handlers: Handlers) -> None:
        self.handlers = handlers

    async def create(self, request: web.Request) -> web.StreamResponse:
        handlers = self.handlers
        started_at = time.monotonic()
        body = decode_responses_body(await handlers._body(request))
        model = handlers._check_model(body.model, request)
        response_id = f"resp_{uuid.uuid4().hex}"
        try:
            form = to_chat(body)
            # instructions, input texts, function calls and outputs, tool definitions
            handlers._check_prompt_bytes(prompt_bytes(form.chat), "input", "input")
            message, output = handlers._chat_message(form.chat, response_id)
        except InvalidRequestError as exc:
            raise rename_error(exc) from None
        created_at = int(time.time())
        stream = bool(body.stream)
        renderer = ResponsesRenderer(response_id, model, created_at, form.settings, output, stream=stream,
                                     want_logprobs=bool(form.chat.logprobs), temperature=message.params.temperature,
                                     top_p=message.params.top_p)
        spec = RenderSpec(CHAT, response_id, model, created_at, stream)  # the request's id, model and mode
        try:
            return await handlers._generate(request, [message], spec, started_at, {}, form.constraint, renderer)
        except PagodaError as exc:  # a refusal by the tokenizer (the prompt too long, a schema that does not compile)
            raise rename_error(exc) from None

    async def input_tokens(self, request: web.Request) -> web.Response:
        """POST /v1/responses/input_tokens (OpenAI's; litellm's count_tokens for an openai/ model, pydantic-ai's
        count_tokens_before_request): the prompt a Responses body would run, tokenized as generation tokenizes it,
        as /v1/messages/count_tokens counts a Messages body."""
        handlers = self.handlers
        body = decode_input_tokens_body(await handlers._body(request))
        handlers._check_model(body.model, request)
        request_id = f"count_{uuid.uuid4().hex}"
        try:
            form = to_chat(body)
            handlers._check_prompt_bytes(prompt_bytes(form.chat), "input", "input")
            prompt = chat_request(form.chat, request_id, time.time(), handlers.state.config.max_logprobs)
            input_tokens = await handlers._count_prompt_tokens(prompt)
        except PagodaError as exc:
            raise rename_error(exc) from None
        return json_response({"object": "response.input_tokens", "input_tokens": input_tokens})

    async def not_stored(self, request: web.Request) -> web.Response:
        """GET / DELETE /v1/responses/{id}, its cancel and input_items: there is nothing stored to read."""
        response_id = request.match_info["response_id"]
        raise ResponseNotFoundError(f"Response with id {response_id!r} not found: {RESPONSES_NOT_STORED}")
