"""The split-merge kernel vs ``merge_normalized_splits`` and a NumPy oracle (Pallas interpreter on CPU), its
Triton lowering, and the tree-attention kernel merging its splits with it."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.configs import TreeAttentionConfig
from pallas_kernels.lowering import verified_triton_modules
from pallas_kernels.split_k import merge_normalized_splits
from pallas_kernels.split_merge import _merge, merge_block_rows, merge_splits_kernel
from pallas_kernels.tree_attention import _plan, tree_attention
from pallas_kernels.tree_attention_reference import tree_attention_reference

DTYPES = {"bfloat16": (jnp.bfloat16, ml_dtypes.bfloat16), "float32": (jnp.float32, np.float32)}


def numpy_merge(o, m, l_):
    """The merge in float64: split j of row r weighted by ``exp(m_j - max_j m) * l_j``, the weights' sum the
    divisor (1 where every split is empty)."""
    o, m, l_ = (np.asarray(a, np.float64) for a in (o, m, l_))
    w = np.exp(m - m.max(axis=1, keepdims=True)) * l_
    total = w.sum(axis=1)
    return (w[..., None] * o).sum(axis=1) / np.where(total > 0, total, 1.0)[..., None]


def operands(seed, batch, splits, rows, head_dim, dtype, empty):
    """Random split outputs, maxima and sums; the splits flagged in ``empty`` saw no key (``m`` = -1e30,
    ``l`` = 0, output 0), as the attention kernel leaves them."""
    keys = jax.random.split(jax.random.key(seed), 3)
    o = jax.random.normal(keys[0], (batch, splits, rows, head_dim)).astype(dtype)
    m = 4 * jax.random.normal(keys[1], (batch, splits, rows))
    l_ = jax.random.uniform(keys[2], (batch, splits, rows), minval=1.0, maxval=64.0)
    seen = jnp.asarray(~np.asarray(empty))[None, :, None]
    return jnp.where(seen[..., None], o, 0), jnp.where(seen, m, -1e30), jnp.where(seen, l_, 0.0)


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), splits=st.integers(1, 9), rows=st.sampled_from([1, 3, 8, 12, 32, 96]),
       log_dim=st.integers(3, 6), dtype=st.sampled_from(sorted(DTYPES)), block_rows=st.sampled_from([1, 4, 16]),
       data=st.data())
def test_interpret_equals_the_jnp_merge_and_numpy(batch, splits, rows, log_dim, dtype, block_rows, data):
    """Any split count (not only powers of two), empty splits among them (all of them too), rows that the
    block does not divide: the jnp merge's result in the output dtype, within one of its roundings, and
    the float64 oracle's."""
    jnp_dtype, np_dtype = DTYPES[dtype]
    empty = data.draw(st.lists(st.booleans(), min_size=splits, max_size=splits))
    args = operands(data.draw(st.integers(0, 2**16)), batch, splits, rows, 1 << log_dim, jnp_dtype, empty)
    got = merge_splits_kernel(*args, block_rows=block_rows, interpret=True)
    assert got.shape == (batch, rows, 1 << log_dim) and got.dtype == jnp_dtype
    ulp = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -21
    got = np.asarray(got, np.float64)
    for want in (np.asarray(merge_normalized_splits(*args).astype(jnp_dtype), np.float64),
                 numpy_merge(*args).astype(np_dtype).astype(np.float64)):
        np.testing.assert_allclose(got, want, rtol=ulp, atol=ulp)
    if all(empty):
        np.testing.assert_array_equal(got, 0.0)


def test_output_dtype_is_the_callers():
    args = operands(0, 1, 3, 16, 16, jnp.float32, [False, True, False])
    got = merge_splits_kernel(*args, out_dtype=jnp.bfloat16, interpret=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(merge_normalized_splits(*args).astype(jnp.bfloat16), np.float32))


def test_block_rows_divide_the_rows():
    assert [merge_block_rows(rows, 16) for rows in (32, 2080, 12, 7, 1, 48)] == [16, 16, 4, 1, 1, 16]
    assert merge_block_rows(64, 4) == 4


