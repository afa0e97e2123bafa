"""AdamW: torch's, for replicated and FSDP parameters, and a sharded one over flat buffers.

`ShardedAdamW` owns one rank's fp32 slice of the flattened parameters and its moments.
`step()` commits an update; `peek()` returns the parameters the same update would give
without touching any state (ACCO's estimate, WP's prediction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:
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
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


@dataclass
class AdamWState:
    master: torch.Tensor  # fp32 parameters of this rank's shard
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0


class ShardedAdamW:
    """AdamW over a 1-D fp32 shard; decoupled weight decay on the `decay_ranges` only.

    The gradient may be in any dtype and is scaled (1 / token count, clipping) as it is read;
    updates work a chunk of the shard at a time, and `out` (any dtype) may be the gradient's
    own buffer, since each chunk is read before it is written. So an update's working memory
    is a few chunks, not fp32 copies of the shard: it runs beside the next micro-batch's
    activations in the overlapped schedules.
    """

    def __init__(self, master: torch.Tensor, decay_ranges: list[tuple[int, int]], cfg: OptimizerConfig):
        assert master.dtype == torch.float32 and master.ndim == 1
        self.state = AdamWState(master, torch.zeros_like(master), torch.zeros_like(master))
        self.decay_ranges = decay_ranges
        self.cfg = cfg

    def step(
        self,
        grad: torch.Tensor,
        lr: float,
        scale: float = 1.0,
        out: torch.Tensor | None = None,
        predict: bool = False,
        chunk: int | None = None,
    ) -> torch.Tensor:
        """Commit one step with the gradient `grad * scale`: master, m, v and step advance. `out`
        receives the new master shard — or, with `predict`, the shard one more step with the same
        gradient would give (weight prediction). Returns the master shard."""
        s = self.state
        s.step += 1
        for part, offset in self._chunks(chunk):
            g = self._scaled(grad[part], scale)
            p, m, v = s.master[part], s.exp_avg[part], s.exp_avg_sq[part]
            self._update(p, m, v, g, lr, s.step, offset)
            if predict:
                p, m, v = p.clone(), m.clone(), v.clone()
                self._update(p, m, v, g, lr, s.step + 1, offset)
            if out is not None:
                out[part].copy_(p)
        return s.master

    def peek(
        self,
        grad: torch.Tensor,
        lr: float,
        scale: float = 1.0,
        out: torch.Tensor | None = None,
        chunk: int | None = None,
        grad_weight: float = 1.0,
        damping: float = 1.0,
    ) -> torch.Tensor:
        """The master shard after `step(grad, lr, scale)`, written into `out` (a new fp32 tensor
        by default), leaving m, v, step and master untouched (ACCO's estimate).

        ACCO's estimate variants (`[acco] estimate_grad_weight`, `estimate_damping`): the gradient
        stepped with is `w · grad·scale + (1 − w) · m̂`, m̂ the bias-corrected first moment (the
        smoothed past gradients; before any commit there is none and w is 1); the result is
        `θ + γ · (Opt(θ, ·) − θ)`. w = γ = 1 is the plain step."""
        s = self.state
        out = torch.empty_like(s.master) if out is None else out
        w = grad_weight if s.step > 0 else 1.0
        for part, offset in self._chunks(chunk):
            g = self._scaled(grad[part], scale)
            p, m, v = s.master[part].clone(), s.exp_avg[part].clone(), s.exp_avg_sq[part].clone()
            if w != 1.0:
                g.mul_(w).add_(m, alpha=(1 - w) / (1 - self.cfg.beta1**s.step))
            self._update(p, m, v, g, lr, s.step + 1, offset)
            if damping != 1.0:
                theta = s.master[part]
                p.sub_(theta).mul_(damping).add_(theta)
            out[part].copy_(p)
        return out

    def _chunks(self, chunk: int | None):
        """(slice, offset) over the shard. By default a 32nd of it, between 64 Ki and 4 Mi
        elements: bounded working memory without thousands of tiny kernels on a large shard."""
        n = self.state.master.numel()
        chunk = chunk or min(max(-(-n // 32), 1 << 16), 1 << 22)
        for start in range(0, n, chunk):
            yield slice(start, start + chunk), start

    @staticmethod
    def _scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
        g = grad.to(torch.float32, copy=True)  # a copy: `out` may overwrite grad's buffer
        return g.mul_(scale) if scale != 1.0 else g

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
        denom = v.sqrt().div_(math.sqrt(1 - c.beta2**step)).add_(c.eps)
        p.addcdiv_(m, denom, value=-lr / bias1)
