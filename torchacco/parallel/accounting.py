"""An update's accounting, the same for every strategy: gather each rank's `Counts` (and any scalars the strategy adds,
such as its share of ‖g‖²) in one small collective, refuse an update without a token in the loss, name the ranks whose
loss was non-finite, and report the update as an `UpdateResult`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchacco.errors import UserError
from torchacco.parallel.collectives import all_gather
from torchacco.parallel.strategy import Counts, UpdateResult


@dataclass
class GatheredCounts:
    """One row per rank of the group: the strategy's scalars, then `Counts.as_tensor()`."""

    rows: torch.Tensor  # (ranks, scalars + Counts.FIELDS), float64 on the CPU
    scalars: int

    def __post_init__(self):
        sums = self.rows.sum(0).tolist()  # column by column: every rank adds in the same order
        self.scalar_sums = sums[: self.scalars]
        self.tokens, self.loss_sum, _, self.consumed, _ = sums[self.scalars :]

    def _column(self, field: int) -> list[float]:
        return self.rows[:, self.scalars + field].tolist()

    def nonfinite_ranks(self, group: dist.ProcessGroup, mp_group: dist.ProcessGroup | None, device) -> list[int]:
        """Global ranks whose own loss was NaN/Inf, named by any rank of their tp × pp block (a pipeline's loss exists
        on its last stage only): a collective over `mp_group`, the union of what its ranks found."""
        members = dist.get_process_group_ranks(group)
        bad = [members[r] for r, v in enumerate(self._column(1)) if not math.isfinite(v)]
        if mp_group is None:
            return sorted(bad)
        marks = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
        marks[bad] = 1
        dist.all_reduce(marks, op=dist.ReduceOp.MAX, group=mp_group)
        return marks.nonzero().flatten().tolist()

    def require_tokens(self) -> None:
        if self.tokens <= 0:
            raise UserError(
                "an update has no token in the loss on any rank (every label masked); raise "
                "[training] local_batch_size or global_batch_size, or check the data's masking"
            )

    def result(self, loss_sum: float, grad_norm: float, lr: float, committed: bool, **extra) -> UpdateResult:
        """`loss_sum` is the whole model's (under pipeline parallelism, the last stage's)."""
        return UpdateResult(
            self.tokens,
            loss_sum / max(self.tokens, 1.0),
            grad_norm,
            lr,
            committed,
            micro_batches=[int(n) for n in self._column(2)],
            compute_s=self._column(4),
            consumed=self.consumed,
            **extra,
        )


def gather_counts(local: Counts, group: dist.ProcessGroup, device, scalars=None) -> GatheredCounts:
    """Every rank's `scalars` (float64, 1-D) and `local` counts, in one all-gather."""
    mine = local.as_tensor(device)
    if scalars is not None:
        mine = torch.cat([scalars.to(torch.float64).reshape(-1), mine])
    rows = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.float64, device=mine.device)
    all_gather(rows, mine, group=group)
    return GatheredCounts(rows.view(-1, mine.numel()).cpu(), mine.numel() - Counts.FIELDS)
