"""`torchacco prepare-data --config FILE [--section.key VALUE ...]`: fetch the corpus,
train or load the tokenizer and tokenize both splits into the cache ([data] cache_dir), in one
process, ahead of a cluster job. A run of the same config then finds the cache ready; run it on
each node whose cache folder is its own (one run serves nodes that share the folder)."""

from __future__ import annotations

import logging
import sys
import time

from torchacco.config import load_config
from torchacco.errors import run_cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def run() -> None:
        from torchacco import data

        cfg = load_config(argv)
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
        start = time.perf_counter()
        print(f"torchacco: preparing {cfg.data.dataset} (tokenizer, {cfg.training.seq_len}-token windows) ...")
        data.prepare(cfg.data, cfg.tokenizer, cfg.training.seq_len)
        print(f"torchacco: data ready in {time.perf_counter() - start:.0f} s (cache: {data.cache_root(cfg.data)})")

    return run_cli(run)
