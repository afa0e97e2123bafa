"""`python -m torchacco predict`: the pick first, at the measured configurations, against the yardstick's saved
measurements; and every recipe in train_configs/ at a measured configuration or saying why not."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchacco.config import Optimizer, load_config
from torchacco.errors import run_cli
from torchacco.parallel.registry import strategies
from torchacco.planning import cost_model as cm
from torchacco.planning import dry_run, predict

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench_results"
CONFIGS = sorted((ROOT / "train_configs").glob("*.toml"))
DIFFERS = re.compile(r"^# differs from measured: (\S.*)$", re.M)  # a recipe's reason, in its header
PICK = re.compile(r"^Pick: (.+), ([0-9.]+)× sooner than the best synchronous strategy that fits \((.+)\): "
                  r"[0-9.]+ (min|h|days) to the loss against [0-9.]+ (min|h|days)\.$")  # fmt: skip
PICK_SYNCHRONOUS = re.compile(r"^Pick: (.+), the best synchronous strategy that fits: [0-9.]+ (?:min|h|days) to the "
                              r"loss\.$")  # fmt: skip
SYNCHRONOUS = ("ddp", "zero1", "fsdp", "hsdp")
# The emulated cluster's rank: GPT-Neo debug (1,024-token vocabulary), 8 sequences of 128 per update in 2
# micro-batches, fp32 on the wire (CPU), the compute of the calibration the speed runs used
EMULATED = [*"--model gpt_neo --flavor debug --vocab-size 1024 --nodes 2 --gpus-per-node 1 --seq-len 128".split(),
            *"--local-batch 4 --micro-batches 2 --comm-bytes 4".split(),
            "--calibration", "bench_results/calibration_2026-11-28.json"]  # fmt: skip


def run(capsys, *argv: str) -> subprocess.CompletedProcess:
    code = run_cli(lambda: predict.main(list(argv)))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def measured_label(path: Path) -> str | None:
    """The measured entry a recipe runs, as predict's row for it finds it: for DiLoCo its outer step measured at its
    replicas, else its strategy's measured ratio; either with the recipe's optimizer."""
    cfg = load_config(["--config", str(path)])
    label, replicas, optimizer = dry_run.strategy_label(cfg), cfg.parallelism.replicas, cfg.optimizer.name
    if replicas > 1:
        source = cm.diloco_token_source(label, replicas, cfg.diloco, optimizer=optimizer)
    else:
        source = cm.token_source(label, optimizer=optimizer)
    return source if source and "mean" in cm.measured_entry(source) else None


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_recipe_runs_a_measured_configuration_or_says_why(path):
    reason = DIFFERS.search(path.read_text(encoding="utf-8"))
    label = measured_label(path)
    assert label or reason, f"{path.name}: not a measured configuration; add '# differs from measured: <why>'"
    assert not (label and reason), f"{path.name} runs {label}, a measured configuration: drop its reason"


def test_the_recipe_check_fails_on_an_unmeasured_outer_step(tmp_path):
    text = (ROOT / "train_configs/default_streaming_diloco.toml").read_text()
    assert (
        measured_label(ROOT / "train_configs/default_streaming_diloco.toml") == "streaming_h10_avg_topk3_int2_senders"
    )
    (tmp_path / "h100.toml").write_text(text.replace("sync_every = 10", "sync_every = 100"))
    assert measured_label(tmp_path / "h100.toml") is None
    assert measured_label(ROOT / "train_configs/llama3_8b_streaming_diloco.toml") == "streaming_h10_pier_warm100_r4"
    # top 3% 2-bit at 4 replicas was measured with Muon and the warm start, the 8B recipe's settings, and no other way
    sparse = ROOT / "train_configs/llama3_8b_sparse_diloco.toml"
    assert measured_label(sparse) == "streaming_h10_avg_topk3_int2_senders_warm100_muon_r4"
    (tmp_path / "adamw.toml").write_text(sparse.read_text().replace('name = "muon"', 'name = "adamw"'))
    assert measured_label(tmp_path / "adamw.toml") is None
    (tmp_path / "r4.toml").write_text(text.replace("replicas = 2", "replicas = 4"))
    assert measured_label(tmp_path / "r4.toml") is None


def yardstick(name: str, setting: str) -> dict[str, tuple[float, float]]:
    """A saved time-to-target table's setting: strategy -> (× sooner than the best synchronous baseline, its 95%
    interval)."""
    strategies = json.loads((RESULTS / f"{name}.json").read_text())["settings"][setting]["strategies"]
    adamw = {s: r for s, r in strategies.items() if not s.endswith("_muon")}  # (the AdamW rows predict is asked for)
    return {s: (r["sooner"], r["sooner_ci95"]) for s, r in adamw.items() if r.get("sooner") is not None}


def mixed_and_slow() -> tuple[dict[str, tuple[float, float]], float, str]:
    """Setting bm: the baselines at DDP's tokens from their speed, balanced Streaming DiLoCo (top 3%) from whole
    runs."""
    speed = json.loads((RESULTS / "speed_bm_senders.json").read_text())["settings"]["bm"]
    best = speed["strategies"][speed["best_baseline"]]["mean"]
    sooner = {s: (best / speed["strategies"][s]["mean"], 0.0) for s in ("ddp", "ddp_balanced", "zero1_balanced")}
    runs = json.loads((RESULTS / "end_to_end_bm_senders.json").read_text())["results"]
    seeds = [r["sooner_than"][speed["best_baseline"]] for r in runs]
    mean = sum(seeds) / len(seeds)
    ci = 2.776 * (sum((x - mean) ** 2 for x in seeds) / (len(seeds) - 1) / len(seeds)) ** 0.5  # t(4), 95%
    sooner["streaming_h10_avg_topk3_int2_senders_balanced"] = (mean, ci)
    return sooner, speed["measured_slowdown"], speed["plan"]


SETTINGS = {  # setting -> (its saved time-to-target table, the link rate in its plan)
    "a": ("time_to_target_topk3_senders_ab", "a"),
    "b": ("time_to_target_topk3_senders_ab", "b"),
    "e": ("time_to_target_muon_e", "e"),  # top 1% and top 3% side by side
}


@pytest.mark.parametrize("setting", [*SETTINGS, "bm"])
def test_the_pick_is_the_yardsticks_soonest_or_within_its_interval(setting):
    """Given the emulated cluster's rate, its measured compute per update and slow factor, predict picks, of the
    strategies the yardstick ran there (stepping AdamW), its soonest to DDP's loss or one whose interval reaches it."""
    if setting == "bm":
        measured, slow, plan = mixed_and_slow()
    else:
        name, key = SETTINGS[setting]
        measured, slow = yardstick(name, key), 1.0
        plan = json.loads((RESULTS / f"{name}.json").read_text())["settings"][key]["plan"]
    rate = re.search(r"links ([0-9.]+mbit)", plan).group(1)
    args = predict.build_parser().parse_args([*EMULATED, "--bandwidth", rate, "--slow-factor", f"{slow:g}",
                                              "--optimizer", "adamw"])  # fmt: skip
    rows, ttl, fits, *_ = predict.evaluate(args)
    inside_ddp = lambda row: ("parallelism", "data_parallel", "ddp") in row.settings  # the yardstick's inner strategy
    as_run = {(row.group if inside_ddp(row) else None) if row.group else name: name for name, row in rows.items()}
    candidates = {label: as_run[label] for label in measured if label in as_run}
    assert len(candidates) == len(measured) >= 3, (sorted(measured), sorted(as_run))
    picked = min(candidates, key=lambda label: ttl[candidates[label]])
    assert ttl[candidates[picked]] == min(t for t in ttl.values() if t is not None)  # its pick overall is one of them
    soonest = max(measured, key=lambda label: measured[label][0])
    (mean, ci), (best, best_ci) = measured[picked], measured[soonest]
    assert picked == soonest or mean + ci >= best - best_ci, (setting, picked, soonest, measured)
    assert fits[candidates[picked]]


