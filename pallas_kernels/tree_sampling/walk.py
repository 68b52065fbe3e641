"""The walk kernel: a program per request walks its tree and makes the final draw.

At each visited node the row's statistics come from the rows pass: greedy rows accept the
argmax child; untruncated rows need only ``m`` and the mass; truncated rows their kept-set
boundary. Where it comes from:

- with at most ``parallel_rows`` node rows (``prepared``), from the rows pass and the fallback;
- with more, the walk finds the candidates of the rows it visits (``candidates.candidate_stats``
  with the floor search over the row, in slot row 0);
- either way, a truncated row left without candidates (more than ``capacity`` tokens above every
  usable floor) gets its boundary by bit searches over the row (``boundary.streamed_boundary``).

Accepting a child reads only the children's logits. The final draw removes the rejected children
(marked in a per-request scratch row) and inverts the cumulative distribution in token-id order
(``draw``): over the candidates in registers (a row with candidates); for an untruncated row
from the precomputed block sums, summing again only the blocks that hold rejected children;
for a truncated row without candidates from per-block sums of one pass; greedy rows take the
argmax. In each case a cumulative sum inside the block that holds the crossing finishes it.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.tree_sampling.boundary import streamed_boundary
from pallas_kernels.tree_sampling.candidates import candidate_stats
from pallas_kernels.tree_sampling.common import (
    INT_MIN,
    BlockStats,
    Request,
    RowStats,
    Slots,
    aliases,
    barrier,
    candidate_block,
    cut,
    either,
    kept,
    order_key,
    pow2_at_least,
    processed,
    sub_size,
    when,
)
from pallas_kernels.tree_sampling.draw import Row, sampled_draw


class Tree(NamedTuple):
    """Each request's tree, ``[B, nodes_pad]``: node tokens, parents (``-1``: none), coins."""

    tokens: Any
    parents: Any
    coins: Any


class Inputs(NamedTuple):
    """The walk's inputs (refs in the kernel); ``scratch`` is updated in place."""

    request: Any
    final_coins: Any
    tree: Any
    stats: Any
    blocks: Any
    logits: Any
    scratch: Any


class Outputs(NamedTuple):
    """The walk's outputs: the scratch, the hot sub-blocks of the row whose candidates it last
    gathered, the accepted path and the emitted tokens (``[B, depth_pad]``)."""

    scratch: Any
    hot: Any
    accept: Any
    emitted: Any


class Scratch(NamedTuple):
    """Per-request scratch updated in place: the rejected-token marks ``[B, V]`` (int8) and the
    candidate ``Slots`` (every node row's when prepared, else one row per request)."""

    rejected: Any
    slots: Any


