"""Data passed to `train(cfg, datasets=(train, val), tokenizer=...)` from Python.

Each of train and val is either a torch dataset of {"input_ids", "labels"} windows (used as
is), or documents: a Hugging Face `datasets.Dataset` (recognised by its `column_names`; the
text is in the column `[data] text_field`), or any iterable of strings, of dicts holding the
text under `text_field`, or of (prompt, response) pairs (the prompt is left out of the loss).
Documents are tokenized in memory with `tokenizer` and packed exactly as torchacco's own
data (EOS after each document, windows of seq_len + 1 tokens split evenly over the
data-parallel ranks), so they resume and shuffle alike. Every rank tokenizes the same documents.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from torch.utils.data import Dataset

from torchacco.data.dataset import PackedDataset, encode_documents
from torchacco.data.sources import Doc
from torchacco.data.split import split
from torchacco.data.tokenizer import as_tokenizer
from torchacco.errors import UserError


def python_datasets(
    datasets,
    tokenizer,
    data_cfg,
    tok_cfg,
    seq_len: int,
    dp_rank: int,
    dp_world: int,
    seed: int,
    need_val: bool,
):
    """(tokenizer or None, train set, validation set) of this data-parallel rank. `tokenizer`
    defaults to `[tokenizer] path`. A val of None holds out `[data] val_fraction` of the training
    documents when there is an evaluation (`need_val`)."""
    if not (isinstance(datasets, tuple | list) and len(datasets) == 2):
        raise UserError(
            f"datasets is a {type(datasets).__name__}; pass a pair: datasets=(train, val) (val may be None)"
        )
    train, val = datasets
    if train is None:
        raise UserError("datasets=(None, ...): pass the training data as the first of the pair")
    if _windows(train) and (val is None or _windows(val)):
        if val is None and need_val:
            raise UserError("no validation data: pass datasets=(train, val), or set [eval] every = 0")
        return None, train, val if val is not None else _empty(seq_len, dp_rank, dp_world)
    if tokenizer is None and not tok_cfg.path:
        raise UserError(
            "texts need a tokenizer: train(cfg, model, datasets, tokenizer=...) with a tokenizer.json path, a "
            "tokenizers.Tokenizer or a transformers tokenizer (or set [tokenizer] path)"
        )
    tok = as_tokenizer(tokenizer if tokenizer is not None else tok_cfg.path)
    train_docs = None if _windows(train) else documents(train, data_cfg.text_field, "the training data")
    if val is None:
        train_docs, val_docs = _hold_out(train_docs, data_cfg.val_fraction if need_val else 0.0)
    else:
        val_docs = None if _windows(val) else documents(val, data_cfg.text_field, "the validation data")
    train_set = train if train_docs is None else _packed(train_docs, tok, seq_len, dp_rank, dp_world, seed, True)
    val_set = val if val_docs is None else _packed(val_docs, tok, seq_len, dp_rank, dp_world, seed, False)
    if train_docs is not None and (train_set.tokens - 1) // seq_len < dp_world:
        raise UserError(
            f"the training texts give {train_set.tokens} tokens, too few for one window of [training] seq_len + 1 = "
            f"{seq_len + 1} tokens on each of {dp_world} data-parallel rank(s); add text or lower seq_len"
        )
    if need_val and val_docs is not None and val_set.num_windows == 0:
        raise UserError(
            f"the validation texts give {val_set.tokens} tokens, fewer than one window of {seq_len + 1} per "
            f"data-parallel rank ({dp_world}); pass more validation text, raise [data] val_fraction, or set "
            "[eval] every = 0"
        )
    return tok, train_set, val_set


def _windows(source) -> bool:
    """A torch dataset of windows. (A `datasets.IterableDataset` is a torch IterableDataset too,
    but holds documents: it has `column_names`.)"""
    return isinstance(source, Dataset) and not hasattr(source, "column_names")


def documents(source, text_field: str, which: str) -> list[Doc]:
    """The non-empty documents of `source` (see the module's docstring)."""
    if isinstance(source, str | bytes):
        raise UserError(f"{which} is a single string; pass a list of texts")
    columns = getattr(source, "column_names", None)  # a datasets.Dataset
    if columns is not None and text_field not in columns:
        raise UserError(
            f"{which} has no column '{text_field}' (its columns: {', '.join(map(str, columns))}); set "
            "[data] text_field to the column holding the text"
        )
    try:
        items = iter(source)
    except TypeError:
        raise UserError(
            f"{which} is a {type(source).__name__}; pass a torch dataset of windows, a datasets.Dataset, or an "
            "iterable of texts"
        ) from None
    docs = [doc for i, item in enumerate(items) if (doc := _document(item, text_field, which, i))]
    if not docs:
        raise UserError(f"{which} holds no text")
    return docs


def _document(item, text_field: str, which: str, i: int) -> Doc:
    if isinstance(item, Mapping):
        if text_field not in item and "input_ids" in item:
            raise UserError(
                f"item {i} of {which} is a window of token ids, not a document; pass windows as a torch Dataset "
                "(torch.utils.data.Dataset or IterableDataset)"
            )
        if text_field not in item:
            raise UserError(
                f"item {i} of {which} has no field '{text_field}' (its fields: {', '.join(map(str, item))}); set "
                "[data] text_field to the one holding the text"
            )
        item = item[text_field]
    if isinstance(item, str):
        return item
    if isinstance(item, tuple) and len(item) == 2 and all(isinstance(part, str) for part in item):
        return item if item[1] else ""  # a pair without a response teaches nothing
    raise UserError(
        f"item {i} of {which} is a {type(item).__name__}; each item must be a text, a dict with the text under "
        f"'{text_field}', or a (prompt, response) pair of texts"
    )


def _hold_out(docs: list[Doc], val_fraction: float) -> tuple[list[Doc], list[Doc]]:
    """Without a validation set: the same deterministic split by document as torchacco's own data."""
    if val_fraction == 0:
        return docs, []
    if len(docs) < 2:
        raise UserError(
            "the training data holds a single document, so none can be held out for validation; pass "
            "datasets=(train, val), or set [data] val_fraction = 0 and [eval] every = 0"
        )
    return split(docs, val_fraction, "the training data")


def _packed(docs: list[Doc], tok, seq_len: int, dp_rank: int, dp_world: int, seed: int, train: bool) -> PackedDataset:
    ids, mask = encode_documents(docs, tok)
    return PackedDataset(ids, mask, seq_len, dp_rank, dp_world, seed, train=train)


def _empty(seq_len: int, dp_rank: int, dp_world: int) -> PackedDataset:
    return PackedDataset(np.zeros(0, dtype=np.uint16), None, seq_len, dp_rank, dp_world, train=False)
