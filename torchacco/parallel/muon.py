"""Muon over flat shards (ZeRO-1, ACCO, DPU, WP): torch's Muon on the hidden matrices, AdamW on the rest, where each
rank holds a contiguous slice of the flattened parameters, so a matrix may straddle ranks.

Newton–Schulz needs a matrix whole. A round: each rank steps its slice's momentum elementwise and writes its slice
of the Nesterov update into its slice of the job's output; a matrix inside one slice is orthogonalised there; the
few that straddle a slice boundary (at most two per rank) are assembled by point-to-point exchanges between the
ranks that share them, in bf16, the dtype Newton–Schulz reads its input in, so the result is torch's Muon's. Each
rank keeps its slice of the result. A tensor-parallel shard is gathered over its tp peers too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr
from torch.profiler import record_function

from torchacco.optim import AdamWState, ShardedAdamW, adamw_update, orthogonalise
from torchacco.parallel.collectives import exchange
from torchacco.parallel.flat import _dtensor_like, _local

if TYPE_CHECKING:
    from torchacco.config import Optimizer as OptimizerConfig
    from torchacco.parallel.flat import FlatParams


class ShardedMuon:
    """One rank's fp32 master slice; one fp32 buffer beside it (AdamW's first moment, Muon's momentum) and AdamW's
    second moment for the AdamW elements only. `step` and `peek` as `ShardedAdamW`'s; both exchange the straddling
    matrices' updates with the ranks that share them."""

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
        self.straddling = _straddling(flat, self.matrices)
        master = flat.initial_master
        self.state = AdamWState(master, torch.zeros_like(master), master.new_zeros(n_adamw))

    def step(self, grad, lr: float, scale: float = 1.0, out=None, predict: bool = False) -> torch.Tensor:
        """Commit one step (`out`: this rank's slice of the output, the new master); with `predict`, the slice one
        more step with the same gradient would give."""
        self.state.step += 1
        if predict:  # the round below overwrites `out`, which may be the gradient's own buffer
            grad = grad.to(torch.float32, copy=True)
        self._round(grad, lr, scale, out, self.state.step, commit=True)
        if predict:
            self._round(grad, lr, scale, out, self.state.step + 1, commit=False)
        return self.state.master

    def peek(self, grad, lr: float, scale=1.0, out=None) -> torch.Tensor:
        """The slice `step` would give, in `out`, leaving every state untouched (ACCO's estimate)."""
        self._round(grad, lr, scale, out, self.state.step + 1, commit=False)
        return out

    def _round(self, grad, lr: float, scale: float, send: torch.Tensor, step: int, commit: bool) -> None:
        """One step of every element of the slice into `send`; the state too if `commit`."""
        s = self.state
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
        wholes = self._assemble(send)
        for lo, hi, i, first in self.matrices:  # each reads its own update, then writes its slice of the result
            with record_function("torchacco/job/newton_schulz"):
                update = self._orthogonalised(wholes.get(i, send[lo:hi]), i, first, hi - lo)
            p = _maybe_copy(s.master[lo:hi], commit)
            p.mul_(1 - lr * self.cfg.weight_decay)
            p.add_(update, alpha=-_adjust_lr(lr, "match_rms_adamw", self.flat.params[i].shape))
            send[lo:hi].copy_(p)

    def _assemble(self, send: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each straddling matrix's whole update (bf16, flat) by parameter index: this rank's piece from `send`, the
        others' received from the ranks that hold them."""
        wholes, pieces = {}, []
        for i, (lo, hi), first, others in self.straddling:
            whole = torch.empty(_local(self.flat.params[i]).numel(), dtype=torch.bfloat16, device=send.device)
            mine = whole[first : first + hi - lo]
            mine.copy_(send[lo:hi])
            pieces += [(peer, mine, whole[a:b]) for peer, a, b in others]
            wholes[i] = whole
        with record_function("torchacco/job/muon_exchange"):
            exchange(pieces, group=self.flat.group)
        return wholes

    def _orthogonalised(self, update: torch.Tensor, i: int, first: int, n: int) -> torch.Tensor:
        """Elements [first, first + n) of parameter i's orthogonalised update, from its whole (local) flat update."""
        p = self.flat.params[i]
        local = update.view(_local(p).shape)
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


def _straddling(flat: FlatParams, matrices) -> list[tuple[int, tuple[int, int], int, list[tuple[int, int, int]]]]:
    """(parameter, its range in this rank's slice, its first element there, and for each other rank that holds a
    piece of it: (that rank, the piece's range in the matrix)) for each matrix of the slice that another slice
    shares. Every rank derives the same pieces from the layout, so the exchanges pair up without a handshake."""
    out, size = [], flat.shard_numel
    for lo, hi, i, first in matrices:
        start, n = flat.offsets[i], _local(flat.params[i]).numel()
        ranks = range(start // size, (start + n - 1) // size + 1)
        pieces = [(q, max(start, q * size) - start, min(start + n, (q + 1) * size) - start) for q in ranks]
        if len(pieces) > 1:
            out.append((i, (lo, hi), first, [piece for piece in pieces if piece[0] != flat.rank]))
    return out
