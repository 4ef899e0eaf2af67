"""The benchmark workload: seeded random prompts of given lengths, the same for pagoda and every peer."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Workload:
    num_prompts: int = 256
    input_len: int = 512
    output_len: int = 256
    input_len_jitter: float = 0.0  # lengths uniform in input_len * [1 - jitter, 1 + jitter]
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """Token ids away from the ends of the vocabulary, where special tokens usually sit."""
        rng = random.Random(self.seed)
        low, high = min(100, vocab_size // 4), max(vocab_size - 300, vocab_size // 2)
        lengths = [max(1, round(self.input_len * (1 + rng.uniform(-self.input_len_jitter, self.input_len_jitter))))
                   for _ in range(self.num_prompts)]
        return [[rng.randrange(low, high) for _ in range(length)] for length in lengths]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
