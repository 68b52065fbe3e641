"""jnp reference of `tree_build.tree_nodes`: the beam and the global order by stable sorts.

Written for plainness: each depth extends every beam entry by every rank (``B x K`` candidates)
and keeps the first ``B`` of a stable sort by (``-logw``, rank-tuple words); the global order is a
stable sort of all beams by the same keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.tree_build import rank_packing


@functools.partial(jax.jit, static_argnames=("budget",))
def tree_nodes_reference(lp_BLK, tok_BLK, *, budget: int):
    """Same arguments and result as `tree_build.tree_nodes` (any budget >= K)."""
    return jax.vmap(functools.partial(_one_request, budget=budget))(lp_BLK.astype(jnp.float32),
                                                                   tok_BLK.astype(jnp.int32))


def _first_by_key(logw_P, words_PX):
    """Entry indices sorted by (-logw, words, index)."""
    index = jnp.arange(logw_P.shape[0], dtype=jnp.int32)
    return jnp.lexsort((index, *reversed(list(words_PX.T)), -logw_P))


def _one_request(lp_LK, tok_LK, *, budget):
    depth, k = lp_LK.shape
    width = budget
    bits, per_word, words = rank_packing(k, depth)

    def shift(d):
        return bits * (per_word - 1 - d % per_word)

    rank = jnp.arange(width, dtype=jnp.int32)
    real_rank = rank < k
    logw = jnp.where(real_rank, lp_LK[0, jnp.minimum(rank, k - 1)], -jnp.inf)
    words_WX = jnp.zeros((width, words), jnp.int32).at[:, 0].set((jnp.where(real_rank, rank, 0) + 1) << shift(0))
    beams = [(logw, words_WX, jnp.where(real_rank, tok_LK[0, jnp.minimum(rank, k - 1)], 0),
              jnp.full((width,), -1, jnp.int32))]
    beam_i = jnp.repeat(jnp.arange(width, dtype=jnp.int32), k)
    cand_r = jnp.tile(jnp.arange(k, dtype=jnp.int32), width)
    for d in range(1, depth):
        logw, words_WX = beams[-1][:2]
        cand_logw = logw[beam_i] + lp_LK[d, cand_r]
        cand_words = words_WX[beam_i].at[:, d // per_word].add((cand_r + 1) << shift(d))
        order = _first_by_key(cand_logw, cand_words)[:width]
        beams.append((cand_logw[order], cand_words[order], tok_LK[d, cand_r[order]], beam_i[order]))

    logw_C = jnp.concatenate([b[0] for b in beams])
    words_CX = jnp.concatenate([b[1] for b in beams])
    order = _first_by_key(logw_C, words_CX)
    position_C = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    node_C = jnp.where(position_C < budget, position_C + 1, -1)
    depth_C = jnp.repeat(jnp.arange(1, depth + 1, dtype=jnp.int32), width)
    parent_C = jnp.concatenate([jnp.zeros((width,), jnp.int32)]
                               + [node_C[(d - 1) * width + beams[d][3]] for d in range(1, depth)])
    real = jnp.isfinite(logw_C)
    first = order[:budget]
    return (jnp.where(real, jnp.concatenate([b[2] for b in beams]), 0)[first],
            jnp.where(real, parent_C, -1)[first].astype(jnp.int32), jnp.where(real, depth_C, 0)[first],
            jnp.where(real, logw_C, -jnp.inf)[first])
