"""The split-K sum + residual + RMSNorm kernel vs its jnp reference and a NumPy oracle (Pallas interpreter on
CPU), its Triton lowering, and the dispatch that runs it after a product."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax import kernels
from pallas_kernels.lowering import verified_triton_modules
from pallas_kernels.matmul_reference import matmul_reference, rms_norm
from pallas_kernels.residual_norm import _residual_norm, kernel_supports, residual_norm
from pallas_kernels.residual_norm_reference import residual_norm_reference

DTYPES = {"bfloat16": (jnp.bfloat16, ml_dtypes.bfloat16), "float32": (jnp.float32, np.float32)}


def numpy_residual_norm(partials, residual, norm, eps, np_dtype):
    """The contract in float64, rounding to the activations' dtype where the reference does."""
    def rounded(a):
        return np.asarray(a).astype(np_dtype).astype(np.float64)
    x = rounded(rounded(partials.astype(np.float64).sum(axis=0)) + residual.astype(np.float64))
    normed = rounded(x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps))
    return x, rounded(norm.astype(np.float64) * normed)


def operands(seed, splits, rows, cols, dtype):
    keys = jax.random.split(jax.random.key(seed), 3)
    partials = jax.random.normal(keys[0], (splits, rows, cols), jnp.float32)
    residual = (3 * jax.random.normal(keys[1], (rows, cols))).astype(dtype)
    norm = (1 + 0.1 * jax.random.normal(keys[2], (cols,))).astype(dtype)
    return partials, residual, norm


