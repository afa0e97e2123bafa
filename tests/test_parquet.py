"""Parquet input (Hugging Face datasets' format): text and Alpaca columns, streamed a row group at a time,
and binary files read as text refused with their format named."""

import bz2
import gzip
import io
import json
import logging
import lzma
import math
import os
import random
import sys
import tarfile
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import read_metrics, run_train, tiny_args

from torchacco import data
from torchacco.config import Data, Tokenizer
from torchacco.data import sources
from torchacco.data.tokenizer import train_bpe
from torchacco.errors import UserError

WORDS = "the king queen sword crown night day love death speak thou hath doth fair foul".split()


def stories(count=120, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(5, 60))).capitalize() + "." for _ in range(count)]


def write_parquet(path, columns: dict, row_group_size=7):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def shards(folder, texts, count=3, split="train"):
    """texts as `count` shards named like the Hugging Face Hub's data/<split>-0000i-of-0000n.parquet."""
    size = math.ceil(len(texts) / count)
    for i in range(count):
        write_parquet(folder / f"{split}-{i:05d}-of-{count:05d}.parquet", {"text": texts[i * size : (i + 1) * size]})
    return folder


def tokens(tmp_path, dataset, tokenizer, name, **data_fields):
    """(train ids, train mask, val ids) of a dataset prepared with a given tokenizer.json."""
    data_cfg = Data(dataset=str(dataset), cache_dir=str(tmp_path / f"cache-{name}"), **data_fields)
    tok_cfg = Tokenizer(path=str(tokenizer))
    data.prepare(data_cfg, tok_cfg, 8)
    train, val = data.build_datasets(data_cfg, tok_cfg, 8, 0, 1, 0)
    return np.array(train._ids), None if train._mask is None else np.array(train._mask), np.array(val._ids)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(stories(200, seed=9), 300, path)
    return path


ALPACA = [
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "Five."},
    {"instruction": "Greet.", "input": None, "output": "Hello there!"},
] * 20


