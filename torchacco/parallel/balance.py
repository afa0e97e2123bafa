"""Balanced batches: each update's micro-batches split between the data-parallel ranks by their
measured speed, the global batch fixed (`[parallelism] balance_batches`; ACCO's `balanced` mode).

A slow GPU gets fewer micro-batches, so the ranks finish together (as Cannikin, arXiv 2402.05302, for DDP); the
update, normalised by the all-reduced token count, is the same whatever the split. The speeds come from the
previous updates' gathered counts, so every rank plans alike without a collective of its own.
"""

from __future__ import annotations

import heapq


class SpeedSplit:
    def __init__(self, per_rank: int, world: int, rank: int, minimum: int = 0):
        self.per_rank, self.world, self.rank = per_rank, world, rank
        self.minimum = minimum  # micro-batches every rank keeps (DDP's all-reduce needs one backward per rank)
        self.split: list[int] | None = None  # micro-batches per rank, once every rank has been measured
        self.seconds: list[float | None] = [None] * world  # measured seconds per micro-batch, per rank

    def count(self) -> int:
        """This rank's micro-batches in the next period."""
        return self.split[self.rank] if self.split else self.per_rank

    def observe(self, micro_batches: list[int], compute_s: list[float]) -> None:
        """Fold in a finished update's per-rank micro-batches and compute seconds (gathered: the same
        on every rank), and plan the next periods."""
        known = self.seconds
        for r, (n, seconds) in enumerate(zip(micro_batches, compute_s)):
            if n > 0 and seconds > 0:
                known[r] = seconds / n if known[r] is None else 0.5 * known[r] + 0.5 * seconds / n
            elif known[r] is not None:
                # No measurement (a rank left without work): its estimate drifts faster each round, so it
                # gets a micro-batch again and is measured anew, instead of idling on a stale reading.
                known[r] *= 0.8
        if all(s is not None for s in known):
            self.split = split_by_speed(self.per_rank * self.world, known, self.minimum)

    def state_dict(self) -> dict:
        seconds = [-1.0 if s is None else s for s in self.seconds]
        return {"split": list(self.split or []), "seconds_per_micro_batch": seconds}

    def load_state_dict(self, state: dict) -> None:
        self.split = list(state.get("split", [])) or None
        seconds = state.get("seconds_per_micro_batch", [])
        if len(seconds) == self.world:
            self.seconds = [None if s < 0 else s for s in seconds]


def split_by_speed(total: int, seconds_per_micro_batch: list[float], minimum: int = 0) -> list[int]:
    """Micro-batches per rank, `total` in all and at least `minimum` each, that minimise the time of the rank finishing
    last: each one goes to the rank that would finish it soonest (optimal for equal micro-batches)."""
    counts = [minimum] * len(seconds_per_micro_batch)
    finish = [((minimum + 1) * s, r) for r, s in enumerate(seconds_per_micro_batch)]  # (finish with one more, rank)
    heapq.heapify(finish)
    for _ in range(total - minimum * len(counts)):
        _, r = heapq.heappop(finish)
        counts[r] += 1
        heapq.heappush(finish, ((counts[r] + 1) * seconds_per_micro_batch[r], r))
    return counts
