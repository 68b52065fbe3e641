"""The samplers on arbitrary first-child / next-sibling encodings (docs/design.md, "FCNS").

Random valid encodings: a random tree on a random subset of the node ids (node 0 the root), every
sibling list in random order, and the unreached ids holding links of their own (into the tree or
to each other, without cycles), which must be ignored. The JAX samplers must agree exactly with
the NumPy oracle, which walks the linked lists with plain loops; parents and sibling ranks must be
the ones drawn. Invalid encodings must raise a ValueError naming the request and the node.
"""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from ddtree_jax import oracle
from ddtree_jax.verify import parents_and_sibling_ranks, parents_from_fcns, tree_greedy_verify, tree_rejection_sample

FIELDS = ("accept_index", "num_accepted", "predicts", "emitted", "bonus")


def assert_same_result(got, want):
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), getattr(want, field), err_msg=field)


def link_lists(parents_N, order_N):
    """First-child / next-sibling links listing each node's children by ascending ``order``."""
    n = parents_N.shape[0]
    next_token, next_sibling = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
    for p in range(n):
        kids = sorted(np.flatnonzero(parents_N == p), key=lambda k: order_N[k])
        if kids:
            next_token[p] = kids[0]
            next_sibling[kids[:-1]] = kids[1:]
    return next_token, next_sibling


def random_encoding(rng, n, vocab, deep):
    """One request: (tokens, next_token, next_sibling, parents, ranks) with a random tree on a random
    subset of the ids, sibling lists in random order and acyclic junk links out of unreached ids."""
    size = int(rng.integers(1, n + 1))
    ids = np.concatenate([[0], rng.permutation(np.arange(1, n))[: size - 1]]).astype(np.int32)
    parents = np.full(n, -1, np.int32)
    for j in range(1, size):  # attach to an earlier id; `deep` favours the most recent ones
        lo = max(0, j - 2) if deep and rng.random() < 0.7 else 0
        parents[ids[j]] = ids[rng.integers(lo, j)]
    next_token, next_sibling = link_lists(parents, rng.permutation(n))
    ranks = np.zeros(n, np.int32)
    tokens = rng.integers(0, vocab, n).astype(np.int32)
    for p in ids:
        kid, rank = next_token[p], 0
        kids = []
        while kid >= 0:
            ranks[kid], rank = rank, rank + 1
            kids.append(kid)
            kid = next_sibling[kid]
        tokens[kids] = rng.choice(vocab, len(kids), replace=False)
    unreached = rng.permutation(np.setdiff1d(np.arange(n), ids))
    for i, u in enumerate(unreached):  # links only into the tree or to later unreached ids: no cycle
        targets = np.concatenate([ids, unreached[i + 1:]])
        for links in (next_token, next_sibling):
            if rng.random() < 0.5:
                links[u] = rng.choice(targets)
    return tokens, next_token, next_sibling, parents, ranks


def random_batch(seed, batch, n, vocab):
    rng = np.random.default_rng(seed)
    deep = bool(rng.random() < 0.5)
    parts = [random_encoding(rng, n, vocab, deep) for _ in range(batch)]
    tokens, next_token, next_sibling, parents, ranks = (np.stack(x) for x in zip(*parts, strict=True))
    # Target rows with exact zeros, and extra mass on each node's children so that walks go deep.
    probs = rng.dirichlet(np.ones(vocab), size=(batch, n))
    probs[rng.random((batch, n, vocab)) < 0.3] = 0.0
    for b in range(batch):
        for k in range(1, n):
            if parents[b, k] >= 0:
                probs[b, parents[b, k], tokens[b, k]] += rng.random() * 2.0 / n
    probs[..., 0] += 1e-3
    probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
    coins = 1.0 - rng.random((batch, n), dtype=np.float32)
    final_coins = 1.0 - rng.random(batch, dtype=np.float32)
    # Greedy targets: mostly the token of some child, so that greedy walks go deep too.
    argmax = rng.integers(0, vocab, (batch, n)).astype(np.int32)
    for b in range(batch):
        for k in range(1, n):
            if parents[b, k] >= 0 and rng.random() < 0.6:
                argmax[b, parents[b, k]] = tokens[b, k]
    return (tokens, next_token, next_sibling), parents, ranks, (coins, final_coins, probs), argmax


