"""Exact selections without long sorts: a two-stage top-k over wide rows and ranks by counting.

On a GPU, XLA lowers ``lax.top_k`` over a 151,936-wide row with ``k > 16`` to a segmented sort of
the whole row, and every ``lax.sort`` to several kernels; the tree build needs one top-k per depth
row and one ordering per depth. The functions here give the same results as ``lax.top_k`` and
``lax.sort`` (ties included) from a row-wise maximum, two short top-ks, and pairwise-comparison
counts that XLA fuses into one reduction each.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_MIN_CHUNK, _MAX_CHUNK = 8, 1024


def chunk_size(vocab: int, k: int) -> int | None:
    """Static chunk width for `top_k` over rows of ``vocab`` entries, ``None`` for a plain top-k.

    The second stage reads ``k * chunk`` values after ``ceil(vocab / chunk)`` chunk maxima, so the
    width is the power of two nearest ``sqrt(vocab / k)`` (in ``[8, 1024]``). Rows shorter than
    ``4 * k * chunk`` (or with no more chunks than ``k``) are not worth splitting.
    """
    chunk = 2 ** round(math.log2(max(vocab / k, 1.0)) / 2)
    chunk = min(max(chunk, _MIN_CHUNK), _MAX_CHUNK)
    if vocab < 4 * k * chunk or -(-vocab // chunk) <= k:
        return None
    return chunk


def top_k(x_NV: Float[Array, "... V"], k: int) -> tuple[Float[Array, "... K"], Int[Array, "... K"]]:
    """``lax.top_k(x_NV, k)`` exactly (values and int32 indices; ties to the lower index first).

    Two stages when `chunk_size` gives a width ``C``: split each row into ``n = ceil(V / C)``
    chunks of ``C`` consecutive entries (the last padded with ``-inf``), take each chunk's maximum,
    keep the ``k`` first chunks in the order (maximum descending, chunk index ascending), gather
    their ``k * C`` entries in ascending chunk order and take the top ``k`` of those.

    Why it is exact. Order the entries by (value descending, index ascending), the order of
    ``lax.top_k``. Take an entry ``x`` of the reference top ``k`` and suppose its chunk ``c`` is
    not among the ``k`` first chunks. Each of those ``k`` chunks ``c'`` precedes ``c``: its
    maximum is larger than ``c``'s (so larger than ``x``), or equal with ``c' < c``, and then its
    first maximal entry has a value ``>= x`` and a smaller index, since chunks are consecutive
    index ranges. Either way that entry precedes ``x``: ``k`` distinct entries precede ``x``, which
    contradicts ``x`` being in the top ``k``. So the gathered entries hold the whole reference top
    ``k``, and the top ``k`` of a subset that contains it is the same list. Gathering the chunks
    in ascending chunk order keeps the entries in ascending index order, so ``lax.top_k``'s
    lower-position-first tie rule on the gathered row is the lower-index-first rule. The padding
    sits at indices ``>= V`` at the end of the last chunk: it follows every real ``-inf`` and is
    never among the first ``k <= V`` entries.
    """
    vocab = x_NV.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}], got {k}")
    chunk = chunk_size(vocab, k)
    if chunk is None:
        values, ids = jax.lax.top_k(x_NV, k)
        return values, ids.astype(jnp.int32)
    lead = x_NV.shape[:-1]
    n = -(-vocab // chunk)
    pad = [(0, 0)] * len(lead) + [(0, n * chunk - vocab)]
    x_NCW = jnp.pad(x_NV, pad, constant_values=-jnp.inf).reshape(*lead, n, chunk)
    _, chunks_NK = jax.lax.top_k(jnp.max(x_NCW, axis=-1), k)
    chunks_NK = jnp.sort(chunks_NK.astype(jnp.int32), axis=-1)
    picked = jnp.take_along_axis(x_NCW, chunks_NK[..., None], axis=-2).reshape(*lead, k * chunk)
    values, pos = jax.lax.top_k(picked, k)
    pos = pos.astype(jnp.int32)
    ids = jnp.take_along_axis(chunks_NK, pos // chunk, axis=-1) * chunk + pos % chunk
    return values, ids


# Counting costs P^2 per call, a sort about log^2 P kernel stages: on an H200 counting was faster at
# P <= 960 (budgets 16 and 64, batch 1 and 8), the sort at P = 3,489 and 7,680 (budget 512, batch 8).
COUNT_MAX = 2048


def ascending_ranks(*keys_P: Array) -> Int[Array, " P"]:
    """Position of each entry when the ``[P]`` keys are sorted lexicographically, ties by index.

    ``ranks[p] = #{q : (keys[q], q) < (keys[p], p)}``, a permutation of ``0..P-1``: what a stable
    ``lax.sort`` with ``num_keys = len(keys)`` puts where. Up to `COUNT_MAX` entries it is one fused
    ``P x P`` count, above it the inverse of a stable sort's permutation. Keys are compared with
    ``<`` and ``==`` (no NaNs; ``-0.0 == 0.0``).
    """
    n = keys_P[0].shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    if n > COUNT_MAX:
        order = jax.lax.sort((*keys_P, idx), num_keys=len(keys_P) + 1)[-1]
        return jnp.zeros((n,), jnp.int32).at[order].set(idx, unique_indices=True)
    before = idx[:, None] < idx[None, :]  # before[q, p]: q sorts before p
    for key in reversed(keys_P):
        before = (key[:, None] < key[None, :]) | ((key[:, None] == key[None, :]) & before)
    return jnp.sum(before, axis=0, dtype=jnp.int32)


def scatter_by_rank(ranks_P: Int[Array, " P"], values_PX: Array, size: int) -> Array:
    """``out[ranks[p]] = values[p]`` for the ``ranks < size``; ``ranks`` must be distinct and cover
    ``0..size-1`` (a permutation of ``0..P-1`` with ``P >= size``)."""
    out = jnp.zeros((size, *values_PX.shape[1:]), values_PX.dtype)
    return out.at[ranks_P].set(values_PX, mode="drop", unique_indices=True)
