"""When each fragment meets the other replicas (docs/diloco.md): integer logic over the inner updates, no tensors.

Fragment f's outer step follows inner update t when t is a multiple of H / P and f = (t / (H / P) − 1) mod P. The
first `warm_start` updates each end in an average instead. With sync_every_max (QSR) the period after an outer step is
H_t / P, H_t = H·(η_peak / η_t)² up to sync_every_max. With balance_replicas replica r computes the first K_r slots of
each period and sits the rest out."""

from __future__ import annotations

from torchacco.errors import UserError
from torchacco.parallel.registry import able

WARM_START = -1  # `Schedule.advance`: the update ends in the warm start's average


class Schedule:
    """The inner updates counted, the periods begun and the replicas' slots of the current one."""

    def __init__(self, options, replicas: int):
        self.options, self.replicas = options, replicas
        self.interval = options.sync_every // options.fragments  # inner updates between two outer steps
        self.updates, self.outer_steps = 0, 0  # inner updates committed, outer steps taken
        # the largest learning rate so far (sync_every_max, outer_momentum_decay) and the last update's
        self.peak_lr, self.lr = 0.0, 0.0
        self.active, self.slot = [self.interval] * replicas, 0  # balance_replicas: K_r, the period's slot
        self.fixed_periods()

    @staticmethod
    def check(d, inner, training) -> None:
        """The periods, warm start, momentum schedule and balance_replicas of [diloco] `d` over strategy `inner`."""
        for name in ("sync_every", "fragments"):
            if getattr(d, name) < 1:
                raise UserError(f"[diloco] {name} must be at least 1, got {getattr(d, name)}")
        if d.sync_every % d.fragments:
            raise UserError(f"[diloco] sync_every = {d.sync_every} is not a multiple of fragments = {d.fragments} (one "
                            "fragment syncs every sync_every / fragments updates); change either")  # fmt: skip
        interval = d.sync_every // d.fragments
        if d.outer_momentum_warmup < 0:
            raise UserError(f"[diloco] outer_momentum_warmup = {d.outer_momentum_warmup} must be 0 (none) or more")
        for name in ("outer_momentum_warmup", "outer_momentum_decay"):
            if getattr(d, name) and not d.outer_momentum:
                raise UserError(f"[diloco] {name} scales the outer momentum, and outer_momentum = 0 (plain averaging); "
                                f"set outer_momentum above 0 (e.g. 0.9), or leave {name} out")  # fmt: skip
        if d.warm_start < 0 or d.warm_start % interval:
            raise UserError(f"[diloco] warm_start = {d.warm_start} must be a multiple of sync_every / fragments = "
                            f"{interval} (the outer steps then begin with a whole period)")  # fmt: skip
        H, H_max = d.sync_every, d.sync_every_max
        if H_max and (H_max < H or H_max % d.fragments or d.balance_replicas):
            raise UserError(f"[diloco] sync_every_max = {H_max} must be 0 (a fixed H), or a multiple of fragments = "
                            f"{d.fragments} of at least sync_every = {H} without balance_replicas (whose periods are "
                            "H's)")  # fmt: skip
        if d.warm_start and d.balance_replicas:
            raise UserError("[diloco] warm_start averages after every update, and balance_replicas idles a slow "
                            "replica's slots: use one of them")  # fmt: skip
        if d.balance_replicas and inner.traits.overlapped:
            synchronous = able(lambda t: not t.why_not_in_replicas and not t.overlapped)
            raise UserError(f"[diloco] balance_replicas idles a slow replica's slots, and data_parallel = '{inner.name}"
                            f"' runs its updates overlapped with the next; use one of {synchronous}, or "
                            "balance_replicas = false")  # fmt: skip
        if d.balance_replicas and not training.max_tokens:
            raise UserError("[diloco] balance_replicas needs [training] max_tokens: the replicas' inner updates "
                            "differ, so the run and its learning-rate schedule are measured in tokens; set it (e.g. "
                            "--training.max_tokens 1000000000)")  # fmt: skip

    def fixed_periods(self) -> None:
        """`period`: the periods begun (each ends in one fragment's outer step, in turn); `next_outer`: the update
        of the next outer step. With a fixed H both follow from `updates` (a healed replica's are its donor's)."""
        self.period = max(self.updates, self.options.warm_start) // self.interval
        self.next_outer = (self.period + 1) * self.interval

    def idle(self, replica: int) -> bool:
        """Whether `replica` sits out the current slot (balance_replicas)."""
        return self.slot >= self.active[replica]

    def computing(self) -> int:
        """The replicas that compute the current slot."""
        return sum(h > self.slot for h in self.active)

    def advance(self, lr: float) -> int | None:
        """One inner update committed at learning rate `lr`: WARM_START, the fragment whose outer step follows it,
        or None."""
        self.updates, self.slot = self.updates + 1, self.slot + 1
        self.peak_lr, self.lr = max(self.peak_lr, lr), lr
        t, o = self.updates, self.options
        if t <= o.warm_start:
            return WARM_START
        if t != self.next_outer:
            return None
        f, self.period = self.period % o.fragments, self.period + 1
        self.next_outer += self.next_interval(lr)
        if o.sync_every_max:  # every replica computes the whole of the next, longer period
            self.active = [self.next_outer - t] * self.replicas
        return f

    def next_interval(self, lr: float) -> int:
        """The updates until the next outer step: H / P, or with sync_every_max QSR's H_t / P."""
        h, most = self.options.sync_every, self.options.sync_every_max
        if not most:
            return self.interval
        grown = most if lr <= 0 else min(most, max(h, int(h * (self.peak_lr / lr) ** 2)))
        return grown // self.options.fragments

    def due(self) -> int:
        """The fragment whose outer step follows inner update `updates`."""
        return (self.updates // self.interval - 1) % self.options.fragments

    def momentum(self, n: int) -> float:
        """μ of the run's n-th outer step: its fragment's k-th, μ·min(1, k / W) over a warm-up of W; with the decay,
        times η_t / η_peak of the last update."""
        warmup, mu = self.options.outer_momentum_warmup, self.options.outer_momentum
        if warmup:
            mu *= min(1.0, ((n - 1) // self.options.fragments + 1) / warmup)
        if self.options.outer_momentum_decay and self.peak_lr > 0:
            mu *= self.lr / self.peak_lr
        return mu

    def balanced(self, seconds: list[float]) -> list[int]:
        """K_r for the next period from each replica's seconds per inner update: as many updates as fit in the
        fastest replica's K = H / P."""
        fastest, h = min(seconds), self.interval
        if fastest <= 0:
            return [h] * self.replicas
        return [max(1, min(h, int(h * fastest / s + 1e-9))) for s in seconds]

    def state_dict(self) -> dict:
        o, qsr, peak = self.options, [self.period, self.next_outer, self.peak_lr], self.peak_lr
        return {"updates": self.updates, "outer_steps": self.outer_steps, "active": list(self.active),
                "slot": self.slot, **({"qsr": qsr} if o.sync_every_max else {}),
                **({"peak_lr": peak} if o.outer_momentum_decay else {})}  # fmt: skip

    def load_state_dict(self, outer: dict) -> None:
        self.updates, self.outer_steps = outer["updates"], outer["outer_steps"]
        self.active, self.slot = list(outer["active"]), outer["slot"]
        if self.options.sync_every_max:
            self.period, self.next_outer, self.peak_lr = outer["qsr"]
        else:
            self.fixed_periods()
        if self.options.outer_momentum_decay:
            self.peak_lr = outer["peak_lr"]


class SharedLRClock:
    """`balance_replicas`: the learning-rate clock of every replica (the run's tokens over the replicas), read in
    place of the inner strategy's own count of its committed tokens (a `TokenSchedule`'s start)."""

    def __init__(self, schedule):
        self.schedule, self.tokens = schedule, 0.0

    def __call__(self, start: float, consumed: float) -> float:
        return self.schedule(self.tokens, consumed)
