"""Tree-verify attention as a Mosaic GPU kernel for Hopper (sm_90a, warpgroup MMA).

Same contract as ``tree_attention_reference``. One program (a warpgroup) per (64-row block of
packed queries, prefix split, request, KV head):

- **GQA packing**: the N queries of the G query heads that share a KV head are stacked into
  ``G * N`` rows (row ``g * N + i`` is node i of head g), padded to a multiple of 64, the
  M-dimension of a wgmma; so even a 16-node tree with a group of 4 fills one wgmma tile;
- **key blocks**: keys stream through shared memory in 64-slot blocks (TMA copies into a ring
  of ``config.num_stages`` buffers, the next block loading while the current one is used);
  per block, ``S = Q K^T`` and ``O += P V`` are two wgmmas and the softmax is flash-style
  online (running max and sum in float32);
- **split-K**: the full 64-slot blocks of the prefix ``[0, lengths[b])`` are cut into chunks,
  one program each (static chunks of the capacity or, with ``config.split_by_length``, equal
  chunks of the request's blocks); they need no mask. The partial results are merged afterwards
  with their softmax residuals (running max and sum), in jnp;
- **tail window**: the last program of each request also visits ``window`` slots starting at
  the last full prefix block: the prefix remainder (< 64 slots) and the tree keys at
  ``[lengths[b], lengths[b] + M)``. Their visibility (the ancestor mask, shifted to the
  window) is a 0 / -inf bias precomputed in jnp, ``[B, rows, window]``.

Only bfloat16 and float16 are supported (float32 would need tf32 wgmma, whose operands must be
K-major, which ``P V`` is not), with head_dim 64 or 128.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.configs import (
    MOSAIC_TREE_ATTENTION_CONFIGS,
    TreeAttentionConfig,
    device_multiprocessors,
    mosaic_interpret_params,
)
from pallas_kernels.split_k import blocks_per_split, merge_splits, round_up, split_count
from pallas_kernels.tree_attention_reference import check_shapes, stacked

BLOCK = 64  # rows per program and keys per block: the wgmma M and a 128-byte bf16 row
HEAD_DIMS = (64, 128)
DTYPES = (jnp.bfloat16, jnp.float16)
# Running max before any key: finite, so that a block with no visible key (all scores -inf)
# gives exp(-inf) = 0 instead of NaN.
_NEG = -1e30


def tree_attention_mgpu(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, *, scale, layer: int | None = None,
                        config: TreeAttentionConfig | None = None, interpret: bool = False):
    """Masked GQA attention of N new queries over one layer's KV cache (Mosaic GPU kernel).

    Args:
      q_BNHD: ``[B, N, H, D]`` queries, bfloat16 or float16, ``D`` in (64, 128).
      k_BKSD, v_BKSD: ``[B, K, S, D]`` one layer's cache (q's dtype), already holding the M new
        keys and values at slots ``[lengths[b], lengths[b] + M)``.
      lengths_B: int ``[B]`` committed prefix length per request.
      mask_BNM: bool ``[B, N, M]``; new slot ``lengths[b] + j`` is visible to query i iff
        ``mask[b, i, j]``; every slot ``< lengths[b]`` is visible.
      scale: softmax scale (a Python float).
      layer: with a layer index, ``k, v`` are stacked ``[L, B, K, S, D]`` caches and that layer is
        sliced out (a copy of the layer) and attended.
      config: split-K policy and pipeline depth (``num_stages`` key buffers); default the
        Hopper entry of ``MOSAIC_TREE_ATTENTION_CONFIGS``.
      interpret: run the kernel in the Mosaic GPU interpreter (CPU) instead of compiling it.

    Returns:
      ``[B, N, H, D]`` in q's dtype; softmax in float32; a query that sees no slot gets zeros.
    """
    k_LBKSD, v_LBKSD, layer = stacked(k_BKSD, v_BKSD, layer)
    k_BKSD, v_BKSD = k_LBKSD[layer], v_LBKSD[layer]
    check_args(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, scale)
    config = MOSAIC_TREE_ATTENTION_CONFIGS[(9, 0)] if config is None else config
    if config.block_m != BLOCK or config.block_k != BLOCK:
        raise ValueError(f"config must have block_m = block_k = {BLOCK}, got block_m="
                         f"{config.block_m}, block_k={config.block_k}")
    return _tree_attention_mgpu(q_BNHD, k_BKSD, v_BKSD, jnp.asarray(lengths_B, jnp.int32),
                                mask_BNM, scale=float(scale), config=config,
                                interpret=bool(interpret))


def check_args(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, scale):
    """ValueError naming the argument for anything the kernel does not handle."""
    check_shapes(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, scale)
    if q_BNHD.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {q_BNHD.shape[-1]}")
    if not any(q_BNHD.dtype == d for d in DTYPES) or not q_BNHD.dtype == k_BKSD.dtype == v_BKSD.dtype:
        raise ValueError(f"q, k, v must share one dtype among bfloat16, float16; got "
                         f"{q_BNHD.dtype}, {k_BKSD.dtype}, {v_BKSD.dtype}")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static tiling of one call."""

    rows_pad: int  # packed query rows, a multiple of BLOCK
    window: int  # tail-window slots: the prefix remainder (< BLOCK) plus the M tree keys
    num_slots: int  # cache slots, zero-padded to whole blocks, at least ``window``
    chunk_blocks: int  # full prefix blocks per split
    num_splits: int


