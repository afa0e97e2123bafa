"""`[profiling]`: torch.profiler traces of chosen updates, per rank, in the dump folder.

    <dump_folder>/profile/rank<r>/trace_step<N>.json      open in chrome://tracing or Perfetto
    <dump_folder>/profile/rank<r>/memory_step<N>.pickle   CUDA allocator history (pytorch.org/memory_viz)

Every thread is traced, so the overlapped schedules' communication thread shows beside the compute. Labels:
`torchacco/forward_backward`, `torchacco/evaluation`, `torchacco/checkpoint_save`; the sharded job
`torchacco/job:<kind>` with `torchacco/job/reduce_scatter`, `.../norm_and_counts`, `.../optimizer_<kind>`,
`.../all_gather`; the compute side's `torchacco/wait_for_job`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from torchacco.config import Profiling
from torchacco.device import Device


class Profiler:
    """Call `step(n)` after each committed update; traces updates start_step .. start_step + active_steps - 1
    (and again every `every` updates)."""

    def __init__(self, cfg: Profiling, folder: Path, rank: int, device: Device, first_step: int = 0):
        self.cfg, self.device = cfg, device
        self.folder = folder / cfg.folder / f"rank{rank}"
        self._prof = None
        self._memory = "off" if not cfg.memory_snapshot else "waiting"  # -> "recording" -> "done"
        self.last_step = first_step
        if not cfg.enable or (cfg.start_step <= first_step and not cfg.every):  # resumed past the traced updates
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        warmup = 1 if cfg.start_step - first_step > 1 else 0
        wait = max(0, cfg.every - cfg.active_steps - warmup) if cfg.every else 0
        skip = max(0, cfg.start_step - 1 - first_step - warmup - wait)  # profiler step k: update first_step + k + 1
        repeat = 0 if cfg.every else 1
        when = schedule(skip_first=skip, wait=wait, warmup=warmup, active=cfg.active_steps, repeat=repeat)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        all_threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        self._prof = profile(
            activities=activities, schedule=when, on_trace_ready=self._save, experimental_config=all_threads
        )
        self._prof.start()

    def _save(self, prof) -> None:
        prof.export_chrome_trace(str(self.folder / f"trace_step{self.last_step}.json"))
        if self._memory == "recording":  # the first traced window only: snapshots are large
            self.device.dump_memory_history(self.folder / f"memory_step{self.last_step}.pickle")
            self._memory = "done"

    def step(self, step: int) -> None:
        """Update `step` has just committed."""
        if self._prof is None:
            return
        self.last_step = step
        if self._memory == "waiting" and step + 1 >= self.cfg.start_step:
            self.device.record_memory_history()
            self._memory = "recording"
        self._prof.step()

    def close(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
