"""Draft vocabularies chosen by token frequency.

A drafter that shares the target's LM head streams all of it every round (1.24 GB at Qwen3-8B's
151,936 tokens, as many bytes as three of its decoder layers). Restricting the drafts to the W
most frequent tokens of a corpus (`dflash.with_draft_vocab`) streams ``W / V`` of it; the
target still verifies every draft, so the output keeps the target's law, and only drafts
outside the W tokens are lost. The counts live beside the target's tokenizer, in
`COUNTS_FILE` (``experiments/count_tokens.py`` writes it); `with_frequent_tokens` gives a drafter
the W most frequent of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ddtree_jax.models.dflash import Drafter, with_draft_vocab
from ddtree_jax.models.qwen3 import Target

COUNTS_FILE = "token_counts.npy"


def token_counts(sequences: Iterable, vocab_size: int) -> np.ndarray:
    """int64 ``[vocab_size]``: how often each id occurs in ``sequences`` (int sequences of ids in
    ``[0, vocab_size)``)."""
    counts = np.zeros(vocab_size, np.int64)
    for ids in sequences:
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token ids must be in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]")
        counts += np.bincount(ids.astype(np.int64).ravel(), minlength=vocab_size)
    return counts


def most_frequent(counts_V, size: int) -> np.ndarray:
    """The ``size`` ids of the largest ``counts`` (ties by lower id), int32 in ascending id order."""
    counts_V = np.asarray(counts_V)
    if counts_V.ndim != 1 or not np.issubdtype(counts_V.dtype, np.integer) or (counts_V < 0).any():
        raise ValueError(f"counts must be a 1-D array of ints >= 0, got {counts_V.dtype} {counts_V.shape}")
    if not 1 <= size <= counts_V.size:
        raise ValueError(f"a draft vocabulary must have 1 to {counts_V.size} tokens, got {size}")
    order = np.lexsort((np.arange(counts_V.size), -counts_V.astype(np.int64)))
    return np.sort(order[:size]).astype(np.int32)


def coverage(counts_V, size: int) -> float:
    """The share of all counted tokens that the ``size`` most frequent ids are (`most_frequent`)."""
    counts_V = np.asarray(counts_V, np.int64)
    total = counts_V.sum()
    return float(counts_V[most_frequent(counts_V, size)].sum() / total) if total else 0.0


def load_counts(model_dir: str | Path, vocab_size: int) -> np.ndarray:
    """The `COUNTS_FILE` of ``model_dir``: int64 ``[vocab_size]``; ``ValueError`` naming the file when
    it is missing or does not fit the vocabulary."""
    path = Path(model_dir) / COUNTS_FILE
    if not path.is_file():
        raise ValueError(f"no token counts at {path}: write them with experiments/count_tokens.py")
    counts = np.load(path, allow_pickle=False)
    if counts.shape != (vocab_size,) or not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
        raise ValueError(f"{path} must hold {vocab_size} counts >= 0, got {counts.dtype} {counts.shape}")
    return counts.astype(np.int64)


def with_frequent_tokens(drafter: Drafter, target: Target, model_dir: str | Path, size: int) -> Drafter:
    """``drafter`` drafting from the ``size`` most frequent tokens by ``model_dir``'s counts
    (`load_counts`, `most_frequent`; `dflash.with_draft_vocab`); ``size = 0``: the whole vocabulary,
    without reading the counts."""
    if not size:
        return with_draft_vocab(drafter, target, None)
    return with_draft_vocab(drafter, target, most_frequent(load_counts(model_dir, target.config.vocab_size), size))
