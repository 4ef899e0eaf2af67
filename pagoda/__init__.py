"""pagoda: an LLM inference server with a paged KV cache, continuous batching and an OpenAI-compatible API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.params import GuidedDecodingParams, RequestOutputKind, SamplingParams
from pagoda.shared.errors import ContextLengthError, InvalidRequestError, ModelNotFoundError, PagodaError
from pagoda.shared.messages import RepetitionDetection, StructuredOutputs

StructuredOutputsParams = StructuredOutputs  # vLLM's name for the same thing
RepetitionDetectionParams = RepetitionDetection  # vLLM's (vllm.sampling_params.RepetitionDetectionParams)

if TYPE_CHECKING:
    from pagoda.llm import LLM, BeamSearchParams

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchParams", "SamplingParams", "StructuredOutputs", "StructuredOutputsParams",
           "RepetitionDetectionParams",
           "GuidedDecodingParams", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "Logprob",
           "PagodaError", "InvalidRequestError", "ContextLengthError",
           "ModelNotFoundError", "__version__"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; the api process imports pagoda.* and must not load it.
    if name in ("LLM", "BeamSearchParams"):
        from pagoda import llm

        return getattr(llm, name)
    raise AttributeError(name)
