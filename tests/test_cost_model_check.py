"""The cost model's check against the cluster's speed tables: what it feeds the model (the labels' DiLoCo settings,
each rank's cores, the probed factors) and the error arithmetic, on fake tables and probes (no cluster)."""

import dataclasses
import json

import pytest

from benchmarks import cost_model_check as check
from benchmarks import cost_model_check as probes
from benchmarks.cluster import ClusterPlan
from benchmarks.yardstick.speed import STRATEGIES, plans
from torchacco.planning import cost_model as cm


def test_a_diloco_label_gives_predict_diloco_its_trainer_arguments_last_one_winning():
    args = ["--parallelism.data_parallel", "zero1", "--parallelism.replicas", "2", "--diloco.sync_every", "50",
            "--diloco.fragments", "2", "--diloco.overlap_steps", "1", "--diloco.outer_dtype", "bf16",
            "--diloco.sync_every", "10"]  # fmt: skip
    assert check.diloco_settings(check.trainer_config(args)) == {
        "inner": "zero1", "replicas": 2, "sync_every": 10, "fragments": 2, "overlap_steps": 1, "outer_dtype": "bf16",
        "topk": 0.0, "balance_replicas": False,
    }  # fmt: skip
    # the speed labels' own arguments: defaults where a label says nothing, mixed replicas flagged
    plain = check.diloco_settings(check.trainer_config(STRATEGIES["diloco_h10_avg"]))
    assert (plain["inner"], plain["sync_every"], plain["fragments"], plain["outer_dtype"]) == ("ddp", 10, 1, "fp32")
    assert check.diloco_settings(check.trainer_config(STRATEGIES["streaming_h10_avg_acco"]))["inner"] == "acco"
    assert check.diloco_settings(check.trainer_config(STRATEGIES["diloco_h50_balanced"]))["balance_replicas"]
    assert check.diloco_settings(check.trainer_config(STRATEGIES["ddp"])) is None
    assert check.diloco_settings(check.trainer_config(STRATEGIES["streaming_h10_avg_topk1_int2"]))["topk"] == 0.01


def test_a_rank_gets_its_nodes_quota_and_its_share_of_the_machine_but_at_most_one_core():
    quota = ClusterPlan(nodes=4, cpu_per_node=0.45, slow_node=3, slow_factor=4.0)
    assert check.cores_per_rank(quota, cores=2) == [0.45, 0.45, 0.45, 0.1125]
    assert check.cores_per_rank(ClusterPlan(nodes=2, ranks_per_node=2), cores=2) == [0.5, 0.5]
    assert check.cores_per_rank(ClusterPlan(nodes=2), cores=16) == [1, 1]


def test_a_rank_under_a_probed_quota_computes_at_the_probed_speed_and_the_others_scale_one_cores():
    plan = ClusterPlan(nodes=4, cpu_per_node=0.45, slow_node=3, slow_factor=4.0)
    inputs = {"cores": 2, "seconds_per_token": 1e-4, "adamw_elements_per_s": 1e8,
              "seconds_per_token_at_cores": {"0.1125": 1.5e-3}}  # fmt: skip
    assert check.seconds_per_token_at(0.45, inputs) == pytest.approx(1e-4 / 0.45)
    assert check.seconds_per_token_at(0.1125, inputs) == 1.5e-3  # 1.69× what 0.1125 of a core would take
    hw = check.hardware(plan, inputs, {"nodes": 4, "bandwidth_bps": None}, {}, tokens_per_micro_batch=128)
    assert hw.compute_s == pytest.approx(128 * 1e-4 / 0.45)
    assert hw.slow_factor == pytest.approx(1.5e-3 / (1e-4 / 0.45))
    assert hw.opt_rate == pytest.approx(1e8 * 0.1125)
    assert "1500.0 µs at 0.1125 cores (1.69× the scaled time)" in check.at_cores(inputs)
    assert check.at_cores({"seconds_per_token": 1e-4}) == ""


