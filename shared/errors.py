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

    @classmethod
    def prompt_too_long(cls, num_tokens: int, param: str, max_model_len: int,
                        max_num_tokens: int) -> ContextLengthError:
        """A prompt that leaves no token to generate within the context or, where smaller, the KV cache
        (`max_num_tokens`: the most tokens of one sequence it holds); vLLM's words and numbers."""
        max_len = min(max_model_len, max_num_tokens) - 1
        return cls(f"{_context_phrase(max_model_len, max_num_tokens)}. However, your request has {num_tokens} "
                   f"input tokens ({param}); at most {max_len} fit, leaving one to generate. Please reduce the "
                   "length of the input (truncate_prompt_tokens: -1 keeps what fits).", param=param)

    @classmethod
    def max_tokens_too_large(cls, num_tokens: int, max_tokens: int, max_model_len: int,
                             max_num_tokens: int) -> ContextLengthError:
        """A prompt plus max_tokens past the context or, where smaller, the KV cache; vLLM's words and numbers."""
        limit = min(max_model_len, max_num_tokens)
        return cls(f"max_tokens is too large: {max_tokens}. {_context_phrase(max_model_len, max_num_tokens)} and "
                   f"your request has {num_tokens} input tokens ({max_tokens} > {limit} - {num_tokens}).",
                   param="max_tokens")


def min_tokens_past_room(min_tokens: int, num_tokens: int, limit: int) -> InvalidRequestError:
    """A min_tokens above what an unset max_tokens becomes, the room the context (`limit`: or the KV cache) leaves
    after the prompt; vLLM fills max_tokens so and refuses min_tokens > max_tokens."""
    return InvalidRequestError(f"min_tokens must not exceed max_tokens: min_tokens={min_tokens}, and an unset "
                               f"max_tokens is the {limit - num_tokens} tokens the context of {limit} leaves after "
                               f"{num_tokens} prompt tokens", param="min_tokens")


def _context_phrase(max_model_len: int, max_num_tokens: int) -> str:
    """vLLM's opening words, which clients match to tell a context overflow from other 400s (LiteLLM maps
    "This model's maximum context length is" to ContextWindowExceededError), and the KV cache where it binds."""
    phrase = f"This model's maximum context length is {max_model_len} tokens"
    if max_num_tokens < max_model_len:
        phrase += f" (this server's KV cache holds at most {max_num_tokens} tokens of one sequence)"
    return phrase


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
