"""Training metrics from rank 0: one dict per record, shown alike as a console line, TensorBoard scalars and
`metrics.jsonl`, so scripts and people never disagree about a run."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from torchacco.device import Device


def _step(line: str) -> float:
    """The step of a metrics.jsonl line; a line cut short by a crash counts as past any checkpoint."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class MetricsLogger:
    def __init__(
        self,
        folder: Path,
        enabled: bool,
        tensorboard: bool,
        progress_bar: bool,
        total_steps: int,
        keep_until_step: int = 0,
        max_tokens: int = 0,
    ):
        self.enabled, self.total_steps = enabled, total_steps
        self.max_tokens = max_tokens  # a run that stops on tokens: its progress is theirs
        self.progress_bar = progress_bar and enabled
        self.start = time.perf_counter()
        self.jsonl = self.writer = None
        if not enabled:
            return
        path = folder / "metrics.jsonl"
        # A resumed run continues the file from its checkpoint's step; a new run starts it afresh.
        kept = path.read_text().splitlines() if path.exists() and keep_until_step else []
        path.write_text("".join(line + "\n" for line in kept if _step(line) <= keep_until_step))
        self.jsonl = open(path, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(folder / "tb"))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        # Strict JSON: a skipped update's NaN loss is written as null.
        strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.jsonl.write(json.dumps(strict) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self.writer.add_scalar(key, value, record["step"])
        print(self._console_line(record), flush=True)

    def _console_line(self, r: dict) -> str:
        loss = "loss —" if r["loss"] is None else f"loss {r['loss']:.4f}"
        parts = [f"step {r['step']:>6}", loss, f"lr {r['lr']:.2e}", f"{r['tokens_per_s']:,.0f} tok/s"]
        if "tflops" in r:
            parts.append(f"{r['tflops']:.3g} TFLOP/s" + (f" ({100 * r['mfu']:.1f}% MFU)" if "mfu" in r else ""))
        parts += [f"mem {r['memory_gib']:.2f} GiB", f"gnorm {r['grad_norm']:.3f}"]
        parts.append(f"data/compute/sync {r['share_data']:.0%}/{r['share_compute']:.0%}/{r['share_sync']:.0%}")
        if "overlap" in r:  # overlapped schedules (acco, dpu, wp)
            mb = r["micro_batches_per_rank"]
            parts.append(f"exposed comm {r['exposed_comm_s']:.3f}s overlap "
                         f"{r['overlap']:.0%} micro-batches {min(mb)}-{max(mb)}")  # fmt: skip
        if "estimate_drift" in r:
            parts.append(f"|θ̃-θ|/|θ| {r['estimate_drift']:.2e}")
        if r.get("skipped"):
            parts.append(f"SKIPPED (non-finite; {r['skipped_steps']} so far)")
        if "val_loss" in r:
            parts.append(f"val loss {r['val_loss']:.4f} (ppl {r['val_perplexity']:.1f})")
        if self.progress_bar:
            done = r["step"] / max(1, self.total_steps)
            if self.max_tokens:
                done = min(1.0, max(done, r["tokens"] / self.max_tokens))
            elapsed = time.perf_counter() - self.start
            eta = elapsed / done * (1 - done) if done > 0 else 0.0
            bar = "#" * int(20 * done)
            parts.append(f"[{bar:<20}] {100 * done:3.0f}% ETA {_fmt_duration(eta)}")
        return " | ".join(parts)

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def close(self) -> None:
        for handle in filter(None, (self.jsonl, self.writer)):
            handle.close()


class Throughput:
    """Tokens/s, FLOP/s, memory and the data/compute/sync split between two log records.
    Per-rank rates divide by every rank (a model replica spans tp × pp of them)."""

    def __init__(self, flops_per_token: float, ranks: int, device: Device, dtype: torch.dtype):
        self.flops_per_token, self.ranks, self.device = flops_per_token, ranks, device
        self.peak = device.peak_flops(dtype)
        self.restart(0.0)

    def restart(self, tokens: float) -> None:
        self.start, self.tokens = time.perf_counter(), tokens
        self.times = {"data": 0.0, "compute": 0.0, "sync": 0.0}

    def since_last(self, tokens: float, result) -> dict:
        tps = (tokens - self.tokens) / (time.perf_counter() - self.start)
        busy = sum(self.times.values()) or 1.0
        achieved = self.flops_per_token * tps / self.ranks
        record = {
            "tokens_per_s": tps,
            "tokens_per_s_per_rank": tps / self.ranks,
            "grad_norm": result.grad_norm,
            "tflops": achieved / 1e12,
            "memory_gib": self.device.peak_memory_gib(),
            **{f"share_{phase}": seconds / busy for phase, seconds in self.times.items()},
            "tokens_per_update": result.consumed,
            "loss_tokens_per_update": result.tokens,
            "micro_batches_per_rank": result.micro_batches,
        }
        if result.seconds:  # an overlapped schedule's job: how much of it the compute did not hide
            # On CUDA both times are the communication thread's and the compute thread's host time: the job's
            # last kernels may still run on the side stream (the profiler's trace shows the GPU's side).
            record["job_s"], record["exposed_comm_s"] = result.seconds, result.exposed_s
            record["overlap"] = max(0.0, 1.0 - result.exposed_s / max(result.jobs_s or result.seconds, 1e-9))
            if result.drift is not None:
                record["estimate_drift"] = result.drift
        if self.peak is not None:
            record["mfu"] = achieved / self.peak
        return record
