"""Reading the user's data as documents: .txt files and folders, .jsonl records, Alpaca .json/.jsonl, Parquet.

A document is a string, or a (prompt, response) pair for instruction data, whose prompt
tokens are left out of the loss. `Documents` reads them anew on every pass and holds one
document at a time (a .txt file of a folder, a .jsonl line, a batch of Parquet rows; a lone
.txt file is read in blocks), so a corpus larger than memory streams; only an Alpaca .json
list is read whole. JSON records are read by records.py, Parquet by parquet.py. Text that is
not valid UTF-8 is decoded with undecodable bytes replaced by U+FFFD and the files affected
are logged; a binary file (Parquet read as text, an archive, compressed data) is an error
naming its format (sniff.py). Empty or null documents are skipped and counted in the log.
Malformed records (bad JSON, missing fields) are errors naming the file and line: silently
dropping them would train on less than asked.
"""

from __future__ import annotations

import codecs
import glob
import logging
from collections.abc import Iterator
from pathlib import Path

from torchacco.data import parquet, records, sniff
from torchacco.data.corpus import cut_pieces
from torchacco.errors import UserError

log = logging.getLogger(__name__)

Doc = str | tuple[str, str]
EXTENSIONS = {
    "text": (".txt",),
    "jsonl": (".jsonl",),
    "alpaca": (".json", ".jsonl", ".parquet"),
    "parquet": (".parquet",),
}
AUTO_EXTENSIONS = ((".txt",), (".jsonl", ".json"), (".parquet",))  # in a folder, the first of these found
TEXT_BLOCK_BYTES = 1 << 23  # a lone .txt file is read in blocks of this size


def files(path: Path, fmt: str) -> list[Path]:
    """The data files of a dataset path: the file itself, the files a glob pattern matches, or the
    matching files under a folder (hidden ones left out: a download tool's cache, editor files)."""
    if not path.exists() and glob.has_magic(str(path)):
        found = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not found:
            raise UserError(f"no files match {path}; fix the pattern in data.dataset (or data.validation)")
        return found
    if not path.exists():
        raise UserError(
            f"data not found: {path} (set data.dataset to a folder of .txt files, a .txt, .jsonl, "
            f"Alpaca .json or .parquet file, a folder or glob pattern of .parquet shards, or 'embedded')"
        )
    if path.is_file():
        return [path]
    everything = [p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path))]
    for suffixes in AUTO_EXTENSIONS if fmt == "auto" else (EXTENSIONS[fmt],):
        found = sorted(p for p in everything if p.suffix in suffixes)
        if found:
            return found
    wanted = [s for group in (AUTO_EXTENSIONS if fmt == "auto" else (EXTENSIONS[fmt],)) for s in group]
    wanted = ", ".join(wanted[:-1]) + " or " + wanted[-1] if len(wanted) > 1 else wanted[0]
    raise UserError(f"no {wanted} files under {path}; put the documents there or point data.dataset at a file")


def fingerprint(path: Path, fmt: str) -> list:
    """What identifies the data for the caches: each file's path, size and modification time."""
    return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files(path, fmt)]


def read_documents(path: Path, fmt: str, text_field: str) -> list[Doc]:
    """All documents of a dataset path, in a list."""
    return list(Documents(path, fmt, text_field))


class Documents:
    """The documents of a dataset path, read anew on every pass. A lone .txt file is cut at blank
    lines into documents; each .txt file of a folder or pattern is one. The first complete pass
    logs what it replaced or skipped, and finding no document at all is an error."""

    def __init__(self, path: Path, fmt: str, text_field: str):
        self.path, self.fmt, self.text_field = path, fmt, text_field
        self.files = files(path, fmt)
        self._reported = False

    def __iter__(self) -> Iterator[Doc]:
        not_utf8, kept, empty = [], 0, 0
        for file in self.files:
            for doc in self._read(file, not_utf8):
                if isinstance(doc, tuple) or (doc and doc.strip()):
                    kept += 1
                    yield doc
                else:
                    empty += 1
        if self._reported:
            return
        self._reported = True
        if not_utf8:
            log.warning(
                "data: %d file(s) are not valid UTF-8 (first: %s); undecodable bytes were replaced by U+FFFD",
                len(not_utf8),
                not_utf8[0],
            )
        if empty:
            log.info("data: skipped %d empty document(s) in %s", empty, self.path)
        if not kept:
            raise UserError(f"no documents in {self.path}: its files hold no text; add data or fix data.dataset")

    def _read(self, file: Path, not_utf8: list) -> Iterator[Doc | None]:
        fmt = self.fmt
        if fmt == "parquet" or (fmt in ("auto", "alpaca") and file.suffix == ".parquet"):
            yield from parquet.documents(file, fmt, self.text_field, not_utf8)
            return
        start = sniff.head(file)
        if fmt in ("auto", "alpaca") and sniff.detect(start) == "parquet":
            yield from parquet.documents(file, fmt, self.text_field, not_utf8)
            return
        sniff.check_text(file, fmt, start)
        kind = fmt if fmt != "auto" else {".json": "alpaca", ".jsonl": "jsonl"}.get(file.suffix, "text")
        if kind == "text":
            if self.path.is_file():
                yield from cut_pieces(_text_blocks(file, not_utf8))
            else:
                yield _read_text(file, not_utf8)
            return
        found = (
            records.json_list(file, _read_text(file, not_utf8))
            if file.suffix == ".json"
            else records.lines(file, not_utf8)
        )
        for number, (where, rec) in enumerate(found):
            if number == 0 and fmt == "auto" and kind == "jsonl" and records.is_alpaca(rec):
                kind = "alpaca"  # the file's first record decides
            yield (
                records.alpaca_pair(file, where, rec)
                if kind == "alpaca"
                else records.field_text(file, where, rec, self.text_field)
            )


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _read_text(file: Path, not_utf8: list) -> str:
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        not_utf8.append(file)
        text = raw.decode("utf-8-sig", errors="replace")
    return text.replace("\r\n", "\n")


def _text_blocks(file: Path, not_utf8: list, block_bytes: int = TEXT_BLOCK_BYTES) -> Iterator[str]:
    """`_read_text(file)` in consecutive pieces."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
    replacement = "\ufffd".encode()
    found, decoded, tail, held = 0, 0, b"", ""
    with open(file, "rb") as f:
        while True:
            raw = f.read(block_bytes)
            new = decoder.decode(raw, final=not raw)
            decoded += new.count("\ufffd")
            found += (tail + raw).count(replacement)  # U+FFFD written in the file, not a replacement
            tail = (tail + raw)[-2:]  # the start of one that ends in the next block
            text = held + new
            held = "\r" if raw and text.endswith("\r") else ""  # a \r\n may straddle two blocks
            yield text[: len(text) - len(held)].replace("\r\n", "\n")
            if not raw:
                break
    if decoded > found:
        not_utf8.append(file)
