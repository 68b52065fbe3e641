"""The DDTree beam and its global best-first order, one program per request.

Given each depth's top ``K`` draft log-probabilities and token ids (descending, ties by lower id),
the best ``B`` prefixes of depth ``d`` extend the best ``B`` of depth ``d - 1`` (a width-``B`` beam),
and one order of all beams by (``-logw``, rank tuple) gives the best-first pop order. XLA runs this
as two reductions per depth (28 kernels of about a microsecond at ``L = 15`` on an H200) plus the
global order's own; here the whole of it is one program per request:

- each depth's candidates are the static pairs (beam entry ``i``, rank ``r``) with
  ``(i + 1)(r + 1) <= B``, in chunks of ``chunk`` candidates (`TreeBuildConfig`; ``0``: one chunk of
  all of them), each loaded from the previous depth's beam and the depth's row;
- a candidate's rank is a pairwise count over (``-logw``, packed rank-tuple words, index), chunk
  against chunk, so that no tile is larger than ``chunk x chunk``; each candidate's fields are stored
  at its rank in the depth's row of scratch outputs, as wide as the candidates so that every store has
  a slot of its own, and the row's first ``B`` slots are the depth's beam, which a barrier of the
  program's threads publishes to the next depth;
- the global order: each row is sorted already, so the entries of row ``d'`` before an entry are a
  prefix of it, whose length a binary search over the stored row finds (``log2(B) + 1`` steps of
  loads over ``[L2, L2, B]`` lanes); an entry's place is the sum of its prefixes, and each field is
  stored at its place.

The result equals `tree_build_reference` (and the library's ``tree_from_top_k``), ties included:
the same keys and the same tie rule. The counts grow as ``L (B ln B)^2``; the kernel takes budgets up
to `MAX_BUDGET` (`kernel_supports`), each with the launch of `tree_build_config` unless told otherwise.
Its beams are a power of two wide: a budget between two is built at the next one, whose first ``B``
nodes are the ``B``-node tree (an entry's predecessors in the order are all in the wider beams).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MAX_BUDGET = 64
MAX_TILE = 128  # candidates on a side of a count tile: a 128 x 128 count
MAX_DEPTH = 16
MAX_CHUNKS = 16  # chunks a depth: chunks^2 count tiles are unrolled in the program
WARPS = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class TreeBuildConfig:
    """Launch of the tree-build kernel: ``num_warps`` Triton warps a program (one of `WARPS`),
    ``chunk`` candidates a count tile side (``0``: all of a depth's candidates in one tile, padded
    to a power of two; else a power of two in [8, `MAX_TILE`])."""

    num_warps: int = 8
    chunk: int = 32

    def __post_init__(self):
        if self.num_warps not in WARPS:
            raise ValueError(f"TreeBuildConfig.num_warps must be one of {WARPS}, got {self.num_warps!r}")
        if not (self.chunk == 0 or (8 <= self.chunk <= MAX_TILE and self.chunk & (self.chunk - 1) == 0)):
            raise ValueError(f"TreeBuildConfig.chunk must be 0 or a power of two in [8, {MAX_TILE}], "
                             f"got {self.chunk!r}")

    def supports(self, budget: int, k: int) -> bool:
        """Whether this launch takes a budget and width `kernel_supports` takes: its count tiles
        within `MAX_TILE` candidates and `MAX_CHUNKS` chunks."""
        tile, chunks = candidate_chunks(budget, k, self.chunk)
        return tile <= MAX_TILE and chunks <= MAX_CHUNKS


def tree_build_config(budget: int, k: int) -> TreeBuildConfig:
    """The launch `tree_nodes` uses by default, the fastest measured (BENCHMARKS.md): chunks of 32
    candidates with 8 warps, 16 at B = 64 (on an H100 at K = 4, batch 1 and 8: 0.040 / 0.054 /
    0.086-0.097 ms at B = 16 / 32 / 64)."""
    return TreeBuildConfig(num_warps=16 if budget == 64 else 8, chunk=32)


def pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``)."""
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


