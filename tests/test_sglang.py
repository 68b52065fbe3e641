"""SGLang's published verification cases, and the converter between its flat layout and ours.

The case is the two-request, six-node tree of sgl-kernel's unit tests in sgl-project/sglang,
``sgl-kernel/tests/speculative/test_speculative_sampling.py`` (``tree_speculative_sampling_target_only``)
and ``sgl-kernel/tests/speculative/test_eagle_utils.py`` (``verify_tree_greedy``), both with the same
arrays and expected outputs; the arrays below are written out from those files. In request 1 the
root's first child is node 4 and node 1 its next sibling, an encoding that is not in index order.

Cases reproduced: the greedy one, and the sampling one with ``threshold_single = threshold_acc =
1``, which is our walk. Its target rows are ``softmax(logits / 0.01)`` of logits 1 and 10: one-hot in
float32, so the expected outputs hold for every coin in ``(0, 1]`` and a few coin draws are checked.
Not reproduced: the sampling case with both thresholds 0, in which sgl-kernel accepts every first
child whatever the target says; that rule is not exact sampling and our walk does not have it (no
coin in ``(0, 1]`` accepts a child of probability 0).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax import oracle
from ddtree_jax.sampling import target_probs
from ddtree_jax.sglang import FlatResult, FlatTree, result_from_flat, result_to_flat, tree_from_flat, tree_to_flat
from ddtree_jax.verify import VerifyResult, tree_greedy_verify, tree_rejection_sample

# From sgl-kernel/tests/speculative/test_speculative_sampling.py and test_eagle_utils.py (sglang).
CANDIDATES = [[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]
RETRIEVE_INDEX = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
RETRIEVE_NEXT_TOKEN = [[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]
RETRIEVE_NEXT_SIBLING = [[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]
VOCAB = 20
PEAKS = [(0, 0, 3), (0, 3, 4), (0, 4, 5), (1, 0, 11), (1, 4, 12)]  # (request, node, token): logit 10
FILL_TOKEN = 18  # logit 10 in every other row; all other logits are 1
TEMPERATURE = 0.01
NUM_SPEC_STEP = 4  # accept_index columns: max_depth = 3
EXPECTED_PREDICTS = [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
EXPECTED_ACCEPT_INDEX = [[0, 3, 4, 5], [6, 10, 11, -1]]
EXPECTED_ACCEPT_TOKEN_NUM = [3, 2]

FIELDS = ("accept_index", "num_accepted", "predicts", "emitted", "bonus")


def published_logits():
    logits = np.ones((2, 6, VOCAB), np.float32)
    for b, k, token in PEAKS:
        logits[b, k, token] = 10.0
    peaked = logits.max(axis=-1) == 10.0
    logits[..., FILL_TOKEN] = np.where(peaked, logits[..., FILL_TOKEN], 10.0)
    return logits


def published_tree():
    return tree_from_flat(FlatTree(np.array(CANDIDATES), np.array(RETRIEVE_INDEX), np.array(RETRIEVE_NEXT_TOKEN),
                                   np.array(RETRIEVE_NEXT_SIBLING)), batch=2)


def assert_published_outputs(result, retrieve_index):
    flat = result_to_flat(result, retrieve_index)
    assert np.asarray(flat.predicts).tolist() == EXPECTED_PREDICTS
    assert np.asarray(flat.accept_index).tolist() == EXPECTED_ACCEPT_INDEX
    assert np.asarray(flat.accept_token_num).tolist() == EXPECTED_ACCEPT_TOKEN_NUM


def assert_same_result(got, want):
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)),
                                      err_msg=field)


def test_published_target_only_case():
    candidates, next_token, next_sibling, retrieve_index = published_tree()
    probs = np.asarray(target_probs(published_logits(), TEMPERATURE, 0, 1.0))
    np.testing.assert_array_equal(probs.max(axis=-1), 1.0)  # one-hot: the coins cannot matter
    rng = np.random.default_rng(0)
    for coins in (np.ones((2, 6), np.float32), 1.0 - rng.random((2, 6), dtype=np.float32),
                  np.full((2, 6), 1e-6, np.float32)):
        final_coins = coins[:, 1]
        args = (candidates, next_token, next_sibling, coins, final_coins, probs)
        result = tree_rejection_sample(*args, max_depth=NUM_SPEC_STEP - 1)
        assert_published_outputs(result, retrieve_index)
        assert_same_result(result, oracle.tree_rejection_sample(*map(np.asarray, args), max_depth=NUM_SPEC_STEP - 1))


def test_published_greedy_case():
    candidates, next_token, next_sibling, retrieve_index = published_tree()
    target_predict = published_logits().argmax(axis=-1)
    result = tree_greedy_verify(candidates, next_token, next_sibling, target_predict, max_depth=NUM_SPEC_STEP - 1)
    assert_published_outputs(result, retrieve_index)
    want = oracle.tree_greedy_verify(*map(np.asarray, (candidates, next_token, next_sibling)), target_predict,
                                     max_depth=NUM_SPEC_STEP - 1)
    assert_same_result(result, want)


def test_published_outputs_in_our_layout():
    """SGLang's expected outputs read back on local ids, written out by hand from the tree."""
    flat = FlatResult(jnp.array(EXPECTED_PREDICTS), jnp.array(EXPECTED_ACCEPT_INDEX),
                      jnp.array(EXPECTED_ACCEPT_TOKEN_NUM))
    local = result_from_flat(flat, np.array(RETRIEVE_INDEX))
    want = VerifyResult(
        accept_index=np.array([[0, 3, 4, 5], [0, 4, 5, -1]]),
        num_accepted=np.array([3, 2]),
        predicts=np.array([[3, -1, -1, 4, 5, 18], [11, -1, -1, -1, 12, 18]]),
        emitted=np.array([[3, 4, 5, 18], [11, 12, 18, -1]]),
        bonus=np.array([18, 18]),
    )
    assert_same_result(local, want)
    back = result_to_flat(local, np.array(RETRIEVE_INDEX))
    for name in ("predicts", "accept_index", "accept_token_num"):
        np.testing.assert_array_equal(np.asarray(getattr(back, name)), np.asarray(getattr(flat, name)))


