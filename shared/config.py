"""The one place that reads settings: CLI flags, keyword arguments and PAGODA_* environment variables."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import ipaddress
import json
import logging
import math
import os
import re
import types
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from pagoda.shared.errors import ConfigError

ENV_PREFIX = "PAGODA_"
DEFAULT_MODEL_DIR = "models/smollm2-135m-instruct"
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names for two of them
DEVICE_PATTERN = r"auto|cpu|cuda(:[0-9]+)?"  # --device: what the worker runs on (auto: cuda when present)
# --tp-init-address: torch.distributed's init_method (its other schemes, file:// and env://, work too)
TP_INIT_PATTERN = r"tcp://([^\s/:\[\]]+|\[[0-9a-fA-F:.]+\]):[0-9]+|file://\S+|env://"
LOAD_FORMATS = ("auto", "dummy")
LOAD_FORMAT_ALIASES = {"safetensors": "auto"}  # vLLM's name for what auto loads here (pagoda reads safetensors only)
# fp8: e4m3 weights, per-output-channel scales, dynamic per-token activation scales; fp8_block: scales per row and
# 128 columns, activations per token and 128 columns (the layout and GEMM of 128x128 block-wise checkpoints)
QUANTIZATIONS = ("fp8", "fp8_block")
ROUTINGS = ("prefix", "round_robin", "random")  # how tokenizers pick an engine replica for a request
PREFIX_CACHE_ISOLATIONS = ("shared", "tenant")  # whose requests may share prefix-cache blocks
# who may read /metrics: open (anyone who reaches the port), key (the operator's --api-key only: the series name
# every tenant), auto (key beside --api-keys-file, open without one)
METRICS_ACCESSES = ("auto", "open", "key")
# --tool-call-parser's names (vLLM's), read by services/protocol/tools.parse_tool_calls
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "deepseek_v3", "deepseek_v31", "qwen3_coder", "glm45",
                     "glm47")
# vLLM's reasoning parser names that pagoda reads with one of its own (GLM-4.5's <think> block opens the output, or
# the template closes an empty one in the prompt when thinking is off: qwen3's rules)
REASONING_PARSER_ALIASES = {"glm45": "qwen3"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the model dtype; fp8 = fp8_e4m3 with per-layer scales
MAX_STREAM_INTERVAL = 2**31 - 1  # --stream-interval's bound, a request's stream_interval's (messages.MAX_INT32)


@dataclass(slots=True)
class EngineConfig:
    """Everything the scheduler and the worker need to run one model replica."""

    model: str = DEFAULT_MODEL_DIR  # a Hugging Face folder, or a dummy shape name (load_format=dummy)
    tokenizer: str | None = None  # defaults to the model folder
    # vLLM's --chat-template: a Jinja file, or the template itself, that renders chats instead of the tokenizer's
    chat_template: str | None = None
    # where requests' sampling defaults come from (vLLM's --generation-config): auto: the model folder's
    # generation_config.json; vllm: none (SamplingParams' own); else a folder holding a generation_config.json
    generation_config: str = "auto"
    # vLLM's --override-generation-config: a JSON object of generation config keys set over (null: unset) what
    # generation_config gives, e.g. {"temperature": 0.5}; checked here, applied by generation_overrides' readers
    override_generation_config: str | None = None
    load_format: str = "auto"  # auto: safetensors from the folder; dummy: random weights for a shape
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when present, else cpu
    seed: int = 0  # dummy weights derive from it (a request without a seed draws fresh randomness)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: a fraction of device memory
    gpu_memory_utilization: float = 0.90  # fraction of device memory the worker may use on CUDA
    num_kv_blocks: int | None = None  # overrides both memory settings (tests, benchmarks)
    # GiB of host memory per worker rank for preempted sequences' KV blocks, copied out and back instead of being
    # recomputed (vLLM's --swap-space); None: DEFAULT_SWAP_GIB on CUDA (at most an eighth of the free RAM shared
    # by the host's GPUs) for models whose K/V copy beats their recompute (model_runner.swap_pays), none on CPU;
    # 0: always recompute
    swap_space: float | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192 on CUDA (16384 offline), 2048 on CPU
    enforce_eager: bool = False  # True: no CUDA graphs
    tensor_parallel_size: int = 1
    tp_init_address: str | None = None  # tcp://host:port where the ranks meet (torch.distributed); None: local
    quantization: str | None = None  # fp8: quantize linear weights at load; FP8 checkpoints are detected anyway
    kv_cache_dtype: str = "auto"  # fp8: e4m3 KV cache (per-layer K and V scales), twice the blocks per byte
    kv_scale_calibration: bool = False  # fp8 KV without checkpoint scales: set them from the first prefill's amax
    async_scheduling: bool | None = None  # plan step N+1 while step N runs; None: on for CUDA, off for CPU
    grammar_process: bool | None = None  # grammar matchers and masks in a process of their own; None: see below
    grammar_fast_forward: bool = True  # the tokens a grammar forces at its start join the prefill (no step each)

    def __post_init__(self) -> None:
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES} (or {', '.join(DTYPE_ALIASES)}), got {self.dtype!r}",
                              param="dtype")
        if not self.generation_config:
            raise ConfigError("generation_config must be 'auto', 'vllm' or a folder", param="generation_config")
        self.generation_overrides()  # a bad JSON text fails here, before any process starts
        if not re.fullmatch(DEVICE_PATTERN, self.device):  # torch's own error came from the worker, once started
            raise ConfigError(f"--device {self.device!r}: pagoda runs on auto (cuda when present, else cpu), cpu, "
                              "cuda or cuda:N", param="device")
        if self.tp_init_address is not None and not re.fullmatch(TP_INIT_PATTERN, self.tp_init_address):
            raise ConfigError(f"tp_init_address {self.tp_init_address!r} is no address torch.distributed meets at "
                              "(tcp://HOST:PORT)", param="tp_init_address")
        self.load_format = LOAD_FORMAT_ALIASES.get(self.load_format, self.load_format)
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"--load-format {self.load_format}: pagoda loads safetensors (auto, safetensors) or "
                              "random weights for a shape (dummy), no other format", param="load_format")
        self.chat_template_text()  # a path that cannot be read fails here, before any process starts
        if not -(2**63) <= self.seed < 2**64:  # torch.manual_seed's range (its own error was a worker's traceback)
            raise ConfigError(f"seed must be in [-2**63, 2**64), got {self.seed}", param="seed")
        for name in ("block_size", "max_num_seqs", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1", param=name)
        for name in ("max_model_len", "kv_cache_memory", "num_kv_blocks", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1", param=name)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"--quantization {self.quantization}: pagoda implements only {', '.join(QUANTIZATIONS)} "
                              "(FP8 checkpoints are detected without the flag)", param="quantization")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype}: pagoda's KV cache is one of "
                              f"{', '.join(KV_CACHE_DTYPES)} (fp8 is e4m3)", param="kv_cache_dtype")
        if self.swap_space is not None and not (math.isfinite(self.swap_space) and self.swap_space >= 0):
            raise ConfigError("swap_space must be a number of GiB >= 0", param="swap_space")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]", param="gpu_memory_utilization")

    def chat_template_text(self) -> str | None:
        """--chat-template as a template: a readable file's text, else the value itself when it holds Jinja
        ("{", "}" or a line break; on one line, the \\n and \\t a shell leaves as two characters become what they
        say, as in vLLM), else a ConfigError (a path that cannot be read). None: the tokenizer's own template."""
        value = self.chat_template
        if value is None:
            return None
        try:
            return Path(value).read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:  # ValueError: a template too long or odd to be a file name
            if not any(ch in value for ch in "{}\n"):
                raise ConfigError(f"--chat-template {value!r} looks like a file path but cannot be read: {exc}",
                                  param="chat_template") from None
        return value if "\n" in value else value.replace("\\n", "\n").replace("\\t", "\t")

    def generation_overrides(self) -> dict[str, Any]:
        """override_generation_config as a dict ({} when unset); ConfigError if it is not a JSON object."""
        if self.override_generation_config is None:
            return {}
        try:
            overrides = json.loads(self.override_generation_config)
        except ValueError as exc:
            raise ConfigError(f"override_generation_config is not valid JSON: {exc}",
                              param="override_generation_config") from None
        if not isinstance(overrides, dict):
            raise ConfigError('override_generation_config must be a JSON object, e.g. {"temperature": 0.5}',
                              param="override_generation_config")
        return overrides

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments (the offline LLM(...)), naming any unknown one."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}", param=unknown[0])
        if isinstance(kwargs.get("kv_cache_memory"), str):
            kwargs["kv_cache_memory"] = parse_bytes(kwargs["kv_cache_memory"])
        if isinstance(kwargs.get("override_generation_config"), dict):  # vLLM's LLM takes a dict
            kwargs["override_generation_config"] = json.dumps(kwargs["override_generation_config"])
        if "seed" in kwargs and kwargs["seed"] is None:  # vLLM's "not seeded": requests without a seed are random
            del kwargs["seed"]  # here anyway; the engine seed only draws dummy weights
        return cls(**kwargs)

    def resolved_max_inflight_plans(self, device: str) -> int:
        """2 with async scheduling (step N+1 planned and launched while step N runs), 1 for the serial loop.
        `device` is the worker's resolved device (services/worker/device.py; this module never imports torch)."""
        enabled = self.async_scheduling if self.async_scheduling is not None else device.startswith("cuda")
        return 2 if enabled else 1

    def resolved_grammar_process(self, device: str, num_cpus: int) -> bool:
        """Structured outputs' matchers and masks run in a process of their own (services/worker/grammar_process.py),
        sharing no GIL with the step loop. Default: on CUDA with async scheduling and GRAMMAR_PROCESS_MIN_CPUS or
        more CPUs (there the step loop is host-bound and shared the GIL with the mask thread, and both slowed down).
        Off otherwise: serial steps fill their masks inline (nothing overlaps them) and on CPU the forward is the
        step, so the process would add only its round trip (bench/grammar_step.py on the 2-core box: 0.1-0.4 ms of
        wire per step at 64-256 rows) and share a core with the forward."""
        if self.grammar_process is not None:
            return self.grammar_process
        overlapped = self.resolved_max_inflight_plans(device) == 2  # serial steps fill masks inline: no gain
        return device.startswith("cuda") and num_cpus >= GRAMMAR_PROCESS_MIN_CPUS and overlapped

    def resolved_swap_bytes(self, device: str, free_ram: int, host_gpus: int = 1) -> int:
        """Host bytes one worker rank keeps for swapped-out KV blocks. Unset: DEFAULT_SWAP_GIB on CUDA, capped at an
        eighth of the free RAM shared among every GPU of the host (`host_gpus`, which other replicas' ranks may
        use) and this replica's ranks: pinned memory is taken from every other process. On CPU the cache already
        is host memory, so none unless asked (tests ask)."""
        if self.swap_space is not None:
            return int(self.swap_space * (1 << 30))
        if not device.startswith("cuda"):
            return 0
        sharers = max(host_gpus, self.tensor_parallel_size)
        return min(int(DEFAULT_SWAP_GIB * (1 << 30)), free_ram // (8 * sharers))

    def resolved_dtype(self, device: str) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device.startswith("cuda") else "float32"

    def resolved_max_num_batched_tokens(self, device: str, offline: bool = False) -> int:
        """Tokens per step. The offline engine on CUDA takes twice the server's budget: with no streams waiting,
        TTFT and ITL do not matter, and an 8192-token prefill step of a small model is bound by the host's
        kernel launches (measured: qwen3-0.6b 16 x 512 tokens, 17.1 ms of kernels in a 23.8 ms step)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if not device.startswith("cuda"):
            return 2048
        return 16384 if offline else 8192


DEFAULT_SWAP_GIB = 16.0  # host swap space per CUDA worker rank when swap_space is unset
GRAMMAR_PROCESS_MIN_CPUS = 4  # the step loop, the grammar process and its fill threads each want a core
# Constraints this large (encoded) compile off the loops that would wait for them: on a thread in the tokenizer
# process, and in the workers before their request joins the batch (the scheduler holds it: grammar_gate.py). A
# JSON schema compiles in ~12 ms at 3.4 KB, ~0.3 s at 69 KB and ~8 s at 600 KB (2-core host, SmolLM2's vocabulary)
SLOW_COMPILE_MIN_BYTES = 4 << 10
# The worker's compiled matchers (services/worker/grammar.py): at most this many distinct constraints, and their
# encoded sizes together at most this many bytes (a matcher holds ~60x its grammar's text: a 550 KiB schema of 8,000
# properties ~35 MB, so 256 large ones would take gigabytes). The scheduler's ledger of which large constraints the
# workers have built keeps half of each (grammar_gate.py): a constraint it counts as built is still there.
MATCHER_CACHE_SIZE = 256
MATCHER_CACHE_BYTES = 8 << 20


_BYTE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
               "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; '1000' -> 1000."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise ConfigError(f"cannot read {text!r} as a size in bytes (e.g. 4GiB, 512MB)", param="kv_cache_memory")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


_TOKEN_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_token_count(text: str, param: str = "max_model_len") -> int:
    """A number of tokens as vLLM reads one: '32k' -> 32000, '32K' -> 32768, '25.6k' -> 25600, '4096' -> 4096."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgKMG]?)\s*", text)
    if match is None:
        hint = (" (vLLM's auto, fitting the context to memory, is not implemented: give a length, or none for the "
                "model's own)") if param == "max_model_len" and text.strip().lower() in ("auto", "-1") else ""
        raise ConfigError(f"cannot read {text!r} as a number of tokens (e.g. 8192, 32k, 32K){hint}",
                          param=param)
    value = Decimal(match.group(1)) * _TOKEN_UNITS[match.group(2)]  # exact: 0.1k is 100
    if value != int(value):
        raise ConfigError(f"{text!r} is not a whole number of tokens", param=param)
    return int(value)



