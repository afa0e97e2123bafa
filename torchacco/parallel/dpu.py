"""DPU, the delayed parameter update: each update applies the previous period's gradients, one
step stale, while the next period computes (the rounds in overlapped.py)."""

from __future__ import annotations

import torch

from torchacco.device import Device
from torchacco.parallel.overlapped import Overlapped, OverlappedOptions
from torchacco.parallel.sharded_job import COMMIT


class DPU(Overlapped):
    """Delayed parameter update: θ_{t+1} = Opt(θ_t, g(θ_{t-1})), one step stale, overlapped.
    The first `[acco] dpu_warmup_steps` updates are synchronous (no staleness)."""

    name = "dpu"
    supports_replicas = False  # not yet tested under DiLoCo's outer step

    def __init__(self, model, dims, plan, optimizer, acco: OverlappedOptions, device: Device, reduce_dtype=None):
        super().__init__(model, dims, plan, optimizer, acco, device, reduce_dtype or torch.float32)
        self.warmup = acco.dpu_warmup_steps

    def _plan(self, finished):
        return COMMIT, False

    def step(self, counts):
        finished = super().step(counts)
        if self.commits < self.warmup:  # synchronous: the update lands before the next period
            self._launch(*self.planned)
            self.planned = None
            finished = self._finish()
        return finished
