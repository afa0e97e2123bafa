"""Flat buffers: the trainable parameters as views into one contiguous tensor.

One contiguous buffer makes the optimizer-sharding collectives single calls
(reduce-scatter of gradients, all-gather of parameters) and gives each data-parallel
rank an equal slice. Padding makes the length a multiple of the world size, so any
world size works, including ranks whose slice is only padding.

Rank r's slice starts at r × ceil(numel / world): DTensor's layout for a 1-D tensor of
`numel` elements sharded over the ranks. So the fp32 master slice and the AdamW moments
are exactly the local shards of unpadded DTensors, which DCP can save and reshard onto
another world size. (That is why there is no extra alignment padding per rank.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from torchacco.optim import no_weight_decay_ids


class FlatParams:
    def __init__(self, model: nn.Module, group: dist.ProcessGroup, dtype: torch.dtype,
                 grad_dtype: torch.dtype = torch.float32):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # shared weights once
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        device = self.params[0].device
        skip = no_weight_decay_ids(model)

        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard_numel = -(-total // self.world)
        self.padded_numel = self.shard_numel * self.world
        shard_start = self.rank * self.shard_numel
        shard_end = shard_start + self.shard_numel

        # The fp32 master slice is taken from the model's own (fp32) initial values, so
        # ZeRO-1 starts exactly where a replicated optimizer would.
        self.params_buffer = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        master = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
        self.decay_ranges: list[tuple[int, int]] = []
        for p, start in zip(self.params, self.offsets):
            end = start + p.numel()
            self.params_buffer[start:end].copy_(p.detach().reshape(-1))
            lo, hi = max(start, shard_start), min(end, shard_end)
            if lo < hi:
                master[lo - shard_start:hi - shard_start].copy_(p.detach().reshape(-1)[lo - start:hi - start])
                if id(p) not in skip:
                    self.decay_ranges.append((lo - shard_start, hi - shard_start))
            p.data = self.params_buffer[start:end].view_as(p)
        self.initial_master = master

        self.grads = torch.zeros(self.padded_numel, dtype=grad_dtype, device=device)
        self.grad_views = [self.grads[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]
        for p, view in zip(self.params, self.grad_views):
            p.register_post_accumulate_grad_hook(self._make_hook(view))

    @staticmethod
    def _make_hook(view: torch.Tensor):
        def accumulate(param: torch.Tensor) -> None:
            view.add_(param.grad)
            param.grad = None  # the flat accumulator is the only gradient storage

        return accumulate

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-length flat tensor."""
        return full[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]

    def real_shard_numel(self) -> int:
        """Elements of this rank's slice that are parameters, not padding (possibly 0)."""
        return max(0, min(self.numel - self.rank * self.shard_numel, self.shard_numel))
