"""ZeRO-1: the parameters as views of one flat buffer, fp32 master weights and AdamW moments
sharded over the data-parallel ranks; after the last micro-batch, the sharded job
(reduce-scatter, AdamW on this rank's shard, all-gather: `sharded_job.py`)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.profiler import record_function

from torchacco.config import Optimizer as OptimizerConfig
from torchacco.errors import UserError
from torchacco.optim import ShardedAdamW
from torchacco.parallel.dims import ParallelDims
from torchacco.parallel.flat import FlatParams
from torchacco.parallel.sharded_job import COMMIT, all_gather, gather_master, reduce_update_gather
from torchacco.parallel.strategy import Counts, Strategy, UpdatePlan, UpdateResult


class ZeRO1(Strategy):
    """Sharded fp32 optimizer state over flat buffers; the job runs after the last micro-batch."""

    name = "zero1"
    communication = "sharded_job"
    flat_buffers = True
    sync_phase = "reduce-scatter, optimizer step and all-gather"

    def __init__(
        self,
        model: nn.Module,
        dims: ParallelDims,
        plan: UpdatePlan,
        optimizer: OptimizerConfig,
        grad_dtype: torch.dtype = torch.float32,
    ):
        self.model = model
        self.accumulation = plan.micro_batches // self.periods_per_update  # per period
        self.schedule = plan.schedule
        self.consumed = 0.0
        self.max_norm = plan.max_norm
        self.dims = dims
        self.flat = FlatParams(
            model,
            dims.dp_group,
            dtype=plan.param_dtype,
            grad_dtype=grad_dtype,
            tp=dims.tp_size,
            mp_group=dims.mp_group,
            owns_loss=dims.tp_rank == 0,
        )
        if dims.mp_group is not None:
            self.flat.layout()  # a collective: now, while every rank is here
        self.optimizer = ShardedAdamW(self.flat.initial_master, self.flat.decay_ranges, optimizer)

    @classmethod
    def from_config(cls, model, cfg, dims, plan, device):
        return cls(model, dims, plan, cfg.optimizer)

    @classmethod
    def checkpoint_key(cls, dims) -> str:
        # The buffers hold one (pp, tp) coordinate's local shards, sharded over dp only: one key per
        # coordinate, so a resume needs the same tp and pp degrees while dp may change.
        return f"dp_pp{dims.pp_rank}_tp{dims.tp_rank}" if dims.model_parallel else "dp"

    def micro_batches(self):
        for _ in range(self.accumulation):
            yield contextlib.nullcontext()

    def lr_for(self) -> callable:
        start = self.consumed  # by value: the job may run while the loop moves on
        return lambda consumed: self.schedule(start, consumed)

    def step(self, counts: Counts) -> UpdateResult:
        flat = self.flat
        send = flat.grads
        if send.dtype != flat.params_buffer.dtype:
            # Reduce in the compute dtype; the parameter buffer is free as the staging area
            # because the all-gather below rewrites all of it.
            flat.params_buffer.copy_(flat.grads)
            send = flat.params_buffer
        with record_function("torchacco/job:commit"):
            result = reduce_update_gather(
                flat,
                self.optimizer,
                send,
                counts,
                self.lr_for(),
                COMMIT,
                out=flat.params_buffer,
                max_norm=self.max_norm,
            )
        flat.grads.zero_()
        self.consumed += result.consumed
        return result

    def _sharded(self, shard: torch.Tensor) -> DTensor:
        """This rank's slice as the local shard of an unpadded 1-D DTensor: DCP saves it and
        reshards it onto any world size; loading writes straight into `shard`."""
        local = shard[: self.flat.real_shard_numel()]
        return DTensor.from_local(
            local, self.dims.dp_mesh, [Shard(0)], run_check=False, shape=(self.flat.numel,), stride=(1,)
        )

    def weights_state_dict(self) -> dict:
        return {"optimizer": {"master": self._sharded(self.optimizer.state.master)}}

    def state_dict(self) -> dict:
        s = self.optimizer.state
        state = {
            "optimizer": {
                "master": self._sharded(s.master),
                "exp_avg": self._sharded(s.exp_avg),
                "exp_avg_sq": self._sharded(s.exp_avg_sq),
                "step": s.step,
            },
            "consumed": self.consumed,
        }
        if self.flat.mp_group is not None:  # tp/pp: which tensors this coordinate's buffer holds
            state["layout"] = self.flat.layout()
        return state

    def load_state_dict(self, state: dict) -> None:
        if "layout" in state and state["layout"] != self.flat.layout():
            # Same sizes can hold other layers (another pipeline_schedule) or other shards.
            raise UserError(
                "this checkpoint's tensor- and pipeline-parallel layout differs from this run's "
                "(tensor_parallel_degree, pipeline_parallel_degree or pipeline_schedule changed); "
                "resume with the [parallelism] it was saved with"
            )
        # DCP has written master, m and v in place; the compute parameters follow from master.
        self.optimizer.state.step = state["optimizer"]["step"]
        self.consumed = state["consumed"]
        self._refresh_params()

    def _refresh_params(self) -> None:
        gather_master(self.flat, self.optimizer, self.flat.params_buffer)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        flat = torch.empty(self.flat.padded_numel, dtype=torch.float32, device=self.flat.params_buffer.device)
        all_gather(flat, self.optimizer.state.master, group=self.flat.group)
        return {name: t.cpu().clone() for name, t in self.flat.full_params(flat).items()}
