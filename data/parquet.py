"""Parquet files (how the Hugging Face Hub stores datasets), read with the optional pyarrow.

Rows are decoded one row group at a time (and large row groups in batches of BATCH_ROWS), so
the memory used is bounded by a row group, not by the file or the corpus.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from torchacco.data import records, sniff
from torchacco.errors import UserError

BATCH_ROWS = 4096
TEXT_TYPES = ("string", "large_string", "string_view")
INSTALL = "pip install 'torchacco[parquet]' (in a ./install.sh checkout: .venv/bin/pip install pyarrow)"


def _pyarrow():
    """pyarrow and pyarrow.parquet, imported on first use: an optional extra."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise UserError(f"reading Parquet files needs pyarrow, an optional extra: {INSTALL}") from None
    return pyarrow, pyarrow.parquet


def _open(file: Path):
    pa, pq = _pyarrow()
    if not sniff.is_parquet(file):
        kind = sniff.detect(sniff.head(file))
        what = f"it is {sniff.NAMES[kind]}" if kind else "it lacks Parquet's PAR1 signature"
        raise UserError(
            f"{file} is not a Parquet file ({what}); set [data] format to the file's format ('auto' detects it)"
            if kind != "lfs"
            else f"{file} is a Git LFS pointer, not the data: fetch the file itself ({sniff.LFS_FIX})"
        )
    try:
        return pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as e:
        raise UserError(
            f"{file} is not a readable Parquet file ({str(e).splitlines()[0]}); it may be truncated: download it again"
        ) from None


def documents(file: Path, fmt: str, text_field: str, not_utf8: list) -> Iterator[str | tuple[str, str] | None]:
    """The documents of a Parquet file: its `text_field` column or, with format alpaca (auto: when it
    has those columns), (prompt, response) pairs of its instruction, input and output columns."""
    types = column_types(file)
    has = ", ".join(f"{name} ({kind})" for name, kind in types.items()) or "none"
    alpaca = fmt == "alpaca" or (fmt == "auto" and records.is_alpaca(types))
    if alpaca:
        missing = [c for c in ("instruction", "output") if c not in types]
        if missing:
            raise UserError(
                f"{file} lacks the Alpaca column(s) {', '.join(missing)} (its columns: {has}); Alpaca data "
                f"has text columns instruction, output and optionally input, else set data.format = 'parquet'"
            )
        columns = [c for c in records.ALPACA_FIELDS if c in types]
    else:
        if text_field not in types:
            raise UserError(
                f"{file} has no column '{text_field}' (its columns: {has}); set data.text_field "
                f"to the column holding the text" + (" or data.format = 'alpaca'" if records.is_alpaca(types) else "")
            )
        columns = [text_field]
    for name in columns:
        if types[name] not in TEXT_TYPES:
            raise UserError(
                f"{file}: column '{name}' holds {types[name]}, not text (its columns: {has}); "
                f"set data.text_field to the column holding the text"
            )
    row = 0
    for batch in batches(file, columns, not_utf8):
        if not alpaca:
            yield from batch[text_field]
            continue
        for values in zip(*(batch[c] for c in columns)):
            row += 1
            yield records.alpaca_pair(file, f"row {row}", dict(zip(columns, values)))


def column_types(file: Path) -> dict[str, str]:
    """The columns of a Parquet file and their Arrow types ('string' for text)."""
    with _open(file) as table:
        return {field.name: str(field.type) for field in table.schema_arrow}


def batches(file: Path, columns: list[str], not_utf8: list) -> Iterator[dict[str, list]]:
    """The values of `columns`, a row group (or BATCH_ROWS rows of one) at a time. Text that is not
    valid UTF-8 has its undecodable bytes replaced by U+FFFD, and the file is added to `not_utf8`."""
    pa, _ = _pyarrow()
    with _open(file) as table:
        rows = 0
        for group in range(table.num_row_groups):
            reader = table.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=columns)
            while True:
                try:
                    batch = next(reader, None)
                    if batch is None:
                        break
                    values = {c: _values(pa, batch.column(c), file, not_utf8) for c in columns}
                except (pa.ArrowException, OSError) as e:
                    raise UserError(
                        f"{file}: the rows after row {rows} cannot be read ({str(e).splitlines()[0]}); the file "
                        f"is damaged: download it again"
                    ) from None
                rows += batch.num_rows
                yield values


def _values(pa, column, file: Path, not_utf8: list) -> list:
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        if file not in not_utf8:
            not_utf8.append(file)
        raw = column.cast(pa.large_binary()).to_pylist()  # a cast that does not check UTF-8
        return [None if v is None else v.decode("utf-8", errors="replace") for v in raw]
