"""Data-parallel strategies, all behind one small interface the training loop uses.

- `micro_batches()` yields one context per micro-batch of a compute period (DDP and FSDP
  skip gradient sync on all but the last).
- `step(local_tokens, local_loss, local_consumed)` ends the period: it turns this rank's
  sum-of-token-loss gradients into an update normalised by the global count of tokens in
  the loss, steps the LR schedule by the tokens consumed (in the loss or not), and returns the
  `UpdateResult` of the update completed now (None when none completed: ACCO's first period).
- `evaluation()` gives the module holding the committed parameters θ; `close()` drains.
- `state_dict()` / `load_state_dict()` (DCP `Stateful`) hold everything needed to resume
  exactly between two updates; `weights_state_dict()` is the part that holds θ, and
  `full_state_dict()` gathers θ as full fp32 tensors by parameter name (for export).

The loop produces gradients of the *sum* of token losses; each strategy divides by the
all-reduced token count, so uneven or masked batches are weighted per token.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from torchacco.config import Config
from torchacco.errors import UserError
from torchacco.lr import TokenSchedule
from torchacco.optim import ShardedAdamW, build_adamw
from torchacco.parallel.dims import ParallelDims
from torchacco.parallel.flat import FlatParams
from torchacco.parallel.sharded import COMMIT, UpdateResult, all_gather, gather_master, reduce_update_gather


class Replicated:
    """Shared by DDP and FSDP: torch's AdamW over the module's own parameters."""

    sync_phase = "gradient all-reduce and optimizer step"

    def __init__(self, model: nn.Module, cfg: Config, dims: ParallelDims, accumulation: int,
                 schedule: TokenSchedule):
        self.model = model
        self.dims = dims
        self.accumulation = accumulation
        self.schedule = schedule
        self.consumed = 0.0  # tokens consumed by committed updates, all ranks: the schedule position
        self.max_norm = cfg.training.max_norm
        self.optimizer = build_adamw(model, cfg.optimizer)

    def _sync(self, last: bool):
        raise NotImplementedError

    def micro_batches(self) -> Iterator[contextlib.AbstractContextManager]:
        for i in range(self.accumulation):
            yield self._sync(last=i == self.accumulation - 1)

    def step(self, local_tokens: float, local_loss: float, local_consumed: float) -> UpdateResult:
        mine = torch.tensor([local_tokens, local_loss, local_consumed], dtype=torch.float64,
                            device=self.dims.mesh.device_type)
        per_rank = torch.empty(self.dims.dp_size * 3, dtype=torch.float64, device=mine.device)
        all_gather(per_rank, mine, group=self.dims.dp_group)
        per_rank = per_rank.view(-1, 3).cpu()
        tokens, loss_sum, consumed = per_rank.sum(0).tolist()
        params = [p for p in self.model.parameters() if p.grad is not None]
        # The reduction averaged over ranks; rescale the mean of sums to a per-token mean.
        torch._foreach_mul_([p.grad for p in params], self.dims.dp_size / tokens)
        if self.dims.pp_size > 1:
            norm, loss_sum = self._clip_over_stages(params, loss_sum)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm or float("inf"), foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norm = norm.item()
        lr = self.schedule(self.consumed, consumed)
        # The norm is of the reduced gradients and the loss of gathered sums: every rank agrees.
        skipped = not (math.isfinite(norm) and math.isfinite(loss_sum))
        if not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.consumed += consumed
        bad = [r for r, v in enumerate(per_rank[:, 1].tolist()) if not math.isfinite(v)]
        return UpdateResult(tokens, loss_sum / tokens, norm, lr, True, [self.accumulation] * self.dims.dp_size,
                            consumed=consumed, skipped=skipped, nonfinite_ranks=bad)

    def _clip_over_stages(self, params: list, loss_sum: float) -> tuple[torch.Tensor, float]:
        """Pipeline stages hold different layers: the norm adds theirs; the loss is the last stage's."""
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        both = torch.stack([norm.double() ** 2, torch.tensor(loss_sum, dtype=torch.float64, device=norm.device)])
        dist.all_reduce(both, group=self.dims.pp_mesh.get_group())
        norm, loss_sum = both[0].sqrt(), both[1].item()
        if self.max_norm and norm.item() > self.max_norm:
            torch._foreach_mul_([p.grad for p in params], self.max_norm / (norm.item() + 1e-6))
        return norm, loss_sum

    @contextlib.contextmanager
    def evaluation(self):
        yield self.model

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.consumed = state["consumed"]

    def weights_state_dict(self) -> dict:
        return {"model": get_model_state_dict(self.model)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.dims.pp_size > 1:
            # Each stage's full tensors on its own ranks (the options below keep them on rank 0
            # only); one tensor at a time on the device.
            return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
                    for name, p in self.model.named_parameters()}
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {k: v.float() for k, v in get_model_state_dict(self.model, options=options).items()}


class DDP(Replicated):
    """torch DDP: replicated parameters, bucketed all-reduce overlapped with backward."""

    def __init__(self, model, cfg, dims, accumulation, schedule):
        wrapped = DistributedDataParallel(
            model, process_group=dims.dp_group, bucket_cap_mb=cfg.parallelism.bucket_cap_mb,
            gradient_as_bucket_view=True,
        )
        super().__init__(wrapped, cfg, dims, accumulation, schedule)

    def _sync(self, last):
        return contextlib.nullcontext() if last else self.model.no_sync()

    @contextlib.contextmanager
    def evaluation(self):
        yield self.model.module


