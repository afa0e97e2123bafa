"""The cost model's time per update against the emulated cluster's measured speed, per setting and strategy.

    sudo .venv/bin/python -m benchmarks cost-model-check --speed speed,speed_streaming,speed_ranks_per_node --probe
    .venv/bin/python -m benchmarks cost-model-check --speed speed,speed_streaming,speed_ranks_per_node

The bar: `predict`'s time-per-update error within 15% on every strategy in every setting. The model is
not fitted to the times it is checked against; its inputs are
  - compute: the calibration in `bench_results/time_to_loss.json` (time_to_target.calibrate's): ZeRO-1's data,
    forward and backward per update on 2 unshaped one-rank nodes (2 micro-batches of 4 × 128 tokens per rank), as
    seconds per token on one core, scaled by the cores a rank gets in each setting (its node's CPU quota, the
    machine's cores shared by all ranks); `--probe` measures it again beside the links (the same ZeRO-1 run, 30
    updates), so that compute and links come from the machine as it is that day, and the report uses that probe when
    it has one; it also runs that ZeRO-1 probe under each CPU quota a one-rank node of the settings gets, and a rank
    at such a quota computes at the probed speed; `--compute same-session` scales it, per setting, to the speed that
    setting's ZeRO-1 run computed at (the machine's speed drifts between the probe and the runs: a diagnostic that
    separates that drift from the model's error);
  - a rank's CPU budget: ZeRO-1's CPU seconds per update beyond its compute (probed), per job of an update, plus
    its micro-batches' compute, over its share of a core, bounds its time per update (the CPU emulation's bound);
  - the collectives: each gloo collective's probed time over the model's ring ideal on a buffer of the model's
    size, per setting (`benchmarks/workers/collective_probe.py`, timed until every rank is done with it, as the
    next collective of a run waits for that; the mean of 15 calls in each of 3 launches) → f_rs, f_ag, f_ar; with
    several ranks per node,
    the all-gather among one node's ranks → the in-node rate (the model's intra_bps; unprobed, in-node traffic
    would be free, though over loopback on a CPU it takes the cores' time);
  - the optimizer: torch's AdamW on one core, elements per second → opt_rate;
  - the settings (`benchmarks.speed.plans`) and each label's trainer arguments (`benchmarks.speed.STRATEGIES`).
The probes need root and a quiet machine: `--probe` measures them into bench_results/cost_model_probes.json, and
without it the report is rebuilt from that file. The measured time is the speed table's mean seconds per recipe
update's tokens (16 × 128). Writes bench_results/<--name>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path

from benchmarks.cluster import ClusterPlan
from benchmarks.cost_model_probes import (
    PROBES,
    ROOT,
    THREADS,
    calibration,
    compute_inputs,
    probes_for,
    trainer_config,
)
from benchmarks.names import ZERO1
from benchmarks.speed import STRATEGIES, TOKENS_PER_UPDATE, compute_s, plans, seconds_per_update, warmup_of
from benchmarks.sweeps.common import panels, save_figure, write_report
from benchmarks.token_efficiency import machine, records
from torchacco import cost_model as cm
from torchacco.errors import UserError

TOLERANCE = 0.15  # the bar on the time per update's relative error


class NotModelled(Exception):
    """A speed label the cost model has no formula for; the message says why."""


# inputs ------------------------------------------------------------------------------------------


def cpu_budget_s(label: str, cfg, plan: ClusterPlan, inputs: dict, work: cm.Workload) -> float:
    """The emulation's CPU budget: a rank on a share of a core (a node's quota, or the machine's cores shared)
    cannot update faster than its CPU work per update over that share. The work is its micro-batches' compute
    plus, per job of the update, what ZeRO-1 spends beyond compute (probed); on a GPU the host does not compute,
    so this bound is the CPU emulation's, not the cost model's. 0 without the probe."""
    overhead = inputs.get("cpu_overhead_s")
    if overhead is None:
        return 0.0
    from torchacco.parallel.balance import split_by_speed

    cls = strategy_class(cfg)
    cores = [c for c in cores_per_rank(plan, inputs["cores"]) for _ in range(plan.ranks_per_node)]
    k = work.micro_batches
    counts = [k] * len(cores)
    if diloco_settings(cfg) is None and cm.variants()[model_label(label, cfg)][1] == "balanced":
        minimum = 1 if cls.communication == "all_reduce_in_backward" else 0
        counts = split_by_speed(k * len(cores), [seconds_per_token_at(c, inputs) for c in cores], minimum)
    jobs = cls.periods_per_update if cls.overlapped else 1
    per_micro_batch = work.tokens_per_micro_batch * inputs["seconds_per_token"]
    return max((n * per_micro_batch + jobs * overhead) / c for n, c in zip(counts, cores))


def machine_cores(meta: dict) -> int:
    """The cores of the machine a speed table was measured on (its meta says 'N-core ...'), else this one's."""
    found = re.match(r"(\d+)-core", meta.get("machine", ""))
    return int(found.group(1)) if found else os.cpu_count()


