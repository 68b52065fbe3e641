from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax.assets import TOKENIZER_PATH
from ddtree_jax.experiments import corpus
from ddtree_jax.tokenizer import Tokenizer

TRICKY = [
    "",
    " ",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "\tif x:\r\n\t\treturn {'a': [1, 2.5e-3]}\r\n",
    "trailing spaces   \n\n\n   ",
    "héllo wörld — “quotes” ½ ß ø",
    "emoji 😀👍🏽 flag 🇫🇷 zwj 👨‍👩‍👧",
    "中文 日本語 한국어 العربية עברית",
    "combining e\u0301 and lone \u0301 and \ufeffBOM",
    "control \x00\x01\x1b[0m\x7f and \u2028 separators \u2029",
    "a <|endoftext|> b<|MASK|>c  <|endoftext|>\n",
    "<|endoftext",
    "r'''\\d+\\s*''' + b'\\xff' + f\"{x!r:>10}\"",
    "\ufffd replacement char",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.default()


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_tricky(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_round_trip_arbitrary_text(text):
    tok = Tokenizer.default()
    assert tok.decode(tok.encode(text)) == text


def test_special_ids_and_vocab(tok):
    assert (tok.eot_id, tok.mask_id, tok.vocab_size) == (0, 1, 4096)
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("<|MASK|>") == [1]
    assert tok.decode([0, 1]) == "<|endoftext|><|MASK|>"


def test_learnt_merges_compress_code(tok):
    text = corpus.read_text(corpus.stdlib_root() / "os.py")
    assert len(text.encode("utf-8")) / len(tok.encode(text)) > 2.5


def test_asset_is_small_and_encode_batch_matches(tok):
    assert TOKENIZER_PATH.stat().st_size < 1_000_000
    texts = TRICKY[2:6]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_bad_inputs(tmp_path: Path):
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_file(tmp_path / "missing.json")
    import tokenizers
    from tokenizers import models

    bare = tokenizers.Tokenizer(models.BPE())
    with pytest.raises(ValueError, match="special tokens"):
        Tokenizer(bare)
