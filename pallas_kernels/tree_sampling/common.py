"""Pieces every kernel of the sampler shares: the ref groups, order keys and kept sets, branches,
block loads and the sizes derived from the launch configuration."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

INT_MIN = -(2**31)
_SIGN_OFF = 0x7FFFFFFF
DRAW_BLOCK = 2048  # entries per precomputed block mass of the final draw
FEW_SLOTS = 256  # candidates ranked (all pairs), not searched, and drawn from in a smaller tile when they fit it
FLOORS = 16  # candidate floors tried per pass (the floor and compaction blocks are sized by it)
_SUB = 64  # entries per sub-block whose max the statistics keep


class Request(NamedTuple):
    """Sampling parameters of each request (``[B]`` arrays, or their refs): temperature, its
    inverse (``scale``, the processed logits are ``z = logits * scale``), top-k, top-p."""

    temperature: Any
    scale: Any
    top_k: Any
    top_p: Any


class BlockStats(NamedTuple):
    """Statistics pass output, per node row and vocabulary block: ``max z``, its first argmax and
    ``sum exp(z - block max)`` (``[B, nodes_pad, K]``), and the max of every sub-block
    (``[B, nodes_pad, S]``)."""

    max: Any
    argmax: Any
    mass: Any
    sub_max: Any


class RowStats(NamedTuple):
    """Per node row (``[B, nodes_pad]``): ``m = max z``, its first argmax, ``total = sum exp(z - m)``,
    the number of candidates (``-1``: none found), the kept-set boundary ``(w, c)`` and kept mass."""

    m: Any
    argmax: Any
    total: Any
    num: Any
    w: Any
    c: Any
    kept: Any


class Slots(NamedTuple):
    """Candidate slots of node rows: ``z`` (float32) and token ids (int32), in id order."""

    z: Any
    id: Any


class Cut(NamedTuple):
    """A row's truncation: whether top-k and top-p are on (both off for greedy rows), and their values."""

    use_k: Any
    use_p: Any
    top_k: Any
    top_p: Any


def cut(temperature, top_k, top_p, vocab) -> Cut:
    """The ``Cut`` of rows with these parameters (scalars or arrays alike)."""
    sampled = temperature > 0.0
    return Cut(sampled & (top_k > 0) & (top_k < vocab), sampled & (top_p < 1.0), top_k, top_p)


def aliases(inputs: tuple, outputs: tuple, field: str) -> dict[int, int]:
    """``input_output_aliases`` of a ``pallas_call`` whose inputs and outputs are named tuples with
    a group ``field`` of the same structure, updated in place: the flat indices of its leaves."""
    def start(groups):
        return len(jax.tree.leaves(groups[:groups._fields.index(field)]))
    group_in, group_out = getattr(inputs, field), getattr(outputs, field)
    if jax.tree.structure(group_in) != jax.tree.structure(group_out):
        raise ValueError(f"aliased group {field!r} must have the same structure in inputs and outputs")
    return {start(inputs) + i: start(outputs) + i for i in range(len(jax.tree.leaves(group_in)))}


def order_key(z):
    """int32 keys ordered like the float32 values ``z`` (``-0.0`` counts as ``0.0``)."""
    bits = lax.bitcast_convert_type(jnp.where(z == 0.0, 0.0, z), jnp.int32)
    return jnp.where(bits < 0, bits ^ _SIGN_OFF, bits)


def key_value(key):
    """Inverse of ``order_key`` for one key."""
    return lax.bitcast_convert_type(jnp.where(key < 0, key ^ _SIGN_OFF, key), jnp.float32)


def kept(key, ids, w, c):
    """Membership in the kept set with boundary ``(w, c)``: ``key > w``, or ``key == w`` and ``id < c``."""
    return (key > w) | ((key == w) & (ids < c))


def barrier(interpret):
    """Orders a program's scratch writes before its reads by other threads (none interpreted)."""
    if not interpret:
        plt.debug_barrier()


