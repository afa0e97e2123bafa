"""Pipeline parallelism with torch.distributed.pipelining, split by layer.

Each pp rank keeps only its stages' layers of the full model object, so parameter names stay the full model's
(checkpoints and exports need no renaming); a stage is a thin module over them from the model folder's
`PipelinePlan`. One micro-batch of the loop is one schedule step over `pipeline_microbatches` pieces (GPipe, 1F1B
or interleaved 1F1B, two stages per rank), its loss the unscaled sum of token losses: the strategies normalise
the gradients as without a pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from torchacco.errors import UserError
from torchacco.loss import IGNORE_INDEX, TokenLoss
from torchacco.parallel.dims import ParallelDims
from torchacco.spec import PipelinePlan

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def _pipelining():
    """torch.distributed.pipelining, imported on first use: it imports torch._dynamo, seconds of every process's
    start on a CPU host, so only a pipelined run pays for it."""
    import torch.distributed.pipelining

    return torch.distributed.pipelining


def stages_per_rank(parallelism) -> int:
    return 2 if parallelism.pipeline_schedule == "interleaved_1f1b" else 1


def microbatches(parallelism) -> int:
    p = parallelism
    return p.pipeline_microbatches or p.pipeline_parallel_degree * stages_per_rank(p)


def check_pipeline(plan: PipelinePlan | None, parallelism, training, args, where: str) -> None:
    p, pp = parallelism, parallelism.pipeline_parallel_degree
    stages = pp * stages_per_rank(p)
    reason = "it has no pipeline plan (ModelSpec.pipeline)" if plan is None else plan.unsupported(args)
    if reason:
        raise UserError(f"pipeline parallelism with {where} is not supported: {reason}")
    if args.n_layers < stages:
        raise UserError(
            f"{where} has {args.n_layers} layers, fewer than the {stages} pipeline stages "
            f"(pipeline_parallel_degree = {pp}, {p.pipeline_schedule}); lower pipeline_parallel_degree"
        )
    n = microbatches(p)
    if training.local_batch_size % n:
        raise UserError(
            f"[training] local_batch_size = {training.local_batch_size} is not divisible by "
            f"[parallelism] pipeline_microbatches = {n} (each local batch is split into that many pieces)"
        )
    if p.pipeline_schedule != "gpipe" and n < pp:
        raise UserError(
            f"{p.pipeline_schedule} needs at least pipeline_parallel_degree = {pp} pipeline_microbatches, "
            f"got {n}; raise it (or use pipeline_schedule = 'gpipe')"
        )
    if p.pipeline_schedule == "interleaved_1f1b" and n % pp:
        raise UserError(
            f"interleaved_1f1b needs pipeline_microbatches to be a multiple of pipeline_parallel_degree = {pp}, got {n}"
        )


def layer_split(n_layers: int, stages: int) -> list[range]:
    """Contiguous layer ranges, the first stages one layer longer when it does not divide."""
    base, extra = divmod(n_layers, stages)
    return [range(s * base + min(s, extra), (s + 1) * base + min(s + 1, extra)) for s in range(stages)]


class Layers(nn.ModuleDict):
    """The blocks this rank keeps, under their full-model indices (so names stay `layers.<i>.…`);
    iterating yields the blocks, as for the full model's ModuleList."""

    def __iter__(self):
        return iter(self.values())


class Pipeline:
    """This rank's stages and the schedule that runs them."""

    def __init__(self, stages: list[PipelineStage], parallelism, first: bool, last: bool, loss: TokenLoss):
        self.stages, self.first, self.last = stages, first, last
        n, kind = microbatches(parallelism), getattr(_pipelining(), SCHEDULES[parallelism.pipeline_schedule])
        stage = stages if parallelism.pipeline_schedule == "interleaved_1f1b" else stages[0]
        self.loss, self.poison = loss, False
        self.schedule = kind(stage, n_microbatches=n, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss(logits, labels)
        return loss * float("nan") if self.poison else loss  # injected fault (torchacco/faults.py)

    def _run(self, run, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        labels = batch["labels"]
        losses: list[torch.Tensor] = []
        args = (batch["input_ids"],) if self.first else ()
        run(*args, target=labels if self.last else None, losses=losses if self.last else None, return_outputs=False)
        loss = torch.stack(losses).sum().detach() if self.last else torch.zeros((), device=labels.device)
        return loss, (labels != IGNORE_INDEX).sum()

    def forward_backward(self, batch: dict, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of token losses (0 except on the last stage) and tokens in the loss (every stage);
        `poison`: the loss is NaN (an injected fault, on the last stage)."""
        self.poison = poison
        try:
            return self._run(self.schedule.step, batch)
        finally:
            self.poison = False

    def evaluate(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run(self.schedule.eval, batch)


def split_stages(model: nn.Module, plan: PipelinePlan, parallelism, dims: ParallelDims, device, loss=None) -> tuple:
    """Prune `model` to this rank's stages; (the pruned model, its pipeline)."""
    pp, v = dims.pp_size, stages_per_rank(parallelism)
    n_stages = pp * v
    ranges = layer_split(len(model.layers), n_stages)
    mine = [dims.pp_rank + k * pp for k in range(v)]  # interleaved: stages r, r + pp, ...
    first, last = 0 in mine, n_stages - 1 in mine
    model.layers = Layers({str(i): model.layers[i] for s in mine for i in ranges[s]})
    plan.prune(model, first, last)
    group, tp, on = dims.pp_mesh.get_group(), dims.tp_size, device.torch
    stages = [
        _pipelining().PipelineStage(
            plan.stage(model, ranges[s], s == 0, s == n_stages - 1, tp), s, n_stages, on, group=group
        )
        for s in mine
    ]
    # A plain list, not submodules (the parameters keep their full-model names): FSDP makes each stage module a root,
    # since the schedule calls them and never model.forward.
    model.stage_modules = [stage.submod for stage in stages]
    return model, Pipeline(stages, parallelism, first, last, loss or TokenLoss())
