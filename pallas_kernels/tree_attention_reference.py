"""Tree-verify attention in plain jnp: the contract every attention kernel reproduces.

N new queries of a request attend to its committed KV-cache prefix (slots ``[0, lengths[b])``)
and to the M new keys written after it (slots ``[lengths[b], lengths[b] + M)``), the latter
through a boolean mask (the tree's ancestor mask, or causal for a prefill). This is also the
XLA path of the library: the models run it wherever no kernel is chosen.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def tree_attention_reference(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, *, scale, layer=None):
    """Masked GQA attention of N new queries over one layer's KV cache.

    Args:
      q_BNHD: ``[B, N, H, D]`` queries of the N new tokens.
      k_BKSD, v_BKSD: ``[B, K, S, D]`` one layer's cache, already holding the M new keys and
        values at slots ``[lengths[b], lengths[b] + M)``; with ``layer``, the stacked caches
        ``[L, B, K, S, D]`` of all layers.
      lengths_B: int ``[B]`` committed prefix length per request.
      mask_BNM: bool ``[B, N, M]``: new slot ``lengths[b] + j`` is visible to query i iff
        ``mask[b, i, j]``; every slot ``< lengths[b]`` is visible.
      scale: softmax scale.
      layer: a static layer index into stacked caches, or ``None``.

    Returns:
      ``[B, N, H, D]`` in ``q``'s dtype. Query head h reads KV head ``h // (H // K)``; scores and
      softmax in float32. A query that sees no slot gets a finite average of all slots (never NaN).
    """
    if layer is not None:
        k_BKSD, v_BKSD = k_BKSD[layer], v_BKSD[layer]
    batch, num_q, num_heads, head_dim = q_BNHD.shape
    num_kv, num_slots = k_BKSD.shape[1], k_BKSD.shape[2]
    q_BKGND = q_BNHD.reshape(batch, num_q, num_kv, num_heads // num_kv, head_dim).transpose(0, 2, 3, 1, 4)
    scores_BKGNS = jnp.einsum("bkgnd,bksd->bkgns", q_BKGND, k_BKSD, preferred_element_type=jnp.float32)
    rel_BS = jnp.arange(num_slots)[None, :] - lengths_B[:, None]
    is_new_BS = (rel_BS >= 0) & (rel_BS < mask_BNM.shape[-1])
    new_idx_BNS = jnp.broadcast_to(jnp.clip(rel_BS, 0, mask_BNM.shape[-1] - 1)[:, None], (batch, num_q, num_slots))
    new_visible_BNS = jnp.take_along_axis(mask_BNM, new_idx_BNS, axis=2) & is_new_BS[:, None]
    visible_BNS = (rel_BS < 0)[:, None] | new_visible_BNS
    scores_BKGNS = jnp.where(visible_BNS[:, None, None], scores_BKGNS * scale, jnp.finfo(jnp.float32).min)
    probs_BKGNS = jax.nn.softmax(scores_BKGNS, axis=-1)
    out_BKGND = jnp.einsum("bkgns,bksd->bkgnd", probs_BKGNS.astype(v_BKSD.dtype), v_BKSD,
                           preferred_element_type=jnp.float32)
    return out_BKGND.transpose(0, 3, 1, 2, 4).reshape(batch, num_q, num_heads, head_dim).astype(q_BNHD.dtype)


def stacked(k, v, layer):
    """``(k [L, B, K, S, D], v, layer)`` for a kernel call: one layer's ``[B, K, S, D]`` cache
    becomes a stack of one; ``layer`` (a static int) indexes a stack given as is."""
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


def check_shapes(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, scale):
    """ValueError naming the argument unless the operands fit the attention contract
    (``k_BKSD, v_BKSD``: one layer, ``[B, K, S, D]``, arrays or ``ShapeDtypeStruct``s)."""
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
