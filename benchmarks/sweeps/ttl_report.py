"""The time-to-loss benchmark's markdown report (from its JSON results)."""

from __future__ import annotations

import math
import re

from benchmarks.cluster import format_rate
from benchmarks.names import ACCO, DDP, FSDP, ZERO1
from benchmarks.sweeps.ttl_strategies import LONGER_BUDGET
from torchacco import cost_model as cm

TARGETS = {"a": 1.3, "b": 1.5, "c": 2.0}  # ACCO's best mode vs the best baseline, time to the target loss
BASELINES = (DDP, ZERO1, FSDP)


def _ms(pair, digits=1, suffix="") -> str:
    mean, std = pair
    if not math.isfinite(mean):
        return "not reached"
    return f"{mean:.{digits}f} ± {std:.{digits}f}{suffix}"


def report(results: dict) -> str:
    c = results["calibration"]
    lines = [
        "# Time to loss on the emulated cluster",
        "",
        f"Seeds {', '.join(map(str, results['seeds']))}. ZeRO-1 computed {c['compute_per_update_s']:.3f} s per "
        f"update unshaped; the balance rate (its job as long as its compute) is {format_rate(c['balance_bps'])}. "
        "Every strategy trains on the same token budget with the same token-indexed schedule. Times are "
        "training time (the trainer's clock: evaluation excluded), mean ± std over the seeds that reach "
        "the target (their count where not all do; — where none does).",
        "",
    ]
    for name, setting in results["settings"].items():
        s = setting["summary"]
        lines += [
            f"## Setting {name}: {setting['plan']}",
            "",
            f"Target: DDP's final validation loss, per seed (mean {s['target_val_loss']:.4f}); loose target 1% "
            f"above it (mean {s['loose_target_val_loss']:.4f}). Equal time: {s['equal_time_s']:.1f} s. Best "
            f"baseline: {s['best_baseline']} (loose: {s['best_baseline_loose']}).",
            "",
            "| strategy | time to target (s) | reached | vs best baseline | time to loose target (s) | vs best "
            "baseline | val loss at equal time | final val loss | training (s) | updates | tokens/s | other CPU |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for strategy, st in s["strategies"].items():
            other = max(run["other_cpu_share"] for run in setting["runs"][strategy])
            lines.append(
                f"| {strategy} | {_ms(st['time_to_target_s'])} | {st['reached']}/{st['seeds']} | "
                f"{_ratio(st['speedup_vs_best_baseline'])} | {_ms(st['time_to_loose_target_s'])}"
                f"{_partial(st['reached_loose'], st['seeds'])} | "
                f"{_ratio(st['speedup_loose'])} | {_ms(st['loss_at_equal_time'], 4)} | "
                f"{_ms(st['final_val_loss'], 4)} | {_ms(st['training_s'])} | {st['updates']:.0f} | "
                f"{st['tokens_per_s']:,.0f} | ≤ {other:.0%} |"
            )
        lines += ["", *_verdicts(name, setting), "", *prediction_lines(setting, c["params"]), ""]
    return "\n".join(lines) + "\n"


def _ratio(speedup: float) -> str:
    return f"{speedup:.2f}×" if speedup > 0 else "—"  # 0: no seed reached the target


def _partial(reached: int, seeds: int) -> str:
    return f" ({reached}/{seeds})" if 0 < reached < seeds else ""


def _verdicts(name: str, setting: dict) -> list[str]:
    summary = setting["summary"]
    s = summary["strategies"]
    acco = {k: v for k, v in s.items() if k.startswith(ACCO) and k not in LONGER_BUDGET}
    out = []
    if acco:
        goal = TARGETS.get(name)
        for key, label, baseline in (
            ("speedup_vs_best_baseline", "the target", summary["best_baseline"]),
            ("speedup_loose", "the loose target", summary["best_baseline_loose"]),
        ):
            best = max(acco, key=lambda k: acco[k][key])
            ratio = acco[best][key]
            verdict = f"; goal ≥ {goal}×: {'met' if ratio >= goal else 'missed'}" if goal else ""
            out.append(f"To {label}, ACCO's best mode is {best}: {ratio:.2f}× the best baseline ({baseline}){verdict}.")
    for longer, (strategy, factor) in LONGER_BUDGET.items():
        if longer in s and s[longer]["reached"]:
            st = s[longer]
            out.append(
                f"{strategy} on {factor:g}× the token budget (its schedule stretched to it) reaches the target in "
                f"{st['reached']}/{st['seeds']} seeds, {_ratio(st['speedup_vs_best_baseline'])} sooner than the "
                f"best baseline on its budget."
            )
    if ACCO in s and DDP in s:
        gap = s[ACCO]["final_val_loss"][0] / s[DDP]["final_val_loss"][0] - 1
        out.append(f"Deterministic ACCO at equal tokens: {gap:+.2%} validation loss vs DDP (goal: within 1%).")
    bound = _acco_bound(setting)
    if bound:
        out.append(bound)
    return out


def _acco_bound(setting: dict) -> str | None:
    """Deterministic ACCO's time per update against 2·max(C/2, M): C from ZeRO-1's compute, M its job."""
    s = setting["summary"]["strategies"]
    if ACCO not in s or ZERO1 not in s or setting.get("nodes") != 2:
        return None
    compute = setting.get("zero1_compute_per_update_s")
    job = setting["job_s"].get(ACCO)
    if not compute or not job or not math.isfinite(job):
        return None
    per_update = s[ACCO]["training_s"][0] / s[ACCO]["updates"]
    bound = 2 * max(compute / 2, job)
    return (
        f"Deterministic ACCO: {per_update:.3f} s per update against its bound 2·max(C/2, M) = {bound:.3f} s "
        f"(C = {compute:.3f} s of compute per update, M = {job:.3f} s per job): {per_update / bound:.2f}× "
        f"(goal ≤ 1.10×)."
    )


def _slowdown(setting: dict) -> float:
    found = re.search(r"measured slowdown ([0-9.]+)×", setting["plan"])
    return float(found.group(1)) if found else 1.0


def predictions(setting: dict, params: float) -> dict[str, dict]:
    """The cost model's time per update and time to the target for each strategy of a setting,
    calibrated on ZeRO-1 alone: its measured compute per update, and its measured job over the ring
    ideal as the collectives' factor (f_rs = f_ag = f_ar); the link rate and the measured slowdown;
    DDP's measured tokens to the target times each strategy's measured ratio (`torchacco/token_efficiency.json`;
    a predicted time to the target of None where the ratio is not measured)."""
    s = setting["summary"]["strategies"]
    compute = setting.get("zero1_compute_per_update_s")
    if not compute or not math.isfinite(compute) or DDP not in s or ZERO1 not in s:
        return {}
    slow = _slowdown(setting)
    tokens = s[DDP]["tokens_per_s"] * s[DDP]["training_s"][0] / s[DDP]["updates"]  # per update
    micro = tokens / (setting["nodes"] * 2)
    work = cm.Workload(params=params, flops_per_token=1.0, tokens_per_micro_batch=micro, comm_bytes=4)
    # ZeRO-1 computes at the slowest rank's pace: a fast rank's micro-batch takes 1/slow of it
    hw = cm.Hardware(nodes=setting["nodes"], flops=1.0, bandwidth_bps=setting["rate_bps"], opt_rate=1e9,
                     slow_factor=slow, compute_s=compute / 2 / slow, streams=False)  # fmt: skip
    ideal_job = cm.predict(work, hw, ZERO1)["job_s"]
    zero1_step = s[ZERO1]["training_s"][0] / s[ZERO1]["updates"]
    factor = max(1.0, (zero1_step - compute) / ideal_job) if ideal_job > 0 else 1.0
    hw.rs_factor = hw.ag_factor = hw.ar_factor = factor
    target_tokens = s[DDP]["tokens_to_target"][0]
    out = {}
    for strategy, st in s.items():
        if strategy in LONGER_BUDGET:
            continue  # the model's updates to the target are for the equal budget
        variant = "acco_adaptive" if strategy.startswith("acco_adaptive") else strategy
        hw.max_growth = 0.0 if strategy.endswith("uncapped") else 2.0
        p = cm.predict(work, hw, variant)
        ratio = cm.tokens_ratio(variant)
        measured_step = st["training_s"][0] / st["updates"]
        out[strategy] = {
            "predicted_step_s": p["step_time_s"],
            "measured_step_s": measured_step,
            "step_error": cm.relative_error(p["step_time_s"], measured_step),
            "predicted_time_to_target_s": None if ratio is None else ratio * target_tokens / p["tokens_per_s"],
            "measured_time_to_target_s": st["time_to_target_s"][0],
            "collective_factor": factor,
        }
    return out


def prediction_lines(setting: dict, params: float) -> list[str]:
    preds = predictions(setting, params)
    if not preds:
        return []
    factor = next(iter(preds.values()))["collective_factor"]
    lines = [
        "Cost model against this setting, calibrated on ZeRO-1 alone (its compute per update, and its job at "
        f"{factor:.2f}× the ring ideal as every collective's factor), the link rate"
        + (", the measured slowdown" if _slowdown(setting) > 1 else "")
        + ", DDP's tokens to the target times each strategy's measured ratio (torchacco/token_efficiency.json):",
        "",
        "| strategy | time per update, predicted / measured (s) | error | time to target, predicted / measured (s) |",
        "|---|---:|---:|---:|",
    ]
    for strategy, p in preds.items():
        predicted, measured = p["predicted_time_to_target_s"], p["measured_time_to_target_s"]
        predicted = "not measured" if predicted is None else f"{predicted:.1f}"
        measured = f"{measured:.1f}" if math.isfinite(measured) else "not reached"
        lines.append(
            f"| {strategy} | {p['predicted_step_s']:.3f} / {p['measured_step_s']:.3f} | {p['step_error']:+.0%} | "
            f"{predicted} / {measured} |"
        )
    errors = [abs(p["step_error"]) for k, p in preds.items() if k != ZERO1]
    lines += [
        "",
        f"Mean absolute error of the time per update: {sum(errors) / len(errors):.0%} over the {len(errors)} "
        "strategies other than ZeRO-1.",
    ]
    return lines
