"""The train/validation split of a document stream.

Without a separate validation source, the validation documents are the `val_fraction` share
whose content hashes lowest: the same documents whatever the order of the files, found in one
pass that keeps 8 bytes per document, not the documents.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from torchacco.data.sources import Doc
from torchacco.errors import UserError


def content_key(doc: Doc) -> int:
    # big-endian, so that integers order as the digests' bytes do
    return int.from_bytes(hashlib.blake2b("".join(doc).encode(), digest_size=8).digest(), "big")


def validation_mask(keys: np.ndarray, val_fraction: float, where: Path | str) -> np.ndarray:
    """Per document (by its key), whether it is held out: the lowest keys, ties broken by position."""
    if len(keys) < 2:
        raise UserError(
            f"{where} holds a single document, so no validation split can be cut from it; "
            f"add documents, set data.validation, or set data.val_fraction = 0"
        )
    count = min(len(keys) - 1, max(1, round(val_fraction * len(keys))))
    mask = np.zeros(len(keys), dtype=bool)
    mask[np.argsort(keys, kind="stable")[:count]] = True
    return mask


def check_fraction(val_fraction: float) -> None:
    if not 0 <= val_fraction < 1:
        raise UserError(f"data.val_fraction must be in [0, 1), got {val_fraction}")


def split(docs: list[Doc], val_fraction: float, where: Path | str) -> tuple[list[Doc], list[Doc]]:
    """(train, validation) documents of a list, each in the list's order."""
    pairs = list(Splits(docs, None, val_fraction, where))
    return [d for d, held_out in pairs if not held_out], [d for d, held_out in pairs if held_out]


class Splits:
    """(document, held out for validation) pairs, read anew on every pass over `docs` (and `validation`).

    A separate validation source follows the training documents; otherwise the first pass finds
    the held-out documents and the later ones read the same documents in the same order.
    """

    def __init__(self, docs: Iterable[Doc], validation: Iterable[Doc] | None, val_fraction: float, where):
        check_fraction(val_fraction)
        self.docs, self.validation, self.val_fraction, self.where = docs, validation, val_fraction, where
        self._mask: np.ndarray | None = None

    def __iter__(self) -> Iterator[tuple[Doc, bool]]:
        if self.validation is not None or self.val_fraction == 0:
            yield from ((doc, False) for doc in self.docs)
            yield from ((doc, True) for doc in self.validation or ())
            return
        if self._mask is None:
            keys = array("Q", (content_key(doc) for doc in self.docs))
            self._mask = validation_mask(np.frombuffer(keys, dtype=np.uint64), self.val_fraction, self.where)
        count = 0
        for count, doc in enumerate(self.docs, 1):
            if count > len(self._mask):
                break
            yield doc, bool(self._mask[count - 1])
        if count != len(self._mask):
            raise UserError(f"the data in {self.where} changed while it was read; run again")

    def train(self) -> Iterator[Doc]:
        return (doc for doc, held_out in self if not held_out)