# the model's inputs per setting and label --------------------------------------------------------


def cores_per_rank(plan: ClusterPlan, cores: int) -> list[float]:
    """Each node's cores per rank: at most one (one compute thread), the node's CPU quota shared by its ranks, and
    the machine's cores shared by all ranks."""
    fair = cores / plan.world_size
    return [min(THREADS, fair, (plan.cores(i) or math.inf) / plan.ranks_per_node) for i in range(plan.nodes)]


def link(plan: ClusterPlan, probed: dict) -> dict:
    """The cost model's Hardware fields for the plan's links: the shaped link between nodes, and the rate at which
    one node's ranks all-gather among themselves where probed (else None: free in the model)."""
    inside = probed.get("node_collectives")
    g = plan.ranks_per_node
    intra = (g - 1) / g * 8 * inside["bytes"] / inside["all_gather_s"] if inside else None
    return {"nodes": plan.nodes, "ranks_per_node": g, "bandwidth_bps": plan.rate_bps,
            "latency_s": plan.latency_ms / 1000, "intra_bps": intra}  # fmt: skip


def collective_factors(links: dict, collectives: dict) -> dict:
    """Each probed collective's seconds over the model's ring ideal for its bytes on these links, for the two
    implementations the strategies run on gloo: "gloo", its own (torch DDP's all-reduce, FSDP2's gathers and
    reduce-scatters), and "rings", torchacco's (the sharded job of ZeRO-1, ACCO, DPU, WP; gloo's all-reduce).
    1 where the ideal is zero: an unshaped link, which the model counts as free."""
    ideal = cm.collective_s(collectives["bytes"], cm.Hardware(flops=1.0, **links))
    if ideal <= 0:
        ones = {"rs_factor": 1.0, "ag_factor": 1.0, "ar_factor": 1.0}
        return {"gloo": ones, "rings": ones}
    gloo = {
        "rs_factor": collectives["reduce_scatter_s"] / ideal,
        "ag_factor": collectives["all_gather_s"] / ideal,
        "ar_factor": collectives["all_reduce_s"] / (2 * ideal),
    }
    rings = {"rs_factor": collectives["ring_reduce_scatter_s"] / ideal,
             "ag_factor": collectives["ring_all_gather_s"] / ideal, "ar_factor": gloo["ar_factor"]}  # fmt: skip
    return {"gloo": gloo, "rings": rings}


def seconds_per_token_at(cores: float, inputs: dict) -> float:
    """A rank's compute per token at its cores: probed at that CPU quota where it was, else one core's over cores."""
    probed = inputs.get("seconds_per_token_at_cores", {}).get(f"{cores:g}")
    return probed if probed is not None else inputs["seconds_per_token"] / cores


def hardware(plan: ClusterPlan, inputs: dict, links: dict, factors: dict, tokens_per_micro_batch: float):
    """The cluster as the cost model sees it: links, probed factors, each rank's compute at its cores."""
    cores = cores_per_rank(plan, inputs["cores"])
    per_token = [seconds_per_token_at(c, inputs) for c in cores]
    fastest, slowest = min(per_token), max(per_token)
    slow = min(cores)
    return cm.Hardware(
        **links,
        **factors,
        flops=1.0,  # unused: compute_s is measured
        compute_s=fastest * tokens_per_micro_batch,
        slow_factor=slowest / fastest,
        opt_rate=inputs["adamw_elements_per_s"] * slow,  # synchronous ranks wait for the slowest one's step
        streams=False,  # the emulation computes on CPU
    )


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
            "outer_dtype": d.outer_dtype, "balance_replicas": d.balance_replicas}  # fmt: skip


