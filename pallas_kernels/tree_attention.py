"""Tree-verify attention: N new queries over a request's KV cache prefix plus the N tree keys.

Same contract as ``ddtree_jax.models.layers.attention`` (see ``tree_attention_reference``).
The Pallas kernel (Triton lowering) works per (request, KV head):

- **GQA packing**: the N queries of the G query heads that share a KV head are stacked into
  ``M = N * G`` rows (row ``i * G + g`` is node i of head g), so that even a 16-node tree
  fills the rows of a matrix-unit tile and each K/V block is read once per group. The program
  gathers its rows from ``q`` and scatters its outputs into the ``[B, N, H, D]`` layout itself,
  and reads the tree mask rows of its nodes, so a call with one split is a single kernel;
- **split-K**: the prefix ``[0, lengths[b])`` is cut into static chunks, one program each,
  so that small batches still fill the GPU; chunks past the request's length do no work;
  the partial results are merged afterwards with their softmax residuals (running max and
  sum, flash-decoding style);
- **tree part**: the program whose chunk holds the end of the prefix also visits the new
  keys at ``[lengths[b], lengths[b] + M)``, masked by the ancestor mask.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.configs import TreeAttentionConfig, device_capability, tree_attention_config
from pallas_kernels.reference import tree_attention_reference

BACKENDS = ("auto", "triton", "interpret", "mosaic", "mosaic_interpret", "xla")
_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Masked scores: finite, so that a block with no visible key yields no NaN (its
# probabilities are zeroed explicitly).
_NEG = -1e30


def tree_attention(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, *, scale, layer: int | None = None,
                   backend="auto", config: TreeAttentionConfig | None = None):
    """Masked GQA attention of N new queries over one layer's KV cache.

    Args:
      q_BNHD: ``[B, N, H, D]`` queries of the N new tokens.
      k_BKSD, v_BKSD: ``[B, K, S, D]`` one layer's cache, already holding the M new keys and
        values at slots ``[lengths[b], lengths[b] + M)``.
      lengths_B: int ``[B]`` committed prefix length per request.
      mask_BNM: bool ``[B, N, M]``; new slot ``lengths[b] + j`` is visible to query i iff
        ``mask[b, i, j]``; every slot ``< lengths[b]`` is visible.
      scale: softmax scale (a Python float).
      layer: with a layer index (a Python int), ``k_BKSD, v_BKSD`` are the stacked caches
        ``[L, B, K, S, D]`` of all layers and layer ``layer`` is attended; the Triton kernel
        reads it in place (a slice passed to a kernel call is a copy of the layer's cache), the
        Mosaic kernel and the reference slice it out.
      backend: ``"triton"`` (Pallas Triton kernel on a CUDA GPU), ``"interpret"`` (the same
        kernel interpreted, any platform), ``"mosaic"`` (the Mosaic GPU kernel of
        ``tree_attention_mgpu``, Hopper only, bf16/fp16, head_dim 64/128; slower than the Triton
        kernel on an H200 at most shapes, so ``"auto"`` never picks it), ``"mosaic_interpret"``
        (that kernel in the Mosaic GPU interpreter, CPU), ``"xla"`` (``tree_attention_reference``) or ``"auto"`` (triton
        on a CUDA GPU when the shapes are supported, else xla).
      config: tiling; default from ``configs.tree_attention_config`` for the local GPU (for
        the mosaic backends, ``configs.MOSAIC_TREE_ATTENTION_CONFIGS``).

    Returns:
      ``[B, N, H, D]`` in ``q``'s dtype. Query head h reads KV head ``h // (H // K)``; softmax
      in float32. A query that sees no slot at all gets zeros from the kernel (the reference
      returns a finite average there); tree masks always let a node see itself.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    k_LBKSD, v_LBKSD, layer = _stacked(k_BKSD, v_BKSD, layer)
    k_BKSD, v_BKSD = (jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in (k_LBKSD, v_LBKSD))
    check_shapes(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, scale)
    if backend == "auto":
        on_cuda = jax.default_backend() == "gpu" and device_capability() >= (8, 0)
        backend = "triton" if on_cuda and kernel_supports(q_BNHD, k_BKSD) else "xla"
    if backend == "xla":
        return tree_attention_reference(q_BNHD, k_LBKSD[layer], v_LBKSD[layer], lengths_B, mask_BNM,
                                        scale=scale)
    if backend in ("mosaic", "mosaic_interpret"):
        # Imported here: that module builds on this one's checks, split count and merge.
        from pallas_kernels.tree_attention_mgpu import tree_attention_mgpu
        return tree_attention_mgpu(q_BNHD, k_LBKSD[layer], v_LBKSD[layer], lengths_B, mask_BNM, scale=scale,
                                   interpret=backend == "mosaic_interpret", config=config)
    if not kernel_supports(q_BNHD, k_BKSD):
        raise ValueError(f"backend={backend!r} needs a power-of-two head_dim >= 16 and float32, "
                         f"bfloat16 or float16 q/k/v of one dtype; got head_dim={q_BNHD.shape[-1]}, "
                         f"dtypes {q_BNHD.dtype}, {k_BKSD.dtype}, {v_BKSD.dtype}")
    if config is None:
        config = tree_attention_config(device_capability() if backend == "triton" else (8, 0))
    return _tree_attention_pallas(q_BNHD, k_LBKSD, v_LBKSD, jnp.asarray(lengths_B, jnp.int32),
                                  mask_BNM, scale=float(scale), layer=layer, config=config,
                                  interpret=backend == "interpret")


def _stacked(k, v, layer):
    """``(k [L, B, K, S, D], v, layer)``: one layer's ``[B, K, S, D]`` cache as a stack of one."""
    if layer is None:
        if k.ndim != 4 or v.ndim != 4:
            raise ValueError(f"k and v must be [B, K, S, D] (or pass layer= with [L, B, K, S, D] caches), "
                             f"got shapes {k.shape} and {v.shape}")
        return k[None], v[None], 0
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise ValueError(f"layer must be an int (a static layer index), got {layer!r}")
    if k.ndim != 5 or v.ndim != 5 or not 0 <= layer < k.shape[0]:
        raise ValueError(f"with layer={layer!r}, k and v must be stacked caches [L, B, K, S, D] with "
                         f"0 <= layer < L, got shapes {k.shape} and {v.shape}")
    return k, v, int(layer)


def kernel_supports(q_BNHD, k_BKSD) -> bool:
    """Whether the Pallas kernel handles these shapes and dtypes."""
    head_dim = q_BNHD.shape[-1]
    return (head_dim >= 16 and head_dim & (head_dim - 1) == 0 and q_BNHD.dtype == k_BKSD.dtype
            and any(q_BNHD.dtype == d for d in _KERNEL_DTYPES))


def check_shapes(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, scale):
    """ValueError naming the argument unless the operands fit the `tree_attention` contract."""
    if not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a Python number, got {scale!r}")
    if q_BNHD.ndim != 4 or k_BKSD.ndim != 4:
        raise ValueError(f"q must be [B, N, H, D] and k [B, K, S, D], got shapes "
                         f"{q_BNHD.shape} and {k_BKSD.shape}")
    batch, num_q, num_heads, head_dim = q_BNHD.shape
    if v_BKSD.shape != k_BKSD.shape or k_BKSD.shape[0] != batch or k_BKSD.shape[3] != head_dim:
        raise ValueError(f"k and v must be [B={batch}, K, S, D={head_dim}] alike, got shapes "
                         f"{k_BKSD.shape} and {v_BKSD.shape}")
    if num_heads % k_BKSD.shape[1]:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads "
                         f"({k_BKSD.shape[1]})")
    if tuple(jnp.shape(lengths_B)) != (batch,):
        raise ValueError(f"lengths must have shape ({batch},), got {jnp.shape(lengths_B)}")
    if mask_BNM.ndim != 3 or mask_BNM.shape[:2] != (batch, num_q) or mask_BNM.dtype != jnp.bool_:
        raise ValueError(f"mask must be bool [B={batch}, N={num_q}, M], got {mask_BNM.dtype} "
                         f"{mask_BNM.shape}")


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


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _split_count(programs: int, num_slots: int, config: TreeAttentionConfig) -> int:
    """Split-K factor: enough programs for ``config.min_programs``, chunks of at least
    ``config.min_chunk`` slots."""
    return max(1, min(-(-config.min_programs // programs), num_slots // config.min_chunk))


def _plan(batch, num_kv, rows, num_new, num_slots, config: TreeAttentionConfig) -> _Plan:
    block_m = min(config.block_m, _pow2_at_least(rows, 16))
    rows_pad = _round_up(rows, block_m)
    block_t = min(config.block_k, _pow2_at_least(num_new, 16))
    splits = _split_count(batch * num_kv * (rows_pad // block_m), num_slots, config)
    chunk = _round_up(-(-num_slots // splits), config.block_k)
    return _Plan(block_m, rows_pad, block_t, _round_up(num_new, block_t),
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


def _kernel(lengths_ref, q_ref, k_ref, v_ref, mask_ref, *out_refs, scale, plan: _Plan,
            group, num_new, block_k, precision):
    """Program (row block, split, b, kv head): its prefix chunk, and the tree if it owns it.

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

    lo = split * plan.chunk
    hi = jnp.minimum(lo + plan.chunk, length)

    def prefix_step(t, carry):
        start = lo + t * block_k
        key_ok = start + jnp.arange(block_k) < hi
        return attend(start, key_ok, key_ok[None, :], carry)

    carry = lax.fori_loop(0, lax.div(jnp.maximum(hi - lo, 0) + block_k - 1, block_k),
                          prefix_step, carry)

    def tree_step(t, carry):
        cols = t * plan.block_t + jnp.arange(plan.block_t)
        key_ok = (cols < num_new) & (length + cols < num_slots)
        visible = plt.load(mask_ref.at[node_M[:, None], jnp.minimum(cols, num_new - 1)[None, :]])
        return attend(length + t * plan.block_t, key_ok, key_ok[None, :] & visible, carry)

    owner = jnp.minimum(lax.div(jnp.maximum(length - 1, 0), plan.chunk), plan.num_splits - 1)
    # select, not jnp.where: a where between two Python ints lowers to an i1 loop bound.
    num_tree_blocks = lax.select(split == owner, jnp.int32(plan.new_pad // plan.block_t),
                                 jnp.int32(0))
    o_MD, m_M, l_M = lax.fori_loop(0, num_tree_blocks, tree_step, carry)

    if plan.num_splits == 1:
        [o_ref] = out_refs
        plt.store(o_ref.at[rows_MD], (o_MD / jnp.where(l_M > 0, l_M, 1.0)[:, None]).astype(o_ref.dtype))
    else:
        o_ref, m_ref, l_ref = out_refs
        plt.store(o_ref.at[rows_MD], o_MD)
        plt.store(m_ref.at[row_M], m_M)
        plt.store(l_ref.at[row_M], l_M)


def _merge_splits(o_XJMD, m_XJM, l_XJM):
    """Combine per-split unnormalised outputs with their running max and sum (the split axis
    ``J`` after any leading axes ``X``): ``[*X, J, M, D] -> [*X, M, D]``."""
    axis = m_XJM.ndim - 2
    m_max_XM = m_XJM.max(axis=axis)
    w_XJM = jnp.exp(m_XJM - jnp.expand_dims(m_max_XM, axis))
    l_XM = (w_XJM * l_XJM).sum(axis=axis)
    o_XMD = (w_XJM[..., None] * o_XJMD).sum(axis=axis)
    return o_XMD / jnp.where(l_XM > 0, l_XM, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("scale", "layer", "config", "interpret"))
def _tree_attention_pallas(q_BNHD, k_LBKSD, v_LBKSD, lengths_B, mask_BNM, *, scale, layer, config,
                           interpret):
    batch, num_q, num_heads, head_dim = q_BNHD.shape
    _, _, num_kv, num_slots, _ = k_LBKSD.shape
    num_new = mask_BNM.shape[2]
    group = num_heads // num_kv
    plan = _plan(batch, num_kv, group * num_q, num_new, num_slots, config)
    q_BRD = q_BNHD.reshape(batch, num_q * num_heads, head_dim)
    # Row blocks vary fastest in launch order, so that the programs reading one K/V chunk run
    # together and share it through L2.
    grid = (plan.rows_pad // plan.block_m, plan.num_splits, batch, num_kv)
    exact = q_BNHD.dtype == jnp.float32
    kernel = functools.partial(_kernel, scale=scale, plan=plan, group=group, num_new=num_new,
                               block_k=config.block_k,
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
        out_shape = [jax.ShapeDtypeStruct((*split_shape, head_dim), jnp.float32),
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
    o_BRD = outs[0] if plan.num_splits == 1 else _merge_splits(*outs)
    return o_BRD.reshape(q_BNHD.shape).astype(q_BNHD.dtype)
