"""Preemption: a scheduler's stop signal ends the run at an update, with a checkpoint to resume from
(docs/reliability.md#preemption). The signal handler only records the signal; the ranks agree at update boundaries
on a gloo group of their own (no GPU sync, no group shared with the communication thread). torchrun stops the
survivors of a dead worker with the same SIGTERM and SIGKILLs them 30 s later, so a rank PEER_CHECK_S past the
signal without a boundary reads the heartbeats: if a peer stopped beating, it prints the diagnosis and exits at once."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

from torchacco import health
from torchacco.errors import Preempted, UserError

ALLOWED = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
PEER_CHECK_S = 3.0  # after a signal, how long a rank may go without a boundary before it checks for a dead peer
DIAGNOSIS_S = 5.0  # about what the check takes (two reads of the heartbeats, 2.5 s apart); it must end within grace_s


def parse_signals(text: str) -> list[signal.Signals]:
    """`[preemption] signals` ("SIGTERM,SIGUSR1"; the SIG prefix is optional) as signals."""
    found = []
    for name in (n.strip().upper() for n in text.split(",") if n.strip()):
        full = name if name.startswith("SIG") else "SIG" + name
        if full not in ALLOWED:
            raise UserError(f'[preemption] signals: {name!r} is not one of {", ".join(ALLOWED)}; '
                            'e.g. signals = "SIGTERM,SIGUSR1"')  # fmt: skip
        found.append(signal.Signals[full])
    if not found:
        raise UserError("[preemption] signals is empty; name one or more (e.g. "
                        '"SIGTERM,SIGUSR1") or set enable = false')  # fmt: skip
    return found


def check_config(p) -> None:
    if not p.enable:
        return
    parse_signals(p.signals)
    if p.grace_s <= 0:
        raise UserError(f"[preemption] grace_s must be positive, got {p.grace_s:g}")
    if not 2 <= p.exit_code <= 125:
        raise UserError(f"[preemption] exit_code = {p.exit_code} must be between 2 and 125 (0 means success, 1 an "
                        "error, 126 and above 'not run' or 'killed by a signal'); the default is 75")  # fmt: skip


def exit_code(p, checkpoints: bool, signum: int) -> int:
    """What a preempted run exits with: the requeue code when there is a checkpoint to resume from;
    without checkpoints a requeued job would start over, so the signal's own code (128 + n)."""
    return p.exit_code if checkpoints else 128 + signum


