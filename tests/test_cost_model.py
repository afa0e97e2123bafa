"""The cost model's arithmetic, and the `predict` command line."""

import dataclasses
import math

import pytest
from conftest import ROOT

from torchacco.errors import UserError
from torchacco.planning import cost_model as cm

WORK = cm.Workload(params=1e6, flops_per_token=1e3, tokens_per_micro_batch=1e3, micro_batches=2, comm_bytes=4)


def hw(**kw):
    # compute per micro-batch: 1e3 * 1e3 / 1e6 = 1 s; optimizer free
    return cm.Hardware(**{"nodes": 2, "flops": 1e6, "bandwidth_bps": 8e6, "opt_rate": 1e30, **kw})


def test_collective_is_a_ring_over_nodes_plus_latency_and_intra_node():
    # 2 nodes: (N-1)/N * 8 bits * 4e6 bytes / 8e6 bit/s = 2 s per reduce-scatter or all-gather
    assert cm.collective_s(4e6, hw()) == pytest.approx(2.0)
    assert cm.collective_s(4e6, hw(nodes=4)) == pytest.approx(3.0)
    assert cm.collective_s(4e6, hw(latency_s=0.1, nodes=4)) == pytest.approx(3.3)
    assert cm.collective_s(4e6, hw(bandwidth_bps=None)) == 0.0
    assert cm.collective_s(4e6, hw(nodes=1)) == 0.0
    # 2 GPUs per node: the intra-node step adds (G-1)/G * 8S / B_intra
    assert cm.collective_s(4e6, hw(ranks_per_node=2, intra_bps=32e6)) == pytest.approx(2.0 + 0.5)


def test_step_times_per_strategy():
    h = hw()  # c = 1 s, V = 2 s, M = 4 s, k = 2
    p = cm.predict_all(WORK, h)
    assert p["zero1"]["step_time_s"] == pytest.approx(2 + 4)
    assert p["zero1"]["exposed_comm_s"] == pytest.approx(4) and p["zero1"]["overlap"] == 0
    # torch's first bucket (1 MiB, a share f of the 4e6 bytes) is all-reduced from f of the way through the last
    # backward (2/3 s) on; the rest once the backward ends and that one is done
    f = 2**20 / 4e6
    assert p["ddp"]["step_time_s"] == pytest.approx(2 + 4 - 2 / 3 * (1 - f))
    # all-gathers on both micro-batches, the reduce-scatter only on the last (gradient sync is skipped before)
    assert p["fsdp"]["step_time_s"] == pytest.approx(max(1, 4) + max(1, 4 + 2))
    assert p["acco"]["step_time_s"] == pytest.approx(2 * max(1, 4))
    assert p["dpu"]["step_time_s"] == p["wp"]["step_time_s"] == pytest.approx(4)
    # adaptive, capped at 2× (the default): rounds of max(1 s, 4 s) = 4 s; 2 micro-batches a rank, then it waits
    assert p["acco_adaptive"]["tokens_per_update"] == pytest.approx(2 * 2 * 2 * 1e3)
    assert p["acco_adaptive"]["exposed_comm_s"] == pytest.approx(2 * (4 - 2))
    # uncapped: each rank computes 4 micro-batches per round, the compute rate
    p = cm.predict_all(WORK, hw(max_growth=0))
    assert p["acco_adaptive"]["tokens_per_update"] == pytest.approx(2 * 2 * 4 * 1e3)
    assert p["acco_adaptive"]["tokens_per_s"] == pytest.approx(2 * 1e3 / 1.0)  # the compute rate
    assert p["acco_adaptive"]["exposed_comm_s"] == 0 and p["acco_adaptive"]["overlap"] == 1
    for s in cm.variants():
        assert p[s]["tokens_per_s"] == pytest.approx(p[s]["tokens_per_update"] / p[s]["step_time_s"])


