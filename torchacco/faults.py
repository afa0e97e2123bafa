"""Fault injection, to test recovery the way it happens: `TORCHACCO_FAULT=kill@rank1:step5`.

Comma-separated faults, each `WHAT@rankR:stepS[:periodP]`:
- `kill`: the rank SIGKILLs itself as it starts computing step S (a lost worker);
- `nan`: the rank's loss is NaN for the compute period(s) of step S (period P only, counted from 1
  within the step: ACCO computes each step in two periods, the estimate's and the commit's). Under
  pipeline parallelism the loss exists on the last stage only: name one of its ranks;
- `stall`: from step S on, the rank's next reduce-scatter or all-gather never starts, as a hung NCCL
  collective: nothing raises, the process lives on (the overlapped schedules' timed wait is what
  notices).
A fault fires the first time its rank reaches its step in a launch, on whichever attempt that
is, and never again in that launch: the launcher's store (which outlives torchrun's restarts)
records it. So a run restarted after a fault goes on as if nothing happened, and a later fault
still fires on the restarted attempt (kill@rank1:step2,kill@rank0:step5 loses a worker twice).
"""

from __future__ import annotations

import os
import re
import signal
import threading

import torch.distributed as dist

from torchacco.errors import UserError

FAULT = re.compile(r"^(kill|nan|stall)@rank(\d+):step(\d+)(?::period(\d+))?$")
FIRED_KEY = "torchacco/fault-fired/"


class Faults:
    def __init__(self, spec: str, rank: int, store: dist.Store | None = None):
        self.faults = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            m = FAULT.match(item)
            if not m:
                raise UserError(
                    f"TORCHACCO_FAULT: cannot parse {item!r}; expected e.g. kill@rank1:step5 or nan@rank0:step3:period1"
                )
            what, r, step, period = m.groups()
            if int(r) == rank:
                self.faults.append((item, what, int(step), int(period) if period else None))
        self.store = store if store is not None else dist.HashStore()  # no launcher: once per process
        self._step, self._period = None, 0

    def before_period(self, step: int) -> bool:
        """Called as each compute period starts; True when this period's loss must be NaN."""
        self._period = self._period + 1 if step == self._step else 1
        self._step = step
        poison = False
        for item, what, at, period in self.faults:
            if at == step and period in (None, self._period) and self._first_time(item, what):
                if what == "kill":
                    from torchacco import health

                    health.current().flush()  # so the survivors can tell where this rank died
                    os.kill(os.getpid(), signal.SIGKILL)
                if what == "stall":
                    from torchacco.parallel.collectives import set_collective_hook

                    set_collective_hook(lambda name, never=threading.Event(): never.wait())
                    continue
                poison = True
        return poison

    def _first_time(self, item: str, what: str) -> bool:
        """Has this fault not fired yet in this launch? Marks it fired. A NaN fault without a period
        spans its step's periods: each is marked on its own (a kill ends the process at the first)."""
        period = f"/period{self._period}" if what == "nan" else ""
        return self.store.add(f"{FIRED_KEY}{item}{period}", 1) == 1


def launch_store() -> dist.Store | None:
    """The launcher's key-value store, under the per-attempt prefixes (a plain process's own store;
    None without a process group)."""
    if not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def from_env(rank: int) -> Faults:
    return Faults(os.environ.get("TORCHACCO_FAULT", ""), rank, launch_store())
