"""ZeRO-1: the parameters as views of one flat buffer, fp32 master weights and AdamW moments
sharded over the data-parallel ranks; after the last micro-batch, the sharded job
(reduce-scatter, AdamW on this rank's shard, all-gather: `sharded_job.py`)."""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

from torchacco.device import DTYPES
from torchacco.parallel.balance import SpeedSplit
from torchacco.parallel.ddp import DDP
from torchacco.parallel.sharded_job import COMMIT
from torchacco.parallel.sharded_state import ShardedOptimizerState
from torchacco.parallel.strategy import Counts, Strategy, Traits, UpdatePlan, UpdateResult


class ZeRO1(Strategy):
    """Sharded fp32 optimizer state over flat buffers; the job runs after the last micro-batch."""

    traits = Traits(
        "zero1",
        "sharded_job",
        "reduce-scatter, optimizer step and all-gather",
        shards_theta=True,
        update_of=DDP.name,  # DDP's AdamW step on the all-reduced gradient, with the state sharded
    )

    def __init__(self, model, dims, plan: UpdatePlan, optimizer, reduce_dtype=torch.float32, balance=False):
        self.model, self.dims, self.reduce_dtype = model, dims, reduce_dtype
        self.accumulation, self.schedule, self.max_norm = plan.micro_batches, plan.schedule, plan.max_norm
        self.consumed = 0.0  # tokens consumed by committed updates, all ranks: the schedule position
        self.sharded = self.theta = ShardedOptimizerState(model, dims, plan.param_dtype, optimizer)
        self.balance = SpeedSplit(plan.micro_batches, dims.dp_size, dims.dp_rank) if balance else None

    @classmethod
    def from_config(cls, model, dims, plan, device, *, parallelism, optimizer, **_):
        return cls(model, dims, plan, optimizer, DTYPES[parallelism.reduce_dtype], parallelism.balance_batches)

    @classmethod
    def checkpoint_key(cls, dims) -> str:
        return sharded_checkpoint_key(dims)

    @classmethod
    def memory(cls, numel, dp_size, param_dtype, reduce_dtype, options=None):
        return ShardedOptimizerState.memory(numel, dp_size, param_dtype)

    def micro_batches(self):
        for _ in range(self.balance.count() if self.balance else self.accumulation):
            yield contextlib.nullcontext()

    def step(self, counts: Counts) -> UpdateResult:
        s = self.sharded
        send = s.grads  # the fp32 accumulator, reduced in place
        if self.reduce_dtype == s.params.dtype != send.dtype:
            # Reduce in the compute dtype ([parallelism] reduce_dtype = "bf16"); the parameter buffer is
            # free as the staging area because the all-gather below rewrites all of it.
            s.params.copy_(s.grads)
            send = s.params
        start = self.consumed
        with record_function("torchacco/job:commit"):
            result = s.run_job(send, counts, lambda c: self.schedule(start, c), COMMIT, s.params, self.max_norm)
        s.grads.zero_()
        self.consumed += result.consumed
        if self.balance:
            self.balance.observe(result.micro_batches, result.compute_s)
        return result

    def state_dict(self) -> dict:
        balance = {"balance": self.balance.state_dict()} if self.balance else {}
        return {**self.sharded.state_dict(), "consumed": self.consumed, **balance}

    def load_state_dict(self, state: dict) -> None:
        self.sharded.load_state_dict(state)
        self.consumed = state["consumed"]
        if self.balance:
            self.balance.load_state_dict(state["balance"])
        self.sharded.refresh_copies()  # the compute parameters follow from θ


def sharded_checkpoint_key(dims) -> str:
    """The flat buffers hold one (pp, tp) coordinate's local shards, sharded over dp only: one key
    per coordinate, so a resume needs the same tp and pp degrees while dp may change."""
    return f"dp_pp{dims.pp_rank}_tp{dims.tp_rank}" if dims.model_parallel else "dp"
