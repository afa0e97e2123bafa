"""One source for the prose's figures: each benchmark number the README and docs/ quote is read back from its JSON in
bench_results/ (or torchacco/planning/token_efficiency.json, what predict reads) and must appear in the page as
written. Where a run wrote no JSON, the entry reads the markdown table it came from and says so; the wire's sizes come
from the code that computes them (wire.bytes_per_element)."""

import json
import re
import statistics
from pathlib import Path

import pytest

from benchmarks.common import DDP, T95, ZERO1, mean_ci

ROOT = Path(__file__).resolve().parents[1]
TOP3, TOP1 = "streaming_h10_avg_topk3_int2_senders", "streaming_h10_avg_topk1_int2_senders"
AB, E = "time_to_target_topk3_senders_ab", "time_to_target_senders_e"  # 2026-11-29: settings a, b and e
MB, ME = "time_to_target_muon_b", "time_to_target_muon_e"  # 2026-12-07: b and e, Muon beside AdamW
README, PERF, DILOCO = "README.md", "docs/performance.md", "docs/diloco.md"
RELIABILITY, ACCO, PARALLEL = "docs/reliability.md", "docs/acco.md", "docs/parallelism.md"
OPTIMIZERS = "docs/optimizers.md"
TE, OUTER2 = "diloco_topk_token_efficiency", "diloco_topk1_outer2_5seeds"  # 2026-11-27 and 11-28: top-k, outer lr 2
REGIME = "speed_virtual_acco_regime_2conn"  # 2026-11-27: ZeRO-1's job about ¼, ½, ¾ of compute


def load(name: str) -> dict:
    path = (
        ROOT / "torchacco" / "planning" / "token_efficiency.json"
        if name == "predict"
        else ROOT / "bench_results" / f"{name}.json"
    )
    return json.loads(path.read_text())


def ttt(table: str, setting: str, label: str, *keys: str) -> list[float]:
    row = load(table)["settings"][setting]["strategies"][label]
    return [row[key] for key in keys]


def tokens_row(label: str) -> dict:
    return load("predict")["tokens_to_target"][label]


def tokens(label: str) -> list[float]:
    return [tokens_row(label)["mean"], tokens_row(label)["ci95"]]


def speed_ratio(table: str, setting: str, faster: str, slower: str) -> list[float]:
    rows = load(table)["settings"][setting]["strategies"]
    return [rows[slower]["mean"] / rows[faster]["mean"]]


def whole_runs(table: str, against: str) -> list[float]:
    return list(mean_ci([r["sooner_than"][against] for r in load(table)["results"]]))


HALF, HALF_4NODES = ("speed_virtual_acco_regime_2conn", "r804mbit"), ("speed_virtual_acco_4nodes_half", "r600mbit")


def acco_virtual(against: tuple[str, ...], where: tuple[str, str] = HALF, per_token: bool = True) -> list[float]:
    """ACCO's speed (or, `per_token`, time to DDP's loss with its measured tokens) over each of `against`'s."""
    ratios = [speed_ratio(*where, "acco", name)[0] for name in against]
    return [r / tokens("acco")[0] for r in ratios] if per_token else ratios


def summary(table: str, label: str, key: str, lr: str = "0.003") -> float | list[float]:
    return load(table)["summary"][lr][label][key]


def cost_model_within(table: str) -> list[int]:
    settings = [s for t in load(table)["tables"].values() for s in t.values()]
    return [sum(s["within"] for s in settings), sum(s["checked"] for s in settings)]


def vs_ddp(table: str, setting: str, label: str) -> list[float]:
    return [load(table)["settings"][setting]["strategies"][label]["sooner"]]


MUON_TOP3 = "streaming_h10_avg_topk3_int2_senders_muon"
MUONS = ("ddp_muon", MUON_TOP3, f"{TOP3}_warm100_muon_r4")  # predict's entries with Muon inside


def muon_time(table: str, setting: str, strategy: str) -> float:
    """A strategy's time per update with Muon over its time with AdamW, in one speed run."""
    times = load(table)["settings"][setting]["strategies"]
    return times[f"{strategy}_muon"]["mean"] / times[strategy]["mean"]


def muon_sync_sooner(table: str, setting: str) -> float:
    """The soonest synchronous strategy with Muon in a time-to-target table, as its × sooner."""
    return max(ttt(table, setting, f"{s}_muon", "sooner")[0] for s in (DDP, ZERO1))


MUON_TUNED = "ddp_muon_tuned_tokens"  # DDP-Muon's lr tuned on seeds 100 and 101, and its tokens at that lr


def muon_tuned_lr() -> dict:
    """DDP-Muon's chosen grid point (lr, grid) in its tuned tokens run."""
    return load(MUON_TUNED)["meta"]["tuned"]["0.003"]["ddp_muon"]


def muon_grid() -> list[float]:
    """DDP-Muon's tuning grid as multiples of AdamW's lr 3e-3."""
    return [point["lr"] / 3e-3 for point in muon_tuned_lr()["grid"]]


def muon_gap(label: str, table: str = "streaming_muon_screen") -> float:
    """Final loss over DDP-Muon's at equal tokens, %, the mean over seeds paired across the two screens."""
    ddp_muon = summary("muon_snoo_screen", "ddp_muon", "val_loss")
    losses = summary(table, label, "val_loss")
    return statistics.mean(100 * (x / y - 1) for x, y in zip(losses, ddp_muon, strict=True))


def floor(table: str) -> list[float]:
    """ZeRO-1-Muon's final loss over DDP-Muon's, %, paired by seed (mean, 95% interval)."""
    zero1, ddp = (summary(table, v, "val_loss") for v in ("zero1_muon", "ddp_muon"))
    return list(mean_ci([100 * (z / d - 1) for z, d in zip(zero1, ddp, strict=True)]))


def gap(table: str, label: str) -> list[float]:
    """Final loss over DDP's at equal tokens, % (mean, 95% interval)."""
    return [summary(table, label, "mean_gap_pct"), summary(table, label, "ci95_gap_pct")]


