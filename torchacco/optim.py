"""AdamW: torch's, for replicated and FSDP parameters, and a sharded one over flat buffers.

`ShardedAdamW` owns one rank's fp32 slice of the flattened parameters and its moments.
`step()` commits an update; `peek()` returns the parameters the same update would give
without touching any state (ACCO's estimate, WP's prediction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from torchacco.config import Optimizer as OptimizerConfig


def no_weight_decay_ids(model: nn.Module) -> set[int]:
    """Norms, biases (ndim < 2) and embeddings (incl. a tied output head) get no decay."""
    ids = {id(p) for p in model.parameters() if p.ndim < 2}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            ids.add(id(module.weight))
    return ids


def build_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    skip = no_weight_decay_ids(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if id(p) not in skip], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if id(p) in skip], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
    )


@dataclass
class AdamWState:
    master: torch.Tensor  # fp32 parameters of this rank's shard
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0


class ShardedAdamW:
    """AdamW over a 1-D fp32 shard; decoupled weight decay on the `decay_ranges` only."""

    def __init__(self, master: torch.Tensor, decay_ranges: list[tuple[int, int]], cfg: OptimizerConfig):
        assert master.dtype == torch.float32 and master.ndim == 1
        self.state = AdamWState(master, torch.zeros_like(master), torch.zeros_like(master))
        self.decay_ranges = decay_ranges
        self.cfg = cfg

    def step(self, grad: torch.Tensor, lr: float) -> torch.Tensor:
        s = self.state
        s.step += 1
        self._update(s.master, s.exp_avg, s.exp_avg_sq, grad, lr, s.step)
        return s.master

    def peek(self, grad: torch.Tensor, lr: float, out: torch.Tensor | None = None,
             chunk: int = 1 << 22) -> torch.Tensor:
        """The master shard after `step(grad, lr)`, written into `out` (any dtype; a new fp32
        tensor by default), leaving m, v, step and master untouched. Works a chunk at a time,
        so its fp32 working memory is a few chunks, not copies of the shard's state."""
        s = self.state
        out = torch.empty_like(s.master) if out is None else out
        for start in range(0, s.master.numel(), chunk):
            part = slice(start, start + chunk)
            p, m, v = s.master[part].clone(), s.exp_avg[part].clone(), s.exp_avg_sq[part].clone()
            self._update(p, m, v, grad[part], lr, s.step + 1, offset=start)
            out[part].copy_(p)
        return out

    def _update(self, p, m, v, grad, lr, step, offset: int = 0) -> None:
        """One AdamW step on a slice of the shard that starts at `offset`."""
        c = self.cfg
        if c.weight_decay:
            for start, end in self.decay_ranges:
                lo, hi = max(start - offset, 0), min(end - offset, p.numel())
                if lo < hi:
                    p[lo:hi].mul_(1 - lr * c.weight_decay)
        m.mul_(c.beta1).add_(grad, alpha=1 - c.beta1)
        v.mul_(c.beta2).addcmul_(grad, grad, value=1 - c.beta2)
        bias1 = 1 - c.beta1**step
        denom = (v.sqrt() / math.sqrt(1 - c.beta2**step)).add_(c.eps)
        p.addcdiv_(m, denom, value=-lr / bias1)
