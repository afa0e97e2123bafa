"""WP, weight prediction: as DPU, computing at a predicted θ (the rounds in overlapped.py)."""

from __future__ import annotations

import dataclasses

from torchacco.parallel.overlapped import OVERLAPPED, Overlapped, Planner
from torchacco.parallel.sharded_job import COMMIT_AND_PREDICT


class WPPlanner(Planner):
    """Weight prediction: as DPU, but the compute runs at Opt(θ_{t+1}, ḡ_t), the last averaged
    gradient applied once more; θ itself stays in the master shards."""

    # between updates its compute parameters are not θ (untested with an outer step)
    traits = dataclasses.replace(OVERLAPPED, name="wp", why_not_in_replicas="its parameters between updates are not θ")
    kind = COMMIT_AND_PREDICT


WP = Overlapped.scheduled_by(WPPlanner)