def test_ddp_all_reduces_each_bucket_once_it_is_full_and_the_one_before_is_done():
    # 4e6 bytes: V_ar = 4 s in all; the last backward (2/3 of a 1 s micro-batch) fills the buckets evenly
    def exposed(bucket_bytes, **kw):
        work = dataclasses.replace(WORK, bucket_bytes=bucket_bytes, first_bucket_bytes=None)
        return cm.predict(work, hw(**kw), "ddp")["exposed_comm_s"]

    assert cm.buckets(4e6, 1.5e6) == [1.5e6, 1.5e6, 1e6]
    assert cm.buckets(4e6, 3e6, first=0.5e6) == [0.5e6, 3e6, 0.5e6]
    assert cm.buckets(1e5, 3e6, first=0.5e6) == [1e5]
    assert cm.ddp_buckets(0) == {} and cm.ddp_buckets(25) == {"bucket_bytes": 25 * 2**20, "first_bucket_bytes": None}
    assert exposed(4e6) == pytest.approx(4)  # one bucket: nothing starts before the backward ends
    # 4 buckets of 1 s: the first full at 1/6 s, each next one starts when the one before ends
    assert exposed(1e6) == pytest.approx(1 / 6 + 4 - 2 / 3)
    # many small buckets: all but the backward's share is exposed (the limit max(0, V_ar - 2/3 c))
    assert exposed(4e3) == pytest.approx(4 - 2 / 3, abs=1e-2)
    # a fast link: the buckets keep up with the backward, only the last one's all-reduce is exposed
    assert exposed(1e6, bandwidth_bps=8e8) == pytest.approx(0.01)
    # bf16 on the wire: the buckets still hold fp32 gradients (4 of 1e6 bytes), each moving half its bytes
    bf16 = dataclasses.replace(WORK, comm_bytes=2, bucket_bytes=1e6, first_bucket_bytes=None)
    assert cm.predict(bf16, hw(), "ddp")["exposed_comm_s"] == pytest.approx(1 / 6 + 2 - 2 / 3)
    # each bucket pays the ring's latency: 2 (N-1) L per all-reduce
    assert exposed(1e6, latency_s=0.01) == pytest.approx(1 / 6 + 4 - 2 / 3 + 4 * 0.02)
    with pytest.raises(ValueError, match="bucket_bytes"):
        dataclasses.replace(WORK, bucket_bytes=0)
    with pytest.raises(ValueError, match="first_bucket_bytes"):
        dataclasses.replace(WORK, first_bucket_bytes=0)


def test_acco_with_most_of_the_update_at_the_estimate_hides_less_until_the_job_outlasts_its_long_round():
    # k = 2 micro-batches of 1 s: rounds of 7/8 · 2 = 1.75 s and 1/8 · 2 = 0.25 s
    fast = cm.predict_all(WORK, hw(bandwidth_bps=64e6))  # V = 0.25 s, M = 0.5 s
    assert fast["acco_share875"]["step_time_s"] == pytest.approx(1.75 + 0.5)
    assert fast["acco"]["step_time_s"] == pytest.approx(2 * 1.0)
    assert fast["acco_share875"]["exposed_comm_s"] == pytest.approx(0.5 - 0.25)
    slow = cm.predict_all(WORK, hw())  # M = 4 s: both take 2·M
    assert slow["acco_share875"]["step_time_s"] == slow["acco"]["step_time_s"] == pytest.approx(2 * 4)
    # its update is not the plain one: its tokens come from its own measurement, never from acco's
    assert cm.token_source("acco_share875", {"tokens_to_target": {"acco": {"ratio": 1.05}}}) is None


def test_without_streams_fsdp2s_collectives_add_to_its_compute_and_the_others_still_overlap():
    # on CPU FSDP2 waits for each all-gather, reduce-scatter and HSDP all-reduce where it issues it
    streams, cpu = cm.predict_all(WORK, hw()), cm.predict_all(WORK, hw(streams=False))
    assert cpu["fsdp"]["step_time_s"] == pytest.approx(2 * (1 + 2 * 2) + 2)  # k·(c + 2V_ag) + V_rs
    assert cpu["fsdp"]["step_time_s"] > streams["fsdp"]["step_time_s"]
    for label in ("ddp", "zero1", "acco", "dpu"):  # torch's reducer and the sharded job's thread
        assert cpu[label]["step_time_s"] == streams[label]["step_time_s"]
    h = hw(ranks_per_node=2, intra_bps=32e6, streams=False)  # the node's ring 0.5 s, 2 s across
    assert cm.predict_all(WORK, h)["hsdp"]["step_time_s"] == pytest.approx(2 * (1 + 2 * 0.5) + 0.5 + 2 * 2.0)


