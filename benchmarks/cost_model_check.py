"""The cost model's time per update against the emulated cluster's measured speed, per setting and strategy.

    sudo .venv/bin/python -m benchmarks cost-model-check --speed speed,speed_streaming --probe
    .venv/bin/python -m benchmarks cost-model-check --speed speed,speed_streaming   # from the cached probes

The bar: `predict`'s error within 15% everywhere. The model's inputs are probed, not fitted to the times checked
(`--probe`: root, a quiet machine; cached in <out>/cost_model_probes.json): ZeRO-1's compute and CPU per update, each
collective's time over the model's ring ideal per setting, the in-node all-gather, AdamW's speed on one core. Writes
<out>/<--name>.{json,md,png}.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
import time
import timeit
from pathlib import Path

from benchmarks import common
from benchmarks.cluster import ClusterPlan, parse_rate, preflight, probe_collectives, run_training
from benchmarks.common import QUIET, ROOT, ZERO1, recipe
from benchmarks.yardstick.speed import STRATEGIES, TOKENS_PER_UPDATE, compute_s, plans, seconds_per_update
from torchacco.config import load_config
from torchacco.errors import UserError
from torchacco.parallel.balance import split_by_speed
from torchacco.planning import cost_model as cm

TOLERANCE = 0.15  # the bar on the time per update's relative error
RANKS = 2  # the calibration runs ZeRO-1 on 2 unshaped nodes of one rank
THREADS = 1  # run_training's default: one compute thread per rank, so a rank uses at most one core
PROBES = "cost_model_probes.json"
MEASURED = dict(flops=1.0, streams=False)  # Hardware from measured times: flops unused (compute_s is measured)
# Until every rank is done (a run's next collective waits for sends still on the wire); the mean over calls and
# launches, as a ring's two directions share a TCP connection and take turns on some calls and some connections.
UNTIL_ALL, LAUNCHES = ["--until", "all", "--repeats", "15", "--stat", "mean"], 3


class NotModelled(Exception):
    """A speed label the cost model has no formula for; the message says why."""


# the probes (root; a quiet machine) ---------------------------------------------------------------------------


def compute_inputs(compute_per_update_s: float, params: float) -> dict:
    """ZeRO-1's compute per update on RANKS one-rank nodes as the model's seconds per token."""
    return {"seconds_per_token": compute_per_update_s / (TOKENS_PER_UPDATE / RANKS), "params": params,
            "compute_per_update_s": compute_per_update_s}  # fmt: skip


def zero1_run(folder: Path, updates: int, cores: float | None = None, virtual: bool = False) -> dict:
    """ZeRO-1 on RANKS unshaped one-rank nodes (`cores`: each under that CPU quota), no evaluation, as speed trains."""
    train = [*recipe(updates, 1.5e-3, 0), *QUIET, *STRATEGIES[ZERO1], "--eval.every", "0"]
    train += ["--training.max_tokens", "0", "--training.steps", str(updates)]
    plan = ClusterPlan(nodes=RANKS, rate_bps=None, cpu_per_node=cores)
    return run_training(plan, train, folder, virtual_compute=virtual)


def probe_virtual_overhead(folder: Path, params: float, updates: int = 60) -> float:
    """Under virtual compute, a rank's host work per micro-batch beside its waits: ZeRO-1's time per update less the
    calibrated waits it was given."""
    run = zero1_run(folder, updates, virtual=True)
    waits, cfg = run["calibration"], trainer_config(STRATEGIES[ZERO1])
    micro_batches = cfg.training.global_batch_size // (cfg.training.local_batch_size * RANKS)
    waited = micro_batches * (waits["forward_s"] + waits["backward_s"])
    waited += waits["optimizer_s_per_param"] * params / RANKS
    return max(0.0, seconds_per_update(run["records"]) - waited) / micro_batches


def probe_compute(folder: Path, cores: float | None = None) -> float:
    """ZeRO-1's data, forward and backward per update (median past 5 of 30 updates) on 2 unshaped one-rank nodes."""
    kept = zero1_run(folder, 30, cores)["records"][5:]
    if not kept:
        raise UserError(f"the compute probe logged no update past the fifth; see {folder}")
    return statistics.median(compute_s(r) for r in kept)


