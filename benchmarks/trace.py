"""Reading a torchacco profiler trace (Chrome trace JSON): the sharded job's GPU kernels and the compute side's, on
which streams, and how much of the job's kernel time ran beside compute kernels. The job's kernels are found by
provenance, not name: every kernel on a stream that the `torchacco/job:<kind>` thread launched on is the job's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import panels, save_figure


@dataclass
class Kernels:
    spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end) in µs
    streams: set = field(default_factory=set)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(spans) -> float:
    """The time covered by `spans` (overlapping ones counted once)."""
    return sum(b - a for a, b in _union(spans))


def split_kernels(trace: Path) -> tuple[Kernels, Kernels]:
    """(the job's kernels, the compute side's kernels) of one trace."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    job_threads = {e["tid"] for e in events if str(e.get("name", "")).startswith("torchacco/job:")}
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("tid") in job_threads]
    job_launches = {e["args"]["correlation"] for e in launches if "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    job_streams = {e["args"].get("stream") for e in kernels if e["args"].get("correlation") in job_launches}
    job, compute = Kernels(), Kernels()
    for e in kernels:
        side = job if e["args"].get("stream") in job_streams else compute
        side.spans.append((e["ts"], e["ts"] + e["dur"]))
        side.streams.add(e["args"].get("stream"))
    return job, compute


def overlap(trace: Path) -> dict:
    """Kernel time of the job and of compute, and the share of the job's that ran beside compute kernels (its overlap;
    exposed: the rest)."""
    job, compute = split_kernels(trace)
    job_us, compute_us = _length(job.spans), _length(compute.spans)
    hidden = max(0.0, job_us + compute_us - _length(job.spans + compute.spans))  # the time both ran
    return {
        "job_kernel_ms": job_us / 1e3,
        "compute_kernel_ms": compute_us / 1e3,
        "job_hidden_ms": hidden / 1e3,
        "job_exposed_ms": (job_us - hidden) / 1e3,
        "overlap": hidden / job_us if job_us else 0.0,
        "job_streams": sorted(map(str, job.streams)),
        "compute_streams": sorted(map(str, compute.streams)),
    }


def render_timeline(trace: Path, png: Path, title: str) -> None:
    """A PNG of the traced window: the compute side's kernels and the job's, one row per stream."""
    drawn = panels(1, height=2.6, width=12)
    if drawn is None:
        return
    fig, (ax,) = drawn
    job, compute = split_kernels(trace)
    origin = min(a for a, _ in job.spans + compute.spans)
    for row, (kernels, color) in enumerate(((compute, "tab:blue"), (job, "tab:orange"))):
        spans = [((a - origin) / 1e3, (b - a) / 1e3) for a, b in _union(kernels.spans)]
        ax.broken_barh(spans, (row * 10, 8), color=color)
    ax.set_yticks([4, 14], ["compute stream", "job stream"])
    ax.set(xlabel="ms", title=title)
    png.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, png)
