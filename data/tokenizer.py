"""A thin wrapper over a Hugging Face `tokenizers` tokenizer.json, and byte-level BPE training."""

from __future__ import annotations

import hashlib
import os
import uuid
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
            tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:
            raise UserError(
                f"{self.path} is not a valid tokenizer.json ({str(e).splitlines()[0]}); "
                f"point tokenizer.path at a Hugging Face tokenizer.json or leave it empty"
            ) from None
        self._use(tok, str(self.path), "use a tokenizer with one, or leave tokenizer.path empty to train one")
        self.sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()

    @classmethod
    def from_object(cls, tok: tokenizers.Tokenizer) -> Tokenizer:
        """A `tokenizers.Tokenizer` held in memory (no file: `path` is None)."""
        self = cls.__new__(cls)
        self.path = None
        self._use(tok, "the tokenizers.Tokenizer passed to train()", "add one, or pass a tokenizer that has one")
        self.sha256 = hashlib.sha256(tok.to_str().encode()).hexdigest()
        return self

    def _use(self, tok: tokenizers.Tokenizer, where: str, fix: str) -> None:
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        eos = [tok.token_to_id(t) for t in EOS_CANDIDATES if tok.token_to_id(t) is not None]
        if not eos:
            raise UserError(f"{where} has no end-of-text token (looked for {', '.join(EOS_CANDIDATES)}); {fix}")
        self.eos_id = eos[0]

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
        tmp = path.with_name(f".tokenizer.json.{uuid.uuid4().hex}.tmp")  # not the pid: two nodes can have the same
        tmp.write_bytes(self.path.read_bytes() if self.path else self._tok.to_str().encode())
        os.replace(tmp, path)
        return path


class TransformersTokenizer:
    """A `transformers` tokenizer (fast or slow) behind the same interface; its own EOS token."""

    def __init__(self, tok):
        if tok.eos_token_id is None:
            raise UserError(
                f"the {type(tok).__name__} passed to train() has no eos_token; set one (tokenizer.eos_token = ...) "
                "so that documents can be separated"
            )
        self.hf = tok  # kept for save_pretrained on export
        self.path = None
        self.eos_id = tok.eos_token_id
        self.vocab_size = len(tok)  # with added tokens

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # verbose=False: documents longer than the model's context are expected here (they are packed).
        return self.hf(texts, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)


def as_tokenizer(tok) -> Tokenizer | TransformersTokenizer:
    """The `tokenizer` argument of train(): a path to a tokenizer.json (or a folder holding one), a
    `tokenizers.Tokenizer`, or a `transformers` tokenizer."""
    if isinstance(tok, Tokenizer | TransformersTokenizer):
        return tok
    if isinstance(tok, str | os.PathLike):
        path = Path(tok).expanduser()
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise UserError(f"tokenizer={str(tok)!r}: no tokenizer.json there; pass the path of one (or of its folder)")
        return Tokenizer(path)
    if isinstance(tok, tokenizers.Tokenizer):
        return Tokenizer.from_object(tok)
    if callable(tok) and hasattr(tok, "eos_token_id"):  # duck-typed: transformers is not a dependency
        return TransformersTokenizer(tok)
    raise UserError(
        f"tokenizer is a {type(tok).__name__}; pass a tokenizer.json path, a tokenizers.Tokenizer or a "
        "transformers tokenizer"
    )


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
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")  # not the pid: two nodes can have the same
    tok.save(str(tmp))
    os.replace(tmp, path)
    return Tokenizer(path)