def probe_cpu_per_update(folder: Path, short: int = 8, long: int = 38) -> float:
    """ZeRO-1's CPU seconds per update and rank: a long run's less a short one's (start-up cancels)."""
    cpu = []
    for updates in (short, long):
        ranks = zero1_run(folder / str(updates), updates)["ranks"]
        if len(ranks) != RANKS:
            raise UserError(f"the CPU probe read {len(ranks)} of {RANKS} ranks' reports; see {folder}")
        cpu.append(statistics.mean(r["cpu_user_s"] + r["cpu_sys_s"] for r in ranks))
    return (cpu[1] - cpu[0]) / (long - short)


def probe_launches(plan: ClusterPlan, folder: Path, params: int, launches: int = LAUNCHES) -> dict:
    """collective_probe on `plan` launched `launches` times (new connections each time): the mean of each time."""
    runs = [probe_collectives(plan, folder / str(i), params, extra=UNTIL_ALL) for i in range(launches)]
    mean = {key: statistics.mean(run[key] for run in runs) for key in runs[0] if key.endswith("_s")}
    return {**runs[0], **mean, "launches": launches, "per_launch": runs}


def probe(settings: dict[str, ClusterPlan], params: float, out: Path, compute: bool = True,
          virtual: bool = False) -> dict:  # fmt: skip
    """The collectives on each setting's cluster (keyed by plan), AdamW's speed; with `compute` the compute and CPU per
    update (virtual compute needs neither), with `virtual` the host work beside its waits."""
    import torch

    preflight(need_cgroup=any(plan.cores(i) is not None for plan in settings.values() for i in range(plan.nodes)))
    folder, say = out / "runs" / "cost_model_probe", lambda text: print(f"[cost-model-check] {text}", flush=True)
    found = {"compute_per_update_s_at_cores": {}}
    if virtual:
        found["virtual_overhead_s"] = probe_virtual_overhead(folder / "virtual_overhead", params)
        say(f"virtual compute: {found['virtual_overhead_s'] * 1e3:.2f} ms of host work per micro-batch")
    if compute:
        found |= {"compute_per_update_s": probe_compute(folder / "compute"),
                  "cpu_per_update_s": probe_cpu_per_update(folder / "cpu")}  # fmt: skip
        say(f"ZeRO-1: compute {found['compute_per_update_s']:.4f} s, CPU {found['cpu_per_update_s']:.4f} s per update")
    # a node under a CPU quota computes slower than its share of a core says (throttled, its caches go cold)
    quotas = {p.cores(i) for p in settings.values() for i in range(p.nodes) if p.ranks_per_node == 1} if compute else {}
    for cores in sorted(q for q in quotas if q is not None and q < THREADS):
        at = found["compute_per_update_s_at_cores"][f"{cores:g}"] = probe_compute(folder / f"compute_{cores:g}", cores)
        say(f"compute at {cores:g} cores: {at:.4f} s per update")
    found["settings"] = {}
    for name, plan in settings.items():
        where = folder / re.sub(r"[^\w.]+", "_", name)
        collectives = probe_launches(plan, where, int(params))
        row = found["settings"][plan.describe()] = {"plan": plan.describe(), "collectives": collectives,
                                                    "date": time.strftime("%Y-%m-%d")}  # fmt: skip
        if plan.ranks_per_node > 1:  # a node on its own: where in-node rings are timed
            one = dataclasses.replace(plan, nodes=1, rate_bps=None, latency_ms=0.0, slow_node=None)
            row["node_collectives"] = probe_launches(one, where / "node", int(params))
        say(f"setting {name}: {row}")
    torch.set_num_threads(THREADS)  # torch's AdamW on one thread over the model's fp32 elements: elements per second
    param = torch.nn.Parameter(torch.randn(int(params)))
    param.grad, optimizer = torch.randn(int(params)), torch.optim.AdamW([param], lr=1e-3)
    times = timeit.repeat(optimizer.step, number=1, repeat=30)
    return {**found, "adamw_elements_per_s": params / statistics.median(times)}