def _collectives(bytes_, rs, ag, ar, ring_rs, ring_ag):
    return {"bytes": bytes_, "reduce_scatter_s": rs, "all_gather_s": ag, "all_reduce_s": ar,
            "ring_reduce_scatter_s": ring_rs, "ring_all_gather_s": ring_ag}  # fmt: skip


def test_a_setting_is_predicted_from_the_probes_and_each_error_is_judged_against_15_percent():
    plan = ClusterPlan(nodes=2, rate_bps=8e6)
    # ring ideal of 4 MB between 2 nodes at 8 Mbit/s: 1/2 · 8 · 4e6 / 8e6 = 2 s
    probed = {"collectives": _collectives(4e6, rs=4.0, ag=3.0, ar=6.0, ring_rs=2.2, ring_ag=2.4)}
    inputs = {"seconds_per_token": 1e-4, "params": 1e6, "adamw_elements_per_s": 1e7, "cores": 2}
    work = cm.Workload(params=1e6, flops_per_token=1.0, tokens_per_micro_batch=4 * 128, micro_batches=2, comm_bytes=4)
    hw = cm.Hardware(nodes=2, flops=1.0, bandwidth_bps=8e6, compute_s=1e-4 * 512, opt_rate=1e7, rs_factor=2.0,
                     ag_factor=1.5, ar_factor=1.5)  # fmt: skip
    ddp = cm.predict(work, hw, "ddp")["step_time_s"]
    # ZeRO-1's job runs torchacco's rings, not gloo's reduce-scatter and all-gather
    zero1 = cm.predict(work, dataclasses.replace(hw, rs_factor=1.1, ag_factor=1.2), "zero1")["step_time_s"]
    table = {"ddp": {"mean": ddp / 0.8}, "zero1": {"mean": zero1 / 1.1}, "diloco_h50_balanced": {"mean": 1.0},
             "mystery": {"mean": 1.0}}  # fmt: skip
    result = check.check_setting(table, plan, [], probed, inputs)
    assert result["factors"]["gloo"] == {"rs_factor": 2.0, "ag_factor": 1.5, "ar_factor": 1.5}
    assert result["factors"]["rings"] == {"rs_factor": 1.1, "ag_factor": 1.2, "ar_factor": 1.5}
    rows = result["rows"]
    assert rows["ddp"]["predicted_s"] == pytest.approx(ddp)
    assert rows["ddp"]["error"] == pytest.approx(-0.2) and not rows["ddp"]["within"]
    assert rows["zero1"]["error"] == pytest.approx(0.1) and rows["zero1"]["within"]
    assert (result["mean_abs_error"], result["within"], result["checked"]) == (pytest.approx(0.15), 1, 2)
    assert set(result["skipped"]) == {"diloco_h50_balanced", "mystery"}
    assert "mixed replicas" in result["skipped"]["diloco_h50_balanced"]