def model_label(label: str, cfg) -> str:
    """The cost model's variant a speed label runs: the label itself, else its strategy (balanced where its batches
    are) with other settings, which the Workload reads (DDP's buckets)."""
    if label in cm.variants():
        return label
    strategy = cfg.parallelism.data_parallel
    balanced = f"{strategy}_balanced" if cfg.parallelism.balance_batches else strategy
    if balanced not in cm.variants():
        raise NotModelled("not one of the cost model's variants (cost_model.variants())")
    return balanced


def predict_label(label: str, cfg, work: cm.Workload, hw: cm.Hardware) -> dict:
    """The cost model's prediction for a speed label's run (raises NotModelled with the reason)."""
    diloco = diloco_settings(cfg)
    if diloco is None:
        return cm.predict(work, hw, model_label(label, cfg))
    if diloco["balance_replicas"]:
        raise NotModelled("mixed replicas: predict_diloco has every replica run all H inner updates")
    if diloco["replicas"] != hw.nodes:
        raise NotModelled(f"{diloco['replicas']} replicas on {hw.nodes} nodes: predict_diloco has one per node")
    m = cfg.model
    sizes = cm.model_fragment_params(m.name, m.flavor, diloco["fragments"], m.vocab_size or cfg.tokenizer.vocab_size)
    sizes = [size * work.params / sum(sizes) for size in sizes]  # the fragments' shares of the probed parameters
    return cm.predict_diloco(work, hw, diloco["inner"], diloco["sync_every"], diloco["fragments"],
                             diloco["overlap_steps"], diloco["outer_dtype"], sizes)  # fmt: skip


def strategy_class(cfg) -> type:
    """The class of the strategy that trains (inside each replica, for DiLoCo)."""
    return cm.variants()[cfg.parallelism.data_parallel][0]


def implementation(cfg) -> str:
    """Whose collectives the strategy runs on gloo (a key of `collective_factors`)."""
    return "rings" if strategy_class(cfg).communication == "sharded_job" else "gloo"


def communicates_in_micro_batches(cfg, world: int) -> bool:
    """Whether the strategy communicates inside its micro-batches (torch DDP waits for its buckets at the end of
    backward, FSDP gathers per micro-batch), so the trainer's time before the sync holds communication."""
    ranks = world // cfg.parallelism.replicas  # a DiLoCo replica's data-parallel group
    return strategy_class(cfg).communication in ("all_reduce_in_backward", "per_micro_batch") and ranks > 1


# the check ---------------------------------------------------------------------------------------


def verdict(prediction: dict, measured_s: float, recipe_tokens: float) -> dict:
    """Predicted against measured seconds per recipe update's tokens (a grown batch's update holds more)."""
    per_recipe = recipe_tokens / prediction["tokens_per_update"]
    predicted = prediction["step_time_s"] * per_recipe
    error = cm.relative_error(predicted, measured_s)
    exposed = prediction["exposed_comm_s"] * per_recipe
    row = {"predicted_s": predicted, "measured_s": measured_s, "error": error, "within": abs(error) <= TOLERANCE,
           "predicted_compute_s": predicted - exposed, "predicted_exposed_s": exposed}  # fmt: skip
    if "outer_exposed_s" in prediction:  # DiLoCo: the outer step's wait, apart from the inner update's sync
        row["predicted_outer_wait_s"] = prediction["outer_exposed_s"] * per_recipe
    return row


def error_summary(rows: dict[str, dict]) -> dict:
    errors = [abs(r["error"]) for r in rows.values()]
    return {"mean_abs_error": statistics.fmean(errors) if errors else math.nan,
            "within": sum(r["within"] for r in rows.values()), "checked": len(rows)}  # fmt: skip


