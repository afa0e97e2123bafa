"""Telling a binary file from text by its first bytes, so that it is an error naming the format, not training data.

A few bytes not valid UTF-8 in a real text file only warn (sources.py replaces them); a file
with a known binary signature (Parquet, Arrow, an archive, a compressed stream), or whose first
block is mostly undecodable or control bytes, is refused with the fix.
"""

from __future__ import annotations

import re
from pathlib import Path

from torchacco.errors import UserError

HEAD_BYTES = 1 << 16  # how much of a file is looked at
BINARY_SHARE = 0.3  # random or compressed bytes score about 0.5; text in a legacy 8-bit encoding less
# Bytes no text holds: undecodable bytes (as surrogate escapes), NUL and the C0 controls other than
# tab, newlines, form feeds and escape.
_NOT_TEXT = re.compile("[\udc80-\udcff\x00-\x08\x0e-\x1a\x1c-\x1f]")
NAMES = {
    "parquet": "a Parquet file",
    "arrow": "an Arrow file",
    "gzip": "gzip-compressed",
    "zip": "a zip archive",
    "tar": "a tar archive",
    "bzip2": "bzip2-compressed",
    "xz": "xz-compressed",
    "zstd": "zstd-compressed",
    "utf16": "UTF-16 text",
    "lfs": "a Git LFS pointer",
}
LFS_FIX = "git lfs pull in its repository, or download it with huggingface-cli download"


def detect(start: bytes) -> str | None:
    """The binary format a file starting with `start` is in, or None."""
    if start.startswith(b"PAR1"):
        return "parquet"
    if start.startswith(b"ARROW1") or start.startswith(b"\xff\xff\xff\xff"):  # IPC file, IPC stream
        return "arrow"
    if start.startswith(b"\x1f\x8b"):
        return "gzip"
    if start[:4] in (b"PK\x03\x04", b"PK\x05\x06", b"PK\x07\x08"):
        return "zip"
    if start[257:262] == b"ustar" and start[262:263] in (b"\x00", b" "):
        return "tar"
    if start.startswith(b"BZh") and start[3:4].isdigit() and start[4:10] in (b"1AY&SY", b"\x17rE8P\x90"):
        return "bzip2"
    if start.startswith(b"\xfd7zXZ\x00"):
        return "xz"
    if start.startswith(b"\x28\xb5\x2f\xfd"):
        return "zstd"
    if start.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "utf16"
    if start.startswith(b"version https://git-lfs.github.com/spec/"):  # a clone without git-lfs
        return "lfs"
    return None


def head(file: Path) -> bytes:
    with open(file, "rb") as f:
        return f.read(HEAD_BYTES)


def check_text(file: Path, fmt: str, start: bytes) -> None:
    """Refuse a file to be read as text that is not (`start`: its head): a UserError naming its format and the fix."""
    kind = detect(start)
    fixes = {
        "parquet": f"is a Parquet file but is read as text (format = '{fmt}'); set [data] format = 'parquet' "
        f"(or 'auto')",
        "arrow": "is an Arrow file (a datasets cache or save_to_disk file), which is not read; export it as "
        "Parquet or JSON Lines (e.g. datasets.Dataset.from_file(path).to_parquet(out))",
        "gzip": f"is gzip-compressed: decompress it first (gunzip -k {file})",
        "zip": "is a zip archive: extract it first (unzip) and point [data] dataset at the files",
        "tar": "is a tar archive: extract it first (tar xf) and point [data] dataset at the files",
        "bzip2": f"is bzip2-compressed: decompress it first (bunzip2 -k {file})",
        "xz": f"is xz-compressed: decompress it first (unxz -k {file})",
        "zstd": f"is zstd-compressed: decompress it first (unzstd {file})",
        "utf16": f"is UTF-16 text: convert it to UTF-8 first (iconv -f UTF-16 -t UTF-8 {file})",
        "lfs": f"is a Git LFS pointer, not the data: fetch the file itself ({LFS_FIX})",
    }
    if kind:
        raise UserError(f"{file} {fixes[kind]}")
    share = len(_NOT_TEXT.findall(start.decode("utf-8", errors="surrogateescape"))) / max(1, len(start))
    if share > BINARY_SHARE:
        raise UserError(
            f"{file} is not text: {share:.0%} of its first {len(start)} bytes are not UTF-8 or are control bytes; "
            f"point [data] dataset at .txt, .jsonl, .json or .parquet files (text must be UTF-8)"
        )


def is_parquet(file: Path) -> bool:
    with open(file, "rb") as f:
        return f.read(4) == b"PAR1"
