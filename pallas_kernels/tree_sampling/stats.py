"""The statistics pass: one read of the logits, a program per node row and ``stats_blocks``
vocabulary blocks, so that the whole GPU works on it even for a single request. It always runs
first; every later kernel starts from its ``BlockStats``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.tree_sampling.common import BlockStats, load_block, pow2_at_least, sub_size


def _block_stats_kernel(scale_ref, logits_ref, out: BlockStats, *, vocab, block, blocks):
    """Program (b, n, j): for each of the blocks ``j * blocks + g`` (g < ``blocks``) of row (b, n), the
    max of ``z = logits * scale`` over the block, its first argmax and ``sum exp(z - block max)``
    (``-inf``, ``vocab`` and 0 for a block past the vocabulary), and the max of each of its
    sub-blocks (``sub_size`` entries)."""
    slot_G = jnp.arange(blocks)
    max_G = jnp.full((blocks,), -jnp.inf, jnp.float32)
    argmax_G = jnp.full((blocks,), vocab, jnp.int32)
    mass_G = jnp.zeros((blocks,), jnp.float32)
    scale = scale_ref[()]
    sub = sub_size(block)
    for g in range(blocks):
        ids, valid, z = load_block(logits_ref, (), (pl.program_id(2) * blocks + g) * block, block, vocab, scale)
        z = jnp.where(valid, z, -jnp.inf)
        m = jnp.max(z)
        max_G = jnp.where(slot_G == g, m, max_G)
        argmax_G = jnp.where(slot_G == g, jnp.min(jnp.where(valid & (z == m), ids, vocab)), argmax_G)
        mass_G = jnp.where(slot_G == g, jnp.sum(jnp.where(valid, jnp.exp(z - m), 0.0)), mass_G)
        out.sub_max[pl.ds(g * (block // sub), block // sub)] = jnp.max(z.reshape(block // sub, sub), axis=1)
    out.max[...] = max_G
    out.argmax[...] = argmax_G
    out.mass[...] = mass_G


def block_stats(logits_BNV, scale_B, nodes_pad, draw_block, num_warps, interpret, blocks=1) -> BlockStats:
    """Per node row and ``draw_block``-entry block: ``max z`` (``z = logits * scale``, the request's
    inverse temperature), its first argmax and ``sum exp(z - block max)`` (each ``[B, nodes_pad, K]``,
    K a power of two), and the max of every sub-block of ``sub_size(draw_block)`` entries
    (``[B, nodes_pad, S]``, ``-inf`` past the vocabulary). Rows past N and blocks past the last
    program's are left unwritten. One program per row and ``blocks`` blocks."""
    batch, num_nodes, vocab = logits_BNV.shape
    programs = pl.cdiv(pl.cdiv(vocab, draw_block), blocks)
    per_block = draw_block // sub_size(draw_block)
    per_program = pl.BlockSpec((None, None, blocks), lambda b, n, j: (b, n, j))
    blocks_K = lambda dtype: jax.ShapeDtypeStruct((batch, nodes_pad, pow2_at_least(programs * blocks)), dtype)  # noqa: E731
    out_shape = BlockStats(blocks_K(jnp.float32), blocks_K(jnp.int32), blocks_K(jnp.float32),
                           jax.ShapeDtypeStruct((batch, nodes_pad, programs * blocks * per_block), jnp.float32))
    out_specs = BlockStats(per_program, per_program, per_program,
                           pl.BlockSpec((None, None, blocks * per_block), lambda b, n, j: (b, n, j)))
    stats, = pl.pallas_call(
        functools.partial(_block_stats_kernel, vocab=vocab, block=draw_block, blocks=blocks),
        grid=(batch, num_nodes, programs),
        in_specs=[pl.BlockSpec((None,), lambda b, n, j: (b,)), pl.BlockSpec((None, None, vocab),
                                                                          lambda b, n, j: (b, n, 0))],
        out_specs=(out_specs,), out_shape=(out_shape,),
        compiler_params=plt.CompilerParams(num_warps=min(num_warps, 4), num_stages=1),
        interpret=interpret, name="tree_sample_row_stats",
    )(scale_B, logits_BNV)
    return stats
