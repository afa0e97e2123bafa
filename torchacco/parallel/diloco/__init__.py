"""DiLoCo and Streaming DiLoCo: [parallelism] replicas train apart, each with its own data-parallel
strategy (ddp, zero1, fsdp or acco, unchanged), and meet in an outer step (docs/diloco.md: the
schedule, eager, top-k, warm start, QSR and balance_replicas in full).

For each fragment f of the model (contiguous blocks; the whole model when P = 1), every H inner updates:

    Δ_r = θ_global − θ_r                  replica r's pseudo-gradient
    Δ̄   = Σ_r (n_r / Σ_s n_s) · Δ_r       n_r: its loss tokens since f's previous Δ
    m   ← μ·m + Δ̄                         Nesterov SGD, as torch.optim.SGD(nesterov=True)
    θ_global ← θ_global − η·(Δ̄ + μ·m)
    θ_r ← θ_global

When each fragment syncs: schedule.py; its state: outer_state.py; how the replicas meet (at once, τ updates ahead,
or fault-tolerant): exchange.py; the wire formats: wire.py, pseudo_gradient.py (dense), compression.py (top-k).

With one replica (`has_outer_step`) Δ̄ = Δ, nothing is sent: lookahead, SNOO (arXiv 2510.15830).

The outer state covers the pieces of θ this rank holds (`Strategy.theta`): under a sharded inner strategy θ_global
and m are this rank's shard, all-reduced between the ranks holding it (`dims.replica_group`)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchacco.device import Device
from torchacco.errors import UserError
from torchacco.fault_tolerance import check_config as check_fault_tolerance
from torchacco.faults import muted_from
from torchacco.parallel.collectives import all_gather_single
from torchacco.parallel.diloco.compression import check_config as check_compression
from torchacco.parallel.diloco.exchange import FaultTolerant, Overlapped, Synchronous
from torchacco.parallel.diloco.outer_state import OuterState, fragment_of
from torchacco.parallel.diloco.schedule import WARM_START, Schedule, SharedLRClock
from torchacco.parallel.registry import able
from torchacco.parallel.strategy import Counts, MemoryParts, Strategy, UpdateResult

if TYPE_CHECKING:
    from torchacco.config import DiLoCo as DiLoCoConfig

__all__ = ["SharedLRClock", "DiLoCo", "fragment_of", "has_outer_step"]


def has_outer_step(replicas: int, options: DiLoCoConfig) -> bool:
    """Several replicas meet in an outer step; one replica has one (SNOO) when any [diloco] key is set."""
    return replicas > 1 or options != type(options)()


class DiLoCo(Strategy):
    """The outer step over an inner strategy (`build.build_strategy` wraps one in it: `has_outer_step`)."""

    def __init__(self, inner: Strategy, dims, options: DiLoCoConfig, device: Device, clock: SharedLRClock | None = None,
                 folder: Path | None = None):  # fmt: skip
        self.inner, self.dims, self.device, self.clock = inner, dims, device, clock
        self.muted_from = muted_from(dims.replica_rank)  # an injected fault (faults.py): a lost replica's reference
        self.theta = GlobalTheta(self)
        self.traits = dataclasses.replace(inner.traits, resume_needs_same_ranks=True)  # per-rank θ_global and m
        self.name, self.options = inner.name, options
        self.state, self.schedule = OuterState(inner, options, device), Schedule(options, dims.replicas)
        exchange = Overlapped if options.overlap_steps else Synchronous  # how the replicas meet
        self.exchange = FaultTolerant(self, folder) if dims.replica_job is not None else exchange(self)
        self.tokens = [0.0] * options.fragments  # the replica's loss tokens since each fragment's last Δ
        self.durations: list[float] = []  # balance_replicas: this period's wall seconds per inner update
        self.stamp = time.perf_counter()
        self.nominal = 0.0  # this replica's input tokens per inner update (its share of the recipe's)
        self.last_seen = (0.0, 0.0)  # the loss and gradient norm its idle slots report: its last update's

    @staticmethod
    def check(inner: type[Strategy], inner_options, d: DiLoCoConfig, parallelism, training) -> None:
        """The [diloco] and replica settings that cannot run over `inner`, one line each: the replicas', then parts'."""
        if not has_outer_step(replicas := parallelism.replicas, d):
            return
        if replicas == 1:  # SNOO: one replica's outer step exchanges nothing; it reads the schedule and outer optimizer
            kept = ("sync_every", "fragments", "sync_every_max", "outer_lr", "outer_momentum", "outer_momentum_warmup",
                    "outer_momentum_decay", "offload")  # fmt: skip
            exchange = [f.name for f in dataclasses.fields(d) if getattr(d, f.name) != getattr(type(d)(), f.name)]
            if exchange := [name for name in exchange if name not in kept]:
                raise UserError(f"[diloco] {', '.join(exchange)} set: they shape the exchange between replicas, and "
                                "[parallelism] replicas = 1 has none (its outer step sends nothing); remove them, or "
                                "set replicas to 2 or more")  # fmt: skip
        elif why := inner.traits.why_not_in_replicas:
            raise UserError(f"data_parallel = '{inner.name}' cannot run inside DiLoCo's replicas ({why}); use one of "
                            f"{able(lambda t: not t.why_not_in_replicas)}")  # fmt: skip
        if getattr(inner_options, "mode", "deterministic") == "adaptive":
            raise UserError("[acco] mode = 'adaptive' inside DiLoCo's replicas is not supported: each replica's batch "
                            "would grow on its own, and the outer step's schedule counts equal updates; use mode = "
                            "'deterministic' or 'balanced'")  # fmt: skip
        Schedule.check(d, inner, training)
        Overlapped.check(d)
        check_compression(d)
        check_fault_tolerance(d, replicas)
        OuterState.check(d)

    @staticmethod
    def outer_memory(numel: float, inner: type[Strategy], dp_size: int, options, largest_fragment=1.0) -> MemoryParts:
        """fp32 θ_global, momentum and topk's residual of the θ this rank holds, on the device unless offloaded,
        and eager's θ̂ of the largest fragment (`largest_fragment`: its share of the parameters)."""
        held = numel / dp_size if inner.traits.shards_theta else numel
        outer = 0.0 if options.offload else (3 if options.topk else 2) * 4 * held
        return MemoryParts(buffers=outer + (4 * held * largest_fragment if options.eager else 0.0))

    @property
    def model(self):
        return self.inner.model

    def micro_batches(self):
        return iter(()) if self.schedule.idle(self.dims.replica_rank) else self.inner.micro_batches()

    def step(self, counts: Counts) -> UpdateResult | None:
        s = self.schedule
        idle = s.idle(self.dims.replica_rank)
        if idle:  # a slot this replica sits out
            result = self._idle_result(self.clock(self.clock.tokens, self.nominal), self.nominal)
        else:
            result = self.inner.step(counts)
            if result is None or not result.committed:
                return result
            now = time.perf_counter()
            self.durations.append(now - self.stamp)
            self.stamp, self.nominal, self.last_seen = now, result.consumed, (result.loss, result.grad_norm)
        computing = s.computing()  # replicas that computed this slot
        if self.clock is not None:  # every replica's lr clock: the run's tokens over the replicas
            own = 0.0 if idle else self.nominal  # the tokens the inner strategy committed, then the correction
            self.clock.tokens += own
            self.clock.tokens += self.nominal * computing / self.dims.replicas - own
        self.tokens = [n + result.tokens for n in self.tokens]
        due, outer = s.advance(result.lr), {}
        if due == WARM_START:
            s.slot = 0  # every update is a period of its own (balance_replicas is refused with a warm start)
            outer = {"outer_warm_start": s.updates, "outer_bytes": self.exchange.average()}
        elif due is not None:
            outer = self.outer_step(due)
        self.exchange.after_update()
        # Every replica consumes the same input tokens per inner update: the run's clock counts those that ran.
        return dataclasses.replace(result, consumed=self.nominal * computing, outer=outer)

    def _idle_result(self, lr: float, consumed: float, outer: dict | None = None) -> UpdateResult:
        """An update this replica computed nothing for: θ stays, and it reports its last loss and gradient norm."""
        loss, norm = self.last_seen
        return UpdateResult(0.0, loss, norm, lr, committed=True, consumed=consumed, outer=outer or {})

    def delta(self, f: int) -> tuple[torch.Tensor, float]:
        """(Δ = θ_global − θ_r for fragment f, the tokens behind it); restarts f's token count."""
        tokens, self.tokens[f] = self.tokens[f], 0.0
        if self.muted_from is not None and self.schedule.updates >= self.muted_from:
            tokens = 0.0
        return self.state.delta(f), tokens

    def start(self, run_state, load_run_state) -> UpdateResult | None:
        """A fault-tolerant replica's start: None when the run starts (or resumes) here; else it healed into a
        running run and took part in the outer step the others are in, which it returns as its update."""
        outer = self.exchange.join(run_state, load_run_state)
        if outer is None:
            return None
        return self._idle_result(float("nan"), self.nominal * self.dims.replicas, outer)  # (the donor's loss and norm)

    def outer_step(self, f: int, opened: bool = False) -> dict:
        s, start = self.schedule, time.perf_counter()
        f, mean = self.exchange.outer(f, opened)
        exposed = time.perf_counter() - start
        mean = mean.to(self.state.home)
        theta = self.state.step(f, mean, s.momentum(s.outer_steps + 1), self.options.outer_lr)
        self.state.scatter(f, self.exchange.land(f, theta))
        self.inner.theta.refresh_copies()
        s.outer_steps += 1
        finished, s.slot = s.active, 0
        if self.options.balance_replicas:
            s.active, self.durations = self._agree_on_periods(), []
        self.stamp = time.perf_counter()
        return {
            "outer_step": s.outer_steps,
            "outer_fragment": f,
            "outer_delta_norm": self._norm(mean),
            "outer_bytes": self.exchange.wire_bytes(f) if self.dims.replicas > 1 else 0.0,
            "outer_exposed_s": exposed,
            **({"outer_next": s.next_outer} if self.options.sync_every_max else {}),
            **({"outer_inner_updates": finished} if self.options.balance_replicas else {}),
            **self.exchange.metrics(),
        }

    def _agree_on_periods(self) -> list[int]:
        """K_r for the next period from every rank's median seconds per inner update (a replica as fast as its
        slowest rank)."""
        mine = sorted(self.durations)[len(self.durations) // 2] if self.durations else 0.0
        seconds = torch.zeros(self.dims.world_size, dtype=torch.float64, device=self.device.torch)
        all_gather_single(seconds, torch.tensor([mine], dtype=torch.float64, device=self.device.torch))
        return self.schedule.balanced(seconds.view(self.dims.replicas, -1).max(dim=1).values.tolist())

    def _norm(self, mean: torch.Tensor) -> float:
        """‖Δ̄‖ of the fragment over this rank's tensor- and pipeline-parallel part of the model."""
        sq = (mean.double() ** 2).sum().to(self.device.torch)  # (a rank's placeholder is 0)
        if self.inner.traits.shards_theta and self.dims.dp_size > 1:
            dist.all_reduce(sq, group=self.dims.dp_group)
        return sq.sqrt().item()

    @contextlib.contextmanager
    def evaluation(self):
        """With θ_global in place of this replica's θ (every replica evaluates the same parameters). Inside the inner
        strategy's evaluation, which then restores its compute parameters (WP's prediction)."""
        with self.inner.evaluation() as model:
            local = [self.state.gather(f) for f in range(self.options.fragments)]
            self.state.write_all(self.state.global_params)
            try:
                yield model
            finally:
                self.state.write_all(local)

    def close(self) -> None:
        self.exchange.close()
        self.inner.close()

    def checkpoint_key(self, dims) -> str:
        # Replicas hold different θ between outer steps: one key each.
        return f"replica{dims.replica_rank}_{self.inner.checkpoint_key(dims)}"

    def state_dict(self) -> dict:
        outer = {
            **self.schedule.state_dict(),
            "tokens": list(self.tokens),
            "nominal": self.nominal,
            "last_seen": list(self.last_seen),
            **({"clock": self.clock.tokens} if self.clock is not None else {}),
            **self.exchange.state_dict(),
            **self.state.state_dict(),
        }
        # Per rank: its shard of θ_global and m (plain tensors under one name would be taken as replicated).
        return {"inner": self.inner.state_dict(), f"outer_rank{self.dims.rank}": outer}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        outer = state[f"outer_rank{self.dims.rank}"]  # the tensors were loaded in place
        self.schedule.load_state_dict(outer)
        self.tokens, self.nominal, self.last_seen = list(outer["tokens"]), outer["nominal"], tuple(outer["last_seen"])
        if self.clock is not None:
            if "clock" not in outer:
                raise UserError("this checkpoint holds no balance_replicas learning-rate clock (it was written "
                                "by an earlier torchacco or without [diloco] balance_replicas): resume it with "
                                "the torchacco and settings that wrote it, or start the run afresh")  # fmt: skip
            self.clock.tokens = outer["clock"]
        self.durations, self.stamp = [], time.perf_counter()  # timing starts again with the resumed run
        self.exchange.load_state_dict(outer)


class GlobalTheta:
    """θ_global (`strategy.Theta` for the export): the committed parameters every replica evaluates."""

    def __init__(self, diloco: DiLoCo):
        self.diloco = diloco

    def weights_state_dict(self) -> dict:
        return self.diloco.state_dict()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        with self.diloco.evaluation():
            return self.diloco.inner.theta.full_state_dict()
