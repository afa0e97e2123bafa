"""Token caches on disk, and the packed, sharded, resumable dataset that the trainer iterates.

A split is cached as one flat file of token ids (`<split>.bin`, uint16 when the vocabulary
fits, else uint32), with an end-of-text token after every document, plus for instruction
data a `<split>.mask` of uint8 flags (0: a prompt token, left out of the loss).
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchacco.data.sources import Doc
from torchacco.data.tokenizer import Tokenizer
from torchacco.errors import UserError

PIECE_CHARS = 1 << 16  # long texts are encoded in pieces of about this many characters
BATCH_CHARS = 1 << 22  # characters handed to one encode_batch call


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def pieces(text: str) -> list[str]:
    """Cut a long text right after newlines that precede a non-space character.

    Byte-level BPE never merges across such a point (a newline before a letter is a
    pre-token of its own), so encoding the pieces separately gives the same tokens.
    """
    out, start = [], 0
    while len(text) - start > PIECE_CHARS:
        cut = text.find("\n", start + PIECE_CHARS)
        while cut != -1 and cut + 1 < len(text) and text[cut + 1].isspace():
            cut = text.find("\n", cut + 1)
        if cut == -1 or cut + 1 == len(text):
            break
        out.append(text[start : cut + 1])
        start = cut + 1
    out.append(text[start:])
    return out


class SplitWriter:
    """Tokenizes documents into `<split>.bin` as they come, BATCH_CHARS of text at a time, and into
    `<split>.mask` from the first prompt/response pair on (the tokens before it all count)."""

    def __init__(self, folder: Path, split: str, tok: Tokenizer):
        self.folder, self.split, self.tok = folder, split, tok
        self.dtype, self.tokens, self.documents = token_dtype(tok.vocab_size), 0, 0
        self._ids, self._mask = open(folder / f"{split}.bin", "wb"), None
        self._batch, self._chars = [], 0

    def add(self, doc: Doc) -> None:
        self._batch.append(doc)
        self._chars += sum(map(len, doc)) if isinstance(doc, tuple) else len(doc)
        if self._chars >= BATCH_CHARS:
            self._flush()

    def close(self) -> dict:
        """Write what is left; the split's entry of meta.json."""
        self._flush()
        self._close_files()
        return {"tokens": self.tokens, "documents": self.documents, "masked": self._mask is not None}

    def _flush(self) -> None:
        if not self._batch:
            return
        ids, mask = _encode(self._batch, self.tok)
        if self._mask is None and any(isinstance(d, tuple) for d in self._batch):
            self._mask = open(self.folder / f"{self.split}.mask", "wb")
            for start in range(0, self.tokens, BATCH_CHARS):
                self._mask.write(np.ones(min(BATCH_CHARS, self.tokens - start), dtype=np.uint8).tobytes())
        self._ids.write(np.asarray(ids, dtype=self.dtype).tobytes())
        if self._mask:
            self._mask.write(np.asarray(mask, dtype=np.uint8).tobytes())
        self.tokens += len(ids)
        self.documents += len(self._batch)
        self._batch, self._chars = [], 0

    def _close_files(self) -> None:
        for file in (self._ids, self._mask):
            if file:
                file.close()

    def __enter__(self) -> SplitWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._close_files()


def encode_documents(docs: list[Doc], tok: Tokenizer) -> tuple[np.ndarray, np.ndarray | None]:
    """What a SplitWriter writes, in memory: (token ids, loss mask or None if no document is a pair)."""
    masked = any(isinstance(d, tuple) for d in docs)
    ids, mask = _encode(docs, tok)
    return np.asarray(ids, dtype=token_dtype(tok.vocab_size)), np.asarray(mask, dtype=np.uint8) if masked else None