class FSDP(Replicated):
    """FSDP2 (ZeRO-3): `fully_shard` per block, then the root — under pipeline parallelism, each
    of this rank's stage modules is a root (the schedule calls them, not the model)."""

    def __init__(self, model, cfg, dims, accumulation, schedule, param_dtype: torch.dtype):
        reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.parallelism.reduce_dtype]
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        reshard = cfg.parallelism.reshard_after_forward
        for block in model.layers:
            fully_shard(block, mesh=dims.dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        self.roots = getattr(model, "stage_modules", None) or [model]
        for root in self.roots:
            fully_shard(root, mesh=dims.dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        super().__init__(model, cfg, dims, accumulation, schedule)

    @contextlib.contextmanager
    def _sync(self, last):
        for root in self.roots:  # (a pipeline stage also reduces after each schedule step)
            root.set_requires_gradient_sync(last)
        yield


class ZeRO1:
    """Sharded fp32 optimizer state over flat buffers; the job runs after the last micro-batch."""

    sync_phase = "reduce-scatter, optimizer step and all-gather"

    def __init__(self, model: nn.Module, cfg: Config, dims: ParallelDims, accumulation: int,
                 schedule: TokenSchedule, param_dtype: torch.dtype, grad_dtype: torch.dtype = torch.float32):
        self.model = model
        self.accumulation = accumulation
        self.schedule = schedule
        self.consumed = 0.0
        self.max_norm = cfg.training.max_norm
        self.dims = dims
        self.flat = FlatParams(model, dims.dp_group, dtype=param_dtype, grad_dtype=grad_dtype, tp=dims.tp_size,
                               mp_group=dims.mp_group, owns_loss=dims.tp_rank == 0)
        if dims.mp_group is not None:
            self.flat.layout()  # a collective: now, while every rank is here
        self.optimizer = ShardedAdamW(self.flat.initial_master, self.flat.decay_ranges, cfg.optimizer)

    def micro_batches(self):
        for _ in range(self.accumulation):
            yield contextlib.nullcontext()

    def lr_for(self) -> callable:
        start = self.consumed  # by value: the job may run while the loop moves on
        return lambda consumed: self.schedule(start, consumed)

    def step(self, local_tokens: float, local_loss: float, local_consumed: float) -> UpdateResult:
        flat = self.flat
        send = flat.grads
        if send.dtype != flat.params_buffer.dtype:
            # Reduce in the compute dtype; the parameter buffer is free as the staging area
            # because the all-gather below rewrites all of it.
            flat.params_buffer.copy_(flat.grads)
            send = flat.params_buffer
        result = reduce_update_gather(flat, self.optimizer, send, (local_tokens, local_loss, self.accumulation, local_consumed),
                                      self.lr_for(), COMMIT, out=flat.params_buffer, max_norm=self.max_norm)
        flat.grads.zero_()
        self.consumed += result.consumed
        return result

    @contextlib.contextmanager
    def evaluation(self):
        yield self.model

    def close(self) -> None:
        pass

    def _sharded(self, shard: torch.Tensor) -> DTensor:
        """This rank's slice as the local shard of an unpadded 1-D DTensor: DCP saves it and
        reshards it onto any world size; loading writes straight into `shard`."""
        local = shard[:self.flat.real_shard_numel()]
        return DTensor.from_local(local, self.dims.dp_mesh, [Shard(0)], run_check=False,
                                  shape=(self.flat.numel,), stride=(1,))

    def weights_state_dict(self) -> dict:
        return {"optimizer": {"master": self._sharded(self.optimizer.state.master)}}

    def state_dict(self) -> dict:
        s = self.optimizer.state
        state = {"optimizer": {"master": self._sharded(s.master), "exp_avg": self._sharded(s.exp_avg),
                               "exp_avg_sq": self._sharded(s.exp_avg_sq), "step": s.step},
                 "consumed": self.consumed}
        if self.flat.mp_group is not None:  # tp/pp: which tensors this coordinate's buffer holds
            state["layout"] = self.flat.layout()
        return state

    def load_state_dict(self, state: dict) -> None:
        if "layout" in state and state["layout"] != self.flat.layout():
            # Same sizes can hold other layers (another pipeline_schedule) or other shards.
            raise UserError("this checkpoint's tensor- and pipeline-parallel layout differs from this run's "
                            "(tensor_parallel_degree, pipeline_parallel_degree or pipeline_schedule changed); "
                            "resume with the [parallelism] it was saved with")
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


def build_data_parallel(model: nn.Module, cfg: Config, dims: ParallelDims, accumulation: int,
                        schedule: TokenSchedule, param_dtype: torch.dtype, device):
    kind = cfg.parallelism.data_parallel
    if kind == "ddp":
        return DDP(model, cfg, dims, accumulation, schedule)
    if kind == "fsdp":
        return FSDP(model, cfg, dims, accumulation, schedule, param_dtype)
    if kind == "zero1":
        return ZeRO1(model, cfg, dims, accumulation, schedule, param_dtype)
    from torchacco.parallel import overlap

    return overlap.build(kind, model, cfg, dims, accumulation, schedule, param_dtype, device)
