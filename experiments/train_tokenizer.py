"""Train the embedded byte-level BPE tokenizer on the train split of the stdlib corpus.

    python experiments/train_tokenizer.py [--vocab-size 4096] [--out ddtree_jax/assets/tokenizer.json]

BPE training has no randomness: the same corpus and flags give the same file byte for byte.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from ddtree_jax.assets import TOKENIZER_PATH
from ddtree_jax.experiments import corpus
from ddtree_jax.tokenizer import SPECIAL_TOKENS, Tokenizer


def train_bpe(texts: list[str], vocab_size: int, min_frequency: int) -> tokenizers.Tokenizer:
    """Byte-level BPE over `texts` with the special tokens at ids 0, 1, ...; `vocab_size` counts them."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab-size", type=int, default=4096, help="total, special tokens included")
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--max-files", type=int, default=None, help="first N train files (quick runs)")
    p.add_argument("--out", type=Path, default=TOKENIZER_PATH)
    args = p.parse_args(argv)
    if not 512 <= args.vocab_size <= 65536:
        raise ValueError(f"--vocab-size must be in [512, 65536], got {args.vocab_size}")

    start = time.perf_counter()
    files = corpus.list_files("train")[: args.max_files]
    texts = [corpus.read_text(f) for f in files]
    tok = train_bpe(texts, args.vocab_size, args.min_frequency)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out))

    wrapped = Tokenizer.from_file(args.out)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(ids) for ids in wrapped.encode_batch(texts))
    print(f"trained on {len(files)} files ({n_bytes / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s")
    print(f"vocab {wrapped.vocab_size}, eot {wrapped.eot_id}, mask {wrapped.mask_id}, "
          f"{n_bytes / n_tokens:.2f} bytes/token, file {args.out} ({args.out.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
