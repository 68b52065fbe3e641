"""Budget policies: which nodes of each request's best-first tree a round verifies.

Every policy keeps, per request, a *prefix* of the tree's pop order (docs/design.md, "Budget
policies"): a parent precedes its children in that order, so a prefix is a tree, and the nodes past
it become padding (`keep_prefix`), the same padding as a tree whose candidate space is smaller than
its budget. Shapes never change; all of it runs on the device inside the round.

- ``"fixed"``: every node of the budget-``B`` tree (today's behaviour; nothing is selected).
- ``"adaptive"`` (`adaptive_keep`): per request, the prefix of ``n`` drafts that maximises
  ``(1 + sum of the drafter's path probabilities exp(logw) of the kept drafts) / cost[n]``, with
  ``cost[n]`` the modelled time of a round that verifies ``n`` drafts per request
  (`ddtree_jax.costs`); ties go to the longer prefix, so a flat cost keeps the whole tree.
- ``"batch"`` (`batch_keep`): one total of ``B`` drafts per live request, given to the most probable
  prefixes over all live requests together. Each request's tree is built with ``BATCH_SPREAD x B``
  slots so that a confident request can take more than ``B``; the verify forward still runs over
  ``batch x (B + 1)`` rows, the kept nodes packed request after request (`packing`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ddtree_jax.tree import DraftTree

POLICIES = ("fixed", "adaptive", "batch")
BATCH_SPREAD = 4  # a request's tree under "batch" has up to BATCH_SPREAD x budget drafts


def check_policy(budget_policy) -> str:
    """``budget_policy`` if it is one of `POLICIES`, else a ``ValueError`` naming it."""
    if budget_policy not in POLICIES:
        raise ValueError(f"budget_policy must be one of {POLICIES}, got {budget_policy!r}")
    return budget_policy


def keep_prefix(tree: DraftTree, keep_B: Int[Array, " B"]) -> DraftTree:
    """``tree`` with nodes ``k >= keep[b]`` of request ``b`` turned into padding (token 0, parent -1,
    depth 0, logw -inf) and ``num_nodes = min(keep, num_nodes)``; ``keep`` counts the root."""
    slot_BN = jnp.arange(tree.tokens.shape[1], dtype=jnp.int32)[None, :]
    kept_BN = slot_BN < keep_B[:, None]
    pad = lambda x, fill: jnp.where(kept_BN, x, jnp.asarray(fill, x.dtype))  # noqa: E731
    return dataclasses.replace(tree, tokens=pad(tree.tokens, 0), parents=pad(tree.parents, -1),
                               depths=pad(tree.depths, 0), logw=pad(tree.logw, -jnp.inf),
                               num_nodes=jnp.minimum(keep_B, tree.num_nodes).astype(jnp.int32))


def adaptive_keep(logw_BN: Float[Array, "B N"], num_nodes_B: Int[Array, " B"],
                  cost_N: Float[Array, " N"]) -> Int[Array, " B"]:
    """Nodes to keep (root included) per request under ``"adaptive"``.

    ``cost_N[n]`` (``> 0``) is the modelled round time with ``n`` drafts per request, ``n = 0 ..
    N - 1``. The expected tokens of keeping ``n`` drafts are estimated by the drafter as ``1 +
    S[n]``, ``S[n]`` the sum of ``exp(logw)`` over drafts ``1 .. n`` (float32; a running maximum
    keeps it non-decreasing whatever the summation order); the result is ``1 + argmax_n (1 + S[n]) /
    cost[n]`` over the request's real drafts, the largest ``n`` among equal maxima.
    """
    n = logw_BN.shape[1]
    draft_BN = jnp.arange(n)[None, :] >= 1
    prob_BN = jnp.where(draft_BN, jnp.exp(logw_BN), 0.0)  # padding: exp(-inf) = 0
    mass_BN = jax.lax.cummax(jnp.cumsum(prob_BN, axis=1), axis=1)
    score_BN = (1.0 + mass_BN) / cost_N.astype(jnp.float32)[None, :]
    real_BN = jnp.arange(n)[None, :] < num_nodes_B[:, None]
    score_BN = jnp.where(real_BN, score_BN, -jnp.inf)
    last_best = n - 1 - jnp.argmax(score_BN[:, ::-1], axis=1)  # argmax takes the first: reversed, the last
    return (last_best + 1).astype(jnp.int32)


def batch_keep(logw_BN: Float[Array, "B N"], num_nodes_B: Int[Array, " B"], live_B: Bool[Array, " B"],
               budget: int) -> Int[Array, " B"]:
    """Nodes to keep (root included) per request under ``"batch"``.

    The real drafts of the live requests are ordered by descending ``logw``, ties to the smaller
    node index, then to the smaller request row; the first ``budget x (live requests)`` of them are
    kept. Within a request this order is its pop order (non-increasing ``logw``, ties by index), so
    each request keeps a prefix. Finished requests keep their root only.
    """
    batch, n = logw_BN.shape
    slot_BN = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], (batch, n))
    row_BN = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, n))
    valid_BN = (slot_BN >= 1) & (slot_BN < num_nodes_B[:, None]) & live_B[:, None]
    keys = (~valid_BN, -logw_BN, slot_BN, row_BN)
    invalid, _, _, row = jax.lax.sort(tuple(k.reshape(-1) for k in keys), num_keys=4)
    total = budget * jnp.sum(live_B, dtype=jnp.int32)
    chosen = (jnp.arange(batch * n) < total) & ~invalid
    return 1 + jnp.zeros((batch,), jnp.int32).at[row].add(chosen.astype(jnp.int32))


def packing(num_nodes_B: Int[Array, " B"], slots: int,
            rows: int) -> tuple[Int[Array, " M"], Int[Array, " M"], Int[Array, "B N"]]:
    """The packed layout of the kept nodes: request after request, each in node order.

    Args:
      num_nodes_B: kept nodes per request (root included), a prefix of its ``N = slots`` tree slots;
        their sum is at most ``rows``.
      slots: ``N``, the tree slots per request.
      rows: ``M``, the packed rows (``batch x (budget + 1)``).

    Returns ``(row_M, slot_M, packed_BN)``: packed row ``m`` holds node ``slot_M[m]`` of request
    ``row_M[m]`` (``row = batch``, ``slot = 0`` for the unused rows past the last kept node);
    ``packed_BN[b, k]`` is the packed row of node ``k`` of request ``b``, ``-1`` if it is not kept.
    """
    batch = num_nodes_B.shape[0]
    slot_BN = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32)[None, :], (batch, slots))
    start_B = (jnp.cumsum(num_nodes_B) - num_nodes_B).astype(jnp.int32)
    packed_BN = jnp.where(slot_BN < num_nodes_B[:, None], start_B[:, None] + slot_BN, -1)
    target_BN = jnp.where(packed_BN >= 0, packed_BN, rows)  # rows: dropped
    row_BN = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, slots))
    row_M = jnp.full((rows,), batch, jnp.int32).at[target_BN].set(row_BN, mode="drop")
    slot_M = jnp.zeros((rows,), jnp.int32).at[target_BN].set(slot_BN, mode="drop")
    return row_M, slot_M, packed_BN
