"""Tensor and pipeline parallelism, applied to a built model before data parallelism.

Order (as torchtitan): split into pipeline stages (this rank keeps its layers), then tensor
parallel on what is kept, then the data-parallel strategy over the dp group of each
(pp, tp) coordinate. The plans come from the model's folder (its ModelSpec).
"""

from __future__ import annotations

import os

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchacco.errors import UserError
from torchacco.parallel.dims import ParallelDims
from torchacco.parallel.pipeline import check_pipeline, split_stages
from torchacco.parallel.registry import strategy_class
from torchacco.parallel.tensor import apply_tensor_parallel, check_tensor_parallel
from torchacco.spec import ModelSpec


def check_model_parallel(spec: ModelSpec, args, parallelism, model_cfg, training) -> None:
    """Shape checks of the configured model against the tp and pp degrees (before launch)."""
    p = parallelism
    where = f"{model_cfg.name} {model_cfg.init_from or model_cfg.flavor}"
    if p.tensor_parallel_degree > 1:
        check_tensor_parallel(spec.tensor_parallel, args, p.tensor_parallel_degree, training.seq_len, where, spec.name)
    if p.pipeline_parallel_degree > 1:
        check_pipeline(spec.pipeline, p, training, args, where)


def check_hardware_queues(parallelism, diloco, device_type: str, env=os.environ) -> None:
    """With tp or pp, an overlapped job's collectives (side stream) and tp/pp's (compute stream) run on
    separate communicators at once; CUDA_DEVICE_MAX_CONNECTIONS=1 puts both streams on one hardware
    queue, where the two can be ordered differently on different ranks and hang."""
    p = parallelism
    overlapped = strategy_class(p.data_parallel).traits.overlapped or (p.replicas > 1 and diloco.overlap_steps > 0)
    model_parallel = p.tensor_parallel_degree * p.pipeline_parallel_degree > 1
    if device_type == "cuda" and overlapped and model_parallel and env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise UserError(
            "CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor or pipeline parallelism and an overlapped schedule can order "
            "the side stream's and the compute stream's collectives differently on different ranks and hang: "
            "unset it (or run a synchronous strategy)"
        )


def apply_model_parallel(model: nn.Module, spec: ModelSpec, parallelism, model_cfg, training, dims, device, loss=None):
    """(this rank's model, the pipeline or None). `loss` (a TokenLoss) says whether the logits stay
    split by vocabulary, and is the pipeline's loss function."""
    if not dims.model_parallel:
        return model, None
    # validate() has refused tp/pp for a model passed to train(): this is one of torchacco's, checked again because
    # its vocabulary may come from the tokenizer
    check_model_parallel(spec, model.args, parallelism, model_cfg, training)
    pipeline = None
    if dims.pp_enabled:
        model, pipeline = split_stages(model, spec.pipeline, parallelism, dims, device, loss)
    if dims.tp_enabled:
        apply_tensor_parallel(model, dims.tp_mesh, spec.tensor_parallel, loss is not None and loss.vocab_parallel)
    return model, pipeline


def local_numel(model: nn.Module) -> int:
    """Parameter elements stored on this rank (local shards of DTensors)."""
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())


def model_parallel_label(dims: ParallelDims, model: nn.Module) -> str:
    """' × tp 2 × pp 2 (1.23M params on rank 0)' for the start line; '' without tp/pp."""
    if not dims.model_parallel:
        return ""
    return f" × tp {dims.tp_size} × pp {dims.pp_size} ({local_numel(model) / 1e6:.3f}M params on rank {dims.rank})"


def gather_stages(weights: dict, dims: ParallelDims) -> dict:
    """Every stage's full tensors on rank 0 (a collective over the pp group of dp = tp = 0)."""
    if not dims.pp_enabled or dims.dp_rank or dims.tp_rank:
        return weights
    parts = [None] * dims.pp_size if dims.is_main else None
    dist.gather_object(weights, parts, dst=0, group=dims.pp_mesh.get_group())
    return {k: v for part in parts for k, v in part.items()} if dims.is_main else weights
