"""Compressed pseudo-gradients: top-k messages with error feedback, and the 8/4/2-bit codes."""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchacco.parallel.diloco.compression import (
    compress,
    decode_offsets,
    decompress,
    dequantize,
    dequantize_kept,
    encode_offsets,
    pack,
    quantize,
    quantize_kept,
    sparse_token_weighted_mean,
    unpack,
)
from torchacco.parallel.diloco.wire import CHUNK, WIRE_BYTES, keep_per_chunk, message_bytes

sys.path.insert(0, str(Path(__file__).parent))
from test_diloco import sparse_reference  # noqa: E402


def residual_like(numel: int, seed: int = 0) -> torch.Tensor:
    """Magnitudes over five decades, and runs of equal magnitudes (AdamW's first updates are ±lr)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)
    x[100:900] = torch.where(torch.rand(800, generator=g) < 0.5, -1e-2, 1e-2)
    return x


@pytest.mark.parametrize("wire, bits", [("fp32", None), ("bf16", None), ("int8", 8), ("int4", 4), ("int2", 2)])
def test_top_k_sends_what_a_sequential_reference_picks(wire, bits):
    """(That the rest stays in the residual is DiLoCo's part: test_diloco's equations check it.)"""
    e = residual_like(2 * CHUNK + 1000)
    keep = keep_per_chunk(0.05)
    message, sent = compress(e, keep, wire)
    expected = sparse_reference(e, keep, bits) if wire != "bf16" else sparse_reference(e, keep, None).bfloat16().float()
    torch.testing.assert_close(sent, expected, rtol=2e-7, atol=0)  # (the codes' step: fp32 against float64 rounding)
    assert torch.equal(decompress(message, e.numel(), keep, wire), sent)  # what is sent is what arrives
    assert message.numel() == message_bytes(e.numel(), keep, wire)
    for c in range(3):  # at most `keep` elements of each chunk were sent
        assert (sent[c * CHUNK : (c + 1) * CHUNK] != 0).sum() <= keep


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_top_k_codes_use_every_level_and_stay_within_half_a_step(bits):
    x = residual_like(3000).view(-1, 100)
    codes, scales = quantize_kept(x, bits)
    back = dequantize_kept(codes, scales, bits)
    assert ((back - x).abs() <= x.abs().amax(dim=1, keepdim=True) / ((1 << bits) - 1) * (1 + 1e-4)).all()
    assert (back != 0).all()  # no level is 0 (2 bits: ±m/3 and ±m)
    assert bits == 8 or set(codes.unique().tolist()) == set(range(1 << bits))


@pytest.mark.parametrize("wire", ["fp32", "int8", "int4", "int2"])
def test_a_chunk_of_zeros_sends_zeros(wire):
    """A frozen parameter's Δ is 0: its chunks send exact 0s (no subnormal scale), and so do the padded
    last chunk's slots past the tensor's end."""
    e = torch.cat([torch.zeros(CHUNK), residual_like(CHUNK + 30)])
    message, sent = compress(e, 41, wire)
    assert torch.equal(decompress(message, e.numel(), 41, wire), sent)
    assert (sent[:CHUNK] == 0).all() and torch.count_nonzero(sent[CHUNK:]) == 41 + 30


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dense_codes_keep_zero_and_stay_within_half_a_step_of_their_row(bits):
    x = residual_like(3000).view(-1, 100)
    codes, scales = quantize(x, bits)
    sent = unpack(pack(codes, bits), bits, codes.numel()).view_as(codes) if bits < 8 else codes
    back = dequantize(sent, scales, bits)
    half_step = x.abs().amax(dim=1, keepdim=True) / (2 * ((1 << (bits - 1)) - 1))
    assert ((back - x).abs() <= half_step * (1 + 1e-6)).all()
    assert codes.max().item() < (1 << bits) and (quantize(torch.zeros(1, 8), bits)[0] == (1 << (bits - 1)) - 1).all()


@pytest.mark.parametrize("keep", [1, 2, 41, 61, 123, 410, 2048, 2049, 4096])
def test_offsets_round_trip_in_about_two_plus_log_bits_each(keep):
    g = torch.Generator().manual_seed(keep)
    rows = [torch.randperm(CHUNK, generator=g)[:keep].sort().values for _ in range(5)]
    rows += [torch.arange(keep), torch.arange(CHUNK - keep, CHUNK)]  # the tightest and the widest high parts
    offsets = torch.stack(rows)
    codes = encode_offsets(offsets)
    assert torch.equal(decode_offsets(codes, keep), offsets)
    assert codes.shape[1] * 8 <= keep * (2 + math.ceil(math.log2(CHUNK / keep))) + 7


def test_codes_pack_into_their_bits():
    for bits in (4, 2):
        codes = torch.randint(0, 1 << bits, (1001,), dtype=torch.uint8)
        assert torch.equal(unpack(pack(codes, bits), bits, 1001), codes)
        assert pack(codes, bits).numel() == -(-1001 * bits // 8)


def test_two_bit_top_k_of_one_and_a_half_percent_is_100_times_smaller_than_bf16():
    numel = 1000 * CHUNK
    assert 2 * numel / message_bytes(numel, keep_per_chunk(0.015), "int2") > 100
    assert WIRE_BYTES["int2"] < WIRE_BYTES["int4"] < WIRE_BYTES["int8"]


def _exchange_rank(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 3), rank=rank, world_size=3)
    e = residual_like(CHUNK + 300, seed=rank)
    results = {}
    for wire in ("fp32", "bf16", "int4", "int2"):
        results[wire] = sparse_token_weighted_mean(e, [100.0, 300.0, 600.0][rank], dist.group.WORLD, wire, 50)
    results["senders"] = sparse_token_weighted_mean(e, [100.0, 300.0, 600.0][rank], dist.group.WORLD, "int2", 50, True)
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.integration
def test_the_sparse_exchange_equals_the_token_weighted_sum_of_what_each_rank_sent(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "mean")
    mp.spawn(_exchange_rank, args=(str(tmp_path / "store"), out), nprocs=3)
    per_rank = [torch.load(f"{out}.{rank}") for rank in range(3)]
    for wire in ("fp32", "bf16", "int4", "int2"):
        expected = sum(share * r[wire][1] for share, r in zip((0.1, 0.3, 0.6), per_rank))
        torch.testing.assert_close(per_rank[0][wire][0], expected, rtol=1e-6, atol=1e-9)
        assert all(torch.equal(r[wire][0], per_rank[0][wire][0]) for r in per_rank), wire  # every rank agrees
    # Over the senders: each element's weights are those of the ranks that sent it (2-bit codes are never 0), at
    # least half of all
    sent = [r["senders"][1] for r in per_rank]
    weight = sum(share * (s != 0) for share, s in zip((0.1, 0.3, 0.6), sent))
    expected = sum(share * s for share, s in zip((0.1, 0.3, 0.6), sent)) / weight.clamp_min(0.5)
    assert (weight == 0).any() and ((weight > 0.5) & (weight < 1)).any()  # elements none sent, and two did
    assert ((weight > 0) & (weight < 0.5)).any()  # elements whose senders hold under half the tokens: the floor
    torch.testing.assert_close(per_rank[0]["senders"][0], expected, rtol=1e-6, atol=1e-9)


def test_sorting_a_few_chunks_at_a_time_picks_the_same(monkeypatch):
    from torchacco.parallel.diloco import compression

    e = residual_like(3 * CHUNK + 5)
    whole = compress(e, 40, "int2")
    monkeypatch.setattr(compression, "SORT_CHUNKS", 1)
    blocked = compress(e, 40, "int2")
    assert torch.equal(whole[0], blocked[0]) and torch.equal(whole[1], blocked[1])