@dataclass(slots=True)
class ServerConfig:
    """The server's processes and the sockets between them; endpoints default to ipc:// in runtime_dir."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # the names clients may send as `model`, comma-separated (vLLM's --served-model-name takes several); the first
    # is the one responses and /health report. Default: the model folder's name
    served_model_name: str | None = None
    api_workers: int = 1  # api processes sharing the port (SO_REUSEPORT)
    tokenizer_workers: int = 1
    runtime_dir: str | None = None  # where ipc:// endpoints live (the launcher makes a private one)
    api_endpoints: str | None = None  # comma-separated, one per api process; tokenizers connect to each
    scheduler_endpoint: str | None = None  # scheduler binds (ROUTER); tokenizers connect
    plan_endpoint: str | None = None  # scheduler binds (PUB); workers subscribe
    result_endpoint: str | None = None  # scheduler binds (PULL); workers push
    stats_endpoint: str | None = None  # scheduler binds (PUB); apis subscribe
    api_index: int = 0  # which api endpoint this api process binds
    worker_rank: int = 0
    tokenizer_id: str | None = None  # default: host name and pid
    heartbeat_interval: float = 0.5  # seconds between signs of life
    heartbeat_timeout: float = 5.0  # a peer silent this long is taken for dead
    shutdown_grace: float = 3.0  # seconds in-flight requests get to finish on SIGTERM
    max_inflight_requests: int = 4096  # per api process; more get HTTP 503
    log_level: str = "info"
    api_key_file: str | None = None  # a file holding the key (keeps it out of `ps`); PAGODA_API_KEY works too
    max_prompt_bytes: int = 4 << 20  # UTF-8 bytes of template input (texts, tool calls, tools) a request; more: 400
    max_completions_per_request: int = 4096  # prompts x n (or best_of) one completions request may ask; more: 400
    request_timeout: float = 0.0  # seconds one HTTP request may take in all (aborted after); 0: no limit
    body_read_timeout: float = 30.0  # seconds to receive a request's headers and body (slow clients: 408)
    max_waiting_requests: int = 0  # waiting requests past which the scheduler answers 503 + Retry-After; 0: none
    step_timeout: float = 0.0  # a worker step running longer is taken as hung; 0: derived (see hang_floor)
    hang_floor: float = 8.0  # the least a step may run before it counts as hung, once warmed up (step_timeout 0)
    resend_interval: float = 0.5  # the first wait before an unacknowledged message between the api, tokenizer and
    # scheduler goes again (doubling up to 8 s): about what a lost frame costs its requests (shared/delivery.Link)
    restart_on_failure: bool = False  # restart a dead or hung tokenizer or api process instead of stopping
    tool_call_parser: str | None = None  # one of TOOL_CALL_PARSERS; default: by the model's name
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1: <think>...</think> becomes reasoning_content
    data_parallel_size: int = 1  # engine replicas (each a scheduler and its worker ranks) the launcher starts
    replica_id: int = 0  # which replica a scheduler or worker process belongs to (its derived endpoints)
    scheduler_endpoints: str | None = None  # comma-separated, one per replica (index = replica id); tokenizers
    stats_endpoints: str | None = None  # comma-separated, one per replica (index = replica id); tokenizers, apis
    routing: str = "prefix"  # prefix (cache affinity weighed against load) | round_robin | random
    registry_endpoint: str | None = None  # the scheduler whose registry apis, tokenizers and replicas join (tcp)
    advertise_host: str | None = None  # host or IP peers reach this process's bound sockets at; None: detected
    api_keys_file: str | None = None  # tenants: hashed API keys with quotas (services/api/tenants.py)
    prefix_cache_isolation: str = "shared"  # shared | tenant: each tenant's requests salted by the tenant (cache_salt)
    metrics_access: str = "auto"  # auto | open | key: who may read /metrics (see metrics_need_key)
    usage_log: str | None = None  # a JSON line per finished generation request (tenant, tokens, times), appended
    cluster_key_dir: str | None = None  # CURVE key pair for tcp:// sockets (shared/transport.py); None: plain
    max_logprobs: int = 20  # most logprobs / top_logprobs / prompt_logprobs a request may ask (vLLM's); -1: no bound
    console: bool = True  # the browser console at / (playground, live view, request inspector)
    console_show_prompts: bool = False  # the request inspector shows prompt text (off: only counts and times)
    console_max_requests: int = 200  # finished requests the inspector keeps (per api process)
    # vLLM's front-end flags (docs/vllm-compat.md#server-flags)
    response_role: str = "assistant"  # the role of a chat answer's message when the request adds a generation prompt
    # a streamed completion's chunks carry at least this many new tokens after its first (a request's stream_interval
    # may raise it); the tokenizer processes hold the deltas back (services/tokenizer/pacing.py)
    stream_interval: int = 1
    # every response carries X-Request-Id: the request's own header, else a fresh uuid (vLLM's flag)
    enable_request_id_headers: bool = False
    # a chat or /tokenize request's own `chat_template` renders its prompt; off: such a request is refused (a
    # template is code the server runs, in transformers' Jinja sandbox; vLLM's flag and default)
    trust_request_chat_template: bool = False
    # a chat request's tools stay in its prompt under tool_choice "none" (vLLM's default, and OpenAI's: the model
    # knows of them, it does not call them); on: left out of the prompt (vLLM's flag)
    exclude_tools_when_tool_choice_none: bool = False
    # the Responses API keeps this many finished responses (0: none, vLLM's default), for previous_response_id and
    # GET /v1/responses/{id}; in responses_store_dir (default: runtime_dir/responses), which the api processes share
    responses_store: int = 0
    responses_store_dir: str | None = None
    root_path: str = ""  # the path prefix a proxy serves this server under: routes answer with and without it
    # CORS: origins (JSON list or comma-separated; "*": any) whose browser pages may call the API; None: no CORS
    allowed_origins: str | None = None
    allowed_methods: str = "*"  # with allowed_origins: the methods a preflight may ask for
    allowed_headers: str = "*"  # with allowed_origins: the request headers a preflight may ask for
    allow_credentials: bool = False  # with allowed_origins: browsers may send cookies and HTTP auth
    log_requests: bool = False  # the api logs one line per generation request (id, route, prompts, sampling)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"--tool-call-parser {self.tool_call_parser}: pagoda parses tool calls with "
                              f"{', '.join(TOOL_CALL_PARSERS)}", param="tool_call_parser")
        if self.routing not in ROUTINGS:
            raise ConfigError(f"routing must be one of {ROUTINGS}", param="routing")
        if self.prefix_cache_isolation not in PREFIX_CACHE_ISOLATIONS:
            raise ConfigError(f"prefix_cache_isolation must be one of {PREFIX_CACHE_ISOLATIONS}",
                              param="prefix_cache_isolation")
        if self.metrics_access not in METRICS_ACCESSES:
            raise ConfigError(f"metrics_access must be one of {METRICS_ACCESSES}, got {self.metrics_access!r}",
                              param="metrics_access")
        self.log_level = check_log_level(self.log_level).lower()  # " DEBUG" from a file: "debug"
        if self.data_parallel_size < 1 or self.replica_id < 0:
            raise ConfigError("data_parallel_size must be >= 1 and replica_id >= 0", param="data_parallel_size")
        if self.reasoning_parser in REASONING_PARSER_ALIASES:
            self.reasoning_parser = REASONING_PARSER_ALIASES[self.reasoning_parser]
        if self.reasoning_parser not in (None, "qwen3", "deepseek_r1"):
            raise ConfigError(f"--reasoning-parser {self.reasoning_parser}: pagoda has the qwen3 and deepseek_r1 "
                              "reasoning parsers (glm45 reads as qwen3)", param="reasoning_parser")
        for name in ("api_workers", "tokenizer_workers", "max_inflight_requests", "max_prompt_bytes",
                     "max_completions_per_request", "console_max_requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1", param=name)
        if not 0 < self.port < 65536:
            raise ConfigError("port must be in 1..65535", param="port")
        for f in dataclasses.fields(self):  # NaN passes every comparison below (each is false), inf is no time
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number of seconds, got {value}", param=f.name)
        if self.heartbeat_interval <= 0:
            raise ConfigError("heartbeat_interval must be > 0", param="heartbeat_interval")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError("heartbeat_timeout must exceed heartbeat_interval", param="heartbeat_timeout")
        if self.max_logprobs < -1:
            raise ConfigError("max_logprobs must be -1 (the whole vocabulary) or >= 0", param="max_logprobs")
        if self.responses_store < 0:
            raise ConfigError("--responses-store must be >= 0 (0: no responses are kept)", param="responses_store")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ConfigError(f"--stream-interval {self.stream_interval}: new tokens per streamed chunk, an integer in "
                              f"[1, {MAX_STREAM_INTERVAL}]", param="stream_interval")
        if self.resend_interval <= 0:
            raise ConfigError("resend_interval must be > 0", param="resend_interval")
        for name in ("request_timeout", "body_read_timeout", "step_timeout", "hang_floor", "max_waiting_requests",
                     "shutdown_grace"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0", param=name)
        for name in ENDPOINT_FIELDS:  # ZeroMQ's own error was a service's traceback, once every process had started
            for address in parse_list(getattr(self, name), name) if name.endswith("s") else [getattr(self, name)]:
                if address is not None and not re.fullmatch(ENDPOINT_PATTERN, address):
                    raise ConfigError(f"{name} {address!r} is no ZeroMQ address (tcp://HOST:PORT or ipc:///PATH)",
                                      param=name)
        if self.api_key is not None:
            # a key from a file-made secret often ends in a newline, which no Authorization header carries
            self.api_key = self.api_key.strip()
            if not self.api_key:  # `--api-key "$UNSET"`: not "no key"
                raise ConfigError("--api-key is empty: give the key, or leave the flag out to serve without one",
                                  param="api_key")
        if self.api_key is None and self.api_key_file:
            self.api_key = read_key_file(self.api_key_file)
            _check_header_safe(self.api_key, "api_key_file")
        elif self.api_key is not None:
            _check_header_safe(self.api_key, "api_key")
        if self.served_model_name is not None and not self.served_model_names():
            raise ConfigError("served_model_name names no model", param="served_model_name")
        if not self.response_role.strip():
            raise ConfigError("response_role must not be empty", param="response_role")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path == "/"):
            raise ConfigError(f"--root-path {self.root_path!r} must be a path such as /llm", param="root_path")
        self.root_path = self.root_path.rstrip("/")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            parse_list(getattr(self, name), name)  # a broken JSON list fails now
        if self.allowed_origins is None and (self.allow_credentials or self.allowed_methods != "*"
                                             or self.allowed_headers != "*"):
            raise ConfigError("--allow-credentials, --allowed-methods and --allowed-headers need --allowed-origins: "
                              "pagoda answers CORS only for the origins given (vLLM's default is any)",
                              param="allowed_origins")
        if self.allow_credentials and "*" in parse_list(self.allowed_origins, "allowed_origins"):
            raise ConfigError("--allow-credentials with --allowed-origins '*' would let any web page call this "
                              "server with its visitors' cookies or proxy logins: name the origins",
                              param="allow_credentials")

    def served_model_names(self) -> list[str]:
        """The names of --served-model-name (empty when unset)."""
        return [n.strip() for n in (self.served_model_name or "").split(",") if n.strip()]

    def metrics_need_key(self) -> bool:
        """Whether /metrics answers only the operator's key (--api-key): with metrics_access key, or auto beside a
        keys file, whose tenants must not read each other's names and usage there."""
        return self.metrics_access == "key" or (self.metrics_access == "auto" and bool(self.api_keys_file))

    def check_metrics_access(self) -> None:
        """The api's own check (run by the api process and `pagoda serve`, not by the other services, which may
        not hold the operator's key): metrics_access key asked for by name needs that key to read /metrics with.
        auto with a keys file and no operator key is not an error: /metrics is then closed to everyone (a server
        that ran before must not stop serving over its metrics) and the api says so when it starts."""
        if self.metrics_access == "key" and not self.api_key:
            raise ConfigError("--metrics-access key needs the operator's key to read /metrics with: set --api-key, "
                              "--api-key-file or PAGODA_API_KEY, or choose --metrics-access open",
                              param="metrics_access")

    def responses_folder(self) -> Path | None:
        """Where --responses-store keeps responses; None when it keeps none."""
        if self.responses_store == 0:
            return None
        folder = self.responses_store_dir or (f"{self.runtime_dir}/responses" if self.runtime_dir else None)
        if folder is None:
            raise ConfigError("--responses-store needs a folder: set --responses-store-dir (there is no runtime "
                              "folder to default to)", param="responses_store_dir")
        return Path(folder)

    def endpoint(self, name: str) -> str:
        """One socket address (scheduler, plan, result or stats): given explicitly, or derived from runtime_dir.
        Each process asks only for the ones it uses, so a service run alone needs only those set."""
        value = getattr(self, f"{name}_endpoint")
        if value:
            return value
        return self._derived_endpoint(name, self.replica_id)

    def _derived_endpoint(self, name: str, replica_id: int) -> str:
        if not self.runtime_dir:
            raise ConfigError(f"{name}_endpoint is not set and there is no runtime_dir to derive it from",
                              param=f"{name}_endpoint")
        if self.data_parallel_size == 1 and replica_id == 0:
            return f"ipc://{self.runtime_dir}/{name}.sock"
        return f"ipc://{self.runtime_dir}/{name}-r{replica_id}.sock"  # per replica: scheduler, plan, result, stats

    def replica_endpoint_list(self, name: str) -> list[str]:
        """The scheduler or stats address of every replica (list index = replica id): given as a
        comma-separated list, or the one {name}_endpoint (a single replica), or derived from runtime_dir."""
        listed = getattr(self, f"{name}_endpoints")
        if listed:
            return [e.strip() for e in listed.split(",") if e.strip()]
        if self.data_parallel_size == 1:
            return [self.endpoint(name)]
        return [self._derived_endpoint(name, r) for r in range(self.data_parallel_size)]

    def api_endpoint_list(self) -> list[str]:
        """One address per api process; tokenizers connect to each. With a registry: those given (often none),
        the rest are discovered."""
        if self.api_endpoints:
            return [e.strip() for e in self.api_endpoints.split(",") if e.strip()]
        if self.registry_endpoint:
            return []
        if not self.runtime_dir:
            raise ConfigError("api_endpoints is not set and there is no runtime_dir to derive it from",
                              param="api_endpoints")
        return [f"ipc://{self.runtime_dir}/api{i}.sock" for i in range(self.api_workers)]

    def endpoints(self) -> Endpoints:
        """Every socket address (the launcher's view)."""
        return Endpoints(api=self.api_endpoint_list(), scheduler=self.endpoint("scheduler"),
                         plan=self.endpoint("plan"), result=self.endpoint("result"), stats=self.endpoint("stats"))


