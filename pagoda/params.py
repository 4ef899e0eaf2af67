"""vLLM's SamplingParams for the offline API: the wire's struct, taking vLLM's shapes and checked where it is made."""

from __future__ import annotations

import msgspec

from pagoda.shared import messages


class SamplingParams(messages.SamplingParams, frozen=True, omit_defaults=True, kw_only=True):
    """shared.messages.SamplingParams as vLLM users write it: `stop` may be one string, None stands for an empty
    list or map, and a bad value raises InvalidRequestError (a ValueError naming the parameter) at construction,
    as vLLM's does. The wire type stays without a __post_init__: msgspec would run it on every decode, and a
    worker must clamp a bad row alone rather than fail the whole plan (tests/reliability/test_isolation.py)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # left a str, each of its characters would be a stop string
            msgspec.structs.force_setattr(self, "stop", [self.stop])
        for name, empty in (("stop", list), ("stop_token_ids", list), ("allowed_token_ids", list),
                            ("logit_bias", dict)):
            if getattr(self, name) is None:
                msgspec.structs.force_setattr(self, name, empty())
        self.validate(max_logprobs=-1)  # the logprobs bound is the engine's, checked when the request is added
