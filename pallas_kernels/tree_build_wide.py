"""The DDTree beam and its global best-first order for large budgets: a grid of programs a depth.

Same contract as `tree_build.tree_nodes` (and `tree_build_reference`): given each depth's top ``K``
draft log-probabilities and ids, the best ``B`` prefixes of each depth extend the best ``B`` of the
depth before, and one order of all of them by (``-logw``, rank tuple) gives the pop order. The
one-program kernel of `tree_build` counts a depth's ``P`` candidates (``about B ln B``) pairwise in
one program, ``P^2`` comparisons: at ``B = 512`` (3,280 candidates) one SM cannot do that in time. Here
each depth is one launch over ``(batch, P / rows)`` programs:

- every program needs all ``P`` candidates' keys, each a sum of the previous beam's and the depth row's
  log-weights gathered by the candidate's (beam entry, rank): either every program computes them all once,
  stores them to one scratch row and reads them back in slices after a barrier (the same values in every
  program), or it gathers each slice again where it compares it (``gather_keys``: no stores, no barrier;
  faster from 512 padded candidates, `wide_build_config`);
- the keys are ``(-logw, lex)``: ``lex`` orders a depth's candidates as their rank tuples do, without
  the tuples' words: ``lex = lex_rank(parent) * K + rank``, where ``lex_rank`` is the parent's place by
  ``lex`` among the previous depth's candidates (``lex`` is the rank itself at depth 1). Comparing two
  ints replaces comparing ``words`` ints;
- program ``c`` counts, for each of its ``rows`` candidates, how many of all ``P`` sort before it
  (its rank) and how many have a lower ``lex`` (its ``lex_rank``), ``cols`` candidates a step; a
  candidate ranked below ``B`` stores its fields at its rank in the depth's row of the beams, which
  pass from launch to launch in place (``input_output_aliases``).

The global order is one more launch over ``(batch, L * B / entries)`` programs, as in `tree_build`:
each row is sorted, so the entries of row ``d'`` before an entry are a prefix of it, found by a binary
search; the rank tuples' words are loaded only where ``logw`` ties. Each entry stores its fields at its
place, and the parents' places become node indices in jnp after it.

Why the orders agree with the reference. Within a depth, ``lex`` order is rank-tuple order: by
induction, parents in ``lex_rank`` order are in tuple order, and a child's tuple is its parent's
followed by its rank. ``-inf`` entries (padding) are ordered by their place in their row instead of
their words; they are padding in the result whichever order they take, and entries of finite ``logw``
sort before all of them in either order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.configs import is_pow2
from pallas_kernels.tree_build import (
    MAX_DEPTH,
    WARPS,
    beam_pairs,
    check_top_k_rows,
    pow2,
    prefix_lengths,
    rank_packing,
)

MAX_PAIRS = 8192  # a depth's candidates, padded to a power of two: every program holds all their keys
_PAD_LEX = 1 << 30  # padding candidates' lex (plus their index): after every real candidate's
_KEY_CHUNK = 1024  # candidates whose keys a program computes at once


@dataclasses.dataclass(frozen=True)
class WideBuildConfig:
    """Launches of the wide build: ``rows`` candidates a program ranks, ``cols`` candidates it compares
    them with a step (at most a depth's padded candidates), ``entries`` a program of the global order,
    ``num_warps`` warps a program (powers of two; ``rows * cols`` and ``entries * L`` are the largest
    tiles a thread block holds); ``gather_keys``: gather the compared candidates' keys at each step
    instead of storing them all first (the module docstring). The default is the fastest launch measured
    with stored keys: on an H100 at B = 512, K = 512, batch 1, the beam and order took 0.245 ms in a loop
    against 0.55 ms with 128 candidates a step and 4 warps (each step's loads wait on the step before:
    fewer, wider steps) and XLA's 0.87 ms; `wide_build_config` gathers the keys where that measured faster."""

    rows: int = 32
    cols: int = 1024
    entries: int = 64
    num_warps: int = 16
    gather_keys: bool = False

    def __post_init__(self):
        if self.gather_keys not in (False, True):
            raise ValueError(f"WideBuildConfig.gather_keys must be a bool, got {self.gather_keys!r}")
        for field in ("rows", "cols", "entries"):
            value = getattr(self, field)
            if not (is_pow2(value) and 8 <= value <= 1024):
                raise ValueError(f"WideBuildConfig.{field} must be a power of two in [8, 1024], got {value!r}")
        if self.num_warps not in WARPS:
            raise ValueError(f"WideBuildConfig.num_warps must be one of {WARPS}, got {self.num_warps!r}")


def padded_pairs(budget: int, k: int, config: WideBuildConfig) -> int:
    """A depth's candidates (`beam_pairs`) padded to a power of two of at least ``rows``."""
    return max(pow2(len(beam_pairs(budget, k)[0])), config.rows)


# Padded candidates a depth from which `wide_build_config` gathers the keys at each step: on an H100 (K = 4,
# batch 1) the beam and order took 0.082 against 0.102 ms at B = 128 (512 padded candidates) and 0.097
# against 0.065 ms at B = 64 (256); uncapped at B = 512 (4,096) 0.205 against 0.261 ms (BENCHMARKS.md).
GATHER_KEYS_MIN_PAIRS = 512


def wide_build_config(budget: int, k: int) -> WideBuildConfig:
    """The launch `tree_nodes_wide` uses by default: `WideBuildConfig()`, gathering the keys at each step
    from `GATHER_KEYS_MIN_PAIRS` padded candidates a depth."""
    stored = WideBuildConfig()
    return dataclasses.replace(stored, gather_keys=padded_pairs(budget, k, stored) >= GATHER_KEYS_MIN_PAIRS)


def kernel_supports(budget: int, k: int, depth: int) -> bool:
    """Whether the wide build takes this shape: ``budget >= 2``, ``1 <= k <= budget``, ``1 <= depth <=
    MAX_DEPTH`` and at most `MAX_PAIRS` candidates a depth once padded (budgets up to 1,024)."""
    return (2 <= budget and 1 <= k <= budget and 1 <= depth <= MAX_DEPTH
            and pow2(len(beam_pairs(budget, k)[0])) <= MAX_PAIRS)


def tree_nodes_wide(lp_BLK, tok_BLK, *, budget: int, config: WideBuildConfig | None = None, interpret: bool = False):
    """Nodes 1..``budget`` of each request's tree in pop order, as `tree_build.tree_nodes`: ``(tokens,
    parents, depths [B, budget] int32, logw [B, budget] float32)``, padding ``0, -1, 0, -inf``; parents
    are node indices (the root, node 0, is the caller's).

    Args:
      lp_BLK: float32 ``[batch, L, K]`` each depth's top-``K`` draft log-probabilities, descending
        (``-inf`` where a depth has fewer than ``K`` tokens).
      tok_BLK: int32 ``[batch, L, K]`` their token ids (ties by lower id first).
      budget: nodes besides the root; `kernel_supports` must hold.
      config: the launches (default `wide_build_config`).
      interpret: run in the Pallas interpreter.
    """
    _, depth, k = check_top_k_rows(lp_BLK, tok_BLK)
    if not (isinstance(budget, int) and kernel_supports(budget, k, depth)):
        raise ValueError(f"the wide tree build does not take budget {budget!r} with k {k} and depth {depth} "
                         f"(kernel_supports)")
    config = wide_build_config(budget, k) if config is None else config
    if not isinstance(config, WideBuildConfig):
        raise ValueError(f"config must be a WideBuildConfig, got {config!r}")
    return _tree_nodes_wide(jnp.asarray(lp_BLK, jnp.float32), jnp.asarray(tok_BLK, jnp.int32), budget=budget,
                            config=config, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("budget", "config", "interpret"))
def _tree_nodes_wide(lp_BLK, tok_BLK, *, budget, config: WideBuildConfig, interpret):
    batch, depth, k = lp_BLK.shape
    depth2, k2 = pow2(depth), pow2(k)
    pad = [(0, 0), (0, depth2 - depth), (0, k2 - k)]
    lp, tok = jnp.pad(lp_BLK, pad, constant_values=-jnp.inf), jnp.pad(tok_BLK, pad)
    bits, per_word, words = rank_packing(k, depth)

    pair_i, pair_r = beam_pairs(budget, k)
    pairs = padded_pairs(budget, k, config)
    # The beams [batch, L2, P] (rank tuple words [batch, words, L2, P]): row d's first B slots are depth
    # d + 1's beam, the rest stay -inf padding (a slot for every candidate's rank, so that no two lanes of
    # a masked store share one: the interpreter's masked stores would write back the masked lanes' old
    # values over a kept one). Depth 1 is the row's K best, padded with -inf.
    slot = jnp.arange(pairs, dtype=jnp.int32)
    first = slot < k
    rank = jnp.minimum(slot, k2 - 1)
    row0 = [jnp.where(first, lp[:, 0, rank], -jnp.inf), jnp.where(first, tok[:, 0, rank], 0),
            jnp.full((batch, pairs), -1, jnp.int32), jnp.broadcast_to(slot, (batch, pairs))]
    fills = (-jnp.inf, 0, -1, 0)
    beams = [jnp.full((batch, depth2, pairs), fill, row.dtype).at[:, 0].set(row) for row, fill in zip(row0, fills)]
    words0 = jnp.where(first, (slot + 1) << (bits * (per_word - 1)), 0)
    beams.append(jnp.zeros((batch, words, depth2, pairs), jnp.int32).at[:, 0, 0].set(
        jnp.broadcast_to(words0, (batch, pairs))))
    pair_i = jnp.asarray(np.pad(pair_i, (0, pairs - len(pair_i)), constant_values=budget))
    pair_r = jnp.asarray(np.pad(pair_r, (0, pairs - len(pair_r)), constant_values=k2))
    extend = _extend_call(batch, depth2, k2, words, pairs, budget=budget, k=k, bits=bits, per_word=per_word,
                          config=config, interpret=interpret)
    for d in range(1, depth):
        beams = extend(jnp.full((1,), d, jnp.int32), lp, tok, pair_i, pair_r, *beams)
    logw, tok, par, _, words = beams  # lex orders candidates within a depth only
    return _order(logw, tok, par, words, budget=budget, config=config, interpret=interpret)


def _extend_call(batch, depth2, k2, words, pairs, *, budget, k, bits, per_word, config, interpret):
    """One depth's launch: ``fn(d [1], lp, tok, pair_i, pair_r, logw, tok, parent, lex, words) -> the five
    beams with row d written`` (in place)."""
    b_map3, b_map4 = (lambda b, c: (b, 0, 0)), (lambda b, c: (b, 0, 0, 0))
    row_spec, beam_spec = pl.BlockSpec((None, depth2, k2), b_map3), pl.BlockSpec((None, depth2, pairs), b_map3)
    words_spec = pl.BlockSpec((None, words, depth2, pairs), b_map4)
    full = pl.BlockSpec((pairs,), lambda b, c: (0,))
    scratch_spec = pl.BlockSpec((None, pairs), lambda b, c: (b, 0))
    kernel = functools.partial(_extend_kernel, budget=budget, k=k, bits=bits, per_word=per_word, words=words,
                               rows=config.rows, cols=min(config.cols, pairs), barrier=not interpret,
                               gather_keys=config.gather_keys)
    beam_shapes = [jax.ShapeDtypeStruct((batch, depth2, pairs), dtype)
                   for dtype in (jnp.float32, jnp.int32, jnp.int32, jnp.int32)]
    out_shape = [*beam_shapes, jax.ShapeDtypeStruct((batch, words, depth2, pairs), jnp.int32),
                 jax.ShapeDtypeStruct((batch, pairs), jnp.float32), jax.ShapeDtypeStruct((batch, pairs), jnp.int32)]
    call = pl.pallas_call(
        kernel, grid=(batch, pairs // config.rows),
        in_specs=[pl.BlockSpec((1,), lambda b, c: (0,)), row_spec, row_spec, full, full, *[beam_spec] * 4, words_spec],
        out_specs=[*[beam_spec] * 4, words_spec, scratch_spec, scratch_spec], out_shape=out_shape,
        input_output_aliases={5 + x: x for x in range(5)}, interpret=interpret, name="tree_build_wide_depth",
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=2))
    return lambda *args: call(*args)[:5]


def _extend_kernel(d_ref, lp_ref, tok_ref, pair_i_ref, pair_r_ref, logw_in, tok_in, par_in, lex_in, words_in,
                   logw_out, tok_out, par_out, lex_out, words_out, neg_logw_buf, lex_buf, *, budget, k, bits, per_word,
                   words, rows, cols, barrier, gather_keys):
    """Program (b, c): depth d's candidates ``[c * rows, (c + 1) * rows)`` ranked among all of the depth's,
    those ranked below the budget stored at their rank in row d of the beams. Scratch (unused with
    ``gather_keys``): every candidate's ``-logw`` and ``lex``, ``[P]`` each."""
    del par_in, tok_in  # aliased to par_out and tok_out, which only this depth's row is written to
    d = d_ref[0]
    pairs, k2 = pair_i_ref.shape[0], lp_ref.shape[1]

    def clamped(pair_i, pair_r):  # the beam entry and rank a pair loads (padding pairs: in range, unused)
        return jnp.minimum(pair_i, budget - 1), jnp.minimum(pair_r, k2 - 1)

    def keys(start, size):  # (-logw, lex) of candidates [start, start + size)
        part = pl.ds(start, size)
        pair_i, pair_r = pair_i_ref[part], pair_r_ref[part]
        i, r = clamped(pair_i, pair_r)
        real = pair_i < budget  # padding pairs (i = B): -inf, lex after every real one's
        above, here = jnp.full((size,), d - 1, jnp.int32), jnp.full((size,), d, jnp.int32)
        logw = plt.load(logw_in.at[above, i]) + plt.load(lp_ref.at[here, r])
        return (jnp.where(real, -logw, jnp.inf),
                jnp.where(real, plt.load(lex_in.at[above, i]) * k + pair_r,
                          _PAD_LEX + start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)))

    own = pl.ds(pl.program_id(1) * rows, rows)
    if gather_keys:
        q_neg_logw, q_lex = keys(pl.program_id(1) * rows, rows)
    else:
        size = min(pairs, _KEY_CHUNK)
        for start in range(0, pairs, size):  # unrolled: independent loads, a bounded number of registers
            neg_logw_buf[pl.ds(start, size)], lex_buf[pl.ds(start, size)] = keys(start, size)
        if barrier:
            plt.debug_barrier()
        q_neg_logw, q_lex = neg_logw_buf[own], lex_buf[own]
    q_key, q_lex = q_neg_logw[None, :], q_lex[None, :]

    def count(step, carry):  # candidates [step * cols, (step + 1) * cols) against this program's
        rank, lex_rank = carry
        if gather_keys:
            p_key, p_lex = keys(step * cols, cols)
        else:
            chunk = pl.ds(step * cols, cols)
            p_key, p_lex = neg_logw_buf[chunk], lex_buf[chunk]
        p_key, p_lex = p_key[:, None], p_lex[:, None]
        lex_before = p_lex < q_lex
        before = (p_key < q_key) | ((p_key == q_key) & lex_before)
        return (rank + jnp.sum(before.astype(jnp.int32), axis=0),
                lex_rank + jnp.sum(lex_before.astype(jnp.int32), axis=0))

    zeros = jnp.zeros((rows,), jnp.int32)
    rank, lex_rank = jax.lax.fori_loop(0, pairs // cols, count, (zeros, zeros))

    pair_i = pair_i_ref[own]
    i, r = clamped(pair_i, pair_r_ref[own])
    logw = -q_neg_logw
    keep = rank < budget
    here, above = jnp.full((rows,), d, jnp.int32), jnp.full((rows,), d - 1, jnp.int32)
    word = jax.lax.div(d, jnp.int32(per_word))
    new_rank = (r + 1) << (bits * (per_word - 1 - jax.lax.rem(d, jnp.int32(per_word))))
    for out, values in ((logw_out, logw), (tok_out, plt.load(tok_ref.at[here, r])), (par_out, pair_i),
                        (lex_out, lex_rank)):
        plt.store(out.at[here, rank], values, mask=keep)
    for x in range(words):
        x_R = jnp.full((rows,), x, jnp.int32)
        parent_words = plt.load(words_in.at[x_R, above, i])
        plt.store(words_out.at[x_R, here, rank], parent_words + jnp.where(word == x, new_rank, 0), mask=keep)


def _order(logw, tok, par, words, *, budget, config, interpret):
    """The global order of the beams' first ``W2`` slots a row (`_order_kernel`), then each node's parent
    entry made a node index."""
    batch, depth2, _ = logw.shape
    num_words, width2 = words.shape[1], pow2(budget)
    slots = depth2 * width2
    entries = min(config.entries, slots)
    beam_spec = pl.BlockSpec((None, depth2, width2), lambda b, c: (b, 0, 0))
    out_spec = pl.BlockSpec((None, slots), lambda b, c: (b, 0))
    ints, floats = jax.ShapeDtypeStruct((batch, slots), jnp.int32), jax.ShapeDtypeStruct((batch, slots), jnp.float32)
    kernel = functools.partial(_order_kernel, budget=budget, entries=entries)
    tok_o, depth_o, logw_o, parent_o, place = pl.pallas_call(
        kernel, grid=(batch, slots // entries),
        in_specs=[beam_spec] * 3 + [pl.BlockSpec((None, num_words, depth2, width2), lambda b, c: (b, 0, 0, 0))],
        out_specs=[out_spec] * 5, out_shape=[ints, ints, floats, ints, ints],
        interpret=interpret, name="tree_build_wide_order",
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=1),
    )(logw, tok, par, words)
    tok_o, depth_o, logw_o, parent_o = (x[:, :budget] for x in (tok_o, depth_o, logw_o, parent_o))
    parent_node = jnp.take_along_axis(place, jnp.maximum(parent_o, 0), axis=1) + 1
    parents = jnp.where(depth_o == 0, -1, jnp.where(depth_o == 1, 0, parent_node))
    return tok_o, parents, depth_o, logw_o


def _order_kernel(logw_ref, tok_ref, par_ref, words_ref, tok_out, depth_out, logw_out, parent_out, place_out, *,
                  budget, entries):
    """Program (b, c): the entries ``[c * entries, (c + 1) * entries)`` of the flat ``[L2 * W2]`` beams, each
    placed in the global order by (``-logw``, rank-tuple words, flat index) for finite ``logw`` and
    (``+inf``, flat index) for padding, and its fields stored at its place when it is below the budget;
    ``place_out`` gets every entry's place, ``parent_out`` its parent's flat index (stored nodes only); the
    outputs have a slot for every place, so that no two lanes of a masked store share one."""
    depth2, width2 = logw_ref.shape
    num_words = words_ref.shape[0]
    shift = width2.bit_length() - 1
    flat = pl.program_id(1) * entries + jax.lax.broadcasted_iota(jnp.int32, (entries,), 0)
    d, w = flat >> shift, flat & (width2 - 1)
    logw = plt.load(logw_ref.at[d, w])
    finite = logw > -jnp.inf
    q_key = -logw
    q_words = [plt.load(words_ref.at[jnp.full((entries,), x, jnp.int32), d, w], mask=finite, other=0)
               for x in range(num_words)]

    lanes = (depth2, entries)
    row_p = jax.lax.broadcasted_iota(jnp.int32, lanes, 0)

    def precedes(at):
        """Whether entry (d', at) of row d' sorts before this program's entries, lane by lane."""
        p_key = -plt.load(logw_ref.at[row_p, at])
        tie = p_key == q_key[None, :]
        word_tie = tie & finite[None, :]
        before = (row_p << shift) + at < flat[None, :]
        for x in reversed(range(num_words)):  # the words decide a finite tie, the flat index the rest
            p_word = plt.load(words_ref.at[jnp.full(lanes, x, jnp.int32), row_p, at], mask=word_tie, other=0)
            q_word = q_words[x][None, :]
            before = jnp.where(word_tie, (p_word < q_word) | ((p_word == q_word) & before), before)
        return (p_key < q_key[None, :]) | (tie & before)

    place = jnp.sum(prefix_lengths(precedes, lanes, width2), axis=0)  # the prefixes of each row before the entry

    plt.store(place_out.at[flat], place)
    keep = place < budget
    parent = jnp.where(d > 0, ((d - 1) << shift) + plt.load(par_ref.at[d, w]), 0)
    fields = ((tok_out, jnp.where(finite, plt.load(tok_ref.at[d, w]), 0)), (depth_out, jnp.where(finite, d + 1, 0)),
              (logw_out, jnp.where(finite, logw, -jnp.inf)), (parent_out, jnp.where(finite, parent, 0)))
    for out, values in fields:
        plt.store(out.at[place], values, mask=keep)
