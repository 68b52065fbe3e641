"""The q/k norm + RoPE kernels (alone, and with the K/V cache write) vs their jnp references (Pallas
interpreter on CPU) and their Triton lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.lowering import verified_triton_modules
from pallas_kernels.matmul_reference import rms_norm
from pallas_kernels.qk_norm_rope import (_qk_norm_rope, _qk_norm_rope_write, kernel_supports, qk_norm_rope,
                                         qk_norm_rope_write)
from pallas_kernels.qk_norm_rope_reference import (qk_norm_rope_reference, qk_norm_rope_write_reference, rope_tables,
                                                   rotate, summed_partials)


def operands(seed, batch, num, heads, kv_heads, head_dim, dtype=jnp.float32, max_position=4096):
    k = jax.random.split(jax.random.key(seed), 4)
    qkv = (3.0 * jax.random.normal(k[0], (batch, num, (heads + 2 * kv_heads) * head_dim))).astype(dtype)
    q_norm, k_norm = ((1.0 + 0.2 * jax.random.normal(key, (head_dim,))).astype(dtype) for key in k[1:3])
    positions = jax.random.randint(k[3], (batch, num), 0, max_position)
    return qkv, q_norm, k_norm, *rope_tables(positions, head_dim, 10000.0)


def assert_close(outs, refs, dtype):
    tol = 2e-6 if dtype == jnp.float32 else 1e-2
    for out, ref in zip(outs, refs, strict=True):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 3), num=st.integers(1, 9), log_heads=st.integers(0, 3), log_kv=st.integers(0, 2),
       log_half=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_interpret_matches_reference(batch, num, log_heads, log_kv, log_half, seed):
    heads, kv_heads, head_dim = 1 << (log_heads + log_kv), 1 << log_kv, 2 << log_half
    args = operands(seed, batch, num, heads, kv_heads, head_dim)
    kwargs = dict(heads=heads, kv_heads=kv_heads, eps=1e-6)
    assert_close(qk_norm_rope(*args, interpret=True, **kwargs), qk_norm_rope_reference(*args, **kwargs), jnp.float32)


def test_bf16_at_qwen3_head_shapes():
    """Qwen3-8B heads (32 query, 8 key/value, head_dim 128): bfloat16 results within one rounding."""
    args = operands(1, 2, 3, 32, 8, 128, jnp.bfloat16)
    kwargs = dict(heads=32, kv_heads=8, eps=1e-6)
    outs = qk_norm_rope(*args, interpret=True, **kwargs)
    refs = qk_norm_rope_reference(*args, **kwargs)
    assert_close(outs, refs, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(outs[2]), np.asarray(refs[2]))  # v is copied


def test_reference_is_norm_then_rotation_of_each_head():
    """The contract itself, checked against NumPy: head h of q is RMSNorm(q_h) * q_norm rotated by
    angle ``p * theta ** (-2i / D)`` on pairs ``(i, i + D / 2)``; v is the last columns."""
    heads, kv_heads, head_dim = 2, 1, 8
    qkv, q_norm, k_norm, cos, sin = operands(7, 1, 2, heads, kv_heads, head_dim)
    positions = np.array([[5, 301]])
    cos, sin = rope_tables(jnp.asarray(positions), head_dim, 10000.0)
    q, k, v = qk_norm_rope_reference(qkv, q_norm, k_norm, cos, sin, heads=heads, kv_heads=kv_heads, eps=1e-6)
    x = np.asarray(qkv, np.float64).reshape(1, 2, 4, head_dim)
    angle = positions[..., None] * 10000.0 ** (-np.arange(4) * 2 / head_dim)

    def expect(h, weight):
        y = x[:, :, h] / np.sqrt(np.mean(x[:, :, h] ** 2, -1, keepdims=True) + 1e-6) * np.asarray(weight)
        y1, y2 = y[..., :4], y[..., 4:]
        return np.concatenate([y1 * np.cos(angle) - y2 * np.sin(angle), y2 * np.cos(angle) + y1 * np.sin(angle)], -1)

    for h in range(heads):
        np.testing.assert_allclose(np.asarray(q[:, :, h]), expect(h, q_norm), atol=2e-5)
    np.testing.assert_allclose(np.asarray(k[:, :, 0]), expect(2, k_norm), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(v[:, :, 0]), x[:, :, 3].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(rotate(rms_norm(qkv.reshape(1, 2, 4, 8)[:, :, :2], q_norm, 1e-6), cos,
                                                    sin)), np.asarray(q))


@pytest.mark.parametrize("heads, kv_heads, head_dim, ok", [(32, 8, 128, True), (40, 8, 128, False),
                                                           (8, 2, 40, False), (4, 1, 2, True), (2, 4, 16, False)])
def test_kernel_supports_powers_of_two(heads, kv_heads, head_dim, ok):
    qkv = jax.ShapeDtypeStruct((1, 1, (heads + 2 * kv_heads) * head_dim), jnp.bfloat16)
    assert kernel_supports(qkv, heads, kv_heads) is ok


@pytest.mark.parametrize("change, match", [
    (dict(heads=5), "qkv_BNC must be"), (dict(heads=40, kv_heads=8, cols=56 * 128, dim=128), "powers of two"),
    (dict(q_norm_shape=(7,)), "q_norm_D must be"), (dict(cos_dtype=jnp.bfloat16), "cos_BNF must be float32"),
])
def test_invalid_operands(change, match):
    heads, kv_heads = change.get("heads", 4), change.get("kv_heads", 2)
    dim = change.get("dim", 16)
    qkv = jnp.zeros((1, 2, change.get("cols", 8 * 16)), jnp.float32)
    norm = jnp.ones(change.get("q_norm_shape", (dim,)), jnp.float32)
    table = jnp.zeros((1, 2, dim // 2), change.get("cos_dtype", jnp.float32))
    with pytest.raises(ValueError, match=match):
        qk_norm_rope(qkv, norm, jnp.ones((dim,)), table, jnp.zeros((1, 2, dim // 2)), heads=heads, kv_heads=kv_heads,
                     eps=1e-6, interpret=True)


@pytest.mark.parametrize("batch, num", [(1, 1), (1, 65), (8, 17)])
def test_lowers_to_valid_triton_ir_at_qwen3_shapes(batch, num):
    """Qwen3-8B (32/8 heads) and Qwen3-30B-A3B (32/4) heads, decode and verify rows (no GPU needed)."""
    S = jax.ShapeDtypeStruct
    for heads, kv_heads in ((32, 8), (32, 4)):
        args = (S((batch, num, (heads + 2 * kv_heads) * 128), jnp.bfloat16), S((128,), jnp.bfloat16),
                S((128,), jnp.bfloat16), S((batch, num, 64), jnp.float32), S((batch, num, 64), jnp.float32))
        fn = functools.partial(_qk_norm_rope, heads=heads, kv_heads=kv_heads, eps=1e-6, interpret=False)
        assert len(verified_triton_modules(fn, *args)) == 1


def test_gpu_equality_script_rope_checks_run_interpreted():
    """`experiments/check_kernels.py`'s rope part on small cases through the interpreter."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.check_kernels import check_rope

    records = check_rope(interpret=True, cases=[(1, 2, 4, 2, "bfloat16"), (2, 3, 8, 1, "float32")], head_dim=16)
    assert [r["ok"] for r in records] == [True, True], records