ENDPOINT_FIELDS = ("api_endpoints", "scheduler_endpoint", "plan_endpoint", "result_endpoint", "stats_endpoint",
                   "scheduler_endpoints", "stats_endpoints", "registry_endpoint")
ENDPOINT_PATTERN = r"tcp://([^\s/:\[\]]+|\[[0-9a-fA-F:.]+\]):([0-9]+|\*)|ipc://\S+|inproc://\S+"


def parse_list(text: str | None, name: str) -> list[str]:
    """A list setting as vLLM writes it (a JSON list, '["http://a.example"]') or as a comma-separated text."""
    if text is None:
        return []
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--{name.replace('_', '-')} is not a JSON list: {exc}", param=name) from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"--{name.replace('_', '-')} must be a list of strings", param=name)
        return [v.strip() for v in value if v.strip()]
    return [v.strip() for v in text.split(",") if v.strip()]


def _check_header_safe(key: str, name: str) -> None:
    """The operator's key travels in an Authorization header, which cannot hold a control character but a tab (a line
    break ends the header): a key with one would let nobody in, the operator included, every request a 401."""
    bad = next((i for i, c in enumerate(key) if (ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F), None)
    if bad is not None:
        raise ConfigError(f"--{name.replace('_', '-')}: the key holds a control character ({key[bad]!r} at index "
                          f"{bad}; a second line?), which no HTTP header can carry: give the key alone", param=name)


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def check_log_level(level: str) -> str:
    """A level logging.basicConfig takes by name (any case); a ConfigError naming log_level otherwise (logging's own
    ValueError was a traceback from `pagoda serve`, or from each service process it started)."""
    if level.strip().upper() not in logging.getLevelNamesMapping():
        raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {level!r}", param="log_level")
    return level.strip().upper()


def read_key_file(path: str) -> str:
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the api key file {path}: {exc}", param="api_key_file") from exc
    if not key:
        raise ConfigError(f"the api key file {path} is empty", param="api_key_file")
    return key


@dataclass(frozen=True, slots=True)
class Endpoints:
    api: list[str]
    scheduler: str
    plan: str
    result: str
    stats: str


LOOPBACK_NAMES = {"localhost": "127.0.0.1", "ip6-localhost": "[::1]", "localhost6": "[::1]"}


def bind_address(endpoint: str) -> str:
    """Where to bind for a connect address: IP literals bind as given, loopback names the loopback (localhost stays
    local), any other name every interface (a service name resolves to a proxy's or peer's address, not ours)."""
    match = re.fullmatch(r"tcp://([^:/]+|\[[^\]]+\]):(\d+)", endpoint)
    if match is None:
        return endpoint
    if match.group(1).lower() in LOOPBACK_NAMES:
        return f"tcp://{LOOPBACK_NAMES[match.group(1).lower()]}:{match.group(2)}"
    host = match.group(1).strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return f"tcp://*:{match.group(2)}"
    return endpoint


# --------------------------------------------------------------------------------------------
# flags and environment variables, derived from the dataclass fields

_PARSERS: dict[str, Any] = {"kv_cache_memory": parse_bytes, "max_model_len": parse_token_count,
                            "max_num_batched_tokens": functools.partial(parse_token_count,
                                                                        param="max_num_batched_tokens")}
# True (or auto) by default: a --no- flag
_FLAG_NAMES: dict[str, str] = {"enable_prefix_caching": "no-prefix-caching", "async_scheduling": "no-async-scheduling",
                               "console": "no-console", "grammar_fast_forward": "no-grammar-fast-forward",
                               "log_requests": "enable-log-requests"}
# vLLM's spellings of the same settings: other option strings of a field's flag
_ALIASES: dict[str, tuple[str, ...]] = {"tensor_parallel_size": ("-tp",), "data_parallel_size": ("-dp",),
                                        "api_workers": ("--api-server-count", "-asc")}
# a switch's other flags, vLLM's (flag -> the value it sets)
_SWITCHES: dict[str, dict[str, bool]] = {
    "enable_prefix_caching": {"--enable-prefix-caching": True, "--no-enable-prefix-caching": False},
    "async_scheduling": {"--async-scheduling": True},
}
_LISTS = frozenset({"served_model_name"})  # several values after the flag, kept comma-separated
_HELP: dict[str, str] = {
    "tool_call_parser": f"how tool_choice auto answers are read for calls: {', '.join(TOOL_CALL_PARSERS)} (vLLM's "
                        "names; default: by the model's name: deepseek, qwen3-coder, hermes, llama-3, mistral...)",
    "model": "model folder (config.json + safetensors) or dummy shape name with --load-format dummy",
    "kv_cache_memory": "bytes for the KV cache, e.g. 2GiB (default: 1 GiB on CPU, what fits on CUDA)",
    "generation_config": "where sampling defaults for fields a request leaves unset come from (temperature, top_p, "
                         "top_k, min_p, repetition_penalty; max_new_tokens as chat's max_tokens): auto (the model "
                         "folder's generation_config.json), vllm (none: the API's own defaults) or a folder holding a "
                         "generation_config.json (vLLM's --generation-config); without that file, config.json's "
                         "sampling keys, as vLLM falls back",
    "override_generation_config": "a JSON object of generation config keys set over what --generation-config gives "
                                  "(also with vllm), e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 256}'; null "
                                  "unsets a key (vLLM's --override-generation-config)",
    "swap_space": "GiB of pinned host memory per worker rank that preempted sequences' KV blocks are copied to and "
                  "back from instead of being recomputed (default: 16 on CUDA, at most an eighth of the free RAM "
                  "shared by the host's GPUs, "
                  "for models whose K/V copies cost less than recomputing them; none on CPU; 0: always recompute)",
    "api_key": "require 'Authorization: Bearer KEY' on /v1 routes (visible in ps: prefer --api-key-file or "
               "PAGODA_API_KEY)",
    "api_key_file": "read the API key from this file (or set PAGODA_API_KEY)",
    "restart_on_failure": "restart a dead or hung tokenizer or api process, or a replica's scheduler and workers "
                          "(default: stop the server; with several replicas the others keep serving)",
    "data_parallel_size": "engine replicas (each a scheduler and its worker ranks; on a GPU host replica r "
                          "takes GPUs r*T..r*T+T-1)",
    "scheduler_endpoints": "comma-separated scheduler addresses, one per replica (tokenizers connect to each)",
    "stats_endpoints": "comma-separated scheduler stats addresses, one per replica (tokenizers and apis)",
    "routing": "how tokenizers pick a replica: prefix (cache affinity vs load), round_robin or random",
    "registry_endpoint": "tcp address of the scheduler keeping the registry (e.g. tcp://scheduler:5555): apis, "
                         "tokenizers and other replicas' schedulers join it and find each other there, no fixed "
                         "lists; the scheduler at this address is the registry",
    "advertise_host": "host name or IP other processes reach this one's bound sockets at (default: this host's "
                      "address on the interface that routes to the registry)",
    "quantization": "fp8: e4m3 linear weights (per-channel scales, quantized at load; FP8 checkpoints load as "
                    "they ship whatever this says)",
    "kv_cache_dtype": "auto (the model dtype) or fp8: e4m3 KV cache with per-layer K/V scales from the checkpoint, "
                      "else 1.0 (see --kv-scale-calibration)",
    "kv_scale_calibration": "fp8 KV: set each layer's K/V scales from the first prefill (2 x amax / 448), "
                            "overriding checkpoint scales",
    "api_keys_file": "JSON file of tenants and their hashed API keys with quotas (make one with `pagoda keys add`); "
                     "reloaded when it changes or on SIGHUP. --api-key keeps working beside it (tenant 'default')",
    "prefix_cache_isolation": "shared: requests share cached prefix blocks unless their cache_salt differs; tenant: "
                              "each tenant's requests (--api-keys-file) are also salted by their tenant, so that no "
                              "tenant reuses (or can time) another's cached prompts (docs/tenants.md)",
    "cluster_key_dir": "folder holding the deployment's CURVE key pair (cluster.key_secret, from `pagoda "
                       "cluster-keys DIR`): tcp:// sockets authenticate and encrypt with it and refuse peers without "
                       "it (ipc:// needs none; `pagoda serve` makes one in its runtime dir for tcp endpoints; "
                       "'none': plain tcp on purpose)",
    "metrics_access": "who may read /metrics (per-tenant series, prefix-cache counters): open (anyone who "
                      "reaches the HTTP port), key (only 'Authorization: Bearer' the operator's --api-key; a "
                      "tenant's key is refused) or auto (key with --api-keys-file, open without; docs/security.md)",
    "usage_log": "append one JSON line per finished generation request (tenant, request id, tokens, times) here",
    "max_logprobs": "the most logprobs (completions), top_logprobs (chat) or prompt_logprobs a request may ask; "
                    "-1 allows the whole vocabulary, which requests then ask with -1 (vLLM's --max-logprobs)",
    "console": "no browser console at / (playground, live view, request inspector; docs/console.md)",
    "console_show_prompts": "the console's request inspector shows prompt text (default: counts and times only)",
    "console_max_requests": "finished requests the console's request inspector keeps, per api process",
    "resend_interval": "seconds before a request, answer or token frame between api, tokenizer and scheduler that is "
                       "not acknowledged goes again (doubling up to 8 s); a loss with frames behind it is resent "
                       "at once (docs/security.md)",
    "grammar_process": "structured outputs' matchers and masks in a process of their own (default: on CUDA with "
                       "async scheduling and 4+ CPUs; PAGODA_GRAMMAR_PROCESS=0 keeps them in the worker)",
    "grammar_fast_forward": "structured outputs: the tokens a grammar forces at its start (e.g. '{\"name\": \"') are "
                            "sampled one step each, as without a grammar (default: they join the prompt's prefill, "
                            "with the grammar's own tokenization of that text)",
    "async_scheduling": "serial steps: plan a step only after the previous one's tokens are back "
                        "(default: overlap planning with the GPU on CUDA)",
    "max_model_len": "context limit in tokens, e.g. 8192, 32k (32000) or 32K (32768) (default: the model's)",
    "max_num_batched_tokens": "tokens one step computes, e.g. 8192 or 8k (default: 8192 on CUDA, 2048 on CPU)",
    "served_model_name": "the names clients may send as `model` (several: the first is the one responses "
                         "report; default: the model folder's name)",
    "chat_template": "a Jinja chat template, or a file holding one, that renders chats instead of the "
                     "tokenizer's own (vLLM's --chat-template)",
    "response_role": "the role of a chat answer's message when the request adds a generation prompt "
                     "(default: assistant; vLLM's --response-role)",
    "stream_interval": "new tokens a streamed completion's chunks carry at least, after its first chunk, which goes "
                       "out at once (its end goes out at once too); a request's stream_interval may raise it, never "
                       "lower it (default 1: every step's tokens; vLLM's --stream-interval)",
    "enable_request_id_headers": "every response carries an X-Request-Id header: the one the request sent, else a "
                                 "fresh id (vLLM's --enable-request-id-headers)",
    "responses_store": "the Responses API keeps this many finished responses (0: none, the default), so that "
                       "previous_response_id continues one and GET / DELETE /v1/responses/{id} and its input_items "
                       "read it; the oldest is dropped past the count (vLLM's VLLM_ENABLE_RESPONSES_API_STORE, "
                       "bounded)",
    "responses_store_dir": "where --responses-store keeps responses, one JSON file each, shared by the api processes "
                           "(default: the runtime folder's responses/; give a shared volume to several hosts)",
    "trust_request_chat_template": "a chat or /tokenize request may send its own chat_template, which then renders "
                                   "its prompt; without the flag such a request is refused (vLLM's "
                                   "--trust-request-chat-template)",
    "exclude_tools_when_tool_choice_none": "leave a chat request's tools out of its prompt when its tool_choice is "
                                           "none (default: the template renders them, the model calls none; "
                                           "vLLM's --exclude-tools-when-tool-choice-none)",
    "root_path": "the path prefix a proxy serves this server under, e.g. /llm: every route answers with and without "
                 "it (vLLM's --root-path)",
    "allowed_origins": "CORS: origins whose browser pages may call the API, a JSON list or comma-separated "
                       "('[\"*\"]': any; default: none, no CORS headers)",
    "allowed_methods": "CORS: the methods a preflight may ask for (default *)",
    "allowed_headers": "CORS: the request headers a preflight may ask for (default *)",
    "allow_credentials": "CORS: browsers may send cookies and HTTP auth along",
    "log_requests": "log one line per generation request at info: id, route, prompt sizes, sampling (vLLM's "
                    "--enable-log-requests)",
}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def env_names() -> list[str]:
    """Every environment variable the config module reads (compose files are checked against this)."""
    names = [env_name(f.name) for cls in (EngineConfig, ServerConfig) for f in dataclasses.fields(cls)]
    return sorted(names)


def _base_type(annotation: Any) -> type:
    if get_origin(annotation) in (Union, types.UnionType):
        return next(arg for arg in get_args(annotation) if arg is not type(None))
    return annotation


_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def _from_text(field_name: str, kind: type, text: str) -> Any:
    if field_name in _PARSERS:
        try:
            return _PARSERS[field_name](text)
        except ConfigError as exc:  # said with the variable's name: the flag was not given
            raise ConfigError(f"{env_name(field_name)}: {exc.message}", param=field_name) from None
    if kind is bool:  # a word that is neither (PAGODA_RESTART_ON_FAILURE=enabled) is refused, not read as off
        word = text.strip().lower()
        if word in _TRUE_WORDS or word in _FALSE_WORDS:
            return word in _TRUE_WORDS
        raise ConfigError(f"{env_name(field_name)}={text!r} is not a valid bool (1, true, yes, on or 0, false, no, "
                          "off)", param=field_name)
    try:
        return kind(text)
    except ValueError as exc:
        raise ConfigError(f"{env_name(field_name)}={text!r} is not a valid {kind.__name__}",
                          param=field_name) from exc


def _flag_type(parse: Any) -> Any:
    """A flag's type function whose ConfigError argparse shows as its message (not 'invalid parse_... value')."""
    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(exc.message) from None
    checked.__name__ = getattr(parse, "__name__", "value")
    return checked


def _add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    group = parser.add_argument_group(title)
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = _base_type(hints[f.name])
        env_text = os.environ.get(env_name(f.name))
        default = _from_text(f.name, kind, env_text) if env_text else f.default
        if kind is bool:
            flag = _FLAG_NAMES.get(f.name, f.name.replace("_", "-"))
            inverted = flag.startswith("no-")
            group.add_argument("--" + flag, dest=f.name, action="store_false" if inverted else "store_true",
                               default=default, help=_HELP.get(f.name))
            for other, value in _SWITCHES.get(f.name, {}).items():
                group.add_argument(other, dest=f.name, action="store_true" if value else "store_false",
                                   default=default, help=f"(vLLM's spelling: {'on' if value else 'off'})")
            continue
        parse = _PARSERS.get(f.name, kind)
        group.add_argument("--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, ()), dest=f.name,
                           type=_flag_type(parse), default=default, nargs="+" if f.name in _LISTS else None,
                           help=_HELP.get(f.name, f"(env {env_name(f.name)})"))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags; each defaults to its PAGODA_<NAME> environment variable, then the dataclass default."""
    _add_dataclass_args(parser, EngineConfig, "engine")
    parser.add_argument("--shape", default=os.environ.get(ENV_PREFIX + "SHAPE") or None,
                        help="dummy shape name (= --model NAME --load-format dummy; env PAGODA_SHAPE)")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    _add_dataclass_args(parser, ServerConfig, "server")


def _from_namespace(cls: type, args: argparse.Namespace) -> Any:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    for name in _LISTS & values.keys():  # given as flags: a list; from the environment: already one text
        if isinstance(values[name], list):
            values[name] = ",".join(values[name])
    return cls(**values)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    if getattr(args, "shape", None):
        args.model, args.load_format = args.shape, "dummy"
    return _from_namespace(EngineConfig, args)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return _from_namespace(ServerConfig, args)


# --------------------------------------------------------------------------------------------
# vLLM's `vllm serve` flags that are not settings of pagoda's own (docs/vllm-compat.md#server-flags): a command line
# written for vLLM starts pagoda, or stops it with one line naming the flag it cannot honour. The settings both
# have are the dataclass fields above under vLLM's names (--max-model-len, --enable-prefix-caching, -tp, ...).

# Accepted, changing nothing here: flag -> (its values: 0 none, 1 one, "+" one or more; why). Logged at start-up.
VLLM_NO_OP_FLAGS: dict[str, tuple[int | str, str]] = {
    "--enable-chunked-prefill": (0, "pagoda always chunks prefills: a step mixes decode tokens and prompt "
                                        "chunks up to --max-num-batched-tokens"),
    "--enable-auto-tool-choice": (0, "tool_choice auto is always on here, parsed with --tool-call-parser "
                                         "(default: chosen by the model's name)"),
    "--trust-remote-code": (0, "pagoda never runs code from a model folder: its model classes are its own and "
                                   "tokenizers load without remote code"),
    "--disable-log-requests": (0, "pagoda logs no requests unless --enable-log-requests is given"),
    "--disable-log-stats": (0, "pagoda logs no periodic stats (/metrics has them)"),
    "--disable-fastapi-docs": (0, "pagoda serves no /docs, /redoc or /openapi.json"),
    "--disable-uvicorn-access-log": (0, "the api logs HTTP access lines only at --log-level debug"),
    "--revision": (1, "pagoda loads local folders only (no hub download), and a folder holds one revision"),
    "--tokenizer-revision": (1, "pagoda loads local folders only (no hub download), and a folder holds one "
                                   "revision"),
    "--code-revision": (1, "pagoda loads local folders only and runs no code from them"),
    "--download-dir": (1, "pagoda loads local folders only: nothing is downloaded"),
    "--max-seq-len-to-capture": (1, "pagoda's decode CUDA graphs serve every sequence length up to "
                                       "--max-model-len"),
}
# Refused: flag -> (its values, why). pagoda would not do what the flag asks, so it does not start.
VLLM_REFUSED_FLAGS: dict[str, tuple[int | str, str]] = {
    "--no-enable-chunked-prefill": (0, "pagoda's scheduler always chunks prefills (a larger "
                                           "--max-num-batched-tokens keeps more prompts whole)"),
    "--speculative-config": (1, "pagoda has no speculative decoding"),
    "--enable-lora": (0, "pagoda serves no LoRA adapters"),
    "--lora-modules": ("+", "pagoda serves no LoRA adapters"),
    "--max-loras": (1, "pagoda serves no LoRA adapters"),
    "--max-lora-rank": (1, "pagoda serves no LoRA adapters"),
    "--cuda-graph-sizes": ("+", "pagoda captures decode graphs for 1, 2, 4, 8 and every 16 sequences up to "
                                 "--max-num-seqs: set --max-num-seqs, or --enforce-eager for none"),
    "--ssl-keyfile": (1, "pagoda serves plain HTTP: terminate TLS at a proxy in front of it"),
    "--ssl-certfile": (1, "pagoda serves plain HTTP: terminate TLS at a proxy in front of it"),
    "--enable-sleep-mode": (0, "pagoda cannot release and reload its GPU memory while running"),
    "--kv-transfer-config": (1, "pagoda has no disaggregated prefill (KV transfer between instances)"),
    "--enable-expert-parallel": (0, "pagoda shards experts by tensor parallelism only"),
}
DISTRIBUTED_BACKENDS = ("mp", "uni")  # one process per rank on this host: what pagoda always does
UVICORN_LOG_LEVELS = {"critical": "critical", "error": "error", "warning": "warning", "info": "info",
                      "debug": "debug", "trace": "debug"}
TOKENIZER_MODES = ("auto", "hf")  # transformers' fast tokenizer from the folder, the only kind pagoda loads
RAW_LOGPROBS = "raw_logprobs"  # vLLM's --logprobs-mode default, the only one pagoda serves (worker/sampler.py)


def _dest(flag: str) -> str:
    return "vllm_" + flag.lstrip("-").replace("-", "_")


def add_vllm_serve_args(parser: argparse.ArgumentParser) -> None:
    """`vllm serve`'s flags with no pagoda field: the positional model, value-dependent ones, no-ops and refusals.
    apply_vllm_serve_args reads them."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model folder, as vLLM takes it (the same as --model)")
    group = parser.add_argument_group("vLLM flags", "accepted for command lines written for `vllm serve` "
                                      "(docs/vllm-compat.md#server-flags)")
    for table, what in ((VLLM_NO_OP_FLAGS, "changes nothing here"), (VLLM_REFUSED_FLAGS, "refused")):
        for flag, (num_values, why) in table.items():
            described = f"{what}: {why}".replace("%", "%%")
            if num_values == 0:
                group.add_argument(flag, dest=_dest(flag), action="store_const", const=True, help=described)
            else:
                group.add_argument(flag, dest=_dest(flag), nargs="+" if num_values == "+" else None, metavar="VALUE",
                                   help=described)
    group.add_argument("--pipeline-parallel-size", "-pp", dest="vllm_pipeline_parallel_size", type=int,
                       default=None, help="1 only: pagoda has no pipeline parallelism")
    group.add_argument("--distributed-executor-backend", dest="vllm_distributed_executor_backend", default=None,
                       help="mp or uni (pagoda's one process per rank); ray and external_launcher are refused")
    group.add_argument("--limit-mm-per-prompt", dest="vllm_limit_mm_per_prompt", default=None,
                       help="only zeros (e.g. '{\"image\": 0}'): pagoda serves text")
    group.add_argument("--uvicorn-log-level", dest="vllm_uvicorn_log_level", default=None,
                       choices=sorted(UVICORN_LOG_LEVELS), help="sets --log-level (trace: debug)")
    group.add_argument("--tokenizer-mode", dest="vllm_tokenizer_mode", default=None,
                       help="auto or hf: the folder's fast tokenizer; slow, mistral and custom are refused")
    group.add_argument("--logprobs-mode", dest="vllm_logprobs_mode", default=None,
                       help="raw_logprobs only (vLLM's default): logprobs are the model's raw distribution's; "
                            "raw_logits and the processed modes are refused")


