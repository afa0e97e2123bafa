"""An Alpaca-format instruction set made from the embedded corpus, for the finetuning recipes.

    torchacco instructions --out outputs/instructions/embedded_instructions.jsonl

Alpaca itself cannot be shipped or fetched here, so this writes a license-clean stand-in from
the public-domain texts of `data.corpus`: one JSON object a line with "instruction", "input"
and "output", read by `data.format = "alpaca"` (the prompt is left out of the loss). Four
tasks in equal shares, the same records for the same seed:

    bible_reference   a King James verse (found once in the Bible) → "Genesis 1"
    quote_verse       "Quote Genesis 1:3 ..." (no input) → the verse
    continue_passage  a few lines of Shakespeare or Milton → the lines that follow
    which_work        a few lines found in one work only → its title, e.g. "Hamlet"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

from torchacco.data import corpus
from torchacco.errors import UserError

TASKS = ("bible_reference", "quote_verse", "continue_passage", "which_work")
DEFAULT_RECORDS = 10_000
MAX_OUTPUT_CHARS = 400
PROMPTS = {
    "bible_reference": (
        "Which book and chapter of the King James Bible is this verse from?",
        "Name the book and chapter of the King James Bible that contain this verse.",
        "Where in the King James Bible is this verse found? Give the book and chapter.",
    ),
    "quote_verse": (
        "Quote verse {verse} of {book} chapter {chapter} in the King James Bible.",
        "Quote {book} {chapter}:{verse} from the King James Bible.",
        "What does {book} {chapter}:{verse} say in the King James Bible?",
    ),
    "continue_passage": (
        "Continue this passage.",
        "Continue this passage from {title}.",
        "Write the lines that come next.",
    ),
    "which_work": (
        "Which work is this passage from?",
        "Name the play or poem this passage comes from.",
        "From which work by Shakespeare or Milton is this passage?",
    ),
}
# Titles the file names do not spell out; the others are the file name in title case, some after "The".
TITLES = {
    "john": "King John",
    "lear": "King Lear",
    "tragedy_of_titus_andronicus": "Titus Andronicus",
    "midsummer_nights_dream": "A Midsummer Night's Dream",
    "lovers_complaint": "A Lover's Complaint",
    "lallegro_il_penseroso_comus_and_lycidas": "L'Allegro, Il Penseroso, Comus and Lycidas",
    "poetical_works": "The Poetical Works of John Milton",
}
THE = {
    "comedy_of_errors",
    "merchant_of_venice",
    "merry_wives_of_windsor",
    "passionate_pilgrim",
    "phoenix_and_the_turtle",
    "rape_of_lucrece",
    "sonnets",
    "taming_of_the_shrew",
    "tempest",
    "two_gentlemen_of_verona",
    "winters_tale",
}
WORDS = {"alls": "All's", "loves": "Love's", "labours": "Labour's", "nights": "Night's", "winters": "Winter's"}
SMALL_WORDS = {"a", "an", "and", "for", "of", "the", "in", "on", "to"}


def title(path: Path) -> str:
    """A readable title from a corpus file name: "henry_iv_part_1_gut.txt" → "Henry IV, Part 1"."""
    stem = re.sub(r"_gut$", "", path.stem)
    stem = re.sub(r"_?\(.*?\)", "", stem)  # "paradise_lost_(no_introduction)"
    if stem in TITLES:
        return TITLES[stem]
    words = []
    for i, word in enumerate(stem.split("_")):
        if word in WORDS:
            word = WORDS[word]
        elif re.fullmatch(r"[ivx]+", word):
            word = word.upper()
        elif i == 0 or word not in SMALL_WORDS:
            word = word.capitalize()
        words.append(word)
    return ("The " if stem in THE else "") + " ".join(words).replace(" Part ", ", Part ")


def load_corpus(folder: Path) -> tuple[dict[str, str], list[dict]]:
    """({title: text} of the plays and poems, [{"book", "chapter", "verse", "text"}] of the bible)."""
    works = {}
    for path in sorted(folder.glob("*_gut.txt")):
        works[title(path)] = path.read_bytes().decode("utf-8-sig").replace("\r\n", "\n")
    bible = folder / "kjv.jsonl"
    if not works or not bible.is_file():
        raise UserError(
            f"the embedded corpus at {folder} is incomplete (no *_gut.txt texts or no kjv.jsonl); "
            f"delete that folder so it is downloaded again"
        )
    with open(bible, encoding="utf-8") as f:
        verses = [json.loads(line) for line in f if line.strip()]
    return works, [v for v in verses if v["text"].strip("[] ")]  # one verse is an empty "[]"


def generate(
    works: dict[str, str], verses: list[dict], seed: int = 0, max_records: int = DEFAULT_RECORDS
) -> list[dict]:
    """`max_records` records, the tasks in equal shares (±1) and shuffled; the same for the same seed."""
    by_task = build(works, verses, seed, math.ceil(max_records / len(TASKS)))
    shortest = min(len(records) for records in by_task.values())
    mixed = [rec for group in zip(*(by_task[t] for t in TASKS)) for rec in group]
    mixed += [rec for t in TASKS for rec in by_task[t][shortest:]]  # only if a task fell short
    mixed = mixed[:max_records]
    random.Random(seed).shuffle(mixed)
    return mixed


def build(works: dict[str, str], verses: list[dict], seed: int, per_task: int) -> dict[str, list[dict]]:
    """Up to `per_task` records of each task (fewer only when the texts are too small to give that many)."""
    rng = random.Random(seed)
    verses = [v for v in verses if len(v["text"]) <= MAX_OUTPUT_CHARS]
    once = Counter(v["text"] for v in verses)
    unique = [v for v in verses if once[v["text"]] == 1]  # "And the LORD spake unto Moses, saying," is not
    out = {
        "bible_reference": [
            _record(rng, "bible_reference", {}, v["text"], f"{v['book']} {v['chapter']}")
            for v in rng.sample(unique, min(per_task, len(unique)))
        ],
        "quote_verse": [
            _record(rng, "quote_verse", v, "", v["text"]) for v in rng.sample(verses, min(per_task, len(verses)))
        ],
    }
    texts = {name: [line.rstrip() for line in text.split("\n")] for name, text in works.items()}
    owners: dict[str, set] = {}  # a long line → the works it appears in (Comus is in three files)
    for name, lines in texts.items():
        for line in lines:
            if len(line.strip()) >= 25:
                owners.setdefault(line.strip(), set()).add(name)
    names, sizes = list(texts), [len(lines) for lines in texts.values()]
    for task in ("continue_passage", "which_work"):
        records, seen = [], set()
        for _ in range(20 * per_task if texts else 0):
            if len(records) == per_task:
                break
            name = rng.choices(names, weights=sizes)[0]
            lines = texts[name]
            passage, end = _take(lines, rng.randrange(len(lines)), rng.randint(120, 240), 300)
            if _letters(passage) < 60 or passage in seen:
                continue
            if task == "which_work":
                if any(len(owners.get(line.strip(), ())) > 1 for line in passage.split("\n")):
                    continue  # a line several works share does not tell the work
                records.append(_record(rng, task, {}, passage, name))
            else:
                following, _ = _take(lines, end, rng.randint(80, 200), MAX_OUTPUT_CHARS)
                if _letters(following) < 40:
                    continue
                records.append(_record(rng, task, {"title": name}, passage, following))
            seen.add(passage)
        out[task] = records
    return out


def write_jsonl(records: list[dict], path: Path) -> None:
    """Write one JSON object a line; the file appears complete or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _record(rng: random.Random, task: str, fields: dict, input: str, output: str) -> dict:
    return {"instruction": rng.choice(PROMPTS[task]).format(**fields), "input": input, "output": output}