def candidate_chunks(budget: int, k: int, chunk: int) -> tuple[int, int]:
    """(candidates a chunk, chunks) of a depth's `beam_pairs` under ``TreeBuildConfig.chunk``."""
    pairs = len(beam_pairs(budget, k)[0])
    tile = chunk or pow2(pairs)
    return tile, -(-pairs // tile)


def kernel_supports(budget: int, k: int, depth: int) -> bool:
    """Whether the kernel takes this shape: ``budget`` in [2, `MAX_BUDGET`], ``1 <= k <= budget`` and
    ``depth <= MAX_DEPTH`` (`tree_build_config` of the beams' width, the next power of two, then gives a
    launch that takes it)."""
    return 2 <= budget <= MAX_BUDGET and 1 <= k <= budget and 1 <= depth <= MAX_DEPTH


def tree_nodes(lp_BLK, tok_BLK, *, budget: int, config: TreeBuildConfig | None = None, interpret: bool = False):
    """Nodes 1..``budget`` of each request's tree in pop order: ``(tokens, parents, depths [B, budget]
    int32, logw [B, budget] float32)``, padding ``0, -1, 0, -inf``; parents are node indices (the root
    is node 0, which the caller prepends).

    Args:
      lp_BLK: float32 ``[batch, L, K]`` each depth's top-``K`` draft log-probabilities, descending
        (``-inf`` where a depth has fewer than ``K`` tokens).
      tok_BLK: int32 ``[batch, L, K]`` their token ids (ties by lower id first).
      budget: nodes besides the root; `kernel_supports` must hold.
      config: the launch (default `tree_build_config` of the beams' width ``W``, ``budget``'s next power
        of two); ``config.supports(W, K)`` must hold.
      interpret: run in the Pallas interpreter.
    """
    batch, depth, k = check_top_k_rows(lp_BLK, tok_BLK)
    if not kernel_supports(budget, k, depth):
        raise ValueError(f"the tree-build kernel does not take budget {budget} with k {k} and depth {depth} "
                         f"(kernel_supports)")
    width = pow2(budget)
    config = tree_build_config(width, k) if config is None else config
    if not isinstance(config, TreeBuildConfig) or not config.supports(width, k):
        raise ValueError(f"config {config!r} does not take budget {budget} (beams {width} wide) with k {k} "
                         f"(TreeBuildConfig.supports)")
    return _tree_nodes(jnp.asarray(lp_BLK, jnp.float32), jnp.asarray(tok_BLK, jnp.int32), budget=int(budget),
                       config=config, interpret=bool(interpret))


def check_top_k_rows(lp_BLK, tok_BLK) -> tuple[int, int, int]:
    """``(batch, L, K)`` of a build's top-k rows; a ValueError naming the argument unless ``lp_BLK`` is
    ``[batch, L, K]`` and ``tok_BLK`` has its shape."""
    if jnp.ndim(lp_BLK) != 3:
        raise ValueError(f"lp_BLK must be [batch, L, K], got shape {jnp.shape(lp_BLK)}")
    if jnp.shape(tok_BLK) != jnp.shape(lp_BLK):
        raise ValueError(f"tok_BLK must have the shape of lp_BLK {jnp.shape(lp_BLK)}, got {jnp.shape(tok_BLK)}")
    return jnp.shape(lp_BLK)


@functools.partial(jax.jit, static_argnames=("budget", "config", "interpret"))
def _tree_nodes(lp_BLK, tok_BLK, *, budget, config: TreeBuildConfig, interpret):
    batch, depth, k = lp_BLK.shape
    width = pow2(budget)  # the beams' width, whose tree's first `budget` nodes are the answer
    depth2, k2 = pow2(depth), pow2(k)
    pair_i, pair_r = beam_pairs(width, k)
    tile, chunks = candidate_chunks(width, k, config.chunk)
    # padding pairs match no beam entry and no rank: -inf candidates
    pair_i = np.pad(pair_i, (0, tile * chunks - len(pair_i)), constant_values=width)
    pair_r = np.pad(pair_r, (0, tile * chunks - len(pair_r)), constant_values=k2)
    pad = [(0, 0), (0, depth2 - depth), (0, k2 - k)]
    lp = jnp.pad(lp_BLK, pad, constant_values=-jnp.inf)
    tok = jnp.pad(tok_BLK, pad)
    bits, per_word, words = rank_packing(k, depth)
    kernel = functools.partial(_kernel, width=width, k=k, depth=depth, bits=bits, per_word=per_word, words=words,
                               tile=tile, chunks=chunks, barrier=not interpret)
    row_spec = pl.BlockSpec((None, depth2, k2), lambda b: (b, 0, 0))
    pair_spec = pl.BlockSpec((tile * chunks,), lambda b: (0,))
    slots = depth2 * width  # every entry stored at its place
    out_spec = pl.BlockSpec((None, slots), lambda b: (b, 0))
    ints, floats = jax.ShapeDtypeStruct((batch, slots), jnp.int32), jax.ShapeDtypeStruct((batch, slots), jnp.float32)
    out_specs, out_shape = [out_spec] * 4, [ints, ints, ints, floats]
    # scratch: each depth's ranked candidates (a slot for every one, the beam the first `width`), which the
    # next depth's candidates and the order load, and each entry's place, which its children load
    row = tile * chunks
    beam_spec = pl.BlockSpec((None, depth2, row), lambda b: (b, 0, 0))
    out_specs += [beam_spec] * 3 + [pl.BlockSpec((None, words, depth2, row), lambda b: (b, 0, 0, 0))]
    out_shape += [jax.ShapeDtypeStruct((batch, *shape), dtype) for shape, dtype in (
        ((depth2, row), jnp.float32), ((depth2, row), jnp.int32), ((depth2, row), jnp.int32),
        ((words, depth2, row), jnp.int32))]
    out_specs.append(pl.BlockSpec((None, depth2, width), lambda b: (b, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((batch, depth2, width), jnp.int32))
    fields = pl.pallas_call(
        kernel, grid=(batch,), in_specs=[row_spec, row_spec, pair_spec, pair_spec], out_specs=out_specs,
        out_shape=out_shape, interpret=interpret, name="tree_build",
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=1),
    )(lp, tok, jnp.asarray(pair_i), jnp.asarray(pair_r))[:4]
    return tuple(field[:, :budget] for field in fields)


def _iota(shape, axis):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _take(hit, values, low):
    """``out[p] = values[q]`` for the one ``q`` with ``hit[p, q]`` (``low`` where none): a reduction, the
    max of floats (filled with -inf) or the sum of ints (filled with 0)."""
    picked = jnp.where(hit, values[None, :], low)
    return jnp.max(picked, axis=1) if jnp.issubdtype(picked.dtype, jnp.floating) else jnp.sum(picked, axis=1)


def _precedes(keys_q, keys_p, before):
    """Whether q sorts before p by ``(keys...)``, ties to ``before`` (broadcast arrays)."""
    for kq, kp in reversed(list(zip(keys_q, keys_p))):
        before = (kq < kp) | ((kq == kp) & before)
    return before


def _kernel(lp_ref, tok_ref, pair_i_ref, pair_r_ref, tok_out, par_out, depth_out, logw_out, logw_buf, tok_buf,
            par_buf, words_buf, place_buf, *, width, k, depth, bits, per_word, words, tile, chunks, barrier):
    """Program b: request b's beams, ``width`` entries a depth, over the ``[L2, K2]`` rows, then every
    entry stored at its place in the global order.
    Scratch: every depth's ranked candidates as a row, logw, tokens, parents ``[L2, C]`` and rank words
    ``[words, L2, C]`` (``C`` the depth's padded candidates, the beam the first ``B`` of a row), and the
    ``[L2, B]`` places of the entries; ``barrier``: whether to synchronise the program's threads
    between their stores and loads (not in the interpreter, which runs them in order)."""
    neg = jnp.float32(-jnp.inf)
    depth2, k2 = lp_ref.shape
    rows = _iota((depth2, width), 0)

    # depth 1: the beam is the row's first K entries (ranks 0..K-1), padded with -inf
    first = _iota((width, k2), 0) == _iota((width, k2), 1)
    logw = _take(first, lp_ref[0, :], neg)
    beam_rank = jnp.where(_iota((width,), 0) < k, _iota((width,), 0), 0)
    beam_words = [((beam_rank + 1) << (bits * (per_word - 1))) if x == 0 else jnp.zeros((width,), jnp.int32)
                  for x in range(words)]
    tok = _take(first, tok_ref[0, :], 0)
    pair_chunks = [(pair_i_ref[pl.ds(a * tile, tile)], pair_r_ref[pl.ds(a * tile, tile)]) for a in range(chunks)]
    for buf, values in ((logw_buf, logw), (tok_buf, tok), (par_buf, jnp.full((width,), -1, jnp.int32))):
        buf[pl.ds(0, 1), pl.ds(0, width)] = values[None, :]
    for x, w in enumerate(beam_words):
        words_buf[x, pl.ds(0, 1), pl.ds(0, width)] = w[None, :]
    if barrier:
        plt.debug_barrier()

    def candidates(d, pair_i, pair_r):
        """A chunk's candidates at depth d: (logw, token, rank-tuple words), loaded from the beam of
        depth d - 1 and row d; padding pairs (i = B, r = K2) load a clamped entry and become -inf."""
        real = pair_i < width
        i, r = jnp.minimum(pair_i, width - 1), jnp.minimum(pair_r, k2 - 1)
        d_T, above_T = jnp.full((tile,), d, jnp.int32), jnp.full((tile,), d - 1, jnp.int32)
        beam_logw = jnp.where(real, plt.load(logw_buf.at[above_T, i]), neg)
        beam_w = [jnp.where(real, plt.load(words_buf.at[jnp.full((tile,), x, jnp.int32), above_T, i]), 0)
                  for x in range(words)]
        row_lp = jnp.where(real, plt.load(lp_ref.at[d_T, r]), neg)
        row_tok = jnp.where(real, plt.load(tok_ref.at[d_T, r]), 0)
        word = jax.lax.div(d, jnp.int32(per_word))  # d >= 0: lax's truncating div and rem are the floor ones
        new_rank = jnp.where(pair_r < k, pair_r + 1, 0) << (bits * (per_word - 1 - jax.lax.rem(d, jnp.int32(per_word))))
        return beam_logw + row_lp, row_tok, [w + jnp.where(word == x, new_rank, 0) for x, w in enumerate(beam_w)]

    # The launches' times on an H200 fit about 0.23 us per reduction across the program's warps
    # (docs/design.md), so the chunks' count tiles are added up elementwise and reduced once a rank.
    def rank(keys_a, keys, a):
        """Candidates of chunk a: how many of all the chunks' candidates sort before each."""
        count = None
        for b, keys_b in enumerate(keys):  # ties by candidate index: chunk b's all before chunk a's when b < a
            before = (_iota((tile, tile), 0) < _iota((tile, tile), 1)) if a == b else jnp.full((tile, tile), b < a)
            before = _precedes([key[:, None] for key in keys_b], [key[None, :] for key in keys_a], before)
            count = before.astype(jnp.int32) if count is None else count + before.astype(jnp.int32)
        return jnp.sum(count, axis=0)

    def extend(d, carry):
        """Depth d: each candidate's fields stored at its rank in row d of the scratch, then a barrier;
        ranks are distinct and the row has a slot for each candidate."""
        cands = [candidates(d, pair_i, pair_r) for pair_i, pair_r in pair_chunks]
        keys = [[-cand_logw, *cand_words] for cand_logw, _, cand_words in cands]
        d_T = jnp.full((tile,), d, jnp.int32)
        for a, ((cand_logw, cand_tok, cand_words), (pair_i, _)) in enumerate(zip(cands, pair_chunks)):
            slot = rank(keys[a], keys, a)
            for buf, values in ((logw_buf, cand_logw), (tok_buf, cand_tok), (par_buf, pair_i)):
                plt.store(buf.at[d_T, slot], values)
            for x, w in enumerate(cand_words):
                plt.store(words_buf.at[jnp.full((tile,), x, jnp.int32), d_T, slot], w)
        if barrier:
            plt.debug_barrier()
        return carry

    jax.lax.fori_loop(1, depth, extend, jnp.int32(0))
    # the beams back from the scratch rows; rows past the last depth are padding
    live, beam = rows < depth, pl.ds(0, width)
    acc_logw = jnp.where(live, logw_buf[:, beam], neg)
    acc_tok, acc_par = jnp.where(live, tok_buf[:, beam], 0), jnp.where(live, par_buf[:, beam], -1)
    acc_words = [jnp.where(live, words_buf[x, :, beam], 0) for x in range(words)]
    _search_order(acc_logw, acc_tok, acc_par, acc_words, (tok_out, par_out, depth_out, logw_out),
                  (logw_buf, words_buf, place_buf), barrier=barrier)


def prefix_lengths(precedes, shape, width: int):
    """Lane by lane, the length of the prefix of a row of ``width`` entries (a power of two) on which
    ``precedes(at)`` holds, ``at`` an int ``[shape]`` array of positions (it must hold on a prefix of the
    row and nowhere after): a binary search of ``log2(width) + 1`` calls of ``precedes``."""
    length = jnp.zeros(shape, jnp.int32)
    step = width // 2
    while step:
        length = length + jnp.where(precedes(length + step - 1), step, 0)
        step //= 2
    return length + precedes(length).astype(jnp.int32)  # length <= width - 1 here: one entry left to test


def _search_order(acc_logw, acc_tok, acc_par, acc_words, outs, scratch, *, barrier):
    """The fields of the entries in the global order, stored into ``outs`` (tokens, parents, depths,
    logw; ``[L2 * B]`` each, of which the caller keeps the first ``B``) at each entry's place: tokens,
    parent nodes (0 the root, -1 padding), depths (1 at the first), logw (-inf padding).

    Each row is a beam, sorted by the order's key (-logw, words, ``d * width + w``), so the entries of
    row d' before entry (d, w) are a prefix of it, whose length a binary search over the stored row
    finds: ``log2(width) + 1`` steps, each a load per key over ``[L2 (d'), L2 (d), width (w)]`` lanes.
    The place is the sum over d'. The places form a permutation of the ``L2 * B`` slots, each stored
    once; an entry's parent node is its parent's place + 1, loaded from the stored places
    (``scratch``: `_kernel`'s logw, rank words and places)."""
    neg = jnp.float32(-jnp.inf)
    logw_buf, words_buf, place_buf = scratch
    depth2, width = acc_logw.shape
    rows, cols = _iota((depth2, width), 0), _iota((depth2, width), 1)
    beam = pl.ds(0, width)
    logw_buf[:, beam] = acc_logw  # the rows past the last depth too, which the beam left unstored
    for x, w in enumerate(acc_words):
        words_buf[x, :, beam] = w
    if barrier:
        plt.debug_barrier()

    lanes = (depth2, depth2, width)
    row_q = _iota(lanes, 0)
    keys_p = [(-acc_logw)[None], *[w[None] for w in acc_words]]
    flat_p = (rows * width + cols)[None]

    def precedes(at):
        """Whether entry (d', at) of row d' sorts before entry (d, w), lane by lane."""
        keys_q = [-plt.load(logw_buf.at[row_q, at]),
                  *[plt.load(words_buf.at[jnp.full(lanes, x, jnp.int32), row_q, at]) for x in range(len(acc_words))]]
        return _precedes(keys_q, keys_p, row_q * width + at < flat_p)

    place = jnp.sum(prefix_lengths(precedes, lanes, width), axis=0)  # the prefixes of row d' before (d, w)

    place_buf[...] = place
    if barrier:
        plt.debug_barrier()
    above = plt.load(place_buf.at[jnp.maximum(rows - 1, 0), jnp.clip(acc_par, 0, width - 1)])
    real = acc_logw > neg
    fields = (jnp.where(real, acc_tok, 0), jnp.where(real, jnp.where(rows == 0, 0, above + 1), -1),
              jnp.where(real, rows + 1, 0), jnp.where(real, acc_logw, neg))
    for out, field in zip(outs, fields):
        plt.store(out.at[place], field)
