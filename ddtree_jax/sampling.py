"""Target-side sampling distribution and per-request coin streams.

Processing order (DESIGN.md §2): ``softmax(logits / T)`` -> keep the ``top_k`` most probable (``0`` =
off) and renormalise -> keep the smallest most-probable set whose mass reaches ``top_p`` (``1`` =
off) and renormalise. ``T = 0`` is greedy: a one-hot row at the argmax. "Most probable" orders
tokens by descending ``logits / T`` with ties broken towards the smaller token id, so the kept set
is always well defined; under top-p a token is kept iff the mass strictly before it is ``< top_p``.
In float32, ``logits / T`` is computed as ``logits * (1 / T)`` (``inverse_temperature``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ddtree_jax import checks


def _filtered(z_RV: Float[Array, "R V"], top_k_R, top_p_R) -> Float[Array, "R V"]:
    """Top-k then top-p filtered, renormalised ``softmax(z)`` (sorts each row once)."""
    vocab = z_RV.shape[-1]
    ids = jax.lax.broadcasted_iota(jnp.int32, z_RV.shape, 1)
    # A stable one-key sort keeps equal logits in id order and lets XLA use a radix sort on GPU.
    neg_z, ids_sorted = jax.lax.sort((-z_RV, ids), num_keys=1, is_stable=True)
    p = jax.nn.softmax(-neg_z, axis=-1)
    rank = jax.lax.broadcasted_iota(jnp.int32, z_RV.shape, 1)
    k = jnp.where(top_k_R > 0, jnp.minimum(top_k_R, vocab), vocab)[:, None]
    p = jnp.where(rank < k, p, 0.0)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    before = jnp.cumsum(p, axis=-1) - p
    p = jnp.where((top_p_R[:, None] >= 1.0) | (before < top_p_R[:, None]), p, 0.0)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    rows = jax.lax.broadcasted_iota(jnp.int32, z_RV.shape, 0)
    return jnp.zeros_like(p).at[rows, ids_sorted].set(p)


def inverse_temperature(temperature):
    """``1 / temperature`` in float32, and 1 where ``temperature <= 0`` (greedy).

    Logits are scaled by this reciprocal rather than divided by the temperature: a product has
    one rounding on every backend and in every kernel, while XLA on the CPU divides by a
    broadcast scalar through its reciprocal and a scalar exactly, so quotients of the same
    numbers could differ in the last bit between programs.
    """
    temperature = jnp.asarray(temperature, jnp.float32)
    return 1.0 / jnp.where(temperature <= 0, 1.0, temperature)


def row_probs(
    logits_RV: Float[Array, "R V"],
    temperature_R: Float[Array, " R"],
    top_k_R: Int[Array, " R"],
    top_p_R: Float[Array, " R"],
) -> Float[Array, "R V"]:
    """Processed float32 distribution of each row (no validation; see ``target_probs``).

    The sort needed by top-k/top-p runs only when some row asks for it.
    """
    greedy = temperature_R <= 0
    z = logits_RV.astype(jnp.float32) * inverse_temperature(temperature_R)[:, None]
    needs_sort = jnp.any(~greedy & ((top_k_R > 0) | (top_p_R < 1.0)))
    p = jax.lax.cond(
        needs_sort,
        lambda: _filtered(z, top_k_R, top_p_R),
        lambda: jax.nn.softmax(z, axis=-1),
    )
    onehot = jax.nn.one_hot(jnp.argmax(logits_RV, axis=-1), z.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy[:, None], onehot, p)


@jax.jit
def batch_probs(logits, temperature, top_k, top_p):
    """`target_probs` without validation: ``[batch, ..., V]`` logits, ``[batch]`` parameters."""
    batch, vocab = logits.shape[0], logits.shape[-1]
    rows = logits.reshape(batch, -1, vocab)
    per_row = lambda x: jnp.repeat(x, rows.shape[1])  # noqa: E731
    flat = row_probs(
        rows.reshape(-1, vocab), per_row(temperature), per_row(top_k), per_row(top_p)
    )
    return flat.reshape(logits.shape)


def target_probs(
    logits: Float[Array, "B ... V"],
    temperature,
    top_k=0,
    top_p=1.0,
) -> Float[Array, "B ... V"]:
    """Target sampling distribution of every row, float32.

    Args:
      logits: ``[batch, N, V]`` (or ``[batch, V]``) target logits.
      temperature: scalar or ``[batch]``, ``>= 0``; ``0`` = greedy (one-hot argmax, ties to the
        smaller id).
      top_k: scalar or ``[batch]``, ``>= 0``; ``0`` = off.
      top_p: scalar or ``[batch]``, in ``(0, 1]``; ``1`` = off.

    Checks: shapes and parameter ranges always; finite logits when concrete.
    """
    if not hasattr(logits, "shape") or logits.ndim not in (2, 3):
        raise ValueError(f"logits must have rank 2 or 3, got shape {getattr(logits, 'shape', None)}")
    logits = checks.array("logits", logits, ndim=logits.ndim, kind="float")
    t, k, p = checks.sampling_params(temperature, top_k, top_p, logits.shape[0])
    checks.finite("logits", logits)
    return batch_probs(logits, t, k, p)


def request_keys(key: jax.Array, request_ids: Int[Array, " B"], round_index) -> jax.Array:
    """Per-request key ``fold_in(fold_in(key, request_id), round)``, independent of the batch."""
    fold = lambda rid: jax.random.fold_in(jax.random.fold_in(key, rid), round_index)  # noqa: E731
    return jax.vmap(fold)(jnp.asarray(request_ids, jnp.int32))


def coins_from_keys(keys_B: jax.Array, num_nodes: int) -> tuple[Float[Array, "B N"], Float[Array, " B"]]:
    """One coin per node and one final coin per request, uniform in ``(0, 1]``.

    The interval is open at 0 so that ``coin <= acc`` never accepts a child of probability zero.
    """

    def one(k):
        k_nodes, k_final = jax.random.split(k)
        return (
            1.0 - jax.random.uniform(k_nodes, (num_nodes,), jnp.float32),
            1.0 - jax.random.uniform(k_final, (), jnp.float32),
        )

    return jax.vmap(one)(keys_B)
