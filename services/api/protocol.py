"""OpenAI response shapes for the api: error bodies here; responses render in services/tokenizer/render.py
(shared with the tokenizer processes, which render the bytes of requests they serve)."""

from __future__ import annotations

from typing import Any

from pagoda.services.tokenizer.render import (  # noqa: F401 (re-exported for the api's modules)
    SSE_DONE,
    ChatRenderer,
    CompletionRenderer,
    Renderer,
    encode_json,
    sse,
)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
