"""Reading the user's data as documents: .txt files and folders, .jsonl records, Alpaca .json/.jsonl.

A document is a string, or a (prompt, response) pair for instruction data, whose prompt
tokens are left out of the loss. Text that is not valid UTF-8 is decoded with undecodable
bytes replaced by U+FFFD; the files affected are counted and logged, not rejected. Empty
documents are skipped and counted in the log. Malformed records (bad JSON, missing fields)
are errors naming the file and line: silently dropping them would train on less than asked.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from torchacco.data.corpus import cut_at_blank_lines
from torchacco.errors import UserError

log = logging.getLogger(__name__)

Doc = str | tuple[str, str]
EXTENSIONS = {"text": (".txt",), "jsonl": (".jsonl",), "alpaca": (".json", ".jsonl"), "auto": (".txt",)}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


def files(path: Path, fmt: str) -> list[Path]:
    """The data files of a dataset path: the file itself, or the matching files under a folder."""
    if not path.exists():
        raise UserError(
            f"data not found: {path} (set data.dataset to a folder of .txt files, a .txt, "
            f".jsonl or Alpaca .json file, or 'embedded')"
        )
    if path.is_file():
        return [path]
    found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in EXTENSIONS[fmt])
    if not found and fmt == "auto":  # a folder of .jsonl / .json shards
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".jsonl", ".json"))
    if not found:
        raise UserError(
            f"no {' or '.join(EXTENSIONS[fmt])} files under {path}; put the documents there "
            f"or point data.dataset at a file"
        )
    return found


def fingerprint(path: Path, fmt: str) -> list:
    """What identifies the data for the caches: each file's path, size and modification time."""
    return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files(path, fmt)]


def read_documents(path: Path, fmt: str, text_field: str) -> list[Doc]:
    """All documents of a dataset path. A lone .txt file is cut at blank lines into documents."""
    docs, not_utf8 = [], []
    for file in files(path, fmt):
        text = _read_text(file, not_utf8)
        kind = fmt if fmt != "auto" else {".json": "alpaca", ".jsonl": "jsonl"}.get(file.suffix, "text")
        if kind == "text":
            docs += cut_at_blank_lines(text) if path.is_file() else [text]
            continue
        records = _records(file, text)
        if kind == "jsonl" and fmt == "auto" and records and text_field not in records[0][1]:
            if {"instruction", "output"} <= records[0][1].keys():
                kind = "alpaca"
        docs += [
            _alpaca(file, where, rec) if kind == "alpaca" else _field(file, where, rec, text_field)
            for where, rec in records
        ]
    if not_utf8:
        log.warning(
            "data: %d file(s) are not valid UTF-8 (first: %s); undecodable bytes were replaced by U+FFFD",
            len(not_utf8),
            not_utf8[0],
        )
    kept = [d for d in docs if not isinstance(d, str) or d.strip()]
    if len(kept) < len(docs):
        log.info("data: skipped %d empty document(s) in %s", len(docs) - len(kept), path)
    docs = kept
    if not docs:
        raise UserError(f"no documents in {path}: its files hold no text; add data or fix data.dataset")
    return docs


def split(docs: list[Doc], val_fraction: float, where: Path | str) -> tuple[list[Doc], list[Doc]]:
    """Deterministic train/validation split by document: the documents whose content hashes lowest."""
    if not 0 <= val_fraction < 1:
        raise UserError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    if val_fraction == 0:
        return docs, []
    if len(docs) < 2:
        raise UserError(
            f"{where} holds a single document, so no validation split can be cut from it; "
            f"add documents, set data.validation, or set data.val_fraction = 0"
        )
    count = min(len(docs) - 1, max(1, round(val_fraction * len(docs))))
    key = [hashlib.blake2b("".join(d).encode(), digest_size=8).digest() for d in docs]
    val = set(sorted(range(len(docs)), key=lambda i: (key[i], i))[:count])
    return [d for i, d in enumerate(docs) if i not in val], [d for i, d in enumerate(docs) if i in val]


def _read_text(file: Path, not_utf8: list) -> str:
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        not_utf8.append(file)
        text = raw.decode("utf-8-sig", errors="replace")
    return text.replace("\r\n", "\n")


def _records(file: Path, text: str) -> list[tuple[str, dict]]:
    """(where, record) pairs of a .jsonl (one object a line) or .json (a list of objects) file."""
    if file.suffix == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{file}: not valid JSON ({e}); an Alpaca .json file holds a list of records") from None
        if not isinstance(items, list):
            raise UserError(f"{file}: expected a JSON list of Alpaca records, got {type(items).__name__}")
        records = [(f"record {i}", item) for i, item in enumerate(items, 1)]
    else:
        records = []
        for i, line in enumerate(text.split("\n"), 1):
            if line.strip():
                try:
                    records.append((f"line {i}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise UserError(
                        f"{file}: line {i} is not valid JSON ({e.msg}); a .jsonl file holds one JSON object per line"
                    ) from None
    for where, rec in records:
        if not isinstance(rec, dict):
            raise UserError(f"{file}: {where} is a {type(rec).__name__}, expected a JSON object")
    return records


def _field(file: Path, where: str, rec: dict, text_field: str) -> str:
    if not isinstance(rec.get(text_field), str):
        problem = "has no field" if text_field not in rec else "has a non-string field"
        raise UserError(
            f"{file}: {where} {problem} '{text_field}' (its fields: {', '.join(rec) or 'none'}); "
            f"set data.text_field to the field holding the text"
        )
    return rec[text_field]


def _alpaca(file: Path, where: str, rec: dict) -> tuple[str, str]:
    missing = [k for k in ("instruction", "output") if not isinstance(rec.get(k), str)]
    if missing or not isinstance(rec.get("input") or "", str):
        missing = missing or ["input"]
        raise UserError(
            f"{file}: {where} lacks the Alpaca text field(s) {', '.join(missing)}; every record "
            f"needs string fields instruction and output (input is optional)"
        )
    template = ALPACA_PROMPT if rec.get("input") else ALPACA_PROMPT_NO_INPUT
    return template.format(instruction=rec["instruction"], input=rec.get("input")), rec["output"]