def apply_vllm_serve_args(args: argparse.Namespace) -> list[str]:
    """Turn add_vllm_serve_args' flags into pagoda's settings on `args` (before the configs are built from it). A
    flag pagoda cannot honour is a ConfigError naming it; the lines returned say, once each, the flags given that
    change nothing here (the caller logs them)."""
    notes: list[str] = []
    if getattr(args, "model_tag", None):
        args.model = args.model_tag  # vLLM's positional model wins over --model, as in vLLM
    for flag, (_, why) in VLLM_REFUSED_FLAGS.items():
        if getattr(args, _dest(flag), None) is not None:
            raise ConfigError(f"{flag} is not supported: {why}", param=_dest(flag)[5:])
    for flag, (_, why) in VLLM_NO_OP_FLAGS.items():
        if getattr(args, _dest(flag), None) is not None:
            notes.append(f"{flag} changes nothing here: {why}")
    pipeline = getattr(args, "vllm_pipeline_parallel_size", None)
    if pipeline is not None and pipeline != 1:
        raise ConfigError(f"--pipeline-parallel-size {pipeline} is not supported: pagoda has no pipeline "
                          "parallelism; use --tensor-parallel-size", param="pipeline_parallel_size")
    backend = getattr(args, "vllm_distributed_executor_backend", None)
    if backend is not None and backend not in DISTRIBUTED_BACKENDS:
        raise ConfigError(f"--distributed-executor-backend {backend} is not supported: pagoda runs one process per "
                          "GPU on one host (mp); across hosts, run its services with tcp:// endpoints "
                          "(docs/operations.md)", param="distributed_executor_backend")
    if backend is not None:
        notes.append(f"--distributed-executor-backend {backend} changes nothing here: pagoda always runs one "
                     "process per worker rank")
    limits = getattr(args, "vllm_limit_mm_per_prompt", None)
    if limits is not None:
        _check_no_multimodal(limits)
        notes.append("--limit-mm-per-prompt changes nothing here: pagoda serves text only, and it allows no items")
    mode = getattr(args, "vllm_tokenizer_mode", None)
    if mode is not None and mode not in TOKENIZER_MODES:
        raise ConfigError(f"--tokenizer-mode {mode} is not supported: pagoda loads the folder's fast tokenizer "
                          "(auto, hf)", param="tokenizer_mode")
    logprobs_mode = getattr(args, "vllm_logprobs_mode", None)
    if logprobs_mode is not None and logprobs_mode != RAW_LOGPROBS:
        raise ConfigError(f"--logprobs-mode {logprobs_mode} is not supported: pagoda returns the log-probabilities of "
                          "the model's raw distribution, before logit_bias, penalties, bans and temperature "
                          f"({RAW_LOGPROBS}, vLLM's default)", param="logprobs_mode")
    if logprobs_mode is not None:
        notes.append(f"--logprobs-mode {RAW_LOGPROBS} changes nothing here: pagoda's logprobs are always the model's "
                     "raw distribution's")
    level = getattr(args, "vllm_uvicorn_log_level", None)
    if level is not None:
        args.log_level = UVICORN_LOG_LEVELS[level]
    dummy = getattr(args, "load_format", "auto") == "dummy" or getattr(args, "shape", None)
    if getattr(args, "seed", 0) != 0 and not dummy:
        notes.append(f"--seed {args.seed} changes no sampling here: it seeds only dummy weights; a request "
                     "without a seed samples fresh randomness (send `seed` per request to repeat an answer)")
    return notes


