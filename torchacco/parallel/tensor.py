"""Tensor parallelism (Megatron-style, with sequence parallelism), applied from outside the model.

Each block's first matmuls are split by output columns (heads, MLP hidden units) and its last ones by input rows:
one all-gather in and one reduce-scatter out per block. Between blocks the residual stream stays split along the
sequence, so norms run on T/tp tokens and DTensor sums their replicated weights' gradients. Embeddings are split by
vocabulary rows; the logits are gathered whole (or kept split for a vocabulary-parallel loss).

Each model folder provides its plan (`models/<name>/parallelize.py`, a `TensorParallelPlan`): module path →
ParallelStyle, the blocks' from `sequence_parallel_block`. After sharding, integer `n_heads` / `n_kv_heads`
attributes are divided by tp (the one hook the model code needs).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchacco.errors import UserError
from torchacco.spec import TensorParallelPlan

__all__ = ["ColwiseParallel", "RowwiseParallel", "SequenceParallel", "Replicate", "Shard"]  # for the model folders


def sequence_parallel_block(
    attention: str, first: list[str], last: str, mlp: str, mlp_first: list[str], mlp_last: str, norms, extra_inputs=0
) -> dict:
    """One decoder block: norms on sequence shards; attention and MLP gather the sequence in,
    split heads/hidden units, and scatter the sequence out."""
    rest = (None,) * extra_inputs  # e.g. Llama's RoPE table, passed through untouched
    plan = {norm: SequenceParallel() for norm in norms}
    plan[attention] = PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))
    plan[mlp] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan.update({f"{attention}.{name}": ColwiseParallel() for name in first})
    plan[f"{attention}.{last}"] = RowwiseParallel(output_layouts=Shard(1))
    plan.update({f"{mlp}.{name}": ColwiseParallel() for name in mlp_first})
    plan[f"{mlp}.{mlp_last}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def check_tensor_parallel(plan: TensorParallelPlan | None, args, tp: int, seq_len: int, where: str, model_name) -> None:
    if plan is None:
        raise UserError(
            f"{where} has no tensor-parallel plan (models/{model_name}/parallelize.py, "
            "ModelSpec.tensor_parallel); add one, or set tensor_parallel_degree = 1"
        )
    for name, size in plan.split_sizes(args):
        if size % tp:
            hint = ""
            if name == "vocab_size":
                hint = f"; set [model] vocab_size to a multiple of {tp} (e.g. {-(-size // tp) * tp}: the extra rows "
                hint += "are never predicted)"
            raise UserError(
                f"{where}: {name} = {size} is not divisible by [parallelism] tensor_parallel_degree = {tp}{hint}"
            )
    if seq_len % tp:
        raise UserError(
            f"[training] seq_len = {seq_len} is not divisible by tensor_parallel_degree = {tp} "
            "(sequence parallelism splits each sequence tp ways)"
        )


def head_layouts(loss_parallel: bool) -> dict:
    """ColwiseParallel arguments for an output head: logits split by vocabulary for a
    vocabulary-parallel loss, else gathered whole."""
    if loss_parallel:
        return dict(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return dict(input_layouts=Shard(1), output_layouts=Replicate())


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan, loss_parallel=False) -> None:
    tp = tp_mesh.size()
    top, block_plan = plan.plans(model, loss_parallel)
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan)
        for module in block.modules():  # the model reshapes by its own head counts
            for attr in ("n_heads", "n_kv_heads"):
                if isinstance(getattr(module, attr, None), int):
                    setattr(module, attr, getattr(module, attr) // tp)
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items() if getattr(model, k, None) is not None})

    # A tied head (F.linear with the vocabulary-split embedding) returns a DTensor in a layout
    # of DTensor's choosing: split it by vocabulary for the loss, or gather it whole.
    def logits_layout(module, inputs, out):
        if not isinstance(out, DTensor):
            return out
        return out.redistribute(out.device_mesh, [Shard(-1)]) if loss_parallel else out.full_tensor()

    model.register_forward_hook(logits_layout)
