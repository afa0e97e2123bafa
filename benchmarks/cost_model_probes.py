"""The cost model check's inputs, probed on the machine as it is: compute, CPU per update, the optimizer's speed and
each setting's collectives (root and a quiet machine: `python -m benchmarks cost-model-check --probe`), cached in
bench_results/cost_model_probes.json and checked against the settings' plans when read."""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
import time
from pathlib import Path

from benchmarks.acco_reference import recipe
from benchmarks.cluster import ClusterPlan, preflight, probe_collectives, run_training
from benchmarks.names import ZERO1
from benchmarks.speed import STRATEGIES, TOKENS_PER_UPDATE, compute_s
from benchmarks.token_efficiency import QUIET, machine
from torchacco.config import load_config
from torchacco.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION_RANKS = 2  # time_to_target.calibrate runs ZeRO-1 on 2 unshaped nodes of one rank
THREADS = 1  # run_training's default: one compute thread per rank, so a rank uses at most one core
PROBES = "cost_model_probes.json"


def calibration(out: Path) -> dict:
    """Seconds per token of one rank on one core, and the model's parameters, from the calibration in
    bench_results/time_to_loss.json (measured by the former time-to-loss sweep, as time_to_target.calibrate does)."""
    calib = json.loads((out / "time_to_loss.json").read_text())["calibration"]
    return compute_inputs(calib["compute_per_update_s"], calib["params"])


def compute_inputs(compute_per_update_s: float, params: float) -> dict:
    """ZeRO-1's compute per update on CALIBRATION_RANKS one-rank nodes as the model's seconds per token."""
    tokens_per_rank = TOKENS_PER_UPDATE / CALIBRATION_RANKS
    return {"seconds_per_token": compute_per_update_s / tokens_per_rank, "params": params,
            "compute_per_update_s": compute_per_update_s}  # fmt: skip


def trainer_config(args: list[str]):
    """The trainer's resolved config for a speed run: the recipe, then `args` (the label's, the setting's)."""
    full = [*recipe(110, 1.5e-3, 0), *args]
    at = full.index("--config") + 1
    full[at] = str(ROOT / full[at])  # the recipe names its file from the repository's root
    return load_config(full)


def adamw_elements_per_s(numel: int, steps: int = 30) -> float:
    """torch's AdamW on one thread over `numel` fp32 elements (the replicated optimizer's step): elements per s."""
    import torch

    torch.set_num_threads(THREADS)
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return numel / statistics.median(times)


def zero1_run(folder: Path, updates: int, cores: float | None = None) -> dict:
    """ZeRO-1 on CALIBRATION_RANKS unshaped one-rank nodes (`cores`: each under that CPU quota) for `updates`
    updates, no evaluation, as benchmarks.speed trains: its records and per-rank reports."""
    train = [*recipe(updates, 1.5e-3, 0), *QUIET, *STRATEGIES[ZERO1], "--eval.every", "0"]
    train += ["--training.max_tokens", "0", "--training.steps", str(updates)]
    return run_training(ClusterPlan(nodes=CALIBRATION_RANKS, rate_bps=None, cpu_per_node=cores), train, folder)


def probe_compute(folder: Path, updates: int = 30, cores: float | None = None) -> float:
    """The calibration measured again: ZeRO-1's data, forward and backward per update (median, past 5 updates)
    on 2 unshaped one-rank nodes, so that compute and links are measured on the machine as it is today; `cores`:
    both nodes under that CPU quota."""
    records = zero1_run(folder, updates, cores)["records"][5:]
    if not records:
        raise UserError(f"the compute probe logged no update past the fifth; see {folder}")
    return statistics.median(compute_s(r) for r in records)


def probe_cpu_per_update(folder: Path, short: int = 8, long: int = 38) -> float:
    """ZeRO-1's CPU seconds per update and rank, all threads (compute, its collectives' copies and sums, the
    optimizer, the trainer's own work), on 2 unshaped one-rank nodes: the CPU time of a long run less a short
    one's (start-up cancels), over the updates between."""
    cpu = []
    for updates in (short, long):
        ranks = zero1_run(folder / str(updates), updates)["ranks"]
        if len(ranks) != CALIBRATION_RANKS:
            raise UserError(f"the CPU probe read {len(ranks)} of {CALIBRATION_RANKS} ranks' reports; see {folder}")
        cpu.append(statistics.mean(r["cpu_user_s"] + r["cpu_sys_s"] for r in ranks))
    return (cpu[1] - cpu[0]) / (long - short)


# A collective is timed until every rank is done with it: a rank's own part can end while its sends are still on
# the wire (on these links a ring's two directions share one TCP connection and take turns), and in a run the
# next collective waits for them. The turn-taking comes on some calls and not on others, so the model takes the
# mean of many: a run's time per update is an average over its calls.
UNTIL_ALL = ["--until", "all", "--repeats", "15", "--stat", "mean"]
# The turn-taking also holds for a connection's life: whole runs (and probes) come out fast or slow on the same
# link, so the probe launches anew several times and takes the mean of the launches.
LAUNCHES = 3


