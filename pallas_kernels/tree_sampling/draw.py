"""The final draw of a walk: from the residual (the kept set minus the rejected children, or the
whole kept set when that leaves no mass), by inverting its cumulative distribution in token-id
order with the request's final coin. Four ways, by the row (``sampled_draw``; greedy rows take the
argmax in the walk):

- a row with candidates: over the candidate slots in registers (``_candidate_draw``);
- an untruncated row: from the precomputed per-block masses of the statistics pass, summing again
  only the blocks that hold rejected children (``_presummed_draw``);
- a truncated row without candidates: from per-block sums of one pass over the row
  (``_streamed_draw``).

The last two finish with a cumulative sum inside the block that holds the crossing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.tree_sampling.common import (
    BlockStats,
    Cut,
    Slots,
    either,
    fold_row,
    in_slots,
    kept,
    load_block,
    load_candidates,
    order_key,
    pow2_at_least,
    rescaled,
)


class Row(NamedTuple):
    """The row a walk ends at: ``logits.at[cur]`` scaled by ``scale``, its max ``m``, kept-set
    boundary ``(w, c)``, the request's rejected-token marks and its final coin."""

    logits: Any
    cur: Any
    scale: Any
    m: Any
    w: Any
    c: Any
    rejected: Any
    coin: Any


def _candidate_draw(row: Row, slots: Slots, slot_row, num, size, vocab):
    index, live, ids, key, e = load_candidates(slots, slot_row, num, row.m, size, vocab)
    keep = live & kept(key, ids, row.w, row.c)
    marked = plt.load(row.rejected.at[jnp.where(live, ids, 0)])
    left_C = jnp.where(keep & (marked == 0), e, 0.0)
    left_C = jnp.where(jnp.sum(left_C) > 0.0, left_C, jnp.where(keep, e, 0.0))
    cum = jnp.cumsum(left_C)
    crossing = jnp.min(jnp.where(live & (cum >= row.coin * jnp.sum(left_C)), index, size))
    # The cumulative sum may round below the sum it is compared with.
    pick = lax.select(crossing < size, crossing, jnp.max(jnp.where(left_C > 0.0, index, -1)))
    return jnp.sum(jnp.where(index == pick, ids, 0))


def _residual(row: Row, start, ids, valid, z, exclude):
    keep = valid & kept(order_key(z), ids, row.w, row.c)
    if exclude:
        keep &= plt.load(row.rejected.at[pl.ds(start, ids.shape[0])], mask=valid, other=0) == 0
    return jnp.where(keep, jnp.exp(z - row.m), 0.0)


def _draw_from_blocks(row: Row, sums_K, size, exclude, vocab):
    """The crossing of the coin in the residual's cumulative mass, given its per-block sums
    (blocks of ``size`` entries): first the block, then the entry inside it. ``exclude``:
    whether the residual leaves out the rejected children."""
    block_ids = jnp.arange(sums_K.shape[0])
    cum = jnp.cumsum(sums_K)
    target = row.coin * jnp.max(cum)
    block = jnp.min(jnp.where(cum >= target, block_ids, pl.cdiv(vocab, size) - 1))
    base = jnp.sum(jnp.where(block_ids < block, sums_K, 0.0))
    ids, valid, z = load_block(row.logits, (row.cur,), block * size, size, vocab, row.scale)
    res = _residual(row, block * size, ids, valid, z, exclude)
    crossing = jnp.min(jnp.where(valid & (base + jnp.cumsum(res) >= target), ids, vocab))
    return lax.select(crossing < vocab, crossing, jnp.max(jnp.where(res > 0.0, ids, -1)))


def _draw_residual(row: Row, excluded_K, whole_K, size, vocab):
    """Draw from the residual without the rejected children (block sums ``excluded_K``); when
    that holds no mass, from the whole kept set (``whole_K()``, computed only then)."""
    return either(jnp.sum(excluded_K) > 0.0, lambda: _draw_from_blocks(row, excluded_K, size, True, vocab),
                  lambda: _draw_from_blocks(row, whole_K(), size, False, vocab))


def _streamed_draw(row: Row, vocab, block_v):
    """Truncated rows without candidates: block sums of the residual from one pass over the row."""
    block_ids = jnp.arange(pow2_at_least(pl.cdiv(vocab, block_v)))

    def sums(exclude):
        return fold_row(row.logits, (row.cur,), row.scale, vocab, lambda s, ids, valid, z, i: jnp.where(
            block_ids == i, jnp.sum(_residual(row, i * block_v, ids, valid, z, exclude)), s),
            jnp.zeros(block_ids.shape), block_v)
    return _draw_residual(row, sums(True), lambda: sums(False), block_v, vocab)


def _presummed_draw(row: Row, blocks: BlockStats, rejected_N, tokens_N, vocab, draw_block):
    """Untruncated rows: the block sums of the whole row come precomputed; only the blocks that
    hold rejected children (``rejected_N``, of node tokens ``tokens_N``) are summed again, without
    them."""
    width = blocks.mass.shape[1]
    full_K = rescaled(plt.load(blocks.mass.at[row.cur, pl.ds(0, width)]),
                      plt.load(blocks.max.at[row.cur, pl.ds(0, width)]), row.m, pl.cdiv(vocab, draw_block))
    block_ids = jnp.arange(full_K.shape[0])
    blocks_N = jnp.where(rejected_N, tokens_N // draw_block, full_K.shape[0])

    def resum(carry):
        block, sums_K = carry
        ids, valid, z = load_block(row.logits, (row.cur,), block * draw_block, draw_block, vocab, row.scale)
        sums_K = jnp.where(block_ids == block, jnp.sum(_residual(row, block * draw_block, ids, valid, z, True)), sums_K)
        return jnp.min(jnp.where(blocks_N > block, blocks_N, full_K.shape[0])), sums_K

    _, sums_K = lax.while_loop(lambda carry: carry[0] < full_K.shape[0], resum, (jnp.min(blocks_N), full_K))
    return _draw_residual(row, sums_K, lambda: full_K, draw_block, vocab)


def sampled_draw(row: Row, slots: Slots, slot_row, num, cut: Cut, rejected_N, tokens_N, blocks: BlockStats, *, vocab,
                 block_v, draw_block, capacity):
    """The final token of a sampled request's walk ending at ``row``: over the ``num`` candidates in
    slots ``slot_row`` when ``num >= 0``, else streamed (truncated) or presummed (untruncated)."""
    return either(num >= 0, lambda: in_slots(num, capacity, lambda size: _candidate_draw(
                      row, slots, slot_row, num, size, vocab)),
                  lambda: either(cut.use_k | cut.use_p, lambda: _streamed_draw(row, vocab, block_v),
                                 lambda: _presummed_draw(row, blocks, rejected_N, tokens_N, vocab, draw_block)))
