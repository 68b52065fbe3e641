"""Draft vocabularies: token counts and the most frequent ids against plain-Python oracles, the drafter's
head over W columns, trees mapped back to token ids, and bad input."""

import collections

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax.checkpoint import save_drafter
from ddtree_jax.draft_vocab import (
    COUNTS_FILE,
    coverage,
    load_counts,
    most_frequent,
    token_counts,
    with_frequent_tokens,
)
from ddtree_jax.models import drafter_logits, with_draft_vocab
from ddtree_jax.tree import build_tree, with_token_ids
from tests.test_engine import tiny_pair


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=40), data=st.data())
def test_most_frequent_is_the_first_ids_by_count_then_id(counts, data):
    size = data.draw(st.integers(1, len(counts)))
    oracle = sorted(sorted(range(len(counts)), key=lambda i: (-counts[i], i))[:size])
    got = most_frequent(np.asarray(counts), size)
    assert got.dtype == np.int32 and got.tolist() == oracle


@settings(max_examples=30, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 9), max_size=12), max_size=5))
def test_token_counts_count_every_id(seqs):
    oracle = collections.Counter(t for s in seqs for t in s)
    assert token_counts(seqs, 10).tolist() == [oracle[i] for i in range(10)]


def test_coverage_is_the_share_of_the_most_frequent():
    counts = np.array([5, 0, 3, 2])
    assert [coverage(counts, w) for w in (1, 2, 3, 4)] == [0.5, 0.8, 1.0, 1.0]
    assert coverage(np.zeros(3, np.int64), 2) == 0.0


def test_counts_and_sizes_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 4\)"):
        token_counts([[1, 4]], 4)
    with pytest.raises(ValueError, match="1 to 3 tokens, got 4"):
        most_frequent(np.array([1, 2, 3]), 4)
    with pytest.raises(ValueError, match="counts must be a 1-D array of ints >= 0"):
        most_frequent(np.array([1, -2, 3]), 1)
    with pytest.raises(ValueError, match=f"no token counts at {tmp_path / COUNTS_FILE}"):
        load_counts(tmp_path, 8)
    np.save(tmp_path / COUNTS_FILE, np.arange(7))
    with pytest.raises(ValueError, match="must hold 8 counts >= 0, got int64 \\(7,\\)"):
        load_counts(tmp_path, 8)
    np.save(tmp_path / COUNTS_FILE, np.arange(8))
    assert load_counts(tmp_path, 8).tolist() == list(range(8))


IDS = [6, 0, 3, 5, 2]  # five of eight tokens, unsorted


def test_the_draft_head_is_the_lm_heads_columns():
    """The head is the target's LM head at the ids, ascending (tied: the embedding's rows), and the draft
    logits are the whole vocabulary's logits at those columns."""
    target, drafter = tiny_pair(vocab=8)
    small = with_draft_vocab(drafter, target, IDS)
    ids = np.sort(IDS)
    np.testing.assert_array_equal(small.params.draft_ids, ids)
    np.testing.assert_array_equal(small.params.draft_head, np.asarray(target.params.embed)[ids].T)
    tokens = jnp.asarray([[1, 2, 3, 4, 5, 6, 7]])
    np.testing.assert_allclose(drafter_logits(small, target, tokens), drafter_logits(drafter, target, tokens)[..., ids],
                               rtol=1e-6, atol=1e-6)
    assert with_draft_vocab(small, target, None).params.draft_head is None


def test_with_frequent_tokens_takes_the_most_frequent_by_the_counts_file(tmp_path):
    """The ``size`` most frequent ids of ``model_dir``'s counts; size 0 the whole vocabulary, no file read."""
    target, drafter = tiny_pair(vocab=8)
    np.save(tmp_path / COUNTS_FILE, np.array([5, 0, 9, 9, 1, 7, 0, 2]))
    small = with_frequent_tokens(drafter, target, tmp_path, 3)
    np.testing.assert_array_equal(small.params.draft_ids, [2, 3, 5])
    want = with_draft_vocab(drafter, target, [2, 3, 5])
    np.testing.assert_array_equal(small.params.draft_head, want.params.draft_head)
    assert with_frequent_tokens(small, target, tmp_path / "none", 0).params.draft_ids is None
    with pytest.raises(ValueError, match="no token counts at"):
        with_frequent_tokens(drafter, target, tmp_path / "none", 3)