def paired(table: str, label: str, bf16: str = TE, digits: int = 1) -> list[str]:
    """Points of loss over bf16 Streaming DiLoCo's, paired by seed, signed as the pages write them (−)."""

    def points(name: str, variant: str) -> list[float]:
        row, ddp = (load(name)["summary"]["0.003"][v]["val_loss"] for v in (variant, "ddp"))
        return [100 * (v / d - 1) for v, d in zip(row, ddp)]

    mean, ci = mean_ci([a - b for a, b in zip(points(table, label), points(bf16, "streaming_h10_avg"))])
    return [f"{mean:+.{digits}f}".replace("-", "−"), f"{ci:.{digits}f}"]


def two_level(label: str) -> float:
    """Streaming DiLoCo over 4 nodes (2026-11-27): time to DDP's loss, as × sooner than ZeRO-1 alone; ACCO alone from
    its time per update and the tokens predict reads (its row there carries no tokens)."""
    rows = load("time_to_target_two_level")["settings"]["b2"]["strategies"]
    if label == "acco":
        return rows["zero1"]["seconds_per_update"] / (rows["acco"]["seconds_per_update"] * tokens("acco")[0])
    return rows[label]["sooner"]


def batch8_sooner(setting: str) -> float:
    """The synchronous baseline at 8 sequences (the faster of DDP and ZeRO-1, its seconds per 16 sequences' tokens,
    times its tokens) against the faster at 16: how soon it reaches DDP-at-16's loss (2026-12-06, one host)."""
    rows = load("speed_batch8")["settings"][setting]["strategies"]
    at8 = min(rows["ddp_b8"]["mean"], rows["zero1_b8"]["mean"]) * summary(
        "ddp_batch8_to_ddp16", "ddp_b8", "mean_tokens_to_target_ratio"
    )
    return min(rows["ddp"]["mean"], rows["zero1"]["mean"]) / at8


def validated_runs() -> list[tuple[float, float]]:
    """(measured, predicted) seconds of the whole runs to DDP's loss (2026-11-26): `--validate` wrote no JSON, so
    they are read from the markdown table in time_to_target_findings.md."""
    text = (ROOT / "bench_results" / "time_to_target_findings.md").read_text()
    rows = re.findall(r"\| a \| (?:ddp|acco) \| [\d,]+ / [\d,]+ \| ([\d.]+) s \| ([\d.]+) s \|", text)
    return [(float(m), float(p)) for m, p in rows]


def slow_momentum_gain() -> list[float]:
    """Points of loss Streaming DiLoCo gains from slow momentum against a DDP using it too (2026-11-28), by seed."""
    rows = {k: v["val_loss"] for k, v in load("diloco_slow_momentum_tuned")["summary"]["0.003"].items()}
    gaps = zip(rows["streaming_h10_avg"], rows["ddp"], rows["streaming_h10_avg_slow99"], rows["ddp_slow99"])
    return list(mean_ci([100 * (s / d - s99 / d99) for s, d, s99, d99 in gaps]))


def bf16_estimate(setting: str) -> list[float]:
    """ACCO's time per update saved by the bf16 estimate, and its final loss over fp32-estimate ACCO's, %."""
    rows = load("time_to_loss")["settings"][setting]["summary"]["strategies"]
    fp32, bf16 = rows["acco"], rows["acco_bf16_estimate"]
    per_update = [r["training_s"][0] / r["updates"] for r in (fp32, bf16)]
    return [1 - per_update[1] / per_update[0], 100 * (bf16["final_val_loss"][0] / fp32["final_val_loss"][0] - 1)]


def link_mbit(table: str, setting: str) -> float:
    """The link rate a setting ran on, from its plan ("2 nodes on ..., links 60.077mbit")."""
    return float(re.search(r"links ([\d.]+)mbit", load(table)["settings"][setting]["plan"]).group(1))


def found(name: str, key: str) -> list[float]:
    """Every value of `key` in the JSON, in file order (the gpu-check's runs nest them at different depths)."""
    return [float(v) for v in re.findall(rf'"{key}": ([\d.]+)', (ROOT / "bench_results" / f"{name}.json").read_text())]


def ring_ratios(connections: str) -> list[float]:
    """The ring's time over its ideal on `connections` ("1" or "**2**"), from gloo_ring_connections.md's table: the
    collective probe wrote no JSON, so the prose is checked against the markdown table it quotes."""
    text = (ROOT / "bench_results" / "gloo_ring_connections.md").read_text()
    rows = re.findall(rf"^\|[^|]*\| {re.escape(connections)} \| (.*)$", text, re.M)
    return [float(x) for row in rows for x in re.findall(r"([\d.]+)×", row.replace("*", ""))]


def fault(name: str) -> dict:
    """The survivor's speed, the merge's tokens per second and the final validation loss, faulted over undisturbed."""
    run = load(name)
    calm, hit = run["undisturbed"], run["faulted"]
    away = run["faulted"]["replicas_per_outer_step"]
    return {
        "speed": calm["train_s"] / hit["train_s"],
        "merge": hit["merged_tokens"] / hit["wall_s"] / (calm["merged_tokens"] / calm["wall_s"]),
        "val_pct": 100 * (hit["final_val_loss"] / calm["final_val_loss"] - 1),
        "away": sum(n < 2 for n in away) / len(away),
        "heal": statistics.median(
            h["copy_s"] * run["link_mbit_s"] * 1e6 / (h["mib"] * 2**20 * 8) for h in hit["heals"]
        ),
        "mib": hit["heals"][0]["mib"],
    }


def fewer_bytes(topk: float, wire: str = "int2") -> list[float]:
    """Bytes per element on the wire and how many times fewer than bf16's 2 (the code's sizes, not a measurement)."""
    from torchacco.parallel.diloco.wire import bytes_per_element

    return [bytes_per_element(wire, topk), 2 / bytes_per_element(wire, topk)]


