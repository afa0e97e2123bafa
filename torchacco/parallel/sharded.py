"""The sharded-optimizer job: the one communication round ZeRO-1, ACCO, DPU and WP share.

all-reduce counts → reduce-scatter gradients → normalise by the global count → clip →
AdamW step (commit) or peek (estimate) on this rank's fp32 shard → all-gather parameters.
ZeRO-1 runs it synchronously after the last micro-batch; the overlapped schedules run it
beside the next compute period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from torchacco.optim import ShardedAdamW
from torchacco.parallel.flat import FlatParams

# torch 2.13 renamed the single-tensor collectives; keep working on older releases.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class UpdateResult:
    tokens: float  # global token count behind the update
    grad_norm: float  # before clipping
    lr: float
    committed: bool


def reduce_update_gather(
    flat: FlatParams,
    opt: ShardedAdamW,
    grads: torch.Tensor,  # full flat sum-of-token-loss gradients of this rank (the send buffer)
    local_tokens: float,
    lr_for: Callable[[float], float],  # global token count of this update -> learning rate
    commit: bool,
    out: torch.Tensor,  # full flat buffer that receives the new parameters
    max_norm: float,
) -> UpdateResult:
    group = flat.group
    grad = torch.empty(flat.shard_numel, dtype=grads.dtype, device=grads.device)
    reduce_scatter(grad, grads, group=group)
    grad = grad.float()

    # One all-reduce for both: ‖Σ G‖² over the shards and the token count N; ‖Σ G / N‖ follows.
    totals = torch.stack([grad.double().square().sum(), grad.new_tensor(local_tokens, dtype=torch.float64)])
    dist.all_reduce(totals, group=group)
    tokens = totals[1].item()
    if tokens <= 0:
        raise RuntimeError("no tokens contributed to this update on any rank (all labels masked?)")
    grad.div_(tokens)
    grad_norm = math.sqrt(totals[0].item()) / tokens
    if max_norm and grad_norm > max_norm:
        grad.mul_(max_norm / (grad_norm + 1e-6))

    lr = lr_for(tokens)
    new = opt.step(grad, lr) if commit else opt.peek(grad, lr)
    all_gather(out, new.to(out.dtype), group=group)
    return UpdateResult(tokens, grad_norm, lr, commit)