def test_trees_over_a_draft_vocabulary_hold_its_token_ids():
    """A tree built from the W columns, mapped back, is the tree built from the whole vocabulary with the
    other tokens impossible (-inf draft logits): the same token ids, parents and depths."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 4, 8)).astype(np.float32) * 2
    ids = np.sort(IDS)
    roots = jnp.asarray([7, 1, 4])
    small = with_token_ids(build_tree(jnp.asarray(logits[..., ids]), jnp.asarray([0, 0, 0]), budget=12), ids)
    masked = np.full_like(logits, -1e30)
    masked[..., ids] = logits[..., ids]
    whole = build_tree(jnp.asarray(masked), roots, budget=12)
    num = np.asarray(whole.num_nodes)
    np.testing.assert_array_equal(small.num_nodes, num)
    for b in range(3):
        np.testing.assert_array_equal(small.tokens[b, 1:num[b]], whole.tokens[b, 1:num[b]])
        np.testing.assert_array_equal(small.parents[b], whole.parents[b])
        np.testing.assert_array_equal(small.depths[b], whole.depths[b])
        assert set(np.asarray(small.tokens[b, 1:num[b]]).tolist()) <= set(IDS)
        np.testing.assert_array_equal(small.tokens[b, num[b]:], 0)  # padding unchanged


def test_bad_draft_vocabularies_get_clear_errors(tmp_path):
    target, drafter = tiny_pair(vocab=8)
    for ids, message in [([], "non-empty 1-D int array"), ([[1, 2]], "non-empty 1-D int array"),
                         ([1.0, 2.0], "non-empty 1-D int array"), ([1, 8], r"distinct ids in \[0, 8\)"),
                         ([-1, 2], r"distinct ids in \[0, 8\)"), ([2, 2, 3], "1 repeated")]:
        with pytest.raises(ValueError, match=message):
            with_draft_vocab(drafter, target, ids)
    small = with_draft_vocab(drafter, target, IDS)
    with pytest.raises(ValueError, match="a DFlash checkpoint does not hold"):
        save_drafter(tmp_path / "d", small)
    half = small.params.__class__(**{**vars(small.params), "draft_head": None})
    with pytest.raises(ValueError, match="must be set together"):
        drafter_logits(small.__class__(config=small.config, params=half), target, jnp.asarray([[1, 2, 3]]))
    wrong = small.params.__class__(**{**vars(small.params), "draft_ids": small.params.draft_ids.astype(jnp.int16)})
    with pytest.raises(ValueError, match="int32 ids"):
        with_draft_vocab(small.__class__(config=small.config, params=wrong), target, IDS)


def test_count_tokens_counts_every_file_and_its_end_of_text(tmp_path):
    """`experiments/count_tokens.py` over two text files: each file's ids once, plus one end-of-text each."""
    from experiments import count_tokens
    from ddtree_jax.assets import TARGET_DIR
    from ddtree_jax.tokenizer import Tokenizer

    texts = ["def f(x):\n    return x\n", "import os\nprint(os.sep)\n"]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    out = tmp_path / "counts.npy"
    assert count_tokens.main(["--files", str(tmp_path / "*.txt"), "--out", str(out)]) == 0
    tok = Tokenizer.from_file(TARGET_DIR / "tokenizer.json")
    oracle = collections.Counter(t for text in texts for t in tok.encode(text) + [tok.eot_id])
    counts = np.load(out)
    assert counts.shape == (tok.vocab_size,) and counts.tolist() == [oracle[i] for i in range(tok.vocab_size)]
    with pytest.raises(ValueError, match="matches no file"):
        count_tokens.main(["--files", str(tmp_path / "*.md"), "--out", str(out)])
