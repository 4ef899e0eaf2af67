"""POST /v1/messages, Anthropic's Messages API, on chat's path: the body becomes a chat request that runs as chat's
do (tenants, limits, timeouts, metrics, aborts); the answer is rendered here (services/protocol/anthropic.py).
/v1/messages/count_tokens counts the prompt as /tokenize does. Under /v1/messages errors take Anthropic's shape and
Anthropic's `x-api-key` header carries the API key as `Authorization: Bearer` does elsewhere."""

from __future__ import annotations

import re
import time

from aiohttp import web
from aiohttp.typedefs import Handler
from multidict import CIMultiDict

from pagoda.services.api.errors import AuthenticationError, RateLimitError
from pagoda.services.api.handlers import Handlers, json_response
from pagoda.services.protocol.anthropic import (
    MessagesRenderer,
    anthropic_error,
    decode_count_tokens_body,
    decode_messages_body,
    new_id,
    rename_error,
    to_chat,
)
from pagoda.services.protocol.render import CHAT
from pagoda.services.protocol.schemas import chat_request, prompt_bytes
from pagoda.shared.errors import InvalidRequestError, PagodaError
from pagoda.shared.messages import RenderSpec

MESSAGES_PATH = "/v1/messages"
AUTH_HELP = "Invalid or missing API key: send 'x-api-key: <key>' or 'Authorization: Bearer <key>'"


class MessagesRoutes:
    def __init__(self, handlers: Handlers) -> None:
        self.handlers = handlers

    async def create(self, request: web.Request) -> web.StreamResponse:
        handlers = self.handlers
        started_at = time.monotonic()
        body = decode_messages_body(await handlers._body(request))
        model = handlers._check_model(body.model, request)
        message_id = new_id("msg")
        form = to_chat(body)  # its errors name the Messages fields already
        try:
            # system, texts, tool calls and results, tool definitions
            handlers._check_prompt_bytes(prompt_bytes(form.chat), "prompt", "messages")
            message, output = handlers._chat_message(form.chat, message_id)
        except InvalidRequestError as exc:
            raise rename_error(exc) from None
        created = int(time.time())
        stream = bool(body.stream)
        renderer = MessagesRenderer(message_id, model, created, output, stream=stream)
        spec = RenderSpec(CHAT, message_id, model, created, stream)  # the request's id, model and mode
        try:
            return await handlers._generate(request, [message], spec, started_at, {}, form.constraint, renderer)
        except PagodaError as exc:  # a refusal by the tokenizer (the prompt too long, a schema that does not compile)
            raise anthropic_context_error(rename_error(exc)) from None

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt a Messages body would run, tokenized as generation tokenizes it: {"input_tokens": N}."""
        handlers = self.handlers
        body = decode_count_tokens_body(await handlers._body(request))
        handlers._check_model(body.model, request)
        request_id = new_id("count")
        form = to_chat(body.as_messages(), count_only=True)
        try:
            handlers._check_prompt_bytes(prompt_bytes(form.chat), "prompt", "messages")
            prompt = chat_request(form.chat, request_id, time.time(), handlers.state.config.max_logprobs,
                                  exclude_tools_when_none=handlers.state.config.exclude_tools_when_tool_choice_none)
        except InvalidRequestError as exc:
            raise rename_error(exc) from None
        try:
            input_tokens = await handlers._count_prompt_tokens(prompt)
        except PagodaError as exc:
            raise rename_error(exc) from None
        return json_response({"input_tokens": input_tokens})


# the numbers of the tokenizer's context refusals (ContextLengthError.prompt_too_long / max_tokens_too_large)
_PROMPT_TOO_LONG = re.compile(r"your request has (\d+) input tokens \([^)]*\); at most (\d+) fit")
_MAX_TOKENS_TOO_LARGE = re.compile(r"your request has (\d+) input tokens \((\d+) > (\d+) - \d+\)")


def anthropic_context_error(exc: PagodaError) -> PagodaError:
    """A context overflow in Anthropic's words, which clients of its API match (Claude Code's "prompt is too long"
    handling): "prompt is too long: N tokens > M maximum", and "input length and `max_tokens` exceed context limit:
    N + K > L, ..."; with no field in front, as Anthropic's. Other errors as they are."""
    if exc.code != "context_length_exceeded":
        return exc
    if match := _MAX_TOKENS_TOO_LARGE.search(exc.message):
        num_tokens, max_tokens, limit = match.groups()
        message = (f"input length and `max_tokens` exceed context limit: {num_tokens} + {max_tokens} > {limit}, "
                   "decrease input length or `max_tokens` and try again")
    elif match := _PROMPT_TOO_LONG.search(exc.message):
        num_tokens, max_len = match.groups()
        message = f"prompt is too long: {num_tokens} tokens > {max_len} maximum"
    else:
        return exc
    return InvalidRequestError(message, code=exc.code)


def _is_messages(request: web.Request) -> bool:
    return request.path == MESSAGES_PATH or request.path.startswith(MESSAGES_PATH + "/")


@web.middleware
async def anthropic_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Under /v1/messages: `x-api-key` joins the Authorization headers as a bearer key (the auth middleware, inside
    this one, checks it as any key: every header must hold the same one), and a failure is Anthropic's error body
    with the status pagoda's error carries. Other routes pass through untouched."""
    if not _is_messages(request):
        return await handler(request)
    api_keys = request.headers.getall("x-api-key", [])
    if api_keys:
        headers = CIMultiDict(request.headers)
        for key in api_keys:
            headers.add("Authorization", f"Bearer {key.strip()}")
        request = request.clone(headers=headers)
    try:
        return await handler(request)
    except PagodaError as exc:
        message = AUTH_HELP if isinstance(exc, AuthenticationError) else exc.message
        response = json_response(anthropic_error(exc.http_status, message, exc.param), status=exc.http_status)
        if isinstance(exc, RateLimitError):
            response.headers["Retry-After"] = str(exc.retry_after_s)
        return response
    except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method, body too large
        if exc.status < 400:
            raise
        response = json_response(anthropic_error(exc.status, f"{exc.reason}: {request.method} {request.path}"),
                                 status=exc.status)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