@pytest.mark.parametrize("bandwidth", ["1gbit", "100gbit"])
def test_the_8b_example_names_a_pick_that_fits_with_its_factor_first(capsys, bandwidth):
    """At 1 Gbit/s DiLoCo, N× sooner than the best synchronous strategy; at 100 Gbit/s that strategy itself (with
    Muon's tokens)."""
    out = run(capsys, *"--model llama3 --flavor 8B --nodes 4 --gpus-per-node 8 --bandwidth".split(), bandwidth)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    m = PICK.match(first) if bandwidth == "1gbit" else PICK_SYNCHRONOUS.match(first)
    assert m, first
    row = next(line for line in out.stdout.splitlines() if line.startswith(f"| {m.group(1)} |"))
    assert "does not fit" not in row and row.split("|")[-3].strip() == "1.00×"
    if bandwidth == "1gbit":
        baseline = next(line for line in out.stdout.splitlines() if line.startswith(f"| {m.group(3)} |"))
        assert baseline.split("|")[-3].strip() == f"{float(m.group(2)):.2f}×"
    assert m.group(m.lastindex if bandwidth == "100gbit" else 3).removesuffix(" + Muon") in SYNCHRONOUS
    assert "[parallelism]" in out.stdout.split("\n\n")[0]  # the config lines that run it, before the table
    assumptions = out.stdout[out.stdout.index("Assumptions:") :].strip().splitlines()
    assert len(assumptions) == 3 and "model size" in assumptions[1] and predict.DOCS in assumptions[2]
    assert re.search(r"\| \d+ s \|", out.stdout) is None  # times in minutes, hours or days
    # a row that does not fit shows only as a registered strategy's own, as the footer says
    unfit = [line.split("|")[1].strip() for line in out.stdout.splitlines() if "| does not fit |" in line]
    assert unfit and set(unfit) <= set(strategies()) and "not fitting (a strategy's own row shows anyway)" in out.stdout
    # the time to the loss: DDP's tokens to it × the row's measured ratio at the row's tokens/s (and a warm start's
    # synchronous updates beside)
    args = predict.build_parser().parse_args(["--bandwidth", bandwidth])
    rows, ttl, *_ = predict.evaluate(args)
    target = 10_000 * rows["ddp"].pred["tokens_per_update"]
    for name, ratio in (("zero1", 1.0), ("acco", cm.token_table()["tokens_to_target"]["acco"]["mean"])):
        assert ttl[name] == pytest.approx(ratio * target / rows[name].pred["tokens_per_s"])
    warm = rows["Streaming DiLoCo, bf16, warm start and Nesterov (fsdp inside)"]
    assert warm.extra_s > 0 and ttl["Streaming DiLoCo, bf16, warm start and Nesterov (fsdp inside)"] == pytest.approx(
        1.3555 * target / warm.pred["tokens_per_s"] + warm.extra_s
    )


