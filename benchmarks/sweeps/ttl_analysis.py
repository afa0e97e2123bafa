"""The arithmetic of the time-to-loss benchmark, kept apart from the runs so it can be tested.

A run is its list of metrics records (`metrics.jsonl`, one per update). Its training clock adds
each update's time (tokens / tokens_per_s: what the trainer measures, evaluation and checkpoints
excluded), and its validation curve is the (training seconds, tokens, val_loss) of each evaluation.
"""

from __future__ import annotations

import math
import statistics

from benchmarks.names import DDP, FSDP, ZERO1


def val_curve(records: list[dict]) -> list[dict]:
    """(step, tokens, training seconds, val_loss) at each evaluation; the clock starts at 0."""
    out, wall, previous = [], 0.0, 0
    for r in records:
        wall += (r["tokens"] - previous) / r["tokens_per_s"]
        previous = r["tokens"]
        if "val_loss" in r:
            out.append({"step": r["step"], "tokens": r["tokens"], "wall_s": wall, "val_loss": r["val_loss"]})
    return out


def training_seconds(records: list[dict]) -> float:
    return sum(
        (r["tokens"] - p) / r["tokens_per_s"] for r, p in zip(records, [0] + [q["tokens"] for q in records[:-1]])
    )


def time_to_target(curve: list[dict], target: float, key: str = "wall_s") -> float:
    """The training time (or tokens, with key="tokens") at which the validation loss first reaches
    `target`, interpolated linearly between the two evaluations around the crossing; inf if never."""
    previous = None
    for point in curve:
        if point["val_loss"] <= target:
            if previous is None:
                return point[key]
            drop = previous["val_loss"] - point["val_loss"]
            share = (previous["val_loss"] - target) / drop if drop > 0 else 1.0
            return previous[key] + share * (point[key] - previous[key])
        previous = point
    return math.inf


def loss_at(curve: list[dict], seconds: float) -> float:
    """The validation loss at training time `seconds`, interpolated between evaluations (nan past the end)."""
    previous = None
    for point in curve:
        if point["wall_s"] >= seconds:
            if previous is None:
                return point["val_loss"]
            share = (seconds - previous["wall_s"]) / (point["wall_s"] - previous["wall_s"])
            return previous["val_loss"] + share * (point["val_loss"] - previous["val_loss"])
        previous = point
    return math.nan


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation of the finite values (inf when none is finite)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.inf, math.nan
    return statistics.mean(finite), statistics.pstdev(finite) if len(finite) > 1 else 0.0


def summarize(
    curves: dict[str, list[list[dict]]],
    baselines=(DDP, ZERO1, FSDP),
    target_from: str = DDP,
    loose: float = 0.01,
) -> dict:
    """Per strategy, over its seeds' validation curves: the time to the target loss, the loss at equal
    training time (the shortest run's end), final loss, training time, updates; and the speed-up of each
    strategy over the best baseline. Seeds are paired: seed i's target is `target_from`'s final loss with
    seed i (the same initialisation and data order), so the target averages to its mean final loss; a
    looser target, `loose` above it, shows the ratios where a strategy a hair worse per token never
    reaches the strict one inside the budget."""
    targets = [c[-1]["val_loss"] for c in curves[target_from]]
    equal_time = min(c[-1]["wall_s"] for cs in curves.values() for c in cs)
    out = {
        "target_val_loss": statistics.mean(targets),
        "loose_target_val_loss": statistics.mean(targets) * (1 + loose),
        "equal_time_s": equal_time,
        "strategies": {},
    }
    for s, cs in curves.items():
        pairs = list(zip(cs, targets))
        times = [time_to_target(c, t) for c, t in pairs]
        loose_times = [time_to_target(c, t * (1 + loose)) for c, t in pairs]
        out["strategies"][s] = {
            "time_to_target_s": mean_std(times),
            "reached": sum(math.isfinite(t) for t in times),
            "time_to_loose_target_s": mean_std(loose_times),
            "reached_loose": sum(math.isfinite(t) for t in loose_times),
            "seeds": len(times),
            "tokens_to_target": mean_std([time_to_target(c, t, key="tokens") for c, t in pairs]),
            "loss_at_equal_time": mean_std([loss_at(c, equal_time) for c in cs]),
            "final_val_loss": mean_std([c[-1]["val_loss"] for c in cs]),
            "training_s": mean_std([c[-1]["wall_s"] for c in cs]),
            "updates": statistics.mean(c[-1]["step"] for c in cs),
            "tokens_per_s": statistics.mean(c[-1]["tokens"] / c[-1]["wall_s"] for c in cs),
        }
    for key in ("time_to_target_s", "time_to_loose_target_s"):
        present = [b for b in baselines if b in out["strategies"]]
        best = min(present, key=lambda b: out["strategies"][b][key][0])
        out["best_baseline" if key == "time_to_target_s" else "best_baseline_loose"] = best
        best_time = out["strategies"][best][key][0]
        for stats in out["strategies"].values():
            mine = stats[key][0]
            ratio = best_time / mine if math.isfinite(mine) else 0.0
            stats["speedup_vs_best_baseline" if key == "time_to_target_s" else "speedup_loose"] = ratio
    return out
