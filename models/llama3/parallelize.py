"""How Llama 3 is split for tensor and pipeline parallelism (applied by torchacco/parallel/)."""

from __future__ import annotations

import torch
import torch.nn as nn

from torchacco.parallel.tensor import (
    ColwiseParallel,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    head_layouts,
    sequence_parallel_block,
)
from torchacco.spec import PipelinePlan, TensorParallelPlan


def tp_plans(model: nn.Module, loss_parallel: bool) -> tuple[dict, dict]:
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
    }
    if model.output is not None:  # untied head: split by vocabulary, logits gathered
        top["output"] = ColwiseParallel(**head_layouts(loss_parallel))
    block = sequence_parallel_block(
        "attention",
        ["wq", "wk", "wv"],
        "wo",
        "feed_forward",
        ["w1", "w3"],
        "w2",
        ["attention_norm", "ffn_norm"],
        extra_inputs=1,
    )  # the RoPE table
    return top, block


def tp_split_sizes(args) -> list[tuple[str, int]]:
    # grouped-query attention: whole kv heads per rank
    return [
        ("n_heads", args.n_heads),
        ("n_kv_heads", args.kv_heads),
        ("ffn hidden dim", args.hidden_dim),
        ("vocab_size", args.vocab_size),
    ]


def pipeline_unsupported(args) -> str | None:
    if args.tie_embeddings:
        return (
            "its output head is tied to the input embedding, which would live on the first and the last stage; "
            "use tensor_parallel_degree instead, or a flavor with an untied head (8B, 70B)"
        )
    return None


def prune(model: nn.Module, first: bool, last: bool) -> None:
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = model.output = None


class LlamaStage(nn.Module):
    """Embedding (first stage) → blocks → norm and head (last stage), over the model's own modules."""

    def __init__(self, model: nn.Module, layer_ids: range, first: bool, last: bool, seq_shards: int):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.blocks = nn.ModuleList(model.layers[str(i)] for i in layer_ids)
        self.norm, self.output = (model.norm, model.output) if last else (None, None)
        # The model owns the RoPE buffer, and may allocate it after the stage is built (a model
        # built on meta): read it through the model, which a tuple keeps from becoming a submodule.
        self.owner = (model,)
        self.seq_shards = seq_shards  # sequence parallelism: activations between stages hold T / tp tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            T = x.shape[1]
            x = self.tok_embeddings(x)
        else:
            T = x.shape[1] * self.seq_shards
        rope = self.owner[0].rope[:T]
        for block in self.blocks:
            x = block(x, rope)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


tensor_parallel = TensorParallelPlan(plans=tp_plans, split_sizes=tp_split_sizes)
pipeline = PipelinePlan(unsupported=pipeline_unsupported, prune=prune, stage=LlamaStage)
