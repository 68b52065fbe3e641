"""The rows pass: a program per node row, after the statistics pass and before the walk.

Every row gets its max, first argmax and mass from its block statistics (all a greedy or
untruncated row needs). With ``candidates`` (at most ``parallel_rows`` node rows), a truncated
row also gets its candidates from its sub-block maxima alone and its kept-set boundary among them
(``candidates.candidate_stats`` without the floor search over the row); rows that this leaves
without candidates are marked (``search``) for the whole-GPU floor passes (``fallback``). With
more node rows the requests' walk programs fill the GPU, and each walk finds the candidates of
the rows it visits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.tree_sampling.candidates import candidate_stats
from pallas_kernels.tree_sampling.common import (
    INT_MIN,
    BlockStats,
    Request,
    RowStats,
    Slots,
    barrier,
    cut,
    pow2_at_least,
    rescaled,
    sub_size,
    when,
)


def _rows_kernel(request: Request, blocks: BlockStats, logits_ref, stats: RowStats, search_ref, *cands, vocab,
                 num_blocks, block_c, sub, capacity, interpret):
    """Program (b, n): node row n of request b. Its max, first argmax and mass from its block
    statistics; with ``cands`` (hot sub-blocks, candidate ``Slots``) and a truncated row, also
    ``candidate_stats`` from the sub-block maxima alone (else ``num = -1``,
    ``(w, c) = (INT_MIN, vocab)``, kept = mass); ``search``: a truncated row left without
    candidates."""
    index_K = jnp.arange(blocks.max.shape[0])
    max_K = jnp.where(index_K < num_blocks, blocks.max[...], -jnp.inf)
    m = jnp.max(max_K)
    first = jnp.min(jnp.where(max_K == m, index_K, blocks.max.shape[0]))  # the first block holding the max
    total = jnp.sum(rescaled(blocks.mass[...], max_K, m, num_blocks))
    argmax = jnp.sum(jnp.where(index_K == first, blocks.argmax[...], 0))
    stats.m[()], stats.argmax[()], stats.total[()] = m, argmax, total
    result = (jnp.int32(-1), jnp.int32(INT_MIN), jnp.int32(vocab), total)
    truncated = jnp.bool_(False)
    if cands:
        hot_ref, slots = cands
        top_k, top_p = request.top_k[()], request.top_p[()]
        row_cut = cut(request.temperature[()], top_k, top_p, vocab)
        truncated = row_cut.use_k | row_cut.use_p
        result = when(truncated, lambda: candidate_stats(
            logits_ref, (), blocks.sub_max, hot_ref, slots, jnp.int32(0), m=m, total=total, scale=request.scale[()],
            cut=row_cut, vocab=vocab, block_c=block_c, sub=sub, capacity=capacity,
            barrier=functools.partial(barrier, interpret), floor_search=False), result)
    stats.num[()], stats.w[()], stats.c[()], stats.kept[()] = result
    search_ref[()] = (truncated & (result[0] < 0)).astype(jnp.int32)


def rows(logits_BNV, request: Request, blocks: BlockStats, *, draw_block, block_c, capacity, candidates, num_warps,
         interpret):
    """A program per node row (``_rows_kernel``). Returns the ``RowStats`` (each ``[B, nodes_pad]``,
    rows past N unwritten), ``search_BN`` (nonzero: a truncated row whose sub-block maxima confined
    no candidates) and, with ``candidates``, the candidate ``Slots`` ``[B, N, capacity + 1]`` (slot
    ``capacity`` is spare), else ``()``.

    ``request``: ``[B]`` parameters; ``blocks``: the statistics of ``stats.block_stats`` (blocks
    of ``draw_block`` entries)."""
    batch, num_nodes, vocab = logits_BNV.shape
    nodes_pad = blocks.max.shape[1]
    per_request = pl.BlockSpec((None,), lambda b, n: (b,))
    per_row = pl.BlockSpec((None, None), lambda b, n: (b, n))
    row = lambda width: pl.BlockSpec((None, None, width), lambda b, n: (b, n, 0))  # noqa: E731
    out_shape = [RowStats(*(jax.ShapeDtypeStruct((batch, nodes_pad), dtype) for dtype in (
                     jnp.float32, jnp.int32, jnp.float32, jnp.int32, jnp.int32, jnp.int32, jnp.float32))),
                 jax.ShapeDtypeStruct((batch, num_nodes), jnp.int32)]
    out_specs = [RowStats(*[per_row] * len(RowStats._fields)), per_row]
    if candidates:
        hot_size = pow2_at_least(blocks.sub_max.shape[2]) + 1
        slot = jax.ShapeDtypeStruct((batch, num_nodes, capacity + 1), jnp.float32)
        out_shape += [jax.ShapeDtypeStruct((batch, num_nodes, hot_size), jnp.int32),
                      Slots(slot, jax.ShapeDtypeStruct(slot.shape, jnp.int32))]
        slot_spec = pl.BlockSpec((None, 1, capacity + 1), lambda b, n: (b, n, 0))
        out_specs += [row(hot_size), Slots(slot_spec, slot_spec)]
    in_specs = (Request(*[per_request] * 4), BlockStats(*(row(x.shape[2]) for x in blocks)), row(vocab))
    stats, search_BN, *cands = pl.pallas_call(
        functools.partial(_rows_kernel, vocab=vocab, num_blocks=pl.cdiv(vocab, draw_block), block_c=block_c,
                          sub=sub_size(draw_block), capacity=capacity, interpret=interpret),
        grid=(batch, num_nodes), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="tree_sample_rows",
    )(request, blocks, logits_BNV)
    return stats, search_BN, cands[1] if cands else ()