def test_the_report_is_rebuilt_from_cached_probes_without_root(tmp_path, capsys):
    calibration = {"compute_per_update_s": 0.05, "params": 600_000, "balance_bps": 3e8}
    (tmp_path / "time_to_loss.json").write_text(json.dumps({"calibration": calibration}))
    plan = plans(tmp_path)["a"][0]
    assert plans(tmp_path, rates="50mbit")["r50mbit"][0].rate_bps == 50e6  # speed --rates: a setting per link rate
    ideal = 0.5 * 8 * 2.4e6 / plan.rate_bps
    collectives = _collectives(2.4e6, ideal, ideal, ideal, ideal, ideal)
    probes = {"settings": {"a": {"plan": plan.describe(), "collectives": collectives}}, "adamw_elements_per_s": 1e8}
    (tmp_path / "cost_model_probes.json").write_text(json.dumps(probes))
    table = {"meta": {"machine": "2-core test"},
             "settings": {"a": {"plan": plan.describe(), "strategies": {"ddp": {"mean": 0.5}}}}}  # fmt: skip
    (tmp_path / "spd.json").write_text(json.dumps(table))
    assert check.main(["--speed", "spd", "--out", str(tmp_path), "--name", "cmc"]) == 0
    row = json.loads((tmp_path / "cmc.json").read_text())["tables"]["spd"]["a"]["rows"]["ddp"]
    assert row["error"] == pytest.approx(row["predicted_s"] / 0.5 - 1) and not row["within"]
    assert "**1 of 1 predictions miss the 15% bar.**" in (tmp_path / "cmc.md").read_text()
    # a compute probed beside the links replaces the calibration: twice the compute, as twice the tokens
    (tmp_path / "cost_model_probes.json").write_text(json.dumps({**probes, "compute_per_update_s": 0.1}))
    assert check.main(["--speed", "spd", "--out", str(tmp_path), "--name", "cmc"]) == 0
    probed = json.loads((tmp_path / "cmc.json").read_text())
    assert probed["tables"]["spd"]["a"]["rows"]["ddp"]["predicted_compute_s"] == pytest.approx(
        2 * row["predicted_compute_s"]
    )
    assert probed["meta"]["inputs"]["compute_probed"] and "probed with the links" in (tmp_path / "cmc.md").read_text()
    # a probe of another plan is not this setting's: one line
    probes["settings"]["a"]["plan"] = "2 nodes at another rate"
    (tmp_path / "cost_model_probes.json").write_text(json.dumps(probes))
    with pytest.raises(SystemExit):
        check.main(["--speed", "spd", "--out", str(tmp_path), "--name", "cmc"])
    assert f"has no probe of setting a of spd ({plan.describe()}): run with --probe" in capsys.readouterr().err


def test_a_virtual_compute_table_is_predicted_from_each_runs_waits_on_its_own_plans(tmp_path, capsys):
    calibration = {"compute_per_update_s": 0.05, "params": 600_000, "balance_bps": 3e8}
    (tmp_path / "time_to_loss.json").write_text(json.dumps({"calibration": calibration}))
    meta = {"machine": "2-core test", "virtual_compute": "on", "rates": "600mbit", "rate_nodes": 4,
            "node_rate": "unshaped"}  # fmt: skip
    plan = check.table_plans(tmp_path, {"v": {"meta": meta, "settings": {}}})["v"]["r600mbit"][0]
    assert (plan.nodes, plan.rate_bps) == (4, 600e6)  # speed --rate-nodes 4, not the default 2
    ideal = 3 / 4 * 8 * 2.4e6 / plan.rate_bps
    collectives = _collectives(2.4e6, ideal, ideal, ideal, ideal, ideal)
    probed = {"settings": {"x": {"plan": plan.describe(), "collectives": collectives}}, "adamw_elements_per_s": 1e8}
    (tmp_path / "cost_model_probes.json").write_text(json.dumps(probed))
    (tmp_path / "v.json").write_text(json.dumps({"meta": meta, "settings": {}}))
    with pytest.raises(SystemExit):  # the host work beside the waits is probed with the links
        check.main(["--speed", "v", "--out", str(tmp_path), "--name", "cmc"])
    assert "no probe of the host work beside virtual compute's waits" in capsys.readouterr().err
    (tmp_path / "cost_model_probes.json").write_text(json.dumps({**probed, "virtual_overhead_s": 0.002}))
    waits = {"forward_s": 0.01, "backward_s": 0.02, "optimizer_s_per_param": 1e-7, "block_share": 0.9}
    rows = {"zero1": {"mean": 0.1, "calibration": waits}, "ddp": {"mean": 0.1}}
    table = {"meta": meta, "settings": {"r600mbit": {"plan": plan.describe(), "strategies": rows}}}
    (tmp_path / "v.json").write_text(json.dumps(table))
    assert check.main(["--speed", "v", "--out", str(tmp_path), "--name", "cmc"]) == 0
    checked = json.loads((tmp_path / "cmc.json").read_text())["tables"]["v"]["r600mbit"]
    cfg = check.trainer_config(STRATEGIES["zero1"])
    work = check.workload(cfg, 4, 600_000)
    # the waits, not the CPU's compute, and the host work per micro-batch, queued: 4 ranks on the table's 2 cores
    hw = cm.Hardware(nodes=4, flops=1.0, bandwidth_bps=600e6, compute_s=0.03 + 2 * 0.002, opt_rate=1e7, streams=False)
    expected = cm.predict(work, hw, "zero1")["step_time_s"]
    assert checked["rows"]["zero1"]["predicted_s"] == pytest.approx(expected)
    assert checked["rows"]["zero1"]["cpu_budget_s"] == 0.0
    assert "lacks its virtual compute's calibration" in checked["skipped"]["ddp"]
    assert (
        "Virtual compute: each row's compute and AdamW are its run's calibrated waits"
        in (tmp_path / "cmc.md").read_text()
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--updates", "60", "--settings", "a", "--strategies", "diloco_h10_avg"], "leaves no timed update for"),
        (["--settings", "z"], "unknown setting 'z'"),
        (["--settings", "a", "--strategies", "nope"], "unknown strategy 'nope'"),
        (["--settings", "c", "--cpu-period-ms", "5"], "node 3's 0.1125 cores are under the kernel's 1 ms quota"),
        (["--settings", "a", "--cpu-period-ms", "0"], "--cpu-period-ms must be between 1 and 1000"),
        (["--settings", "a", "--cpu-period-ms", "nan"], "--cpu-period-ms must be a finite number"),
        (["--settings", "n8x4"], "setting n8x4 needs --virtual-compute on"),
    ],
)
def test_the_speed_benchmark_refuses_what_it_cannot_time_with_one_line_before_any_run(argv, words, tmp_path, capsys):
    from benchmarks.yardstick import speed

    calibration = {"compute_per_update_s": 0.05, "params": 600_000, "balance_bps": 3e8}
    (tmp_path / "time_to_loss.json").write_text(json.dumps({"calibration": calibration}))  # the settings' rates
    with pytest.raises(SystemExit):
        speed.main([*argv, "--out", str(tmp_path)])
    assert words in capsys.readouterr().err