def check_setting(strategies: dict, plan: ClusterPlan, extra: list[str], probed: dict, inputs: dict) -> dict:
    """Every label of one setting of a speed table: its verdict, or why the model cannot predict it."""
    links = link(plan, probed)
    factors = collective_factors(links, probed["collectives"])
    rows, skipped = {}, {}
    for label, measured in strategies.items():
        if label not in STRATEGIES:
            skipped[label] = "its trainer arguments are not in benchmarks.speed.STRATEGIES"
            continue
        cfg = trainer_config([*STRATEGIES[label], *extra])  # the setting's arguments last, as benchmarks.speed
        try:
            work = workload(cfg, plan.world_size, inputs["params"])
            hw = hardware(plan, inputs, links, factors[implementation(cfg)], work.tokens_per_micro_batch)
            prediction = predict_label(label, cfg, work, hw)
            budget = cpu_budget_s(label, cfg, plan, inputs, work)
            if budget > prediction["step_time_s"]:  # CPU-bound: the compute share grows, the exposed time stays
                prediction = {
                    **prediction,
                    "step_time_s": budget,
                    "tokens_per_s": prediction["tokens_per_update"] / budget,
                }
            rows[label] = verdict(prediction, measured["mean"], TOKENS_PER_UPDATE)
            rows[label]["cpu_budget_s"] = budget
            rows[label]["communicates_in_micro_batches"] = communicates_in_micro_batches(cfg, plan.world_size)
        except NotModelled as e:
            skipped[label] = str(e)
    return {"cores_per_rank": cores_per_rank(plan, inputs["cores"]), "factors": factors,
            "intra_bps": links["intra_bps"], "rows": rows, "skipped": skipped, **error_summary(rows)}  # fmt: skip


def kept_records(runs: Path, setting: str, label: str, row: dict) -> list[dict]:
    """Rank 0's records past warm-up from the speed runs that made `row`: a run counts when its records give the
    table's time for that repeat (later runs overwrite the folders). Empty when none is left."""
    warmup = warmup_of(label)
    kept = []
    for repeat, expected in enumerate(row.get("seconds_per_update", [])):
        logged = records(runs / f"{setting}_{label}_{repeat}")
        if len(logged) > warmup and math.isclose(seconds_per_update(logged, warmup), expected, rel_tol=1e-9):
            kept += logged[warmup:]
    return kept


def measured_compute(kept: list[dict]) -> float | None:
    """Rank 0's seconds per update before the sync (data, forward, backward); None without records."""
    if not kept or not all("share_sync" in r for r in kept):
        return None
    return statistics.fmean(compute_s(r) for r in kept)


def measured_outer_wait(kept: list[dict]) -> float | None:
    """DiLoCo: rank 0's wait for the outer steps' transfers (`outer_exposed_s`), per update; None without any."""
    if not any("outer_exposed_s" in r for r in kept):
        return None
    return sum(r.get("outer_exposed_s", 0.0) for r in kept) / len(kept)


def outer_wait_text(row: dict, rest: float) -> str:
    """DiLoCo: the time after the sync split into the outer step's wait and the inner update's sync, each against
    the model's."""
    wait = row.get("measured_outer_wait_s")
    if wait is None:
        return ""
    model_wait = row["predicted_outer_wait_s"]
    inner = row["predicted_exposed_s"] - model_wait
    return (f" (of which the outer step's wait {wait:.3f} s against the model's {model_wait:.3f} s, the inner "
            f"update's sync and step {rest - wait:.3f} s against {inner:.3f} s)")  # fmt: skip


def cause(label: str, row: dict) -> str:
    """Where a row's error lies, from the numbers: the compute before the sync, or the rest of the update."""
    head = f"{label}: predicted {row['predicted_s']:.3f} s, measured {row['measured_s']:.3f} s ({row['error']:+.0%})"
    model = f"the model's compute {row['predicted_compute_s']:.3f} s + exposed {row['predicted_exposed_s']:.3f} s"
    compute = row.get("measured_compute_s")
    if compute is None:
        return f"{head}; {model} (no matching run records, so no measured split)."
    rest = row["measured_s"] - compute
    split = f"{head}; {model}, measured {compute:.3f} s until the sync + {rest:.3f} s after"
    split += outer_wait_text(row, rest)
    if row["communicates_in_micro_batches"]:
        return (f"{split}. Its communication runs inside the micro-batches, so the time until the sync holds it "
                f"too, and is {compute - row['predicted_s']:+.3f} s from the model's whole update (its compute and "
                "collectives): the run's collectives or compute are slower than probed.")  # fmt: skip
    compute_gap, rest_gap = compute - row["predicted_compute_s"], rest - row["predicted_exposed_s"]
    if abs(compute_gap) >= abs(rest_gap):
        why = ("the ranks compute slower than the calibration at their cores: CPU contention (communication "
               "threads, tc's shaping, ranks beyond the cores, other work on the machine) or per-micro-batch "
               "overhead the model does not count"
               if compute_gap > 0 else "the ranks compute faster than the calibration at their cores")  # fmt: skip
        return f"{split}. Mostly compute ({compute_gap:+.3f} s): {why}."
    why = ("more communication or optimizer time is exposed than the model leaves: collectives slower beside "
           "compute than the probe's alone, or an overlap the run does not achieve"
           if rest_gap > 0 else "the model exposes more communication than the run")  # fmt: skip
    return f"{split}. Mostly after the compute ({rest_gap:+.3f} s): {why}."