# (pages, the text as written with {} for each number, the numbers from their JSON)
NUMBERS = [
    ((README, PERF, DILOCO), "{:.2f}× ± {:.2f}", lambda: ttt(AB, "b", TOP3, "sooner", "sooner_ci95")),
    ((README, PERF), "{:.2f}× where communication ≈ compute", lambda: ttt(AB, "a", TOP3, "sooner")),
    ((DILOCO,), "{:.2f}× ± {:.2f}** where it takes 1×", lambda: ttt(AB, "a", TOP3, "sooner", "sooner_ci95")),
    ((PERF, DILOCO), "{:.1f}× ± {:.1f}", lambda: ttt(E, "e", TOP1, "sooner", "sooner_ci95")),
    ((README,), "{:.3f}× DDP's tokens", lambda: ttt(AB, "b", TOP3, "tokens_ratio")),
    ((DILOCO,), "{:.3f} ± {:.3f}× DDP's tokens", lambda: ttt(AB, "b", TOP3, "tokens_ratio", "tokens_ratio_ci95")),
    ((README, PERF, DILOCO), "bf16 {:.2f}×", lambda: ttt(AB, "b", "streaming_h10_avg", "sooner")),
    ((README, PERF, DILOCO), "{:.2f}× in the same run", lambda: ttt(AB, "a", "streaming_h10_avg", "sooner")),
    (
        (DILOCO,),
        "in bf16 {:.3f} ± {:.3f}× (tuned",
        lambda: ttt(AB, "b", "streaming_h10_avg", "tokens_ratio", "tokens_ratio_ci95"),
    ),  # fmt: skip
    ((DILOCO,), "{:.2f}× DDP's tokens; bf16", lambda: ttt(E, "e", TOP1, "tokens_ratio")),
    ((PERF, DILOCO), "bf16 {:.1f}×", lambda: ttt(E, "e", "streaming_h10_avg", "sooner")),
    # the top 3% and 1% side by side at e, and Muon inside, at a and b (2026-12-07)
    (
        (README,),
        "**{:.1f}× ± {:.1f} sooner than ZeRO-1**; the top 1% {:.1f}× in the same run (141× fewer bytes than bf16, but "
        "{:.2f}× DDP's",
        lambda: ttt(ME, "e", TOP3, "sooner", "sooner_ci95") + ttt(ME, "e", TOP1, "sooner", "tokens_ratio"),
    ),
    ((README,), "with Muon inside {:.1f}×;", lambda: ttt(ME, "e", MUON_TOP3, "sooner")),
    (
        (OPTIMIZERS,),
        "Muon takes {:.2f}× AdamW's time per update under DDP, {:.2f}× under ZeRO-1 and {:.2f}× under ACCO",
        lambda: [muon_time("speed_muon_a", "a", s) for s in (DDP, ZERO1, "acco")],
    ),
    (
        (OPTIMIZERS,),
        "took {:.2f}×, and {:.2f}× sooner than the soonest synchronous Muon there",
        lambda: ttt(MB, "b", TOP3, "sooner") + [ttt(MB, "b", MUON_TOP3, "sooner")[0] / muon_sync_sooner(MB, "b")],
    ),
    (
        (README, OPTIMIZERS),
        "with Muon inside **{:.2f}× ± {:.2f}** sooner than ZeRO-1 in a run of 2026-12-07 where AdamW's took {:.2f}×",
        lambda: ttt(MB, "b", MUON_TOP3, "sooner", "sooner_ci95") + ttt(MB, "b", TOP3, "sooner"),
    ),
    (
        (README, DILOCO),
        "{:.2f}× ± {:.2f} sooner than balanced ZeRO-1",
        lambda: whole_runs("end_to_end_bm_senders", "zero1_balanced"),
    ),  # fmt: skip
    # the token ratios predict reads
    ((PERF,), "| acco | {:.3f} ± {:.3f} |", lambda: tokens("acco")),
    ((PERF,), "`estimate_share = 0.875` | {:.3f} ± {:.3f} |", lambda: tokens("acco_share875")),
    ((PERF, DILOCO), "{:.3f} ± {:.3f}", lambda: tokens("streaming_h10_avg")),
    ((PERF, DILOCO), "{:.3f} ± {:.3f}", lambda: tokens("streaming_h10_avg_r4")),
    ((PERF, DILOCO), "{:.3f} ± {:.3f}", lambda: tokens("streaming_h10_pier_warm100_r4")),
    ((PERF, DILOCO), "{:.3f} ± {:.3f}", lambda: tokens("streaming_h50_avg")),
    ((PERF,), "{:.3f} ± {:.3f}; ", lambda: tokens("streaming_h10_avg_topk1_int2")),
    ((PERF,), "{:.3f} ± {:.3f}; ", lambda: tokens(TOP1)),
    ((PERF,), "{:.3f} ± {:.3f}; not reached", lambda: tokens(TOP3)),
    ((PERF,), "| {:+.2f}% |", lambda: [load("predict")["tokens_to_target"]["acco"]["gap_pct"]]),
    (
        (PERF,),
        "| {:+.1f}%, {:+.1f}% | 3, 2 |",
        lambda: [load("predict")["tokens_to_target"][v]["gap_pct"] for v in ("dpu", "wp")],
    ),  # fmt: skip
    ((PERF,), "not reached within {:g}× |", lambda: [load("predict")["tokens_to_target"]["dpu"]["not_reached_within"]]),
    (
        (PERF,),
        "| {:.3f} ± {:.3f}; {:.3f} ± {:.3f}; {:.3f} ± {:.3f} | −{:.2f}%; −{:.2f}%; −{:.2f}% | 5, 5, 5 |",
        lambda: [x for v in MUONS for x in tokens(v)] + [-tokens_row(v)["gap_pct"] for v in MUONS],
    ),
    # the noise floor: ZeRO-1 and FSDP compute DDP's update (final loss over 5 seeds, sd)
    (
        (PERF,),
        "{:+.2f} ± {:.2f}% and {:+.2f} ± {:.2f}% (sd)",
        lambda: [
            load("fsdp_floor_lr3e-3")["summary"]["0.003"][v][k]
            for v in ("zero1", "fsdp")
            for k in ("mean_gap_pct", "sd_gap_pct")
        ],
    ),  # fmt: skip
    # the cost model against the speed runs: rows within 15%, real compute and virtual
    (
        (PERF,),
        "within 15% in {} of {} rows; under virtual compute in **{} of {}**",
        lambda: cost_model_within("cost_model_check_all") + cost_model_within("cost_model_check_virtual"),
    ),  # fmt: skip
    # the batch tuned at equal tokens (2026-12-06): DDP at 8 sequences against 16, Streaming DiLoCo at 8 against DDP's
    (
        (PERF,),
        "DDP **{:.2f} ± {:.2f}% lower loss** than at 16",
        lambda: [
            -summary("ddp_batch8_to_ddp16", "ddp_b8", "mean_gap_pct"),
            summary("ddp_batch8_to_ddp16", "ddp_b8", "ci95_gap_pct"),
        ],
    ),
    (
        (PERF,),
        "{:.3f}× the tokens to its loss",
        lambda: [summary("ddp_batch8_to_ddp16", "ddp_b8", "mean_tokens_to_target_ratio")],
    ),
    ((PERF, DILOCO), "{:.3f}", lambda: [summary("diloco_batch_tuned", TOP3, "mean_tokens_to_target_ratio")]),
    # ACCO and ZeRO-1 against DDP, their rings on one connection (2026-11-26)
    (
        (PERF,),
        "**{:.2f}× and {:.2f}× as soon as DDP**",
        lambda: vs_ddp("time_to_target_all", "a", "acco") + vs_ddp("time_to_target_all", "b", "acco"),
    ),  # fmt: skip
    (
        (PERF,),
        "ZeRO-1 {:.2f}× and {:.2f}×",
        lambda: vs_ddp("time_to_target_all", "a", "zero1") + vs_ddp("time_to_target_all", "b", "zero1"),
    ),  # fmt: skip
    # balanced batches on 4 nodes, one 4× slower (2026-11-23)
    (
        (README, PERF),
        "balanced ACCO {:.2f}× of it",
        lambda: speed_ratio("speed", "c", "acco_balanced", "zero1_balanced"),
    ),
    (
        (README, PERF),
        "{:.1f}–{:.1f}× faster",
        lambda: sorted(speed_ratio("speed", "c", f"{s}_balanced", s)[0] for s in ("ddp", "zero1", "acco"))[::2],
    ),  # fmt: skip
    # virtual compute, ZeRO-1's job ≈ ½ of compute (2026-11-27): speed, and time to DDP's loss with ACCO's tokens
    ((README,), "{:.2f}× and {:.2f}× their speed", lambda: acco_virtual(("ddp", "zero1"), per_token=False)),
    ((README,), "{:.2f}× sooner than DDP, {:.2f}× than ZeRO-1", lambda: acco_virtual(("ddp", "zero1"))),
    ((README,), "{:.2f}× sooner than ZeRO-1, the fastest that fits", lambda: acco_virtual(("zero1",), HALF_4NODES)),
    (
        (README,),
        "DiLoCo's mixed replicas {:.2f}–{:.2f}×",
        lambda: sorted(
            r["sooner_than"]["zero1"] for r in load("end_to_end_mixed")["results"] if r["strategy"].startswith("diloco")
        ),
    ),
    (
        (README,),
        "{:.1%} MFU** on one H100 and {:.1%} on one H200",
        lambda: found("gpu_check_2026-11-27", "mfu"),
    ),
    # the rest of the token table predict reads: loss at equal tokens, seeds
    (
        (PERF,),
        "tuned: {:.3f} ± {:.3f} | {:.3f} ± {:.3f} | {:+.2f}% | {} |",
        lambda: (
            ttt(AB, "b", "streaming_h10_avg", "tokens_ratio", "tokens_ratio_ci95")
            + tokens("streaming_h10_avg")
            + [load("predict")["tokens_to_target"]["streaming_h10_avg"][k] for k in ("gap_pct", "seeds")]
        ),
    ),
    (
        (PERF,),
        "| {:+.2f}% ({:+.2f}%); {:+.2f}% | {}, {} |",
        lambda: (
            [
                load("predict")["tokens_to_target"][v]["gap_pct"]
                for v in ("streaming_h10_avg_r4", "streaming_h10_pier_warm100_r4", "streaming_h50_avg")
            ]
            + [load("predict")["tokens_to_target"][v]["seeds"] for v in ("streaming_h10_avg_r4", "streaming_h50_avg")]
        ),
    ),  # fmt: skip
    (
        (PERF,),
        "not reached within {:g}× | {:+.2f}%; {:+.2f}%; {:+.2f}%; {:+.2f}% | {}, {}, {}, {} |",
        lambda: (
            [load("predict")["tokens_to_target"]["streaming_h50_avg_topk3_int2_senders"]["not_reached_within"]]
            + [
                load("predict")["tokens_to_target"][v][k]
                for k in ("gap_pct", "seeds")
                for v in ("streaming_h10_avg_topk1_int2", TOP1, TOP3, "streaming_h50_avg_topk3_int2_senders")
            ]
        ),
    ),  # fmt: skip
    ((PERF,), "| +0.69% | {} |", lambda: [load("predict")["tokens_to_target"]["acco"]["seeds"]]),
    (
        (PERF,),
        "(lr {}×)",
        lambda: [{0.5: "½"}[load("predict")["tokens_to_target"]["streaming_h50_avg"]["lr_multiple"]]],
    ),
    # the wire's bytes per element (wire.bytes_per_element, what the cost model and outer_bytes use)
    ((README, PERF), "{1:.0f}× fewer bytes", lambda: fewer_bytes(0.01)),
    ((DILOCO,), "| {:.4f} ({:.0f}×) |", lambda: fewer_bytes(0.01)),
    ((DILOCO,), "| {:.3f} ({:.0f}×) |", lambda: fewer_bytes(0.03)),
    ((DILOCO,), "| {:.3f} ({:.0f}×) |", lambda: fewer_bytes(0.1, "int4")),
    ((DILOCO,), "| {:.4f} ({:.0f}×) |", lambda: fewer_bytes(0.015)),
    ((PERF,), "0.03 ({1:.0f}×)", lambda: fewer_bytes(0.03)),
    ((DILOCO,), "in 2 bits: {1:.0f}× fewer bytes than bf16", lambda: fewer_bytes(0.03)),
    ((DILOCO,), "`topk = 0.01` ({1:.0f}×)", lambda: fewer_bytes(0.01)),
    # ACCO and ZeRO-1 against DDP 2026-11-26: ACCO's tokens
    (
        (PERF,),
        "two jobs per update, {:.2f}× the tokens",
        lambda: ttt("time_to_target_all", "a", "acco", "tokens_ratio"),
    ),
    # the ring on a connection per direction (2026-11-27): the probe's ratios to the ideal (markdown table, no JSON),
    # then setting b's speed on two connections (speed_b_two_connections) against one (speed_virtual_check)
    (
        (PERF,),
        "**{:.2f}–{:.2f}×** its ideal ({:.2f}–{:.2f}× on one)",
        lambda: [min(ring_ratios("**2**")), max(ring_ratios("**2**")), min(ring_ratios("1")), max(ring_ratios("1"))],
    ),
    (
        (PERF,),
        "ZeRO-1 {:.2f}× and ACCO {:.2f}× faster than on one",
        lambda: [
            load("speed_virtual_check")["settings"]["b"]["strategies"][s]["mean"]
            / load("speed_b_two_connections")["settings"]["b"]["strategies"][s]["mean"]
            for s in ("zero1", "acco")
        ],
    ),  # fmt: skip
    # one H100 (2026-11-22: gpu_mfu's 8B × 8 row, gpu_overlap) and the 2026-11-27 recheck on an H100 and an H200
    (
        (PERF,),
        "**{:.1%} MFU**, {:,.0f} tokens/s; ACCO's job {:.1%} under",
        lambda: (
            [
                next(r[k] for r in load("gpu_mfu") if r["layers"] == 8 and r["ac"] == "selective")
                for k in ("mfu", "tokens_per_s")
            ]
            + [load("gpu_overlap")["overlap"]]
        ),
    ),  # fmt: skip
    (
        (PERF,),
        "rechecked 2026-11-27: {:.1%}, {:.1%}; on one H200 {:.1%}, {:.1%}; torchtitan 0.2.2 {:.2f}× our tokens/s",
        lambda: [
            found("gpu_check_2026-11-27", "mfu")[0],
            found("gpu_check_2026-11-27", "overlap")[0],
            found("gpu_check_2026-11-27", "mfu")[1],
            found("gpu_check_2026-11-27", "overlap")[1],
            1 / found("gpu_check_2026-11-27", "tokens_per_s_ratio")[0],
        ],
    ),  # fmt: skip
    (
        (README,),
        "torchtitan 0.2.2 runs the same case at {:.2f}× our tokens/s",
        lambda: [1 / found("gpu_check_2026-11-27", "tokens_per_s_ratio")[0]],
    ),
    # fault-tolerant DiLoCo (2026-11-27): a replica killed every 5 minutes, then kills, cuts and freezes in turn
    ((README,), "costs the others {:.1%} of their speed", lambda: [1 - fault("fault_goodput_kills")["speed"]]),
    (
        (RELIABILITY,),
        "{:.1%} of the survivor's speed with replica 1 killed every 5 minutes",
        lambda: [fault("fault_goodput_kills")["speed"]],
    ),
    ((RELIABILITY,), "{:.2f} with kills, cuts and freezes", lambda: [fault("fault_goodput")["speed"]]),
    # Muon and SNOO against DDP-AdamW at equal tokens (2026-12-07)
    ((OPTIMIZERS,), "DDP with Muon ends {:.2f} ± {:.2f}% below", lambda: gap("muon_snoo_screen", "ddp_muon")),
    (
        (OPTIMIZERS,),
        "DDP with Muon does best at {:g}× AdamW's lr, inside a grid of {:g}–{:g}×",
        lambda: [muon_tuned_lr()["lr"] / 3e-3, min(muon_grid()), max(muon_grid())],
    ),
    ((OPTIMIZERS,), "and ends {:.2f} ± {:.2f}% below DDP-AdamW", lambda: gap(MUON_TUNED, "ddp_muon")),
    (
        (OPTIMIZERS,),
        "At {:g}× AdamW's lr DDP with Muon needs {:.3f} ± {:.3f}× DDP-AdamW's tokens",
        lambda: [tokens_row("ddp_muon")["lr_multiple"], *tokens("ddp_muon")],
    ),
    (
        (OPTIMIZERS,),
        "reaches it in at most {:.3f}× its tokens on every seed",
        lambda: [max(summary("ddp_muon_tokens", "ddp_muon", "tokens_to_target_ratio"))],
    ),
    ((OPTIMIZERS,), "ZeRO-1 with Muon ends {:+.3f} ± {:.3f}% from DDP with Muon", lambda: floor("muon_noise_floor")),
    ((DILOCO,), "it ended {:+.2f} ± {:.2f}% above DDP's loss", lambda: gap("muon_snoo_screen", "snoo_h10")),
    ((OPTIMIZERS,), "with Muon inside ends {:.2f} ± {:.2f}% below", lambda: gap("streaming_muon_screen", MUON_TOP3)),
    ((OPTIMIZERS,), "but {:+.2f}% above DDP-Muon", lambda: [muon_gap(MUON_TOP3)]),
    (
        (OPTIMIZERS,),
        "Uncompressed (bf16) it ends {:+.2f}% above DDP-Muon, where AdamW's ends {:+.2f}% above DDP",
        lambda: [muon_gap("streaming_h10_avg_muon", "streaming_muon_bf16_screen"), gap(TE, "streaming_h10_avg")[0]],
    ),
    (
        (OPTIMIZERS,),
        "needs {:.3f}× DDP-AdamW's tokens for its loss",
        lambda: [statistics.mean(summary("streaming_muon_tokens", MUON_TOP3, "tokens_to_target_ratio"))],
    ),
    (
        (OPTIMIZERS,),
        "Muon inside needs {:.3f}× DDP-AdamW's tokens, where AdamW's best at 4 replicas needs {:.3f}×",
        lambda: [
            summary("streaming_muon_r4_tokens", f"{TOP3}_warm100_muon_r4", "mean_tokens_to_target_ratio"),
            summary("diloco_r4_pier_warm100_budgets", "streaming_h10_pier_warm100_r4", "mean_tokens_to_target_ratio"),
        ],
    ),
    # DiLoCo's wire table: loss vs DDP at equal tokens, and paired against bf16 (2026-11-27 to 11-29)
    ((DILOCO,), "| 2 | {:+.2f} ± {:.2f}% (5 seeds) |", lambda: gap(TE, "streaming_h10_avg")),
    (
        (DILOCO,),
        "| {:+.2f} ± {:.2f}% (5 seeds) | {} ± {} points |",
        lambda: gap(TE, "streaming_h10_avg_topk10_int4") + paired(TE, "streaming_h10_avg_topk10_int4"),
    ),
    (
        (DILOCO,),
        "| {:+.2f} ± {:.2f}%; **{:+.2f} ± {:.2f}%** (5 seeds) | {} ± {}; **{} ± {} points** |",
        lambda: (
            gap(TE, "streaming_h10_avg_topk3_int2")
            + gap("diloco_topk3_senders", TOP3)
            + paired(TE, "streaming_h10_avg_topk3_int2")
            + paired("diloco_topk3_senders", TOP3)
        ),
    ),  # fmt: skip
    (
        (DILOCO,),
        "| {:+.2f} ± {:.2f}%; {:+.2f} ± {:.2f}%; **{:+.2f} ± {:.2f}%** (5 seeds) "
        "| {} ± {}; {} ± {}; **{} ± {} points** |",
        lambda: (
            gap(TE, "streaming_h10_avg_topk1_int2")
            + gap(OUTER2, "streaming_h10_avg_topk1_int2_outer2")
            + gap("diloco_topk1_senders_budgets", TOP1)
            + paired(TE, "streaming_h10_avg_topk1_int2")
            + paired(OUTER2, "streaming_h10_avg_topk1_int2_outer2", OUTER2)
            + paired("diloco_topk1_senders_budgets", TOP1, digits=2)
        ),
    ),  # fmt: skip
    (
        (DILOCO,),
        "| {:+.2f} ± {:.2f}% (5 seeds) | {} ± {} points |",
        lambda: (
            gap("diloco_topk1p5_tuned", "streaming_h10_avg_topk1p5_int2")
            + paired("diloco_topk1p5_tuned", "streaming_h10_avg_topk1p5_int2", "diloco_r4_token_efficiency")
        ),
    ),
    (
        (DILOCO,),
        "{:.3f} ± {:.3f}× DDP's tokens (1%: {:.2f}×, over all {:.2f}×)",
        lambda: tokens(TOP3) + tokens(TOP1)[:1] + tokens("streaming_h10_avg_topk1_int2")[:1],
    ),
    # 4 replicas at 3%: over senders (the floor), after the warm start, over all replicas, bf16, no floor
    (
        (DILOCO,),
        "at 3%: {:+.2f}% at equal tokens ({:+.2f}% after `warm_start = 100`), over all {:+.2f}%, bf16 {:+.2f}% "
        "(no floor: {:+.1f}%)",
        lambda: [
            summary(t, v, "mean_gap_pct")
            for t, v in (
                ("diloco_topk3_r4_floor", "streaming_h10_avg_topk3_int2_senders_r4"),
                ("diloco_r4_senders_warm100", "streaming_h10_avg_topk3_int2_senders_warm100_r4"),
                ("diloco_topk3_r4", "streaming_h10_avg_topk3_int2_r4"),
                ("diloco_topk3_r4", "streaming_h10_avg_r4"),
                ("diloco_topk3_r4", "streaming_h10_avg_topk3_int2_senders_r4"),
            )
        ],
    ),  # fmt: skip
    (
        (DILOCO,),
        "in bf16, 4 needed {:.2f}× DDP's tokens, 2 {:.2f}×); with 4,",
        lambda: tokens("streaming_h10_avg_r4")[:1] + tokens("streaming_h10_avg")[:1],
    ),
    ((DILOCO,), "bring it to {:.2f}×", lambda: tokens("streaming_h10_pier_warm100_r4")[:1]),
    (
        (DILOCO,),
        "{:+.2f}% at equal tokens, {:.3f}× after `warm_start = 100`",
        lambda: [
            summary("diloco_topk3_senders_warm100", TOP3, "mean_gap_pct"),
            summary("diloco_topk3_senders_warm100", TOP3 + "_warm100", "mean_tokens_to_target_ratio"),
        ],
    ),  # fmt: skip
    # ACCO's results table (final loss vs DDP, sd; the tokens predict reads) and its time to DDP's loss (2026-11-26)
    (
        (ACCO,),
        "| acco | {:+.2f} ± {:.2f}%, {:+.2f} ± {:.2f}% | | 2026-11-23, AMD EPYC, {} |",
        lambda: (
            [
                load(t)["summary"][lr]["acco"][k]
                for t, lr in (("token_efficiency_1000_half_lr", "0.00075"), ("token_efficiency_1000", "0.0015"))
                for k in ("mean_gap_pct", "sd_gap_pct")
            ]
            + [len(load("token_efficiency_1000")["meta"]["seeds"])]
        ),
    ),  # fmt: skip
    (
        (ACCO,),
        "| acco | {:+.2f} ± {:.2f}% | **{:.3f} ± {:.3f}** | 2026-11-25, AMD EPYC, {}; "
        "tokens 2026-11-26, Intel Xeon, {} |",
        lambda: (
            [summary("acco_share875_10seeds_lr3e-3", "acco", k) for k in ("mean_gap_pct", "sd_gap_pct")]
            + tokens("acco")
            + [
                len(load("acco_share875_10seeds_lr3e-3")["meta"]["seeds"]),
                load("predict")["tokens_to_target"]["acco"]["seeds"],
            ]
        ),
    ),  # fmt: skip
    (
        (ACCO,),
        "| {:+.2f} ± {:.2f}% | {:.3f} ± {:.3f} | 2026-11-25, AMD EPYC, {}; tokens 2026-11-24, {} |",
        lambda: (
            [summary("acco_share875_30seeds_lr3e-3", "acco_share875", k) for k in ("mean_gap_pct", "sd_gap_pct")]
            + tokens("acco_share875")
            + [
                len(load("acco_share875_30seeds_lr3e-3")["meta"]["seeds"]),
                load("predict")["tokens_to_target"]["acco_share875"]["seeds"],
            ]
        ),
    ),  # fmt: skip
    (
        (ACCO,),
        "reached DDP's loss in {:.1f}–{:.1f}× DDP's time",
        lambda: [1 / vs_ddp("time_to_target_all", s, "acco")[0] for s in "ab"],
    ),
    # where each strategy wins (parallelism.md): virtual compute, the ring on two connections (2026-11-27)
    ((PARALLEL,), "the synchronous update, {:.2f}× the tokens", lambda: tokens("acco")[:1]),
    (
        (PARALLEL,),
        "| {:.2f}× sooner than DDP; where DDP does not fit, {:.2f}× sooner than ZeRO-1, the fastest that does |",
        lambda: acco_virtual(("ddp",)) + acco_virtual(("zero1",), HALF_4NODES),
    ),
    (
        (PARALLEL,),
        "| ddp, zero1, acco within {:.0%} |",
        lambda: [
            max(ttt(REGIME, "r1608mbit", s, "mean")[0] for s in ("ddp", "zero1", "acco"))
            / min(ttt(REGIME, "r1608mbit", s, "mean")[0] for s in ("ddp", "zero1", "acco"))
            - 1
        ],
    ),  # fmt: skip
    ((PARALLEL,), "ACCO {:.2f}× DDP at ¾", lambda: speed_ratio(REGIME, "r536mbit", "acco", "ddp")),
    ((PARALLEL,), "{:.2f}× sooner than ZeRO-1 where communication ≈ 3× compute", lambda: ttt(AB, "b", TOP3, "sooner")),
    (
        (PARALLEL,),
        "to DDP's loss {:.2f}× sooner than ZeRO-1 inside, {:.1f}× than ACCO alone; DDP inside {:.2f}× sooner",
        lambda: [
            two_level("streaming_h10_avg_acco") / two_level("streaming_h10_avg_zero1"),
            two_level("streaming_h10_avg_acco") / two_level("acco"),
            two_level("streaming_h10_avg") / two_level("streaming_h10_avg_acco"),
        ],
    ),  # fmt: skip
    (
        (PARALLEL,),
        "{:.1f}–{:.1f}× faster with one node 4× slower",
        lambda: sorted(speed_ratio("speed", "c", f"{s}_balanced", s)[0] for s in ("ddp", "zero1", "acco"))[::2],
    ),  # fmt: skip
    (
        (PARALLEL,),
        "on CPU gloo {:.1f}× ZeRO-1",
        lambda: [statistics.fmean(speed_ratio(REGIME, r, "zero1", "fsdp")[0] ** -1 for r in load(REGIME)["settings"])],
    ),
    # performance.md's remaining rows: virtual compute, the batch of 8 (2026-12-06), whole runs validated (2026-11-26)
    (
        (PERF,),
        "ACCO **{:.2f}× sooner than DDP** (2 nodes); with DDP over a memory budget **{:.2f}× sooner than ZeRO-1**",
        lambda: acco_virtual(("ddp",)) + acco_virtual(("zero1",), HALF_4NODES),
    ),
    (
        (README,),
        "{:.3f}× DDP's tokens, {} seeds)",
        lambda: tokens("acco")[:1] + [load("predict")["tokens_to_target"]["acco"]["seeds"]],
    ),
    (
        (PERF,),
        "yet {:.2f}× and {:.2f}× as soon at 180 and 60 Mbit/s",
        lambda: [batch8_sooner(s) for s in "ab"],
    ),
    (
        (PERF,),
        "at 8 needs {:.3f} ± {:.3f}× DDP-at-8's tokens ({:.3f}× both at 16)",
        lambda: [
            summary("diloco_batch_tuned", TOP3, "mean_tokens_to_target_ratio"),
            T95[4] * summary("diloco_batch_tuned", TOP3, "sd_tokens_to_target_ratio") / 5**0.5,
            summary("diloco_global_batch_moments_h10", TOP3, "mean_tokens_to_target_ratio"),
        ],
    ),  # fmt: skip
    (
        (PERF,),
        "whole runs within {}% and {}% of the prediction",
        lambda: [f"{100 * (p / m - 1):.1f}".replace("-", "−") for m, p in validated_runs()],
    ),
    # the rest of DiLoCo's results and tuning paragraphs
    (
        (DILOCO,),
        "the noise floor, ZeRO-1, {:.3f} ± {:.3f}×",
        lambda: list(mean_ci(summary("diloco_tuned_token_efficiency", "zero1", "tokens_to_target_ratio"))),
    ),
    (
        (DILOCO,),
        "on GPT-Neo tiny (bf16) {:.3f} ± {:.3f}×",
        lambda: list(
            mean_ci(summary("tiny_streaming_h10_budgets", "streaming_h10_avg", "tokens_to_target_ratio", "0.0015"))
        ),
    ),  # fmt: skip
    (
        (DILOCO,),
        "H 50 (bf16, lr ½×) {:.3f} ± {:.3f}×, the top 3% not within {:g}×",
        lambda: (
            tokens("streaming_h50_avg")
            + [load("predict")["tokens_to_target"]["streaming_h50_avg_topk3_int2_senders"]["not_reached_within"]]
        ),
    ),
    ((DILOCO,), "the top 3%: {:.3f}×)", lambda: [summary("diloco_clip_tuned", TOP3, "mean_tokens_to_target_ratio")]),
    (
        (DILOCO,),
        "gains {:.1f} ± {:.1f} points on a DDP using it too, whose loss it raises {:.0f}%",
        lambda: slow_momentum_gain() + [summary("diloco_slow_momentum_tuned", "ddp_slow99", "mean_gap_pct")],
    ),
    (
        (DILOCO,),
        "tokens to DDP's loss by {:+.3f} ± {:.3f}×",
        lambda: list(
            mean_ci(
                [
                    a - b
                    for a, b in zip(
                        summary("diloco_global_batch_moments_h10", TOP3 + "_gbm", "tokens_to_target_ratio"),
                        summary("diloco_global_batch_moments_h10", TOP3, "tokens_to_target_ratio"),
                    )
                ]
            )
        ),
    ),  # fmt: skip
    (
        (DILOCO,),
        "bf16 {:+.2f}%, {:+.1f} and {:.3f}× at H 1; at the tuned batch of 8 H 1 needs {:.3f}×, H 10 {:.3f}×, "
        "{:.3f}× after",
        lambda: [
            load("predict")["tokens_to_target"]["streaming_h10_avg"]["gap_pct"],
            summary("diloco_h1_floor_screen", "diloco_h1_avg", "mean_gap_pct"),
            summary("diloco_h1_floor_screen", "diloco_h1_avg", "mean_tokens_to_target_ratio"),
            summary("diloco_h1_floor_b8", "diloco_h1_avg", "mean_tokens_to_target_ratio"),
            summary("diloco_batch_tuned", TOP3, "mean_tokens_to_target_ratio"),
            summary("diloco_warm200_b8", TOP3 + "_warm200", "mean_tokens_to_target_ratio"),
        ],
    ),  # fmt: skip
    (
        (DILOCO,),
        "(whole runs; bf16 {:.2f}×)",
        lambda: [
            statistics.fmean(r["sooner_than"]["zero1_balanced"] for r in load("end_to_end_bm_recalibrated")["results"])
        ],
    ),  # fmt: skip
    # reliability.md: the preemption agreement's cost (2026-11-23)
    (
        (RELIABILITY,),
        "the agreement cost {:.2f}–{:.2f} ms per update",
        lambda: [load("preemption_agreement")["rows"][f"{s}_async"]["median_ms"] for s in ("idle", "busy")],
    ),
    # ACCO's bf16 estimate in whole runs of 160 updates (time_to_loss, settings a and b: both round to the same)
    *[
        (
            (ACCO,),
            "cut ACCO's time per update by {:.0%} in whole runs of 160 updates, for {:+.2f}% final loss",
            lambda setting=setting: bf16_estimate(setting),
        )
        for setting in "ab"
    ],
    # the mixed figure's caption: the slow node's factor, as the figures command titled it
    (
        (README,),
        "The same with one node {}× slower",
        lambda: re.findall(r"one ([\d.]+)× slower", load("figures")["figures"]["time_to_loss_mixed"][0]),
    ),
    # the links the runs were measured on, from each setting's plan
    ((README,), "a slower link still ({:.0f} Mbit/s:", lambda: [link_mbit(E, "e")]),
    ((PERF, DILOCO), "at {:.1f} Mbit/s", lambda: [link_mbit(E, "e")]),
    ((PERF,), "communication ≈ 3× compute ({:.0f} Mbit/s here)", lambda: [link_mbit(AB, "b")]),
    ((PERF,), "| 2 nodes at {:.0f} and {:.0f} Mbit/s |", lambda: [link_mbit("time_to_target_all", s) for s in "ab"]),
]


