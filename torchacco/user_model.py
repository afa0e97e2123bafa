"""A model passed to `train(cfg, model=...)` that is not one of torchacco's (it has no `.args`): a Hugging Face
`PreTrainedModel` such as an `AutoModelForCausalLM`, or any module mapping token ids [B, T] to logits
[B, T, vocab] (or to an object holding them as `.logits`, or a tuple whose first element they are).

It is adapted from outside, so its parameter names, checkpoints and exports stay its own; what it supports is
docs/python_api.md's "What is supported with a Hugging Face model".
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from torchacco.blocks import blocks_of
from torchacco.errors import UserError


def check(model: nn.Module, parallelism, training, checkpoint) -> None:
    """Before anything is built: what a foreign model cannot do with these config sections."""
    p, name = parallelism, type(model).__name__
    if p.tensor_parallel_degree > 1 or p.pipeline_parallel_degree > 1:
        raise UserError(
            f"tensor and pipeline parallelism need a torchacco model folder (models/<name>/ whose ModelSpec has a "
            f"TensorParallelPlan / PipelinePlan, see torchacco/spec.py); the {name} passed to train() runs under "
            "data parallelism only: set [parallelism] tensor_parallel_degree = 1 and pipeline_parallel_degree = 1"
        )
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int) and training.seq_len > positions:
        raise UserError(
            f"[training] seq_len = {training.seq_len} exceeds the {positions} positions of the {name} "
            f"(config.max_position_embeddings); use --training.seq_len {positions} or less"
        )
    if training.activation_checkpoint != "none" and blocks_of(model) is None:
        raise UserError(
            f"[training] activation_checkpoint needs the model's blocks and the {name} has no nn.ModuleList of "
            "decoder layers; set activation_checkpoint = 'none'"
        )
    if checkpoint.export_hf and not hasattr(model, "save_pretrained"):
        raise UserError(
            f"[checkpoint] export_hf writes a Hugging Face folder, which needs a torchacco model or a transformers "
            f"PreTrainedModel (save_pretrained); the {name} is neither: set export_hf = false"
        )


@dataclass
class Adapter:
    """The hooks that make a foreign model return logits; `remove()` gives the model back as it was."""

    handles: list = field(default_factory=list)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def adapt(model: nn.Module) -> Adapter:
    """Hook `model` so that `model(input_ids)` returns logits; put it in training mode (from_pretrained returns
    it in eval mode, which would turn dropout off)."""
    adapter = Adapter()
    if "use_cache" in inspect.signature(model.forward).parameters:
        no_cache = lambda module, args, kwargs: (args, {**kwargs, "use_cache": False})
        adapter.handles.append(model.register_forward_pre_hook(no_cache, with_kwargs=True))
    adapter.handles.append(model.register_forward_hook(_logits))
    model.train()
    return adapter


def _logits(module, args, output):
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        logits = output[0]  # return_dict=False: (logits, ...) when no labels are passed
    if not isinstance(logits, torch.Tensor):
        raise UserError(
            f"the {type(module).__name__} returned a {type(output).__name__}; train() needs logits [batch, seq, "
            "vocab] from model(input_ids), or an output with .logits"
        )
    return logits


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Forward + backward FLOPs per token, as torchacco's models count them: 6 × the matmul weights (embedding
    lookups are free, a tied head is not) + 12 × layers × hidden_size × seq_len; without a width, 6 × params."""
    params = {id(p): p.numel() for p in model.parameters()}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module) and isinstance(getattr(head, "weight", None), torch.Tensor):
        lookups.discard(id(head.weight))  # a tied head multiplies by the embedding
    n = sum(v for k, v in params.items() if k not in lookups)
    width, blocks = getattr(getattr(model, "config", None), "hidden_size", None), blocks_of(model)
    if not isinstance(width, int) or blocks is None:
        return 6.0 * sum(params.values())
    return 6.0 * n + 12.0 * len(blocks) * width * seq_len


def check_vocabulary(model: nn.Module, vocab_size: int) -> None:
    """The tokenizer's ids must fit the model's input embedding."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)
    if isinstance(rows, int) and vocab_size > rows:
        raise UserError(
            f"the tokenizer has {vocab_size} tokens but the {type(model).__name__}'s input embedding has {rows} "
            f"rows; pass the model's own tokenizer, or grow it first: model.resize_token_embeddings({vocab_size})"
        )


def export(model: nn.Module, weights: dict, folder: Path, dtype: torch.dtype, tokenizer) -> Path:
    """θ as a Hugging Face folder by the model's own `save_pretrained`, with the tokenizer (a transformers one
    by its own save_pretrained, else as tokenizer.json)."""
    model.save_pretrained(folder, state_dict={k: v.to(dtype) for k, v in weights.items()})
    if getattr(tokenizer, "hf", None) is not None:
        tokenizer.hf.save_pretrained(folder)
    elif tokenizer is not None:
        tokenizer.save(folder)
    return folder
