"""`[diloco] global_batch_moments`: a replica's AdamW and clipping as if they saw the global batch.

A replica's gradient ḡ averages N micro-batch gradients; the global batch's would average N·M (M replicas). Its
first moment is linear in ḡ, so the replicas' mean m is the global one, but E[ḡ²] exceeds E[G²] by the noise the
other replicas' batches would have averaged away: (1 − 1/M)·σ²/N per element, σ² a micro-batch gradient's variance.
One micro-batch's gradient g₁ estimates it without communication, as E[(g₁ − ḡ)²] = σ²·(1 − 1/N):

    v ← β2·v + (1 − β2)·max(ḡ² − k·(g₁ − ḡ)², ḡ² / M),   k = (1 − 1/M) / (N − 1)

and clipping reads max(‖ḡ‖² − k·‖g₁ − ḡ‖², ‖ḡ‖² / M), the global batch's expected squared norm. The floor is
E[G²] ≥ E[ḡ²] / M (pure noise): one update's estimate alone may be near 0, and AdamW would divide by it.
Micro-batches are taken as equal in tokens (fixed-length packed sequences); the ranks of a replica average their
(g₁ − ḡ)², so they agree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GlobalBatchMoments:
    def __init__(self, replicas: int, group: dist.ProcessGroup, group_size: int):
        self.replicas, self.group, self.group_size = replicas, group, group_size
        self.first: dict = {}

    def keep_first(self, params) -> None:
        """After the first micro-batch's backward (not yet reduced): its token-loss gradient sums."""
        self.first = {p: p.grad.detach().clone() for p in params if p.grad is not None}

    @torch.no_grad()
    def clip(self, params: list, micro_batches: int, tokens: float, max_norm: float) -> tuple[float, dict]:
        """With each .grad the replica's per-token mean ḡ over `micro_batches` and `tokens`: clip it as the global
        batch would be, and return (that norm, each parameter's square for AdamW's second moment)."""
        grads = [p.grad for p in params]
        deviation = [self.first[p] if p in self.first else torch.zeros_like(p.grad) for p in params]
        self.first = {}
        torch._foreach_mul_(deviation, micro_batches / tokens)  # g₁: the first micro-batch's sum over its T / N tokens
        torch._foreach_sub_(deviation, grads)
        torch._foreach_mul_(deviation, deviation)
        if self.group_size > 1:  # one all-reduce of the flattened squares
            flat = torch.cat([d.reshape(-1) for d in deviation])
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group)
            deviation = [f.view_as(d) for f, d in zip(flat.split([d.numel() for d in deviation]), deviation)]
        k = (1 - 1 / self.replicas) / (micro_batches - 1)
        own = torch._foreach_mul(grads, grads)
        squares = torch._foreach_add(own, deviation, alpha=-k)
        del deviation
        norm_sq = sum(s.double().sum() for s in squares).item()
        own_norm_sq = sum(s.double().sum() for s in own).item()
        norm = max(norm_sq, own_norm_sq / self.replicas) ** 0.5
        torch._foreach_mul_(own, 1 / self.replicas)
        torch._foreach_maximum_(squares, own)  # the floor: E[G²] ≥ E[ḡ²] / M
        if max_norm and norm > max_norm:
            f = max_norm / (norm + 1e-6)
            torch._foreach_mul_(grads, f)
            torch._foreach_mul_(squares, f * f)
        return norm, dict(zip(params, squares))
