"""Target-side sampling distribution and per-request coin streams.

The target law (temperature, then top-k, then top-p; ``T = 0`` greedy) is specified, with
``row_probs`` and ``inverse_temperature``, in ``pallas_kernels.tree_sampling.reference``; this module
validates and batches it and derives each request's coins.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ddtree_jax import checks
from pallas_kernels.tree_sampling.reference import inverse_temperature, row_probs

__all__ = ["batch_probs", "coins_from_keys", "inverse_temperature", "request_keys", "row_probs", "target_probs"]


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
    logits = checks.as_array(logits)
    if logits.ndim not in (2, 3):
        raise ValueError(f"logits must have rank 2 or 3, got shape {logits.shape}")
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