def with_compute_scaled(inputs: dict, scale: float) -> dict:
    """The inputs with every rank's compute `scale` times the probed one (at every quota alike)."""
    at_cores = {cores: s * scale for cores, s in inputs.get("seconds_per_token_at_cores", {}).items()}
    return {**inputs, "seconds_per_token": inputs["seconds_per_token"] * scale, "seconds_per_token_at_cores": at_cores}


def same_session_scale(plan: ClusterPlan, inputs: dict, zero1_compute_s: float | None) -> float | None:
    """The setting's ZeRO-1 run's measured compute (rank 0's time until the sync, in the same session as the other
    labels) over the probe's for rank 0's cores: the machine's speed at the time of the runs. None without it."""
    if zero1_compute_s is None:
        return None
    tokens = TOKENS_PER_UPDATE / plan.world_size
    return zero1_compute_s / (seconds_per_token_at(cores_per_rank(plan, inputs["cores"])[0], inputs) * tokens)


def check(
    tables: dict[str, dict], settings: dict, probes: dict, inputs: dict, runs: Path, same_session: bool = False
) -> dict:
    """Every table's settings checked, with the measured compute where the runs' records are left; same_session:
    each setting's compute scaled to its ZeRO-1 run's (where the table has one with its records)."""
    result = {}
    for name, table in tables.items():
        measured_on = {**inputs, "cores": machine_cores(table.get("meta", {}))}
        checked = result[name] = {}
        for setting, data in table["settings"].items():
            if setting not in settings:
                checked[setting] = {"plan": data["plan"], "not_checked": "benchmarks.speed.plans has no such setting"}
                continue
            plan, extra = settings[setting]
            if data["plan"] != plan.describe():
                checked[setting] = {"plan": data["plan"], "not_checked": f"measured on another plan than the probes' "
                                    f"({plan.describe()}): check it with probes of its own plan"}  # fmt: skip
                continue
            s = check_setting(data["strategies"], plan, extra, probes[setting], measured_on)
            kept = {label: kept_records(runs, setting, label, data["strategies"][label]) for label in s["rows"]}
            measured = {label: measured_compute(records) for label, records in kept.items()}
            scale = same_session_scale(plan, measured_on, measured.get(ZERO1)) if same_session else None
            if scale is not None:
                scaled = with_compute_scaled(measured_on, scale)
                s = check_setting(data["strategies"], plan, extra, probes[setting], scaled)
            for label, row in s["rows"].items():
                row["measured_compute_s"] = measured[label]
                if "predicted_outer_wait_s" in row:
                    row["measured_outer_wait_s"] = measured_outer_wait(kept[label])
            checked[setting] = {"plan": data["plan"], "same_session": same_session, "compute_scale": scale, **s}
    return result


# the report --------------------------------------------------------------------------------------


def cpu_budget_text(inputs: dict) -> str:
    if "cpu_overhead_s" not in inputs:
        return ""
    return (
        f"; a rank's CPU budget: its compute plus {inputs['cpu_overhead_s'] * 1e3:.1f} ms of CPU per job (ZeRO-1's "
        "CPU per update beyond its compute, probed), over its share of a core, bounds its time per update"
    )


def at_cores(inputs: dict) -> str:
    """The compute probed under CPU quotas, as the report names it."""
    probed = inputs.get("seconds_per_token_at_cores") or {}
    rows = [f"{s * 1e6:.1f} µs at {cores} cores ({s * float(cores) / inputs['seconds_per_token']:.2f}× the scaled time)"
            for cores, s in sorted(probed.items(), key=lambda kv: float(kv[0]))]  # fmt: skip
    return f", except where probed under that quota: {', '.join(rows)}" if rows else ""


