"""`python -m benchmarks figures`: the README's figures from saved results. Time to DDP's loss against the link rate
(10 Mbit/s to 10 Gbit/s) on 2 nodes, and with one node at a third of a core: the cost model's curve of each family
(the calibration's measured compute per update, ring-ideal links, the family's measured tokens; balanced replicas add
up their updates per second) under the measured points with their 95% intervals. Writes <out>/time_to_loss_by_link.png,
<out>/time_to_loss_mixed.png and <out>/<--name>.{json,md}."""

from __future__ import annotations

import functools
import json
import math
import re

import numpy

from benchmarks import common
from benchmarks import cost_model_check as cmc
from benchmarks.common import DDP, ROOT, ZERO1, mean_ci, plain_name
from benchmarks.yardstick.speed import STRATEGIES
from torchacco.planning import cost_model as cm

CALIBRATION = "calibration_2026-11-28"  # the compute per update of the machine that measured the points below
TABLES = ("time_to_target_topk3_senders_ab", "time_to_target_senders_e")  # settings a, b and e: 2 nodes
MIXED_SPEED, MIXED_RUNS = "speed_bm_senders", "end_to_end_bm_senders"  # setting bm: node 1 at ⅓ of a core
SYNCHRONOUS, TOP3 = "DDP or ZeRO-1 (synchronous)", "streaming_h10_avg_topk3_int2_senders"
# ACCO is left out: on a CPU core its job runs in turn with compute, which the cost model does not charge
FAMILIES = ("streaming_h10_avg", TOP3, "streaming_h10_avg_topk1_int2_senders")
MIXED = (DDP, f"{ZERO1}_balanced", "streaming_h10_avg_balanced", f"{TOP3}_balanced")
RATES = [10 ** (7 + i / 32) for i in range(97)]  # 10 Mbit/s to 10 Gbit/s
UPDATES = 1000  # DDP's run: the target is its final loss