def page_text(page: str) -> str:
    return re.sub(r"\s+", " ", (ROOT / page).read_text())


@pytest.mark.parametrize("pages, text, numbers", NUMBERS, ids=[f"{i}:{n[1]}" for i, n in enumerate(NUMBERS)])
def test_each_benchmark_number_in_the_prose_is_the_one_its_json_holds(pages, text, numbers):
    written = text.format(*numbers())
    for page in pages:
        assert written in page_text(page), f"{page} should say {written!r} (from bench_results/ JSON)"


def test_zero1_is_the_fastest_synchronous_strategy_where_the_readme_says_so():
    # README and docs call ZeRO-1 the best synchronous baseline in the 2026-11-29 runs: DDP ran at 0.97-1.00× its
    # speed there (the 2026-11-26 rows, ZeRO-1 0.66-0.73× of DDP, ran the sharded ring on one connection)
    for table, settings in ((AB, "ab"), (E, "e")):
        for setting in settings:
            assert load(table)["settings"][setting]["best_baseline"] == "zero1"
    ddp = [load(AB)["settings"][s]["strategies"]["ddp"]["speed_vs_best"] for s in "ab"]
    assert f"DDP {min(ddp):.2f}–{max(ddp):.2f}× its speed" in page_text(README)
    assert statistics.fmean(ddp) < 1


