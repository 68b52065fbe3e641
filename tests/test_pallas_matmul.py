"""Skinny matmul kernel vs its jnp reference (Pallas interpreter on CPU) and its Triton lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import configs
from pallas_kernels.configs import MatmulConfig, matmul_config
from pallas_kernels.lowering import verified_triton_modules
from pallas_kernels.matmul import _matmul, matmul
from pallas_kernels.matmul_reference import matmul_reference, rms_norm

SMALL = MatmulConfig(block_m=16, block_n=16, block_k=32, splits=1, num_warps=4, num_stages=2)


def operands(seed, m, k, n, dtype=jnp.float32):
    kx, kw, kn = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    norm = (1.0 + 0.1 * jax.random.normal(kn, (k,), jnp.float32)).astype(dtype)
    return x, w, norm


def assert_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 150), n=st.integers(1, 70), splits=st.integers(1, 4),
       norm=st.booleans(), gated=st.booleans(), residual=st.booleans(), seed=st.integers(0, 2**16))
def test_interpret_matches_reference_on_ragged_shapes(m, k, n, splits, norm, gated, residual, seed):
    n += n % 2 if gated else 0
    x, w, norm_K = operands(seed, m, k, n)
    res = jax.random.normal(jax.random.key(seed + 1), (m, n // 2 if gated else n)) if residual else None
    kwargs = dict(norm_K=norm_K if norm else None, gated=gated, residual_MN=res)
    config = MatmulConfig(block_m=16, block_n=16, block_k=32, splits=splits, num_stages=2)
    assert_close(matmul(x, w, config=config, interpret=True, **kwargs), matmul_reference(x, w, **kwargs),
                 jnp.float32)


@pytest.mark.parametrize("splits", [1, 3])
def test_bf16_with_every_option(splits):
    x, w, norm_K = operands(1, 5, 96, 64, jnp.bfloat16)
    config = MatmulConfig(block_m=16, block_n=16, block_k=32, splits=splits, num_stages=2)
    residual = jax.random.normal(jax.random.key(9), (5, 64), jnp.float32).astype(jnp.bfloat16)
    for kwargs in (dict(), dict(norm_K=norm_K), dict(norm_K=norm_K, gated=True), dict(out_dtype=jnp.float32),
                   dict(columns=(16, 48)), dict(residual_MN=residual), dict(norm_K=norm_K, residual_MN=residual)):
        out = matmul(x, w, config=config, interpret=True, **kwargs)
        assert_close(out, matmul_reference(x, w, **kwargs), jnp.bfloat16 if "out_dtype" not in kwargs else jnp.float32)


def test_column_range_is_that_slice():
    x, w, _ = operands(2, 3, 40, 50)
    out = matmul(x, w, columns=(13, 37), config=SMALL, interpret=True)
    assert_close(out, matmul_reference(x, w[:, 13:37]), jnp.float32)


def test_norm_prologue_is_the_models_rms_norm_with_and_without_splits():
    x, w, norm_K = operands(3, 4, 64, 32)
    for splits in (1, 2):
        config = MatmulConfig(block_m=16, block_n=16, block_k=16, splits=splits, num_stages=2)
        out = matmul(x, w, norm_K=norm_K, eps=1e-5, config=config, interpret=True)
        assert_close(out, jnp.matmul(rms_norm(x, norm_K, 1e-5), w), jnp.float32)


def test_every_output_entry_is_written():
    """Rows and columns past the tiles (M = 17 rows in 16-row blocks, N = 33 in 16-column blocks)."""
    x, w, _ = operands(4, 17, 48, 33)
    out = np.asarray(matmul(x, w, config=SMALL, interpret=True))
    assert np.isfinite(out).all()
    assert_close(jnp.asarray(out), matmul_reference(x, w), jnp.float32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(w_shape=(8, 4)), "x must be"),
    (dict(w_dtype=jnp.bfloat16), "share a floating dtype"),
    (dict(norm_shape=(3,)), "norm_K"),
    (dict(gated=True, n=5), "even number of columns"),
    (dict(columns=(4, 2)), "columns"),
    (dict(columns=(0, 9)), "columns"),
    (dict(residual_MN=jnp.zeros((2, 7))), "residual_MN"),
    (dict(residual_MN=jnp.zeros((2, 8), jnp.bfloat16)), "residual_MN"),
])
def test_invalid_operands(kwargs, match):
    n = kwargs.pop("n", 8)
    x, w, norm_K = operands(0, 2, 16, n)
    if "w_shape" in kwargs:
        w = jnp.zeros(kwargs.pop("w_shape"))
    if "w_dtype" in kwargs:
        w = w.astype(kwargs.pop("w_dtype"))
    norm = jnp.ones(kwargs.pop("norm_shape")) if "norm_shape" in kwargs else None
    with pytest.raises(ValueError, match=match):
        matmul(x, w, norm_K=norm, config=SMALL, interpret=True, **kwargs)


@pytest.mark.parametrize("field, value", [("block_m", 8), ("block_n", 48), ("splits", 0), ("num_warps", 3)])
def test_invalid_config(field, value):
    with pytest.raises(ValueError, match=field):
        MatmulConfig(**{field: value})


QWEN3_8B = [(4096, 6144, False, True, False), (4096, 4096, False, False, True), (4096, 24576, True, True, False),
            (12288, 4096, False, False, True), (4096, 151936, False, False, False)]  # K, N, gated, norm, residual


@pytest.mark.parametrize("capability", sorted(configs.MATMUL_POLICIES))
@pytest.mark.parametrize("m", [1, 16, 65, 128])
def test_every_policy_lowers_to_valid_triton_ir_at_qwen3_shapes(capability, m):
    """The configs of every GPU generation at Qwen3-8B's projections lower to Triton IR that the MLIR
    verifier accepts (no GPU needed)."""
    S = jax.ShapeDtypeStruct
    for k, n, gated, norm, residual in QWEN3_8B:
        config = matmul_config(configs.matmul_policy(capability), m, k, n, gated)
        args = (S((m, k), jnp.bfloat16), S((k, n), jnp.bfloat16), S((k,), jnp.bfloat16) if norm else None,
                S((m, n), jnp.bfloat16) if residual else None)
        fn = lambda x, w, nw, res, gated=gated, config=config, n=n: _matmul(  # noqa: E731
            x, w, nw, res, eps=1e-6, gated=gated, out_dtype=jnp.dtype(jnp.bfloat16), columns=(0, n), config=config,
            interpret=False)
        assert len(verified_triton_modules(fn, *args)) == 1


def test_config_splits_k_until_the_grid_is_full():
    policy = configs.matmul_policy((9, 0))
    for k, n, gated, *_ in QWEN3_8B:
        config = matmul_config(policy, 1, k, n, gated)
        columns = (n // 2 if gated else n) // config.block_n
        assert config.block_m == 16 and config.splits >= 1
        assert columns * config.splits >= policy.min_programs or config.splits == k // config.block_k // 2
    assert matmul_config(policy, 100, 4096, 4096).block_m == 128


def test_gpu_equality_script_matmul_checks_run_interpreted():
    """`experiments/check_kernels.py`'s matmul part on small cases through the interpreter."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.check_kernels import check_matmul

    cases = [(3, 100, 48, False, True, True, None), (5, 64, 64, True, True, False, None),
             (2, 64, 96, False, False, False, (32, 96))]
    records = check_matmul(interpret=True, cases=cases)
    assert [r["ok"] for r in records] == [True, True, True], records