def test_hsdp_gathers_inside_the_node_and_all_reduces_each_nodes_gradient_across():
    # 2 nodes of 2 ranks, intra-node ring 0.5 s per all-gather or reduce-scatter, 2 s across the nodes' link
    h = hw(ranks_per_node=2, intra_bps=32e6)
    p = cm.predict_all(WORK, h)
    across = 2 * 2.0  # the shards' all-reduce: a whole gradient per node, both ring phases
    assert p["hsdp"]["step_time_s"] == pytest.approx(max(1, 1.0) + max(1, 1.0 + 0.5) + (across - 2 / 3))
    assert p["hsdp"]["step_time_s"] < p["fsdp"]["step_time_s"]  # its all-gathers never cross the link
    assert cm.memory_bytes(WORK, h, "hsdp") == pytest.approx(1e6 * 16 / 2)  # FSDP's state over a node
    assert cm.memory_bytes(WORK, h, "fsdp") == pytest.approx(1e6 * 16 / 4)


def test_acco_hides_a_job_shorter_than_a_period_and_doubles_at_balance():
    fast = hw(bandwidth_bps=32e6)  # V = 0.5, M = 1 = one micro-batch
    p = cm.predict_all(WORK, fast)
    assert p["acco"]["exposed_comm_s"] == pytest.approx(0) and p["acco"]["overlap"] == 1
    assert p["acco"]["tokens_per_s"] / p["zero1"]["tokens_per_s"] == pytest.approx(3 / 2)
    # at the balance rate ZeRO-1's communication equals its compute: adaptive ACCO is 2x, deterministic 1x
    p = cm.predict_all(WORK, hw(bandwidth_bps=16e6))  # 2 * (N-1)/N * 8 * P * bytes = 32e6 bits over k*c = 2 s
    assert p["zero1"]["exposed_comm_s"] == pytest.approx(2.0)
    assert p["acco_adaptive"]["tokens_per_s"] / p["zero1"]["tokens_per_s"] == pytest.approx(2.0)
    assert p["acco"]["tokens_per_s"] / p["zero1"]["tokens_per_s"] == pytest.approx(1.0)


def test_slow_worker():
    slow = hw(bandwidth_bps=None, slow_factor=4, max_growth=0)  # one rank 4x slower, communication free
    p = cm.predict_all(WORK, slow)
    assert p["zero1"]["step_time_s"] == pytest.approx(8)
    # adaptive: the slow rank does its 1 micro-batch per round (4 s), the fast one 4
    assert p["acco_adaptive"]["tokens_per_s"] / p["zero1"]["tokens_per_s"] == pytest.approx(5 / 2)
    four = cm.predict_all(WORK, hw(nodes=4, bandwidth_bps=None, slow_factor=4, max_growth=0))
    assert four["acco_adaptive"]["tokens_per_s"] / four["zero1"]["tokens_per_s"] == pytest.approx(13 / 4)
    # balanced: each round's 4 micro-batches go to the fast ranks (2, 1, 1): rounds of 2 s, not 4
    assert four["acco_balanced"]["tokens_per_update"] == four["zero1"]["tokens_per_update"]
    assert four["acco_balanced"]["step_time_s"] == pytest.approx(2 * 2.0)
    assert four["zero1"]["step_time_s"] == pytest.approx(2 * 4.0)


def test_measured_compute_overrides_flops():
    p = cm.predict(WORK, hw(compute_s=0.5, bandwidth_bps=None), "zero1")
    assert p["step_time_s"] == pytest.approx(1.0)


def test_memory_acco_is_zero1_plus_one_copy():
    h = hw(nodes=4)
    extra = cm.memory_bytes(WORK, h, "acco") - cm.memory_bytes(WORK, h, "zero1")
    assert extra == pytest.approx(4 * WORK.params)  # C in fp32: bf16 gradients are summed in fp32 by default
    assert cm.memory_bytes(WORK, h, "fsdp") == pytest.approx(16 * WORK.params / 4)


def test_model_workload_from_a_model_folder():
    w = cm.model_workload("gpt_neo", "tiny", 256, 4, 2, vocab_size=10000, comm_bytes=4)
    assert w.params == pytest.approx(5.85e6, rel=0.01)
    assert w.tokens_per_micro_batch == 1024
    with pytest.raises(UserError, match="no flavor 'huge'"):  # the trainer's own line
        cm.model_workload("gpt_neo", "huge", 256, 4, 2)
    with pytest.raises(ValueError):
        cm.Workload(params=0, flops_per_token=1, tokens_per_micro_batch=1)
    with pytest.raises(ValueError, match="unknown strategy"):
        cm.predict(WORK, hw(), "zero7")


def test_relative_error():
    assert cm.relative_error(110, 100) == pytest.approx(0.1)


