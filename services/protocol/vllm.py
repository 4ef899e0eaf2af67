"""vLLM's extensions to the OpenAI API that pagoda answers in vLLM's own way: request-level structured-output
backends, deprecated fields (accepted, reported in a response header and the log), and the fields and routes it
refuses, each with its reason. docs/vllm-compat.md is the table of all of them; tests/test_vllm_compat.py checks
the table against a running server."""

from __future__ import annotations

import logging

from pagoda.shared.errors import InvalidRequestError

log = logging.getLogger(__name__)

# vLLM's structured-output backends pagoda serves with its one grammar engine (llguidance): each constrains the
# output to the same language (the schema, regex, choices or grammar). A grammar is served under every name, as
# vLLM V0 did (outlines took grammars, lm-format-enforcer fell back to outlines for them); V1's outlines and
# lm-format-enforcer backends refuse grammars, a limitation of theirs that no client relies on.
GUIDED_BACKENDS = ("auto", "guidance", "llguidance", "xgrammar", "outlines", "lm-format-enforcer")
# vLLM's "backend:option,option" suffixes: it never falls back to another engine (no-fallback holds either way), and
# disable-any-whitespace is StructuredOutputs.disable_any_whitespace (compact JSON)
BACKEND_OPTIONS = ("no-fallback", "disable-any-whitespace")

# Fields vLLM has deprecated that pagoda still takes: field -> what replaces it. They are named in a `Warning`
# response header (RFC 9111 code 299) and logged once per process.
DEPRECATED_FIELDS = {
    "guided_json": "structured_outputs.json or response_format",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "structural_tag": "structured_outputs.structural_tag or response_format {\"type\": \"structural_tag\"}",
    "guided_decoding_backend": "nothing: the server chooses the backend (vLLM V1 refuses request-level backends)",
}

# vLLM request fields pagoda refuses (400), with the reason the error message gives.
UNSUPPORTED_FIELDS = {
    "suffix": "fill-in-the-middle prompts are not implemented",
    "watermarking": "output watermarking is not implemented",
    "prompt_embeds": "prompt embeddings are not accepted: prompts are text or token ids",
    "session_id": "sessions are not tracked",
    "routed_experts_prompt_start": "routed-expert data is not returned",
    "return_token_offsets": "token offsets of the rendered prompt are not made",
    "return_prompt_text": "the rendered prompt is not returned; use /tokenize with return_token_strs",
    "return_mm_kwargs": "multimodal inputs are not accepted",
    "kv_transfer_params": "disaggregated prefill (KV transfer) is not implemented",
    "ec_transfer_params": "encoder-cache transfer is not implemented",
    "vllm_xargs": "custom extension arguments are not accepted",
    "media_io_kwargs": "multimodal inputs are not accepted",
    "mm_processor_kwargs": "multimodal inputs are not accepted",
    "logits_processors": "per-request logits processors were removed in vLLM V1 and are not implemented",
    "guided_whitespace_pattern": "vLLM deprecated this field: give structured_outputs' whitespace_pattern",
}

# Why the routes that read a stored response back answer 404 (POST /v1/responses takes `store` and keeps nothing).
RESPONSES_NOT_STORED = ("responses are not stored here (store is accepted, nothing is kept after the answer; "
                        "the server keeps them with --responses-store N)")

# vLLM routes pagoda does not serve: path -> reason (answered 404 with it).
UNSUPPORTED_ROUTES = {
    "/v1/responses/{response_id}": RESPONSES_NOT_STORED,
    "/v1/responses/{response_id}/cancel": RESPONSES_NOT_STORED,
    "/v1/embeddings": "pagoda serves generative models only",
    "/pooling": "pagoda serves generative models only",
    "/classify": "pagoda serves generative models only",
    "/score": "pagoda serves generative models only",
    "/v1/score": "pagoda serves generative models only",
    "/rerank": "pagoda serves generative models only",
    "/v1/rerank": "pagoda serves generative models only",
    "/v2/rerank": "pagoda serves generative models only",
    "/v1/audio/transcriptions": "audio models are not served",
    "/v1/audio/translations": "audio models are not served",
    "/v1/load_lora_adapter": "LoRA adapters are not implemented",
    "/v1/unload_lora_adapter": "LoRA adapters are not implemented",
    "/server_info": "a development route of vLLM (VLLM_SERVER_DEV_MODE)",
    "/reset_prefix_cache": "a development route of vLLM (VLLM_SERVER_DEV_MODE)",
    "/sleep": "a development route of vLLM (VLLM_SERVER_DEV_MODE)",
    "/wake_up": "a development route of vLLM (VLLM_SERVER_DEV_MODE)",
    "/is_sleeping": "a development route of vLLM (VLLM_SERVER_DEV_MODE)",
    "/collective_rpc": "a development route of vLLM (VLLM_SERVER_DEV_MODE)",
    "/start_profile": "profiling routes are not served; see bench/",
    "/stop_profile": "profiling routes are not served; see bench/",
    "/scale_elastic_ep": "elastic expert parallelism is not implemented",
    "/is_scaling_elastic_ep": "elastic expert parallelism is not implemented",
}

_logged: set[str] = set()


def check_guided_backend(backend: str) -> None:
    """vLLM's `guided_decoding_backend` ("name" or "name:option,option"): a name pagoda's grammar engine stands
    for is accepted, with options that hold here; anything else is an InvalidRequestError naming what exists."""
    name, _, options = backend.partition(":")
    if name not in GUIDED_BACKENDS:
        raise InvalidRequestError(f"guided_decoding_backend {name!r} does not exist here; the backends are "
                                  f"{', '.join(GUIDED_BACKENDS)} (all served by llguidance)",
                                  param="guided_decoding_backend")
    unknown = [option for option in options.split(",") if option and option not in BACKEND_OPTIONS]
    if unknown:
        raise InvalidRequestError(f"guided_decoding_backend option(s) {', '.join(unknown)} are not supported; "
                                  f"the options are {', '.join(BACKEND_OPTIONS)}", param="guided_decoding_backend")


def backend_disables_whitespace(backend: str) -> bool:
    """Whether a `guided_decoding_backend` (checked) carries the disable-any-whitespace option."""
    return "disable-any-whitespace" in backend.partition(":")[2].split(",")


def deprecation_header(fields: list[str]) -> str:
    """The `Warning` header naming deprecated fields a request used; each is logged once per process."""
    for name in fields:
        if name not in _logged:
            _logged.add(name)
            log.warning("a client sent %s, which vLLM deprecated; use %s", name, DEPRECATED_FIELDS[name])
    text = "; ".join(f"{name} is deprecated, use {DEPRECATED_FIELDS[name]}" for name in fields)
    return f'299 pagoda "{text}"'


def unsupported_reason(field: str) -> str:
    """Why a refused vLLM field is refused ("" for a field pagoda has never heard of)."""
    reason = UNSUPPORTED_FIELDS.get(field.rsplit(".", 1)[-1])
    return f": {reason}" if reason else ""
