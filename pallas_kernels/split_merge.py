"""The attention's split outputs merged in one kernel (the second pass of flash-decoding).

The tree-attention kernel, cut into ``J`` splits of the keys, writes for each split ``j`` and packed row
``r`` the split's output divided by its own softmax sum (``o[b, j, r]``, the activations' dtype) and its
running max and sum (``m``, ``l``, float32). `split_k.merge_normalized_splits` combines them in jnp, which
XLA runs as two or three fusions (the maxima and the weights, the weighted sum, the cast). Program ``(b, p)``
of the grid ``(B, R / block_rows)`` here reads its rows' maxima and sums of every split, weighs the splits
by ``exp(m - max m) * l`` and sums their outputs in one pass, storing the result in the output dtype.

Same function as ``merge_normalized_splits`` (then cast to the output dtype) within the order of its
float32 sums: the splits are added in order here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.configs import is_pow2

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def merge_splits_kernel(o_BJRD, m_BJR, l_BJR, *, out_dtype=None, block_rows: int = 16, num_warps: int = 4,
                        interpret: bool = False):
    """``merge_normalized_splits(o, m, l)`` cast to ``out_dtype`` (default ``o``'s), by the Pallas kernel
    (Triton lowering).

    Args:
      o_BJRD: ``[B, J, R, D]`` split outputs, each divided by its split's softmax sum (0 where the split
        saw no key), float32, bfloat16 or float16; ``D`` a power of two.
      m_BJR, l_BJR: ``[B, J, R]`` float32 running max and sum of each split.
      block_rows: rows a program, a power of two; the largest power of two dividing ``R`` when smaller.
      num_warps: a program's warps.
      interpret: run the kernel in the Pallas interpreter (any platform) instead of compiling it.

    Returns:
      ``[B, R, D]`` in ``out_dtype``.
    """
    check_operands(o_BJRD, m_BJR, l_BJR)
    if not is_pow2(block_rows):
        raise ValueError(f"block_rows must be a power of two, got {block_rows!r}")
    out_dtype = jnp.dtype(o_BJRD.dtype if out_dtype is None else out_dtype)
    return _merge(o_BJRD, m_BJR, l_BJR, out_dtype=out_dtype, block_rows=merge_block_rows(o_BJRD.shape[2], block_rows),
                  num_warps=int(num_warps), interpret=bool(interpret))


def check_operands(o_BJRD, m_BJR, l_BJR) -> None:
    """ValueError naming the operand unless the shapes and dtypes fit `merge_splits_kernel`."""
    if o_BJRD.ndim != 4 or not any(o_BJRD.dtype == d for d in DTYPES) or not is_pow2(o_BJRD.shape[3]):
        raise ValueError(f"o_BJRD must be a float32, bfloat16 or float16 [B, J, R, D] with D a power of two, "
                         f"got {o_BJRD.dtype} {o_BJRD.shape}")
    for name, x in (("m_BJR", m_BJR), ("l_BJR", l_BJR)):
        if x.shape != o_BJRD.shape[:3] or x.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32 {o_BJRD.shape[:3]}, got {x.dtype} {x.shape}")


def merge_block_rows(rows: int, most: int) -> int:
    """Rows a program: the largest power of two up to ``most`` that divides ``rows``."""
    block = 1
    while block * 2 <= most and rows % (block * 2) == 0:
        block *= 2
    return block


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_rows", "num_warps", "interpret"))
def _merge(o_BJRD, m_BJR, l_BJR, *, out_dtype, block_rows, num_warps, interpret):
    batch, splits, rows, head_dim = o_BJRD.shape
    stats_spec = pl.BlockSpec((None, splits, block_rows), lambda b, p: (b, 0, p))
    return pl.pallas_call(
        _kernel, grid=(batch, rows // block_rows),
        in_specs=[pl.BlockSpec((None, splits, block_rows, head_dim), lambda b, p: (b, 0, p, 0)),
                  stats_spec, stats_spec],
        out_specs=pl.BlockSpec((None, block_rows, head_dim), lambda b, p: (b, p, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, rows, head_dim), out_dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="split_merge",
    )(o_BJRD, m_BJR, l_BJR)


def _kernel(o_ref, m_ref, l_ref, out_ref):
    """Program (b, p): rows ``[p * block_rows, (p + 1) * block_rows)`` of request b, every split read once
    (each split's row of ``o``, ``m`` and ``l`` a load: ``J`` need not be a power of two)."""
    splits = m_ref.shape[0]
    m_J = [m_ref[j] for j in range(splits)]
    top = functools.reduce(jnp.maximum, m_J)
    total = jnp.zeros_like(top)
    acc = jnp.zeros(out_ref.shape, jnp.float32)
    for j in range(splits):
        w = jnp.exp(m_J[j] - top) * l_ref[j]
        total = total + w
        acc = acc + w[:, None] * o_ref[j].astype(jnp.float32)
    out_ref[...] = (acc / jnp.where(total > 0, total, 1.0)[:, None]).astype(out_ref.dtype)
