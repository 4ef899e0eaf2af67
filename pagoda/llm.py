"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...)) and .chat(...)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pagoda.params as vllm_params
from pagoda.engine import LLMEngine, is_model_reference
from pagoda.outputs import CompletionOutput, Logprob, Metric, RequestOutput, StreamDelta
from pagoda.services.tokenizer.generation_config import sampling_defaults
from pagoda.shared.config import DEFAULT_MODEL_DIR, EngineConfig
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import MAX_N, SamplingParams
from pagoda.shared.shapes import SHAPES

Prompt = str | list[int]
# vLLM's TextPrompt {"prompt": text} or TokensPrompt {"prompt_token_ids": ids}, either with "cache_salt"
PromptDict = dict[str, Any]
Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class _PromptInput:
    """One prompt as the engine takes it: text or token ids, and vLLM's cache_salt (None: unsalted)."""

    prompt: Prompt
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams, plus transformers' early_stopping (True, False or "never") and stop_token_ids.
    include_stop_str_in_output: a hypothesis that ended on its end-of-sequence (or stop) token keeps that token in
    its tokens and text; vLLM's default, False, leaves it out (its log-probability stays in the score)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # 0 or 1: the model's log-probabilities; else log_softmax(logits / T)
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False

    def sampling_params(self) -> SamplingParams:
        # vLLM's beam search makes a SamplingParams of its temperature: one in (0, 0.01) is raised, with its warning
        return SamplingParams(use_beam_search=True, best_of=self.beam_width, n=self.beam_width,
                              max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              temperature=vllm_params.raised_or_same_temperature(self.temperature),
                              length_penalty=self.length_penalty, early_stopping=self.early_stopping,
                              stop_token_ids=list(self.stop_token_ids))


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished hypothesis: the prompt and generated tokens and their text (vLLM's layout: tokenizer.decode of
    them all, special tokens kept)."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty: the ranking
    finish_reason: str | None
    stop_reason: int | None = None  # the stop_token_ids id that ended it (vLLM's)
    lora_request: None = None  # vLLM's: LoRA adapters are not implemented


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


