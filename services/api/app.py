"""The aiohttp application: routes, API-key check, and JSON error bodies for every failure."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid

from aiohttp import HttpVersion11, web
from aiohttp.typedefs import Handler, Middleware

from pagoda.services.api.anthropic import MessagesRoutes, anthropic_middleware
from pagoda.services.api.console.routes import API_PREFIX as CONSOLE_API_PREFIX
from pagoda.services.api.console.routes import Console
from pagoda.services.api.errors import AuthenticationError, RateLimitError, UnsupportedMediaTypeError
from pagoda.services.api.handlers import COUNTED, DEFAULT_TENANT, TENANT, ApiState, Handlers, json_response
from pagoda.services.api.metrics import ApiMetrics
from pagoda.services.api.responses import ResponsesRoutes
from pagoda.services.api.tenants import Tenant
from pagoda.services.protocol.render import error_body
from pagoda.services.protocol.vllm import UNSUPPORTED_ROUTES
from pagoda.shared.config import ServerConfig, parse_list
from pagoda.shared.errors import PagodaError

log = logging.getLogger(__name__)

# Large enough for a long prompt as token ids in JSON, small enough that its wire message fits a frame.
MAX_BODY_BYTES = 32 << 20
# /health, /ping, /version, /load and the console's page and scripts stay open (probes and load balancers ask them;
# they tell nothing of any tenant); the console's data needs the key. /metrics is open unless --metrics-access
# says key, the default beside a keys file: its series name every tenant (docs/security.md)
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info", "/invocations", "/inference/",
                      CONSOLE_API_PREFIX)
METRICS_PATH = "/metrics"
RETRY_AFTER_S = "1"
# the routes whose POSTs are generation requests, counted per tenant by status (docs/tenants.md)
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                              "/invocations", "/inference/v1/generate"})
# the routes that make the (shared) tokenizers work without generating: each takes one of a tenant's
# requests_per_minute, as a generation request does (docs/tenants.md)
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info", "/v1/messages/count_tokens",
                             "/v1/responses/input_tokens", "/v1/chat/completions/render", "/v1/completions/render"})
CORS_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")  # what --allowed-methods '*' allows
CLIENT_CLOSED_STATUS = 499  # counted for a client that hung up before its answer (nginx's code, as the tenants' metric)


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """--enable-request-id-headers (vLLM's): the response carries the request's X-Request-Id, else a fresh one."""
    response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex


def build_app(state: ApiState) -> web.Application:
    handlers = Handlers(state)
    responses = ResponsesRoutes(handlers)
    stored = responses.store is not None  # --responses-store: the routes that read a response back serve it
    messages = MessagesRoutes(handlers)
    # anthropic_middleware: Anthropic's error shape and x-api-key under /v1/messages (auth runs inside it)
    config = state.config
    front: list[Middleware] = [root_path_middleware(config.root_path)] if config.root_path else []
    cors = Cors(config) if config.allowed_origins else None
    if cors is not None:  # a browser's preflight carries no key: answered before the key check
        front.append(cors.preflight)
    app = web.Application(middlewares=[*front, error_middleware(state.metrics), anthropic_middleware,
                                       auth_middleware(state), body_size_middleware, content_type_middleware],
                          client_max_size=MAX_BODY_BYTES)
    if cors is not None:
        app.on_response_prepare.append(cors.add_headers)  # before the headers go: streamed answers get them too
    if config.enable_request_id_headers:
        app.on_response_prepare.append(add_request_id_header)
    if responses.background is not None:  # at shutdown, after the drain: no background response left in_progress
        app.on_shutdown.append(responses.background.close)
    app.add_routes(_with_expect_handler([
        web.post("/v1/completions", handlers.completions),
        web.post("/v1/chat/completions", handlers.chat_completions),
        # vLLM's token-in / token-out API: an inference body rendered to the request generate takes, and generate
        web.post("/v1/completions/render", handlers.completions_render),
        web.post("/v1/chat/completions/render", handlers.chat_completions_render),
        web.post("/inference/v1/generate", handlers.generate),
        web.post("/v1/responses", responses.create),
        web.post("/v1/responses/input_tokens", responses.input_tokens),  # before {response_id}: a plain path
        # nothing is stored to read back: 404 saying so
        web.get("/v1/responses/{response_id}", responses.retrieve if stored else responses.not_stored),
        web.delete("/v1/responses/{response_id}", responses.delete if stored else responses.not_stored),
        web.post("/v1/responses/{response_id}/cancel", responses.cancel if stored else responses.not_stored),
        web.get("/v1/responses/{response_id}/input_items", responses.input_items if stored else responses.not_stored),
        web.post("/v1/messages", messages.create),
        web.post("/v1/messages/count_tokens", messages.count_tokens),
        web.get("/v1/models", handlers.models),
        web.get("/v1/models/{model_id:.+}", handlers.model),
        web.post("/tokenize", handlers.tokenize),
        web.post("/detokenize", handlers.detokenize),
        web.get("/health", handlers.health),
        web.get(METRICS_PATH, handlers.metrics),
        # vLLM's service routes (docs/vllm-compat.md)
        web.get("/tokenizer_info", handlers.tokenizer_info),
        web.get("/version", handlers.version),
        web.get("/load", handlers.load),
        web.get("/ping", handlers.ping),
        web.post("/ping", handlers.ping),
        web.post("/invocations", handlers.invocations),
    ]))
    if state.config.console:
        Console(state, handlers.health_problems).install(app)
    return app


def _with_expect_handler(routes: list[web.RouteDef]) -> list[web.RouteDef]:
    """The routes, each answering 'Expect: 100-continue' with expect_continue."""
    return [web.RouteDef(r.method, r.path, r.handler, {**r.kwargs, "expect_handler": expect_continue}) for r in routes]


def _declared_too_large(request: web.Request) -> bool:
    length = request.content_length
    return length is not None and length > MAX_BODY_BYTES


async def expect_continue(request: web.Request) -> None:
    """'Expect: 100-continue', which aiohttp answers before any middleware: a body declared past MAX_BODY_BYTES
    gets no '100 Continue' (the client would send it all to be refused), body_size_middleware answers 413; any
    other body is let come, as aiohttp's own handler does. An expectation other than 100-continue is a 417."""
    if _declared_too_large(request):
        return
    if request.headers.get("Expect", "").lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {request.headers.get('Expect')}")
    if request.version == HttpVersion11:  # HTTP/1.0 has no interim answers
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's size, for the access log, counts from its status line


def root_path_middleware(root_path: str) -> Middleware:
    """--root-path: a request under the prefix (a proxy that forwards it) is handled as the same request without
    it, from routing on, so that every check (the key, /metrics) sees the route's own path; a request without the
    prefix (a proxy that strips it) is handled as it came."""

    @web.middleware
    async def strip(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.rel_url.path
        if path != root_path and not path.startswith(root_path + "/"):
            return await handler(request)
        inner = request.clone(rel_url=request.rel_url.with_path(path[len(root_path):] or "/")
                              .with_query(request.rel_url.query))
        return await request.app._handle(inner)  # routed again: the route, its middlewares and handler

    return strip


class Cors:
    """CORS for browser pages on other origins (--allowed-origins, --allowed-methods, --allowed-headers,
    --allow-credentials; vLLM's, with its defaults of * for methods and headers)."""

    def __init__(self, config: ServerConfig) -> None:
        self.origins = frozenset(parse_list(config.allowed_origins, "allowed_origins"))
        self.methods = [m.upper() for m in parse_list(config.allowed_methods, "allowed_methods")]
        self.headers = parse_list(config.allowed_headers, "allowed_headers")
        self.credentials = config.allow_credentials

    def _allowed_origin(self, origin: str) -> str | None:
        """The Access-Control-Allow-Origin value for a request from `origin`; None if it may not call."""
        if "*" in self.origins:
            return origin if self.credentials else "*"  # credentials may not go with "*"
        return origin if origin in self.origins else None

    @web.middleware
    async def preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        method = request.headers.get("Access-Control-Request-Method")
        origin = request.headers.get("Origin")
        if request.method != "OPTIONS" or method is None or origin is None:
            return await handler(request)
        allow_origin = self._allowed_origin(origin)
        asked = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
        refused = ("origin" if allow_origin is None
                   else "method" if "*" not in self.methods and method.upper() not in self.methods
                   else "headers" if "*" not in self.headers and
                   any(h.lower() not in {x.lower() for x in self.headers} for h in asked)
                   else None)
        if refused is not None:
            return web.Response(status=400, text=f"Disallowed CORS {refused}")
        headers = {"Access-Control-Allow-Origin": allow_origin or "*", "Access-Control-Max-Age": "600",
                   "Access-Control-Allow-Methods": ", ".join(CORS_METHODS if "*" in self.methods else self.methods),
                   "Access-Control-Allow-Headers": ", ".join(asked if "*" in self.headers else self.headers),
                   "Vary": "Origin"}
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return web.Response(status=200, headers=headers)

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        allow_origin = self._allowed_origin(origin) if origin is not None else None
        if allow_origin is None or "Access-Control-Allow-Origin" in response.headers:
            return
        response.headers["Access-Control-Allow-Origin"] = allow_origin
        if allow_origin != "*":
            response.headers.add("Vary", "Origin")
        if self.credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"


def auth_middleware(state: ApiState) -> Middleware:
    """With a key (--api-key) or a keys file (--api-keys-file), /v1 routes need 'Authorization: Bearer KEY'; a
    key from the file makes the request its tenant's (request[TENANT], read by the handlers). The console's data,
    and /metrics when config.metrics_need_key(), take the operator's key (--api-key) alone: they show every tenant.
    """
    api_key = state.config.api_key
    expected = api_key.encode("utf-8", "surrogateescape") if api_key else None  # the operator's bearer token
    keys = state.keys
    metrics_need_key = state.config.metrics_need_key()
    metrics_refused = False  # logged once per process: a scraper or probe left without the key after an upgrade

    def tenant_of(request: web.Request, operator_only: bool) -> tuple[str, Tenant] | None:
        # Every Authorization header must hold the same key (a proxy may add or keep one), whatever the spelling of
        # its scheme; another scheme holds none. Header values are str with surrogates for bytes that are not
        # UTF-8: those bytes compare as themselves.
        given = [_bearer_token(value.strip().encode("utf-8", "surrogateescape"))
                 for value in request.headers.getall("Authorization", [])]
        if not given or any(token != given[0] for token in given):
            raise AuthenticationError()
        # constant time: no key guessing by timing (the file holds hashes: a lookup leaks nothing of a key)
        if expected is not None and hmac.compare_digest(given[0], expected):
            return DEFAULT_TENANT if keys is not None else None
        token = given[0].decode("utf-8", "surrogateescape")
        found = keys.lookup(token) if keys is not None and not operator_only else None
        if found is None:
            raise AuthenticationError()
        return found

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        nonlocal metrics_refused
        metrics = metrics_need_key and _is_metrics(request)
        if metrics or ((expected is not None or keys is not None) and request.path.startswith(PROTECTED_PREFIXES)):
            # the console and /metrics show every tenant's requests: the operator's key only, never a tenant's
            try:
                request[TENANT] = tenant_of(request, metrics or request.path.startswith(CONSOLE_API_PREFIX))
            except AuthenticationError:
                if metrics and not metrics_refused:
                    metrics_refused = True
                    log.warning("%s %s refused: /metrics takes the operator's key (--api-key)%s; give Prometheus "
                                "that key as its bearer token, point probes at /version or /health, or choose "
                                "--metrics-access open (docs/security.md)", request.method, request.path,
                                "" if expected is not None else ", and this server has none")
                raise
        found = request.get(TENANT)
        if found is not None and found is not DEFAULT_TENANT and request.path in TOKENIZER_PATHS:
            try:
                state.gate.admit_utility(found[1], time.monotonic())
            except RateLimitError as exc:
                state.metrics.tenant_rejected(found[1].name, exc.error_type)
                raise
        if found is None or request.method != "POST" or request.path not in GENERATION_PATHS:
            return await handler(request)
        try:
            return await handler(request)
        except (PagodaError, web.HTTPException) as exc:
            # refused before the handler's own accounting (a bad body, a model the tenant may not use, a quota):
            # pagoda_tenant_requests_total counts every answered generation request of the tenant, these too
            status = exc.http_status if isinstance(exc, PagodaError) else exc.status
            if not request.get(COUNTED) and status >= 400:
                state.metrics.tenant_finished(found[1].name, status, 0, 0, None)
            raise

    return check_key


def _is_metrics(request: web.Request) -> bool:
    """The request goes to /metrics: by the route the router matched (whatever spelling of the path reached it)."""
    resource = request.match_info.route.resource
    return request.path == METRICS_PATH or (resource is not None and resource.canonical == METRICS_PATH)


def _bearer_token(value: bytes) -> bytes:
    """The token of an Authorization value, its scheme "Bearer" in any case (RFC 9110: schemes are
    case-insensitive), for the operator's key and a tenant's alike; b"" for another scheme."""
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


@web.middleware
async def body_size_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A body whose Content-Length is past MAX_BODY_BYTES is refused (413) before any of it is read: reading it
    would take 32 MiB of it first (or wait for a client that waits for '100 Continue'). A chunked body has no
    length to check: reading it stops at the limit. A route that is not served stays a 404 or 405."""
    if _declared_too_large(request) and request.match_info.http_exception is None:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=request.content_length or 0)
    return await handler(request)


JSON_CONTENT_TYPES = ("application/json", "text/plain", "application/octet-stream")  # the last two: lenient clients


@web.middleware
async def content_type_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A body that is not JSON is refused with 415 before anything reads it (a form post is not JSON). A route
    that is not served stays a 404: the openai SDK posts multipart forms to /v1/audio/*, which a 415 telling it to
    send JSON would misdirect."""
    if (request.method == "POST" and request.headers.get("Content-Type")
            and request.match_info.http_exception is None):
        media_type = request.content_type.lower()
        if media_type not in JSON_CONTENT_TYPES and not media_type.endswith("+json"):
            raise UnsupportedMediaTypeError(media_type)
    return await handler(request)


def _client_gone(request: web.Request) -> bool:
    """The HTTP connection is closed or closing: the peer left (what aiohttp's ConnectionResetError then means)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def _error_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_middleware(metrics: ApiMetrics) -> Middleware:
    @web.middleware
    async def to_json(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except asyncio.CancelledError:
            if _client_gone(request):  # aiohttp cancels the handler of a client that left (handler_cancellation)
                metrics.http_requests.labels(_route_label(request), str(CLIENT_CLOSED_STATUS)).inc()
            raise
        except PagodaError as exc:
            response = json_response(exc.to_dict(), status=exc.http_status)
            if isinstance(exc, RateLimitError):
                response.headers["Retry-After"] = str(exc.retry_after_s)
        except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method, body too large
            reason = UNSUPPORTED_ROUTES.get(request.path) if exc.status == 404 else None
            message = f"{exc.reason}: {request.method} {request.path}" + (f" ({reason})" if reason else "")
            response = json_response(error_body(message, _error_type(exc.status)), status=exc.status)
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
        except ConnectionResetError:
            if not _client_gone(request):
                log.exception("unhandled error in %s %s", request.method, request.path)
                response = json_response(error_body("internal server error", "server_error"), status=500)
            else:
                # The client hung up before its answer (e.g. halfway through sending its body): no server error.
                log.info("the client left %s %s before its answer", request.method, request.path)
                response = json_response(error_body("the client closed the connection", "invalid_request_error"),
                                         status=CLIENT_CLOSED_STATUS)
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            response = json_response(error_body("internal server error", "server_error"), status=500)
        if response.status == 503 and "Retry-After" not in response.headers:
            response.headers["Retry-After"] = RETRY_AFTER_S  # overloaded or a process restarting: come back soon
        metrics.http_requests.labels(_route_label(request), str(response.status)).inc()
        return response

    return to_json


def _route_label(request: web.Request) -> str:
    """The request's route as a metric label: its pattern, so label values stay bounded."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"
