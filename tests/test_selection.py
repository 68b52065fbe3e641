"""The exact staged top-k and the counted ranks against ``lax.top_k``, ``lax.sort`` and NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ddtree_jax import oracle, selection
from ddtree_jax.tree import build_tree, draft_log_probs


def numpy_top_k(x_NV, k):
    """Reference: the first ``k`` of a stable sort by descending value (ties: lower index)."""
    ids = np.argsort(-x_NV, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x_NV, ids, axis=-1), ids


def tied_rows(seed, rows, vocab, levels, neg_inf_share):
    """Integer-valued rows from ``levels`` distinct values (heavy ties), some entries ``-inf``."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-levels // 2, levels - levels // 2, size=(rows, vocab)).astype(np.float32)
    x[rng.random(x.shape) < neg_inf_share] = -np.inf
    return x


# Jitted: one compile per shape (run eagerly, every op of the stages compiles on its own).
top_k = jax.jit(selection.top_k, static_argnums=1, static_argnames="staged")
lax_top_k = jax.jit(jax.lax.top_k, static_argnums=1)


def assert_top_k_exact(x, k, staged=True):
    """`selection.top_k` (by default its staged path, forced: on a CPU it runs ``lax.top_k``) equals
    NumPy's stable order and ``lax.top_k``."""
    want_values, want_ids = numpy_top_k(x, k)
    ref_values, ref_ids = lax_top_k(jnp.asarray(x), k)
    values, ids = top_k(jnp.asarray(x), k, staged=staged)
    assert ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_array_equal(np.asarray(values), want_values)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(ref_values))


# (V, k) for three rows, each shape one compile: the plans V <= 5000, k <= 80 have (`top_k_plan`), the
# whole row ranked at once (V <= COUNT_MAX, k = V among them) or one stage of groups, its last group
# short (2049, 4099) or not (5000).
TOP_K_SHAPES = [(2, 1), (2, 2), (17, 17), (300, 80), (2048, 64), (2049, 1), (4099, 16), (5000, 80)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.sampled_from(TOP_K_SHAPES), st.sampled_from([1, 2, 3, 8, 1000]),
       st.sampled_from([0.0, 0.3, 0.97]))
@example(0, (4099, 16), 2, 0.0)  # V not a multiple of the chunk, two values only
@example(1, (4099, 16), 1000, 0.999)  # nearly all -inf: the top k reaches the -inf entries
@example(2, (2048, 64), 1, 0.0)  # one value everywhere: the first k indices
def test_top_k_matches_lax_and_numpy_with_ties(seed, shape, levels, neg_inf_share):
    vocab, k = shape
    assert_top_k_exact(tied_rows(seed, 3, vocab, levels, neg_inf_share), k)


@pytest.mark.parametrize("vocab,k,rows,stages", [(4099, 16, 2, 1), (20_000, 300, 2, 2), (4096, 1, 2, 1),
                                                 (9000, 64, 2, 1), (151_936, 16, 15, 2), (30_000, 128, 30, 3),
                                                 (60_000, 1100, 2, None), (3000, 1500, 2, None)])
def test_staged_paths_are_exact(vocab, k, rows, stages):
    """Plans of one to three stages, and the route through ``lax.top_k`` where no plan is (groups,
    then a plain ``lax.top_k`` on the shorter row)."""
    plan = selection.top_k_plan(vocab, k, rows)
    assert (plan is None) if stages is None else (len(plan) == stages), plan
    for seed, levels in enumerate([2, 7, 10_000]):
        assert_top_k_exact(tied_rows(seed, rows, vocab, levels, 0.1), k)


def test_ties_across_group_boundaries_keep_lower_ids():
    """Every group holds the same maximum: only the first-index tie rule keeps the lowest ids."""
    vocab, k = 4099, 16
    chunk = selection.top_k_plan(vocab, k, 2)[0]
    x = np.zeros((2, vocab), np.float32)
    x[0, ::chunk] = 1.0  # the first entry of each group is its maximum, all equal
    x[1, 1::chunk] = 1.0  # the second one
    x[:, -1] = 1.0  # and one in the short last group
    values, ids = top_k(jnp.asarray(x), k, staged=True)
    np.testing.assert_array_equal(np.asarray(ids), np.arange(k) * chunk + np.arange(2)[:, None])
    np.testing.assert_array_equal(np.asarray(values), np.ones((2, k)))


