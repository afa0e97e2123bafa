"""A thin wrapper over a Hugging Face `tokenizers` tokenizer.json, and byte-level BPE training."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from torchacco.errors import UserError

EOS = "<|endoftext|>"
EOS_CANDIDATES = (EOS, "<|end_of_text|>", "</s>", "<eos>")


class Tokenizer:
    """Loaded from a tokenizer.json: `encode`, `decode`, `vocab_size`, `eos_id`, `path`, `save`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(
                f"tokenizer not found: {self.path} (set tokenizer.path to a tokenizer.json, "
                f"or leave it empty to train one on the data)"
            )
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:
            raise UserError(
                f"{self.path} is not a valid tokenizer.json ({str(e).splitlines()[0]}); "
                f"point tokenizer.path at a Hugging Face tokenizer.json or leave it empty"
            ) from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = [self._tok.token_to_id(t) for t in EOS_CANDIDATES if self._tok.token_to_id(t) is not None]
        if not eos:
            raise UserError(
                f"{self.path} has no end-of-text token (looked for {', '.join(EOS_CANDIDATES)}); "
                f"use a tokenizer with one, or leave tokenizer.path empty to train one"
            )
        self.eos_id = eos[0]
        self.sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # fast: no offsets
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def save(self, folder: str | Path) -> Path:
        """Write tokenizer.json into `folder` (atomically) and return its path."""
        path = Path(folder) / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tokenizer.json.{os.getpid()}.tmp")
        tmp.write_bytes(self.path.read_bytes())
        os.replace(tmp, path)
        return path


def train_bpe(texts: Iterable[str], vocab_size: int, path: Path) -> Tokenizer:
    """Train a byte-level BPE with EOS as its one special token; save it atomically at `path`."""
    if vocab_size < 257:
        raise UserError(
            f"tokenizer.vocab_size = {vocab_size} is too small: a byte-level BPE needs at "
            f"least 257 (256 bytes + end-of-text)"
        )
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return Tokenizer(path)