def either(pred, true_fn, false_fn):
    """``true_fn()`` if ``pred`` else ``false_fn()``; only the taken branch runs.

    Every output passes through a select on ``pred``: a Triton branch cannot yield a constant.
    """
    def branch(fn):
        return lambda _: jax.tree.map(lambda v: jnp.where(pred, v, v), fn())
    return lax.cond(pred, branch(true_fn), branch(false_fn), None)


def when(pred, fn, default):
    """``fn()`` if ``pred`` else ``default``; only the taken branch runs."""
    return either(pred, fn, lambda: default)


def in_slots(num, capacity, fn):
    """``fn(size)`` for the fewer of ``FEW_SLOTS`` or ``capacity`` candidate slots that hold ``num``
    candidates: the boundary and the draw work on every slot they load."""
    few = min(FEW_SLOTS, capacity)
    return fn(capacity) if few == capacity else either(num <= few, lambda: fn(few), lambda: fn(capacity))


def processed(logits, scale):
    """The processed logits ``z = logits * (1 / T)`` in float32: the one definition every kernel uses,
    so that they all agree with each other and with the jnp reference bit for bit."""
    return logits.astype(jnp.float32) * scale


def load_block(logits_ref, row, start, size, vocab, scale):
    """Ids, validity and ``z`` of the entries ``[start, start + size)`` of a logits row
    (``logits_ref.at[row]``, ``row`` a tuple of leading indices)."""
    ids = start + jnp.arange(size)
    valid = ids < vocab
    return ids, valid, processed(plt.load(logits_ref.at[(*row, pl.ds(start, size))], mask=valid, other=0), scale)


def fold_row(logits_ref, row, scale, vocab, fn, init, size):
    """Fold ``fn(carry, ids, valid, z, block)`` over the ``size``-entry blocks of logits row
    ``logits_ref.at[row]`` (``z = logits * scale``)."""
    def body(i, carry):
        return fn(carry, *load_block(logits_ref, row, i * size, size, vocab, scale), i)
    return lax.fori_loop(0, pl.cdiv(vocab, size), body, init)


def load_candidates(slots: Slots, row, num, m, size, vocab, start=0):
    """``(slots, live, ids, keys, exp(z - m))`` of candidate slots ``[start, start + size)`` of ``row``,
    of which those below ``num`` are live (the others read as id ``vocab``, mass 0)."""
    index = start + jnp.arange(size)
    live = index < num
    z = jnp.where(live, plt.load(slots.z.at[row, pl.ds(start, size)]), -jnp.inf)
    ids = jnp.where(live, plt.load(slots.id.at[row, pl.ds(start, size)]), vocab)
    return index, live, ids, order_key(z), jnp.where(live, jnp.exp(z - m), 0.0)


def store_candidates(slots: Slots, row, ids, z, sel, base, capacity):
    """Writes the ``sel`` lanes of a block to candidate slots ``base, base + 1, ...`` of ``row``."""
    # Unselected lanes aim at the spare slot ``capacity``: an interpreted masked scatter may write
    # old values back at the indices of masked-out lanes.
    slot = jnp.where(sel, base + jnp.cumsum(sel.astype(jnp.int32)) - 1, capacity)
    plt.store(slots.z.at[row, slot], z, mask=sel)
    plt.store(slots.id.at[row, slot], ids, mask=sel)


def rescaled(mass_K, max_K, m, num_blocks):
    """Per-block masses ``sum exp(z - block max)`` made relative to the row max ``m`` (0 past
    ``num_blocks``: those entries may hold anything)."""
    valid = jnp.arange(mass_K.shape[0]) < num_blocks
    return jnp.where(valid, mass_K * jnp.exp(jnp.where(valid, max_K, -jnp.inf) - m), 0.0)


def pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


def candidate_block(block_v: int) -> int:
    """Vocabulary block of the floor and compaction passes: their ``[floors, block]`` tensors
    hold as many entries as one ``block_v`` block."""
    return min(block_v, max(16, block_v // FLOORS))


def draw_block(block_v: int) -> int:
    """Vocabulary block of the precomputed per-block masses of the final draw."""
    return min(block_v, DRAW_BLOCK)


def sub_size(block: int) -> int:
    """Entries per sub-block whose max the statistics keep (a power of two dividing ``block``)."""
    return min(_SUB, block)
