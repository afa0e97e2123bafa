"""Time to target from its two parts: the tokens a strategy needs for DDP's final loss, interpolated between runs of
several budgets (each with its own cosine), times its measured time per update."""

import json
import math
import statistics

import pytest

from benchmarks import yardstick
from benchmarks.yardstick import table as ttt
from benchmarks.yardstick.tokens import budget_rows, updates_to_target


def test_the_budget_for_a_target_is_interpolated_between_the_finished_runs_that_bracket_it():
    finals = {1000: 4.0, 1250: 3.9, 1500: 3.85}
    assert updates_to_target(3.95, finals) == (pytest.approx(1125), False)  # halfway from 1000 to 1250
    assert updates_to_target(3.86, finals) == (pytest.approx(1450), False)
    assert updates_to_target(4.2, finals) == (1000.0, True)  # the smallest budget already reaches it: a bound
    assert updates_to_target(3.5, finals) == (None, False)  # no budget reaches it
    # a noisy, non-monotone series: the first bracketing pair counts
    assert updates_to_target(3.95, {1000: 4.0, 1250: 3.9, 1500: 3.97})[0] == pytest.approx(1125)


def test_budget_rows_pair_each_seed_with_ddps_final_loss_of_that_seed():
    by_budget = {1000: [4.1, 4.0], 1500: [3.9, 3.7]}
    rows = budget_rows(by_budget, ddp_finals=[4.0, 3.8], updates=1000)
    assert rows["tokens_to_target_ratio"] == [pytest.approx(1.25), pytest.approx(1 + 0.5 * 0.2 / 0.3)]
    assert rows["ratio_is_upper_bound"] == [False, False]
    assert rows["mean_tokens_to_target_ratio"] == pytest.approx((1.25 + 1 + 1 / 3) / 2)
    missing = budget_rows(by_budget, ddp_finals=[3.0, 3.8], updates=1000)
    assert missing["tokens_to_target_ratio"][0] is None and missing["mean_tokens_to_target_ratio"] is None


def test_time_to_target_multiplies_tokens_by_speed_against_the_best_baseline(tmp_path):
    tokens = {"0.003": {"ddp": {"val_loss": [4.0, 3.9]}, "zero1": {"val_loss": [4.0, 3.9]},
                        "diloco": {"val_loss": [4.1, 4.0], "tokens_to_target_ratio": [1.2, 1.1]}}}  # fmt: skip
    speed = {"b": {"plan": "2 nodes", "strategies": {"ddp": {"mean": 0.3}, "zero1": {"mean": 0.4},
                                                      "diloco": {"mean": 0.1}}}}  # fmt: skip
    (tmp_path / "tok.json").write_text(json.dumps({"summary": tokens}))
    (tmp_path / "spd.json").write_text(json.dumps({"settings": speed}))
    assert ttt.main(["--tokens", "tok", "--speed", "spd", "--out", str(tmp_path), "--name", "ttt"]) == 0
    result = json.loads((tmp_path / "ttt.json").read_text())["settings"]["b"]
    assert result["best_baseline"] == "ddp"  # zero1 has no token ratio: shown by speed only
    diloco = result["strategies"]["diloco"]
    assert diloco["sooner_per_seed"] == [pytest.approx(0.3 / 0.12), pytest.approx(0.3 / 0.11)]
    assert diloco["sooner"] == pytest.approx((2.5 + 0.3 / 0.11) / 2)
    assert "tokens_ratio" not in result["strategies"]["zero1"]
    assert math.isclose(result["strategies"]["ddp"]["sooner"], 1.0)
    assert "**2.61×**" in (tmp_path / "ttt.md").read_text()
    assert result["faster_unpaired"] == []
    # A faster ZeRO-1 without a token side is named, not silently passed over; ZeRO-1 computes DDP's update,
    # so with --same-update it needs DDP's tokens and becomes the baseline
    speed["b"]["strategies"]["zero1"]["mean"] = 0.25
    (tmp_path / "spd.json").write_text(json.dumps({"settings": speed}))
    args = ["--tokens", "tok", "--speed", "spd", "--out", str(tmp_path), "--name", "ttt"]
    ttt.main(args)
    assert json.loads((tmp_path / "ttt.json").read_text())["settings"]["b"]["faster_unpaired"] == ["zero1"]
    assert "without a token side, so not compared: zero1" in (tmp_path / "ttt.md").read_text()
    ttt.main([*args, "--same-update", "zero1=ddp", "--lr", "3e-3"])
    result = json.loads((tmp_path / "ttt.json").read_text())["settings"]["b"]
    assert result["best_baseline"] == "zero1" and result["strategies"]["zero1"]["tokens_as"] == "ddp"
    assert result["strategies"]["diloco"]["sooner"] == pytest.approx((0.25 / 0.12 + 0.25 / 0.11) / 2)
    assert "zero1 (tokens as ddp)" in (tmp_path / "ttt.md").read_text()


