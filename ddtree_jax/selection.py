"""Exact selections without long sorts: a staged top-k over wide rows and ranks by counting.

On a GPU, XLA lowers ``lax.top_k`` over a 151,936-wide row to its top-k kernel (``k <= 16``, about
44 us for the fifteen rows of one draft on an H200) or a sort of the row, and every ``lax.sort``
to several kernels; the tree build needs one top-k per depth row and one ordering per depth. The
functions here give the same results as ``lax.top_k`` and ``lax.sort`` (ties included) from group
maxima and pairwise-comparison counts, each a single fused reduction.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# Counting costs P^2 per call, a sort about log^2 P kernel stages: on an H200 counting was faster at
# P <= 960 (budgets 16 and 64, batch 1 and 8), the sort at P = 3,489 and 7,680 (budget 512, batch 8).
COUNT_MAX = 2048
# A single request's rankings are counted up to this many entries on a GPU: on an H200 the budget-512
# build at batch 1 (3,489 candidates a depth, 7,680 in the global order) took 1.04 ms counted against
# 1.22 ms sorted, while at batch 8 counting them took 15.4 ms against 1.52 ms.
SINGLE_COUNT_MAX = 8192
# The staged top-k's cost model, in kernel launches: a count of this many comparisons costs about one
# launch on an H200 (a few TB/s of comparisons against about 2.5 us per small kernel).
_COUNTS_PER_LAUNCH = 10_000_000
# What the two-stage route through ``lax.top_k`` (`_lax_two_stage`) costs, in the same launches: on an
# H200 it took 0.29 / 0.40 ms at k = 512 for 15 / 120 rows of 151,936 entries, where the seven-stage
# plan took 0.21 / 1.0 ms (modelled 36 / 128 launches).
_LAX_ROUTE_LAUNCHES = 60
_MIN_CHUNK, _MAX_CHUNK = 8, 1024


@functools.cache
def top_k_plan(vocab: int, k: int, rows: int = 1) -> tuple[int, ...] | None:
    """Group widths of `top_k`'s stages over ``rows`` rows of ``vocab`` entries; ``()`` ranks the
    row at once, ``None`` leaves it to the route through ``lax.top_k`` (`_lax_two_stage`): when every
    plan ranks more than `COUNT_MAX` entries at some stage (e.g. ``k > COUNT_MAX / 2`` on a long
    row), or when the best one is modelled to cost more than that route (`_LAX_ROUTE_LAUNCHES`).

    A stage of width ``C`` over ``P`` entries ranks ``ceil(P / C)`` groups (at most `COUNT_MAX`,
    more than ``k``) and passes ``k * C`` entries on; widths are powers of two, each dividing the
    one before. Of the feasible plans, the one with the fewest modelled launches: three per stage
    and two for the final ranking, plus ``rows x (entries ranked)^2 / _COUNTS_PER_LAUNCH``.
    """
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}], got {k}")

    @functools.cache
    def best(entries: int, widest: int) -> tuple[float, tuple[int, ...]] | None:
        options = [(2 + rows * entries**2 / _COUNTS_PER_LAUNCH, ())] if entries <= COUNT_MAX else []
        chunk = 2
        while chunk <= widest:
            groups = -(-entries // chunk)
            rest = best(k * chunk, chunk // 2) if k < groups <= COUNT_MAX else None
            if rest is not None:
                options.append((3 + rows * groups**2 / _COUNTS_PER_LAUNCH + rest[0], (chunk, *rest[1])))
            chunk *= 2
        return min(options) if options else None

    plan = best(vocab, _MAX_CHUNK)
    return None if plan is None or plan[0] > _LAX_ROUTE_LAUNCHES else plan[1]


def top_k(x_NV: Float[Array, "... V"], k: int, *, staged: bool | None = None
          ) -> tuple[Float[Array, "... K"], Int[Array, "... K"]]:
    """``lax.top_k(x_NV, k)`` exactly (values as stored and int32 indices; ties, ``-0.0 == 0.0`` among
    them, to the lower index first, on every backend and path).

    ``staged``: take it in the stages below (default: on a GPU; where `top_k_plan` gives none, by
    `_lax_two_stage`). Elsewhere ``lax.top_k`` is XLA's partial sort, which beats the counts: on a
    2-core CPU 9.5 ms against 20 ms for fifteen rows of 151,936 entries at ``k = 16``, 0.5 ms
    against 13 ms for 4,096 entries at ``k = 64``.

    In the stages of `top_k_plan`: each splits the entries still in play into groups of ``C``
    consecutive indices (the row padded with ``-inf`` at indices ``>= V``), ranks the groups by
    their best entry, (maximum descending, first index ascending), and keeps the entries of the
    ``k`` first groups; the last step ranks the entries left by (value descending, index
    ascending) and returns the first ``k``. Every rank is a pairwise count (`_first_k`).

    Why it is exact. Order all entries as ``lax.top_k`` does, by (value descending, index
    ascending); a group's best entry is its maximum at its lowest index, and since groups are
    ranges of consecutive indices, comparing groups by (maximum, first index) compares their best
    entries. Take an entry ``x`` of the true top ``k`` in a group ``g`` that was not kept: each of
    the ``k`` kept groups has a best entry before ``g``'s, hence before ``x``, so ``k`` distinct
    entries precede ``x``, a contradiction. So every stage keeps the whole true top ``k``, and the
    final ranking of a superset of it returns exactly that list. Padding follows every real entry
    (value ``-inf``, larger index), and ``k <= V`` real entries precede it.
    """
    vocab = x_NV.shape[-1]
    plan = top_k_plan(vocab, k, math.prod(x_NV.shape[:-1]))
    on_stages = jax.default_backend() == "gpu" if staged is None else staged
    if not on_stages or plan is None:  # lax.top_k's order of -0.0 and 0.0 varies: it ranks keys without -0.0
        keys = jnp.where(x_NV == 0, 0.0, x_NV)
        ids = _lax_two_stage(keys, k) if on_stages else jax.lax.top_k(keys, k)[1].astype(jnp.int32)
        return jnp.take_along_axis(x_NV, ids, axis=-1), ids
    lead = x_NV.shape[:-1]
    width = -(-vocab // plan[0]) * plan[0] if plan else vocab
    x_NW = jnp.pad(x_NV, [(0, 0)] * len(lead) + [(0, width - vocab)], constant_values=-jnp.inf)
    ids_NP = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), x_NW.shape)
    for chunk in plan:
        values_NP = x_NW if ids_NP.shape[-1] == width else jnp.take_along_axis(x_NW, ids_NP, axis=-1)
        groups = ids_NP.shape[-1] // chunk
        maxima_NG = jnp.max(values_NP.reshape(*lead, groups, chunk), axis=-1)
        _, firsts_NK = _first_k(maxima_NG, ids_NP[..., ::chunk], k)
        ids_NP = (firsts_NK[..., None] + jnp.arange(chunk, dtype=jnp.int32)).reshape(*lead, k * chunk)
    values_NP = x_NW if ids_NP.shape[-1] == width else jnp.take_along_axis(x_NW, ids_NP, axis=-1)
    return _first_k(values_NP, ids_NP, k)


def _lax_two_stage(x_NV, k):
    """The indices of `top_k` through ``lax.top_k`` (``x`` free of ``-0.0``): one stage of groups of the
    power of two nearest ``sqrt(V / k)`` (in ``[8, 1024]``), the best ``k`` groups by ``lax.top_k``
    over their maxima, gathered in ascending group order (so that ``lax.top_k``'s lower-position-first
    ties are lower-index-first ties), then ``lax.top_k`` over those ``k x C`` entries; a plain
    ``lax.top_k`` where rows are shorter than ``4 k C``. Exact by the argument of `top_k`."""
    vocab, lead = x_NV.shape[-1], x_NV.shape[:-1]
    chunk = min(max(2 ** round(math.log2(max(vocab / k, 1.0)) / 2), _MIN_CHUNK), _MAX_CHUNK)
    groups = -(-vocab // chunk)
    if vocab < 4 * k * chunk or groups <= k:
        return jax.lax.top_k(x_NV, k)[1].astype(jnp.int32)
    pad = [(0, 0)] * len(lead) + [(0, groups * chunk - vocab)]
    x_NGC = jnp.pad(x_NV, pad, constant_values=-jnp.inf).reshape(*lead, groups, chunk)
    _, groups_NK = jax.lax.top_k(jnp.max(x_NGC, axis=-1), k)
    groups_NK = jnp.sort(groups_NK.astype(jnp.int32), axis=-1)
    picked = jnp.take_along_axis(x_NGC, groups_NK[..., None], axis=-2).reshape(*lead, k * chunk)
    pos = jax.lax.top_k(picked, k)[1].astype(jnp.int32)
    return jnp.take_along_axis(groups_NK, pos // chunk, axis=-1) * chunk + pos % chunk


def _first_k(values_NP, ids_NP, k):
    """The ``k`` first entries by (value descending, id ascending), ids distinct: ``(values, ids)``
    ``[..., k]``. Each entry's place is counted from pairwise comparisons, then each output slot
    takes the entry counted to it (`_take_by_rank`)."""
    v_q, v_p = values_NP[..., :, None], values_NP[..., None, :]
    i_q, i_p = ids_NP[..., :, None], ids_NP[..., None, :]
    place_NP = jnp.sum((v_q > v_p) | ((v_q == v_p) & (i_q < i_p)), axis=-2, dtype=jnp.int32)
    return _take_by_rank(place_NP, values_NP, k), _take_by_rank(place_NP, ids_NP, k)


def _take_by_rank(ranks_NP, values_NP, size):
    """``out[..., s] = values[..., p]`` for the ``p`` with ``ranks[..., p] == s < size`` (ranks distinct
    along the last axis): a maximum over a one-hot mask, one fused reduction, exact (``-0.0`` and
    ``-inf`` stay)."""
    hit_NSP = ranks_NP[..., None, :] == jnp.arange(size, dtype=ranks_NP.dtype)[:, None]
    low = -jnp.inf if jnp.issubdtype(values_NP.dtype, jnp.floating) else jnp.iinfo(values_NP.dtype).min
    return jnp.max(jnp.where(hit_NSP, values_NP[..., None, :], low), axis=-1)


def count_limit(batch: int) -> int:
    """How many entries `ascending_ranks` and `scatter_by_rank` count (rather than sort) in each of
    ``batch`` independent rankings: `SINGLE_COUNT_MAX` for one ranking on a GPU, else `COUNT_MAX`."""
    return SINGLE_COUNT_MAX if batch == 1 and jax.default_backend() == "gpu" else COUNT_MAX


def ascending_ranks(*keys_P: Array, count_max: int = COUNT_MAX) -> Int[Array, " P"]:
    """Position of each entry when the ``[P]`` keys are sorted lexicographically, ties by index.

    ``ranks[p] = #{q : (keys[q], q) < (keys[p], p)}``, a permutation of ``0..P-1``: what a stable
    ``lax.sort`` with ``num_keys = len(keys)`` puts where. Up to ``count_max`` entries it is one fused
    ``P x P`` count, above it the inverse of a stable sort's permutation. Keys are compared with
    ``<`` and ``==`` (no NaNs; ``-0.0 == 0.0``).
    """
    n = keys_P[0].shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    if n > count_max:
        order = jax.lax.sort((*keys_P, idx), num_keys=len(keys_P) + 1)[-1]
        return jnp.zeros((n,), jnp.int32).at[order].set(idx, unique_indices=True)
    before = idx[:, None] < idx[None, :]  # before[q, p]: q sorts before p
    for key in reversed(keys_P):
        before = (key[:, None] < key[None, :]) | ((key[:, None] == key[None, :]) & before)
    return jnp.sum(before, axis=0, dtype=jnp.int32)


def scatter_by_rank(ranks_P: Int[Array, " P"], values_PX: Array, size: int, count_max: int = COUNT_MAX) -> Array:
    """``out[ranks[p]] = values[p]`` for the ``ranks < size``; ``ranks`` must be distinct and cover
    ``0..size-1`` (a permutation of ``0..P-1`` with ``P >= size``).

    Up to ``count_max`` entries each slot takes the entry ranked to it (`_take_by_rank`: one fused
    reduction, where XLA's scatter is a kernel of its own); above it, a scatter.
    """
    if ranks_P.shape[0] > count_max:
        out = jnp.zeros((size, *values_PX.shape[1:]), values_PX.dtype)
        return out.at[ranks_P].set(values_PX, mode="drop", unique_indices=True)
    return jnp.moveaxis(_take_by_rank(ranks_P, jnp.moveaxis(values_PX, 0, -1), size), -1, 0)
