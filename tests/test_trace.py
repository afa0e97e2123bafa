"""Reading a profiler trace: the job's kernels by provenance, and how much of them overlapped compute."""

import json

import pytest

from benchmarks.trace import overlap


def _kernel(ts, dur, stream, correlation):
    return {"cat": "kernel", "name": "k", "ts": ts, "dur": dur, "args": {"stream": stream, "correlation": correlation}}


def _launch(tid, correlation):
    return {
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "tid": tid,
        "ts": 0,
        "args": {"correlation": correlation},
    }


def test_overlap_counts_the_job_streams_kernels_against_compute_kernels(tmp_path):
    events = [
        {"cat": "user_annotation", "name": "torchacco/job:commit", "tid": 2, "ts": 0, "dur": 100},
        _launch(2, 10),  # the job thread's launch: its stream (20) is the job's
        _launch(1, 11),
        _kernel(0, 100, 7, 11),  # compute: 0-100 µs
        _kernel(150, 50, 7, 12),  # compute: 150-200 µs
        _kernel(50, 80, 20, 10),  # job: 50-130 µs, of which 50-100 under compute
        _kernel(180, 40, 20, 99),  # job stream, launched before the window: 180-220, 180-200 under compute
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    found = overlap(path)
    assert found["job_kernel_ms"] == pytest.approx(0.120)
    assert found["compute_kernel_ms"] == pytest.approx(0.150)
    assert found["job_hidden_ms"] == pytest.approx(0.070)
    assert found["job_exposed_ms"] == pytest.approx(0.050)
    assert found["overlap"] == pytest.approx(70 / 120)
    assert found["job_streams"] == ["20"] and found["compute_streams"] == ["7"]