def _take(lines: list[str], start: int, min_chars: int, max_chars: int) -> tuple[str, int]:
    """Lines from `start` (blank runs kept as one blank line) until `min_chars` of text, staying within
    `max_chars` after the first line; the text, dedented, and the index of the next line."""
    while start < len(lines) and not lines[start].strip():
        start += 1
    block, chars, i = [], 0, start
    while i < len(lines) and chars < min_chars:
        line = lines[i]
        if line.strip():
            if block and len("\n".join(block)) + 1 + len(line) > max_chars:
                break
            block.append(line)
            chars += len(line.strip())
        elif block and block[-1]:
            block.append("")
        i += 1
    while block and not block[-1]:
        block.pop()
    return textwrap.dedent("\n".join(block)), i


def _letters(text: str) -> int:
    return sum(c.isalpha() for c in text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="torchacco instructions",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="the .jsonl file to write")
    parser.add_argument(
        "--cache-dir",
        default="",
        help="where the embedded corpus is cached (default: $TORCHACCO_CACHE or ~/.cache/torchacco, as data.cache_dir)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-records", type=int, default=DEFAULT_RECORDS)
    args = parser.parse_args(argv)
    try:
        if args.max_records < len(TASKS):
            raise UserError(
                f"--max-records must be at least {len(TASKS)} (one record per task), got {args.max_records}"
            )
        start = time.perf_counter()
        from torchacco.config import Data
        from torchacco.data import cache_root

        works, verses = load_corpus(corpus.ensure_corpus(cache_root(Data(cache_dir=args.cache_dir))))
        records = generate(works, verses, args.seed, args.max_records)
        out = Path(args.out).expanduser()
        write_jsonl(records, out)
    except UserError as e:
        print(f"torchacco instructions: error: {e}", file=sys.stderr, flush=True)
        return 1
    print(
        f"wrote {len(records)} instruction records ({len(works)} works, {len(verses)} verses, seed {args.seed}) "
        f"to {out} ({out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - start:.1f}s"
    )
    return 0
