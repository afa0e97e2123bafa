"""The overlapped schedules' shared machinery: the sharded optimizer state's job run beside the next compute
period, one round behind; a `Planner` (acco.py, dpu.py, wp.py) plans the rounds (docs/acco.md).

The compute side owns the parameter buffer P and the gradient accumulator A; the job owns the buffer C (gradients
in, parameters out), the one extra parameter copy over ZeRO-1. At every round boundary (`step()`) the compute side
waits for the job in flight (adaptive mode keeps accumulating until it is done) and swaps in its parameters,
P ← C, then plans the next job; when the next period starts (`micro_batches()`) it hands A over (C ← A), launches
the job and zeroes A or keeps adding. So between rounds, where the loop logs, evaluates and stops, no job is in
flight and the master shards hold exactly θ."""

from __future__ import annotations

import collections
import contextlib
import math
import time
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.profiler import record_function

from torchacco.device import DTYPES
from torchacco.errors import UserError
from torchacco.options import OverlappedOptions
from torchacco.parallel.balance import SpeedSplit
from torchacco.parallel.collectives import PIECE_NUMEL
from torchacco.parallel.flat import padded_numel
from torchacco.parallel.sharded_job import COMMIT, ESTIMATE
from torchacco.parallel.sharded_state import ShardedOptimizerState
from torchacco.parallel.strategy import Counts, Strategy, Traits, UpdateResult
from torchacco.parallel.zero1 import sharded_checkpoint_key
from torchacco.runners import stall_deadline_s

# The traits the overlapped schedules share; each names itself (and ACCO its estimate rounds). Their checkpoints hold
# each rank's accumulator: resumed on as many ranks.
OVERLAPPED = Traits("", "sharded_job", "wait for the communication job", overlapped=True, shards_theta=True,
                    options=OverlappedOptions, resume_needs_same_ranks=True)  # fmt: skip


