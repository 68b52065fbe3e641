"""Fused tree verification from target logits: one Pallas program per request walks its tree.

Same result as ``ddtree_jax.verify.verify_from_coins`` (the jnp path) for the same coins: the
walk of DESIGN.md §2 (sgl-kernel "target-only" tree rejection sampling, thresholds 1), where the
processed target row (``z = logits * (1 / T)``, then top-k, then top-p, see
``ddtree_jax.sampling``) is never materialised and never sorted.

Before the walk, two passes over every node row (a program per row, and per vocabulary block for
the first, so that the whole GPU works even for one request):

- statistics (one read of the logits; ``stats_blocks`` blocks of 2,048 entries per program):
  per block, ``max z``, its first argmax and ``sum exp(z - block max)``, and the max of every
  64-entry sub-block;
- rows: a program per row combines its blocks into ``m = max z``, the first argmax and
  ``sum exp(z - m)`` (a greedy or untruncated row needs nothing more), and, when there are at most
  ``parallel_rows`` node rows, finds the candidates and kept set of a truncated (top-k / top-p)
  row. It picks a floor from the row's sub-block maxima alone (at least k maxima above it for
  top-k, at least ``top_p`` of the mass in them for top-p: 16 floors below ``m``, geometric, then
  16 linear ones) and writes the tokens above it, in id order, to the row's candidate slots,
  reading only the sub-blocks whose max reaches the floor. Rows for which that finds no floor,
  or more than ``capacity`` tokens above it, get theirs, only when there are such rows, from
  passes over the whole GPU (the same floors over all tokens, refined linearly at most twice,
  then a compaction pass; a program per row and vocabulary block), then their kept sets from a
  program per row. With more node rows the requests' programs fill the GPU, and each walk finds
  the candidates of the rows it visits only, searching the floors over a row itself where the
  maxima do not suffice.

A kept set is a prefix of the order (descending z, ascending token id), written as a boundary
``(w, c)``: token t is kept iff ``key(z_t) > w`` or ``key(z_t) == w and t < c``, where ``key``
maps float32 to int32 preserving order. Among at most 256 candidates it is read off each one's
rank in the order and the mass before it (all pairs compared); among more, ``w`` comes from a radix
search in registers (4 bits per step, the k-th largest key for top-k, the mass prefix for top-p)
and ``c`` from the ties' ranks. Kept sets that no floor confines to ``capacity`` tokens fall back
to the same searches done bit by bit, in the walk, with one pass over the row per bit.

Accepting a child reads only the children's logits. The final draw removes the rejected
children (marked in a per-request scratch row) and inverts the cumulative distribution in
token-id order: over the candidates in registers; for an untruncated row from the precomputed
block sums, summing again only the blocks that hold rejected children; otherwise from per-block
sums of one pass. In each case a cumulative sum inside the block that holds the crossing
finishes it.

Probabilities are summed in another order than the jnp path, so they may differ in the last
bits; accepted paths and tokens agree except when a coin falls within that rounding of a
boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ddtree_jax.sampling import inverse_temperature
from ddtree_jax.tree import DraftTree
from ddtree_jax.verify import VerifyResult, verify_from_coins
from pallas_kernels.configs import device_capability

BACKENDS = ("auto", "triton", "interpret", "xla")
_INT_MIN = -(2**31)
_SIGN_OFF = 0x7FFFFFFF
_FLOORS = 16  # candidate floors tried per pass
_FLOOR_PASSES = 3  # one geometric pass, then up to two refinements
_LN2 = 0.6931471805599453
_DRAW_BLOCK = 2048  # entries per precomputed block mass of the final draw
_FEW_SLOTS = 256  # candidates ranked (all pairs), not searched, and drawn from in a smaller tile when they fit it
_PAIR_CHUNK = 32  # candidates compared with all the others per step of the ranking
_SUB = 64  # entries per sub-block whose max the statistics keep
_SUB_CHUNK = 512  # sub-block maxima compared with the floors per step
_HOT_CHUNK = 32  # sub-blocks read per step when gathering the tokens above a floor
# Up to this many node rows (batch x nodes), candidates are found a program per row; beyond, the
# walk of each request finds those of the rows it visits (fewer rows, and the requests fill the GPU).
PARALLEL_ROWS = 1024


def tree_sample(tree: DraftTree, target_logits_BNV, coins_BN, final_coins_B, temperature_B, top_k_B,
                top_p_B, *, backend="auto", block_v=32768, num_warps=8, num_stages=1,
                capacity=2048, stats_blocks=1, parallel_rows=PARALLEL_ROWS) -> VerifyResult:
    """Verify each request's tree against the target logits (greedy and sampled requests mixed).

    Args:
      tree: the drafted trees (``N`` nodes each, ``tree.max_depth`` levels).
      target_logits_BNV: ``[B, N, V]`` float32 or bfloat16 target logits after each node.
      coins_BN: float32 ``[B, N]`` in ``(0, 1]``; node k's coin chooses among k's children.
      final_coins_B: float32 ``[B]`` in ``(0, 1]`` for the final (bonus) draw.
      temperature_B, top_k_B, top_p_B: ``[B]`` sampling parameters (``temperature <= 0`` is greedy,
        ``top_k = 0`` and ``top_p >= 1`` are off).
      backend: ``"triton"`` (Pallas kernel on a CUDA GPU), ``"interpret"`` (the same kernel
        interpreted), ``"xla"`` (``verify_from_coins``) or ``"auto"`` (triton on a CUDA GPU, else xla).
      block_v: vocabulary entries per block (a power of two); num_warps, num_stages: Triton warps
        per program and software-pipelining depth of the vocabulary loops.
      capacity: candidate slots per node row (a power of two): a truncated kept set that fits
        them is searched in registers; a larger one by passes over the row.
      stats_blocks: vocabulary blocks (of 2,048 entries at most) per program of the row-statistics
        pass; more blocks mean fewer, longer programs.
      parallel_rows: with at most this many node rows (``B * N``), the candidates of every
        truncated row are found before the walk, a program per row; with more, each request's
        program finds those of the rows it visits.

    Returns:
      ``VerifyResult`` as ``verify_from_coins``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    if capacity < 16 or capacity & (capacity - 1):
        raise ValueError(f"capacity must be a power of two >= 16, got {capacity}")
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two in [1, 32], got {num_warps}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not isinstance(stats_blocks, int) or stats_blocks < 1:
        raise ValueError(f"stats_blocks must be an int >= 1, got {stats_blocks!r}")
    if not isinstance(parallel_rows, int) or parallel_rows < 0:
        raise ValueError(f"parallel_rows must be an int >= 0, got {parallel_rows!r}")
    batch, num_nodes = tree.tokens.shape
    if target_logits_BNV.ndim != 3 or target_logits_BNV.shape[:2] != (batch, num_nodes):
        raise ValueError(f"target_logits must be [B={batch}, N={num_nodes}, V], got "
                         f"{target_logits_BNV.shape}")
    if backend == "auto":
        on_cuda = jax.default_backend() == "gpu" and device_capability() >= (8, 0)
        backend = "triton" if on_cuda else "xla"
    if backend == "xla":
        return verify_from_coins(tree, target_logits_BNV, coins_BN, final_coins_B, temperature_B,
                                 top_k_B, top_p_B)
    return _tree_sample_pallas(tree.tokens, tree.parents, target_logits_BNV,
                               jnp.asarray(coins_BN, jnp.float32),
                               jnp.asarray(final_coins_B, jnp.float32),
                               jnp.asarray(temperature_B, jnp.float32),
                               jnp.asarray(top_k_B, jnp.int32), jnp.asarray(top_p_B, jnp.float32),
                               max_depth=tree.max_depth, block_v=block_v, num_warps=num_warps,
                               num_stages=num_stages, capacity=capacity, stats_blocks=stats_blocks,
                               parallel_rows=parallel_rows,
                               interpret=backend == "interpret")


def _order_key(z):
    """int32 keys ordered like the float32 values ``z`` (``-0.0`` counts as ``0.0``)."""
    bits = lax.bitcast_convert_type(jnp.where(z == 0.0, 0.0, z), jnp.int32)
    return jnp.where(bits < 0, bits ^ _SIGN_OFF, bits)


def _key_value(key):
    """Inverse of ``_order_key`` for one key."""
    return lax.bitcast_convert_type(jnp.where(key < 0, key ^ _SIGN_OFF, key), jnp.float32)


def _kept(key, ids, w, c):
    """Membership in the kept set with boundary ``(w, c)``."""
    return (key > w) | ((key == w) & (ids < c))


def _barrier(interpret):
    """Orders a program's scratch writes before its reads by other threads (none interpreted)."""
    if not interpret:
        plt.debug_barrier()