def probes_for(out: Path, wanted: dict[str, ClusterPlan], params: float, probe_now: bool, argv: list[str] | None,
               compute: bool = True, virtual: bool = False) -> dict:  # fmt: skip
    """The probes of the `wanted` plans (setting -> plan), measured now into the cache or read from it; keyed by the
    plan's description, as a setting's name can name other plans in other tables (speed --rate-nodes)."""
    path = out / PROBES
    cached = json.loads(path.read_text()) if path.exists() else {"settings": {}}
    cached["settings"] = {row["plan"]: row for row in cached["settings"].values()}  # a cache keyed by setting names
    if probe_now:
        fresh = probe(wanted, params, out, compute, virtual)
        meta = common.meta("cost-model-check", argv)
        merged = {key: {**cached.get(key, {}), **fresh[key]} for key in ("settings", "compute_per_update_s_at_cores")}
        cached = {**cached, "meta": meta, **fresh, **merged}  # what was not probed now: the cache's
        path.write_text(json.dumps(cached, indent=1))
    missing = [f"setting {s} ({plan.describe()})" for s, plan in wanted.items()
               if plan.describe() not in cached["settings"]]  # fmt: skip
    if virtual and "virtual_overhead_s" not in cached:
        missing.append("the host work beside virtual compute's waits")
    if missing or "adamw_elements_per_s" not in cached:
        raise UserError(f"{path} has no probe of {', '.join(missing) or 'the optimizer'}: run with --probe (root, "
                        "a quiet machine)")  # fmt: skip
    for s, plan in wanted.items():
        if "ring_reduce_scatter_s" not in cached["settings"][plan.describe()]["collectives"]:
            raise UserError(f"{path}: setting {s}'s probe has no times of torchacco's rings: run with --probe")
    return cached


# the model's inputs per setting and label ----------------------------------------------------------------------


def trainer_config(args: list[str]):
    """The trainer's resolved config for a speed run: the recipe, then `args` (the label's, the setting's)."""
    full = [*recipe(110, 1.5e-3, 0), *args]
    full[full.index("--config") + 1] = str(ROOT / full[full.index("--config") + 1])  # named from the repository root
    return load_config(full)


def cores_per_rank(plan: ClusterPlan, cores: int) -> list[float]:
    """Each node's cores per rank: at most one thread's, its node's quota and the machine's cores shared."""
    fair = cores / plan.world_size
    return [min(THREADS, fair, (plan.cores(i) or math.inf) / plan.ranks_per_node) for i in range(plan.nodes)]


def seconds_per_token_at(cores: float, inputs: dict) -> float:
    """A rank's compute per token at its cores: probed at that CPU quota where it was, else one core's over cores."""
    probed = inputs.get("seconds_per_token_at_cores", {}).get(f"{cores:g}")
    return probed if probed is not None else inputs["seconds_per_token"] / cores


def link(plan: ClusterPlan, probed: dict) -> dict:
    """Hardware's link fields: the shaped link between nodes, and the in-node all-gather's rate where probed."""
    inside, g = probed.get("node_collectives"), plan.ranks_per_node
    intra = (g - 1) / g * 8 * inside["bytes"] / inside["all_gather_s"] if inside else None
    return {"nodes": plan.nodes, "ranks_per_node": g, "bandwidth_bps": plan.rate_bps,
            "latency_s": plan.latency_ms / 1000, "intra_bps": intra}  # fmt: skip