def test_time_to_target_reads_each_variants_tokens_from_the_first_of_several_files(tmp_path, capsys):
    first = {"0.003": {"ddp": {"val_loss": [4.0, 3.9]}, "a": {"val_loss": [4.1, 4], "tokens_to_target_ratio": [2, 2]}}}
    second = {"0.003": {"ddp": {"val_loss": [4.2, 4.1]}, "a": {"val_loss": [0, 0], "tokens_to_target_ratio": [9, 9]},
                        "b": {"val_loss": [4.3, 4.2], "tokens_to_target_ratio": [1.5, 1.0]}}}  # fmt: skip
    speed = {"b": {"plan": "2 nodes", "strategies": {"zero1": {"mean": 0.6}, "a": {"mean": 0.1}, "b": {"mean": 0.2}}}}
    for name, data in (("one", {"summary": first}), ("two", {"summary": second}), ("spd", {"settings": speed})):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    args = ["--speed", "spd", "--out", str(tmp_path), "--name", "ttt", "--same-update", "zero1=ddp"]
    assert ttt.main(["--tokens", "one,two", *args]) == 0
    rows = json.loads((tmp_path / "ttt.json").read_text())["settings"]["b"]["strategies"]
    assert rows["a"]["sooner_per_seed"] == [pytest.approx(3.0), pytest.approx(3.0)]  # the first file's ratios
    assert rows["b"]["sooner_per_seed"] == [pytest.approx(2.0), pytest.approx(3.0)]
    assert "`" + str(tmp_path) + "/two.md`" in (tmp_path / "ttt.md").read_text()
    second["0.003"]["b"]["val_loss"] = [4.3]  # one seed against the first file's two: no pairing
    (tmp_path / "two.json").write_text(json.dumps({"summary": second}))
    with pytest.raises(SystemExit):
        ttt.main(["--tokens", "one,two", *args])
    assert "ran different numbers of seeds" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "cannot read the results"),
        (["--same-update", "zero1"], "takes A=B pairs"),
        (["--lr", "3e-3"], "no setting of spd has a synchronous baseline"),  # zero1 timed, its tokens not given
    ],
)
def test_time_to_target_names_a_mistake_in_one_line(tmp_path, capsys, extra, message):
    (tmp_path / "tok.json").write_text(json.dumps({"summary": {"0.003": {"ddp": {"val_loss": [4.0]}}}}))
    speed = {"b": {"plan": "p", "strategies": {"zero1": {"mean": 0.2}}}}
    (tmp_path / "spd.json").write_text(json.dumps({"settings": speed}))
    names = ["--tokens", "tok", "--speed", "spd"] if extra else ["--tokens", "nope", "--speed", "nope"]
    with pytest.raises(SystemExit) as exit_:
        ttt.main([*names, "--out", str(tmp_path), *extra])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budgets", "1,x"], "comma-separated multiples"),
        (["--budgets", "1,0"], "positive multiples"),
        (["--levels", "0.75,1"], "--levels needs --budgets"),
        (["--levels", "0.75,nan"], "--levels must be positive multiples"),
        (["--flavor", "huge"], "invalid choice: 'huge'"),
        (["--tune-lrs", "x"], "--tune-lrs takes comma-separated multiples of --lrs"),
        (["--tune-outer", "0.7"], "--tune-outer takes comma-separated LR:MOMENTUM pairs"),
        (["--tune-clip", "one"], "--tune-outer and --tune-clip take non-negative numbers"),
        (["--tune-batch", "12"], "--tune-batch takes multiples of 8 that divide 16 × --updates"),
        (["--tune-batch", "8,x"], "--tune-batch takes multiples of 8"),
        (["--tune-batch", "0"], "--tune-batch takes multiples of 8"),
        (["--tune-batch", "8", "--variants", "ddp,ddp_b8"], "leave out the variants that set their own"),
        (
            ["--tune-batch", "8", "--variants", "ddp,streaming_h10_avg_topk3_int2_senders_warm100_r4"],
            "_warm100_r4 splits its batch into micro-batches over its ranks in multiples of 16 sequences",
        ),
    ],
)
def test_token_efficiency_arguments_it_cannot_run_are_one_line(args, message, capsys):
    from benchmarks.yardstick.tokens import main as token_efficiency

    with pytest.raises(SystemExit) as exit_:
        token_efficiency(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_another_flavor_trains_that_model_in_runs_of_its_own(monkeypatch, tmp_path):
    from benchmarks.yardstick import tokens as te

    trained = []

    def fake_train(variant, lr, seed, updates, folder, fresh, flavor, extra=(), batch=16):
        trained.append((folder.name, te.recipe(updates, lr, seed, flavor=flavor)))
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text(
            json.dumps({"step": updates, "tokens": 64 * updates, "loss": 5.0, "val_loss": 5.0}) + "\n"
        )
        return te.records(folder)

    monkeypatch.setattr(te, "train", fake_train)
    te.main(["--flavor", "tiny", "--updates", "10", "--seeds", "0", "--variants", "ddp", "--out", str(tmp_path)])
    ((name, args),) = trained
    assert name == "tiny_u10_lr0.003_ddp_s0"  # apart from the debug model's runs, which keep their names
    assert args[args.index("--model.flavor") + 1] == "tiny"
    assert "GPT-Neo tiny" in (tmp_path / "tiny_token_efficiency.md").read_text()  # beside the debug model's report
    # the table `predict` reads holds the debug model's runs only
    from benchmarks.yardstick import efficiency as efficiency_table

    with pytest.raises(SystemExit, match="tiny_token_efficiency measured GPT-Neo tiny"):
        efficiency_table.main(
            ["--tokens", "tiny_token_efficiency", "--out", str(tmp_path), "--to", str(tmp_path / "t")]
        )


def test_the_token_efficiency_report_gives_the_mean_gaps_95_percent_interval(monkeypatch, tmp_path):
    from benchmarks.yardstick import tokens as te

    losses = {("ddp", 0): 4.0, ("ddp", 1): 4.0, ("ddp", 2): 5.0, ("acco", 0): 4.04, ("acco", 1): 4.0, ("acco", 2): 5.1}
    losses |= {(v, s): 3.0 for v in ("ddp_muon", "zero1_muon") for s in range(3)} | {("zero1_muon", 0): 3.03}

    def fake_train(variant, lr, seed, updates, folder, fresh, flavor, extra=(), batch=16):
        folder.mkdir(parents=True)
        record = {"step": updates, "tokens": 64 * updates, "loss": 5.0, "val_loss": losses[(variant, seed)]}
        (folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")
        return te.records(folder)

    monkeypatch.setattr(te, "train", fake_train)
    variants = "ddp,acco,ddp_muon,zero1_muon"
    te.main(["--updates", "10", "--seeds", "0,1,2", "--variants", variants, "--out", str(tmp_path), "--name", "t"])
    row = json.loads((tmp_path / "t.json").read_text())["summary"]["0.003"]["acco"]
    gaps = [1.0, 0.0, 2.0]  # % per seed; mean 1, sd 1, Student's t at 2 degrees of freedom 4.30
    assert row["gap_pct"] == pytest.approx(gaps)
    assert row["ci95_gap_pct"] == pytest.approx(4.30 / 3**0.5)
    assert "| +1.00 ± 1.00 | -1.48 to +3.48 |" in (tmp_path / "t.md").read_text()
    # ZeRO-1 against DDP with the same optimizer: gaps +1, 0, 0 (%): mean 1/3, sd 1/√3
    floor = f"Noise floor at lr 0.003: zero1_muon against ddp_muon, +0.333 ± {4.30 / 3:.3f}% (95% interval)"
    assert floor in (tmp_path / "t.md").read_text()


def test_tuning_picks_each_variants_best_grid_point_on_its_own_seeds_and_reports_the_others_there(
    monkeypatch, tmp_path
):
    from benchmarks.yardstick import tokens as te

    ran = []

    def fake_train(variant, lr, seed, updates, folder, fresh, flavor, extra=(), batch=16):
        ran.append((variant, lr, seed, tuple(extra)))
        best = 0.006 if variant == "ddp" else 0.0015  # DDP's best at 2× the base lr, DiLoCo's at ½× with outer 1:0
        loss = 4.0 + abs(lr - best) * 10 + (0.0 if extra[:4] == ("--diloco.outer_lr", "1") else 0.01) + seed * 1e-3
        folder.mkdir(parents=True, exist_ok=True)
        record = {"step": updates, "tokens": 64 * updates, "loss": loss, "val_loss": loss}
        (folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")
        return te.records(folder)

    monkeypatch.setattr(te, "train", fake_train)
    argv = ["--updates", "10", "--seeds", "0,1", "--tune-seeds", "100,101", "--variants", "ddp,zero1,diloco_h10"]
    te.main([*argv, "--out", str(tmp_path), "--name", "t"])
    tuned = json.loads((tmp_path / "t.json").read_text())["meta"]["tuned"]["0.003"]
    assert tuned["ddp"]["lr"] == pytest.approx(0.006) and len(tuned["ddp"]["grid"]) == 3  # lr ×½, ×1, ×2
    assert tuned["diloco_h10"]["lr"] == pytest.approx(0.0015) and len(tuned["diloco_h10"]["grid"]) == 6
    assert tuned["diloco_h10"]["extra"] == ["--diloco.outer_lr", "1", "--diloco.outer_momentum", "0"]
    assert tuned["zero1"] == tuned["ddp"]  # the noise floor: DDP's mathematics at DDP's point, not tuned apart
    reported = [r for r in ran if r[2] in (0, 1)]
    assert {(v, lr) for v, lr, _, _ in reported} == {("ddp", 0.006), ("zero1", 0.006), ("diloco_h10", 0.0015)}
    assert len(ran) == (3 + 6) * 2 + len(reported) and len(reported) == 6  # the grids on the tuning seeds only
    report = (tmp_path / "t.md").read_text()
    assert "| 0.003 | diloco_h10 | lr×0.5 outer 1:0 |" in report
    assert "| 0.003 | zero1 | DDP's (the noise floor" in report
    # A chosen point the variant already makes is its untuned runs: the same folders, not run again
    folders = []
    monkeypatch.setattr(te, "train", lambda *a, **k: folders.append(a[4].name) or fake_train(*a, **k))
    te.main(["--updates", "10", "--seeds", "0", "--tune-seeds", "100", "--tune-lrs", "1", "--tune-outer", "1:0,2:0",
             "--variants", "ddp,diloco_h10_avg", "--out", str(tmp_path), "--name", "t2"])  # fmt: skip
    assert folders[-1] == "u10_lr0.003_diloco_h10_avg_s0"
    # Clipping is tuned for every variant, DDP too: a tighter norm helps DDP's full batch as well
    te.main(["--updates", "10", "--seeds", "0", "--tune-seeds", "100", "--tune-lrs", "1", "--tune-clip", "1,0.5",
             "--variants", "ddp", "--out", str(tmp_path), "--name", "t3"])  # fmt: skip
    grid = json.loads((tmp_path / "t3.json").read_text())["meta"]["tuned"]["0.003"]["ddp"]["grid"]
    assert [g["extra"] for g in grid] == [["--training.max_norm", "1"], ["--training.max_norm", "0.5"]]
    assert not te.sets_already("diloco_h10", ["--diloco.outer_lr", "1"])  # Nesterov's outer lr is 0.7
    with pytest.raises(SystemExit):  # the same seeds for tuning and for the report: refused
        te.main(["--updates", "10", "--seeds", "0,1", "--tune-seeds", "1,2", "--out", str(tmp_path)])


def test_the_batch_is_tuned_at_equal_tokens_and_the_chosen_batch_runs_the_reported_seeds(monkeypatch, tmp_path):
    from benchmarks.yardstick import tokens as te

    # Another global batch runs the same tokens: the warm-up, evaluations and step limit scale by 16 / batch
    keys = ("--training.global_batch_size", "--training.max_tokens", "--lr_schedule.warmup_steps", "--eval.every")
    flags = lambda args: [args[args.index(k) + 1] for k in keys]
    assert flags(te.recipe(1000, 3e-3, 0)) == ["16", "2048000", "50", "100"]
    assert flags(te.recipe(1000, 3e-3, 0, batch=8)) == ["8", "2048000", "100", "200"]
    ran = []

    def fake_train(variant, lr, seed, updates, folder, fresh, flavor, extra=(), batch=16):
        ran.append((variant, seed, updates, batch, folder.name))
        loss = 4.0 + (0.05 if (batch == 8) == (variant == "ddp") else 0.0)  # DDP's best batch 16, DiLoCo's 8
        folder.mkdir(parents=True, exist_ok=True)
        record = {"step": updates * 16 // batch, "tokens": 2048 * updates, "loss": loss, "val_loss": loss}
        (folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")
        return te.records(folder)

    monkeypatch.setattr(te, "train", fake_train)
    grid = ["--tune-seeds", "100", "--tune-lrs", "1", "--tune-outer", "1:0", "--tune-batch", "8,16"]
    te.main(["--updates", "10", "--seeds", "0", *grid, "--variants", "ddp,diloco_h10_avg", "--out", str(tmp_path)])
    tuned = json.loads((tmp_path / "token_efficiency.json").read_text())["meta"]["tuned"]["0.003"]
    assert (tuned["ddp"]["batch"], tuned["diloco_h10_avg"]["batch"]) == (16, 8)
    assert [g["label"] for g in tuned["ddp"]["grid"]] == ["lr×1 batch 8", "lr×1 batch 16"]
    reported = [r for r in ran if r[1] == 0]
    assert reported == [("ddp", 0, 10, 16, "u10_lr0.003_ddp_s0"),
                        ("diloco_h10_avg", 0, 10, 8, "u10_lr0.003_diloco_h10_avg_b8_s0")]  # fmt: skip
    assert "| 0.003 | diloco_h10_avg | lr×1 outer 1:0 batch 8 |" in (tmp_path / "token_efficiency.md").read_text()
    # `predict` times every update at the recipe's batch: the measured table takes no run at another
    from benchmarks.yardstick import efficiency as efficiency_table

    with pytest.raises(SystemExit, match="ran diloco_h10_avg at a batch of 8; the table holds runs at the recipe's 16"):
        efficiency_table.main(["--tokens", "token_efficiency", "--out", str(tmp_path), "--to", str(tmp_path / "t")])
    # A variant that sets its own batch runs it at the recipe's tokens, in folders of its own name
    ran.clear()
    te.main(["--updates", "10", "--seeds", "0", "--variants", "ddp,ddp_b8", "--out", str(tmp_path), "--name", "b"])
    assert ran[1] == ("ddp_b8", 0, 10, 8, "u10_lr0.003_ddp_b8_s0")


def test_the_end_to_end_check_runs_the_bracketing_budgets_and_sets_the_measured_time_against_the_prediction(
    monkeypatch, tmp_path
):
    from benchmarks.yardstick import end_to_end

    tokens = {
        "meta": {"seeds": [0, 1], "updates": 1000},
        "summary": {
            "0.003": {
                "ddp": {"val_loss": [3.90, 3.95]},
                "streaming": {
                    "budgets": {"1000": [4.05, 4.1], "1250": [3.92, 3.9], "1500": [3.78, 3.8]},
                    "tokens_to_target_ratio": [1.2857, 1.2],
                },
            }
        },
    }
    speed = {"settings": {"b": {"strategies": {"streaming": {"mean": 0.01}, "ddp": {"mean": 0.03}}}}}
    ran = []

    def fake_run(setting, name, seed, updates, lr, out, fresh=False, calibration=None):  # loopback's; 0.011 s/update
        ran.append(updates)
        loss = tokens["summary"]["0.003"][name]["budgets"][str(updates)][seed]
        return {"loss": loss, "seconds": 0.011 * updates, "wall_s": 0.0, "updates": updates}

    monkeypatch.setattr(end_to_end, "train_on_cluster", fake_run)
    row = end_to_end.validate("b", "streaming", 0, tokens, speed, 1000, 3e-3, tmp_path)
    assert ran == [1250, 1500]  # 1,000 misses the target on loopback, so the cluster starts at 1,250
    needed = 1250 + 250 * (3.92 - 3.90) / (3.92 - 3.78)
    assert row["measured_updates"] == pytest.approx(needed)
    assert row["measured_s"] == pytest.approx(0.011 * needed)
    assert row["predicted_s"] == pytest.approx(1.2857 * 1000 * 0.01)
    assert row["error"] == pytest.approx(1.2857 * 10 / (0.011 * needed) - 1)
    assert row["loss_vs_loopback"] == {1250: 0.0, 1500: 0.0}
    assert end_to_end.training_seconds([{"tokens_per_update": 2048, "tokens_per_s": 1024}] * 3) == pytest.approx(6)
    # against the baseline's whole run in the same setting and seed, where one ran
    ddp = {"setting": "b", "strategy": "ddp", "seed": 0, "measured_s": 30.0}
    rows = [ddp, row, {**ddp, "seed": 1}]
    end_to_end.against_runs(rows)
    assert row["sooner_than_runs"] == {"ddp": pytest.approx(30.0 / row["measured_s"])}
    meta = {"date": "d", "machine": "m", "tokens": "t", "speed": "s", "lr": "0.003", "command": "c"}
    assert f"| {30.0 / row['measured_s']:.2f}× (ddp) |" in end_to_end.markdown([row], meta)


def test_the_efficiency_table_keeps_measured_ratios_with_their_source_and_a_diloco_runs_settings(tmp_path, capsys):
    from benchmarks.yardstick import efficiency as efficiency_table
    from torchacco.config import DiLoCo
    from torchacco.planning import cost_model as cm

    def result(name, rows, seeds=(0, 1)):
        meta = {"date": "2026-11-24", "machine": "2-core test", "updates": 1000, "command": f"token_efficiency {name}",
                "seeds": list(seeds)}  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps({"meta": meta, "summary": {"0.003": rows}}))

    ddp = {"val_loss": [4.0, 3.9]}
    h50 = {"val_loss": [4.2, 4.1], "mean_gap_pct": 7.7, "tokens_to_target_ratio": [None, None],
           "budgets": {"1000": [4.2, 4.1], "1600": [4.0, 3.95]}}  # fmt: skip
    never = {"val_loss": [4.4, 4.3], "mean_gap_pct": 10.0, "tokens_to_target_ratio": [None, None],
             "budgets": {"1000": [4.4, 4.3], "1250": [4.2, 4.1]}}  # fmt: skip
    result("diloco", {"ddp": ddp, "streaming_h10_avg": {"tokens_to_target_ratio": [1.2, 1.3]},
                      "streaming_h50_avg_topk3_int2_senders": h50})  # fmt: skip
    result("sync", {"ddp": ddp, "acco": {"tokens_to_target_ratio": [1.01, 1.03], "gap_pct": [0.2, 0.8]},
                    "dpu": {"tokens_to_target_ratio": [1.0, 1.2], "ratio_is_upper_bound": [True, False]},
                    "wp": {"tokens_to_target_ratio": [1.1, None]}, "ddp_muon": {"tokens_to_target_ratio": [0.5, 0.52]},
                    "acco_clip_commit": never})  # fmt: skip
    to = tmp_path / "table.json"
    args = ["--tokens", "diloco", "--tokens", "sync", "--out", str(tmp_path), "--to", str(to)]
    assert efficiency_table.main(args) == 0
    table = json.loads(to.read_text())
    # dpu only a bound, wp a seed short; acco_clip_commit reached it in no seed: recorded as such
    assert set(table["tokens_to_target"]) == {
        "streaming_h10_avg",
        "streaming_h50_avg_topk3_int2_senders",
        "acco",
        "acco_clip_commit",
        "ddp_muon",
    }
    assert table["tokens_to_target"]["acco_clip_commit"] == {"not_reached_within": 1.25, "gap_pct": 10.0, "seeds": 2,
                                                             "source": "bench_results/sync.md"}  # fmt: skip
    assert "dpu left out (only a bound)" in capsys.readouterr().err
    acco = table["tokens_to_target"]["acco"]
    assert acco["mean"] == pytest.approx(1.02) and acco["seeds"] == 2 and acco["source"] == "bench_results/sync.md"
    assert acco["ci95"] == pytest.approx(12.71 * 0.01, abs=1e-4) and "diloco" not in acco  # t(1) · sd / √2
    streaming = table["tokens_to_target"]["streaming_h10_avg"]["diloco"]
    assert streaming["replicas"] == 2 and streaming["inner"] == "ddp" and streaming["ranks_per_replica"] == 1
    assert (streaming["sync_every"], streaming["fragments"], streaming["outer_dtype"], streaming["eager"]) == (
        10, 2, "bf16", True)  # fmt: skip
    # a DiLoCo variant that never reached DDP's loss keeps its outer step: predict finds it by a config's settings
    unreached = table["tokens_to_target"]["streaming_h50_avg_topk3_int2_senders"]
    assert unreached["not_reached_within"] == 1.6 and unreached["gap_pct"] == 7.7
    assert (unreached["diloco"]["sync_every"], unreached["diloco"]["topk"]) == (50, 0.03)
    outer = DiLoCo(sync_every=50, fragments=2, overlap_steps=1, eager=True, outer_lr=1, outer_momentum=0,
                   outer_dtype="int2", topk=0.03, topk_mean="senders")  # fmt: skip
    source = cm.diloco_token_source("ddp", 2, outer, table)
    assert cm.not_reached_note(source, table) == "not reached in 1.6× the tokens"
    assert "lr 0.003, 1,000 updates" in table["model"] and table["date"] == "2026-11-24"
    assert table["commands"][:2] == ["token_efficiency diloco", "token_efficiency sync"]
    assert cm.measured_entry(cm.token_source("acco_balanced", table), table)["mean"] == pytest.approx(1.02)
    assert cm.token_source("wp", table) is None  # a seed short: not in the table
    # a Muon variant records its optimizer: the strategies computing DDP's update take its ratio with Muon only
    assert table["tokens_to_target"]["ddp_muon"]["optimizer"] == "muon" and "optimizer" not in acco
    assert cm.token_source("zero1", table, optimizer="muon") == "ddp_muon" and cm.token_source("zero1", table) == "ddp"
    assert cm.token_source("acco", table, optimizer="muon") is None
    with pytest.raises(SystemExit, match="is measured in sync and sync with seed 0; pool files with distinct seeds"):
        efficiency_table.main([*args, "--tokens", "sync"])
    # more seeds of a variant, in a file of their own, pool with the first file's into one interval
    ddp3 = {"val_loss": [4.0, 3.9, 3.8]}
    result("more", {"ddp": ddp3, "acco": {"tokens_to_target_ratio": [1.05, 1.0, 1.06], "gap_pct": [1.0, 0.1, 1.1]},
                    "streaming_h10_avg": {"tokens_to_target_ratio": [1.25, 1.1, None]}}, seeds=(2, 3, 4))  # fmt: skip
    assert efficiency_table.main([*args, "--tokens", "more"]) == 0
    pooled = json.loads(to.read_text())["tokens_to_target"]
    values = [1.01, 1.03, 1.05, 1.0, 1.06]
    assert pooled["acco"]["seeds"] == 5 and pooled["acco"]["mean"] == pytest.approx(sum(values) / 5)
    assert pooled["acco"]["ci95"] == pytest.approx(2.776 * statistics.stdev(values) / 5**0.5, abs=1e-4)
    assert pooled["acco"]["source"] == "bench_results/sync.md and bench_results/more.md"
    assert pooled["acco"]["gap_pct"] == pytest.approx((0.2 + 0.8 + 1.0 + 0.1 + 1.1) / 5)  # loss at equal tokens
    # a seed of the second file never reached DDP's loss: the first file's seeds alone would be a chosen subset
    assert "streaming_h10_avg" not in pooled
    # a tuned file: the entry is the chosen grid point's (its lr multiple and outer step), and pools with no other
    point = {"lr": 0.0015, "extra": ["--diloco.outer_lr", "0.7", "--diloco.outer_momentum", "0.9"]}
    result("tuned", {"ddp": ddp3, "streaming_h10_avg": {"tokens_to_target_ratio": [1.3, 1.2, 1.25]}}, seeds=(5, 6, 7))
    data = json.loads((tmp_path / "tuned.json").read_text())
    data["meta"]["tuned"] = {"0.003": {"ddp": {"lr": 0.003, "extra": []}, "streaming_h10_avg": point}}
    (tmp_path / "tuned.json").write_text(json.dumps(data))
    assert efficiency_table.main(["--tokens", "tuned", "--out", str(tmp_path), "--to", str(to)]) == 0
    tuned = json.loads(to.read_text())["tokens_to_target"]["streaming_h10_avg"]
    outer = tuned["diloco"]["outer_lr"], tuned["diloco"]["outer_momentum"]
    assert tuned["lr_multiple"] == 0.5 and outer == (0.7, 0.9)
    with pytest.raises(SystemExit, match="streaming_h10_avg ran at other settings in diloco and tuned"):
        efficiency_table.main([*args, "--tokens", "tuned"])


def test_each_ddp_budget_is_a_target_level_and_every_variant_is_interpolated_to_each(monkeypatch, tmp_path):
    from benchmarks.yardstick import tokens as te

    finals = {("ddp", 500): [4.2, 4.3], ("ddp", 1000): [4.0, 4.1],
              ("acco", 500): [4.3, 4.4], ("acco", 1000): [4.1, 4.15], ("acco", 1500): [3.9, 4.0]}  # fmt: skip

    def fake_train(variant, lr, seed, updates, folder, fresh, flavor, extra=(), batch=16):
        folder.mkdir(parents=True)
        record = {"step": updates, "tokens": 64 * updates, "loss": 5.0, "val_loss": finals[(variant, updates)][seed]}
        (folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")
        return te.records(folder)

    monkeypatch.setattr(te, "train", fake_train)
    te.main(["--updates", "1000", "--seeds", "0,1", "--variants", "ddp,acco", "--budgets", "0.5,1,1.5",
             "--levels", "0.5,1", "--out", str(tmp_path), "--name", "t"])  # fmt: skip
    summary = json.loads((tmp_path / "t.json").read_text())["summary"]["0.003"]
    row = summary["acco"]
    # the loss-against-tokens plot's data: the base budget's curve over the seeds, and every finished run
    assert row["val_loss_along_run"]["tokens"] == [64_000] and row["val_loss_along_run"]["tokens_per_update"] == 64
    assert row["val_loss_along_run"]["mean"] == [pytest.approx(4.125)]
    assert row["val_loss_along_run"]["sd"] == [pytest.approx(0.05 / 2**0.5)]
    assert summary["ddp"]["levels_val_loss"] == {"500": [4.2, 4.3], "1000": [4.0, 4.1]}
    # DDP's 500-update losses (4.2, 4.3): acco reaches them between its 500 and 1,000 updates
    at_500 = [(500 + 500 * (4.3 - 4.2) / (4.3 - 4.1)) / 500, (500 + 500 * (4.4 - 4.3) / (4.4 - 4.15)) / 500]
    # DDP's 1,000-update losses (4.0, 4.1): between acco's 1,000 and 1,500
    at_1000 = [(1000 + 500 * 0.1 / 0.2) / 1000, (1000 + 500 * 0.05 / 0.15) / 1000]
    assert row["levels"]["500"]["tokens_to_target_ratio"] == pytest.approx(at_500)
    assert row["levels"]["1000"]["tokens_to_target_ratio"] == pytest.approx(at_1000)
    assert row["tokens_to_target_ratio"] == pytest.approx(at_1000)  # the base level, as without --levels
    assert row["levels"]["500"]["target"] == pytest.approx(4.25)
    half = 12.71 * statistics.stdev(at_500) / 2**0.5
    assert row["levels"]["500"]["ci95_tokens_to_target_ratio"] == pytest.approx(half)
    report = (tmp_path / "t.md").read_text()
    assert "| DDP's loss at 500 updates | DDP's loss at 1000 updates |" in report
    assert f"{statistics.fmean(at_500):.3f} ± {half:.3f} (target 4.2500)" in report


def test_time_to_target_at_several_levels_pairs_each_level_with_the_measured_speed(tmp_path):
    # as token-efficiency --levels 0.5,1 writes them: the targets are in the variants' level rows
    levels = {"500": {"tokens_to_target_ratio": [1.5, 1.3], "ratio_is_upper_bound": [False, False], "target": 4.25},
              "1000": {"tokens_to_target_ratio": [1.25, 1.1], "ratio_is_upper_bound": [False, False],
                       "target": 4.05}}  # fmt: skip
    tokens = {"0.003": {"ddp": {"val_loss": [4.0, 4.1]},
                        "acco": {"val_loss": [4.1, 4.15], "tokens_to_target_ratio": [1.25, 1.1], "levels": levels},
                        "dpu": {"val_loss": [4.5, 4.6], "tokens_to_target_ratio": [None, 1.2]}}}  # fmt: skip
    speed = {
        "a": {
            "plan": "2 nodes",
            "strategies": {
                "ddp": {"mean": 0.3},
                "zero1": {"mean": 0.2},
                "acco": {"mean": 0.1},
                "dpu_balanced": {"mean": 0.05},
            },
        }
    }
    (tmp_path / "tok.json").write_text(json.dumps({"summary": tokens}))
    (tmp_path / "spd.json").write_text(json.dumps({"settings": speed}))
    args = ["--tokens", "tok", "--speed", "spd", "--out", str(tmp_path), "--name", "ttt",
            "--same-update", "zero1=ddp,dpu_balanced=dpu"]  # fmt: skip
    assert ttt.main(args) == 0
    data = json.loads((tmp_path / "ttt.json").read_text())
    assert data["targets"] == {"500": pytest.approx(4.25), "1000": pytest.approx(4.05)}
    at_500 = data["levels"]["500"]["a"]
    assert at_500["best_baseline"] == "zero1"  # DDP's update at ZeRO-1's speed
    assert at_500["strategies"]["acco"]["sooner_per_seed"] == [pytest.approx(0.2 / 0.15), pytest.approx(0.2 / 0.13)]
    assert data["levels"]["1000"]["a"]["strategies"]["acco"]["sooner_per_seed"] == [
        pytest.approx(0.2 / 0.125), pytest.approx(0.2 / 0.11)]  # fmt: skip
    report = (tmp_path / "ttt.md").read_text()
    assert "| setting | strategy | 500 updates (4.2500) | 1000 updates (4.0500) |" in report
    assert "| a | zero1 | **1.00× ± 0.00** | **1.00× ± 0.00** |" in report
    # a variant one seed of which never reached DDP's loss has no time to target, and says so; the rest stands
    assert "| dpu_balanced | 0.0500 | not reached within the budgets | — | |" in report


def test_a_resumed_speed_run_is_kept_only_with_the_same_arguments_on_the_same_plan(monkeypatch, tmp_path):
    import dataclasses

    from benchmarks.cluster import ClusterPlan
    from benchmarks.yardstick import speed

    ran = []

    def fake_run(plan, train, folder, env=None, virtual_compute=False, virtual_scale=1.0, calibration=None):
        ran.append(train)
        folder.mkdir(parents=True, exist_ok=True)
        return {"records": [{"step": len(ran)}]}

    monkeypatch.setattr(speed, "run_training", fake_run)
    plan = ClusterPlan(nodes=2, rate_bps=3e8)
    steps = lambda plan, args, resume: speed.timed_run(plan, args, tmp_path / "r", resume)["records"]  # noqa: E731
    assert steps(plan, ["--a"], resume=False) == [{"step": 1}]
    again = dataclasses.replace(plan, prefix="other")  # a later call's names for the same cluster
    assert steps(again, ["--a"], resume=True) == [{"step": 1}]
    assert steps(plan, ["--a"], resume=False) == [{"step": 2}]  # not resumed: run again
    assert steps(plan, ["--b"], resume=True) == [{"step": 3}]  # other arguments
    slower = dataclasses.replace(plan, rate_bps=1e8)
    assert steps(slower, ["--b"], resume=True) == [{"step": 4}]  # another link
    assert len(ran) == 4


def test_the_time_to_target_benchmark_runs_its_parts_in_turn_and_resumes(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from benchmarks.yardstick import end_to_end, speed, table, tokens

    calls, calibrations = [], []
    for module in (tokens, speed, table, end_to_end):
        monkeypatch.setattr(module, "main", lambda argv, m=module.__name__: calls.append((m.split(".")[-1], argv)))
    fake_calibrate = lambda folder, timeout: calibrations.append(1) or {"balance_bps": 1e8}  # noqa: E731
    monkeypatch.setattr(yardstick, "calibrate", fake_calibrate)
    args = SimpleNamespace(out=str(tmp_path), name="ttt", updates=1000, lr="3e-3", seeds="3,4", variants="acco",
                           budgets="0.75,1,1.25", levels="0.75,1", settings="a,b", strategies="ddp,zero1_balanced,acco",
                           speed_updates=110, repeats=2, validate="a:acco", timeout=60, resume=False)  # fmt: skip
    yardstick.time_to_target(args)
    parts = dict(calls)
    assert [name for name, _ in calls] == ["tokens", "speed", "table", "end_to_end"]
    assert parts["tokens"][parts["tokens"].index("--variants") + 1] == "ddp,acco"
    assert "--fresh" in parts["tokens"] and "--resume" not in parts["speed"]
    assert parts["table"][-2:] == ["--same-update", "zero1_balanced=ddp"]  # DDP's update: DDP's tokens
    assert parts["end_to_end"][parts["end_to_end"].index("--seeds") + 1] == "3"
    assert parts["speed"][parts["speed"].index("--calibration") + 1] == "ttt_calibration"
    assert json.loads((tmp_path / "ttt_calibration.json").read_text())["calibration"] == {"balance_bps": 1e8}
    calls.clear()
    yardstick.time_to_target(SimpleNamespace(**{**vars(args), "resume": True}))
    parts = dict(calls)
    assert calibrations == [1]  # kept: the resumed runs' settings are the ones they were timed on
    assert "--fresh" not in parts["tokens"] and "--resume" in parts["speed"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"strategies": "ddp,nope"}, "unknown variant or strategy 'nope'"),
        ({"strategies": "zero1,acco"}, "keep ddp in --strategies"),
        ({"variants": "streaming_h10_avg"}, "--strategies acco computes acco's update, which --variants does not"),
        ({"strategies": "ddp,acco,diloco_h50_balanced"}, "diloco_h50_balanced's loss per token depends on the run's"),
        ({"strategies": "ddp,acco_bf16_estimate"}, "acco_bf16_estimate: no token-efficiency variant computes"),
        ({"settings": "a,z"}, "--settings 'a,z': choose from a, b, a2, b2, c"),
        (
            {"strategies": "ddp,streaming_h10_avg", "variants": "streaming_h10_avg", "speed_updates": 60},
            "use at least 61",
        ),
        ({"seeds": "0,x"}, "--seeds takes integers"),
        ({"validate": "c:acco"}, "--validate c:acco: give setting:strategy with a setting of --settings"),
        ({"validate": "a:zero1"}, None),  # DDP's update: DDP's tokens, so a prediction to check
    ],
)
def test_the_time_to_target_benchmark_names_a_mistake_in_one_line_before_any_run(change, message):
    from types import SimpleNamespace

    from torchacco.errors import UserError

    defaults = {"variants": "acco", "strategies": "ddp,zero1,acco", "settings": "a,b", "speed_updates": 110,
                "seeds": "0,1", "lr": "3e-3", "validate": ""}  # fmt: skip
    args = SimpleNamespace(**{**defaults, **change})
    if message is None:
        assert yardstick.check(args) == (["acco"], ["ddp", "zero1", "acco"])
        return
    with pytest.raises(UserError, match=message):
        yardstick.check(args)


def test_each_timed_strategy_takes_the_tokens_of_the_update_it_computes():

    assert [yardstick.token_variant(s) for s in ("zero1", "fsdp", "ddp_one_bucket", "zero1_balanced")] == ["ddp"] * 4
    assert yardstick.token_variant("acco_balanced") == "acco"  # the split changes who computes what, not the update
    assert yardstick.token_variant("streaming_h10_avg_zero1") == "streaming_h10_avg"  # ZeRO-1 inside: DDP's update
    assert yardstick.token_variant("streaming_h10_avg_acco") == "streaming_h10_avg_acco"  # ACCO inside: not measured
    assert yardstick.token_variant("diloco_h50_balanced") == "diloco_h50_balanced"  # mixed replicas: their own update


def test_a_whole_run_on_the_cluster_is_kept_only_for_the_same_arguments_on_the_same_plan(monkeypatch, tmp_path):
    from benchmarks.cluster import ClusterError
    from benchmarks.yardstick import end_to_end

    (tmp_path / "cal.json").write_text(json.dumps({"calibration": {"balance_bps": 3e8}}))
    ran = []

    def fake_run(plan, args, folder, timeout_s):
        ran.append(plan.rate_bps)
        folder.mkdir(parents=True, exist_ok=True)
        records = [{"step": i, "tokens": 2048 * i, "tokens_per_update": 2048, "tokens_per_s": 2048.0} for i in (1, 2)]
        records = [*records, {"step": 3, "tokens": 3 * 2048, "val_loss": 4.0, "tokens_per_update": 2048,
                              "tokens_per_s": 1024.0}]  # fmt: skip
        return {"records": records, "wall_s": 12.0}

    monkeypatch.setattr(end_to_end, "run_training", fake_run)
    first = end_to_end.train_on_cluster("a", "ddp", 0, 10, 3e-3, tmp_path, calibration="cal")
    # the run's validation loss against tokens and training wall-clock is kept with it
    curve = [{"step": 3, "tokens": 6144, "wall_s": pytest.approx(4.0), "val_loss": 4.0}]
    assert first == {"loss": 4.0, "seconds": pytest.approx(4.0), "wall_s": 12.0, "updates": 3, "curve": curve}
    assert end_to_end.train_on_cluster("a", "ddp", 0, 10, 3e-3, tmp_path, calibration="cal") == first
    assert ran == [3e8]  # kept
    (tmp_path / "cal.json").write_text(json.dumps({"calibration": {"balance_bps": 1e8}}))  # another machine's rate
    end_to_end.train_on_cluster("a", "ddp", 0, 10, 3e-3, tmp_path, calibration="cal")
    assert ran == [3e8, 1e8]
    end_to_end.train_on_cluster("a", "ddp", 0, 10, 1.5e-3, tmp_path, calibration="cal")  # another lr
    assert len(ran) == 3
    with pytest.raises(ClusterError, match="no calibration in"):
        end_to_end.train_on_cluster("a", "ddp", 0, 10, 3e-3, tmp_path, calibration="missing")


def test_one_command_line_runs_every_benchmark(monkeypatch, capsys):
    from benchmarks import cli
    from benchmarks.yardstick import speed

    monkeypatch.setattr(speed, "main", lambda argv: seen.append(argv) or 0)
    seen = []
    assert cli.run(["speed", "--settings", "c"]) == 0 and seen == [["--settings", "c"]]
    with pytest.raises(SystemExit):
        cli.run(["--help"])
    listed = capsys.readouterr().out
    assert all(command in listed for command in cli.MODULES)
    with pytest.raises(SystemExit):
        cli.run(["speeed"])
    assert "invalid choice: 'speeed'" in capsys.readouterr().err


def test_a_commands_module_run_with_python_m_names_the_command_in_one_line():
    import subprocess
    import sys

    from conftest import ROOT

    module = ["-m", "benchmarks.yardstick.speed", "--updates", "1"]
    proc = subprocess.run([sys.executable, *module], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "torchacco: error: run it as python -m benchmarks speed (not python -m benchmarks.yardstick.speed)"
    ]


def test_speed_times_any_registered_variant_at_given_link_rates_with_each_ranks_peak_memory(monkeypatch, tmp_path):
    from benchmarks.yardstick import speed

    (tmp_path / "time_to_loss.json").write_text(json.dumps({"calibration": {"balance_bps": 3e8}}))
    runs = []

    def fake_run(plan, train, folder, env=None, virtual_compute=False, virtual_scale=1.0, calibration=None):
        runs.append((plan, train, env))
        record = {"tokens_per_update": 2048, "tokens_per_s": 2048 / (0.1 * len(runs))}
        return {"records": [record] * 12, "ranks": [{"peak_rss_gib": 0.5}, {"peak_rss_gib": 0.75}], "wall_s": 1.0}

    monkeypatch.setattr(speed, "run_training", fake_run)
    monkeypatch.setattr(speed, "slowdown", lambda plan, folder: 3.9)  # a busy loop in every node of setting c
    argv = ["--updates", "12", "--repeats", "1", "--settings", "c", "--rates", "50mbit", "--strategies",
            "zero1,acco_adaptive", "--malloc-mmap", "--train-args", "--training.mixed_precision bf16", "--out",
            str(tmp_path), "--name", "s"]  # fmt: skip
    assert speed.main(argv) == 0
    settings = json.loads((tmp_path / "s.json").read_text())["settings"]
    assert list(settings) == ["c", "r50mbit"] and settings["c"]["measured_slowdown"] == 3.9
    assert "measured_slowdown" not in settings["r50mbit"]  # no slow node there
    plan, train, env = runs[3]
    assert (plan.nodes, plan.rate_bps, plan.slow_node) == (2, 50e6, None) and env == speed.MMAP
    assert train[-2:] == ["--training.mixed_precision", "bf16"]
    # acco_adaptive is a registered strategy's variant: an adaptive run that steps end needs a token budget it misses
    assert ["--acco.mode", "adaptive", "--training.max_tokens", "1000000000000"] == speed.STRATEGIES["acco_adaptive"][
        2:
    ]
    zero1 = settings["r50mbit"]["strategies"]["zero1"]
    assert zero1["peak_rss_gib_per_rank"] == [[0.5, 0.75]] and zero1["mean"] == pytest.approx(0.3)
    assert "| zero1 | 0.3000 (0.3000) | 1.00× |  | — | 512, 768 |" in (tmp_path / "s.md").read_text()


def test_speed_runs_each_strategy_on_virtual_compute_beside_real_compute_and_reports_their_ratio(monkeypatch, tmp_path):
    from benchmarks.yardstick import speed

    (tmp_path / "time_to_loss.json").write_text(json.dumps({"calibration": {"balance_bps": 3e8}}))
    runs = []

    def fake_run(plan, train, folder, env=None, virtual_compute=False, virtual_scale=1.0, calibration=None):
        runs.append((folder.name, virtual_compute))
        seconds = 0.2 if virtual_compute else 0.25
        return {"records": [{"tokens_per_update": 2048, "tokens_per_s": 2048 / seconds}] * 12, "ranks": []}

    monkeypatch.setattr(speed, "run_training", fake_run)
    monkeypatch.setattr(speed, "settled_calibration", lambda train: {"forward_s": 0.01, "backward_s": 0.02})
    argv = ["--updates", "12", "--repeats", "1", "--settings", "b", "--strategies", "ddp", "--virtual-compute", "both",
            "--out", str(tmp_path), "--name", "v"]  # fmt: skip
    assert speed.main(argv) == 0
    assert runs == [("b_ddp_0", False), ("b_ddp_0_virtual", True)]
    assert json.loads((tmp_path / "v.json").read_text())["meta"]["virtual_scale"] == 1.0
    ddp = json.loads((tmp_path / "v.json").read_text())["settings"]["b"]["strategies"]["ddp"]
    assert ddp["mean"] == pytest.approx(0.25) and ddp["virtual_vs_real"] == pytest.approx(0.8)  # real stays the row
    assert "| virtual / real |" in (tmp_path / "v.md").read_text() and "| 0.800 |" in (tmp_path / "v.md").read_text()
    assert speed.main([*argv[:5], "b2", *argv[6:], "--node-rate", "2gbit"]) == 0  # the link inside a node shaped
    assert json.loads((tmp_path / "v.json").read_text())["settings"]["b2"]["plan"].startswith(
        "2 nodes of 2 ranks (2gbit inside)"
    )


def test_a_memory_budget_leaves_the_strategies_that_do_not_fit_out_of_the_baselines(monkeypatch, tmp_path):
    from benchmarks.yardstick import speed

    calibration = {"calibration": {"balance_bps": 3e8, "params": 592_640}}
    (tmp_path / "time_to_loss.json").write_text(json.dumps(calibration))
    seconds = {"ddp": 0.1, "zero1": 0.2, "acco": 0.15}

    def fake_run(plan, train, folder, env=None, virtual_compute=False, virtual_scale=1.0, calibration=None):
        s = (
            seconds[train[train.index("--parallelism.data_parallel") + 1]]
            if "--parallelism.data_parallel" in train
            else seconds["ddp"]
        )
        waits = {"calibration": {"forward_s": s / 4, "backward_s": s / 2}} if virtual_compute else {}
        return {"records": [{"tokens_per_update": 2048, "tokens_per_s": 2048 / s}] * 12, "ranks": [], **waits}

    monkeypatch.setattr(speed, "run_training", fake_run)
    monkeypatch.setattr(speed, "settled_calibration", lambda train: {"forward_s": 0.01, "backward_s": 0.02})
    # on 4 ranks a rank keeps 16 bytes per parameter under ddp, 15 under acco (12 + its sharded 12 / 4), 11 under zero1
    argv = ["--updates", "12", "--repeats", "1", "--settings", "", "--rates", "1gbit", "--rate-nodes", "4",
            "--strategies", "ddp,zero1,acco", "--memory-budget-mib", "8.6", "--out", str(tmp_path), "--name", "m",
            "--train-args", "--training.local_batch_size 2"]  # fmt: skip
    assert speed.main(argv) == 0
    setting = json.loads((tmp_path / "m.json").read_text())["settings"]["r1gbit"]
    rows = setting["strategies"]
    assert rows["ddp"]["persistent_mib"] == pytest.approx(16 * 592_640 / 2**20) and not rows["ddp"]["fits"]
    assert rows["acco"]["persistent_mib"] == pytest.approx(15 * 592_640 / 2**20) and rows["acco"]["fits"]
    assert setting["best_baseline"] == "zero1" and rows["acco"]["speedup_vs_best_baseline"] == pytest.approx(4 / 3)
    assert "9.04 (does not fit) |" in (tmp_path / "m.md").read_text()
    # under virtual compute each row keeps the waits its run was given, and the table how it was planned
    assert speed.main([*argv, "--virtual-compute", "on", "--name", "v"]) == 0
    virtual = json.loads((tmp_path / "v.json").read_text())
    assert virtual["settings"]["r1gbit"]["strategies"]["acco"]["calibration"] == {
        "forward_s": 0.0375,
        "backward_s": 0.075,
    }
    assert (virtual["meta"]["rate_nodes"], virtual["meta"]["train_args"]) == (4, "--training.local_batch_size 2")
    assert "calibration" not in rows["acco"]
    # HSDP keeps FSDP's 16 bytes per parameter over its shard group, not over every rank
    hsdp = [*speed.recipe(12, 1e-3, 0), "--parallelism.data_parallel", "hsdp", "--hsdp.shard_degree", "2"]
    assert speed.persistent_mib(hsdp, 4, 2**20) == pytest.approx(8)
    assert speed.persistent_mib(hsdp[:-2], 4, 2**20, ranks_per_node=4) == pytest.approx(4)  # 0: a node's ranks


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--virtual-scale", "0"], "--virtual-scale must be positive, got 0"),
        (["--memory-budget-mib", "-3"], "--memory-budget-mib must be positive (0: no budget), got -3"),
        (["--rate-nodes", "1"], "--rate-nodes must be at least 2 (the nodes a link joins), got 1"),
    ],
)
def test_speed_names_a_bad_emulation_argument_in_one_line(extra, message, capsys, tmp_path):
    from benchmarks.yardstick import speed

    (tmp_path / "time_to_loss.json").write_text(json.dumps({"calibration": {"balance_bps": 3e8}}))
    with pytest.raises(SystemExit):
        speed.main(["--out", str(tmp_path), "--rates", "1gbit", "--settings", "", "--strategies", "ddp", *extra])
    assert capsys.readouterr().err.splitlines()[-1].endswith(message)


def test_virtual_compute_calibration_repeats_until_the_machine_is_quiet_and_says_so_when_it_never_is():
    from benchmarks.cluster.launch import ClusterError, settled_calibration

    def fake(seconds):
        times = iter(seconds)
        return lambda train, threads: {"forward_s": next(times) / 3, "backward_s": 0.0, "optimizer_s_per_param": 1e-9}

    # a busy start (0.0136, 0.0191, 0.0234 s: the spread that reordered strategies), then three within 5%
    settled = settled_calibration([], measure=fake([0.0136, 0.0191, 0.0234, 0.0140, 0.0141, 0.0139]))
    assert settled["tries"] == 6 and settled["forward_s"] == pytest.approx(0.0140 / 3)  # the median of the three
    assert settled["compute_s_repeats"] == pytest.approx([0.0139 / 3, 0.0140 / 3, 0.0141 / 3])
    with pytest.raises(ClusterError, match=r"never settled: 4 calibrations, no 3 in a row within 5%.*busy"):
        settled_calibration([], measure=fake([0.01, 0.02, 0.01, 0.02]), tries=4)


def test_a_speed_table_calibrates_once_per_micro_batch_shape_and_reuses_a_saved_calibration(monkeypatch, tmp_path):
    from benchmarks.yardstick import speed

    (tmp_path / "time_to_loss.json").write_text(json.dumps({"calibration": {"balance_bps": 3e8}}))
    given, measured = [], []

    def fake_run(plan, train, folder, env=None, virtual_compute=False, virtual_scale=1.0, calibration=None):
        given.append((speed.micro_batch_shape(train), calibration))
        return {"records": [{"tokens_per_update": 2048, "tokens_per_s": 2048 / 0.2}] * 12, "calibration": calibration}

    def fake_calibration(train):  # each call another machine state: only one per shape may be taken
        measured.append(speed.micro_batch_shape(train))
        return {"forward_s": 0.01 * len(measured), "backward_s": 0.02}

    monkeypatch.setattr(speed, "run_training", fake_run)
    monkeypatch.setattr(speed, "settled_calibration", fake_calibration)
    argv = ["--updates", "12", "--repeats", "2", "--settings", "b", "--strategies", "ddp,zero1,acco",
            "--virtual-compute", "on", "--out", str(tmp_path), "--name", "v"]  # fmt: skip
    assert speed.main(argv) == 0
    assert len(measured) == 1 and len(given) == 6 and all(waits == given[0][1] for _, waits in given)
    assert "local_batch_size=4" in measured[0]
    table = json.loads((tmp_path / "v.json").read_text())
    assert table["virtual_calibration"] == {measured[0]: given[0][1]}
    assert json.loads((tmp_path / "v_virtual_calibration.json").read_text()) == {
        "virtual_calibration": {measured[0]: given[0][1]}
    }
    # another micro-batch shape is calibrated once more; a saved table's calibration is reused without measuring
    assert speed.main([*argv[:-1], "v2", "--train-args", "--training.local_batch_size 2"]) == 0
    assert len(measured) == 2 and "local_batch_size=2" in measured[1]
    given.clear()
    assert speed.main([*argv[:-1], "w", "--virtual-calibration", "v"]) == 0
    assert len(measured) == 2 and {waits["forward_s"] for _, waits in given} == {0.01}
    assert speed.main([*argv, "--resume"]) == 0 and len(measured) == 2  # --resume keeps the table's own
