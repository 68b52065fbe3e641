"""Exact top-k of long float32 rows (a draft's vocabulary) by radix selection: two Triton launches.

``lax.top_k`` over 151,936 entries is a sort of the row, or XLA's top-k kernel for ``k <= 16``; the
library's staged top-k (`ddtree_jax.selection`) is many small XLA kernels. Here:

- **keys**: each value becomes an int32 whose order is the float order (``-0.0`` as ``0.0``), and
  ``u = key ^ 0x80000000`` the same order unsigned, read four bits at a time from the top;
- **selection** (launch 1, program ``(row, s)``): segment ``s`` of the row finds the key of its
  ``need``-th largest valid entry digit by digit: eight passes over the segment, each a 16-bin
  histogram of the next digit among the entries whose higher digits match the prefix found so far
  (sixteen counters a lane, one a bin, kept across the segment's blocks and summed once a pass). A last pass stores
  every entry above that key and the first entries equal to it, in index order, ``need`` in all
  (``min(k, valid entries of the segment)``), into the segment's slots; the other lanes of a store go
  to one spare slot, so no kept lane shares its slot;
- **merge** (launch 2, one program a row): the same selection over the segments' kept entries (the
  row's top ``k`` are among them: each segment kept its own top ``min(k, size)``), in segment order,
  which is index order;
- **order**: the ``k`` kept entries are placed by counting, per pair, which precedes the other by
  (value descending, index ascending), as ``lax.top_k`` orders them.

Rows must hold no NaN. The result equals `top_k_reference` (``lax.top_k`` with int32 indices),
ties included.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.configs import DEFAULT_MULTIPROCESSORS, device_multiprocessors, is_pow2

DIGIT_BITS = 4
BINS = 1 << DIGIT_BITS
PASSES = 32 // DIGIT_BITS
MAX_K = 1024
_SIGN = -(1 << 31)  # 0x80000000 as an int32


@dataclasses.dataclass(frozen=True)
class TopKConfig:
    """Launches of the top-k: ``block`` entries a program loads a step, ``num_warps`` warps a program,
    ``segments`` programs a row in the selection (``0``: `segment_count`)."""

    block: int = 1024
    num_warps: int = 8
    segments: int = 0

    def __post_init__(self):
        if not (is_pow2(self.block) and 128 <= self.block <= 4096):
            raise ValueError(f"TopKConfig.block must be a power of two in [128, 4096], got {self.block!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TopKConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps!r}")
        if not (isinstance(self.segments, int) and self.segments >= 0):
            raise ValueError(f"TopKConfig.segments must be an int >= 0, got {self.segments!r}")


def segment_count(rows: int, vocab: int, k: int, block: int, multiprocessors: int) -> int:
    """Segments a row: enough programs for every streaming multiprocessor (``rows * segments``), none
    shorter than four blocks or ``4 k`` entries (the merge reads ``k`` entries a segment)."""
    longest = max(1, vocab // max(4 * block, 4 * k))
    return max(1, min(-(-multiprocessors // rows), longest))


def top_k(x_NV, k: int, *, config: TopKConfig | None = None, interpret: bool = False):
    """The ``k`` largest entries of each row and their indices, as ``lax.top_k``.

    Args:
      x_NV: float32 ``[N, V]``, no NaN.
      k: ``1 <= k <= min(V, MAX_K)``.
      config: the launches (default `TopKConfig()`).
      interpret: run in the Pallas interpreter.

    Returns:
      ``(values [N, k] float32, indices [N, k] int32)``: descending, ties (``-0.0 == 0.0`` among them)
      by lower index first; the values as stored (``-0.0`` stays).
    """
    if jnp.ndim(x_NV) != 2 or jnp.result_type(x_NV) != jnp.float32:
        raise ValueError(f"x_NV must be a float32 [N, V] array, got {jnp.result_type(x_NV)} of shape {jnp.shape(x_NV)}")
    rows, vocab = x_NV.shape
    if not (isinstance(k, int) and 1 <= k <= min(vocab, MAX_K)):
        raise ValueError(f"k must be an int in [1, min(V = {vocab}, {MAX_K})], got {k!r}")
    config = TopKConfig() if config is None else config
    if not isinstance(config, TopKConfig):
        raise ValueError(f"config must be a TopKConfig, got {config!r}")
    segments = config.segments or segment_count(rows, vocab, k, config.block,
                                                device_multiprocessors() or DEFAULT_MULTIPROCESSORS)
    return _top_k(x_NV, k=k, segments=min(segments, -(-vocab // config.block)), config=config,
                  interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("k", "segments", "config", "interpret"))
def _top_k(x_NV, *, k, segments, config: TopKConfig, interpret):
    rows, vocab = x_NV.shape
    block = config.block
    size = -(-vocab // (segments * block)) * block  # a segment's entries, whole blocks
    params = plt.CompilerParams(num_warps=config.num_warps, num_stages=2)
    select = functools.partial(_select_kernel, k=k, block=block, vocab=vocab, size=size)
    slots = jax.ShapeDtypeStruct((rows, segments, k + 1), jnp.float32), \
        jax.ShapeDtypeStruct((rows, segments, k + 1), jnp.int32)
    seg_val, seg_id = pl.pallas_call(
        functools.partial(select, merge=False), grid=(rows, segments), out_shape=slots,
        interpret=interpret, name="top_k_select", compiler_params=params,
    )(x_NV, jnp.zeros((rows, 1), jnp.int32))
    if segments > 1:
        merged = jax.ShapeDtypeStruct((rows, 1, k + 1), jnp.float32), jax.ShapeDtypeStruct((rows, 1, k + 1), jnp.int32)
        seg_val, seg_id = pl.pallas_call(
            functools.partial(select, merge=True), grid=(rows, 1), out_shape=merged,
            interpret=interpret, name="top_k_merge", compiler_params=params,
        )(seg_val.reshape(rows, -1), seg_id.reshape(rows, -1))
    return _ordered(seg_val[:, 0, :k], seg_id[:, 0, :k])


def _ordered(val_NK, id_NK):
    """The ``k`` kept entries of each row (distinct indices) placed by (value descending, index
    ascending), ``-0.0`` equal to ``0.0``."""
    key = jnp.where(val_NK == 0, 0.0, val_NK)
    v_q, v_p, i_q, i_p = key[:, :, None], key[:, None, :], id_NK[:, :, None], id_NK[:, None, :]
    place_NK = jnp.sum((v_p > v_q) | ((v_p == v_q) & (i_p < i_q)), axis=2, dtype=jnp.int32)
    row = jnp.arange(val_NK.shape[0])[:, None]
    return (jnp.zeros_like(val_NK).at[row, place_NK].set(val_NK, unique_indices=True),
            jnp.zeros_like(id_NK).at[row, place_NK].set(id_NK, unique_indices=True))


def _sortable(x):
    """int32 keys in the order of float32 ``x`` (``-0.0`` as ``0.0``; ``-inf`` lowest, NaN aside)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _select_kernel(x_ref, ids_ref, val_out, id_out, *, k, block, vocab, size, merge):
    """Program ``(r, s)``: the top ``need`` entries of row ``r``'s segment ``s`` (entries ``[s * size, (s
    + 1) * size)`` of ``x``, their indices their positions; ``ids_ref`` is a placeholder) stored in index
    order in ``[r, s, :need]`` of the outputs. With ``merge`` (``s = 0``): the same over the whole row of
    the segments' slots, ``k + 1`` a segment, their indices read from ``ids_ref``."""
    r, s = pl.program_id(0), pl.program_id(1)
    width = x_ref.shape[1]
    length = width if merge else size
    lane = jax.lax.broadcasted_iota(jnp.int32, (block,), 0)

    def entries(b):
        """Block ``b`` of the program's entries: ``(value, key, index, valid)``."""
        at = b * block + lane
        if merge:  # slot j of segment t holds a kept entry when j < min(k, entries of segment t)
            t, j = at // (k + 1), at % (k + 1)
            valid = (at < width) & (j < jnp.minimum(k, jnp.clip(vocab - t * size, 0, size)))
            index = plt.load(ids_ref.at[r, pl.ds(b * block, block)], mask=valid, other=0)
        else:
            index = s * size + at
            valid = index < vocab
        value = plt.load(x_ref.at[r, pl.ds(b * block + (0 if merge else s * size), block)], mask=valid,
                         other=-jnp.inf)
        return value, _sortable(value), index, valid

    blocks = -(-length // block)
    if merge:
        need = jnp.int32(k)
    else:
        need = jnp.minimum(k, jnp.clip(vocab - s * size, 0, size)).astype(jnp.int32)

    def digit_pass(p, carry):
        prefix, remaining = carry
        shift = 32 - DIGIT_BITS * (p + 1)
        high = jnp.where(p == 0, 0, jnp.int32(-1) << (shift + DIGIT_BITS))  # the digits above this one

        def count(b, counts):  # a counter a bin and lane: elementwise in the loaded layout, no 2-D tile
            _, key, _, valid = entries(b)
            u = key ^ _SIGN
            digit = jnp.where(valid & ((u & high) == prefix), (u >> shift) & (BINS - 1), BINS)  # BINS: no bin
            return tuple(c + (digit == v).astype(jnp.int32) for v, c in enumerate(counts))

        counts = jax.lax.fori_loop(0, blocks, count, (jnp.zeros((block,), jnp.int32),) * BINS)
        hist = [jnp.sum(c) for c in counts]
        at_least = [sum(hist[v:]) for v in range(BINS)]  # entries matching the prefix with digit >= v
        d = sum((a >= remaining).astype(jnp.int32) for a in at_least) - 1
        above = sum(jnp.where(v > d, h, 0) for v, h in enumerate(hist))
        return prefix | (jnp.maximum(d, 0) << shift), remaining - above

    prefix, remaining = jax.lax.fori_loop(0, PASSES, digit_pass, (jnp.int32(0), need))
    threshold = prefix ^ _SIGN  # the need-th largest key

    def store(b, carry):
        equal_seen, taken = carry
        value, key, index, valid = entries(b)
        equal = valid & (key == threshold)
        equal_rank = jnp.cumsum(equal.astype(jnp.int32)) - equal.astype(jnp.int32) + equal_seen
        take = (valid & (key > threshold)) | (equal & (equal_rank < remaining))
        take_i = take.astype(jnp.int32)
        slot = jnp.where(take, jnp.cumsum(take_i) - take_i + taken, k)  # the spare slot k for the rest
        seg = jnp.full((block,), s, jnp.int32)
        plt.store(val_out.at[r, seg, slot], value, mask=take)
        plt.store(id_out.at[r, seg, slot], index, mask=take)
        return equal_seen + jnp.sum(equal.astype(jnp.int32)), taken + jnp.sum(take_i)

    jax.lax.fori_loop(0, blocks, store, (jnp.int32(0), jnp.int32(0)))
