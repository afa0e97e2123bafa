"""ACCO, DPU and WP: the sharded-optimizer job runs beside the next compute period.

Buffers (docs/acco.md): the compute side owns the parameter buffer P (what forward and
backward read) and the gradient accumulator A; the job owns the communication buffer C —
gradients in, parameters out — the one extra parameter copy (compute dtype) over ZeRO-1. The fp32 master
shard and AdamW moments are ZeRO-1's, untouched except by committing jobs.

At every round boundary (`step()`) the compute side
  1. waits for the job in flight — deterministic mode after a fixed number of micro-batches;
     adaptive mode keeps accumulating until it is done — and swaps in the parameters it
     produced: P ← C;
  2. plans the next job; when the next period starts (`micro_batches()`), hands its
     accumulator over (C ← A), launches the job on the runner and zeroes A or keeps adding.
Launching at the start of a period means that between rounds — where the loop logs,
evaluates and stops — no job is in flight and the master shards hold exactly θ.
The schedules differ only in `_plan()`: which job, and whether A is zeroed.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import sys
import time

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.profiler import record_function

from torchacco import health
from torchacco.config import Acco as AccoConfig
from torchacco.device import Device
from torchacco.errors import UserError
from torchacco.parallel.sharded_job import COMMIT, COMMIT_AND_PREDICT, ESTIMATE, gather_master, reduce_update_gather
from torchacco.parallel.strategy import Counts, UpdateResult
from torchacco.parallel.zero1 import ZeRO1

ACCUMULATOR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Overlapped(ZeRO1):
    """ZeRO-1's buffers and job, run on a communication runner one round behind."""

    overlapped = True
    resume_needs_same_ranks = True  # checkpoints hold each rank's accumulator
    sync_phase = "wait for the communication job"

    def __init__(self, model, dims, plan, optimizer, acco: AccoConfig, device: Device):
        super().__init__(model, dims, plan, optimizer, grad_dtype=ACCUMULATOR_DTYPES[acco.accumulator_dtype])
        self.comm = torch.zeros_like(self.flat.params_buffer)  # C: the job's private buffer
        self.job_buffer = self.comm  # C, or its first half seen as bf16 (a bf16 estimate round)
        self.runner = device.runner()
        self.device = device
        self.mode = acco.mode
        self.max_growth = acco.max_growth  # bounds an adaptive period (0: no bound)
        self.lr_batch_scaling = acco.lr_batch_scaling if acco.mode == "adaptive" else 0.0
        self.nominal_tokens = plan.tokens_per_update
        self.estimate_in_bf16 = acco.estimate_comm == "bf16" and self.comm.dtype == torch.float32
        self.split: list[int] | None = None  # balanced: micro-batches per data-parallel rank in a period
        self.seconds_per_micro_batch: list[float | None] = [None] * self.flat.world  # balanced: measured
        self.pending = Counts()  # what A holds
        self.planned: tuple[str, bool] | None = None  # the job to launch when the next period starts
        self.exposed = 0.0  # seconds the compute side waited on jobs since the last commit
        self.job_seconds = 0.0  # seconds the jobs since the last commit took
        self.commits = 0  # committed updates (ACCO's drift cadence, DPU's warm-up)
        self.estimate = (1.0, 1.0)  # ACCO's estimate variant: (gradient weight, damping); a plain step elsewhere
        self.estimate_share = 0.5  # ACCO: the share of an update's micro-batches computed at θ̃

    @classmethod
    def from_config(cls, model, cfg, dims, plan, device):
        return cls(model, dims, plan, cfg.optimizer, cfg.acco, device)

    @classmethod
    def check_config(cls, cfg, dp_size: int, model_parallel: str) -> None:
        super().check_config(cfg, dp_size, model_parallel)
        a = cfg.acco
        if a.mode != "deterministic" and model_parallel:
            raise UserError(
                f"[acco] mode = '{a.mode}' with {model_parallel} is not supported: each rank picks its "
                "own number of micro-batches, but tensor- and pipeline-parallel peers must run the same "
                "ones; use mode = 'deterministic'"
            )
        if a.max_growth < 0 or 0 < a.max_growth < 1:
            raise UserError(f"[acco] max_growth = {a.max_growth:g} must be 0 (no cap) or at least 1")
        if a.lr_batch_scaling < 0:
            raise UserError(f"[acco] lr_batch_scaling = {a.lr_batch_scaling:g} must be >= 0 (0.5: square root)")
        if a.estimate_comm == "bf16" and (cls.name != "acco" or cfg.training.mixed_precision == "bf16"):
            reason = "only acco has an estimate round" if cls.name != "acco" else "the compute dtype is bf16 already"
            raise UserError(f"[acco] estimate_comm = 'bf16' does nothing here ({reason}); set it to 'full'")
        if cfg.acco.mode == "adaptive" and not cfg.training.max_tokens:
            raise UserError(
                "[acco] mode = 'adaptive' lets each update's batch grow while communication runs, so a step count "
                "does not fix the learning-rate schedule or the data seen: set [training] max_tokens (the token "
                "budget)"
            )

    def micro_batches(self):
        target = self._period_micro_batches()
        if self.planned is not None:
            self._launch(*self.planned)
            self.planned = None
        cap = self.max_growth * target if self.max_growth else float("inf")
        n, marks = 0, collections.deque()
        # adaptive: past its micro-batches, a rank keeps accumulating while the job runs
        while n < target or (self.mode == "adaptive" and n + 1 <= cap and self._job_running()):
            yield contextlib.nullcontext()
            n += 1
            if self.mode == "adaptive":  # compare the job with the work done, not queued (CUDA: one queued)
                marks.append(self.device.mark())
                if len(marks) > 1:
                    marks.popleft().synchronize()

    def _period_micro_batches(self) -> int:
        """This rank's micro-batches in the period about to start (before its job is launched)."""
        return self.split[self.flat.rank] if self.split else self.accumulation

    def _job_running(self) -> bool:
        return self.runner.in_flight() and not self.runner.done()

    def lr_for(self) -> callable:
        """Adaptive mode: the schedule's lr scaled for the realised batch, (tokens / nominal)^α."""
        schedule_lr, alpha, nominal = super().lr_for(), self.lr_batch_scaling, self.nominal_tokens
        if not alpha or not nominal:
            return schedule_lr
        return lambda consumed: schedule_lr(consumed) * (consumed / nominal) ** alpha

    def _launch(self, kind: str, keep_accumulating: bool) -> None:
        # C ← A: in bf16 for a bf16 estimate round, in C's first half (the same memory)
        bf16 = kind == ESTIMATE and self.estimate_in_bf16
        self.job_buffer = self.comm.view(torch.bfloat16)[: self.comm.numel()] if bf16 else self.comm
        self.job_buffer.copy_(self.flat.grads)
        flat, opt, comm, local = self.flat, self.optimizer, self.job_buffer, self.pending
        lr_for = self.lr_for()
        if kind == ESTIMATE:
            # The estimate uses the commit's lr: the commit will span this period and the next,
            # about 1 / estimate_share (twice) the tokens (it matters during warm-up, where lr grows with tokens).
            commit_lr, share = lr_for, self.estimate_share
            lr_for = lambda consumed: commit_lr(consumed / share)  # noqa: E731

        heartbeat = health.current()

        def job() -> UpdateResult:
            heartbeat.comm_phase(f"communication job ({kind}: reduce-scatter, optimizer, all-gather)")
            start = time.perf_counter()
            with record_function(f"torchacco/job:{kind}"):
                result = reduce_update_gather(
                    flat, opt, comm, local, lr_for, kind, out=comm, max_norm=self.max_norm, estimate=self.estimate
                )
            result.seconds = time.perf_counter() - start
            heartbeat.comm_phase("")
            return result

        self.runner.launch(job)
        if not keep_accumulating:
            self.flat.grads.zero_()
            self.pending = Counts()

    def _finish(self) -> UpdateResult | None:
        """Wait for the job in flight, swap in its parameters (P ← C), account for it."""
        if not self.runner.in_flight():
            return None
        start = time.perf_counter()
        with record_function("torchacco/wait_for_job"):
            finished = self.runner.wait()
        self.exposed += time.perf_counter() - start
        self.job_seconds += finished.seconds
        self._before_swap(finished)
        self.flat.params_buffer.copy_(self.job_buffer)  # P ← C
        if finished.committed:
            self.commits += 1
            self.consumed += finished.consumed
            finished.exposed_s, finished.jobs_s = self.exposed, self.job_seconds
            self.exposed = self.job_seconds = 0.0
        return finished

    def step(self, counts: Counts) -> UpdateResult | None:
        self.pending = self.pending + counts
        finished = self._finish()
        self.planned = self._plan(finished)
        if self.mode == "balanced" and finished is not None:
            self._rebalance(finished)
        return finished

    def _rebalance(self, finished: UpdateResult) -> None:
        """Balanced mode: split the next periods' micro-batches by each rank's measured time per
        micro-batch (from the gathered numbers, so every rank plans alike)."""
        known = self.seconds_per_micro_batch
        for r, (n, seconds) in enumerate(zip(finished.micro_batches, finished.compute_s)):
            if n > 0 and seconds > 0:
                known[r] = seconds / n if known[r] is None else 0.5 * known[r] + 0.5 * seconds / n
            elif known[r] is not None:
                # No measurement (a rank left without work): its estimate drifts faster each round, so it
                # gets a micro-batch again and is measured anew, instead of idling on a stale reading.
                known[r] *= 0.8
        if all(s is not None for s in known):
            self.split = split_by_speed(self.accumulation * self.flat.world, known)

    def _plan(self, finished: UpdateResult | None) -> tuple[str, bool]:
        """(the next job's kind, whether A keeps accumulating after handing it over)."""
        raise NotImplementedError

    def _before_swap(self, finished: UpdateResult) -> None:
        pass

    @contextlib.contextmanager
    def evaluation(self):
        """Between rounds (no job in flight), with θ — the fp32 master shards, gathered — in P.
        C is free until the next launch, so it keeps P's contents meanwhile."""
        assert not self.runner.in_flight()
        self.comm.copy_(self.flat.params_buffer)
        gather_master(self.flat, self.optimizer, self.flat.params_buffer)
        try:
            yield self.model
        finally:
            self.flat.params_buffer.copy_(self.comm)

    def close(self) -> None:
        """Drain the job in flight. While an error unwinds, that error is the one to report: the
        job's own (often the same peer failure) is dropped, and a job stuck on a frozen peer is
        left to the process's exit."""
        if sys.exc_info()[0] is not None:
            self.runner.abandon()
            return
        if self.runner.in_flight():
            self.runner.wait()
        self.runner.close()

    def state_dict(self) -> dict:
        """Between rounds: ZeRO-1's state, plus what the next rounds need — the compute
        parameters P (θ̃, θ or WP's prediction), this rank's accumulator and its counts, and
        the planned job (ACCO's round parity)."""
        assert not self.runner.in_flight()
        world = self.flat.world
        per_rank = dict(device_mesh=self.dims.dp_mesh, placements=[Shard(0)], run_check=False)
        # The counts behind A, without their compute time: a wall-clock reading is no state to resume.
        pending = self.pending.as_tensor(self.comm.device)[: Counts.FIELDS - 1].unsqueeze(0).contiguous()
        self._pending_buffer = pending  # DCP loads into it
        return {
            **super().state_dict(),
            "schedule": {
                "name": self.name,
                "world": world,
                "commits": self.commits,
                "split": list(self.split or []),  # balanced mode's plan and measurements (the same on every rank)
                "seconds_per_micro_batch": [-1.0 if s is None else s for s in self.seconds_per_micro_batch],
                "planned": "" if self.planned is None else f"{self.planned[0]}:{int(self.planned[1])}",
                "params": self.flat.params_buffer,
                "accumulator": DTensor.from_local(
                    self.flat.grads.unsqueeze(0),
                    **per_rank,
                    shape=(world, self.flat.padded_numel),
                    stride=(self.flat.padded_numel, 1),
                ),
                "pending": DTensor.from_local(
                    pending, **per_rank, shape=(world, Counts.FIELDS - 1), stride=(Counts.FIELDS - 1, 1)
                ),
            },
        }

    def load_state_dict(self, state: dict) -> None:
        schedule = state["schedule"]
        if schedule["name"].lower() != self.name:  # (older checkpoints hold the class name)
            raise UserError(
                f"this checkpoint was saved by {schedule['name'].lower()}, not {self.name}; resume it "
                f'with [parallelism] data_parallel = "{schedule["name"].lower()}"'
            )
        assert schedule["world"] == self.flat.world, "the trainer checks the world size before loading"
        super().load_state_dict(state)
        tokens, loss_sum, micro_batches, consumed = self._pending_buffer[0].tolist()
        self.pending = Counts(tokens, loss_sum, int(micro_batches), consumed)
        kind, _, keep = schedule["planned"].partition(":")
        self.planned = (kind, bool(int(keep))) if kind else None
        self.commits = schedule["commits"]
        self.split = list(schedule.get("split", [])) or None
        seconds = schedule.get("seconds_per_micro_batch", [])
        if len(seconds) == self.flat.world:
            self.seconds_per_micro_batch = [None if s < 0 else s for s in seconds]

    def _refresh_params(self) -> None:
        pass  # P was saved as it was (θ̃, θ or a prediction) and DCP loaded it in place