class Preemption:
    """The preemption handling of one train() call (a collective: every rank creates it)."""

    def __init__(self, cfg, dims, checkpoints: bool):
        self.cfg, self.rank, self.checkpoints, self.heartbeat = cfg, dims.rank, checkpoints, dims.heartbeat
        self.signum = 0  # the signal this rank acts on (0: none yet)
        self.group = None
        self._pending: tuple | None = None  # the agreement started at the last boundary
        self._previous: dict[signal.Signals, object] = {}
        self._signalled = threading.Event()
        self._stand_down = threading.Event()  # the watchdog gives up: handled, deferred or closed
        self._saved = self._deferred = False
        self._agreed = False  # every rank saw the stop signal: the stop is a preemption, not a failure
        if not self.cfg.enable:
            return
        if dims.world_size > 1:
            self.group = dims.new_group(backend="gloo")
            # gloo connects a new group's pairs in turn: a rank that finished first and then exits on a mistake
            # of its own (a bad tokenizer file) would leave a peer mid-connect with a traceback, not one line
            dist.barrier(group=self.group)
        threading.Thread(target=self._watchdog, name="torchacco-preemption", daemon=True).start()
        if threading.current_thread() is threading.main_thread():  # signals can only be set there
            self._listen(parse_signals(cfg.signals))

    def _listen(self, signals: list[signal.Signals]) -> None:
        """Python runs a handler once the main thread is back in Python, which a rank blocked in a collective on a
        frozen peer never is; the C handler writes the signal's number to the wakeup fd at once, so a thread reading
        it sees the signal in time (and the watchdog can end such a rank)."""
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._wakeup, writer = socket.socketpair()
        writer.setblocking(False)
        self._writer = writer
        self._previous_fd = signal.set_wakeup_fd(writer.fileno())
        mine = {int(s) for s in signals}

        def read() -> None:
            with contextlib.suppress(OSError):  # (closed: the run is over)
                while numbers := self._wakeup.recv(64):
                    for number in numbers:
                        if number in mine:
                            self._handle(number, None)

        threading.Thread(target=read, name="torchacco-preemption-signals", daemon=True).start()

    def _handle(self, signum, frame) -> None:
        """Both the listener and the Python-level handler get here; the first one counts."""
        if not self._deferred and not self.signum:
            self.signum = signum
            self._signalled.set()

    def agreed(self, wait: bool = False) -> bool:
        """At an update boundary, on every rank together: did any rank have a stop signal at the previous one?
        That boundary's all-reduce ran beside this update's compute, so no update waits for its round trip (on a
        shaped link, behind a job's transfer); a signal is acted on one update later. `wait`: at this boundary's
        own all-reduce (where boundaries are far apart: DiLoCo's outer steps)."""
        if not self.cfg.enable:
            return False
        if self.group is None:
            return bool(self.signum)
        # Only all-reduced values count: a signal arriving meanwhile waits for the next boundary, so no rank stops alone
        agreed = self._arrived()
        flag = torch.tensor([self.signum], dtype=torch.int32)
        self._pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        if wait:
            agreed = max(agreed, self._arrived())
        if agreed:
            self._agreed = True
            self.signum = agreed  # the same signal named on every rank
            self._signalled.set()  # a peer's signal: this rank's grace period starts now
        return bool(agreed)

    def _arrived(self) -> int:
        if self._pending is None:
            return 0
        (flag, work), self._pending = self._pending, None
        work.wait()
        return int(flag.item())

    def stop(self, step: int, checkpointer, state) -> None:
        """Save a checkpoint of `step` (`state()` gives it; None: saved at this step already); raise Preempted."""
        name = signal.Signals(self.signum).name
        code = exit_code(self.cfg, checkpointer is not None, self.signum)
        if checkpointer is None:
            raise Preempted(f"stopped at step {step} on {name}; [checkpoint] enable = false, so nothing "
                            f"was saved and a relaunch starts over (exit code {code})", code)  # fmt: skip
        start = time.perf_counter()
        self.heartbeat.enter(f"checkpoint save on {name} (step {step})")
        with record_function("torchacco/checkpoint_save"):
            if state is not None:
                checkpointer.save(step, state())
            checkpointer.wait()
        self._saved = True
        raise Preempted(f"stopped at step {step} on {name} and saved {checkpointer.folder / f'step-{step:08d}'} "
                        f"({time.perf_counter() - start:.1f} s); exit code {code}: requeue the job, the same "
                        "command resumes from there", code)  # fmt: skip

    def _watchdog(self) -> None:
        self._signalled.wait()
        signalled = time.monotonic()
        if self.cfg.grace_s > PEER_CHECK_S + DIAGNOSIS_S:
            if self._stand_down.wait(PEER_CHECK_S) or self._exit_if_a_peer_died():
                return
        if self._stand_down.wait(max(0.0, self.cfg.grace_s - (time.monotonic() - signalled))):
            return
        if not self._saved and self.rank == 0:
            print(f"torchacco: preempted ({signal.Signals(self.signum).name}), but the update and its checkpoint did "
                  f"not finish within [preemption] grace_s = {self.cfg.grace_s:g} (rank 0 was in "
                  f"{self.heartbeat.where()}); exiting without it: a relaunch resumes from the latest complete "
                  "checkpoint", file=sys.stderr, flush=True)  # fmt: skip
        sys.stderr.flush()
        os._exit(exit_code(self.cfg, self.checkpoints, self.signum))

    def _exit_if_a_peer_died(self) -> bool:
        """A survivor blocked on a dead peer (in a collective that never fails, as NCCL's) never reaches the
        boundary before torchrun's SIGKILL; unless the ranks agreed on a stop (then a silent peer has just exited
        after its save), name the dead rank and exit."""
        if self.group is None or self._agreed:
            return False
        where, diagnosis = self.heartbeat.where(), self.heartbeat.diagnose()
        if "stopped responding" not in diagnosis or self._stand_down.is_set() or self._agreed:
            return False
        name = signal.Signals(self.signum).name
        health.report(f"rank {self.rank}: stopped by {name} during its {where}, waiting on a peer: {diagnosis}")
        os._exit(exit_code(self.cfg, self.checkpoints, self.signum))  # as after grace_s: a preemption requeues

    def defer(self) -> None:
        """A failure is being diagnosed: the signals no longer stop anything here, nor the watchdog."""
        self._deferred = True
        self._stand_down.set()

    def close(self, clean: bool = True) -> None:
        if self._previous:
            signal.set_wakeup_fd(self._previous_fd)
            self._writer.close()
            self._wakeup.shutdown(socket.SHUT_RDWR)  # ends the listener's recv
            self._wakeup.close()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        self._stand_down.set()
        self._signalled.set()  # lets the watchdog thread end
        if self.group is not None:
            # Every rank started the same agreements: one in flight is finished before the group goes, unless the
            # run failed (a dead peer would never answer it).
            if self._pending is not None and clean:
                self._arrived()
            if self._pending is None:
                dist.destroy_process_group(self.group)
            self.group = None
