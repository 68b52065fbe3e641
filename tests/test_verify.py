"""Verification and the target law against the NumPy oracle (same coins, exact tokens)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree_jax import oracle
from ddtree_jax.sampling import coins_from_keys, inverse_temperature, request_keys, target_probs
from ddtree_jax.tree import build_tree, compile_retrieve
from ddtree_jax.verify import (
    expected_acceptance,
    parents_from_fcns,
    tree_greedy_verify,
    tree_rejection_sample,
    verify,
    verify_from_coins,
)

FIELDS = ("accept_index", "num_accepted", "predicts", "emitted", "bonus")


def assert_same_result(got, want):
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), getattr(want, field), err_msg=field)


def random_case(seed, batch, depth, vocab, budget, cap, sharp):
    """A built tree plus target logits that agree with the draft often enough to accept deep paths."""
    rng = np.random.default_rng(seed)
    draft = rng.normal(size=(batch, depth, vocab)).astype(np.float32) * sharp
    tree = build_tree(draft, rng.integers(0, vocab, batch), budget=budget, topk_cap=cap)
    n = budget + 1
    # Target row after node k favours the draft's choice at depth(k) + 1, so walks go deep.
    nxt = np.minimum(np.asarray(tree.depths), depth - 1)
    logits = rng.normal(size=(batch, n, vocab)).astype(np.float32)
    logits += sharp * np.take_along_axis(draft, nxt[..., None].repeat(vocab, -1), axis=1)
    return tree, logits


def random_params(seed, batch):
    rng = np.random.default_rng(seed)
    temperature = rng.choice([0.0, 0.4, 1.0, 1.7], batch).astype(np.float32)
    top_k = rng.choice([0, 1, 2, 5], batch).astype(np.int32)
    top_p = rng.choice([1.0, 0.3, 0.8], batch).astype(np.float32)
    return temperature, top_k, top_p


# A few fixed shapes (each compiles once) with many data draws: (batch, depth, vocab, budget). The
# other tests use them too, so that their builds and programs are compiled already.
SHAPES = [(1, 1, 2, 1), (4, 3, 9, 8), (3, 8, 100, 64), (2, 5, 3000, 20)]
cases = st.tuples(
    st.integers(0, 2**31 - 1),
    st.sampled_from(SHAPES),
    st.sampled_from([None, 2]),  # cap
    st.sampled_from([0.5, 2.0, 5.0]),  # sharpness
).map(lambda c: (c[0], *c[1], c[2], c[3]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_verify_matches_oracle_for_mixed_batches(case):
    seed, batch, depth, vocab, budget, cap, sharp = case
    tree, logits = random_case(seed, batch, depth, vocab, budget, cap, sharp)
    t, k, p = random_params(seed, batch)
    keys = request_keys(jax.random.key(seed), jnp.arange(batch), 3)
    coins, final_coins = coins_from_keys(keys, budget + 1)
    got = verify(tree, logits, key=jax.random.key(seed), temperature=t, top_k=k, top_p=p, round_index=3)
    want = oracle.verify(
        tree, logits, coins=np.asarray(coins), final_coins=np.asarray(final_coins),
        temperature=t, top_k=k, top_p=p, max_depth=depth,
    )
    assert_same_result(got, want)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_rejection_sample_and_greedy_match_oracle(case):
    seed, batch, depth, vocab, budget, cap, sharp = case
    tree, logits = random_case(seed, batch, depth, vocab, budget, cap, sharp)
    rng = np.random.default_rng(seed)
    probs = oracle.target_probs(logits, rng.uniform(0.3, 2.0, batch), 0, 1.0)
    coins = 1.0 - rng.random((batch, budget + 1), dtype=np.float32)
    final_coins = 1.0 - rng.random(batch, dtype=np.float32)
    fcns = compile_retrieve(tree)
    args = (np.asarray(tree.tokens), np.asarray(fcns.next_token), np.asarray(fcns.next_sibling))
    for max_depth in (depth, max(depth - 2, 0)):
        got = tree_rejection_sample(*args, coins, final_coins, probs, max_depth=max_depth)
        assert_same_result(got, oracle.tree_rejection_sample(*args, coins, final_coins, probs, max_depth=max_depth))
        argmax = logits.argmax(-1)
        got = tree_greedy_verify(*args, argmax, max_depth=max_depth)
        assert_same_result(got, oracle.tree_greedy_verify(*args, argmax, max_depth=max_depth))


@settings(max_examples=20, deadline=None)
@given(cases)
def test_target_probs_and_expected_acceptance_match_oracle(case):
    seed, batch, depth, vocab, budget, cap, sharp = case
    tree, logits = random_case(seed, batch, depth, vocab, budget, cap, sharp)
    t, k, p = random_params(seed + 1, batch)
    probs = target_probs(logits, t, k, p)
    np.testing.assert_allclose(np.asarray(probs), oracle.target_probs(logits, t, k, p), atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(expected_acceptance(tree, probs)), oracle.expected_acceptance(tree, probs), rtol=1e-5, atol=1e-6
    )


def test_logits_are_scaled_by_the_reciprocal_temperature():
    """``z = logits * (1 / T)`` (1 for greedy rows): one rounding, so every program (the jnp path,
    each fused-sampler kernel, any vector width) gets the same z bit for bit."""
    t = np.array([0.0, 0.6, 1.7, 1.0], np.float32)
    np.testing.assert_array_equal(np.asarray(inverse_temperature(t)), np.float32(1) / np.where(t > 0, t, 1))
    x = np.float32(16.71761)  # x / 0.6 and x * (1 / 0.6) differ in the last bit
    assert x / np.float32(0.6) != x * (np.float32(1) / np.float32(0.6))
    for width in (1, 8, 64):  # scalar and vectorised CPU code: the same products
        row = jax.jit(lambda v: v * inverse_temperature(np.float32(0.6)))(np.full((width,), x))
        assert np.all(np.asarray(row) == x * (np.float32(1) / np.float32(0.6)))


def test_parents_from_fcns_inverts_compile_retrieve():
    tree, _ = random_case(0, 3, 8, 100, 64, 2, 1.0)
    fcns = compile_retrieve(tree)
    parents = parents_from_fcns(fcns.next_token, fcns.next_sibling)
    np.testing.assert_array_equal(np.asarray(parents), np.asarray(tree.parents))


def test_greedy_verify_walks_the_target_argmax():
    """At T = 0 the emitted tokens are exactly the argmax chain, as far as the tree holds it."""
    tree, logits = random_case(4, 3, 8, 100, 64, None, 5.0)
    res = verify(tree, logits, key=jax.random.key(0), temperature=0.0)
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    for b in range(3):
        node, expected = 0, []
        while True:
            want = int(logits[b, node].argmax())
            expected.append(want)
            kids = [j for j in range(1, tokens.shape[1]) if parents[b, j] == node and tokens[b, j] == want]
            if not kids or len(expected) > 8:
                break
            node = kids[0]
        assert np.asarray(res.emitted[b, : len(expected)]).tolist() == expected
        assert int(res.num_accepted[b]) == len(expected) - 1


def test_results_do_not_depend_on_the_batch():
    tree, logits = random_case(7, 3, 8, 100, 64, 2, 2.0)
    t, k, p = random_params(8, 3)
    whole = verify(tree, logits, key=jax.random.key(1), temperature=t, top_k=k, top_p=p, request_ids=np.arange(10, 13))
    for b in range(3):
        one = jax.tree_util.tree_map(lambda x, b=b: x[b : b + 1], tree)
        alone = verify(one, logits[b : b + 1], key=jax.random.key(1), temperature=t[b], top_k=k[b], top_p=p[b],
                       request_ids=np.array([10 + b]))
        np.testing.assert_array_equal(np.asarray(alone.emitted[0]), np.asarray(whole.emitted[b]))


def test_verify_from_coins_is_traceable_and_vmappable():
    tree, logits = random_case(3, 4, 3, 9, 8, None, 2.0)
    coins = jnp.full((4, 9), 0.5)
    args = (coins, jnp.full((4,), 0.5), jnp.ones(4), jnp.zeros(4, jnp.int32), jnp.ones(4))
    jitted = jax.jit(verify_from_coins)(tree, logits, *args)
    eager = verify_from_coins(tree, jnp.asarray(logits), *args)
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(jitted, field)), np.asarray(getattr(eager, field)))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
        (dict(temperature=1.0, top_k=1.5), "top_k"),
        (dict(temperature=np.ones(3)), "temperature"),
    ],
)
def test_bad_sampling_parameters_raise(kwargs, message):
    tree, logits = random_case(0, 4, 3, 9, 8, None, 1.0)
    with pytest.raises(ValueError, match=message):
        verify(tree, logits, key=jax.random.key(0), **kwargs)
    with pytest.raises(ValueError, match=message):
        target_probs(logits, **{"top_k": 0, "top_p": 1.0, **kwargs})


def test_bad_data_is_reported():
    tree, logits = random_case(0, 4, 3, 9, 8, None, 1.0)
    with pytest.raises(ValueError, match="non-finite"):
        nan_logits = np.where(np.arange(9) == 2, np.nan, logits).astype(np.float32)
        verify(tree, nan_logits, key=jax.random.key(0), temperature=1.0)
    with pytest.raises(ValueError, match="target_logits"):
        verify(tree, logits[:, :3], key=jax.random.key(0), temperature=1.0)
    with pytest.raises(ValueError, match=r"request_ids must be integers in \[0, 2147483648\), got \[-1\]"):
        verify(tree, logits, key=jax.random.key(0), temperature=1.0, request_ids=np.array([0, 1, 2, -1]))
    fcns = compile_retrieve(tree)
    cand = np.asarray(tree.tokens).copy()
    probs = oracle.target_probs(logits, 1.0, 0, 1.0)
    ones = np.ones(cand.shape, np.float32)
    kids = np.flatnonzero(np.asarray(tree.parents[0]) == 0)
    cand[0, kids[1]] = cand[0, kids[0]]
    with pytest.raises(ValueError, match="duplicate child tokens"):
        tree_rejection_sample(cand, fcns.next_token, fcns.next_sibling, ones, ones[:, 0], probs, max_depth=3)
    with pytest.raises(ValueError, match="token ids"):
        tree_rejection_sample(np.asarray(tree.tokens) + 5, fcns.next_token, fcns.next_sibling, ones, ones[:, 0],
                              probs, max_depth=3)
    with pytest.raises(ValueError, match="coins must lie in"):
        tree_rejection_sample(np.asarray(tree.tokens), fcns.next_token, fcns.next_sibling, ones * 0, ones[:, 0],
                              probs, max_depth=3)
    with pytest.raises(ValueError, match="next_sibling links"):
        bad = np.asarray(fcns.next_sibling).copy()
        bad[0, 2] = 1
        tree_greedy_verify(np.asarray(tree.tokens), fcns.next_token, bad, ones.astype(np.int32), max_depth=3)
    with pytest.raises(ValueError, match="every row of probs must be a distribution"):
        tree_rejection_sample(np.asarray(tree.tokens), fcns.next_token, fcns.next_sibling, ones, ones[:, 0],
                              probs * 0.5, max_depth=3)
    with pytest.raises(ValueError, match=r"target_argmax must be token ids >= 0, got \[-1, -1"):
        tree_greedy_verify(np.asarray(tree.tokens), fcns.next_token, fcns.next_sibling, -ones.astype(np.int32),
                           max_depth=3)


def test_verify_names_a_bad_tree_key_or_round():
    tree, logits = random_case(0, 2, 3, 9, 8, None, 1.0)
    for kwargs, message in [(dict(key=None), "key must be a jax.random key"), (dict(key=3), "key must be one jax"),
                            (dict(round_index=-1), "round_index must be an integer >= 0, got -1"),
                            (dict(round_index=1.5), "round_index must be an integer >= 0, got 1.5")]:
        with pytest.raises(ValueError, match=message):
            verify(tree, logits, **{"key": jax.random.key(0), **kwargs}, temperature=1.0)
    with pytest.raises(ValueError, match=r"tree must be a DraftTree \(build_tree\), got tuple"):
        verify(tuple(tree.tokens), logits, key=jax.random.key(0), temperature=1.0)


def test_low_level_samplers_take_nested_lists():
    tree, _ = random_case(1, 2, 3, 9, 8, None, 1.0)
    fcns = compile_retrieve(tree)
    argmax = np.asarray(tree.tokens)
    want = tree_greedy_verify(tree.tokens, fcns.next_token, fcns.next_sibling, argmax, max_depth=3)
    lists = [np.asarray(x).tolist() for x in (tree.tokens, fcns.next_token, fcns.next_sibling, argmax)]
    got = tree_greedy_verify(*lists, max_depth=3)
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)))