def assert_within_a_rounding(got, want, dtype):
    """Equal up to a rounding of the activations' dtype at the values' scale (the sums run in other orders,
    and a sum that cancels keeps the absolute error of its terms)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -21
    np.testing.assert_allclose(got, want, rtol=ulp, atol=ulp * np.abs(want).max())


@settings(max_examples=20, deadline=None)
@given(log_splits=st.integers(0, 3), rows=st.integers(1, 6), log_cols=st.integers(3, 8),
       dtype=st.sampled_from(sorted(DTYPES)), eps=st.sampled_from([1e-6, 1e-2]), seed=st.integers(0, 2**16))
def test_interpret_equals_reference_and_numpy(log_splits, rows, log_cols, dtype, eps, seed):
    jnp_dtype, np_dtype = DTYPES[dtype]
    args = operands(seed, 1 << log_splits, rows, 1 << log_cols, jnp_dtype)
    got = residual_norm(*args, eps=eps, interpret=True)
    want = residual_norm_reference(*args, eps=eps)
    oracle = numpy_residual_norm(*(np.asarray(a, np.float32) for a in args), eps, np_dtype)
    for out, ref, exact in zip(got, want, oracle, strict=True):
        assert out.shape == ref.shape == (rows, 1 << log_cols) and out.dtype == ref.dtype == jnp_dtype
        assert_within_a_rounding(out, ref, jnp_dtype)
        assert_within_a_rounding(out, exact, jnp_dtype)


def test_the_reference_is_the_product_then_the_norm():
    """The contract as the models use it: a split-K product's partials summed, the residual added as
    ``matmul_reference`` adds it, then ``rms_norm``."""
    from pallas_kernels.matmul_reference import split_partials

    keys = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(keys[0], (5, 32), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (32, 16)) / 6).astype(jnp.bfloat16)
    residual = jax.random.normal(keys[2], (5, 16), jnp.bfloat16)
    norm = (1 + 0.1 * jax.random.normal(keys[3], (16,))).astype(jnp.bfloat16)
    got_x, got_normed = residual_norm_reference(split_partials(x, w, 4), residual, norm, eps=1e-6)
    want_x = matmul_reference(x, w, residual_MN=residual, splits=4)
    np.testing.assert_array_equal(np.asarray(got_x, np.float32), np.asarray(want_x, np.float32))
    np.testing.assert_array_equal(np.asarray(got_normed, np.float32),
                                  np.asarray(rms_norm(want_x, norm, 1e-6), np.float32))


@pytest.mark.parametrize("case, message", [
    (((4, 2, 8), jnp.bfloat16, (2, 8), jnp.bfloat16, (8,), jnp.bfloat16), "partials_SPN must be float32"),
    (((4, 2, 8), jnp.float32, (3, 8), jnp.bfloat16, (8,), jnp.bfloat16), "residual_PN must be a floating"),
    (((4, 2, 8), jnp.float32, (2, 8), jnp.int32, (8,), jnp.int32), "residual_PN must be a floating"),
    (((4, 2, 8), jnp.float32, (2, 8), jnp.bfloat16, (8,), jnp.float32), "norm_N must be bfloat16"),
    (((4, 2, 8), jnp.float32, (2, 8), jnp.bfloat16, (4,), jnp.bfloat16), "norm_N must be bfloat16"),
])
def test_bad_operands_are_named(case, message):
    p_shape, p_dtype, r_shape, r_dtype, n_shape, n_dtype = case
    args = (jnp.zeros(p_shape, p_dtype), jnp.zeros(r_shape, r_dtype), jnp.ones(n_shape, n_dtype))
    for fn in (residual_norm_reference, functools.partial(residual_norm, interpret=True)):
        with pytest.raises(ValueError, match=message):
            fn(*args, eps=1e-6)


def test_kernel_needs_powers_of_two():
    assert kernel_supports(jnp.zeros((4, 3, 4096))) and kernel_supports(jnp.zeros((1, 1, 16)))
    assert not kernel_supports(jnp.zeros((3, 2, 64))) and not kernel_supports(jnp.zeros((4, 2, 5120)))
    with pytest.raises(ValueError, match="powers of two for S and N"):
        residual_norm(jnp.zeros((4, 2, 48)), jnp.zeros((2, 48), jnp.bfloat16), jnp.ones(48, jnp.bfloat16), eps=1e-6,
                      interpret=True)


def test_lowers_to_valid_triton_at_qwen3_8b_shapes():
    sds = jax.ShapeDtypeStruct
    [module] = verified_triton_modules(functools.partial(_residual_norm, eps=1e-6, num_warps=16, interpret=False),
                                       sds((4, 64, 4096), jnp.float32), sds((64, 4096), jnp.bfloat16),
                                       sds((4096,), jnp.bfloat16))
    assert "tensor<4x4096xf32>" in module


def products(min_rows=3, splits=2):
    return kernels.residual_norm_product(matmul_reference, min_rows, lambda k: splits, interpret=True)


@pytest.mark.parametrize("rows", [3, 7])
def test_residual_norm_product_gives_the_sum_and_its_norm(rows):
    """From ``min_rows`` rows a product with a residual and ``then_norm_N`` returns the residual sum and
    its RMSNorm, within a rounding of the reference's product and norm."""
    keys = jax.random.split(jax.random.key(rows), 4)
    x = jax.random.normal(keys[0], (rows, 32), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (32, 16)) / 6).astype(jnp.bfloat16)
    residual = jax.random.normal(keys[2], (rows, 16), jnp.bfloat16)
    norm = (1 + 0.1 * jax.random.normal(keys[3], (16,))).astype(jnp.bfloat16)
    got_x, got_normed = products()(x, w, residual_MN=residual, then_norm_N=norm, eps=1e-5)
    want_x = matmul_reference(x, w, residual_MN=residual)
    assert_within_a_rounding(got_x, want_x, jnp.bfloat16)
    assert_within_a_rounding(got_normed, rms_norm(got_x, norm, 1e-5), jnp.bfloat16)


