"""A matrix read into the GPU's L2 cache ahead of its product, by a kernel that runs beside other work.

Between the products of a decoder layer run launches that leave HBM idle: at one token the q/k norm +
RoPE + cache write, the attention and the merge of its splits take about 9 us a layer on an H100 before
the attention output product, whose 33.5 MB at Qwen3-8B shapes fit the 50 MB L2. This kernel reads the
first ``tiles`` tiles of a matrix (its elements in row-major order as rows of ``cols``, ``block_rows``
rows a tile) with the evict-last policy, so that a product launched after it finds them in L2; program
``p`` of ``P`` reads tiles ``p, p + P, ...``, so that the programs stream one region together. Each
program stores the maximum of what it read, which gives the reads a use; ``ddtree_jax.kernels`` runs the
kernel on a second stream, after the product before and ahead of the product that reads the matrix.

Same result as ``l2_prefetch_reference``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.configs import is_pow2
from pallas_kernels.l2_prefetch_reference import check_operands


def l2_prefetch(w, after=None, *, tiles: int, programs: int, block_rows: int = 64, cols: int = 512,
                num_warps: int = 8, interpret: bool = False):
    """`l2_prefetch_reference` by the Pallas kernel (Triton lowering); same arguments and result, plus
    ``after`` (any array, not read: the kernel's launch waits for it), ``num_warps`` and ``interpret``
    (run in the Pallas interpreter). ``block_rows`` and ``cols`` must be powers of two."""
    _check_launch(w, tiles, programs, block_rows, cols)
    after = jnp.zeros((), jnp.int32) if after is None else after
    return _l2_prefetch(w, after, tiles=tiles, programs=programs, block_rows=block_rows, cols=cols,
                        num_warps=int(num_warps), interpret=bool(interpret))


def l2_prefetch_rows(w_RC, after, *, tiles: int, programs: int, block_rows: int, num_warps: int, interpret: bool):
    """`l2_prefetch` of a matrix already viewed as rows of ``cols`` (``[R, cols]``), not jitted: the launch is a
    single custom call in the caller's program, for a caller that sets attributes on it (``ddtree_jax.kernels``
    sets the stream)."""
    _check_launch(w_RC, tiles, programs, block_rows, w_RC.shape[-1])
    return _launch(w_RC, after, tiles=tiles, programs=programs, block_rows=block_rows, num_warps=num_warps,
                   interpret=interpret)


def _check_launch(w, tiles, programs, block_rows, cols) -> None:
    check_operands(w, tiles=tiles, programs=programs, block_rows=block_rows, cols=cols)
    if not (is_pow2(block_rows) and is_pow2(cols)):
        raise ValueError(f"the l2_prefetch kernel needs powers of two for block_rows and cols, got {block_rows}, "
                         f"{cols}")


@functools.partial(jax.jit, static_argnames=("tiles", "programs", "block_rows", "cols", "num_warps", "interpret"))
def _l2_prefetch(w, after, *, tiles, programs, block_rows, cols, num_warps, interpret):
    return _launch(w.reshape(-1, cols), after, tiles=tiles, programs=programs, block_rows=block_rows,
                   num_warps=num_warps, interpret=interpret)


def _launch(w_RC, after, *, tiles, programs, block_rows, num_warps, interpret):
    return pl.pallas_call(
        functools.partial(_kernel, tiles=tiles, block_rows=block_rows), grid=(programs,),
        in_specs=[pl.BlockSpec(w_RC.shape, lambda p: (0, 0)),
                  pl.BlockSpec(after.shape, lambda p: (0,) * after.ndim)],
        out_specs=pl.BlockSpec((None,), lambda p: (p,)),
        out_shape=jax.ShapeDtypeStruct((programs,), jnp.float32), interpret=interpret, name="l2_prefetch",
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
    )(w_RC, after)


def _kernel(w_ref, after_ref, out_ref, *, tiles, block_rows):
    """Program p: the maximum of tiles ``p, p + P, ...`` below ``tiles``; ``after_ref`` is never read."""
    del after_ref
    p, programs = pl.program_id(0), pl.num_programs(0)

    def read(t, acc):
        rows = pl.ds((p + t * programs) * block_rows, block_rows)
        return jnp.maximum(acc, plt.load(w_ref.at[rows, :], eviction_policy="evict_last").astype(jnp.float32).max())

    count = lax.div(jnp.maximum(tiles - p + programs - 1, 0), programs)
    out_ref[()] = lax.fori_loop(0, count, read, jnp.float32(-jnp.inf))