def read_split(folder: Path, split: str, info: dict, vocab_size: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Memory-map a cached split: (token ids, loss mask or None)."""

    def mmap(path: Path, dtype) -> np.ndarray:
        return np.memmap(path, dtype=dtype, mode="r") if info["tokens"] else np.zeros(0, dtype)

    tokens = mmap(folder / f"{split}.bin", token_dtype(vocab_size))
    return tokens, mmap(folder / f"{split}.mask", np.uint8) if info["masked"] else None


def _encode(docs: list[Doc], tok: Tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of the documents, each followed by EOS, and per token 1 if it counts in the loss."""
    texts, keep_flags = [], []  # every piece of text, and per document the keep flag of each piece
    for doc in docs:
        flags = []
        for text, keep in [(doc, 1)] if isinstance(doc, str) else [(doc[0], 0), (doc[1], 1)]:
            cut = pieces(text)
            texts += cut
            flags += [keep] * len(cut)
        keep_flags.append(flags)
    encoded = iter(tok.encode_batch(texts))
    ids, mask = [], []
    for flags in keep_flags:
        for keep in flags:
            piece = next(encoded)
            ids += piece
            mask += [keep] * len(piece)
        ids.append(tok.eos_id)
        mask.append(1)  # the model learns where a document (a response) ends
    return ids, mask


class PackedDataset(IterableDataset):
    """Windows of seq_len + 1 tokens at stride seq_len, split across data-parallel ranks.

    Each rank gets the same number of windows per epoch, `num_windows`, so ranks stay in
    lockstep. Training: shuffled by a generator seeded with (seed, epoch), endless (epochs
    wrap). Validation: in order, one pass, and every new iterator starts again at the top.
    `state_dict()` is the exact position, {"epoch", "index"}; StatefulDataLoader saves it.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        mask: np.ndarray | None,
        seq_len: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        seed: int = 0,
        train: bool = True,
    ):
        self._ids, self._mask = tokens, mask
        self.seq_len, self.dp_rank, self.dp_world, self.seed, self.train = seq_len, dp_rank, dp_world, seed, train
        self.tokens = len(tokens)
        self._all_windows = max(0, (len(tokens) - 1) // seq_len)
        self.num_windows = self._all_windows // dp_world  # per rank and epoch
        self.epoch, self.index, self._resuming = 0, 0, False

    def __len__(self) -> int:
        if self.train:
            raise TypeError("the training dataset is endless")
        return self.num_windows

    def __iter__(self):
        if not self.train and not self._resuming:
            self.epoch, self.index = 0, 0
        self._resuming = False
        while self.num_windows:
            order = self.windows(self.epoch)
            while self.index < self.num_windows:
                window = int(order[self.index])
                self.index += 1  # before the yield: the state counts what was handed out
                yield self._sample(window)
            if not self.train:
                return
            self.epoch, self.index = self.epoch + 1, 0

    def windows(self, epoch: int) -> torch.Tensor:
        """The window numbers this rank reads in `epoch`, in order."""
        if self.train:
            seed = hashlib.blake2b(f"{self.seed}/{epoch}".encode(), digest_size=8).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(seed, "little") >> 1)
            order = torch.randperm(self._all_windows, generator=generator)
        else:
            order = torch.arange(self._all_windows)
        return order[: self.num_windows * self.dp_world][self.dp_rank :: self.dp_world]

    def _sample(self, window: int) -> dict[str, torch.Tensor]:
        start = window * self.seq_len
        ids = torch.from_numpy(self._ids[start : start + self.seq_len + 1].astype(np.int64))
        labels = ids[1:].clone()
        if self._mask is not None:
            labels[torch.from_numpy(self._mask[start + 1 : start + self.seq_len + 1] == 0)] = -100
        return {"input_ids": ids[:-1], "labels": labels}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_windows", self.num_windows) != self.num_windows:
            raise UserError(
                f"cannot resume the data position: it was saved with {state['num_windows']} windows "
                f"per rank, now there are {self.num_windows}; the data, training.seq_len or the "
                f"data-parallel size changed since the checkpoint"
            )
        self.epoch, self.index, self._resuming = int(state["epoch"]), int(state["index"]), True


def build_loader(dataset: PackedDataset, batch_size: int) -> StatefulDataLoader:
    """Batches {"input_ids", "labels"}: LongTensor[batch_size, seq_len]; the last validation batch may be smaller."""
    with warnings.catch_warnings():  # torchdata 0.11 calls a torch API that newer torch deprecates
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(dataset, batch_size=batch_size, num_workers=0)
