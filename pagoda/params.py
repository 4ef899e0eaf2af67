"""vLLM's SamplingParams for the offline API: the wire's struct, taking vLLM's shapes and checked where it is made."""

from __future__ import annotations

import copy

from pagoda.shared import messages
from pagoda.shared.errors import InvalidRequestError


class SamplingParams(messages.SamplingParams, frozen=False, omit_defaults=True, kw_only=True):
    """shared.messages.SamplingParams as vLLM users write it: `stop` may be one string, None stands for an empty
    list or map, seed=-1 for no seed and logprobs=True for 1, and a bad value raises InvalidRequestError (a
    ValueError naming the parameter) at construction, as vLLM's does. Mutable like vLLM's (its examples set
    fields after making one): LLM hands the engine a frozen copy (`wire`), normalized and checked again. The wire
    type stays without a __post_init__: msgspec would run it on every decode, and a worker must clamp a bad row
    alone rather than fail the whole plan (tests/reliability/test_isolation.py)."""

    # vLLM's: False leaves the output without text (and logprobs without decoded_token); LLM drops them
    detokenize: bool = True

    def __post_init__(self) -> None:
        self._normalize()
        self.validate(max_logprobs=-1)  # the logprobs bound is the engine's, checked when the request is added

    def _normalize(self) -> None:
        if isinstance(self.stop, str):  # left a str, each of its characters would be a stop string
            self.stop = [self.stop]
        for name, empty in (("stop", list), ("stop_token_ids", list), ("allowed_token_ids", list),
                            ("logit_bias", dict)):
            if getattr(self, name) is None:
                setattr(self, name, empty())
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:  # vLLM's: the chosen token's logprob, and one more
                setattr(self, name, 1)
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop strings need detokenize=True: they are matched in the text", param="stop")

    def wire(self) -> messages.SamplingParams:
        """A frozen copy for the engine, with what was set since construction normalized (not yet validated:
        the engine validates every request it is given); without `detokenize`, which LLM applies to the output."""
        self._normalize()
        fields = messages.SamplingParams.__struct_fields__
        return messages.SamplingParams(**{name: getattr(self, name) for name in fields})

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's SamplingParams.clone)."""
        return copy.deepcopy(self)