def split_by_speed(total: int, seconds_per_micro_batch: list[float]) -> list[int]:
    """Micro-batches per rank, `total` in all, that minimise the time of the rank finishing last:
    each one goes to the rank that would finish it soonest (optimal for equal micro-batches)."""
    counts = [0] * len(seconds_per_micro_batch)
    finish = [(s, r) for r, s in enumerate(seconds_per_micro_batch)]  # (finish time with one more, rank)
    heapq.heapify(finish)
    for _ in range(total):
        _, r = heapq.heappop(finish)
        counts[r] += 1
        heapq.heappush(finish, ((counts[r] + 1) * seconds_per_micro_batch[r], r))
    return counts


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

    def __init__(self, model, dims, plan, optimizer, acco: AccoConfig, device: Device):
        super().__init__(model, dims, plan, optimizer, acco, device)
        self.drift_every = acco.drift_every
        self.estimate = (acco.estimate_grad_weight, acco.estimate_damping)
        self.estimate_share = acco.estimate_share
        per_update = plan.micro_batches
        # Deterministic periods of unequal length: the one at θ̃ (hiding the commit) and the one at θ (the estimate).
        self.at_estimate = round(acco.estimate_share * per_update)
        self.at_theta = per_update - self.at_estimate

    @classmethod
    def check_config(cls, cfg, dp_size: int, model_parallel: str) -> None:
        super().check_config(cfg, dp_size, model_parallel)
        a = cfg.acco
        if not 0 <= a.estimate_grad_weight <= 1:
            raise UserError(f"[acco] estimate_grad_weight = {a.estimate_grad_weight:g} must be in [0, 1]")
        if not 0 < a.estimate_damping <= 1:
            raise UserError(f"[acco] estimate_damping = {a.estimate_damping:g} must be in (0, 1]")
        t = cfg.training
        micro_batches = (t.global_batch_size or t.local_batch_size * dp_size) // (t.local_batch_size * dp_size)
        share = a.estimate_share * micro_batches
        if a.estimate_share != 0.5 and (a.mode != "deterministic" or abs(share - round(share)) > 1e-9
                                        or not 1 <= round(share) < micro_batches):  # fmt: skip
            raise UserError(
                f"[acco] estimate_share = {a.estimate_share:g} needs mode = 'deterministic' and a whole number of the "
                f"{micro_batches} micro-batches per update and rank in each period (at least one in each); e.g. "
                f"estimate_share = 0.75 with 4 micro-batches ([training] global_batch_size = 4 × local_batch_size × "
                f"ranks)"
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

    def _before_swap(self, finished):
        # P still holds θ̃_{t+1}, C now holds θ_{t+1}: measure the estimation error.
        if finished.committed and self.drift_every and (self.commits + 1) % self.drift_every == 0:
            finished.drift = relative_distance(self.flat.params_buffer, self.job_buffer)


class DPU(Overlapped):
    """Delayed parameter update: θ_{t+1} = Opt(θ_t, g(θ_{t-1})), one step stale, overlapped.
    The first `[acco] dpu_warmup_steps` updates are synchronous (no staleness)."""

    name = "dpu"

    def __init__(self, model, dims, plan, optimizer, acco: AccoConfig, device: Device):
        super().__init__(model, dims, plan, optimizer, acco, device)
        self.warmup = acco.dpu_warmup_steps

    def _plan(self, finished):
        return COMMIT, False

    def step(self, counts):
        finished = super().step(counts)
        if self.commits < self.warmup:  # synchronous: the update lands before the next period
            self._launch(*self.planned)
            self.planned = None
            finished = self._finish()
        return finished


class WP(Overlapped):
    """Weight prediction: as DPU, but the compute runs at Opt(θ_{t+1}, ḡ_t), the last averaged
    gradient applied once more; θ itself stays in the master shards."""

    name = "wp"

    def _plan(self, finished):
        return COMMIT_AND_PREDICT, False