def markdown(result: dict, meta: dict) -> str:
    inputs = meta["inputs"]
    lines = [
        "# The cost model's time per update against the emulated cluster",
        "",
        f"{meta['date']}, {meta['machine']}. Command: `{meta['command']}`. Probes: {meta['probes']}.",
        "",
        f"Inputs, none of them the times checked: compute {inputs['seconds_per_token'] * 1e6:.1f} µs per token on "
        f"one core ({'probed with the links' if inputs.get('compute_probed') else 'the calibration'}: "
        f"ZeRO-1, {inputs['compute_per_update_s']:.4f} s per update on 2 unshaped nodes), scaled by each rank's "
        f"cores{at_cores(inputs)}{cpu_budget_text(inputs)}; AdamW {inputs['adamw_elements_per_s']:.3g} elements/s on "
        f"one core; {inputs['params']:,.0f} parameters in fp32; each setting's gloo collectives probed alone. "
        f"Bar: |error| ≤ {TOLERANCE:.0%}.",
    ]
    if any(s.get("compute_scale") is not None for settings in result.values() for s in settings.values()):
        lines += ["", "With `--compute same-session`, a setting's ZeRO-1 run's time until the sync is an input, so "
                      "its own row checks only the rest of its update."]  # fmt: skip
    misses, total = [], 0
    for name, settings in result.items():
        for setting, s in settings.items():
            lines += ["", f"## {name}, setting {setting}: {s['plan']}", ""]
            if "not_checked" in s:
                lines.append(f"Not checked: {s['not_checked']}.")
                continue
            gloo, rings = s["factors"]["gloo"], s["factors"]["rings"]
            cores = ", ".join(f"{c:g}" for c in s["cores_per_rank"])
            in_node = f" In-node all-gather: {cm.format_rate(s['intra_bps'])}." if s["intra_bps"] else ""
            if s.get("compute_scale") is not None:
                lines += [f"Compute: {s['compute_scale']:.3f}× the probe's, as this setting's ZeRO-1 run computed "
                          "in the same session (`--compute same-session`).", ""]  # fmt: skip
            elif s.get("same_session"):
                lines += ["Compute: the probe's (`--compute same-session` needs the table's ZeRO-1 run of this "
                          "setting with its records under `bench_results/runs/speed/`).", ""]  # fmt: skip
            lines += [
                f"Cores per rank by node: {cores}. Probed times over the ring ideal: gloo's reduce-scatter "
                f"{gloo['rs_factor']:.2f}, all-gather {gloo['ag_factor']:.2f}, all-reduce {gloo['ar_factor']:.2f} "
                f"(DDP, FSDP, HSDP); torchacco's rings {rings['rs_factor']:.2f} and {rings['ag_factor']:.2f} (the "
                f"sharded job).{in_node}",
                "",
                "| strategy | predicted (s) | measured (s) | error | ≤ 15% | model: compute + exposed (s) "
                "| measured until the sync (s) |",
                "|---|---:|---:|---:|:---:|---:|---:|",
            ]
            for label, r in s["rows"].items():
                compute = "—" if r["measured_compute_s"] is None else f"{r['measured_compute_s']:.4f}"
                lines.append(
                    f"| {label} | {r['predicted_s']:.4f} | {r['measured_s']:.4f} | {r['error']:+.1%} | "
                    f"{'yes' if r['within'] else '**no**'} | {r['predicted_compute_s']:.4f} + "
                    f"{r['predicted_exposed_s']:.4f} | {compute} |"
                )
            lines += ["", f"Mean |error|: {s['mean_abs_error']:.1%}; within {TOLERANCE:.0%}: {s['within']}/"
                          f"{s['checked']}."]  # fmt: skip
            lines += [f"Not predicted: {label}: {why}." for label, why in s["skipped"].items()]
            misses += [f"- {name} {setting}: {cause(label, r)}" for label, r in s["rows"].items() if not r["within"]]
            total += s["checked"]
    lines += ["", "## Verdict", ""]
    if not misses:
        lines.append(f"Every one of the {total} predictions is within {TOLERANCE:.0%}.")
    else:
        lines += [f"**{len(misses)} of {total} predictions miss the {TOLERANCE:.0%} bar.**", "", *misses]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    drawn = panels(len(result), height=4.5)
    if drawn is None:
        return
    fig, axes = drawn
    for ax, (name, settings) in zip(axes, result.items()):
        rows = [(f"{setting} {label}", r["error"]) for setting, s in settings.items() for label, r in
                s.get("rows", {}).items()]  # fmt: skip
        ax.barh([n for n, _ in rows], [100 * e for _, e in rows],
                color=["tab:blue" if abs(e) <= TOLERANCE else "tab:red" for _, e in rows])  # fmt: skip
        ax.axvline(0, color="grey", lw=0.5)
        for x in (-100 * TOLERANCE, 100 * TOLERANCE):  # the bar
            ax.axvline(x, color="grey", lw=0.7, ls=":")
        ax.invert_yaxis()
        ax.set(title=name, xlabel="time per update: predicted vs measured (%)")
    save_figure(fig, path)


