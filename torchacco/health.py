"""Where each rank is, so a failed collective can name the rank that stopped and what it was doing
(docs/reliability.md#how-diagnosis-works). Heartbeats go to the launcher's store from a daemon thread once a second
however short the steps are: the store's load does not grow with the step rate, and the loop only sets strings.
Store reads have a deadline: an unreachable store must not hold the diagnosis past torchrun's SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from torchacco.errors import Stalled, Terminated, print_error
from torchacco.parallel.collectives import watch_collectives

BEAT_KEY = "torchacco/heartbeat/"
READ_TIMEOUT_S = 8.0  # per read of every heartbeat; diagnose() reads twice, 2.5 s apart: ~19 s at most
TEARDOWN_S = 10.0  # after a reported failure, the most time the process takes to end
MIN_WATCH_S = 20.0  # the shortest deadline the watchdog keeps (a loaded machine's slow step is no hang)


class Heartbeat:
    def __init__(self, store: dist.Store | None, rank: int, world: int, interval_s: float = 1.0):
        self.store, self.rank, self.world, self.interval_s = store, rank, world, interval_s
        self.phase = "startup"  # the training loop's
        self.comm = ""  # the communication job's, while one is in flight
        self.collectives: dict[str, list] = {}  # per group: [reduce-scatters and all-gathers entered, the last one]
        self.moved = time.monotonic()  # the main thread's last progress: a phase entered, a collective issued
        self.last_issued = (0, "")  # (ns, what) of the last collective issued from Python
        self._beats = 0
        self._cond = threading.Condition()
        self._flushes_asked = self._flushes_done = 0
        self.closed = threading.Event()  # set: the beats and the watchdog stop
        self._thread = None
        if store is not None and world > 1:
            self._thread = threading.Thread(target=self._run, name="torchacco-heartbeat", daemon=True)
            self._thread.start()

    def enter(self, phase: str) -> None:
        self.phase = phase  # published with the next beat: a phase change writes nothing
        self.moved = time.monotonic()

    def comm_phase(self, phase: str) -> None:
        self.comm = phase

    def issued(self, op: str, group: str) -> None:  # (collectives.py watches torch.distributed's)
        self.last_issued = (time.time_ns(), f"{op.replace('_', '-')} on process group {group}")
        if threading.current_thread() is threading.main_thread():
            self.moved = time.monotonic()

    def entered(self, op: str, group: str) -> None:
        """A reduce-scatter or all-gather of `group` (a name its ranks agree on) starts. (Counted per group:
        DiLoCo's replicas take different numbers of steps.)"""
        count = self.collectives.setdefault(group, [0, op])
        count[:] = count[0] + 1, op

    def flush(self, timeout_s: float = 2.0) -> None:
        """Publish the current phase now, and wait until it is (an injected kill does, so its phase is exact)."""
        if self._thread is None:
            return
        with self._cond:
            self._flushes_asked += 1
            asked = self._flushes_asked
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._flushes_done >= asked or self.closed.is_set(), timeout_s)

    def where(self) -> str:
        return f"{self.phase}, with its {self.comm} in flight" if self.comm else self.phase

    def _run(self) -> None:
        while True:
            with self._cond:
                if self.closed.is_set():
                    return
                serving = self._flushes_asked  # the phase read below is at least as new as these
            self._beats += 1
            try:
                self.store.set(f"{BEAT_KEY}{self.rank}", json.dumps(self._beat()))
            except Exception:  # the store's host is gone: diagnose() reports it
                return
            with self._cond:
                self._flushes_done = serving
                self._cond.notify_all()
                if self._flushes_asked == serving and not self.closed.is_set():
                    self._cond.wait(self.interval_s)  # until the next beat, or a flush or close

    def _beat(self) -> dict:
        return {"beat": self._beats, "where": self.where(), "collectives": dict(self.collectives)}

    def close(self) -> None:
        with self._cond:
            self.closed.set()
            self._cond.notify_all()

    def read(self) -> dict[int, dict] | None:
        """The other ranks' heartbeats; None when the store does not answer within READ_TIMEOUT_S. (On a thread: a store
        whose host hangs blocks a read for the store's own timeout, the collective timeout, and no timeout bounds a read
        in progress.)"""
        keys = {r: f"{BEAT_KEY}{r}" for r in range(self.world) if r != self.rank}
        read = lambda: {r: json.loads(self.store.get(k)) for r, k in keys.items() if self.store.check([k])}
        return within(read, READ_TIMEOUT_S, "torchacco-heartbeat-read")  # None too when the store's host is gone

    def diagnose(self, watch_s: float | None = None) -> str:
        """A sentence naming the ranks that stopped and where, or what is known."""
        if self._thread is None:
            return "no heartbeat to go by"
        first = self.read()
        if first is None:
            return "the launcher's store is unreachable too: node 0 (its host) is probably down"
        time.sleep(2.5 * self.interval_s if watch_s is None else watch_s)
        second = self.read()
        if second is None:
            return "the launcher's store stopped answering while the heartbeats were read: node 0 is probably down"
        others = (r for r in range(self.world) if r != self.rank)
        silent = [r for r in others if r not in first or (r in second and second[r]["beat"] == first[r]["beat"])]
        if silent:
            stopped = {r: f"stopped responding in {first[r]['where']}" for r in silent if r in first}
            never = "never reported (it died or stalled while starting)"
            return "; ".join(f"rank {r} {stopped.get(r, never)}" for r in silent)
        busy = "; ".join(f"rank {r} is alive, in {second[r]['where']}" for r in sorted(second))
        return behind({**second, self.rank: self._beat()}) or (
            f"no rank stopped: {busy} — a rank much slower than the others, ranks that disagree on the work to do, or "
            "a collective hung in the communication library (with NCCL, <dump_folder>/flight_recorder holds each "
            "rank's last collectives)")  # fmt: skip