def probe_launches(plan: ClusterPlan, folder: Path, params: int, launches: int = LAUNCHES) -> dict:
    """collective_probe on `plan` launched `launches` times (new connections each time): the mean of each time."""
    runs = [probe_collectives(plan, folder / str(i), params, extra=UNTIL_ALL) for i in range(launches)]
    mean = {key: statistics.mean(run[key] for run in runs) for key in runs[0] if key.endswith("_s")}
    return {**runs[0], **mean, "launches": launches, "per_launch": runs}


def probe(settings: dict[str, ClusterPlan], params: float, out: Path) -> dict:
    """The collectives on each setting's cluster, the optimizer's speed and the compute (root; a quiet machine)."""
    preflight(need_cgroup=any(plan.cores(i) is not None for plan in settings.values() for i in range(plan.nodes)))
    quotas = [plan.cores(i) for plan in settings.values() for i in range(plan.nodes) if plan.ranks_per_node == 1]
    compute = probe_compute(out / "runs" / "cost_model_probe" / "compute")
    cpu = probe_cpu_per_update(out / "runs" / "cost_model_probe" / "cpu")
    print(f"[cost-model-check] CPU: ZeRO-1 {cpu:.4f} s per update and rank", flush=True)
    print(f"[cost-model-check] compute: ZeRO-1 {compute:.4f} s per update on 2 unshaped nodes", flush=True)
    # a node under a CPU quota computes slower than its share of a core says (throttled, its caches go cold), so
    # each quota a one-rank node gets is measured as it is
    at_cores = {}
    for cores in sorted({q for q in quotas if q is not None and q < THREADS}):
        at_cores[f"{cores:g}"] = probe_compute(out / "runs" / "cost_model_probe" / f"compute_{cores:g}", cores=cores)
        print(f"[cost-model-check] compute at {cores:g} cores: {at_cores[f'{cores:g}']:.4f} s per update", flush=True)
    probed = {}
    for name, plan in settings.items():
        folder = out / "runs" / "cost_model_probe" / name
        probed[name] = {"plan": plan.describe(), "date": datetime.date.today().isoformat(),
                        "collectives": probe_launches(plan, folder, int(params))}  # fmt: skip
        if plan.ranks_per_node > 1:
            node = probe_launches(one_node(plan), folder / "node", int(params))
            probed[name]["node_collectives"] = node
        print(f"[cost-model-check] setting {name}: {probed[name]}", flush=True)
    return {"settings": probed, "adamw_elements_per_s": adamw_elements_per_s(int(params)),
            "compute_per_update_s": compute, "compute_per_update_s_at_cores": at_cores,
            "cpu_per_update_s": cpu}  # fmt: skip


def one_node(plan: ClusterPlan) -> ClusterPlan:
    """A node of the plan on its own (its ranks and CPU quota, no link to shape): where in-node rings are timed."""
    return dataclasses.replace(plan, nodes=1, rate_bps=None, latency_ms=0.0, slow_node=None)


def probes_for(out: Path, settings: dict, wanted: list[str], params: float, probe_now: bool, command: str) -> dict:
    """The probes: measured now (probe_now) and merged into the cache, or read from it; checked against the plans."""
    path = out / PROBES
    cached = json.loads(path.read_text()) if path.exists() else {"settings": {}}
    if probe_now:
        fresh = probe({s: settings[s][0] for s in wanted}, params, out)
        meta = {"date": datetime.date.today().isoformat(), "machine": machine(), "command": command}
        merged = {key: {**cached.get(key, {}), **fresh[key]} for key in ("settings", "compute_per_update_s_at_cores")}
        cached = {"meta": meta, **fresh, **merged}  # a setting or quota not probed now: the cache's
        path.write_text(json.dumps(cached, indent=1))
    missing = [s for s in wanted if s not in cached["settings"]]
    if missing or "adamw_elements_per_s" not in cached:
        raise UserError(f"{path} has no probe of {', '.join(missing) or 'the optimizer'}: run with --probe (root, "
                        "a quiet machine)")  # fmt: skip
    for s in wanted:
        if "ring_reduce_scatter_s" not in cached["settings"][s]["collectives"]:
            raise UserError(f"{path}: setting {s}'s probe has no times of torchacco's rings: run with --probe")
        if cached["settings"][s]["plan"] != settings[s][0].describe():
            raise UserError(f"setting {s} was probed as '{cached['settings'][s]['plan']}' but is now "
                            f"'{settings[s][0].describe()}': run with --probe")  # fmt: skip
    return cached
