"""DDP: torch's DistributedDataParallel, replicated parameters and AdamW, the gradient all-reduce
bucketed under the last micro-batch's backward."""

from __future__ import annotations

import contextlib

from torch.nn.parallel import DistributedDataParallel

from torchacco.blocks import unwrap
from torchacco.parallel.replicated import Replicated
from torchacco.parallel.strategy import MemoryParts, Traits


class DDP(Replicated):
    """torch DDP: replicated parameters, bucketed all-reduce overlapped with backward."""

    traits = Traits(
        "ddp",
        "all_reduce_in_backward",
        "gradient all-reduce and optimizer step",
        model_parallel=False,  # torch DDP cannot broadcast or bucket DTensor parameters, nor wrap pipeline stages
        autocast_compute=True,
    )

    def __init__(self, model, dims, plan, optimizer, bucket_cap_mb: float = 0.0, balance: bool = False):
        # an unset cap (None) is what gets torch's small first bucket; a given one makes every bucket that size
        wrapped = DistributedDataParallel(
            model, process_group=dims.dp_group, bucket_cap_mb=bucket_cap_mb or None, gradient_as_bucket_view=True
        )
        super().__init__(wrapped, dims, plan, optimizer, balance)

    @classmethod
    def memory(cls, numel, dp_size, param_dtype, reduce_dtype, options=None):
        # autocast keeps fp32 weights; the gradients are views of the fp32 buckets (gradient_as_bucket_view)
        return MemoryParts(weights=4 * numel, gradients=4 * numel, optimizer=8 * numel)

    @classmethod
    def from_config(cls, model, cfg, dims, plan, device):
        p = cfg.parallelism
        return cls(model, dims, plan, cfg.optimizer, p.bucket_cap_mb, p.balance_batches)

    def _sync(self, last):
        return contextlib.nullcontext() if last else self.model.no_sync()

    @contextlib.contextmanager
    def evaluation(self):
        yield unwrap(self.model)
