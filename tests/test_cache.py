"""KV cache: scratch writes, commit, capacity checks, and the masked GQA attention."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.models import KVCache, check_capacity, commit, init_cache
from pallas_kernels.kv_write_reference import write_scratch
from pallas_kernels.tree_attention_reference import tree_attention_reference as attention


def filled_cache(rng, lengths, max_len=10):
    shape = (2, len(lengths), 3, max_len, 4)
    k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
    return KVCache(k=k, v=v, lengths=jnp.asarray(lengths, jnp.int32))


def test_init_cache_is_zeros_and_validates():
    cache = init_cache(2, 3, 1, 8, 4, jnp.bfloat16)
    assert cache.k.shape == (2, 3, 1, 8, 4) and cache.k.dtype == jnp.bfloat16 and cache.max_len == 8
    assert not np.any(np.asarray(cache.k, np.float32)) and not np.any(np.asarray(cache.v, np.float32))
    np.testing.assert_array_equal(cache.lengths, [0, 0, 0])
    with pytest.raises(ValueError, match="max_len must be a positive int, got 0"):
        init_cache(2, 3, 1, 0, 4)


def test_commit_matches_numpy_and_jits_with_donation():
    rng = np.random.default_rng(0)
    cache = filled_cache(rng, [1, 4, 0])
    keep = np.array([[2, 0, 3], [1, -1, -1], [0, 1, 2]], np.int32)
    num_keep = np.array([3, 1, 0], np.int32)
    k_ref, v_ref = np.array(cache.k), np.array(cache.v)
    for b, length in enumerate(np.asarray(cache.lengths)):
        for a in range(num_keep[b]):
            k_ref[:, b, :, length + a] = np.asarray(cache.k)[:, b, :, length + keep[b, a]]
            v_ref[:, b, :, length + a] = np.asarray(cache.v)[:, b, :, length + keep[b, a]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "Some donation buffers were not usable"
        out = jax.jit(commit, donate_argnums=0)(cache, jnp.asarray(keep), jnp.asarray(num_keep))
    np.testing.assert_array_equal(out.lengths, [4, 5, 0])
    np.testing.assert_array_equal(out.k, k_ref)
    np.testing.assert_array_equal(out.v, v_ref)


def test_writes_past_max_len_are_dropped_not_wrapped():
    rng = np.random.default_rng(1)
    cache = filled_cache(rng, [7, 2], max_len=8)
    new = jnp.asarray(rng.normal(size=(2, 3, 3, 4)), jnp.float32)
    k = write_scratch(cache.k, 1, new, cache.lengths)
    np.testing.assert_array_equal(k[1, 0, :, 7], new[0, 0])
    np.testing.assert_array_equal(k[1, 0, :, :7], cache.k[1, 0, :, :7])  # nothing wrapped to the start
    np.testing.assert_array_equal(k[1, 1, :, 2:5], new[1].transpose(1, 0, 2))
    np.testing.assert_array_equal(k[0], cache.k[0])
    out = commit(cache, jnp.asarray([[0, 1, 2], [0, 1, 2]], jnp.int32), jnp.asarray([3, 3], jnp.int32))
    np.testing.assert_array_equal(out.lengths, [8, 5])
    np.testing.assert_array_equal(out.k[:, 0], cache.k[:, 0])


def test_check_capacity_names_request_length_and_max_len():
    cache = filled_cache(np.random.default_rng(2), [3, 6], max_len=10)
    check_capacity(cache, 4)
    check_capacity(cache, np.array([7, 4]))
    with pytest.raises(ValueError, match="request 1 has length 6 and needs 5 more slots, but max_len is 10"):
        check_capacity(cache, 5)
    with pytest.raises(ValueError, match="request 0 has length 3"):
        check_capacity(cache, np.array([8, 0]))


def reference_attention(q, k, v, lengths, mask, scale):
    batch, num_q, heads, _ = q.shape
    group = heads // k.shape[1]
    out = np.zeros(q.shape)
    for b in range(batch):
        for i in range(num_q):
            visible = [s for s in range(k.shape[2]) if s < lengths[b]
                       or (s - lengths[b] < mask.shape[2] and mask[b, i, s - lengths[b]])]
            for h in range(heads):
                scores = k[b, h // group, visible] @ q[b, i, h] * scale
                p = np.exp(scores - scores.max())
                out[b, i, h] = (p / p.sum()) @ v[b, h // group, visible]
    return out


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attention_matches_naive_loops(kv_heads):
    rng = np.random.default_rng(kv_heads)
    batch, num_q, heads, dim, slots = 2, 3, 4, 8, 9
    q = rng.normal(size=(batch, num_q, heads, dim))
    k = rng.normal(size=(batch, kv_heads, slots, dim))
    v = rng.normal(size=(batch, kv_heads, slots, dim))
    lengths = np.array([2, 5])
    mask = rng.random((batch, num_q, num_q)) < 0.5
    mask[:, np.arange(num_q), np.arange(num_q)] = True
    out = attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(lengths), jnp.asarray(mask),
                    scale=0.3)
    np.testing.assert_allclose(out, reference_attention(q, k, v, lengths, mask, 0.3), atol=1e-5)