def cache_operands(seed, layers, batch, kv_heads, slots, head_dim, dtype):
    k = jax.random.split(jax.random.key(seed + 1), 2)
    return [jax.random.normal(key, (layers, batch, kv_heads, slots, head_dim), dtype) for key in k]


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 3), num=st.integers(1, 5), log_heads=st.integers(0, 2), log_kv=st.integers(0, 1),
       log_half=st.integers(0, 3), slots=st.integers(1, 9), seed=st.integers(0, 2**16), data=st.data())
def test_write_interpret_matches_reference(batch, num, log_heads, log_kv, log_half, slots, seed, data):
    """The fused kernel's q and caches against `qk_norm_rope_write_reference`, slots past the end of the
    cache included (dropped); float32 within rounding, the values bit for bit."""
    heads, kv_heads, head_dim = 1 << (log_heads + log_kv), 1 << log_kv, 2 << log_half
    lengths = jnp.asarray(data.draw(st.lists(st.integers(0, slots + 1), min_size=batch, max_size=batch)), jnp.int32)
    layers = data.draw(st.integers(1, 2))
    queries = data.draw(st.sampled_from([None, *range(1, num + 1)]))  # q of the last rows only (a drafter's block)
    args = (*operands(seed, batch, num, heads, kv_heads, head_dim), *cache_operands(seed, layers, batch, kv_heads,
                                                                                   slots, head_dim, jnp.float32),
            lengths)
    kwargs = dict(layer=layers - 1, heads=heads, kv_heads=kv_heads, eps=1e-6, queries=queries)
    outs = qk_norm_rope_write(*args, interpret=True, **kwargs)
    refs = qk_norm_rope_write_reference(*args, **kwargs)
    assert outs[0].shape == (batch, queries or num, heads, head_dim)
    assert_close(outs, refs, jnp.float32)
    np.testing.assert_array_equal(np.asarray(outs[2]), np.asarray(refs[2]))


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 3), num=st.integers(1, 5), chunks=st.integers(1, 4), pad=st.integers(0, 3),
       log_half=st.integers(0, 3), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), seed=st.integers(0, 2**16),
       data=st.data())