@pytest.mark.parametrize("args, kwargs, message", [
    (((1, 2, 4, 8), jnp.int32, (1, 2, 4), (1, 2, 4)), {}, "o_BJRD must be"),
    (((1, 2, 4, 12), jnp.float32, (1, 2, 4), (1, 2, 4)), {}, "o_BJRD must be"),
    (((2, 4, 8), jnp.float32, (2, 4), (2, 4)), {}, "o_BJRD must be"),
    (((1, 2, 4, 8), jnp.bfloat16, (1, 3, 4), (1, 2, 4)), {}, "m_BJR must be"),
    (((1, 2, 4, 8), jnp.bfloat16, (1, 2, 4), (1, 2, 5)), {}, "l_BJR must be"),
    (((1, 2, 4, 8), jnp.bfloat16, (1, 2, 4), (1, 2, 4)), {"block_rows": 6}, "block_rows must be"),
])
def test_bad_operands_are_named(args, kwargs, message):
    o_shape, o_dtype, m_shape, l_shape = args
    with pytest.raises(ValueError, match=message):
        merge_splits_kernel(jnp.zeros(o_shape, o_dtype), jnp.zeros(m_shape), jnp.zeros(l_shape), interpret=True,
                            **kwargs)


def test_stats_must_be_float32():
    with pytest.raises(ValueError, match="m_BJR must be float32"):
        merge_splits_kernel(jnp.zeros((1, 2, 4, 8)), jnp.zeros((1, 2, 4), jnp.bfloat16), jnp.zeros((1, 2, 4)),
                            interpret=True)


@pytest.mark.parametrize("splits", [5, 8])
def test_lowers_to_valid_triton_at_a_64_node_verify(splits):
    """Qwen3-8B's 32 query heads at 64 nodes: 2,048 packed rows of 128, 16 a program; five splits (the
    65-node plan's, not a power of two) and eight."""
    sds = jax.ShapeDtypeStruct
    fn = functools.partial(_merge, out_dtype=jnp.dtype(jnp.bfloat16), block_rows=16, num_warps=4, interpret=False)
    [module] = verified_triton_modules(fn, sds((1, splits, 2048, 128), jnp.bfloat16),
                                       sds((1, splits, 2048), jnp.float32), sds((1, splits, 2048), jnp.float32))
    assert "tensor<16x128xbf16>" in module


def test_tree_attention_merges_its_splits_with_the_kernel():
    """A tree-attention call cut into several splits gives the same result with the splits merged by the
    kernel as by the jnp merge (bf16 partials: within one rounding), and equals the reference."""
    config = TreeAttentionConfig(block_m=16, block_k=16, min_programs=64, min_chunk=16, split_by_length=True)
    merged = dataclasses.replace(config, merge_rows=4)
    rng = np.random.default_rng(0)
    batch, num_q, heads, kv_heads, head_dim, slots = 2, 5, 4, 2, 16, 90
    assert _plan(batch, kv_heads, num_q * heads // kv_heads, num_q, slots, config).num_splits > 1
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
               for s in [(batch, num_q, heads, head_dim)] + [(batch, kv_heads, slots, head_dim)] * 2)
    lengths = jnp.asarray([70, 9], jnp.int32)
    mask = jnp.asarray(np.tril(np.ones((num_q, num_q), bool)))[None].repeat(batch, 0)
    args = (q, k, v, lengths, mask)
    got = tree_attention(*args, scale=0.25, config=merged, interpret=True)
    plain = tree_attention(*args, scale=0.25, config=config, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(plain, np.float32), rtol=2 ** -7, atol=2 ** -7)
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(tree_attention_reference(*args, scale=0.25), np.float32), atol=3e-2)


def test_merge_rows_is_a_power_of_two_or_zero():
    assert TreeAttentionConfig(merge_rows=0).merge_rows == 0 and TreeAttentionConfig(merge_rows=1).merge_rows == 1
    for bad in (3, -16, 2.0, True):
        with pytest.raises(ValueError, match="merge_rows"):
            TreeAttentionConfig(merge_rows=bad)
