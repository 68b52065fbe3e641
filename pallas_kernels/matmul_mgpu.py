"""Skinny matrix products on Hopper as a Mosaic GPU kernel: ``y = x @ w``, weights streamed by TMA.

At 16 rows XLA's products of the Qwen3-8B projections are library GEMMs that load their tiles with
TMA into warpgroup MMAs, and the Triton kernel of `matmul` (pointer loads) streams the weights slower
than they do. This kernel streams them the same way, as a base for products of our own that fuse what
XLA runs around its GEMMs. Program ``(j, s)`` of the grid ``(N / block_n, splits)``:

- **rows**: ``x``'s ``M <= 64`` rows are zero-padded to 64, the M of a wgmma; the MMA work is four
  times what 16 rows need, and still a small part of the time the weights take to stream;
- **streaming**: the ``[block_k, block_n]`` tiles of ``w``'s column block ``j`` in the ``s``-th K chunk
  are TMA-copied into a ring of ``num_stages`` swizzled shared-memory buffers (``emit_pipeline``), each
  multiplied into a float32 accumulator by one wgmma as it lands, with ``x``'s ``[64, block_k]`` tile;
- **split-K**: with few column blocks (``N = 4096`` gives 32) K is cut into ``splits`` chunks so that
  every SM streams; each program writes its block of a float32 partial product ``[splits, M8, N]``
  (``M8``: ``M`` rounded up to 8, the padding rows left out) that the wrapper adds up and rounds.

Same function as the plain product of `matmul_reference` (float32 accumulation, rounded to the result's
dtype), within the order of the float32 sums.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.configs import DEFAULT_MULTIPROCESSORS, device_multiprocessors, mosaic_interpret_params
from pallas_kernels.matmul import check_operands

ROWS = 64  # the M of a wgmma: x's rows are padded to it
DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class MosaicMatmulConfig:
    """Tiling of one product: ``block_n`` columns and ``block_k`` rows of ``w`` a tile (64 or 128 rows:
    whole 128-byte swizzled rows of 16-bit values), ``splits`` K chunks (``0``: the fewest that give at
    least one program a streaming multiprocessor, `split_count`), ``num_stages`` tiles in flight."""

    block_n: int = 128
    block_k: int = 64
    splits: int = 0
    num_stages: int = 4

    def __post_init__(self):
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"MosaicMatmulConfig.block_n must be 64, 128 or 256, got {self.block_n!r}")
        if self.block_k not in (64, 128):
            raise ValueError(f"MosaicMatmulConfig.block_k must be 64 or 128, got {self.block_k!r}")
        if not (isinstance(self.splits, int) and self.splits >= 0):
            raise ValueError(f"MosaicMatmulConfig.splits must be an int >= 0, got {self.splits!r}")
        if not (isinstance(self.num_stages, int) and 1 <= self.num_stages <= 8):
            raise ValueError(f"MosaicMatmulConfig.num_stages must be an int in [1, 8], got {self.num_stages!r}")


def split_count(k_tiles: int, column_blocks: int, multiprocessors: int) -> int:
    """The fewest K chunks, a divisor of ``k_tiles``, with ``column_blocks * chunks >= multiprocessors``
    (all of ``k_tiles`` when none reaches it)."""
    return next((d for d in range(1, k_tiles + 1) if k_tiles % d == 0 and column_blocks * d >= multiprocessors),
                k_tiles)


def matmul_mgpu(x_MK, w_KN, *, out_dtype=None, config: MosaicMatmulConfig | None = None, interpret: bool = False):
    """``x @ w`` accumulated in float32 by the Mosaic GPU kernel (Hopper).

    Args:
      x_MK: ``[M, K]`` activations, bfloat16 or float16, ``1 <= M <= 64``.
      w_KN: ``[K, N]`` weight of ``x``'s dtype; ``K`` a multiple of ``config.block_k``, ``N`` of
        ``config.block_n``.
      out_dtype: the result's dtype (default ``x``'s).
      config: the tiling (default `MosaicMatmulConfig()`).
      interpret: run the kernel in the Mosaic GPU interpreter (CPU) instead of compiling it.

    Returns:
      ``[M, N]`` in ``out_dtype``.
    """
    config = MosaicMatmulConfig() if config is None else config
    if not isinstance(config, MosaicMatmulConfig):
        raise ValueError(f"config must be a MosaicMatmulConfig, got {config!r}")
    check_operands(x_MK, w_KN, None, False)
    (m, k), n = x_MK.shape, w_KN.shape[1]
    if not any(x_MK.dtype == d for d in DTYPES) or x_MK.dtype != w_KN.dtype:
        raise ValueError(f"x and w must share one dtype among bfloat16, float16, got {x_MK.dtype} and {w_KN.dtype}")
    if not 1 <= m <= ROWS:
        raise ValueError(f"x must have 1 to {ROWS} rows, got {m}")
    if k % config.block_k or n % config.block_n:
        raise ValueError(f"K = {k} must be a multiple of block_k = {config.block_k} and N = {n} of block_n = "
                         f"{config.block_n}")
    k_tiles = k // config.block_k
    splits = config.splits or split_count(k_tiles, n // config.block_n,
                                          device_multiprocessors() or DEFAULT_MULTIPROCESSORS)
    if k_tiles % splits:
        raise ValueError(f"splits = {splits} must divide the {k_tiles} tiles of K")
    out_dtype = jnp.dtype(x_MK.dtype if out_dtype is None else out_dtype)
    return _matmul_mgpu(x_MK, w_KN, splits=splits, out_dtype=out_dtype, config=config, interpret=bool(interpret))


def _swizzled(dtype):
    """The shared-memory layout of TMA copies and wgmma operands: 128-byte swizzled rows."""
    row_elems = 128 // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, row_elems)), plgpu.SwizzleTransform(128)


@functools.partial(jax.jit, static_argnames=("splits", "out_dtype", "config", "interpret"))
def _matmul_mgpu(x_MK, w_KN, *, splits, out_dtype, config: MosaicMatmulConfig, interpret):
    (m, k), n = x_MK.shape, w_KN.shape[1]
    bn, bk = config.block_n, config.block_k
    per_split = k // bk // splits
    rows_out = min(ROWS, -(-m // 8) * 8)  # the partials keep x's rows (whole 8-row groups), not the padding
    transforms = _swizzled(x_MK.dtype)

    def kernel(x_gmem, w_gmem, out_gmem, out_smem):
        j, s = lax.axis_index("n"), lax.axis_index("split")

        def step(_, x_smem, w_smem, acc_ref):
            plgpu.wgmma(acc_ref, x_smem, w_smem)
            plgpu.wgmma_wait(0)
            return acc_ref

        def accumulate(acc_ref):
            plgpu.emit_pipeline(
                step, grid=(per_split,), max_concurrent_steps=config.num_stages, init_carry=acc_ref,
                in_specs=[plgpu.BlockSpec((ROWS, bk), lambda t: (0, s * per_split + t), transforms=transforms),
                          plgpu.BlockSpec((bk, bn), lambda t: (s * per_split + t, j), transforms=transforms)],
            )(x_gmem, w_gmem)
            return acc_ref[...]

        out_smem[...] = pl.run_scoped(accumulate, plgpu.ACC((ROWS, bn), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[:rows_out], out_gmem.at[s, :, pl.ds(j * bn, bn)])
        plgpu.wait_smem_to_gmem(0)

    partial_SRN = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits, rows_out, n), jnp.float32),
        scratch_types=[plgpu.SMEM((ROWS, bn), jnp.float32)], grid=(n // bn, splits), grid_names=("n", "split"),
        interpret=mosaic_interpret_params() if interpret else None,
    )(jnp.pad(x_MK, ((0, ROWS - m), (0, 0))), w_KN)
    return partial_SRN.sum(axis=0)[:m].astype(out_dtype)