def _check_no_multimodal(text: str) -> None:
    try:
        limits = json.loads(text)
    except ValueError:  # vLLM's older form: image=0,video=0
        limits = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    if not isinstance(limits, dict) or any(str(v).strip() not in ("0", "0.0") and v != 0 for v in limits.values()):
        raise ConfigError(f"--limit-mm-per-prompt {text} is not supported: pagoda serves text only (no images, "
                          "audio or video); only zero limits are accepted", param="limit_mm_per_prompt")


def to_env(*configs: EngineConfig | ServerConfig) -> dict[str, str]:
    """PAGODA_* variables that rebuild these configs in a child process (None fields are left out)."""
    env: dict[str, str] = {}
    for config in configs:
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            if value is not None:
                env[env_name(f.name)] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return env


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """What a fault-injecting socket does to each frame it sends (tests only): drop it, send it twice, or hold it
    back until the socket's next send (a delay that reorders)."""

    drop: float = 0.0
    dup: float = 0.0
    hold: float = 0.0
    seed: int = 0


def test_faults() -> dict[str, FaultSpec]:
    """Test-only fault injection (tests/reliability): PAGODA_TEST_FAULTS="plan=drop:0.1,dup:0.1,hold:0.1;result=..."
    makes the sockets of those roles (shared/transport.make_socket) lose, repeat and reorder what they send.
    Unset in every real deployment."""
    text = os.environ.get(ENV_PREFIX + "TEST_FAULTS", "").strip()
    faults: dict[str, FaultSpec] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        role, _, spec = part.partition("=")
        try:
            values = {key.strip(): float(value) for key, value in (item.split(":") for item in spec.split(","))}
            faults[role.strip()] = FaultSpec(values.get("drop", 0.0), values.get("dup", 0.0), values.get("hold", 0.0),
                                             int(values.get("seed", 0)))
        except ValueError as exc:
            raise ConfigError(f"cannot read {ENV_PREFIX}TEST_FAULTS part {part!r}: {exc}",
                              param="test_faults") from exc
    return faults


