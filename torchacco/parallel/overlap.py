"""ACCO, DPU and WP: the sharded-optimizer job runs beside the next compute period.

Buffers (see ACCO.md): the compute side owns the parameter buffer P (what forward and
backward read) and the gradient accumulator A; the job owns the communication buffer C —
gradients in, parameters out — the one extra bf16 copy over ZeRO-1. The fp32 master
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

import contextlib
import time

import torch
from torch.distributed.tensor import DTensor, Shard

from torchacco import health
from torchacco.config import Config
from torchacco.device import Device, make_runner
from torchacco.errors import UserError
from torchacco.lr import TokenSchedule
from torchacco.parallel.data_parallel import ZeRO1
from torchacco.parallel.dims import ParallelDims
from torchacco.parallel.sharded import (COMMIT, COMMIT_AND_PREDICT, ESTIMATE, UpdateResult, gather_master,
                                        reduce_update_gather)

ACCUMULATOR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Overlapped(ZeRO1):
    """ZeRO-1's buffers and job, run on a communication runner one round behind."""

    resume_needs_same_ranks = True  # checkpoints hold each rank's accumulator
    sync_phase = "wait for the communication job"

    def __init__(self, model, cfg: Config, dims: ParallelDims, accumulation: int, schedule: TokenSchedule,
                 param_dtype: torch.dtype, device: Device):
        super().__init__(model, cfg, dims, accumulation, schedule, param_dtype,
                         grad_dtype=ACCUMULATOR_DTYPES[cfg.acco.accumulator_dtype])
        self.comm = torch.zeros_like(self.flat.params_buffer)  # C: the job's private buffer
        self.runner = make_runner(device)
        self.adaptive = cfg.acco.mode == "adaptive"
        self.max_micro_batches = cfg.acco.max_micro_batches  # bounds an adaptive period (0: no bound)
        self.pending: list[float] = [0.0, 0.0, 0, 0.0]  # loss tokens, loss sum, micro-batches, consumed behind A
        self.planned: tuple[str, bool] | None = None  # the job to launch when the next period starts
        self.exposed = 0.0  # seconds the compute side waited on jobs since the last report

    def micro_batches(self):
        if self.planned is not None:
            self._launch(*self.planned)
            self.planned = None
        n = 0
        while True:
            yield contextlib.nullcontext()
            n += 1
            job_running = self.runner.in_flight() and not self.runner.done()
            capped = self.max_micro_batches and n >= self.max_micro_batches
            if n >= self.accumulation and not (self.adaptive and job_running and not capped):
                self.pending[2] += n
                return

    def _launch(self, kind: str, keep_accumulating: bool) -> None:
        self.comm.copy_(self.flat.grads)  # C ← A
        flat, opt, comm, local = self.flat, self.optimizer, self.comm, tuple(self.pending)
        lr_for = self.lr_for()
        if kind == ESTIMATE:
            # The estimate uses the commit's lr: the commit will span this period and the next,
            # about twice the tokens (it matters during warm-up, where lr grows with tokens).
            commit_lr = lr_for
            lr_for = lambda consumed: commit_lr(2 * consumed)  # noqa: E731

        heartbeat = health.current()

        def job() -> UpdateResult:
            heartbeat.comm_phase(f"communication job ({kind}: reduce-scatter, optimizer, all-gather)")
            start = time.perf_counter()
            result = reduce_update_gather(flat, opt, comm, local, lr_for, kind, out=comm, max_norm=self.max_norm)
            result.seconds = time.perf_counter() - start
            heartbeat.comm_phase("")
            return result

        self.runner.launch(job)
        if not keep_accumulating:
            self.flat.grads.zero_()
            self.pending = [0.0, 0.0, 0, 0.0]

    def _finish(self) -> UpdateResult | None:
        """Wait for the job in flight, swap in its parameters (P ← C), account for it."""
        if not self.runner.in_flight():
            return None
        start = time.perf_counter()
        finished = self.runner.wait()
        self.exposed += time.perf_counter() - start
        self._before_swap(finished)
        self.flat.params_buffer.copy_(self.comm)  # P ← C
        if finished.committed:
            self.consumed += finished.consumed
            finished.exposed_s, self.exposed = self.exposed, 0.0
        return finished

    def step(self, local_tokens: float, local_loss: float, local_consumed: float) -> UpdateResult | None:
        self.pending[0] += local_tokens
        self.pending[1] += local_loss
        self.pending[3] += local_consumed
        finished = self._finish()
        self.planned = self._plan(finished)
        return finished

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
        pending = torch.tensor([self.pending], dtype=torch.float64, device=self.comm.device)
        self._pending_buffer = pending  # DCP loads into it
        return {**super().state_dict(), "schedule": {
            "name": type(self).__name__, "world": world, "commits": getattr(self, "commits", 0),
            "planned": "" if self.planned is None else f"{self.planned[0]}:{int(self.planned[1])}",
            "params": self.flat.params_buffer,
            "accumulator": DTensor.from_local(self.flat.grads.unsqueeze(0), **per_rank,
                                              shape=(world, self.flat.padded_numel), stride=(self.flat.padded_numel, 1)),
            "pending": DTensor.from_local(pending, **per_rank, shape=(world, 4), stride=(4, 1)),
        }}

    def load_state_dict(self, state: dict) -> None:
        schedule = state["schedule"]
        if schedule["name"] != type(self).__name__:
            raise UserError(f"this checkpoint was saved by {schedule['name']}, not {type(self).__name__}; resume it "
                            f"with [parallelism] data_parallel = \"{schedule['name'].lower()}\"")
        assert schedule["world"] == self.flat.world, "the trainer checks the world size before loading"
        super().load_state_dict(state)
        tokens, loss, micro_batches, consumed = self._pending_buffer[0].tolist()
        self.pending = [tokens, loss, int(micro_batches), consumed]
        kind, _, keep = schedule["planned"].partition(":")
        self.planned = (kind, bool(int(keep))) if kind else None
        if hasattr(self, "commits"):
            self.commits = schedule["commits"]

    def _refresh_params(self) -> None:
        pass  # P was saved as it was (θ̃, θ or a prediction) and DCP loaded it in place


