"""Checks of the NumPy oracle itself: brute-force optimality of the tree, hand-computed
encodings and target laws, and exactness of tree rejection sampling (the emitted sequence
follows the target law)."""

import itertools

import numpy as np
import pytest
from scipy import stats

from ddtree_jax import oracle

# ----------------------------------------------------------------------------- helpers


def softmax64(logits_LV):
    z = np.asarray(logits_LV, dtype=np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def prefix_space(width, depth_limit):
    """Rank tuples of length 1..depth_limit with ranks < width, parents before children."""
    return [
        ranks
        for depth in range(1, depth_limit + 1)
        for ranks in itertools.product(range(width), repeat=depth)
    ]


def best_prefix_closed_mass(space, size, path_prob):
    """Max over every prefix-closed subset of ``space`` with ``size`` elements of the summed
    path probability, by exhaustive include/exclude enumeration."""
    best, chosen = -1.0, set()

    def extend(i, mass):
        nonlocal best
        if len(chosen) == size:
            best = max(best, mass)
            return
        if len(space) - i < size - len(chosen):
            return
        ranks = space[i]
        if len(ranks) == 1 or ranks[:-1] in chosen:
            chosen.add(ranks)
            extend(i + 1, mass + path_prob[ranks])
            chosen.remove(ranks)
        extend(i + 1, mass)

    extend(0, 0.0)
    return best


def node_paths(tree, b=0):
    """Token path (root excluded) of every real node of request b."""
    paths = [()]
    for k in range(1, int(tree.num_nodes[b])):
        paths.append(paths[tree.parents[b, k]] + (int(tree.tokens[b, k]),))
    return paths


def path_probs(tree, probs_NV, b=0):
    """Target probability of reaching every real node of request b."""
    mass = [1.0]
    for k in range(1, int(tree.num_nodes[b])):
        parent = tree.parents[b, k]
        mass.append(mass[parent] * probs_NV[parent, tree.tokens[b, k]])
    return mass


def prefix_mass(law, prefix):
    return sum(p for seq, p in law.items() if seq[: len(prefix)] == prefix)


def random_rows(rng, slots, vocab, zero_fraction=0.3):
    """Random target rows, some entries exactly zero (as after top-k / top-p)."""
    probs = rng.dirichlet(np.ones(vocab), size=slots)
    probs[rng.random((slots, vocab)) < zero_fraction] = 0.0
    probs[np.arange(slots), rng.integers(vocab, size=slots)] += 0.1
    return probs / probs.sum(axis=-1, keepdims=True)


def random_tree(rng, vocab, depth_limit, budget, topk_cap=None):
    logits = rng.normal(scale=1.5, size=(1, depth_limit, vocab))
    return oracle.build_tree(logits, [vocab - 1], budget=budget, topk_cap=topk_cap)


def check_tree_structure(tree, b=0):
    n = int(tree.num_nodes[b])
    assert tree.parents[b, 0] == -1 and tree.depths[b, 0] == 0 and tree.logw[b, 0] == 0
    for k in range(1, n):
        parent = tree.parents[b, k]
        assert 0 <= parent < k
        assert tree.depths[b, k] == tree.depths[b, parent] + 1
    assert np.all(np.diff(tree.logw[b, 1:n]) <= 0), "pop order must have non-increasing logw"
    for parent in range(n):
        siblings = tree.tokens[b, 1:n][tree.parents[b, 1:n] == parent]
        assert len(set(siblings.tolist())) == len(siblings), "siblings must be distinct"
    assert np.all(tree.parents[b, n:] == -1) and np.all(tree.depths[b, n:] == 0)
    assert np.all(tree.tokens[b, n:] == 0) and np.all(tree.logw[b, n:] == -np.inf)


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize("vocab", [2, 3, 4])
@pytest.mark.parametrize("depth_limit", [1, 2, 3])
@pytest.mark.parametrize("topk_cap", [None, 1, 2, 3])
def test_build_tree_is_the_best_prefix_closed_tree(vocab, depth_limit, topk_cap):
    rng = np.random.default_rng(100 * vocab + 10 * depth_limit + (topk_cap or 0))
    logits_LV = rng.normal(scale=1.5, size=(depth_limit, vocab))
    q_LV = softmax64(logits_LV)
    order_LV = np.argsort(-q_LV, axis=-1, kind="stable")
    for budget in [1, 2, 3, 5, 7, 10]:
        width = min(budget, vocab, topk_cap or budget)
        if width == 4 and depth_limit == 3 and budget > 6:
            continue  # over four million subsets: too slow to enumerate
        space = prefix_space(width, depth_limit)
        path_prob = {
            ranks: np.prod([q_LV[d, order_LV[d, r]] for d, r in enumerate(ranks)])
            for ranks in space
        }
        size = min(budget, len(space))
        tree = oracle.build_tree(logits_LV[None], [vocab], budget=budget, topk_cap=topk_cap)

        assert tree.tokens.shape == (1, budget + 1) and tree.tokens.dtype == np.int32
        assert tree.logw.dtype == np.float32 and tree.num_nodes.dtype == np.int32
        assert tree.num_nodes[0] == size + 1 and tree.tokens[0, 0] == vocab
        check_tree_structure(tree)
        lp_LV = [oracle.draft_log_probs(row, 1.0) for row in logits_LV]
        mass = 0.0
        for k, path in enumerate(node_paths(tree)[1:], start=1):
            depth = len(path)
            assert path[-1] in order_LV[depth - 1, :width], "token outside the top-K"
            parent = tree.parents[0, k]
            assert tree.logw[0, k] == np.float32(tree.logw[0, parent] + lp_LV[depth - 1][path[-1]])
            mass += np.prod([q_LV[d, t] for d, t in enumerate(path)])
        assert mass == pytest.approx(best_prefix_closed_mass(space, size, path_prob), rel=1e-9)


def test_build_tree_ties_follow_rank_tuples():
    tree = oracle.build_tree(np.zeros((1, 2, 3)), [7], budget=5)
    np.testing.assert_array_equal(tree.tokens, [[7, 0, 1, 2, 0, 1]])
    np.testing.assert_array_equal(tree.parents, [[-1, 0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(tree.depths, [[0, 1, 1, 1, 2, 2]])
    np.testing.assert_allclose(tree.logw, [[0] + [-np.log(3)] * 3 + [-2 * np.log(3)] * 2],
                               rtol=1e-6)


def test_build_tree_prefers_a_likely_grandchild_over_an_unlikely_sibling():
    logits = np.log([[[0.9, 0.1], [0.9, 0.1]]])
    tree = oracle.build_tree(logits, [5], budget=2)
    np.testing.assert_array_equal(tree.tokens, [[5, 0, 0]])
    np.testing.assert_array_equal(tree.parents, [[-1, 0, 1]])
    np.testing.assert_allclose(tree.logw, [[0, np.log(0.9), 2 * np.log(0.9)]], rtol=1e-6)


def test_build_tree_cap_one_is_a_padded_chain_of_argmaxes():
    logits = np.array([[[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 5.0]],
                       [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 4.0, 1.0]]])
    tree = oracle.build_tree(logits, [4, 6], budget=5, topk_cap=1)
    np.testing.assert_array_equal(tree.tokens, [[4, 1, 0, 2, 0, 0], [6, 0, 2, 1, 0, 0]])
    np.testing.assert_array_equal(tree.parents, [[-1, 0, 1, 2, -1, -1]] * 2)
    np.testing.assert_array_equal(tree.depths, [[0, 1, 2, 3, 0, 0]] * 2)
    np.testing.assert_array_equal(tree.num_nodes, [4, 4])
    assert np.all(tree.logw[:, 4:] == -np.inf)


def test_build_tree_draft_temperature_sharpens():
    logits = np.array([[[1.0, 0.0]]])
    tree = oracle.build_tree(logits, [0], budget=2, draft_temperature=0.5)
    np.testing.assert_allclose(tree.logw[0, 1:], np.log(softmax64([2.0, 0.0])), rtol=1e-6)


def test_build_tree_large_budget_and_vocab():
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(1, 16, 50_000)).astype(np.float32)
    tree = oracle.build_tree(logits, [1], budget=1024, topk_cap=8)
    assert tree.num_nodes[0] == 1025
    check_tree_structure(tree)
    assert tree.depths.max() > 1 and np.bincount(tree.parents[0, 1:]).max() <= 8


@pytest.mark.parametrize(
    "kwargs",
    [{"budget": 0}, {"budget": 2.0}, {"budget": 2, "topk_cap": 0},
     {"budget": 2, "draft_temperature": 0.0}, {"budget": 2, "draft_temperature": np.inf}],
)
def test_build_tree_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        oracle.build_tree(np.zeros((1, 2, 3)), [0], **kwargs)


def test_build_tree_rejects_bad_shapes():
    with pytest.raises(ValueError, match="draft_logits"):
        oracle.build_tree(np.zeros((2, 3)), [0], budget=2)
    with pytest.raises(ValueError, match="root_tokens"):
        oracle.build_tree(np.zeros((2, 2, 3)), [0], budget=2)


# ----------------------------------------------------------------------------- encoding


@pytest.fixture
def padded_tree():
    """Uniform V=2, L=2, budget 8: the 6 prefixes in rank-tuple order, then 2 padding slots."""
    return oracle.build_tree(np.zeros((1, 2, 2)), [9], budget=8)


def test_padded_tree_layout(padded_tree):
    np.testing.assert_array_equal(padded_tree.tokens, [[9, 0, 1, 0, 1, 0, 1, 0, 0]])
    np.testing.assert_array_equal(padded_tree.parents, [[-1, 0, 0, 1, 1, 2, 2, -1, -1]])
    np.testing.assert_array_equal(padded_tree.num_nodes, [7])
    check_tree_structure(padded_tree)


def test_compile_retrieve(padded_tree):
    retrieve = oracle.compile_retrieve(padded_tree)
    np.testing.assert_array_equal(retrieve.next_token, [[1, 3, 5, -1, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(retrieve.next_sibling, [[-1, 2, -1, 4, -1, 6, -1, -1, -1]])
    np.testing.assert_array_equal(retrieve.index, [np.arange(9)])
    two = oracle.Tree(*(np.concatenate([a, a]) for a in padded_tree))
    np.testing.assert_array_equal(oracle.compile_retrieve(two).index[1], np.arange(9, 18))


def test_tree_attention_mask(padded_tree):
    mask = oracle.tree_attention_mask(padded_tree)[0]
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4},
                5: {0, 2, 5}, 6: {0, 2, 6}, 7: {7}, 8: {8}}
    for i, attended in expected.items():
        assert set(np.flatnonzero(mask[i]).tolist()) == attended


def test_tree_positions(padded_tree):
    two = oracle.Tree(*(np.concatenate([a, a]) for a in padded_tree))
    positions = oracle.tree_positions(two, [10, 3])
    assert positions.dtype == np.int32
    np.testing.assert_array_equal(positions[0], [10, 11, 11, 12, 12, 12, 12, 10, 10])
    np.testing.assert_array_equal(positions[1], [3, 4, 4, 5, 5, 5, 5, 3, 3])


# ----------------------------------------------------------------------------- target law


@pytest.mark.parametrize(
    "logits, temperature, top_k, top_p, expected",
    [
        ([1.0, 3.0, 3.0, 0.0], 0.0, 0, 1.0, [0, 1, 0, 0]),  # argmax tie -> smaller id
        ([0.0, np.log(2.0)], 0.5, 0, 1.0, [0.2, 0.8]),
        ([0.0, np.log(2.0)], 1.0, 0, 1.0, [1 / 3, 2 / 3]),
        ([2.0, 1.0, 1.0, 0.0], 1.0, 2, 1.0,  # tie at the top-k boundary -> smaller id
         [np.e / (np.e + 1), 1 / (np.e + 1), 0, 0]),
        ([0.0, 1.0, 1.0], 1.0, 1, 1.0, [0, 1, 0]),
        ([0.0, 0.0, 0.0], 1.0, 5, 1.0, [1 / 3, 1 / 3, 1 / 3]),  # top_k > V keeps all
        (np.log([0.5, 0.3, 0.2]), 1.0, 0, 0.75, [0.625, 0.375, 0]),
        (np.log([0.5, 0.3, 0.2]), 1.0, 0, 0.4, [1, 0, 0]),
        (np.log([0.2, 0.4, 0.4]), 1.0, 0, 0.3, [0, 1, 0]),  # top-p tie -> smaller id
        (np.log([0.2, 0.4, 0.4]), 1.0, 0, 0.5, [0, 0.5, 0.5]),
        # top-p measures mass on the top-k renormalised row: 0.7 < 0.72 < 7/9
        (np.log([0.4, 0.3, 0.2, 0.1]), 1.0, 3, 0.72, [4 / 7, 3 / 7, 0, 0]),
        (np.log([0.4, 0.3, 0.2, 0.1]), 1.0, 0, 0.72, [4 / 9, 3 / 9, 2 / 9, 0]),
    ],
)
def test_target_probs_hand_examples(logits, temperature, top_k, top_p, expected):
    probs = oracle.target_probs(np.asarray(logits)[None], temperature, top_k, top_p)
    assert probs.dtype == np.float32
    np.testing.assert_allclose(probs[0], expected, rtol=1e-6, atol=1e-7)


def test_target_probs_per_request_parameters_and_shapes():
    rng = np.random.default_rng(1)
    logits_BNV = rng.normal(size=(3, 4, 50))
    temperature, top_k, top_p = [0.0, 0.7, 1.3], [0, 5, 0], [1.0, 0.9, 0.6]
    probs_BNV = oracle.target_probs(logits_BNV, temperature, top_k, top_p)
    assert probs_BNV.shape == (3, 4, 50)
    np.testing.assert_allclose(probs_BNV.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(probs_BNV[0].argmax(-1), logits_BNV[0].argmax(-1))
    assert np.all((probs_BNV[0] == 0) | (probs_BNV[0] == 1))
    assert np.all((probs_BNV[1] > 0).sum(-1) <= 5)
    for b in range(3):
        alone = oracle.target_probs(logits_BNV[b], temperature[b], top_k[b], top_p[b])
        np.testing.assert_array_equal(alone, probs_BNV[b])


def test_target_probs_large_top_k_matches_full_sort():
    rng = np.random.default_rng(2)
    logits = np.round(rng.normal(size=(2, 3000)), 1)  # many exact ties
    probs = oracle.target_probs(logits, 1.0, 40, 1.0)
    for row, logits_row in zip(probs, logits, strict=True):
        kept = np.argsort(-logits_row, kind="stable")[:40]
        np.testing.assert_array_equal(np.sort(np.flatnonzero(row)), np.sort(kept))


@pytest.mark.parametrize(
    "temperature, top_k, top_p, name",
    [(-1.0, 0, 1.0, "temperature"), (np.nan, 0, 1.0, "temperature"),
     (1.0, -1, 1.0, "top_k"), (1.0, 0, 0.0, "top_p"), (1.0, 0, 1.5, "top_p"),
     ([1.0, 1.0, 1.0], 0, 1.0, "temperature")],
)
def test_target_probs_rejects_bad_parameters(temperature, top_k, top_p, name):
    with pytest.raises(ValueError, match=name):
        oracle.target_probs(np.zeros((2, 3, 4)), temperature, top_k, top_p)


# ----------------------------------------------------------------------------- verification


@pytest.fixture
def small_walk():
    """Root (node 0) with children node 1 (token 5) and node 2 (token 3); node 3 (token 2)
    is the child of node 1. V = 6."""
    candidates = np.array([[9, 5, 3, 2]])
    next_token = np.array([[1, 3, -1, -1]])
    next_sibling = np.array([[-1, 2, -1, -1]])
    probs = np.zeros((1, 4, 6))
    probs[0, 0, [5, 3, 0]] = [0.5, 0.2, 0.3]
    probs[0, 1, [2, 1]] = [0.6, 0.4]
    probs[0, 2, 4] = 1.0
    probs[0, 3, [0, 1]] = [0.25, 0.75]
    return candidates, next_token, next_sibling, probs


def repeat(arrays, batch):
    return [np.repeat(a, batch, axis=0) for a in arrays]


def test_tree_rejection_sample_hand_cases(small_walk):
    candidates, next_token, next_sibling, probs = repeat(small_walk, 4)
    coins = np.array([[0.4, 0.5, 1.0, 1.0],   # accept 1, accept 3, leaf -> row 3
                      [0.6, 1.0, 1.0, 1.0],   # reject 1, accept 2, leaf -> row 2
                      [0.9, 1.0, 1.0, 1.0],   # reject both -> row 0 without tokens 5, 3
                      [0.4, 0.7, 1.0, 1.0]])  # accept 1, reject 3 -> row 1 without token 2
    final_coins = np.array([0.5, 0.5, 0.99, 0.99])
    result = oracle.tree_rejection_sample(
        candidates, next_token, next_sibling, coins, final_coins, probs, max_depth=3)
    np.testing.assert_array_equal(
        result.accept_index, [[0, 1, 3, -1], [0, 2, -1, -1], [0, -1, -1, -1], [0, 1, -1, -1]])
    np.testing.assert_array_equal(result.num_accepted, [2, 1, 0, 1])
    np.testing.assert_array_equal(
        result.emitted, [[5, 2, 1, -1], [3, 4, -1, -1], [0, -1, -1, -1], [5, 1, -1, -1]])
    np.testing.assert_array_equal(result.bonus, [1, 4, 0, 1])
    np.testing.assert_array_equal(
        result.predicts, [[5, 2, -1, 1], [3, -1, 4, -1], [0, -1, -1, -1], [5, 1, -1, -1]])
    for field in result:
        assert field.dtype == np.int32


def test_tree_rejection_sample_depth_limit_draws_from_the_full_row(small_walk):
    candidates, next_token, next_sibling, probs = small_walk
    coins = np.array([[0.4, 0.9, 1.0, 1.0]])  # would reject node 3 if it were walked
    result = oracle.tree_rejection_sample(
        candidates, next_token, next_sibling, coins, [0.5], probs, max_depth=1)
    np.testing.assert_array_equal(result.accept_index, [[0, 1]])
    np.testing.assert_array_equal(result.emitted, [[5, 2]])  # token 2 was not rejected


def test_tree_rejection_sample_rejects_bad_coins(small_walk):
    candidates, next_token, next_sibling, probs = small_walk
    with pytest.raises(ValueError, match="coins"):
        oracle.tree_rejection_sample(candidates, next_token, next_sibling,
                                     np.zeros((1, 4)), [0.5], probs, max_depth=2)
    with pytest.raises(ValueError, match="final_coins"):
        oracle.tree_rejection_sample(candidates, next_token, next_sibling,
                                     np.ones((1, 4)), [1.5], probs, max_depth=2)
    with pytest.raises(ValueError, match="max_depth"):
        oracle.tree_rejection_sample(candidates, next_token, next_sibling,
                                     np.ones((1, 4)), [0.5], probs, max_depth=-1)


def test_tree_greedy_verify(small_walk):
    candidates, next_token, next_sibling, _ = repeat(small_walk, 3)
    target_argmax = np.array([[5, 2, 4, 1], [0, 2, 4, 1], [3, 2, 4, 1]])
    result = oracle.tree_greedy_verify(
        candidates, next_token, next_sibling, target_argmax, max_depth=2)
    np.testing.assert_array_equal(result.accept_index, [[0, 1, 3], [0, -1, -1], [0, 2, -1]])
    np.testing.assert_array_equal(result.emitted, [[5, 2, 1], [0, -1, -1], [3, 4, -1]])
    np.testing.assert_array_equal(result.num_accepted, [2, 0, 1])
    np.testing.assert_array_equal(result.bonus, [1, 0, 4])
    np.testing.assert_array_equal(
        result.predicts, [[5, 2, -1, 1], [0, -1, -1, -1], [3, -1, 4, -1]])
    limited = oracle.tree_greedy_verify(
        candidates[:1], next_token[:1], next_sibling[:1], target_argmax[:1], max_depth=1)
    np.testing.assert_array_equal(limited.emitted, [[5, 2]])


def test_verify_greedy_requests_match_greedy_verification():
    rng = np.random.default_rng(3)
    vocab, depth_limit, budget, batch = 5, 3, 9, 6
    tree = oracle.build_tree(
        rng.normal(size=(batch, depth_limit, vocab)), rng.integers(vocab, size=batch),
        budget=budget)
    target_logits = rng.normal(scale=2.0, size=(batch, budget + 1, vocab))
    # Make the target agree with the drafts often so that paths get long.
    target_logits[:, :, :2] += 2.0
    retrieve = oracle.compile_retrieve(tree)
    result = oracle.verify(
        tree, target_logits, coins=1.0 - rng.random((batch, budget + 1)),
        final_coins=1.0 - rng.random(batch), temperature=0.0, top_k=0, top_p=1.0, max_depth=3)
    greedy = oracle.tree_greedy_verify(
        tree.tokens, retrieve.next_token, retrieve.next_sibling, target_logits.argmax(-1),
        max_depth=3)
    for got, want in zip(result, greedy, strict=True):
        np.testing.assert_array_equal(got, want)
    assert result.num_accepted.max() >= 2


def test_verify_mixed_batch_equals_single_requests():
    rng = np.random.default_rng(4)
    vocab, budget, batch = 6, 7, 4
    tree = oracle.build_tree(rng.normal(size=(batch, 3, vocab)), [0, 1, 2, 3], budget=budget)
    target_logits = rng.normal(size=(batch, budget + 1, vocab))
    coins, final_coins = 1.0 - rng.random((batch, budget + 1)), 1.0 - rng.random(batch)
    params = {"temperature": [0.0, 1.0, 0.7, 1.5], "top_k": [0, 0, 3, 2],
              "top_p": [1.0, 0.8, 1.0, 0.9]}
    result = oracle.verify(tree, target_logits, coins=coins, final_coins=final_coins,
                           max_depth=3, **params)
    for b in range(batch):
        one = oracle.verify(
            oracle.Tree(*(a[b: b + 1] for a in tree)), target_logits[b: b + 1],
            coins=coins[b: b + 1], final_coins=final_coins[b: b + 1], max_depth=3,
            **{name: value[b] for name, value in params.items()})
        for got, want in zip(result, one, strict=True):
            np.testing.assert_array_equal(got[b], want[0])


# ----------------------------------------------------------------------------- exactness

LAW_CASES = [
    # (seed, vocab, depth_limit, budget, topk_cap, max_depth)
    (10, 3, 1, 2, None, 1),
    (11, 4, 2, 5, None, 2),
    (12, 4, 3, 8, None, 3),
    (13, 5, 3, 8, 2, 3),
    (17, 4, 3, 9, None, 2),  # depth limit below the tree depth
    (15, 3, 2, 3, 1, 1),
    (16, 5, 2, 10, None, 0),
]


@pytest.mark.parametrize("seed, vocab, depth_limit, budget, topk_cap, max_depth", LAW_CASES)
def test_emitted_law_is_the_target_law(seed, vocab, depth_limit, budget, topk_cap, max_depth):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, vocab, depth_limit, budget, topk_cap)
    probs_NV = random_rows(rng, budget + 1, vocab)
    law = oracle.emitted_law(tree, probs_NV[None], max_depth)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    assert all(len(seq) <= max_depth + 1 for seq in law)
    reach = path_probs(tree, probs_NV)
    checked = 0
    for k, path in enumerate(node_paths(tree)):
        if len(path) > max_depth:
            continue
        for token in range(vocab):
            want = reach[k] * probs_NV[k, token]
            assert prefix_mass(law, path + (token,)) == pytest.approx(want, abs=1e-12)
            checked += 1
    assert checked >= vocab


def test_emitted_law_first_two_tokens():
    rng = np.random.default_rng(20)
    tree = random_tree(rng, 4, 2, 6)
    probs_NV = random_rows(rng, 7, 4)
    law = oracle.emitted_law(tree, probs_NV[None], 2)
    node_of_root_child = {int(tree.tokens[0, k]): k
                          for k in range(1, int(tree.num_nodes[0])) if tree.parents[0, k] == 0}
    assert node_of_root_child
    for t1 in range(4):
        assert prefix_mass(law, (t1,)) == pytest.approx(probs_NV[0, t1], abs=1e-12)
        if t1 in node_of_root_child:
            row = probs_NV[node_of_root_child[t1]]
            for t2 in range(4):
                want = probs_NV[0, t1] * row[t2]
                assert prefix_mass(law, (t1, t2)) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("seed, vocab, depth_limit, budget, topk_cap, max_depth", LAW_CASES)
def test_expected_acceptance_is_the_mean_accepted_count(
        seed, vocab, depth_limit, budget, topk_cap, max_depth):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, vocab, depth_limit, budget, topk_cap)
    probs_NV = random_rows(rng, budget + 1, vocab)
    law = oracle.emitted_law(tree, probs_NV[None], max_depth)
    mean_accepted = sum(p * (len(seq) - 1) for seq, p in law.items())
    expected = oracle.expected_acceptance(tree, probs_NV[None])
    assert expected.shape == (1,)
    # Nodes deeper than max_depth are never accepted; expected_acceptance counts them all.
    reach = path_probs(tree, probs_NV)
    depths = [len(path) for path in node_paths(tree)]
    beyond = sum(r for r, depth in zip(reach, depths, strict=True) if depth > max_depth)
    assert (beyond > 0) == (max_depth < tree.depths.max())
    assert expected[0] == pytest.approx(mean_accepted + beyond, abs=1e-12)


def sample_counts(tree, probs_NV, max_depth, num_samples, rng):
    retrieve = oracle.compile_retrieve(tree)
    result = oracle.tree_rejection_sample(
        *repeat([tree.tokens, retrieve.next_token, retrieve.next_sibling], num_samples),
        1.0 - rng.random((num_samples, tree.tokens.shape[1])), 1.0 - rng.random(num_samples),
        np.broadcast_to(probs_NV, (num_samples,) + probs_NV.shape), max_depth=max_depth)
    counts = {}
    for row in result.emitted:
        seq = tuple(int(t) for t in row if t >= 0)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def chi_square_pvalue(counts, law):
    """Pearson test of the counts against the law, pooling cells expected below 5."""
    total = sum(counts.values())
    assert set(counts) <= set(law), "sampled a sequence of probability zero"
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq, p in law.items():
        if p * total >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(p * total)
        else:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += p * total
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    return stats.chisquare(observed, np.array(expected) * total / sum(expected)).pvalue


@pytest.mark.slow
def test_tree_rejection_sample_frequencies_match_emitted_law():
    rng = np.random.default_rng(30)
    tree = random_tree(rng, 4, 3, 7)
    probs_NV = random_rows(rng, 8, 4, zero_fraction=0.2)
    law = oracle.emitted_law(tree, probs_NV[None], 3)
    counts = sample_counts(tree, probs_NV, 3, 20_000, rng)
    assert len(law) >= 10
    assert chi_square_pvalue(counts, law) > 1e-3
    # The same samples clearly reject the law of a different set of target rows.
    wrong_law = oracle.emitted_law(tree, probs_NV[None, ::-1], 3)
    wrong_counts = {seq: n for seq, n in counts.items() if seq in wrong_law}
    assert chi_square_pvalue(wrong_counts, wrong_law) < 1e-6
