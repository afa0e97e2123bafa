"""DDP and FSDP: replicated (or fully sharded) parameters with torch's own AdamW."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function

from torchacco.config import Optimizer as OptimizerConfig
from torchacco.errors import UserError
from torchacco.optim import build_adamw
from torchacco.parallel.dims import ParallelDims, global_ranks, union_over
from torchacco.parallel.sharded_job import all_gather
from torchacco.parallel.strategy import Counts, Strategy, UpdatePlan, UpdateResult
from torchacco.user_model import blocks_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Replicated(Strategy):
    """Shared by DDP and FSDP: torch's AdamW over the module's own parameters."""

    sync_phase = "gradient all-reduce and optimizer step"

    def __init__(self, model: nn.Module, dims: ParallelDims, plan: UpdatePlan, optimizer: OptimizerConfig):
        self.model = model
        self.dims = dims
        self.accumulation = plan.micro_batches
        self.schedule = plan.schedule
        self.consumed = 0.0  # tokens consumed by committed updates, all ranks: the schedule position
        self.max_norm = plan.max_norm
        self.optimizer = build_adamw(model, optimizer)

    def _sync(self, last: bool):
        raise NotImplementedError

    def micro_batches(self) -> Iterator[contextlib.AbstractContextManager]:
        for i in range(self.accumulation):
            yield self._sync(last=i == self.accumulation - 1)

    def step(self, counts: Counts) -> UpdateResult:
        mine = counts.as_tensor(self.dims.mesh.device_type)
        per_rank = torch.empty(self.dims.dp_size * Counts.FIELDS, dtype=torch.float64, device=mine.device)
        all_gather(per_rank, mine, group=self.dims.dp_group)
        per_rank = per_rank.view(-1, Counts.FIELDS).cpu()
        tokens, loss_sum, _, consumed, _ = per_rank.sum(0).tolist()
        if tokens <= 0:
            raise UserError(
                "an update has no token in the loss on any rank (every label masked); raise "
                "[training] local_batch_size or global_batch_size, or check the data's masking"
            )
        params = [p for p in self.model.parameters() if p.grad is not None]
        # The reduction averaged over ranks; rescale the mean of sums to a per-token mean.
        torch._foreach_mul_([p.grad for p in params], self.dims.dp_size / tokens)
        if self.dims.pp_enabled:
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
            with record_function("torchacco/optimizer_step"):
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.consumed += consumed
        bad = global_ranks(
            self.dims.dp_group, [r for r, v in enumerate(per_rank[:, 1].tolist()) if not math.isfinite(v)]
        )
        if skipped:  # every rank is here: the loss of a pipeline is the last stage's, name its ranks everywhere
            bad = union_over(self.dims.mp_group, bad, mine.device)
        return UpdateResult(
            tokens,
            loss_sum / tokens,
            norm,
            lr,
            True,
            [int(n) for n in per_rank[:, 2].tolist()],
            per_rank[:, 4].tolist(),
            consumed=consumed,
            skipped=skipped,
            nonfinite_ranks=bad,
        )

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
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.consumed = state["consumed"]

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


class DDP(Replicated):
    """torch DDP: replicated parameters, bucketed all-reduce overlapped with backward."""

    name = "ddp"
    communication = "all_reduce_in_backward"
    # torch DDP cannot broadcast or bucket DTensor parameters, nor wrap pipeline stages.
    supports_model_parallel = False
    autocast_compute = True

    def __init__(self, model, dims, plan, optimizer, bucket_cap_mb: float = 25.0):
        wrapped = DistributedDataParallel(
            model, process_group=dims.dp_group, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True
        )
        super().__init__(wrapped, dims, plan, optimizer)

    @classmethod
    def from_config(cls, model, cfg, dims, plan, device):
        return cls(model, dims, plan, cfg.optimizer, cfg.parallelism.bucket_cap_mb)

    def _sync(self, last):
        return contextlib.nullcontext() if last else self.model.no_sync()

    @contextlib.contextmanager
    def evaluation(self):
        yield self.model.module


class FSDP(Replicated):
    """FSDP2 (ZeRO-3): `fully_shard` per block, then the root — under pipeline parallelism, each
    of this rank's stage modules is a root (the schedule calls them, not the model)."""

    name = "fsdp"
    communication = "per_micro_batch"

    def __init__(
        self,
        model,
        dims,
        plan,
        optimizer,
        reduce_dtype: torch.dtype = torch.float32,
        reshard_after_forward: bool = True,
    ):
        mp = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=reduce_dtype)
        for block in blocks_of(model) or []:  # a foreign model without blocks is sharded as one unit
            fully_shard(block, mesh=dims.dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        self.roots = getattr(model, "stage_modules", None) or [model]
        for root in self.roots:
            fully_shard(root, mesh=dims.dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        super().__init__(model, dims, plan, optimizer)

    @classmethod
    def from_config(cls, model, cfg, dims, plan, device):
        p = cfg.parallelism
        return cls(model, dims, plan, cfg.optimizer, DTYPES[p.reduce_dtype], p.reshard_after_forward)

    @classmethod
    def checkpoint_key(cls, dims) -> str:
        # DTensors span dp and tp; the optimizer's param groups are saved by index, which would
        # collide between stages: one key per stage.
        return f"dp_pp{dims.pp_rank}" if dims.pp_enabled else "dp"

    @contextlib.contextmanager
    def _sync(self, last):
        for root in self.roots:  # (a pipeline stage also reduces after each schedule step)
            root.set_requires_gradient_sync(last)
        yield
