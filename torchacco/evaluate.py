"""Validation loss: the mean token loss over a few batches per rank, with the committed θ."""

from __future__ import annotations

import torch
import torch.nn as nn

from torchacco.device import Device
from torchacco.loss import value
from torchacco.parallel.collectives import all_reduce_sum
from torchacco.parallel.dims import ParallelDims


def evaluate(model: nn.Module, loader, batches: int, device: Device, dims: ParallelDims, pipeline, loss_fn) -> float:
    was_training = model.training
    model.eval()
    loss_sum, count = torch.zeros((), dtype=torch.float64, device=device.torch), 0
    with torch.no_grad(), loss_fn.context():
        full = None
        for i, batch in enumerate(loader):
            full = full or batch["input_ids"].shape[0]
            if i >= batches or (pipeline and batch["input_ids"].shape[0] < full):
                break  # a pipeline's stages keep the shapes of their first batch: no short last one
            batch = {k: v.to(device.torch, non_blocking=True) for k, v in batch.items()}
            loss, n = pipeline.evaluate(batch) if pipeline else loss_fn.of_batch(model, batch)
            loss_sum += value(loss).double()
            count += n.item()
    model.train(was_training)
    if not dims.model_parallel:
        total, tokens = all_reduce_sum([loss_sum.item(), float(count)], device.torch, dims.data_group)
    else:  # one rank per (pp, tp) block holds the loss: the last stage's first tp rank
        owner = dims.tp_rank == 0 and dims.pp_rank == dims.pp_size - 1
        total, tokens = all_reduce_sum([loss_sum.item() * owner, float(count) * owner], device.torch)
    return total / max(tokens, 1.0)
