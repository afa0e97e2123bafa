"""JSON records as documents: .jsonl lines and Alpaca .json lists, and the Alpaca prompt template.

A record's text field is a document; an Alpaca record (instruction, optional input, output)
is a (prompt, response) pair whose prompt is left out of the loss.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path

from torchacco.errors import UserError

ALPACA_FIELDS = ("instruction", "input", "output")
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


def is_alpaca(fields) -> bool:
    """Whether a record's fields (or a table's columns) make it Alpaca data."""
    return {"instruction", "output"} <= set(fields)


def lines(file: Path, not_utf8: list) -> Iterator[tuple[str, dict]]:
    """(where, record) pairs of a .jsonl file (one object a line), a line at a time."""
    replaced = False
    with open(file, "rb") as f:
        for i, raw in enumerate(f, 1):
            if i == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                replaced, line = True, raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{file}: line {i} is not valid JSON ({e.msg}); a .jsonl file holds one JSON object per line"
                ) from None
            yield _object(file, f"line {i}", rec)
    if replaced:
        not_utf8.append(file)


def json_list(file: Path, text: str) -> Iterator[tuple[str, dict]]:
    """(where, record) pairs of a .json file holding a list of objects."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{file}: not valid JSON ({e}); an Alpaca .json file holds a list of records") from None
    if not isinstance(items, list):
        raise UserError(f"{file}: expected a JSON list of Alpaca records, got {type(items).__name__}")
    return (_object(file, f"record {i}", item) for i, item in enumerate(items, 1))


def _object(file: Path, where: str, rec) -> tuple[str, dict]:
    if not isinstance(rec, dict):
        raise UserError(f"{file}: {where} is a {type(rec).__name__}, expected a JSON object")
    return where, rec


def field_text(file: Path, where: str, rec: dict, text_field: str) -> str | None:
    """The text of a record's `text_field` (None for a null: an empty document)."""
    if text_field in rec and rec[text_field] is None:
        return None
    if not isinstance(rec.get(text_field), str):
        problem = "has no field" if text_field not in rec else "has a non-string field"
        raise UserError(
            f"{file}: {where} {problem} '{text_field}' (its fields: {', '.join(rec) or 'none'}); "
            f"set data.text_field to the field holding the text"
        )
    return rec[text_field]


def alpaca_pair(file: Path, where: str, rec: dict) -> tuple[str, str]:
    """An Alpaca record as (prompt, response)."""
    missing = [k for k in ("instruction", "output") if not isinstance(rec.get(k), str)]
    if missing or not isinstance(rec.get("input") or "", str):
        missing = missing or ["input"]
        raise UserError(
            f"{file}: {where} lacks the Alpaca text field(s) {', '.join(missing)}; every record "
            f"needs string fields instruction and output (input is optional)"
        )
    template = ALPACA_PROMPT if rec.get("input") else ALPACA_PROMPT_NO_INPUT
    return template.format(instruction=rec["instruction"], input=rec.get("input")), rec["output"]