def sampler_fault_seed() -> int | None:
    """Test-only fault injection (tests/reliability): the worker's sampler fails any batch holding a row with
    this seed, so that isolation can be tested through real processes. Unset in every real deployment."""
    text = os.environ.get(ENV_PREFIX + "TEST_SAMPLER_FAULT_SEED", "")
    return int(text) if text.strip() else None


# Measurement switches: PAGODA_* variables that A/B a kernel or fusion choice for bench/step_ab.py, which sets them
# between variants inside one process, so each is read where it is used, not once at start-up. Name (after the
# prefix) -> the values it takes ("" = unset, the default behaviour); None: the kernel module checks the value.
# Unset in a deployment: every default is the measured choice.
MEASUREMENT_SWITCHES: dict[str, tuple[str, ...] | None] = {
    "DENSE_GEMV": ("", "0", "1"),  # kernels/gemv: the 16-bit GEMV everywhere (1), nowhere (0), where tuned ("")
    "HEAD_GEMV": ("", "0", "1"),  # MLA's per-head projections on the GEMV under DENSE_GEMV=1 (0: torch.bmm)
    "FP8_FAST_ACCUM": ("", "0", "1"),  # cuBLASLt FP8 GEMMs without periodic fp32 promotion (default on)
    "MOE_ACT_FP8": ("", "table", "0", "1", "auto"),  # FP8 experts' W8A8-or-weight-only choice
    "MOE_FP8_GMM": ("", "auto", "0", "1"),  # FP8 experts on torch._scaled_grouped_mm
    "MOE_FP8_GMM_SPLIT": ("", "0", "1"),  # that path's expert split (kernels/moe.expert_split)
    "PDL": ("", "0", "1", "force"),  # programmatic dependent launch: off, default, every step
    "PDL_TRIGGER": ("", "exit"),  # PDL kernels trigger their dependents as their programs exit
    "FP8_DECODE_PIPELINED": ("", "0", "1", "2", "3", "4"),  # the Gluon fp8-cache decode kernel: off, on, ring depth
    "FP8_KV_DECODE": None,  # an fp8-cache decode conversion mode (kernels/paged_attention.FP8_CONVERTS)
    "FUSE_SPLIT_K": ("", "0", "norms", "1"),  # weight-only split-K partials summed by the next kernels
    "FUSE_MOE_SUM": ("", "0", "1"),  # the sparse layers' top-k sum in the next norm
    "FUSE_SILU_GEMV": ("", "0", "1"),  # SiLU-and-mul inside the FP8 down GEMV (default: at one row)
}


def measurement_switch(name: str) -> str:
    """PAGODA_<name>'s value, "" when unset; a value MEASUREMENT_SWITCHES does not list is a ConfigError (a
    mistyped switch would otherwise measure the default under another label)."""
    accepted = MEASUREMENT_SWITCHES[name]
    value = os.environ.get(ENV_PREFIX + name, "")
    if accepted is not None and value not in accepted:
        raise ConfigError(f"{ENV_PREFIX}{name} must be one of {[v for v in accepted if v]} or unset, got {value!r}",
                          param=name.lower())
    return value


def triton_interpreted() -> bool:
    """Whether Triton kernels run under its CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
