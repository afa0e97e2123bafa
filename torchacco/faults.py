"""Fault injection, to test recovery the way it happens: `TORCHACCO_FAULT=kill@rank1:step5`.

Comma-separated faults, each `WHAT@[replicaN:]rankR:stepS[:periodP]` (with `replicaN`, rank R of DiLoCo's
replica N only; in a fault-tolerant run, R counts within the replica's job):
- `kill`: the rank SIGKILLs itself as it starts computing step S (a lost worker);
- `nan`: the rank's loss is NaN for the compute period(s) of step S (period P only, counted from 1 within the step:
  ACCO computes each step in two periods). Under pipeline parallelism name a rank of the last stage;
- `stall`: from step S on, the rank's next reduce-scatter or all-gather never starts, as a hung NCCL collective:
  nothing raises, the process lives on (the overlapped schedules' timed wait is what notices);
- `hang`: from step S on, the rank's next collective issued from Python (a reduce-scatter or all-gather of the sharded
  job or FSDP, an all-reduce of the counts; not DDP's or DTensor's, which C++ issues) is a receive that no peer
  sends: the rank waits inside the communication library, as in a hung NCCL kernel, and so do the peers in theirs;
- `freeze@replicaN:rankR:stepS:Ts`: from step S on, once the rank's next fault-tolerant outer step has sent its
  first message, it stops (SIGSTOP: a frozen machine) for T seconds; `kill_mid_transfer@replicaN:rankR:stepS`: SIGKILL;
- `pause@[replicaN:]rankR:stepS:Ts`: the rank sleeps T seconds as it starts step S (a straggler: it lives, and a
  fault-tolerant replica's heartbeats go on), so that the others, or a restarting replica, catch up;
- `mute@replicaN:stepS`: from the first outer step at update S or later on, replica N's pseudo-gradients weigh
  nothing in the merge (its tokens count 0): the reference for a replica lost at step S;
- `slow_data@rankR:Ns` adds N seconds to the rank's data preparation (a corpus slow to fetch or tokenize), which
  the other ranks wait out without a collective deadline.
A fault fires the first time its rank reaches its step in a launch, on whichever attempt that is, and never again
in that launch: the launcher's store (which outlives torchrun's restarts) records it. So a restarted run goes on as
if nothing happened, and a later fault still fires (kill@rank1:step2,kill@rank0:step5 loses a worker twice).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import torch
import torch.distributed as dist

from torchacco import health
from torchacco.errors import UserError
from torchacco.parallel.collectives import set_collective_hook

FAULT = re.compile(r"^(kill_mid_transfer|kill|nan|stall|hang|freeze|pause)@(?:replica(\d+):)?rank(\d+):step(\d+)"
                   r"(?::period(\d+)|:(\d+(?:\.\d+)?)s)?$")  # fmt: skip
TIMED = ("freeze", "pause")  # the faults that take seconds; the others may take a period
MUTE = re.compile(r"^mute@replica(\d+):step(\d+)$")
SLOW_DATA = re.compile(r"^slow_data@rank(\d+):(\d+(?:\.\d+)?)s$")
FIRED_KEY = "torchacco/fault-fired/"


class Faults:
    def __init__(self, spec: str, rank: int, store: dist.Store | None = None, replica: int = 0, heartbeat=None):
        self.heartbeat = heartbeat or health.Heartbeat(None, rank, 1)  # (None: silent)
        self.faults = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            if SLOW_DATA.match(item) or MUTE.match(item):
                continue  # (data_delay's, muted_from's)
            m = FAULT.match(item)
            if not m or (m[6] is None) == (m[1] in TIMED):
                raise UserError(
                    f"TORCHACCO_FAULT: cannot parse {item!r}; expected e.g. kill@rank1:step5, "
                    "nan@rank0:step3:period1, kill_mid_transfer@replica1:rank0:step5, freeze@replica1:rank0:step5:20s, "
                    "pause@rank0:step5:20s, mute@replica1:step5 or slow_data@rank0:30s"
                )
            what, on_replica, r, step, period, seconds = m.groups()
            if int(r) == rank and (on_replica is None or int(on_replica) == replica):
                arg = float(seconds) if seconds else int(period) if period else None
                self.faults.append((item, what, int(step), arg))
        self.store = store if store is not None else dist.HashStore()  # no launcher: once per process
        self._step, self._period = None, 0

    def before_period(self, step: int) -> bool:
        """Called as each compute period starts; True when this period's loss must be NaN."""
        self._period = self._period + 1 if step == self._step else 1
        self._step = step
        poison = False
        global _in_transfer
        for item, what, at, arg in self.faults:  # (`arg`: a freeze's or a pause's seconds, else the period)
            other_period = what not in TIMED and arg not in (None, self._period)
            if at != step or other_period or not self._first_time(item, what):
                continue
            if what in ("freeze", "kill_mid_transfer"):
                _in_transfer = (what, arg)
            elif what == "pause":
                time.sleep(arg)
            elif what == "kill":
                self.heartbeat.flush()  # so the survivors can tell where this rank died
                os.kill(os.getpid(), signal.SIGKILL)
            elif what == "hang":  # the next collective issued from Python, whatever the strategy
                set_collective_hook(_receive_forever, everywhere=True)
            elif what == "stall":
                set_collective_hook(lambda name, never=threading.Event(): never.wait())
            else:
                poison = True
        return poison

    def _first_time(self, item: str, what: str) -> bool:
        """Has this fault not fired yet in this launch? Marks it fired. A NaN fault without a period
        spans its step's periods: each is marked on its own (a kill ends the process at the first)."""
        period = f"/period{self._period}" if what == "nan" else ""
        return self.store.add(f"{FIRED_KEY}{item}{period}", 1) == 1


