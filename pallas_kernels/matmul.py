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
- **RMSNorm prologue** (``norm_K``): every program normalises its rows itself, from their sum of
  squares over the whole of K (``x`` is a few KB and stays in L2), so the norm needs no launch;
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
           config: MatmulConfig | None = None, interpret: bool = False):
    """``x @ w`` (with the optional RMSNorm prologue and SwiGLU epilogue) by the Pallas kernel.

    Arguments and result as ``matmul_reference``; ``config`` tiles the product (see the module
    docstring, default `MatmulConfig()`; a SwiGLU with several splits is applied after the sum),
    ``interpret`` runs the kernel in the Pallas interpreter.
    """
    columns = check_operands(x_MK, w_KN, norm_K, gated, columns)
    out_dtype = jnp.dtype(x_MK.dtype if out_dtype is None else out_dtype)
    return _matmul(x_MK, w_KN, norm_K, eps=float(eps), gated=bool(gated), out_dtype=out_dtype, columns=columns,
                   config=MatmulConfig() if config is None else config, interpret=bool(interpret))


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
def _matmul(x_MK, w_KN, norm_K, *, eps, gated, out_dtype, columns, config: MatmulConfig, interpret):
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
    out_shape = jax.ShapeDtypeStruct((m, n_out), out_dtype) if splits == 1 else \
        jax.ShapeDtypeStruct((splits, m, n_out), jnp.float32)
    y = pl.pallas_call(
        kernel, grid=grid, out_shape=out_shape, interpret=interpret, name="skinny_matmul",
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    )(x_MK, w_KN, norm_K)
    if splits == 1:
        return y
    y = y.sum(axis=0).astype(out_dtype)
    return swiglu(y) if gated else y


def _row_scale(x_ref, rows_ok, row_block, *, k, block_k, eps):
    """``rsqrt(mean(x^2) + eps)`` of each row of the block, from all of its K entries: ``[block_m, 1]``."""
    def body(t, acc):
        cols = t * block_k + jnp.arange(block_k)
        x = plt.load(x_ref.at[row_block, pl.ds(t * block_k, block_k)], mask=rows_ok[:, None] & (cols < k)[None, :],
                     other=0).astype(jnp.float32)
        return acc + jnp.sum(x * x, axis=1, keepdims=True)

    sum_sq = lax.fori_loop(0, pl.cdiv(k, block_k), body, jnp.zeros((rows_ok.shape[0], 1), jnp.float32))
    return lax.rsqrt(sum_sq / k + eps)


def _kernel(x_ref, w_ref, norm_ref, o_ref, *, m, k, n_out, first, half, per_split, tiles, eps, out_dtype,
            config: MatmulConfig):
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = i * bm + jnp.arange(bm)
    rows_ok = rows < m
    cols = j * bn + jnp.arange(bn)
    cols_ok = cols < n_out
    row_block = pl.ds(i * bm, bm)
    scale = None if norm_ref is None else _row_scale(x_ref, rows_ok, row_block, k=k, block_k=bk, eps=eps)

    def w_tile(start, col0, k_ok):
        return plt.load(w_ref.at[pl.ds(start, bk), pl.ds(col0, bn)], mask=k_ok[:, None] & cols_ok[None, :], other=0,
                        eviction_policy="evict_first")

    def body(t, accs):
        start = (s * per_split + t) * bk
        k_ok = start + jnp.arange(bk) < k
        x = plt.load(x_ref.at[row_block, pl.ds(start, bk)], mask=rows_ok[:, None] & k_ok[None, :], other=0)
        if scale is not None:
            weight = plt.load(norm_ref.at[pl.ds(start, bk)], mask=k_ok, other=0)
            normed = (x.astype(jnp.float32) * scale).astype(x.dtype)
            x = (weight.astype(jnp.float32)[None, :] * normed.astype(jnp.float32)).astype(
                jnp.result_type(weight, x.dtype))
        x = x.astype(w_ref.dtype)
        return tuple(acc + plt.dot(x, w_tile(start, col0, k_ok))
                     for acc, col0 in zip(accs, (first + j * bn, first + half + j * bn)[:len(accs)]))

    count = jnp.minimum(per_split, tiles - s * per_split)
    zeros = jnp.zeros((bm, bn), jnp.float32)
    accs = lax.fori_loop(0, count, body, (zeros, zeros) if half else (zeros,))
    mask = rows_ok[:, None] & cols_ok[None, :]
    if half:  # the fused SwiGLU: product rounded to the output dtype first, as the reference does
        gate, up = (a.astype(out_dtype).astype(jnp.float32) for a in accs)
        y = (jax.nn.silu(gate).astype(out_dtype).astype(jnp.float32) * up).astype(out_dtype)
    else:
        y = accs[0].astype(o_ref.dtype)
    target = o_ref.at[row_block, pl.ds(j * bn, bn)] if len(o_ref.shape) == 2 else \
        o_ref.at[s, row_block, pl.ds(j * bn, bn)]
    plt.store(target, y, mask=mask)