class Planner:
    """A schedule's rounds, which `Overlapped` runs through its public methods: this base commits every round with
    A zeroed (`kind`: WP predicts as it commits). A planner class declares the schedule's traits and checks."""

    traits: ClassVar[Traits]  # the schedule's, under its registry name
    kind = COMMIT
    estimate_clip_norm: float | None = None  # the norm that clips an estimate job; None: its own
    share = 0.5  # of an update's micro-batches computed at θ̃

    def __init__(self, options: OverlappedOptions, plan):
        """From the [acco] options and the update plan."""

    @classmethod
    def check_config(cls, dp_size: int, *, options, training, optimizer, lr_schedule) -> str | None:
        """Why this schedule cannot run the sections, beyond what every overlapped one checks (one line), or None."""
        return None

    def plan(self, finished: UpdateResult | None) -> tuple[str, bool]:
        """(the next job's kind, whether A keeps accumulating after handing it over)."""
        return self.kind, False

    def period(self, schedule: Overlapped) -> int | None:
        """This rank's micro-batches in the period about to start (None: the balancer's count)."""
        return None

    def finished(self, schedule: Overlapped, finished: UpdateResult | None) -> UpdateResult | None:
        """After a round: what the loop gets (the update it finished, or a later one)."""
        return finished

    def before_swap(self, schedule: Overlapped, finished: UpdateResult) -> None:
        """The job's parameters are in C, P still holds the period's: the last look at both."""

    def committed(self, finished: UpdateResult) -> None:
        """A commit landed."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, schedule: dict) -> None: ...


@dataclass
class JobTimes:
    """Since the last commit: the seconds the compute side waited on jobs (exposed) and the seconds they took."""

    exposed: float = 0.0
    jobs: float = 0.0


class Overlapped(Strategy):
    """The sharded job one round behind, its rounds planned by a `Planner`. The registry lists one class per
    planner (`scheduled_by`): the planner's traits and checks, the rest this class's."""

    planner_class: ClassVar[type[Planner]]

    def __init__(self, model, dims, plan, optimizer, acco: OverlappedOptions, device, reduce_dtype=torch.float32):
        self.model, self.plan, self.options = model, plan, acco
        self.planner = self.planner_class(acco, plan)
        self.consumed = 0.0  # tokens consumed by committed updates, all ranks: the schedule position
        grad_dtype = DTYPES[acco.accumulator_dtype]
        # θ is read and written between rounds only (no job in flight): the loop's and DiLoCo's outer step's turn
        self.sharded = self.theta = ShardedOptimizerState(model, dims, plan.param_dtype, optimizer, grad_dtype)
        params, flat = self.sharded.params, self.sharded.flat
        # C: the job's private buffer, gradients in and parameters out (the job buffer, P ← it); fp32 when it sums
        # the gradients of bf16 compute in fp32, the parameters then landing in a bf16 half of it (`_fp32_reduce_out`).
        comm_dtype = job_buffer_dtype(params.dtype, reduce_dtype, flat.world)
        self.comm = comm = torch.zeros(params.numel(), dtype=comm_dtype, device=params.device)
        self.job_buffer = comm if comm_dtype == params.dtype else _fp32_reduce_out(comm, params.dtype, flat.rank)
        self.runner, self.device = device.runner(), device
        self.stall_s = stall_deadline_s(dims.timeout)  # a job running longer: a peer stalled
        self.sharded.on_job_thread = self._on_job_thread  # (θ gathered for evaluation and DiLoCo's outer step)
        self.balanced = acco.mode == "balanced"  # or [parallelism] balance_batches (from_config)
        self.balance = SpeedSplit(plan.micro_batches // self.traits.periods_per_update, flat.world, flat.rank)
        self.pending = Counts()  # what A holds
        self.planned: tuple[str, bool] | None = None  # the job to launch when the next period starts
        self.times = JobTimes()
        self.commits = 0  # committed updates (ACCO's drift cadence, DPU's warm-up)

    @classmethod
    def scheduled_by(cls, planner_class: type[Planner]) -> type[Overlapped]:
        """The strategy class of `planner_class`'s schedule, named as its traits name it (acco: ACCO)."""
        body = {"traits": planner_class.traits, "planner_class": planner_class, "__module__": planner_class.__module__}
        return type(planner_class.traits.name.upper(), (cls,), body)

    @classmethod
    def from_config(cls, model, dims, plan, device, *, parallelism, optimizer, options):
        strategy = cls(model, dims, plan, optimizer, options, device, DTYPES[parallelism.reduce_dtype])
        strategy.balanced = strategy.balanced or parallelism.balance_batches
        return strategy

    @classmethod
    def check_config(cls, dp_size: int, model_parallel: str, *, options, training, **sections) -> str | None:
        a, estimates = options, cls.traits.estimates
        if a.mode != "deterministic" and model_parallel:
            return (f"[acco] mode = '{a.mode}' with {model_parallel} is not supported: each rank "
                    "picks its own number of micro-batches, but tensor- and pipeline-parallel "
                    "peers must run the same ones; use mode = 'deterministic'")  # fmt: skip
        if a.max_growth < 0 or 0 < a.max_growth < 1:
            return f"[acco] max_growth = {a.max_growth:g} must be 0 (no cap) or at least 1"
        if a.lr_batch_scaling < 0:
            return f"[acco] lr_batch_scaling = {a.lr_batch_scaling:g} must be >= 0 (0.5: square root)"
        if a.estimate_comm == "bf16" and (not estimates or training.mixed_precision == "bf16"):
            reason = "only acco has an estimate round" if not estimates else "the compute dtype is bf16 already"
            return f"[acco] estimate_comm = 'bf16' does nothing here ({reason}); set it to 'full'"
        defaults = OverlappedOptions()
        for option in ("estimate_share", "estimate_clip"):
            value, default = getattr(a, option), getattr(defaults, option)
            if not estimates and value != default:
                return (f"[acco] {option} = {value!r} does nothing here (only acco has an "
                        f"estimate round); remove it or set it to {default!r}")  # fmt: skip
        if a.estimate_clip == "commit" and not training.max_norm:
            return ("[acco] estimate_clip = 'commit' does nothing without clipping "
                    "([training] max_norm = 0); remove it or set max_norm")  # fmt: skip
        if a.mode == "adaptive" and not training.max_tokens:
            return ("[acco] mode = 'adaptive' lets each update's batch grow while communication "
                    "runs, so a step count does not fix the learning-rate schedule or the data "
                    "seen: set [training] max_tokens (the token budget)")  # fmt: skip
        return cls.planner_class.check_config(dp_size, options=options, training=training, **sections)

    def micro_batches(self):
        target = self.planner.period(self)  # this period's micro-batches, decided before its job is launched
        target = self.balance.count() if target is None else target
        self.launch_planned()
        adaptive, max_growth = self.options.mode == "adaptive", self.options.max_growth  # max_growth 0: no bound
        cap = max_growth * target if max_growth else float("inf")
        n, marks = 0, collections.deque()
        # adaptive: past its micro-batches, a rank keeps accumulating while the job runs
        while n < target or (adaptive and n + 1 <= cap and self._job_running()):
            yield contextlib.nullcontext()
            n += 1
            if adaptive:  # compare the job with the work done, not queued (CUDA: one queued)
                marks.append(self.device.mark())
                if len(marks) > 1:
                    marks.popleft().synchronize()

    def _job_running(self) -> bool:
        return self.runner.in_flight() and not self.runner.done()

    def lr_for(self) -> callable:
        """Adaptive mode: the schedule's lr scaled for the realised batch, (tokens / nominal)^α."""
        start = self.consumed  # by value: the job runs while the loop moves on
        schedule_lr = lambda consumed: self.plan.schedule(start, consumed)  # noqa: E731
        alpha, nominal = self.options.lr_batch_scaling, self.plan.tokens_per_update
        if self.options.mode != "adaptive" or not alpha or not nominal:
            return schedule_lr
        return lambda consumed: schedule_lr(consumed) * (consumed / nominal) ** alpha

    @property
    def next_job(self) -> str | None:
        """The kind of job the next period launches (None: none planned)."""
        return None if self.planned is None else self.planned[0]

    def launch_planned(self) -> None:
        """Launch the job `step()` planned, if any: C ← A, then A zeroed or kept."""
        if self.planned is None:
            return
        (kind, keep_accumulating), self.planned = self.planned, None
        # C ← A: in bf16 for a bf16 estimate round, in C's first half (the same memory)
        sharded, params = self.sharded, self.sharded.params
        bf16 = kind == ESTIMATE and self.options.estimate_comm == "bf16" and params.dtype == torch.float32
        send = self.comm.view(torch.bfloat16)[: self.comm.numel()] if bf16 else self.comm
        self.job_buffer = send if self.comm.dtype == params.dtype else self.job_buffer  # fp32 C: its bf16 half
        send.copy_(sharded.grads)
        comm, out, local, max_norm = send, self.job_buffer, self.pending, self.plan.max_norm
        clip_norm = self.planner.estimate_clip_norm
        lr_for = self.lr_for()
        if kind == ESTIMATE:
            # The estimate uses the commit's lr: the commit will span this period and the next,
            # about 1 / estimate_share (twice) the tokens (it matters during warm-up, where lr grows with tokens).
            commit_lr, share = lr_for, self.planner.share
            lr_for = lambda consumed: commit_lr(consumed / share)  # noqa: E731

        heartbeat = sharded.dims.heartbeat

        def job() -> UpdateResult:
            heartbeat.comm_phase(f"communication job ({kind}: reduce-scatter, optimizer, all-gather)")
            start = time.perf_counter()
            with record_function(f"torchacco/job:{kind}"):
                result = sharded.run_job(comm, local, lr_for, kind, out, max_norm, clip_norm)
            result.seconds = time.perf_counter() - start
            heartbeat.comm_phase("")
            return result

        self.runner.launch(job)
        if not keep_accumulating:
            sharded.grads.zero_()
            self.pending = Counts()

    def finish(self) -> UpdateResult | None:
        """Wait for the job in flight, swap in its parameters (P ← C), account for it."""
        if not self.runner.in_flight():
            return None
        start = time.perf_counter()
        with record_function("torchacco/wait_for_job"):
            finished = self.runner.wait(self.stall_s)
        self.times.exposed += time.perf_counter() - start
        self.times.jobs += finished.seconds
        self.planner.before_swap(self, finished)
        self.sharded.params.copy_(self.job_buffer)  # P ← C
        if finished.committed:
            self.commits += 1
            self.planner.committed(finished)
            self.consumed += finished.consumed
            finished.exposed_s, finished.jobs_s = self.times.exposed, self.times.jobs
            self.times = JobTimes()
        return finished

    def step(self, counts: Counts) -> UpdateResult | None:
        self.pending = self.pending + counts
        finished = self.finish()
        self.planned = self.planner.plan(finished)
        if self.balanced and finished is not None:
            self.balance.observe(finished.micro_batches, finished.compute_s)
        return self.planner.finished(self, finished)

    @contextlib.contextmanager
    def evaluation(self):
        """Between rounds (no job in flight), with θ — the fp32 master shards, gathered — in P.
        C is free until the next launch, so it keeps P's contents meanwhile."""
        assert not self.runner.in_flight()
        self.comm.copy_(self.sharded.params)
        self.sharded.refresh_copies()  # P ← θ
        try:
            yield self.model
        finally:
            self.sharded.params.copy_(self.comm)

    def close(self) -> None:
        self.runner.drain(self.stall_s)

    def _on_job_thread(self, fn):
        """`fn()` between rounds, on the job's thread: the one that issues on the data-parallel group."""
        self.runner.launch(fn)
        return self.runner.wait(self.stall_s)

    def state_dict(self) -> dict:
        """Between rounds: ZeRO-1's state, plus what the next rounds need — the compute parameters P (θ̃, θ or WP's
        prediction), this rank's accumulator and its counts, and the planned job (ACCO's round parity)."""
        assert not self.runner.in_flight()
        world, dp_mesh = self.sharded.flat.world, self.sharded.dims.dp_mesh

        def per_rank(row: torch.Tensor) -> DTensor:  # this rank's row of a (world, n) tensor
            n = row.shape[1]
            return DTensor.from_local(row, dp_mesh, [Shard(0)], run_check=False, shape=(world, n), stride=(n, 1))

        # The counts behind A, without their compute time: a wall-clock reading is no state to resume.
        pending = self.pending.as_tensor(self.comm.device)[: Counts.FIELDS - 1].unsqueeze(0).contiguous()
        self._pending_buffer = pending  # DCP loads into it
        return {
            **self.sharded.state_dict(),
            "consumed": self.consumed,
            "schedule": {
                "name": self.name,
                "world": world,
                "commits": self.commits,
                **self.planner.state_dict(),
                **self.balance.state_dict(),  # balanced mode's plan and measurements (the same on every rank)
                "planned": "" if self.planned is None else f"{self.planned[0]}:{int(self.planned[1])}",
                "params": self.sharded.params,
                "accumulator": per_rank(self.sharded.grads.unsqueeze(0)),
                "pending": per_rank(pending),
            },
        }

    def load_state_dict(self, state: dict) -> None:
        schedule = state["schedule"]
        if schedule["name"] != self.name:
            raise UserError(f"this checkpoint was saved by {schedule['name']}, not {self.name}; resume "
                            f'it with [parallelism] data_parallel = "{schedule["name"]}"')  # fmt: skip
        assert schedule["world"] == self.sharded.flat.world, "the trainer checks the world size before loading"
        self.sharded.load_state_dict(state)  # P was saved as it was (θ̃, θ or a prediction) and loaded in place
        self.consumed = state["consumed"]
        tokens, loss_sum, micro_batches, consumed = self._pending_buffer[0].tolist()
        self.pending = Counts(tokens, loss_sum, int(micro_batches), consumed)
        kind, _, keep = schedule["planned"].partition(":")
        self.planned = (kind, bool(int(keep))) if kind else None
        self.commits = schedule["commits"]
        self.planner.load_state_dict(schedule)
        self.balance.load_state_dict(schedule)

    @classmethod
    def checkpoint_key(cls, dims) -> str:
        return sharded_checkpoint_key(dims)

    @classmethod
    def memory(cls, numel, dp_size, param_dtype, reduce_dtype, options=None):
        """ZeRO-1's state with the [acco] accumulator's dtype, and the job's buffer C."""
        grad_dtype = DTYPES[(options or OverlappedOptions()).accumulator_dtype]
        state = ShardedOptimizerState.memory(numel, dp_size, param_dtype, grad_dtype)
        job = padded_numel(math.ceil(numel), dp_size) * job_buffer_dtype(param_dtype, reduce_dtype, dp_size).itemsize
        return replace(state, buffers=job)

    @classmethod
    def gathered_memory(cls, parallelism, block_numel, root_numel, blocks, param_dtype, group=1):
        # the job's reduce-scatter beside forward and backward: on gloo a ring through a staging buffer of at most
        # PIECE_NUMEL elements of C's dtype (NCCL's own buffers are in the dry run's reserve)
        shard = padded_numel(math.ceil(block_numel * blocks + root_numel), group) / group
        job = job_buffer_dtype(param_dtype, DTYPES[parallelism.reduce_dtype], group)
        return min(PIECE_NUMEL, shard) * job.itemsize if group > 1 else 0.0


def job_buffer_dtype(param_dtype: torch.dtype, reduce_dtype: torch.dtype, world: int) -> torch.dtype:
    """C's dtype: the compute dtype, or fp32 where the job sums lower-precision gradients over several ranks in fp32."""
    wide = reduce_dtype == torch.float32 and param_dtype != torch.float32 and world > 1
    return torch.float32 if wide else param_dtype


def _fp32_reduce_out(comm: torch.Tensor, dtype: torch.dtype, rank: int) -> torch.Tensor:
    """Where the job writes the new parameters when it reduces fp32 gradients in C: a half of C seen
    as `dtype`. The optimizer reads this rank's reduced fp32 shard (C's bytes [4rs, 4rs + 4s)) while
    it writes this rank's slice of the output ([2rs, 2rs + 2s) from the half's start), so the two
    must not meet: the first half is clear of the shard for every rank but 0, the second half for
    rank 0 (with at least 2 ranks). The all-gather fills the rest of the output after the step."""
    half = comm.view(dtype)
    n = comm.numel()
    return half[n:] if rank == 0 else half[:n]