def test_muon_rows_take_the_ratios_measured_with_muon_and_the_table_shows_the_sooner(capsys):
    """--optimizer best (the default): every row with AdamW and with Muon, each at the tokens measured with that
    optimizer (ZeRO-1's and FSDP's: DDP-Muon's) and Newton–Schulz's time; of a strategy's two rows the table shows the
    sooner. --optimizer adamw: no Muon row."""
    args = predict.build_parser().parse_args(["--bandwidth", "100gbit"])
    rows, ttl, fits, *_ = predict.evaluate(args)
    target, muon = 10_000 * rows["ddp"].pred["tokens_per_update"], cm.token_table()["tokens_to_target"]["ddp_muon"]
    assert muon["optimizer"] == "muon" and muon["mean"] < 1
    for name in ("zero1", "fsdp", "hsdp"):
        row = rows[f"{name} + Muon"]
        assert row.source == "ddp_muon" and ("optimizer", "name", "muon") in row.settings
        # measured at a multiple of the recipe's tuned lr: its config lines run that multiple of the default's
        assert ("optimizer", "lr", Optimizer().lr * muon["lr_multiple"]) in row.settings and muon["lr_multiple"] != 1
        assert not any(key == "lr" for _, key, _ in rows[name].settings)
        assert ttl[f"{name} + Muon"] == pytest.approx(muon["mean"] * target / row.pred["tokens_per_s"])
        assert row.pred["tokens_per_s"] < rows[name].pred["tokens_per_s"]  # Newton–Schulz and its gathers
        shown = [n for n in (name, f"{name} + Muon") if predict.shown_by_default(n, rows, ttl, fits)]
        assert shown == [min((name, f"{name} + Muon"), key=ttl.get)], (name, shown)
    two = predict.evaluate(predict.build_parser().parse_args(["--nodes", "2", "--flavor", "1B"]))[0]
    measured = [n for n, r in two.items() if r.source == "streaming_h10_avg_topk3_int2_senders_muon"]
    assert measured and all(n.endswith(" + Muon") for n in measured)  # Muon inside, at 2 replicas
    only = predict.evaluate(predict.build_parser().parse_args(["--bandwidth", "100gbit", "--optimizer", "adamw"]))[0]
    assert not any(name.endswith(" + Muon") for name in only) and set(only) < set(rows)


