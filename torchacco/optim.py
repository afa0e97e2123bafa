"""AdamW: torch's, for replicated and FSDP parameters, and a sharded one over flat buffers.

`ShardedAdamW` owns one rank's fp32 slice of the flattened parameters and its moments; `step()` commits an
update, `peek()` returns the parameters it would give without touching any state (ACCO's estimate).

With `[optimizer] slow_beta`, both keep a second, slow first moment s (MT-DAO, arXiv 2510.05361) and step along
(1 − ω)·m̂ + ω·ŝ, both bias-corrected: a direction that remembers more than β1's few updates, which is what the
replicas of local-update schedules lose between syncs.
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
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return embeddings | {id(p) for p in model.parameters() if p.ndim < 2}


def build_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """torch's AdamW, or `SlowMomentumAdamW` with `slow_beta`."""
    skip = no_weight_decay_ids(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if id(p) not in skip], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if id(p) in skip], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.slow_beta:
        return SlowMomentumAdamW(groups, cfg)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def adamw_update(p, m, v, grad, lr: float, step: int, cfg: OptimizerConfig, slow=None, decay: float = 0.0) -> None:
    """One AdamW step in place, elementwise (so any slice of a tensor steps as the whole would);
    with `slow`, the slow moment is mixed into the direction. `decay` is the weight decay of `p`."""
    if decay:
        p.mul_(1 - lr * decay)
    m.mul_(cfg.beta1).add_(grad, alpha=1 - cfg.beta1)
    v.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
    bias1 = 1 - cfg.beta1**step
    denom = v.sqrt().div_(math.sqrt(1 - cfg.beta2**step)).add_(cfg.eps)
    if slow is None:
        p.addcdiv_(m, denom, value=-lr / bias1)
        return
    w = cfg.slow_weight
    slow.mul_(cfg.slow_beta).add_(grad, alpha=1 - cfg.slow_beta)
    direction = m.mul((1 - w) / bias1).add_(slow, alpha=w / (1 - cfg.slow_beta**step))
    p.addcdiv_(direction, denom, value=-lr)


class SlowMomentumAdamW(torch.optim.Optimizer):
    """AdamW with the slow first moment, for replicated and FSDP parameters (DTensors included):
    `adamw_update` per parameter, so ZeRO-1's sharded steps equal DDP's."""

    def __init__(self, groups: list[dict], cfg: OptimizerConfig):
        super().__init__(groups, {"lr": cfg.lr, "weight_decay": cfg.weight_decay})
        self.cfg = cfg

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    for name in ("exp_avg", "exp_avg_sq", "exp_avg_slow"):
                        state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                adamw_update(
                    p, state["exp_avg"], state["exp_avg_sq"], p.grad, group["lr"], int(state["step"].item()),
                    self.cfg, slow=state["exp_avg_slow"], decay=group["weight_decay"],
                )  # fmt: skip


@dataclass
class AdamWState:
    master: torch.Tensor  # fp32 parameters of this rank's shard
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0
    exp_avg_slow: torch.Tensor | None = None  # with [optimizer] slow_beta


class ShardedAdamW:
    """AdamW over a 1-D fp32 shard; decoupled weight decay on the `decay_ranges` only.

    The gradient (any dtype) is scaled (1 / token count, clipping) as it is read, a chunk at a time, and `out`
    (any dtype) may be the gradient's own buffer, since each chunk is read before it is written: an update's
    working memory is a few chunks, not fp32 copies of the shard, beside the next micro-batch's activations.
    """

    def __init__(self, master: torch.Tensor, decay_ranges: list[tuple[int, int]], cfg: OptimizerConfig):
        assert master.dtype == torch.float32 and master.ndim == 1
        slow = torch.zeros_like(master) if cfg.slow_beta else None
        self.state = AdamWState(master, torch.zeros_like(master), torch.zeros_like(master), exp_avg_slow=slow)
        self.decay_ranges, self.cfg = decay_ranges, cfg

    def step(self, grad, lr: float, scale: float = 1.0, out=None, predict: bool = False, chunk=None) -> torch.Tensor:
        """Commit one step with the gradient `grad * scale`: master, m, v and step advance. `out` receives the
        new master shard, or with `predict` the shard one more step with the same gradient would give (weight
        prediction). Returns the master shard."""
        s = self.state
        s.step += 1
        for part, offset in self._chunks(chunk):
            g = self._scaled(grad[part], scale)
            p = self._update(self._slices(part), g, lr, s.step, offset)
            if predict:
                p = self._update(self._slices(part, clone=True), g, lr, s.step + 1, offset)
            if out is not None:
                out[part].copy_(p)
        return s.master

    def peek(self, grad, lr: float, scale=1.0, out=None, chunk=None) -> torch.Tensor:
        """The master shard after `step(grad, lr, scale)`, written into `out` (a new fp32 tensor by default),
        leaving m, v, step and master untouched (ACCO's estimate)."""
        s = self.state
        out = torch.empty_like(s.master) if out is None else out
        for part, offset in self._chunks(chunk):
            g = self._scaled(grad[part], scale)
            out[part].copy_(self._update(self._slices(part, clone=True), g, lr, s.step + 1, offset))
        return out

    def _chunks(self, chunk: int | None):
        """(slice, offset) over the shard; by default a 32nd of it, between 64 Ki and 4 Mi elements: bounded
        working memory without thousands of tiny kernels."""
        n = self.state.master.numel()
        chunk = chunk or min(max(-(-n // 32), 1 << 16), 1 << 22)
        for start in range(0, n, chunk):
            yield slice(start, start + chunk), start

    @staticmethod
    def _scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
        g = grad.to(torch.float32, copy=True)  # a copy: `out` may overwrite grad's buffer
        return g.mul_(scale) if scale != 1.0 else g

    def _slices(self, part: slice, clone: bool = False) -> tuple:
        """(master, m, v, slow moment or None) over `part`: views of the state, or copies."""
        s = self.state
        slow = None if s.exp_avg_slow is None else s.exp_avg_slow[part]
        views = (s.master[part], s.exp_avg[part], s.exp_avg_sq[part], slow)
        return tuple(None if t is None else t.clone() for t in views) if clone else views

    def _update(self, slices: tuple, grad, lr, step, offset: int) -> torch.Tensor:
        """One AdamW step on (p, m, v, slow), a slice of the shard that starts at `offset`; returns p."""
        p, m, v, slow = slices
        if self.cfg.weight_decay:
            for start, end in self.decay_ranges:
                lo, hi = max(start - offset, 0), min(end - offset, p.numel())
                if lo < hi:
                    p[lo:hi].mul_(1 - lr * self.cfg.weight_decay)
        adamw_update(p, m, v, grad, lr, step, self.cfg, slow)
        return p
