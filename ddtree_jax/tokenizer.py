"""Byte-level BPE tokenizer of the embedded model (a thin wrapper over HF `tokenizers`).

Byte-level means every string, whatever its characters, encodes to ids that decode back to
exactly the same string. Two special tokens exist: `<|endoftext|>` (joins documents in the
training stream, stops generation) and `<|MASK|>` (the DFlash drafter's mask token).
"""

from __future__ import annotations

from pathlib import Path

import tokenizers

from ddtree_jax.assets import TOKENIZER_PATH

EOT_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|MASK|>"
SPECIAL_TOKENS = (EOT_TOKEN, MASK_TOKEN)


class Tokenizer:
    """Encode text to int ids and back; `eot_id`, `mask_id`, `vocab_size` describe the vocabulary."""

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer):
        self.hf = hf_tokenizer
        missing = [t for t in SPECIAL_TOKENS if hf_tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks the special tokens {missing}")
        self.eot_id: int = hf_tokenizer.token_to_id(EOT_TOKEN)
        self.mask_id: int = hf_tokenizer.token_to_id(MASK_TOKEN)
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a `tokenizer.json` written by HF `tokenizers`."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer file {str(path)!r} does not exist")
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    @classmethod
    def default(cls) -> Tokenizer:
        """The tokenizer shipped in `ddtree_jax/assets/tokenizer.json`."""
        return cls.from_file(TOKENIZER_PATH)

    def encode(self, text: str) -> list[int]:
        """`text` -> token ids; special-token strings in `text` map to their ids."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` for many texts at once (parallel inside `tokenizers`)."""
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        """Token ids (any int sequence or 1-D array) -> text, special tokens kept as text."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)