def behind(beats: dict[int, dict], named: int = 4) -> str | None:
    """Every rank alive (`beats`: each rank's last heartbeat): the ranks that have not entered the reduce-scatter
    or all-gather the others of their group are in, and where they are instead; None when none lags. (A rank that
    never entered one of a group's collectives is not compared.)"""
    said, late_ranks = [], set()
    groups = {g for b in beats.values() for g in b.get("collectives", {})}
    for group in sorted(groups):
        entered = {r: b["collectives"][group] for r, b in beats.items() if group in b.get("collectives", {})}
        most = max(n for n, _ in entered.values())
        late = sorted(r for r, (n, _) in entered.items() if n < most and r not in late_ranks)
        ahead = sorted(r for r, (n, _) in entered.items() if n == most)
        op = entered[ahead[0]][1].replace("_", "-")
        waiting = f"rank {ahead[0]} is" if len(ahead) == 1 else f"ranks {', '.join(map(str, ahead[:named]))}"
        waiting += "" if len(ahead) == 1 else (" are" if len(ahead) <= named else f" and {len(ahead) - named} more are")
        for r in late:
            late_ranks.add(r)
            said.append(f"rank {r} has not entered the {op} that {waiting} in (their "
                        f"reduce-scatter or all-gather #{most}; rank {r} entered {entered[r][0]}): "
                        f"rank {r} is alive, in {beats[r]['where']}")  # fmt: skip
    if not said:
        return None
    more = f"; and {len(said) - named} more ranks behind" if len(said) > named else ""
    return "; ".join(said[:named]) + more


def watch(hb: Heartbeat, deadline_s: float, timeout_s: float, dump: Callable[[], None]):
    """A main thread without progress for `deadline_s` (no job in flight: the overlapped schedules time their own
    wait) is hung in a collective: one line naming the rank, the collective and the diagnosis, before NCCL's abort."""
    trained = False  # (armed once the loop's phases (step N) start: a preparation before may take hours)
    while not hb.closed.wait(1.0):
        idle, trained = time.monotonic() - hb.moved, trained or "(step " in hb.phase
        if trained and idle >= deadline_s and not hb.comm and not hb.phase.startswith("waiting for rank"):
            dump()
            collective = max(hb.last_issued, last_collective())[1] or "last collective"
            report(f"rank {hb.rank}: its {collective} made no progress for {idle:.0f} s during its {hb.where()}: "
                   f"{hb.diagnose()}; [training] collective_timeout_s = {timeout_s:g}")  # fmt: skip
            return


