"""A forward's new keys and values written into the stacked KV caches in place, as one kernel.

`kv_write_reference` is a scatter with drop semantics. XLA turns it into, per layer, a slice of the
old slots, an in-bounds test of the start indices, a select between the old and the new rows and an
in-place update, for the keys and again for the values: six launches of a microsecond or two, each
on a few kilobytes, in every layer of every forward. Here program ``(b, n)`` of the grid ``(B, N)``
stores token n of request b into slot ``lengths[b] + n`` of the layer, the store masked off when the
slot is past the cache's end; the caches are aliased to the outputs, so nothing else is read or
written.

Same result as ``kv_write_reference``, bit for bit. ``K`` (key/value heads) and ``head_dim`` must be
powers of two (`kernel_supports`). On an H200 at Qwen3-8B shapes (batch 1, context 1k) it took the
device time of the AR round from 5.15 to 5.05 ms; the models now write the target's and the drafter's
block K/V with ``qk_norm_rope_write`` (the norms and RoPE in the same kernel) and use this one where
the keys come without them (the drafter's context, the packed rows of ``budget_policy="batch"``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.configs import is_pow2


def kv_write(k_LBKSD, v_LBKSD, k_BNKD, v_BNKD, lengths_B, *, layer: int, interpret: bool = False):
    """`kv_write_reference` by the Pallas kernel (Triton lowering); same arguments and result, plus
    ``interpret`` (run in the Pallas interpreter). Donate or discard the input caches: the outputs
    alias them."""
    check_operands(k_LBKSD, v_LBKSD, k_BNKD, v_BNKD, lengths_B, layer)
    if not kernel_supports(k_LBKSD):
        raise ValueError(f"the kv_write kernel needs powers of two for the key/value heads and head_dim, "
                         f"got cache shape {k_LBKSD.shape}")
    return _kv_write(k_LBKSD, v_LBKSD, k_BNKD, v_BNKD, jnp.asarray(lengths_B, jnp.int32), layer=int(layer),
                     interpret=bool(interpret))


def check_operands(k_LBKSD, v_LBKSD, k_BNKD, v_BNKD, lengths_B, layer) -> None:
    """ValueError naming the operand unless the shapes fit `kv_write`."""
    if k_LBKSD.ndim != 5 or v_LBKSD.shape != k_LBKSD.shape or v_LBKSD.dtype != k_LBKSD.dtype:
        raise ValueError(f"k_LBKSD and v_LBKSD must be caches [L, B, K, S, D] of one shape and dtype, got "
                         f"{k_LBKSD.dtype} {k_LBKSD.shape} and {v_LBKSD.dtype} {v_LBKSD.shape}")
    num_layers, batch, num_kv, _, head_dim = k_LBKSD.shape
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}), got {layer}")
    for name, new in (("k_BNKD", k_BNKD), ("v_BNKD", v_BNKD)):
        if new.ndim != 4 or new.shape[0] != batch or new.shape[2:] != (num_kv, head_dim):
            raise ValueError(f"{name} must be [{batch}, N, {num_kv}, {head_dim}], got {new.shape}")
    if k_BNKD.shape != v_BNKD.shape or jnp.shape(lengths_B) != (batch,):
        raise ValueError(f"k_BNKD {k_BNKD.shape} and v_BNKD {v_BNKD.shape} must match, lengths_B must be "
                         f"({batch},), got {jnp.shape(lengths_B)}")


def kernel_supports(k_LBKSD) -> bool:
    """Whether the kernel takes this cache: power-of-two key/value heads and ``head_dim``."""
    num_kv, head_dim = k_LBKSD.shape[2], k_LBKSD.shape[4]
    return is_pow2(num_kv) and is_pow2(head_dim)


@functools.partial(jax.jit, static_argnames=("layer", "interpret"))
def _kv_write(k_LBKSD, v_LBKSD, k_BNKD, v_BNKD, lengths_B, *, layer, interpret):
    _, batch, num_kv, num_slots, head_dim = k_LBKSD.shape
    num_new = k_BNKD.shape[1]
    new_spec = pl.BlockSpec((None, None, num_kv, head_dim), lambda b, n: (b, n, 0, 0))
    cache_spec = pl.BlockSpec((None, None, num_kv, num_slots, head_dim), lambda b, n: (layer, b, 0, 0, 0))
    return pl.pallas_call(
        _kernel, grid=(batch, num_new),
        in_specs=[pl.BlockSpec((None,), lambda b, n: (b,)), new_spec, new_spec, cache_spec, cache_spec],
        out_specs=[cache_spec, cache_spec],
        out_shape=[jax.ShapeDtypeStruct(k_LBKSD.shape, k_LBKSD.dtype)] * 2,
        input_output_aliases={3: 0, 4: 1}, interpret=interpret, name="kv_write",
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
    )(lengths_B, k_BNKD, v_BNKD, k_LBKSD, v_LBKSD)


def _kernel(lengths_ref, k_new_ref, v_new_ref, k_in_ref, v_in_ref, k_ref, v_ref):
    """Program (b, n): token n's ``[K, D]`` keys and values into slot ``lengths[b] + n`` of request b's
    ``[K, S, D]`` layer cache (``k_in_ref``/``v_in_ref`` are the same buffers as ``k_ref``/``v_ref``)."""
    del k_in_ref, v_in_ref
    slot = lengths_ref[()] + pl.program_id(1)
    for new_ref, out_ref in ((k_new_ref, k_ref), (v_new_ref, v_ref)):
        store_slot(out_ref, slot, plt.load(new_ref))


def store_slot(cache_ref, slot, x_KC, first_col: int = 0):
    """Store ``x [K, C]`` (every head of one token) into columns ``[first_col, first_col + C)`` of
    ``slot`` of a ``[K, S, D]`` cache block, cast to its dtype; nothing is stored when ``slot >= S``.
    Shared with the fused norm + RoPE + write kernel (``qk_norm_rope.py``)."""
    num_kv, cols = x_KC.shape
    # Index arrays on every axis: the interpreter scatters only without slices.
    head_KC = jnp.broadcast_to(jnp.arange(num_kv)[:, None], (num_kv, cols))
    col_KC = jnp.broadcast_to(first_col + jnp.arange(cols)[None, :], (num_kv, cols))
    slot_KC = jnp.full((num_kv, cols), slot)
    plt.store(cache_ref.at[head_KC, slot_KC, col_KC], x_KC.astype(cache_ref.dtype), mask=slot_KC < cache_ref.shape[1])