def test_benchmark_reads_xla_gemm_tiles_from_hlo():
    """`experiments/bench_matmul.py --match-xla` tiles the kernel as XLA's Triton GEMM of the product."""
    import dataclasses
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.bench_matmul import xla_gemm_config

    hlo = ('%gemm_fusion_dot = bf16[16,24576]{1,0} fusion(...), backend_config={"fusion_backend_config":'
           '{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"32","block_n":"128","block_k":"64",'
           '"split_k":"2","num_stages":"4","num_warps":"8","num_ctas":"1"}}}')
    tiles = xla_gemm_config(hlo, 1, 4096, gated=True)
    assert tiles["xla_tiles"] == MatmulConfig(block_m=16, block_n=128, block_k=64, splits=2, num_warps=8,
                                              num_stages=4)
    assert tiles["xla_tiles_half"] == dataclasses.replace(tiles["xla_tiles"], block_n=64)
    assert xla_gemm_config(hlo, 64, 4096, gated=False) == {
        "xla_tiles": dataclasses.replace(tiles["xla_tiles"], block_m=32)}
    assert xla_gemm_config("%custom-call = (bf16[16,4096]) custom-call(...), custom_call_target=\"__cublas$gemm\"",
                           16, 4096, gated=False) == {}


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 20), chunk=st.integers(1, 24), splits=st.sampled_from([1, 2, 3, 4, 8]),
       n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_split_product_is_the_product_summed_over_k_chunks(m, chunk, splits, n, seed):
    """`split_product` (``bench_matmul.py --split-k``): the float32 product of every K chunk, summed, equals
    the product in float64 within float32 rounding, and ``matmul_reference(splits=...)`` rounds it as its
    one-product form does."""
    from pallas_kernels.matmul_reference import split_product

    x, w, _ = operands(seed, m, chunk * splits, n)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    got = split_product(x, w, splits)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    assert_close(matmul_reference(xb, wb, splits=splits), matmul_reference(xb, wb), jnp.bfloat16)


def test_split_product_rejects_a_count_that_does_not_divide_k():
    from pallas_kernels.matmul_reference import split_product

    x, w, _ = operands(0, 2, 12, 3)
    for splits in (0, 5, -2):
        with pytest.raises(ValueError, match=f"splits must be a positive divisor of K=12, got {splits}"):
            split_product(x, w, splits)


def test_benchmark_times_xla_split_k_variants(tmp_path):
    """`bench_matmul.py --split-k 2,3,4`: a row per count that divides K, each XLA's product checked against
    the one-product reference."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.bench_matmul import SHAPES, main

    out = tmp_path / "bench.json"
    main(["--rows", "2", "--shapes", "o", "--split-k", "2,3,4", "--copies", "1", "--calls", "1", "--repeats", "1",
          "--out", str(out)])
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    assert SHAPES["o"][0] % 3  # K = 4096: 3 does not divide it, so no row
    assert set(rows) == {"xla", "kernel", "xla_split2", "xla_split4"}
    assert rows["xla_split4"]["config"] == 4 and rows["xla_split2"]["ok"] and rows["xla_split4"]["ok"]