def test_published_tree_round_trips_through_the_flat_layout():
    candidates, next_token, next_sibling, retrieve_index = published_tree()
    np.testing.assert_array_equal(np.asarray(next_token), RETRIEVE_NEXT_TOKEN)
    flat = tree_to_flat(candidates, next_token, next_sibling, retrieve_index)
    np.testing.assert_array_equal(np.asarray(flat.retrieve_index), np.arange(12))  # SGLang's b * N + k
    np.testing.assert_array_equal(np.asarray(flat.retrieve_next_sibling), np.ravel(RETRIEVE_NEXT_SIBLING))
    again = tree_from_flat(flat, batch=2)  # flat [batch * N] arrays this time
    for got, want in zip(again, (candidates, next_token, next_sibling, retrieve_index), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(1, 1, 0), (2, 6, 3), (3, 9, 4)]), st.booleans())
def test_results_round_trip_with_any_slot_map(seed, shape, spare_slots):
    """result_from_flat inverts result_to_flat for any one-to-one retrieve_index, and back."""
    batch, n, max_depth = shape
    rng = np.random.default_rng(seed)
    num_slots = batch * n + (5 if spare_slots else 0)
    retrieve_index = rng.permutation(num_slots)[: batch * n].reshape(batch, n).astype(np.int32)
    # A random accepted path per request (node ids along it are distinct, root first).
    accept_index = np.full((batch, max_depth + 1), -1, np.int32)
    predicts = np.full((batch, n), -1, np.int32)
    emitted = np.full((batch, max_depth + 1), -1, np.int32)
    for b in range(batch):
        length = rng.integers(0, min(max_depth, n - 1) + 1)
        path = [0, *rng.permutation(np.arange(1, n))[:length]]
        tokens = rng.integers(0, 50, len(path))
        accept_index[b, : len(path)] = path
        predicts[b, path] = tokens
        emitted[b, : len(path)] = tokens
    num_accepted = (accept_index >= 0).sum(axis=1).astype(np.int32) - 1
    result = VerifyResult(accept_index, num_accepted, predicts, emitted, emitted[np.arange(batch), num_accepted])
    flat = result_to_flat(result, retrieve_index, num_slots)
    assert np.asarray(flat.predicts).shape == (num_slots,)
    on_path = accept_index >= 0
    np.testing.assert_array_equal(np.asarray(flat.accept_index)[on_path],
                                  np.take_along_axis(retrieve_index, np.maximum(accept_index, 0), 1)[on_path])
    assert_same_result(result_from_flat(flat, retrieve_index), result)
    again = result_to_flat(result_from_flat(flat, retrieve_index), retrieve_index, num_slots)
    for name in ("predicts", "accept_index", "accept_token_num"):
        np.testing.assert_array_equal(np.asarray(getattr(again, name)), np.asarray(getattr(flat, name)))
    tree = (rng.integers(0, 50, (batch, n)), rng.integers(-1, n, (batch, n)), rng.integers(-1, n, (batch, n)))
    back = tree_from_flat(tree_to_flat(*tree, None if spare_slots else retrieve_index), batch)
    for got, want in zip(back[:3], tree, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_bad_layouts_are_reported():
    candidates, next_token, next_sibling, retrieve_index = published_tree()
    with pytest.raises(ValueError, match="retrieve_index must not repeat"):
        tree_to_flat(candidates, next_token, next_sibling, np.zeros((2, 6), np.int32))
    with pytest.raises(ValueError, match=r"retrieve_index must hold flat slots in \[0, 12\)"):
        tree_to_flat(candidates, next_token, next_sibling, np.asarray(retrieve_index) + 1)
    with pytest.raises(ValueError, match="retrieve_next_token must have shape"):
        tree_from_flat(FlatTree(np.zeros(12, int), np.arange(12), np.zeros(11, int), np.zeros(12, int)), batch=2)
    with pytest.raises(ValueError, match="candidates must have shape"):
        tree_from_flat(FlatTree(np.zeros(13, int), np.arange(12), np.zeros(12, int), np.zeros(12, int)), batch=2)
    flat = FlatResult(jnp.array(EXPECTED_PREDICTS), jnp.array([[0, 3, 4, 5], [6, 3, 11, -1]]),
                      jnp.array(EXPECTED_ACCEPT_TOKEN_NUM))
    with pytest.raises(ValueError, match=r"accept_index\[1, 1\] = 3 is no node of request 1"):
        result_from_flat(flat, np.array(RETRIEVE_INDEX))
    flat = FlatResult(jnp.array(EXPECTED_PREDICTS), jnp.array(EXPECTED_ACCEPT_INDEX), jnp.array([3, 1]))
    with pytest.raises(ValueError, match="accept_token_num"):
        result_from_flat(flat, np.array(RETRIEVE_INDEX))