def test_backend_collective_factors():
    # gloo: the reduce-scatter takes ~2x its ring ideal, the all-gather ~1.5x
    p = cm.predict_all(WORK, hw(rs_factor=2.0, ag_factor=1.5, ar_factor=1.1))
    assert p["zero1"]["step_time_s"] == pytest.approx(2 + 2 * 2 + 1.5 * 2)
    assert p["ddp"]["step_time_s"] == pytest.approx(2 + 1.1 * 4 - 2 / 3 * (1 - 2**20 / 4e6))
    assert p["fsdp"]["step_time_s"] == pytest.approx(2 * 1.5 * 2 + (2 * 1.5 * 2 + 2 * 2))


def test_bf16_estimate_halves_the_estimate_rounds_bytes():
    p = cm.predict_all(WORK, hw())  # fp32 on the wire: M = 4 s; the bf16 estimate round 2 s
    assert p["acco"]["step_time_s"] == pytest.approx(4 + 4)
    assert p["acco_bf16_estimate"]["step_time_s"] == pytest.approx(2 + 4)


STREAMING = {"replicas": 2, "inner": "ddp", "ranks_per_replica": 1, "sync_every": 10, "outer_lr": 1.0,
             "outer_momentum": 0.0, "fragments": 2, "overlap_steps": 1, "mixing": 0.0, "outer_dtype": "bf16",
             "eager": True, "balance_replicas": False}  # fmt: skip
TABLE = {"tokens_to_target": {
    "acco": {"mean": 1.02, "ci95": 0.01, "seeds": 5, "source": "bench_results/a.md"},
    "zero1": {"mean": 1.001, "ci95": 0.002, "seeds": 5, "source": "bench_results/a.md"},
    "wp": {"not_reached_within": 1.25, "gap_pct": 15.0, "seeds": 2, "source": "bench_results/c.md"},
    "streaming_h10_avg": {"mean": 1.25, "ci95": 0.04, "seeds": 5, "source": "bench_results/b.md", "diloco": STREAMING},
    **{f"streaming_h10_avg_topk1_int2{suffix}": {"mean": 1.4, "ci95": 0.1, "seeds": 5, "source": "bench_results/d.md",
                                                 "diloco": {**STREAMING, "outer_dtype": "int2", "topk": 0.01,
                                                            "topk_mean": mean}}
       for suffix, mean in (("", "replicas"), ("_senders", "senders"))},
}}  # fmt: skip


def test_tokens_ratio_is_measured_or_inherited_from_the_update_computed_and_else_none():
    def ratio(label):  # tokens to DDP's loss over DDP's, as predict reads them
        source = cm.token_source(label, TABLE)
        return None if source is None else cm.measured_entry(source, TABLE).get("mean")

    assert ratio("ddp") == ratio("ddp_balanced") == 1.0  # the reference
    assert ratio("zero1") == ratio("zero1_balanced") == 1.001  # its own entry first, a balanced mode's its strategy's
    assert ratio("fsdp") == ratio("hsdp") == 1.0  # DDP's update in another floating-point order (HSDP inherits FSDP)
    assert ratio("acco") == ratio("acco_balanced") == 1.02
    for unmeasured in ("acco_bf16_estimate", "acco_adaptive", "acco_adaptive_uncapped", "dpu", "wp"):
        assert ratio(unmeasured) is None, unmeasured
    # measured not to reach DDP's loss: no time, and the cell says so rather than "not measured"
    assert cm.not_reached_note(cm.token_source("wp", TABLE), TABLE) == "not reached in 1.25× the tokens"
    assert cm.not_reached_note(cm.token_source("dpu", TABLE), TABLE) is None
    assert cm.token_source("hsdp", TABLE) == "ddp" and cm.token_source("acco_balanced", TABLE) == "acco"