def test_write_from_partials_matches_reference(batch, num, chunks, pad, log_half, dtype, seed, data):
    """Given the float32 partials of a split-K (rows padded), the kernel sums each row's in order and gives the
    reference's result on their sum, the value cache bit for bit; so does the reference given the partials."""
    heads, kv_heads, head_dim = 4, 2, 2 << log_half
    qkv, *rest = operands(seed, batch, num, heads, kv_heads, head_dim, dtype)
    partials = jax.random.normal(jax.random.key(seed + 7), (chunks, batch * num + pad, qkv.shape[-1]), jnp.float32)
    qkv = summed_partials(partials, qkv.shape, dtype)
    lengths = jnp.asarray(data.draw(st.lists(st.integers(0, 6), min_size=batch, max_size=batch)), jnp.int32)
    args = (qkv, *rest, *cache_operands(seed, 1, batch, kv_heads, 6, head_dim, dtype), lengths)
    kwargs = dict(layer=0, heads=heads, kv_heads=kv_heads, eps=1e-6, queries=data.draw(st.sampled_from([None, 1])))
    outs = qk_norm_rope_write(*args, partials_SRC=partials, interpret=True, **kwargs)
    refs = qk_norm_rope_write_reference(*args, **kwargs)
    assert_close(outs, refs, dtype)
    np.testing.assert_array_equal(np.asarray(outs[2], np.float32), np.asarray(refs[2], np.float32))
    from_partials = qk_norm_rope_write_reference(jnp.zeros_like(qkv), *args[1:], partials_SRC=partials, **kwargs)
    for a, b in zip(from_partials, refs, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_summed_partials_add_the_chunks_in_order_then_round():
    parts = jnp.asarray([[[1.0, 2.0**-9], [5.0, 6.0]], [[2.0**-9, 2.0**-9], [7.0, 8.0]],
                         [[0.5, 0.0], [0.0, 0.0]]], jnp.float32)
    got = summed_partials(parts, (1, 1, 2), jnp.bfloat16)
    # 1 + 2^-9 + 0.5 = 1.501953125 rounds to 1.5 in bf16; 2^-8 is exact
    np.testing.assert_array_equal(np.asarray(got, np.float32), [[[1.5, 2.0**-8]]])


def test_write_refuses_partials_that_do_not_fit():
    args = (*operands(0, 2, 3, 4, 2, 16), *cache_operands(0, 1, 2, 2, 5, 16, jnp.float32), jnp.zeros((2,), jnp.int32))
    kwargs = dict(layer=0, heads=4, kv_heads=2, eps=1e-6, interpret=True)
    cols = args[0].shape[-1]
    for bad in (jnp.zeros((2, 5, cols), jnp.float32), jnp.zeros((2, 6, cols), jnp.bfloat16),
                jnp.zeros((2, 6, cols + 1), jnp.float32), jnp.zeros((6, cols), jnp.float32)):
        with pytest.raises(ValueError, match="partials_SRC must be float32"):
            qk_norm_rope_write(*args, partials_SRC=bad, **kwargs)


@pytest.mark.parametrize("num, rows", [(1, 16), (64, 64)])
def test_write_from_partials_lowers_to_valid_triton_ir_at_qwen3_shapes(num, rows):
    S = jax.ShapeDtypeStruct
    cache = S((36, 1, 8, 1100, 128), jnp.bfloat16)
    args = (S((4, rows * 48, 128), jnp.float32), S((128,), jnp.bfloat16), S((128,), jnp.bfloat16),
            S((1, num, 64), jnp.float32), S((1, num, 64), jnp.float32), cache, cache, S((1,), jnp.int32))
    fn = functools.partial(_qk_norm_rope_write, layer=35, heads=32, kv_heads=8, eps=1e-6, queries=num,
                           dtype=jnp.dtype(jnp.bfloat16), interpret=False)
    [module] = verified_triton_modules(fn, *args)
    assert module.count("tt.load") >= 4 * 5  # q, k and v heads' halves from each of the 4 partials


def test_write_reference_queries_are_the_last_rows_of_all():
    args = (*operands(3, 2, 5, 4, 2, 16), *cache_operands(3, 1, 2, 2, 9, 16, jnp.float32), jnp.asarray([0, 3]))
    kwargs = dict(layer=0, heads=4, kv_heads=2, eps=1e-6)
    every, part = qk_norm_rope_write_reference(*args, **kwargs), qk_norm_rope_write_reference(*args, queries=2,
                                                                                               **kwargs)
    np.testing.assert_array_equal(np.asarray(part[0]), np.asarray(every[0][:, 3:]))
    for a, b in zip(part[1:], every[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_write_bf16_at_qwen3_head_shapes():
    """Qwen3-8B heads, a verify of 3 rows per request into bf16 caches, one request past the end."""
    args = (*operands(2, 2, 3, 32, 8, 128, jnp.bfloat16), *cache_operands(2, 2, 2, 8, 6, 128, jnp.bfloat16),
            jnp.asarray([1, 5], jnp.int32))
    kwargs = dict(layer=1, heads=32, kv_heads=8, eps=1e-6)
    assert_close(qk_norm_rope_write(*args, interpret=True, **kwargs), qk_norm_rope_write_reference(*args, **kwargs),
                 jnp.bfloat16)


@pytest.mark.parametrize("batch, num, queries", [(1, 1, 1), (8, 17, 17), (1, 20, 16)])
def test_write_lowers_to_valid_triton_ir_at_qwen3_shapes(batch, num, queries):
    S = jax.ShapeDtypeStruct
    cache = S((36, batch, 8, 1100, 128), jnp.bfloat16)
    args = (S((batch * num * 48, 128), jnp.bfloat16), S((128,), jnp.bfloat16), S((128,), jnp.bfloat16),
            S((batch, num, 64), jnp.float32), S((batch, num, 64), jnp.float32), cache, cache, S((batch,), jnp.int32))
    fn = functools.partial(_qk_norm_rope_write, layer=35, heads=32, kv_heads=8, eps=1e-6, queries=queries,
                           dtype=jnp.dtype(jnp.bfloat16), interpret=False)
    assert len(verified_triton_modules(fn, *args)) == 1


def test_write_refuses_caches_that_do_not_fit():
    args = operands(0, 1, 2, 4, 2, 16)
    caches = cache_operands(0, 2, 1, 2, 5, 16, jnp.float32)
    with pytest.raises(ValueError, match="k_LBKSD and v_LBKSD must be caches"):
        qk_norm_rope_write(*args, caches[0][:, :, :1], caches[1], jnp.zeros((1,), jnp.int32), layer=0, heads=4,
                           kv_heads=2, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="layer in"):
        qk_norm_rope_write(*args, *caches, jnp.zeros((1,), jnp.int32), layer=2, heads=4, kv_heads=2, eps=1e-6,
                           interpret=True)
    for queries in (0, 3, 1.0):
        with pytest.raises(ValueError, match=r"queries must be an int in \[1, 2\]"):
            qk_norm_rope_write(*args, *caches, jnp.zeros((1,), jnp.int32), layer=0, heads=4, kv_heads=2, eps=1e-6,
                               queries=queries, interpret=True)


def test_gpu_equality_script_rope_write_checks_run_interpreted():
    """`experiments/check_kernels.py`'s rope_write part on small cases through the interpreter."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.check_kernels import check_rope_write

    cases = [(2, 2, 3, 4, 2, 5, [0, 4], "bfloat16", None, 0), (1, 1, 2, 2, 1, 8, [3], "float32", None, 0),
             (1, 2, 5, 4, 2, 9, [0, 3], "bfloat16", 3, 0), (1, 1, 1, 4, 2, 5, [2], "bfloat16", None, 4),
             (2, 2, 3, 4, 2, 9, [0, 3], "float32", 2, 2)]
    assert [r["ok"] for r in check_rope_write(interpret=True, cases=cases, head_dim=16)] == [True] * 5


def test_partials_product_hands_over_padded_partials_of_plain_products():
    """A product asked ``with_partials`` (with or without its RMSNorm prologue) returns the partials of ``x``
    padded to ``min_rows`` and their rounded sum, within a rounding of the reference; any other product is
    the wrapped one's, with no partials."""
    from ddtree_jax import kernels
    from pallas_kernels.matmul_reference import matmul_reference

    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (3, 32), jnp.bfloat16)
    w = (0.2 * jax.random.normal(keys[1], (32, 24))).astype(jnp.bfloat16)
    norm = (1 + 0.1 * jax.random.normal(keys[2], (32,))).astype(jnp.bfloat16)
    split = kernels.partials_product(matmul_reference, 8, lambda k: 4)
    for kwargs in ({}, dict(norm_K=norm, eps=1e-5)):
        y, partials = split(x, w, with_partials=True, **kwargs)
        assert partials.shape == (4, 8, 24) and partials.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(partials[:, 3:]), 0.0)
        np.testing.assert_array_equal(np.asarray(y, np.float32),
                                      np.asarray(summed_partials(partials, (1, 3, 24), y.dtype)[0], np.float32))
        np.testing.assert_allclose(np.asarray(y, np.float32),
                                   np.asarray(matmul_reference(x, w, **kwargs), np.float32), rtol=2e-2, atol=2e-2)
    y, partials = split(x, w, with_partials=True, columns=(0, 8))
    assert partials is None and y.shape == (3, 8)
    y, partials = kernels.partials_product(matmul_reference, 2, lambda k: 5)(x, w, with_partials=True)
    assert partials is None  # 5 chunks do not divide K = 32
    np.testing.assert_array_equal(np.asarray(split(x, w), np.float32), np.asarray(matmul_reference(x, w), np.float32))
    assert matmul_reference(x, w, with_partials=True)[1] is None
    with pytest.raises(ValueError, match="with_partials and then_norm_N"):
        matmul_reference(x, w, with_partials=True, then_norm_N=jnp.ones(24, jnp.bfloat16))


def test_forward_with_partials_into_the_kernel_equals_the_xla_forward(monkeypatch):
    """A small Qwen3 target's verify forward whose q/k/v products hand their split-K partials to the
    interpreted norm + RoPE + write kernel gives the XLA forward's logits and caches within bf16 rounding."""
    from ddtree_jax import kernels
    from ddtree_jax.models import Qwen3Config, init_target, target_forward
    from pallas_kernels.matmul_reference import matmul_reference
    from test_pallas_residual_norm import verify_inputs

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
    target = init_target(cfg, jax.random.key(0), jnp.bfloat16)
    split, handed = kernels.partials_product(matmul_reference, 8, lambda k: 2), []

    def counted(x, w, **kwargs):
        out = split(x, w, **kwargs)
        handed.append(kwargs.get("with_partials", False) and out[1] is not None)
        return out

    monkeypatch.setattr(kernels, "matmul_fn",
                        lambda impl, mesh=None: counted if impl == "interpret" else matmul_reference)
    cache, tokens, positions, mask = verify_inputs(1, layers=2, num=3)
    jax.clear_caches()
    got = target_forward(target, tokens, positions, mask, cache, attention_impl="interpret", matmul_impl="interpret")
    want = target_forward(target, tokens, positions, mask, cache)
    jax.clear_caches()
    assert sum(handed) == 2  # each layer's q/k/v product
    scale = float(jnp.abs(want[0]).max())
    for a, b in ((got[0], want[0]), (got[2].k, want[2].k), (got[2].v, want[2].v)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=0.05 * max(scale, 1.0))
