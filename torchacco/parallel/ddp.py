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
    def gathered_memory(cls, parallelism, block_numel, root_numel, blocks, param_dtype, group=1):
        # autocast's compute-dtype copy of every weight, saved by forward for backward
        numel = block_numel * blocks + root_numel
        return numel * param_dtype.itemsize if param_dtype.itemsize < 4 else 0.0

    @classmethod
    def accumulation_memory(cls, parallelism, numel, micro_batches):
        # torch makes the gradients views of its fp32 buckets at the first synchronised backward: the first update's
        # no_sync micro-batches accumulate into gradients of their own beside the buckets
        return 2 * 4 * numel if micro_batches > 1 else 0.0

    @classmethod
    def from_config(cls, model, dims, plan, device, *, parallelism, optimizer, **_):
        return cls(model, dims, plan, optimizer, parallelism.bucket_cap_mb, parallelism.balance_batches)

    def _sync(self, last):
        return contextlib.nullcontext() if last else self.model.no_sync()

    @contextlib.contextmanager
    def evaluation(self):
        yield unwrap(self.model)