class LLM:
    """An engine in this process. `model` is a model folder or a dummy shape name (random weights).
    generation_config (vLLM's): where the default SamplingParams come from; "auto": the model folder's
    generation_config.json, "vllm": SamplingParams' own defaults, else a folder holding a generation_config.json."""

    def __init__(self, model: str = DEFAULT_MODEL_DIR, *, generation_config: str = "auto",
                 **engine_args: Any) -> None:
        if "load_format" not in engine_args and model in SHAPES and not is_model_reference(model):
            engine_args["load_format"] = "dummy"
        config = EngineConfig.from_kwargs(model=model, generation_config=generation_config, **engine_args)
        self._sampling_defaults = sampling_defaults(config.model, config.generation_config,
                                                    config.generation_overrides())
        self.engine = LLMEngine(config)

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer itself, as vLLM's returns: a ported script's decode, apply_chat_template and
        __call__ keep transformers' defaults (pagoda's own wrapper, engine.tokenizer, differs: its decode skips
        special tokens and its chat template adds the generation prompt). None for a model without a tokenizer."""
        tokenizer = self.engine.tokenizer
        return tokenizer.hf if tokenizer is not None else None

    def get_default_sampling_params(self) -> vllm_params.SamplingParams:
        """A new SamplingParams with the generation config's sampling defaults (what generate uses without one)."""
        return vllm_params.SamplingParams(**self._sampling_defaults)

    def generate(self, prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; one RequestOutput per prompt, in order. A prompt is
        text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}, which may carry a "cache_salt"
        (only prompts with the same salt share prefix-cache blocks). `use_tqdm` is taken for vLLM's scripts and
        draws nothing: pagoda shows no progress bar. lora_request: None only."""
        _no_lora(lora_request)
        return self._generate(_as_prompt_list(prompts), sampling_params, priority)

    def _generate(self, prompt_list: list[_PromptInput],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  priority: Sequence[int] | None) -> list[RequestOutput]:
        """generate's work, on prompts already parsed (beam_search hands its chunks here)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        bare = [not getattr(p, "detokenize", True) for p in _per_prompt(sampling_params, len(prompt_list), False)]
        params_list = _per_prompt(sampling_params, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise InvalidRequestError("priority needs one entry per prompt", param="priority")
        request_ids = self._add_all(prompt_list, params_list, priorities)
        engine = self.engine
        try:
            while engine.has_unfinished_requests():
                engine.step(deltas=False)  # nothing reads the text before the end: detokenized in bulk
        except BaseException:
            for request_id in request_ids:  # leave the engine clean for the next call: no request, no output
                engine.abort_request(request_id)
                engine._outputs.pop(request_id, None)
            raise
        outputs = [engine.pop_output(request_id) for request_id in request_ids]
        for output in (output for output, no_text in zip(outputs, bare, strict=True) if no_text):
            _drop_text(output)
        return outputs

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template (or `chat_template`: a Jinja template, or the name of one of the model's)
        to one conversation or a list of them, then generate.
        continue_final_message: the reply continues the last message (vLLM's; no generation prompt then).
        vLLM's other keywords are taken at the value that changes nothing here, refused otherwise: the template
        renders text content ("auto" or "string" content format), with no LoRA and no multimodal input."""
        _no_lora(lora_request)
        if chat_template_content_format not in ("auto", "string"):
            raise InvalidRequestError("chat_template_content_format must be 'auto' or 'string': message content is "
                                      "rendered as text", param="chat_template_content_format")
        if mm_processor_kwargs:
            raise InvalidRequestError("mm_processor_kwargs is not supported: multimodal inputs are not accepted",
                                      param="mm_processor_kwargs")
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer and so no chat template", param="messages")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                      param="continue_final_message")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [tokenizer.render_chat(conversation, add_generation_prompt, tools,  # type: ignore[arg-type]
                                       continue_final_message, chat_template_kwargs, chat_template=chat_template)
                 for conversation in conversations]
        # the template writes the special tokens, so encoding adds none
        prompts: list[Prompt] = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text  # vLLM's chat outputs carry the rendered prompt
        return outputs

    def beam_search(self, prompts: Prompt | dict[str, Any] | Sequence[Prompt | dict[str, Any]],
                    params: BeamSearchParams, lora_request: Any = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """Beam search in the engine (the beams of every prompt batched together, sharing KV blocks): each
        prompt's beam_width best hypotheses. Prompts may also be vLLM's {"prompt": ...} or
        {"prompt_token_ids": [...]} dicts (with a "cache_salt" or not). concurrency_limit: at most this many prompts
        searched at once."""
        _no_lora(lora_request)
        if not isinstance(params, BeamSearchParams):  # a SamplingParams has no sampling_params() to call
            raise InvalidRequestError(f"beam_search takes a BeamSearchParams, not {type(params).__name__} (generate "
                                      "takes SamplingParams(use_beam_search=True, ...))", param="params")
        prompt_list = _as_prompt_list(prompts)
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise InvalidRequestError("concurrency_limit must be a positive integer or None",
                                      param="concurrency_limit")
        _check_beam_width(params.beam_width)
        chunk_len = concurrency_limit or len(prompt_list)
        try:
            outputs = [output for start in range(0, len(prompt_list), chunk_len)
                       for output in self._generate(prompt_list[start:start + chunk_len], params.sampling_params(),
                                                    None)]
        except InvalidRequestError as exc:
            if exc.param in ("n", "best_of"):  # SamplingParams' two names for the width: the caller set beam_width
                exc.param = "beam_width"
            raise
        # vLLM's text: tokenizer.decode(tokens), the prompt's and the generated tokens', special tokens kept
        hf = self.engine.tokenizer.hf if self.engine.tokenizer is not None else None
        return [BeamSearchOutput([BeamSearchSequence(tokens, hf.decode(tokens) if hf is not None else c.text,
                                                     c.cumulative_logprob or 0.0, c.score or 0.0, c.finish_reason,
                                                     c.stop_reason)
                                  for c in output.outputs
                                  for tokens in [output.prompt_token_ids + _beam_tokens(c, params)]])
                for output in outputs]

    def get_metrics(self) -> list[Metric]:
        """vLLM's: a snapshot of the engine's metrics as Counter and Gauge objects (pagoda.outputs, the shapes of
        vllm.v1.metrics.reader), named as the server's /metrics names them; always kept (vLLM's need
        disable_log_stats=False)."""
        return self.engine.metrics()

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prefix block, so that the next run prefills from scratch (benchmarks call it
        between runs). False, and nothing forgotten, while requests hold blocks (never between generate calls)."""
        if self.engine.has_unfinished_requests():
            return False
        self.engine.scheduler.blocks.reset_prefix_cache()
        return True

    # vLLM's pooling API: present, so that a ported script fails with a reason rather than an AttributeError
    def encode(self, *args: Any, **kwargs: Any) -> Any:
        _no_pooling("encode")

    def embed(self, *args: Any, **kwargs: Any) -> Any:
        _no_pooling("embed")

    def classify(self, *args: Any, **kwargs: Any) -> Any:
        _no_pooling("classify")

    def score(self, *args: Any, **kwargs: Any) -> Any:
        _no_pooling("score")

    def reward(self, *args: Any, **kwargs: Any) -> Any:
        _no_pooling("reward")

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Generate one prompt, yielding text as it is produced (the demo and tests use it)."""
        engine = self.engine
        if not getattr(sampling_params, "detokenize", True):
            raise InvalidRequestError("stream yields text: it needs detokenize=True", param="detokenize")
        request_id = engine.add_request(prompt, _frozen(sampling_params or SamplingParams()))
        try:
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    if delta.request_id == request_id:
                        yield delta
        finally:
            engine.abort_request(request_id)
            engine._outputs.pop(request_id, None)

    def _add_all(self, prompts: list[_PromptInput], params: list[SamplingParams], priorities: list[int]) -> list[str]:
        """Add every request or none: a bad prompt aborts the ones already queued."""
        request_ids: list[str] = []
        try:
            for prompt, sampling, priority in zip(prompts, params, priorities, strict=True):
                request_ids.append(self.engine.add_request(prompt.prompt, sampling, priority=priority,
                                                           cache_salt=prompt.cache_salt))
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
                self.engine.pop_output(request_id)
            raise
        return request_ids


def _check_beam_width(width: object) -> None:
    """BeamSearchParams.beam_width, which beam_search passes as both n and best_of, checked under its own name."""
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_N:
        raise InvalidRequestError(f"beam_width must be an integer in [1, {MAX_N}], got {width!r}", param="beam_width")


def _beam_tokens(completion: CompletionOutput, params: BeamSearchParams) -> list[int]:
    """A hypothesis's generated tokens as vLLM's beam_search returns them: a beam ends with "stop" only on its
    end-of-sequence or a stop token, which is left out unless include_stop_str_in_output."""
    ends_on_stop = completion.finish_reason == "stop" and completion.token_ids
    return completion.token_ids[:-1] if ends_on_stop and not params.include_stop_str_in_output else completion.token_ids


def _no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise InvalidRequestError("lora_request is not supported: LoRA adapters are not implemented",
                                  param="lora_request")


def _no_pooling(method: str) -> None:
    raise NotImplementedError(f"LLM.{method} is vLLM's pooling API, which pagoda does not implement: it serves "
                              "generative models only (generate, chat, beam_search)")


def _dict_prompt(prompt: PromptDict) -> _PromptInput:
    """vLLM's TextPrompt / TokensPrompt (with its cache_salt); a key pagoda cannot honour (multi_modal_data,
    prompt_embeds, ...) is refused rather than dropped."""
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
    if unknown:
        raise InvalidRequestError(f"prompt dict key(s) {unknown} are not supported: a prompt dict holds 'prompt' "
                                  "or 'prompt_token_ids', and may hold 'cache_salt'", param="prompt")
    cache_salt = prompt.get("cache_salt")
    # each key holds its own kind, checked here: the engine takes text and token ids alike, so ids under "prompt"
    # (or text under "prompt_token_ids") would otherwise run as the other kind of prompt
    if "prompt_token_ids" in prompt:
        token_ids = prompt["prompt_token_ids"]
        if not isinstance(token_ids, (list, tuple)):
            raise InvalidRequestError(f"a prompt dict's 'prompt_token_ids' must be a list of token ids, got "
                                      f"{type(token_ids).__name__}", param="prompt")
        return _PromptInput(list(token_ids), cache_salt)
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise InvalidRequestError(f"a prompt dict's 'prompt' must be a string (token ids go in "
                                      f"'prompt_token_ids'), got {type(prompt['prompt']).__name__}", param="prompt")
        return _PromptInput(prompt["prompt"], cache_salt)
    raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")


def _as_prompt_list(prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict]) -> list[_PromptInput]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [_PromptInput(prompts)]  # one prompt given as token ids
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequestError("prompts must be a non-empty string, token id list, prompt dict, or list of them",
                                  param="prompt")
    return [_dict_prompt(p) if isinstance(p, dict) else _PromptInput(p) for p in prompts]  # type: ignore[arg-type]


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int,
                frozen: bool = True) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [_frozen(params) if frozen else params] * count
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        # a dict of fields was read as a sequence of its keys: an AttributeError from deep in the engine
        raise InvalidRequestError("sampling_params must be a SamplingParams or a list of them, one per prompt, got "
                                  f"{type(params).__name__}", param="sampling_params")
    if len(params) != count:
        raise InvalidRequestError("sampling_params needs one entry per prompt", param="sampling_params")
    return [_frozen(p) if frozen else p for p in params]


def _drop_text(output: RequestOutput) -> None:
    """vLLM's detokenize=False: no text, and logprobs without their decoded_token."""
    for completion in output.outputs:
        completion.text = ""
        if completion.logprobs is not None:
            completion.logprobs = [_bare_logprobs(step) for step in completion.logprobs]
    if output.prompt_logprobs is not None:
        output.prompt_logprobs = [_bare_logprobs(step) if step is not None else None for step in output.prompt_logprobs]


def _bare_logprobs(step: dict[int, Logprob]) -> dict[int, Logprob]:
    return {token_id: Logprob(float(logprob), logprob.rank) for token_id, logprob in step.items()}


def _frozen(params: SamplingParams) -> SamplingParams:
    """What the engine keeps: vLLM's mutable SamplingParams as set now, the wire's frozen struct as it is (either
    refused where the offline engine cannot honour it, vllm_params.check_offline)."""
    frozen = params.wire() if isinstance(params, vllm_params.SamplingParams) else params
    vllm_params.check_offline(frozen)
    return frozen
