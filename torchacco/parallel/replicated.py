"""What DDP and FSDP share: torch's AdamW over the module's own (replicated or fully sharded)
parameters, stepped once torch's wrapper has reduced the gradients."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from torchacco.blocks import unwrap
from torchacco.device import Stopwatch
from torchacco.optim import build_optimizer
from torchacco.parallel.accounting import gather_counts
from torchacco.parallel.balance import SpeedSplit
from torchacco.parallel.dims import ParallelDims
from torchacco.parallel.strategy import Counts, Strategy, UpdatePlan, UpdateResult

if TYPE_CHECKING:
    from torchacco.config import Optimizer as OptimizerConfig


class Replicated(Strategy):
    """The base of DDP and FSDP: a torch wrapper reduces the gradients inside backward (`_sync`
    says when), then torch's AdamW steps over the module's own parameters."""

    def __init__(self, model, dims: ParallelDims, plan: UpdatePlan, optimizer: OptimizerConfig, balance=False):
        self.model, self.dims = model, dims
        self.accumulation, self.schedule, self.max_norm = plan.micro_batches, plan.schedule, plan.max_norm
        # balance_batches: every rank keeps one micro-batch, as DDP's all-reduce runs in its last backward
        self.balance = SpeedSplit(plan.micro_batches, dims.dp_size, dims.dp_rank, minimum=1) if balance else None
        self.consumed = 0.0  # tokens consumed by committed updates, all ranks: the schedule position
        self.optimizer = build_optimizer(model, optimizer)
        self.theta = ModuleTheta(model, dims)

    def _sync(self, last: bool):
        raise NotImplementedError

    def micro_batches(self) -> Iterator[contextlib.AbstractContextManager]:
        n = self.balance.count() if self.balance else self.accumulation
        self._timed = []  # balance_batches: the micro-batches without gradient sync, each timed
        for i in range(n):
            last = i == n - 1
            watch = Stopwatch(self.dims.mesh.device_type == "cuda").start() if self.balance and not last else None
            yield self._sync(last)
            if watch is not None:
                self._timed.append(watch.stop())

    def _own_speed(self, counts: Counts) -> Counts:
        """A rank's compute time for balancing, from its micro-batches without sync: the last one's
        backward waits in the all-reduce for the slowest rank, which would make every rank look as slow.
        With one micro-batch there is no such reading (0: the balancer lets its estimate drift)."""
        seconds = [w.seconds() for w in self._timed]
        per = sum(seconds) / len(seconds) if seconds else 0.0
        return dataclasses.replace(counts, compute=(_Seconds(per * counts.micro_batches),))

    def step(self, counts: Counts) -> UpdateResult:
        if self.balance:
            counts = self._own_speed(counts)
        gathered = gather_counts(counts, self.dims.dp_group, self.dims.mesh.device_type)
        gathered.require_tokens()
        loss_sum = gathered.loss_sum
        params = [p for p in self.model.parameters() if p.grad is not None]
        # The reduction averaged over ranks; rescale the mean of sums to a per-token mean.
        torch._foreach_mul_([p.grad for p in params], self.dims.dp_size / gathered.tokens)
        if self.dims.pp_enabled:
            norm, loss_sum = self._clip_over_stages(params, loss_sum)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm or float("inf"), foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norm = norm.item()
        lr = self.schedule(self.consumed, gathered.consumed)
        # The norm is of the reduced gradients and the loss of gathered sums: every rank agrees.
        skipped = not (math.isfinite(norm) and math.isfinite(loss_sum))
        if not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            with record_function("torchacco/optimizer_step"):
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.consumed += gathered.consumed
        # Every rank is here: a pipeline's loss is the last stage's, so its ranks are named everywhere.
        mp_group = self.dims.mp_group if skipped else None
        bad = gathered.nonfinite_ranks(self.dims.dp_group, mp_group, self.dims.mesh.device_type)
        result = gathered.result(loss_sum, norm, lr, True, skipped=skipped, nonfinite_ranks=bad)
        if self.balance:
            self.balance.observe(result.micro_batches, result.compute_s)
        return result

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

    def state_dict(self) -> dict:
        fresh = not self.optimizer.state
        model, optimizer = get_state_dict(self.model, self.optimizer)
        if fresh:  # DCP made the state by stepping AdamW at lr 0, which counts a step: forget it, and say 0 steps
            self.optimizer.state.clear()
            for entry in optimizer["state"].values():
                if "step" in entry:
                    entry["step"] = torch.zeros_like(entry["step"]) if torch.is_tensor(entry["step"]) else 0
        balance = {"balance": self.balance.state_dict()} if self.balance else {}
        return {"model": model, "optimizer": optimizer, "consumed": self.consumed, **balance}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.consumed = state["consumed"]
        if self.balance:
            self.balance.load_state_dict(state["balance"])


class ModuleTheta:
    """θ of DDP and FSDP (`strategy.Theta`): the module's own parameters (FSDP's: this rank's shards)."""

    def __init__(self, model: nn.Module, dims: ParallelDims):
        self.model, self.dims = model, dims

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        module = unwrap(self.model)  # DDP's wrapper prefixes the names
        with torch.no_grad():  # a DTensor's (FSDP's shard's) local tensor is its storage
            return [
                (name, p.to_local() if isinstance(p, DTensor) else p.data)
                for name, p in module.named_parameters()
                if p.requires_grad
            ]

    def refresh_copies(self) -> None:
        pass  # the compute parameters are θ itself

    def weights_state_dict(self) -> dict:
        return {"model": get_model_state_dict(self.model)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.dims.pp_enabled:
            # Each stage's full tensors on its own ranks (the options below keep them on rank 0
            # only); one tensor at a time on the device.
            return {
                name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
                for name, p in self.model.named_parameters()
            }
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {k: v.float() for k, v in get_model_state_dict(self.model, options=options).items()}


@dataclasses.dataclass
class _Seconds:
    """A reading in seconds, where `Counts` expects a stopwatch."""

    value: float

    def seconds(self) -> float:
        return self.value
