"""DiLoCo and Streaming DiLoCo: [parallelism] replicas train apart, each with its own data-parallel
strategy (ddp, zero1, fsdp or acco, unchanged), and meet in an outer step (docs/diloco.md: the
schedule, eager, top-k, warm start, QSR and balance_replicas in full).

For each fragment f of the model (contiguous blocks; the whole model when P = 1), every H inner updates:

    Δ_r = θ_global − θ_r                  replica r's pseudo-gradient
    Δ̄   = Σ_r (n_r / Σ_s n_s) · Δ_r       n_r: its loss tokens since f's previous Δ
    m   ← μ·m + Δ̄                         Nesterov SGD, as torch.optim.SGD(nesterov=True)
    θ_global ← θ_global − η·(Δ̄ + μ·m)
    θ_r ← θ_global

Fragment f's outer step follows inner update t when t is a multiple of H / P and f = (t / (H / P) − 1) mod P.
With τ > 0, Δ is taken τ updates earlier and all-reduced on the side runner; then θ_r ← (1 − α)·θ_global + α·θ_r.
Eager: meanwhile the replica continues from θ̂, the outer step with its own Δ_r for Δ̄ (m untouched); when Δ̄
arrives, θ_r ← θ_global + (θ_r − θ̂) keeps the τ local updates.

With one replica (`has_outer_step`) Δ̄ = Δ, nothing is sent: lookahead, SNOO (arXiv 2510.15830).

The outer state covers the pieces of θ this rank holds (`Strategy.theta`): under a sharded inner strategy θ_global
and m are this rank's shard, all-reduced between the ranks holding it (`dims.replica_group`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchacco.blocks import block_list, unwrap
from torchacco.device import Device
from torchacco.errors import UserError
from torchacco.faults import in_outer_exchange, muted_from
from torchacco.parallel.collectives import all_gather_single
from torchacco.parallel.compression import CHUNK, keep_per_chunk, message_bytes, sparse_token_weighted_mean
from torchacco.parallel.dims import group_per_row
from torchacco.parallel.pseudo_gradient import ROW, WIRE_BYTES, split_across, split_token_weighted_mean
from torchacco.parallel.strategy import Counts, MemoryParts, Strategy, UpdateResult
from torchacco.runners import stall_deadline_s

if TYPE_CHECKING:
    from torchacco.config import DiLoCo as DiLoCoConfig


def fragment_of(module: torch.nn.Module, names: list[str], fragments: int) -> list[int]:
    """The fragment of each parameter name: block i of L goes to fragment ⌊i·P / L⌋; parameters outside the blocks go
    with the first fragment before them (embeddings) or the last after them (final norm, output head)."""
    blocks = block_list(module)
    if fragments > max(len(blocks), 1):
        raise UserError(
            f"[diloco] fragments = {fragments} exceeds the {len(blocks)} transformer blocks of the model (on this "
            "rank's pipeline stage); use at most that many"
        )
    index = {id(b): i for i, b in enumerate(blocks)}
    prefixes = [(name + ".", index[id(m)]) for name, m in module.named_modules() if id(m) in index]
    out, after_blocks = [], False
    for name in names:
        block = next((i for prefix, i in prefixes if name.startswith(prefix)), None)
        if block is None:
            out.append(fragments - 1 if after_blocks else 0)
        else:
            after_blocks = True
            out.append(block * fragments // len(blocks))
    return out


def has_outer_step(replicas: int, options: DiLoCoConfig) -> bool:
    """Several replicas meet in an outer step; one replica has one (SNOO) when any [diloco] key is set."""
    return replicas > 1 or options != type(options)()


class DiLoCo(Strategy):
    """The outer step over an inner strategy (`build.build_strategy` wraps one in it: `has_outer_step`)."""

    def __init__(self, inner: Strategy, dims, options: DiLoCoConfig, device: Device, clock: Clock | None = None):
        self.inner, self.dims, self.device, self.clock = inner, dims, device, clock
        self.link = dims.link  # fault_tolerant: the replicas meet through torchft (torchacco/fault_tolerance.py)
        self.merged_tokens = 0.0  # fault_tolerant: the loss tokens behind the last outer step's merge
        self.muted_from = muted_from(dims.replica_rank)  # an injected fault (faults.py): a lost replica's reference
        self.theta = GlobalTheta(self)
        self.traits = dataclasses.replace(inner.traits, resume_needs_same_ranks=True)  # per-rank θ_global and m
        self.name, self.options = inner.name, options
        self.interval = options.sync_every // options.fragments  # inner updates between two outer steps
        self.tau, self.alpha, self.wire = options.overlap_steps, options.mixing, options.outer_dtype
        # A replicated inner strategy over several ranks: each sends its 1/dp of Δ and they all-gather the rest, on
        # a dp group of its own (the transfer may run on a thread beside compute's dims.dp_group all-reduces).
        split = not inner.traits.shards_theta and dims.dp_size > 1
        self.split_group = group_per_row(dims.mesh, "dp", dims.timeout) if split else None
        named = inner.theta.pieces()
        which = fragment_of(unwrap(inner.model), [n for n, _ in named], options.fragments)
        self.pieces = [[p for (_, p), f in zip(named, which) if f == frag] for frag in range(options.fragments)]
        home = torch.device("cpu") if options.offload else device.torch
        pin = options.offload and device.type == "cuda"
        self.backup = [self._gather(f).to(home).pin_memory() if pin else self._gather(f).to(home).clone()
                       for f in range(options.fragments)]  # fmt: skip
        self.momentum = [torch.zeros_like(b) for b in self.backup]
        self.keep = keep_per_chunk(options.topk) if options.topk else 0
        self.over_senders = options.topk_mean == "senders"
        self.residual = [torch.zeros_like(b) for b in self.backup] if self.keep else []  # top-k: not sent yet
        self.tokens = [0.0] * options.fragments  # the replica's loss tokens since each fragment's last Δ
        self.updates = 0  # inner updates committed
        # the largest learning rate so far (sync_every_max, outer_momentum_decay) and the last update's
        self.outer_steps, self.peak_lr, self.lr = 0, 0.0, 0.0
        self._fixed_periods()
        self.runner = device.runner() if self.tau else None
        self.stall_s = stall_deadline_s(dims.timeout)
        self.in_flight: int | None = None  # the fragment whose Δ is being all-reduced
        self.arrived: torch.Tensor | None = None  # its mean, once waited for (by a checkpoint)
        self._largest = max(b.numel() for b in self.backup)
        # eager: θ̂ of the fragment in flight
        self.eager = torch.zeros(self._largest, dtype=torch.float32, device=device.torch) if options.eager else None
        self.active, self.slot = [self.interval] * dims.replicas, 0  # balance_replicas: K_r, the period's slot
        self.durations: list[float] = []  # this period's wall seconds per inner update
        self.stamp = time.perf_counter()
        self.nominal = 0.0  # this replica's input tokens per inner update (its share of the recipe's)
        self.last_seen = (0.0, 0.0)  # the loss and gradient norm its idle slots report: its last update's

    @staticmethod
    def outer_memory(numel: float, inner: type[Strategy], dp_size: int, options, largest_fragment=1.0) -> MemoryParts:
        """fp32 θ_global, momentum and topk's residual of the θ this rank holds, on the device unless offloaded,
        and eager's θ̂ of the largest fragment (`largest_fragment`: its share of the parameters)."""
        held = numel / dp_size if inner.traits.shards_theta else numel
        outer = 0.0 if options.offload else (3 if options.topk else 2) * 4 * held
        return MemoryParts(buffers=outer + (4 * held * largest_fragment if options.eager else 0.0))

    def _gather(self, f: int) -> torch.Tensor:
        """This rank's θ for fragment f, flat (a one-element placeholder when the rank holds none of it)."""
        pieces = self.pieces[f]
        if not pieces:
            return torch.zeros(1, dtype=torch.float32, device=self.device.torch)
        return torch.cat([p.detach().reshape(-1).float() for p in pieces])

    def _scatter(self, f: int, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.pieces[f]:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def _write_all(self, flats: list[torch.Tensor]) -> None:
        for f, flat in enumerate(flats):
            self._scatter(f, flat.to(self.device.torch))
        self.inner.theta.written()

    @property
    def model(self):
        return self.inner.model

    def micro_batches(self):
        return iter(()) if self._idle() else self.inner.micro_batches()

    def _idle(self) -> bool:
        return self.slot >= self.active[self.dims.replica_rank]

    def step(self, counts: Counts) -> UpdateResult | None:
        idle = self._idle()
        if idle:  # a slot this replica sits out
            result = self._sat_out(self.clock(self.clock.tokens, self.nominal), self.nominal)
        else:
            result = self.inner.step(counts)
            if result is None or not result.committed:
                return result
            now = time.perf_counter()
            self.durations.append(now - self.stamp)
            self.stamp, self.nominal, self.last_seen = now, result.consumed, (result.loss, result.grad_norm)
        computing = sum(h > self.slot for h in self.active)  # replicas that computed this slot
        if self.clock is not None:  # every replica's lr clock: the run's tokens over the replicas
            own = 0.0 if idle else self.nominal  # the tokens the inner strategy committed, then the correction
            self.clock.tokens += own
            self.clock.tokens += self.nominal * computing / self.dims.replicas - own
        self.updates, self.slot = self.updates + 1, self.slot + 1
        self.tokens = [n + result.tokens for n in self.tokens]
        t, outer = self.updates, {}
        self.peak_lr, self.lr = max(self.peak_lr, result.lr), result.lr
        if t <= self.options.warm_start:
            outer = self._average()
        elif t == self.next_outer:
            f, self.period = self.period % self.options.fragments, self.period + 1
            self.next_outer += self._next_interval(result.lr)
            outer = self._outer_step(f)
            if self.options.sync_every_max:  # every replica computes the whole of the next, longer period
                self.active = [self.next_outer - t] * self.dims.replicas
        if self.tau and t + self.tau == self.next_outer:
            self._start(self.period % self.options.fragments)
        # Every replica consumes the same input tokens per inner update: the run's clock counts those that ran.
        return dataclasses.replace(result, consumed=self.nominal * computing, outer=outer)

    def _sat_out(self, lr: float, consumed: float, outer: dict | None = None) -> UpdateResult:
        """An update this replica computed nothing for: θ stays, and it reports its last loss and gradient norm."""
        loss, norm = self.last_seen
        return UpdateResult(0.0, loss, norm, lr, committed=True, consumed=consumed, outer=outer or {})

    def _fixed_periods(self) -> None:
        """`period`: the periods begun (each ends in one fragment's outer step, in turn); `next_outer`: the update
        of the next outer step. With a fixed H both follow from `updates` (a healed replica's are its donor's)."""
        self.period = max(self.updates, self.options.warm_start) // self.interval
        self.next_outer = (self.period + 1) * self.interval

    def _next_interval(self, lr: float) -> int:
        """The updates until the next outer step: H / P, or with sync_every_max QSR's H_t / P."""
        h, most = self.options.sync_every, self.options.sync_every_max
        if not most:
            return self.interval
        grown = most if lr <= 0 else min(most, max(h, int(h * (self.peak_lr / lr) ** 2)))
        return grown // self.options.fragments

    def _agree_on_periods(self) -> list[int]:
        """K_r for the next period from every rank's median seconds per inner update (a replica as
        fast as its slowest rank): as many updates as fit in the fastest replica's K = H / P."""
        mine = sorted(self.durations)[len(self.durations) // 2] if self.durations else 0.0
        seconds = torch.zeros(self.dims.world_size, dtype=torch.float64, device=self.device.torch)
        all_gather_single(seconds, torch.tensor([mine], dtype=torch.float64, device=self.device.torch))
        per_replica = seconds.view(self.dims.replicas, -1).max(dim=1).values.tolist()
        fastest, h = min(per_replica), self.interval
        if fastest <= 0:
            return [h] * self.dims.replicas
        return [max(1, min(h, int(h * fastest / s + 1e-9))) for s in per_replica]

    def _delta(self, f: int) -> tuple[torch.Tensor, float]:
        """(Δ = θ_global − θ_r for fragment f, the tokens behind it); restarts f's token count."""
        delta = self.backup[f].to(self.device.torch) - self._gather(f)
        tokens, self.tokens[f] = self.tokens[f], 0.0
        if self.muted_from is not None and self.updates >= self.muted_from:
            tokens = 0.0
        return delta, tokens

    def _start(self, f: int) -> None:
        delta, tokens = self._delta(f)
        self.in_flight = f
        self.runner.launch(lambda: self._mean(f, delta, tokens))
        if self.eager is not None:  # θ̂: the outer step with this replica's Δ, without touching m
            mu, lr = self._momentum(self.outer_steps + 1), self.options.outer_lr
            momentum = self.momentum[f].to(delta.device)
            guess = self.backup[f].to(delta.device) - lr * (delta + mu * (mu * momentum + delta))
            self.eager[: guess.numel()] = guess
            self._scatter(f, guess)
            self.inner.theta.written()

    def _mean(self, f: int, delta: torch.Tensor, tokens: float, group=None) -> torch.Tensor:
        """The replicas' token-weighted mean of Δ (of what top-k sends of it, error-fed), over `group` (a fault-tolerant
        round's) or the mesh's replica group."""
        group = group or self.dims.replica_group
        if self.keep:
            return self._sparse_mean(f, delta, tokens, group)
        return split_token_weighted_mean(delta, tokens, group, self.wire, self.split_group)

    def _due(self) -> int:
        """The fragment whose outer step follows inner update `updates`."""
        return (self.updates // self.interval - 1) % self.options.fragments

    def _round(self, f: int, opened: bool = False) -> tuple[int, torch.Tensor]:
        """(the fragment, the mean of the replicas present) of one fault-tolerant outer step. A replica that
        healed in the round holds a peer's state: it sends zeros at weight 0, for the fragment the peers are at."""
        delta, tokens = self._delta(f)

        def exchange(group) -> torch.Tensor:
            nonlocal f, delta, tokens
            if self.link.healed:
                self.tokens, self.durations, self.stamp = [0.0] * self.options.fragments, [], time.perf_counter()
                f = self._due()
                delta, tokens = torch.zeros_like(self.backup[f], device=self.device.torch), 0.0
            merged = torch.tensor([tokens], dtype=torch.float64, device=self.device.torch)
            dist.all_reduce(merged, group=group)  # the tokens behind the round's merge: what the lost ones lack
            self.merged_tokens = merged.item()
            in_outer_exchange()  # an injected `freeze` (faults.py)
            return self._mean(f, delta, tokens, group)

        mean = self.link.round(exchange, opened)
        return f, mean

    def join(self) -> UpdateResult | None:
        """A fault-tolerant replica's start: None when the run starts (or resumes) here; else it healed into a
        running run and took part in the outer step the others are in, which it returns as its update."""
        if not self.link.join(lambda: self.updates > 0, self.options.join_timeout_s):
            return None
        outer = self._outer_step(self._due(), opened=True)
        return self._sat_out(float("nan"), self.nominal * self.dims.replicas, outer)  # (the donor's loss and norm)

    def _sparse_mean(self, f: int, delta: torch.Tensor, tokens: float, group) -> torch.Tensor:
        """e ← β·e + Δ; the replicas' token-weighted mean of their top-k of e; e ← e − what was sent.
        Every rank of a replicated inner strategy holds e alike: each sends its 1/n of the chunks, and
        they all-gather the mean and what was sent."""
        residual = self.residual[f]
        e = residual.to(delta.device).mul_(self.options.error_decay).add_(delta)

        def exchange(x: torch.Tensor):
            return sparse_token_weighted_mean(x, tokens, group, self.wire, self.keep, self.over_senders)

        mean, sent = split_across(exchange, e, self.split_group, CHUNK)
        residual.copy_(e.sub_(sent))
        return mean

    def _momentum(self, n: int) -> float:
        """μ of the run's n-th outer step: its fragment's k-th, μ·min(1, k / W) over a warm-up of W; with the decay,
        times η_t / η_peak of the last update."""
        warmup, mu = self.options.outer_momentum_warmup, self.options.outer_momentum
        if warmup:
            mu *= min(1.0, ((n - 1) // self.options.fragments + 1) / warmup)
        if self.options.outer_momentum_decay and self.peak_lr > 0:
            mu *= self.lr / self.peak_lr
        return mu

    def _average(self) -> dict:
        """Warm start: θ_global ← the replicas' token-weighted mean of θ_r, in fp32, for every fragment, and θ_r ←
        θ_global; the outer momentum and the residuals are left as they are."""
        sent = 0
        for f in range(self.options.fragments):
            delta, tokens = self._delta(f)
            mean = split_token_weighted_mean(delta, tokens, self.dims.replica_group, "fp32", self.split_group)
            self.backup[f].sub_(mean.to(self.backup[f].device))
            self._scatter(f, self.backup[f].to(self.device.torch))
            sent += delta.numel() if self.split_group is None else -(-delta.numel() // self.dims.dp_size)
        self.inner.theta.written()
        self.slot = 0  # every update is a period of its own (balance_replicas is refused with a warm start)
        return {"outer_warm_start": self.updates, "outer_bytes": 4.0 * sent}

    def _outer_step(self, f: int, opened: bool = False) -> dict:
        start = time.perf_counter()
        if self.link is not None:
            f, mean = self._round(f, opened)
        elif self.tau:
            assert self.in_flight == f, "the fragment's transfer was started τ updates ago"
            mean = self.arrived if self.arrived is not None else self.runner.wait(self.stall_s)
            self.in_flight, self.arrived = None, None
        else:
            delta, tokens = self._delta(f)
            mean = delta if self.dims.replicas == 1 else self._mean(f, delta, tokens)
        exposed = time.perf_counter() - start
        backup, momentum, mu = self.backup[f], self.momentum[f], self._momentum(self.outer_steps + 1)
        mean = mean.to(backup.device)
        momentum.mul_(mu).add_(mean)
        backup.sub_(mean.add(momentum, alpha=mu), alpha=self.options.outer_lr)
        theta = backup.to(self.device.torch)
        if self.alpha:
            theta = torch.lerp(theta, self._gather(f), self.alpha)  # keep α of the τ local updates
        if self.eager is not None:  # the τ local updates since θ̂, moved onto the true outer step
            theta = theta + (self._gather(f) - self.eager[: theta.numel()])
        self._scatter(f, theta)
        self.inner.theta.written()
        self.outer_steps += 1
        finished, self.slot = self.active, 0
        if self.options.balance_replicas:
            self.active, self.durations = self._agree_on_periods(), []
        self.stamp = time.perf_counter()
        return {
            "outer_step": self.outer_steps,
            "outer_fragment": f,
            "outer_delta_norm": self._norm(mean),
            "outer_bytes": self._wire_bytes(f) if self.dims.replicas > 1 else 0.0,
            "outer_exposed_s": exposed,
            **({"outer_next": self.next_outer} if self.options.sync_every_max else {}),
            **({"outer_inner_updates": finished} if self.options.balance_replicas else {}),
            **({"outer_replicas": self.link.present, "outer_merged_tokens": self.merged_tokens} if self.link else {}),
        }

    def _wire_bytes(self, f: int) -> float:
        """The bytes of fragment f this rank sends to the other replicas."""
        numel = sum(p.numel() for p in self.pieces[f])
        if self.split_group is not None:  # whole rows or chunks, as split_across cuts them
            align = CHUNK if self.keep else ROW
            numel = -(-numel // (self.dims.dp_size * align)) * align
        if self.keep:
            return float(message_bytes(numel, self.keep, self.wire))
        return numel * WIRE_BYTES[self.wire]

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
            local = [self._gather(f) for f in range(self.options.fragments)]
            self._write_all(self.backup)
            try:
                yield model
            finally:
                self._write_all(local)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.drain(self.stall_s)
        self.inner.close()

    def checkpoint_key(self, dims) -> str:
        # Replicas hold different θ between outer steps: one key each.
        return f"replica{dims.replica_rank}_{self.inner.checkpoint_key(dims)}"

    def state_dict(self) -> dict:
        if self.in_flight is not None and self.arrived is None:  # the transfer's result is part of the state
            self.arrived = self.runner.wait(self.stall_s)
        self._arrived_buffer = torch.zeros(self._largest, dtype=torch.float32, device=self.device.torch)
        if self.arrived is not None:
            self._arrived_buffer[: self.arrived.numel()] = self.arrived
        outer = {
            "updates": self.updates,
            "outer_steps": self.outer_steps,
            "tokens": list(self.tokens),
            "in_flight": -1 if self.in_flight is None else self.in_flight,
            "active": list(self.active),
            "slot": self.slot,
            "nominal": self.nominal,
            "last_seen": list(self.last_seen),
            **({"qsr": [self.period, self.next_outer, self.peak_lr]} if self.options.sync_every_max else {}),
            **({"peak_lr": self.peak_lr} if self.options.outer_momentum_decay else {}),
            **({"clock": self.clock.tokens} if self.clock is not None else {}),
            "arrived": self._arrived_buffer,
            **({"eager": self.eager} if self.eager is not None else {}),
            **{f"backup{f}": b for f, b in enumerate(self.backup)},
            **{f"momentum{f}": m for f, m in enumerate(self.momentum)},
            **{f"residual{f}": e for f, e in enumerate(self.residual)},
        }
        # Per rank: its shard of θ_global and m (plain tensors under one name would be taken as replicated).
        return {"inner": self.inner.state_dict(), f"outer_rank{self.dims.rank}": outer}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        outer = state[f"outer_rank{self.dims.rank}"]  # the tensors were loaded in place
        self.updates, self.outer_steps, self.tokens = outer["updates"], outer["outer_steps"], list(outer["tokens"])
        self.in_flight = None if outer["in_flight"] < 0 else outer["in_flight"]
        self.active, self.slot, self.nominal = list(outer["active"]), outer["slot"], outer["nominal"]
        self.last_seen = tuple(outer["last_seen"])
        if self.options.sync_every_max:
            self.period, self.next_outer, self.peak_lr = outer["qsr"]
        else:
            self._fixed_periods()
        if self.options.outer_momentum_decay:
            self.peak_lr = outer["peak_lr"]
        if self.clock is not None:
            if "clock" not in outer:
                raise UserError(
                    "this checkpoint holds no balance_replicas learning-rate clock (it was written by an earlier "
                    "torchacco or without [diloco] balance_replicas): resume it with the torchacco and settings "
                    "that wrote it, or start the run afresh"
                )
            self.clock.tokens = outer["clock"]
        self.durations, self.stamp = [], time.perf_counter()  # timing starts again with the resumed run
        if self.in_flight is not None:
            self.arrived = self._arrived_buffer[: self.backup[self.in_flight].numel()].clone()


class GlobalTheta:
    """θ_global (`strategy.Theta` for the export): the committed parameters every replica evaluates."""

    def __init__(self, diloco: DiLoCo):
        self.diloco = diloco

    def weights_state_dict(self) -> dict:
        return self.diloco.state_dict()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        with self.diloco.evaluation():
            return self.diloco.inner.theta.full_state_dict()


class Clock:
    """`balance_replicas`: the learning-rate clock of every replica (the run's tokens over the replicas), read in
    place of the inner strategy's own count of its committed tokens (a `TokenSchedule`'s start)."""

    def __init__(self, schedule):
        self.schedule, self.tokens = schedule, 0.0

    def __call__(self, start: float, consumed: float) -> float:
        return self.schedule(self.tokens, consumed)