def _either(pred, true_fn, false_fn):
    """``true_fn()`` if ``pred`` else ``false_fn()``; only the taken branch runs.

    Every output passes through a select on ``pred``: a Triton branch cannot yield a constant.
    """
    def branch(fn):
        return lambda _: jax.tree.map(lambda v: jnp.where(pred, v, v), fn())
    return lax.cond(pred, branch(true_fn), branch(false_fn), None)


def _when(pred, fn, default):
    """``fn()`` if ``pred`` else ``default``; only the taken branch runs."""
    return _either(pred, fn, lambda: default)


def _search_bits(bits, start, keep_going):
    """Largest ``u`` reachable from ``start`` by setting the ``bits`` low bits, one at a time from
    the top, while ``keep_going(candidate)`` holds (a monotone predicate)."""
    def body(i, u):
        candidate = u | lax.shift_left(jnp.int32(1), bits - 1 - i)
        return lax.select(keep_going(candidate), candidate, u)
    return lax.fori_loop(0, bits, body, start)


def _search_start(ge):
    """Where ``_search_bits`` starts a search over keys: 0 if ``ge(0)``, else ``INT_MIN``."""
    return lax.select(ge(jnp.int32(0)), jnp.int32(0), jnp.int32(_INT_MIN))


def _id_bits(vocab: int) -> int:
    return max(vocab - 1, 1).bit_length()


def _top_k_cut(w_k, rank, ties, id_cutoff, vocab):
    """Top-k boundary at key ``w_k``: of its ``ties``, keep the first ``rank`` in id order;
    ``id_cutoff(n)`` is the id just past the n-th tie."""
    return w_k, _when(ties > rank, lambda: id_cutoff(rank), jnp.int32(vocab))


def _top_p_cut(w_p, target, mass_gt, e_w, ties, id_cutoff, w, c, vocab):
    """Top-p boundary at key ``w_p``: of its ``ties``, keep the fewest (in id order) whose mass
    reaches ``target`` past ``mass_gt``; ``id_cutoff(n)`` is the id just past the n-th tie."""
    keep = jnp.clip(jnp.ceil((target - mass_gt) / e_w), 1, ties).astype(jnp.int32)
    all_ties = lax.select(w_p == w, c, jnp.int32(vocab))
    return w_p, _when(keep < ties, lambda: id_cutoff(keep), all_ties)


def _radix_search(holds):
    """Largest int32 ``u`` for which the monotone (non-increasing) predicate holds, given that it
    holds at ``INT_MIN``. Four bits per step, most significant first, over ``x = u ^ INT_MIN``
    (``x`` orders like ``u`` as unsigned): ``holds(candidates_R) -> bool_R`` tests all 16 digits
    of a step at once."""
    x = jnp.int32(0)
    for shift in range(28, -1, -4):
        candidates = x | lax.shift_left(jnp.arange(16, dtype=jnp.int32), shift)
        ok = holds(candidates ^ _INT_MIN)  # a prefix of trues
        digit = jnp.maximum(jnp.sum(ok.astype(jnp.int32)) - 1, 0)
        x = x | lax.shift_left(digit, shift)
    return x ^ _INT_MIN


def _nth_id(in_set, n, ids, none):
    """Id of the n-th (from 1) member of ``in_set``, whose entries are in increasing id order."""
    rank = jnp.cumsum(in_set.astype(jnp.int32))
    return jnp.min(jnp.where(in_set & (rank == n), ids, none))


def _in_slots(num, capacity, fn):
    """``fn(size)`` for the fewer of ``_FEW_SLOTS`` or ``capacity`` candidate slots that hold ``num``
    candidates: the boundary and the draw work on every slot they load."""
    few = min(_FEW_SLOTS, capacity)
    return fn(capacity) if few == capacity else _either(num <= few, lambda: fn(few), lambda: fn(capacity))


def _load_candidates(cand_z_ref, cand_id_ref, row, num, m, size, vocab, start=0):
    """``(slots, live, ids, keys, exp(z - m))`` of candidate slots ``[start, start + size)`` of ``row``,
    of which those below ``num`` are live (the others read as id ``vocab``, mass 0)."""
    slots = start + jnp.arange(size)
    live = slots < num
    z = jnp.where(live, plt.load(cand_z_ref.at[row, pl.ds(start, size)]), -jnp.inf)
    ids = jnp.where(live, plt.load(cand_id_ref.at[row, pl.ds(start, size)]), vocab)
    return slots, live, ids, _order_key(z), jnp.where(live, jnp.exp(z - m), 0.0)


def _ranked_boundary(cand_z_ref, cand_id_ref, row, num, m, total_all, use_k, use_p, top_k, top_p, size, vocab):
    """``_candidate_boundary`` of at most ``size`` candidates without a serial search: each candidate's
    rank in the order and the mass before it, from all pairs (``_PAIR_CHUNK`` candidates against
    all at a time); kept iff ``rank < k`` and ``mass before < top_p * kept-by-k mass``."""
    _, live, ids, key, e = _load_candidates(cand_z_ref, cand_id_ref, row, num, m, size, vocab)
    pair_chunk = min(_PAIR_CHUNK, size)

    def chunk(i, acc):
        rank, before = acc
        _, live_j, ids_j, key_j, e_j = _load_candidates(cand_z_ref, cand_id_ref, row, num, m, pair_chunk, vocab,
                                                        start=i * pair_chunk)
        ahead_IJ = live_j[None, :] & ((key_j[None, :] > key[:, None]) | (
            (key_j[None, :] == key[:, None]) & (ids_j[None, :] < ids[:, None])))
        return (rank + jnp.sum(ahead_IJ.astype(jnp.int32), axis=1),
                before + jnp.sum(jnp.where(ahead_IJ, e_j[None, :], 0.0), axis=1))

    rank, before = lax.fori_loop(0, pl.cdiv(num, pair_chunk), chunk,
                                 (jnp.zeros((size,), jnp.int32), jnp.zeros((size,), jnp.float32)))
    in_k = live & (~use_k | (rank < top_k))
    target = top_p * lax.select(use_k, jnp.sum(jnp.where(in_k, e, 0.0)), total_all)
    kept = in_k & (~use_p | (before < target))
    last = kept & (rank == jnp.max(jnp.where(kept, rank, -1)))
    return (jnp.sum(jnp.where(last, key, 0)), jnp.sum(jnp.where(last, ids, 0)) + 1,
            jnp.sum(jnp.where(kept, e, 0.0)))


def _candidate_boundary(live, ids, key, e, m, total_all, use_k, use_p, top_k, top_p, vocab):
    """Top-k then top-p boundary ``(w, c)`` of a row with max ``m`` and its kept mass, from its
    candidates in registers (``e = exp(z - m)``; ``total_all``: that sum over the whole row)."""
    w, c = jnp.int32(_INT_MIN), jnp.int32(vocab)

    def top_k_boundary():
        ge = lambda u_R: jnp.sum((live[None, :] & (key[None, :] >= u_R[:, None])).astype(  # noqa: E731
            jnp.int32), axis=1) >= top_k
        w_k = _radix_search(ge)
        rank = top_k - jnp.sum((live & (key > w_k)).astype(jnp.int32))
        tie = live & (key == w_k)
        return _top_k_cut(w_k, rank, jnp.sum(tie.astype(jnp.int32)),
                          lambda n: _nth_id(tie, n, ids, vocab) + 1, vocab)

    def top_p_boundary(w, c):
        in_k = live & _kept(key, ids, w, c)
        target = top_p * lax.select(use_k, jnp.sum(jnp.where(in_k, e, 0.0)), total_all)
        ge = lambda u_R: jnp.sum(jnp.where(  # noqa: E731
            in_k[None, :] & (key[None, :] >= u_R[:, None]), e[None, :], 0.0), axis=1) >= target
        w_p = _radix_search(ge)
        mass_gt = jnp.sum(jnp.where(in_k & (key > w_p), e, 0.0))
        tie = in_k & (key == w_p)
        return _top_p_cut(w_p, target, mass_gt, jnp.exp(_key_value(w_p) - m),
                          jnp.sum(tie.astype(jnp.int32)),
                          lambda n: _nth_id(tie, n, ids, vocab) + 1, w, c, vocab)

    w, c = _when(use_k, top_k_boundary, (w, c))
    w, c = _when(use_p, lambda: top_p_boundary(w, c), (w, c))
    return w, c, jnp.sum(jnp.where(live & _kept(key, ids, w, c), e, 0.0))


