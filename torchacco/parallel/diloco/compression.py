"""Compressed pseudo-gradients (`[diloco] topk`, 4- and 2-bit codes) for a slow link between replicas
(docs/diloco.md#compression). Top-k with error feedback, as SparseLoCo (arXiv 2508.15706), at each outer step:

    e ← β·e + Δ_r                       β: [diloco] error_decay
    c = Q(top-k of e, per chunk)        the k largest magnitudes of every CHUNK elements (ties: lowest offset)
    e ← e − c                           what Q and top-k dropped waits for the next outer step

A message is a chunk's k offsets in an Elias–Fano code and its values as `outer_dtype` (fp32, bf16, or codes with
one fp32 scale per chunk), the same size on every rank: one all-gather of bytes, decoded and summed in fp32 in
rank order (the same result everywhere)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from torchacco.device import DTYPES
from torchacco.errors import UserError
from torchacco.parallel.collectives import all_gather_single
from torchacco.parallel.diloco.wire import CHUNK, CODE_BITS, VALUE_BITS, offset_code

SORT_CHUNKS = 1 << 14  # chunks sorted at once (64M elements: about 1 GiB of the sort's temporaries)


def check_config(d) -> None:
    """[diloco] topk and what reads it."""
    if not 0.0 <= d.topk <= 1.0:
        raise UserError(f"[diloco] topk = {d.topk:g} is the fraction of the pseudo-gradient sent: use 0 (all) to 1")
    if not 0.0 <= d.error_decay <= 1.0:
        raise UserError(f"[diloco] error_decay = {d.error_decay:g} must be between 0 and 1")
    needs_topk = {"error_decay": "applies to what topk leaves unsent", "topk_mean": "averages what topk sends"}
    for name, what in needs_topk.items():
        if getattr(d, name) != getattr(type(d)(), name) and not d.topk:
            raise UserError(f"[diloco] {name} = {getattr(d, name)!r} {what}, and topk = 0 sends all; set topk")


# Codes: b bits per value, levels symmetric about 0 -------------------------------------------


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as uint8, one fp32 scale per row) of a 2-D fp32 tensor, for a dense pseudo-gradient: the
    levels −h..h·scale with h = 2^(b−1) − 1 and scale = max|row| / h, as int8's (0 stays 0), stored as
    q + h. An element's error is at most half a step, max|row| / 2h."""
    h = (1 << (bits - 1)) - 1
    scales = x.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / h
    codes = torch.round(x / scales[:, None]).clamp_(-h, h) + h
    return codes.to(torch.uint8), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    return (codes.float() - ((1 << (bits - 1)) - 1)) * scales[:, None]