def collective_factors(links: dict, collectives: dict) -> dict:
    """Each probed collective's seconds over the model's ring ideal, for gloo's own ("gloo": DDP, FSDP) and torchacco's
    rings ("rings": the sharded job); 1 where the ideal is zero (an unshaped link)."""
    ideal = cm.collective_s(collectives["bytes"], cm.Hardware(flops=1.0, **links))
    if ideal <= 0:
        return dict.fromkeys(("gloo", "rings"), {"rs_factor": 1.0, "ag_factor": 1.0, "ar_factor": 1.0})
    ar = collectives["all_reduce_s"] / (2 * ideal)
    factors = lambda rs, ag: {"rs_factor": collectives[rs] / ideal, "ag_factor": collectives[ag] / ideal,
                              "ar_factor": ar}  # fmt: skip
    return {"gloo": factors("reduce_scatter_s", "all_gather_s"),
            "rings": factors("ring_reduce_scatter_s", "ring_all_gather_s")}  # fmt: skip


def hardware(plan: ClusterPlan, inputs: dict, links: dict, factors: dict, tokens_per_micro_batch: float):
    """The cluster as the cost model sees it: links, probed factors, each rank's compute at its cores."""
    cores = cores_per_rank(plan, inputs["cores"])
    per_token = [seconds_per_token_at(c, inputs) for c in cores]
    compute, slow = min(per_token) * tokens_per_micro_batch, max(per_token) / min(per_token)
    opt_rate = inputs["adamw_elements_per_s"] * min(cores)  # synchronous ranks wait for the slowest
    return cm.Hardware(**links, **factors, **MEASURED, compute_s=compute, slow_factor=slow, opt_rate=opt_rate)


def virtual_hardware(plan: ClusterPlan, calibration: dict, links: dict, factors: dict, inputs: dict) -> cm.Hardware:
    """The cluster under virtual compute: the run's calibrated waits, whole on every rank (a wait holds no CPU), plus
    the probed host work, which queues for the cores where ranks outnumber them (they leave their waits together)."""
    host = inputs.get("virtual_overhead_s", 0.0) * max(1.0, plan.world_size / inputs["cores"])
    compute = calibration["forward_s"] + calibration["backward_s"] + host
    slow, opt_rate = plan.slow_factor if plan.slow_node is not None else 1.0, 1 / calibration["optimizer_s_per_param"]
    return cm.Hardware(**links, **factors, **MEASURED, compute_s=compute, slow_factor=slow, opt_rate=opt_rate)


def shards_across_nodes(cfg, plan: ClusterPlan) -> None:
    """NotModelled for a strategy the cost model shards inside a node (HSDP) run over another shard group."""
    from torchacco.parallel.hsdp import shard_degree

    cls = cm.variants()[cfg.parallelism.data_parallel][0]
    if cls.traits.shards_within_node:
        degree = shard_degree(cfg.options(cls.traits.options), plan.world_size, plan.ranks_per_node, 1, 1)
        if degree != plan.ranks_per_node:
            raise NotModelled(f"{cls.name} sharded over {degree} ranks, a node holding {plan.ranks_per_node}: the "
                              "cost model shards it inside a node")  # fmt: skip


def workload(cfg, world: int, params: float) -> cm.Workload:
    t = cfg.training
    per_rank = t.global_batch_size / (t.local_batch_size * world)
    if per_rank < 1 or per_rank != int(per_rank):
        raise NotModelled(f"{t.global_batch_size} sequences per update do not split into whole micro-batches "
                          f"of {t.local_batch_size} over {world} ranks")  # fmt: skip
    # flops_per_token is unused (Hardware.compute_s is measured); the CPU trains and communicates in fp32
    return cm.Workload(params=params, flops_per_token=1.0, tokens_per_micro_batch=t.local_batch_size * t.seq_len,
                       micro_batches=int(per_rank), comm_bytes=4.0,
                       **cm.ddp_buckets(cfg.parallelism.bucket_cap_mb))  # fmt: skip


def diloco_settings(cfg) -> dict | None:
    """predict_diloco's settings of a run (and its replicas and mixed-replica switch); None: no outer step."""
    if cfg.parallelism.replicas == 1:
        return None
    d = cfg.diloco
    return {"inner": cfg.parallelism.data_parallel, "replicas": cfg.parallelism.replicas,
            "sync_every": d.sync_every, "fragments": d.fragments, "overlap_steps": d.overlap_steps,
            "outer_dtype": d.outer_dtype, "topk": d.topk, "balance_replicas": d.balance_replicas}  # fmt: skip


