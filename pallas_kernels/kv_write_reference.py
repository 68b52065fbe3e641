"""A forward's new keys and values written into one layer of the stacked KV caches, in plain jnp.

A forward of N new tokens writes token n of request b to slot ``lengths[b] + n`` of its layer; slots
at or beyond the cache's end are dropped, never wrapped or clamped onto other slots. This is the
models' code and the contract of the kernel in ``kv_write.py``.
"""

from __future__ import annotations

import jax.numpy as jnp


def write_scratch(cache_LBKSD, layer: int, new_BNKD, lengths_B):
    """``cache [L, B, K, S, D]`` with ``new [B, N, K, D]`` at slots ``[lengths[b], lengths[b] + N)`` of
    ``layer`` (cast to the cache's dtype); slots ``>= S`` are dropped."""
    batch, num_new = new_BNKD.shape[:2]
    slots_BN = lengths_B[:, None] + jnp.arange(num_new)[None, :]
    batch_BN = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, num_new))
    return cache_LBKSD.at[layer, batch_BN, :, slots_BN].set(new_BNKD.astype(cache_LBKSD.dtype), mode="drop")


def kv_write_reference(k_LBKSD, v_LBKSD, k_BNKD, v_BNKD, lengths_B, *, layer: int):
    """`write_scratch` of the keys and of the values: ``(k_LBKSD, v_LBKSD)`` updated."""
    return write_scratch(k_LBKSD, layer, k_BNKD, lengths_B), write_scratch(v_LBKSD, layer, v_BNKD, lengths_B)