def _plan(batch, num_kv, rows, num_new, num_slots, config: TreeAttentionConfig,
          multiprocessors: int | None = None) -> _Plan:
    rows_pad = round_up(rows, BLOCK)
    window = round_up(BLOCK - 1 + num_new, BLOCK)
    # Whole blocks: every TMA copy then starts at a multiple of BLOCK (a cache whose slot count
    # is not one is copied once, padded).
    num_slots = round_up(max(num_slots, window), BLOCK)
    splits = split_count(batch * num_kv * (rows_pad // BLOCK), num_slots, config, multiprocessors)
    num_blocks = num_slots // BLOCK
    chunk_blocks = max(1, -(-num_blocks // splits))
    return _Plan(rows_pad, window, num_slots, chunk_blocks,
                 num_splits=max(1, -(-num_blocks // chunk_blocks)))


def _window_bias(mask_BNM, lengths_B, starts_B, group, num_slots, plan: _Plan, dtype):
    """``[B, rows_pad, window]``: 0 where packed row r sees slot ``starts[b] + j``, else -inf.

    The window covers what the unmasked prefix blocks leave out: the slots in
    ``[BLOCK * (lengths // BLOCK), lengths)`` and the tree keys ``lengths + [0, M)`` that lie
    in the cache (``< num_slots``).
    """
    num_q, num_new = mask_BNM.shape[1:]
    rows = jnp.arange(plan.rows_pad)
    mask_BRM = mask_BNM[:, rows % num_q, :] & (rows < group * num_q)[None, :, None]
    slot_BW = starts_B[:, None] + jnp.arange(plan.window)[None, :]
    full_end_B = lengths_B // BLOCK * BLOCK
    new_BW = slot_BW - lengths_B[:, None]
    is_new_BW = (new_BW >= 0) & (new_BW < num_new) & (slot_BW < num_slots)
    tree_BRW = jnp.take_along_axis(mask_BRM, jnp.clip(new_BW, 0, num_new - 1)[:, None, :], axis=2)
    prefix_BW = (slot_BW >= full_end_B[:, None]) & (new_BW < 0)
    visible_BRW = prefix_BW[:, None, :] | (is_new_BW[:, None, :] & tree_BRW)
    return jnp.where(visible_BRW, 0.0, -jnp.inf).astype(dtype)


def _matmul(a_smem, b_smem, shape):
    """``a @ b`` of two shared-memory tiles by one wgmma, as float32 registers."""
    def run(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem)
        return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _online_softmax_step(s_MT, v_smem, p_smem, carry):
    """Folds one key block (scores ``s``, values in ``v_smem``) into (o, running max, sum)."""
    o_MD, m_M, l_M = carry
    m_new_M = jnp.maximum(m_M, s_MT.max(axis=1))
    p_MT = jnp.exp(s_MT - lax.broadcast_in_dim(m_new_M, s_MT.shape, [0]))
    alpha_M = jnp.exp(m_M - m_new_M)
    p_smem[...] = p_MT.astype(p_smem.dtype)
    plgpu.commit_smem()
    pv_MD = _matmul(p_smem, v_smem, o_MD.shape)
    o_MD = lax.broadcast_in_dim(alpha_M, o_MD.shape, [0]) * o_MD + pv_MD
    return o_MD, m_new_M, alpha_M * l_M + p_MT.sum(axis=1)


def _stream(num_blocks, num_buffers, fetch, compute, carry):
    """``compute(i, buffer, carry)`` for ``i < num_blocks``, ``fetch``-ing blocks ahead.

    ``fetch(i, buffer)`` starts the copies of block i; block i uses buffer ``i % num_buffers``
    and is fetched while block ``i - num_buffers + 1`` is computed.
    """
    for i in range(num_buffers - 1):
        pl.when(i < num_blocks)(functools.partial(fetch, i, i))

    def body(i, carry):
        ahead = i + num_buffers - 1

        @pl.when(ahead < num_blocks)
        def _():
            fetch(ahead, lax.rem(ahead, num_buffers))

        return compute(i, lax.rem(i, num_buffers), carry)

    return lax.fori_loop(0, num_blocks, body, carry)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Compile-time parameters of the kernel body."""

    plan: _Plan
    scale: float
    num_buffers: int
    split_by_length: bool
    # The JAX 0.10 interpreter applies neither transposed wgmma operands nor layout casts: it
    # gets the keys already transposed ([B, K, D, S], a copy the compiled kernel avoids) and
    # skips the casts, which do not change values.
    interpret: bool


def _kernel(lengths_ref, starts_ref, q_ref, k_ref, v_ref, bias_ref, o_ref, m_ref, l_ref,
            q_smem, k_smem, v_smem, bias_smem, p_smem, o_smem, m_smem, l_smem, barriers,
            *, static: _Static):
    """Program (row block, split, b, kv head): its full prefix blocks, and the window if last."""
    row_block, split = lax.axis_index("rows"), lax.axis_index("split")
    b, h = lax.axis_index("batch"), lax.axis_index("kv")
    plan = static.plan
    q_bar, k_bar, v_bar, bias_bar = barriers
    # Dynamic offsets of TMA copies must be provably aligned to the shared-memory tiling.
    def aligned(x):
        return x if isinstance(x, int) else pl.multiple_of(x, BLOCK)

    rows = pl.ds(aligned(row_block * BLOCK), BLOCK)
    cast = (lambda x, _: x) if static.interpret else plgpu.layout_cast

    plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_bar)

    def fetch_kv(start, buffer):
        keys = pl.ds(aligned(start), BLOCK)
        k_src = k_ref.at[b, h, :, keys] if static.interpret else k_ref.at[b, h, keys]
        plgpu.copy_gmem_to_smem(k_src, k_smem.at[buffer], k_bar.at[buffer])
        plgpu.copy_gmem_to_smem(v_ref.at[b, h, keys], v_smem.at[buffer], v_bar.at[buffer])

    def scores(buffer):
        plgpu.barrier_wait(k_bar.at[buffer])
        k_tile = k_smem.at[buffer]
        kt_tile = k_tile if static.interpret else plgpu.transpose_ref(k_tile, (1, 0))
        s_MT = _matmul(q_smem, kt_tile, (BLOCK, BLOCK)) * static.scale
        plgpu.barrier_wait(v_bar.at[buffer])
        return s_MT

    def prefix_block(i, buffer, carry):
        return _online_softmax_step(scores(buffer), v_smem.at[buffer], p_smem, carry)

    def fetch_window(i, buffer):
        fetch_kv(starts_ref[b] + i * BLOCK, buffer)
        plgpu.copy_gmem_to_smem(bias_ref.at[b, rows, pl.ds(aligned(i * BLOCK), BLOCK)],
                                bias_smem.at[buffer], bias_bar.at[buffer])

    def window_block(i, buffer, carry):
        s_MT = scores(buffer)
        plgpu.barrier_wait(bias_bar.at[buffer])
        s_MT = s_MT + bias_smem.at[buffer][...].astype(jnp.float32)
        return _online_softmax_step(s_MT, v_smem.at[buffer], p_smem, carry)

    head_dim = q_smem.shape[-1]
    carry = (cast(jnp.zeros((BLOCK, head_dim), jnp.float32), plgpu.Layout.WGMMA),
             cast(jnp.full((BLOCK,), _NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
             cast(jnp.zeros((BLOCK,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
    plgpu.barrier_wait(q_bar)

    full_blocks = lax.div(lengths_ref[b], BLOCK)
    chunk_blocks = blocks_per_split(full_blocks, plan.num_splits) if static.split_by_length else plan.chunk_blocks
    first = split * chunk_blocks
    num_full = jnp.clip(full_blocks - first, 0, chunk_blocks)
    carry = _stream(num_full, static.num_buffers,
                    lambda i, buffer: fetch_kv((first + i) * BLOCK, buffer), prefix_block, carry)
    num_window = lax.select(split == plan.num_splits - 1, jnp.int32(plan.window // BLOCK),
                            jnp.int32(0))
    o_MD, m_M, l_M = _stream(num_window, static.num_buffers, fetch_window, window_block, carry)

    o_smem[...] = o_MD
    m_smem[...] = m_M
    l_smem[...] = l_M
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, split, rows])
    plgpu.copy_smem_to_gmem(m_smem, m_ref.at[b, h, split, rows])
    plgpu.copy_smem_to_gmem(l_smem, l_ref.at[b, h, split, rows])
    plgpu.wait_smem_to_gmem(0)


def _smem_tile(shape, dtype):
    """A shared-memory tile in the swizzled layout wgmma and TMA expect (128-byte rows)."""
    row_elems = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, row_elems)),
                                                plgpu.SwizzleTransform(128)))


def _scratch(head_dim, dtype, num_buffers, keys_transposed):
    key_tile = (head_dim, BLOCK) if keys_transposed else (BLOCK, head_dim)
    ring = functools.partial(plgpu.Barrier, num_barriers=num_buffers)
    return [
        _smem_tile((BLOCK, head_dim), dtype),  # q
        _smem_tile((num_buffers, *key_tile), dtype),  # k
        _smem_tile((num_buffers, BLOCK, head_dim), dtype),  # v
        _smem_tile((num_buffers, BLOCK, BLOCK), dtype),  # window bias
        _smem_tile((BLOCK, BLOCK), dtype),  # p
        _smem_tile((BLOCK, head_dim), jnp.float32),  # o
        plgpu.SMEM((BLOCK,), jnp.float32),  # running max
        plgpu.SMEM((BLOCK,), jnp.float32),  # running sum
        (plgpu.Barrier(), ring(), ring(), ring()),
    ]


def _pack_queries(q_BNHD, num_kv, rows_pad):
    """``[B, N, H, D]`` -> ``[B, K, rows_pad, D]`` with row ``g * N + i`` = node i of head g."""
    batch, num_q, num_heads, head_dim = q_BNHD.shape
    group = num_heads // num_kv
    q_BKMD = q_BNHD.reshape(batch, num_q, num_kv, group, head_dim).transpose(0, 2, 3, 1, 4)
    q_BKMD = q_BKMD.reshape(batch, num_kv, group * num_q, head_dim)
    return jnp.pad(q_BKMD, ((0, 0), (0, 0), (0, rows_pad - group * num_q), (0, 0)))


def _unpack_output(o_BKMD, num_q, num_heads):
    batch, num_kv, _, head_dim = o_BKMD.shape
    group = num_heads // num_kv
    o_BKGND = o_BKMD[:, :, :group * num_q].reshape(batch, num_kv, group, num_q, head_dim)
    return o_BKGND.transpose(0, 3, 1, 2, 4).reshape(batch, num_q, num_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def _tree_attention_mgpu(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, *, scale, config,
                         interpret):
    batch, num_q, num_heads, head_dim = q_BNHD.shape
    _, num_kv, num_slots, _ = k_BKSD.shape
    group = num_heads // num_kv
    plan = _plan(batch, num_kv, group * num_q, mask_BNM.shape[2], num_slots, config, device_multiprocessors())
    pad_slots = ((0, 0), (0, 0), (0, plan.num_slots - num_slots), (0, 0))
    k_BKSD, v_BKSD = jnp.pad(k_BKSD, pad_slots), jnp.pad(v_BKSD, pad_slots)
    lengths_B = jnp.clip(lengths_B, 0, num_slots)
    starts_B = jnp.minimum(lengths_B // BLOCK * BLOCK, plan.num_slots - plan.window)
    bias_BRW = _window_bias(mask_BNM, lengths_B, starts_B, group, num_slots, plan,
                            q_BNHD.dtype)
    q_BKMD = _pack_queries(q_BNHD, num_kv, plan.rows_pad)
    keys = k_BKSD.swapaxes(2, 3) if interpret else k_BKSD

    split_shape = (batch, num_kv, plan.num_splits, plan.rows_pad)
    out_type = (jax.ShapeDtypeStruct((*split_shape, head_dim), jnp.float32),
                jax.ShapeDtypeStruct(split_shape, jnp.float32),
                jax.ShapeDtypeStruct(split_shape, jnp.float32))
    num_buffers = max(2, config.num_stages)
    static = _Static(plan, scale, num_buffers, config.split_by_length, interpret)
    kernel = plgpu.kernel(
        functools.partial(_kernel, static=static), out_type=out_type,
        scratch_types=_scratch(head_dim, q_BNHD.dtype, num_buffers, keys_transposed=interpret),
        grid=(plan.rows_pad // BLOCK, plan.num_splits, batch, num_kv),
        grid_names=("rows", "split", "batch", "kv"),
        interpret=mosaic_interpret_params() if interpret else None)
    o_BKJMD, m_BKJM, l_BKJM = kernel(lengths_B, starts_B, q_BKMD, keys, v_BKSD, bias_BRW)
    o_BKMD = merge_splits(o_BKJMD, m_BKJM, l_BKJM)
    return _unpack_output(o_BKMD, num_q, num_heads).astype(q_BNHD.dtype)