def traits(cfg):
    """The traits of the strategy that trains (inside each replica, for DiLoCo)."""
    return cm.variants()[cfg.parallelism.data_parallel][0].traits


def model_label(label: str, cfg) -> str:
    """The cost model's variant a speed label runs: the label, else its strategy (balanced where its batches are)."""
    if label in cm.variants():
        return label
    strategy = cfg.parallelism.data_parallel
    balanced = f"{strategy}_balanced" if cfg.parallelism.balance_batches else strategy
    if balanced not in cm.variants():
        raise NotModelled("not one of the cost model's variants (cost_model.variants())")
    return balanced


def predict_label(label: str, cfg, work: cm.Workload, hw: cm.Hardware) -> dict:
    """The cost model's prediction for a speed label's run (raises NotModelled with the reason)."""
    d = diloco_settings(cfg)
    if d is None:
        return cm.predict(work, hw, model_label(label, cfg))
    if d["balance_replicas"]:
        raise NotModelled("mixed replicas: predict_diloco has every replica run all H inner updates")
    if d["replicas"] != hw.nodes:
        raise NotModelled(f"{d['replicas']} replicas on {hw.nodes} nodes: predict_diloco has one per node")
    return predict_diloco(cfg, d, work, hw)


def predict_diloco(cfg, d: dict, work: cm.Workload, hw: cm.Hardware) -> dict:
    """predict_diloco for a run's outer settings `d` (diloco_settings), each fragment its share of work.params."""
    m = cfg.model
    sizes = cm.model_fragment_params(m.name, m.flavor, d["fragments"], m.vocab_size or cfg.tokenizer.vocab_size)
    sizes = [size * work.params / sum(sizes) for size in sizes]  # the fragments' shares of the probed parameters
    return cm.predict_diloco(work, hw, d["inner"], d["sync_every"], d["fragments"], d["overlap_steps"],
                             d["outer_dtype"], sizes, d["topk"])  # fmt: skip


def cpu_budget_s(label: str, cfg, plan: ClusterPlan, inputs: dict, work: cm.Workload) -> float:
    """A rank's floor on its share of a core: its compute plus, per job, ZeRO-1's CPU beyond compute (0: not probed)."""
    overhead = inputs.get("cpu_overhead_s")
    if overhead is None:
        return 0.0
    t = traits(cfg)
    cores = [c for c in cores_per_rank(plan, inputs["cores"]) for _ in range(plan.ranks_per_node)]
    counts = [work.micro_batches] * len(cores)
    if diloco_settings(cfg) is None and cm.variants()[model_label(label, cfg)][1] == "balanced":
        minimum = 1 if t.communication == "all_reduce_in_backward" else 0
        counts = split_by_speed(sum(counts), [seconds_per_token_at(c, inputs) for c in cores], minimum)
    jobs = t.periods_per_update if t.overlapped else 1
    per_micro_batch = work.tokens_per_micro_batch * inputs["seconds_per_token"]
    return max((n * per_micro_batch + jobs * overhead) / c for n, c in zip(counts, cores))


# the check ------------------------------------------------------------------------------------------------------