def relative_distance(estimate: torch.Tensor, truth: torch.Tensor, chunk: int = 1 << 24) -> float:
    """‖estimate − truth‖ / ‖truth‖ in fp32, a chunk at a time (no full-size fp32 copies)."""
    diff_sq = truth_sq = 0.0
    for start in range(0, truth.numel(), chunk):
        t = truth[start:start + chunk].float()
        diff_sq += (estimate[start:start + chunk].float() - t).square().sum().item()
        truth_sq += t.square().sum().item()
    return (diff_sq / max(truth_sq, 1e-30)) ** 0.5


class ACCO(Overlapped):
    """Rounds alternate, as in ACCO.md's table:

    | round      | compute side                               | job                                      |
    | ESTIMATE t | g_t at θ_t ADDED to A, which holds g̃_t      | θ̃_{t+1} = Opt(θ_t, mean g̃_t), no commit   |
    | COMMIT t   | g̃_{t+1} at θ̃_{t+1} into a zeroed A          | θ_{t+1} = Opt(θ_t, (g̃_t + g_t) / N)       |

    The first period computes at θ_0 (θ̃_0 = θ_0); the first job is an ESTIMATE.
    """

    def __init__(self, *args, drift_every: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.drift_every = drift_every
        self.commits = 0

    def _plan(self, finished):
        if finished is None or finished.committed:
            return ESTIMATE, True  # keep g̃_t in A: the next period adds g_t to it
        return COMMIT, False  # A = g̃_t + g_t goes to the commit; g̃_{t+1} starts from zero

    def _before_swap(self, finished):
        # P still holds θ̃_{t+1}, C now holds θ_{t+1}: measure the estimation error.
        if finished.committed:
            self.commits += 1
            if self.drift_every and self.commits % self.drift_every == 0:
                finished.drift = relative_distance(self.flat.params_buffer, self.comm)


class DPU(Overlapped):
    """Delayed parameter update: θ_{t+1} = Opt(θ_t, g(θ_{t-1})), one step stale, overlapped.
    The first `warmup` updates are synchronous (no staleness)."""

    def __init__(self, *args, warmup: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.warmup = warmup
        self.commits = 0

    def _plan(self, finished):
        return COMMIT, False

    def step(self, local_tokens, local_loss, local_consumed):
        finished = super().step(local_tokens, local_loss, local_consumed)
        if self.commits < self.warmup:  # synchronous: the update lands before the next period
            self._launch(*self.planned)
            self.planned = None
            finished = self._finish()
        self.commits += finished is not None
        return finished


class WP(Overlapped):
    """Weight prediction: as DPU, but the compute runs at Opt(θ_{t+1}, ḡ_t), the last averaged
    gradient applied once more; θ itself stays in the master shards."""

    def _plan(self, finished):
        return COMMIT_AND_PREDICT, False


def build(kind, model, cfg: Config, dims, accumulation, schedule, param_dtype, device):
    assert kind != "acco" or accumulation % 2 == 0, "validate() requires an even accumulation for acco"
    common = (model, cfg, dims, accumulation // 2 if kind == "acco" else accumulation, schedule, param_dtype, device)
    if kind == "acco":
        return ACCO(*common, drift_every=cfg.acco.drift_every)
    if kind == "dpu":
        return DPU(*common, warmup=cfg.acco.dpu_warmup_steps)
    if kind == "wp":
        return WP(*common)
    raise AssertionError(kind)
