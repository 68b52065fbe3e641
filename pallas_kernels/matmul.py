"""Skinny matrix products for decoding and tree verification: ``y = x @ w`` with few rows.

At decode time ``x`` has M = batch x new tokens rows (1 to a few hundred) and the product is bound
by streaming ``w`` from HBM once. Program ``(i, j, s)`` of the grid ``(M / block_m, N / block_n,
splits)`` multiplies row block i of ``x`` with column block j of ``w`` over the s-th chunk of K:

- **split-K**: with few column blocks (``N = 4096`` at M = 1 gives 64 of them) K is cut into
  ``splits`` chunks so that every SM streams; each program writes float32 partial sums
  ``[splits, M, N]`` that the wrapper adds up (XLA fuses that sum with what follows it);
- **streaming**: ``block_k``-row tiles of ``w`` (contiguous ``block_n``-column segments) go through
  a ``num_stages``-deep software pipeline into the matrix units; ``x``'s rows are padded to
  ``block_m`` (at least 16, the smallest MMA tile);
- **RMSNorm prologue** (``norm_K``): by linearity, ``rms_norm(x) @ w`` is ``(x * norm) @ w`` scaled
  row by row by ``rsqrt(mean(x^2) + eps)``; the loop accumulates the sum of squares of ``x`` beside
  the product and scales at the end, so the norm costs neither a launch nor a pass of its own;
- **residual epilogue** (``residual_MN``): ``residual + x @ w`` in the same pass (after the sum of
  the splits when there are several);
- **SwiGLU epilogue** (``gated``, one split): program j reads the gate block j and the up block j
  (``N / 2`` columns further) and writes ``silu(gate) * up``, never the ``[M, N]`` product;
- **column ranges** (``columns``): a product with a column range of ``w`` reads that range in
  place (a slice passed to a kernel call would be a copy of it).

Same function as ``matmul_reference`` (within float32 accumulation order).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.configs import MatmulConfig
from pallas_kernels.matmul_reference import swiglu


def matmul(x_MK, w_KN, *, norm_K=None, eps: float = 1e-6, gated: bool = False, out_dtype=None, columns=None,
           residual_MN=None, config: MatmulConfig | None = None, interpret: bool = False):
    """``x @ w`` (with the optional RMSNorm prologue, SwiGLU and residual epilogues) by the Pallas kernel.

    Arguments and result as ``matmul_reference``; ``config`` tiles the product (see the module
    docstring, default `MatmulConfig()`; a SwiGLU with several splits is applied after the sum),
    ``interpret`` runs the kernel in the Pallas interpreter.
    """
    columns = check_operands(x_MK, w_KN, norm_K, gated, columns)
    out_dtype = jnp.dtype(x_MK.dtype if out_dtype is None else out_dtype)
    n_out = (columns[1] - columns[0]) // (2 if gated else 1)
    if residual_MN is not None and (residual_MN.shape != (x_MK.shape[0], n_out) or residual_MN.dtype != out_dtype):
        raise ValueError(f"residual_MN must be {out_dtype} [{x_MK.shape[0]}, {n_out}], got {residual_MN.dtype} "
                         f"{residual_MN.shape}")
    return _matmul(x_MK, w_KN, norm_K, residual_MN, eps=float(eps), gated=bool(gated), out_dtype=out_dtype,
                   columns=columns, config=MatmulConfig() if config is None else config, interpret=bool(interpret))


def check_operands(x_MK, w_KN, norm_K, gated, columns=None) -> tuple[int, int]:
    """ValueError naming the operand unless shapes and dtypes fit ``matmul``; returns the column
    range ``(start, stop)`` (all of ``w``'s by default)."""
    if x_MK.ndim != 2 or w_KN.ndim != 2 or x_MK.shape[1] != w_KN.shape[0]:
        raise ValueError(f"x must be [M, K] and w [K, N], got shapes {x_MK.shape} and {w_KN.shape}")
    if x_MK.dtype != w_KN.dtype or not jnp.issubdtype(x_MK.dtype, jnp.floating):
        raise ValueError(f"x and w must share a floating dtype, got {x_MK.dtype} and {w_KN.dtype}")
    if norm_K is not None and norm_K.shape != (x_MK.shape[1],):
        raise ValueError(f"norm_K must have shape ({x_MK.shape[1]},), got {norm_K.shape}")
    if gated and w_KN.shape[1] % 2:
        raise ValueError(f"gated needs an even number of columns [gate | up], got {w_KN.shape[1]}")
    if columns is None:
        return 0, w_KN.shape[1]
    start, stop = columns
    if gated or not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= w_KN.shape[1]):
        raise ValueError(f"columns must be ints 0 <= start < stop <= {w_KN.shape[1]} (and not gated), got {columns!r}")
    return start, stop