def check_setting(strategies: dict, plan: ClusterPlan, extra: list[str], probed: dict, inputs: dict,
                  virtual: bool = False) -> dict:  # fmt: skip
    """Every label of one setting of a speed table: predicted against measured seconds per recipe update's tokens,
    or why the model cannot predict it (`virtual`: each row ran virtual compute with its calibration)."""
    links = link(plan, probed)
    factors = collective_factors(links, probed["collectives"])
    rows, skipped = {}, {}
    for label, measured in strategies.items():
        try:
            if label not in STRATEGIES:
                raise NotModelled("its trainer arguments are not among the speed benchmark's strategies")
            cfg = trainer_config([*STRATEGIES[label], *extra])  # the setting's arguments last, as speed's
            t = traits(cfg)
            shards_across_nodes(cfg, plan)
            work = workload(cfg, plan.world_size, inputs["params"])
            implementation = factors["rings" if t.communication == "sharded_job" else "gloo"]
            if virtual and "calibration" not in measured:
                raise NotModelled("the table lacks its virtual compute's calibration (measured before speed kept it)")
            hw = (virtual_hardware(plan, measured["calibration"], links, implementation, inputs) if virtual
                  else hardware(plan, inputs, links, implementation, work.tokens_per_micro_batch))  # fmt: skip
            prediction = predict_label(label, cfg, work, hw)
            budget = 0.0 if virtual else cpu_budget_s(label, cfg, plan, inputs, work)
        except NotModelled as e:
            skipped[label] = str(e)
            continue
        step = max(budget, prediction["step_time_s"])  # CPU-bound: the compute share grows, the exposed time stays
        per_recipe = TOKENS_PER_UPDATE / prediction["tokens_per_update"]  # a grown batch's update holds more
        predicted, exposed = step * per_recipe, prediction["exposed_comm_s"] * per_recipe
        error = cm.relative_error(predicted, measured["mean"])
        rows[label] = {"predicted_s": predicted, "measured_s": measured["mean"], "error": error,
                             "within": abs(error) <= TOLERANCE, "predicted_compute_s": predicted - exposed,
                             "predicted_exposed_s": exposed, "cpu_budget_s": budget}  # fmt: skip
    errors = [abs(r["error"]) for r in rows.values()]
    return {"cores_per_rank": cores_per_rank(plan, inputs["cores"]), "factors": factors,
            "intra_bps": links["intra_bps"], "rows": rows, "skipped": skipped,
            "mean_abs_error": statistics.fmean(errors) if errors else math.nan,
            "within": sum(r["within"] for r in rows.values()), "checked": len(rows)}  # fmt: skip


def table_plans(out: Path, tables: dict[str, dict]) -> dict[str, dict]:
    """Each table's settings as speed planned them: its link rates, nodes per rate and link inside a node."""
    rates = ",".join(s[1:] for t in tables.values() for s in t["settings"] if s.startswith("r"))  # --rates'
    found = {}
    for name, table in tables.items():
        meta = table.get("meta", {})
        settings = plans(out, rates=meta.get("rates", rates), rate_nodes=meta.get("rate_nodes", 2))
        inside = parse_rate(meta.get("node_rate", "unshaped"))
        found[name] = {s: (dataclasses.replace(plan, node_rate_bps=inside), extra) for s, (plan, extra) in
                       settings.items()}  # fmt: skip
    return found


def check(tables: dict[str, dict], plans_of: dict[str, dict], probes: dict, inputs: dict) -> dict:
    """Every table's settings checked against the probes of its plans (`plans_of`: table_plans)."""
    result = {}
    for name, table in tables.items():
        meta = table.get("meta", {})
        found = re.match(r"(\d+)-core", meta.get("machine", ""))  # the table's machine's cores
        measured_on = {**inputs, "cores": int(found.group(1)) if found else os.cpu_count()}
        virtual, settings = meta.get("virtual_compute") == "on", plans_of[name]
        checked = result[name] = {}
        for setting, data in table["settings"].items():
            if setting not in settings:
                checked[setting] = {"plan": data["plan"], "not_checked": "the speed benchmark has no such setting"}
                continue
            plan, extra = settings[setting]
            if data["plan"] != plan.describe():
                checked[setting] = {"plan": data["plan"], "not_checked": f"measured on another plan than the probes' "
                                    f"({plan.describe()}): check it with probes of its own plan"}  # fmt: skip
                continue
            extra = [*extra, *meta.get("train_args", "").split()]  # speed --train-args, last
            s = check_setting(data["strategies"], plan, extra, probes[plan.describe()], measured_on, virtual)
            checked[setting] = {"plan": data["plan"], "virtual": virtual, **s}
    return result


# the report -----------------------------------------------------------------------------------------------------


