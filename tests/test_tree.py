"""build_tree and the encodings against the NumPy oracle, plus structural properties."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ddtree_jax import oracle, selection, tree
from ddtree_jax.tree import (
    build_tree,
    compile_retrieve,
    draft_log_probs,
    tree_attention_mask,
    tree_positions,
)


def draft_logits(seed, batch, depth, vocab, ties):
    """Continuous random logits; with ``ties`` many exact duplicates inside each row.

    Exact duplicates exercise the tie rule; continuous values keep accidental near-ties (which the
    two implementations could round differently) improbable.
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, depth, vocab)).astype(np.float32) * rng.uniform(0.5, 4)
    if ties:
        pool = x[..., : max(1, vocab // 3)]
        x = np.take_along_axis(pool, rng.integers(0, pool.shape[-1], size=x.shape), axis=-1)
    return x


def assert_same_tree(got, want):
    for field in ("tokens", "parents", "depths", "num_nodes"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), getattr(want, field), err_msg=field)
    np.testing.assert_allclose(np.asarray(got.logw), want.logw, rtol=1e-6, atol=1e-5)


# (batch, depth L, vocab, budget, cap): a few builds, each compiled once, with many data draws. Among
# them one request and several; depth 1 and 16; the per-depth k = min(cap, budget, vocab) equal to the
# budget and below it (a padded first beam), 1 included (cap 1: a chain; budget 1); rank tuples in one
# int32 word and in several (k = 100 at depth 16: four; k = 8 at depth 9: two); fewer candidate paths
# than the budget (padding nodes: vocab 3 at depth 3, the chain of 7).
BUILDS = [(1, 1, 2, 1, None), (2, 16, 1000, 100, None), (3, 6, 17, 40, 4), (2, 3, 3, 40, None), (1, 7, 64, 16, 1),
          (2, 9, 64, 16, 8), (3, 5, 17, 1, None), (3, 4, 2, 3, 2)]
cases = st.tuples(st.integers(0, 2**31 - 1), st.sampled_from(BUILDS), st.booleans()).map(  # seed, build, ties
    lambda c: (c[0], *c[1], c[2]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases)
@example((1, 2, 15, 50_000, 1024, None, False))
@example((2, 1, 16, 3000, 1024, 8, True))
@example((3, 2, 5, 2, 1024, None, False))  # candidate space smaller than the budget: padding
def test_build_tree_matches_oracle(case):
    seed, batch, depth, vocab, budget, cap, ties = case
    logits = draft_logits(seed, batch, depth, vocab, ties)
    roots = np.arange(batch) % vocab
    got = build_tree(logits, roots, budget=budget, topk_cap=cap)
    assert_same_tree(got, oracle.build_tree(logits, roots, budget=budget, topk_cap=cap))
    retrieve = compile_retrieve(got)
    want = oracle.compile_retrieve(got)
    for field in ("index", "next_token", "next_sibling"):
        np.testing.assert_array_equal(np.asarray(getattr(retrieve, field)), getattr(want, field))
    np.testing.assert_array_equal(np.asarray(tree_attention_mask(got)), oracle.tree_attention_mask(got))
    prefix = np.arange(batch, dtype=np.int32) * 7 + 3
    np.testing.assert_array_equal(np.asarray(tree_positions(got, prefix)), oracle.tree_positions(got, prefix))


@pytest.mark.parametrize("budget, cap", [(8, None), (16, 4), (40, None)])
def test_depths_of_certain_tokens_match_oracle(budget, cap):
    """Depths where one token has probability 1 (its log-probability rounds to 0) make paths of different
    depths tie; children must still follow their parents. With the inexact ``log`` of the suite's XLA
    flags, an unclamped edge of +4.8e-7 put children first."""
    rng = np.random.default_rng(5)
    logits = rng.integers(-3, 3, (3, 6, 40)).astype(np.float32)
    logits[:, 1::2] = -50.0
    logits[:, 1::2, 7] = 50.0
    lp = np.asarray(draft_log_probs(jnp.asarray(logits), 0.7))
    assert lp.max() == 0.0 and np.all(lp[:, 1::2, 7] == 0.0)
    roots = np.array([1, 2, 3])
    got = build_tree(logits, roots, budget=budget, topk_cap=cap, draft_temperature=0.7)
    assert_same_tree(got, oracle.build_tree(logits, roots, budget=budget, topk_cap=cap, draft_temperature=0.7))
    parents = np.asarray(got.parents)
    assert np.all(parents < np.arange(parents.shape[1]))


@pytest.mark.parametrize("case", [(0, 2, 15, 50_000, 64, None, True), (1, 1, 15, 151_936, 16, None, False),
                                  (2, 3, 6, 3000, 40, 8, True), (3, 2, 4, 5, 30, None, False)])
def test_build_with_the_staged_top_k_matches_oracle(case, monkeypatch):
    """The build as a GPU runs it: the staged vocabulary top-k (on a CPU `selection.top_k` is
    ``lax.top_k``), heavy ties included."""
    monkeypatch.setattr(tree.selection, "top_k", functools.partial(selection.top_k, staged=True))
    jax.clear_caches()  # build_tree_unchecked is traced again with the staged top-k
    seed, batch, depth, vocab, budget, cap, ties = case
    logits = draft_logits(seed, batch, depth, vocab, ties)
    roots = np.arange(batch) % vocab
    assert_same_tree(build_tree(logits, roots, budget=budget, topk_cap=cap),
                     oracle.build_tree(logits, roots, budget=budget, topk_cap=cap))
    monkeypatch.undo()
    jax.clear_caches()


def test_a_single_request_counted_beyond_count_max_matches_oracle(monkeypatch):
    """A GPU counts one request's rankings up to `selection.SINGLE_COUNT_MAX` entries: at budget 512 the
    beam's 3,489 candidates a depth and the 7,680 of the global order, which are sorted elsewhere."""
    assert len(tree.beam_pairs(512, 512)[0]) > selection.COUNT_MAX and 15 * 512 <= selection.SINGLE_COUNT_MAX
    monkeypatch.setattr(tree.selection, "count_limit", lambda batch: selection.SINGLE_COUNT_MAX)
    jax.clear_caches()
    logits = draft_logits(4, 1, 15, 3000, True)
    assert_same_tree(build_tree(logits, np.array([7]), budget=512),
                     oracle.build_tree(logits, np.array([7]), budget=512))
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_draft_temperature_matches_oracle(temperature):
    logits = draft_logits(5, 3, 6, 17, False)  # a build of BUILDS: no new compile
    got = build_tree(logits, np.array([1, 2, 0]), budget=40, topk_cap=4, draft_temperature=temperature)
    want = oracle.build_tree(logits, np.array([1, 2, 0]), budget=40, topk_cap=4, draft_temperature=temperature)
    assert_same_tree(got, want)


def test_without_jit_matches_jit():
    logits = draft_logits(9, 2, 3, 11, True)
    roots = np.array([0, 4])
    with_jit = build_tree(logits, roots, budget=9, topk_cap=3)
    with jax.disable_jit():
        without = build_tree(logits, roots, budget=9, topk_cap=3)
        retrieve = compile_retrieve(without)
        mask = tree_attention_mask(without)
    assert_same_tree(without, oracle.build_tree(logits, roots, budget=9, topk_cap=3))
    assert_same_tree(with_jit, oracle.build_tree(logits, roots, budget=9, topk_cap=3))
    np.testing.assert_array_equal(np.asarray(retrieve.next_token), oracle.compile_retrieve(with_jit).next_token)
    np.testing.assert_array_equal(np.asarray(mask), oracle.tree_attention_mask(with_jit))


def test_vmap_over_batch_equals_per_request():
    logits = draft_logits(4, 3, 6, 17, False)  # a build of BUILDS
    roots = np.array([3, 1, 4])
    whole = build_tree(logits, roots, budget=40, topk_cap=4)
    for b in range(3):
        alone = build_tree(logits[b : b + 1], roots[b : b + 1], budget=40, topk_cap=4)
        np.testing.assert_array_equal(np.asarray(alone.tokens[0]), np.asarray(whole.tokens[b]))
        np.testing.assert_array_equal(np.asarray(alone.parents[0]), np.asarray(whole.parents[b]))


@pytest.mark.parametrize("budget,depth", [(1, 5), (4, 5), (9, 5), (20, 3)])
def test_topk_cap_one_is_a_chain_of_argmaxes(budget, depth):
    logits = draft_logits(1, 2, depth, 13, False)
    tree = build_tree(logits, np.array([0, 1]), budget=budget, topk_cap=1)
    drafts = min(budget, depth)
    np.testing.assert_array_equal(np.asarray(tree.num_nodes), [drafts + 1] * 2)
    np.testing.assert_array_equal(np.asarray(tree.parents[:, 1 : drafts + 1]), np.tile(np.arange(drafts), (2, 1)))
    np.testing.assert_array_equal(np.asarray(tree.tokens[:, 1 : drafts + 1]), logits.argmax(-1)[:, :drafts])


def path_tuple(tokens, parents, node):
    path = []
    while node > 0:
        path.append(int(tokens[node]))
        node = int(parents[node])
    return tuple(reversed(path))


@settings(max_examples=20, deadline=None)
@given(cases)
def test_structure_prefix_closed_parent_before_child_distinct_siblings(case):
    seed, batch, depth, vocab, budget, cap, ties = case
    tree = build_tree(draft_logits(seed, batch, depth, vocab, ties), np.zeros(batch, int), budget=budget, topk_cap=cap)
    for b in range(batch):
        n = int(tree.num_nodes[b])
        tokens, parents, depths, logw = (np.asarray(x[b]) for x in (tree.tokens, tree.parents, tree.depths, tree.logw))
        assert np.all(parents[1:n] < np.arange(1, n)) and np.all(parents[1:n] >= 0)
        assert np.all(depths[1:n] == depths[parents[1:n]] + 1)
        assert np.all(np.diff(logw[:n]) <= 0)
        paths = {path_tuple(tokens, parents, j) for j in range(1, n)}
        assert len(paths) == n - 1  # distinct paths <=> distinct siblings
        assert all(p[:-1] in paths or len(p) == 1 for p in paths)  # prefix-closed
        assert np.all(parents[n:] == -1) and np.all(np.isneginf(logw[n:]))


def best_tree_mass(lp, budget, k):
    """Brute force: the largest total path probability of any prefix-closed tree of ``budget`` nodes."""
    depth, vocab = lp.shape
    ranked = [np.argsort(-lp[d], kind="stable")[:k] for d in range(depth)]
    prefixes = [p for d in range(1, depth + 1) for p in itertools.product(*ranked[:d])]
    mass = {p: float(np.exp(sum(lp[i, t] for i, t in enumerate(p)))) for p in prefixes}
    best = 0.0
    for subset in itertools.combinations(prefixes, min(budget, len(prefixes))):
        chosen = set(subset)
        if all(len(p) == 1 or p[:-1] in chosen for p in subset):
            best = max(best, sum(mass[p] for p in subset))
    return best


@pytest.mark.parametrize("seed,vocab,depth,budget,cap", [
    (0, 2, 3, 4, None), (1, 3, 2, 5, None), (2, 3, 3, 6, 2), (3, 4, 2, 7, 3), (4, 2, 4, 6, None),
])
def test_tree_mass_is_maximal_among_all_trees(seed, vocab, depth, budget, cap):
    logits = draft_logits(seed, 1, depth, vocab, False)
    tree = build_tree(logits, np.zeros(1, int), budget=budget, topk_cap=cap)
    n = int(tree.num_nodes[0])
    got = float(np.sum(np.exp(np.asarray(tree.logw[0, 1:n], np.float64))))
    lp = np.asarray(draft_log_probs(jnp.asarray(logits[0]), 1.0), np.float64)
    k = min(budget, vocab) if cap is None else min(cap, budget, vocab)
    assert got == pytest.approx(best_tree_mass(lp, budget, k), rel=1e-5)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(budget=0), "budget"),
        (dict(budget=2.5), "budget"),
        (dict(budget=4, topk_cap=0), "topk_cap"),
        (dict(budget=4, draft_temperature=0.0), "draft_temperature"),
        (dict(budget=4, draft_temperature=-1.0), "draft_temperature"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_tree(np.zeros((1, 2, 5), np.float32), np.zeros(1, np.int32), **kwargs)


def test_bad_arrays_raise_clear_errors():
    good = np.zeros((1, 2, 5), np.float32)
    with pytest.raises(ValueError, match="draft_logits must have rank 3"):
        build_tree(good[0], np.zeros(1, np.int32), budget=3)
    with pytest.raises(ValueError, match="floating"):
        build_tree(good.astype(np.int32), np.zeros(1, np.int32), budget=3)
    with pytest.raises(ValueError, match="root_tokens"):
        build_tree(good, np.zeros(2, np.int32), budget=3)
    with pytest.raises(ValueError, match=r"root_tokens must hold token ids in \[0, 5\)"):
        build_tree(good, np.array([5]), budget=3)
    with pytest.raises(ValueError, match="non-finite"):
        build_tree(np.full((1, 2, 5), np.nan, np.float32), np.zeros(1, np.int32), budget=3)
