"""Learning-rate schedules indexed by tokens consumed, not optimizer steps.

ACCO's batch per update varies with how much each worker accumulated, so the schedule
position is the (all-reduced) token count; for fixed-batch strategies it is the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenSchedule:
    peak_lr: float
    warmup_tokens: int
    total_tokens: int
    decay: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1

    def __call__(self, start: float, count: float = 0.0) -> float:
        """The learning rate of an update of `count` tokens after `start` tokens so far.

        Warm-up counts the update's own tokens (its first update is not at lr 0); decay is
        measured from `start` (with no warm-up, the first update is at the peak)."""
        if self.warmup_tokens and start < self.warmup_tokens:
            return self.peak_lr * min(1.0, (start + count) / self.warmup_tokens)
        if self.decay == "constant":
            return self.peak_lr
        span = max(1, self.total_tokens - self.warmup_tokens)
        progress = min(1.0, max(0.0, (start - self.warmup_tokens) / span))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1 - progress
        return self.peak_lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * shape)