def test_the_collective_probe_is_the_mean_of_several_launches(monkeypatch, tmp_path):
    times = iter([0.1, 0.3, 0.2])

    def fake(plan, folder, params, extra):
        assert "--until" in extra and "mean" in extra
        return {"bytes": 8, "ring_all_gather_s": next(times), "until": "all"}

    monkeypatch.setattr(probes, "probe_collectives", fake)
    probed = probes.probe_launches(ClusterPlan(nodes=2), tmp_path, 2)
    assert probed["ring_all_gather_s"] == pytest.approx(0.2) and probed["bytes"] == 8
    assert probed["launches"] == 3 and [r["ring_all_gather_s"] for r in probed["per_launch"]] == [0.1, 0.3, 0.2]


def test_a_rank_on_a_small_cpu_share_is_bounded_by_its_cpu_work_per_update():
    plan, extra = plans(check.ROOT / "bench_results")["c"]  # 0.45 cores a node, 0.1125 on the slow one; 4 micro-batches
    inputs = {"cores": 2, "seconds_per_token": 1e-4, "cpu_overhead_s": 0.02}
    cfg = check.trainer_config([*STRATEGIES["zero1"], *extra])
    work = check.workload(cfg, plan.world_size, 6e5)
    assert work.micro_batches == 4 and work.tokens_per_micro_batch == 128
    assert check.cpu_budget_s("zero1", cfg, plan, inputs, work) == pytest.approx((4 * 128 * 1e-4 + 0.02) / 0.1125)
    acco = check.trainer_config([*STRATEGIES["acco"], *extra])  # two jobs per update
    assert check.cpu_budget_s("acco", acco, plan, inputs, work) == pytest.approx((4 * 128 * 1e-4 + 0.04) / 0.1125)
    # balanced: the slow rank keeps fewer micro-batches, so a fast one may bind
    bal = check.cpu_budget_s("zero1_balanced", check.trainer_config([*STRATEGIES["zero1_balanced"], *extra]), plan,
                             inputs, work)  # fmt: skip
    assert bal < check.cpu_budget_s("zero1", cfg, plan, inputs, work)
    assert check.cpu_budget_s("zero1", cfg, plan, {"cores": 2, "seconds_per_token": 1e-4}, work) == 0.0