def at_cores(inputs: dict) -> str:
    """The compute probed under CPU quotas, as the report names it."""
    probed = sorted((inputs.get("seconds_per_token_at_cores") or {}).items(), key=lambda kv: float(kv[0]))
    rows = [f"{s * 1e6:.1f} µs at {cores} cores ({s * float(cores) / inputs['seconds_per_token']:.2f}× the scaled "
            "time)" for cores, s in probed]  # fmt: skip
    return f", except where probed under that quota: {', '.join(rows)}" if rows else ""


def markdown(result: dict, meta: dict) -> str:
    inputs = meta["inputs"]
    budget = (f"; a rank's CPU budget: its compute plus {inputs['cpu_overhead_s'] * 1e3:.1f} ms of CPU per job "
              "(ZeRO-1's CPU per update beyond its compute, probed), over its share of a core, bounds its time per "
              "update") if "cpu_overhead_s" in inputs else ""  # fmt: skip
    virtual = (f"; under virtual compute, each row's calibrated waits plus {inputs['virtual_overhead_s'] * 1e3:.2f} "
               "ms of host work per micro-batch (probed: ZeRO-1 under virtual compute on 2 unshaped nodes, its time "
               "per update less its waits), times ranks / cores where the ranks outnumber the cores"
               ) if "virtual_overhead_s" in inputs else ""  # fmt: skip
    lines = ["# The cost model's time per update against the emulated cluster", "",
             f"{meta['date']}, {meta['machine']}. Command: `{meta['command']}`. Probes: {meta['probes']}.", "",
             f"Inputs, none of them the times checked: compute {inputs['seconds_per_token'] * 1e6:.1f} µs per token on "
             f"one core ({'probed with the links' if inputs.get('compute_probed') else 'the calibration'}: ZeRO-1, "
             f"{inputs['compute_per_update_s']:.4f} s per update on 2 unshaped nodes), scaled by each rank's "
             f"cores{at_cores(inputs)}{budget}; AdamW {inputs['adamw_elements_per_s']:.3g} elements/s on one core; "
             f"{inputs['params']:,.0f} parameters in fp32; each setting's gloo collectives probed alone"
             f"{virtual}. Bar: |error| ≤ {TOLERANCE:.0%}."]  # fmt: skip
    misses, total = [], 0
    for name, settings in result.items():
        for setting, s in settings.items():
            lines += ["", f"## {name}, setting {setting}: {s['plan']}", ""]
            if "not_checked" in s:
                lines.append(f"Not checked: {s['not_checked']}.")
                continue
            gloo, rings = s["factors"]["gloo"], s["factors"]["rings"]
            cores = ("Virtual compute: each row's compute and AdamW are its run's calibrated waits, whole on every "
                     "rank" if s.get("virtual") else f"Cores per rank by node: "
                     f"{', '.join(f'{c:g}' for c in s['cores_per_rank'])}")  # fmt: skip
            lines += [f"{cores}. Probed times "
                      f"over the ring ideal: gloo's reduce-scatter {gloo['rs_factor']:.2f}, all-gather "
                      f"{gloo['ag_factor']:.2f}, all-reduce {gloo['ar_factor']:.2f} (DDP, FSDP, HSDP); torchacco's "
                      f"rings {rings['rs_factor']:.2f} and {rings['ag_factor']:.2f} (the sharded job)."
                      + (f" In-node all-gather: {cm.format_rate(s['intra_bps'])}." if s["intra_bps"] else ""), "",
                      "| strategy | predicted (s) | measured (s) | error | ≤ 15% | model: compute + exposed (s) |",
                      "|---|---:|---:|---:|:---:|---:|"]  # fmt: skip
            for label, r in s["rows"].items():
                lines.append(f"| {label} | {r['predicted_s']:.4f} | {r['measured_s']:.4f} | {r['error']:+.1%} | "
                             f"{'yes' if r['within'] else '**no**'} | {r['predicted_compute_s']:.4f} + "
                             f"{r['predicted_exposed_s']:.4f} |")  # fmt: skip
            lines += ["", f"Mean |error|: {s['mean_abs_error']:.1%}; within {TOLERANCE:.0%}: {s['within']}/"
                          f"{s['checked']}."]  # fmt: skip
            lines += [f"Not predicted: {label}: {why}." for label, why in s["skipped"].items()]
            misses += [
                f"- {name} {setting}: {label}, {r['error']:+.0%}" for label, r in s["rows"].items() if not r["within"]
            ]
            total += s["checked"]
    lines += ["", "## Verdict", "", f"Every one of the {total} predictions is within {TOLERANCE:.0%}." if not misses
              else f"**{len(misses)} of {total} predictions miss the {TOLERANCE:.0%} bar.**", *[""] * bool(misses),
              *misses]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = common.parser("cost-model-check", __doc__, "cost_model_check")
    parser.add_argument("--speed", required=True, help="comma-separated speed table names (benchmarks speed --name)")
    parser.add_argument("--probe", action="store_true", help=f"measure the collectives and AdamW anew into {PROBES}")
    args = parser.parse_args(argv)
    out, tables = ROOT / args.out, {}
    for name in (n for n in args.speed.split(",") if n):
        try:
            tables[name] = json.loads((out / f"{name}.json").read_text())
        except (OSError, ValueError) as e:
            parser.error(f"--speed {name}: cannot read {out / name}.json ({e})")
        if not isinstance(tables[name], dict) or not isinstance(tables[name].get("settings"), dict):
            parser.error(f"--speed {name}: {out / name}.json is not a speed table (no settings)")
    if not tables:
        parser.error("--speed names no table")
    try:
        calibration = json.loads((out / "time_to_loss.json").read_text())["calibration"]
        inputs = compute_inputs(calibration["compute_per_update_s"], calibration["params"])
        plans_of = table_plans(out, tables)
    except (OSError, KeyError, ValueError) as e:
        parser.error(f"cannot read the calibration in {out / 'time_to_loss.json'} ({e})")
    by_plan = {plans_of[name][s][0].describe(): (f"{s} of {name}", plans_of[name][s][0]) for name, t in tables.items()
               for s in t["settings"] if s in plans_of[name]}  # fmt: skip
    wanted = dict(by_plan.values())  # one probe per plan
    virtual = [t.get("meta", {}).get("virtual_compute") == "on" for t in tables.values()]
    try:
        cached = probes_for(
            out, wanted, inputs["params"], args.probe, argv, compute=not all(virtual), virtual=any(virtual)
        )
    except UserError as e:
        parser.error(str(e))
    inputs |= {key: cached[key] for key in ("adamw_elements_per_s", "virtual_overhead_s") if key in cached}
    if "compute_per_update_s" in cached:  # the calibration measured again beside the probes: today's machine
        inputs = {**inputs, **compute_inputs(cached["compute_per_update_s"], inputs["params"]), "compute_probed": True}
        if "cpu_per_update_s" in cached:  # ZeRO-1's CPU beyond its compute, per update and rank
            inputs["cpu_overhead_s"] = max(0.0, cached["cpu_per_update_s"] - cached["compute_per_update_s"])
        quotas = cached.get("compute_per_update_s_at_cores", {}).items()
        inputs["seconds_per_token_at_cores"] = {c: compute_inputs(s, inputs["params"])["seconds_per_token"]
                                                for c, s in quotas}  # fmt: skip
    result = check(tables, plans_of, cached["settings"], inputs)
    probed = cached.get("meta", {})
    probes = f"{PROBES}, {probed.get('date', '?')}, {probed.get('machine', '?')}"
    meta = common.meta("cost-model-check", argv, probes=probes, inputs=inputs)
    bars = {name: [(f"{setting} {label}", 100 * r["error"], 0) for setting, x in settings.items()
                   for label, r in x.get("rows", {}).items()] for name, settings in result.items()}  # fmt: skip
    common.write_report(out, args.name, {"meta": meta, "tables": result}, markdown(result, meta),
                        lambda path: common.bars(path, bars, "time per update: predicted vs measured (%)", 0.0,
                                                 100 * TOLERANCE))  # fmt: skip
    return 0
