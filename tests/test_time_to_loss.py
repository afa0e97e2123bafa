"""The time-to-loss benchmark's arithmetic: crossing times by interpolation, loss at equal time,
the same token budget and schedule for every strategy."""

import json
import math
from types import SimpleNamespace

import pytest

from benchmarks.sweeps import time_to_loss as ttl
from benchmarks.sweeps.ttl_analysis import loss_at, summarize, time_to_target, training_seconds, val_curve
from torchacco.config import load_config


def _records(losses, tokens_per_update=100, seconds_per_update=1.0, eval_every=2):
    """One record per update; a validation loss every `eval_every` updates."""
    out = []
    for step, loss in enumerate(losses, 1):
        r = {"step": step, "tokens": step * tokens_per_update, "tokens_per_s": tokens_per_update / seconds_per_update}
        if step % eval_every == 0:
            r["val_loss"] = loss
        out.append(r)
    return out


def test_training_clock_and_validation_curve():
    records = _records([5, 4, 3, 2], seconds_per_update=0.5)
    assert training_seconds(records) == pytest.approx(2.0)
    assert val_curve(records) == [
        {"step": 2, "tokens": 200, "wall_s": 1.0, "val_loss": 4},
        {"step": 4, "tokens": 400, "wall_s": 2.0, "val_loss": 2},
    ]


def test_target_crossing_is_interpolated_between_evaluations():
    curve = val_curve(_records([9, 6, 9, 4, 9, 3], eval_every=2))  # (2 s, 6), (4 s, 4), (6 s, 3)
    assert time_to_target(curve, 5.0) == pytest.approx(3.0)  # halfway from 6 to 4
    assert time_to_target(curve, 6.0) == pytest.approx(2.0)
    assert time_to_target(curve, 3.5, key="tokens") == pytest.approx(500)
    assert time_to_target(curve, 2.0) == math.inf  # never reached
    assert time_to_target(curve, 7.0) == pytest.approx(2.0)  # reached at the first evaluation


def test_loss_at_equal_time_interpolates_and_is_nan_past_a_runs_end():
    curve = val_curve(_records([9, 6, 9, 4]))
    assert loss_at(curve, 3.0) == pytest.approx(5.0)
    assert math.isnan(loss_at(curve, 4.5))


def test_summary_pairs_seeds_with_ddps_and_compares_with_the_best_baseline():
    curves = {
        "ddp": [val_curve(_records([6, 5, 5, 4], seconds_per_update=2.0)),  # its targets: 4 and 4.2, at 8 s
                val_curve(_records([6, 5, 5, 4.2], seconds_per_update=2.0))],
        "zero1": [val_curve(_records([6, 5, 5, 4], seconds_per_update=3.0))] * 2,  # 12 s; seed 1 crosses 4.2 sooner
        "acco": [val_curve(_records([6, 4.5, 5, 3.5], seconds_per_update=1.0)),
                 val_curve(_records([6, 5, 5, 4.1], seconds_per_update=1.0))],
    }  # fmt: skip
    s = summarize(curves)
    assert s["target_val_loss"] == pytest.approx(4.1) and s["best_baseline"] == "ddp"
    assert s["strategies"]["ddp"]["time_to_target_s"] == (pytest.approx(8.0), 0.0)  # its own final losses
    assert s["strategies"]["zero1"]["time_to_target_s"][0] == pytest.approx((12.0 + 6 + 6 * 0.8) / 2)
    acco = s["strategies"]["acco"]
    # seed 0 crosses 4 halfway between (2 s, 4.5) and (4 s, 3.5): 3 s; seed 1 crosses 4.2 at 2 + 2 × 0.8 / 0.9
    assert acco["time_to_target_s"][0] == pytest.approx((3.0 + 2 + 2 * 0.8 / 0.9) / 2)
    assert acco["speedup_vs_best_baseline"] == pytest.approx(8.0 / acco["time_to_target_s"][0])
    assert s["equal_time_s"] == pytest.approx(4.0)  # the shortest run's end
    assert s["strategies"]["zero1"]["loss_at_equal_time"][0] == pytest.approx(5.0)
    # the loose target (1% above): DDP reaches 4.04 sooner than its end, between 5 (4 s) and 4 (8 s)
    assert s["loose_target_val_loss"] == pytest.approx(4.1 * 1.01)
    assert s["strategies"]["ddp"]["time_to_loose_target_s"][0] < 8.0


def test_every_strategy_gets_the_same_token_budget_and_schedule():
    args = SimpleNamespace(updates=240, seq_len=128, eval_every=20)
    base = ttl.model_args(args, nodes=2, local_batch=4)

    def value(argv, key):
        return argv[argv.index(key) + 1]

    assert value(base, "--training.max_tokens") == str(240 * 2 * 4 * 2 * 128)  # updates × tokens per update
    for name, extra in ttl.strategies().items():
        argv = [*base, *extra]
        assert "--training.max_tokens" not in extra and "--lr_schedule.warmup_steps" not in extra, name
        assert value(argv, "--lr_schedule.warmup_steps") == "12"  # 5% of the budget, in nominal updates


def test_resume_needs_the_partial_sweep_and_its_seeds(tmp_path):
    from torchacco.errors import UserError

    with pytest.raises(UserError, match="does not exist"):
        ttl._previous(tmp_path, [0, 1, 2])
    for damaged in ('{"seeds": [0', '{"seeds": [0], "settings": {"a": {}}}', "[1, 2]"):
        (tmp_path / "time_to_loss.json").write_text(damaged)
        with pytest.raises(UserError, match="is not a time-to-loss sweep's results"):
            ttl._previous(tmp_path, [0])
    (tmp_path / "time_to_loss.json").write_text('{"seeds": [0], "settings": {}, "calibration": {}}')
    with pytest.raises(UserError, match="holds seeds \\[0\\]"):
        ttl._previous(tmp_path, [0, 1, 2])
    assert ttl._previous(tmp_path, [0])["settings"] == {}
    curves = {"ddp": [val_curve(_records([3.0, 2.0, 1.0, 0.5]))]}
    (tmp_path / "time_to_loss.json").write_text(json.dumps({"seeds": [0], "settings": {"a": {"curves": curves}}}))
    assert ttl._previous(tmp_path, [0])["settings"]["a"]["summary"] == summarize(curves)  # summarised anew


def test_a_longer_budget_variant_changes_only_the_budget():
    args = SimpleNamespace(updates=240, seq_len=128, eval_every=20)
    base = ttl.model_args(args, nodes=4, local_batch=2)
    for name, (strategy, factor) in ttl.LONGER_BUDGET.items():
        argv = ttl.strategy_args(name, base)
        assert argv[: len(base)] == base and argv[len(base) :][:-2] == ttl.strategies()[strategy]
        budget = int(base[base.index("--training.max_tokens") + 1])
        assert argv[-2:] == ["--training.max_tokens", str(int(budget * factor))]
        assert load_config(argv).training.max_tokens == int(budget * factor)  # the last override wins
