"""DPU, the delayed parameter update: each update applies the previous period's gradients, one
step stale, while the next period computes (the rounds in overlapped.py)."""

from __future__ import annotations

import dataclasses

from torchacco.parallel.overlapped import OVERLAPPED, Overlapped, Planner


class DPUPlanner(Planner):
    """Delayed parameter update: θ_{t+1} = Opt(θ_t, g(θ_{t-1})), one step stale, overlapped: a commit every round.
    The first `[acco] dpu_warmup_steps` updates are synchronous (no staleness)."""

    # (not yet tested under DiLoCo's outer step)
    traits = dataclasses.replace(OVERLAPPED, name="dpu", why_not_in_replicas="its parameters between updates are not θ")

    def __init__(self, options, plan):
        self.warmup = options.dpu_warmup_steps

    def finished(self, s: Overlapped, finished):
        if s.commits < self.warmup:  # synchronous: the update lands before the next period
            s.launch_planned()
            finished = s.finish()
        return finished


DPU = Overlapped.scheduled_by(DPUPlanner)