_in_transfer: tuple | None = None  # a `freeze` or `kill_mid_transfer` that has fired, for the next outer step


def in_outer_exchange() -> None:
    """Where a fault-tolerant outer step has sent its first message: a pending `kill_mid_transfer` ends the process
    here, a `freeze` stops it (a child process it leaves behind continues it, SIGCONT, after the fault's seconds)."""
    global _in_transfer
    if _in_transfer is None:
        return
    (what, seconds), _in_transfer = _in_transfer, None
    if what == "freeze":
        subprocess.Popen(["sh", "-c", f"sleep {seconds:g}; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP if what == "freeze" else signal.SIGKILL)


def _receive_forever(name: str) -> None:
    """Inside the communication library until the group's timeout: a receive no peer answers (once)."""
    set_collective_hook(None)
    peer = (dist.get_rank() + 1) % dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    dist.recv(torch.zeros(1, device=device), src=peer, tag=7_777)  # (a tag no other message uses)


def from_env(rank: int, replica: int = 0, heartbeat: health.Heartbeat | None = None) -> Faults:
    """This rank's faults; fired ones are marked in the launcher's store beneath torchrun's per-attempt prefixes."""
    store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return Faults(os.environ.get("TORCHACCO_FAULT", ""), rank, store, replica, heartbeat)


def _matches(pattern: re.Pattern, spec: str | None) -> list[re.Match]:
    spec = os.environ.get("TORCHACCO_FAULT", "") if spec is None else spec
    return [m for m in (pattern.match(item.strip()) for item in spec.split(",")) if m]


def muted_from(replica: int) -> int | None:
    """The step from which `mute` faults silence this replica's pseudo-gradients, if any."""
    return min((int(m[2]) for m in _matches(MUTE, None) if int(m[1]) == replica), default=None)


def data_delay(rank: int, spec: str | None = None) -> float:
    """Seconds that `slow_data` faults add to this rank's data preparation."""
    return sum(float(m[2]) for m in _matches(SLOW_DATA, spec) if int(m[1]) == rank)
