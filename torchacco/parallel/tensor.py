"""Tensor parallelism (Megatron-style, with sequence parallelism), applied from outside the model.

Each block's first matmuls are split by output columns (attention heads, MLP hidden units)
and its last ones by input rows, so a block costs one all-gather in and one reduce-scatter
out. Between blocks the residual stream stays split along the sequence (sequence
parallelism): norms and residual adds run on T/tp tokens per rank, and their (replicated)
weights get gradients summed over the sequence shards by DTensor.

Embeddings are split by vocabulary rows; the logits are gathered whole at the end, so the
loss and everything downstream see a plain tensor.

A plan is a dict of module path → ParallelStyle per model class; after sharding, attention
modules count their local heads (the one hook the model code needs: `n_heads` attributes).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from torchacco.errors import UserError


def _block_plan(attention: str, first: list[str], last: str, mlp: str, mlp_first: list[str], mlp_last: str,
                norms: list[str], extra_inputs: int) -> dict:
    """One decoder block: norms on sequence shards; attention and MLP gather the sequence in,
    split heads/hidden units, and scatter the sequence out."""
    rest = (None,) * extra_inputs  # e.g. Llama's RoPE table, passed through untouched
    plan = {norm: SequenceParallel() for norm in norms}
    plan[attention] = PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))
    plan[mlp] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for name in first:
        plan[f"{attention}.{name}"] = ColwiseParallel()
    plan[f"{attention}.{last}"] = RowwiseParallel(output_layouts=Shard(1))
    for name in mlp_first:
        plan[f"{mlp}.{name}"] = ColwiseParallel()
    plan[f"{mlp}.{mlp_last}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def _llama3(model: nn.Module) -> tuple[dict, dict]:
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           "norm": SequenceParallel()}
    if model.output is not None:  # untied head: split by vocabulary, logits gathered
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    block = _block_plan("attention", ["wq", "wk", "wv"], "wo", "feed_forward", ["w1", "w3"], "w2",
                        ["attention_norm", "ffn_norm"], extra_inputs=1)
    return top, block


def _gpt_neo(model: nn.Module) -> tuple[dict, dict]:
    top = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           # positions [T] -> [T, dim]: split along T (dim 0) to add to the local token shard
           "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
           "ln_f": SequenceParallel()}
    block = _block_plan("attn", ["q_proj", "k_proj", "v_proj"], "out_proj", "mlp", ["c_fc"], "c_proj",
                        ["ln_1", "ln_2"], extra_inputs=0)
    return top, block


PLANS = {"Llama3": _llama3, "GPTNeo": _gpt_neo}


def divisibility(args, tp: int) -> list[tuple[str, int]]:
    """(name, size) of every dimension tensor parallelism splits tp ways."""
    sizes = [("n_heads", args.n_heads)]
    if hasattr(args, "kv_heads"):  # grouped-query attention: whole kv heads per rank
        sizes.append(("n_kv_heads", args.kv_heads))
    sizes += [("ffn hidden dim", args.hidden_dim), ("vocab_size", args.vocab_size)]
    if hasattr(args, "window_size"):  # GPT-Neo's learned positions are split too
        sizes.append(("max_seq_len", args.max_seq_len))
    return sizes


def check_tensor_parallel(args, tp: int, seq_len: int, where: str) -> None:
    for name, size in divisibility(args, tp):
        if size % tp:
            hint = (f"; set [model] vocab_size to a multiple of {tp} (e.g. {-(-size // tp) * tp}: the extra rows are "
                    "never predicted)") if name == "vocab_size" else ""
            raise UserError(f"{where}: {name} = {size} is not divisible by [parallelism] tensor_parallel_degree = "
                            f"{tp}{hint}")
    if seq_len % tp:
        raise UserError(f"[training] seq_len = {seq_len} is not divisible by tensor_parallel_degree = {tp} "
                        "(sequence parallelism splits each sequence tp ways)")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    tp = tp_mesh.size()
    plan_for = PLANS.get(type(model).__name__)
    if plan_for is None:
        raise UserError(f"no tensor-parallel plan for {type(model).__name__}; add one to torchacco/parallel/tensor.py "
                        f"(known: {', '.join(PLANS)})")
    top, block_plan = plan_for(model)
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan)
        for module in block.modules():  # the model reshapes by its own head counts
            for attr in ("n_heads", "n_kv_heads"):
                if isinstance(getattr(module, attr, None), int):
                    setattr(module, attr, getattr(module, attr) // tp)
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items() if getattr(model, k, None) is not None})
    # A tied head (F.linear with the vocabulary-split embedding) returns a DTensor: gather it
    # whole so the loss sees plain logits, as with an untied head.
    model.register_forward_hook(lambda module, inputs, out: out.full_tensor() if isinstance(out, DTensor) else out)
