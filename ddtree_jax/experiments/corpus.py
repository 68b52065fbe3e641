"""Training and evaluation text: the `.py` sources of the running interpreter's standard library.

Files are split into train (about 98%) and held-out (about 2%) by a hash of their relative POSIX
path inside the standard library directory, so a file lands in the same split on every machine
and CPython version (only the set of files differs between versions).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

SPLITS = ("train", "heldout")
HELDOUT_PER_MILLE = 20
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """`"heldout"` iff the first 8 bytes of sha256(relpath), big-endian, mod 1000 are < 20.

    `relpath` is the POSIX path relative to the standard library root, e.g. `"json/decoder.py"`.
    """
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE else "train"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def list_files(split: str, root: str | Path | None = None) -> list[Path]:
    """The `.py` files of `split` under `root` (default: the stdlib), sorted by relative POSIX path.

    Directories named site-packages or dist-packages (and everything under them) are excluded.
    """
    _check_split(split)
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"corpus root {str(root)!r} is not a directory")
    relpaths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        relpaths += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
    return [root / r for r in sorted(relpaths) if split_of(r) == split]


def read_text(path: str | Path) -> str:
    """A file's text decoded as UTF-8, undecodable bytes replaced by U+FFFD; newlines untouched."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        return f.read()


def _encode_files(tokenizer, files: list[Path]) -> list[np.ndarray]:
    ids = tokenizer.encode_batch([read_text(p) for p in files])
    return [np.asarray(d + [tokenizer.eot_id], dtype=np.int32) for d in ids]


def token_blocks(tokenizer, split: str, block_len: int, *, seed: int,
                 max_files: int | None = None, repeat: bool = True,
                 root: str | Path | None = None) -> Iterator[np.ndarray]:
    """Stream int32 token blocks of shape `[block_len]` from the files of `split`.

    Each file is encoded once (here, before the first block) and followed by the end-of-text
    token. Epoch e concatenates the documents in a permutation drawn from `seed` and e, cuts the
    stream into whole blocks (the remainder is dropped) and yields them in a second seeded
    permutation. `repeat=False` stops after one epoch. `max_files` keeps the first files in path
    order (small runs and tests).
    """
    if block_len < 1:
        raise ValueError(f"block_len must be >= 1, got {block_len}")
    docs = _encode_files(tokenizer, list_files(split, root)[:max_files])
    total = sum(len(d) for d in docs)
    if total < block_len:
        raise ValueError(f"block_len={block_len} exceeds the {total} tokens of split {split!r}")
    return _shuffled_blocks(docs, block_len, seed, repeat)


def _shuffled_blocks(docs: list[np.ndarray], block_len: int, seed: int, repeat: bool) -> Iterator[np.ndarray]:
    epoch = 0
    while True:
        rng = np.random.default_rng([seed, epoch])
        stream = np.concatenate([docs[i] for i in rng.permutation(len(docs))])
        blocks = stream[: len(stream) // block_len * block_len].reshape(-1, block_len)
        yield from blocks[rng.permutation(len(blocks))]
        epoch += 1
        if not repeat:
            return


def heldout_prompts(tokenizer, n: int, prompt_tokens: int, seed: int,
                    root: str | Path | None = None) -> np.ndarray:
    """`n` evaluation prompts from held-out files, int32 `[n, prompt_tokens]`.

    Prompt i comes from file `order[i % F]` (a seeded permutation of the F held-out files longer
    than `prompt_tokens`): its text up to a seeded cut point, keeping the last `prompt_tokens`
    tokens. The end-of-text token is not part of any prompt.
    """
    if n < 1 or prompt_tokens < 1:
        raise ValueError(f"n and prompt_tokens must be >= 1, got n={n}, prompt_tokens={prompt_tokens}")
    docs = [d[:-1] for d in _encode_files(tokenizer, list_files("heldout", root))]
    docs = [d for d in docs if len(d) > prompt_tokens]
    if not docs:
        raise ValueError(f"no held-out file is longer than prompt_tokens={prompt_tokens}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(docs))
    prompts = []
    for i in range(n):
        doc = docs[order[i % len(docs)]]
        cut = int(rng.integers(prompt_tokens, len(doc) + 1))
        prompts.append(doc[cut - prompt_tokens: cut])
    return np.stack(prompts)