def test_a_diloco_row_takes_a_measurement_only_with_the_same_replicas_inner_update_and_outer_step():
    from torchacco.config import DiLoCo

    outer = DiLoCo(sync_every=10, fragments=2, overlap_steps=1, eager=True, outer_lr=1, outer_momentum=0,
                   outer_dtype="bf16")  # fmt: skip
    source = lambda inner, replicas=2, **changed: cm.diloco_token_source(
        inner, replicas, dataclasses.replace(outer, **changed), TABLE
    )
    # ZeRO-1 and FSDP inside compute DDP's update, however many ranks a replica has
    assert source("ddp") == source("zero1") == source("fsdp") == "streaming_h10_avg"
    assert source("ddp", replicas=4) is None
    for changed in (
        {"sync_every": 20},
        {"fragments": 1, "overlap_steps": 0, "eager": False},
        {"eager": False},
        {"outer_lr": 0.7},
        {"outer_momentum": 0.9},
        {"outer_dtype": "fp32"},
        {"topk": 0.01},
    ):  # fmt: skip  (an entry recording no topk measured the dense pseudo-gradient)
        assert source("ddp", **changed) is None, changed
    assert source("ddp", offload=True) == "streaming_h10_avg"  # where θ_global is kept, not what it is
    # the residual's decay and the sparse mean change nothing without topk, and everything with it
    assert source("ddp", error_decay=1.0, topk_mean="replicas") == "streaming_h10_avg"
    sparse = dict(topk=0.01, outer_dtype="int2")
    assert source("ddp", **sparse) == "streaming_h10_avg_topk1_int2_senders"  # the default mean
    assert source("ddp", **sparse, topk_mean="replicas") == "streaming_h10_avg_topk1_int2"
    assert source("ddp", **sparse, error_decay=1.0) is None


def test_the_shipped_table_says_where_its_numbers_come_from():
    table = cm.token_table()
    assert {"date", "machine", "model", "commands"} <= set(table) and table["commands"]
    for label, entry in table["tokens_to_target"].items():
        measured = entry.get("mean", 0) > 0 or entry.get("not_reached_within", 0) > 1
        assert measured and entry["seeds"] >= 2, label
        for source in entry["source"].split(" and "):  # a pooled entry names each file it pools
            assert (ROOT / source).exists(), (label, source)


def test_fragments_hold_the_parameters_the_trainer_gives_them():
    from torchacco.models.gpt_neo import spec
    from torchacco.planning.cost_model import model_fragment_params

    sizes = model_fragment_params("gpt_neo", "debug", 2, vocab_size=1024)
    args = dataclasses.replace(spec.flavors["debug"], vocab_size=1024)
    assert sum(sizes) == args.num_params()
    # One block each; the token and position embeddings before the first, the final norm after the last.
    assert sizes[0] - (args.vocab_size + args.max_seq_len) * args.dim == sizes[1] - 2 * args.dim


