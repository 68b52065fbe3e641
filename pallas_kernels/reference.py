"""jnp references of the kernels (the XLA paths the kernels must reproduce).

The tree-attention reference is the models' own attention, so that the kernel is checked
against exactly what the target forward computes without it.
"""

from __future__ import annotations

from ddtree_jax.models import layers


def tree_attention_reference(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, *, scale):
    """Masked GQA attention of N new queries over one layer's KV cache (dense jnp).

    ``q_BNHD`` ``[B, N, H, D]``; ``k_BKSD, v_BKSD`` ``[B, K, S, D]`` already holding the M new
    keys at slots ``[lengths[b], lengths[b] + M)``; ``lengths_B`` int ``[B]``; ``mask_BNM`` bool
    ``[B, N, M]``. Slot s is visible to query i iff ``s < lengths[b]`` or
    ``mask[b, i, s - lengths[b]]`` for a new slot; query head h reads kv head ``h // (H // K)``.
    Softmax in float32; returns ``[B, N, H, D]`` in ``q``'s dtype.
    """
    return layers.attention(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, scale=scale)