@pytest.mark.parametrize("vocab", [100, 4096, 151_936])
@pytest.mark.parametrize("k", [1, 16, 64, 512, 2048])
@pytest.mark.parametrize("rows", [1, 15, 120])
def test_top_k_plan_rule(vocab, k, rows):
    """Every stage ranks at most COUNT_MAX groups, more than k, in power-of-two widths that divide
    the one before; the final ranking takes at most COUNT_MAX entries; None when no plan does (the row
    is longer than COUNT_MAX and even groups of two would leave more than COUNT_MAX entries) or the
    best costs more than the route through lax.top_k."""
    if k > vocab:
        return
    plan = selection.top_k_plan(vocab, k, rows)
    if vocab > selection.COUNT_MAX and 2 * k > selection.COUNT_MAX:
        assert plan is None
    if (vocab, k) == (151_936, 512):
        assert (plan is None) == (rows == 120)  # measured: 7 stages beat lax at 15 rows, not at 120
    if plan is None:
        return
    entries, widest = vocab, 2 * selection._MAX_CHUNK
    for chunk in plan:
        groups = -(-entries // chunk)
        assert chunk & (chunk - 1) == 0 and widest % chunk == 0 and chunk < widest
        assert k < groups <= selection.COUNT_MAX
        entries, widest = k * chunk, chunk
    assert entries <= selection.COUNT_MAX
    assert plan != () or vocab <= selection.COUNT_MAX
    if (vocab, k, rows) == (151_936, 16, 15):
        assert len(plan) <= 2  # one request's draft at budget 16: few launches


@pytest.mark.parametrize("vocab,k", [(2, 2), (3, 1), (17, 17), (64, 40)])
def test_top_k_small_rows_and_k_equal_vocab(vocab, k):
    assert_top_k_exact(tied_rows(vocab, 4, vocab, 3, 0.2), k)


@pytest.mark.parametrize("vocab,k", [(5, 2), (4099, 16)])
def test_top_k_default_path(vocab, k):
    """What the backend picks (``lax.top_k`` off a GPU, the stages on one)."""
    assert_top_k_exact(tied_rows(1, 2, vocab, 5, 0.1), k, staged=None)


@pytest.mark.parametrize("vocab,k,staged", [(40, 12, False), (40, 12, True), (4099, 16, True), (4099, 16, None),
                                            (3000, 1500, True)])
def test_top_k_ties_signed_zeros_by_index(vocab, k, staged):
    """``-0.0`` and ``0.0`` tie (the lower index first) on every path, the plain ``lax.top_k`` of a CPU
    (which ranks ``-0.0`` below ``0.0``) and the route through it included; values keep their sign."""
    x = np.full((2, vocab), -1.0, np.float32)
    x[:, ::2] = -0.0
    x[:, 1::4] = 0.0
    values, ids = top_k(jnp.asarray(x), k, staged=staged)
    want = np.lexsort((np.broadcast_to(np.arange(vocab), x.shape), -x), axis=-1)[:, :k]
    np.testing.assert_array_equal(np.asarray(ids), want)
    np.testing.assert_array_equal(np.signbit(np.asarray(values)), np.signbit(np.take_along_axis(x, want, -1)))


def test_top_k_rejects_bad_k():
    for staged in (True, None):
        with pytest.raises(ValueError, match="k must be in"):
            selection.top_k(jnp.zeros((2, 5)), 6, staged=staged)


def test_top_k_under_vmap_and_leading_axes():
    x = tied_rows(3, 2 * 3 * 5000, 1, 5, 0.0).reshape(2, 3, 5000)
    values, ids = jax.jit(jax.vmap(lambda r: selection.top_k(r, 20, staged=True)))(jnp.asarray(x))
    want_values, want_ids = numpy_top_k(x, 20)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_array_equal(np.asarray(values), want_values)


ascending_ranks = jax.jit(selection.ascending_ranks)
scatter_by_rank = jax.jit(selection.scatter_by_rank, static_argnums=2)


# Lengths both ways, counted (up to COUNT_MAX, which included) and sorted (COUNT_MAX + 1 and longer), and
# scatters of the first, about half and all ranks: each (length, keys, size) compiles once.
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1),
       st.sampled_from([1, 2, 37, selection.COUNT_MAX, selection.COUNT_MAX + 1, selection.COUNT_MAX + 400]),
       st.integers(1, 3), st.sampled_from([1, 3, 50]), st.sampled_from(["one", "half", "all"]))
