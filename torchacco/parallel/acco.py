"""ACCO: each update computed over two periods, at the estimate θ̃ and at θ, while the sharded
job of the previous period runs beside them (docs/acco.md; the rounds in overlapped.py)."""

from __future__ import annotations

from fractions import Fraction

import torch

from torchacco.device import Device
from torchacco.errors import UserError
from torchacco.parallel.overlapped import Overlapped, OverlappedOptions
from torchacco.parallel.sharded_job import COMMIT, ESTIMATE

ADVICE_AT_COMMIT = 20  # past compilation and the first, slower updates


def share_advice(share: float, compute_s: float, job_s: float, micro_batches: int) -> str | None:
    """One line when the other measured estimate_share fits this run better (docs/acco.md).

    With C the compute of an update and M one job, rounds cost max(s·C, M) + max((1 − s)·C, M):
    0.875 costs halves' time where M ≤ C/8 or M ≥ 7C/8, and min(M − C/8, 7C/8 − M) more between.
    Near DDP's largest stable learning rate it reached DDP's loss with about 5% fewer tokens."""
    if compute_s <= 0 or share not in (0.5, 0.875):
        return None
    ratio, extra = job_s / compute_s, min(job_s - compute_s / 8, 7 * compute_s / 8 - job_s)
    if share == 0.5 and extra <= 0:
        needs = (
            ""
            if micro_batches % 8 == 0
            else f"; it needs a multiple of 8 micro-batches per rank (here {micro_batches})"
        )
        return (
            f"[acco] a job takes {ratio:.0%} of an update's compute here, so estimate_share = 0.875 would cost no "
            "time (as for any job under 12.5% or over 87.5% of it) and, near DDP's largest stable learning "
            f"rate, needed about 5% fewer tokens to DDP's loss than halves (docs/acco.md){needs}"
        )
    if share == 0.875 and extra > 0:
        return (
            f"[acco] a job takes {ratio:.0%} of an update's compute here, so estimate_share = 0.875 can leave up to "
            f"about {extra:.3g} s per update exposed ({extra / compute_s:.0%} of the compute) that halves (0.5) would "
            "hide, at some loss per token near DDP's largest stable learning rate (docs/acco.md)"
        )
    return None


def relative_distance(estimate: torch.Tensor, truth: torch.Tensor, chunk: int = 1 << 24) -> float:
    """‖estimate − truth‖ / ‖truth‖ in fp32, a chunk at a time (no full-size fp32 copies)."""
    diff_sq = truth_sq = 0.0
    for start in range(0, truth.numel(), chunk):
        t = truth[start : start + chunk].float()
        diff_sq += (estimate[start : start + chunk].float() - t).square().sum().item()
        truth_sq += t.square().sum().item()
    return (diff_sq / max(truth_sq, 1e-30)) ** 0.5


