import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the king and queen of a land far away went to see the sea with their horse dog cat bird "
         "under sun moon and then they sang of old times while rain fell on green hills").split()


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """A few dozen KB of word salad: enough for a 400-token BPE and many 64-token windows."""
    folder = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for f in range(8):
        paragraphs = (" ".join(rng.choice(WORDS) for _ in range(60)) + "." for _ in range(60))
        (folder / f"doc{f}.txt").write_text("\n\n".join(paragraphs))
    return folder


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory) -> Path:
    """One cache folder for the tests that use the embedded corpus: it is fetched and tokenized once."""
    return tmp_path_factory.mktemp("embedded-cache")


def tiny_args(corpus: Path, cache: Path, out: Path, *extra: str) -> list[str]:
    """CLI overrides for a seconds-long run of the GPT-Neo debug model on `corpus`."""
    return [
        "--data.dataset", str(corpus), "--data.cache_dir", str(cache), "--tokenizer.vocab_size", "400",
        "--model.flavor", "debug", "--training.seq_len", "64", "--training.local_batch_size", "4",
        "--training.steps", "6", "--metrics.log_every", "1", "--metrics.tensorboard", "false",
        "--eval.every", "3", "--eval.batches", "2", "--job.dump_folder", str(out), *extra,
    ]


def run_train(args: list[str], nproc: int = 2, timeout: int = 300, env: dict | None = None):
    """./run_train.sh as a user runs it; returns the completed process."""
    full_env = {**os.environ, "NPROC": str(nproc), "PYTHON": sys.executable, **(env or {})}
    return subprocess.run([str(ROOT / "run_train.sh"), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