def test_ascending_ranks_is_the_stable_lexicographic_sort(seed, n, num_keys, levels, scattered_share):
    rng = np.random.default_rng(seed)
    keys = [rng.integers(0, levels, n).astype(np.int32) for _ in range(num_keys - 1)]
    first = rng.integers(0, levels, n).astype(np.float32)
    first[rng.random(n) < 0.2] = -np.inf
    got = np.asarray(ascending_ranks(jnp.asarray(first), *map(jnp.asarray, keys)))
    order = np.lexsort([np.arange(n), *reversed(keys), first])  # last key is the primary one
    want = np.empty(n, np.int64)
    want[order] = np.arange(n)
    np.testing.assert_array_equal(got, want)
    sorted_by_lax = jax.lax.sort((jnp.asarray(first), *map(jnp.asarray, keys), jnp.arange(n)), num_keys=num_keys)
    np.testing.assert_array_equal(np.asarray(sorted_by_lax[-1]), order)
    size = {"one": 1, "half": -(-n // 2), "all": n}[scattered_share]
    values = rng.integers(0, 1000, (n, 2)).astype(np.int32)
    scattered = scatter_by_rank(jnp.asarray(got), jnp.asarray(values), size)
    np.testing.assert_array_equal(np.asarray(scattered), values[order[:size]])
    floats = np.where(values[:, 0] % 3 == 0, -np.inf, np.where(values[:, 0] % 3 == 1, -0.0, values[:, 0]))
    scattered = np.asarray(scatter_by_rank(jnp.asarray(got), jnp.asarray(floats, np.float32), size))
    np.testing.assert_array_equal(scattered, floats[order[:size]])
    np.testing.assert_array_equal(np.signbit(scattered), np.signbit(floats[order[:size]]))  # -0.0 stays


@pytest.mark.filterwarnings("ignore:overflow encountered in subtract")  # the oracle's z - max z: the point here
def test_extreme_logits_give_no_nan_and_the_oracle_tree():
    """Finite logits 6e38 apart underflow to ``-inf`` log-probabilities (ties at ``-inf``), never NaN."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 4, 3000)).astype(np.float32)
    logits[..., ::7] = -3e38
    logits[..., 5] = 3e38
    logits[1, 2] = np.float32(3e38)  # a whole row tied at the top
    lp = np.asarray(draft_log_probs(jnp.asarray(logits), 1.0))
    assert not np.isnan(lp).any() and np.isneginf(lp).any()
    for budget in (5, 40):
        got = build_tree(logits, np.array([0, 1]), budget=budget)
        want = oracle.build_tree(logits, np.array([0, 1]), budget=budget)
        for field in ("tokens", "parents", "depths", "num_nodes"):
            np.testing.assert_array_equal(np.asarray(getattr(got, field)), getattr(want, field), err_msg=field)
        np.testing.assert_allclose(np.asarray(got.logw), want.logw, rtol=1e-6, atol=1e-5)


def test_count_limit_raised_for_one_request_on_a_gpu(monkeypatch):
    assert selection.count_limit(1) == selection.COUNT_MAX  # this CPU
    monkeypatch.setattr(selection.jax, "default_backend", lambda: "gpu")
    assert selection.count_limit(1) == selection.SINGLE_COUNT_MAX > selection.COUNT_MAX
    assert selection.count_limit(2) == selection.count_limit(8) == selection.COUNT_MAX
