"""Budget policies: the selection rules against the NumPy oracle, prefix closure, the packed layout,
and the cost tables."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ddtree_jax import budget, costs, oracle
from ddtree_jax.tree import build_tree, tree_attention_mask, tree_positions
from test_tree import assert_same_tree, draft_logits

# (batch, depth L, vocab, budget, cap): a few trees, each compiled once (at the budget and at
# BATCH_SPREAD x it), with many data draws. Among them one request and four; depth 1 and 5; budget 1
# and 20; a cap; trees with fewer nodes than slots (vocab 2); a per-depth k that grows with the budget
# (vocab 40) and one that does not (vocab 3, cap 2).
TREES = [(4, 5, 3, 8, None), (3, 4, 40, 20, None), (1, 3, 7, 3, 2), (2, 1, 2, 1, None), (4, 2, 2, 20, 2),
         (2, 5, 40, 1, None)]
cases = st.tuples(st.integers(0, 2**31 - 1), st.sampled_from(TREES), st.booleans()).map(  # seed, tree, ties
    lambda c: (c[0], *c[1], c[2]))

# Jitted, as the engine runs them: one compile per tree shape (run eagerly, every op compiles on its own).
adaptive_keep = jax.jit(budget.adaptive_keep)
batch_keep = jax.jit(budget.batch_keep, static_argnums=3)
keep_prefix = jax.jit(budget.keep_prefix)


def trees(case, slots_factor=1):
    seed, batch, depth, vocab, b, cap, ties = case
    logits = draft_logits(seed, batch, depth, vocab, ties)
    tree = build_tree(logits, np.arange(batch) % vocab, budget=b * slots_factor, topk_cap=cap)
    return tree, np.random.default_rng(seed)


def kept_is_a_tree(tree):
    """Every kept node's parent is kept and precedes it; everything past ``num_nodes`` is padding."""
    parents, num_nodes = np.asarray(tree.parents), np.asarray(tree.num_nodes)
    for b in range(parents.shape[0]):
        n = int(num_nodes[b])
        assert np.all((parents[b, 1:n] >= 0) & (parents[b, 1:n] < np.arange(1, n)))
        assert np.all(parents[b, n:] == -1) and np.all(np.isneginf(np.asarray(tree.logw)[b, n:]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases, st.sampled_from(["flat", "rising", "random"]))
@example((0, 3, 4, 40, 20, None, False), "rising")
def test_adaptive_keep_matches_oracle(case, shape):
    tree, rng = trees(case)
    n = tree.tokens.shape[1]
    cost = {"flat": np.full(n, 3.0), "rising": 1.0 + rng.uniform(0.005, 0.3) * np.arange(n),
            "random": rng.uniform(0.5, 2.0, n)}[shape].astype(np.float32)
    got = np.asarray(adaptive_keep(tree.logw, tree.num_nodes, jnp.asarray(cost)))
    np.testing.assert_array_equal(got, oracle.adaptive_keep(tree.logw, tree.num_nodes, cost))
    if shape == "flat":  # a flat cost keeps the whole tree: adaptive = fixed
        np.testing.assert_array_equal(got, np.asarray(tree.num_nodes))
    masked = keep_prefix(tree, jnp.asarray(got))
    assert_same_tree(masked, oracle.keep_prefix(tree, got))
    kept_is_a_tree(masked)


def top_set(logw, num_nodes, live, b):
    """The chosen (request, node) pairs of the batch rule as a set, without assuming they are prefixes."""
    pairs = sorted((-float(logw[r, k]), k, r) for r in range(len(live)) if live[r] for k in range(1, num_nodes[r]))
    return {(r, k) for _, k, r in pairs[: b * int(np.sum(live))]}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases, st.integers(0, 2**5 - 1))
