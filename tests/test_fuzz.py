"""Inputs from outside — configs, CLI overrides, data files, tokenizer files, token caches — fuzzed
with random and truncated contents: each either loads or raises a `UserError` (one clear line),
never another exception."""

import io
import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchacco import data
from torchacco.config import Config, load_config
from torchacco.data import corpus, sources
from torchacco.data.tokenizer import Tokenizer
from torchacco.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
# Derandomized: CI explores the same 150 cases every run (no flaky failures); raise
# max_examples or drop derandomize locally to search further.
FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
DEFAULT_TOML = (ROOT / "train_configs" / "default_acco.toml").read_text()


def loads_or_user_error(fn, *args):
    try:
        fn(*args)
    except UserError as e:
        assert str(e) and "\n" not in str(e).strip(), "a UserError is one line"


@FUZZ
@given(cut=st.integers(0, len(DEFAULT_TOML)), noise=st.text(max_size=40), at=st.integers(0, len(DEFAULT_TOML)))
def test_truncated_or_garbled_toml_configs(tmp_path_factory, cut, noise, at):
    text = DEFAULT_TOML[:cut]
    text = text[:at] + noise + text[at:]
    path = tmp_path_factory.mktemp("cfg") / "c.toml"
    path.write_text(text)
    loads_or_user_error(load_config, ["--config", str(path)])


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_as_a_config_file(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("cfg") / "c.toml"
    path.write_bytes(raw)
    loads_or_user_error(load_config, ["--config", str(path)])


SECTIONS = ["training", "model", "optimizer", "acco", "data", "bogus", ""]
KEYS = ["steps", "lr", "seq_len", "mode", "dataset", "flavor", "nope", ""]


@FUZZ
@given(
    st.lists(
        st.one_of(
            st.builds(lambda s, k: f"--{s}.{k}", st.sampled_from(SECTIONS), st.sampled_from(KEYS)),
            st.text(max_size=12),
            st.sampled_from(["1", "-3", "1e400", "nan", "true", "[1,2]", "acco", "--config"]),
        ),
        max_size=6,
    )
)
def test_random_command_lines(argv):
    loads_or_user_error(load_config, argv)


def _data_file(folder: Path, name: str, content: bytes) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    path = folder / name
    path.write_bytes(content)
    return path


ALPACA = json.dumps(
    [{"instruction": "Add 2 and 3.", "input": "", "output": "5"}, {"instruction": "Say hi.", "output": "hi"}]
).encode()
JSONL = b'{"text": "one doc"}\n{"text": "another"}\n'


def _parquet_bytes() -> bytes:
    out = io.BytesIO()
    table = pa.table({"instruction": ["Add 2 and 3.", "Say hi."], "input": ["", None], "output": ["5", "hi"]})
    pq.write_table(table.append_column("text", pa.array(["one doc", "another"])), out, row_group_size=1)
    return out.getvalue()


PARQUET = _parquet_bytes()


def _flip(raw: bytes, at: int) -> bytes:
    damaged = bytearray(raw)
    damaged[at % len(raw)] ^= 0x5A
    return bytes(damaged)


@FUZZ
@given(
    name=st.sampled_from(["d.txt", "d.jsonl", "d.json", "d.parquet"]),
    fmt=st.sampled_from(["auto", "text", "jsonl", "alpaca", "parquet"]),
    content=st.one_of(
        st.binary(max_size=200),
        st.builds(lambda cut: ALPACA[:cut], st.integers(0, len(ALPACA))),
        st.builds(lambda cut: JSONL[:cut], st.integers(0, len(JSONL))),
        st.builds(lambda cut: PARQUET[:cut], st.integers(0, len(PARQUET))),
        st.builds(lambda at: _flip(PARQUET, at), st.integers(0, len(PARQUET))),
        st.sampled_from(
            [
                b"",
                b"\n\n\n",
                b"\xff\xfe\x00bad",
                b"[{}]",
                b"[1, 2]",
                b"{}",
                b"null",
                b'[{"instruction": 1, "output": "x"}]',
                b'{"text": 3}\n',
            ]
        ),
    ),
)
def test_data_files_with_random_truncated_or_odd_contents(tmp_path_factory, name, fmt, content):
    path = _data_file(tmp_path_factory.mktemp("data"), name, content)
    try:
        docs = sources.read_documents(path, fmt, "text")
    except UserError:
        return
    assert docs and all(isinstance(d, (str, tuple)) for d in docs)  # empty documents are dropped, not kept


def _cut_at_blank_lines_whole(text: str, size: int) -> list[str]:
    """The cut of a whole text into documents, as corpus.cut_at_blank_lines defines it."""
    docs, block, chars = [], [], 0
    for para in re.split(r"\n\s*\n", text):
        para = para.strip("\n").rstrip()
        if not para.strip():
            continue
        block.append(para)
        chars += len(para)
        if chars >= size:
            docs.append("\n\n".join(block))
            block, chars = [], 0
    return docs + ["\n\n".join(block)] if block else docs


@FUZZ
@given(
    text=st.text(st.sampled_from(["a", "b", " ", "\t", "\n", "\r", "\u3000", "é"]), max_size=300),
    cuts=st.lists(st.integers(0, 300), max_size=8),
    size=st.integers(1, 40),
)
def test_a_lone_text_file_cut_a_piece_at_a_time_gives_the_documents_of_the_whole(text, cuts, size):
    bounds = [0, *sorted(cuts), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert list(corpus.cut_pieces(pieces, size)) == _cut_at_blank_lines_whole(text, size)


@FUZZ
@given(
    raw=st.lists(
        st.sampled_from(
            [b"\xef\xbb\xbf", b"a", b"\r", b"\n", b"\r\n", "é€😀\ufffd".encode(), b"\xff", b"\xc3", b"\xe2\x82"]
        ),
        max_size=30,
    ).map(b"".join),
    block=st.integers(1, 9),
)
def test_a_text_file_read_in_blocks_decodes_as_read_whole(tmp_path_factory, raw, block):
    path = _data_file(tmp_path_factory.mktemp("blocks"), "d.txt", raw)
    whole, blocks = [], []
    expected = sources._read_text(path, whole)
    assert "".join(sources._text_blocks(path, blocks, block_bytes=block)) == expected
    assert blocks == whole  # both say whether bytes were replaced


TOKENIZER_JSON = None


def _tokenizer_json(tmp_path_factory) -> bytes:
    global TOKENIZER_JSON
    if TOKENIZER_JSON is None:
        from torchacco.data.tokenizer import train_bpe

        path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
        train_bpe(["the king and the queen went to see the sea"] * 20, 300, path)
        TOKENIZER_JSON = path.read_bytes()
    return TOKENIZER_JSON


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
@given(cut=st.floats(0, 1), flip=st.integers(0, 10_000))
def test_truncated_or_corrupted_tokenizer_json(tmp_path_factory, cut, flip):
    good = _tokenizer_json(tmp_path_factory)
    broken = bytearray(good[: int(cut * len(good))])
    if broken:
        broken[flip % len(broken)] ^= 0x5A
    path = _data_file(tmp_path_factory.mktemp("tok"), "tokenizer.json", bytes(broken))
    loads_or_user_error(Tokenizer, path)


@pytest.mark.parametrize("damage", ["truncate-bin", "drop-bin", "garble-meta", "truncate-mask"])
def test_a_damaged_token_cache_is_rebuilt(tmp_path, tiny_corpus, damage, caplog):
    """A token cache cut short (a full disk, a copy interrupted) is noticed and rebuilt, not read."""
    cfg = Config()
    cfg.data.dataset, cfg.data.cache_dir, cfg.tokenizer.vocab_size = str(tiny_corpus), str(tmp_path), 400
    if damage == "truncate-mask":  # instruction data has a loss mask beside the tokens
        records = [{"instruction": f"say {w}", "output": w} for w in "a b c d e f g h".split() * 40]
        (tmp_path / "alpaca.json").write_text(json.dumps(records))
        cfg.data.dataset = str(tmp_path / "alpaca.json")
    data.prepare(cfg.data, cfg.tokenizer, 32)
    [folder] = (tmp_path / "tokens").iterdir()
    expected = (folder / "train.bin").read_bytes()
    if damage == "truncate-bin":
        (folder / "train.bin").write_bytes(expected[: len(expected) // 2])
    elif damage == "drop-bin":
        (folder / "train.bin").unlink()
    elif damage == "garble-meta":
        (folder / "meta.json").write_text('{"train": {"tok')
    else:
        mask = folder / "train.mask"
        mask.write_bytes(mask.read_bytes()[:-3])

    with pytest.raises(UserError, match="token cache .* is damaged"):
        data.build_datasets(cfg.data, cfg.tokenizer, 32, 0, 1, 0)
    data.prepare(cfg.data, cfg.tokenizer, 32)
    assert "damaged" in caplog.text and "rebuilding" in caplog.text
    assert (folder / "train.bin").read_bytes() == expected
    train, _ = data.build_datasets(cfg.data, cfg.tokenizer, 32, 0, 1, 0)
    assert train.tokens * 2 == len(expected)
