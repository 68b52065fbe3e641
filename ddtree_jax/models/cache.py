"""Per-request KV cache with a scratch region, shared by the target and the drafter.

Slots ``[0, lengths[b])`` of request b are committed. A forward writes its new tokens' K/V to
the scratch slots ``[lengths[b], lengths[b] + N)`` without advancing ``lengths``; `commit` then
keeps a chosen subset of them (gathered, written contiguously after the prefix). Writes beyond
``max_len`` are dropped inside jit; `check_capacity` is the host-side error for that case.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "lengths"], meta_fields=[])
@dataclasses.dataclass
class KVCache:
    """``k, v [layers, batch, kv_heads, max_len, head_dim]``, ``lengths`` int32 ``[batch]``."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def init_cache(num_layers, batch, kv_heads, max_len, head_dim, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache (zeros, ``lengths = 0``)."""
    sizes = {"num_layers": num_layers, "batch": batch, "kv_heads": kv_heads, "max_len": max_len, "head_dim": head_dim}
    for name, value in sizes.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"init_cache: {name} must be a positive int, got {value!r}")
    shape = (num_layers, batch, kv_heads, max_len, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))


def check_capacity(cache: KVCache, num_new) -> None:
    """Raise ``ValueError`` if some request cannot take ``num_new`` more slots.

    ``num_new`` is an int or an int array ``[batch]``; the check is ``lengths + num_new <= max_len``
    and runs on the host (it reads ``lengths``), so call it outside jit, once per bound.
    """
    lengths_B = np.asarray(cache.lengths)
    needed_B = lengths_B + np.broadcast_to(np.asarray(num_new), lengths_B.shape)
    for b in np.flatnonzero(needed_B > cache.max_len):
        raise ValueError(f"KV cache overflow: request {b} has length {lengths_B[b]} and needs "
                         f"{needed_B[b] - lengths_B[b]} more slots, but max_len is {cache.max_len}")


def check_cache_shape(cache: KVCache, *, num_layers, batch, kv_heads, head_dim) -> None:
    """Raise ``ValueError`` unless the cache fits a model with these sizes and this batch."""
    max_len = cache.k.shape[3] if cache.k.ndim == 5 else None
    want = (num_layers, batch, kv_heads, max_len, head_dim)
    if cache.k.shape != want or cache.v.shape != want or cache.lengths.shape != (batch,):
        raise ValueError(f"cache: k {cache.k.shape}, v {cache.v.shape}, lengths {cache.lengths.shape} do not "
                         f"match (layers, batch, kv_heads, max_len, head_dim) = {want} and lengths ({batch},)")


def commit(cache: KVCache, keep_BA, num_keep_B) -> KVCache:
    """Keep chosen scratch slots and advance ``lengths``.

    For ``a < num_keep[b]``, slot ``lengths[b] + keep[b, a]`` moves to ``lengths[b] + a`` (all
    layers, K and V; a gather then a contiguous write), then ``lengths += num_keep`` (capped at
    ``max_len``: overflow is `check_capacity`'s job). Entries of ``keep`` beyond ``num_keep``
    are ignored (may be -1). Prefill: ``keep = arange``, ``num_keep = prompt lengths``; tree
    commit: ``keep = accept_index`` (root first). Fixed shapes; jit it with the cache donated.
    """
    batch, num_slots = keep_BA.shape
    lengths_B = cache.lengths
    valid_BA = jnp.arange(num_slots)[None, :] < num_keep_B[:, None]
    src_BA = jnp.clip(lengths_B[:, None] + jnp.where(valid_BA, keep_BA, 0), 0, cache.max_len - 1)
    dst_BA = jnp.where(valid_BA, lengths_B[:, None] + jnp.arange(num_slots)[None, :], cache.max_len)
    batch_BA = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, num_slots))

    def move(x_LBKSD):
        kept_BALKD = x_LBKSD[:, batch_BA, :, src_BA]
        return x_LBKSD.at[:, batch_BA, :, dst_BA].set(kept_BALKD, mode="drop")

    new_lengths_B = jnp.minimum(lengths_B + num_keep_B.astype(jnp.int32), cache.max_len)
    return KVCache(k=move(cache.k), v=move(cache.v), lengths=new_lengths_B.astype(jnp.int32))