@example((2, 4, 5, 3, 8, None, True), 0b1011)  # ties across requests, one finished request
def test_batch_keep_matches_oracle_and_keeps_prefix_closed_trees(case, live_bits):
    tree, _ = trees(case, budget.BATCH_SPREAD)
    batch, b = tree.tokens.shape[0], case[4]
    live = np.array([(live_bits >> i) & 1 for i in range(batch)], bool)
    got = np.asarray(batch_keep(tree.logw, tree.num_nodes, jnp.asarray(live), b))
    np.testing.assert_array_equal(got, oracle.batch_keep(tree.logw, tree.num_nodes, live, b))
    # The top set is, request by request, a prefix of the pop order (so the counts say it all) ...
    chosen = top_set(np.asarray(tree.logw), np.asarray(tree.num_nodes), live, b)
    assert chosen == {(r, k) for r in range(batch) for k in range(1, got[r])}
    assert np.all(got[~live] == 1) and got.sum() - batch <= b * live.sum()
    # The shared total holds at least the draft mass of `b` drafts per live request (the fixed policy).
    mass = lambda keep: sum(np.exp(np.float64(tree.logw[r, 1:keep[r]])).sum() for r in range(batch) if live[r])  # noqa: E731
    assert mass(got) >= mass(np.full(batch, b + 1)) * (1 - 1e-6)
    # ... and a prefix of the pop order is a tree: every kept node's parent is kept.
    masked = keep_prefix(tree, jnp.asarray(got))
    assert_same_tree(masked, oracle.keep_prefix(tree, got))
    kept_is_a_tree(masked)
    np.testing.assert_array_equal(np.asarray(tree_attention_mask(masked)), oracle.tree_attention_mask(masked))
    prefix = np.arange(batch, dtype=np.int32) * 5
    np.testing.assert_array_equal(np.asarray(tree_positions(masked, prefix)), oracle.tree_positions(masked, prefix))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_the_budget_prefix_of_a_larger_tree_is_the_budget_tree(case):
    """A single request under "batch" keeps the first B nodes of its BATCH_SPREAD x B tree: exactly
    the budget-B tree, per-depth cap included (so "batch" at batch 1 is "fixed")."""
    seed, batch, depth, vocab, b, cap, ties = case
    logits = draft_logits(seed, batch, depth, vocab, ties)
    roots = np.arange(batch) % vocab
    small = build_tree(logits, roots, budget=b, topk_cap=cap)
    large = build_tree(logits, roots, budget=b * budget.BATCH_SPREAD, topk_cap=cap)
    kept = keep_prefix(large, jnp.full((batch,), b + 1, jnp.int32))
    for field in ("tokens", "parents", "depths", "logw"):
        np.testing.assert_array_equal(np.asarray(getattr(kept, field))[:, : b + 1], np.asarray(getattr(small, field)))
    np.testing.assert_array_equal(np.asarray(kept.num_nodes), np.asarray(small.num_nodes))
    assert np.all(np.asarray(kept.parents)[:, b + 1:] == -1)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(0, 5))
def test_packing_lists_each_kept_node_once_request_after_request(kept, spare):
    slots, batch = 9, len(kept)
    rows = sum(kept) + spare
    row_M, slot_M, packed_BN = (np.asarray(x) for x in budget.packing(jnp.asarray(kept, jnp.int32), slots, rows))
    want = [(b, k) for b in range(batch) for k in range(kept[b])]
    assert list(zip(row_M[: len(want)].tolist(), slot_M[: len(want)].tolist())) == want
    assert np.all(row_M[len(want):] == batch) and np.all(slot_M[len(want):] == 0)
    for b in range(batch):
        np.testing.assert_array_equal(packed_BN[b, : kept[b]], [want.index((b, k)) for k in range(kept[b])])
        assert np.all(packed_BN[b, kept[b]:] == -1)


def test_policy_names_are_checked():
    assert budget.check_policy("batch") == "batch"
    with pytest.raises(ValueError, match="budget_policy must be one of"):
        budget.check_policy("global")


