"""The Mosaic GPU skinny matmul vs the plain product of its jnp reference (Mosaic GPU interpreter on
CPU), its lowering at Qwen3-8B projection shapes, its split policy and its bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul_mgpu import ROWS, MosaicMatmulConfig, _matmul_mgpu, matmul_mgpu, split_count
from pallas_kernels.matmul_reference import matmul_reference


def operands(m, k, n, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (m, k), dtype), (jax.random.normal(kw, (k, n)) * k ** -0.5).astype(dtype)


def assert_close(got, want):
    """Within two roundings of the result's dtype (the float32 sums run in another order)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    np.testing.assert_allclose(got, want, rtol=2 * eps, atol=2 * eps * np.abs(want).max())


# (M, K, N, dtype, config): one row to all 64, one split to one a K tile, both tile heights, three tile
# widths, four stages to one and more stages than a split's tiles, float16, a float32 result.
CASES = [(1, 256, 256, jnp.bfloat16, MosaicMatmulConfig(splits=2)),
         (16, 512, 256, jnp.bfloat16, MosaicMatmulConfig(splits=1)),
         (64, 256, 128, jnp.bfloat16, MosaicMatmulConfig(splits=4, num_stages=1)),
         (5, 512, 512, jnp.float16, MosaicMatmulConfig(block_n=256, block_k=128, splits=2, num_stages=8)),
         (33, 384, 192, jnp.bfloat16, MosaicMatmulConfig(block_n=64, splits=3, num_stages=2)),
         (16, 256, 128, jnp.bfloat16, None)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_interpret_matches_reference(case):
    m, k, n, dtype, config = case
    x, w = operands(m, k, n, dtype)
    got = matmul_mgpu(x, w, config=config, interpret=True)
    assert got.shape == (m, n) and got.dtype == dtype
    assert_close(got, matmul_reference(x, w))


def test_float32_result_and_a_wrong_product_is_caught():
    x, w = operands(16, 256, 128, jnp.bfloat16, seed=1)
    got = matmul_mgpu(x, w, out_dtype=jnp.float32, config=MosaicMatmulConfig(splits=2), interpret=True)
    assert got.dtype == jnp.float32
    assert_close(got, matmul_reference(x, w, out_dtype=jnp.float32))
    with pytest.raises(AssertionError):  # the tolerance tells one K tile left out
        assert_close(got, matmul_reference(x[:, 64:], w[64:], out_dtype=jnp.float32))


@pytest.mark.parametrize("k, n", [(4096, 4096), (4096, 6144), (4096, 24576), (12288, 4096)])
def test_lowers_to_mosaic_gpu_at_projection_shapes(k, n):
    """The Qwen3-8B projections at 16 rows pass the Pallas -> Mosaic GPU lowering (layouts, TMA
    tiling, wgmma operands), without a GPU; the split policy covers 132 SMs."""
    config = MosaicMatmulConfig()
    splits = split_count(k // config.block_k, n // config.block_n, 132)
    fn = jax.jit(lambda x, w: _matmul_mgpu(x, w, splits=splits, out_dtype=jnp.dtype(jnp.bfloat16), config=config,
                                           interpret=False))
    args = [jax.ShapeDtypeStruct((16, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)]
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_split_policy():
    assert split_count(64, 32, 132) == 8  # attention output: 32 column blocks, 64 K tiles -> 256 programs
    assert split_count(64, 192, 132) == 1  # gate/up: 192 column blocks already
    assert split_count(64, 48, 132) == 4  # q/k/v
    assert split_count(192, 32, 132) == 6  # down: a divisor of its 192 K tiles
    assert split_count(3, 2, 132) == 3  # all of K where no divisor reaches the SMs


@pytest.mark.parametrize("args, kwargs, match", [
    (((16, 256), (256, 128), jnp.float32), {}, "share one dtype among bfloat16, float16"),
    (((65, 256), (256, 128), jnp.bfloat16), {}, f"1 to {ROWS} rows"),
    (((16, 200), (200, 128), jnp.bfloat16), {}, "multiple of block_k"),
    (((16, 256), (256, 100), jnp.bfloat16), {}, "multiple of block_k = 64 and N = 100 of block_n"),
    (((16, 256), (128, 128), jnp.bfloat16), {}, r"x must be \[M, K\] and w \[K, N\]"),
    (((16, 256), (256, 128), jnp.bfloat16), {"config": MosaicMatmulConfig(splits=3)}, "must divide the 4 tiles"),
    (((16, 256), (256, 128), jnp.bfloat16), {"config": 3}, "config must be a MosaicMatmulConfig"),
])
def test_bad_input_raises_clear_errors(args, kwargs, match):
    x_shape, w_shape, dtype = args
    with pytest.raises(ValueError, match=match):
        matmul_mgpu(jnp.zeros(x_shape, dtype), jnp.zeros(w_shape, dtype), interpret=True, **kwargs)


@pytest.mark.parametrize("field, value", [("block_n", 96), ("block_k", 32), ("splits", -1), ("num_stages", 9)])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=f"MosaicMatmulConfig.{field} must be"):
        MosaicMatmulConfig(**{field: value})


@pytest.mark.parametrize("gated, norm, residual", [(True, True, False), (False, False, True)])
def test_benchmark_product_with_the_mosaic_kernel(gated, norm, residual):
    """`experiments/bench_matmul.py --mosaic`: the kernel's product with XLA's prologue and epilogues is the
    shape's reference product (interpreted here)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.bench_matmul import operands as bench_operands
    from experiments.bench_matmul import product_fn

    x, norm_K, residual_MN, ws = bench_operands(16, 256, 256, copies=2)
    config = MosaicMatmulConfig(splits=2)
    got = product_fn(config, gated, norm, jnp.bfloat16, residual)(x, norm_K, residual_MN, ws)
    want = product_fn(None, gated, norm, jnp.bfloat16, residual)(x, norm_K, residual_MN, ws)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


def test_gpu_equality_script_mosaic_part_runs_interpreted(monkeypatch):
    """`experiments/check_kernels.py`'s matmul_mosaic part on small cases through the interpreter, and a
    broken kernel fails it."""
    from experiments import check_kernels

    cases = [(1, 256, 256), (16, 512, 128)]
    assert [r["ok"] for r in check_kernels.check_matmul_mosaic(interpret=True, cases=cases)] == [True, True]
    monkeypatch.setattr(check_kernels, "matmul_mgpu", lambda x, w, interpret: matmul_mgpu(
        x[:, 64:], w[64:], interpret=interpret))  # one K tile left out
    assert not any(r["ok"] for r in check_kernels.check_matmul_mosaic(interpret=True, cases=cases))


def test_benchmark_sweep_of_mosaic_configs():
    """`bench_matmul.py --mosaic-sweep`: every config fits a Hopper block's shared memory and splits K's
    tiles evenly, the policy's splits among them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.bench_matmul import MOSAIC_SMEM_BYTES, mosaic_sweep_configs

    grid = mosaic_sweep_configs(12288, 4096)
    assert grid and all((64 + c.block_n) * c.block_k * 2 * c.num_stages + 64 * c.block_n * 4 <= MOSAIC_SMEM_BYTES
                        for c in grid.values())
    assert all((12288 // c.block_k) % c.splits == 0 for c in grid.values())
    assert grid["mosaic_n128_k64_s4_x6"] == MosaicMatmulConfig(splits=6)  # the policy's split at 132 SMs
    assert "mosaic_n256_k128_s6_x3" not in grid  # 6 stages of 128 x 256 tiles: 288 KB
