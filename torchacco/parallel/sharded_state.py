"""The sharded optimizer state that ZeRO-1 and the overlapped schedules share: the parameters as views of one flat
buffer, a flat gradient accumulator, this rank's fp32 master shard and AdamW moments, and the job that turns
accumulated gradients into new parameters (`sharded_job.reduce_update_gather`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from torchacco.errors import UserError
from torchacco.optim import ShardedAdamW
from torchacco.parallel.dims import ParallelDims
from torchacco.parallel.flat import FlatParams, padded_numel
from torchacco.parallel.muon import ShardedMuon
from torchacco.parallel.sharded_job import all_gather, gather_master, reduce_update_gather
from torchacco.parallel.strategy import Counts, MemoryParts, UpdateResult

if TYPE_CHECKING:
    from torchacco.config import Optimizer as OptimizerConfig

GRAD_DTYPE = torch.float32  # the flat accumulator's, unless a strategy asks for another


class ShardedOptimizerState:
    """ZeRO-1's state and job, and the `Theta` of the strategies that keep it (zero1, acco, dpu, wp)."""

    def __init__(
        self, model: nn.Module, dims: ParallelDims, param_dtype, optimizer: OptimizerConfig, grad_dtype=GRAD_DTYPE
    ):
        self.dims = dims
        self.on_job_thread = lambda fn: fn()  # an overlapped schedule's: its data-parallel group has one thread
        self.flat = FlatParams(model, dims, param_dtype, grad_dtype)
        if dims.mp_group is not None:
            self.flat.layout()  # a collective: now, while every rank is here
        if optimizer.name == "muon":
            self.optimizer = ShardedMuon(self.flat, optimizer)
        else:
            self.optimizer = ShardedAdamW(self.flat.initial_master, self.flat.decay_ranges, optimizer)
        # P, the flat buffer forward and backward read; A, the accumulator backward adds into; this rank's fp32
        # slice of θ (padding included), what an outer step works on
        self.params, self.grads, self.master = self.flat.params_buffer, self.flat.grads, self.optimizer.state.master

    @staticmethod
    def memory(numel: float, dp_size: int, param_dtype: torch.dtype, grad_dtype: torch.dtype = GRAD_DTYPE):
        """What the constructor allocates: the flat parameters and accumulator (padded), this rank's fp32
        master slice, and AdamW's two fp32 moments of it."""
        full = padded_numel(math.ceil(numel), dp_size)
        shard = full // dp_size
        return MemoryParts(
            weights=full * param_dtype.itemsize, gradients=full * grad_dtype.itemsize, master=4 * shard,
            optimizer=8 * shard,  # exp_avg and exp_avg_sq
        )  # fmt: skip

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The master shard's piece of each parameter (the outer step's view of θ)."""
        return self.flat.shard_pieces(self.master)

    def refresh_copies(self) -> None:
        """P ← θ, from every rank's master shard: after a commit the compute parameters are θ (an estimate round
        starts from it)."""
        self.on_job_thread(lambda: gather_master(self.flat, self.optimizer, self.params))

    def run_job(
        self, grads, counts: Counts, lr_for, kind: str, out: torch.Tensor, max_norm: float, clip_norm=None
    ) -> UpdateResult:
        """reduce-scatter `grads` → AdamW on this rank's shard (`kind`; an ESTIMATE clipped by `clip_norm` if given)
        → all-gather into `out`."""
        return reduce_update_gather(self.flat, self.optimizer, grads, counts, lr_for, kind, out, max_norm, clip_norm)

    def _sharded(self, shard: torch.Tensor) -> DTensor:
        """This rank's slice as the local shard of an unpadded 1-D DTensor: DCP saves it and
        reshards it onto any world size; loading writes straight into `shard`."""
        local = shard[: self.flat.real_shard_numel()]
        return DTensor.from_local(
            local, self.dims.dp_mesh, [Shard(0)], run_check=False, shape=(self.flat.numel,), stride=(1,)
        )

    def weights_state_dict(self) -> dict:
        return {"optimizer": {"master": self._sharded(self.master)}}

    def state_dict(self) -> dict:
        shards = {name: self._sharded(t) for name, t in self.optimizer.shards().items()}
        state = {"optimizer": {**shards, "step": self.optimizer.state.step}}
        if self.flat.mp_group is not None:  # tp/pp: which tensors this coordinate's buffer holds
            state["layout"] = self.flat.layout()
        return state

    def load_state_dict(self, state: dict) -> None:
        """DCP has written master, m and v in place; the step count is restored here."""
        if "layout" in state and state["layout"] != self.flat.layout():
            # Same sizes can hold other layers (another pipeline_schedule) or other shards.
            raise UserError(
                "this checkpoint's tensor- and pipeline-parallel layout differs from this run's "
                "(tensor_parallel_degree, pipeline_parallel_degree or pipeline_schedule changed); "
                "resume with the [parallelism] it was saved with"
            )
        self.optimizer.loaded(state["optimizer"]["step"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """θ as full fp32 tensors by parameter name (a collective)."""
        flat = torch.empty(self.flat.padded_numel, dtype=torch.float32, device=self.params.device)
        self.on_job_thread(lambda: all_gather(flat, self.master, group=self.flat.group))
        return {name: t.cpu().clone() for name, t in self.flat.full_params(flat).items()}
