"""Activation checkpointing, applied to the model's blocks from outside the model.

- full: a block keeps only its input; backward runs its forward again.
- selective, by op ("op"): a block keeps the outputs of its matmuls and attention (the
  expensive ops) and recomputes the cheap element-wise ones (norms, activations, RoPE).
- selective, by layer ("k", a number): every k-th block is checkpointed fully, the others not.

Each block's `forward` is wrapped in place (non-reentrant `torch.utils.checkpoint`), so the parameter names,
checkpoints and exports stay the model's. Applied after tensor parallelism, before compile and data parallelism.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from torchacco.errors import UserError

# Ops whose outputs selective-by-op keeps: the matmuls and attention kernels.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def check_activation_checkpoint(mode: str, selective: str) -> None:
    if mode == "selective" and selective != "op" and not (selective.isdigit() and int(selective) >= 1):
        raise UserError(
            f"[training] selective_checkpoint = {selective!r} is neither 'op' nor a whole number of "
            "blocks (e.g. '2': every second block)"
        )


def apply_activation_checkpoint(blocks, mode: str, selective: str = "op") -> int:
    """Wrap the forward of the blocks to checkpoint; returns how many were wrapped."""
    check_activation_checkpoint(mode, selective)
    if mode == "none":
        return 0
    every = int(selective) if mode == "selective" and selective != "op" else 1
    by_op = mode == "selective" and selective == "op"
    chosen = [block for i, block in enumerate(blocks) if i % every == every - 1]
    for block in chosen:
        _checkpoint_forward(block, by_op)
    return len(chosen)


def _checkpoint_forward(block: nn.Module, by_op: bool) -> None:
    forward = block.forward
    context = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls) if by_op else noop_context_fn

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to save
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)

    block.forward = checkpointed