def test_residual_norm_product_leaves_other_products_as_they_are():
    """Fewer rows, no residual, no ``then_norm_N``, a prologue, SwiGLU, a K the splits do not divide or mixed
    dtypes: ``product``'s result, with ``None`` for the norm where one was asked."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (4, 32), jnp.bfloat16)
    w = jax.random.normal(keys[1], (32, 16), jnp.bfloat16)
    residual = jax.random.normal(keys[2], (4, 16), jnp.bfloat16)
    norm = jnp.ones(16, jnp.bfloat16)
    fused = products(min_rows=3, splits=2)
    cases = [(products(min_rows=5), x, w, dict(residual_MN=residual, then_norm_N=norm)),
             (products(splits=3), x, w, dict(residual_MN=residual, then_norm_N=norm)),
             (fused, x, w, dict(then_norm_N=norm)),
             (fused, x, w, dict(residual_MN=residual, then_norm_N=norm, norm_K=jnp.ones(32, jnp.bfloat16))),
             (fused, x, w, dict(residual_MN=residual.astype(jnp.float32), then_norm_N=norm))]
    for product, xs, ws, kwargs in cases:
        y, normed = product(xs, ws, **kwargs)
        assert normed is None
        np.testing.assert_array_equal(np.asarray(y, np.float32),
                                      np.asarray(matmul_reference(xs, ws, **kwargs)[0], np.float32))
    plain = fused(x, w, residual_MN=residual)
    np.testing.assert_array_equal(np.asarray(plain, np.float32),
                                  np.asarray(matmul_reference(x, w, residual_MN=residual), np.float32))


def test_auto_matmul_finishes_many_rows_by_the_kernel_on_hopper(monkeypatch):
    """On an sm_90 GPU without a mesh ``auto`` wraps the padded XLA product in `residual_norm_product` with
    the measured rows and splits, then in `partials_product` (padded as XLA's products are); elsewhere the
    reference leaves the norm to the next product."""
    from pallas_kernels import configs
    from ddtree_jax.sharding import make_mesh

    calls = []
    monkeypatch.setattr(configs, "device_capability", lambda: (9, 0))
    monkeypatch.setattr(kernels, "pallas_gpu", lambda: True)
    monkeypatch.setattr(kernels, "residual_norm_product",
                        lambda product, rows, splits: calls.append(("norm", rows, splits)) or "norm")
    monkeypatch.setattr(kernels, "partials_product",
                        lambda product, rows, splits: calls.append((product, rows, splits)) or "partials")
    monkeypatch.setattr(kernels, "up_to_rows", lambda product, plain, rows: (product, plain.__name__, rows))
    auto, plain, max_rows = kernels.matmul_fn("auto")
    assert auto == "partials" and plain == "padded" and max_rows == kernels.SPLIT_K_MAX_ROWS
    assert calls == [("norm", kernels.RESIDUAL_NORM_MIN_ROWS[(9, 0)], kernels.split_k_chunks),
                     ("norm", kernels.XLA_MIN_ROWS[(9, 0)], kernels.split_k_chunks)]
    assert kernels.matmul_fn("auto", make_mesh(1, 1)) is matmul_reference and len(calls) == 2
    assert kernels.matmul_fn("xla") is matmul_reference
    y, normed = matmul_reference(jnp.ones((2, 4)), jnp.ones((4, 3)), then_norm_N=jnp.ones(3))
    assert normed is None and y.shape == (2, 3)


def test_products_of_more_rows_than_the_bound_run_plain():
    """`up_to_rows`: a product of at most the bound's rows is the split one, of more the plain one, with
    every keyword passed on."""
    seen = []

    def named(name):
        return lambda x, w, **kwargs: seen.append((name, x.shape[0], kwargs)) or name

    bounded = kernels.up_to_rows(named("split"), named("plain"), 4)
    w = jnp.ones((3, 2))
    assert [bounded(jnp.ones((m, 3)), w, then_norm_N=m) for m in (1, 4, 5, 9)] == ["split", "split", "plain", "plain"]
    assert seen == [(n, m, {"then_norm_N": m}) for n, m in (("split", 1), ("split", 4), ("plain", 5), ("plain", 9))]
    assert kernels.SPLIT_K_MAX_ROWS >= 8 * 65  # the verify forwards of 8 requests keep the measured split-K


def test_split_k_chunks_cut_k_into_the_fewest_short_chunks(monkeypatch):
    """The fewest chunks, a power of two from the minimum, of at most the chunk limit: 4 for Qwen3-8B's
    attention output and q/k/v products (K = 4096), 8 for its down product (12,288)."""
    assert [kernels.split_k_chunks(k) for k in (64, 4096, 6144, 6145, 12288, 25600)] == [4, 4, 4, 8, 8, 32]
    monkeypatch.setattr(kernels, "SPLIT_K_MAX_CHUNK", 512)
    monkeypatch.setattr(kernels, "SPLIT_K_MIN_CHUNKS", 2)
    assert [kernels.split_k_chunks(k) for k in (512, 1024, 1025, 4096)] == [2, 2, 4, 8]


def verify_inputs(seed, layers, num, context=8, vocab=64):
    """A verify forward's operands for the small test target (2 KV heads of 16): a random bf16 cache of
    ``context`` tokens with room for ``num`` more, ``num`` random tokens after them and a causal mask:
    ``(cache, tokens [1, num], positions [1, num], mask [1, num, num])``."""
    from ddtree_jax.models import KVCache

    keys = jax.random.split(jax.random.key(seed), 3)
    cache = KVCache(*(jax.random.normal(k, (layers, 1, 2, context + num, 16), jnp.bfloat16) for k in keys[:2]),
                    lengths=jnp.full((1,), context, jnp.int32))
    tokens = jax.random.randint(keys[2], (1, num), 0, vocab)
    positions = context + jnp.arange(num, dtype=jnp.int32)[None]
    return cache, tokens, positions, jnp.tril(jnp.ones((num, num), bool))[None]


def test_forward_with_the_kernel_equals_the_xla_forward(monkeypatch):
    """A small Qwen3 target's verify forward with every output and down product finished by the kernel (the
    next norm passed on to the next product) gives the XLA forward's logits, taps and cache within bf16
    rounding; a forward of fewer rows than ``min_rows`` is the XLA one exactly."""
    from ddtree_jax.models import Qwen3Config, init_target, target_forward

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
    target = init_target(cfg, jax.random.key(0), jnp.bfloat16)
    fused, seen = products(min_rows=4, splits=2), []

    def counted(x, w, **kwargs):
        out = fused(x, w, **kwargs)
        seen.append(isinstance(out, tuple) and out[1] is not None)
        return out

    monkeypatch.setattr(kernels, "matmul_fn", lambda impl, mesh=None: counted if impl == "auto" else matmul_reference)
    jax.clear_caches()
    for num in (5, 2):
        cache, tokens, positions, mask = verify_inputs(num, layers=3, num=num)
        seen.clear()
        outs = {impl: target_forward(target, tokens, positions, mask, cache, tap_layers=(0, 2), matmul_impl=impl)
                for impl in ("auto", "xla")}
        (got_logits, got_taps, got_cache), (want_logits, want_taps, want_cache) = outs["auto"], outs["xla"]
        if num >= 4:
            assert sum(seen) == 5  # the output product of each layer, the down product of the first two
            scale = float(jnp.abs(want_logits.astype(jnp.float32)).max())
            for got, want in ((got_logits, want_logits), (got_taps, want_taps), (got_cache.k, want_cache.k),
                              (got_cache.v, want_cache.v)):
                np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                           atol=0.05 * max(scale, 1.0))
        else:
            assert not any(seen)
            np.testing.assert_array_equal(np.asarray(got_logits, np.float32), np.asarray(want_logits, np.float32))
    jax.clear_caches()


def test_check_kernels_residual_norm_part_through_the_interpreter(monkeypatch):
    """`experiments/check_kernels.py --parts residual_norm` on small cases passes, and fails when the kernel
    drops the residual."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments import check_kernels

    cases = [(4, 3, 64, "bfloat16"), (2, 1, 32, "float32")]
    assert [r["ok"] for r in check_kernels.check_residual_norm(interpret=True, cases=cases)] == [True, True]
    monkeypatch.setattr(check_kernels, "residual_norm",
                        lambda p, r, n, **kw: residual_norm(p, jnp.zeros_like(r), n, **kw))
    assert not any(r["ok"] for r in check_kernels.check_residual_norm(interpret=True, cases=cases))
