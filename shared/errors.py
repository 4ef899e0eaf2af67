"""Typed errors for bad input: each names the offending parameter and maps to an HTTP status."""

from __future__ import annotations


class PagodaError(Exception):
    """Base of every error pagoda raises on purpose for a request or a setting."""

    http_status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, object]:
        """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


class InvalidRequestError(PagodaError, ValueError):
    """A request parameter is missing, of the wrong type, or out of range."""

    http_status = 400
    error_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit in the model's context."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelNotFoundError(PagodaError, FileNotFoundError):
    """The model named is neither a folder with a config.json nor a known dummy shape."""

    http_status = 404
    error_type = "not_found_error"

    def __init__(self, message: str, param: str = "model") -> None:
        super().__init__(message, param=param, code="model_not_found")


class ServerOverloadedError(PagodaError):
    """The server cannot take the request now (queue full, shutting down, a process gone)."""

    http_status = 503
    error_type = "server_error"


class ConfigError(PagodaError, ValueError):
    """A server setting (CLI flag or environment variable) is invalid."""

    http_status = 500
    error_type = "config_error"