def _walk_kernel(request: Request, final_coin_ref, tree: Tree, stats: RowStats, blocks: BlockStats, logits_ref,
                 _scratch_in, scratch: Scratch, hot_ref, accept_ref, emitted_ref, *, vocab, block_v, draw_block,
                 capacity, num_nodes, max_depth, prepared, interpret):
    """Program b: the whole walk and final draw of request b, given each node row's statistics
    (``rows.rows``; ``blocks`` without the argmaxes). ``prepared``: the candidates of every truncated
    row come found (``stats.num``, ``scratch.slots[row]``) with the row's kept-set boundary and mass
    (``stats.w``, ``stats.c``, ``stats.kept``); else the walk finds those of the rows it visits, the
    candidates in ``scratch.slots[0]``."""
    nodes_pad = tree.tokens.shape[0]
    block_c = candidate_block(block_v)
    temperature = request.temperature[()]
    greedy = temperature <= 0.0
    scale = request.scale[()]
    top_k, top_p = request.top_k[()], request.top_p[()]
    row_cut = cut(temperature, top_k, top_p, vocab)
    node_ids = jnp.arange(nodes_pad)
    tokens = tree.tokens[...]
    parents = tree.parents[...]
    sync = functools.partial(barrier, interpret)

    def at_node(x_ref, node):
        """``x_ref[node]``, one scalar load (a node past the tree reads the last padding slot)."""
        return x_ref[jnp.minimum(node, nodes_pad - 1)]

    def cand_row(cur):
        return cur if prepared else jnp.int32(0)

    def row_stats(cur):
        """``(m, w, c, total, num)`` of row ``cur``: max, kept-set boundary, kept mass and the
        number of candidates in the scratch (``-1``: the kept set is streamed from the row)."""
        m, total_all = at_node(stats.m, cur), at_node(stats.total, cur)

        def greedy_stats():
            return m, order_key(m), at_node(stats.argmax, cur) + 1, jnp.float32(1.0), jnp.int32(-1)

        def sampled_stats():

            def truncated():
                if prepared:
                    num, w, c, kept_mass = (at_node(x_ref, cur) for x_ref in (stats.num, stats.w, stats.c, stats.kept))
                else:
                    num, w, c, kept_mass = candidate_stats(
                        logits_ref, (cur,), blocks.sub_max, hot_ref, scratch.slots, cand_row(cur), m=m,
                        total=total_all, scale=scale, cut=row_cut, vocab=vocab, block_c=block_c,
                        sub=sub_size(draw_block), capacity=capacity, barrier=sync, floor_search=True)
                return either(num >= 0, lambda: (w, c, kept_mass, num),
                              lambda: (*streamed_boundary(logits_ref, (cur,), scale, vocab, block_v, m, row_cut),
                                       jnp.int32(-1)))

            untruncated = (jnp.int32(INT_MIN), jnp.int32(vocab), total_all, jnp.int32(-1))
            return (m, *when(row_cut.use_k | row_cut.use_p, truncated, untruncated))

        return either(greedy, greedy_stats, sampled_stats)

    def children(cur):
        return (parents == cur) & (node_ids > 0) & (node_ids < num_nodes)

    def step(t, carry):
        cur, active, depth, row, accept, emitted = carry
        row = when(active, lambda: row_stats(cur), row)
        m, w, c, total, _ = row
        is_child = children(cur)
        z = processed(plt.load(logits_ref.at[cur, tokens]), scale)
        q = jnp.where(is_child & kept(order_key(z), tokens, w, c), jnp.exp(z - m) / total, 0.0)
        coin = at_node(tree.coins, cur)
        hit = is_child & (coin <= jnp.cumsum(q))
        tries = active & (t < max_depth)
        took = tries & (jnp.max(hit.astype(jnp.int32)) > 0)
        child = jnp.min(jnp.where(hit, node_ids, nodes_pad))
        token = at_node(tree.tokens, child)
        accept = jnp.where(took & (jnp.arange(accept.shape[0]) == t + 1), child, accept)
        emitted = jnp.where(took & (jnp.arange(emitted.shape[0]) == t), token, emitted)
        return (lax.select(took, child, cur), active & (took | (t >= max_depth)),
                depth + took.astype(jnp.int32), row, accept, emitted)

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
    first_token = at_node(tree.tokens, first)
    plt.store(scratch.rejected.at[jnp.where(rejected, tokens, first_token)], jnp.ones((nodes_pad,), jnp.int8),
              mask=jnp.broadcast_to(first < nodes_pad, (nodes_pad,)))
    sync()
    row = Row(logits_ref, cur, scale, m, w, c, scratch.rejected, final_coin_ref[()])
    token = either(greedy, lambda: c - 1, lambda: sampled_draw(
        row, scratch.slots, cand_row(cur), num, row_cut, rejected, tokens, blocks, vocab=vocab, block_v=block_v,
        draw_block=draw_block, capacity=capacity))
    accept_ref[...] = accept
    emitted_ref[...] = jnp.where(jnp.arange(depth_pad) == depth, token, emitted)


def walk(logits_BNV, tokens_BN, parents_BN, coins_BN, final_coins_B, request: Request, stats: RowStats,
         blocks: BlockStats, slots: Slots | None, *, max_depth, block_v, draw_block, capacity, num_warps, num_stages,
         interpret):
    """A program per request (``_walk_kernel``): ``(accept_BD, emitted_BD)``, int32 ``[B, depth_pad]``.

    ``stats``, ``blocks``: the rows pass's and statistics pass's outputs; ``slots``: the candidate
    ``Slots`` of every node row (prepared), or ``None`` (the walk finds the candidates itself)."""
    batch, num_nodes, vocab = logits_BNV.shape
    nodes_pad = blocks.max.shape[1]
    depth_pad = pow2_at_least(max_depth + 2)
    prepared = slots is not None
    if not prepared:
        slots = Slots(*(jnp.zeros((batch, 1, capacity + 1), dtype) for dtype in (jnp.float32, jnp.int32)))
    pad_nodes = lambda x_BN, value: jnp.pad(x_BN, ((0, 0), (0, nodes_pad - num_nodes)), constant_values=value)  # noqa: E731
    blocks = blocks._replace(argmax=None)  # the walk does not read the block argmaxes
    tree = Tree(pad_nodes(tokens_BN, 0), pad_nodes(parents_BN, -1), pad_nodes(coins_BN, 1.0))
    inputs = Inputs(request, final_coins_B, tree, stats, blocks, logits_BNV,
                    Scratch(jnp.zeros((batch, vocab), jnp.int8), slots))
    path = jax.ShapeDtypeStruct((batch, depth_pad), jnp.int32)
    out_shape = Outputs(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), inputs.scratch),
                        jax.ShapeDtypeStruct((batch, pow2_at_least(blocks.sub_max.shape[2]) + 1), jnp.int32),
                        path, path)
    per_request = lambda x: pl.BlockSpec((None, *x.shape[1:]), lambda b: (b,) + (0,) * (len(x.shape) - 1))  # noqa: E731
    kernel = functools.partial(_walk_kernel, vocab=vocab, block_v=block_v, draw_block=draw_block, capacity=capacity,
                               num_nodes=num_nodes, max_depth=max_depth, prepared=prepared, interpret=interpret)
    out = pl.pallas_call(
        kernel, grid=(batch,), in_specs=tuple(jax.tree.map(per_request, inputs)),
        out_specs=jax.tree.map(per_request, out_shape), out_shape=out_shape,
        input_output_aliases=aliases(inputs, out_shape, "scratch"),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="tree_sample",
    )(*inputs)
    return out.accept, out.emitted