def last_collective() -> tuple[int, str]:
    """(ns, what) of the flight recorder's newest collective (DDP's, DTensor's: C++ issues them), or (0, "")."""

    def read() -> tuple[int, str]:
        e = max(pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, True))["entries"],
                key=lambda e: e["time_created_ns"])  # fmt: skip
        seq = e["collective_seq_id"] or e.get("p2p_seq_id", 0)
        return e["time_created_ns"], f"{e['profiling_name']} (#{seq}) on process group {e['process_group'][0]}"

    if int(os.environ.get("TORCH_FR_BUFFER_SIZE") or 0) <= 0:
        return 0, ""
    return within(read, 5.0, "torchacco-flight-recorder-read") or (0, "")  # (its lock may be held beside the hang)


def within(fn: Callable[[], object], timeout_s: float, name: str, errors: tuple = (Exception,)):
    """`fn()` on a daemon thread of its own, waited for at most `timeout_s`: its result, or None when it raised one of
    `errors` or is still running (a store or a lock held beside a hang must not hold up a diagnosis)."""
    found = []

    def run() -> None:
        with contextlib.suppress(*errors):
            found.append(fn())

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return found[0] if found else None


_report_lock = threading.Lock()
_exit_timer: threading.Timer | None = None


def report(message: str) -> bool:
    """Print a failure's one line now, once per process, and end the process if its teardown then outlasts
    TEARDOWN_S: a teardown beside a dead peer can block past torchrun's SIGKILL, and a line printed after it be lost.
    False when a failure was reported already (the line is not printed again)."""
    global _exit_timer
    with _report_lock:
        if _exit_timer is not None:
            return False
        print_error(message)
        _exit_timer = threading.Timer(TEARDOWN_S, os._exit, (1,))
        _exit_timer.daemon = True
        _exit_timer.start()
        return True


def torn_down() -> None:
    """The reported failure's teardown finished: the process goes on (or exits) by itself."""
    global _exit_timer
    with _report_lock:
        if _exit_timer is not None:
            _exit_timer.cancel()
        _exit_timer = None


def start(rank: int, world: int, deadline_s: float = 0.0, timeout_s: float = 0.0, dump=lambda: None) -> Heartbeat:
    """The heartbeat of this process, over the default process group's store, and the watchdog of its main thread;
    torch.distributed's collectives and torchacco's report to it until `stop`."""
    store = dist.distributed_c10d._get_default_store() if dist.is_initialized() and world > 1 else None
    heartbeat = Heartbeat(store, rank, world)
    watch_collectives(heartbeat)
    if MIN_WATCH_S <= deadline_s < timeout_s and store is not None:  # (under it: the library's own timeout first)
        args = (heartbeat, deadline_s, timeout_s, dump)
        threading.Thread(target=watch, args=args, name="torchacco-watchdog", daemon=True).start()
    return heartbeat


def stop(heartbeat: Heartbeat) -> None:
    watch_collectives(None)
    heartbeat.close()


class SigtermGuard:
    """SIGTERM raises `Terminated` in the main thread (once it is back in Python: a collective blocked on a dead peer
    fails first), or is held while a failure is being diagnosed (torchrun sends SIGKILL 30 s after SIGTERM)."""

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
    return isinstance(error, dist.DistBackendError | Stalled) or any(marker in str(error) for marker in PEER_FAILURES)


# What gloo raises, as a plain RuntimeError from inside DDP's backward hooks, when a peer dies or stalls (the last:
# gloo's own timeout on a stalled peer's connection)
PEER_FAILURES = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer",
                 "Application timeout caused pair closure")  # fmt: skip