def test_the_default_rows_are_the_measured_choices_and_all_adds_the_rest(capsys):
    base = "--model llama3 --flavor 1B --nodes 2 --gpus-per-node 8 --bandwidth 1gbit".split()
    rows = lambda out: [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")][1:]
    default, every_out = rows(run(capsys, *base).stdout), run(capsys, *base, "--all").stdout
    every = rows(every_out)
    assert not any("balanced" in r or "adaptive" in r or r in ("dpu", "wp", "acco_bf16_estimate") for r in default)
    assert {"acco_adaptive_uncapped", "ddp_balanced", "dpu", "Streaming DiLoCo, bf16 (ddp inside)"} <= set(every)
    # past adaptive ACCO's default cap (2× the batch) a row's tokens/s is of a batch no run had: its growth instead
    cells = {r.split("|")[1].strip(): r.split("|")[3].strip() for r in every_out.splitlines() if r.startswith("| ")}
    assert re.fullmatch(r"— \(\d+× the batch\)", cells["acco_adaptive_uncapped"]), cells["acco_adaptive_uncapped"]
    assert re.fullmatch(r"[\d,]+", cells["acco_adaptive"]) and re.fullmatch(r"[\d,]+", cells["ddp"])
    assert len([r for r in default if r.startswith("Streaming DiLoCo, top 3%")]) == 1  # the soonest inside
    # ZeRO-1 and FSDP inside DiLoCo take the ratio measured with DDP inside
    ratio = lambda inner: next(
        line
        for line in every_out.splitlines()
        if line.startswith(f"| Streaming DiLoCo, top 3%, 2-bit ({inner} inside) |")
    ).split("|")[4]
    assert ratio("ddp") == ratio("zero1") == ratio("fsdp") == " 1.135 ± 0.059 "
    slow = rows(run(capsys, *base, "--slow-factor", "3").stdout)
    assert any(r.startswith("zero1_balanced") for r in slow) and any("inside, balanced)" in r for r in slow)


def test_a_diloco_flag_row_is_measured_only_at_a_measured_outer_step(capsys):
    base = "--model llama3 --flavor 1B --nodes 2 --gpus-per-node 8 --bandwidth 1gbit --optimizer adamw".split()
    measured = "--sync-every 10 --fragments 2 --overlap-steps 1 --eager --outer-lr 1 --outer-momentum 0".split()
    row = lambda out, name: next(r for r in out.splitlines() if r.startswith(f"| {name} |"))
    out = run(capsys, *base, *measured, "--outer-dtype", "int2", "--topk", "0.03").stdout
    assert "1.135 ± 0.059" in row(out, "diloco_h10 (fsdp inside, int2 top-k 0.03)")
    out = run(capsys, *base, *measured, "--outer-dtype", "int2", "--topk", "0.03", "--topk-mean", "replicas").stdout
    assert "not measured" in row(out, "diloco_h10 (fsdp inside, int2 top-k 0.03)")
    odd = run(capsys, *base, "--sync-every", "7", "--all")
    assert odd.returncode == 0 and "not measured" in row(odd.stdout, "diloco_h7 (ddp inside, bf16)")
    bad = run(capsys, "--nodes", "2", "--eager")
    assert bad.returncode == 1 and "[diloco] eager" in bad.stderr and "overlap_steps >= 1" in bad.stderr


def test_write_gives_a_config_that_loads_and_runs_the_pick(capsys, tmp_path):
    out = run(capsys, *EMULATED, "--bandwidth", "60mbit", "--slow-factor", "3", "--write", str(tmp_path / "p.toml"))
    assert out.returncode == 0, out.stderr
    cfg = load_config(["--config", str(tmp_path / "p.toml")])
    assert cfg.parallelism.replicas == 2 and cfg.diloco.topk == 0.03 and cfg.diloco.balance_replicas
    assert cfg.training.max_tokens > 0 and cfg.model.name == "gpt_neo" and cfg.job.cluster == "2x1"
    # without --config or --vocab-size the written file dry-runs the model predict evaluated, the flavor's vocabulary
    argv = "--model llama3 --flavor 1B --nodes 2 --bandwidth 1gbit --write".split()
    assert run(capsys, *argv, str(tmp_path / "r.toml")).returncode == 0
    work = predict.workload_and_hardware(predict.build_parser().parse_args(argv + ["x"]))[0]
    written = dry_run.plan(load_config(["--config", str(tmp_path / "r.toml")]), dry_run.Cluster(2, 8))
    assert written.params == work.params and written.args.vocab_size == 128256
    recipe = ROOT / "train_configs/llama3_8b_fsdp.toml"
    out = run(capsys, "--config", str(recipe), "--bandwidth", "1gbit", "--write", str(tmp_path / "q.toml"))
    assert out.returncode == 0, out.stderr
    cfg = load_config(["--config", str(tmp_path / "q.toml")])
    assert cfg.data.dataset == "datasets/pretrain" and cfg.parallelism.replicas == 4  # the recipe's, with the pick
    assert cm.measured_outer_step(cfg.diloco) in cm.MEASURED


def test_every_flag_has_help_with_its_default():
    text = " ".join(predict.build_parser().format_help().split())
    for action in predict.build_parser()._actions:
        assert action.help, action.option_strings
    assert "(default: 4)" in text and "(default: 100gbit)" in text and "--topk-mean" in text


@pytest.mark.integration
def test_predict_runs_as_a_command_and_refuses_mistakes_in_one_line(capsys):
    proc = subprocess.run([sys.executable, "-m", "torchacco", "predict", "--nodes", "2", "--flavor", "1B"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    first = proc.stdout.splitlines()[0] if proc.stdout else ""
    assert proc.returncode == 0 and (PICK.match(first) or PICK_SYNCHRONOUS.match(first)), proc.stdout + proc.stderr
    small = run(capsys, "--memory-gib", "1")
    assert small.returncode == 1 and "no strategy fits 1 GiB per GPU" in small.stderr
    mistakes = ((["--device", "TPU9"], "unknown --device"), (["--bandwidth", "lots"], "cannot read link rate"),
                (["--calibration", "nowhere.json"], "cannot read compute_per_update_s"))  # fmt: skip
    for argv, message in mistakes:
        bad = run(capsys, *argv)
        assert bad.returncode == 1 and bad.stderr.startswith("torchacco: error:") and message in bad.stderr, argv
    for value in ("-1", "inf", "nan"):
        bad = run(capsys, "--bucket-cap-mb", value)
        assert bad.returncode == 1 and bad.stderr.strip() == (
            f"torchacco: error: --bucket-cap-mb must be 0 (torch's default) or positive, got {value}"
        )
