"""How GPT-Neo is split for tensor parallelism (applied by torchacco/parallel/tensor.py).
It has no pipeline split: its output head is its input embedding."""

from __future__ import annotations

import torch.nn as nn

from torchacco.parallel.tensor import Replicate, RowwiseParallel, SequenceParallel, Shard, sequence_parallel_block
from torchacco.spec import PipelinePlan, TensorParallelPlan


def tp_plans(model: nn.Module, loss_parallel: bool) -> tuple[dict, dict]:
    top = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        # positions [T] -> [T, dim]: split along T (dim 0) to add to the local token shard
        "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
    }
    block = sequence_parallel_block(
        "attn", ["q_proj", "k_proj", "v_proj"], "out_proj", "mlp", ["c_fc"], "c_proj", ["ln_1", "ln_2"]
    )
    return top, block


def tp_split_sizes(args) -> list[tuple[str, int]]:
    # the learned positions are split too
    return [
        ("n_heads", args.n_heads),
        ("ffn hidden dim", args.hidden_dim),
        ("vocab_size", args.vocab_size),
        ("max_seq_len", args.max_seq_len),
    ]


tensor_parallel = TensorParallelPlan(plans=tp_plans, split_sizes=tp_split_sizes)
pipeline = PipelinePlan(
    unsupported=lambda args: (
        "its output head is tied to the input embedding (always, in GPT-Neo), which would live on the first and the "
        "last stage; use tensor_parallel_degree instead, or a model with an untied head (llama3 8B/70B)"
    )
)