def test_predict_runs_ddp_muon_at_its_tuned_lr_and_the_tokens_measured_there():
    row, (mean, ci) = tokens_row("ddp_muon"), mean_ci(summary(MUON_TUNED, "ddp_muon", "tokens_to_target_ratio"))
    assert row["source"] == f"bench_results/{MUON_TUNED}.md" and row["lr_multiple"] == muon_tuned_lr()["lr"] / 3e-3
    assert not any(summary(MUON_TUNED, "ddp_muon", "ratio_is_upper_bound"))  # every seed measured, none a bound
    assert (row["mean"], row["ci95"]) == (round(mean, 4), round(ci, 4))


def test_the_figures_md_names_its_sources_and_command():
    text = (ROOT / "bench_results" / "figures.md").read_text()
    assert "Command: `python -m benchmarks figures`" in text and f"`{AB}.json`" in text


def test_the_figures_command_draws_both_figures_from_saved_results_and_names_the_pick(tmp_path):
    import shutil

    from benchmarks import figures

    for name in (figures.CALIBRATION, *figures.TABLES, figures.MIXED_SPEED, figures.MIXED_RUNS):
        shutil.copy(ROOT / "bench_results" / f"{name}.json", tmp_path)
    assert figures.main(["--out", str(tmp_path)]) == 0
    assert (tmp_path / "time_to_loss_by_link.png").stat().st_size > 10_000 and (
        tmp_path / "time_to_loss_mixed.png"
    ).exists()
    data = json.loads((tmp_path / "figures.json").read_text())["figures"]
    title, curves, points = data["time_to_loss_by_link"]
    # the soonest on a slow link is Streaming DiLoCo with the top 3% in 2 bits, on a fast one a synchronous strategy
    assert (
        title.startswith("Pick Streaming DiLoCo, top 3%, 2-bit up to") and "DDP or ZeRO-1 (synchronous) above" in title
    )
    assert set(curves) == {figures.SYNCHRONOUS, "Streaming DiLoCo, bf16", "Streaming DiLoCo, top 3%, 2-bit",
                           "Streaming DiLoCo, top 1%, 2-bit"}  # fmt: skip
    top3_b = next(p for p in points if p[4] == "Streaming DiLoCo, top 3%, 2-bit" and p[1] < 1e8)
    row = load(AB)["settings"]["b"]["strategies"][TOP3]
    assert top3_b[2] == pytest.approx(row["seconds_per_update"] * row["tokens_ratio"] * 1000 / 60)
    assert "| measured / model |" in (tmp_path / "figures.md").read_text()


def test_plots_name_strategies_plainly_and_their_panels_by_the_link():
    from benchmarks.common import panel_title, plain_name

    assert plain_name(TOP3) == "Streaming DiLoCo, top 3%, 2-bit"
    assert plain_name("streaming_h10_avg_topk1_int2") == "Streaming DiLoCo, top 1%, 2-bit, mean over all"
    assert plain_name("zero1_balanced") == "ZeRO-1, balanced" and plain_name("diloco_h50") == "DiLoCo H 50, Nesterov"
    assert panel_title("b", "2 nodes on 10.77.0.0/24, links 60.077mbit") == "2 nodes, 60.1 Mbit/s (setting b)"
