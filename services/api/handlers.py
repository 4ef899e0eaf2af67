"""The HTTP routes: each parses and checks its body, asks a tokenizer, and writes the OpenAI answer."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from pagoda.services.api.console.inspector import RequestLog, RequestRecord
from pagoda.services.api.errors import RateLimitError, RequestTimeoutError, UpstreamError
from pagoda.services.api.generation import Generation
from pagoda.services.api.metrics import ApiMetrics
from pagoda.services.api.pool import Reply, TokenizerPool
from pagoda.services.api.stats import ReplicaStatsFeed
from pagoda.services.api.tenants import KeyTable, Lease, QuotaGate, Tenant, UsageLog, tenant_cache_salt
from pagoda.services.protocol.chat_output import ChatOutputSpec
from pagoda.services.protocol.generate import (
    GenerateBody,
    GenerateRenderer,
    check_render_fields,
    completion_body,
    generate_error,
    generate_request_json,
)
from pagoda.services.protocol.render import CHAT, COMPLETION, Renderer, encode_json, renderer_for
from pagoda.services.protocol.schemas import (
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    chat_echo_text,
    chat_messages,
    chat_output_spec,
    chat_request,
    chat_response_role,
    check_thinking_budget,
    completion_requests,
    constraint_param,
    decode_body,
    prompt_bytes,
    tokenize_tools,
)
from pagoda.services.protocol.tools import default_tool_parser, keeps_special_tokens
from pagoda.services.protocol.vllm import deprecation_header
from pagoda.shared.config import ServerConfig
from pagoda.shared.errors import InvalidRequestError, ModelNotFoundError, PagodaError
from pagoda.shared.messages import (
    MAX_INT32,
    DetokenizeRequest,
    DetokenizeResult,
    GenerateRequest,
    PromptRendered,
    RenderSpec,
    RequestFailed,
    TokenizeRequest,
    TokenizeResult,
    TokenizerInfoRequest,
    TokenizerInfoResult,
    check_client_request_id,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


def _request_key(name: str, kind: type) -> Any:
    """A key of a request's storage: typed where aiohttp has them (web.RequestKey; a plain string key there draws
    a NotAppKeyWarning), else the string."""
    return web.RequestKey(name, kind) if hasattr(web, "RequestKey") else name


# request[TENANT]: (key id, Tenant) of the key that authenticated it, or None
TENANT = _request_key("pagoda.tenant", tuple)
DEFAULT_TENANT = ("default", Tenant("default"))  # the --api-key key beside a keys file: no limits
# request[COUNTED]: the generation request reached the tenant accounting of _generate (its status, tokens, usage
# line); one refused before then (a bad body, a model the tenant may not use, a quota) is counted by app.py
COUNTED = _request_key("pagoda.counted", bool)


def _headers(deprecated: list[str]) -> dict[str, str]:
    return {"Warning": deprecation_header(deprecated)} if deprecated else {}


def _name_constraint(exc: PagodaError, constraint: str | None) -> None:
    """A refusal from the tokenizer that names SamplingParams' structured_outputs (a grammar that does not compile)
    names the body's field that asked for the constraint instead."""
    if constraint is not None and (exc.param or "").startswith("structured_outputs"):
        exc.param = constraint

def _params_summary(params: msgspec.Struct) -> str:
    """The settings a request sent, for --enable-log-requests: numbers and switches as they are; texts, lists and
    objects (stop strings, choices, schemas, bias maps: the client's content) only as their kind and size."""
    sent = msgspec.to_builtins(params)  # omit_defaults: what differs from the defaults
    parts = [f"{name}={value}" if isinstance(value, bool | int | float) or value is None
             else f"{name}=<{type(value).__name__} of {len(value) if hasattr(value, '__len__') else 1}>"
             for name, value in sent.items()]
    return " ".join(parts)


def _name_body_constraint(exc: PagodaError, body: CompletionBody | ChatBody) -> None:
    """A refusal of the request's SamplingParams that names their structured_outputs names the body's field that
    asked for the constraint (guided_*, response_format, tools), as a refusal from the tokenizer does; a body that
    sent structured_outputs itself keeps the param as it is (its sub-field)."""
    constraint = constraint_param(body)
    if constraint != "structured_outputs":
        _name_constraint(exc, constraint)


def _name_max_completion_tokens(exc: PagodaError, body: ChatBody) -> None:
    """A refusal naming max_tokens (the tokenizer's context check, a SamplingParams range) names the field the chat
    body sent it as: max_completion_tokens, when that was sent."""
    if exc.param == "max_tokens" and body.max_completion_tokens is not None:
        exc.message = exc.message.replace("max_tokens", "max_completion_tokens")
        exc.args = (exc.message,)
        exc.param = "max_completion_tokens"


SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}  # proxies must pass each event on at once


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=encode_json(obj), status=status, content_type="application/json", headers=headers)


