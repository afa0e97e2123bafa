"""How the replicas meet in an outer step, behind one interface: at once (`Synchronous`), τ updates ahead on the side
runner (`Overlapped`: overlap_steps, mixing, eager), or as a torchft round of the replicas present (`FaultTolerant`).
An injected fault (faults.py) mutes a replica's tokens at their source, `DiLoCo.delta`."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchacco.errors import UserError
from torchacco.fault_tolerance import ReplicaLink, unmerged_updates
from torchacco.faults import in_outer_exchange
from torchacco.parallel.diloco.compression import sparse_token_weighted_mean
from torchacco.parallel.diloco.pseudo_gradient import split_across, split_token_weighted_mean
from torchacco.parallel.diloco.wire import CHUNK, ROW, keep_per_chunk, wire_bytes
from torchacco.parallel.dims import group_per_row
from torchacco.runners import stall_deadline_s


class Synchronous:
    """Δ̄ of a fragment when its outer step is due: the replicas' token-weighted mean of Δ on the `outer_dtype` wire
    (with topk: of the top-k of the error-fed residual), over the mesh's replica group."""

    def __init__(self, diloco):
        self.diloco, dims, options = diloco, diloco.dims, diloco.options
        self.wire = options.outer_dtype
        self.keep = keep_per_chunk(options.topk) if options.topk else 0
        self.over_senders = options.topk_mean == "senders"
        # A replicated inner strategy over several ranks: each sends its 1/dp of Δ and they all-gather the rest, on
        # a dp group of its own (the transfer may run on a thread beside compute's dims.dp_group all-reduces).
        split = not diloco.inner.traits.shards_theta and dims.dp_size > 1
        self.split_group = group_per_row(dims.mesh, "dp", dims.timeout) if split else None

    def mean(self, f: int, delta: torch.Tensor, tokens: float, group=None) -> torch.Tensor:
        """The replicas' token-weighted mean of Δ (of what top-k sends of it, error-fed), over `group` (a fault-tolerant
        round's) or the mesh's replica group."""
        group = group or self.diloco.dims.replica_group
        if self.keep:
            return self._sparse_mean(f, delta, tokens, group)
        return split_token_weighted_mean(delta, tokens, group, self.wire, self.split_group)

    def _sparse_mean(self, f: int, delta: torch.Tensor, tokens: float, group) -> torch.Tensor:
        """e ← β·e + Δ; the replicas' token-weighted mean of their top-k of e; e ← e − what was sent.
        Every rank of a replicated inner strategy holds e alike: each sends its 1/n of the chunks, and
        they all-gather the mean and what was sent."""
        residual = self.diloco.state.residual[f]
        e = residual.to(delta.device).mul_(self.diloco.options.error_decay).add_(delta)

        def exchange(x: torch.Tensor):
            return sparse_token_weighted_mean(x, tokens, group, self.wire, self.keep, self.over_senders)

        mean, sent = split_across(exchange, e, self.split_group, CHUNK)
        residual.copy_(e.sub_(sent))
        return mean

    def average(self) -> float:
        """Warm start: θ_global ← the replicas' token-weighted mean of θ_r, in fp32, for every fragment, and θ_r ←
        θ_global; the outer momentum and the residuals are left as they are. The bytes sent."""
        d, sent = self.diloco, 0
        for f, theta in enumerate(d.state.global_params):
            delta, tokens = d.delta(f)
            mean = split_token_weighted_mean(delta, tokens, d.dims.replica_group, "fp32", self.split_group)
            theta.sub_(mean.to(theta.device))
            d.state.scatter(f, theta.to(d.device.torch))
            sent += delta.numel() if self.split_group is None else -(-delta.numel() // d.dims.dp_size)
        d.inner.theta.refresh_copies()
        return 4.0 * sent

    def outer(self, f: int, opened: bool = False) -> tuple[int, torch.Tensor]:
        """(the fragment, Δ̄) of the outer step due for fragment f."""
        delta, tokens = self.diloco.delta(f)
        return f, delta if self.diloco.dims.replicas == 1 else self.mean(f, delta, tokens)

    def after_update(self) -> None: ...  # (an overlapped exchange starts its transfers here)

    def land(self, f: int, theta: torch.Tensor) -> torch.Tensor:  # the θ_r that follows θ_global = `theta`
        return theta

    def wire_bytes(self, f: int) -> float:
        """The bytes of fragment f this rank sends to the other replicas."""
        numel = sum(p.numel() for p in self.diloco.state.by_fragment[f])
        if self.split_group is not None:  # whole rows or chunks, as split_across cuts them
            align = CHUNK if self.keep else ROW
            numel = -(-numel // (self.diloco.dims.dp_size * align)) * align
        return wire_bytes(numel, self.wire, self.keep)

    def metrics(self) -> dict:
        return {}

    def join(self, run_state, load_run_state) -> dict | None:  # the outer step a fault-tolerant replica healed into
        return None

    def state_dict(self) -> dict:
        arrived = torch.zeros(self.diloco.state.largest, dtype=torch.float32, device=self.diloco.device.torch)
        return {"in_flight": -1, "arrived": arrived}

    def load_state_dict(self, outer: dict) -> None: ...

    def close(self) -> None: ...


class Overlapped(Synchronous):
    """overlap_steps = τ > 0: fragment f's Δ is taken τ updates before its outer step and averaged on the side runner;
    then θ_r ← (1 − α)·θ_global + α·θ_r. Eager: meanwhile the replica continues from θ̂, the outer step with its own
    Δ_r for Δ̄ (m untouched); when Δ̄ arrives, θ_r ← θ_global + (θ_r − θ̂) keeps the τ local updates."""

    def __init__(self, diloco):
        super().__init__(diloco)
        self.tau, self.alpha = diloco.options.overlap_steps, diloco.options.mixing
        self.runner, self.stall_s = diloco.device.runner(), stall_deadline_s(diloco.dims.timeout)
        self.in_flight: int | None = None  # the fragment whose Δ is being all-reduced
        self.arrived: torch.Tensor | None = None  # its mean, once waited for (by a checkpoint)
        eager, largest = diloco.options.eager, diloco.state.largest  # θ̂ of the fragment in flight
        self.eager = torch.zeros(largest, dtype=torch.float32, device=diloco.device.torch) if eager else None

    @staticmethod
    def check(d) -> None:
        if not 0 <= d.overlap_steps < (interval := d.sync_every // d.fragments):
            raise UserError(f"[diloco] overlap_steps = {d.overlap_steps} must be at least 0 and below sync_every / "
                            f"fragments = {interval} (a fragment's all-reduce must arrive before the next one "
                            "starts)")  # fmt: skip
        if not 0.0 <= d.mixing <= 1.0:
            raise UserError(f"[diloco] mixing = {d.mixing:g} must be between 0 and 1")
        if d.eager and (not d.overlap_steps or d.mixing):
            raise UserError("[diloco] eager continues from an estimated outer step while the all-reduce runs beside "
                            "overlap_steps inner updates and keeps all of them (mixing does not apply): set "
                            "overlap_steps >= 1 and mixing = 0")  # fmt: skip
        if d.mixing and not d.overlap_steps:
            raise UserError("[diloco] mixing mixes in the local updates made during overlap_steps, and overlap_steps = "
                            "0; set overlap_steps >= 1 or mixing = 0")  # fmt: skip

    def after_update(self) -> None:
        s = self.diloco.schedule
        if s.updates + self.tau == s.next_outer:
            self._start(s.period % self.diloco.options.fragments)

    def _start(self, f: int) -> None:
        d = self.diloco
        delta, tokens = d.delta(f)
        self.in_flight = f
        self.runner.launch(lambda: self.mean(f, delta, tokens))
        if self.eager is not None:  # θ̂: the outer step with this replica's Δ, without touching m
            mu, lr = d.schedule.momentum(d.schedule.outer_steps + 1), d.options.outer_lr
            momentum = d.state.momentum[f].to(delta.device)
            guess = d.state.global_params[f].to(delta.device) - lr * (delta + mu * (mu * momentum + delta))
            self.eager[: guess.numel()] = guess
            d.state.scatter(f, guess)
            d.inner.theta.refresh_copies()

    def outer(self, f: int, opened: bool = False) -> tuple[int, torch.Tensor]:
        assert self.in_flight == f, "the fragment's transfer was started τ updates ago"
        mean = self.arrived if self.arrived is not None else self.runner.wait(self.stall_s)
        self.in_flight, self.arrived = None, None
        return f, mean

    def land(self, f: int, theta: torch.Tensor) -> torch.Tensor:
        if self.alpha:
            theta = torch.lerp(theta, self.diloco.state.gather(f), self.alpha)  # keep α of the τ local updates
        if self.eager is not None:  # the τ local updates since θ̂, moved onto the true outer step
            theta = theta + (self.diloco.state.gather(f) - self.eager[: theta.numel()])
        return theta

    def state_dict(self) -> dict:
        if self.in_flight is not None and self.arrived is None:  # the transfer's result is part of the state
            self.arrived = self.runner.wait(self.stall_s)
        self._arrived_buffer = super().state_dict()["arrived"]
        if self.arrived is not None:
            self._arrived_buffer[: self.arrived.numel()] = self.arrived
        in_flight = -1 if self.in_flight is None else self.in_flight
        return {"in_flight": in_flight, "arrived": self._arrived_buffer,
                **({"eager": self.eager} if self.eager is not None else {})}  # fmt: skip

    def load_state_dict(self, outer: dict) -> None:
        self.in_flight = None if outer["in_flight"] < 0 else outer["in_flight"]
        if self.in_flight is not None:
            self.arrived = self._arrived_buffer[: self.diloco.state.global_params[self.in_flight].numel()].clone()

    def close(self) -> None:
        self.runner.drain(self.stall_s)


class FaultTolerant(Synchronous):
    """Each outer step one round of the replicas present, through torchft (`fault_tolerance.ReplicaLink`)."""

    def __init__(self, diloco, folder: Path | None):
        super().__init__(diloco)
        dims, (replica, replicas) = diloco.dims, diloco.dims.replica_job
        say = print if dims.rank == 0 else lambda *args, **kwargs: None
        layout = f"{dims.world_size} ranks, {diloco.name}, tp {dims.tp_size}, pp {dims.pp_size}"
        self.link = ReplicaLink(diloco.options, replica, replicas, dims, diloco.device.type, layout, say)
        # the updates a previous run of this replica computed past its last outer step (before its log is cut back)
        self.unmerged = unmerged_updates(folder / "metrics.jsonl") if folder is not None else (0, 0)
        self.merged_tokens = 0.0  # the loss tokens behind the last outer step's merge

    def outer(self, f: int, opened: bool = False) -> tuple[int, torch.Tensor]:
        """A replica that healed in the round holds a peer's state: it sends zeros at weight 0, for the fragment the
        peers are at."""
        d = self.diloco
        delta, tokens = d.delta(f)

        def exchange(group) -> torch.Tensor:
            nonlocal f, delta, tokens
            if self.link.healed:
                d.tokens, d.durations, d.stamp = [0.0] * d.options.fragments, [], time.perf_counter()
                f = d.schedule.due()
                delta, tokens = torch.zeros_like(d.state.global_params[f], device=d.device.torch), 0.0
            merged = torch.tensor([tokens], dtype=torch.float64, device=d.device.torch)
            dist.all_reduce(merged, group=group)  # the tokens behind the round's merge: what the lost ones lack
            self.merged_tokens = merged.item()
            in_outer_exchange()  # an injected `freeze` or `kill_mid_transfer` (faults.py)
            return self.mean(f, delta, tokens, group)

        return f, self.link.round(exchange, opened)

    def join(self, run_state, load_run_state) -> dict | None:
        """The first rounds: this replica copies `run_state()` of a live one when it is behind (`heal_with`). None when
        the run starts (or resumes) here; else it healed into a running run and took part in the outer step the
        others are in, whose metrics it returns."""
        d, (first, last) = self.diloco, self.unmerged
        self.link.heal_with(run_state, load_run_state)
        if not self.link.join(lambda: d.schedule.updates > 0, d.options.join_timeout_s):
            return None
        outer = d.outer_step(d.schedule.due(), opened=True)
        lost = f"; its updates {first}-{last} before it stopped were never merged (at least " \
               f"{(last - first + 1) * d.nominal:,.0f} tokens lost)" if last else ""  # fmt: skip
        self.link.log(f"torchacco: replica {self.link.replica} joined the run at step {d.schedule.updates}{lost}")
        return outer

    def close(self) -> None:
        self.link.close()

    def metrics(self) -> dict:
        return {"outer_replicas": self.link.present, "outer_merged_tokens": self.merged_tokens}
