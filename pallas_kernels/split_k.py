"""Split-K over a KV-cache prefix, shared by the attention kernels.

The prefix is cut into chunks, one program each, so that a small batch still fills the GPU: static
chunks of the capacity (`split_count`), or equal chunks of a request's length (`blocks_per_split`,
``split_by_length``); each program returns its output with its running softmax max and sum, and
`merge_splits` (unnormalised outputs) or `merge_normalized_splits` (each output divided by its own sum)
combines them (flash-decoding style).
"""

from __future__ import annotations

import fractions

import jax.numpy as jnp
from jax import lax

from pallas_kernels.configs import TreeAttentionConfig


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def split_count(programs: int, num_slots: int, config: TreeAttentionConfig,
                multiprocessors: int | None = None) -> int:
    """Split-K factor for a grid of ``programs`` without splits: enough programs for
    ``config.min_programs``, chunks of at least ``config.min_chunk`` slots, at most
    ``config.max_splits`` splits. With ``config.whole_waves`` and ``multiprocessors`` known, the count
    ``s`` up to that one with the fewest waves per unit of prefix, ``ceil(programs * s /
    multiprocessors) / s``; the largest such ``s`` on ties."""
    splits = min(-(-config.min_programs // programs), num_slots // config.min_chunk)
    if config.max_splits is not None:
        splits = min(splits, config.max_splits)
    splits = max(1, splits)
    if config.whole_waves and multiprocessors is not None:
        def waves_per_split(s):
            return fractions.Fraction(-(-programs * s // multiprocessors), s)
        splits = min(range(splits, 0, -1), key=waves_per_split)
    return splits


def blocks_per_split(blocks, num_splits: int):
    """Key blocks per split when ``blocks`` (a traced count) are cut into ``num_splits`` equal chunks:
    ``ceil(blocks / num_splits)``, at least one (``split_by_length``)."""
    return jnp.maximum(lax.div(blocks + num_splits - 1, jnp.int32(num_splits)), 1)


def merge_splits(o_XJMD, m_XJM, l_XJM):
    """Combine per-split unnormalised outputs with their running max and sum (the split axis
    ``J`` after any leading axes ``X``): ``[*X, J, M, D] -> [*X, M, D]``."""
    axis = m_XJM.ndim - 2
    m_max_XM = m_XJM.max(axis=axis)
    w_XJM = jnp.exp(m_XJM - jnp.expand_dims(m_max_XM, axis))
    l_XM = (w_XJM * l_XJM).sum(axis=axis)
    o_XMD = (w_XJM[..., None] * o_XJMD).sum(axis=axis)
    return o_XMD / jnp.where(l_XM > 0, l_XM, 1.0)[..., None]


def merge_normalized_splits(o_XJMD, m_XJM, l_XJM):
    """`merge_splits` of outputs each already divided by its split's sum (``0`` where the split saw no key),
    in any float dtype: ``[*X, J, M, D] -> [*X, M, D]`` float32, the splits weighted by
    ``exp(m - max m) * l``."""
    axis = m_XJM.ndim - 2
    w_XJM = jnp.exp(m_XJM - jnp.expand_dims(m_XJM.max(axis=axis), axis)) * l_XJM
    l_XM = w_XJM.sum(axis=axis)
    o_XMD = (w_XJM[..., None] * o_XJMD.astype(jnp.float32)).sum(axis=axis)
    return o_XMD / jnp.where(l_XM > 0, l_XM, 1.0)[..., None]
