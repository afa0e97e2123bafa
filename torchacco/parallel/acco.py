"""ACCO: each update computed over two periods, at the estimate θ̃ and at θ, while the sharded job of the previous
period runs beside them (docs/acco.md; the rounds in overlapped.py)."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import torch

from torchacco.options import OverlappedOptions
from torchacco.parallel.overlapped import OVERLAPPED, Overlapped, Planner
from torchacco.parallel.sharded_job import COMMIT, ESTIMATE
from torchacco.parallel.strategy import UpdatePlan

ADVICE_AT_COMMIT = 20  # past compilation and the first, slower updates


def share_advice(share: float, compute_s: float, job_s: float, micro_batches: int) -> str | None:
    """One line when the other measured estimate_share fits this run better (docs/acco.md). With C an update's
    compute and M one job, rounds cost max(s·C, M) + max((1 − s)·C, M): 0.875 costs halves' time where M ≤ C/8 or
    M ≥ 7C/8, and min(M − C/8, 7C/8 − M) more between."""
    if compute_s <= 0 or share not in (0.5, 0.875):
        return None
    ratio, extra = job_s / compute_s, min(job_s - compute_s / 8, 7 * compute_s / 8 - job_s)
    if share == 0.5 and extra <= 0:
        needs = f"; it needs a multiple of 8 micro-batches per rank (here {micro_batches})" if micro_batches % 8 else ""
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


class AccoPlanner(Planner):
    """ACCO: each update over two periods, at the estimate θ̃ and at θ. Rounds alternate, as in docs/acco.md's table:

    | round      | compute side                               | job                                      |
    | ESTIMATE t | g_t at θ_t ADDED to A, which holds g̃_t      | θ̃_{t+1} = Opt(θ_t, mean g̃_t), no commit   |
    | COMMIT t   | g̃_{t+1} at θ̃_{t+1} into a zeroed A          | θ_{t+1} = Opt(θ_t, (g̃_t + g_t) / N)       |

    The first period computes at θ_0 (θ̃_0 = θ_0); the first job is an ESTIMATE.
    """

    traits = dataclasses.replace(OVERLAPPED, name="acco", periods_per_update=2, estimates=True)  # one at θ̃, one at θ

    def __init__(self, acco: OverlappedOptions, plan: UpdatePlan):
        self.clip_by_commit = acco.estimate_clip == "commit"
        self.commit_norm: float | None = None  # then: the last commit's gradient norm
        self.share = acco.estimate_share
        self.drift_every = acco.drift_every
        # Deterministic periods of unequal length: the one at θ̃ (hiding the commit) and the one at θ (the estimate).
        self.at_estimate = round(acco.estimate_share * plan.micro_batches)
        self.at_theta = plan.micro_batches - self.at_estimate

    @property
    def estimate_clip_norm(self) -> float | None:
        return self.commit_norm  # None: clipped by its own norm

    def plan(self, finished):
        if finished is None or finished.committed:
            return ESTIMATE, True  # keep g̃_t in A: the next period adds g_t to it
        return COMMIT, False  # A = g̃_t + g_t goes to the commit; g̃_{t+1} starts from zero

    def period(self, s: Overlapped) -> int | None:
        if self.share == 0.5 or s.balance.split:  # balanced: the measured split decides
            return None
        # The first period (θ̃_0 = θ_0) and every period beside a commit compute g̃ at θ̃.
        at_estimate = s.next_job in (None, COMMIT)
        return self.at_estimate if at_estimate else self.at_theta

    def finished(self, s: Overlapped, finished):
        if finished is not None and finished.committed and s.commits == ADVICE_AT_COMMIT:
            if s.options.mode == "deterministic" and not s.balanced and finished.compute_s and not finished.skipped:
                finished.advice = share_advice(
                    self.share, max(finished.compute_s), finished.jobs_s / 2, self.at_estimate + self.at_theta
                )
        return finished

    def before_swap(self, s: Overlapped, finished) -> None:
        # P still holds θ̃_{t+1}, C now holds θ_{t+1}: measure the estimation error.
        if finished.committed and self.drift_every and (s.commits + 1) % self.drift_every == 0:
            finished.drift = relative_distance(s.sharded.params, s.job_buffer)

    def committed(self, finished) -> None:
        if self.clip_by_commit and not finished.skipped:
            self.commit_norm = finished.grad_norm

    def state_dict(self) -> dict:
        """The last commit's norm, which clips the next estimate (`[acco] estimate_clip = 'commit'`; -1: none yet).
        Only then: checkpoints of every other configuration keep their keys."""
        if not self.clip_by_commit:
            return {}
        return {"commit_norm": -1.0 if self.commit_norm is None else self.commit_norm}

    def load_state_dict(self, schedule: dict) -> None:
        if self.clip_by_commit:
            self.commit_norm = None if schedule["commit_norm"] < 0 else schedule["commit_norm"]

    @classmethod
    def check_config(cls, dp_size: int, *, options, training, optimizer, lr_schedule) -> str | None:
        a = options
        if not 0 < a.estimate_share < 1:
            return f"[acco] estimate_share = {a.estimate_share:g} must be between 0 and 1 (0.5: the paper)"
        t = training
        micro_batches = UpdatePlan.from_config(t, optimizer, lr_schedule, dp_size).micro_batches
        global_batch = micro_batches * t.local_batch_size * dp_size
        share = a.estimate_share * micro_batches
        if a.estimate_share != 0.5 and (a.mode != "deterministic" or abs(share - round(share)) > 1e-9
                                        or not 1 <= round(share) < micro_batches):  # fmt: skip
            # the fewest micro-batches per rank that split as the share asks, and a local batch that gives them
            needed = Fraction(a.estimate_share).limit_denominator(1000).denominator
            local = global_batch // (needed * dp_size)
            how = (f"[training] local_batch_size = {local}" if local >= 1 and local * needed * dp_size == global_batch
                   else f"[training] global_batch_size = {needed} × local_batch_size × {dp_size} ranks")  # fmt: skip
            return (
                f"[acco] estimate_share = {a.estimate_share:g} needs mode = 'deterministic' and a whole number of the "
                f"{micro_batches} micro-batches per update and rank in each period (at least one in each): use a "
                f"multiple of {needed} micro-batches per rank, e.g. {how}"
            )
        if micro_batches % 2 and a.estimate_share == 0.5:
            return (
                f"acco computes each update over two periods (at θ̃ and at θ), so it needs an even number of "
                f"micro-batches per update and rank; got {micro_batches}: set [training] global_batch_size to a "
                f"multiple of 2 × local_batch_size × ranks = {2 * t.local_batch_size * dp_size}"
            )
        return None


ACCO = Overlapped.scheduled_by(AccoPlanner)
