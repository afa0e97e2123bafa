"""The device seam: the only module that asks which device it is on.

Everything else receives a `Device` and calls its methods (memory statistics, peak
FLOP/s, synchronisation, the collective backend) instead of branching on CUDA.
"""

from __future__ import annotations

import os
import resource
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from torchacco.errors import UserError

# Dense bf16 peak FLOP/s of common accelerators, for MFU. Unknown devices report no MFU.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


@dataclass(frozen=True)
class Device:
    type: str  # "cuda" or "cpu"
    index: int = 0

    @property
    def torch(self) -> torch.device:
        return torch.device(self.type, self.index) if self.type == "cuda" else torch.device("cpu")

    @property
    def backend(self) -> str:
        return "nccl" if self.type == "cuda" else "gloo"

    @property
    def name(self) -> str:
        if self.type == "cuda":
            return torch.cuda.get_device_name(self.index)
        return "cpu"

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        if self.type != "cuda" or dtype != torch.bfloat16:
            return None
        return next((f for key, f in PEAK_BF16_FLOPS.items() if key in self.name), None)

    def synchronize(self) -> None:
        """Wait for the compute stream only: a job on the side stream keeps running."""
        if self.type == "cuda":
            torch.cuda.current_stream(self.index).synchronize()

    def reset_peak_memory(self) -> None:
        if self.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.index)

    def peak_memory_gib(self) -> float:
        """CUDA: max allocated by tensors. CPU: the process's peak resident set size."""
        if self.type == "cuda":
            return torch.cuda.max_memory_allocated(self.index) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def select_device(requested: str, local_rank: int) -> Device:
    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        raise UserError(
            "[training] device = 'cuda' but CUDA is not available on this machine; "
            "use --training.device cpu (or auto)"
        )
    if requested == "cuda" or (requested == "auto" and available):
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                "launch at most one process per GPU (NGPU)"
            )
        torch.cuda.set_device(local_rank)
        return Device("cuda", local_rank)
    return Device("cpu")


def compute_dtype(setting: str, device: Device) -> torch.dtype:
    """`auto` is bf16 on CUDA and fp32 on CPU, where bf16 matmuls are far slower."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[setting]


def set_cpu_threads(requested: int, local_world_size: int) -> int:
    threads = requested or max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


class ThreadRunner:
    """Runs one job at a time beside the compute, on a communication thread.

    Collectives are issued only by this thread while a job is in flight, so every rank
    issues them in the same order. gloo and NCCL release the GIL while they wait.
    """

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchacco-comm")
        self._future: Future | None = None

    def launch(self, job: Callable[[], Any]) -> None:
        assert self._future is None, "a job is already in flight"
        self._future = self._pool.submit(job)

    def in_flight(self) -> bool:
        return self._future is not None

    def done(self) -> bool:
        """Non-blocking: has the job in flight finished (True when there is none)?"""
        return self._future is None or self._future.done()

    def wait(self) -> Any:
        """The job's result (re-raising its error); None when nothing was in flight."""
        if self._future is None:
            return None
        future, self._future = self._future, None
        return future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class StreamRunner(ThreadRunner):
    """CUDA: the job's kernels run on a side stream, ordered against the compute stream by
    events. The thread only issues them (and blocks on the job's own host syncs), so the
    compute side never blocks: `done()` polls the event with `query()`."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.stream = torch.cuda.Stream(device)
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

    def wait(self):
        result = super().wait()
        if self._done_event is not None:
            torch.cuda.current_stream().wait_event(self._done_event)
            self._done_event = None
        return result


def make_runner(device: Device) -> ThreadRunner:
    return StreamRunner(device.torch) if device.type == "cuda" else ThreadRunner()