def quantize_kept(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` for the values top-k kept, which are the chunk's largest and never worth sending as 0:
    all 2^b levels, (q − (2^b − 1)/2)·scale with scale = 2·max|row| / (2^b − 1) (2 bits: ±m/3, ±m). An
    element's error is at most max|row| / (2^b − 1)."""
    top = (1 << bits) - 1
    scales = x.abs().amax(dim=1) * (2.0 / top)  # 0 for a row of zeros (a frozen parameter's), which then sends 0s
    codes = torch.round(x / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None] + top / 2).clamp_(0, top)
    return codes.to(torch.uint8), scales


def dequantize_kept(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    return (codes.float() - ((1 << bits) - 1) / 2) * scales[:, None]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of `bits` < 8 bits each, 8 / bits to a byte (the count padded to whole bytes)."""
    per = 8 // bits
    flat = torch.nn.functional.pad(codes.reshape(-1), (0, -codes.numel() % per)).view(-1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (flat << shifts).sum(dim=1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    return ((packed.to(torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count].to(torch.uint8)


def _bit_weights(n: int, device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device)


def encode_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """Rows of ascending offsets (< CHUNK), `keep` a row, as their Elias–Fano codes: (rows, bytes per chunk)."""
    rows, keep = offsets.shape
    low, nbytes = offset_code(keep)
    bits = torch.zeros(rows, nbytes * 8, dtype=torch.uint8, device=offsets.device)
    bits[:, : keep * low] = ((offsets[..., None] >> _bit_weights(low, offsets.device)) & 1).reshape(rows, keep * low)
    bits.scatter_(1, keep * low + (offsets >> low) + _bit_weights(keep, offsets.device), 1)
    return (bits.view(rows, nbytes, 8).long() << _bit_weights(8, offsets.device)).sum(-1).to(torch.uint8)


def decode_offsets(codes: torch.Tensor, keep: int) -> torch.Tensor:
    """`encode_offsets` undone: (rows, keep) ascending offsets. No host sync (no nonzero): each set bit of
    the high bitmap goes to its rank's column by a running count."""
    low = offset_code(keep)[0]
    bits = ((codes.long()[..., None] >> _bit_weights(8, codes.device)) & 1).view(codes.shape[0], -1)
    lows = (bits[:, : keep * low].reshape(codes.shape[0], keep, low) << _bit_weights(low, codes.device)).sum(-1)
    high = bits[:, keep * low : keep * low + keep + (CHUNK >> low)]
    column = torch.where(high.bool(), high.cumsum(1) - 1, keep)  # unset bits go to a spare column
    where = torch.zeros(codes.shape[0], keep + 1, dtype=torch.int64, device=codes.device)
    where.scatter_(1, column, _bit_weights(high.shape[1], codes.device).expand_as(high))
    return ((where[:, :keep] - _bit_weights(keep, codes.device)) << low) | lows


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return b.clone().view(dtype)  # (a copy: a view must start at a multiple of the dtype's size)


# Top-k messages -------------------------------------------------------------------------------


def compress(e: torch.Tensor, keep: int, wire: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the message: bytes, what it decodes to: dense fp32 like e) of the `keep` largest magnitudes of
    every chunk of the flat fp32 tensor e."""
    chunks = torch.nn.functional.pad(e, (0, -e.numel() % CHUNK)).view(-1, CHUNK)
    # A stable sort, not topk: equal magnitudes (AdamW's first updates are ±lr) go to the lowest offset on every
    # device; SORT_CHUNKS at a time bound its memory; the kept offsets go in ascending order, as their code wants.
    order = [b.abs().sort(dim=1, descending=True, stable=True).indices[:, :keep].sort(dim=1).values
             for b in chunks.split(SORT_CHUNKS)]  # fmt: skip
    offsets = torch.cat(order)
    values = chunks.gather(1, offsets)
    if wire in CODE_BITS:
        bits = CODE_BITS[wire]
        codes, scales = quantize_kept(values, bits)
        sent = dequantize_kept(codes, scales, bits)
        payload = [pack(codes, bits) if bits < 8 else codes.reshape(-1), as_bytes(scales)]
    else:
        sent = values.to(DTYPES[wire])
        payload = [as_bytes(sent)]
        sent = sent.float()
    dense = torch.zeros_like(chunks).scatter_(1, offsets, sent).view(-1)[: e.numel()]
    index = torch.cat([encode_offsets(b).view(-1) for b in offsets.split(SORT_CHUNKS)])
    return torch.cat([index, *payload]), dense


def decompress(message: torch.Tensor, numel: int, keep: int, wire: str) -> torch.Tensor:
    """The dense fp32 tensor of `numel` elements that `compress` sent as `message`."""
    offsets, values = decode(message, numel, keep, wire)
    dense = torch.zeros(offsets.shape[0], CHUNK, dtype=torch.float32, device=message.device)
    return dense.scatter_(1, offsets, values).view(-1)[:numel]


def decode(message: torch.Tensor, numel: int, keep: int, wire: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets, fp32 values), each (chunks, keep), of the message `compress` sent for `numel` elements."""
    chunks, bits = -(-numel // CHUNK), VALUE_BITS[wire]
    n, offset_bytes = chunks * keep, chunks * offset_code(keep)[1]
    codes = message[:offset_bytes].view(chunks, -1)
    offsets = torch.cat([decode_offsets(b, keep) for b in codes.split(SORT_CHUNKS)])
    rest = message[offset_bytes:]
    if wire in CODE_BITS:
        code_bytes = math.ceil(n * bits / 8)
        codes = unpack(rest[:code_bytes], bits, n) if bits < 8 else rest[:code_bytes]
        scales = from_bytes(rest[code_bytes : code_bytes + 4 * chunks], torch.float32)
        values = dequantize_kept(codes.view(chunks, keep), scales, bits)
    else:
        values = from_bytes(rest, DTYPES[wire]).float().view(chunks, keep)
    return offsets, values


SENDERS_FLOOR = 0.5  # over the senders, the divisor's least share of all tokens: an element moves ≤ 2× its share


def sparse_token_weighted_mean(e: torch.Tensor, tokens: float, group, wire: str, keep: int, over_senders=False):
    """(Σ_r (tokens_r / Σ_s tokens_s) · c_r over the ranks of `group`, this rank's c), c_r the top-k message of rank
    r's `e`; `over_senders`: each element's Σ_s runs over the ranks that sent it, at least half of all tokens (so an
    element moves by at most twice its share: the others send theirs later). No host sync (a CUDA side stream's)."""
    message, sent = compress(e, keep, wire)
    world = dist.get_world_size(group)
    weights = torch.empty(world, dtype=torch.float64, device=e.device)
    all_gather_single(weights, torch.full((1,), tokens, dtype=torch.float64, device=e.device), group=group)
    shares = (weights / weights.sum()).to(torch.float32)
    messages = torch.empty(world * message.numel(), dtype=torch.uint8, device=e.device)
    all_gather_single(messages, message, group=group)
    messages = messages.view(world, -1)
    chunks = -(-e.numel() // CHUNK)
    mean = torch.zeros(chunks, CHUNK, dtype=torch.float32, device=e.device)
    senders = torch.zeros_like(mean) if over_senders else None
    for r in range(world):  # in rank order: every rank sums alike
        offsets, values = decode(messages[r], e.numel(), keep, wire)
        mean.scatter_add_(1, offsets, values * shares[r])
        if senders is not None:
            senders.scatter_add_(1, offsets, shares[r].expand_as(values))
    if senders is not None:
        mean.div_(senders.clamp_min_(SENDERS_FLOOR))
    return mean.view(-1)[: e.numel()], sent
