"""The outer step's wire formats in one table (docs/diloco.md#compression): each `outer_dtype`'s bits per value, sent
dense (pseudo_gradient.py) or as top-k messages (compression.py). The exchange's outer_bytes, the cost model and the
codecs read their sizes here."""

from __future__ import annotations

import math

ROW = 256  # elements per scale of the dense integer codes
CHUNK = 4096  # elements per top-k chunk and per scale of the sparse codes
VALUE_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4, "int2": 2}  # the wires: bits per value
CODE_BITS = {wire: bits for wire, bits in VALUE_BITS.items() if wire.startswith("int")}  # codes, with fp32 scales
# Dense: its values and, for a code, one fp32 scale per ROW elements.
WIRE_BYTES = {wire: bits / 8 + (4.0 / ROW if wire in CODE_BITS else 0.0) for wire, bits in VALUE_BITS.items()}


def keep_per_chunk(topk: float) -> int:
    """Elements kept of every CHUNK: the fraction `topk`, rounded, at least one."""
    return max(1, min(CHUNK, round(topk * CHUNK)))


def offset_code(keep: int) -> tuple[int, int]:
    """(low bits per offset, bytes per chunk) of the Elias–Fano code of a chunk's `keep` offsets: each
    offset's low bits as they are, its high part x >> low as one set bit at (x >> low) + i in a bitmap of
    keep + (CHUNK >> low) bits (i its rank in ascending order). low = ⌊log2(CHUNK / keep)⌋ makes it at most
    2 + ⌈log2(CHUNK / keep)⌉ bits an offset, whatever the offsets are."""
    low = (CHUNK // keep).bit_length() - 1
    return low, -(-(keep * low + keep + (CHUNK >> low)) // 8)


def message_bytes(numel: int, keep: int, wire: str) -> int:
    """The size of one rank's top-k message for `numel` elements."""
    chunks, bits = -(-numel // CHUNK), VALUE_BITS[wire]
    offsets = chunks * offset_code(keep)[1]
    if wire in CODE_BITS:
        values = math.ceil(chunks * keep * bits / 8) + 4 * chunks
    else:
        values = chunks * keep * bits // 8
    return offsets + values


def wire_bytes(numel: int, wire: str, keep: int = 0) -> float:
    """The bytes one rank sends for `numel` elements: dense, or the top-k message of `keep` per chunk."""
    return float(message_bytes(numel, keep, wire)) if keep else numel * WIRE_BYTES[wire]


def bytes_per_element(wire: str, topk: float = 0.0) -> float:
    """The mean bytes on the wire per element of a large pseudo-gradient (the cost model's)."""
    return wire_bytes(8 * CHUNK, wire, keep_per_chunk(topk) if topk else 0) / (8 * CHUNK)  # (whole bytes of codes)
