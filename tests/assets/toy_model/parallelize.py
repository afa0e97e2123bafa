"""Tensor parallelism for the toy model, with torchacco's sequence-parallel block helper."""

from torchacco.parallel.tensor import (
    ColwiseParallel,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    head_layouts,
    sequence_parallel_block,
)
from torchacco.spec import TensorParallelPlan


def plans(model, loss_parallel):
    top = {
        "tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "positions": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(**head_layouts(loss_parallel)),
    }
    return top, sequence_parallel_block("attn", ["q", "k", "v"], "o", "mlp", ["up"], "down", ["norm1", "norm2"])


tensor_parallel = TensorParallelPlan(
    plans=plans,
    split_sizes=lambda args: [
        ("n_heads", args.n_heads),
        ("hidden_dim", args.hidden_dim),
        ("vocab_size", args.vocab_size),
        ("max_seq_len", args.max_seq_len),
    ],
)
