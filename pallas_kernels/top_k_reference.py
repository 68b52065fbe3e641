"""jnp reference of `top_k.top_k`: ``lax.top_k`` with int32 indices and ``-0.0`` ranked as ``0.0``."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k_reference(x_NV, k: int):
    """``(values [N, k], indices [N, k] int32)``: the ``k`` largest entries of each row, descending, ties
    by lower index (``-0.0`` tied with ``0.0``, whichever ``lax.top_k`` of the backend does), values as
    stored."""
    _, indices = jax.lax.top_k(jnp.where(x_NV == 0, 0.0, x_NV), k)
    indices = indices.astype(jnp.int32)
    return jnp.take_along_axis(x_NV, indices, axis=-1), indices
