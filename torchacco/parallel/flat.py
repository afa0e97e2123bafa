"""Flat buffers: the trainable parameters as views into one contiguous tensor, so the optimizer-sharding
collectives are single calls and each data-parallel rank gets an equal slice (padded to a multiple of the world
size: any world size works, even ranks whose slice is only padding).

Rank r's slice starts at r × ceil(numel / world), DTensor's layout of a 1-D tensor sharded over the ranks: the
fp32 master slice and the AdamW moments are the local shards of unpadded DTensors, which DCP can reshard onto
another world size (hence no alignment padding per rank). Under tensor or pipeline parallelism the buffer holds
this rank's local shards, and its dp group's buffers line up element for element.
"""

from __future__ import annotations

import hashlib
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchacco.optim import hidden_matrix_ids, no_weight_decay_ids
from torchacco.parallel.dims import ParallelDims, _model_parallel_group


def padded_numel(numel: int, world: int) -> int:
    """The flat buffers' length: `numel` padded to a multiple of the world size (every rank an equal slice)."""
    return -(-numel // world) * world


class FlatParams:
    def __init__(self, model: nn.Module, dims: ParallelDims, dtype: torch.dtype, grad_dtype: torch.dtype):
        # Model parallelism: ‖g‖² and the loss are summed over mp_group (the tp × pp block), where tp-replicated
        # parameters count 1/tp each and one rank of the block (owns_loss: tp rank 0) reports the loss. The job's
        # block group is its own: an overlapped job's thread issues on it, the main thread on block_group, tp, pp.
        self.group, self.block_group = dims.dp_group, dims.mp_group
        self.mp_group = None if dims.mp_group is None else _model_parallel_group(dims.mesh, dims.tp_size, dims.pp_size,
                                                                                 dims.timeout)  # fmt: skip
        self.tp, self.owns_loss = dims.tp_size, dims.tp_rank == 0
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # shared weights once
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        hidden = hidden_matrix_ids(model)
        self.hidden = [id(p) in hidden for p in self.params]  # Muon's matrices ([optimizer] name = "muon")
        local = [_local(p) for p in self.params]
        *self.offsets, self.numel = itertools.accumulate((t.numel() for t in local), initial=0)
        self.padded_numel = padded_numel(self.numel, self.world)
        self.shard_numel = self.padded_numel // self.world
        self.params_buffer = torch.zeros(self.padded_numel, dtype=dtype, device=local[0].device)
        self.initial_master = self._shard_ranges(model, local)
        self._place_parameters(model, local)
        self.grads = torch.zeros(self.padded_numel, dtype=grad_dtype, device=local[0].device)
        grad_views = [self.grads[o : o + t.numel()].view_as(t) for t, o in zip(local, self.offsets)]
        for p, view in zip(self.params, grad_views):
            if isinstance(p, DTensor) or view.dtype != p.dtype:
                p.register_post_accumulate_grad_hook(self._make_hook(view))
            else:
                p.grad = view  # autograd adds into an existing .grad in place: no copy, no hook

    def _in_shard(self):
        """(index, first element in the slice, range in the slice) of each parameter in this rank's slice."""
        start = self.rank * self.shard_numel
        for i, (p, offset) in enumerate(zip(self.params, self.offsets)):
            lo, hi = max(offset, start), min(offset + _local(p).numel(), start + self.shard_numel)
            if lo < hi:
                yield i, lo - offset, (lo - start, hi - start)

    def _shard_ranges(self, model: nn.Module, local: list[torch.Tensor]) -> torch.Tensor:
        """This rank's fp32 master slice, from the model's own (fp32) initial values so ZeRO-1
        starts exactly where a replicated optimizer would; and the slice's ranges that get weight
        decay and that tensor parallelism replicates."""
        skip = no_weight_decay_ids(model)
        master = torch.zeros(self.shard_numel, dtype=torch.float32, device=local[0].device)
        self.decay_ranges: list[tuple[int, int]] = []
        self.replicated_ranges: list[tuple[int, int]] = []  # in the shard: tp-replicated parameters
        for i, first, (lo, hi) in self._in_shard():
            p = self.params[i]
            master[lo:hi].copy_(local[i].detach().reshape(-1)[first : first + hi - lo])
            if id(p) not in skip:
                self.decay_ranges.append((lo, hi))
            if self.tp > 1 and not _tp_sharded(p):
                self.replicated_ranges.append((lo, hi))
        return master

    def _place_parameters(self, model: nn.Module, local: list[torch.Tensor]) -> None:
        """Copy each parameter into the flat buffer and make it a view of it."""
        for i, (name, p, t, start) in enumerate(zip(self.names, self.params, local, self.offsets)):
            view = self.params_buffer[start : start + t.numel()].view_as(t)
            view.copy_(t.detach())
            if isinstance(p, DTensor):
                # A new DTensor parameter over the view, in the module's slot (torch.compile
                # cannot trace a DTensor whose local tensor was swapped in place).
                self.params[i] = nn.Parameter(_dtensor_like(p, view), p.requires_grad)
                path, _, attr = name.rpartition(".")
                setattr(model.get_submodule(path), attr, self.params[i])
            else:
                p.data = view

    @staticmethod
    def _make_hook(view: torch.Tensor):
        def accumulate(param: torch.Tensor) -> None:
            grad = param.grad
            if isinstance(grad, DTensor):
                # A replicated weight used on sequence shards (norms) gets a partial sum per
                # rank: complete it (a small all-reduce over tp) so replicas stay identical.
                grad = grad.redistribute(param.device_mesh, param.placements).to_local()
            view.add_(grad)
            param.grad = None  # the flat accumulator is the only gradient storage

        return accumulate

    def sq_norm(self, grad_shard: torch.Tensor) -> torch.Tensor:
        """This rank's share of ‖g‖²: tp-replicated parameters count 1/tp (all tp ranks hold them)."""
        total = _sq_norm(grad_shard)
        for lo, hi in self.replicated_ranges:
            total -= (1 - 1 / self.tp) * _sq_norm(grad_shard[lo:hi])
        return total

    def model_parallel_sum(self, sq_norm: float, loss_sum: float) -> tuple[float, float]:
        """‖g‖² over every parameter of the model and the loss, from the data-parallel sums."""
        if self.mp_group is None:
            return sq_norm, loss_sum
        device = self.params_buffer.device
        both = torch.tensor([sq_norm, loss_sum if self.owns_loss else 0.0], dtype=torch.float64, device=device)
        dist.all_reduce(both, group=self.mp_group)
        return tuple(both.tolist())

    def layout(self) -> str:
        """A digest of the names and local shapes the buffers of one model replica (the tp × pp
        block) hold: the same on every rank, so a mismatch stops all of them, and independent of
        dp, so a checkpoint can reshard onto another number of replicas."""
        if not hasattr(self, "_layout"):
            text = ";".join(f"{n}:{tuple(_local(p).shape)}" for n, p in zip(self.names, self.params))
            texts = [None] * dist.get_world_size(self.block_group)
            dist.all_gather_object(texts, text, group=self.block_group)
            self._layout = hashlib.sha1("|".join(texts).encode()).hexdigest()
        return self._layout

    def full_params(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Full tensors by name from a full-length flat buffer of local shards (a collective over
        tp for sharded parameters)."""
        out = {}
        for name, p, o in zip(self.names, self.params, self.offsets):
            shape = _local(p).shape
            local = flat[o : o + shape.numel()].view(shape)
            out[name] = _dtensor_like(p, local).full_tensor() if isinstance(p, DTensor) else local
        return out

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-length flat tensor."""
        return full[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]

    def shard_pieces(self, shard: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(name, view of `shard`) for each parameter's elements in this rank's slice, in order."""
        return [(self.names[i], shard[lo:hi]) for i, _, (lo, hi) in self._in_shard()]

    def real_shard_numel(self) -> int:
        """Elements of this rank's slice that are parameters, not padding (possibly 0)."""
        return max(0, min(self.numel - self.rank * self.shard_numel, self.shard_numel))


def _sq_norm(t: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """‖t‖² in fp64, from fp32 norms of chunks (a bf16 shard is never copied whole to fp32)."""
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for start in range(0, t.numel(), chunk):
        total += torch.linalg.vector_norm(t[start : start + chunk], dtype=torch.float32).double() ** 2
    return total


def _local(p: torch.Tensor) -> torch.Tensor:
    if isinstance(p, DTensor):
        with torch.no_grad():  # no autograd edge: only read
            return p.to_local()
    return p


def _dtensor_like(p: DTensor, local: torch.Tensor) -> DTensor:
    """`local` as the local shard of a DTensor laid out as `p`."""
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _tp_sharded(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and any(not placement.is_replicate() for placement in p.placements)