def load(out, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def rate_of(plan: str) -> float:
    value, unit = re.search(r"links ([\d.]+)([mg])bit", plan).groups()
    return float(value) * {"m": 1e6, "g": 1e9}[unit]


def words(bps: float) -> str:
    value, unit = (bps / 1e9, "Gbit/s") if bps >= 1e9 else (bps / 1e6, "Mbit/s")
    return f"{float(f'{value:.2g}'):g} {unit}"  # two significant digits


@functools.cache
def model_inputs(label: str, params: float):
    cfg = cmc.trainer_config(STRATEGIES[label])
    return cfg, cmc.workload(cfg, 2, params), cmc.diloco_settings(cfg)


def step_s(label: str, rate: float, calibration: dict, slow: float = 1.0) -> float:
    """The cost model's seconds per update of `label` on 2 nodes at `rate`, one node `slow` times slower."""
    cfg, work, d = model_inputs(label, calibration["params"])
    c = calibration["compute_per_update_s"] / work.micro_batches
    hw = cm.Hardware(nodes=2, bandwidth_bps=rate, compute_s=c, slow_factor=1.0 if d else slow, **cmc.MEASURED)
    if d is None:
        return cm.predict(work, hw, cmc.model_label(label, cfg))["step_time_s"]
    step = cmc.predict_diloco(cfg, d, work, hw)["step_time_s"]
    return step * 2 / (1 + 1 / slow) if d["balance_replicas"] else step  # the slow replica runs 1/slow of the updates


def tokens_ratios(tables: list[dict]) -> dict[str, float]:
    """Each label's measured tokens to DDP's loss × DDP's: the tables' own, else predict's (synchronous ones: 1)."""
    ratios = {name: row["mean"] for name, row in cm.token_table()["tokens_to_target"].items() if "mean" in row}
    ratios |= {n: r["tokens_ratio"] for t in tables for s in t["settings"].values()
               for n, r in s["strategies"].items() if "tokens_ratio" in r}  # fmt: skip
    return ratios | dict.fromkeys((DDP, ZERO1), 1.0)


def curves(labels, ratios: dict, calibration: dict, slow: float = 1.0) -> dict[str, list[float]]:
    """Plain name -> minutes to DDP's loss at each of RATES (a balanced variant needs its plain self's tokens)."""
    tokens = lambda label: ratios[label.removesuffix("_balanced")] * UPDATES / 60  # noqa: E731
    return {plain_name(n): [step_s(n, r, calibration, slow) * tokens(n) for r in RATES] for n in labels}


def verdict(drawn: dict[str, list[float]]) -> str:
    """What to pick where: the soonest curve over each stretch of link rates."""
    best = [min(drawn, key=lambda n: drawn[n][i]) for i in range(len(RATES))]
    stretches = [(name, RATES[i]) for i, name in enumerate(best) if i == 0 or best[i - 1] != name]
    parts = [f"{name} up to {words(stretches[k + 1][1])}" if k + 1 < len(stretches) else f"{name} above"
             for k, (name, _) in enumerate(stretches)]  # fmt: skip
    return "Pick " + ";\n".join(parts) if len(parts) > 1 else f"Pick {best[0]} at every rate"


def measured(tables: list[dict]) -> list[tuple]:
    """(curve, link rate, minutes, 95% half-width, label) of each measured time to target."""
    at = lambda n, r, key: r["seconds_per_update"] * r[key] * UPDATES / 60  # noqa: E731
    return [(SYNCHRONOUS if n in (DDP, ZERO1) else plain_name(n), rate_of(s["plan"]), at(n, r, "tokens_ratio"),
             at(n, r, "tokens_ratio_ci95"), plain_name(n)) for t in tables for s in t["settings"].values()
            for n, r in s["strategies"].items() if "tokens_ratio" in r]  # fmt: skip


def mixed_measured(speed: dict, runs: list[dict]) -> list[tuple]:
    """The same on the mixed cluster: the synchronous ones' speed (DDP's update), Streaming DiLoCo's whole runs."""
    rate, top3 = rate_of(speed["plan"]), plain_name(f"{TOP3}_balanced")
    points = [(plain_name(n), rate, r["mean"] * UPDATES / 60, 0.0, plain_name(n))
              for n, r in speed["strategies"].items() if n in MIXED[:2]]  # fmt: skip
    return [*points, (top3, rate, *mean_ci([r["measured_s"] / 60 for r in runs]), f"{top3} (whole runs)")]


def main(argv=None) -> int:
    args = common.parser("figures", __doc__, "figures").parse_args(argv)
    out = ROOT / args.out
    calibration, tables = load(out, CALIBRATION)["calibration"], [load(out, name) for name in TABLES]
    ratios, speed = tokens_ratios(tables), load(out, MIXED_SPEED)["settings"]["bm"]
    sync = curves((DDP, ZERO1), ratios, calibration).values()
    drawn = {SYNCHRONOUS: [min(a, b) for a, b in zip(*sync)], **curves(FAMILIES, ratios, calibration)}
    slow = speed["measured_slowdown"]
    figures = {
        "time_to_loss_by_link": (verdict(drawn) + f"\n(2 nodes, GPT-Neo debug on CPU, {UPDATES:,} of DDP's updates)",
                                 drawn, measured(tables)),
        "time_to_loss_mixed": (verdict(mixed := curves(MIXED, ratios, calibration, slow)) + f"\n(2 nodes, one "
                               f"{slow:.1f}× slower: ⅓ of a core)", mixed,
                               mixed_measured(speed, load(out, MIXED_RUNS)["results"])),
    }  # fmt: skip
    sources = [CALIBRATION, *TABLES, MIXED_SPEED, MIXED_RUNS]
    meta = common.meta("figures", argv, calibration=calibration, sources=sources)
    common.write_report(out, args.name, {"meta": meta, "rates_bps": RATES, "figures": figures}, markdown(meta, figures))
    for name, (title, lines, points) in figures.items():
        draw(out / f"{name}.png", title, lines, points)
    return 0


def draw(path, title: str, lines: dict, points: list) -> None:
    drawn = common.panels(1, height=4.8, width=7.6)
    if drawn is None:
        return
    fig, (ax,) = drawn
    colour = {name: ax.plot([r / 1e6 for r in RATES], y, lw=2, label=name)[0].get_color() for name, y in lines.items()}
    for name, rate, value, half, _ in points:
        ax.errorbar(rate / 1e6, value, yerr=half, fmt="o", color=colour[name], capsize=4, ms=6, mec="black")
    ax.plot([], [], "o", color="grey", mec="black", label="measured, 95% interval (lines: cost model)")
    ax.set(xscale="log", yscale="log", xlabel="link rate between the nodes", ylabel="minutes to DDP's loss")
    ax.set_title(title, fontsize=10)
    ax.set_xticks([10, 100, 1000, 10000], ["10 Mbit/s", "100 Mbit/s", "1 Gbit/s", "10 Gbit/s"])
    ax.yaxis.set_major_formatter("{x:g}")
    ax.yaxis.set_minor_formatter("{x:g}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    common.save_figure(fig, path)


def row(curve: dict, c: str, rate: float, value: float, half: float, label: str) -> str:
    model = numpy.interp(math.log(rate), [math.log(r) for r in RATES], curve[c])
    return f"| {label} | {words(rate)} | {value:.2f} | {half:.2f} | {value / model:.2f} |"


def markdown(meta: dict, figures: dict) -> str:
    lines = ["# Time to DDP's loss against the link rate", "",
             f"{meta['date']}, {meta['machine']}. Command: `{meta['command']}`. Sources: "
             + ", ".join(f"`{s}.json`" for s in meta["sources"]) + ".", "",
             "Lines: the cost model (`torchacco/planning/cost_model.py`) with the calibration's compute per update "
             f"({meta['calibration']['compute_per_update_s']:.4f} s), ring-ideal links and each family's measured "
             "tokens to DDP's loss. Points: measured (tokens on loopback × speed on the emulated cluster, or whole "
             "runs), with their 95% intervals over seeds. ACCO is not drawn: on one CPU core per node its job runs in "
             "turn with compute ([where it wins](../docs/parallelism.md#data-parallel-strategies)). Mixed "
             "replicas: the slow one runs 1/slowdown of the inner updates, at the plain variant's tokens."]  # fmt: skip
    for name, (title, curve, points) in figures.items():
        head = title.split("\n(")[0].replace("\n", " ")
        lines += ["", f"## {name}.png: {head}", "", "| measured | link | minutes | ± | measured / model |",
                  "|---|---|---:|---:|---:|", *(row(curve, *point) for point in points)]  # fmt: skip
    return "\n".join(lines) + "\n"