class ACCO(Overlapped):
    """Rounds alternate, as in docs/acco.md's table:

    | round      | compute side                               | job                                      |
    | ESTIMATE t | g_t at θ_t ADDED to A, which holds g̃_t      | θ̃_{t+1} = Opt(θ_t, mean g̃_t), no commit   |
    | COMMIT t   | g̃_{t+1} at θ̃_{t+1} into a zeroed A          | θ_{t+1} = Opt(θ_t, (g̃_t + g_t) / N)       |

    The first period computes at θ_0 (θ̃_0 = θ_0); the first job is an ESTIMATE.
    """

    name = "acco"
    periods_per_update = 2  # one at θ̃, one at θ
    estimates = True
    variants = {
        "acco_bf16_estimate": (("--acco.estimate_comm", "bf16"), "bf16_estimate"),
        "acco_balanced": (("--acco.mode", "balanced"), "balanced"),
        "acco_adaptive": (("--acco.mode", "adaptive"), "adaptive"),  # capped at max_growth (default 2)
        "acco_adaptive_uncapped": (("--acco.mode", "adaptive", "--acco.max_growth", "0"), "adaptive_uncapped"),
        # 7 of every 8 micro-batches at θ̃: level with DDP per token at its best lr (docs/acco.md); needs 8 per rank
        "acco_share875": (("--acco.estimate_share", "0.875"), "share875"),
    }
    estimate_shares = {"share875": 0.875}  # the cost model's mode -> the share of an update computed at θ̃

    def __init__(self, model, dims, plan, optimizer, acco: OverlappedOptions, device: Device, reduce_dtype=None):
        super().__init__(model, dims, plan, optimizer, acco, device, reduce_dtype or torch.float32)
        self.drift_every = acco.drift_every
        self.estimate = (acco.estimate_grad_weight, acco.estimate_damping)
        self.clip_by_commit = acco.estimate_clip == "commit"
        self.estimate_token_weight = acco.estimate_token_weight
        self.estimate_share = acco.estimate_share
        # Deterministic periods of unequal length: the one at θ̃ (hiding the commit) and the one at θ (the estimate).
        self.at_estimate = round(acco.estimate_share * plan.micro_batches)
        self.at_theta = plan.micro_batches - self.at_estimate

    @classmethod
    def check_config(cls, cfg, dp_size: int, model_parallel: str) -> None:
        super().check_config(cfg, dp_size, model_parallel)
        a = getattr(cfg, cls.options_section)
        if not 0 <= a.estimate_grad_weight <= 1:
            raise UserError(f"[acco] estimate_grad_weight = {a.estimate_grad_weight:g} must be in [0, 1]")
        if not 0 < a.estimate_damping <= 1:
            raise UserError(f"[acco] estimate_damping = {a.estimate_damping:g} must be in (0, 1]")
        if not a.estimate_token_weight > 0:
            raise UserError(
                f"[acco] estimate_token_weight = {a.estimate_token_weight:g} must be > 0 (1: the plain one)"
            )
        if not 0 < a.estimate_share < 1:
            raise UserError(f"[acco] estimate_share = {a.estimate_share:g} must be between 0 and 1 (0.5: the paper)")
        t = cfg.training
        global_batch = t.global_batch_size or t.local_batch_size * dp_size
        micro_batches = global_batch // (t.local_batch_size * dp_size)
        share = a.estimate_share * micro_batches
        if a.estimate_share != 0.5 and (a.mode != "deterministic" or abs(share - round(share)) > 1e-9
                                        or not 1 <= round(share) < micro_batches):  # fmt: skip
            # the fewest micro-batches per rank that split as the share asks, and a local batch that gives them
            needed = Fraction(a.estimate_share).limit_denominator(1000).denominator
            local = global_batch // (needed * dp_size)
            how = (f"[training] local_batch_size = {local}" if local >= 1 and local * needed * dp_size == global_batch
                   else f"[training] global_batch_size = {needed} × local_batch_size × {dp_size} ranks")  # fmt: skip
            raise UserError(
                f"[acco] estimate_share = {a.estimate_share:g} needs mode = 'deterministic' and a whole number of the "
                f"{micro_batches} micro-batches per update and rank in each period (at least one in each): use a "
                f"multiple of {needed} micro-batches per rank, e.g. {how}"
            )
        if micro_batches % 2 and a.estimate_share == 0.5:
            raise UserError(
                f"acco computes each update over two periods (at θ̃ and at θ), so it needs an even number of "
                f"micro-batches per update and rank; got {micro_batches}: set [training] global_batch_size to a "
                f"multiple of 2 × local_batch_size × ranks = {2 * t.local_batch_size * dp_size}"
            )

    def _period_micro_batches(self) -> int:
        if self.estimate_share == 0.5 or self.split:
            return super()._period_micro_batches()
        # The first period (θ̃_0 = θ_0) and every period beside a commit compute g̃ at θ̃.
        at_estimate = self.planned is None or self.planned[0] == COMMIT
        return self.at_estimate if at_estimate else self.at_theta

    def _plan(self, finished):
        if finished is None or finished.committed:
            return ESTIMATE, True  # keep g̃_t in A: the next period adds g_t to it
        return COMMIT, False  # A = g̃_t + g_t goes to the commit; g̃_{t+1} starts from zero

    def step(self, counts):
        finished = super().step(counts)
        if finished is not None and finished.committed and self.commits == ADVICE_AT_COMMIT:
            if self.mode == "deterministic" and not self.balanced and finished.compute_s and not finished.skipped:
                finished.advice = share_advice(
                    self.estimate_share, max(finished.compute_s), finished.jobs_s / 2, self.at_estimate + self.at_theta
                )
        return finished

    def _before_swap(self, finished):
        # P still holds θ̃_{t+1}, C now holds θ_{t+1}: measure the estimation error.
        if finished.committed and self.drift_every and (self.commits + 1) % self.drift_every == 0:
            finished.drift = relative_distance(self.flat.params_buffer, self.job_buffer)
