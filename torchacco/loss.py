"""The training loss: the sum of per-token cross-entropies, and the number of tokens behind it.

Strategies divide the summed gradients by the all-reduced token count, so masked data and uneven workers are
weighted per token. Two things keep the loss from multiplying the logits' memory:
- chunks: the cross-entropy runs over pieces of the sequence, each upcast to fp32 and checkpointed, so fp32
  logits and their softmax exist for one piece at a time.
- vocab_parallel (tensor parallelism): the logits stay split by vocabulary over the tp ranks (DTensor's
  `loss_parallel`), so no rank holds the whole vocabulary's logits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # labels that do not count (padding, instruction prompts)


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


@dataclass(frozen=True)
class TokenLoss:
    chunks: int = 1  # pieces of the sequence the fp32 cross-entropy runs over
    vocab_parallel: bool = False  # the logits arrive split by vocabulary (a DTensor)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of per-token cross-entropy losses, in fp32 (a replicated DTensor when vocab-parallel)."""
        if self.chunks <= 1 or logits.shape[1] < 2:
            return _cross_entropy_sum(logits, labels)
        size = -(-logits.shape[1] // self.chunks)
        total = None
        for part, part_labels in zip(logits.split(size, dim=1), labels.split(size, dim=1)):
            if torch.is_grad_enabled():
                loss = checkpoint(_cross_entropy_sum, part, part_labels, use_reentrant=False)
            else:
                loss = _cross_entropy_sum(part, part_labels)
            total = loss if total is None else total + loss
        return total

    def context(self) -> contextlib.AbstractContextManager:
        """Around forward and backward: DTensor's vocabulary-parallel cross-entropy when enabled."""
        return loss_parallel() if self.vocab_parallel else contextlib.nullcontext()

    def of_batch(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss sum of `model` on `batch` (backward-able) and the number of tokens in it."""
        labels = batch["labels"]
        return self(model(batch["input_ids"]), labels), (labels != IGNORE_INDEX).sum()


def value(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain detached tensor (a vocab-parallel loss is a replicated DTensor)."""
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
