"""Where each rank is, so a failed collective can name the rank that stopped and what it was doing.

Every rank publishes a heartbeat — a counter and its current phases (the training loop's, and
the communication job's for the overlapped schedules) — to the launcher's key-value store, from a
daemon thread, once a second and on every phase change. The training loop only sets two
strings, so the heartbeat costs it nothing.

When a collective fails (a peer's connection closed, or the collective timed out), `diagnose()`
reads every rank's heartbeat twice a few seconds apart: a rank whose counter did not move is dead
or frozen, and its last published phase says where it stopped. A rank whose counter moves is
alive, just elsewhere (e.g. still computing, when it is much slower than the others).
"""

from __future__ import annotations

import json
import signal
import threading
import time

import torch.distributed as dist

from torchacco.errors import Terminated

BEAT_KEY = "torchacco/heartbeat/"


class Heartbeat:
    def __init__(self, store: dist.Store | None, rank: int, world: int, interval_s: float = 1.0):
        self.store, self.rank, self.world, self.interval_s = store, rank, world, interval_s
        self.phase = "startup"  # the training loop's
        self.comm = ""  # the communication job's, while one is in flight
        self._beats = 0
        self._changed = threading.Event()
        self._written = threading.Event()
        self._stop = threading.Event()
        self._thread = None
        if store is not None and world > 1:
            self._thread = threading.Thread(target=self._run, name="torchacco-heartbeat", daemon=True)
            self._thread.start()

    def enter(self, phase: str) -> None:
        self.phase = phase
        self._changed.set()

    def comm_phase(self, phase: str) -> None:
        self.comm = phase
        self._changed.set()

    def flush(self, timeout_s: float = 2.0) -> None:
        """Wait until the current phase is published."""
        if self._thread is not None:
            self._written.clear()
            self._changed.set()
            self._written.wait(timeout_s)

    def where(self) -> str:
        return f"{self.phase}, with its {self.comm} in flight" if self.comm else self.phase

    def _run(self) -> None:
        while not self._stop.is_set():
            self._beats += 1
            try:
                self.store.set(f"{BEAT_KEY}{self.rank}", json.dumps({"beat": self._beats, "where": self.where()}))
            except Exception:  # the store's host is gone: diagnose() reports it
                return
            self._written.set()
            self._changed.wait(self.interval_s)
            self._changed.clear()

    def close(self) -> None:
        self._stop.set()
        self._changed.set()

    def read(self) -> dict[int, dict]:
        beats = {}
        for rank in range(self.world):
            if rank == self.rank:
                continue
            try:
                if self.store.check([f"{BEAT_KEY}{rank}"]):
                    beats[rank] = json.loads(self.store.get(f"{BEAT_KEY}{rank}"))
            except Exception:
                return {}
        return beats

    def diagnose(self, watch_s: float | None = None) -> str:
        """A sentence naming the ranks that stopped and where, or what is known."""
        if self._thread is None:
            return "no heartbeat to go by"
        first = self.read()
        if not first:
            return "the launcher's store is unreachable too: node 0 (its host) is probably down"
        time.sleep(2.5 * self.interval_s if watch_s is None else watch_s)
        second = self.read()
        silent = [
            r
            for r in range(self.world)
            if r != self.rank and (r not in first or (r in second and second[r]["beat"] == first[r]["beat"]))
        ]
        if silent:
            return "; ".join(
                f"rank {r} stopped responding in {first[r]['where']}"
                if r in first
                else f"rank {r} never reported (it died or stalled while starting)"
                for r in silent
            )
        busy = [f"rank {r} is alive, in {second[r]['where']}" for r in sorted(second)]
        return (
            "no rank stopped: "
            + "; ".join(busy)
            + " — a rank much slower than the others, or ranks that disagree on the work to do"
        )


_current: Heartbeat | None = None


def start(rank: int, world: int) -> Heartbeat:
    """The heartbeat of this process, over the default process group's store."""
    global _current
    store = dist.distributed_c10d._get_default_store() if dist.is_initialized() and world > 1 else None
    _current = Heartbeat(store, rank, world)
    return _current


def current() -> Heartbeat:
    """The running heartbeat, or a silent one (single process, or used as a library)."""
    global _current
    if _current is None:
        _current = Heartbeat(None, 0, 1)
    return _current


def stop() -> None:
    global _current
    if _current is not None:
        _current.close()
    _current = None


class SigtermGuard:
    """SIGTERM raises `Terminated` in the main thread (once it is back in Python: a collective
    blocked on a dead peer fails first), or is held while a failure is being diagnosed
    (torchrun waits 30 s after SIGTERM before it sends SIGKILL)."""

    def __init__(self):
        self.deferred = False
        try:
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self.previous = None

    def _handle(self, signum, frame):
        if not self.deferred:
            raise Terminated()

    def defer(self) -> None:
        self.deferred = True

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None


def is_peer_failure(error: BaseException) -> bool:
    """Does this error from a collective mean a peer died or stalled?"""
    text = str(error)
    return isinstance(error, dist.DistBackendError) or any(
        marker in text for marker in ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer")
    )
