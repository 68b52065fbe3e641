"""The DDTree beam and its global best-first order, one program per request.

Given each depth's top ``K`` draft log-probabilities and token ids (descending, ties by lower id),
the best ``B`` prefixes of depth ``d`` extend the best ``B`` of depth ``d - 1`` (a width-``B`` beam),
and one order of all beams by (``-logw``, rank tuple) gives the best-first pop order. XLA runs this
as two reductions per depth (28 kernels of about a microsecond at ``L = 15`` on an H200) plus the
global order's own; here the whole of it is one program per request:

- each depth's candidates are the static pairs (beam entry ``i``, rank ``r``) with
  ``(i + 1)(r + 1) <= B``, gathered from the beam and the depth's row by one-hot reductions;
- their order is a pairwise count over (``-logw``, packed rank-tuple words, index), the new beam
  a one-hot selection by rank, the beams kept as rows of ``[L2, B]`` tiles;
- the global order counts, for each depth row of the tiles, the entries of every row before it,
  and each output slot takes the entry ranked to it.

The result equals `tree_build_reference` (and the library's ``tree_from_top_k``), ties included:
the same keys and the same tie rule. Work grows as ``L (B ln B)^2``, so the kernel takes budgets
that are powers of two up to 32 with at most `MAX_CANDIDATES` candidates a depth
(`kernel_supports`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MAX_BUDGET = 32
MAX_CANDIDATES = 128  # a depth's candidates, padded to a power of two: a 128 x 128 count per depth
MAX_DEPTH = 16
WARPS = (1, 2, 4, 8, 16)  # warp counts `tree_nodes` launches with


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def beam_pairs(budget: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Static (beam index, rank) pairs that can reach a depth's top ``budget``: every pair (i', r')
    with i' <= i and r' <= r precedes (i, r), so (i, r) needs ``(i + 1) * (r + 1) <= budget``, about
    ``budget * ln(budget)`` pairs."""
    pairs = [(i, r) for i in range(budget) for r in range(min(k, budget // (i + 1)))]
    beam_i, rank = np.array(pairs, np.int32).T
    return beam_i, rank


def rank_packing(k: int, depth: int) -> tuple[int, int, int]:
    """(bits per rank, ranks per int32 word, words) of a rank tuple of ``depth`` values ``rank + 1 <=
    k``, big-end first, ``0`` past a node's depth: comparing the words compares the tuples
    lexicographically, a prefix before its extensions."""
    bits = k.bit_length()
    per_word = 31 // bits
    return bits, per_word, -(-depth // per_word)


def kernel_supports(budget: int, k: int, depth: int) -> bool:
    """Whether the kernel takes this shape: ``budget`` a power of two in [2, `MAX_BUDGET`], ``1 <= k <=
    budget``, ``depth <= MAX_DEPTH`` and at most `MAX_CANDIDATES` candidates a depth, padded."""
    if not (2 <= budget <= MAX_BUDGET and budget & (budget - 1) == 0 and 1 <= k <= budget and 1 <= depth <= MAX_DEPTH):
        return False
    return _pow2(len(beam_pairs(budget, k)[0])) <= MAX_CANDIDATES


def tree_nodes(lp_BLK, tok_BLK, *, budget: int, num_warps: int = 4, interpret: bool = False):
    """Nodes 1..``budget`` of each request's tree in pop order: ``(tokens, parents, depths [B, budget]
    int32, logw [B, budget] float32)``, padding ``0, -1, 0, -inf``; parents are node indices (the root
    is node 0, which the caller prepends).

    Args:
      lp_BLK: float32 ``[batch, L, K]`` each depth's top-``K`` draft log-probabilities, descending
        (``-inf`` where a depth has fewer than ``K`` tokens).
      tok_BLK: int32 ``[batch, L, K]`` their token ids (ties by lower id first).
      budget: nodes besides the root; `kernel_supports` must hold.
      num_warps: Triton warps per program (1 to 16, a power of two): the lanes that share a depth's
        pairwise count.
      interpret: run in the Pallas interpreter.
    """
    if jnp.ndim(lp_BLK) != 3:
        raise ValueError(f"lp_BLK must be [batch, L, K], got shape {jnp.shape(lp_BLK)}")
    batch, depth, k = lp_BLK.shape
    if tok_BLK.shape != lp_BLK.shape:
        raise ValueError(f"tok_BLK must have the shape of lp_BLK {lp_BLK.shape}, got {tok_BLK.shape}")
    if not kernel_supports(budget, k, depth):
        raise ValueError(f"the tree-build kernel does not take budget {budget} with k {k} and depth {depth} "
                         f"(kernel_supports)")
    if num_warps not in WARPS:
        raise ValueError(f"num_warps must be one of {WARPS}, got {num_warps!r}")
    return _tree_nodes(jnp.asarray(lp_BLK, jnp.float32), jnp.asarray(tok_BLK, jnp.int32), budget=int(budget),
                       num_warps=int(num_warps), interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("budget", "num_warps", "interpret"))
def _tree_nodes(lp_BLK, tok_BLK, *, budget, num_warps, interpret):
    batch, depth, k = lp_BLK.shape
    depth2, k2 = _pow2(depth), _pow2(k)
    pair_i, pair_r = beam_pairs(budget, k)
    pairs = _pow2(len(pair_i))
    # padding pairs match no beam entry and no rank: -inf candidates
    pair_i = np.pad(pair_i, (0, pairs - len(pair_i)), constant_values=budget)
    pair_r = np.pad(pair_r, (0, pairs - len(pair_r)), constant_values=k2)
    pad = [(0, 0), (0, depth2 - depth), (0, k2 - k)]
    lp = jnp.pad(lp_BLK, pad, constant_values=-jnp.inf)
    tok = jnp.pad(tok_BLK, pad)
    bits, per_word, words = rank_packing(k, depth)
    kernel = functools.partial(_kernel, budget=budget, k=k, depth=depth, bits=bits, per_word=per_word, words=words)
    row_spec = pl.BlockSpec((None, depth2, k2), lambda b: (b, 0, 0))
    pair_spec = pl.BlockSpec((pairs,), lambda b: (0,))
    out_spec = pl.BlockSpec((None, budget), lambda b: (b, 0))
    ints = jax.ShapeDtypeStruct((batch, budget), jnp.int32)
    return pl.pallas_call(
        kernel, grid=(batch,), in_specs=[row_spec, row_spec, pair_spec, pair_spec], out_specs=[out_spec] * 4,
        out_shape=[ints, ints, ints, jax.ShapeDtypeStruct((batch, budget), jnp.float32)],
        interpret=interpret, name="tree_build", compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
    )(lp, tok, jnp.asarray(pair_i), jnp.asarray(pair_r))


def _iota(shape, axis):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _take(hit, values, low):
    """``out[p] = values[q]`` for the one ``q`` with ``hit[p, q]`` (``low`` where none): a reduction."""
    picked = jnp.where(hit, values[None, :], low)
    return jnp.max(picked, axis=1) if jnp.issubdtype(values.dtype, jnp.floating) else jnp.sum(picked, axis=1)


def _precedes(keys_q, keys_p, before):
    """Whether q sorts before p by ``(keys...)``, ties to ``before`` (broadcast arrays)."""
    for kq, kp in reversed(list(zip(keys_q, keys_p))):
        before = (kq < kp) | ((kq == kp) & before)
    return before


def _kernel(lp_ref, tok_ref, pair_i_ref, pair_r_ref, tok_out, par_out, depth_out, logw_out, *, budget, k, depth,
            bits, per_word, words):
    """Program b: request b's beam over the ``[L2, K2]`` rows, then its ``budget`` first entries."""
    neg = jnp.float32(-jnp.inf)
    depth2, k2 = lp_ref.shape
    pairs = pair_i_ref.shape[0]
    width = budget
    pair_i, pair_r = pair_i_ref[...], pair_r_ref[...]
    from_beam = pair_i[:, None] == _iota((pairs, width), 1)
    from_row = pair_r[:, None] == _iota((pairs, k2), 1)
    rank_plus_one = jnp.where(pair_r < k, pair_r + 1, 0)
    rows = _iota((depth2, width), 0)

    # depth 1: the beam is the row's first K entries (ranks 0..K-1), padded with -inf
    first = _iota((width, k2), 0) == _iota((width, k2), 1)
    logw = _take(first, lp_ref[0, :], neg)
    beam_rank = jnp.where(_iota((width,), 0) < k, _iota((width,), 0), 0)
    beam_words = [((beam_rank + 1) << (bits * (per_word - 1))) if x == 0 else jnp.zeros((width,), jnp.int32)
                  for x in range(words)]
    at_row0 = rows == 0
    acc_logw = jnp.where(at_row0, logw[None, :], neg)
    acc_tok = jnp.where(at_row0, _take(first, tok_ref[0, :], 0)[None, :], 0)
    acc_par = jnp.full((depth2, width), -1, jnp.int32)
    acc_words = [jnp.where(at_row0, w[None, :], 0) for w in beam_words]
    index_before = _iota((pairs, pairs), 0) < _iota((pairs, pairs), 1)

    def extend(d, carry):
        logw, beam_words, acc_logw, acc_tok, acc_par, acc_words = carry
        lp_d, tok_d = lp_ref[pl.ds(d, 1), :][0], tok_ref[pl.ds(d, 1), :][0]
        cand_logw = _take(from_beam, logw, neg) + _take(from_row, lp_d, neg)
        cand_tok = _take(from_row, tok_d, 0)
        word = jax.lax.div(d, jnp.int32(per_word))  # d >= 0: lax's truncating div and rem are the floor ones
        new_rank = rank_plus_one << (bits * (per_word - 1 - jax.lax.rem(d, jnp.int32(per_word))))
        cand_words = [_take(from_beam, w, 0) + jnp.where(word == x, new_rank, 0) for x, w in enumerate(beam_words)]
        keys = [-cand_logw, *cand_words]
        before = _precedes([key[:, None] for key in keys], [key[None, :] for key in keys], index_before)
        rank = jnp.sum(before.astype(jnp.int32), axis=0)
        chosen = rank[None, :] == _iota((width, pairs), 0)
        logw = _take(chosen, cand_logw, neg)
        beam_words = [_take(chosen, w, 0) for w in cand_words]
        at_row = rows == d
        return (logw, beam_words, jnp.where(at_row, logw[None, :], acc_logw),
                jnp.where(at_row, _take(chosen, cand_tok, 0)[None, :], acc_tok),
                jnp.where(at_row, _take(chosen, pair_i, 0)[None, :], acc_par),
                [jnp.where(at_row, w[None, :], a) for w, a in zip(beam_words, acc_words)])

    carry = (logw, beam_words, acc_logw, acc_tok, acc_par, acc_words)
    _, _, acc_logw, acc_tok, acc_par, acc_words = jax.lax.fori_loop(1, depth, extend, carry)

    # global order of every beam entry (d, w) by (-logw, words, d * width + w), one depth row at a time
    flat = rows * width + _iota((depth2, width), 1)
    keys_p = [key[:, :, None] for key in (-acc_logw, *acc_words)]

    def count_row(dq, order):
        at_q = rows == dq
        keys_q = [(-jnp.max(jnp.where(at_q, acc_logw, neg), axis=0))[None, None, :],
                  *[jnp.sum(jnp.where(at_q, a, 0), axis=0)[None, None, :] for a in acc_words]]
        before = (dq * width + _iota((width,), 0))[None, None, :] < flat[:, :, None]
        return order + jnp.sum(_precedes(keys_q, keys_p, before).astype(jnp.int32), axis=2)

    order = jax.lax.fori_loop(0, depth2, count_row, jnp.zeros((depth2, width), jnp.int32))
    real = acc_logw > neg
    node = jnp.where(order < budget, order + 1, -1)
    # parent node of (d, w): the node of entry acc_par[d, w] of row d - 1
    shape3 = (depth2, depth2, width)
    node_above = jnp.sum(jnp.where(_iota(shape3, 1) == _iota(shape3, 0) - 1, node[None, :, :], 0), axis=1)
    shape3 = (depth2, width, width)
    parent = jnp.sum(jnp.where(acc_par[:, :, None] == _iota(shape3, 2), node_above[:, None, :], 0), axis=2)
    parent = jnp.where(rows == 0, 0, parent)

    slots = (budget, depth2, width)
    hit = order[None, :, :] == _iota(slots, 0)
    fields = ((tok_out, jnp.where(real, acc_tok, 0)), (par_out, jnp.where(real, parent, -1)),
              (depth_out, jnp.where(real, rows + 1, 0)), (logw_out, jnp.where(real, acc_logw, neg)))
    for out, field in fields:  # slot s takes the entry ordered s-th: a reduction over the tiles
        floating = jnp.issubdtype(field.dtype, jnp.floating)
        picked = jnp.where(hit, field[None, :, :], neg if floating else 0)
        reduce = jnp.max if floating else jnp.sum
        out[...] = reduce(reduce(picked, axis=2), axis=1)
