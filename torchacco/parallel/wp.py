"""WP, weight prediction: as DPU, computing at a predicted θ (the rounds in overlapped.py)."""

from __future__ import annotations

from torchacco.parallel.overlapped import Overlapped
from torchacco.parallel.sharded_job import COMMIT_AND_PREDICT


class WP(Overlapped):
    """Weight prediction: as DPU, but the compute runs at Opt(θ_{t+1}, ḡ_t), the last averaged
    gradient applied once more; θ itself stays in the master shards."""

    name = "wp"
    supports_replicas = False  # between updates its compute parameters are not θ (untested with an outer step)

    def _plan(self, finished):
        return COMMIT_AND_PREDICT, False
