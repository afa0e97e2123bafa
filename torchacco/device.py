"""The device seam: with `runners.py`, the only code that asks which device it is on.

Everything else receives a `Device` and calls its methods (memory statistics, peak FLOP/s, synchronisation, the
collective backend, the communication runner) instead of branching on CUDA.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from torchacco.errors import UserError

# Dense bf16 peak FLOP/s of common accelerators, for MFU. Unknown devices report no MFU.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


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
        return torch.cuda.get_device_name(self.index) if self.type == "cuda" else "cpu"

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        if self.type != "cuda" or dtype != torch.bfloat16:
            return None
        return next((f for key, f in PEAK_BF16_FLOPS.items() if key in self.name), None)

    def mark(self):
        """A point in the compute stream's work that `.synchronize()` waits for (CPU: already reached)."""
        if self.type != "cuda":
            return SimpleNamespace(synchronize=lambda: None)
        event = torch.cuda.Event()
        event.record()
        return event

    def stopwatch(self) -> Stopwatch:
        return Stopwatch(cuda=self.type == "cuda")

    def runner(self):
        """What runs the sharded job beside the compute: a CUDA side stream, or a thread on CPU."""
        from torchacco.runners import StreamRunner, ThreadRunner

        return StreamRunner(self.torch) if self.type == "cuda" else ThreadRunner()

    def record_memory_history(self) -> None:
        """CUDA: start recording the allocator's history (for a memory snapshot)."""
        if self.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=200_000)

    def dump_memory_history(self, path) -> None:
        """CUDA: write the recorded history (pytorch.org/memory_viz reads it) and stop recording."""
        if self.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)

    def reset_peak_memory(self) -> None:
        if self.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.index)

    def peak_memory_gib(self) -> float:
        """CUDA: max allocated by tensors. CPU: the process's peak resident set size."""
        if self.type == "cuda":
            return torch.cuda.max_memory_allocated(self.index) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Stopwatch:
    """The time of the work issued between `start()` and `stop()`, read later with `seconds()` without stalling
    the code that issued it: on CPU the wall time; on CUDA two events on the compute stream (`seconds()` waits for
    the second, so call it where waiting costs nothing)."""

    def __init__(self, cuda: bool):
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        self._start = self._seconds = None

    def start(self) -> Stopwatch:
        if self._events:
            self._events[0].record()
        else:
            self._start = time.perf_counter()
        return self

    def stop(self) -> Stopwatch:
        if self._events:
            self._events[1].record()
        elif self._start is not None:
            self._seconds = time.perf_counter() - self._start
        return self

    def seconds(self) -> float:
        if self._events:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1e3
        return self._seconds or 0.0


def select_device(requested: str, local_rank: int) -> Device:
    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        raise UserError(
            "[training] device = 'cuda' but CUDA is not available on this machine; use --training.device cpu (or auto)"
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


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # a config's dtype names


def compute_dtype(setting: str, device: Device) -> torch.dtype:
    """`auto` is bf16 on CUDA and fp32 on CPU, where bf16 matmuls are far slower."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[setting]


def set_cpu_threads(requested: int, local_world_size: int) -> None:
    torch.set_num_threads(requested or max(1, (os.cpu_count() or 1) // max(1, local_world_size)))
