"""Errors only the api raises: a bad API key, and a failure reported by a tokenizer or the pool."""

from __future__ import annotations

from pagoda.shared.errors import PagodaError
from pagoda.shared.messages import RequestFailed


class AuthenticationError(PagodaError):
    http_status = 401
    error_type = "authentication_error"

    def __init__(self) -> None:
        super().__init__("Invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


class UnsupportedMediaTypeError(PagodaError):
    http_status = 415
    error_type = "invalid_request_error"

    def __init__(self, media_type: str) -> None:
        super().__init__(f"Content-Type {media_type} is not supported: send the body as application/json",
                         code="unsupported_media_type")


class RequestTimeoutError(PagodaError):
    http_status = 408
    error_type = "invalid_request_error"


class UpstreamError(PagodaError):
    """A request failed behind the api; status and type come from the failure, not the class."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.http_status = status
        self.error_type = error_type

    @classmethod
    def from_failed(cls, failed: RequestFailed) -> UpstreamError:
        return cls(failed.status, failed.message, failed.error_type, failed.param, failed.code)


class RateLimitError(PagodaError):
    """A tenant's quota is used up: 429 with Retry-After. `kind` is OpenAI's error type for it: requests or
    tokens."""

    http_status = 429

    def __init__(self, message: str, kind: str, retry_after_s: int, code: str = "rate_limit_exceeded") -> None:
        super().__init__(message, code=code)
        self.error_type = kind
        self.retry_after_s = max(1, retry_after_s)
