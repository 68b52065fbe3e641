"""The kept set of a truncated row (top-k, then top-p), written as a boundary ``(w, c)``.

A kept set is a prefix of the order (descending z, ascending token id): token t is kept iff
``key(z_t) > w`` or ``key(z_t) == w and t < c`` (``common.kept``), ``key`` mapping float32 to int32
preserving order (``common.order_key``). Three ways find it:

- ranked (``ranked_boundary``): a row whose candidates fit ``FEW_SLOTS`` slots: each candidate's
  rank in the order and the mass before it, all pairs compared;
- searched in registers (``_candidate_boundary``): a row with more candidates (up to ``capacity``):
  ``w`` from a radix search over the candidates' keys (4 bits per step: the k-th largest key for
  top-k, the mass prefix for top-p), ``c`` from the ties' ranks;
- streamed (``streamed_boundary``, in the walk): a row that no floor confines to ``capacity``
  candidates: the same searches done bit by bit, one pass over the row per bit.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.tree_sampling.common import (
    FEW_SLOTS,
    INT_MIN,
    Cut,
    Slots,
    fold_row,
    in_slots,
    kept,
    key_value,
    load_candidates,
    order_key,
    when,
)

_PAIR_CHUNK = 32  # candidates compared with all the others per step of the ranking


def _top_k_cut(w_k, rank, ties, id_cutoff, vocab):
    """Top-k boundary at key ``w_k``: of its ``ties``, keep the first ``rank`` in id order;
    ``id_cutoff(n)`` is the id just past the n-th tie."""
    return w_k, when(ties > rank, lambda: id_cutoff(rank), jnp.int32(vocab))


def _top_p_cut(w_p, target, mass_gt, e_w, ties, id_cutoff, w, c, vocab):
    """Top-p boundary at key ``w_p``: of its ``ties``, keep the fewest (in id order) whose mass
    reaches ``target`` past ``mass_gt``; ``id_cutoff(n)`` is the id just past the n-th tie."""
    keep = jnp.clip(jnp.ceil((target - mass_gt) / e_w), 1, ties).astype(jnp.int32)
    all_ties = lax.select(w_p == w, c, jnp.int32(vocab))
    return w_p, when(keep < ties, lambda: id_cutoff(keep), all_ties)


def _radix_search(holds):
    """Largest int32 ``u`` for which the monotone (non-increasing) predicate holds, given that it
    holds at ``INT_MIN``. Four bits per step, most significant first, over ``x = u ^ INT_MIN``
    (``x`` orders like ``u`` as unsigned): ``holds(candidates_R) -> bool_R`` tests all 16 digits
    of a step at once."""
    x = jnp.int32(0)
    for shift in range(28, -1, -4):
        candidates = x | lax.shift_left(jnp.arange(16, dtype=jnp.int32), shift)
        ok = holds(candidates ^ INT_MIN)  # a prefix of trues
        digit = jnp.maximum(jnp.sum(ok.astype(jnp.int32)) - 1, 0)
        x = x | lax.shift_left(digit, shift)
    return x ^ INT_MIN


def _nth_id(in_set, n, ids, none):
    """Id of the n-th (from 1) member of ``in_set``, whose entries are in increasing id order."""
    rank = jnp.cumsum(in_set.astype(jnp.int32))
    return jnp.min(jnp.where(in_set & (rank == n), ids, none))


def _search_bits(bits, start, keep_going):
    """Largest ``u`` reachable from ``start`` by setting the ``bits`` low bits, one at a time from
    the top, while ``keep_going(candidate)`` holds (a monotone predicate)."""
    def body(i, u):
        candidate = u | lax.shift_left(jnp.int32(1), bits - 1 - i)
        return lax.select(keep_going(candidate), candidate, u)
    return lax.fori_loop(0, bits, body, start)


def _search_start(ge):
    """Where ``_search_bits`` starts a search over keys: 0 if ``ge(0)``, else ``INT_MIN``."""
    return lax.select(ge(jnp.int32(0)), jnp.int32(0), jnp.int32(INT_MIN))


def _id_bits(vocab: int) -> int:
    return max(vocab - 1, 1).bit_length()


def _ranked_boundary(slots: Slots, row, num, m, total_all, cut: Cut, size, vocab):
    """``_candidate_boundary`` of at most ``size`` candidates without a serial search: each candidate's
    rank in the order and the mass before it, from all pairs (``_PAIR_CHUNK`` candidates against
    all at a time); kept iff ``rank < k`` and ``mass before < top_p * kept-by-k mass``."""
    _, live, ids, key, e = load_candidates(slots, row, num, m, size, vocab)
    pair_chunk = min(_PAIR_CHUNK, size)

    def chunk(i, acc):
        rank, before = acc
        _, live_j, ids_j, key_j, e_j = load_candidates(slots, row, num, m, pair_chunk, vocab, start=i * pair_chunk)
        ahead_IJ = live_j[None, :] & ((key_j[None, :] > key[:, None]) | (
            (key_j[None, :] == key[:, None]) & (ids_j[None, :] < ids[:, None])))
        return (rank + jnp.sum(ahead_IJ.astype(jnp.int32), axis=1),
                before + jnp.sum(jnp.where(ahead_IJ, e_j[None, :], 0.0), axis=1))

    rank, before = lax.fori_loop(0, pl.cdiv(num, pair_chunk), chunk,
                                 (jnp.zeros((size,), jnp.int32), jnp.zeros((size,), jnp.float32)))
    in_k = live & (~cut.use_k | (rank < cut.top_k))
    target = cut.top_p * lax.select(cut.use_k, jnp.sum(jnp.where(in_k, e, 0.0)), total_all)
    keep = in_k & (~cut.use_p | (before < target))
    last = keep & (rank == jnp.max(jnp.where(keep, rank, -1)))
    return (jnp.sum(jnp.where(last, key, 0)), jnp.sum(jnp.where(last, ids, 0)) + 1,
            jnp.sum(jnp.where(keep, e, 0.0)))


def _candidate_boundary(live, ids, key, e, m, total_all, cut: Cut, vocab):
    """Top-k then top-p boundary ``(w, c)`` of a row with max ``m`` and its kept mass, from its
    candidates in registers (``e = exp(z - m)``; ``total_all``: that sum over the whole row)."""
    w, c = jnp.int32(INT_MIN), jnp.int32(vocab)

    def top_k_boundary():
        ge = lambda u_R: jnp.sum((live[None, :] & (key[None, :] >= u_R[:, None])).astype(  # noqa: E731
            jnp.int32), axis=1) >= cut.top_k
        w_k = _radix_search(ge)
        rank = cut.top_k - jnp.sum((live & (key > w_k)).astype(jnp.int32))
        tie = live & (key == w_k)
        return _top_k_cut(w_k, rank, jnp.sum(tie.astype(jnp.int32)),
                          lambda n: _nth_id(tie, n, ids, vocab) + 1, vocab)

    def top_p_boundary(w, c):
        in_k = live & kept(key, ids, w, c)
        target = cut.top_p * lax.select(cut.use_k, jnp.sum(jnp.where(in_k, e, 0.0)), total_all)
        ge = lambda u_R: jnp.sum(jnp.where(  # noqa: E731
            in_k[None, :] & (key[None, :] >= u_R[:, None]), e[None, :], 0.0), axis=1) >= target
        w_p = _radix_search(ge)
        mass_gt = jnp.sum(jnp.where(in_k & (key > w_p), e, 0.0))
        tie = in_k & (key == w_p)
        return _top_p_cut(w_p, target, mass_gt, jnp.exp(key_value(w_p) - m),
                          jnp.sum(tie.astype(jnp.int32)),
                          lambda n: _nth_id(tie, n, ids, vocab) + 1, w, c, vocab)

    w, c = when(cut.use_k, top_k_boundary, (w, c))
    w, c = when(cut.use_p, lambda: top_p_boundary(w, c), (w, c))
    return w, c, jnp.sum(jnp.where(live & kept(key, ids, w, c), e, 0.0))


def row_boundary(slots: Slots, row, num, m, total_all, cut: Cut, capacity, vocab):
    """Boundary ``(w, c)`` and kept mass of the ``num`` candidates in slots ``row`` of the candidate
    refs: ranked (``_ranked_boundary``) when they fit ``FEW_SLOTS``, else searched in registers
    (``_candidate_boundary``); ``(INT_MIN, vocab, total_all)`` when ``num < 0`` (no candidates)."""
    def boundary(size):
        if size <= FEW_SLOTS:
            return _ranked_boundary(slots, row, num, m, total_all, cut, size, vocab)
        _, live, ids, key, e = load_candidates(slots, row, num, m, size, vocab)
        return _candidate_boundary(live, ids, key, e, m, total_all, cut, vocab)
    return when(num >= 0, lambda: in_slots(num, capacity, boundary), (jnp.int32(INT_MIN), jnp.int32(vocab), total_all))


def streamed_boundary(logits_ref, row, scale, vocab, block_v, m, cut: Cut):
    """Boundary ``(w, c)`` and kept mass of logits row ``logits_ref.at[row]`` (max ``m``) by bit
    searches, each step a pass over the row in ``block_v`` blocks: for kept sets that no floor
    confines to the candidate slots."""
    def count(pred):
        return fold_row(logits_ref, row, scale, vocab, lambda n, ids, valid, z, i: n + jnp.sum(
            (valid & pred(order_key(z), ids)).astype(jnp.int32)), jnp.int32(0), block_v)

    def mass(pred):
        return fold_row(logits_ref, row, scale, vocab, lambda s, ids, valid, z, i: s + jnp.sum(
            jnp.where(valid & pred(order_key(z), ids), jnp.exp(z - m), 0.0)), jnp.float32(0.0), block_v)

    def id_cutoff(w, rank, in_set):
        """Smallest c such that ``rank`` tokens of ``in_set`` with key w have an id < c."""
        below = lambda c: count(lambda key, ids: in_set(key, ids) & (key == w) & (ids < c))  # noqa: E731
        return _search_bits(_id_bits(vocab), jnp.int32(0), lambda c: below(c) < rank) + 1

    def top_k_boundary():
        ge = lambda u: count(lambda key, ids: key >= u) >= cut.top_k  # noqa: E731
        w_k = _search_bits(31, _search_start(ge), ge)
        rank = cut.top_k - count(lambda key, ids: key > w_k)
        everything = lambda key, ids: key == key  # noqa: E731
        return _top_k_cut(w_k, rank, count(lambda key, ids: key == w_k),
                          lambda n: id_cutoff(w_k, n, everything), vocab)

    def top_p_boundary(w, c):
        in_k = lambda key, ids: kept(key, ids, w, c)  # noqa: E731
        target = cut.top_p * mass(in_k)
        ge = lambda u: mass(lambda key, ids: in_k(key, ids) & (key >= u)) >= target  # noqa: E731
        w_p = _search_bits(31, _search_start(ge), ge)
        mass_gt = mass(lambda key, ids: in_k(key, ids) & (key > w_p))
        tie = lambda key, ids: in_k(key, ids) & (key == w_p)  # noqa: E731
        return _top_p_cut(w_p, target, mass_gt, jnp.exp(key_value(w_p) - m), count(tie),
                          lambda n: id_cutoff(w_p, n, in_k), w, c, vocab)

    w, c = jnp.int32(INT_MIN), jnp.int32(vocab)
    w, c = when(cut.use_k, top_k_boundary, (w, c))
    w, c = when(cut.use_p, lambda: top_p_boundary(w, c), (w, c))
    return w, c, mass(lambda key, ids: kept(key, ids, w, c))