def _version() -> str:
    try:
        return importlib.metadata.version("pagoda")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


VERSION = _version()


@dataclass(slots=True)
class ApiState:
    """What every handler shares in one api process."""

    config: ServerConfig
    served_model_name: str
    model_names: frozenset[str]  # names a request may use for the one model served
    model_root: str  # the model as given to the engine (--model): the model card's `root`, as vLLM's
    pool: TokenizerPool
    stats: ReplicaStatsFeed
    metrics: ApiMetrics
    started: int  # time.time() at start, the models' "created"
    shutting_down: bool = False
    keys: KeyTable | None = None  # --api-keys-file: tenants and their quotas
    gate: QuotaGate = field(default_factory=QuotaGate)
    usage_log: UsageLog | None = None
    console_requests: RequestLog | None = None  # the console's request inspector (None: --no-console)
    served_names: tuple[str, ...] = ()  # every --served-model-name (the first is served_model_name); (): that one


class Handlers:
    def __init__(self, state: ApiState) -> None:
        self.state = state

    def _allowed_names(self, tenant: Tenant | None) -> frozenset[str]:
        """The model names (served names, the model's path) the request's tenant may send; all for no tenant. The
        model's path (--model) and the first served name are one name: listing either allows both."""
        state = self.state
        if tenant is None or "*" in tenant.models:
            return state.model_names
        listed = set(tenant.models)
        if listed & {state.model_root, state.served_model_name}:
            listed |= {state.model_root, state.served_model_name}
        return state.model_names & listed

    def _check_model(self, name: str | None, request: web.Request) -> str:
        """The name the answer reports. A tenant may send only the names its `models` lists (an alias of the same
        model it does not list is another served name: 404), and learns nothing of the names it may not use: a
        refused name, served or not, gets one message, naming only what the tenant may use."""
        state = self.state
        tenant = request_tenant(request)
        allowed = self._allowed_names(tenant)
        if not allowed:  # a tenant that may use no served name learns none
            assert tenant is not None
            state.metrics.tenant_rejected(tenant.name, "model")
            raise ModelNotFoundError(f"The model `{name}` does not exist or your API key may not use it." if name
                                     else "This server serves no model your API key may use.")
        # what answers and refusals name: the first served name, else the first the tenant may use
        shown = next(n for n in (*state.served_names, state.served_model_name, *sorted(allowed)) if n in allowed)
        if name is not None and name not in allowed:
            if allowed == state.model_names:  # every name is allowed: this one is not served
                raise ModelNotFoundError(f"The model `{name}` does not exist; this server serves `{shown}`.")
            if tenant is not None and name in state.model_names:  # refused by its list, not a typo
                state.metrics.tenant_rejected(tenant.name, "model")
            raise ModelNotFoundError(f"The model `{name}` does not exist or your API key may not use it; it may use "
                                     f"`{shown}`.")
        return state.served_model_name if state.served_model_name in allowed else name or shown

    async def _body(self, request: web.Request) -> bytes:
        """The body, read within body_read_timeout (a slow client gets 408); aiohttp keeps it for a second read."""
        timeout = self.state.config.body_read_timeout or None
        try:
            return await asyncio.wait_for(request.read(), timeout)
        except TimeoutError:
            raise RequestTimeoutError(f"the request body did not arrive within {timeout:g} s") from None
        except web.RequestPayloadError as exc:  # e.g. a Content-Encoding: gzip body that is not gzip
            # Nothing more of it, nor of the connection, can be read: the body is marked ended (else aiohttp, draining
            # it after the answer, fails again) and the connection closes after the answer (else a next request on it
            # waits for an answer that never comes).
            request.content.feed_eof()
            request.protocol.close()
            detail = getattr(exc.__cause__, "message", None) or str(exc)
            raise InvalidRequestError(f"the request body could not be read: {detail}") from None

    async def _read(self, request: web.Request, kind: type[T]) -> T:
        """The body, read within body_read_timeout and decoded as `kind`."""
        body = decode_body(await self._body(request), kind)
        param = "messages" if hasattr(body, "messages") and getattr(body, "messages", None) else "prompt"
        self._check_prompt_bytes(prompt_bytes(body), "prompt", param)
        return body

    def _check_prompt_bytes(self, size: int, what: str, param: str) -> None:
        """--max-prompt-bytes: an InvalidRequestError naming `param` when the prompt's text is past it."""
        limit = self.state.config.max_prompt_bytes
        if size > limit:
            raise InvalidRequestError(f"the {what} has {size} bytes; this server accepts at most {limit} "
                                      "(--max-prompt-bytes)", param=param)

    # ------------------------------------------------------------------ generation

    def _completion_requests(self, body: CompletionBody, request_id: str) -> list[GenerateRequest]:
        """A completions body's engine requests (one a prompt) under this server's limits and sampling defaults."""
        config = self.state.config
        return completion_requests(body, request_id, time.time(), config.max_logprobs,
                                   config.max_completions_per_request, self.state.pool.sampling_defaults)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        started_at = time.monotonic()
        body = await self._read(request, CompletionBody)
        model = self._check_model(body.model, request)
        request_id = f"cmpl-{uuid.uuid4().hex}"  # the engine's: unique whatever the client names its request
        response_id = _client_response_id("cmpl-", request, body.request_id) or request_id
        try:
            messages = self._completion_requests(body, request_id)
        except InvalidRequestError as exc:
            _name_body_constraint(exc, body)  # e.g. beam search refusing the guided_choice it was sent
            raise
        spec = RenderSpec(COMPLETION, response_id, model, int(time.time()), bool(body.stream),
                          want_logprobs=body.logprobs is not None, include_usage=body.include_usage,
                          echo=bool(body.echo), return_token_ids=bool(body.return_token_ids),
                          continuous_usage=body.continuous_usage, prompt_logprobs=body.prompt_logprobs is not None,
                          tokens_as_ids=bool(body.return_tokens_as_token_ids))
        return await self._generate(request, messages, spec, started_at, _headers(body.deprecated_fields),
                                    constraint_param(body))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        started_at = time.monotonic()
        body = await self._read(request, ChatBody)
        model = self._check_model(body.model, request)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"  # the engine's: unique whatever the client names its request
        response_id = _client_response_id("chatcmpl-", request, body.request_id) or request_id
        try:
            message, output = self._chat_message(body, request_id)
        except InvalidRequestError as exc:
            _name_body_constraint(exc, body)  # e.g. beam search refusing the response_format it was sent
            _name_max_completion_tokens(exc, body)
            raise
        role = chat_response_role(message, self.state.config.response_role)
        spec = RenderSpec(CHAT, response_id, model, int(time.time()), bool(body.stream),
                          want_logprobs=bool(body.logprobs), include_usage=body.include_usage,
                          return_token_ids=bool(body.return_token_ids), tool_mode=output.tool_mode,
                          tool_parser=output.tool_parser, tool_name=output.tool_name,
                          reasoning_parser=output.reasoning_parser, max_calls=output.max_calls,
                          continuous_usage=body.continuous_usage, prompt_logprobs=body.prompt_logprobs is not None,
                          tokens_as_ids=bool(body.return_tokens_as_token_ids),
                          echo_text=chat_echo_text(body, message, role), role=role,
                          tool_parameters=output.tool_parameters, include_reasoning=output.include_reasoning)
        try:
            return await self._generate(request, [message], spec, started_at, _headers(body.deprecated_fields),
                                        constraint_param(body))
        except PagodaError as exc:  # the tokenizer's refusal of the prompt plus max_tokens past the context
            _name_max_completion_tokens(exc, body)
            raise

    # ------------------------------------------------------------------ vLLM's token-in / token-out API

    async def completions_render(self, request: web.Request) -> web.Response:
        """vLLM's /v1/completions/render: each prompt of a completions body as the request generate takes (its
        token ids and the sampling params it would run with), checked as the completion would be; nothing runs."""
        body = await self._read(request, CompletionBody)
        model = self._check_model(body.model, request)
        check_render_fields(body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        response_id = _client_response_id("cmpl-", request, body.request_id) or request_id
        try:
            messages = self._completion_requests(body, request_id)
        except InvalidRequestError as exc:
            _name_body_constraint(exc, body)
            raise
        rendered = await self._render(messages, constraint_param(body))
        ids = [response_id] if len(rendered) == 1 else [f"{response_id}-{i}" for i in range(len(rendered))]
        return json_response([generate_request_json(rid, r.token_ids, r.params, model, bool(body.stream),
                                                    body.stream_options, body.cache_salt, body.priority or 0)
                              for rid, r in zip(ids, rendered, strict=True)], headers=_headers(body.deprecated_fields))

    async def chat_completions_render(self, request: web.Request) -> web.Response:
        """vLLM's /v1/chat/completions/render: the chat body's prompt (template, tools, truncation) as the request
        generate takes, checked as the chat completion would be; nothing runs."""
        body = await self._read(request, ChatBody)
        model = self._check_model(body.model, request)
        check_render_fields(body)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        response_id = _client_response_id("chatcmpl-", request, body.request_id) or request_id
        try:
            message, _ = self._chat_message(body, request_id)
            (rendered,) = await self._render([message], constraint_param(body))
        except InvalidRequestError as exc:
            _name_body_constraint(exc, body)
            _name_max_completion_tokens(exc, body)
            raise
        except PagodaError as exc:
            _name_max_completion_tokens(exc, body)
            raise
        return json_response(generate_request_json(response_id, rendered.token_ids, rendered.params, model,
                                                   bool(body.stream), body.stream_options, body.cache_salt,
                                                   body.priority or 0), headers=_headers(body.deprecated_fields))

    async def _render(self, messages: list[GenerateRequest], constraint: str | None) -> list[PromptRendered]:
        """The tokenizer's rendering of each prompt (every check generation makes, nothing admitted), in order; the
        first refusal is the answer."""
        messages = [msgspec.structs.replace(m, render_only=True) for m in messages]
        ticket = self.state.pool.submit(messages, self._engine_tokenizers())
        rendered: dict[str, PromptRendered] = {}
        try:
            while len(rendered) < len(messages):
                reply = await ticket.queue.get()
                if isinstance(reply, RequestFailed):
                    exc = UpstreamError.from_failed(reply)
                    _name_constraint(exc, constraint)
                    raise exc
                assert isinstance(reply, PromptRendered), type(reply).__name__
                rendered[reply.request_id] = reply
        finally:  # the prompts still rendering (one failed, or the client left) are dropped
            self.state.pool.finish(ticket, [m.request_id for m in messages if m.request_id not in rendered])
        return [rendered[m.request_id] for m in messages]

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """vLLM's /inference/v1/generate: token ids in, generated token ids out. It runs as a completion of a
        token-id prompt (admission, tenants, limits, metrics, aborts) and answers in vLLM's GenerateResponse."""
        started_at = time.monotonic()
        generate_body = decode_body(await self._body(request), GenerateBody)
        body = completion_body(generate_body)
        model = self._check_model(body.model, request)
        request_id = f"generate-tokens-{uuid.uuid4().hex}"
        response_id = _client_response_id("generate-tokens-", request, generate_body.request_id) or request_id
        try:
            messages = self._completion_requests(body, request_id)
        except InvalidRequestError as exc:
            raise generate_error(exc) from None
        created = int(time.time())
        stream = bool(body.stream)
        renderer = GenerateRenderer(response_id, model, created, want_logprobs=body.logprobs is not None,
                                    include_usage=body.include_usage, continuous_usage=body.continuous_usage,
                                    prompt_logprobs=body.prompt_logprobs is not None)
        spec = RenderSpec(COMPLETION, response_id, model, created, stream)
        try:
            return await self._generate(request, messages, spec, started_at, {}, "structured_outputs", renderer)
        except PagodaError as exc:  # the tokenizer's refusal (an id past the vocabulary, the context)
            raise generate_error(exc) from None

    def _chat_message(self, body: ChatBody, request_id: str) -> tuple[GenerateRequest, ChatOutputSpec]:
        """The chat path's request and output reading for a chat body: chat completions, and the Responses and
        Messages APIs once their bodies are turned into chat."""
        config = self.state.config
        self._check_request_template(body.chat_template)
        message = chat_request(body, request_id, time.time(), config.max_logprobs, self.state.pool.sampling_defaults,
                               config.exclude_tools_when_tool_choice_none)
        check_thinking_budget(message.params, config.reasoning_parser)
        output = chat_output_spec(body, self._tool_parser(), config.reasoning_parser)
        message = msgspec.structs.replace(message, tool_parser=output.tool_parser)
        if body.skip_special_tokens is None and keeps_special_tokens(output.tool_mode, output.tool_parser):
            message = msgspec.structs.replace(message, params=msgspec.structs.replace(message.params,
                                                                                      skip_special_tokens=False))
        return message, output

    def _check_request_template(self, template: str | None) -> None:
        """A request's own chat_template runs only under --trust-request-chat-template (vLLM's rule and words)."""
        if template is not None and not self.state.config.trust_request_chat_template:
            raise InvalidRequestError("Chat template is passed with request, but --trust-request-chat-template is not "
                                      "set. Refused request with untrusted chat template.", param="chat_template")

    def _tool_parser(self) -> str:
        """The parser of `auto` tool calls: --tool-call-parser, else the default for the served model's names."""
        return self.state.config.tool_call_parser or default_tool_parser(sorted(self.state.model_names))

    async def _generate(self, request: web.Request, messages: list[GenerateRequest], spec: RenderSpec,
                        started_at: float, headers: dict[str, str], constraint: str | None,
                        renderer: Renderer | None = None) -> web.StreamResponse:
        """`constraint`: the body field that asked for a constraint, which its compile error names. `renderer`:
        one that renders here from the tokenizer's text (the messages then carry no RenderSpec) and sees every
        batch, streamed or not (the Responses API, whose events and body need the whole output)."""
        found = request.get(TENANT)
        tenant: Tenant | None = found[1] if found is not None else None
        # 429 over quota, before any work. The operator's key (tenant "default", no limits) takes no lease: it must not
        # count against, nor reset the buckets of, a keys-file tenant that is also named "default".
        lease = self._admit(tenant) if found is not DEFAULT_TENANT else None
        request[COUNTED] = True  # from here _account counts it (and releases the lease), whatever happens
        gen: Generation | None = None
        status = 499  # the client left (the handler was cancelled) unless set below
        arrival = messages[0].arrival_time
        try:
            shared = self._scheduled_tenant(found)  # the share of the engine it runs in
            # The tokenizer renders each prompt's choices (they start at prompt index * n); the same renderer here
            # serves a tokenizer that answers with text instead. The tenant rides along for the scheduler's share
            # (and, with --prefix-cache-isolation tenant, in the request's cache salt).
            n = messages[0].params.n
            if self.state.config.log_requests:  # vLLM's --enable-log-requests: sizes and settings, never prompt text
                log.info("request %s: %s, model %s, tenant %s, %d prompt(s) %s, params %s", messages[0].request_id,
                         "chat" if spec.route == CHAT else "completion", spec.model, found[1].name if found else "-",
                         len(messages), [_prompt_size(m) for m in messages], _params_summary(messages[0].params))
            messages = [msgspec.structs.replace(m, render=msgspec.structs.replace(spec, first_choice=i * n)
                                                if renderer is None else None,
                                                **self._tenant_fields(shared, m.cache_salt))
                        for i, m in enumerate(messages)]
            ticket = self.state.pool.submit(messages, self._engine_tokenizers())
            timeout = self.state.config.request_timeout
            gen = Generation(ticket, n, started_at, self.state.metrics, renderer or renderer_for(spec),
                             spec.stream or renderer is not None,
                             deadline=started_at + timeout if timeout > 0 else None)
            inspector = self.state.console_requests
            record = inspector.start(gen.renderer.route_name, messages, spec.stream,
                                     started_at) if inspector is not None else None
            try:
                try:
                    await gen.accept()  # a refused prompt still gets a plain HTTP error, even when streaming
                except PagodaError as exc:
                    _name_constraint(exc, constraint)
                    raise
                self._charge(lease, gen)  # the prompt, at once: a long request's tokens count while it runs
                if spec.stream:
                    # the status line went out as 200; a stream that then ends in an error event is counted and
                    # logged with that error's status, as the same request unstreamed would be
                    response, status = await self._stream(request, gen, headers, lease)
                else:
                    while not gen.finished:
                        await gen.next_batch()
                        self._charge(lease, gen)
                    gen.observe_e2e()
                    response = json_response(gen.body(), headers=headers)
                    status = response.status
                return response
            except Exception as exc:
                gen.error = exc.message if isinstance(exc, PagodaError) else "internal server error"
                raise
            finally:
                # Runs on success, on error and on cancellation (the client hung up): whatever still runs is
                # aborted.
                self.state.pool.finish(ticket, gen.unfinished_request_ids())
                self.state.metrics.vllm_finished(gen, messages[0].params.max_tokens)
                if inspector is not None and record is not None:
                    _log_finished(inspector, record, gen)
        except PagodaError as exc:
            status = exc.http_status
            raise
        except Exception:
            status = 500
            raise
        finally:
            self._account(found, lease, gen, spec, status, arrival, started_at, messages[0].params.beam_width,
                          messages[0].params.max_tokens)

    def _scheduled_tenant(self, found: tuple[str, Tenant] | None) -> Tenant | None:
        """The tenant whose share of the engine the request runs in. The operator's key is tenant "default": beside a
        keys file that defines one, with that tenant's weight and tier (the scheduler's record of a tenant follows its
        latest request, so the operator's own weight 1 and tier 0 would rewrite them), though none of its quotas."""
        if found is DEFAULT_TENANT and self.state.keys is not None:
            return self.state.keys.tenant(DEFAULT_TENANT[1].name) or DEFAULT_TENANT[1]
        return found[1] if found is not None else None

    def _tenant_fields(self, tenant: Tenant | None, cache_salt: str) -> dict[str, Any]:
        """What a request carries of its tenant: its name, weight and tier for the scheduler's fair share and, with
        --prefix-cache-isolation tenant, a cache salt of its own (the client's salt within it)."""
        if tenant is None:
            return {}
        fields: dict[str, Any] = {"tenant": tenant.name, "tenant_weight": tenant.weight,
                                  "tenant_priority": tenant.priority}
        if self.state.config.prefix_cache_isolation == "tenant":
            fields["cache_salt"] = tenant_cache_salt(tenant.name, cache_salt)
        return fields

    def _admit(self, tenant: Tenant | None) -> Lease | None:
        if tenant is None:
            return None
        try:
            return self.state.gate.admit(tenant, time.monotonic())
        except RateLimitError as exc:
            self.state.metrics.tenant_rejected(tenant.name, exc.error_type if exc.code == "rate_limit_exceeded"
                                               else "concurrency")
            raise

    def _charge(self, lease: Lease | None, gen: Generation) -> None:
        """Charge the tenant's tokens_per_minute the tokens its request has used so far (per batch: nothing to do
        for a tenant without that quota, whose whole count release() takes at the end)."""
        if lease is not None and lease.tenant.tokens_per_minute:
            self.state.gate.charge(lease, gen.prompt_tokens + gen.completion_tokens, time.monotonic())

    def _account(self, found: tuple[str, Tenant] | None, lease: Lease | None, gen: Generation | None,
                 spec: RenderSpec, status: int, arrival: float, started_at: float, beam_width: int = 0,
                 max_tokens: int | None = None) -> None:
        """A finished generation request: its tokens charged to its tenant, counted, and logged for billing.
        `beam_width` and `max_tokens`: a beam search's, which charge what its beams ran (or could run, when cut)."""
        prompt_tokens = gen.prompt_tokens if gen is not None else 0
        completion_tokens = gen.completion_tokens if gen is not None else 0
        if gen is not None and gen.failed_upstream and completion_tokens == 0:
            # the engine refused it (overloaded, a check of the scheduler's) or failed before any output came back:
            # nothing to bill, and its prompt's charge, taken once the tokenizer accepted it, is given back
            charged_tokens = 0
        elif gen is not None and beam_width > 0:  # n == best_of too: its hypotheses come back only at the end
            stats = self.state.stats.latest
            charged_tokens = prompt_tokens + _beam_tokens(gen, beam_width, max_tokens,
                                                          stats.max_model_len if stats is not None else 0)
        else:
            charged_tokens = prompt_tokens + completion_tokens
        now = time.monotonic()
        if lease is not None:
            self.state.gate.release(lease, charged_tokens, now)
        first_token_s = gen.first_token_at - started_at if gen is not None and gen.first_token_at else None
        if found is not None:
            self.state.metrics.tenant_finished(found[1].name, status, prompt_tokens, completion_tokens,
                                               first_token_s)
        if self.state.usage_log is not None:
            self.state.usage_log.write({
                "tenant": found[1].name if found is not None else "", "key_id": found[0] if found else "",
                "request_id": spec.response_id, "model": spec.model, "status": status,
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "cached_tokens": gen.cached_tokens if gen is not None else 0, "charged_tokens": charged_tokens,
                "arrival_time": arrival,
                "first_token_s": None if first_token_s is None else round(first_token_s, 6),
                "duration_s": round(now - started_at, 6), "end_time": time.time()})

    async def _stream(self, request: web.Request, gen: Generation, headers: dict[str, str],
                      lease: Lease | None = None) -> tuple[web.StreamResponse, int]:
        """The streamed answer, and the status it ended with: 200, the status of the error its last event carries,
        or 499 when the client left."""
        response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        status = 200
        try:
            await response.prepare(request)
            try:
                await response.write(gen.opening())
                while not gen.finished:
                    data = await gen.next_batch()
                    self._charge(lease, gen)
                    if data:
                        await response.write(data)
                gen.observe_e2e()
                await response.write(gen.closing())
            except Exception as exc:
                # The status line is sent already: the error travels as an event, then the stream ends.
                if not isinstance(exc, PagodaError):
                    if isinstance(exc, ConnectionResetError):
                        raise
                    log.exception("stream %s failed", gen.ticket.request_ids[0])
                    exc = PagodaError("internal server error")
                gen.error = exc.message
                status = exc.http_status
                await response.write(gen.renderer.stream_error(exc.to_dict()))
        except ConnectionResetError:
            log.info("client left stream %s", gen.ticket.request_ids[0])  # the caller's finally aborts it
            status = 499
        return response, status

    # ------------------------------------------------------------------ tokenizer utilities

    async def _ask(self, message: TokenizeRequest | DetokenizeRequest | TokenizerInfoRequest) -> Reply:
        ticket = self.state.pool.submit([message], self._engine_tokenizers())
        try:
            reply = await ticket.queue.get()
        finally:
            self.state.pool.finish(ticket, [])  # nothing to abort: the tokenizer answers these at once
        if isinstance(reply, RequestFailed):
            raise UpstreamError.from_failed(reply)
        return reply

    async def _count_prompt_tokens(self, prompt: GenerateRequest) -> int:
        """How many tokens a chat request's prompt renders to, as generation renders it (the count_tokens routes of
        the Messages and Responses APIs)."""
        reply = await self._ask(TokenizeRequest(
            prompt.request_id, messages=prompt.messages, add_special_tokens=prompt.add_special_tokens,
            add_generation_prompt=prompt.add_generation_prompt, continue_final_message=prompt.continue_final_message,
            tools=prompt.tools, chat_template_kwargs=prompt.chat_template_kwargs, tool_parser=prompt.tool_parser,
            documents=prompt.documents, chat_template=prompt.chat_template))
        assert isinstance(reply, TokenizeResult), type(reply).__name__
        return len(reply.token_ids)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._read(request, TokenizeBody)
        self._check_model(body.model, request)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        request_id = f"tokenize-{uuid.uuid4().hex}"
        continue_final = bool(body.continue_final_message)
        if continue_final and body.messages is None:
            raise InvalidRequestError("continue_final_message needs messages", param="continue_final_message")
        if continue_final and body.add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                      param="continue_final_message")
        want_strs = bool(body.return_token_strs)
        tools = tokenize_tools(body)
        if body.chat_template_kwargs is not None and body.messages is None:
            raise InvalidRequestError("chat_template_kwargs needs messages", param="chat_template_kwargs")
        if body.chat_template is not None and body.messages is None:
            raise InvalidRequestError("chat_template needs messages", param="chat_template")
        self._check_request_template(body.chat_template)
        if body.messages is not None:
            messages = chat_messages(body.messages)
            if continue_final and messages[-1].role != "assistant":
                raise InvalidRequestError("continue_final_message needs an assistant message last",
                                          param="continue_final_message")
            # chat templates carry their own BOS; adding one more would double it
            add_generation_prompt = not continue_final if body.add_generation_prompt is None \
                else body.add_generation_prompt
            message = TokenizeRequest(request_id, messages=messages,
                                      add_special_tokens=bool(body.add_special_tokens),
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final, return_token_strs=want_strs,
                                      tools=tools, chat_template_kwargs=body.chat_template_kwargs or {},
                                      tool_parser=self._tool_parser(), chat_template=body.chat_template or "")
        else:
            message = TokenizeRequest(request_id, prompt_text=body.prompt,
                                      add_special_tokens=body.add_special_tokens is not False,
                                      return_token_strs=want_strs)
        reply = await self._ask(message)
        if not isinstance(reply, TokenizeResult):
            raise UpstreamError(502, f"unexpected reply {type(reply).__name__}", "server_error")
        # vLLM's shape: token_strs is null unless asked (its clients read the key)
        return json_response({"tokens": reply.token_ids, "count": len(reply.token_ids),
                              "max_model_len": reply.max_model_len,
                              "token_strs": reply.token_strs if want_strs else None})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._read(request, DetokenizeBody)
        self._check_model(body.model, request)
        if any(not 0 <= t <= MAX_INT32 for t in body.tokens):
            raise InvalidRequestError(f"token ids must be integers in [0, {MAX_INT32}]", param="tokens")
        reply = await self._ask(DetokenizeRequest(f"detokenize-{uuid.uuid4().hex}", body.tokens))
        if not isinstance(reply, DetokenizeResult):
            raise UpstreamError(502, f"unexpected reply {type(reply).__name__}", "server_error")
        return json_response({"prompt": reply.text})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's /tokenizer_info: the tokenizer's configuration, as the tokenizer process loaded it."""
        self._check_model(None, request)  # a tenant that may not use the model reads nothing of it (404, as /tokenize)
        reply = await self._ask(TokenizerInfoRequest(f"tokenizer-info-{uuid.uuid4().hex}"))
        if not isinstance(reply, TokenizerInfoResult):
            raise UpstreamError(502, f"unexpected reply {type(reply).__name__}", "server_error")
        return web.Response(body=reply.info, content_type="application/json")

    # ------------------------------------------------------------------ vLLM's service routes

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": VERSION})

    async def load(self, request: web.Request) -> web.Response:
        """vLLM's /load: requests this api process is serving now (vLLM's server_load_metrics)."""
        return json_response({"server_load": self.state.pool.num_open})

    async def ping(self, request: web.Request) -> web.Response:
        """SageMaker's health check (vLLM's /ping): /health's answer."""
        return await self.health(request)

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's one route (vLLM's /invocations): a body with messages is a chat completion, one with a
        prompt a completion."""
        body = decode_body(await self._body(request), dict[str, msgspec.Raw])  # the route's handler checks the rest
        if "messages" in body:
            return await self.chat_completions(request)
        if "prompt" in body:
            return await self.completions(request)
        raise InvalidRequestError("Cannot find suitable handler for request: /invocations takes a chat completion "
                                  "(messages) or a completion (prompt)", param="messages")

    # ------------------------------------------------------------------ state

    def _model_card(self, name: str | None = None) -> dict[str, Any]:
        stats = self.state.stats.latest
        max_model_len = stats.max_model_len if stats is not None and stats.max_model_len > 0 else None
        state = self.state
        name = name or state.served_model_name
        permission = {"id": f"modelperm-{name}", "object": "model_permission",
                      "created": state.started, "allow_create_engine": False, "allow_sampling": True,
                      "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                      "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
        return {"id": name, "object": "model", "created": state.started, "owned_by": "pagoda",
                "root": state.model_root, "parent": None, "max_model_len": max_model_len, "permission": [permission]}

    async def models(self, request: web.Request) -> web.Response:
        allowed = self._allowed_names(request_tenant(request))
        names = self.state.served_names or (self.state.served_model_name,)  # vLLM: a card per --served-model-name
        return json_response({"object": "list", "data": [self._model_card(n) for n in names if n in allowed]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the SDK's models.retrieve; 404 for a name this server does not serve."""
        name = request.match_info["model_id"]
        self._check_model(name, request)
        return json_response(self._model_card(name if name in self.state.served_names else None))

    async def health(self, request: web.Request) -> web.Response:
        problems = self.health_problems()
        if problems:
            return json_response({"status": "unavailable", "problems": problems}, status=503)
        down = self.state.stats.down()  # engine replicas not serving (several replicas: the others do)
        return json_response({"status": "ok", "replicas_down": down} if down else {"status": "ok"})

    def health_problems(self) -> list[str]:
        state = self.state
        problems = []
        if state.shutting_down:
            problems.append("the server is shutting down")
        if state.pool.num_live == 0:
            problems.append("no live tokenizer process")
        elif state.stats.latest is not None and state.pool.num_registered(self._engine_tokenizers()) == 0:
            # One the api knows but the scheduler does not (yet, or since it restarted) would hold a request
            # until it registers, or fail it: not ready. It registers on its hello, and gets ModelInfo with it.
            problems.append("no live tokenizer process is registered with the scheduler")
        age = state.stats.age()
        if age is None:
            problems.append("no scheduler stats received yet")
        elif age > state.config.heartbeat_timeout:
            problems.append(f"the scheduler's latest stats are {age:.1f} s old")
        stats = state.stats.latest
        if stats is not None and stats.problem:
            problems.append(stats.problem)
        elif stats is not None and not stats.worker_alive:
            problems.append("the worker is not alive")
        if stats is not None and not stats.worker_ready:
            problems.append("the worker is not ready")
        return problems

    def _engine_tokenizers(self) -> frozenset[str]:
        """The tokenizers the scheduler (any serving replica) has registered, as of its latest stats."""
        stats = self.state.stats.latest
        return frozenset(stats.tokenizer_ids) if stats is not None else frozenset()

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.state.metrics.render(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})


