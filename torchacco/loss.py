"""The training loss: the sum of per-token cross-entropies, and the number of tokens behind it.

Strategies divide the summed gradients by the all-reduced token count, so masked (instruction)
data and uneven workers are weighted per token.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100  # labels that do not count (padding, instruction prompts)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy losses, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def token_loss_sum(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of per-token cross-entropy losses and the number of tokens behind it."""
    labels = batch["labels"]
    return token_loss(model(batch["input_ids"]), labels), (labels != IGNORE_INDEX).sum()
