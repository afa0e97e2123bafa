"""Runners: "start this job beside the compute; is it done?; wait" — the half of the device seam that the
overlapped schedules use. A thread on CPU; on CUDA a thread that issues the job's kernels on a side stream."""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

import torch

from torchacco.errors import Stalled

# Set when a job was given up unfinished: its thread or kernels may sit in the comm library, and the interpreter's
# finalization can abort ("terminate called without an active exception") when that thread wakes: end with os._exit.
left_stuck = threading.Event()


def stall_deadline_s(collective_timeout: timedelta) -> float:
    """How long the compute side waits for a job before it gives up and diagnoses: a minute (or a fifth) before the
    collective timeout, when NCCL's watchdog aborts the process without a word, so the diagnosis has time."""
    timeout = collective_timeout.total_seconds()
    return max(timeout - 60.0, 0.8 * timeout)


class ThreadRunner:
    """Runs one job at a time beside the compute, on a communication thread: collectives are issued only by this thread
    while a job is in flight, so every rank issues them in the same order. The thread is a daemon: a job stuck on a
    frozen peer never keeps the process from exiting."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._future: Future | None = None
        self._thread = threading.Thread(target=self._serve, name="torchacco-comm", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            try:
                future.set_result(job())
            except BaseException as e:  # handed to wait(), which re-raises it on the compute side
                future.set_exception(e)

    def launch(self, job: Callable[[], Any]) -> None:
        assert self._future is None, "a job is already in flight"
        self._future = Future()
        self._jobs.put((job, self._future))

    def in_flight(self) -> bool:
        return self._future is not None

    def done(self) -> bool:
        """Non-blocking: has the job in flight finished (True when there is none)?"""
        return self._future is None or self._future.done()

    def wait(self, timeout_s: float | None = None) -> Any:
        """The job's result (re-raising its error); None when nothing was in flight. A job still running after
        `timeout_s` raises `Stalled` (the job is abandoned: its thread is a daemon)."""
        if self._future is None:
            return None
        future, self._future = self._future, None
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            left_stuck.set()
            raise Stalled(f"the communication job made no progress for {timeout_s:.0f} "
                          "s (Timed out waiting for it)") from None  # fmt: skip

    def abandon(self) -> None:
        """Forget the job in flight (while another error ends the run): nothing waits for it."""
        if self._future is not None and not self._future.done():
            left_stuck.set()
        self._future = None

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def drain(self, timeout_s: float) -> None:
        """At the end of a run: wait for the job in flight, then stop. While an error unwinds, that error is the one
        to report: the job's own is dropped, and a job stuck on a frozen peer is left to the process's exit."""
        if sys.exc_info()[0] is not None:
            self.abandon()
            return
        self.wait(timeout_s)  # the last job can hang too
        self.close()


class StreamRunner(ThreadRunner):
    """CUDA: the job's kernels run on a side stream, ordered against the compute stream by events. The thread only
    issues them (and blocks on the job's own host syncs), so the compute side never blocks: `done()` polls."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        # High priority, as FSDP2's communication streams: the job's small kernels (norm, AdamW chunks, copies) run
        # as soon as they are ready instead of queueing behind compute kernels.
        self.stream = torch.cuda.Stream(device, priority=-1)
        self._done_event: torch.cuda.Event | None = None

    def launch(self, job):
        ready = torch.cuda.Event()
        ready.record()  # the buffers the job reads were written on the compute stream
        done = self._done_event = torch.cuda.Event()

        def on_side_stream():
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                result = job()
                done.record(self.stream)
            return result

        super().launch(on_side_stream)

    def done(self):
        return super().done() and (self._done_event is None or self._done_event.query())

    def abandon(self):
        super().abandon()
        self._done_event = None

    def wait(self, timeout_s=None):
        start = time.monotonic()
        result = super().wait(timeout_s)
        if self._done_event is not None:
            done, self._done_event = self._done_event, None
            # The thread has issued the job; its kernels may still hang on the GPU, where a blocking wait would end
            # only in NCCL's watchdog: poll within the deadline.
            waited = time.monotonic() - start
            wait_for_event(done, None if timeout_s is None else timeout_s - waited, waited)
            torch.cuda.current_stream().wait_event(done)
        return result


def wait_for_event(event, timeout_s: float | None, waited_s: float = 0.0, poll_s: float = 0.0002) -> None:
    """Wait until `event.query()`, raising `Stalled` past `timeout_s` (None: no deadline; `waited_s`: how long the
    job had been waited for already, for the message)."""
    deadline = None if timeout_s is None else time.monotonic() + max(timeout_s, 0.0)
    while not event.query():
        if deadline is not None and time.monotonic() > deadline:
            left_stuck.set()  # kernels still queued behind the hung collective
            raise Stalled("the communication job's kernels made no progress for "
                          f"{waited_s + timeout_s:.0f} s (Timed out waiting for it)")  # fmt: skip
        time.sleep(poll_s)
