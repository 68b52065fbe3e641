"""Token counts of a corpus under a target's tokenizer, for draft vocabularies (`ddtree_jax.draft_vocab`).

Counts every id of the corpus's files (default: the standard library's training split, the
embedded pair's own training text), writes int64 ``[V]`` to ``--out`` (default
``<target>/token_counts.npy``, where ``ddtree generate --draft-vocab N`` looks for it) and prints
the share of the tokens that the 1,024, 2,048, ... most frequent ids cover.

    python experiments/count_tokens.py --target ddtree_jax/assets/target
    python experiments/count_tokens.py --target DIR --files 'corpus/*.txt'
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import tokenizers  # noqa: E402
from tqdm import tqdm  # noqa: E402

from ddtree_jax.assets import TARGET_DIR  # noqa: E402
from ddtree_jax.draft_vocab import COUNTS_FILE, coverage, token_counts  # noqa: E402
from ddtree_jax.experiments.corpus import list_files, read_text  # noqa: E402
from ddtree_jax.tokenizer import EOT_TOKEN  # noqa: E402

BATCH_FILES = 64


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=TARGET_DIR, help="target directory with its tokenizer.json")
    ap.add_argument("--files", default="", help="glob of text files to count (default: the stdlib training split)")
    ap.add_argument("--max-files", type=int, default=0, help="count only the first N files (0 = all)")
    ap.add_argument("--out", type=Path, help=f"counts file (default: <target>/{COUNTS_FILE})")
    args = ap.parse_args(argv)
    if args.max_files < 0:
        raise ValueError(f"--max-files must be >= 0, got {args.max_files}")
    path = args.target / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"--target {args.target} has no tokenizer.json")
    tokenizer = tokenizers.Tokenizer.from_file(str(path))  # any HF tokenizer, the special tokens it has
    eot = [] if tokenizer.token_to_id(EOT_TOKEN) is None else [tokenizer.token_to_id(EOT_TOKEN)]
    vocab = json.loads((args.target / "config.json").read_text())["vocab_size"]
    files = sorted(Path(p) for p in glob.glob(args.files, recursive=True)) if args.files else list_files("train")
    files = files[: args.max_files or None]
    if not files:
        raise ValueError(f"--files {args.files!r} matches no file")
    start = time.perf_counter()
    batches = (files[i: i + BATCH_FILES] for i in range(0, len(files), BATCH_FILES))
    counts = token_counts((e.ids + eot  # each file ends in end-of-text, as in training
                           for batch in tqdm(batches, total=-(-len(files) // BATCH_FILES), unit="batch")
                           for e in tokenizer.encode_batch([read_text(p) for p in batch], add_special_tokens=False)),
                          vocab)
    out = args.out or args.target / COUNTS_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, counts)
    print(f"{counts.sum()} tokens of {len(files)} files, {int((counts > 0).sum())} of {vocab} ids seen; "
          f"wrote {out} in {time.perf_counter() - start:.1f} s")
    for size in (1 << e for e in range(10, vocab.bit_length()) if 1 << e < vocab):
        print(f"  the {size:>7,} most frequent ids: {100 * coverage(counts, size):6.2f}% of the tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