# ----------------------------------------------------------------------------- cost tables


def test_curve_interpolates_holds_and_extrapolates():
    curve = costs.CostCurve(batch=1, context=1024, nodes=(16, 64, 256), round_ms=(10.0, 12.0, 20.0))
    np.testing.assert_allclose(curve.at([0, 16, 40, 64, 160, 256, 512]), [10, 10, 11, 12, 16, 20, 20 + 8 * 256 / 192])
    assert float(costs.CostCurve(1, 1, (8,), (5.0,)).at(100)) == 5.0


def test_table_picks_the_nearest_batch_then_context():
    points = ((1, 1024), (1, 8192), (8, 1024))
    curves = tuple(costs.CostCurve(b, c, (16,), (float(b * 100_000 + c),)) for b, c in points)
    table = costs.CostTable("dev", curves)
    picked = [table.curve(b, c).round_ms[0] for b, c in ((1, 100), (1, 5000), (2, 8192), (3, 8192), (64, 10))]
    assert picked == [101_024, 108_192, 108_192, 801_024, 801_024]  # log scale: 3 is nearer 8 than 1
    assert table.round_costs(1, 1024, 3) == (101_024.0,) * 4
    assert costs.FLAT.flat and costs.FLAT.round_costs(8, 1024, 2) == (1.0, 1.0, 1.0)


def test_shipped_h200_table_holds_the_cited_measurements():
    table = costs.load("nvidia-h200")
    assert table.device == "NVIDIA H200" and costs.for_device("NVIDIA H200") == table
    one, eight = table.curve(1, 1024), table.curve(8, 1024)
    # batch 1, 1k: the ddtree bench rounds of 2026-12-01 (BENCHMARKS.md, the round-cost table)
    assert one.decode_ms == 6.40 and one.nodes == (4, 16, 64, 256)
    assert one.round_ms == (7.23, 8.03, 10.03, 13.76)
    assert float(table.curve(1, 8192).at(16)) == 9.16  # 2026-12-01, B = 16 cap 4 at 8k
    # batch 8, 1k: the ddtree bench rounds of 2026-12-01 to B = 64, the 2026-11-29 rows scaled beyond
    assert eight.decode_ms == 6.07 and eight.nodes == (4, 16, 64, 256, 512)
    assert eight.round_ms[:3] == (8.83, 10.64, 21.14)
    assert eight.round_ms[3:] == tuple(round(ms * 21.14 / 26.76, 2) for ms in (72.30, 132.48))
    assert costs.for_device("cpu") is costs.FLAT


def test_table_round_trips_through_json(tmp_path):
    table = costs.load("nvidia-h200")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table.to_json()))
    assert costs.load(path) == table


@pytest.mark.parametrize("data,message", [
    ({"device": "x"}, "'curves' list"),
    ({"curves": [{"batch": 1, "context": 8, "nodes": [4]}]}, r"curves\[0\] must have batch, context, nodes"),
    ({"curves": [{"batch": 1, "context": 8, "nodes": [4, 2], "round_ms": [1, 2]}]}, "strictly increasing"),
    ({"curves": [{"batch": 1, "context": 8, "nodes": [4], "round_ms": [1, 2]}]}, "one length"),
    ({"curves": [{"batch": 0, "context": 8, "nodes": [4], "round_ms": [1]}]}, "batch must be an integer >= 1"),
    ({"curves": [{"batch": 1, "context": 8, "nodes": [4], "round_ms": [-1]}]}, "finite and > 0"),
])
def test_bad_tables_are_named(tmp_path, data, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        costs.load(path)


def test_missing_or_broken_table_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="neither a file nor a shipped table"):
        costs.load(tmp_path / "none.json")
    (tmp_path / "cut.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        costs.load(tmp_path / "cut.json")
    with pytest.raises(ValueError, match="cost_table must be"):
        costs.resolve(3)
