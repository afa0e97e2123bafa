"""Muon over flat shards (ZeRO-1, ACCO, DPU, WP): torch's Muon on the hidden matrices, AdamW on the rest, where each
rank holds a contiguous slice of the flattened parameters, so a matrix may straddle ranks.

Newton–Schulz needs a matrix whole. A round: each rank steps its slice's momentum elementwise and writes its slice
of the Nesterov update into the job's output buffer (which the job's final all-gather rewrites anyway); one
all-gather assembles every matrix on every rank; each rank orthogonalises the matrices its slice touches and keeps
its slice of the result. Newton–Schulz reads the update in bf16, so gathering it in the parameters' dtype (bf16 or
fp32) gives it the input torch's Muon gives it. A tensor-parallel shard is gathered over its tp peers too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr
from torch.profiler import record_function

from torchacco.optim import AdamWState, ShardedAdamW, adamw_update, orthogonalise
from torchacco.parallel.collectives import all_gather
from torchacco.parallel.flat import _dtensor_like, _local

if TYPE_CHECKING:
    from torchacco.config import Optimizer as OptimizerConfig
    from torchacco.parallel.flat import FlatParams


class ShardedMuon:
    """One rank's fp32 master slice; one fp32 buffer beside it (AdamW's first moment, Muon's momentum) and AdamW's
    second moment for the AdamW elements only. `step` and `peek` as `ShardedAdamW`'s, but `out` is the job's whole
    flat output buffer, and both are collectives over the dp group."""

    whole_out = True

    def __init__(self, flat: FlatParams, cfg: OptimizerConfig):
        self.flat, self.cfg = flat, cfg
        decay = set(flat.decay_ranges)
        self.matrices: list[tuple[int, int, int, int]] = []  # (lo, hi) in the slice, parameter, its first element
        self.adamw: list[tuple[int, int, int, bool]] = []  # (lo, hi) in the slice, start in exp_avg_sq, decay
        n_adamw = 0
        for i, first, (lo, hi) in flat._in_shard():
            if flat.hidden[i]:
                self.matrices.append((lo, hi, i, first))
            else:
                self.adamw.append((lo, hi, n_adamw, (lo, hi) in decay))
                n_adamw += hi - lo
        master = flat.initial_master
        self.state = AdamWState(master, torch.zeros_like(master), master.new_zeros(n_adamw))

    def step(self, grad, lr: float, scale: float = 1.0, out=None, predict: bool = False) -> torch.Tensor:
        """Commit one step (`out`: the whole output buffer, this rank's slice the new master); with `predict`,
        the slice one more step with the same gradient would give."""
        self.state.step += 1
        if predict:  # the round below overwrites `out`, which may be the gradient's own buffer
            grad = grad.to(torch.float32, copy=True)
        self._round(grad, lr, scale, out, self.state.step, commit=True)
        if predict:
            self._round(grad, lr, scale, out, self.state.step + 1, commit=False)
        return self.state.master

    def peek(self, grad, lr: float, scale=1.0, out=None) -> torch.Tensor:
        """The slice `step` would give, in `out`'s slice, leaving every state untouched (ACCO's estimate)."""
        self._round(grad, lr, scale, out, self.state.step + 1, commit=False)
        return self.flat.shard(out)

    def _round(self, grad, lr: float, scale: float, out: torch.Tensor, step: int, commit: bool) -> None:
        """One step of every element of the slice into `out`'s slice; the state too if `commit`."""
        s, send = self.state, self.flat.shard(out)
        for lo, hi, start, decay in self.adamw:
            p, m = _maybe_copy(s.master[lo:hi], commit), _maybe_copy(s.exp_avg[lo:hi], commit)
            v = _maybe_copy(s.exp_avg_sq[start : start + hi - lo], commit)
            g = ShardedAdamW._scaled(grad[lo:hi], scale)
            if decay:
                p.mul_(1 - lr * self.cfg.weight_decay)
            adamw_update(p, m, v, g, lr, step, self.cfg)
            send[lo:hi].copy_(p)
        for lo, hi, _, _ in self.matrices:  # torch's Muon: buf ← lerp(buf, g, 1 − μ), update ← lerp(g, buf, μ)
            g, buf = ShardedAdamW._scaled(grad[lo:hi], scale), _maybe_copy(s.exp_avg[lo:hi], commit)
            buf.lerp_(g, 1 - self.cfg.muon_momentum)
            send[lo:hi].copy_(g.lerp_(buf, self.cfg.muon_momentum))
        with record_function("torchacco/job/muon_all_gather"):
            all_gather(out, send, group=self.flat.group)
        for lo, hi, i, first in self.matrices:  # each reads its own range of `out`, then writes its slice of it
            with record_function("torchacco/job/newton_schulz"):
                update = self._orthogonalised(out, i, first, hi - lo)
            p = _maybe_copy(s.master[lo:hi], commit)
            p.mul_(1 - lr * self.cfg.weight_decay)
            p.add_(update, alpha=-_adjust_lr(lr, "match_rms_adamw", self.flat.params[i].shape))
            send[lo:hi].copy_(p)

    def _orthogonalised(self, out: torch.Tensor, i: int, first: int, n: int) -> torch.Tensor:
        """Elements [first, first + n) of parameter i's orthogonalised update, from its gathered update in `out`."""
        p, offset = self.flat.params[i], self.flat.offsets[i]
        local_shape = _local(p).shape
        local = out[offset : offset + local_shape.numel()].view(local_shape)
        if isinstance(p, DTensor):  # a tensor-parallel shard: the matrix over its tp peers
            ortho = orthogonalise(_dtensor_like(p, local).full_tensor(), self.cfg.ns_steps)
            ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None).to_local()
        else:
            ortho = orthogonalise(local, self.cfg.ns_steps)
        return ortho.reshape(-1)[first : first + n]

    def shards(self) -> dict[str, torch.Tensor]:
        """As `ShardedAdamW.shards`: exp_avg_sq spread over the whole slice (0 on matrices), so a checkpoint
        reshards as AdamW's does."""
        s = self.state
        self._spread = torch.zeros_like(s.master)  # DCP loads into it; `loaded` packs it back
        for lo, hi, start, _ in self.adamw:
            self._spread[lo:hi].copy_(s.exp_avg_sq[start : start + hi - lo])
        return {"master": s.master, "exp_avg": s.exp_avg, "exp_avg_sq": self._spread}

    def loaded(self, step: int) -> None:
        s = self.state
        s.step = step
        for lo, hi, start, _ in self.adamw:
            s.exp_avg_sq[start : start + hi - lo].copy_(self._spread[lo:hi])
        del self._spread


def _maybe_copy(t: torch.Tensor, commit: bool) -> torch.Tensor:
    """The state itself for a commit, a copy for a peek."""
    return t if commit else t.clone()
