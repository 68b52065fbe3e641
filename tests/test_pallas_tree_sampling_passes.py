"""The statistics, rows and whole-GPU candidate passes of the fused sampler (interpret mode on CPU)
against NumPy: block maxima, argmaxes and masses; candidates above a floor; kept sets as the oracle's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ddtree_jax import oracle
from pallas_kernels.tree_sampling.common import FEW_SLOTS, Request, order_key
from pallas_kernels.tree_sampling.fallback import searched_rows
from pallas_kernels.tree_sampling.reference import inverse_temperature
from pallas_kernels.tree_sampling.rows import rows
from pallas_kernels.tree_sampling.stats import block_stats


def params(*requests):
    """(temperature, top_k, top_p) per request -> three [batch] arrays."""
    t, k, p = zip(*requests)
    return jnp.array(t, jnp.float32), jnp.array(k, jnp.int32), jnp.array(p, jnp.float32)


@functools.partial(jax.jit, static_argnames=("block", "blocks"))
def row_passes(logits, *, block, blocks):
    """One program (compiled once per shape, whatever the logits) for a greedy and a T 0.7
    request: the statistics pass (``blocks`` blocks a program) and the rows pass without candidates."""
    temperature = jnp.asarray([0.0, 0.7], jnp.float32)
    scale = inverse_temperature(temperature)  # greedy rows: 1
    stats = block_stats(logits, scale, 4, block, 4, True, blocks)
    request = Request(temperature, scale, jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.float32))
    return scale, stats, rows(logits, request, stats, draw_block=block, block_c=block, capacity=16, candidates=False,
                              num_warps=4, interpret=True)


# Each example checks both logit grids (continuous and integer ties) with one compiled program.
@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), vocab=st.integers(1, 300), block=st.sampled_from([16, 64, 512]),
       dtype=st.sampled_from(["float32", "bfloat16"]), blocks=st.sampled_from([1, 3]))
def test_row_statistics_match_numpy(seed, vocab, block, dtype, blocks):
    """The statistics pass (a program per row and ``blocks`` blocks) and the rows' combination of
    its blocks (``rows``) against NumPy on the processed rows: maxima and first argmaxes exact,
    masses to float32 rounding."""
    logits = 3.0 * np.random.default_rng(seed).standard_normal((2, 3, vocab))
    for tie_step in (None, 1.0):
        assert_row_statistics(np.round(logits / tie_step) * tie_step if tie_step else logits, block, dtype, blocks)


def assert_row_statistics(logits, block, dtype, blocks):
    """``test_row_statistics_match_numpy``'s checks on ``logits`` (``[2, 3, vocab]``)."""
    vocab = logits.shape[2]
    logits = jnp.asarray(logits, dtype)
    scale, stats, (row_stats, search, cands) = row_passes(logits, block=block, blocks=blocks)
    block_max, block_argmax, block_mass, sub_max = (np.asarray(x)[:, :3] for x in stats)
    z = np.asarray(logits, np.float32) * np.asarray(scale)[:, None, None]
    num_blocks = -(-vocab // block)
    assert block_max.shape[2] >= num_blocks and block_max.shape[2] & (block_max.shape[2] - 1) == 0
    blocks_z = np.pad(z, ((0, 0), (0, 0), (0, num_blocks * block - vocab)), constant_values=-np.inf).reshape(
        2, 3, num_blocks, block)
    np.testing.assert_array_equal(block_max[..., :num_blocks], blocks_z.max(-1))
    np.testing.assert_array_equal(block_argmax[..., :num_blocks], blocks_z.argmax(-1) + block * np.arange(num_blocks))
    np.testing.assert_allclose(block_mass[..., :num_blocks],
                               np.exp(blocks_z - blocks_z.max(-1, keepdims=True)).sum(-1), rtol=1e-5)
    sub = min(64, block)
    num_subs = -(-vocab // sub)
    padded = np.pad(z, ((0, 0), (0, 0), (0, num_subs * sub - vocab)), constant_values=-np.inf)
    np.testing.assert_array_equal(sub_max[..., :num_subs], padded.reshape(2, 3, num_subs, sub).max(-1))
    np.testing.assert_array_equal(sub_max[..., num_subs:], -np.inf)
    m, argmax, total, num, _, _, kept = (np.asarray(x)[:, :3] for x in row_stats)
    assert cands == () and not np.any(search)
    np.testing.assert_array_equal(m, z.max(-1))
    np.testing.assert_array_equal(argmax, z.argmax(-1))
    np.testing.assert_allclose(total, np.exp(z - z.max(-1, keepdims=True)).sum(-1), rtol=1e-5)
    np.testing.assert_array_equal(num, -1)
    np.testing.assert_array_equal(kept, total)


CANDIDATE_ROWS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (1.0, 3, 1.0), (0.7, 40, 1.0), (1.0, 0, 0.3), (1.3, 0, 0.9),
                  (0.5, 20, 0.8), (2.0, 1000, 1.0), (1.0, 0, 0.999), (1.0, 300, 0.95)]


def assert_candidates(num, cand_z, cand_id, z, capacity):
    """Per truncated row of ``CANDIDATE_ROWS`` with candidates (``num >= 0``): in id order, all the
    tokens above a floor, at most ``capacity``, holding the kept set (top-k: at least k tokens;
    top-p: at least ``top_p`` of the mass); untruncated rows have none. Returns the truncated rows."""
    vocab = z.shape[1]
    truncated = []
    for r, (temperature, top_k, top_p) in enumerate(CANDIDATE_ROWS):
        if not (temperature > 0 and (0 < top_k < vocab or top_p < 1)):
            assert num[r] == -1, r
            continue
        truncated.append(r)
        if num[r] < 0:
            continue
        ids = cand_id[r, :num[r]]
        assert 1 <= num[r] <= capacity
        np.testing.assert_array_equal(ids, np.flatnonzero(z[r] >= z[r, ids].min()), err_msg=str(r))
        np.testing.assert_array_equal(cand_z[r, :num[r]], z[r, ids])
        e = np.exp(z[r].astype(np.float64) - z[r].max())
        if 0 < top_k < vocab:
            assert num[r] >= top_k, r
        else:
            assert e[ids].sum() >= top_p * e.sum() * 1.00005, r
    return truncated


@functools.partial(jax.jit, static_argnames=("block", "capacity"))
def candidate_passes(logits_B1V, *, block, capacity):
    """One program (compiled once per shape, whatever the logits) for ``CANDIDATE_ROWS``: the
    statistics, the rows pass with candidates (``fast``) and the whole-GPU floor search after it
    (``searched``; rows not marked by the rows pass keep their values)."""
    t, k, p = params(*CANDIDATE_ROWS)
    scale = inverse_temperature(t)
    request = Request(t, scale, k, p)
    stats = block_stats(logits_B1V, scale, 2, block, 4, True)
    fast = rows(logits_B1V, request, stats, draw_block=block, block_c=block, capacity=capacity, candidates=True,
                num_warps=4, interpret=True)
    return fast, searched_rows(logits_B1V, request, *fast, block_c=block, capacity=capacity, num_warps=4,
                               interpret=True)


def assert_passes(logits, block, capacity, tie_step):
    """``test_candidates_of_truncated_rows_match_numpy``'s checks on ``logits`` (``[rows, vocab]``),
    rounded to multiples of ``tie_step`` if given."""
    vocab = logits.shape[1]
    logits = np.round(logits / tie_step) * tie_step if tie_step else logits
    t, k, p = params(*CANDIDATE_ROWS)
    z = logits * np.asarray(inverse_temperature(t))[:, None]
    fast, searched = candidate_passes(jnp.asarray(logits)[:, None], block=block, capacity=capacity)
    columns = lambda row_stats, cands: (*(np.asarray(x)[:, 0] for x in row_stats[3:]),  # noqa: E731
                                        *(np.asarray(x)[:, 0] for x in cands))
    fast_num, *_, fast_z, fast_id = columns(fast[0], fast[2])
    truncated = assert_candidates(fast_num, fast_z, fast_id, z, capacity)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(fast[1])[:, 0]),
                                  [r for r in truncated if fast_num[r] < 0])
    sub = min(64, block)  # the statistics' sub-block size
    if vocab > 2 * sub and capacity >= 3 * sub and not tie_step:
        assert fast_num[2] >= 0  # top-k 3: three sub-blocks hold every candidate
    num, w, c, kept, cand_z, cand_id = columns(*searched)
    np.testing.assert_array_equal(num[fast_num >= 0], fast_num[fast_num >= 0])
    truncated = assert_candidates(num, cand_z, cand_id, z, capacity)
    if vocab > 3 and not tie_step:
        assert num[2] >= 0
    if vocab == 700 and capacity > FEW_SLOTS:
        assert num[-1] > FEW_SLOTS  # top-k 300: searched
    key = np.asarray(order_key(jnp.asarray(z)))
    oracle_probs = oracle.target_probs(logits[:, None], t, k, p)[:, 0]
    for r in truncated:
        if num[r] < 0:
            continue
        e = np.exp(z[r].astype(np.float64) - z[r].max())
        kept_set = (key[r] > w[r]) | ((key[r] == w[r]) & (np.arange(vocab) < c[r]))
        np.testing.assert_array_equal(kept_set, oracle_probs[r] > 0, err_msg=str(r))
        np.testing.assert_allclose(float(kept[r]), e[kept_set].sum(), rtol=1e-5)


# Each example checks both logit grids (continuous and integer ties) with one compiled program.
@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), vocab=st.integers(1, 700), block=st.sampled_from([16, 64, 256]),
       capacity=st.sampled_from([16, 64, 1024]))
@example(seed=0, vocab=700, block=256, capacity=1024)  # kept sets ranked and searched
@example(seed=1, vocab=700, block=64, capacity=1024)
def test_candidates_of_truncated_rows_match_numpy(seed, vocab, block, capacity):
    """The candidates of the truncated rows (``assert_candidates``), first from the sub-block maxima
    alone, then with the floor search for the rows those leave without. Small top-k always finds
    candidates from the maxima. The boundary found from them (ranked when they fit
    ``FEW_SLOTS``, else searched) keeps exactly the oracle's kept set, and its mass."""
    logits = 3.0 * np.random.default_rng(seed).standard_normal((len(CANDIDATE_ROWS), vocab)).astype(np.float32)
    for tie_step in (None, 1.0):
        assert_passes(logits, block, capacity, tie_step)