def test_diloco_time_per_update_adds_the_exposed_outer_transfer_over_h_updates():
    from torchacco.planning.cost_model import Hardware, Workload, diloco_memory_bytes, predict, predict_diloco

    work = Workload(params=1e6, flops_per_token=6e6, tokens_per_micro_batch=1000, micro_batches=2)
    hw = Hardware(nodes=2, flops=1e12, bandwidth_bps=1e8, ranks_per_node=1)
    inner = predict(work, Hardware(nodes=1, flops=1e12, bandwidth_bps=1e8), "zero1")["step_time_s"]
    transfer = 2 * (1 / 2) * 8 * 4e6 / 1e8  # one fp32 ring all-reduce of 1M parameters between 2 nodes
    plain = predict_diloco(work, hw, "zero1", sync_every=50)
    assert plain["step_time_s"] == pytest.approx(inner + transfer / 50)
    # 2 fragments in bf16, each all-gathered (one hop of its half) beside 4 inner updates: hidden when they outlast it
    streaming = predict_diloco(work, hw, "zero1", sync_every=50, fragments=2, overlap_steps=4, outer_dtype="bf16")
    fragment = 1 * 8 * 2e6 / 2 / 1e8
    assert streaming["step_time_s"] == pytest.approx(inner + 2 * max(0.0, fragment - 4 * inner) / 50)
    assert plain["tokens_per_update"] == 2 * 2 * 1000
    # top-k (41 of 4096 in 2 bits): each element costs its message's bytes over 4096, one all-gather hop
    sparse = predict_diloco(work, hw, "zero1", sync_every=50, outer_dtype="int2", topk=0.01)
    # offsets: 41 × 6 low bits and a bitmap of 41 + 4096 / 2⁶ bits; 2-bit codes; one fp32 scale
    message = math.ceil((41 * 6 + 41 + 64) / 8) + 41 * 2 / 8 + 4
    assert sparse["step_time_s"] == pytest.approx(inner + 8 * 1e6 * message / 4096 / 1e8 / 50)
    # DDP inside nodes of 4 ranks: each rank sends a quarter of Δ across, then the node all-gathers it in fp32
    four = Hardware(nodes=2, flops=1e12, bandwidth_bps=1e8, ranks_per_node=4, intra_bps=1e9)
    inner_ddp = predict(work, dataclasses.replace(four, nodes=1), "ddp")["step_time_s"]
    gather = 3 / 4 * 8 * 4e6 / 1e9  # the node's ring all-gather of the fp32 mean (ag_factor 1)
    ddp_inside = predict_diloco(work, four, "ddp", sync_every=50)
    assert ddp_inside["step_time_s"] == pytest.approx(inner_ddp + (transfer + gather) / 50)
    # Fragments of their own sizes, each at the all-gather's probed factor: a big first fragment (the embedding)
    # outlasts the inner updates that hide an even split's.
    slow = dataclasses.replace(hw, ag_factor=1.5)
    hide = fragment / inner + 0.5  # τ: each even fragment hidden with room to spare (T = 1.5 · 0.08 s)
    even = predict_diloco(work, hw, "zero1", 50, 2, overlap_steps=hide, outer_dtype="bf16")
    assert even["step_time_s"] == pytest.approx(inner)
    uneven = predict_diloco(work, slow, "zero1", 50, 2, hide, "bf16", fragment_params=[0.8e6, 0.2e6])
    big = 1.5 * 8 * 2 * 0.8e6 / 1e8
    assert uneven["step_time_s"] == pytest.approx(inner + (big - hide * inner) / 50)
    with pytest.raises(ValueError, match="3 sizes for 2 fragments"):
        predict_diloco(work, hw, "zero1", 50, 2, fragment_params=[1, 2, 3])
    node = Hardware(nodes=1, flops=1e12, bandwidth_bps=1e8, ranks_per_node=4)
    eight = Hardware(nodes=2, flops=1e12, bandwidth_bps=1e8, ranks_per_node=4)
    from torchacco.planning.cost_model import memory_bytes

    assert diloco_memory_bytes(work, eight, "zero1") == memory_bytes(work, node, "zero1") + 8 * 1e6 / 4
    assert diloco_memory_bytes(work, eight, "ddp") == memory_bytes(work, node, "ddp") + 8 * 1e6
    assert diloco_memory_bytes(work, eight, "zero1", offload=True) == memory_bytes(work, node, "zero1")


@pytest.mark.parametrize("cap_mb, expected", [(0.0, 2), (25.0, 1)])
def test_ddps_buckets_are_the_ones_the_model_assumes(cap_mb, expected):
    """torchacco's DDP on a group of one: [parallelism] bucket_cap_mb = 0 gets torch's small first bucket, a cap
    that is set makes every bucket that size (torch rebuilds its buckets in the backward's order after one
    update); the cost model splits the same bytes the same way."""
    import types

    import torch
    import torch.distributed as dist

    from torchacco.config import Optimizer
    from torchacco.parallel.ddp import DDP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])  # 2.1 MB of fp32 gradients
        dims = types.SimpleNamespace(dp_group=dist.group.WORLD, dp_size=1, dp_rank=0)
        plan = types.SimpleNamespace(micro_batches=1, schedule=None, max_norm=1.0)
        ddp = DDP(model, dims, plan, Optimizer(), bucket_cap_mb=cap_mb)
        for _ in range(3):
            ddp.model(torch.randn(4, 256)).sum().backward()
        sizes = [int(s) for s in ddp.model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")]
    finally:
        dist.destroy_process_group()
    total = sum(p.numel() * 4 for p in model.parameters())
    work = dataclasses.replace(WORK, params=total / 4, **cm.ddp_buckets(cap_mb))
    modelled = cm.buckets(total, work.bucket_bytes, work.first_bucket_bytes)
    assert len(sizes) == len(modelled) == expected
    assert sizes == pytest.approx(modelled, rel=0.01)  # torch closes a bucket at the first parameter past the cap


def test_predict_names_the_lr_a_ratio_was_tuned_to(monkeypatch):
    from torchacco.planning import predict

    entry = {"mean": 1.4, "ci95": 0.05, "seeds": 5, "source": "bench_results/h50.md", "lr_multiple": 0.5}
    monkeypatch.setattr(cm, "measured_entry", lambda source: entry)
    assert predict._ratio("streaming_h50_avg") == "1.400 ± 0.050 at 0.5× lr"
    del entry["lr_multiple"]  # measured at DDP's lr: nothing said
    assert predict._ratio("streaming_h50_avg") == "1.400 ± 0.050"
