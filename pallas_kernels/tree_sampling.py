"""Fused tree verification from target logits: one Pallas program per request walks its tree.

Same result as ``ddtree_jax.verify.verify_from_coins`` (the jnp path) for the same coins: the
walk of DESIGN.md §2 (sgl-kernel "target-only" tree rejection sampling, thresholds 1), where the
processed target row (temperature, then top-k, then top-p, see ``ddtree_jax.sampling``) is
computed from the logits only for the nodes the walk visits, by streaming the vocabulary in
blocks, never materialising probabilities and never sorting:

- ``z = logits / T``; every pass recomputes ``e = exp(z - max z)`` on the fly;
- a kept set is a prefix of the order (descending z, ascending token id), written as a boundary
  ``(w, c)``: token t is kept iff ``key(z_t) > w`` or ``key(z_t) == w and t < c``, where ``key``
  maps float32 to int32 preserving order; greedy rows keep only the argmax;
- top-k: ``w`` = the k-th largest key, built bit by bit from the most significant one (each bit
  one counting pass), then, only when ties straddle the boundary, the token-id cutoff ``c`` by
  the same search over id bits;
- top-p: the same search on the mass ``sum e`` of the kept set instead of the count;
- accepting a child reads only the children's logits; the final draw removes the rejected
  children (marked in a per-request scratch row) and inverts the cumulative distribution in
  token-id order, block sums first, then a cumulative sum inside the block.

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

from ddtree_jax.tree import DraftTree
from ddtree_jax.verify import VerifyResult, verify_from_coins
from pallas_kernels.configs import device_capability

BACKENDS = ("auto", "triton", "interpret", "xla")
_INT_MIN = -(2**31)
_SIGN_OFF = 0x7FFFFFFF


def tree_sample(tree: DraftTree, target_logits_BNV, coins_BN, final_coins_B, temperature_B, top_k_B,
                top_p_B, *, backend="auto", block_v=4096, num_warps=8, num_stages=1) -> VerifyResult:
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

    Returns:
      ``VerifyResult`` as ``verify_from_coins``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
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
                               num_stages=num_stages, interpret=backend == "interpret")


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


def _when(pred, fn, default):
    """``fn()`` if ``pred`` else ``default``; only the taken branch runs.

    ``default`` goes through ``cond`` as an operand: a branch that returns a constant does not
    lower to Triton, so ``default`` must not be a constant either.
    """
    return lax.cond(pred, lambda _: fn(), lambda d: d, default)


def _search_bits(bits, start, keep_going):
    """Largest ``u`` reachable from ``start`` by setting the ``bits`` low bits, one at a time from
    the top, while ``keep_going(candidate)`` holds (a monotone predicate)."""
    def body(i, u):
        candidate = u | lax.shift_left(jnp.int32(1), bits - 1 - i)
        return lax.select(keep_going(candidate), candidate, u)
    return lax.fori_loop(0, bits, body, start)


def _sample_kernel(temperature_ref, top_k_ref, top_p_ref, final_coin_ref, tokens_ref, parents_ref,
                   coins_ref, logits_ref, _, accept_ref, emitted_ref, rejected_ref, *, vocab,
                   block_v, num_nodes, max_depth, interpret):
    """Program b: the whole walk and final draw of request b."""
    nodes_pad = tokens_ref.shape[0]
    num_blocks = pl.cdiv(vocab, block_v)
    id_bits = max(vocab - 1, 1).bit_length()
    temperature = temperature_ref[()]
    greedy = temperature <= 0.0
    divisor = jnp.where(greedy, 1.0, temperature)
    top_k, top_p = top_k_ref[()], top_p_ref[()]
    node_ids = jnp.arange(nodes_pad)
    tokens = tokens_ref[...]
    parents = parents_ref[...]
    coins = coins_ref[...]

    def fold_row(cur, fn, init):
        """Fold ``fn(carry, ids, valid, z, key, block)`` over the vocabulary blocks of row ``cur``."""
        def body(i, carry):
            ids = i * block_v + jnp.arange(block_v)
            valid = ids < vocab
            x = plt.load(logits_ref.at[cur, pl.ds(i * block_v, block_v)], mask=valid, other=0)
            z = x.astype(jnp.float32) / divisor
            return fn(carry, ids, valid, z, _order_key(z), i)
        return lax.fori_loop(0, num_blocks, body, init)

    def count(cur, pred):
        return fold_row(cur, lambda n, ids, valid, z, key, i: n + jnp.sum(
            (valid & pred(key, ids)).astype(jnp.int32)), jnp.int32(0))

    def mass(cur, m, pred):
        return fold_row(cur, lambda s, ids, valid, z, key, i: s + jnp.sum(
            jnp.where(valid & pred(key, ids), jnp.exp(z - m), 0.0)), jnp.float32(0.0))

    def id_cutoff(cur, w, rank, in_set):
        """Smallest c such that ``rank`` tokens of ``in_set`` with key w have an id < c."""
        below = lambda c: count(cur, lambda key, ids: in_set(key, ids) & (key == w) & (ids < c))  # noqa: E731
        return _search_bits(id_bits, jnp.int32(0), lambda c: below(c) < rank) + 1

    def top_k_boundary(cur, w, c):
        k = top_k
        ge = lambda u: count(cur, lambda key, ids: key >= u) >= k  # noqa: E731
        w_k = _search_bits(31, lax.select(ge(jnp.int32(0)), jnp.int32(0), jnp.int32(_INT_MIN)), ge)
        rank = k - count(cur, lambda key, ids: key > w_k)
        ties = count(cur, lambda key, ids: key == w_k)
        everything = lambda key, ids: key == key  # noqa: E731
        cut = _when(ties > rank, lambda: id_cutoff(cur, w_k, rank, everything), rank)
        c_k = lax.select(ties > rank, cut, jnp.int32(vocab))
        return w_k, c_k

    def top_p_boundary(cur, m, w, c):
        in_k = lambda key, ids: _kept(key, ids, w, c)  # noqa: E731
        target = top_p * mass(cur, m, in_k)
        ge = lambda u: mass(cur, m, lambda key, ids: in_k(key, ids) & (key >= u)) >= target  # noqa: E731
        w_p = _search_bits(31, lax.select(ge(jnp.int32(0)), jnp.int32(0), jnp.int32(_INT_MIN)), ge)
        mass_gt = mass(cur, m, lambda key, ids: in_k(key, ids) & (key > w_p))
        e_w = jnp.exp(_key_value(w_p) - m)
        ties = count(cur, lambda key, ids: in_k(key, ids) & (key == w_p))
        keep = jnp.clip(jnp.ceil((target - mass_gt) / e_w), 1, ties).astype(jnp.int32)
        all_ties = lax.select(w_p == w, c, jnp.int32(vocab))
        c_p = _when(keep < ties, lambda: id_cutoff(cur, w_p, keep, in_k), all_ties)
        return w_p, c_p

    def row_stats(cur):
        """Max, kept-set boundary and kept mass of row ``cur`` after temperature/top-k/top-p."""
        def max_step(carry, ids, valid, z, key, i):
            m, arg = carry
            z = jnp.where(valid, z, -jnp.inf)
            block_max = jnp.max(z)
            block_arg = jnp.min(jnp.where(z == block_max, ids, vocab))
            better = block_max > m
            return lax.select(better, block_max, m), lax.select(better, block_arg, arg)

        m, arg = fold_row(cur, max_step, (jnp.float32(-jnp.inf), jnp.int32(vocab)))
        w = lax.select(greedy, _order_key(m), jnp.int32(_INT_MIN))
        c = lax.select(greedy, arg + 1, jnp.int32(vocab))
        use_k = ~greedy & (top_k > 0) & (top_k < vocab)
        w, c = _when(use_k, lambda: top_k_boundary(cur, w, c), (w, c))
        w, c = _when(~greedy & (top_p < 1.0), lambda: top_p_boundary(cur, m, w, c), (w, c))
        total = mass(cur, m, lambda key, ids: _kept(key, ids, w, c))
        return m, w, c, total

    def children(cur):
        return (parents == cur) & (node_ids > 0) & (node_ids < num_nodes)

    def step(t, carry):
        cur, active, depth, stats, accept, emitted = carry
        stats = _when(active, lambda: row_stats(cur), stats)
        m, w, c, total = stats
        is_child = children(cur)
        z = plt.load(logits_ref.at[cur, tokens]).astype(jnp.float32) / divisor
        q = jnp.where(is_child & _kept(_order_key(z), tokens, w, c), jnp.exp(z - m) / total, 0.0)
        coin = jnp.sum(jnp.where(node_ids == cur, coins, 0.0))
        hit = is_child & (coin <= jnp.cumsum(q))
        tries = active & (t < max_depth)
        took = tries & (jnp.max(hit.astype(jnp.int32)) > 0)
        child = jnp.min(jnp.where(hit, node_ids, nodes_pad))
        token = jnp.sum(jnp.where(node_ids == child, tokens, 0))
        accept = jnp.where(took & (jnp.arange(accept.shape[0]) == t + 1), child, accept)
        emitted = jnp.where(took & (jnp.arange(emitted.shape[0]) == t), token, emitted)
        return (lax.select(took, child, cur), active & (took | (t >= max_depth)),
                depth + took.astype(jnp.int32), stats, accept, emitted)

    depth_pad = accept_ref.shape[0]
    no_stats = (jnp.float32(0.0), jnp.int32(0), jnp.int32(0), jnp.float32(1.0))
    init = (jnp.int32(0), jnp.bool_(True), jnp.int32(0), no_stats,
            jnp.where(jnp.arange(depth_pad) == 0, 0, -1), jnp.full((depth_pad,), -1, jnp.int32))
    cur, active, depth, (m, w, c, _), accept, emitted = lax.fori_loop(0, max_depth + 1, step, init)

    # A walk that stopped early rejected every child of its last node; one that reached the
    # depth limit examined none of them.
    # Masked-out lanes repeat a rejected child's token rather than sitting out: a masked scatter
    # with duplicate indices may write the old value back over a mark (the interpreter does).
    rejected = children(cur) & ~active
    first = jnp.min(jnp.where(rejected, node_ids, nodes_pad))
    first_token = jnp.sum(jnp.where(node_ids == first, tokens, 0))
    plt.store(rejected_ref.at[jnp.where(rejected, tokens, first_token)], jnp.ones((nodes_pad,), jnp.int8),
              mask=jnp.broadcast_to(first < nodes_pad, (nodes_pad,)))
    if not interpret:  # the marks are read back by other threads (no barrier when interpreted)
        plt.debug_barrier()

    def residual(ids, valid, z, key, i, exclude):
        keep = valid & _kept(key, ids, w, c)
        if exclude:
            marked = plt.load(rejected_ref.at[pl.ds(i * block_v, block_v)], mask=valid, other=0)
            keep &= marked == 0
        return jnp.where(keep, jnp.exp(z - m), 0.0)

    def draw(exclude):
        r = lambda ids, valid, z, key, i: residual(ids, valid, z, key, i, exclude)  # noqa: E731
        total = fold_row(cur, lambda s, *a: s + jnp.sum(r(*a)), jnp.float32(0.0))
        target = final_coin_ref[()] * total

        def find_block(carry, *a):
            running, block, base = carry
            after = running + jnp.sum(r(*a))
            first = (block < 0) & (after >= target)
            return after, lax.select(first, a[-1], block), lax.select(first, running, base)

        _, block, base = fold_row(cur, find_block, (jnp.float32(0.0), jnp.int32(-1), jnp.float32(0.0)))
        ids = block * block_v + jnp.arange(block_v)
        valid = ids < vocab
        x = plt.load(logits_ref.at[cur, pl.ds(block * block_v, block_v)], mask=valid, other=0)
        z = x.astype(jnp.float32) / divisor
        res = r(ids, valid, z, _order_key(z), block)
        crossing = jnp.min(jnp.where(valid & (base + jnp.cumsum(res) >= target), ids, vocab))
        # The in-block cumulative sum may round below the block sum that located the block.
        last_positive = jnp.max(jnp.where(res > 0.0, ids, -1))
        return total, lax.select(crossing < vocab, crossing, last_positive)

    total, token = draw(exclude=True)
    token = _when(total <= 0.0, lambda: draw(exclude=False)[1], token)
    accept_ref[...] = accept
    emitted_ref[...] = jnp.where(jnp.arange(depth_pad) == depth, token, emitted)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


@functools.partial(jax.jit, static_argnames=("max_depth", "block_v", "num_warps", "num_stages",
                                              "interpret"))
def _tree_sample_pallas(tokens_BN, parents_BN, logits_BNV, coins_BN, final_coins_B, temperature_B,
                        top_k_B, top_p_B, *, max_depth, block_v, num_warps, num_stages, interpret):
    batch, num_nodes, vocab = logits_BNV.shape
    nodes_pad = _pow2_at_least(num_nodes)
    depth_pad = _pow2_at_least(max_depth + 2)
    pad = lambda x, value: jnp.pad(x, ((0, 0), (0, nodes_pad - num_nodes)), constant_values=value)  # noqa: E731
    kernel = functools.partial(_sample_kernel, vocab=vocab, block_v=min(block_v, _pow2_at_least(vocab)),
                               num_nodes=num_nodes, max_depth=max_depth, interpret=interpret)
    scalar = pl.BlockSpec((None,), lambda b: (b,))
    per_node = pl.BlockSpec((None, nodes_pad), lambda b: (b, 0))
    per_depth = pl.BlockSpec((None, depth_pad), lambda b: (b, 0))
    accept_BD, emitted_BD, _ = pl.pallas_call(
        kernel, grid=(batch,),
        in_specs=[scalar, scalar, scalar, scalar, per_node, per_node, per_node,
                  pl.BlockSpec((None, num_nodes, vocab), lambda b: (b, 0, 0)),
                  pl.BlockSpec((None, vocab), lambda b: (b, 0))],
        out_specs=[per_depth, per_depth, pl.BlockSpec((None, vocab), lambda b: (b, 0))],
        out_shape=[jax.ShapeDtypeStruct((batch, depth_pad), jnp.int32),
                   jax.ShapeDtypeStruct((batch, depth_pad), jnp.int32),
                   jax.ShapeDtypeStruct((batch, vocab), jnp.int8)],
        input_output_aliases={8: 2},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="tree_sample",
    )(temperature_B, top_k_B, top_p_B, final_coins_B, pad(tokens_BN, 0), pad(parents_BN, -1),
      pad(coins_BN, 1.0), logits_BNV, jnp.zeros((batch, vocab), jnp.int8))
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
