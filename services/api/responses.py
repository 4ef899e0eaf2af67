"""POST /v1/responses, OpenAI's Responses API, on chat's path: the body becomes a chat request that runs as chat's do
(tenants, limits, timeouts, priority, metrics, aborts); the answer is rendered here (services/protocol/responses.py).
With --responses-store N finished responses are kept (services/api/response_store.py): previous_response_id
continues one, and GET / DELETE /v1/responses/{id} and its input_items read it; `background: true` runs on
detached from its request, read back while it runs, and can be cancelled (services/api/background.py). Without
it the routes that would read one back answer 404 saying so."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from pagoda.services.api.background import RUNNING, BackgroundRenderer, BackgroundRuns, Run
from pagoda.services.api.handlers import SSE_HEADERS, Handlers, json_response, request_tenant
from pagoda.services.api.response_store import ResponseStore, StoredResponse
from pagoda.services.protocol.render import CHAT
from pagoda.services.protocol.responses import (
    NO_OP_VALUES,
    ResponsesBody,
    ResponsesRenderer,
    decode_input_tokens_body,
    decode_responses_body,
    own_input_error,
    rename_error,
    stored_input_items,
    to_chat,
)
from pagoda.services.protocol.schemas import MAX_TURNS, chat_request, prompt_bytes
from pagoda.services.protocol.schemas import require as _require
from pagoda.services.protocol.vllm import RESPONSES_NOT_STORED
from pagoda.shared.errors import InvalidRequestError, PagodaError
from pagoda.shared.messages import RenderSpec

log = logging.getLogger(__name__)


class ResponseNotFoundError(PagodaError):
    http_status = 404
    error_type = "invalid_request_error"  # OpenAI's, for an id it does not know


class ResponsesRoutes:
    def __init__(self, handlers: Handlers) -> None:
        self.handlers = handlers
        folder = handlers.state.config.responses_folder()
        capacity = handlers.state.config.responses_store
        self.store = ResponseStore(folder, capacity) if folder is not None else None
        self.background = BackgroundRuns(self.store) if self.store is not None else None

    async def create(self, request: web.Request) -> web.StreamResponse:
        handlers = self.handlers
        started_at = time.monotonic()
        body = decode_responses_body(await handlers._body(request))
        model = handlers._check_model(body.model, request)
        response_id = f"resp_{uuid.uuid4().hex}"
        tenant = _tenant_name(request)
        previous_response_id = body.previous_response_id
        background = self._background(body)
        num_earlier = 0  # the previous response's items before the client's input
        try:
            body, num_earlier = await self._continued(msgspec.structs.replace(body, background=None), tenant)
            form = to_chat(body)
            # instructions, input texts, function calls and outputs, tool definitions
            handlers._check_prompt_bytes(prompt_bytes(form.chat), "input", "input")
            message, output = handlers._chat_message(form.chat, response_id)
        except InvalidRequestError as exc:
            raise rename_error(own_input_error(exc, num_earlier)) from None
        keep = self.store is not None and body.store is not False  # OpenAI's default: stored
        form.settings["previous_response_id"] = previous_response_id
        form.settings["background"] = background
        created_at = int(time.time())
        stream = bool(body.stream) and not background  # a background run's request is never streamed itself
        run = Run(response_id, tenant, BackgroundRenderer(
            response_id, model, created_at, form.settings, output, stream=bool(body.stream),
            want_logprobs=bool(form.chat.logprobs), temperature=message.params.temperature,
            top_p=message.params.top_p), stored_input_items(body.input)) if background else None
        if run is not None:
            assert self.background is not None
            run.renderer.on_final = self.background.keep(run)
            renderer: ResponsesRenderer = run.renderer
        else:
            renderer = ResponsesRenderer(response_id, model, created_at, form.settings, output, stream=stream,
                                         want_logprobs=bool(form.chat.logprobs),
                                         temperature=message.params.temperature, top_p=message.params.top_p,
                                         on_final=self._keeper(response_id, tenant, body) if keep else None)
        spec = RenderSpec(CHAT, response_id, model, created_at, stream)  # the request's id, model and mode
        try:
            if run is not None:
                assert self.background is not None
                # the generation runs as any request (the tenant's quota and concurrency, the in-flight limit, the
                # request timeout, metrics), in a task of its own; the POST answers once its prompt is admitted
                queued = await self.background.start(run, lambda: handlers._generate(
                    request, [message], spec, started_at, {}, form.constraint, run.renderer))
                if body.stream:  # its events as they come; a client that leaves stops reading, not the run
                    return await self._stream_events(request, run.record(queued), -1, run)
                return json_response(queued)
            return await handlers._generate(request, [message], spec, started_at, {}, form.constraint, renderer)
        except PagodaError as exc:  # a refusal by the tokenizer (the prompt too long, a schema that does not compile)
            raise rename_error(exc) from None

    def _background(self, body: ResponsesBody) -> bool:
        """`background: true`, which needs the store (its state is read back from it) and store not false (vLLM's
        words)."""
        if not body.background:
            return False
        _require(self.store is not None, "background",
                 f"{NO_OP_VALUES['background'][1]}, which this server does not keep")
        _require(body.store is not False, "background", "background can only be used when `store` is true")
        return True

    def _keeper(self, response_id: str, tenant: str, body: ResponsesBody) -> Callable[[dict[str, Any]], None]:
        """What keeps the finished response object (the renderer calls it once, before the answer's last bytes)."""
        store, items = self.store, stored_input_items(body.input)
        assert store is not None

        def keep(response: dict[str, Any]) -> None:
            try:
                store.put_now(response_id, StoredResponse(tenant, response, items))
            except OSError as exc:  # the answer still goes out; continuing this one will say it is not found
                log.warning("could not keep response %s in %s: %s", response_id, store.folder, exc)
        return keep

    async def _continued(self, body: ResponsesBody, tenant: str) -> tuple[ResponsesBody, int]:
        """With previous_response_id (and a store): the body whose input is that response's conversation (its input
        items, earlier turns included, then its output) followed by this input, and the number of those earlier
        items. OpenAI's rule: the earlier instructions are not carried over."""
        if body.previous_response_id is None or self.store is None:
            return body, 0  # without a store, to_chat refuses the field
        previous_id = body.previous_response_id
        _require(isinstance(previous_id, str), "previous_response_id", "previous_response_id must be a string")
        previous = await self.store.get(previous_id, tenant)
        if previous is not None and self.background is not None:
            previous = await self.background.settle(previous)
        if previous is None:  # OpenAI's code: clients match it to send the whole conversation instead
            raise InvalidRequestError(f"Previous response with id {previous_id!r} not found (never stored, store: "
                                      "false, deleted, or dropped past the --responses-store count)",
                                      param="previous_response_id", code="previous_response_not_found")
        _require(previous.response.get("status") not in RUNNING, "previous_response_id",
                 f"Previous response with id {previous_id!r} has not finished (a background response): wait until "
                 f"it ends")
        earlier = previous.conversation()
        conversation = [*earlier, *stored_input_items(body.input)]
        _require(len(conversation) <= MAX_TURNS, "previous_response_id",
                 f"the conversation would have {len(conversation)} items; at most {MAX_TURNS}")
        return msgspec.structs.replace(body, input=conversation, previous_response_id=None), len(earlier)

    async def input_tokens(self, request: web.Request) -> web.Response:
        """POST /v1/responses/input_tokens (OpenAI's; litellm's count_tokens for an openai/ model, pydantic-ai's
        count_tokens_before_request): the prompt a Responses body would run, tokenized as generation tokenizes it,
        as /v1/messages/count_tokens counts a Messages body."""
        handlers = self.handlers
        body = decode_input_tokens_body(await handlers._body(request))
        handlers._check_model(body.model, request)
        request_id = f"count_{uuid.uuid4().hex}"
        num_earlier = 0
        try:
            body, num_earlier = await self._continued(body, _tenant_name(request))
            form = to_chat(body)
            handlers._check_prompt_bytes(prompt_bytes(form.chat), "input", "input")
            prompt = chat_request(form.chat, request_id, time.time(), handlers.state.config.max_logprobs,
                                  exclude_tools_when_none=handlers.state.config.exclude_tools_when_tool_choice_none)
            input_tokens = await handlers._count_prompt_tokens(prompt)
        except PagodaError as exc:
            raise rename_error(own_input_error(exc, num_earlier)) from None
        return json_response({"object": "response.input_tokens", "input_tokens": input_tokens})

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/responses/{id}: the stored response object, as its answer gave it; with `stream=true` (a
        background response created streamed) its events again, those after `starting_after` (a sequence_number),
        until its last, as OpenAI's resumption of a background stream."""
        found = await self._stored(request)
        if not found.response.get("background"):
            _no_query(request, ())
        _no_query(request, ("stream", "starting_after"))
        stream, starting_after = request.query.get("stream", "false"), _query_int(request, "starting_after", "-1")
        _require(stream in ("true", "false"), "stream", "stream must be true or false")
        _require(starting_after is not None and starting_after >= -1, "starting_after",
                 "starting_after must be an integer >= -1 (a sequence_number)")
        assert starting_after is not None
        if stream == "false":
            _require("starting_after" not in request.query, "starting_after", "starting_after needs stream=true")
            return json_response(found.response)
        assert self.store is not None
        _require(await asyncio.to_thread(self.store.has_events, found.response["id"]), "stream",
                 "this background response was not created with stream: true: it has no events to stream")
        return await self._stream_events(request, found, starting_after)

    async def _stream_events(self, request: web.Request, found: StoredResponse, starting_after: int,
                             run: Run | None = None) -> web.StreamResponse:
        assert self.background is not None
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            async for data in self.background.events(found, starting_after, run):
                await response.write(data)
        except ConnectionResetError:
            log.info("client left the stream of background response %s", found.response["id"])
        return response

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        assert self.store is not None  # the routes that read the store are served only with one (build_app)
        found = await self._stored(request)
        # its run would write it back: cancel it first
        _require(found.response.get("status") not in RUNNING, "response_id",
                 f"Response with id {response_id!r} is a background response still running: cancel it first")
        if not await self.store.delete(response_id, _tenant_name(request)):
            raise _not_found(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}/input_items: the conversation the response answered (earlier turns' items
        included, instructions not), OpenAI's list: `order` desc (default) or asc, `limit` 1-100 (20), `after` an
        item id."""
        _no_query(request, ("order", "limit", "after"))
        items = list((await self._stored(request)).input_items)
        order, limit, after = request.query.get("order", "desc"), _query_int(request, "limit", "20"), \
            request.query.get("after")
        _require(order in ("asc", "desc"), "order", "order must be asc or desc")
        _require(limit is not None and 1 <= limit <= 100, "limit", "limit must be an integer in [1, 100]")
        assert limit is not None
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.get("id") for item in items]
            _require(after in ids, "after", f"no input item {after!r} in this response")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})

    async def cancel(self, request: web.Request) -> web.Response:
        """POST /v1/responses/{id}/cancel: a background response still running ends `cancelled` (its generation
        aborted, whichever api process runs it: services/api/background.py) and that object is the answer; one that
        ended answers its final object unchanged (OpenAI's: a cancel is idempotent). Only a background response can
        be cancelled."""
        found = await self._stored(request)
        if not found.response.get("background"):
            raise InvalidRequestError("Only responses created with background set to true can be cancelled",
                                      param=None)
        if found.response.get("status") not in RUNNING:
            return json_response(found.response)
        assert self.background is not None
        return json_response(await self.background.cancel(found))

    async def not_stored(self, request: web.Request) -> web.Response:
        """GET / DELETE /v1/responses/{id}, its cancel and input_items without a store: nothing to read."""
        response_id = request.match_info["response_id"]
        raise ResponseNotFoundError(f"Response with id {response_id!r} not found: {RESPONSES_NOT_STORED}")

    async def _stored(self, request: web.Request) -> StoredResponse:
        response_id = request.match_info["response_id"]
        assert self.store is not None  # the routes that read the store are served only with one (build_app)
        found = await self.store.get(response_id, _tenant_name(request))
        if found is None:
            raise _not_found(response_id)
        assert self.background is not None
        return await self.background.settle(found)  # a running one whose api process was killed: failed


def _not_found(response_id: str) -> PagodaError:
    return ResponseNotFoundError(f"Response with id {response_id!r} not found")


def _tenant_name(request: web.Request) -> str:
    tenant = request_tenant(request)
    return tenant.name if tenant is not None else ""


def _no_query(request: web.Request, allowed: tuple[str, ...]) -> None:
    """Query parameters outside `allowed` (stream, include, ...) would be ignored: refused naming the first; so would
    a repeat of one (only the first is read)."""
    extra = next((name for name in request.query if name not in allowed), None)
    _require(extra is None, str(extra), f"the query parameter {extra!r} is not supported here"
                                        + (f" (this route takes {', '.join(allowed)})" if allowed else ""))
    repeated = next((name for name in allowed if len(request.query.getall(name, ())) > 1), None)
    _require(repeated is None, str(repeated), f"the query parameter {repeated!r} is given more than once")


def _query_int(request: web.Request, name: str, default: str) -> int | None:
    """A query parameter's integer: ASCII digits, at most 18 (str.isdigit passes "²", which int() refuses, and int()
    refuses past 4300 digits: each was a 500), an optional minus; None when it is not one."""
    value = request.query.get(name, default)
    return int(value) if re.fullmatch(r"-?[0-9]{1,18}", value) else None