# (batch, N, V) with V >= N so that any sibling list gets distinct tokens.
SHAPES = [(1, 1, 2), (2, 5, 6), (3, 12, 13), (2, 30, 31)]
# max_depth: none, 2, or None for N: deeper than any path (a chain of N nodes has N - 1 drafts). The
# walk is unrolled over max_depth steps, so N costs less to compile than a fixed 29 for small trees.
cases = st.tuples(st.integers(0, 2**31 - 1), st.sampled_from(SHAPES), st.sampled_from([0, 2, None]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_samplers_match_oracle_on_random_encodings(case):
    seed, (batch, n, vocab), max_depth = case
    max_depth = n if max_depth is None else max_depth
    links, parents, ranks, (coins, final_coins, probs), argmax = random_batch(seed, batch, n, vocab)
    got_parents, got_ranks = parents_and_sibling_ranks(links[1], links[2])
    np.testing.assert_array_equal(np.asarray(got_parents), parents)
    np.testing.assert_array_equal(np.asarray(got_ranks), ranks)
    np.testing.assert_array_equal(np.asarray(parents_from_fcns(links[1], links[2])), parents)
    got = tree_rejection_sample(*links, coins, final_coins, probs, max_depth=max_depth)
    assert_same_result(got, oracle.tree_rejection_sample(*links, coins, final_coins, probs, max_depth=max_depth))
    got = tree_greedy_verify(*links, argmax, max_depth=max_depth)
    assert_same_result(got, oracle.tree_greedy_verify(*links, argmax, max_depth=max_depth))


def test_children_are_walked_in_sibling_list_order():
    """SGLang's request with root children listed 4 then 1: the coin interval of node 4 comes first."""
    candidates = np.array([[7, 8, 9, 10, 11, 12]])
    next_token = np.array([[4, 2, 3, -1, 5, -1]])
    next_sibling = np.array([[-1, -1, -1, -1, 1, -1]])
    probs = np.full((1, 6, 13), 0.0, np.float32)
    probs[0, :, 0] = 1.0
    probs[0, 0] = 0.0
    probs[0, 0, [11, 8]] = 0.5  # tokens of nodes 4 and 1
    for coin, node in ((0.4, 4), (0.6, 1)):
        coins = np.full((1, 6), coin, np.float32)
        for result in (tree_rejection_sample(candidates, next_token, next_sibling, coins, coins[:, 0], probs,
                                             max_depth=1),
                       oracle.tree_rejection_sample(candidates, next_token, next_sibling, coins, coins[:, 0], probs,
                                                    max_depth=1)):
            assert np.asarray(result.accept_index).tolist() == [[0, node]]


@pytest.mark.slow
def test_permuted_encoding_emits_the_target_law():
    """Sibling order moves the coin intervals around but not the law of the emitted tokens: the
    counts of a relabelled, reordered tree follow the oracle's exact law of the original tree, and
    reject the law of other target rows."""
    rng = np.random.default_rng(5)
    vocab, budget, max_depth, samples = 4, 7, 3, 20_000
    tree = oracle.build_tree(rng.normal(scale=1.5, size=(1, 3, vocab)), [vocab - 1], budget=budget)
    probs_NV = rng.dirichlet(np.ones(vocab), size=budget + 1)
    probs_NV[rng.random(probs_NV.shape) < 0.2] = 0.0
    probs_NV[:, 0] += 0.05
    probs_NV = (probs_NV / probs_NV.sum(-1, keepdims=True)).astype(np.float32)
    law = oracle.emitted_law(tree, probs_NV[None], max_depth)
    relabel = np.concatenate([[0], 1 + rng.permutation(budget)])  # old id -> new id
    parents = np.full(budget + 1, -1, np.int32)
    parents[relabel[1:]] = relabel[tree.parents[0, 1:]]
    next_token, next_sibling = link_lists(parents, rng.permutation(budget + 1))
    assert np.any(next_sibling[next_sibling >= 0] < np.flatnonzero(next_sibling >= 0))  # not in index order
    tokens = np.zeros(budget + 1, np.int32)
    tokens[relabel] = tree.tokens[0]
    probs = np.zeros_like(probs_NV)
    probs[relabel] = probs_NV
    key_coins, key_final = jax.random.split(jax.random.key(5))
    coins = 1.0 - np.asarray(jax.random.uniform(key_coins, (samples, budget + 1)))
    final_coins = 1.0 - np.asarray(jax.random.uniform(key_final, (samples,)))
    batch = lambda x: np.broadcast_to(x, (samples, *x.shape))  # noqa: E731
    result = tree_rejection_sample(batch(tokens), batch(next_token), batch(next_sibling), coins, final_coins,
                                   batch(probs), max_depth=max_depth)
    counts = {}
    for row in np.asarray(result.emitted):
        seq = tuple(int(t) for t in row if t >= 0)
        counts[seq] = counts.get(seq, 0) + 1
    assert len(law) >= 10 and set(counts) <= set(law)
    assert pvalue(counts, law) > 1e-3
    wrong_law = oracle.emitted_law(tree, probs_NV[None, ::-1], max_depth)
    assert pvalue({s: c for s, c in counts.items() if s in wrong_law}, wrong_law) < 1e-6


def pvalue(counts, law):
    """Pearson chi-square of the counts against the law, cells expected below 5 pooled."""
    total = sum(counts.values())
    big = [s for s, p in law.items() if p * total >= 5]
    observed = [counts.get(s, 0) for s in big]
    expected = [law[s] * total for s in big]
    pooled = total * (1.0 - sum(law[s] for s in big))
    if pooled > 1e-9 * total:
        observed.append(total - sum(observed))
        expected.append(pooled)
    return stats.chisquare(observed, np.array(expected) * total / sum(expected)).pvalue


# The SGLang tree (tests/test_sglang.py) as request 2 of 3, then broken.
GOOD = ([[1, 2, -1, 4, 5, -1]] * 2 + [[4, 2, 3, -1, 5, -1]], [[-1, 3, -1, -1, -1, -1]] * 2 + [[-1, -1, -1, -1, 1, -1]])
BROKEN = [
    # (link array, node, new value, message)
    (1, 1, 4, r"request 2 form a cycle through node [14]\b"),  # 4 -> 1 -> 4 among the root's children
    (1, 5, 0, r"request 2 form a cycle through node [045]\b"),  # back to the root
    (0, 3, 3, r"request 2 form a cycle through node 3\b"),  # a node its own first child
    (0, 2, 5, r"request 2 reach node 5 twice from node 0"),  # node 5: child of 4 and of 2
    (1, 5, 2, r"request 2 reach node 2 twice from node 0"),  # node 2: child of 1 and sibling of 5
    (0, 2, 6, r"next_token\[2, 2\] = 6 \(request 2, node 2\)"),
    (1, 5, -2, r"next_sibling\[2, 5\] = -2 \(request 2, node 5\)"),
]


@pytest.mark.parametrize("array, node, value, message", BROKEN)
def test_invalid_encodings_name_the_request_and_node(array, node, value, message):
    links = [np.array(x, np.int32) for x in GOOD]
    links[array][2, node] = value
    candidates = np.array([[0, 1, 2, 3, 4, 5]] * 3)
    ones = np.ones((3, 6), np.float32)
    probs = np.full((3, 6, 6), 1 / 6, np.float32)
    with pytest.raises(ValueError, match=message):
        tree_rejection_sample(candidates, *links, ones, ones[:, 0], probs, max_depth=3)
    with pytest.raises(ValueError, match=message):
        tree_greedy_verify(candidates, *links, candidates, max_depth=3)
    with pytest.raises(ValueError, match=message):
        oracle.tree_rejection_sample(candidates, *links, ones, ones[:, 0], probs, max_depth=3)
    with pytest.raises(ValueError, match=message):
        oracle.tree_greedy_verify(candidates, *links, candidates, max_depth=3)


def test_cycles_among_unreached_nodes_are_invalid_and_other_links_there_ignored():
    candidates = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])
    next_token = np.array([[1, -1, -1, -1, -1, -1, -1, 3]])  # 7 -> 3: out of the tree, ignored
    next_sibling = np.array([[-1, 2, -1, -1, -1, -1, 7, 2]])  # 6 -> 7 -> 2 likewise
    ones = np.ones((1, 8), np.float32)
    probs = np.full((1, 8, 8), 1 / 8, np.float32)
    np.testing.assert_array_equal(np.asarray(parents_from_fcns(next_token, next_sibling)),
                                  [[-1, 0, 0, -1, -1, -1, -1, -1]])
    result = tree_rejection_sample(candidates, next_token, next_sibling, ones * 0.2, ones[:, 0], probs, max_depth=2)
    assert_same_result(result, oracle.tree_rejection_sample(candidates, next_token, next_sibling, ones * 0.2,
                                                            ones[:, 0], probs, max_depth=2))
    next_sibling[0, 4], next_token[0, 5] = 5, 4  # 4 -> 5 -> 4, all unreached
    for sample in (tree_rejection_sample, oracle.tree_rejection_sample):
        with pytest.raises(ValueError, match=r"request 0 form a cycle through node [45]\b"):
            sample(candidates, next_token, next_sibling, ones, ones[:, 0], probs, max_depth=2)


def test_encodings_name_a_bad_tree_or_prefix():
    from ddtree_jax.tree import build_tree, compile_retrieve, tree_attention_mask, tree_positions

    tree = build_tree(np.zeros((2, 3, 5), np.float32), np.array([1, 2]), budget=4)
    for fn in (compile_retrieve, tree_attention_mask, lambda t: tree_positions(t, np.array([0, 0]))):
        with pytest.raises(ValueError, match=r"tree must be a DraftTree \(build_tree\), got str"):
            fn("tree")
    assert np.asarray(tree_positions(tree, [3, 4]))[:, 0].tolist() == [3, 4]
    for prefix, message in [([-1, 4], r"prefix_len must be >= 0, got \[-1\]"), ([3], "prefix_len has shape"),
                            ([3.0, 4.0], "prefix_len must have an integer dtype")]:
        with pytest.raises(ValueError, match=message):
            tree_positions(tree, prefix)
