"""Mosaic GPU tree-attention kernel vs the jnp reference, in the Mosaic GPU interpreter (CPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import configs
from pallas_kernels.configs import TreeAttentionConfig
from pallas_kernels.tree_attention_reference import tree_attention_reference
from pallas_kernels.tree_attention_mgpu import BLOCK, _plan, _tree_attention_mgpu, tree_attention_mgpu
from test_pallas_tree_attention import make_inputs

# Splits the prefix of CPU-sized caches into 64-slot chunks, so that several splits, the
# residual merge and splits past a request's length are exercised.
SPLIT = TreeAttentionConfig(block_m=64, block_k=64, min_programs=64, min_chunk=64)
HOPPER = configs.MOSAIC_TREE_ATTENTION_CONFIGS[(9, 0)]
TOL = 3e-2  # a few bf16 ulps of outputs of size ~1; a wrong mask is off by 0.1 or more


def assert_close(out, ref, dtype):
    assert out.dtype == ref.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=TOL, rtol=TOL)


# (batch, N, H, K, head_dim, S, lengths, padding nodes, dtype, config)
CASES = [
    # group 4 in one row block, ragged lengths incl. 0 and a multiple of 64, several splits
    (3, 9, 4, 1, 64, 200, [0, 150, 64], 2, jnp.bfloat16, SPLIT),
    # group 1, a cache shorter than the tail window (zero-padded), a tree ending at the cache end
    (2, 5, 2, 2, 64, 100, [95, 3], 1, jnp.bfloat16, HOPPER),
    # group 4 over two row blocks, head_dim 128, float16, one split
    (2, 20, 8, 2, 128, 300, [260, 17], 3, jnp.float16, HOPPER),
    # the first case with the prefix cut into equal chunks of each request's blocks
    (3, 9, 4, 1, 64, 200, [0, 150, 64], 2, jnp.bfloat16, dataclasses.replace(SPLIT, split_by_length=True)),
]


@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}N{c[1]}H{c[2]}K{c[3]}D{c[4]}S{c[5]}"
                                               + ("_by_length" if c[9].split_by_length else "") for c in CASES])
def test_interpret_matches_reference(case):
    batch, num_q, heads, kv_heads, head_dim, slots, lengths, padding, dtype, config = case
    args = make_inputs(len(lengths) + num_q, batch=batch, num_q=num_q, heads=heads,
                       kv_heads=kv_heads, head_dim=head_dim, slots=slots, lengths=lengths,
                       dtype=dtype, padding=padding)
    scale = head_dim ** -0.5
    out = tree_attention_mgpu(*args, scale=scale, interpret=True, config=config)
    assert_close(out, tree_attention_reference(*args, scale=scale), dtype)


def test_under_jit_with_more_new_keys_than_queries():
    args = make_inputs(4, batch=2, num_q=3, heads=4, kv_heads=2, head_dim=64, slots=160,
                       lengths=[70, 130], dtype=jnp.bfloat16, num_new=11)
    fn = jax.jit(lambda *a: tree_attention_mgpu(*a, scale=0.1, interpret=True, config=SPLIT))
    assert_close(fn(*args), tree_attention_reference(*args, scale=0.1), jnp.bfloat16)


def test_a_wrong_mask_is_caught():
    """The tolerance above is tight enough: hiding one ancestor of each node fails it."""
    q, k, v, lengths, mask = make_inputs(2, batch=1, num_q=8, heads=4, kv_heads=1, head_dim=64,
                                         slots=128, lengths=[20], dtype=jnp.bfloat16)
    ref = tree_attention_reference(q, k, v, lengths, mask, scale=0.125)
    without_root = mask.at[:, 1:, 0].set(False)
    out = tree_attention_mgpu(q, k, v, lengths, without_root, scale=0.125, interpret=True)
    assert_close(out, tree_attention_reference(q, k, v, lengths, without_root, scale=0.125),
                 jnp.bfloat16)
    with pytest.raises(AssertionError):
        assert_close(out, ref, jnp.bfloat16)


def test_query_seeing_nothing_gets_zeros():
    q, k, v, _, mask = make_inputs(5, batch=1, num_q=4, heads=2, kv_heads=2, head_dim=64,
                                   slots=64, lengths=[0], dtype=jnp.bfloat16)
    mask = mask.at[0, 2, :].set(False)
    lengths = jnp.zeros(1, jnp.int32)
    out = tree_attention_mgpu(q, k, v, lengths, mask, scale=0.125, interpret=True)
    ref = tree_attention_reference(q, k, v, lengths, mask, scale=0.125)
    np.testing.assert_array_equal(np.asarray(out[0, 2], np.float32), 0.0)
    assert_close(out[0, jnp.array([0, 1, 3])], ref[0, jnp.array([0, 1, 3])], jnp.bfloat16)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype=jnp.float32), "dtype"),
    (dict(head_dim=32), "head_dim"),
    (dict(config=TreeAttentionConfig(block_k=32)), "block_k"),
    (dict(scale=jnp.float32(0.1)), "scale"),
    (dict(heads=3), "multiple of kv heads"),
])
def test_invalid_arguments(kwargs, match):
    shape = dict(batch=1, num_q=4, heads=kwargs.pop("heads", 2), kv_heads=2,
                 head_dim=kwargs.pop("head_dim", 64), slots=80, lengths=[8],
                 dtype=kwargs.pop("dtype", jnp.bfloat16))
    with pytest.raises(ValueError, match=match):
        tree_attention_mgpu(*make_inputs(0, **shape), **{"scale": 0.1, "interpret": True,
                                                         **kwargs})


@pytest.mark.parametrize("dtype, head_dim, num_q, by_length", [
    (jnp.bfloat16, 128, 16, False), (jnp.float16, 64, 40, False), (jnp.bfloat16, 128, 16, True)])
def test_compiled_variant_lowers_to_mosaic_gpu(dtype, head_dim, num_q, by_length):
    """The GPU path (transposed key tiles, layout casts) passes the Pallas -> Mosaic GPU lowering.

    The lowering runs without a GPU; it checks layouts and wgmma operands (it rejects, e.g.,
    float32 with a transposed operand), not the numbers.
    """
    shapes = [((2, num_q, 32, head_dim), dtype), ((2, 8, 4096, head_dim), dtype),
              ((2, 8, 4096, head_dim), dtype), ((2,), jnp.int32), ((2, num_q, num_q), jnp.bool_)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    config = dataclasses.replace(HOPPER, split_by_length=by_length)
    fn = jax.jit(lambda *a: _tree_attention_mgpu(*a, scale=0.1, config=config, interpret=False))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("batch, rows, num_new, slots",
                         [(1, 64, 16, 65536), (16, 1024, 256, 1024), (3, 20, 5, 30)])
def test_plan_covers_the_cache(batch, rows, num_new, slots):
    plan = _plan(batch, 8, rows, num_new, slots, HOPPER)
    full_blocks = plan.num_slots // BLOCK
    assert plan.num_splits * plan.chunk_blocks >= full_blocks
    assert (plan.num_splits - 1) * plan.chunk_blocks < max(full_blocks, 1)
    assert plan.rows_pad % BLOCK == 0 and plan.rows_pad >= rows
    assert plan.num_slots >= max(slots, plan.window) and plan.window >= BLOCK - 1 + num_new


def test_mosaic_config_is_unmeasured():
    assert not HOPPER.measured and (HOPPER.block_m, HOPPER.block_k) == (BLOCK, BLOCK)