def request_tenant(request: web.Request) -> Tenant | None:
    """The tenant (API key) a request was let in as; None without API keys."""
    found = request.get(TENANT)
    return found[1] if found is not None else None


def _log_finished(inspector: RequestLog, record: RequestRecord, gen: Generation) -> None:
    inspector.finish(record, finished=gen.finished, error=gen.error, tokenized_mono=gen.accepted_at,
                first_token_mono=gen.first_token_at, prompt_tokens=gen.prompt_tokens,
                completion_tokens=gen.completion_tokens, cached_tokens=gen.cached_tokens,
                finish_reasons=[c.finish_reason for c in gen.choices])


def _beam_tokens(gen: Generation, beam_width: int, max_tokens: int | None, max_model_len: int) -> int:
    """The completion tokens a beam search ran, for its tenant's tokens_per_minute: each prompt's beam_width beams
    (best_of) for as many steps as its longest returned hypothesis, not only the n hypotheses its usage reports (a
    tenant sending best_of 128, n 1 would otherwise pay for 1/128th of what it runs). A prompt whose search was cut
    (the client left, a timeout) returned no hypotheses, though its beams ran: it is charged its budget,
    beam_width x max_tokens (or the context left after its prompt), else leaving just before the end would make
    any search free."""
    total = 0
    for i, num_prompt_tokens in enumerate(gen.num_prompt_tokens):
        choices = gen.choices[i * gen.n:(i + 1) * gen.n]
        if all(c.finish_reason >= 0 for c in choices):
            total += beam_width * max(c.num_tokens for c in choices)
        elif num_prompt_tokens > 0:  # admitted, then cut before its hypotheses came back
            total += beam_width * (max_tokens if max_tokens is not None else max(0, max_model_len - num_prompt_tokens))
    return total


def _prompt_size(message: GenerateRequest) -> str:
    """A prompt's size for the request log: its token ids, characters or chat messages (never its text)."""
    if message.prompt_token_ids is not None:
        return f"{len(message.prompt_token_ids)} ids"
    if message.prompt_text is not None:
        return f"{len(message.prompt_text)} chars"
    return f"{len(message.messages or [])} messages"


def _client_response_id(prefix: str, request: web.Request, body_id: str | None) -> str:
    """vLLM's id for a response the client named: `prefix` + the X-Request-Id header, else + the body's request_id;
    "" when it named none. Only the response shows it: the engine's own id stays unique."""
    header = request.headers.get("X-Request-Id")
    if header is not None:
        if not _is_utf8(header):
            raise InvalidRequestError("X-Request-Id must be UTF-8 text", param="X-Request-Id")
        return prefix + check_client_request_id(header, "X-Request-Id")
    return prefix + check_client_request_id(body_id, "request_id") if body_id is not None else ""


def _is_utf8(header_value: str) -> bool:
    """aiohttp hands a header's bytes that are not UTF-8 over as surrogates (surrogateescape), which no wire
    message can carry."""
    try:
        header_value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