def _row_boundary(cand_z_ref, cand_id_ref, row, num, m, total_all, use_k, use_p, top_k, top_p, capacity, vocab):
    """Boundary ``(w, c)`` and kept mass of the ``num`` candidates in slots ``row`` of the candidate
    refs: ranked (``_ranked_boundary``) when they fit ``_FEW_SLOTS``, else searched in registers
    (``_candidate_boundary``); ``(INT_MIN, vocab, total_all)`` when ``num < 0`` (no candidates)."""
    def boundary(size):
        if size <= _FEW_SLOTS:
            return _ranked_boundary(cand_z_ref, cand_id_ref, row, num, m, total_all, use_k, use_p, top_k, top_p,
                                    size, vocab)
        _, live, ids, key, e = _load_candidates(cand_z_ref, cand_id_ref, row, num, m, size, vocab)
        return _candidate_boundary(live, ids, key, e, m, total_all, use_k, use_p, top_k, top_p, vocab)
    return _when(num >= 0, lambda: _in_slots(num, capacity, boundary),
                 (jnp.int32(_INT_MIN), jnp.int32(vocab), total_all))


def _sample_kernel(temperature_ref, scale_ref, top_k_ref, top_p_ref, final_coin_ref, tokens_ref, parents_ref,
                   coins_ref, max_ref, argmax_ref, total_ref, num_ref, w_ref, c_ref, kept_ref, block_max_ref,
                   block_mass_ref, sub_max_ref, logits_ref, _rejected, _z, _id, rejected_ref, cand_z_ref, cand_id_ref,
                   hot_ref, accept_ref, emitted_ref, *, vocab, block_v, draw_block, capacity, num_nodes, max_depth,
                   prepared, interpret):
    """Program b: the whole walk and final draw of request b, given each node row's statistics
    (``_rows``). ``prepared``: the candidates of every truncated row come found (``num_ref``,
    ``cand_*_ref[row]``) with the row's kept-set boundary and mass (``w_ref``, ``c_ref``,
    ``kept_ref``); else the walk finds those of the rows it visits, the candidates in
    ``cand_*_ref[0]``."""
    nodes_pad = tokens_ref.shape[0]
    block_c = _candidate_block(block_v)
    temperature = temperature_ref[()]
    greedy = temperature <= 0.0
    scale = scale_ref[()]
    top_k, top_p = top_k_ref[()], top_p_ref[()]
    use_k, use_p = _truncation(temperature, top_k, top_p, vocab)
    node_ids = jnp.arange(nodes_pad)
    tokens = tokens_ref[...]
    parents = parents_ref[...]

    def at_node(x_ref, node):
        """``x_ref[node]``, one scalar load (a node past the tree reads the last padding slot)."""
        return x_ref[jnp.minimum(node, nodes_pad - 1)]

    barrier = functools.partial(_barrier, interpret)

    def load_block(cur, start, size):
        return _load_block(logits_ref, (cur,), start, size, vocab, scale)

    def fold_row(cur, fn, init, size=block_v):
        return _fold_row(logits_ref, (cur,), scale, vocab, fn, init, size)

    # --- passes over a row ----------------------------------------------------------------------
    def count(cur, pred):
        return fold_row(cur, lambda n, ids, valid, z, i: n + jnp.sum(
            (valid & pred(_order_key(z), ids)).astype(jnp.int32)), jnp.int32(0))

    def mass(cur, m, pred):
        return fold_row(cur, lambda s, ids, valid, z, i: s + jnp.sum(
            jnp.where(valid & pred(_order_key(z), ids), jnp.exp(z - m), 0.0)), jnp.float32(0.0))

    def cand_row(cur):
        return cur if prepared else jnp.int32(0)

    def candidates(cur, m, num, size):
        return _load_candidates(cand_z_ref, cand_id_ref, cand_row(cur), num, m, size, vocab)

    # --- truncation by bit searches over whole rows (kept sets beyond ``capacity``) -------------
    def streamed_boundary(cur, m):
        def id_cutoff(w, rank, in_set):
            """Smallest c such that ``rank`` tokens of ``in_set`` with key w have an id < c."""
            below = lambda c: count(cur, lambda key, ids: in_set(key, ids) & (key == w) & (ids < c))  # noqa: E731
            return _search_bits(_id_bits(vocab), jnp.int32(0), lambda c: below(c) < rank) + 1

        def top_k_boundary():
            ge = lambda u: count(cur, lambda key, ids: key >= u) >= top_k  # noqa: E731
            w_k = _search_bits(31, _search_start(ge), ge)
            rank = top_k - count(cur, lambda key, ids: key > w_k)
            everything = lambda key, ids: key == key  # noqa: E731
            return _top_k_cut(w_k, rank, count(cur, lambda key, ids: key == w_k),
                              lambda n: id_cutoff(w_k, n, everything), vocab)

        def top_p_boundary(w, c):
            in_k = lambda key, ids: _kept(key, ids, w, c)  # noqa: E731
            target = top_p * mass(cur, m, in_k)
            ge = lambda u: mass(cur, m, lambda key, ids: in_k(key, ids) & (key >= u)) >= target  # noqa: E731
            w_p = _search_bits(31, _search_start(ge), ge)
            mass_gt = mass(cur, m, lambda key, ids: in_k(key, ids) & (key > w_p))
            tie = lambda key, ids: in_k(key, ids) & (key == w_p)  # noqa: E731
            return _top_p_cut(w_p, target, mass_gt, jnp.exp(_key_value(w_p) - m), count(cur, tie),
                              lambda n: id_cutoff(w_p, n, in_k), w, c, vocab)

        w, c = jnp.int32(_INT_MIN), jnp.int32(vocab)
        w, c = _when(use_k, top_k_boundary, (w, c))
        w, c = _when(use_p, lambda: top_p_boundary(w, c), (w, c))
        return w, c, mass(cur, m, lambda key, ids: _kept(key, ids, w, c))

    def row_stats(cur):
        """``(m, w, c, total, num)`` of row ``cur``: max, kept-set boundary, kept mass and the
        number of candidates in the scratch (``-1``: the kept set is streamed from the row)."""
        m, total_all = at_node(max_ref, cur), at_node(total_ref, cur)

        def greedy_stats():
            return m, _order_key(m), at_node(argmax_ref, cur) + 1, jnp.float32(1.0), jnp.int32(-1)

        def sampled_stats():

            def truncated():
                if prepared:
                    num, w, c, kept = (at_node(x_ref, cur) for x_ref in (num_ref, w_ref, c_ref, kept_ref))
                else:
                    num, w, c, kept = _candidate_stats(
                        logits_ref, (cur,), sub_max_ref, hot_ref, cand_z_ref, cand_id_ref, cand_row(cur), m=m,
                        total=total_all, scale=scale, use_k=use_k, use_p=use_p, top_k=top_k, top_p=top_p,
                        vocab=vocab, block_c=block_c, sub=_sub_size(draw_block), capacity=capacity, barrier=barrier)
                return _either(num >= 0, lambda: (w, c, kept, num),
                               lambda: (*streamed_boundary(cur, m), jnp.int32(-1)))

            untruncated = (jnp.int32(_INT_MIN), jnp.int32(vocab), total_all, jnp.int32(-1))
            return (m, *_when(use_k | use_p, truncated, untruncated))

        return _either(greedy, greedy_stats, sampled_stats)

    # --- the walk -------------------------------------------------------------------------------
    def children(cur):
        return (parents == cur) & (node_ids > 0) & (node_ids < num_nodes)

    def step(t, carry):
        cur, active, depth, stats, accept, emitted = carry
        stats = _when(active, lambda: row_stats(cur), stats)
        m, w, c, total, _ = stats
        is_child = children(cur)
        z = _processed(plt.load(logits_ref.at[cur, tokens]), scale)
        q = jnp.where(is_child & _kept(_order_key(z), tokens, w, c), jnp.exp(z - m) / total, 0.0)
        coin = at_node(coins_ref, cur)
        hit = is_child & (coin <= jnp.cumsum(q))
        tries = active & (t < max_depth)
        took = tries & (jnp.max(hit.astype(jnp.int32)) > 0)
        child = jnp.min(jnp.where(hit, node_ids, nodes_pad))
        token = at_node(tokens_ref, child)
        accept = jnp.where(took & (jnp.arange(accept.shape[0]) == t + 1), child, accept)
        emitted = jnp.where(took & (jnp.arange(emitted.shape[0]) == t), token, emitted)
        return (lax.select(took, child, cur), active & (took | (t >= max_depth)),
                depth + took.astype(jnp.int32), stats, accept, emitted)

    depth_pad = accept_ref.shape[0]
    no_stats = (jnp.float32(0.0), jnp.int32(0), jnp.int32(0), jnp.float32(1.0), jnp.int32(-1))
    init = (jnp.int32(0), jnp.bool_(True), jnp.int32(0), no_stats,
            jnp.where(jnp.arange(depth_pad) == 0, 0, -1), jnp.full((depth_pad,), -1, jnp.int32))
    cur, active, depth, (m, w, c, _, num), accept, emitted = lax.fori_loop(0, max_depth + 1, step, init)

    # A walk that stopped early rejected every child of its last node; one that reached the
    # depth limit examined none of them.
    # Masked-out lanes repeat a rejected child's token rather than sitting out: a masked scatter
    # with duplicate indices may write the old value back over a mark (the interpreter does).
    rejected = children(cur) & ~active
    first = jnp.min(jnp.where(rejected, node_ids, nodes_pad))
    first_token = at_node(tokens_ref, first)
    plt.store(rejected_ref.at[jnp.where(rejected, tokens, first_token)], jnp.ones((nodes_pad,), jnp.int8),
              mask=jnp.broadcast_to(first < nodes_pad, (nodes_pad,)))
    barrier()
    final_coin = final_coin_ref[()]

    # --- the final draw: from the residual (kept set minus rejected children), in id order -----
    def candidate_draw(size):
        slots, live, ids, key, e = candidates(cur, m, num, size)
        kept = live & _kept(key, ids, w, c)
        marked = plt.load(rejected_ref.at[jnp.where(live, ids, 0)])
        left_C = jnp.where(kept & (marked == 0), e, 0.0)
        left_C = jnp.where(jnp.sum(left_C) > 0.0, left_C, jnp.where(kept, e, 0.0))
        cum = jnp.cumsum(left_C)
        crossing = jnp.min(jnp.where(live & (cum >= final_coin * jnp.sum(left_C)), slots, size))
        # The cumulative sum may round below the sum it is compared with.
        pick = lax.select(crossing < size, crossing, jnp.max(jnp.where(left_C > 0.0, slots, -1)))
        return jnp.sum(jnp.where(slots == pick, ids, 0))

    def residual(start, ids, valid, z, exclude):
        keep = valid & _kept(_order_key(z), ids, w, c)
        if exclude:
            keep &= plt.load(rejected_ref.at[pl.ds(start, ids.shape[0])], mask=valid, other=0) == 0
        return jnp.where(keep, jnp.exp(z - m), 0.0)

    def draw_from_blocks(sums_K, size, exclude):
        """The crossing of ``final_coin`` in the residual's cumulative mass, given its per-block sums
        (blocks of ``size`` entries): first the block, then the entry inside it. ``exclude``:
        whether the residual leaves out the rejected children."""
        block_ids = jnp.arange(sums_K.shape[0])
        cum = jnp.cumsum(sums_K)
        target = final_coin * jnp.max(cum)
        block = jnp.min(jnp.where(cum >= target, block_ids, pl.cdiv(vocab, size) - 1))
        base = jnp.sum(jnp.where(block_ids < block, sums_K, 0.0))
        ids, valid, z = load_block(cur, block * size, size)
        res = residual(block * size, ids, valid, z, exclude)
        crossing = jnp.min(jnp.where(valid & (base + jnp.cumsum(res) >= target), ids, vocab))
        return lax.select(crossing < vocab, crossing, jnp.max(jnp.where(res > 0.0, ids, -1)))

    def draw_residual(excluded_K, whole_K, size):
        """Draw from the residual without the rejected children (block sums ``excluded_K``); when
        that holds no mass, from the whole kept set (``whole_K()``, computed only then)."""
        return _either(jnp.sum(excluded_K) > 0.0, lambda: draw_from_blocks(excluded_K, size, True),
                       lambda: draw_from_blocks(whole_K(), size, False))

    def streamed_draw():
        """Truncated rows: block sums of the residual from one pass over the row."""
        block_ids = jnp.arange(_pow2_at_least(pl.cdiv(vocab, block_v)))

        def sums(exclude):
            return fold_row(cur, lambda s, ids, valid, z, i: jnp.where(
                block_ids == i, jnp.sum(residual(i * block_v, ids, valid, z, exclude)), s), jnp.zeros(block_ids.shape))
        return draw_residual(sums(True), lambda: sums(False), block_v)

    def presummed_draw():
        """Untruncated rows: the block sums of the whole row come precomputed; only the blocks that
        hold rejected children are summed again, without them."""
        width = block_mass_ref.shape[1]
        full_K = _rescaled(plt.load(block_mass_ref.at[cur, pl.ds(0, width)]),
                           plt.load(block_max_ref.at[cur, pl.ds(0, width)]), m, pl.cdiv(vocab, draw_block))
        block_ids = jnp.arange(full_K.shape[0])
        blocks_N = jnp.where(rejected, tokens // draw_block, full_K.shape[0])

        def resum(carry):
            block, sums_K = carry
            ids, valid, z = load_block(cur, block * draw_block, draw_block)
            sums_K = jnp.where(block_ids == block, jnp.sum(residual(block * draw_block, ids, valid, z, True)), sums_K)
            return jnp.min(jnp.where(blocks_N > block, blocks_N, full_K.shape[0])), sums_K

        _, sums_K = lax.while_loop(lambda carry: carry[0] < full_K.shape[0], resum,
                                   (jnp.min(blocks_N), full_K))
        return draw_residual(sums_K, lambda: full_K, draw_block)

    def sampled_draw():
        return _either(num >= 0, lambda: _in_slots(num, capacity, candidate_draw),
                       lambda: _either(use_k | use_p, streamed_draw, presummed_draw))

    token = _either(greedy, lambda: c - 1, sampled_draw)
    accept_ref[...] = accept
    emitted_ref[...] = jnp.where(jnp.arange(depth_pad) == depth, token, emitted)


def _processed(logits, scale):
    """The processed logits ``z = logits * (1 / T)`` in float32: the one definition every kernel uses,
    so that they all agree with each other and with the jnp path bit for bit."""
    return logits.astype(jnp.float32) * scale


def _load_block(logits_ref, row, start, size, vocab, scale):
    """Ids, validity and ``z`` of the entries ``[start, start + size)`` of a logits row
    (``logits_ref.at[row]``, ``row`` a tuple of leading indices)."""
    ids = start + jnp.arange(size)
    valid = ids < vocab
    return ids, valid, _processed(plt.load(logits_ref.at[(*row, pl.ds(start, size))], mask=valid, other=0), scale)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


def _candidate_block(block_v: int) -> int:
    """Vocabulary block of the floor and compaction passes: their ``[floors, block]`` tensors
    hold as many entries as one ``block_v`` block."""
    return min(block_v, max(16, block_v // _FLOORS))


def _draw_block(block_v: int) -> int:
    """Vocabulary block of the precomputed per-block masses of the final draw."""
    return min(block_v, _DRAW_BLOCK)


def _sub_size(block: int) -> int:
    """Entries per sub-block whose max the statistics keep (a power of two dividing ``block``)."""
    return min(_SUB, block)


def _block_stats_kernel(scale_ref, logits_ref, max_ref, argmax_ref, mass_ref, sub_max_ref, *, vocab, block, blocks):
    """Program (b, n, j): for each of the blocks ``j * blocks + g`` (g < ``blocks``) of row (b, n), the
    max of ``z = logits * scale`` over the block, its first argmax and ``sum exp(z - block max)``
    (``-inf``, ``vocab`` and 0 for a block past the vocabulary), and the max of each of its
    sub-blocks (``_sub_size`` entries)."""
    slot_G = jnp.arange(blocks)
    max_G = jnp.full((blocks,), -jnp.inf, jnp.float32)
    argmax_G = jnp.full((blocks,), vocab, jnp.int32)
    mass_G = jnp.zeros((blocks,), jnp.float32)
    scale = scale_ref[()]
    sub = _sub_size(block)
    for g in range(blocks):
        ids, valid, z = _load_block(logits_ref, (), (pl.program_id(2) * blocks + g) * block, block, vocab, scale)
        z = jnp.where(valid, z, -jnp.inf)
        m = jnp.max(z)
        max_G = jnp.where(slot_G == g, m, max_G)
        argmax_G = jnp.where(slot_G == g, jnp.min(jnp.where(valid & (z == m), ids, vocab)), argmax_G)
        mass_G = jnp.where(slot_G == g, jnp.sum(jnp.where(valid, jnp.exp(z - m), 0.0)), mass_G)
        sub_max_ref[pl.ds(g * (block // sub), block // sub)] = jnp.max(z.reshape(block // sub, sub), axis=1)
    max_ref[...] = max_G
    argmax_ref[...] = argmax_G
    mass_ref[...] = mass_G


def _row_stats(logits_BNV, scale_B, nodes_pad, draw_block, num_warps, interpret, blocks=1):
    """Per node row and ``draw_block``-entry block: ``max z`` (``z = logits * scale``, the request's
    inverse temperature), its first argmax and ``sum exp(z - block max)`` (each ``[B, nodes_pad, K]``,
    K a power of two), and the max of every sub-block of ``_sub_size(draw_block)`` entries
    (``[B, nodes_pad, S]``, ``-inf`` past the vocabulary). Rows past N and blocks past the last
    program's are left unwritten. One read of the logits, one program per row and ``blocks``
    blocks: the whole GPU works on it even for a single request."""
    batch, num_nodes, vocab = logits_BNV.shape
    programs = pl.cdiv(pl.cdiv(vocab, draw_block), blocks)
    per_block = draw_block // _sub_size(draw_block)
    per_program = pl.BlockSpec((None, None, blocks), lambda b, n, j: (b, n, j))
    return pl.pallas_call(
        functools.partial(_block_stats_kernel, vocab=vocab, block=draw_block, blocks=blocks),
        grid=(batch, num_nodes, programs),
        in_specs=[pl.BlockSpec((None,), lambda b, n, j: (b,)), pl.BlockSpec((None, None, vocab),
                                                                          lambda b, n, j: (b, n, 0))],
        out_specs=[per_program] * 3 + [pl.BlockSpec((None, None, blocks * per_block), lambda b, n, j: (b, n, j))],
        out_shape=[jax.ShapeDtypeStruct((batch, nodes_pad, _pow2_at_least(programs * blocks)), dtype)
                   for dtype in (jnp.float32, jnp.int32, jnp.float32)]
        + [jax.ShapeDtypeStruct((batch, nodes_pad, programs * blocks * per_block), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=min(num_warps, 4), num_stages=1),
        interpret=interpret, name="tree_sample_row_stats",
    )(scale_B, logits_BNV)


def _truncation(temperature_R, top_k_R, top_p_R, vocab):
    """Per row: whether top-k is on, whether top-p is on (both off for greedy rows)."""
    sampled = temperature_R > 0.0
    return sampled & (top_k_R > 0) & (top_k_R < vocab), sampled & (top_p_R < 1.0)


# --- the floor search of truncated rows, shared by the whole-GPU passes and the walk's own ----------
def _holds(count_F, mass_F, use_k, top_k, top_p, total):
    """Floors that the kept set lies above: at least k tokens reach them (top-k), else at least
    ``top_p`` of the mass (with a margin for the rounding between these sums and the searches')."""
    return jnp.where(use_k, count_F >= top_k, mass_F >= top_p * total * 1.0001)


def _pass_floors(p, m, lo, hi):
    """The ``F`` floors of pass ``p`` of a row with max ``m``: geometric below the max, then linear
    between the highest floor found to hold (``lo``) and the one above it (``hi``)."""
    steps_F = jnp.arange(_FLOORS).astype(jnp.float32)
    return jnp.where(p == 0, m - 0.25 * jnp.exp(0.5 * _LN2 * steps_F), hi - (hi - lo) * steps_F / _FLOORS)


def _searching(p, lo, found):
    """Whether pass ``p`` runs: no floor confines the kept set to the candidate slots yet, and the
    geometric pass found a floor that holds."""
    return (p < _FLOOR_PASSES) & ~found & ((p == 0) | (lo > -jnp.inf))


def _refine(lo, hi, count_lo, floors_F, count_F, ok_F, *, p, capacity):
    """After pass ``p``: ``(lo, hi, count_lo, found, first)``, ``first`` the highest floor that holds
    (``F`` if none), ``count_lo`` the tokens above ``lo``, ``found`` whether they fit the slots the
    pass aims at: ``_FEW_SLOTS`` (searched in a smaller register tile) before the last pass,
    ``capacity`` at the last."""
    index_F = jnp.arange(_FLOORS)
    first = jnp.min(jnp.where(ok_F, index_F, _FLOORS))
    pick = lambda x_F, j: jnp.sum(jnp.where(index_F == j, x_F, 0))  # noqa: E731
    any_ok = first < _FLOORS
    lo = lax.select(any_ok, pick(floors_F, first), lo)
    count_lo = lax.select(any_ok, pick(count_F, first), count_lo)
    above = lax.select(first > 0, pick(floors_F, first - 1), hi)
    hi = lax.select(any_ok, above, pick(floors_F, _FLOORS - 1))
    # select, not jnp.where: a where between two Python ints lowers to an i1 in Triton.
    slots = lax.select(p < _FLOOR_PASSES - 1, jnp.int32(min(_FEW_SLOTS, capacity)), jnp.int32(capacity))
    return lo, hi, count_lo, count_lo <= slots, first


def _floor_counts(valid, z, floors_F, m, with_mass):
    """Count and mass ``sum exp(z - m)`` of a block's tokens with ``z >= floor``, per floor; the
    mass only ``with_mass`` (else zeros: a top-k row's floors hold by the count alone)."""
    ge_FV = valid[None, :] & (z[None, :] >= floors_F[:, None])
    mass_F = _when(with_mass, lambda: jnp.sum(jnp.where(ge_FV, jnp.exp(z - m)[None, :], 0.0), axis=1),
                   jnp.zeros((_FLOORS,), jnp.float32))
    return jnp.sum(ge_FV.astype(jnp.int32), axis=1), mass_F


def _store_candidates(cand_z_ref, cand_id_ref, row, ids, z, sel, base, capacity):
    """Writes the ``sel`` lanes of a block to candidate slots ``base, base + 1, ...`` of ``row``."""
    # Unselected lanes aim at the spare slot ``capacity``: an interpreted masked scatter may write
    # old values back at the indices of masked-out lanes.
    slot = jnp.where(sel, base + jnp.cumsum(sel.astype(jnp.int32)) - 1, capacity)
    plt.store(cand_z_ref.at[row, slot], z, mask=sel)
    plt.store(cand_id_ref.at[row, slot], ids, mask=sel)


# --- candidates from the sub-block maxima: no pass over the row ----------------------------------
def _sub_block_floor(sub_max_ref, row, width, m, total, use_k, top_k, top_p):
    """``(floor, found)``: a floor such that the sub-block maxima at or above it alone show that the
    kept set lies above it (at least k maxima for top-k, at least ``top_p`` of the mass for top-p,
    as ``_holds``): the highest of the geometric floors of ``_pass_floors`` that holds, then the
    highest of the linear floors between it and the one above. ``found`` is false when none of
    the geometric floors holds. The ``width`` maxima of ``sub_max_ref.at[row]`` are read in
    chunks of ``_SUB_CHUNK``."""
    chunk = min(_SUB_CHUNK, _pow2_at_least(width))
    index_F = jnp.arange(_FLOORS)

    def highest_holding(floors_F, default):
        def step(i, acc):
            slots = i * chunk + jnp.arange(chunk)
            valid = slots < width
            sub_max = plt.load(sub_max_ref.at[(*row, pl.ds(i * chunk, chunk))], mask=valid, other=-jnp.inf)
            return jax.tree.map(jnp.add, acc, _floor_counts(valid, sub_max, floors_F, m, ~use_k))

        count_F, mass_F = lax.fori_loop(0, pl.cdiv(width, chunk), step, (jnp.zeros((_FLOORS,), jnp.int32),
                                                                         jnp.zeros((_FLOORS,), jnp.float32)))
        ok_F = _holds(count_F, mass_F, use_k, top_k, top_p, total)
        first = jnp.min(jnp.where(ok_F, index_F, _FLOORS))
        pick = lambda j: jnp.sum(jnp.where(index_F == j, floors_F, 0.0))  # noqa: E731
        return lax.select(first < _FLOORS, pick(first), default), first, lax.select(first > 0, pick(first - 1), m)

    lo, first, hi = highest_holding(_pass_floors(0, m, -jnp.inf, m), jnp.float32(-jnp.inf))
    floor, *_ = highest_holding(_pass_floors(1, m, lo, hi), lo)
    return floor, first < _FLOORS


def _sub_block_candidates(sub_max_ref, logits_ref, row, hot_ref, cand_z_ref, cand_id_ref, cand_row, *, m, total, scale,
                          use_k, top_k, top_p, sub, capacity, vocab, barrier):
    """Candidates of a truncated row without a pass over it: the floor of ``_sub_block_floor``,
    then the tokens at or above it, read from the sub-blocks whose max reaches it ("hot", listed
    in ``hot_ref``), written in id order to candidate slots ``cand_row``. Returns their number, or
    ``-1`` when no floor was found or more than ``capacity`` tokens reach it.

    ``sub_max_ref.at[row]``: the row's sub-block maxima (``sub`` entries each); ``logits_ref.at[row]``
    its logits; ``barrier()`` orders this program's scratch writes before its reads."""
    width = sub_max_ref.shape[-1]
    size = _pow2_at_least(width)
    slots_S = jnp.arange(size)
    valid_S = slots_S < width
    floor, found = _sub_block_floor(sub_max_ref, row, width, m, total, use_k, top_k, top_p)
    sub_max_S = plt.load(sub_max_ref.at[(*row, pl.ds(0, size))], mask=valid_S, other=-jnp.inf)
    hot_S = valid_S & (sub_max_S >= floor)
    num_hot = jnp.sum(hot_S.astype(jnp.int32))

    def gather():
        plt.store(hot_ref.at[jnp.where(hot_S, jnp.cumsum(hot_S.astype(jnp.int32)) - 1, size)], slots_S, mask=hot_S)
        barrier()
        lane = jnp.arange(_HOT_CHUNK * sub)

        def chunk(carry):
            i, base = carry
            h = i * _HOT_CHUNK + lane // sub
            live = h < num_hot
            ids = plt.load(hot_ref.at[jnp.where(live, h, size)], mask=live, other=0) * sub + lane % sub
            live &= ids < vocab
            z = _processed(plt.load(logits_ref.at[(*row, jnp.where(live, ids, 0))], mask=live, other=0), scale)
            sel = live & (z >= floor)
            fits = sel & (base + jnp.cumsum(sel.astype(jnp.int32)) <= capacity)
            _store_candidates(cand_z_ref, cand_id_ref, cand_row, ids, z, fits, base, capacity)
            return i + 1, base + jnp.sum(sel.astype(jnp.int32))

        # Stops once more than ``capacity`` tokens reach the floor: the row has no candidates then.
        _, num = lax.while_loop(lambda c: (c[0] < pl.cdiv(num_hot, _HOT_CHUNK)) & (c[1] <= capacity), chunk,
                                (jnp.int32(0), jnp.int32(0)))
        barrier()
        return lax.select(num <= capacity, num, jnp.int32(-1))

    # Every hot sub-block holds a token at its max: more than ``capacity`` of them cannot fit.
    return _when(found & (num_hot <= capacity), gather, jnp.int32(-1))


def _fold_row(logits_ref, row, scale, vocab, fn, init, size):
    """Fold ``fn(carry, ids, valid, z, block)`` over the ``size``-entry blocks of logits row
    ``logits_ref.at[row]`` (``z = logits * scale``)."""
    def body(i, carry):
        return fn(carry, *_load_block(logits_ref, row, i * size, size, vocab, scale), i)
    return lax.fori_loop(0, pl.cdiv(vocab, size), body, init)


def _find_candidates(logits_ref, row, sub_max_ref, hot_ref, cand_z_ref, cand_id_ref, cand_row, *, m, total, scale,
                     use_k, top_k, top_p, vocab, block_c, sub, capacity, barrier, floor_search=True):
    """Candidates of a truncated row, written in id order to slots ``cand_row`` of the candidate refs;
    returns their number, ``-1`` when no floor confines the kept set to ``capacity`` tokens.

    First from the row's sub-block maxima (``_sub_block_candidates``); for a row that leaves without
    and ``floor_search``, by the floor search over the whole row (``_pass_floors``, refined
    linearly, one pass over the row each, ``block_c`` entries per step), then a pass that writes
    the tokens above the floor found."""
    num = _sub_block_candidates(sub_max_ref, logits_ref, row, hot_ref, cand_z_ref, cand_id_ref, cand_row, m=m,
                                total=total, scale=scale, use_k=use_k, top_k=top_k, top_p=top_p, sub=sub,
                                capacity=capacity, vocab=vocab, barrier=barrier)
    if not floor_search:
        return num
    fold = lambda fn, init: _fold_row(logits_ref, row, scale, vocab, fn, init, block_c)  # noqa: E731

    def search(carry):
        p, lo, hi, count_lo, _ = carry
        floors_F = _pass_floors(p, m, lo, hi)
        count_F, mass_F = fold(lambda acc, ids, valid, z, i: jax.tree.map(
            jnp.add, acc, _floor_counts(valid, z, floors_F, m, ~use_k)), (jnp.zeros((_FLOORS,), jnp.int32),
                                                                    jnp.zeros((_FLOORS,), jnp.float32)))
        ok_F = _holds(count_F, mass_F, use_k, top_k, top_p, total)
        return (p + 1, *_refine(lo, hi, count_lo, floors_F, count_F, ok_F, p=p, capacity=capacity)[:4])

    def floor_candidates():
        init = (jnp.int32(0), jnp.float32(-jnp.inf), m, jnp.int32(vocab), jnp.bool_(vocab <= capacity))
        _, lo, _, count, found = lax.while_loop(lambda c: _searching(c[0], c[1], c[4]), search, init)

        def compact():
            def step(base, ids, valid, z, i):
                sel = valid & (z >= lo)
                _store_candidates(cand_z_ref, cand_id_ref, cand_row, ids, z, sel, base, capacity)
                return base + jnp.sum(sel.astype(jnp.int32))
            fold(step, jnp.int32(0))
            barrier()
            return count
        return _when(found, compact, jnp.int32(-1))
    return _either(num >= 0, lambda: num, floor_candidates)


def _candidate_stats(logits_ref, row, sub_max_ref, hot_ref, cand_z_ref, cand_id_ref, cand_row, *, m, total, scale,
                     use_k, use_p, top_k, top_p, vocab, block_c, sub, capacity, barrier, floor_search=True):
    """``(num, w, c, kept)`` of a truncated row: its candidates (``_find_candidates``), then its
    kept-set boundary and mass among them (``_row_boundary``); ``(-1, INT_MIN, vocab, total)``
    when it has none."""
    num = _find_candidates(logits_ref, row, sub_max_ref, hot_ref, cand_z_ref, cand_id_ref, cand_row, m=m, total=total,
                           scale=scale, use_k=use_k, top_k=top_k, top_p=top_p, vocab=vocab, block_c=block_c, sub=sub,
                           capacity=capacity, barrier=barrier, floor_search=floor_search)
    return num, *_row_boundary(cand_z_ref, cand_id_ref, cand_row, num, m, total, use_k, use_p, top_k, top_p,
                               capacity, vocab)


def _rescaled(mass_K, max_K, m, num_blocks):
    """Per-block masses ``sum exp(z - block max)`` made relative to the row max ``m`` (0 past
    ``num_blocks``: those entries may hold anything)."""
    valid = jnp.arange(mass_K.shape[0]) < num_blocks
    return jnp.where(valid, mass_K * jnp.exp(jnp.where(valid, max_K, -jnp.inf) - m), 0.0)


def _rows_kernel(temperature_ref, scale_ref, top_k_ref, top_p_ref, max_ref, argmax_ref, mass_ref, sub_max_ref,
                 logits_ref, m_ref, argmax_out_ref, total_ref, num_ref, w_ref, c_ref, kept_ref, search_ref, *cand_refs,
                 vocab, num_blocks, block_c, sub, capacity, interpret):
    """Program (b, n): node row n of request b. Its max, first argmax and mass from its block
    statistics; with ``cand_refs`` (hot sub-blocks, candidate ``z`` and ids) and a truncated row,
    also ``_candidate_stats`` from the sub-block maxima alone (else ``num = -1``,
    ``(w, c) = (INT_MIN, vocab)``, kept = mass); ``search``: a truncated row left without
    candidates."""
    index_K = jnp.arange(max_ref.shape[0])
    max_K = jnp.where(index_K < num_blocks, max_ref[...], -jnp.inf)
    m = jnp.max(max_K)
    first = jnp.min(jnp.where(max_K == m, index_K, max_ref.shape[0]))  # the first block holding the max
    total = jnp.sum(_rescaled(mass_ref[...], max_K, m, num_blocks))
    m_ref[()], argmax_out_ref[()], total_ref[()] = m, jnp.sum(jnp.where(index_K == first, argmax_ref[...], 0)), total
    stats = (jnp.int32(-1), jnp.int32(_INT_MIN), jnp.int32(vocab), total)
    truncated = jnp.bool_(False)
    if cand_refs:
        hot_ref, cand_z_ref, cand_id_ref = cand_refs
        top_k, top_p = top_k_ref[()], top_p_ref[()]
        use_k, use_p = _truncation(temperature_ref[()], top_k, top_p, vocab)
        truncated = use_k | use_p
        stats = _when(truncated, lambda: _candidate_stats(
            logits_ref, (), sub_max_ref, hot_ref, cand_z_ref, cand_id_ref, jnp.int32(0), m=m, total=total,
            scale=scale_ref[()], use_k=use_k, use_p=use_p, top_k=top_k, top_p=top_p, vocab=vocab, block_c=block_c,
            sub=sub, capacity=capacity, barrier=functools.partial(_barrier, interpret), floor_search=False), stats)
    num_ref[()], w_ref[()], c_ref[()], kept_ref[()] = stats
    search_ref[()] = (truncated & (stats[0] < 0)).astype(jnp.int32)


def _rows(logits_BNV, temperature_B, scale_B, top_k_B, top_p_B, max_BNK, argmax_BNK, mass_BNK, sub_max_BNS, *,
          draw_block, block_c, capacity, candidates, num_warps, interpret):
    """A program per node row (``_rows_kernel``). Returns ``(m, argmax, total, num, w, c, kept)``, each
    ``[B, nodes_pad]`` (rows past N unwritten), ``search_BN`` (nonzero: a truncated row whose
    sub-block maxima confined no candidates) and, with ``candidates``, the candidate slots ``z``
    and ids ``[B, N, capacity + 1]`` (slot ``capacity`` is spare), else ``()``.

    ``*_BNK``, ``sub_max_BNS``: the block statistics of ``_row_stats`` (blocks of ``draw_block``
    entries)."""
    batch, num_nodes, vocab = logits_BNV.shape
    nodes_pad = max_BNK.shape[1]
    per_request = pl.BlockSpec((None,), lambda b, n: (b,))
    per_row = pl.BlockSpec((None, None), lambda b, n: (b, n))
    row = lambda width: pl.BlockSpec((None, None, width), lambda b, n: (b, n, 0))  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((batch, nodes_pad), dtype) for dtype in (
        jnp.float32, jnp.int32, jnp.float32, jnp.int32, jnp.int32, jnp.int32, jnp.float32)]
    out_shape.append(jax.ShapeDtypeStruct((batch, num_nodes), jnp.int32))
    out_specs = [per_row] * len(out_shape)
    if candidates:
        hot_size = _pow2_at_least(sub_max_BNS.shape[2]) + 1
        slots = pl.BlockSpec((None, 1, capacity + 1), lambda b, n: (b, n, 0))
        out_shape += [jax.ShapeDtypeStruct((batch, num_nodes, hot_size), jnp.int32),
                      *(jax.ShapeDtypeStruct((batch, num_nodes, capacity + 1), dtype) for dtype in (jnp.float32,
                                                                                                 jnp.int32))]
        out_specs += [row(hot_size), slots, slots]
    outs = pl.pallas_call(
        functools.partial(_rows_kernel, vocab=vocab, num_blocks=pl.cdiv(vocab, draw_block), block_c=block_c,
                          sub=_sub_size(draw_block), capacity=capacity, interpret=interpret),
        grid=(batch, num_nodes), in_specs=[per_request] * 4 + [row(max_BNK.shape[2])] * 3
        + [row(sub_max_BNS.shape[2]), row(vocab)], out_specs=out_specs, out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="tree_sample_rows",
    )(temperature_B, scale_B, top_k_B, top_p_B, max_BNK, argmax_BNK, mass_BNK, sub_max_BNS, logits_BNV)
    return tuple(outs[:7]), outs[7], tuple(outs[9:])


# --- the floor search over the whole GPU: a program per (row, block) ---------------------------------
def _floor_kernel(mode_ref, scale_ref, max_ref, floors_ref, logits_ref, count_ref, mass_ref, *, block):
    """Program (row r, block j): ``_floor_counts`` of the block; ``mode``: 0 (no pass for the row),
    1 (counts only, a top-k row), 2 (counts and masses)."""
    j = pl.program_id(1)  # read outside the branch: the interpreter cannot lower it inside
    mode = mode_ref[()]

    @pl.when(mode != 0)
    def _():
        _, valid, z = _load_block(logits_ref, (), j * block, block, logits_ref.shape[0], scale_ref[()])
        count_ref[...], mass_ref[...] = _floor_counts(valid, z, floors_ref[...], max_ref[()], mode == 2)


def _compact_kernel(active_ref, scale_ref, floor_ref, offset_ref, logits_ref, _z, _id, cand_z_ref, cand_id_ref, *,
                    block, capacity):
    """Program (row r, block j) of an active row: writes the block's tokens with ``z >= floor`` to
    the row's candidate slots from ``offset`` on (the row's candidates in id order)."""
    j = pl.program_id(1)

    @pl.when(active_ref[()] != 0)
    def _():
        ids, valid, z = _load_block(logits_ref, (), j * block, block, logits_ref.shape[0], scale_ref[()])
        _store_candidates(cand_z_ref, cand_id_ref, 0, ids, z, valid & (z >= floor_ref[()]), offset_ref[()],
                          capacity)


def _boundary_kernel(num_ref, max_ref, mass_ref, use_k_ref, use_p_ref, top_k_ref, top_p_ref, cand_z_ref,
                     cand_id_ref, w_ref, c_ref, kept_ref, *, capacity, vocab):
    """Program r: the kept-set boundary ``(w, c)`` and kept mass of row r from its candidates
    (``_row_boundary``); ``(INT_MIN, vocab, total)`` for a row without candidates."""
    w_ref[()], c_ref[()], kept_ref[()] = _row_boundary(
        cand_z_ref, cand_id_ref, jnp.int32(0), num_ref[()], max_ref[()], mass_ref[()], use_k_ref[()] != 0,
        use_p_ref[()] != 0, top_k_ref[()], top_p_ref[()], capacity, vocab)


def _floor_candidates(logits_RV, scale_R, max_R, mass_R, search_R, use_k_R, top_k_R, top_p_R, num_R, cand_z_R1C,
                      cand_id_R1C, *, block, capacity, params, interpret):
    """Candidates of the rows ``search_R`` by passes over the whole GPU (the rows whose sub-block
    maxima confine no candidates): the floor search (``_pass_floors``), each pass a program per row
    and block (other rows return at once); then the tokens above the floor found are written to the
    row's slots in id order, from offsets given by the per-block counts. Other rows keep ``num_R``
    and their slots of ``cand_*_R1C``."""
    rows, vocab = logits_RV.shape
    num_blocks = pl.cdiv(vocab, block)
    per_row = pl.BlockSpec((None,), lambda r, j: (r,))
    row = pl.BlockSpec((None, vocab), lambda r, j: (r, 0))
    holds = jax.vmap(_holds)

    lo_R = jnp.full((rows,), -jnp.inf, jnp.float32)
    hi_R = max_R
    count_R = jnp.full((rows,), vocab, jnp.int32)
    found_R = jnp.full((rows,), vocab <= capacity)
    per_block_RP = jnp.broadcast_to(jnp.minimum(block, vocab - block * jnp.arange(num_blocks)), (rows, num_blocks))
    for p in range(_FLOOR_PASSES):
        active_R = search_R & _searching(p, lo_R, found_R)
        floors_RF = jax.vmap(functools.partial(_pass_floors, p))(max_R, lo_R, hi_R)
        count_RPF, mass_RPF = pl.pallas_call(
            functools.partial(_floor_kernel, block=block), grid=(rows, num_blocks),
            in_specs=[per_row, per_row, per_row, pl.BlockSpec((None, _FLOORS), lambda r, j: (r, 0)), row],
            out_specs=[pl.BlockSpec((None, None, _FLOORS), lambda r, j: (r, j, 0))] * 2,
            out_shape=[jax.ShapeDtypeStruct((rows, num_blocks, _FLOORS), dtype) for dtype in (jnp.int32,
                                                                                           jnp.float32)],
            compiler_params=params, interpret=interpret, name="tree_sample_floors",
        )(jnp.where(active_R, jnp.where(use_k_R, 1, 2), 0), scale_R, max_R, floors_RF, logits_RV)
        count_RF = jnp.sum(count_RPF, axis=1)
        ok_RF = holds(count_RF, jnp.sum(mass_RPF, axis=1), use_k_R, top_k_R, top_p_R, mass_R)
        *state, first_R = jax.vmap(functools.partial(_refine, p=p, capacity=capacity))(
            lo_R, hi_R, count_R, floors_RF, count_RF, ok_RF)
        at_first_RP = jnp.take_along_axis(count_RPF, jnp.minimum(first_R, _FLOORS - 1)[:, None, None], axis=2)[..., 0]
        per_block_RP = jnp.where((active_R & (first_R < _FLOORS))[:, None], at_first_RP, per_block_RP)
        lo_R, hi_R, count_R, found_R = (jnp.where(active_R, new, old) for new, old in zip(
            state, (lo_R, hi_R, count_R, found_R)))

    compact_R = search_R & found_R
    slots = pl.BlockSpec((None, 1, capacity + 1), lambda r, j: (r, 0, 0))
    cand_z_R1C, cand_id_R1C = pl.pallas_call(
        functools.partial(_compact_kernel, block=block, capacity=capacity), grid=(rows, num_blocks),
        in_specs=[per_row, per_row, per_row, pl.BlockSpec((None, None), lambda r, j: (r, j)), row, slots, slots],
        out_specs=[slots, slots], out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (cand_z_R1C, cand_id_R1C)],
        input_output_aliases={5: 0, 6: 1}, compiler_params=params, interpret=interpret, name="tree_sample_candidates",
    )(compact_R.astype(jnp.int32), scale_R, lo_R, jnp.cumsum(per_block_RP, axis=1) - per_block_RP, logits_RV,
      cand_z_R1C, cand_id_R1C)
    return jnp.where(compact_R, count_R, num_R), cand_z_R1C, cand_id_R1C


def _searched_rows(logits_BNV, temperature_B, scale_B, top_k_B, top_p_B, stats_BN, search_BN, cands, *, block_c,
                   capacity, num_warps, interpret):
    """``_rows``' results with the rows ``search_BN`` completed over the whole GPU: their candidates
    by ``_floor_candidates``, then, for those that found some, their kept-set boundary and mass
    (``_boundary_kernel``, a program per row)."""
    batch, num_nodes, vocab = logits_BNV.shape
    rows = batch * num_nodes
    params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
    m_BN, argmax_BN, total_BN, num_BN, *bounds_BN = stats_BN
    flat = lambda x_BN: x_BN[:, :num_nodes].reshape(rows)  # noqa: E731
    m_R, total_R = flat(m_BN), flat(total_BN)
    per_row = lambda x_B: jnp.repeat(x_B, num_nodes)  # noqa: E731
    top_k_R, top_p_R = per_row(top_k_B), per_row(top_p_B)
    use_k_R, use_p_R = _truncation(per_row(temperature_B), top_k_R, top_p_R, vocab)
    search_R = search_BN.reshape(rows) != 0
    num_R, *cands_R1C = _floor_candidates(
        logits_BNV.reshape(rows, vocab), per_row(scale_B), m_R, total_R, search_R, use_k_R, top_k_R,
        top_p_R, flat(num_BN), *(c.reshape(rows, 1, capacity + 1) for c in cands), block=block_c, capacity=capacity,
        params=params, interpret=interpret)
    scalar = pl.BlockSpec((None,), lambda r: (r,))
    cand_row = pl.BlockSpec((None, 1, capacity + 1), lambda r: (r, 0, 0))
    searched_R = pl.pallas_call(
        functools.partial(_boundary_kernel, capacity=capacity, vocab=vocab), grid=(rows,),
        in_specs=[scalar] * 7 + [cand_row] * 2, out_specs=[scalar] * 3,
        out_shape=[jax.ShapeDtypeStruct((rows,), dtype) for dtype in (jnp.int32, jnp.int32, jnp.float32)],
        compiler_params=params, interpret=interpret, name="tree_sample_boundaries",
    )(jnp.where(search_R, num_R, -1), m_R, total_R, use_k_R.astype(jnp.int32),
      use_p_R.astype(jnp.int32), top_k_R, top_p_R, *cands_R1C)
    update = lambda x_BN, x_R: x_BN.at[:, :num_nodes].set(jnp.where(search_R, x_R, flat(x_BN)).reshape(  # noqa: E731
        batch, num_nodes))
    return ((m_BN, argmax_BN, total_BN, *(update(x_BN, x_R) for x_BN, x_R in zip((num_BN, *bounds_BN),
                                                                                 (num_R, *searched_R)))),
            tuple(c.reshape(batch, num_nodes, capacity + 1) for c in cands_R1C))


@functools.partial(jax.jit, static_argnames=("max_depth", "block_v", "num_warps", "num_stages",
                                              "capacity", "stats_blocks", "parallel_rows", "interpret"))
def _tree_sample_pallas(tokens_BN, parents_BN, logits_BNV, coins_BN, final_coins_B, temperature_B,
                        top_k_B, top_p_B, *, max_depth, block_v, num_warps, num_stages, capacity,
                        interpret, stats_blocks=1, parallel_rows=PARALLEL_ROWS):
    batch, num_nodes, vocab = logits_BNV.shape
    nodes_pad = _pow2_at_least(num_nodes)
    depth_pad = _pow2_at_least(max_depth + 2)
    block_v = min(block_v, _pow2_at_least(vocab))
    draw_block = _draw_block(block_v)
    pad_nodes = lambda x_BN, value: jnp.pad(x_BN, ((0, 0), (0, nodes_pad - num_nodes)), constant_values=value)  # noqa: E731
    scale_B = inverse_temperature(temperature_B)
    block_stats = _row_stats(logits_BNV, scale_B, nodes_pad, draw_block, num_warps, interpret, stats_blocks)
    max_BNK, _, block_mass_BNK, sub_max_BNS = block_stats
    prepared = batch * num_nodes <= parallel_rows
    block_c = _candidate_block(block_v)
    inputs = (logits_BNV, temperature_B, scale_B, top_k_B, top_p_B)
    stats_BN, search_BN, cands = _rows(*inputs, *block_stats, draw_block=draw_block, block_c=block_c,
                                       capacity=capacity, candidates=prepared, num_warps=num_warps, interpret=interpret)
    if prepared:
        stats_BN, cands = lax.cond(jnp.any(search_BN != 0), lambda: _searched_rows(
            *inputs, stats_BN, search_BN, cands, block_c=block_c, capacity=capacity, num_warps=num_warps,
            interpret=interpret), lambda: (stats_BN, cands))
    else:
        cands = [jnp.zeros((batch, 1, capacity + 1), dtype) for dtype in (jnp.float32, jnp.int32)]
    kernel = functools.partial(_sample_kernel, vocab=vocab, block_v=block_v, draw_block=draw_block,
                               capacity=capacity, num_nodes=num_nodes, max_depth=max_depth, prepared=prepared,
                               interpret=interpret)
    scalar = pl.BlockSpec((None,), lambda b: (b,))
    per_node = pl.BlockSpec((None, nodes_pad), lambda b: (b, 0))
    row = lambda n: pl.BlockSpec((None, n), lambda b: (b, 0))  # noqa: E731
    rows = lambda shape: pl.BlockSpec((None, *shape), lambda b: (b,) + (0,) * len(shape))  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((batch, vocab), jnp.int8),  # rejected-token marks
                 *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in cands),
                 jax.ShapeDtypeStruct((batch, _pow2_at_least(sub_max_BNS.shape[2]) + 1), jnp.int32),  # hot sub-blocks
                 jax.ShapeDtypeStruct((batch, depth_pad), jnp.int32),
                 jax.ShapeDtypeStruct((batch, depth_pad), jnp.int32)]
    *_, accept_BD, emitted_BD = pl.pallas_call(
        kernel, grid=(batch,),
        in_specs=[scalar] * 5 + [per_node] * 10 + [rows(x.shape[1:]) for x in (max_BNK, block_mass_BNK, sub_max_BNS,
                                                                                logits_BNV)]
        + [row(vocab)] + [rows(c.shape[1:]) for c in cands],
        out_specs=[rows(x.shape[1:]) for x in out_shape], out_shape=out_shape,
        input_output_aliases={19: 0, 20: 1, 21: 2},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="tree_sample",
    )(temperature_B, scale_B, top_k_B, top_p_B, final_coins_B, pad_nodes(tokens_BN, 0), pad_nodes(parents_BN, -1),
      pad_nodes(coins_BN, 1.0), *stats_BN, max_BNK, block_mass_BNK, sub_max_BNS, logits_BNV,
      jnp.zeros((batch, vocab), jnp.int8), *cands)
    return _verify_result(accept_BD[:, :max_depth + 1], emitted_BD[:, :max_depth + 1], num_nodes)


def _verify_result(accept_BD, emitted_BD, num_nodes) -> VerifyResult:
    """``VerifyResult`` from the accepted path and the emitted tokens (final token included)."""
    num_accepted = jnp.sum(accept_BD >= 0, axis=1, dtype=jnp.int32) - 1
    rows = jnp.arange(accept_BD.shape[0])[:, None]
    slots = jnp.where(accept_BD >= 0, accept_BD, num_nodes)
    predicts = jnp.full((accept_BD.shape[0], num_nodes), -1, jnp.int32).at[rows, slots].set(
        emitted_BD, mode="drop")
    bonus = jnp.take_along_axis(emitted_BD, num_accepted[:, None], axis=1)[:, 0]
    return VerifyResult(accept_BD, num_accepted, predicts, emitted_BD, bonus)
