"""The plain-jnp specification of tree sampling: the target law and the walk over a drafted tree.

Target law, per request with temperature ``T``, ``top_k`` and ``top_p``: ``softmax(logits / T)`` ->
keep the ``top_k`` most probable (``0`` = off) and renormalise -> keep the smallest most-probable set
whose mass reaches ``top_p`` (``1`` = off) and renormalise. ``T <= 0`` is greedy: a one-hot row at
the argmax. "Most probable" orders tokens by descending ``logits / T`` with ties broken towards the
smaller token id, so the kept set is always well defined; under top-p a token is kept iff the mass
strictly before it is ``< top_p``. In float32, ``logits / T`` is computed as ``logits * (1 / T)``
(``inverse_temperature``).

The walk ("target-only" tree rejection sampling, both thresholds 1): from the root, at the current
node with target row ``q`` and coin ``c``, the children are visited in sibling order (ascending
``sibling_rank`` where one is given, else ascending node index) accumulating
``acc += q[token(child)]``; the first child with ``c <= acc`` is accepted and the walk continues
from it with its own coin. When no child is accepted (or at a leaf, or after
``max_depth`` acceptances) the final token is drawn from ``q`` with the rejected children's tokens
removed, renormalised, by inverse CDF with the request's final coin. Greedy verification is the same
walk on one-hot rows (a one-hot row accepts exactly the child holding the argmax, and the final draw
returns the argmax), so one walk serves batches mixing greedy and sampled requests. It computes a
target row only for the nodes it visits: ``max_depth + 1`` rows per request instead of ``N``.

Every walk returns ``(accept_index_BD, emitted_BD)``, int32 ``[B, max_depth + 1]``, ``-1`` padded:
the local node ids of the accepted path (root first) and the accepted drafts' tokens followed by the
final token.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


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
    """The target law of each row, float32 ``[R, V]`` (no validation).

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


