"""The outer step's wire: the token-weighted mean of the replicas' pseudo-gradients (docs/diloco.md). fp32 is one
all-reduce; bf16 and the integer codes are all-gathered and summed in fp32 (a sum in the wire format would round at
every hop; codes have no sum), with one fp32 scale per `ROW` elements: an element's error is at most |x|_max / 254
in int8, / 14 in int4, / 2 in int2 (its row's)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from torchacco.parallel.collectives import all_gather_single
from torchacco.parallel.diloco.compression import as_bytes, dequantize, from_bytes, pack, quantize, unpack
from torchacco.parallel.diloco.wire import CODE_BITS, ROW


def token_weighted_mean(delta: torch.Tensor, tokens: float, group, wire: str = "fp32") -> torch.Tensor:
    """Σ_r (tokens_r / Σ_s tokens_s) · Δ_r over the ranks of `group`, in fp32. The weights stay
    on the device (no host sync, so this runs on a CUDA side stream as it is)."""
    weight = torch.full((1,), tokens, dtype=torch.float64, device=delta.device)  # (a kernel, not a host copy)
    dist.all_reduce(weight, group=group)
    share = (tokens / weight).to(torch.float32)
    if wire == "fp32":
        out = delta * share
        dist.all_reduce(out, group=group)
        return out
    world = dist.get_world_size(group)
    if wire == "bf16":
        payload = (delta * share).to(torch.bfloat16)
        gathered = [torch.empty_like(payload) for _ in range(world)]
        dist.all_gather(gathered, payload, group=group)
        return torch.stack([g.float() for g in gathered]).sum(dim=0)
    return _dense_code_mean(delta * share, group, CODE_BITS[wire])


def _dense_code_mean(x: torch.Tensor, group, bits: int) -> torch.Tensor:
    """Σ over `group` of x, sent in a `bits`-bit code with one scale per ROW elements."""
    codes, scales = quantize(torch.nn.functional.pad(x, (0, -x.numel() % ROW)).view(-1, ROW), bits)
    message = torch.cat([pack(codes, bits), as_bytes(scales)])
    world = dist.get_world_size(group)
    messages = torch.empty(world * message.numel(), dtype=torch.uint8, device=x.device)
    all_gather_single(messages, message, group=group)
    messages = messages.view(world, -1)
    code_bytes = codes.numel() * bits // 8
    out = torch.zeros(codes.numel(), dtype=torch.float32, device=x.device)
    for m in messages:  # in rank order: every rank sums alike
        got = unpack(m[:code_bytes], bits, codes.numel()).view(-1, ROW)
        out.add_(dequantize(got, from_bytes(m[code_bytes:], torch.float32), bits).view(-1))
    return out[: x.numel()]


def split_across(
    fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], x: torch.Tensor, split_group, align: int
) -> tuple[torch.Tensor, ...]:
    """`fn` of x when every rank of `split_group` holds x alike: each rank applies `fn` to its 1/n of
    x (pieces of whole `align`s, zero-padded past x's end), and `split_group` all-gathers each result.
    With `split_group` None (no split; not the world group here), `fn(x)` itself."""
    if split_group is None:
        return fn(x)
    n, me = dist.get_world_size(split_group), dist.get_rank(split_group)
    size = -(-x.numel() // (n * align)) * align
    piece = x[me * size : (me + 1) * size]
    outs = []
    for mine in fn(torch.nn.functional.pad(piece, (0, size - piece.numel()))):
        out = torch.empty(n * size, dtype=mine.dtype, device=mine.device)
        all_gather_single(out, mine.contiguous(), group=split_group)
        outs.append(out[: x.numel()])
    return tuple(outs)


def split_token_weighted_mean(delta: torch.Tensor, tokens: float, group, wire: str, split_group) -> torch.Tensor:
    """`token_weighted_mean` of a Δ that every rank of `split_group` holds alike (a replicated inner strategy's ranks in
    one replica): each rank takes its 1/n of Δ over `group`, and `split_group` all-gathers the pieces. The link between
    replicas carries Δ once per replica instead of once per rank. Pieces are whole rows, so bf16 and the integer codes
    give the unsplit mean element for element, and fp32 does up to the order of its sum over more than two replicas.
    With `split_group` None (no split; not the world group), `token_weighted_mean` itself."""
    (mean,) = split_across(lambda piece: (token_weighted_mean(piece, tokens, group, wire),), delta, split_group, ROW)
    return mean
