"""Candidates of a truncated row: the tokens above a floor, in id order, in ``capacity`` slots,
among which the kept set is then found (``boundary``).

A floor holds when the kept set lies above it (at least k tokens reach it for top-k, at least
``top_p`` of the mass for top-p, ``holds``). The floors tried: 16 below the row max, geometric,
then 16 linear ones between the highest that holds and the one above it (``pass_floors``).
Two ways find them, both in the program of one row:

- from the sub-block maxima alone (``_sub_block_candidates``), always tried first: the floor from
  the maxima (a sub-block max above a floor is a token above it), then the tokens of the "hot"
  sub-blocks whose max reaches it; no pass over the row. It leaves a row without candidates when
  no geometric floor holds by the maxima or more than ``capacity`` tokens reach the floor;
- by the floor search over the whole row (``_find_candidates`` with ``floor_search``), for the
  rows the maxima leave without, in the walk when there are more than ``parallel_rows`` node rows:
  one pass over the row per floor pass (refined linearly at most twice), then a compaction pass.

With at most ``parallel_rows`` node rows, the rows the maxima leave without go to the floor
passes over the whole GPU instead (``fallback``), which reuse ``holds``, ``pass_floors``,
``searching``, ``refine`` and ``floor_counts``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.tree_sampling.boundary import row_boundary
from pallas_kernels.tree_sampling.common import (
    FEW_SLOTS,
    FLOORS,
    Cut,
    Slots,
    either,
    fold_row,
    pow2_at_least,
    processed,
    store_candidates,
    when,
)

FLOOR_PASSES = 3  # one geometric pass, then up to two refinements
_LN2 = 0.6931471805599453
_SUB_CHUNK = 512  # sub-block maxima compared with the floors per step
_HOT_CHUNK = 32  # sub-blocks read per step when gathering the tokens above a floor


def holds(count_F, mass_F, cut: Cut, total):
    """Floors that the kept set lies above: at least k tokens reach them (top-k), else at least
    ``top_p`` of the mass (with a margin for the rounding between these sums and the searches')."""
    return jnp.where(cut.use_k, count_F >= cut.top_k, mass_F >= cut.top_p * total * 1.0001)


def pass_floors(p, m, lo, hi):
    """The ``FLOORS`` floors of pass ``p`` of a row with max ``m``: geometric below the max, then
    linear between the highest floor found to hold (``lo``) and the one above it (``hi``)."""
    steps_F = jnp.arange(FLOORS).astype(jnp.float32)
    return jnp.where(p == 0, m - 0.25 * jnp.exp(0.5 * _LN2 * steps_F), hi - (hi - lo) * steps_F / FLOORS)


def searching(p, lo, found):
    """Whether pass ``p`` runs: no floor confines the kept set to the candidate slots yet, and the
    geometric pass found a floor that holds."""
    return (p < FLOOR_PASSES) & ~found & ((p == 0) | (lo > -jnp.inf))


def refine(lo, hi, count_lo, floors_F, count_F, ok_F, *, p, capacity):
    """After pass ``p``: ``(lo, hi, count_lo, found, first)``, ``first`` the highest floor that holds
    (``FLOORS`` if none), ``count_lo`` the tokens above ``lo``, ``found`` whether they fit the slots
    the pass aims at: ``FEW_SLOTS`` (searched in a smaller register tile) before the last pass,
    ``capacity`` at the last."""
    index_F = jnp.arange(FLOORS)
    first = jnp.min(jnp.where(ok_F, index_F, FLOORS))
    pick = lambda x_F, j: jnp.sum(jnp.where(index_F == j, x_F, 0))  # noqa: E731
    any_ok = first < FLOORS
    lo = lax.select(any_ok, pick(floors_F, first), lo)
    count_lo = lax.select(any_ok, pick(count_F, first), count_lo)
    above = lax.select(first > 0, pick(floors_F, first - 1), hi)
    hi = lax.select(any_ok, above, pick(floors_F, FLOORS - 1))
    # select, not jnp.where: a where between two Python ints lowers to an i1 in Triton.
    slots = lax.select(p < FLOOR_PASSES - 1, jnp.int32(min(FEW_SLOTS, capacity)), jnp.int32(capacity))
    return lo, hi, count_lo, count_lo <= slots, first


def floor_counts(valid, z, floors_F, m, with_mass):
    """Count and mass ``sum exp(z - m)`` of a block's tokens with ``z >= floor``, per floor; the
    mass only ``with_mass`` (else zeros: a top-k row's floors hold by the count alone)."""
    ge_FV = valid[None, :] & (z[None, :] >= floors_F[:, None])
    mass_F = when(with_mass, lambda: jnp.sum(jnp.where(ge_FV, jnp.exp(z - m)[None, :], 0.0), axis=1),
                  jnp.zeros((FLOORS,), jnp.float32))
    return jnp.sum(ge_FV.astype(jnp.int32), axis=1), mass_F


def _sub_block_floor(sub_max_ref, row, width, m, total, cut: Cut):
    """``(floor, found)``: a floor such that the sub-block maxima at or above it alone show that the
    kept set lies above it (as ``holds``): the highest of the geometric floors of ``pass_floors``
    that holds, then the highest of the linear floors between it and the one above. ``found`` is
    false when none of the geometric floors holds. The ``width`` maxima of ``sub_max_ref.at[row]``
    are read in chunks of ``_SUB_CHUNK``."""
    chunk = min(_SUB_CHUNK, pow2_at_least(width))
    index_F = jnp.arange(FLOORS)

    def highest_holding(floors_F, default):
        def step(i, acc):
            index = i * chunk + jnp.arange(chunk)
            valid = index < width
            sub_max = plt.load(sub_max_ref.at[(*row, pl.ds(i * chunk, chunk))], mask=valid, other=-jnp.inf)
            return jax.tree.map(jnp.add, acc, floor_counts(valid, sub_max, floors_F, m, ~cut.use_k))

        count_F, mass_F = lax.fori_loop(0, pl.cdiv(width, chunk), step, (jnp.zeros((FLOORS,), jnp.int32),
                                                                         jnp.zeros((FLOORS,), jnp.float32)))
        ok_F = holds(count_F, mass_F, cut, total)
        first = jnp.min(jnp.where(ok_F, index_F, FLOORS))
        pick = lambda j: jnp.sum(jnp.where(index_F == j, floors_F, 0.0))  # noqa: E731
        return lax.select(first < FLOORS, pick(first), default), first, lax.select(first > 0, pick(first - 1), m)

    lo, first, hi = highest_holding(pass_floors(0, m, -jnp.inf, m), jnp.float32(-jnp.inf))
    floor, *_ = highest_holding(pass_floors(1, m, lo, hi), lo)
    return floor, first < FLOORS


def _sub_block_candidates(sub_max_ref, logits_ref, row, hot_ref, slots: Slots, cand_row, *, m, total, scale,
                          cut: Cut, sub, capacity, vocab, barrier):
    """Candidates of a truncated row without a pass over it: the floor of ``_sub_block_floor``,
    then the tokens at or above it, read from the sub-blocks whose max reaches it ("hot", listed
    in ``hot_ref``), written in id order to candidate slots ``cand_row``. Returns their number, or
    ``-1`` when no floor was found or more than ``capacity`` tokens reach it.

    ``sub_max_ref.at[row]``: the row's sub-block maxima (``sub`` entries each); ``logits_ref.at[row]``
    its logits; ``barrier()`` orders this program's scratch writes before its reads."""
    width = sub_max_ref.shape[-1]
    size = pow2_at_least(width)
    index_S = jnp.arange(size)
    valid_S = index_S < width
    floor, found = _sub_block_floor(sub_max_ref, row, width, m, total, cut)
    sub_max_S = plt.load(sub_max_ref.at[(*row, pl.ds(0, size))], mask=valid_S, other=-jnp.inf)
    hot_S = valid_S & (sub_max_S >= floor)
    num_hot = jnp.sum(hot_S.astype(jnp.int32))

    def gather():
        plt.store(hot_ref.at[jnp.where(hot_S, jnp.cumsum(hot_S.astype(jnp.int32)) - 1, size)], index_S, mask=hot_S)
        barrier()
        lane = jnp.arange(_HOT_CHUNK * sub)

        def chunk(carry):
            i, base = carry
            h = i * _HOT_CHUNK + lane // sub
            live = h < num_hot
            ids = plt.load(hot_ref.at[jnp.where(live, h, size)], mask=live, other=0) * sub + lane % sub
            live &= ids < vocab
            z = processed(plt.load(logits_ref.at[(*row, jnp.where(live, ids, 0))], mask=live, other=0), scale)
            sel = live & (z >= floor)
            fits = sel & (base + jnp.cumsum(sel.astype(jnp.int32)) <= capacity)
            store_candidates(slots, cand_row, ids, z, fits, base, capacity)
            return i + 1, base + jnp.sum(sel.astype(jnp.int32))

        # Stops once more than ``capacity`` tokens reach the floor: the row has no candidates then.
        _, num = lax.while_loop(lambda c: (c[0] < pl.cdiv(num_hot, _HOT_CHUNK)) & (c[1] <= capacity), chunk,
                                (jnp.int32(0), jnp.int32(0)))
        barrier()
        return lax.select(num <= capacity, num, jnp.int32(-1))

    # Every hot sub-block holds a token at its max: more than ``capacity`` of them cannot fit.
    return when(found & (num_hot <= capacity), gather, jnp.int32(-1))


def _find_candidates(logits_ref, row, sub_max_ref, hot_ref, slots: Slots, cand_row, *, m, total, scale, cut: Cut,
                     vocab, block_c, sub, capacity, barrier, floor_search):
    """Candidates of a truncated row, written in id order to slots ``cand_row`` of the candidate refs;
    returns their number, ``-1`` when no floor confines the kept set to ``capacity`` tokens.

    First from the row's sub-block maxima (``_sub_block_candidates``); for a row that leaves without
    and ``floor_search``, by the floor search over the whole row (``pass_floors``, refined
    linearly, one pass over the row each, ``block_c`` entries per step), then a pass that writes
    the tokens above the floor found."""
    num = _sub_block_candidates(sub_max_ref, logits_ref, row, hot_ref, slots, cand_row, m=m, total=total, scale=scale,
                                cut=cut, sub=sub, capacity=capacity, vocab=vocab, barrier=barrier)
    if not floor_search:
        return num
    fold = lambda fn, init: fold_row(logits_ref, row, scale, vocab, fn, init, block_c)  # noqa: E731

    def search(carry):
        p, lo, hi, count_lo, _ = carry
        floors_F = pass_floors(p, m, lo, hi)
        count_F, mass_F = fold(lambda acc, ids, valid, z, i: jax.tree.map(
            jnp.add, acc, floor_counts(valid, z, floors_F, m, ~cut.use_k)), (jnp.zeros((FLOORS,), jnp.int32),
                                                                         jnp.zeros((FLOORS,), jnp.float32)))
        ok_F = holds(count_F, mass_F, cut, total)
        return (p + 1, *refine(lo, hi, count_lo, floors_F, count_F, ok_F, p=p, capacity=capacity)[:4])

    def floor_candidates():
        init = (jnp.int32(0), jnp.float32(-jnp.inf), m, jnp.int32(vocab), jnp.bool_(vocab <= capacity))
        _, lo, _, count, found = lax.while_loop(lambda c: searching(c[0], c[1], c[4]), search, init)

        def compact():
            def step(base, ids, valid, z, i):
                sel = valid & (z >= lo)
                store_candidates(slots, cand_row, ids, z, sel, base, capacity)
                return base + jnp.sum(sel.astype(jnp.int32))
            fold(step, jnp.int32(0))
            barrier()
            return count
        return when(found, compact, jnp.int32(-1))
    return either(num >= 0, lambda: num, floor_candidates)


def candidate_stats(logits_ref, row, sub_max_ref, hot_ref, slots: Slots, cand_row, *, m, total, scale, cut: Cut,
                    vocab, block_c, sub, capacity, barrier, floor_search):
    """``(num, w, c, kept)`` of a truncated row: its candidates (``_find_candidates``, with the floor
    search over the row only ``floor_search``), then its kept-set boundary and mass among them
    (``row_boundary``); ``(-1, INT_MIN, vocab, total)`` when it has none."""
    num = _find_candidates(logits_ref, row, sub_max_ref, hot_ref, slots, cand_row, m=m, total=total, scale=scale,
                           cut=cut, vocab=vocab, block_c=block_c, sub=sub, capacity=capacity, barrier=barrier,
                           floor_search=floor_search)
    return num, *row_boundary(slots, cand_row, num, m, total, cut, capacity, vocab)
