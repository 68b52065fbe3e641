"""Candidates over the whole GPU for the rows the sub-block maxima leave without.

Runs only with at most ``parallel_rows`` node rows (the rows pass found the other rows'
candidates) and only when some truncated row is marked ``search`` by the rows pass (the entry
puts it under a ``lax.cond``). For those rows: the floor search of ``candidates`` over all their
tokens (``FLOOR_PASSES`` passes, each a program per row and vocabulary block: ``_floor_kernel``),
then the tokens above the floor found written to the row's slots in id order (``_compact_kernel``,
per-block offsets from the counts), then the kept-set boundary among them (``_boundary_kernel``,
a program per row). A row that no floor confines to ``capacity`` tokens keeps ``num = -1``; the
walk then finds its kept set by passes over the row (``boundary.streamed_boundary``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.tree_sampling.boundary import row_boundary
from pallas_kernels.tree_sampling.candidates import FLOOR_PASSES, floor_counts, holds, pass_floors, refine, searching
from pallas_kernels.tree_sampling.common import (
    FLOORS,
    Cut,
    Request,
    RowStats,
    Slots,
    aliases,
    cut,
    load_block,
    store_candidates,
)


class _Compaction(NamedTuple):
    """Inputs of the compaction kernel: per row whether it runs, its scale and floor, its
    per-block offsets ``[R, P]``, its logits and its candidate ``Slots`` (updated in place)."""

    active: Any
    scale: Any
    floor: Any
    offset: Any
    logits: Any
    slots: Any


class _Compacted(NamedTuple):
    slots: Any


def _floor_kernel(mode_ref, scale_ref, max_ref, floors_ref, logits_ref, count_ref, mass_ref, *, block):
    """Program (row r, block j): ``floor_counts`` of the block; ``mode``: 0 (no pass for the row),
    1 (counts only, a top-k row), 2 (counts and masses)."""
    j = pl.program_id(1)  # read outside the branch: the interpreter cannot lower it inside
    mode = mode_ref[()]

    @pl.when(mode != 0)
    def _():
        _, valid, z = load_block(logits_ref, (), j * block, block, logits_ref.shape[0], scale_ref[()])
        count_ref[...], mass_ref[...] = floor_counts(valid, z, floors_ref[...], max_ref[()], mode == 2)


def _compact_kernel(active_ref, scale_ref, floor_ref, offset_ref, logits_ref, _slots_in, slots: Slots, *, block,
                    capacity):
    """Program (row r, block j) of an active row: writes the block's tokens with ``z >= floor`` to
    the row's candidate slots from ``offset`` on (the row's candidates in id order)."""
    j = pl.program_id(1)

    @pl.when(active_ref[()] != 0)
    def _():
        ids, valid, z = load_block(logits_ref, (), j * block, block, logits_ref.shape[0], scale_ref[()])
        store_candidates(slots, 0, ids, z, valid & (z >= floor_ref[()]), offset_ref[()], capacity)


def _boundary_kernel(num_ref, max_ref, mass_ref, cut_refs: Cut, slots: Slots, w_ref, c_ref, kept_ref, *, capacity,
                     vocab):
    """Program r: the kept-set boundary ``(w, c)`` and kept mass of row r from its candidates
    (``row_boundary``); ``(INT_MIN, vocab, total)`` for a row without candidates."""
    w_ref[()], c_ref[()], kept_ref[()] = row_boundary(
        slots, jnp.int32(0), num_ref[()], max_ref[()], mass_ref[()],
        Cut(cut_refs.use_k[()] != 0, cut_refs.use_p[()] != 0, cut_refs.top_k[()], cut_refs.top_p[()]), capacity, vocab)


def _floor_candidates(logits_RV, scale_R, max_R, mass_R, search_R, cut_R: Cut, num_R, slots_R1C: Slots, *, block,
                      capacity, params, interpret):
    """``(num_R, slots_R1C)`` with the candidates of the rows ``search_R`` found by passes over the
    whole GPU: the floor search (``pass_floors``), each pass a program per row and block (other
    rows return at once); then the tokens above the floor found are written to the row's slots in
    id order, from offsets given by the per-block counts. Other rows keep ``num_R`` and their slots."""
    rows, vocab = logits_RV.shape
    num_blocks = pl.cdiv(vocab, block)
    per_row = pl.BlockSpec((None,), lambda r, j: (r,))
    row = pl.BlockSpec((None, vocab), lambda r, j: (r, 0))
    holds_R = jax.vmap(holds)

    lo_R = jnp.full((rows,), -jnp.inf, jnp.float32)
    hi_R = max_R
    count_R = jnp.full((rows,), vocab, jnp.int32)
    found_R = jnp.full((rows,), vocab <= capacity)
    per_block_RP = jnp.broadcast_to(jnp.minimum(block, vocab - block * jnp.arange(num_blocks)), (rows, num_blocks))
    for p in range(FLOOR_PASSES):
        active_R = search_R & searching(p, lo_R, found_R)
        floors_RF = jax.vmap(functools.partial(pass_floors, p))(max_R, lo_R, hi_R)
        count_RPF, mass_RPF = pl.pallas_call(
            functools.partial(_floor_kernel, block=block), grid=(rows, num_blocks),
            in_specs=[per_row, per_row, per_row, pl.BlockSpec((None, FLOORS), lambda r, j: (r, 0)), row],
            out_specs=[pl.BlockSpec((None, None, FLOORS), lambda r, j: (r, j, 0))] * 2,
            out_shape=[jax.ShapeDtypeStruct((rows, num_blocks, FLOORS), dtype) for dtype in (jnp.int32,
                                                                                          jnp.float32)],
            compiler_params=params, interpret=interpret, name="tree_sample_floors",
        )(jnp.where(active_R, jnp.where(cut_R.use_k, 1, 2), 0), scale_R, max_R, floors_RF, logits_RV)
        count_RF = jnp.sum(count_RPF, axis=1)
        ok_RF = holds_R(count_RF, jnp.sum(mass_RPF, axis=1), cut_R, mass_R)
        *state, first_R = jax.vmap(functools.partial(refine, p=p, capacity=capacity))(
            lo_R, hi_R, count_R, floors_RF, count_RF, ok_RF)
        at_first_RP = jnp.take_along_axis(count_RPF, jnp.minimum(first_R, FLOORS - 1)[:, None, None], axis=2)[..., 0]
        per_block_RP = jnp.where((active_R & (first_R < FLOORS))[:, None], at_first_RP, per_block_RP)
        lo_R, hi_R, count_R, found_R = (jnp.where(active_R, new, old) for new, old in zip(
            state, (lo_R, hi_R, count_R, found_R)))

    compact_R = search_R & found_R
    slot = pl.BlockSpec((None, 1, capacity + 1), lambda r, j: (r, 0, 0))
    inputs = _Compaction(compact_R.astype(jnp.int32), scale_R, lo_R, jnp.cumsum(per_block_RP, axis=1) - per_block_RP,
                         logits_RV, slots_R1C)
    out_shape = _Compacted(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), slots_R1C))
    in_specs = _Compaction(per_row, per_row, per_row, pl.BlockSpec((None, None), lambda r, j: (r, j)), row,
                           Slots(slot, slot))
    out = pl.pallas_call(
        functools.partial(_compact_kernel, block=block, capacity=capacity), grid=(rows, num_blocks),
        in_specs=tuple(in_specs), out_specs=_Compacted(Slots(slot, slot)), out_shape=out_shape,
        input_output_aliases=aliases(inputs, out_shape, "slots"), compiler_params=params, interpret=interpret,
        name="tree_sample_candidates",
    )(*inputs)
    return jnp.where(compact_R, count_R, num_R), out.slots


def searched_rows(logits_BNV, request: Request, stats: RowStats, search_BN, slots: Slots, *, block_c, capacity,
                  num_warps, interpret) -> tuple[RowStats, Slots]:
    """The rows pass's ``stats`` and candidate ``slots`` with the rows ``search_BN`` completed over
    the whole GPU: their candidates by ``_floor_candidates``, then, for those that found some, their
    kept-set boundary and mass (``_boundary_kernel``, a program per row)."""
    batch, num_nodes, vocab = logits_BNV.shape
    rows = batch * num_nodes
    params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
    flat = lambda x_BN: x_BN[:, :num_nodes].reshape(rows)  # noqa: E731
    m_R, total_R = flat(stats.m), flat(stats.total)
    per_row = lambda x_B: jnp.repeat(x_B, num_nodes)  # noqa: E731
    top_k_R, top_p_R = per_row(request.top_k), per_row(request.top_p)
    cut_R = cut(per_row(request.temperature), top_k_R, top_p_R, vocab)
    search_R = search_BN.reshape(rows) != 0
    num_R, slots_R1C = _floor_candidates(
        logits_BNV.reshape(rows, vocab), per_row(request.scale), m_R, total_R, search_R, cut_R, flat(stats.num),
        Slots(*(x.reshape(rows, 1, capacity + 1) for x in slots)), block=block_c, capacity=capacity, params=params,
        interpret=interpret)
    scalar = pl.BlockSpec((None,), lambda r: (r,))
    cand_row = pl.BlockSpec((None, 1, capacity + 1), lambda r: (r, 0, 0))
    w_R, c_R, kept_R = pl.pallas_call(
        functools.partial(_boundary_kernel, capacity=capacity, vocab=vocab), grid=(rows,),
        in_specs=[scalar] * 3 + [Cut(*[scalar] * 4), Slots(cand_row, cand_row)], out_specs=[scalar] * 3,
        out_shape=[jax.ShapeDtypeStruct((rows,), dtype) for dtype in (jnp.int32, jnp.int32, jnp.float32)],
        compiler_params=params, interpret=interpret, name="tree_sample_boundaries",
    )(jnp.where(search_R, num_R, -1), m_R, total_R,
      cut_R._replace(use_k=cut_R.use_k.astype(jnp.int32), use_p=cut_R.use_p.astype(jnp.int32)), slots_R1C)
    update = lambda x_BN, x_R: x_BN.at[:, :num_nodes].set(jnp.where(search_R, x_R, flat(x_BN)).reshape(  # noqa: E731
        batch, num_nodes))
    return (stats._replace(num=update(stats.num, num_R), w=update(stats.w, w_R), c=update(stats.c, c_R),
                           kept=update(stats.kept, kept_R)),
            Slots(*(x.reshape(batch, num_nodes, capacity + 1) for x in slots_R1C)))