@dataclasses.dataclass(frozen=True)
class ProbRow:
    """A batch of target rows given as probabilities ``q_BV``."""

    q_BV: Float[Array, "B V"]

    def mass(self, tokens_BN):
        return jnp.take_along_axis(self.q_BV, tokens_BN, axis=1)

    def draw(self, rejected_BN, tokens_BN, coin_B):
        vocab = self.q_BV.shape[1]
        rows = jnp.arange(tokens_BN.shape[0])[:, None]
        drop = jnp.where(rejected_BN, tokens_BN, vocab)  # vocab = out of range, dropped
        residual = self.q_BV.at[rows, drop].set(0.0, mode="drop")
        residual = jnp.where(jnp.sum(residual, 1, keepdims=True) > 0, residual, self.q_BV)
        cdf = jnp.cumsum(residual, axis=1)
        return jnp.argmax(cdf >= coin_B[:, None] * cdf[:, -1:], axis=1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class ArgmaxRow:
    """A batch of one-hot target rows given by their argmax token."""

    argmax_B: Int[Array, " B"]

    def mass(self, tokens_BN):
        return (tokens_BN == self.argmax_B[:, None]).astype(jnp.float32)

    def draw(self, rejected_BN, tokens_BN, coin_B):
        return self.argmax_B


def _sibling_cumsum(mass_BN, is_child_BN, sibling_rank_BN):
    """Each child's running sum of the children's ``mass`` in sibling order (node index order when
    ``sibling_rank_BN`` is None: masses of non-children are 0, so a plain cumsum is that sum)."""
    if sibling_rank_BN is None:
        return jnp.cumsum(mass_BN, axis=1)
    rows = jnp.arange(mass_BN.shape[0])[:, None]
    slots = jnp.where(is_child_BN, sibling_rank_BN, mass_BN.shape[1])  # out of range, dropped
    by_rank = jnp.zeros_like(mass_BN).at[rows, slots].set(mass_BN, mode="drop")
    return jnp.take_along_axis(jnp.cumsum(by_rank, axis=1), sibling_rank_BN, axis=1)


def _first_sibling(hit_BN, sibling_rank_BN):
    """The node of each row's first hit in sibling order (0 when there is none)."""
    if sibling_rank_BN is None:
        return jnp.argmax(hit_BN, axis=1).astype(jnp.int32)
    return jnp.argmin(jnp.where(hit_BN, sibling_rank_BN, hit_BN.shape[1]), axis=1).astype(jnp.int32)


def walk(
    tokens_BN: Int[Array, "B N"],
    parents_BN: Int[Array, "B N"],
    coins_BN: Float[Array, "B N"],
    final_coins_B: Float[Array, " B"],
    row_at: Callable[[Int[Array, " B"]], ProbRow | ArgmaxRow],
    max_depth: int,
    sibling_rank_BN: Int[Array, "B N"] | None = None,
) -> tuple[Int[Array, "B D"], Int[Array, "B D"]]:
    """The walk (module docstring) with the target row of node ``cur_B`` given by ``row_at(cur_B)``;
    ``parents_BN``: each node's parent (``-1`` for the root and padding); ``sibling_rank_BN``: each
    node's position in its parent's list of children, in ``[0, N)`` (``None``: children in ascending
    node index, as in the engine's trees). Returns ``(accept_index_BD, emitted_BD)``."""
    batch, n = tokens_BN.shape
    rows = jnp.arange(batch)
    node_ids = jnp.arange(n, dtype=jnp.int32)[None, :]

    def children(cur):
        return (parents_BN == cur[:, None]) & (node_ids > 0)

    def step(t, state):
        cur, active, accept, emitted = state
        is_child = children(cur) & active[:, None]
        mass = jnp.where(is_child, row_at(cur).mass(tokens_BN), 0.0)
        acc = _sibling_cumsum(mass, is_child, sibling_rank_BN)
        hit = is_child & (coins_BN[rows, cur][:, None] <= acc)
        took = jnp.any(hit, axis=1)
        child = _first_sibling(hit, sibling_rank_BN)
        accept = accept.at[:, t + 1].set(jnp.where(took, child, -1))
        emitted = emitted.at[:, t].set(jnp.where(took, tokens_BN[rows, child], -1))
        return jnp.where(took, child, cur), active & took, accept, emitted

    init = (
        jnp.zeros((batch,), jnp.int32),
        jnp.ones((batch,), bool),
        jnp.full((batch, max_depth + 1), -1, jnp.int32).at[:, 0].set(0),
        jnp.full((batch, max_depth + 1), -1, jnp.int32),
    )
    cur, active, accept, emitted = jax.lax.fori_loop(0, max_depth, step, init, unroll=True)
    num_accepted = jnp.sum(accept >= 0, axis=1, dtype=jnp.int32) - 1
    # A walk that stopped early rejected every child of its last node; one that ran out of depth
    # examined none of them.
    rejected = children(cur) & ~active[:, None]
    final = row_at(cur).draw(rejected, tokens_BN, final_coins_B)
    return accept, emitted.at[rows, num_accepted].set(final)


def argmax_walk(tokens_BN, parents_BN, argmax_BN, max_depth: int, sibling_rank_BN=None):
    """The walk on one-hot rows given each node's target argmax ``argmax_BN`` (coins cannot change
    its outcome); ``sibling_rank_BN`` as in ``walk``. Returns ``(accept_index_BD, emitted_BD)``."""
    rows = jnp.arange(tokens_BN.shape[0])
    ones = jnp.ones(tokens_BN.shape, jnp.float32)
    return walk(tokens_BN, parents_BN, ones, ones[:, 0], lambda cur: ArgmaxRow(argmax_BN[rows, cur]), max_depth,
                sibling_rank_BN)


@functools.partial(jax.jit, static_argnames=("max_depth",))
def tree_sample_reference(tokens_BN, parents_BN, logits_BNV, coins_BN, final_coins_B, temperature_B, top_k_B, top_p_B,
                          *, max_depth: int):
    """Verify each request's tree against the target logits, greedy and sampled requests mixed.

    Args:
      tokens_BN, parents_BN: int32 ``[B, N]`` node tokens (node 0 = the root) and parents (``-1``
        for the root and padding; children in ascending node index).
      logits_BNV: ``[B, N, V]`` target logits after each node.
      coins_BN: float32 ``[B, N]`` in ``(0, 1]``; node k's coin chooses among k's children.
      final_coins_B: float32 ``[B]`` in ``(0, 1]`` for the final draw.
      temperature_B, top_k_B, top_p_B: ``[B]`` sampling parameters (``temperature <= 0`` is greedy,
        ``top_k = 0`` and ``top_p >= 1`` are off).
      max_depth: at most this many drafts are accepted.

    Returns:
      ``(accept_index_BD, emitted_BD)``, int32 ``[B, max_depth + 1]``, ``-1`` padded.

    Computes the target row (``row_probs``) only at the nodes the walk visits. An all-greedy batch
    instead takes every node's argmax in one pass and walks on those (the same walk on one-hot
    rows, without a dependent vocabulary pass per step). No validation; traceable.
    """
    rows = jnp.arange(tokens_BN.shape[0])

    def greedy():
        argmax_BN = jnp.argmax(logits_BNV, axis=-1).astype(jnp.int32)
        return argmax_walk(tokens_BN, parents_BN, argmax_BN, max_depth)

    def sampled():
        row_at = lambda cur: ProbRow(row_probs(logits_BNV[rows, cur], temperature_B, top_k_B, top_p_B))  # noqa: E731
        return walk(tokens_BN, parents_BN, coins_BN, final_coins_B, row_at, max_depth)

    return jax.lax.cond(jnp.all(temperature_B <= 0), greedy, sampled)