@functools.partial(jax.jit, static_argnames=("eps", "gated", "out_dtype", "columns", "config", "interpret"))
def _matmul(x_MK, w_KN, norm_K, residual_MN, *, eps, gated, out_dtype, columns, config: MatmulConfig, interpret):
    m, k = x_MK.shape
    n = columns[1] - columns[0]
    tiles = pl.cdiv(k, config.block_k)
    per_split = pl.cdiv(tiles, config.splits)
    splits = pl.cdiv(tiles, per_split)
    fused_gate = gated and splits == 1
    n_out = n // 2 if fused_gate else n
    grid = (pl.cdiv(m, config.block_m), pl.cdiv(n_out, config.block_n), splits)
    kernel = functools.partial(_kernel, m=m, k=k, n_out=n_out, first=columns[0], half=n // 2 if fused_gate else 0,
                               per_split=per_split, tiles=tiles, eps=eps, out_dtype=out_dtype, config=config)
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((m, n_out), out_dtype), None
    else:  # float32 partial sums, and each split's sum of squares of x when it needs the norm
        out_shape = (jax.ShapeDtypeStruct((splits, m, n_out), jnp.float32),
                     None if norm_K is None else jax.ShapeDtypeStruct((splits, m, 1), jnp.float32))
    y, sum_sq = pl.pallas_call(
        kernel, grid=grid, out_shape=out_shape, interpret=interpret, name="skinny_matmul",
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    )(x_MK, w_KN, norm_K, residual_MN if splits == 1 else None)
    if splits == 1:
        return y
    y = y.sum(axis=0)
    if norm_K is not None:
        y = y * lax.rsqrt(sum_sq.sum(axis=0) / k + eps)
    y = y.astype(out_dtype)
    y = swiglu(y) if gated else y
    return y if residual_MN is None else residual_MN + y


def _kernel(x_ref, w_ref, norm_ref, residual_ref, o_ref, sum_sq_ref, *, m, k, n_out, first, half, per_split, tiles,
            eps, out_dtype, config: MatmulConfig):
    """Program (i, j, s). The RMSNorm goes through linearity: ``rms_norm(x) @ w`` is
    ``((x * norm) @ w) * rsqrt(mean(x^2) + eps)`` row by row, so the loop accumulates the product of
    ``x * norm`` and the sum of squares of ``x`` together and scales at the end (with several splits
    the wrapper scales after adding the splits up)."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows_ok = i * bm + jnp.arange(bm) < m
    cols_ok = j * bn + jnp.arange(bn) < n_out
    row_block, col_block = pl.ds(i * bm, bm), pl.ds(j * bn, bn)

    def w_tile(start, col0, k_ok):
        return plt.load(w_ref.at[pl.ds(start, bk), pl.ds(col0, bn)], mask=k_ok[:, None] & cols_ok[None, :], other=0,
                        eviction_policy="evict_first")

    def body(t, carry):
        accs, sum_sq = carry
        start = (s * per_split + t) * bk
        k_ok = start + jnp.arange(bk) < k
        x = plt.load(x_ref.at[row_block, pl.ds(start, bk)], mask=rows_ok[:, None] & k_ok[None, :], other=0)
        if norm_ref is not None:
            x32 = x.astype(jnp.float32)
            sum_sq = sum_sq + jnp.sum(x32 * x32, axis=1, keepdims=True)
            weight = plt.load(norm_ref.at[pl.ds(start, bk)], mask=k_ok, other=0)
            x = x32 * weight.astype(jnp.float32)[None, :]
        x = x.astype(w_ref.dtype)
        accs = tuple(acc + plt.dot(x, w_tile(start, col0, k_ok))
                     for acc, col0 in zip(accs, (first + j * bn, first + half + j * bn)[:len(accs)]))
        return accs, sum_sq

    count = jnp.minimum(per_split, tiles - s * per_split)
    zeros = jnp.zeros((bm, bn), jnp.float32)
    accs, sum_sq = lax.fori_loop(0, count, body, ((zeros, zeros) if half else (zeros,),
                                                  jnp.zeros((bm, 1), jnp.float32)))
    mask = rows_ok[:, None] & cols_ok[None, :]
    if sum_sq_ref is not None:  # one split of several: partial sums, scaled by the wrapper
        plt.store(o_ref.at[s, row_block, col_block], accs[0], mask=mask)
        plt.store(sum_sq_ref.at[s, row_block, pl.ds(0, 1)], sum_sq, mask=rows_ok[:, None])
        return
    if len(o_ref.shape) == 3:
        plt.store(o_ref.at[s, row_block, col_block], accs[0], mask=mask)
        return
    if norm_ref is not None:
        accs = tuple(acc * lax.rsqrt(sum_sq / k + eps) for acc in accs)
    y = accs[0].astype(out_dtype)
    if half:  # the fused SwiGLU: the product rounded to the output dtype first, as the reference does
        gate, up = (a.astype(out_dtype).astype(jnp.float32) for a in accs)
        y = (jax.nn.silu(gate).astype(out_dtype).astype(jnp.float32) * up).astype(out_dtype)
    if residual_ref is not None:
        residual = plt.load(residual_ref.at[row_block, col_block], mask=mask, other=0)
        y = (residual.astype(jnp.float32) + y.astype(jnp.float32)).astype(o_ref.dtype)
    plt.store(o_ref.at[row_block, col_block], y.astype(o_ref.dtype), mask=mask)
