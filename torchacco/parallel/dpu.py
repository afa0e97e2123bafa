"""DPU, the delayed parameter update: each update applies the previous period's gradients, one
step stale, while the next period computes (the rounds in overlapped.py)."""

from __future__ import annotations

import dataclasses

from torchacco.parallel.overlapped import OVERLAPPED, Overlapped, Planner


class DPUPlanner(Planner):
    """A commit every round; the first `warmup` updates land before the next period (no staleness)."""

    def __init__(self, warmup: int):
        super().__init__()
        self.warmup = warmup

    def finished(self, s: Overlapped, finished):
        if s.commits < self.warmup:  # synchronous: the update lands before the next period
            s._launch(*s.planned)
            s.planned = None
            finished = s._finish()
        return finished


class DPU(Overlapped):
    """Delayed parameter update: θ_{t+1} = Opt(θ_t, g(θ_{t-1})), one step stale, overlapped.
    The first `[acco] dpu_warmup_steps` updates are synchronous (no staleness)."""

    # (not yet tested under DiLoCo's outer step)
    traits = dataclasses.replace(OVERLAPPED, name="dpu", replicas_refused="its parameters between updates are not θ")

    @classmethod
    def planner_for(cls, options, plan) -> Planner:
        return DPUPlanner(options.dpu_warmup_steps)
