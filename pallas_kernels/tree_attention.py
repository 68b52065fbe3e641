"""Tree-verify attention: N new queries over a request's KV cache prefix plus the N tree keys.

Same contract as ``tree_attention_reference``.
The Pallas kernel (Triton lowering) works per (request, KV head):

- **GQA packing**: the N queries of the G query heads that share a KV head are stacked into
  ``M = N * G`` rows (row ``i * G + g`` is node i of head g), so that even a 16-node tree
  fills the rows of a matrix-unit tile and each K/V block is read once per group. The program
  gathers its rows from ``q`` and scatters its outputs into the ``[B, N, H, D]`` layout itself,
  and reads the tree mask rows of its nodes, so a call with one split is a single kernel;
- **split-K**: the prefix ``[0, lengths[b])`` is cut into chunks, one program each, so that
  small batches still fill the GPU: the cache's capacity in static chunks (those past the
  request's length do no work) or, with ``config.split_by_length``, the request's length in
  equal chunks of whole key blocks;
  each split's output, divided by its own softmax sum and stored in the activations' dtype
  (half the bytes of float32 unnormalised partials in bfloat16), is merged afterwards with its
  running max and sum (flash-decoding style);
- **tree part**: the new keys at ``[lengths[b], lengths[b] + M)``, masked by the ancestor mask,
  come after the prefix as key blocks of their own. Cut by length, a split takes an equal share of
  the prefix's and the tree's blocks together, so the tree's blocks go to the splits the prefix
  leaves short or empty rather than lengthening the last one; cut by capacity, the split that holds
  the end of the prefix also takes every tree block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.configs import TreeAttentionConfig, device_multiprocessors
from pallas_kernels.split_k import blocks_per_split, merge_normalized_splits, round_up, split_count
from pallas_kernels.tree_attention_reference import check_shapes, stacked

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Masked scores: finite, so that a block with no visible key yields no NaN (its
# probabilities are zeroed explicitly).
_NEG = -1e30


def tree_attention(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, *, scale, layer: int | None = None,
                   config: TreeAttentionConfig | None = None, interpret: bool = False):
    """Masked GQA attention of N new queries over one layer's KV cache (Pallas, Triton lowering).

    Same arguments and result as ``tree_attention_reference`` (``layer``: the kernel reads that
    layer of the stacked ``[L, B, K, S, D]`` caches in place; a slice passed to a kernel call
    would be a copy of the layer's cache), plus:

      config: tiling, e.g. ``configs.tree_attention_config(capability)``; default the Ampere
        entry.
      interpret: run the kernel in the Pallas interpreter (any platform) instead of compiling it.

    Needs `kernel_supports`. A query that sees no slot at all gets zeros (the reference returns a
    finite average there); tree masks always let a node see itself.
    """
    k_LBKSD, v_LBKSD, layer = stacked(k_BKSD, v_BKSD, layer)
    k_BKSD, v_BKSD = (jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in (k_LBKSD, v_LBKSD))
    check_shapes(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, scale)
    if not kernel_supports(q_BNHD, k_BKSD):
        raise ValueError(f"the Triton attention kernel needs a power-of-two head_dim >= 16 and float32, "
                         f"bfloat16 or float16 q/k/v of one dtype; got head_dim={q_BNHD.shape[-1]}, "
                         f"dtypes {q_BNHD.dtype}, {k_BKSD.dtype}, {v_BKSD.dtype}")
    config = TreeAttentionConfig() if config is None else config
    return _tree_attention_pallas(q_BNHD, k_LBKSD, v_LBKSD, jnp.asarray(lengths_B, jnp.int32),
                                  mask_BNM, scale=float(scale), layer=layer, config=config,
                                  interpret=bool(interpret))


def kernel_supports(q_BNHD, k_BKSD) -> bool:
    """Whether the Triton kernel handles these shapes and dtypes."""
    head_dim = q_BNHD.shape[-1]
    return (head_dim >= 16 and head_dim & (head_dim - 1) == 0 and q_BNHD.dtype == k_BKSD.dtype
            and any(q_BNHD.dtype == d for d in DTYPES))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static tiling of one call: packed rows, tree-key blocks and the prefix split."""

    block_m: int
    rows_pad: int
    block_t: int
    new_pad: int
    num_splits: int
    chunk: int


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


def _plan(batch, num_kv, rows, num_new, num_slots, config: TreeAttentionConfig,
          multiprocessors: int | None = None) -> _Plan:
    block_m = min(config.block_m, _pow2_at_least(rows, 16))
    rows_pad = round_up(rows, block_m)
    block_t = min(config.block_k, _pow2_at_least(num_new, 16))
    splits = split_count(batch * num_kv * (rows_pad // block_m), num_slots, config, multiprocessors)
    chunk = round_up(-(-num_slots // splits), config.block_k)
    return _Plan(block_m, rows_pad, block_t, round_up(num_new, block_t),
                 num_splits=-(-num_slots // chunk), chunk=chunk)


def _attend(q_MD, k_ref, v_ref, start, key_ok_T, visible_MT, carry, *, scale, precision):
    """One online-softmax step over the keys at ``[start, start + T)`` of a ``[S, D]`` cache."""
    o_MD, m_M, l_M = carry
    keys = pl.ds(start, key_ok_T.shape[0])
    k_TD = plt.load(k_ref.at[keys, :], mask=key_ok_T[:, None], other=0)
    v_TD = plt.load(v_ref.at[keys, :], mask=key_ok_T[:, None], other=0)
    s_MT = plt.dot(q_MD, k_TD, trans_b=True, precision=precision) * scale
    s_MT = jnp.where(visible_MT, s_MT, _NEG)
    m_new_M = jnp.maximum(m_M, s_MT.max(axis=1))
    p_MT = jnp.where(visible_MT, jnp.exp(s_MT - m_new_M[:, None]), 0.0)
    alpha_M = jnp.exp(m_M - m_new_M)
    o_MD = alpha_M[:, None] * o_MD + plt.dot(p_MT.astype(v_TD.dtype), v_TD, precision=precision)
    return o_MD, m_new_M, alpha_M * l_M + p_MT.sum(axis=1)


def _split_blocks(split, prefix, plan: _Plan, block_k, split_by_length):
    """Key blocks ``[lo, hi)`` of one split, counted over the prefix's ``prefix`` blocks (``ceil(length /
    block_k)``) followed by the tree's ``new_pad / block_t``: by length, ``ceil(all / num_splits)`` blocks a
    split (at least one); by capacity, ``plan.chunk`` slots of the prefix a split, the tree's blocks with
    the split that holds the prefix's last block (the first split for an empty prefix)."""
    total = prefix + plan.new_pad // plan.block_t
    if split_by_length:
        per = blocks_per_split(total, plan.num_splits)
        lo = split * per
        return lo, jnp.minimum(lo + per, total)
    per = plan.chunk // block_k
    lo = jnp.minimum(split * per, prefix)
    owner = jnp.minimum(lax.div(jnp.maximum(prefix - 1, 0), jnp.int32(per)), plan.num_splits - 1)
    return lo, lax.select(split == owner, total, jnp.minimum(lo + per, prefix))


def _kernel(lengths_ref, q_ref, k_ref, v_ref, mask_ref, *out_refs, scale, plan: _Plan,
            group, num_new, block_k, split_by_length, precision):
    """Program (row block, split, b, kv head): its split's key blocks (`_split_blocks`).

    ``q_ref``/``out_refs``: the request's ``[N * H, D]`` rows (row ``i * H + h``); packed row
    ``i * G + g`` is row ``i * H + kv * G + g``. Rows past ``N * G`` repeat the last node's
    rows: they compute the same values and store them over the same rows, so no store is masked.
    """
    split = pl.program_id(1)
    num_slots = k_ref.shape[0]
    num_q = mask_ref.shape[0]
    length = jnp.minimum(lengths_ref[()], num_slots)
    packed = pl.program_id(0) * plan.block_m + jnp.arange(plan.block_m)
    node_M = jnp.minimum(packed // group, num_q - 1)
    row_M = node_M * (q_ref.shape[0] // num_q) + pl.program_id(3) * group + packed % group
    head_dim = q_ref.shape[1]
    # Index arrays on both axes: the interpreter gathers only without slices.
    rows_MD = (row_M[:, None], jnp.arange(head_dim)[None, :])
    q_MD = plt.load(q_ref.at[rows_MD])
    attend = functools.partial(_attend, q_MD, k_ref, v_ref, scale=scale, precision=precision)
    carry = (jnp.zeros((plan.block_m, head_dim), jnp.float32),
             jnp.full((plan.block_m,), _NEG, jnp.float32), jnp.zeros((plan.block_m,), jnp.float32))

    prefix = lax.div(length + block_k - 1, jnp.int32(block_k))
    lo, hi = _split_blocks(split, prefix, plan, block_k, split_by_length)

    def prefix_step(t, carry):
        start = t * block_k
        key_ok = start + jnp.arange(block_k) < length
        return attend(start, key_ok, key_ok[None, :], carry)

    carry = lax.fori_loop(lo, jnp.minimum(hi, prefix), prefix_step, carry)

    def tree_step(t, carry):
        cols = t * plan.block_t + jnp.arange(plan.block_t)
        key_ok = (cols < num_new) & (length + cols < num_slots)
        visible = plt.load(mask_ref.at[node_M[:, None], jnp.minimum(cols, num_new - 1)[None, :]])
        return attend(length + t * plan.block_t, key_ok, key_ok[None, :] & visible, carry)

    o_MD, m_M, l_M = lax.fori_loop(jnp.maximum(lo, prefix) - prefix, hi - prefix, tree_step, carry)

    o_ref, *stats_refs = out_refs
    plt.store(o_ref.at[rows_MD], (o_MD / jnp.where(l_M > 0, l_M, 1.0)[:, None]).astype(o_ref.dtype))
    if stats_refs:
        m_ref, l_ref = stats_refs
        plt.store(m_ref.at[row_M], m_M)
        plt.store(l_ref.at[row_M], l_M)


@functools.partial(jax.jit, static_argnames=("scale", "layer", "config", "interpret"))
def _tree_attention_pallas(q_BNHD, k_LBKSD, v_LBKSD, lengths_B, mask_BNM, *, scale, layer, config,
                           interpret):
    batch, num_q, num_heads, head_dim = q_BNHD.shape
    _, _, num_kv, num_slots, _ = k_LBKSD.shape
    num_new = mask_BNM.shape[2]
    group = num_heads // num_kv
    plan = _plan(batch, num_kv, group * num_q, num_new, num_slots, config, device_multiprocessors())
    q_BRD = q_BNHD.reshape(batch, num_q * num_heads, head_dim)
    # Row blocks vary fastest in launch order, so that the programs reading one K/V chunk run
    # together and share it through L2.
    grid = (plan.rows_pad // plan.block_m, plan.num_splits, batch, num_kv)
    exact = q_BNHD.dtype == jnp.float32
    kernel = functools.partial(_kernel, scale=scale, plan=plan, group=group, num_new=num_new,
                               block_k=config.block_k, split_by_length=config.split_by_length,
                               precision=lax.Precision.HIGHEST if exact else None)
    in_specs = [
        pl.BlockSpec((None,), lambda r, j, b, h: (b,)),
        pl.BlockSpec((None, num_q * num_heads, head_dim), lambda r, j, b, h: (b, 0, 0)),
        pl.BlockSpec((None, None, None, num_slots, head_dim), lambda r, j, b, h: (layer, b, h, 0, 0)),
        pl.BlockSpec((None, None, None, num_slots, head_dim), lambda r, j, b, h: (layer, b, h, 0, 0)),
        pl.BlockSpec((None, num_q, num_new), lambda r, j, b, h: (b, 0, 0)),
    ]
    rows = num_q * num_heads
    if plan.num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((batch, rows, head_dim), q_BNHD.dtype)]
        out_specs = [pl.BlockSpec((None, rows, head_dim), lambda r, j, b, h: (b, 0, 0))]
    else:
        split_shape = (batch, plan.num_splits, rows)
        out_shape = [jax.ShapeDtypeStruct((*split_shape, head_dim), q_BNHD.dtype),
                     jax.ShapeDtypeStruct(split_shape, jnp.float32),
                     jax.ShapeDtypeStruct(split_shape, jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, rows, head_dim), lambda r, j, b, h: (b, j, 0, 0)),
                     pl.BlockSpec((None, None, rows), lambda r, j, b, h: (b, j, 0)),
                     pl.BlockSpec((None, None, rows), lambda r, j, b, h: (b, j, 0))]
    outs = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plt.CompilerParams(
            num_warps=config.launch_warps(plan.block_m),
            num_stages=config.launch_stages(plan.block_m, head_dim, q_BNHD.dtype.itemsize)),
        interpret=interpret, name="tree_attention",
    )(lengths_B, q_BRD, k_LBKSD, v_LBKSD, mask_BNM)
    o_BRD = outs[0] if plan.num_splits == 1 else merge_normalized_splits(*outs)
    return o_BRD.reshape(q_BNHD.shape).astype(q_BNHD.dtype)