def test_a_label_that_changes_only_what_the_workload_reads_is_predicted_as_its_strategy():
    one_bucket = check.trainer_config(STRATEGIES["ddp_one_bucket"])
    assert check.model_label("ddp_one_bucket", one_bucket) == "ddp"
    assert check.model_label("zero1_balanced", check.trainer_config(STRATEGIES["zero1_balanced"])) == "zero1_balanced"
    work = check.workload(one_bucket, 2, 6e5)
    assert work.bucket_bytes == 25 * 2**20 and work.first_bucket_bytes is None
    hw = cm.Hardware(nodes=2, flops=1.0, bandwidth_bps=1e8, compute_s=0.03)
    torch_buckets = check.workload(check.trainer_config(STRATEGIES["ddp"]), 2, 6e5)
    one, default = check.predict_label("ddp_one_bucket", one_bucket, work, hw), cm.predict(torch_buckets, hw, "ddp")
    assert one["exposed_comm_s"] > default["exposed_comm_s"]  # nothing starts inside the backward


def test_the_internet_and_the_mixed_slow_settings_and_their_strategies(tmp_path):
    from benchmarks.yardstick import speed

    (tmp_path / "time_to_loss.json").write_text(json.dumps({"calibration": {"balance_bps": 3e8}}))
    settings = plans(tmp_path)
    assert settings["e"][0].rate_bps == pytest.approx(settings["b"][0].rate_bps / 10)  # a tenth of b's link
    mixed = settings["bm"][0]
    assert mixed.rate_bps == settings["b"][0].rate_bps and mixed.slow_node == 1 and mixed.slow_factor == 3.0
    assert all(name in speed.STRATEGIES for names in speed.PER_SETTING.values() for name in names)
    assert "streaming_h10_avg_balanced" in speed.PER_SETTING["bm"]  # mixed replicas with fragments and τ


def test_a_table_measured_on_another_plan_is_not_checked_against_these_probes():
    settings = plans(check.ROOT / "bench_results")
    table = {"t": {"settings": {"c": {"plan": "4 nodes ..., node3 0.1125 cores per 10 ms", "strategies": {}}}}}
    result = check.check(table, {"t": settings}, {}, {"cores": 2})
    assert "measured on another plan" in result["t"]["c"]["not_checked"]


def test_where_the_cpu_budget_binds_it_is_the_prediction():
    plan, extra = plans(check.ROOT / "bench_results")["c"]
    probed = {"collectives": _collectives(2.4e6, 0.1, 0.05, 0.1, 0.05, 0.05)}
    inputs = {"cores": 2, "seconds_per_token": 5e-5, "adamw_elements_per_s": 1e8, "params": 6e5}
    free = check.check_setting({"zero1": {"mean": 1.0}}, plan, extra, probed, inputs)["rows"]["zero1"]
    bound = check.check_setting({"zero1": {"mean": 1.0}}, plan, extra, probed, {**inputs, "cpu_overhead_s": 0.5})
    row = bound["rows"]["zero1"]
    assert row["cpu_budget_s"] == pytest.approx((4 * 128 * 5e-5 + 0.5) / 0.1125) and free["cpu_budget_s"] == 0.0
    assert row["predicted_s"] == pytest.approx(row["cpu_budget_s"]) and row["predicted_s"] > free["predicted_s"]


def test_hsdp_sharded_across_nodes_is_not_predicted_with_the_reason():
    plan = ClusterPlan(nodes=4, rate_bps=6e8)
    across = check.trainer_config([*STRATEGIES["hsdp"], "--hsdp.shard_degree", "2"])
    with pytest.raises(check.NotModelled, match="hsdp sharded over 2 ranks, a node holding 1"):
        check.shards_across_nodes(across, plan)
    check.shards_across_nodes(check.trainer_config(STRATEGIES["hsdp"]), ClusterPlan(nodes=2, ranks_per_node=2))
