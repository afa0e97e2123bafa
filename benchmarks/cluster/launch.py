"""Training on the cluster: one torchrun agent per node inside its namespace, rendezvous at node 0, gloo over the
namespaces' links; then the run's records and per-rank reports (or the collectives' times), or one line saying which
node failed and why."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.cluster.namespaces import ROOT, Cluster
from benchmarks.cluster.plan import ClusterError, ClusterPlan
from benchmarks.common import records, update_s
from torchacco.emulation import overrides

NODE_TRAIN = "benchmarks.workers.node_train"


def train_argv(plan: ClusterPlan, i: int, train_args: list[str], port: int, module: str = NODE_TRAIN,
               python: str = sys.executable, run_id: str = "tacc") -> list[str]:  # fmt: skip
    """The per-node torchrun command: `ranks_per_node` processes, c10d rendezvous at node 0."""
    return [python, "-m", "torchacco.launch", "--nnodes", str(plan.nodes), "--node_rank", str(i), "--nproc_per_node",
            str(plan.ranks_per_node), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{plan.address(0)}:{port}",
            "--rdzv_id", run_id, "--rdzv_conf", f"is_host={int(i == 0)}", "--local_addr", plan.address(i),
            "--max_restarts", "0", "--monitor_interval", "0.5", "-m", module, *train_args]  # fmt: skip


def node_env(threads: int = 1, extra: dict | None = None) -> dict:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_ERROR_FILE"):
        env.pop(key, None)
    return {**env, **(extra or {})}


def calibrate(train_args: list[str], threads: int = 1) -> dict:
    """Virtual compute's durations for `train_args`' micro-batch, measured on the host with a rank's threads."""
    proc = subprocess.run([sys.executable, "-m", "torchacco", "calibrate", "--threads", str(threads), *train_args],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    if proc.returncode:
        raise ClusterError(f"calibrating virtual compute failed: {last_error(proc.stderr)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def settled_calibration(train_args: list[str], threads: int = 1, measure=calibrate, window: int = 3, tries: int = 8,
                        spread: float = 0.05) -> dict:  # fmt: skip
    """Virtual compute's waits from a quiet machine: calibrations repeated until the last `window` agree within
    `spread` (max / min − 1 of forward + backward), their median one, with the times it chose from. A machine that
    never settles within `tries` is one ClusterError: its calibrations would reorder the strategies."""
    taken = []
    for _ in range(tries):
        taken.append(measure(train_args, threads))
        last = sorted(taken[-window:], key=lambda c: c["forward_s"] + c["backward_s"])
        seconds = [c["forward_s"] + c["backward_s"] for c in last]
        if len(last) == window and seconds[-1] <= seconds[0] * (1 + spread):
            return {**last[window // 2], "compute_s_repeats": seconds, "tries": len(taken)}
    raise ClusterError(f"virtual compute's calibration never settled: {tries} calibrations, no {window} in a row "
                       f"within {spread:.0%} (the last: {', '.join(f'{s:.4f}' for s in seconds)} s); the machine is "
                       "busy: stop what else runs, or reuse a saved one (speed --virtual-calibration)")  # fmt: skip


def run_training(plan: ClusterPlan, train_args: list[str], folder: Path, timeout_s: float = 900, port: int = 29400,
                 threads: int = 1, verbose: bool = False, env: dict | None = None, virtual_compute: bool = False,
                 virtual_scale: float = 1.0, calibration: dict | None = None) -> dict:  # fmt: skip
    """Train on the emulated cluster: {'records', 'ranks' (per-rank reports), 'wall_s'}, and with `virtual_compute`
    (waits instead of compute; a slow node waits `slow_factor` times as long, as a slower GPU would) 'calibration':
    the given one, else measured now, each wait `virtual_scale` times as long. A failing node or a timeout is one line
    (ClusterError)."""
    folder.mkdir(parents=True, exist_ok=True)  # (overwrite: the folder holds the node logs)
    args = [*train_args, "--job.dump_folder", str(folder), "--job.overwrite", "true", "--training.num_threads",
            str(threads)]  # fmt: skip
    calibration = (calibration or calibrate(train_args, threads)) if virtual_compute else None
    if calibration and virtual_scale != 1.0:
        keys = ("forward_s", "backward_s", "optimizer_s_per_param")
        calibration = {**calibration, **{k: calibration[k] * virtual_scale for k in keys}, "scale": virtual_scale}
    if calibration:
        args += [*overrides(calibration), "--eval.every", "0"]
        if plan.slow_node is not None:  # node_train names its own ranks slow
            env = {**(env or {}), "TORCHACCO_SLOW_NODE": str(plan.slow_node),
                   "TORCHACCO_SLOW_FACTOR": str(plan.slow_factor)}  # fmt: skip
            plan = dataclasses.replace(plan, slow_node=None, slow_factor=1.0)
    validate = subprocess.run([sys.executable, "-m", "torchacco", "validate", *args], cwd=ROOT, capture_output=True,
                              text=True, env={**os.environ, "WORLD_SIZE": str(plan.world_size),
                                              "LOCAL_WORLD_SIZE": str(plan.ranks_per_node)})  # fmt: skip
    if validate.returncode:
        raise ClusterError(last_error(validate.stderr, "invalid config"))
    wall = run_nodes(plan, NODE_TRAIN, args, folder, timeout_s, port, threads, verbose, env)
    result = {"records": read_records(folder), "ranks": read_rank_reports(folder), "wall_s": wall}
    return result | ({"calibration": calibration} if calibration else {})


def run_nodes(plan: ClusterPlan, module: str, args: list[str], folder: Path, timeout_s: float = 900, port: int = 29400,
              threads: int = 1, verbose: bool = False, extra_env: dict | None = None) -> float:  # fmt: skip
    """Build the cluster, run `module args` under one torchrun agent per node, tear down: the wall seconds, or a
    ClusterError naming the failing node's last error."""
    folder.mkdir(parents=True, exist_ok=True)
    env = node_env(threads, {"TORCHACCO_NODE_REPORT_DIR": str(folder), **(extra_env or {})})
    started, logs = time.perf_counter(), f"{folder}/node*.log"
    with Cluster(plan, verbose=verbose) as cluster:
        procs = [cluster.launch(i, train_argv(plan, i, args, port, module=module, run_id=plan.prefix),
                                {**env, "TORCHACCO_NODE_ADDR": plan.address(i), "TORCHACCO_NODE_INDEX": str(i)},
                                folder / f"node{i}.log") for i in range(plan.nodes)]  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:  # until every node is done or one has failed
            codes = [p.poll() for p in procs]
            failed = next((i for i, code in enumerate(codes) if code), None)
            if failed is not None or None not in codes:
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"the cluster run did not finish within {timeout_s:.0f} s (logs: {logs})")
            time.sleep(0.2)
        if failed is not None:
            raise ClusterError(f"node {failed} failed: {_last_error(folder / f'node{failed}.log')} (logs: {logs})")
    return time.perf_counter() - started


def probe_collectives(plan: ClusterPlan, folder: Path, numel: int, port: int = 29400, timeout_s: float = 600,
                      extra: list[str] = ()) -> dict:  # fmt: skip
    """Seconds of each collective of `numel` fp32 over the cluster (`extra`: more collective_probe.py options)."""
    run_nodes(plan, "benchmarks.workers.collective_probe", ["--numel", str(numel), *extra], folder, timeout_s, port)
    return json.loads((folder / "collectives.json").read_text())


def last_error(output: str, default: str = "no output") -> str:
    """A process's error line (without its prefix), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    line = next((x for x in reversed(lines) if x.startswith("torchacco: error: ")), lines[-1] if lines else default)
    return line.removeprefix("torchacco: error: ")


def _last_error(log: Path) -> str:
    try:
        return last_error(log.read_text(errors="replace"))
    except OSError:
        return "no log"


def read_records(folder: Path) -> list[dict]:
    if not (folder / "metrics.jsonl").exists():
        raise ClusterError(f"no metrics.jsonl in {folder}: the run logged nothing")
    return records(folder)


def read_rank_reports(folder: Path) -> list[dict]:
    reports = []
    for path in sorted(folder.glob("rank*.json"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0)):
        with contextlib.suppress(OSError, ValueError):
            reports.append(json.loads(path.read_text()))
    return reports


def summarize(records: list[dict], warmup: int) -> dict:
    """A run's records after `warmup`: tokens/s, step time, exposed communication, overlap and final loss."""
    kept = records[warmup:] if len(records) > warmup else records
    step_times = [update_s(r) for r in kept]
    # what the compute side waited for: overlapped schedules measure it; a synchronous one's is its sync
    exposed = [r.get("exposed_comm_s", r["share_sync"] * t) for r, t in zip(kept, step_times)]
    return {"steps": len(kept), "tokens_per_s": sum(r["tokens_per_update"] for r in kept) / sum(step_times),
            "step_time_s": statistics.mean(step_times), "exposed_comm_s": statistics.mean(exposed),
            "overlap": statistics.mean(r.get("overlap", 0.0) for r in kept),
            "final_loss": kept[-1]["loss"]}  # fmt: skip