# the command -------------------------------------------------------------------------------------


def read_tables(out: Path, names: list[str], parser) -> dict[str, dict]:
    tables = {}
    for name in names:
        try:
            tables[name] = json.loads((out / f"{name}.json").read_text())
        except (OSError, ValueError) as e:
            parser.error(f"--speed {name}: cannot read {out / name}.json ({e})")
        if not isinstance(tables[name], dict) or not isinstance(tables[name].get("settings"), dict):
            parser.error(f"--speed {name}: {out / name}.json is not a speed table (no settings); see benchmarks.speed")
    return tables


def command(argv: list[str] | None) -> str:
    return "python -m benchmarks cost-model-check " + " ".join(sys.argv[1:] if argv is None else argv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks cost-model-check", description=__doc__)
    parser.add_argument("--speed", required=True, help="comma-separated speed table names (benchmarks.speed --name)")
    parser.add_argument("--probe", action="store_true", help=f"measure the collectives and AdamW anew into {PROBES}")
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--name", default="cost_model_check")
    parser.add_argument(
        "--compute",
        choices=("probe", "same-session"),
        default="probe",
        help="probe: every rank computes at the probed speed; same-session: scaled, per setting, to the speed its "
        "ZeRO-1 run computed at in the same session as the other labels (the machine's speed drifts by the hour)",
    )
    args = parser.parse_args(argv)
    out = ROOT / args.out
    tables = read_tables(out, [n for n in args.speed.split(",") if n], parser)
    if not tables:
        parser.error("--speed names no table")
    try:
        inputs = calibration(out)
        settings = plans(out)
    except (OSError, KeyError, ValueError) as e:
        parser.error(f"cannot read the calibration in {out / 'time_to_loss.json'} ({e})")
    wanted = sorted({s for t in tables.values() for s in t["settings"] if s in settings})
    try:
        cached = probes_for(out, settings, wanted, inputs["params"], args.probe, command(argv))
    except UserError as e:
        parser.error(str(e))
    inputs["adamw_elements_per_s"] = cached["adamw_elements_per_s"]
    if "compute_per_update_s" in cached:  # the calibration measured again beside the probes: today's machine
        inputs = {**inputs, **compute_inputs(cached["compute_per_update_s"], inputs["params"]), "compute_probed": True}
        per_update = cached.get("compute_per_update_s_at_cores", {})
        if "cpu_per_update_s" in cached:  # ZeRO-1's CPU beyond its compute, per update and rank
            inputs["cpu_overhead_s"] = max(0.0, cached["cpu_per_update_s"] - cached["compute_per_update_s"])
        inputs["seconds_per_token_at_cores"] = {
            cores: compute_inputs(s, inputs["params"])["seconds_per_token"] for cores, s in per_update.items()
        }
    runs = out / "runs" / "speed"
    result = check(tables, settings, cached["settings"], inputs, runs, same_session=args.compute == "same-session")
    if args.compute == "same-session" and not any(s.get("compute_scale") for t in result.values() for s in t.values()):
        parser.error(f"--compute same-session: no setting has its ZeRO-1 run's records under {runs}; run "
                     "benchmarks.speed with zero1 in each setting, or use --compute probe")  # fmt: skip
    probed = cached.get("meta", {})
    meta = {"date": datetime.date.today().isoformat(), "machine": machine(), "command": command(argv),
            "probes": f"{PROBES}, {probed.get('date', '?')}, {probed.get('machine', '?')}",
            "inputs": inputs}  # fmt: skip
    data = {"meta": meta, "tables": result}
    write_report(out, args.name, data, markdown(result, meta), lambda path: plot(result, path))
    return 0


if __name__ == "__main__":  # the old form: one line naming `python -m benchmarks <command>`
    from benchmarks.cli import moved

    raise SystemExit(moved(__spec__.name))