def test_parquet_shards_tokenize_to_the_same_tokens_as_the_same_text_in_jsonl(tmp_path, tokenizer):
    texts = stories() + [""]  # an empty row is skipped, as an empty record is
    shards(tmp_path / "data", texts)
    (tmp_path / "same.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    from_parquet = tokens(tmp_path, tmp_path / "data", tokenizer, "pq", val_fraction=0.1)
    from_jsonl = tokens(tmp_path, tmp_path / "same.jsonl", tokenizer, "jsonl", val_fraction=0.1)
    assert len(from_parquet[2]) > 0 and from_parquet[1] is None  # a validation split; no loss mask
    assert all(np.array_equal(a, b) for a, b in zip(from_parquet, from_jsonl) if a is not None)
    by_format = tokens(tmp_path, tmp_path / "data", tokenizer, "fmt", val_fraction=0.1, format="parquet")
    assert np.array_equal(by_format[0], from_parquet[0])


def test_parquet_is_read_a_row_group_at_a_time(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "d.parquet", {"text": stories(100)}, row_group_size=10)
    groups_read = []
    iter_batches = pq.ParquetFile.iter_batches

    def spy(self, *args, row_groups=None, **kwargs):
        groups_read.append(row_groups)
        return iter_batches(self, *args, row_groups=row_groups, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    docs = iter(sources.Documents(path, "auto", "text"))
    assert next(docs) == stories(100)[0] and groups_read == [[0]]
    assert [next(docs) for _ in range(10)] == stories(100)[1:11] and groups_read == [[0], [1]]
    assert len(list(docs)) == 89 and groups_read == [[g] for g in range(10)]


def test_alpaca_parquet_is_masked_like_alpaca_json(tmp_path, tokenizer):
    columns = {k: [r[k] for r in ALPACA] for k in ("instruction", "input", "output")}
    columns["text"] = [f"{r['instruction']} {r['output']}" for r in ALPACA]  # tatsu-lab/alpaca has one too
    path = write_parquet(tmp_path / "alpaca" / "train-00000-of-00001.parquet", columns)
    (tmp_path / "alpaca.json").write_text(json.dumps(ALPACA))
    docs = sources.read_documents(tmp_path / "alpaca.json", "alpaca", "text")
    assert sources.read_documents(path, "auto", "text") == sources.read_documents(path, "alpaca", "text") == docs
    assert docs[2] == ("### Instruction:\nGreet.\n\n### Response:\n", "Hello there!")
    assert sources.read_documents(path, "parquet", "text") == columns["text"]  # the text column, no masking

    ids, mask, _ = tokens(tmp_path, tmp_path / "alpaca", tokenizer, "pq", format="alpaca", val_fraction=0)
    want_ids, want_mask, _ = tokens(tmp_path, tmp_path / "alpaca.json", tokenizer, "json", val_fraction=0)
    assert np.array_equal(ids, want_ids) and np.array_equal(mask, want_mask) and 0 < mask.mean() < 1


def test_glob_patterns_pick_the_split_shards_of_a_hub_data_folder(tmp_path, tokenizer):
    folder = shards(tmp_path / "data", stories(90), count=3)
    shards(folder, stories(30, seed=5), count=1, split="validation")
    train, _, val = tokens(
        tmp_path,
        folder / "train-*.parquet",
        tokenizer,
        "glob",
        validation=str(folder / "validation-*.parquet"),
    )
    assert len(val) < len(train) / 2 and len(val) > 0
    with pytest.raises(UserError, match=r"no files match .*test-\*\.parquet; fix the pattern in data.dataset"):
        sources.read_documents(folder / "test-*.parquet", "auto", "text")


def test_a_parquet_file_is_recognised_by_its_content_in_auto(tmp_path):
    path = write_parquet(tmp_path / "train.data", {"text": ["one story", "another story"]})
    assert sources.read_documents(path, "auto", "text") == ["one story", "another story"]


@pytest.mark.parametrize(
    "columns, fmt, match",
    [
        (
            {"story": ["x"]},
            "auto",
            r"d.parquet has no column 'text' \(its columns: story \(string\)\); set data.text_f",
        ),
        ({"instruction": ["x"], "output": ["y"]}, "parquet", "has no column 'text'.* or data.format = 'alpaca'"),
        ({"instruction": ["x"], "text": ["y"]}, "alpaca", r"lacks the Alpaca column\(s\) output \(its columns: inst"),
        ({"text": [1, 2]}, "auto", "column 'text' holds int64, not text"),
        ({"instruction": ["x", None], "output": ["y", "z"]}, "auto", "row 2 lacks the Alpaca text field.*instruction"),
    ],
)
def test_missing_or_mistyped_columns_are_a_one_line_user_error(tmp_path, columns, fmt, match):
    path = write_parquet(tmp_path / "d.parquet", columns)
    with pytest.raises(UserError, match=match) as error:
        data.prepare(Data(dataset=str(path), format=fmt, cache_dir=str(tmp_path)), Tokenizer(vocab_size=300), 8)
    assert "\n" not in str(error.value)


def test_without_pyarrow_parquet_is_a_user_error_naming_the_extra(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "d.parquet", {"text": ["a story"]})
    (tmp_path / "d.jsonl").write_text('{"text": "a story"}\n')
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match=r"needs pyarrow.*pip install 'torchacco\[parquet\]'.*pip install pyarrow"):
        sources.read_documents(path, "auto", "text")
    assert sources.read_documents(tmp_path / "d.jsonl", "auto", "text") == ["a story"]  # only Parquet needs it


def _tar(text: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("train.txt")
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
    return out.getvalue()


def _zip(text: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("train.txt", text)
    return out.getvalue()


def _arrow(text: bytes, stream: bool) -> bytes:
    table, out = pa.table({"text": [text.decode()]}), io.BytesIO()
    with (pa.ipc.new_stream if stream else pa.ipc.new_file)(out, table.schema) as writer:
        writer.write_table(table)
    return out.getvalue()


def _parquet(text: bytes) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.table({"text": [text.decode()] * 50}), out)
    return out.getvalue()


TEXT = " ".join(stories(400)).encode()
BINARIES = {
    "parquet": (_parquet, r"train.parquet is a Parquet file but is read as text \(format = 'text'\); set \[data\] fo"),
    "gzip": (gzip.compress, r"is gzip-compressed: decompress it first \(gunzip"),
    "zip": (_zip, r"is a zip archive: extract it first"),
    "tar": (_tar, r"is a tar archive: extract it first"),
    "bzip2": (bz2.compress, r"is bzip2-compressed: decompress it first"),
    "xz": (lzma.compress, r"is xz-compressed: decompress it first"),
    "arrow-file": (lambda t: _arrow(t, stream=False), r"is an Arrow file .*export it as Parquet or JSON Lines"),
    "arrow-stream": (lambda t: _arrow(t, stream=True), r"is an Arrow file"),
    "utf16": (lambda t: t.decode().encode("utf-16"), r"is UTF-16 text: convert it to UTF-8"),
    "lfs": (lambda t: b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n", r"is a Git LFS pointer"),
    "random": (lambda t: random.Random(0).randbytes(400_000), r"is not text: \d\d% of its first 65536 bytes are not"),
    "tokens": (lambda t: np.arange(30_000, dtype=np.uint32).tobytes(), r"is not text: .*control bytes"),
}


@pytest.mark.parametrize("kind", BINARIES)
def test_binary_files_read_as_text_are_a_user_error_naming_the_format(tmp_path, kind):
    make, match = BINARIES[kind]
    (tmp_path / "datasets").mkdir()
    path = tmp_path / "datasets" / "train.parquet"  # any name: the content decides
    path.write_bytes(make(TEXT))
    with pytest.raises(UserError, match=match) as error:
        data.prepare(Data(dataset=str(path), format="text", cache_dir=str(tmp_path)), Tokenizer(vocab_size=300), 8)
    assert "\n" not in str(error.value)
    if kind != "parquet":  # nor is it read as a .jsonl, or as Parquet
        with pytest.raises(UserError, match=match if kind != "lfs" else "Git LFS pointer, not the data"):
            sources.read_documents(path.rename(path.with_suffix(".jsonl")), "auto", "text")
        with pytest.raises(UserError, match="is not a Parquet file|Git LFS pointer"):
            sources.read_documents(path.with_suffix(".jsonl"), "parquet", "text")


def test_a_mostly_utf8_text_file_is_read_with_a_warning(tmp_path, caplog):
    text = " ".join(stories(200)).replace("queen", "reine café").encode("latin-1")  # a few latin-1 bytes
    assert 0.005 < text.count(0xE9) / len(text) < 0.05
    (tmp_path / "latin.txt").write_bytes(text)
    with caplog.at_level(logging.WARNING):
        docs = sources.read_documents(tmp_path / "latin.txt", "text", "text")
    assert "caf\ufffd" in docs[0] and "not valid UTF-8" in caplog.text


def test_a_truncated_parquet_download_is_a_user_error(tmp_path):
    good = write_parquet(tmp_path / "good.parquet", {"text": stories()})
    (tmp_path / "cut.parquet").write_bytes(good.read_bytes()[: os.path.getsize(good) // 2])
    with pytest.raises(UserError, match=r"cut.parquet is not a readable Parquet file .*download it again"):
        sources.read_documents(tmp_path / "cut.parquet", "auto", "text")


def test_a_prompt_after_plain_documents_starts_a_loss_mask_that_counts_them(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(data.dataset, "BATCH_CHARS", 64)  # several batches before the first pair
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in stories(30)))
    (folder / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ALPACA[:3]))  # read as Alpaca
    ids, mask, _ = tokens(tmp_path, folder, tokenizer, "mixed", val_fraction=0)
    plain = sum(len(data.Tokenizer(tokenizer).encode(t)) + 1 for t in stories(30))
    assert len(mask) == len(ids) and mask[:plain].all() and not mask[plain:].all()


@pytest.mark.integration
def test_training_on_a_parquet_folder_with_two_ranks(tmp_path, tiny_corpus):
    texts = [p for f in sorted(tiny_corpus.glob("*.txt")) for p in f.read_text().split("\n\n")]
    shards(tmp_path / "TinyStories" / "data", texts, count=4)
    out = tmp_path / "run"
    args = tiny_args(tmp_path / "TinyStories" / "data" / "train-*.parquet", tmp_path / "cache", out)
    proc = run_train([*args, "--data.format", "parquet", "--training.steps", "4"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
